#include "tensorstash/array/box.h"

#include <cstring>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

TEST(BoxTest, IntersectAndContains) {
  Box a({0, 2}, {4, 4}), b({2, 0}, {4, 4});
  EXPECT_EQ(Intersect(a, b), Box({2, 2}, {2, 2}));
  EXPECT_TRUE(a.Contains(Box({1, 3}, {2, 2})));
  EXPECT_FALSE(a.Contains(Box({1, 3}, {2, 4})));
  EXPECT_TRUE(Intersect(Box({0}, {2}), Box({5}, {2})).empty());
  EXPECT_EQ(Box({0, 2}, {4, 4}).ToString(), "[0:4, 2:6]");
}

TEST(BoxTest, ZeroRank) {
  Box scalar = Box::FromShape({});
  EXPECT_EQ(scalar.num_elements(), 1);
  EXPECT_TRUE(scalar.Contains(scalar));
  EXPECT_TRUE(IsContiguousIn(scalar, scalar));
  int64_t src = 42, dst = 0;
  ASSERT_TRUE(CopyBox(scalar, DType::kInt64, &src, scalar, DType::kInt64, &dst, scalar, "x").ok());
  EXPECT_EQ(dst, 42);
}

TEST(BoxTest, Contiguity) {
  Box outer({0, 0, 0}, {4, 5, 6});
  EXPECT_TRUE(IsContiguousIn(Box({1, 0, 0}, {2, 5, 6}), outer));
  EXPECT_TRUE(IsContiguousIn(Box({1, 2, 0}, {1, 2, 6}), outer));
  EXPECT_TRUE(IsContiguousIn(Box({1, 2, 1}, {1, 1, 3}), outer));
  EXPECT_FALSE(IsContiguousIn(Box({1, 2, 0}, {2, 2, 6}), outer));
  EXPECT_FALSE(IsContiguousIn(Box({0, 0, 0}, {4, 5, 3}), outer));
  EXPECT_EQ(ByteOffsetIn(Box({1, 2, 3}, {1, 1, 1}), outer, 4), ((1 * 5 + 2) * 6 + 3) * 4);
}

TEST(BoxTest, ValidateRejectsBadBoxes) {
  EXPECT_THAT(std::string(ValidateBox(Box({0}, {-1}), 4, "array 'w'").message()),
              HasSubstr("array 'w'"));
  EXPECT_FALSE(ValidateBox(Box({-1}, {1}), 4, "x").ok());
  EXPECT_FALSE(ValidateBox(Box({0}, {1, 2}), 4, "x").ok());
  EXPECT_FALSE(ValidateBox(Box::FromShape(std::vector<int64_t>(kMaxRank + 1, 1)), 4, "x").ok());
  // 2^31 * 2^31 * 4 bytes overflows int64.
  EXPECT_EQ(ValidateBox(Box::FromShape({int64_t{1} << 31, int64_t{1} << 31, 4}), 4, "x").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(CheckedNumElements({int64_t{1} << 40, int64_t{1} << 40}, "x").ok());
  EXPECT_FALSE(ValidateBox(Box({INT64_MAX}, {1}), 1, "x").ok());
  EXPECT_TRUE(ValidateBox(Box({3, 0}, {0, 7}), 8, "x").ok());
}

// CopyBox against an element-by-element reference over random boxes of random ranks.
TEST(BoxTest, CopyBoxMatchesReference) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int rank = 1 + static_cast<int>(rng() % 5);
    Box src_box, dst_box;
    for (int d = 0; d < rank; ++d) {
      src_box.origin.push_back(rng() % 4);
      src_box.shape.push_back(1 + rng() % 5);
      dst_box.origin.push_back(rng() % 4);
      dst_box.shape.push_back(1 + rng() % 5);
    }
    Box region = Intersect(src_box, dst_box);
    std::vector<int32_t> src(src_box.num_elements()), dst(dst_box.num_elements(), -1);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<int32_t>(i * 7 + 1);
    std::vector<int32_t> expected = dst;
    // Reference: walk every point of the region.
    if (!region.empty()) {
      std::vector<int64_t> p(region.origin);
      for (;;) {
        int64_t si = 0, di = 0;
        for (int d = 0; d < rank; ++d) {
          si = si * src_box.shape[d] + (p[d] - src_box.origin[d]);
          di = di * dst_box.shape[d] + (p[d] - dst_box.origin[d]);
        }
        expected[di] = src[si];
        int d = rank - 1;
        for (; d >= 0; --d) {
          if (++p[d] < region.origin[d] + region.shape[d]) break;
          p[d] = region.origin[d];
        }
        if (d < 0) break;
      }
    }
    ASSERT_TRUE(
        CopyBox(region, DType::kInt32, src.data(), src_box, DType::kInt32, dst.data(), dst_box, "x")
            .ok());
    ASSERT_EQ(dst, expected) << "trial " << trial;
    // With a cast on the way.
    std::vector<int64_t> wide(dst_box.num_elements(), -1), wide_expected(wide.size());
    for (size_t i = 0; i < wide.size(); ++i) wide_expected[i] = expected[i];
    ASSERT_TRUE(CopyBox(region, DType::kInt32, src.data(), src_box, DType::kInt64, wide.data(),
                        dst_box, "x")
                    .ok());
    ASSERT_EQ(wide, wide_expected) << "trial " << trial;
  }
}

TEST(BoxTest, CopyBoxReportsCastErrorsWithName) {
  Box box = Box::FromShape({2});
  int32_t src[2] = {1, 300};
  int8_t dst[2];
  Status status =
      CopyBox(box, DType::kInt32, src, box, DType::kInt8, dst, box, "array 'opt/count'");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("opt/count"));
}

}  // namespace
}  // namespace tensorstash
