// The JSON API bodies the gs:// store parses, good and hostile.
#include "tensorstash/kvstore/gcs/gcs_json.h"

#include <chrono>
#include <string>

#include "gtest/gtest.h"

namespace tensorstash {
namespace {

TEST(GcsJsonTest, ParsesAnObjectWithInt64FieldsAsStrings) {
  Result<GcsObject> object = ParseGcsObject(
      R"({"kind":"storage#object","name":"run/a b%c\u00e9","bucket":"bkt",
          "generation":"1764400910123456","metageneration":"1","size":"10",
          "crc32c":"4waSgw==","md5Hash":"x","updated":"2026-11-29T08:21:50.123Z",
          "timeCreated":"2026-11-29T08:21:50Z","metadata":{"tensorstash-write":"n1","n":3}})",
      "reading 'k'");
  ASSERT_TRUE(object.ok()) << object.status();
  EXPECT_EQ(object->name, "run/a b%c\xc3\xa9");
  EXPECT_EQ(object->generation, "1764400910123456");
  EXPECT_EQ(object->size, 10u);
  EXPECT_EQ(object->crc32c, "4waSgw==");
  EXPECT_EQ(object->updated, "2026-11-29T08:21:50.123Z");
  EXPECT_EQ(object->metadata.at("tensorstash-write"), "n1");
  EXPECT_EQ(object->metadata.count("n"), 0u);  // not a string: ignored
  // Numbers where GCS sends strings are taken too.
  Result<GcsObject> numbers =
      ParseGcsObject(R"({"name":"k","generation":7,"size":0})", "reading 'k'");
  ASSERT_TRUE(numbers.ok()) << numbers.status();
  EXPECT_EQ(numbers->generation, "7");
}

TEST(GcsJsonTest, HostileObjectsAreDataLossNamingWhatAndTheField) {
  const char* bodies[] = {
      "",
      "not json",
      "[]",
      "null",
      R"({"name":"k","size":"10"})",                            // no generation
      R"({"name":"k","generation":"1"})",                       // no size
      R"({"name":"k","generation":"-1","size":"1"})",
      R"({"name":"k","generation":"1e3","size":"1"})",
      R"({"name":"k","generation":"9223372036854775808","size":"1"})",  // past int64
      R"({"name":"k","generation":"18446744073709551616","size":"1"})",
      R"({"name":"k","generation":"1","size":"-5"})",
      R"({"name":"k","generation":"1","size":1.5})",
      R"({"name":7,"generation":"1","size":"1"})",
      R"({"generation":"1","size":"1"})",
      R"({"name":"k","generation":"1","size":"1","metadata":[1]})",
      R"({"name":"k","generation":"1","size":"1","crc32c":5})",
      "{\"name\":\"k\",\"generation\":\"1\",\"size\":\"1\"",  // cut
  };
  for (const char* body : bodies) {
    Result<GcsObject> object = ParseGcsObject(body, "reading 'k' in gs://b");
    EXPECT_TRUE(absl::IsDataLoss(object.status())) << body << ": " << object.status();
    if (!object.ok()) {
      EXPECT_NE(object.status().message().find("reading 'k' in gs://b"), std::string_view::npos);
    }
  }
}

TEST(GcsJsonTest, ParsesListPagesAndRefusesHostileOnes) {
  Result<GcsListPage> page = ParseGcsListPage(
      R"({"kind":"storage#objects","prefixes":["a/x/"],"nextPageToken":"t2",
          "items":[{"name":"a/1","generation":"5","size":"3"}]})",
      "listing");
  ASSERT_TRUE(page.ok()) << page.status();
  ASSERT_EQ(page->items.size(), 1u);
  EXPECT_EQ(page->items[0].name, "a/1");
  EXPECT_EQ(page->prefixes, std::vector<std::string>({"a/x/"}));
  EXPECT_EQ(page->next_page_token, "t2");
  Result<GcsListPage> empty = ParseGcsListPage(R"({"kind":"storage#objects"})", "listing");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->items.empty());
  EXPECT_TRUE(empty->next_page_token.empty());
  for (const char* body : {R"({"items":{}})", R"({"items":[{"name":"a"}]})", R"({"prefixes":[1]})",
                           R"({"prefixes":"a/"})", R"({"nextPageToken":3})", "[1]", "{"}) {
    EXPECT_TRUE(absl::IsDataLoss(ParseGcsListPage(body, "listing").status())) << body;
  }
}

TEST(GcsJsonTest, ParsesErrorsAndIgnoresWhatIsNotOne) {
  GcsError error = ParseGcsError(
      R"({"error":{"code":412,"message":"At least one of the pre-conditions you specified did not hold.",
          "errors":[{"reason":"conditionNotMet","domain":"global"}]}})");
  EXPECT_EQ(error.code, 412);
  EXPECT_EQ(error.reason, "conditionNotMet");
  EXPECT_NE(error.message.find("pre-conditions"), std::string::npos);
  for (const char* body : {"", "<html>", R"({"error":"x"})", R"({"error":{"code":"412"}})",
                           R"({"error":{"code":1e30,"errors":[7]}})", "[]"}) {
    GcsError junk = ParseGcsError(body);
    EXPECT_EQ(junk.code, 0) << body;
    EXPECT_TRUE(junk.reason.empty()) << body;
  }
}

TEST(GcsJsonTest, ParsesRfc3339Times) {
  using std::chrono::system_clock;
  Result<system_clock::time_point> epoch = ParseRfc3339("1970-01-01T00:00:00Z");
  ASSERT_TRUE(epoch.ok()) << epoch.status();
  EXPECT_EQ(epoch->time_since_epoch().count(), 0);
  Result<system_clock::time_point> t = ParseRfc3339("2026-11-29T08:21:50.5Z");
  Result<system_clock::time_point> offset = ParseRfc3339("2026-11-29T09:21:50.500+01:00");
  ASSERT_TRUE(t.ok() && offset.ok());
  EXPECT_EQ(*t, *offset);
  EXPECT_EQ(std::chrono::duration_cast<std::chrono::milliseconds>(t->time_since_epoch()).count(),
            1795940510500);
  for (const char* bad : {"", "2026-11-29", "2026-13-01T00:00:00Z", "2026-02-30T00:00:00Z",
                          "2026-11-29T08:21:50", "2026-11-29T08:21:50.Z", "2026-11-29 08:21:50Z",
                          "2026-11-29T08:21:50Zjunk", "2026-11-29T-1:21:50Z",
                          "2026-11-29T08:21:50+-1:00", "+026-11-29T08:21:50Z"}) {
    EXPECT_FALSE(ParseRfc3339(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace tensorstash
