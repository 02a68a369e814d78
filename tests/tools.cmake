# Tests of the `epx` command (tools/): command-level cases in a shell script, and the
# bench's check and statistics helpers in C.
set(EPX_TOOLS_TEST_SCRIPT ${CMAKE_CURRENT_LIST_DIR}/tools/tools_test.sh)
set(EPX_TOOLS_TEST_CASES
    launch_env launch_output launch_failure launch_exec_failure launch_timeout
    launch_forward_signal launch_bad_flag launch_mps params_list params_bad_value version
    bench_bad_flag bench_check bench_json bench_auto_register bench_fanout bench_nodes bench_ll_nodes bench_ll_check bench_ll_json soak
    soak_inject soak_rejoin soak_bad_flag)
foreach(case ${EPX_TOOLS_TEST_CASES})
  add_test(NAME tools.${case} COMMAND sh ${EPX_TOOLS_TEST_SCRIPT} $<TARGET_FILE:epx_tool> ${case})
  set_tests_properties(tools.${case} PROPERTIES TIMEOUT 120)
endforeach()
# The command must say what this build has (it links libepx.so, whose build flags it
# does not inherit).
if(EPX_HAVE_CUDA)
  set_tests_properties(tools.version PROPERTIES ENVIRONMENT "EPXTEST_CUDA=built")
else()
  set_tests_properties(tools.version PROPERTIES ENVIRONMENT "EPXTEST_CUDA=not built")
endif()

add_executable(test_bench_helpers ${CMAKE_CURRENT_LIST_DIR}/tools/test_bench_helpers.c
               ${CMAKE_SOURCE_DIR}/tools/bench/bench_check.c
               ${CMAKE_SOURCE_DIR}/tools/bench/bench_report.c
               ${CMAKE_SOURCE_DIR}/tools/bench/bench_ll_report.c)
target_include_directories(test_bench_helpers PRIVATE ${CMAKE_SOURCE_DIR}/tools/bench)
target_link_libraries(test_bench_helpers PRIVATE epx_internal epx_test_common m)
add_test(NAME tools.bench_helpers COMMAND test_bench_helpers)
set_tests_properties(tools.bench_helpers PROPERTIES TIMEOUT 60)

# The expected traffic across nodes of `epx bench --ranks-per-node`, on a hand-made routing.
add_executable(test_bench_nodes ${CMAKE_CURRENT_LIST_DIR}/tools/test_bench_nodes.c
               ${CMAKE_SOURCE_DIR}/tools/bench/bench_nodes.c
               ${CMAKE_SOURCE_DIR}/tools/bench/bench_report.c)
target_include_directories(test_bench_nodes PRIVATE ${CMAKE_SOURCE_DIR}/tools/bench)
target_link_libraries(test_bench_nodes PRIVATE epx_internal epx_test_common m)
add_test(NAME tools.bench_nodes_counts COMMAND test_bench_nodes)
set_tests_properties(tools.bench_nodes_counts PROPERTIES TIMEOUT 60)

# scripts/ll-trace (the EPX_LL_TRACE reader) on hand-made traces.
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  add_test(NAME tools.ll_trace
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/tools/test_ll_trace.py)
  set_tests_properties(tools.ll_trace PROPERTIES TIMEOUT 60)
  # scripts/normal-trace (the EPX_NORMAL_TRACE reader), likewise.
  add_test(NAME tools.normal_trace
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/tools/test_normal_trace.py)
  set_tests_properties(tools.normal_trace PROPERTIES TIMEOUT 60)
  # scripts/normal-bars (the bars beside gpu-check's benches), on a CPU-backend bench.
  add_test(NAME tools.normal_bars
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/tools/test_normal_bars.py
                   $<TARGET_FILE:epx_tool>)
  set_tests_properties(tools.normal_bars PROPERTIES TIMEOUT 300)
endif()
