# Finds the CUDA library nimble_train links beside the CUDA runtime (NCCL), and the CUDA math
# libraries' headers torch's CUDA headers include.
#
# Each is looked for first where the user points (NCCL_ROOT), then in the
# nvidia-* wheels next to torch (the copies torch itself loads), then on the system. A
# library that is missing only turns its feature off; nt_cuda_library() records why.

# nt_cuda_library(NAME HEADER <h> LIBS <names...> VERSION_HEADER <h> VERSION_REGEX <prefix>
#                 VERSION_FIELDS <a b c> ROOT_VAR <var>)
# Defines NT_HAVE_<NAME>, NT_<NAME>_VERSION, NT_<NAME>_REASON and target nt::<name>.
function(nt_cuda_library name)
  cmake_parse_arguments(arg "" "HEADER;VERSION_HEADER;ROOT_VAR" "LIBS;VERSION_FIELDS" ${ARGN})
  string(TOUPPER "${name}" up)
  set(hints)
  if(arg_ROOT_VAR)
    list(APPEND hints ${${arg_ROOT_VAR}} $ENV{${arg_ROOT_VAR}})
  endif()
  list(APPEND hints ${NT_NVIDIA_DIRS} ${CUDAToolkit_LIBRARY_ROOT}
       ${CUDAToolkit_INCLUDE_DIRS}/.. ${CUDAToolkit_LIBRARY_DIR}/..)

  find_path(NT_${up}_INCLUDE_DIR ${arg_HEADER} HINTS ${hints} PATH_SUFFIXES include)
  # NAMES_PER_DIR: the first folder in hint order wins, whatever name the library has there
  # (the wheels carry only libnccl.so.2, the system also libnccl.so).
  find_library(NT_${up}_LIBRARY NAMES ${arg_LIBS} NAMES_PER_DIR HINTS ${hints}
               PATH_SUFFIXES lib lib64)
  if(NOT NT_${up}_INCLUDE_DIR OR NOT NT_${up}_LIBRARY)
    set(NT_HAVE_${up} OFF PARENT_SCOPE)
    set(NT_${up}_VERSION "" PARENT_SCOPE)
    string(CONCAT reason "${arg_HEADER} or lib${name} not found (looked in ${arg_ROOT_VAR}, "
           "the nvidia-* wheels beside torch, the CUDA toolkit and the system paths)")
    set(NT_${up}_REASON "${reason}" PARENT_SCOPE)
    message(STATUS "nimble_train: ${name} left out: ${reason}")
    return()
  endif()

  set(version_parts)
  file(READ "${NT_${up}_INCLUDE_DIR}/${arg_VERSION_HEADER}" text)
  foreach(field IN LISTS arg_VERSION_FIELDS)
    if(text MATCHES "#define[ \t]+${field}[ \t]+([0-9]+)")
      list(APPEND version_parts ${CMAKE_MATCH_1})
    endif()
  endforeach()
  list(JOIN version_parts "." version)

  add_library(nt::${name} INTERFACE IMPORTED GLOBAL)
  target_include_directories(nt::${name} INTERFACE "${NT_${up}_INCLUDE_DIR}")
  target_link_libraries(nt::${name} INTERFACE "${NT_${up}_LIBRARY}")
  set(NT_HAVE_${up} ON PARENT_SCOPE)
  set(NT_${up}_VERSION "${version}" PARENT_SCOPE)
  set(NT_${up}_REASON "" PARENT_SCOPE)
  message(STATUS "nimble_train: ${name} ${version}: ${NT_${up}_LIBRARY}")
endfunction()

macro(nt_find_cuda_libraries)
  nt_cuda_library(nccl HEADER nccl.h LIBS nccl libnccl.so.2 ROOT_VAR NCCL_ROOT
    VERSION_HEADER nccl.h VERSION_FIELDS NCCL_MAJOR NCCL_MINOR NCCL_PATCH)
endmacro()

# The headers of CUDA's math libraries that torch's ATen/cuda/CUDAContextLight.h includes
# (cuBLAS, cuBLASLt, cuSPARSE, cuSOLVER), for the one source that reads torch's cuBLAS
# workspaces (src/capture/blas_workspaces.cpp): the toolkit's, else the nvidia-* wheels' beside
# torch. Sets NT_CUDA_MATH_INCLUDE_DIRS.
function(nt_find_cuda_math_headers)
  set(dirs)
  foreach(header cublas_v2.h cublasLt.h cusparse.h cusolverDn.h)
    string(MAKE_C_IDENTIFIER "NT_${header}_DIR" var)
    find_path(${var} ${header} HINTS ${CUDAToolkit_INCLUDE_DIRS} ${NT_NVIDIA_DIRS}
              PATH_SUFFIXES include)
    if(NOT ${var})
      message(FATAL_ERROR "nimble_train: ${header} not found in the CUDA toolkit "
              "(${CUDAToolkit_INCLUDE_DIRS}) nor in the nvidia-* wheels beside torch "
              "(${NT_NVIDIA_DIRS}); torch's CUDA headers include it. Install the toolkit's "
              "math libraries or reinstall torch with its CUDA dependencies.")
    endif()
    list(APPEND dirs "${${var}}")
  endforeach()
  list(REMOVE_DUPLICATES dirs)
  set(NT_CUDA_MATH_INCLUDE_DIRS "${dirs}" PARENT_SCOPE)
endfunction()
