#include "distca/core/file.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <iterator>

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

// A file written in pieces is the pieces in order; a producer that fails leaves the old file
// as it was and no temporary file beside it.
TEST(File, StreamedWriteIsAllThePiecesOrNothing) {
  const auto dir = std::filesystem::temp_directory_path() / "distca_file_test_streamed";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "a.txt").string();
  ASSERT_TRUE(write_file_atomic_streamed(path, [](const WriteFn& write) {
                for (const char* piece : {"one ", "two ", "three\n"}) DISTCA_RETURN_IF_ERROR(write(piece));
                return Status::ok();
              }).is_ok());
  EXPECT_EQ(read_text_file(path).value(), "one two three\n");
  const Status failed = write_file_atomic_streamed(path, [](const WriteFn& write) {
    DISTCA_RETURN_IF_ERROR(write("half"));
    return internal_error("the producer failed");
  });
  EXPECT_EQ(failed.message(), "the producer failed");
  EXPECT_EQ(read_text_file(path).value(), "one two three\n");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator()), 1);
  std::filesystem::remove_all(dir);
}

TEST(File, MissingFileAndUnwritableDirectoryAreErrors) {
  EXPECT_EQ(read_text_file("/nonexistent/x.json").status().code(), StatusCode::kNotFound);
  Status s = write_file_atomic("/nonexistent/dir/x.json", "x");
  EXPECT_FALSE(s.is_ok());
  EXPECT_FALSE(std::filesystem::exists("/nonexistent/dir/x.json"));
  // The message names the path the caller gave, not the temporary file.
  EXPECT_NE(s.message().find("/nonexistent/dir/x.json:"), std::string::npos) << s.message();
  EXPECT_EQ(s.message().find(".tmp"), std::string::npos) << s.message();
}

TEST(File, ADirectoryIsNotAFile) {
  Result<std::string> r = read_text_file(std::filesystem::temp_directory_path().string());
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("is a directory"), std::string::npos) << r.status().message();
}

TEST(File, OutputPathsAreCheckedBeforeAnyWork) {
  const auto dir = std::filesystem::temp_directory_path() / "distca_file_test_out";
  std::filesystem::create_directories(dir);
  const std::string good = (dir / "x.json").string();
  EXPECT_TRUE(check_output_path("--json", good).is_ok());
  EXPECT_FALSE(std::filesystem::exists(good)) << "the check creates nothing";
  Status missing = check_output_path("--json", "/nonexistent/x.json");
  EXPECT_EQ(missing.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.message().find("--json /nonexistent/x.json"), std::string::npos) << missing.message();
  EXPECT_NE(missing.message().find("does not exist"), std::string::npos) << missing.message();
  EXPECT_FALSE(check_output_path("--out", dir.string()).is_ok()) << "a directory is not a file";
  EXPECT_FALSE(check_output_path("--out", "").is_ok());
  EXPECT_TRUE(check_output_path("--out", "relative-name.json").is_ok()) << "a bare name is in the current folder";
  // Two outputs on one file, spelled differently, are refused; distinct files pass.
  const std::string other = (dir / "sub" / ".." / "x.json").string();
  std::filesystem::create_directories(dir / "sub");
  Status same = check_output_paths({{"--json", good}, {"--checkpoint", other}});
  EXPECT_EQ(same.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(same.message().find("same file"), std::string::npos) << same.message();
  EXPECT_TRUE(check_output_paths({{"--json", good}, {"--checkpoint", (dir / "ck.bin").string()}, {"--plot", ""}}).is_ok());
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace distca
