// The XML of the S3 API: parsers for the response bodies the S3 store reads (listings, multipart
// uploads, errors) and the writer of the one request body it sends (CompleteMultipartUpload).
//
// Written for what AWS S3, SeaweedFS, moto and MinIO send, on libexpat:
//   - elements are matched by local name, so the xmlns AWS puts on the root (and any "prefix:")
//     makes no difference, and by their path from the root: <Key> counts only inside <Contents>,
//     the top-level <Prefix> of a listing is not a common prefix;
//   - the root must be the expected one; a 200 answer whose body is an <Error> document (S3 does
//     this for CompleteMultipartUpload) gives the status S3ErrorBodyToStatus describes;
//   - leading whitespace is skipped (S3 may pad a slow CompleteMultipartUpload answer with it);
//   - hostile input: parsing is iterative (expat) and linear in the body, nesting deeper than
//     kS3XmlMaxDepth and document type declarations (hence entity definitions) are refused;
//   - malformed XML is DataLoss naming `where` (e.g. "ListObjectsV2 of bucket 'b'"), with expat's
//     message and the line and column.
//
//   ParseListObjectsV2("<ListBucketResult><Contents><Key>a</Key><Size>3</Size>...", where)
//     -> {.objects = {{"a", 3, "\"...\""}}, ...}
//
// Thread-safety: pure functions.
#ifndef TENSORSTASH_KVSTORE_S3_S3_XML_H_
#define TENSORSTASH_KVSTORE_S3_S3_XML_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/util/status.h"

namespace tensorstash {

// Elements nested deeper than this are refused (S3 documents are four deep).
inline constexpr size_t kS3XmlMaxDepth = 64;

// One <Contents> of a listing.
struct S3ListedObject {
  std::string key;  // decoded (see ParseListObjectsV2)
  uint64_t size = 0;
  std::string etag;  // as sent, quotes included
  std::string last_modified;  // <LastModified> as sent ("" when absent)
};

struct S3ListPage {
  std::vector<S3ListedObject> objects;       // <Contents>, in the order sent
  std::vector<std::string> common_prefixes;  // <CommonPrefixes><Prefix>, decoded
  bool truncated = false;                    // <IsTruncated>true</IsTruncated>
  std::string next_continuation_token;       // <NextContinuationToken>, never encoded
};

// Parses the body of ListObjectsV2 (GET /bucket?list-type=2...), root <ListBucketResult>.
// When the body says <EncodingType>url</EncodingType> (wherever in the document), the <Key> of
// each <Contents> and the <Prefix> of each <CommonPrefixes> are decoded: %XX to the byte, '+' to a
// space; without it they are taken as they are. NextContinuationToken is opaque and never decoded.
// DataLoss naming `where` for malformed XML, another root, a <Contents> without <Key>, a missing or
// non-decimal <Size>, an <IsTruncated> other than true/false, an EncodingType other than url, or
// a malformed %XX escape; an <Error> root gives S3ErrorBodyToStatus's status.
Result<S3ListPage> ParseListObjectsV2(std::string_view xml, std::string_view where);

// One <Upload> of ListMultipartUploads.
struct S3Upload {
  std::string key;        // decoded (see ParseListMultipartUploads)
  std::string upload_id;  // never empty
  std::string initiated;  // ISO 8601 text as sent ("2024-01-02T03:04:05.000Z"), "" when absent
};

struct S3UploadsPage {
  std::vector<S3Upload> uploads;      // in the order sent
  bool truncated = false;             // <IsTruncated>
  std::string next_key_marker;        // <NextKeyMarker>, decoded like keys
  std::string next_upload_id_marker;  // <NextUploadIdMarker>, never encoded
};

// Parses the body of ListMultipartUploads (GET /bucket?uploads), root
// <ListMultipartUploadsResult>. With <EncodingType>url</EncodingType> the <Key> of each <Upload>
// and <NextKeyMarker> are decoded as in ParseListObjectsV2 (S3 encodes both). DataLoss naming
// `where` for malformed XML, another root, an <Upload> without <Key> or with a missing or empty
// <UploadId>, a bad <IsTruncated>, EncodingType or escape; an <Error> root as above.
Result<S3UploadsPage> ParseListMultipartUploads(std::string_view xml, std::string_view where);

// The <UploadId> of an <InitiateMultipartUploadResult> (POST /bucket/key?uploads). DataLoss naming
// `where` for malformed XML, another root or an absent or empty UploadId; an <Error> root as above.
Result<std::string> ParseInitiateMultipartUpload(std::string_view xml, std::string_view where);

// The <ETag> of a <CompleteMultipartUploadResult>, as sent (quotes included). S3 may answer
// CompleteMultipartUpload with 200 and then an <Error> body (the failure came after the headers):
// that gives S3ErrorBodyToStatus's status. DataLoss naming `where` for malformed XML, another root
// or an absent or empty ETag.
Result<std::string> ParseCompleteMultipartUpload(std::string_view xml, std::string_view where);

// An S3 error document. Every field is "" when absent.
struct S3Error {
  std::string code;  // "NoSuchKey", "SlowDown", ...
  std::string message;
  std::string request_id;
  std::string resource;
};

// Parses <Error><Code>..</Code><Message>..</Message><RequestId>..</RequestId>
// <Resource>..</Resource></Error> (the <Error> at any depth, by local name). Never fails: a body
// that is not well-formed XML or has no <Error> element (an HTML page from a proxy, an empty body)
// gives code "" and as message the first 200 bytes of the body.
S3Error ParseS3Error(std::string_view body);

// The status for an <Error> document that came where a result was expected (with a 2xx code):
// Unavailable (worth retrying) for the transient codes InternalError, SlowDown,
// ServiceUnavailable and RequestTimeout; FailedPrecondition for any other code (InvalidPart,
// InvalidPartOrder, EntityTooSmall, NoSuchUpload, ...: the request cannot succeed as it stands),
// none of which means stored bytes are corrupt. The message names `where`, the code, the message
// and the request id.
Status S3ErrorBodyToStatus(const S3Error& error, std::string_view where);

// One part of a multipart upload, as CompleteMultipartUpload lists it.
struct S3CompletedPart {
  int number = 0;    // 1 to 10000
  std::string etag;  // as UploadPart returned it, quotes included
};

// The body of CompleteMultipartUpload (POST /bucket/key?uploadId=...):
//   <CompleteMultipartUpload xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
//   <Part><PartNumber>1</PartNumber><ETag>&quot;...&quot;</ETag></Part>...
//   </CompleteMultipartUpload>
// (on one line), with the parts in the order given (S3 wants them ascending) and & < > " '
// escaped in the ETags.
std::string CompleteMultipartUploadBody(const std::vector<S3CompletedPart>& parts);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_S3_S3_XML_H_
