// Whole-file reads and atomic writes: an output file is either complete or absent.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "distca/core/status.h"

namespace distca {

// Reads a whole file; a missing file is kNotFound, a directory or an unreadable file
// kInvalidArgument, each naming the path.
Result<std::string> read_text_file(const std::string& path);
// Writes `text` to `path` through a temporary file and a rename: a failed write leaves no file.
// Errors name `path` (the temporary file is an implementation detail).
Status write_file_atomic(const std::string& path, const std::string& text);

// Checks, before any work starts, that `path` can be written later: not empty, not a directory,
// its folder exists and is writable, and an existing file there is writable. `flag` names the
// option in the message ("--json"). Nothing is created. kInvalidArgument on failure.
Status check_output_path(const std::string& flag, const std::string& path);
// Checks every (flag, path) pair with check_output_path and that no two name the same file
// (after resolving "." and ".." and symlinks of the folder). Empty paths are skipped.
Status check_output_paths(const std::vector<std::pair<std::string, std::string>>& outputs);

}  // namespace distca
