#include "tensorstash/kvstore/object_store/ranged_read.h"

#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

// "bytes FIRST-LAST/TOTAL" (TOTAL may be '*'): FIRST and LAST, or false.
bool ParseContentRange(std::string_view text, uint64_t* first, uint64_t* last) {
  if (!text.starts_with("bytes ")) return false;
  text.remove_prefix(6);
  const size_t dash = text.find('-');
  const size_t slash = text.find('/');
  if (dash == std::string_view::npos || slash == std::string_view::npos || slash < dash) {
    return false;
  }
  return ParseInt(text.substr(0, dash), first) &&
         ParseInt(text.substr(dash + 1, slash - dash - 1), last);
}

}  // namespace

Status CheckRangedAnswer(const RangedAnswer& answer, uint64_t offset, size_t size,
                         std::string_view what, std::string_view store) {
  if (size == 0) return OkStatus();  // the whole object: nothing to check against
  const std::string asked = StrCat("bytes ", offset, "-", offset + size - 1);
  // A 200 that is not the whole object asked for (more bytes than asked, or any part but the
  // start): the server ignored the Range header, or (rclone's "serve s3") sent a part with 200
  // and a Content-Range, which HTTP gives no meaning to in a 200.
  if (answer.status == 200 && (answer.overflow || offset > 0)) {
    if (!answer.overflow && !answer.content_range.empty()) {
      return UnimplementedError(StrCat(
          what, ": the server answered a request for ", asked, " with 200 and Content-Range '",
          answer.content_range, "' instead of 206 (Partial Content); ", store,
          " does not implement range requests as HTTP specifies them, which reading a "
          "checkpoint needs"));
    }
    return UnimplementedError(StrCat(
        what, ": the server ignored the Range header and answered 200 with the whole object",
        answer.content_length.empty() ? "" : StrCat(" (", answer.content_length, " bytes)"),
        " to a request for ", asked, "; ", store,
        " does not support range requests, which reading a checkpoint needs"));
  }
  if (answer.overflow) {
    return DataLossError(StrCat(what, ": the server answered HTTP ", answer.status,
                                " with more than the ", size, " bytes asked for (", asked, ")"));
  }
  if (answer.status == 206 && !answer.content_range.empty()) {
    uint64_t first = 0;
    uint64_t last = 0;
    if (!ParseContentRange(answer.content_range, &first, &last) || first != offset ||
        last < first || last - first + 1 != answer.received) {
      return DataLossError(StrCat(what, ": the server answered a request for ", asked,
                                  " with Content-Range '", answer.content_range, "' and ",
                                  answer.received, " bytes, not the bytes asked for"));
    }
  }
  if (answer.received != size) {
    return DataLossError(StrCat(what, " is truncated: ", answer.received, " of the ", size,
                                " bytes at offset ", offset, " exist"));
  }
  return OkStatus();
}

}  // namespace tensorstash
