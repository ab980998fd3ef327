# The floors of volt's headers, and the check that every include stands below its includer.
#
# A room is a folder of include/volt/ (`loops/`) or a header at its top (`context.hpp`); a folder and the header of
# the same name at the top (`checkpoint/` and `checkpoint.hpp`, `trainer/` and `trainer.hpp`, `data/` and the
# umbrella `data.hpp`) are one room. A header may include any header of its own room, and of rooms on lower floors
# only: never a room on its own floor or above. So the include graph between rooms has no circle, and a reader who
# knows a room's floor knows what it may use.
#
#   cmake -DROOT=<source dir> -P test/static/floors.cmake [-DEXTRA="from.hpp>to.hpp;..."]
#
# EXTRA adds include lines that are not in the tree (`loops/hooks.hpp>trainer.hpp`): the check's own test that it
# fails on an include running back up.

set(floors
  "detail errors version batch seed stage reduce declared_hooks roles"  # 0  the ground: no volt header below them
  "options metric_store checkpoint"                         # 1  settings, logged values, the file formats (checkpoint, safetensors)
  "context cluster weights units model_plan config"         # 2  what a module's steps are handed; the job's hosts; weights into modules; its units and parts; configuration files and flags
  "module comm data precision optim accelerators activation_checkpoint"  # 3  policies' rooms, each alone
  "launchers"                                               # 4  starting processes (over comm)
  "strategies callbacks"                                    # 5  strategies (over launchers), callbacks
  "loops loggers"                                           # 6  what the Trainer's loops are made of; loggers (callbacks of a kind of their own)
  "connectors"                                              # 7  checkpoints and loggers as the Trainer writes them
  "rules"                                                   # 8  the rules between the slots
  "trainer"                                                 # 9  the Trainer and its out-of-class parts
  "volt")                                                   # 10 volt.hpp, everything

if(NOT ROOT)
  message(FATAL_ERROR "floors.cmake: give -DROOT=<the source directory>")
endif()

set(floor 0)
foreach(line IN LISTS floors)
  string(REPLACE " " ";" rooms "${line}")
  foreach(room IN LISTS rooms)
    if(room)
      set(floor_of_${room} ${floor})
    endif()
  endforeach()
  math(EXPR floor "${floor} + 1")
endforeach()

# The room of a path under include/volt/: its first component without ".hpp".
function(room_of path out)
  string(REGEX REPLACE "/.*$" "" first "${path}")
  string(REGEX REPLACE "\\.hpp$" "" first "${first}")
  set(${out} ${first} PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE headers RELATIVE ${ROOT}/include/volt ${ROOT}/include/volt/*.hpp)
set(edges)
foreach(header IN LISTS headers)
  file(STRINGS ${ROOT}/include/volt/${header} lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<]volt/")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*[\"<]volt/([^\">]+)[\">].*$" "\\1" target "${line}")
    list(APPEND edges "${header}>${target}")
  endforeach()
endforeach()
list(APPEND edges ${EXTRA})

set(errors 0)
set(unplaced)
foreach(header IN LISTS headers)
  room_of(${header} room)
  if(NOT DEFINED floor_of_${room})
    list(APPEND unplaced ${room})
  endif()
endforeach()
list(REMOVE_DUPLICATES unplaced)
foreach(room IN LISTS unplaced)
  message("floors: room '${room}' (include/volt/${room}) has no floor: add it to the table in test/static/floors.cmake")
  math(EXPR errors "${errors} + 1")
endforeach()

list(LENGTH edges n)
foreach(edge IN LISTS edges)
  string(REPLACE ">" ";" pair "${edge}")
  list(GET pair 0 from)
  list(GET pair 1 to)
  room_of(${from} from_room)
  room_of(${to} to_room)
  if(from_room STREQUAL to_room OR NOT DEFINED floor_of_${from_room} OR NOT DEFINED floor_of_${to_room})
    continue()
  endif()
  if(NOT floor_of_${to_room} LESS floor_of_${from_room})
    message("floors: volt/${from} includes volt/${to}, but room '${to_room}' (floor ${floor_of_${to_room}}) does not "
            "stand below room '${from_room}' (floor ${floor_of_${from_room}}): move what it needs down a floor")
    math(EXPR errors "${errors} + 1")
  endif()
endforeach()

if(errors GREATER 0)
  message(FATAL_ERROR "floors: ${errors} include(s) out of place among ${n}")
endif()
message("floors: ${n} includes of volt headers, each to its own room or one below")
