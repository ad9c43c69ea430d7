#include "distca/core/file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <new>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>

#include "distca/core/knobs.h"

namespace distca {

namespace fs = std::filesystem;

namespace {

// What a non-regular file is, for messages.
const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

constexpr const char* kNotReplaced =
    "distca writes an output as a new file renamed into place and replaces only regular files";

// The file a path names once symbolic links are followed (the path itself when it is not a link;
// a dangling link gives the path it points to).
Result<fs::path> resolve_links(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return fs::path(path);
  std::error_code ec;
  fs::path target = fs::weakly_canonical(fs::absolute(path), ec);
  if (ec) return invalid_argument(fmt::format("{}: cannot follow the symbolic link ({})", path, ec.message()));
  return target;
}

// The file's identity where it exists.
struct Identity {
  bool exists = false;
  bool is_dir = false;
  dev_t dev = 0;
  ino_t ino = 0;
  fs::path canonical;
};

Identity identify(const std::string& path) {
  Identity id;
  std::error_code ec;
  id.canonical = fs::weakly_canonical(fs::absolute(path), ec);
  if (ec) id.canonical = fs::absolute(path).lexically_normal();
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) {
    id.exists = true;
    id.is_dir = S_ISDIR(st.st_mode);
    id.dev = st.st_dev;
    id.ino = st.st_ino;
  }
  return id;
}

bool same_file(const Identity& a, const Identity& b) {
  if (a.exists && b.exists) return a.dev == b.dev && a.ino == b.ino;
  return a.canonical == b.canonical;
}

// Whether `inner` lies inside the folder `outer` (component by component).
bool is_inside(const fs::path& inner, const fs::path& outer) {
  auto i = inner.begin();
  for (auto o = outer.begin(); o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == inner.end() || *i != *o) return false;
  }
  return i != inner.end();
}

std::string mib(int64_t bytes) { return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20)); }

std::string too_large(const std::string& path, const std::string& size, int64_t limit) {
  return fmt::format("{}: too large ({}; an input may have at most {} MiB: set {} to raise the limit)", path, size,
                     limit >> 20, kMaxInputEnv);
}

}  // namespace

Result<int64_t> max_input_bytes() {
  const char* env = knob(kMaxInputEnv);
  if (env == nullptr || *env == '\0') return kDefaultMaxInputMiB << 20;
  const std::string text(env);
  int64_t value = 0;
  const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (err != std::errc() || end != text.data() + text.size() || value < 1 || value > (int64_t{1} << 20)) {
    return invalid_argument(fmt::format("{}={:.40}: expected a whole number of MiB in 1..1048576", kMaxInputEnv, text));
  }
  return value << 20;
}

Result<std::string> read_text_file(const std::string& path) {
  DISTCA_ASSIGN_OR_RETURN(const int64_t limit, max_input_bytes());
  return read_text_file(path, limit);
}

namespace {

// The input rules on `path` (see file.h); `what` starts every message ("--data x.jsonl" or the path).
Result<struct stat> check_input(const std::string& what, const std::string& path, int64_t max_bytes, bool allow_pipe) {
  if (path.empty()) return invalid_argument(fmt::format("{}: an empty file name", what));
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) return not_found(fmt::format("{}: no such file", what));
    return invalid_argument(fmt::format("{}: cannot open file ({})", what, std::strerror(err)));
  }
  if (S_ISDIR(st.st_mode)) return invalid_argument(fmt::format("{}: is a directory, expected a file", what));
  if (S_ISFIFO(st.st_mode) && !allow_pipe) {
    return invalid_argument(fmt::format("{}: is a FIFO (named pipe); this input is read more than once, so it must be "
                                        "a regular file",
                                        what));
  }
  if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode)) {
    return invalid_argument(fmt::format("{}: is {}, not a file (inputs are regular files{})", what,
                                        kind_of(st.st_mode), allow_pipe ? " or pipes" : ""));
  }
  if (S_ISREG(st.st_mode) && st.st_size > max_bytes) return invalid_argument(too_large(what, mib(st.st_size), max_bytes));
  return st;
}

}  // namespace

