# Defines volt::nccl when NCCL and the CUDA runtime headers are found (NCCL_HOME, CUDA_HOME, /usr/local/cuda
# or the default paths): an interface target that adds them and VOLT_WITH_NCCL=1. Used by the build tree
# and by voltConfig.cmake.
if(NOT TARGET volt::nccl)
  find_path(VOLT_NCCL_INCLUDE_DIR nccl.h HINTS ENV NCCL_HOME ENV CUDA_HOME PATHS /usr/local/cuda PATH_SUFFIXES include)
  find_library(VOLT_NCCL_LIBRARY nccl HINTS ENV NCCL_HOME ENV CUDA_HOME PATHS /usr/local/cuda PATH_SUFFIXES lib64 lib)
  find_path(VOLT_CUDART_INCLUDE_DIR cuda_runtime_api.h HINTS ENV CUDA_HOME PATHS /usr/local/cuda PATH_SUFFIXES include)
  if(VOLT_NCCL_INCLUDE_DIR AND VOLT_NCCL_LIBRARY AND VOLT_CUDART_INCLUDE_DIR)
    add_library(volt_nccl INTERFACE IMPORTED GLOBAL)
    set_target_properties(volt_nccl PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${VOLT_NCCL_INCLUDE_DIR};${VOLT_CUDART_INCLUDE_DIR}"
      INTERFACE_LINK_LIBRARIES "${VOLT_NCCL_LIBRARY}"
      INTERFACE_COMPILE_DEFINITIONS "VOLT_WITH_NCCL=1")
    add_library(volt::nccl ALIAS volt_nccl)
  endif()
endif()
