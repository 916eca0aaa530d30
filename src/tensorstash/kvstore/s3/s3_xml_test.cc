// The S3 XML parsers on bodies as AWS S3 documents them and as SeaweedFS, moto and MinIO send
// them (namespaced roots, url encoding-type listings, empty listings, errors in 200 answers), on
// broken and hostile input, and the CompleteMultipartUpload body read back by expat.
#include "tensorstash/kvstore/s3/s3_xml.h"

#include <expat.h>

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/testing/status_test_macros.h"

namespace tensorstash {
namespace {

using ::testing::HasSubstr;

constexpr char kWhere[] = "listing of bucket 'ckpt'";

TEST(S3XmlTest, ListObjectsV2AwsBody) {
  const std::string xml = R"(<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
  <Name>ckpt</Name>
  <Prefix>run1/</Prefix>
  <KeyCount>4</KeyCount>
  <MaxKeys>4</MaxKeys>
  <Delimiter>/</Delimiter>
  <IsTruncated>true</IsTruncated>
  <Contents>
    <Key>run1/COMMIT</Key>
    <LastModified>2024-01-02T03:04:05.000Z</LastModified>
    <ETag>"9b2cf535f27731c974343645a3985328"</ETag>
    <ChecksumAlgorithm>CRC32</ChecksumAlgorithm>
    <Size>17</Size>
    <Owner><ID>75aa57f09aa0c8caeab4f8c24e99d10f8e7faeebf76c078efc7c6caea54ba06a</ID></Owner>
    <StorageClass>STANDARD</StorageClass>
  </Contents>
  <Contents>
    <Key>run1/manifest.json</Key>
    <LastModified>2024-01-02T03:04:06.000Z</LastModified>
    <ETag>"d41d8cd98f00b204e9800998ecf8427e-3"</ETag>
    <Size>18446744073709551615</Size>
    <StorageClass>STANDARD</StorageClass>
  </Contents>
  <CommonPrefixes><Prefix>run1/arrays/</Prefix></CommonPrefixes>
  <CommonPrefixes><Prefix>run1/meta/</Prefix></CommonPrefixes>
  <ContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</ContinuationToken>
  <NextContinuationToken>1w41l63U0xa8q7smH50vCxyTQqdxo69O3EmK28Bi5PcROI4wI/EyIJg==</NextContinuationToken>
  <StartAfter>run1/A</StartAfter>
</ListBucketResult>)";
  Result<S3ListPage> page = ParseListObjectsV2(xml, kWhere);
  TS_ASSERT_OK(page.status());
  ASSERT_EQ(page->objects.size(), 2u);
  EXPECT_EQ(page->objects[0].key, "run1/COMMIT");
  EXPECT_EQ(page->objects[0].size, 17u);
  EXPECT_EQ(page->objects[0].etag, "\"9b2cf535f27731c974343645a3985328\"");
  EXPECT_EQ(page->objects[1].key, "run1/manifest.json");
  EXPECT_EQ(page->objects[1].size, 18446744073709551615u);
  EXPECT_EQ(page->objects[1].etag, "\"d41d8cd98f00b204e9800998ecf8427e-3\"");
  EXPECT_EQ(page->common_prefixes, (std::vector<std::string>{"run1/arrays/", "run1/meta/"}));
  EXPECT_TRUE(page->truncated);
  EXPECT_EQ(page->next_continuation_token,
            "1w41l63U0xa8q7smH50vCxyTQqdxo69O3EmK28Bi5PcROI4wI/EyIJg==");
}

TEST(S3XmlTest, ListObjectsV2NamespacePrefixesAndEntities) {
  // A prefixed namespace, an entity and a CDATA section in keys.
  const std::string xml =
      "<s3:ListBucketResult xmlns:s3=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
      "<s3:IsTruncated>false</s3:IsTruncated>"
      "<s3:Contents><s3:Key>a&amp;b&lt;c</s3:Key><s3:Size>0</s3:Size></s3:Contents>"
      "<s3:Contents><s3:Key><![CDATA[x<y]]></s3:Key><s3:Size> 5 </s3:Size></s3:Contents>"
      "</s3:ListBucketResult>";
  Result<S3ListPage> page = ParseListObjectsV2(xml, kWhere);
  TS_ASSERT_OK(page.status());
  ASSERT_EQ(page->objects.size(), 2u);
  EXPECT_EQ(page->objects[0].key, "a&b<c");
  EXPECT_EQ(page->objects[0].size, 0u);
  EXPECT_EQ(page->objects[0].etag, "");
  EXPECT_EQ(page->objects[1].key, "x<y");
  EXPECT_EQ(page->objects[1].size, 5u);
  EXPECT_FALSE(page->truncated);
  EXPECT_EQ(page->next_continuation_token, "");
}

TEST(S3XmlTest, ListObjectsV2UrlEncodingType) {
  // As AWS sends it: EncodingType after the Contents, keys and prefixes encoded, the start-after
  // and the token not.
  const std::string xml = R"(<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
<Name>ckpt</Name><Prefix>d%2B</Prefix><KeyCount>4</KeyCount><MaxKeys>1000</MaxKeys>
<Delimiter>%2F</Delimiter><IsTruncated>false</IsTruncated>
<Contents><Key>a%20b</Key><Size>1</Size><ETag>"e1"</ETag></Contents>
<Contents><Key>x+y</Key><Size>2</Size></Contents>
<Contents><Key>p%2Fq%2fr</Key><Size>3</Size></Contents>
<Contents><Key>caf%C3%A9/%E6%97%A5%2B</Key><Size>4</Size></Contents>
<CommonPrefixes><Prefix>dir+one%2F</Prefix></CommonPrefixes>
<EncodingType>url</EncodingType>
<NextContinuationToken>a+b%20c</NextContinuationToken>
</ListBucketResult>)";
  Result<S3ListPage> page = ParseListObjectsV2(xml, kWhere);
  TS_ASSERT_OK(page.status());
  ASSERT_EQ(page->objects.size(), 4u);
  EXPECT_EQ(page->objects[0].key, "a b");
  EXPECT_EQ(page->objects[0].etag, "\"e1\"");
  EXPECT_EQ(page->objects[1].key, "x y");
  EXPECT_EQ(page->objects[2].key, "p/q/r");
  EXPECT_EQ(page->objects[3].key, "caf\xc3\xa9/\xe6\x97\xa5+");
  EXPECT_EQ(page->objects[3].size, 4u);
  EXPECT_EQ(page->common_prefixes, std::vector<std::string>{"dir one/"});
  EXPECT_EQ(page->next_continuation_token, "a+b%20c");
}

