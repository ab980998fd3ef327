# volt's own builds (tests, examples, benchmarks) compile through ccache where it is installed, so a build folder or a
# fresh clone on a machine that has built volt before compiles only what changed. A result is reused only for the same
# compiler (its size and time stamp), the same arguments and the same bytes of the source and of every file it
# includes, precompiled headers among them: it is the object the compiler would write again. Failed compilations are
# never stored (the compile-fail tests compile every time), linking is never cached, and every test runs.
#   CCACHE_BASEDIR: paths under the source folder are hashed relative to it, so clones in other folders share results.
#   CCACHE_NOHASHDIR: the build folder is not hashed either (it is, by default, for units with debug information: the
#   ThreadSanitizer build's -g); such a unit's debug information may then name another clone's folder.
#   CCACHE_SLOPPINESS=pch_defines,time_macros: what ccache needs to cache precompiled headers and the units that use
#   them (volt's sources use no __DATE__ or __TIME__).
# VOLT_CCACHE=OFF, or a CMAKE_CXX_COMPILER_LAUNCHER of one's own, leaves it out. The cache is the user's (ccache's
# own settings: ~/.cache/ccache, 5 GB unless configured otherwise; `ccache -s` shows it).
option(VOLT_CCACHE "Compile volt's tests, examples and benchmarks through ccache when it is installed" ON)
if(VOLT_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  find_program(VOLT_CCACHE_PROGRAM ccache)
  if(VOLT_CCACHE_PROGRAM)
    set(CMAKE_CXX_COMPILER_LAUNCHER ${CMAKE_COMMAND} -E env CCACHE_BASEDIR=${PROJECT_SOURCE_DIR} CCACHE_NOHASHDIR=1
        CCACHE_SLOPPINESS=pch_defines,time_macros ${VOLT_CCACHE_PROGRAM})
    message(STATUS "volt: compiling through ${VOLT_CCACHE_PROGRAM} (VOLT_CCACHE=OFF leaves it out)")
  endif()
endif()
