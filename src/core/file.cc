#include "distca/core/file.h"

#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <sstream>

namespace distca {

Status write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return internal_error(fmt::format("{}: cannot open for writing", tmp));
    out << text;
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      return internal_error(fmt::format("{}: write failed", tmp));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return internal_error(fmt::format("{}: cannot rename into place", path));
  }
  return Status::ok();
}

Result<std::string> read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found(fmt::format("{}: cannot open file", path));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace distca