TEST(S3XmlTest, ListObjectsV2WithoutEncodingTypeKeepsPercentAndPlus) {
  const std::string xml =
      "<ListBucketResult><Contents><Key>a%20b+c</Key><Size>1</Size></Contents>"
      "<CommonPrefixes><Prefix>p+%2F</Prefix></CommonPrefixes></ListBucketResult>";
  Result<S3ListPage> page = ParseListObjectsV2(xml, kWhere);
  TS_ASSERT_OK(page.status());
  ASSERT_EQ(page->objects.size(), 1u);
  EXPECT_EQ(page->objects[0].key, "a%20b+c");
  EXPECT_EQ(page->common_prefixes, std::vector<std::string>{"p+%2F"});
}

TEST(S3XmlTest, ListObjectsV2BadUrlEscapeIsDataLoss) {
  const std::string xml =
      "<ListBucketResult><EncodingType>url</EncodingType>"
      "<Contents><Key>a%2</Key><Size>1</Size></Contents></ListBucketResult>";
  Result<S3ListPage> page = ParseListObjectsV2(xml, kWhere);
  ASSERT_FALSE(page.ok());
  EXPECT_TRUE(absl::IsDataLoss(page.status())) << page.status();
  EXPECT_THAT(page.status().message(), HasSubstr(kWhere));
  EXPECT_THAT(page.status().message(), HasSubstr("a%2"));
}

