# No `requires` probe on an optional member of a strategy or of a layout's holder in trainer/, loops/ or strategies/:
# such a probe falls silently to its default when the member is misspelt. The optional members are roles, declared in
# a type's `volt_roles` and checked (volt/roles.hpp). A probe here is a requires-expression (`requires { ... }`, or
# `if constexpr (requires(...) { ... })`) whose body names a strategy (`strategy_`, `p_.strategy`, `S::`), a holder
# (`holder`) or a part (`g.`); concepts, roles and requires-clauses are not probes.
#   cmake -DROOT=<the source directory> [-DEXTRA=<text read as one more header>] -P probes.cmake
if(NOT ROOT)
  message(FATAL_ERROR "probes.cmake: give -DROOT=<the source directory>")
endif()
set(names "(strategy|holder|[^a-z_]g\\.|[^a-zA-Z_]S::)[^}]*}")
set(pattern "(requires[ \t\r\n]*{|constexpr[ \t\r\n]*\\(requires[^{]*{)[^}]*${names}")
set(found 0)
set(texts)
foreach(room trainer loops strategies)
  file(GLOB_RECURSE headers ${ROOT}/include/volt/${room}/*.hpp)
  foreach(header IN LISTS headers)
    file(READ ${header} text)
    string(REGEX MATCHALL "${pattern}" hits "${text}")
    foreach(hit IN LISTS hits)
      string(REPLACE "\n" " " hit "${hit}")
      file(RELATIVE_PATH name ${ROOT} ${header})
      message("probes: ${name}: ${hit}")
      math(EXPR found "${found} + 1")
    endforeach()
  endforeach()
endforeach()
if(EXTRA)
  string(REGEX MATCHALL "${pattern}" hits "${EXTRA}")
  foreach(hit IN LISTS hits)
    message("probes: (extra): ${hit}")
    math(EXPR found "${found} + 1")
  endforeach()
endif()
if(found GREATER 0)
  message(FATAL_ERROR "probes: ${found} requires-probe(s) on a strategy's or holder's member: declare a role instead "
                      "(volt/roles.hpp, strategies/concept.hpp, strategies/layout.hpp)")
endif()
message("probes: none in trainer/, loops/, strategies/")
