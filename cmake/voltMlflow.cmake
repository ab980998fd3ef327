# Defines volt::mlflow: link it (with volt::volt) to log to an MLflow tracking server with volt::MLFlowLogger
# (volt/loggers/mlflow.hpp), which speaks MLflow's REST protocol through libcurl. Used by the build tree and by
# voltConfig.cmake. Where libcurl is not found the target is not defined, and CMake says so at the target that links
# it (apt-get install libcurl4-openssl-dev).
if(NOT TARGET volt::mlflow)
  find_package(CURL QUIET)
  if(CURL_FOUND)
    add_library(volt_mlflow INTERFACE IMPORTED GLOBAL)
    add_library(volt::mlflow ALIAS volt_mlflow)
    set_target_properties(volt_mlflow PROPERTIES INTERFACE_LINK_LIBRARIES CURL::libcurl)
  endif()
endif()
