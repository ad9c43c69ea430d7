# Included by tests/CMakeLists.txt (kept here: the fixture's names below are not knobs, and
# knobs.cmake does not read tests/knobs/).
# Knobs (core/knobs.h): every DISTCA_* name in the tree is a knob of the table, a macro or a CMake
# name, every knob is used where the table says, and `distca --help-env` lists each; the fixture is
# a tree that breaks each rule once.
add_test(NAME Knobs.EveryDistcaNameIsInTheTableOrAMacro
         COMMAND ${CMAKE_COMMAND} -DROOT=${CMAKE_SOURCE_DIR} -DDISTCA=$<TARGET_FILE:distca>
                 -P ${CMAKE_CURRENT_SOURCE_DIR}/knobs/knobs.cmake)
add_test(NAME Knobs.NamesOutsideTheTableAreNamed
         COMMAND ${CMAKE_COMMAND} -DROOT=${CMAKE_CURRENT_SOURCE_DIR}/knobs/fixture
                 -DTABLE=${CMAKE_CURRENT_SOURCE_DIR}/knobs/fixture/knobs.json -P ${CMAKE_CURRENT_SOURCE_DIR}/knobs/knobs.cmake)
set_tests_properties(Knobs.NamesOutsideTheTableAreNamed PROPERTIES
  PASS_REGULAR_EXPRESSION "DISTCA_HIDDEN \\(src/reads.cc\\): an environment variable that is not in the table.*DISTCA_NOPE_ \\(src/reads.cc\\): no knob starts with it.*DISTCA_PLAIN \\(src/reads.cc\\): not in the table.*DISTCA_SCRIPT_ONLY \\(scripts/run.sh\\): an environment variable.*DISTCA_STALE: the table says C\\+\\+ uses it.*DISTCA_STALE: the table says scripts uses it.*DISTCA_UNLISTED \\(src/reads.cc\\): an environment variable.*7 problem\\(s\\)"
  FAIL_REGULAR_EXPRESSION "DISTCA_(USED|MACRO|OPTION|DEFINED|FAMILY_A?)[ :(]")