TEST(S3XmlTest, ListObjectsV2Empty) {
  const std::string xml = R"(<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>ckpt</Name><Prefix>none/</Prefix><KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated></ListBucketResult>)";
  Result<S3ListPage> page = ParseListObjectsV2(xml, kWhere);
  TS_ASSERT_OK(page.status());
  EXPECT_TRUE(page->objects.empty());
  EXPECT_TRUE(page->common_prefixes.empty());
  EXPECT_FALSE(page->truncated);
  EXPECT_EQ(page->next_continuation_token, "");
}

TEST(S3XmlTest, TopLevelPrefixIsNotACommonPrefixAndNestedKeysAreIgnored) {
  const std::string xml =
      "<ListBucketResult><Prefix>top/</Prefix>"
      "<Contents><Key>k</Key><Size>1</Size><Owner><Key>not-a-key</Key></Owner></Contents>"
      "<Key>stray</Key></ListBucketResult>";
  Result<S3ListPage> page = ParseListObjectsV2(xml, kWhere);
  TS_ASSERT_OK(page.status());
  ASSERT_EQ(page->objects.size(), 1u);
  EXPECT_EQ(page->objects[0].key, "k");
  EXPECT_TRUE(page->common_prefixes.empty());
}

TEST(S3XmlTest, MalformedXmlIsDataLossNamingWhere) {
  for (const std::string xml : {
           "<ListBucketResult><Contents><Key>a</Key><Size>1</Size></Contents>",  // truncated
           "<ListBucketResult><Contents></ListBucketResult>",                    // mismatched
           "",                                                                   // empty
           "not xml at all",
           "<ListBucketResult>&undefined;</ListBucketResult>",
           "<ListBucketResult/>trailing junk",
       }) {
    Result<S3ListPage> page = ParseListObjectsV2(xml, kWhere);
    ASSERT_FALSE(page.ok()) << xml;
    EXPECT_TRUE(absl::IsDataLoss(page.status())) << page.status();
    EXPECT_THAT(page.status().message(), HasSubstr(kWhere));
    EXPECT_THAT(page.status().message(), HasSubstr("malformed XML at line"));
  }
  Result<S3ListPage> page = ParseListObjectsV2("<ListBucketResult>\n<a></b>", kWhere);
  ASSERT_FALSE(page.ok());
  EXPECT_THAT(page.status().message(), HasSubstr("line 2"));
  EXPECT_THAT(page.status().message(), HasSubstr("mismatched tag"));
}

TEST(S3XmlTest, MissingOrBadSizeIsDataLoss) {
  Result<S3ListPage> page = ParseListObjectsV2(
      "<ListBucketResult><Contents><Key>no-size</Key><ETag>\"e\"</ETag></Contents>"
      "</ListBucketResult>",
      kWhere);
  ASSERT_FALSE(page.ok());
  EXPECT_TRUE(absl::IsDataLoss(page.status())) << page.status();
  EXPECT_THAT(page.status().message(), HasSubstr(kWhere));
  EXPECT_THAT(page.status().message(), HasSubstr("no-size"));
  EXPECT_THAT(page.status().message(), HasSubstr("<Size>"));

  for (const std::string size : {"", "-1", "12a", "0x10", "18446744073709551616"}) {
    page = ParseListObjectsV2("<ListBucketResult><Contents><Key>k</Key><Size>" + size +
                                  "</Size></Contents>" + "</ListBucketResult>",
                              kWhere);
    ASSERT_FALSE(page.ok()) << size;
    EXPECT_TRUE(absl::IsDataLoss(page.status())) << page.status();
    EXPECT_THAT(page.status().message(), HasSubstr("invalid <Size>"));
  }

  page = ParseListObjectsV2(
      "<ListBucketResult><Contents><Size>1</Size></Contents></ListBucketResult>", kWhere);
  ASSERT_FALSE(page.ok());
  EXPECT_TRUE(absl::IsDataLoss(page.status())) << page.status();
  EXPECT_THAT(page.status().message(), HasSubstr("no <Key>"));
}

