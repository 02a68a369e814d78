# Installing epx and using it from outside the tree (tests/install/). Included by
# tests/CMakeLists.txt; ctest -L install runs them.
#
# - install.c_example: `cmake --install` into a fresh prefix, then the README's C example
#   (examples/dispatch_combine.c) built with pkg-config and with find_package(epx), run
#   through PREFIX/bin/epx launch -n 4.
# - install.python_venv: a fresh virtual environment, `pip install ./python[test]` (the
#   package builds its own host-only libepx and epx command), then from a directory outside
#   the repository `v/bin/epx launch -n 2 -- v/bin/python examples/moe_layer.py` and the
#   package's tests. Pip reads EPX_TEST_WHEELS (scripts/setup fills .venv/wheels) without
#   an index when given, else PyPI.
set(EPX_TEST_WHEELS "" CACHE PATH "Wheel files for install.python_venv (no index); empty = PyPI")

set(EPX_INSTALL_TEST_CFLAGS "")
if(EPX_SANITIZE)
  set(EPX_INSTALL_TEST_CFLAGS "-fsanitize=address,undefined")
endif()
add_test(NAME install.c_example
         COMMAND sh ${CMAKE_CURRENT_LIST_DIR}/install/c_example.sh ${CMAKE_SOURCE_DIR}
                 ${CMAKE_BINARY_DIR} "${EPX_INSTALL_TEST_CFLAGS}")
set_tests_properties(install.c_example PROPERTIES TIMEOUT 300 LABELS install)

if(Python3_Interpreter_FOUND)
  add_test(NAME install.python_venv
           COMMAND sh ${CMAKE_CURRENT_LIST_DIR}/install/python_venv.sh ${CMAKE_SOURCE_DIR}
                   ${CMAKE_CURRENT_BINARY_DIR}/install-python ${Python3_EXECUTABLE}
                   "${EPX_TEST_WHEELS}")
  # Builds the package's own libepx (host only, kept between runs): give it room, and run
  # it alone so the build does not slow the multi-rank tests into their timeouts.
  set_tests_properties(install.python_venv PROPERTIES TIMEOUT 600 RUN_SERIAL ON
                       SKIP_RETURN_CODE 77 LABELS "install;python")
endif()
