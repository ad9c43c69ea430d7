#include "distca/core/tensor.h"

#include <gtest/gtest.h>

#include <vector>

namespace distca {
namespace {

TEST(DType, SizesAndNamesRoundTrip) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kI64), 8u);
  for (DType d : {DType::kF32, DType::kF64, DType::kBF16, DType::kF16, DType::kI32, DType::kI64}) {
    EXPECT_EQ(dtype_from_name(dtype_name(d)).value(), d);
  }
  EXPECT_FALSE(dtype_from_name("fp8").is_ok());
}

TEST(TensorView, ContiguousThdViewAddressesRows) {
  std::vector<float> data(5 * 3 * 4);  // [T=5, H=3, D=4]
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(i);
  TensorView v = TensorView::contiguous(data.data(), DType::kF32, {5, 3, 4});
  EXPECT_EQ(v.num_elements(), 60);
  EXPECT_EQ(v.num_bytes(), 240u);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.offset({2, 1, 3}), 2 * 12 + 1 * 4 + 3);
  TensorView rows = v.slice_rows(2, 4);
  EXPECT_EQ(rows.shape[0], 2);
  EXPECT_EQ(rows.as<float>()[0], 24.0f);
  EXPECT_EQ(rows.as<float>()[rows.offset({1, 2, 0})], static_cast<float>(3 * 12 + 2 * 4));
}

TEST(TensorViewDeathTest, OutOfRangeIndexAborts) {
  std::vector<float> data(6);
  TensorView v = TensorView::contiguous(data.data(), DType::kF32, {2, 3});
  EXPECT_DEATH((void)v.offset({2, 0}), "outside dim 0");
  EXPECT_DEATH((void)v.slice_rows(1, 3), "outside");
}

}  // namespace
}  // namespace distca