TEST(S3XmlTest, BadIsTruncatedOrEncodingTypeIsDataLoss) {
  Result<S3ListPage> page = ParseListObjectsV2(
      "<ListBucketResult><IsTruncated>yes</IsTruncated></ListBucketResult>", kWhere);
  ASSERT_FALSE(page.ok());
  EXPECT_TRUE(absl::IsDataLoss(page.status())) << page.status();
  page = ParseListObjectsV2(
      "<ListBucketResult><EncodingType>base64</EncodingType></ListBucketResult>", kWhere);
  ASSERT_FALSE(page.ok());
  EXPECT_TRUE(absl::IsDataLoss(page.status())) << page.status();
  EXPECT_THAT(page.status().message(), HasSubstr("base64"));
}

TEST(S3XmlTest, WrongRootIsDataLoss) {
  Result<S3ListPage> page =
      ParseListObjectsV2("<ListAllMyBucketsResult><Buckets/></ListAllMyBucketsResult>", kWhere);
  ASSERT_FALSE(page.ok());
  EXPECT_TRUE(absl::IsDataLoss(page.status())) << page.status();
  EXPECT_THAT(page.status().message(), HasSubstr("ListAllMyBucketsResult"));
}

TEST(S3XmlTest, HostileInputIsRefused) {
  // Entity expansion needs a DTD; any DOCTYPE is refused.
  const std::string laughs =
      "<?xml version=\"1.0\"?><!DOCTYPE lolz [<!ENTITY lol \"lol\">"
      "<!ENTITY lol2 \"&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;\">]>"
      "<ListBucketResult><Contents><Key>&lol2;</Key><Size>1</Size></Contents></ListBucketResult>";
  Result<S3ListPage> page = ParseListObjectsV2(laughs, kWhere);
  ASSERT_FALSE(page.ok());
  EXPECT_TRUE(absl::IsDataLoss(page.status())) << page.status();
  EXPECT_THAT(page.status().message(), HasSubstr("document type declaration"));
  EXPECT_THAT(page.status().message(), HasSubstr(kWhere));

  // Deep nesting is refused rather than followed.
  std::string deep = "<ListBucketResult>";
  for (int i = 0; i < 100000; ++i) deep += "<a>";
  page = ParseListObjectsV2(deep, kWhere);
  ASSERT_FALSE(page.ok());
  EXPECT_TRUE(absl::IsDataLoss(page.status())) << page.status();
  EXPECT_THAT(page.status().message(), HasSubstr("nested deeper"));

  // A large listing is fine (and is fed to expat in pieces).
  std::string big = "<ListBucketResult>";
  for (int i = 0; i < 200000; ++i) {
    big += "<Contents><Key>k" + std::to_string(i) + "</Key><Size>" + std::to_string(i) +
           "</Size><ETag>\"0123456789abcdef0123456789abcdef\"</ETag></Contents>";
  }
  big += "</ListBucketResult>";
  page = ParseListObjectsV2(big, kWhere);
  TS_ASSERT_OK(page.status());
  ASSERT_EQ(page->objects.size(), 200000u);
  EXPECT_EQ(page->objects[199999].key, "k199999");
  EXPECT_EQ(page->objects[199999].size, 199999u);
}

