// The S3 request signer against signatures computed elsewhere: AWS's published example of a
// signed S3 GET ("Signature Calculations for the Authorization Header", examplebucket), and
// requests signed by botocore's S3SigV4Auth (an independent implementation) with keys and query
// parameters that trip up other signers: spaces, '+', a literal "%2F", '=', '&', non-ASCII,
// parameters out of order and without a value, and a session token.
#include "tensorstash/kvstore/s3/sigv4.h"

#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

const std::string kEmptySha256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

std::map<std::string, std::string> Sign(const SigV4Request& request,
                                        const AwsCredentials& credentials, std::string_view region,
                                        std::string_view date) {
  Result<std::vector<std::pair<std::string, std::string>>> headers =
      SignV4(request, credentials, region, date);
  EXPECT_TRUE(headers.ok()) << headers.status();
  std::map<std::string, std::string> out;
  if (headers.ok()) out.insert(headers->begin(), headers->end());
  return out;
}

TEST(SigV4Test, AwsPublishedS3GetExample) {
  SigV4Request request;
  request.method = "GET";
  request.path = "/test.txt";
  request.headers = {{"Host", "examplebucket.s3.amazonaws.com"}, {"Range", "bytes=0-9"}};
  request.payload_sha256 = kEmptySha256;
  std::map<std::string, std::string> headers =
      Sign(request, {"AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", ""},
           "us-east-1", "20130524T000000Z");
  EXPECT_EQ(headers["authorization"],
            "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
            "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
            "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
  EXPECT_EQ(headers["x-amz-date"], "20130524T000000Z");
  EXPECT_EQ(headers["x-amz-content-sha256"], kEmptySha256);
  EXPECT_EQ(headers.count("x-amz-security-token"), 0u);
}

TEST(SigV4Test, AwkwardKeysAndQueryParametersAsBotocoreSignsThem) {
  SigV4Request request;
  request.method = "GET";
  request.path = "/bucket/dir/a b+c%2Fd=e&f\xc3\xa9.txt";
  request.query = {{"list-type", "2"}, {"uploads", ""}, {"prefix", "x y/z"}, {"a", "b"}};
  request.headers = {{"Host", "127.0.0.1:8333"}, {"Range", "bytes=0-9"}};
  request.payload_sha256 = kEmptySha256;
  const AwsCredentials credentials{"AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", ""};
  std::map<std::string, std::string> headers =
      Sign(request, credentials, "us-east-1", "20240102T030405Z");
  EXPECT_EQ(headers["authorization"],
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20240102/us-east-1/s3/aws4_request, "
            "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
            "Signature=a7ecc212972be184e8113be50278daf8ad3a076d05e190f4d5306493977ecf73");
  // What the URL must carry for that signature to match.
  EXPECT_EQ(AwsUriEncode(request.path, false), "/bucket/dir/a%20b%2Bc%252Fd%3De%26f%C3%A9.txt");
  EXPECT_EQ(CanonicalQueryString(request.query), "a=b&list-type=2&prefix=x%20y%2Fz&uploads=");
}

TEST(SigV4Test, ASessionTokenIsSentAndSigned) {
  SigV4Request request;
  request.method = "PUT";
  request.path = "/bucket/step/COMMIT";
  request.headers = {
      {"Host", "s3.eu-west-1.amazonaws.com"}, {"If-None-Match", "*"}, {"Content-Length", "5"}};
  request.payload_sha256 = kEmptySha256;
  std::map<std::string, std::string> headers =
      Sign(request, {"AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "SESSION/TOKEN+1"},
           "eu-west-1", "20241124T120000Z");
  EXPECT_EQ(headers["x-amz-security-token"], "SESSION/TOKEN+1");
  EXPECT_EQ(headers["authorization"],
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20241124/eu-west-1/s3/aws4_request, "
            "SignedHeaders=content-length;host;if-none-match;x-amz-content-sha256;x-amz-date;"
            "x-amz-security-token, "
            "Signature=c9bc69f2dccaeb7938be70aa5f2633875c317a6d52813ebff659189001e5f3ba");
}

TEST(SigV4Test, CanonicalRequestTrimsSortsAndMergesHeaders) {
  SigV4Request request;
  request.method = "PUT";
  request.path = "/b/k~1";
  request.headers = {{"X-Amz-Meta-A", "  two   words  "}, {"host", "h"}, {"x-amz-meta-a", "again"}};
  EXPECT_EQ(CanonicalRequest(request, "20240101T000000Z"),
            "PUT\n/b/k~1\n\nhost:h\nx-amz-meta-a:two words,again\n\nhost;x-amz-meta-a\n"
            "UNSIGNED-PAYLOAD");
}

TEST(SigV4Test, BadDatesAndMissingCredentialsAreRefused) {
  SigV4Request request;
  request.method = "GET";
  request.path = "/";
  request.headers = {{"host", "h"}};
  const AwsCredentials credentials{"A", "S", ""};
  for (const char* date : {"", "2024-01-01T00:00:00Z", "20240101T000000", "2024010xT000000Z"}) {
    Result<std::vector<std::pair<std::string, std::string>>> signed_headers =
        SignV4(request, credentials, "us-east-1", date);
    EXPECT_TRUE(absl::IsInvalidArgument(signed_headers.status())) << date;
  }
  Result<std::vector<std::pair<std::string, std::string>>> anonymous =
      SignV4(request, AwsCredentials{}, "us-east-1", "20240101T000000Z");
  EXPECT_TRUE(absl::IsInvalidArgument(anonymous.status()));
  EXPECT_THAT(anonymous.status().message(), HasSubstr("secret access key"));
  EXPECT_EQ(AmzDateNow().size(), 16u);
}

TEST(SigV4Test, UriEncodingKeepsOnlyUnreservedCharacters) {
  EXPECT_EQ(AwsUriEncode("aZ09-_.~/", false), "aZ09-_.~/");
  EXPECT_EQ(AwsUriEncode("aZ09-_.~/", true), "aZ09-_.~%2F");
  EXPECT_EQ(AwsUriEncode(" +*%=&?#\x01\xff", false), "%20%2B%2A%25%3D%26%3F%23%01%FF");
  EXPECT_EQ(Sha256Hex(""), kEmptySha256);
}

}  // namespace
}  // namespace tensorstash
