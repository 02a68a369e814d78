# Python package tests (python/tests, examples/moe_layer.py), run with pytest through
# python/tests/run_ctest.py; the multi-rank ones under `epx launch`. They run with the
# Python CMake finds: scripts/setup passes its .venv's (-DPython3_EXECUTABLE), which has
# numpy, ml_dtypes, pytest and jax. In CI a missing one fails the test; elsewhere a test
# skips (exit 77) saying "COULD NOT RUN" (numpy, ml_dtypes, pytest: required) or "SKIP
# (optional)" (jax: a framework the package does not need), and scripts/test lists both.
# Included by tests/CMakeLists.txt; ctest -L python runs them.
find_package(Python3 COMPONENTS Interpreter)
if(NOT Python3_Interpreter_FOUND)
  message(STATUS "epx: no Python 3 interpreter found, Python tests not registered")
  return()
endif()

set(EPX_PY_ROOT ${CMAKE_SOURCE_DIR})
set(EPX_PY_TESTS ${EPX_PY_ROOT}/python/tests)
set(EPX_PY_RUN ${Python3_EXECUTABLE} ${EPX_PY_TESTS}/run_ctest.py)
if(NOT DEFINED EPX_TEST_BACKEND)
  set(EPX_TEST_BACKEND auto)
endif()
# EPXTEST_* rather than EPX_*: the library warns about EPX_* variables it does not know.
set(EPX_PY_ENV PYTHONPATH=${EPX_PY_ROOT}/python EPX_LIBRARY=$<TARGET_FILE:epx>
               EPXTEST_BACKEND=${EPX_TEST_BACKEND} EPXTEST_TOOL=$<TARGET_FILE:epx_tool>)

add_test(NAME python.unit
         COMMAND ${EPX_PY_RUN} -- -q ${EPX_PY_TESTS}/test_capi.py ${EPX_PY_TESTS}/test_dlpack.py
                 ${EPX_PY_TESTS}/test_library.py ${EPX_PY_TESTS}/test_exit.py
         WORKING_DIRECTORY ${EPX_PY_ROOT})
set_tests_properties(python.unit PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 LABELS python
                     ENVIRONMENT "${EPX_PY_ENV}")

# Rejoin in low-latency mode (CPU backend): one pytest process that starts, kills and
# replaces its own worker processes.
add_test(NAME python.rejoin
         COMMAND ${EPX_PY_RUN} -- -q ${EPX_PY_TESTS}/test_rejoin.py
         WORKING_DIRECTORY ${EPX_PY_ROOT})
set_tests_properties(python.rejoin PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77
                     LABELS "python;multirank" ENVIRONMENT "${EPX_PY_ENV}")

foreach(ranks 1 2 4)
  add_test(NAME python.multirank.n${ranks}
           COMMAND ${EPX_PY_RUN} --launch $<TARGET_FILE:epx_tool> -n ${ranks} -- -q
                   ${EPX_PY_TESTS}/test_buffer.py ${EPX_PY_TESTS}/test_bad_input.py
                   ${EPX_PY_TESTS}/test_group.py ${EPX_PY_TESTS}/test_low_latency.py
                   ${EPX_PY_TESTS}/test_deep_ep.py ${EPX_PY_TESTS}/test_elastic.py
           WORKING_DIRECTORY ${EPX_PY_ROOT})
  set_tests_properties(python.multirank.n${ranks} PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77
                       LABELS "python;multirank" ENVIRONMENT "${EPX_PY_ENV}")
endforeach()

# epx.deep_ep on a group spanning nodes (2 virtual nodes of 2 ranks, CPU backend): the
# internode handle, num_tokens_per_rdma_rank, combine summed per node, bias and dispatch
# without top-k across nodes; low-latency mode across the virtual nodes too; DeepEP V2's
# ElasticBuffer (test_elastic.py) with its scale-up domain of 2.
add_test(NAME python.multirank.n4.nodes2x2
         COMMAND ${EPX_PY_RUN} --launch $<TARGET_FILE:epx_tool> -n 4 -- -q
                 ${EPX_PY_TESTS}/test_deep_ep.py ${EPX_PY_TESTS}/test_elastic.py
         WORKING_DIRECTORY ${EPX_PY_ROOT})
set_tests_properties(python.multirank.n4.nodes2x2 PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77
                     LABELS "python;multirank"
                     ENVIRONMENT "${EPX_PY_ENV};EPX_RANKS_PER_NODE=2")

# JAX arrays through DLPack (CPU backend); scripts/setup installs jax[cpu]. JAX is
# optional for the package, so without it these skip as optional (a failure in CI).
foreach(ranks 1 2)
  add_test(NAME python.jax.n${ranks}
           COMMAND ${EPX_PY_RUN} --optional jax --launch $<TARGET_FILE:epx_tool> -n ${ranks}
                   -- -q -rs ${EPX_PY_TESTS}/test_jax.py
           WORKING_DIRECTORY ${EPX_PY_ROOT})
  set_tests_properties(python.jax.n${ranks} PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77
                       LABELS "python;multirank;jax" ENVIRONMENT "${EPX_PY_ENV}")
endforeach()

foreach(ranks 2 4)
  add_test(NAME python.example.moe_layer.n${ranks}
           COMMAND ${EPX_PY_RUN} --launch $<TARGET_FILE:epx_tool> -n ${ranks}
                   --script ${EPX_PY_ROOT}/examples/moe_layer.py
           WORKING_DIRECTORY ${EPX_PY_ROOT})
  set_tests_properties(python.example.moe_layer.n${ranks} PROPERTIES TIMEOUT 300
                       SKIP_RETURN_CODE 77 LABELS "python;multirank" ENVIRONMENT "${EPX_PY_ENV}")
endforeach()