TEST(S3XmlTest, ListMultipartUploads) {
  const std::string xml = R"(<?xml version="1.0" encoding="UTF-8"?>
<ListMultipartUploadsResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
  <Bucket>ckpt</Bucket>
  <KeyMarker></KeyMarker>
  <UploadIdMarker></UploadIdMarker>
  <NextKeyMarker>run1/b%20c</NextKeyMarker>
  <NextUploadIdMarker>xY3.Z</NextUploadIdMarker>
  <EncodingType>url</EncodingType>
  <MaxUploads>2</MaxUploads>
  <IsTruncated>true</IsTruncated>
  <Upload>
    <Key>run1/a</Key>
    <UploadId>VXBsb2FkIElEIGZvciA2aWWpbmcncyBteS1tb3ZpZS5tMnRzIHVwbG9hZA</UploadId>
    <Initiator><ID>arn:aws:iam::111122223333:user/user1</ID><DisplayName>user1</DisplayName></Initiator>
    <Owner><ID>75aa57f09aa0c8caeab4f8c24e99d10f8e7faeebf76c078efc7c6caea54ba06a</ID></Owner>
    <StorageClass>STANDARD</StorageClass>
    <Initiated>2010-11-10T20:48:33.000Z</Initiated>
  </Upload>
  <Upload>
    <Key>run1/b+c%C3%A9</Key>
    <UploadId>xY3.Z</UploadId>
    <Initiated>2010-11-10T20:49:33.000Z</Initiated>
  </Upload>
  <CommonPrefixes><Prefix>run2/</Prefix></CommonPrefixes>
</ListMultipartUploadsResult>)";
  Result<S3UploadsPage> page = ParseListMultipartUploads(xml, kWhere);
  TS_ASSERT_OK(page.status());
  ASSERT_EQ(page->uploads.size(), 2u);
  EXPECT_EQ(page->uploads[0].key, "run1/a");
  EXPECT_EQ(page->uploads[0].upload_id,
            "VXBsb2FkIElEIGZvciA2aWWpbmcncyBteS1tb3ZpZS5tMnRzIHVwbG9hZA");
  EXPECT_EQ(page->uploads[0].initiated, "2010-11-10T20:48:33.000Z");
  EXPECT_EQ(page->uploads[1].key, "run1/b c\xc3\xa9");
  EXPECT_EQ(page->uploads[1].upload_id, "xY3.Z");
  EXPECT_EQ(page->uploads[1].initiated, "2010-11-10T20:49:33.000Z");
  EXPECT_TRUE(page->truncated);
  EXPECT_EQ(page->next_key_marker, "run1/b c");
  EXPECT_EQ(page->next_upload_id_marker, "xY3.Z");
}

TEST(S3XmlTest, ListMultipartUploadsEmptyAndBroken) {
  Result<S3UploadsPage> page = ParseListMultipartUploads(
      "<ListMultipartUploadsResult><Bucket>b</Bucket><IsTruncated>false</IsTruncated>"
      "</ListMultipartUploadsResult>",
      kWhere);
  TS_ASSERT_OK(page.status());
  EXPECT_TRUE(page->uploads.empty());
  EXPECT_FALSE(page->truncated);

  page = ParseListMultipartUploads(
      "<ListMultipartUploadsResult><Upload><Key>k</Key></Upload></ListMultipartUploadsResult>",
      kWhere);
  ASSERT_FALSE(page.ok());
  EXPECT_TRUE(absl::IsDataLoss(page.status())) << page.status();
  EXPECT_THAT(page.status().message(), HasSubstr("<UploadId>"));

  page = ParseListMultipartUploads("<ListBucketResult/>", kWhere);
  ASSERT_FALSE(page.ok());
  EXPECT_TRUE(absl::IsDataLoss(page.status())) << page.status();
}

TEST(S3XmlTest, InitiateMultipartUpload) {
  const std::string xml = R"(<?xml version="1.0" encoding="UTF-8"?>
<InitiateMultipartUploadResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
  <Bucket>ckpt</Bucket>
  <Key>run1/big.bin</Key>
  <UploadId>VXBsb2FkIElEIGZvciA2aWWpbmcncyBteS1tb3ZpZS5tMnRzIHVwbG9hZA</UploadId>
</InitiateMultipartUploadResult>)";
  Result<std::string> upload_id = ParseInitiateMultipartUpload(xml, kWhere);
  TS_ASSERT_OK(upload_id.status());
  EXPECT_EQ(*upload_id, "VXBsb2FkIElEIGZvciA2aWWpbmcncyBteS1tb3ZpZS5tMnRzIHVwbG9hZA");

  for (const std::string bad : {
           "<InitiateMultipartUploadResult><Bucket>b</Bucket></InitiateMultipartUploadResult>",
           "<InitiateMultipartUploadResult><UploadId></UploadId></InitiateMultipartUploadResult>",
           "<InitiateMultipartUploadResult><X><UploadId>u</UploadId></X>"
           "</InitiateMultipartUploadResult>",
       }) {
    upload_id = ParseInitiateMultipartUpload(bad, kWhere);
    ASSERT_FALSE(upload_id.ok()) << bad;
    EXPECT_TRUE(absl::IsDataLoss(upload_id.status())) << upload_id.status();
    EXPECT_THAT(upload_id.status().message(), HasSubstr(kWhere));
  }
}

