// Whole-file reads and atomic writes: an output file is either complete or absent.
#pragma once

#include <string>

#include "distca/core/status.h"

namespace distca {

Result<std::string> read_text_file(const std::string& path);
// Writes `text` to `path` through a temporary file and a rename: a failed write leaves no file.
Status write_file_atomic(const std::string& path, const std::string& text);

}  // namespace distca
