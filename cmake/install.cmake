# `cmake --install BUILD [--prefix PREFIX]`: the epx command, the shared library (and the
# NVSHMEM plugin beside it, where it was built), the header, a pkg-config file and a CMake
# package (find_package(epx) gives the imported target epx::epx). Included by the top
# CMakeLists.txt after the targets exist.
#
#   PREFIX/bin/epx
#   PREFIX/lib/libepx.so -> libepx.so.0 -> libepx.so.0.1.0
#   PREFIX/lib/libepx_nvshmem.so                (low-latency mode on GPUs; optional)
#   PREFIX/include/epx.h
#   PREFIX/lib/pkgconfig/epx.pc
#   PREFIX/lib/cmake/epx/epx-config.cmake, epx-config-version.cmake, epx-targets*.cmake
include(CMakePackageConfigHelpers)

# The epx command links libepx.so (which finds the NVSHMEM plugin beside itself): its run
# path points at the installed library directory.
file(RELATIVE_PATH EPX_BIN_TO_LIB ${CMAKE_INSTALL_FULL_BINDIR} ${CMAKE_INSTALL_FULL_LIBDIR})
# Link directories outside the system ones (the CUDA runtime's) stay in the run path, so
# an installed copy starts wherever the build did.
set_target_properties(epx_tool PROPERTIES INSTALL_RPATH "$ORIGIN/${EPX_BIN_TO_LIB}"
                      INSTALL_RPATH_USE_LINK_PATH ON)
set_target_properties(epx PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)

install(TARGETS epx_tool RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS epx EXPORT epx-targets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ${CMAKE_CURRENT_SOURCE_DIR}/include/epx.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(TARGET epx_nvshmem)
  # libepx loads it from its own directory (src/ops/cuda/ll_setup.c).
  install(TARGETS epx_nvshmem LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
endif()

set(EPX_CMAKE_PACKAGE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/epx)
install(EXPORT epx-targets NAMESPACE epx:: FILE epx-targets.cmake
        DESTINATION ${EPX_CMAKE_PACKAGE_DIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/epx-config.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/epx-config.cmake
                              INSTALL_DESTINATION ${EPX_CMAKE_PACKAGE_DIR})
# 0.x: a minor version may change the API, so only the same minor version matches.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/epx-config-version.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/epx-config.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/epx-config-version.cmake
        DESTINATION ${EPX_CMAKE_PACKAGE_DIR})

# pkg-config: its prefix is written at install time, so that the paths are those of the
# prefix given to `cmake --install --prefix`, not the one configured.
foreach(dir LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${CMAKE_INSTALL_${dir}}")
    set(EPX_PC_${dir} "${CMAKE_INSTALL_${dir}}")
  else()
    set(EPX_PC_${dir} "\${prefix}/${CMAKE_INSTALL_${dir}}")
  endif()
endforeach()
set(EPX_PC_PREFIX "@EPX_PC_PREFIX@") # kept for the install step
configure_file(${CMAKE_CURRENT_LIST_DIR}/epx.pc.in ${CMAKE_CURRENT_BINARY_DIR}/epx.pc.in @ONLY)
install(CODE "
  file(READ \"${CMAKE_CURRENT_BINARY_DIR}/epx.pc.in\" epx_pc)
  string(REPLACE \"@EPX_PC_PREFIX@\" \"\${CMAKE_INSTALL_PREFIX}\" epx_pc \"\${epx_pc}\")
  file(WRITE \"${CMAKE_CURRENT_BINARY_DIR}/epx.pc\" \"\${epx_pc}\")
")
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/epx.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
