# Torch's CMake files (a LibTorch with CUDA, such as pip's) set CMAKE_CUDA_STANDARD to CMAKE_CXX_STANDARD when it is
# unset, then compile a CUDA probe (their GPU detection, unless TORCH_CUDA_ARCH_LIST is set). A C++20 project
# (`set(CMAKE_CXX_STANDARD 20)` before `find_package(volt)`) thus asks nvcc for "CUDA20", which CMake 3.25 has no flags
# for: the configure fails inside Torch's files ("requires the language dialect CUDA20"). volt has Torch found with
# CUDA 17 in that case, and leaves CMAKE_CUDA_STANDARD unset again afterwards; a project that sets it keeps its own.
macro(volt_find_torch)
  set(_volt_cuda_standard_set_here FALSE)
  if(NOT DEFINED CMAKE_CUDA_STANDARD AND DEFINED CMAKE_CXX_STANDARD AND CMAKE_CXX_STANDARD GREATER_EQUAL 20)
    set(CMAKE_CUDA_STANDARD 17)
    set(_volt_cuda_standard_set_here TRUE)
  endif()
  find_package(Torch ${ARGN})
  if(_volt_cuda_standard_set_here)
    unset(CMAKE_CUDA_STANDARD)
  endif()
endmacro()