Status check_input_file(const std::string& flag, const std::string& path, bool allow_pipe) {
  DISTCA_ASSIGN_OR_RETURN(const int64_t limit, max_input_bytes());
  return check_input(flag.empty() ? path : fmt::format("{} {}", flag, path), path, limit, allow_pipe).status();
}

Result<std::string> read_text_file(const std::string& path, int64_t max_bytes) {
  DISTCA_ASSIGN_OR_RETURN(const struct stat st, check_input(path, path, max_bytes, /*allow_pipe=*/true));
  // O_NONBLOCK: opening a FIFO that no process writes to returns at once (and reads as empty)
  // instead of waiting forever; reads block again once it is open.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return invalid_argument(fmt::format("{}: cannot open file ({})", path, std::strerror(errno)));
  if (const int flags = ::fcntl(fd, F_GETFL); flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd);
    return invalid_argument(fmt::format("{}: cannot read file ({})", path, std::strerror(err)));
  }
  std::string text;
  if (S_ISREG(st.st_mode)) text.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return invalid_argument(fmt::format("{}: read failed ({})", path, std::strerror(err)));
    }
    if (n == 0) break;
    if (static_cast<int64_t>(text.size()) + n > max_bytes) {
      ::close(fd);
      return invalid_argument(too_large(path, fmt::format("more than {} MiB", max_bytes >> 20), max_bytes));
    }
    // Grow by doubling, but never past the limit: a stream at the limit holds at most max_bytes.
    // A doubling that would land over half the limit goes to the limit at once, so that the
    // last growth is never from just under the limit to it (briefly holding twice the limit).
    if (text.size() + static_cast<size_t>(n) > text.capacity()) {
      int64_t next = 2 * static_cast<int64_t>(text.capacity()) + n;
      if (2 * next > max_bytes) next = max_bytes;
      try {
        text.reserve(static_cast<size_t>(next));
      } catch (const std::bad_alloc&) {
        ::close(fd);
        return invalid_argument(fmt::format("{}: out of memory after reading {} (lower {} or free memory)", path,
                                            mib(static_cast<int64_t>(text.size())), kMaxInputEnv));
      }
    }
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return text;
}

Status write_file_atomic_streamed(const std::string& path, const std::function<Status(const WriteFn&)>& produce) {
  if (path.empty()) return invalid_argument("an output needs a file name");
  DISTCA_ASSIGN_OR_RETURN(const fs::path target, resolve_links(path));
  std::optional<mode_t> keep_mode;
  struct stat st;
  if (::stat(target.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) {
      return invalid_argument(fmt::format("{}: is {}, not a regular file; {}", path, kind_of(st.st_mode), kNotReplaced));
    }
    keep_mode = st.st_mode & 07777;
  }
  // A new, uniquely named file beside the target (never one that exists: O_EXCL).
  static std::atomic<uint64_t> serial{0};
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string tmp =
      (dir / fmt::format(".{}.distca-{}-{}.tmp", target.filename().string(), ::getpid(), serial++)).string();
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) return internal_error(fmt::format("{}: cannot open for writing ({})", path, std::strerror(errno)));
  auto fail = [&](const char* what, int err) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return internal_error(fmt::format("{}: {} ({})", path, what, std::strerror(err)));
  };
  int write_error = 0;
  const WriteFn write = [&](std::string_view text) {
    for (size_t done = 0; done < text.size();) {
      const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        write_error = errno;
        return internal_error("write failed");
      }
      done += static_cast<size_t>(n);
    }
    return Status::ok();
  };
  if (Status produced = produce(write); !produced.is_ok()) {
    if (write_error != 0) return fail("write failed", write_error);
    ::close(fd);
    ::unlink(tmp.c_str());
    return produced;
  }
  if (keep_mode && ::fchmod(fd, *keep_mode) != 0) return fail("cannot keep the file's permissions", errno);
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return internal_error(fmt::format("{}: write failed ({})", path, std::strerror(err)));
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return internal_error(fmt::format("{}: cannot rename into place ({})", path, std::strerror(err)));
  }
  return Status::ok();
}

