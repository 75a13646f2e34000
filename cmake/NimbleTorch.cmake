# Finds the installed torch through its own Python and defines imported targets for it.
#
# torch's TorchConfig.cmake is not used: for a CUDA build of torch it demands the whole CUDA
# toolkit (nvrtc, cuBLAS, ...) even for code that needs none of it, and rewrites the CUDA
# architecture flags for a dozen GPUs. torch.utils.cpp_extension does not use it either; like
# it, we take the headers and libraries from the torch package itself.
#
# Sets NT_TORCH_VERSION, NT_TORCH_CUDA ("" for a CPU build), NT_TORCH_LIBSTDCXX (the C++
# runtime torch's process loads), NT_NVIDIA_DIRS (the nvidia-* wheels' folders) and the targets
# nt::torch, nt::torch_python and, for a CUDA build, nt::torch_cuda.

function(_nt_run_torch_query out_var rc_var err_var)
  set(query "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/torch_query.py")
  execute_process(
    COMMAND "${Python_EXECUTABLE}" "${query}"
    OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    # pip's isolated build hides the environment's packages behind PYTHONPATH and
    # PYTHONNOUSERSITE, but runs the environment's own interpreter: without those two
    # variables that interpreter sees the torch the user installed, the one to build against.
    execute_process(
      COMMAND "${CMAKE_COMMAND}" -E env --unset=PYTHONPATH --unset=PYTHONNOUSERSITE
              "${Python_EXECUTABLE}" "${query}"
      OUTPUT_VARIABLE out ERROR_VARIABLE err2 RESULT_VARIABLE rc)
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
  set(${rc_var} "${rc}" PARENT_SCOPE)
  set(${err_var} "${err}" PARENT_SCOPE)
endfunction()

function(_nt_torch_library target name root)
  find_library(NT_TORCH_LIB_${name} NAMES ${name} HINTS "${root}/lib" NO_DEFAULT_PATH)
  if(NOT NT_TORCH_LIB_${name})
    message(FATAL_ERROR "torch at ${root} has no lib${name}.so in ${root}/lib; "
                        "reinstall torch (pip install --force-reinstall torch).")
  endif()
  target_link_libraries(${target} INTERFACE "${NT_TORCH_LIB_${name}}")
endfunction()

macro(nt_find_torch)
  _nt_run_torch_query(_nt_out _nt_rc _nt_err)
  if(NOT _nt_rc EQUAL 0)
    message(FATAL_ERROR
      "nimble_train is built against the installed torch, but ${Python_EXECUTABLE} "
      "could not import it:\n${_nt_err}\n"
      "Install torch into this Python environment first (pip install torch), then build "
      "again (pip install --no-build-isolation -e .).")
  endif()
  string(REPLACE "\n" ";" _nt_lines "${_nt_out}")
  set(NT_NVIDIA_DIRS)
  foreach(_nt_line IN LISTS _nt_lines)
    if(_nt_line MATCHES "^nvidia_dir=(.*)$")
      list(APPEND NT_NVIDIA_DIRS "${CMAKE_MATCH_1}")
    elseif(_nt_line MATCHES "^([a-z0-9_]+)=(.*)$")
      string(TOUPPER "${CMAKE_MATCH_1}" _nt_key)
      set(NT_TORCH_${_nt_key} "${CMAKE_MATCH_2}")
    endif()
  endforeach()
  message(STATUS "nimble_train: torch ${NT_TORCH_VERSION} at ${NT_TORCH_PREFIX}"
                 " (CUDA: ${NT_TORCH_CUDA})")

  add_library(nt::torch INTERFACE IMPORTED)
  target_include_directories(nt::torch INTERFACE
    "${NT_TORCH_PREFIX}/include" "${NT_TORCH_PREFIX}/include/torch/csrc/api/include")
  target_compile_definitions(nt::torch INTERFACE
    _GLIBCXX_USE_CXX11_ABI=${NT_TORCH_CXX11_ABI})
  target_compile_features(nt::torch INTERFACE cxx_std_20)  # torch's headers require C++20
  foreach(_nt_lib c10 torch_cpu torch)
    _nt_torch_library(nt::torch ${_nt_lib} "${NT_TORCH_PREFIX}")
  endforeach()

  # The extension must use the C++ runtime that Python and torch have loaded. A toolchain that
  # only ships libstdc++.a (CXX pointing at such a wrapper) would otherwise link a private
  # copy into _C, whose streams and locales then get mixed with the process's copy and crash.
  # Naming the loaded libstdc++.so first on the link line resolves every C++ runtime symbol
  # there, so nothing is taken from the static archive.
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so
                  OUTPUT_VARIABLE _nt_shared_libstdcxx OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT IS_ABSOLUTE "${_nt_shared_libstdcxx}" AND NT_TORCH_LIBSTDCXX)
    message(STATUS "nimble_train: ${CMAKE_CXX_COMPILER} has no shared libstdc++; linking the "
                   "one torch runs with: ${NT_TORCH_LIBSTDCXX}")
    target_link_libraries(nt::torch INTERFACE "${NT_TORCH_LIBSTDCXX}")
  endif()

  add_library(nt::torch_python INTERFACE IMPORTED)
  _nt_torch_library(nt::torch_python torch_python "${NT_TORCH_PREFIX}")

  if(NOT NT_TORCH_CUDA STREQUAL "")
    add_library(nt::torch_cuda INTERFACE IMPORTED)
    foreach(_nt_lib c10_cuda torch_cuda)
      _nt_torch_library(nt::torch_cuda ${_nt_lib} "${NT_TORCH_PREFIX}")
    endforeach()
  endif()
endmacro()
