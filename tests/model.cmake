# Models of the GPU kernels' protocols, explored on the CPU: model/ll_slot_release.py runs
# every interleaving of the low-latency slot releases (kernels 2) at 2 and 3 ranks and
# checks that it catches two deliberate bugs. Needs only Python 3.
find_package(Python3 COMPONENTS Interpreter)
if(NOT Python3_Interpreter_FOUND)
  message(STATUS "epx: no Python 3 interpreter found, protocol models not registered")
  return()
endif()
add_test(NAME model.ll_slot_release
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/model/ll_slot_release.py)
set_tests_properties(model.ll_slot_release PROPERTIES TIMEOUT 300 LABELS model)
