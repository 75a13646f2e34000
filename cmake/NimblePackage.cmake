# Installs the runtime library's headers and a CMake package, so that a LibTorch program finds
# it with find_package(nimble_train):
#
#   cmake -DCMAKE_PREFIX_PATH="$(python -c 'import nimble_train; print(nimble_train.cmake_prefix_path)')" ..
#   target_link_libraries(app PRIVATE nimble_train::nimble_train)
#
# Everything goes into the wheel's nimble_train/ folder beside the library: include/ holds the
# headers (#include <nimble_train/step.h>, <nimble_train/capture/step_graph.h>), share/cmake/nimble_train/ the package.
# The package links the torch the library was built against (its headers and libraries, found
# at build time), so the program and the library agree on one torch.

# The headers a C++ program may include, relative to src/.
set(NT_PUBLIC_HEADERS
  capture/blas_workspaces.h
  capture/graph_structure.h
  capture/slot_ring.h
  capture/staging_ring.h
  capture/static_inputs.h
  capture/step_graph.h
  capture/torch_graph.h
  common/check.h
  common/cuda_fwd.h
  common/dtype.h
  nimble_train/step.h
  optim/boundary.h
  optim/device_tables.h
  optim/flat_layout.h
  optim/fused_step.h
  streams/stream_assignment.h)

function(nt_install_package target)
  foreach(header IN LISTS NT_PUBLIC_HEADERS)
    get_filename_component(dir "${header}" DIRECTORY)
    install(FILES "src/${header}" DESTINATION "nimble_train/include/nimble_train/${dir}")
  endforeach()
  install(FILES "${CMAKE_CURRENT_BINARY_DIR}/generated/nimble_train/build_config.h"
          DESTINATION nimble_train/include/nimble_train/nimble_train)

  set(NT_PACKAGE_TORCH_INCLUDES
      "${NT_TORCH_PREFIX}/include;${NT_TORCH_PREFIX}/include/torch/csrc/api/include")
  set(NT_PACKAGE_TORCH_LIBRARIES "")
  foreach(lib c10 torch_cpu torch c10_cuda torch_cuda)
    if(NT_TORCH_LIB_${lib})
      list(APPEND NT_PACKAGE_TORCH_LIBRARIES "${NT_TORCH_LIB_${lib}}")
    endif()
  endforeach()
  if(NT_HAVE_CUDA)
    list(APPEND NT_PACKAGE_TORCH_INCLUDES "${CUDAToolkit_INCLUDE_DIRS}")
  endif()
  set(dir "${CMAKE_CURRENT_BINARY_DIR}/package")
  configure_file(cmake/nimble_trainConfig.cmake.in "${dir}/nimble_trainConfig.cmake" @ONLY)
  include(CMakePackageConfigHelpers)
  write_basic_package_version_file("${dir}/nimble_trainConfigVersion.cmake"
                                   VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
  install(FILES "${dir}/nimble_trainConfig.cmake" "${dir}/nimble_trainConfigVersion.cmake"
          DESTINATION nimble_train/share/cmake/nimble_train)
endfunction()
