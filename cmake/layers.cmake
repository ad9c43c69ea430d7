# distca_add_layer(NAME SOURCES ... DEPS ...)
# Defines library target distca_NAME whose public include root is src/NAME/include (headers are
# included as "distca/NAME/x.h"). DEPS are lower layers; they are the only other include roots
# the layer sees, which is what makes an upward include fail to compile.
function(distca_add_layer name)
  cmake_parse_arguments(L "" "" "SOURCES;DEPS" ${ARGN})
  add_library(distca_${name} STATIC ${L_SOURCES})
  target_include_directories(distca_${name} PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/include)
  target_link_libraries(distca_${name} PUBLIC ${L_DEPS})
endfunction()
