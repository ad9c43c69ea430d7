// What `distca --version` and the configure summary say about the GPU parts (tools/build_info.h,
// CMakeLists.txt): what each kernel family is and what it was built for, no claim of what ran
// where and no date (issue 72 row 16: a CUDA build said "sm_90a validated on an NVIDIA H100 on
// 2026-11-25", of kernels that had never run on a GPU).
#include "build_info.h"

#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <sstream>
#include <string>

namespace distca::tools {
namespace {

// No "validated", no "passed", no date: what ran where is in reports/gpu/, from the runs.
void expect_no_claim(const std::string& text) {
  EXPECT_EQ(text.find("validated"), std::string::npos) << text;
  EXPECT_EQ(text.find("passed"), std::string::npos) << text;
  EXPECT_FALSE(std::regex_search(text, std::regex("20[0-9][0-9]-[0-9][0-9]-[0-9][0-9]"))) << text;
}

TEST(BuildInfo, CudaBuildNamesEachKernelFamilyAndClaimsNoValidation) {
  const std::string both = cuda_kernels_text(true, "80-real,90a-real", true);  // the default DISTCA_CUDA_ARCHS
  EXPECT_EQ(both,
            "built for 80-real,90a-real: distca's kernels (mma.sync, sm_80 and up) for each; the sm_90a kernels (TMA, wgmma) "
            "for 90a; cuDNN's fused attention; what has run on which GPU: reports/gpu/");
  expect_no_claim(both);
  EXPECT_NE(cuda_kernels_text(true, "90a", false).find("the sm_90a kernels (TMA, wgmma) for 90a"), std::string::npos);
  const std::string sm80 = cuda_kernels_text(true, "80-real", false);
  EXPECT_NE(sm80.find("the sm_90a kernels (TMA, wgmma) not built (no 90a listed)"), std::string::npos) << sm80;
  EXPECT_NE(sm80.find("cuDNN's fused attention not built"), std::string::npos) << sm80;
  expect_no_claim(sm80);
  EXPECT_EQ(cuda_kernels_text(false, "", false), "not built (no nvcc at configure time)");
  expect_no_claim(nccl_text(true));
  EXPECT_NE(nccl_text(true).find("reports/gpu/"), std::string::npos);
}

// The configure summary's CUDA and NCCL lines, as CMakeLists.txt writes them.
TEST(BuildInfo, ConfigureSummaryClaimsNoValidation) {
  std::ifstream in(std::string(DISTCA_SOURCE_DIR) + "/CMakeLists.txt");
  ASSERT_TRUE(in.good());
  int summary_lines = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.find("message(STATUS \"  CUDA attention kernels: built") == std::string::npos &&
        line.find("message(STATUS \"  NcclComm: built") == std::string::npos) {
      continue;
    }
    ++summary_lines;
    expect_no_claim(line);
    EXPECT_NE(line.find("reports/gpu/"), std::string::npos) << line;
  }
  EXPECT_EQ(summary_lines, 2);
}

}  // namespace
}  // namespace distca::tools
