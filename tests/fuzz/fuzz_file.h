// A scratch file for the fuzz targets of path-based parsers (load_doc_lengths, load_checkpoint,
// open_jsonl_source): one per process, rewritten with every input, removed at exit. It lives in
// $TMPDIR when that is set, else in /dev/shm (memory: no disk writes at thousands of inputs per
// second), else in /tmp.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <sys/stat.h>

namespace distca::fuzz {

namespace detail {
// A plain array, not a std::string: the atexit handler runs after static objects are destroyed.
inline char scratch_path[4096];
inline void remove_scratch_file() { unlink(scratch_path); }
}  // namespace detail

// Writes `data` to this process's scratch file (named after `target`, ending in `suffix`) and
// returns its path. Aborts when the file cannot be written: every later input would test nothing.
inline std::string write_scratch_file(const char* target, const char* suffix, const uint8_t* data, size_t size) {
  if (detail::scratch_path[0] == '\0') {
    const char* dir = std::getenv("TMPDIR");
    struct stat st {};
    if (dir == nullptr || dir[0] == '\0') dir = stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) ? "/dev/shm" : "/tmp";
    std::snprintf(detail::scratch_path, sizeof(detail::scratch_path), "%s/distca-fuzz-%s-%ld%s", dir, target,
                  static_cast<long>(getpid()), suffix);
    std::atexit(detail::remove_scratch_file);
  }
  FILE* f = std::fopen(detail::scratch_path, "wb");
  bool is_written = f != nullptr && (size == 0 || std::fwrite(data, 1, size, f) == size);
  if (f != nullptr) is_written = std::fclose(f) == 0 && is_written;
  if (!is_written) {
    std::fprintf(stderr, "fuzz: cannot write the scratch file %s\n", detail::scratch_path);
    std::abort();
  }
  return detail::scratch_path;
}

// Aborts with a message when a parser breaks its own contract (a value it returned as valid is
// not): libFuzzer reports it as a crash, with the input that caused it.
inline void require(bool cond, const char* what) {
  if (!cond) {
    std::fprintf(stderr, "fuzz: contract broken: %s\n", what);
    std::abort();
  }
}

}  // namespace distca::fuzz
