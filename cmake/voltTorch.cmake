# Checks on the LibTorch that find_package(Torch) found; used by the build tree and by voltConfig.cmake.
#
# 1. One install, not two. TorchConfig.cmake looks for its libraries in its own prefix only *after* the system
#    paths, so with two LibTorch installs (Debian's in /usr and pip's in a virtual environment, say) the headers
#    of one can be paired with the libraries of the other: that links, then fails in strange ways. Refused here.
# 2. VOLT_TORCH_HAS_CUDA: whether this LibTorch was built with CUDA (volt::nccl needs it).
if(DEFINED TORCH_INSTALL_PREFIX AND TORCH_LIBRARY)
  cmake_path(IS_PREFIX TORCH_INSTALL_PREFIX "${TORCH_LIBRARY}" NORMALIZE volt_torch_lib_in_prefix)
  if(NOT volt_torch_lib_in_prefix)
    message(FATAL_ERROR "volt: Torch's CMake files are from ${TORCH_INSTALL_PREFIX} but its library was found at "
      "${TORCH_LIBRARY}, which belongs to another LibTorch. Put the LibTorch folder itself (the one that holds lib/ "
      "and share/cmake/; for pip's torch: python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))') "
      "on CMAKE_PREFIX_PATH, not only its share/cmake folder.")
  endif()
endif()
set(VOLT_TORCH_HAS_CUDA OFF)
if(CAFFE2_USE_CUDA)
  set(VOLT_TORCH_HAS_CUDA ON)
elseif(TARGET torch)
  get_target_property(volt_torch_links torch INTERFACE_LINK_LIBRARIES)
  if(volt_torch_links MATCHES "c10_cuda")
    set(VOLT_TORCH_HAS_CUDA ON)
  endif()
endif()
