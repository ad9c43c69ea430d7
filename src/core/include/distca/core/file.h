// Whole-file reads with a size limit, and atomic writes: an output file is either complete or
// absent, and nothing but a regular file (or a new one) is ever replaced.
//
// The rules every command and the Python package follow:
// - Inputs: a regular file or a pipe (FIFO, `<(...)`, /dev/stdin on a pipe), at most
//   max_input_bytes() (DISTCA_MAX_INPUT_MB, default 1024 MiB); a directory, a device or a socket
//   is refused with a message naming the path.
// - Outputs: a new file, or an existing regular file, which is replaced by a new one renamed into
//   place (a symbolic link is followed: the file it names is replaced, the link stays). A device,
//   a FIFO, a socket or a directory is refused: writing through it could not be atomic, and
//   replacing it (as `--out /dev/null` under root once did) destroys what distca did not create.
// - An output never names an input of the same run (however spelled: another relative path, a
//   symbolic link, a hard link), lies inside an input folder, or names another output.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "distca/core/status.h"

namespace distca {

// The default limit on an input file, and the environment variable that overrides it.
inline constexpr int64_t kDefaultMaxInputMiB = 1024;
inline constexpr const char* kMaxInputEnv = "DISTCA_MAX_INPUT_MB";

// The input limit in bytes: DISTCA_MAX_INPUT_MB MiB when set (a whole number 1..1048576, else
// kInvalidArgument naming the variable), else kDefaultMaxInputMiB.
Result<int64_t> max_input_bytes();

// Reads a whole file of at most max_input_bytes(): a missing file is kNotFound; a directory, a
// device, a socket, an unreadable file or one over the limit kInvalidArgument, each naming the
// path. A FIFO is read until its end (or the limit).
Result<std::string> read_text_file(const std::string& path);
Result<std::string> read_text_file(const std::string& path, int64_t max_bytes);

// Checks the input rules on a file read later by other means (a data file read line by line, at
// every epoch): it exists, is a regular file (or a FIFO where `allow_pipe`) and is within
// max_input_bytes(). Messages start with "`flag` `path`". kNotFound or kInvalidArgument.
Status check_input_file(const std::string& flag, const std::string& path, bool allow_pipe);

// Writes `text` to `path` through a new temporary file in the same folder and a rename: a failed
// write leaves no file and changes nothing. An existing target that is not a regular file is
// refused (kInvalidArgument); an existing regular file keeps its permissions. Errors name `path`.
Status write_file_atomic(const std::string& path, const std::string& text);
// The same for a file made in pieces, never held whole: `produce` passes each piece to `write` in
// order; if it fails (or a write does), no file is left and the target is unchanged.
using WriteFn = std::function<Status(std::string_view)>;
Status write_file_atomic_streamed(const std::string& path, const std::function<Status(const WriteFn&)>& produce);

// Checks, before any work starts, that `path` can be written later: not empty, not "-" (an output
// flag never means standard output by it, nor a file named "-"), not a directory, device, FIFO or
// socket (after following symbolic links), its folder exists and is writable, and an existing
// file there is writable. `flag` names the option in the message ("--json"). Nothing
// is created. kInvalidArgument on failure.
Status check_output_path(const std::string& flag, const std::string& path);

// (flag, path) pairs of a run's outputs or inputs; empty paths are skipped.
using FlagPaths = std::vector<std::pair<std::string, std::string>>;

// Checks every output with check_output_path, that no two outputs name the same file, and that
// no output names an input (the same file under another spelling, through a symbolic or hard
// link) or lies inside an input folder. kInvalidArgument naming both flags.
Status check_output_paths(const FlagPaths& outputs, const FlagPaths& inputs = {});

}  // namespace distca
