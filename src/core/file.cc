#include "distca/core/file.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace distca {

namespace fs = std::filesystem;

Status write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return internal_error(fmt::format("{}: cannot open for writing ({})", path, std::strerror(errno)));
    out << text;
    out.flush();
    if (!out) {
      const int err = errno;
      std::remove(tmp.c_str());
      return internal_error(fmt::format("{}: write failed ({})", path, std::strerror(err)));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return internal_error(fmt::format("{}: cannot rename into place ({})", path, std::strerror(err)));
  }
  return Status::ok();
}

Result<std::string> read_text_file(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    return invalid_argument(fmt::format("{}: is a directory, expected a file", path));
  }
  if (!fs::exists(path, ec)) return not_found(fmt::format("{}: no such file", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) return invalid_argument(fmt::format("{}: cannot open file ({})", path, std::strerror(errno)));
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return invalid_argument(fmt::format("{}: read failed", path));
  return text.str();
}

Status check_output_path(const std::string& flag, const std::string& path) {
  if (path.empty()) return invalid_argument(fmt::format("{} needs a file name", flag));
  std::error_code ec;
  const fs::path p(path);
  if (fs::is_directory(p, ec)) {
    return invalid_argument(fmt::format("{} {}: is a directory; give a file name", flag, path));
  }
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
  if (fs::exists(p, ec) && ::access(p.c_str(), W_OK) != 0) {
    return invalid_argument(fmt::format("{} {}: the file exists and is not writable", flag, path));
  }
  return Status::ok();
}

Status check_output_paths(const std::vector<std::pair<std::string, std::string>>& outputs) {
  std::vector<std::pair<std::string, fs::path>> seen;
  for (const auto& [flag, path] : outputs) {
    if (path.empty()) continue;
    DISTCA_RETURN_IF_ERROR(check_output_path(flag, path));
    std::error_code ec;
    fs::path canonical = fs::weakly_canonical(fs::absolute(path), ec);
    if (ec) canonical = fs::absolute(path).lexically_normal();
    for (const auto& [other_flag, other] : seen) {
      if (other == canonical) {
        return invalid_argument(fmt::format("{} and {} name the same file ({}); give each output its own path", other_flag,
                                            flag, path));
      }
    }
    seen.emplace_back(flag, canonical);
  }
  return Status::ok();
}

}  // namespace distca
