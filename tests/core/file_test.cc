#include "distca/core/file.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace distca {
namespace {

TEST(File, AtomicWriteThenReadBack) {
  const auto dir = std::filesystem::temp_directory_path() / "distca_file_test";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "a.txt").string();
  ASSERT_TRUE(write_file_atomic(path, "hello\n").is_ok());
  EXPECT_EQ(read_text_file(path).value(), "hello\n");
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  std::filesystem::remove_all(dir);
}

TEST(File, MissingFileAndUnwritableDirectoryAreErrors) {
  EXPECT_EQ(read_text_file("/nonexistent/x.json").status().code(), StatusCode::kNotFound);
  Status s = write_file_atomic("/nonexistent/dir/x.json", "x");
  EXPECT_FALSE(s.is_ok());
  EXPECT_FALSE(std::filesystem::exists("/nonexistent/dir/x.json"));
}

}  // namespace
}  // namespace distca
