// GoogleTest assertions on Status and Result: TS_ASSERT_OK(expr), TS_EXPECT_OK(expr). On failure
// the message shows the status (code and text).
#ifndef TENSORSTASH_TESTING_STATUS_TEST_MACROS_H_
#define TENSORSTASH_TESTING_STATUS_TEST_MACROS_H_

#include "gtest/gtest.h"
#include "tensorstash/util/status.h"

#ifndef TS_ASSERT_OK
#define TS_ASSERT_OK(expr) ASSERT_EQ(::absl::OkStatus(), (expr))
#endif
#ifndef TS_EXPECT_OK
#define TS_EXPECT_OK(expr) EXPECT_EQ(::absl::OkStatus(), (expr))
#endif

#endif  // TENSORSTASH_TESTING_STATUS_TEST_MACROS_H_
