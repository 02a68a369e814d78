# Multi-rank tests: programs started through `epx launch` (test_killed_rank starts its
# own ranks). Included by tests/CMakeLists.txt; ctest -L multirank runs them.
set(EPX_TEST_BACKEND "auto" CACHE STRING "Backend for the multi-rank tests: auto, host or cuda")

set(EPX_MULTIRANK_DIR ${CMAKE_CURRENT_LIST_DIR})
add_library(epx_multirank_common STATIC ${EPX_MULTIRANK_DIR}/mem.c ${EPX_MULTIRANK_DIR}/harness.c)
target_include_directories(epx_multirank_common PUBLIC ${EPX_MULTIRANK_DIR})
target_link_libraries(epx_multirank_common PUBLIC epx_internal epx_test_common)

add_executable(test_normal ${EPX_MULTIRANK_DIR}/test_normal.c ${EPX_MULTIRANK_DIR}/normal_check.c)
add_executable(test_bad_input
               ${EPX_MULTIRANK_DIR}/test_bad_input.c ${EPX_MULTIRANK_DIR}/bad_input_dispatch.c
               ${EPX_MULTIRANK_DIR}/bad_input_combine.c ${EPX_MULTIRANK_DIR}/bad_input_remote.c
               ${EPX_MULTIRANK_DIR}/bad_input_ll.c ${EPX_MULTIRANK_DIR}/bad_input_form.c
               ${EPX_MULTIRANK_DIR}/bad_input_fanout.c ${EPX_MULTIRANK_DIR}/bad_input_fanin.c
               ${EPX_MULTIRANK_DIR}/bad_input_register.c)
add_executable(test_killed_rank ${EPX_MULTIRANK_DIR}/test_killed_rank.c)
foreach(program test_normal test_bad_input test_killed_rank)
  target_link_libraries(${program} PRIVATE epx_multirank_common)
endforeach()

set(EPX_LAUNCH $<TARGET_FILE:epx_tool> launch)
foreach(ranks 1 2 3 4 8)
  add_test(NAME multirank.normal.n${ranks}
           COMMAND ${EPX_LAUNCH} -n ${ranks} -- $<TARGET_FILE:test_normal>
                   --backend ${EPX_TEST_BACKEND})
  set_tests_properties(multirank.normal.n${ranks} PROPERTIES TIMEOUT 120 LABELS multirank)
endforeach()

# Virtual nodes (docs/INTERNODE.md): RANKSxPER_NODE splits, every case. Dispatch results
# do not change; combine sums node by node, which the oracle follows. n8 above is 1x8.
foreach(split 8:4 8:2 8:1 4:2)
  string(REPLACE ":" ";" split_parts ${split})
  list(GET split_parts 0 ranks)
  list(GET split_parts 1 per_node)
  math(EXPR nodes "${ranks} / ${per_node}")
  add_test(NAME multirank.normal.n${ranks}.nodes${nodes}x${per_node}
           COMMAND ${EPX_LAUNCH} -n ${ranks} --ranks-per-node ${per_node} --
                   $<TARGET_FILE:test_normal> --backend ${EPX_TEST_BACKEND})
  set_tests_properties(multirank.normal.n${ranks}.nodes${nodes}x${per_node}
                       PROPERTIES TIMEOUT 120 LABELS multirank)
endforeach()

foreach(ranks 1 2)
  add_test(NAME multirank.bad_input.n${ranks}
           COMMAND ${EPX_LAUNCH} -n ${ranks} -- $<TARGET_FILE:test_bad_input>
                   --backend ${EPX_TEST_BACKEND})
  set_tests_properties(multirank.bad_input.n${ranks} PROPERTIES TIMEOUT 120 LABELS multirank)
endforeach()
# Across virtual nodes: a refusal on one rank reaches the other node's ranks as
# EPX_ERR_REMOTE naming it (never their timeout).
add_test(NAME multirank.bad_input.n4.nodes2x2
         COMMAND ${EPX_LAUNCH} -n 4 --ranks-per-node 2 -- $<TARGET_FILE:test_bad_input>
                 --backend ${EPX_TEST_BACKEND})
