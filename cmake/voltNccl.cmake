# Defines volt::nccl: link it (with volt::volt) to reduce CUDA tensors with NCCL; it adds NCCL's and the CUDA
# runtime's headers and library and VOLT_WITH_NCCL=1. Used by the build tree and by voltConfig.cmake, after
# voltTorch.cmake (which sets VOLT_TORCH_HAS_CUDA).
#
# NCCL is found through NCCL_HOME, CUDA_HOME, /usr/local/cuda or the default paths. When it cannot serve (no NCCL,
# or a LibTorch built without CUDA, whose c10 lacks the CUDA headers NCCL's code needs), volt::nccl still exists
# so that the project configures as far as it can, and a check at the end of the top-level CMakeLists.txt names
# every target that links it and says why it cannot.
if(NOT TARGET volt::nccl)
  find_path(VOLT_NCCL_INCLUDE_DIR nccl.h HINTS ENV NCCL_HOME ENV CUDA_HOME PATHS /usr/local/cuda PATH_SUFFIXES include)
  find_library(VOLT_NCCL_LIBRARY nccl HINTS ENV NCCL_HOME ENV CUDA_HOME PATHS /usr/local/cuda PATH_SUFFIXES lib64 lib)
  find_path(VOLT_CUDART_INCLUDE_DIR cuda_runtime_api.h HINTS ENV CUDA_HOME PATHS /usr/local/cuda PATH_SUFFIXES include)
  add_library(volt_nccl INTERFACE IMPORTED GLOBAL)
  add_library(volt::nccl ALIAS volt_nccl)
  set(VOLT_NCCL_FOUND OFF)
  if(NOT (VOLT_NCCL_INCLUDE_DIR AND VOLT_NCCL_LIBRARY AND VOLT_CUDART_INCLUDE_DIR))
    string(CONCAT volt_why "NCCL was not found (nccl.h, libnccl and cuda_runtime_api.h under NCCL_HOME, CUDA_HOME or "
      "/usr/local/cuda). Install NCCL and the CUDA toolkit, or set NCCL_HOME")
    set_property(GLOBAL PROPERTY VOLT_NCCL_UNUSABLE "${volt_why}")
  elseif(NOT VOLT_TORCH_HAS_CUDA)
    string(CONCAT volt_why "the LibTorch found (${TORCH_INSTALL_PREFIX}, version ${Torch_VERSION}) was built without "
      "CUDA, and NCCL reduces CUDA tensors only. Use a CUDA build of LibTorch (pip's torch, or PyTorch's LibTorch "
      "archive for CUDA) through CMAKE_PREFIX_PATH, or leave volt::nccl out: volt::Mpi serves CPU tensors")
    set_property(GLOBAL PROPERTY VOLT_NCCL_UNUSABLE "${volt_why}")
  else()
    set(VOLT_NCCL_FOUND ON)
    set_target_properties(volt_nccl PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${VOLT_NCCL_INCLUDE_DIR};${VOLT_CUDART_INCLUDE_DIR}"
      INTERFACE_LINK_LIBRARIES "${VOLT_NCCL_LIBRARY}"
      INTERFACE_COMPILE_DEFINITIONS "VOLT_WITH_NCCL=1")
  endif()

  # Every target of the whole project that links volt::nccl, or an empty list.
  function(volt_nccl_users out)
    set(users)
    set(dirs "${CMAKE_SOURCE_DIR}")
    while(dirs)
      list(POP_FRONT dirs dir)
      get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
      foreach(t IN LISTS targets)
        get_target_property(type ${t} TYPE)
        set(libs)
        if(NOT type STREQUAL "INTERFACE_LIBRARY")
          get_target_property(libs ${t} LINK_LIBRARIES)
        endif()
        get_target_property(ilibs ${t} INTERFACE_LINK_LIBRARIES)
        if("volt::nccl" IN_LIST libs OR "volt::nccl" IN_LIST ilibs OR "volt_nccl" IN_LIST libs OR "volt_nccl" IN_LIST ilibs)
          list(APPEND users ${t})
        endif()
      endforeach()
      get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
      list(APPEND dirs ${subdirs})
    endwhile()
    set(${out} "${users}" PARENT_SCOPE)
  endfunction()

  function(volt_nccl_check_users)
    get_property(why GLOBAL PROPERTY VOLT_NCCL_UNUSABLE)
    volt_nccl_users(users)
    if(users)
      list(JOIN users ", " users)
      message(FATAL_ERROR "volt: target(s) ${users} link volt::nccl, but ${why}.")
    endif()
  endfunction()
  get_property(volt_nccl_why GLOBAL PROPERTY VOLT_NCCL_UNUSABLE)
  if(volt_nccl_why)
    cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL volt_nccl_check_users)
  endif()
endif()