Status write_file_atomic(const std::string& path, const std::string& text) {
  return write_file_atomic_streamed(path, [&](const WriteFn& write) { return write(text); });
}

Status check_output_path(const std::string& flag, const std::string& path) {
  if (path.empty()) return invalid_argument(fmt::format("{} needs a file name", flag));
  // "-" is not standard output: an output flag names a file (replaced atomically), and a file
  // named "-" is never what was meant. --json-out's report has --json for stdout, where the table
  // would otherwise go too.
  if (path == "-") {
    return invalid_argument(
        flag == "--json-out"
            ? std::string("--json-out -: '-' is not standard output here: --json prints the JSON report on stdout "
                          "(in place of the table); give --json-out a file name")
            : fmt::format("{} -: '-' is not standard output here (it would write a file named '-'); give a file name",
                          flag));
  }
  Result<fs::path> resolved = resolve_links(path);
  if (!resolved.is_ok()) return invalid_argument(fmt::format("{} {}", flag, resolved.status().message()));
  const fs::path p = resolved.value();
  struct stat st;
  const bool exists = ::stat(p.c_str(), &st) == 0;
  if (exists && S_ISDIR(st.st_mode)) {
    return invalid_argument(fmt::format("{} {}: is a directory; give a file name", flag, path));
  }
  if (exists && !S_ISREG(st.st_mode)) {
    return invalid_argument(fmt::format("{} {}: is {}, not a regular file; {}", flag, path, kind_of(st.st_mode),
                                        kNotReplaced));
  }
  std::error_code ec;
  fs::path dir = p.parent_path();
  if (dir.empty()) dir = ".";
  if (!fs::exists(dir, ec)) {
    return invalid_argument(fmt::format("{} {}: the folder {} does not exist (create it first)", flag, path, dir.string()));
  }
  if (!fs::is_directory(dir, ec)) {
    return invalid_argument(fmt::format("{} {}: {} is not a folder", flag, path, dir.string()));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return invalid_argument(fmt::format("{} {}: the folder {} is not writable", flag, path, dir.string()));
  }
  if (exists && ::access(p.c_str(), W_OK) != 0) {
    return invalid_argument(fmt::format("{} {}: the file exists and is not writable", flag, path));
  }
  return Status::ok();
}

Status check_output_paths(const FlagPaths& outputs, const FlagPaths& inputs) {
  struct Seen {
    std::string flag, path;
    Identity id;
  };
  std::vector<Seen> seen;
  for (const auto& [flag, path] : outputs) {
    if (path.empty()) continue;
    DISTCA_RETURN_IF_ERROR(check_output_path(flag, path));
    const Identity id = identify(path);
    for (const Seen& other : seen) {
      if (same_file(id, other.id)) {
        return invalid_argument(fmt::format("{} and {} name the same file ({}); give each output its own path", other.flag,
                                            flag, path));
      }
    }
    seen.push_back({flag, path, id});
  }
  for (const auto& [in_flag, in_path] : inputs) {
    if (in_path.empty()) continue;
    const Identity in = identify(in_path);
    for (const Seen& out : seen) {
      if (same_file(out.id, in)) {
        return invalid_argument(fmt::format("{} {} names the same file as {} {}: an output never replaces an input of "
                                            "the same run; give the output another path",
                                            out.flag, out.path, in_flag, in_path));
      }
      if (in.is_dir && is_inside(out.id.canonical, in.canonical)) {
        return invalid_argument(fmt::format("{} {} lies inside the folder {} {} reads; write it elsewhere", out.flag,
                                            out.path, in_flag, in_path));
      }
    }
  }
  return Status::ok();
}

}  // namespace distca