set_tests_properties(multirank.bad_input.n4.nodes2x2 PROPERTIES TIMEOUT 120 LABELS multirank)

# epx_fanin_reduce (tool support) checked bit for bit, alone and after epx_fanout_copy;
# 8 ranks for the fractional fanin 5.25 of a standard combine.
add_executable(test_fanin ${EPX_MULTIRANK_DIR}/test_fanin.c)
target_link_libraries(test_fanin PRIVATE epx_multirank_common m)
foreach(ranks 2 4 8)
  add_test(NAME multirank.fanin.n${ranks}
           COMMAND ${EPX_LAUNCH} -n ${ranks} -- $<TARGET_FILE:test_fanin>
                   --backend ${EPX_TEST_BACKEND})
  set_tests_properties(multirank.fanin.n${ranks} PROPERTIES TIMEOUT 120 LABELS multirank)
endforeach()

# A rank killed inside epx_buffer_create: nothing left in /dev/shm (CPU backend).
add_executable(test_create_killed ${EPX_MULTIRANK_DIR}/test_create_killed.c)
target_link_libraries(test_create_killed PRIVATE epx_multirank_common)
add_test(NAME multirank.create_killed COMMAND test_create_killed --backend host)
set_tests_properties(multirank.create_killed PROPERTIES TIMEOUT 300 LABELS multirank)

# A rank lost in low-latency serving: the step completes without it (CPU backend).
add_executable(test_ll_fault ${EPX_MULTIRANK_DIR}/test_ll_fault.c ${EPX_MULTIRANK_DIR}/ll_step.c)
target_link_libraries(test_ll_fault PRIVATE epx_multirank_common)
add_test(NAME multirank.ll_fault COMMAND test_ll_fault)
set_tests_properties(multirank.ll_fault PROPERTIES TIMEOUT 120 LABELS multirank)

add_test(NAME multirank.killed_rank
         COMMAND test_killed_rank --backend ${EPX_TEST_BACKEND})
set_tests_properties(multirank.killed_rank PROPERTIES TIMEOUT 120 LABELS multirank)
# The same across two virtual nodes of 2 ranks: the failed ranks are in the other node.
add_test(NAME multirank.killed_rank.nodes2x2
         COMMAND test_killed_rank --backend ${EPX_TEST_BACKEND} --ranks-per-node 2)
set_tests_properties(multirank.killed_rank.nodes2x2 PROPERTIES TIMEOUT 120 LABELS multirank)

# Low-latency mode (include/epx.h, docs/LOW_LATENCY.md) against tests/common/moe_ll.c.
add_executable(test_ll ${EPX_MULTIRANK_DIR}/test_ll.c)
target_link_libraries(test_ll PRIVATE epx_multirank_common)
foreach(ranks 1 2 4 8)
  add_test(NAME multirank.ll.n${ranks}
           COMMAND ${EPX_LAUNCH} -n ${ranks} -- $<TARGET_FILE:test_ll> --backend ${EPX_TEST_BACKEND})
  set_tests_properties(multirank.ll.n${ranks} PROPERTIES TIMEOUT 120 LABELS multirank)
endforeach()

# Rejoin in low-latency mode: a lost rank's replacement joins the running buffer (CPU
# backend; its own launcher, as ll_fault).
add_executable(test_ll_rejoin ${EPX_MULTIRANK_DIR}/test_ll_rejoin.c ${EPX_MULTIRANK_DIR}/ll_step.c)
target_link_libraries(test_ll_rejoin PRIVATE epx_multirank_common)
add_test(NAME multirank.ll_rejoin COMMAND test_ll_rejoin)
set_tests_properties(multirank.ll_rejoin PROPERTIES TIMEOUT 180 LABELS multirank)
