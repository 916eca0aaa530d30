// The checks every object-store driver makes of the answer to a GET with a Range: that the
// bytes are the ones asked for, all of them and no more. Plain fields in, so the kit stays free
// of HTTP; a driver copies them from its response.
//
// Thread-safety: a pure function.
#ifndef TENSORSTASH_KVSTORE_OBJECT_STORE_RANGED_READ_H_
#define TENSORSTASH_KVSTORE_OBJECT_STORE_RANGED_READ_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "tensorstash/util/status.h"

namespace tensorstash {

// A 2xx answer to a GET of bytes [offset, offset + size) (size 0: the whole object, no Range).
struct RangedAnswer {
  long status = 0;            // 200 or 206
  std::string content_range;  // the Content-Range header, "" when absent
  std::string content_length; // the Content-Length header, "" when absent (for messages)
  size_t received = 0;        // body bytes that arrived
  bool overflow = false;      // more bytes came than `size`
};

// OK when `answer` holds exactly the bytes asked for. Else, with `what` ("reading 'k' in
// s3://b") and `store` ("s3://b") in the message:
//  - Unimplemented when a ranged GET was answered 200 with other bytes than the range (the
//    server ignored Range, or sent a part with 200): the store cannot serve a checkpoint's reads;
//  - DataLoss when more bytes came than asked, when fewer came (the object is shorter: it is
//    truncated), or when a 206's Content-Range is not the range asked for or does not parse
//    (an answer "bytes 10-4/5" with no bytes, for a start past the end, included).
// Never FailedPrecondition or NotFound: a committed step's reader takes those for an object
// replaced or removed after the commit.
Status CheckRangedAnswer(const RangedAnswer& answer, uint64_t offset, size_t size,
                         std::string_view what, std::string_view store);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_OBJECT_STORE_RANGED_READ_H_