TEST(S3XmlTest, CompleteMultipartUpload) {
  // With the leading whitespace S3 sends while it assembles a large object.
  const std::string xml =
      "   \n  \n"
      R"(<?xml version="1.0" encoding="UTF-8"?>
<CompleteMultipartUploadResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
  <Location>https://ckpt.s3.amazonaws.com/run1/big.bin</Location>
  <Bucket>ckpt</Bucket>
  <Key>run1/big.bin</Key>
  <ETag>"3858f62230ac3c915f300c664312c11f-9"</ETag>
</CompleteMultipartUploadResult>)";
  Result<std::string> etag = ParseCompleteMultipartUpload(xml, kWhere);
  TS_ASSERT_OK(etag.status());
  EXPECT_EQ(*etag, "\"3858f62230ac3c915f300c664312c11f-9\"");

  etag = ParseCompleteMultipartUpload(
      "<CompleteMultipartUploadResult><Key>k</Key></CompleteMultipartUploadResult>", kWhere);
  ASSERT_FALSE(etag.ok());
  EXPECT_TRUE(absl::IsDataLoss(etag.status())) << etag.status();
}

TEST(S3XmlTest, CompleteMultipartUploadErrorIn200Answer) {
  const std::string internal = R"(<?xml version="1.0" encoding="UTF-8"?>

<Error>
  <Code>InternalError</Code>
  <Message>We encountered an internal error. Please try again.</Message>
  <RequestId>656c76696e6727732072657175657374</RequestId>
  <HostId>Uuag1LuByRx9e6j5Onimru9pO4ZVKnJ2Qz7/C1NPcfTWAtRPfTaOFg==</HostId>
</Error>)";
  Result<std::string> etag = ParseCompleteMultipartUpload(internal, kWhere);
  ASSERT_FALSE(etag.ok());
  EXPECT_TRUE(absl::IsUnavailable(etag.status())) << etag.status();
  EXPECT_THAT(etag.status().message(), HasSubstr(kWhere));
  EXPECT_THAT(etag.status().message(), HasSubstr("InternalError"));
  EXPECT_THAT(etag.status().message(), HasSubstr("We encountered an internal error"));
  EXPECT_THAT(etag.status().message(), HasSubstr("656c76696e6727732072657175657374"));

  etag = ParseCompleteMultipartUpload(
      "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>",
      kWhere);
  ASSERT_FALSE(etag.ok());
  EXPECT_TRUE(absl::IsUnavailable(etag.status())) << etag.status();

  etag = ParseCompleteMultipartUpload(
      "<Error><Code>InvalidPart</Code><Message>One or more of the specified parts could not be "
      "found.</Message><UploadId>u1</UploadId><PartNumber>2</PartNumber></Error>",
      kWhere);
  ASSERT_FALSE(etag.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(etag.status())) << etag.status();
  EXPECT_THAT(etag.status().message(), HasSubstr("InvalidPart"));
}

TEST(S3XmlTest, ParseS3ErrorRealBody) {
  const S3Error error = ParseS3Error(R"(<?xml version="1.0" encoding="UTF-8"?>
<Error>
  <Code>NoSuchKey</Code>
  <Message>The resource you requested does not exist</Message>
  <Resource>/ckpt/run1/missing &amp; gone</Resource>
  <RequestId>4442587FB7D0A2F9</RequestId>
</Error>)");
  EXPECT_EQ(error.code, "NoSuchKey");
  EXPECT_EQ(error.message, "The resource you requested does not exist");
  EXPECT_EQ(error.resource, "/ckpt/run1/missing & gone");
  EXPECT_EQ(error.request_id, "4442587FB7D0A2F9");

  const S3Error partial = ParseS3Error("<Error><Code>AccessDenied</Code></Error>");
  EXPECT_EQ(partial.code, "AccessDenied");
  EXPECT_EQ(partial.message, "");
  EXPECT_EQ(partial.request_id, "");
  EXPECT_EQ(partial.resource, "");
}

