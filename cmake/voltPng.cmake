# Defines volt::png: link it (with volt::volt) to read PNG files with volt::data::ImageFolder (volt/data/image_folder.hpp),
# which decodes with libpng. Used by the build tree and by voltConfig.cmake. Where libpng is not found the target is
# not defined, and CMake says so at the target that links it (apt-get install libpng-dev).
if(NOT TARGET volt::png)
  find_package(PNG QUIET)
  if(PNG_FOUND)
    add_library(volt_png INTERFACE IMPORTED GLOBAL)
    add_library(volt::png ALIAS volt_png)
    set_target_properties(volt_png PROPERTIES INTERFACE_LINK_LIBRARIES PNG::PNG)
  endif()
endif()
