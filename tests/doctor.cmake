# Tests of `epx doctor` (tools/doctor/). Included at the end of tests/CMakeLists.txt.
#
# - unit.test_doctor_parse / _report / _child / _internode: the unit-test glob makes these
#   targets; here they get the doctor sources they test and the recorded samples.
# - doctor.json / doctor.text: the whole command on this machine, output checked by
#   tests/doctor/check_doctor.py (python3's json module only).
# - doctor.internode: env.internode's values and warnings under made-up NVSHMEM_* and
#   EPX_* settings, and a bad EPX_XN_RING_TOKENS refused (check_doctor.py says which).
# - doctor.plugin: nvshmem.plugin finds the libepx_nvshmem.so of this build from another
#   directory (the build-directory fallback), and with EPX_NVSHMEM_PLUGIN=/nonexistent
#   says not-present with the fix. The script is told the plugin's path, or "none" when
#   this build has none.

set(EPX_DOCTOR_TOOLS ${CMAKE_SOURCE_DIR}/tools/doctor)

if(TARGET test_doctor_parse)
  target_sources(test_doctor_parse PRIVATE ${EPX_DOCTOR_TOOLS}/doctor_parse.c
                 ${EPX_DOCTOR_TOOLS}/doctor_sysfs.c)
  target_include_directories(test_doctor_parse PRIVATE ${EPX_DOCTOR_TOOLS})
  target_compile_definitions(test_doctor_parse PRIVATE
                             EPX_DOCTOR_DATA_DIR="${CMAKE_CURRENT_LIST_DIR}/data/doctor")
endif()

if(TARGET test_doctor_internode)
  target_sources(test_doctor_internode PRIVATE ${EPX_DOCTOR_TOOLS}/doctor_internode.c
                 ${EPX_DOCTOR_TOOLS}/doctor_parse.c ${EPX_DOCTOR_TOOLS}/doctor_sysfs.c)
  target_include_directories(test_doctor_internode PRIVATE ${EPX_DOCTOR_TOOLS})
endif()

if(TARGET test_doctor_child)
  target_sources(test_doctor_child PRIVATE ${EPX_DOCTOR_TOOLS}/doctor_child.c
                 ${EPX_DOCTOR_TOOLS}/doctor_report.c ${CMAKE_SOURCE_DIR}/tools/common/tool.c)
  target_include_directories(test_doctor_child PRIVATE ${EPX_DOCTOR_TOOLS} ${CMAKE_SOURCE_DIR}/tools)
endif()

if(TARGET test_doctor_report)
  target_sources(test_doctor_report PRIVATE ${EPX_DOCTOR_TOOLS}/doctor_report.c)
  target_include_directories(test_doctor_report PRIVATE ${EPX_DOCTOR_TOOLS})
endif()

if(TARGET epx_nvshmem)
  set(EPX_DOCTOR_PLUGIN $<TARGET_FILE:epx_nvshmem>)
else()
  set(EPX_DOCTOR_PLUGIN none)
endif()

find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  foreach(mode json text plugin internode)
    add_test(NAME doctor.${mode}
             COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/doctor/check_doctor.py
                     $<TARGET_FILE:epx_tool> ${mode} ${EPX_DOCTOR_PLUGIN})
    # The smoke run starts ranks; leave it room, but a hang still ends the test.
    set_tests_properties(doctor.${mode} PROPERTIES TIMEOUT 300 LABELS doctor)
  endforeach()
endif()
