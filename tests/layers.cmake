# The layers point one way (docs/DESIGN.md): tests/layers/check_layers.sh lists each
# object's undefined symbols with nm and fails when one is defined in a higher layer,
# or when the epx tool uses an epx__ internal. Runs on every build, CUDA objects
# included when nvcc built them. layers.self_test shows that the check can fail.
set(EPX_LAYER_TARGETS epx_objects epx_tool)
if(TARGET epx_nvshmem)
  list(APPEND EPX_LAYER_TARGETS epx_nvshmem)
endif()
set(EPX_LAYER_OBJECTS "")
foreach(target ${EPX_LAYER_TARGETS})
  string(APPEND EPX_LAYER_OBJECTS "$<JOIN:$<TARGET_OBJECTS:${target}>,\n>\n")
endforeach()
file(GENERATE OUTPUT ${CMAKE_BINARY_DIR}/layer_objects.txt CONTENT "${EPX_LAYER_OBJECTS}")

add_test(NAME layers.check
         COMMAND sh ${CMAKE_CURRENT_LIST_DIR}/layers/check_layers.sh
                 ${CMAKE_BINARY_DIR}/layer_objects.txt)
add_test(NAME layers.self_test
         COMMAND sh ${CMAKE_CURRENT_LIST_DIR}/layers/check_layers.sh --self-test)
set_tests_properties(layers.check layers.self_test PROPERTIES TIMEOUT 120 LABELS layers)