TEST(S3XmlTest, ParseS3ErrorNotXml) {
  const std::string html =
      "<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad Gateway</h1>"
      "</center><hr><center>nginx</center>" +
      std::string(300, 'x');
  S3Error error = ParseS3Error(html);
  EXPECT_EQ(error.code, "");
  EXPECT_EQ(error.message, html.substr(0, 200));
  EXPECT_EQ(error.request_id, "");

  error = ParseS3Error("Service Unavailable");
  EXPECT_EQ(error.code, "");
  EXPECT_EQ(error.message, "Service Unavailable");

  error = ParseS3Error("");
  EXPECT_EQ(error.code, "");
  EXPECT_EQ(error.message, "");

  // Cut off mid-way: not XML either, and no half-read fields.
  error = ParseS3Error("<Error><Code>NoSuchKey</Code><Message>gone");
  EXPECT_EQ(error.code, "");
  EXPECT_EQ(error.message, "<Error><Code>NoSuchKey</Code><Message>gone");
}

// The part numbers and ETags of a CompleteMultipartUpload body as expat reads them.
struct ReadBack {
  std::vector<std::string> path;
  std::string text;
  std::string root;
  std::vector<S3CompletedPart> parts;
};

void XMLCALL ReadBackStart(void* user_data, const XML_Char* name, const XML_Char** /*atts*/) {
  auto* state = static_cast<ReadBack*>(user_data);
  state->path.emplace_back(name);
  if (state->path.size() == 1) state->root = name;
  if (state->path.size() == 2 && state->path[1] == "Part") state->parts.emplace_back();
  state->text.clear();
}

void XMLCALL ReadBackEnd(void* user_data, const XML_Char* /*name*/) {
  auto* state = static_cast<ReadBack*>(user_data);
  if (state->path.size() == 3 && state->path[2] == "PartNumber") {
    state->parts.back().number = std::stoi(state->text);
  } else if (state->path.size() == 3 && state->path[2] == "ETag") {
    state->parts.back().etag = state->text;
  }
  state->path.pop_back();
}

void XMLCALL ReadBackText(void* user_data, const XML_Char* data, int length) {
  static_cast<ReadBack*>(user_data)->text.append(data, static_cast<size_t>(length));
}

TEST(S3XmlTest, CompleteMultipartUploadBodyRoundTrips) {
  const std::vector<S3CompletedPart> parts = {
      {1, "\"a54357aff0632cce46d942af68356b38\""},
      {2, "\"0c78aef83f66abc1fa1e8477f296d394\""},
      {3, "odd&<etag>'\"value"},
  };
  const std::string body = CompleteMultipartUploadBody(parts);
  EXPECT_EQ(body.rfind("<CompleteMultipartUpload", 0), 0u) << body;
  EXPECT_THAT(body, HasSubstr("<Part><PartNumber>1</PartNumber><ETag>&quot;"
                              "a54357aff0632cce46d942af68356b38&quot;</ETag></Part>"));
  EXPECT_THAT(body, HasSubstr("odd&amp;&lt;etag&gt;&apos;&quot;value"));
  EXPECT_EQ(body.find('"' + std::string("a54357")), std::string::npos);

  XML_Parser parser = XML_ParserCreate(nullptr);
  ASSERT_NE(parser, nullptr);
  ReadBack state;
  XML_SetUserData(parser, &state);
  XML_SetElementHandler(parser, ReadBackStart, ReadBackEnd);
  XML_SetCharacterDataHandler(parser, ReadBackText);
  const XML_Status result = XML_Parse(parser, body.data(), static_cast<int>(body.size()), 1);
  const int error_code = static_cast<int>(XML_GetErrorCode(parser));
  XML_ParserFree(parser);
  ASSERT_EQ(result, XML_STATUS_OK) << "expat error " << error_code << "\n" << body;
  EXPECT_EQ(state.root, "CompleteMultipartUpload");
  ASSERT_EQ(state.parts.size(), parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    EXPECT_EQ(state.parts[i].number, parts[i].number);
    EXPECT_EQ(state.parts[i].etag, parts[i].etag);
  }

  EXPECT_EQ(CompleteMultipartUploadBody({}),
            "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
            "</CompleteMultipartUpload>");
}

}  // namespace
}  // namespace tensorstash
