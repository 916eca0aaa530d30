#include "tensorstash/kvstore/s3/s3_xml.h"

#include <expat.h>

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <memory>
#include <type_traits>
#include <utility>

namespace tensorstash {

namespace {

// Local names of the open elements, the root first.
using XmlPath = std::vector<std::string>;

// Called when an element opens (the path ends with it).
using StartHandler = std::function<Status(const XmlPath& path)>;
// Called when an element closes (the path still ends with it), with the text it held since the
// last child element closed (all of it for a leaf element).
using EndHandler = std::function<Status(const XmlPath& path, std::string& text)>;

// Bytes handed to expat at once (XML_Parse takes an int length).
constexpr size_t kParseChunk = size_t{1} << 24;

// What the expat callbacks share.
struct Walk {
  XML_Parser parser = nullptr;
  const StartHandler* on_start = nullptr;
  const EndHandler* on_end = nullptr;
  std::string_view where;
  XmlPath path;
  std::string root;
  std::string text;
  Status status;  // the first error a handler reported; parsing stops there

  void Fail(Status error) {
    if (!status.ok()) return;
    status = std::move(error);
    XML_StopParser(parser, XML_FALSE);
  }
};

// "s3:Key" -> "Key".
std::string LocalName(const XML_Char* name) {
  std::string_view view(name);
  const size_t colon = view.rfind(':');
  if (colon != std::string_view::npos) view.remove_prefix(colon + 1);
  return std::string(view);
}

void XMLCALL OnStartElement(void* user_data, const XML_Char* name, const XML_Char** /*atts*/) {
  auto* walk = static_cast<Walk*>(user_data);
  if (!walk->status.ok()) return;
  if (walk->path.size() >= kS3XmlMaxDepth) {
    walk->Fail(DataLossError(StrCat(walk->where, ": XML nested deeper than ", kS3XmlMaxDepth,
                                    " elements at line ", XML_GetCurrentLineNumber(walk->parser))));
    return;
  }
  walk->path.push_back(LocalName(name));
  if (walk->path.size() == 1) walk->root = walk->path.back();
  walk->text.clear();
  if (*walk->on_start) {
    Status status = (*walk->on_start)(walk->path);
    if (!status.ok()) walk->Fail(std::move(status));
  }
}

void XMLCALL OnEndElement(void* user_data, const XML_Char* /*name*/) {
  auto* walk = static_cast<Walk*>(user_data);
  if (!walk->status.ok()) return;
  Status status = (*walk->on_end)(walk->path, walk->text);
  walk->text.clear();
  walk->path.pop_back();
  if (!status.ok()) walk->Fail(std::move(status));
}

void XMLCALL OnCharacterData(void* user_data, const XML_Char* data, int length) {
  auto* walk = static_cast<Walk*>(user_data);
  if (!walk->status.ok() || length <= 0) return;
  walk->text.append(data, static_cast<size_t>(length));
}

// S3 documents never declare a document type; refusing one keeps entity definitions (and the
// expansion attacks they allow) out.
void XMLCALL OnStartDoctype(void* user_data, const XML_Char* /*name*/, const XML_Char* /*sysid*/,
                            const XML_Char* /*pubid*/, int /*has_internal_subset*/) {
  auto* walk = static_cast<Walk*>(user_data);
  walk->Fail(DataLossError(StrCat(walk->where,
                                  ": XML with a document type declaration (not allowed) at line ",
                                  XML_GetCurrentLineNumber(walk->parser))));
}

struct ParserFree {
  void operator()(XML_Parser parser) const { XML_ParserFree(parser); }
};

std::string_view SkipLeadingSpace(std::string_view text) {
  size_t i = 0;
  while (i < text.size() &&
         (text[i] == ' ' || text[i] == '\t' || text[i] == '\r' || text[i] == '\n')) {
    ++i;
  }
  return text.substr(i);
}

std::string_view TrimSpace(std::string_view text) {
  text = SkipLeadingSpace(text);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t' || text.back() == '\r' ||
                           text.back() == '\n')) {
    text.remove_suffix(1);
  }
  return text;
}

// Parses `xml` (after any leading whitespace), calling the handlers for every element; returns the
// local name of the root. The first error of a handler is returned as it is; malformed XML is
// DataLoss naming `where`.
Result<std::string> WalkXml(std::string_view xml, std::string_view where,
                            const StartHandler& on_start, const EndHandler& on_end) {
  std::unique_ptr<std::remove_pointer_t<XML_Parser>, ParserFree> parser(XML_ParserCreate(nullptr));
  if (parser == nullptr) {
    return OutOfMemoryError(StrCat(where, ": cannot create an XML parser"));
  }
  Walk walk;
  walk.parser = parser.get();
  walk.on_start = &on_start;
  walk.on_end = &on_end;
  walk.where = where;
  XML_SetUserData(parser.get(), &walk);
  XML_SetElementHandler(parser.get(), OnStartElement, OnEndElement);
  XML_SetCharacterDataHandler(parser.get(), OnCharacterData);
  XML_SetStartDoctypeDeclHandler(parser.get(), OnStartDoctype);

  xml = SkipLeadingSpace(xml);
  do {
    const size_t length = std::min(xml.size(), kParseChunk);
    const bool last = length == xml.size();
    const XML_Status result =
        XML_Parse(parser.get(), xml.data(), static_cast<int>(length), last ? 1 : 0);
    if (!walk.status.ok()) return walk.status;
    if (result != XML_STATUS_OK) {
      const XML_LChar* message = XML_ErrorString(XML_GetErrorCode(parser.get()));
      return DataLossError(StrCat(where, ": malformed XML at line ",
                                  XML_GetCurrentLineNumber(parser.get()), ", column ",
                                  XML_GetCurrentColumnNumber(parser.get()), ": ",
                                  message != nullptr ? message : "unknown error"));
    }
    xml.remove_prefix(length);
  } while (!xml.empty());
  return std::move(walk.root);
}

bool PathIs(const XmlPath& path, std::initializer_list<std::string_view> names) {
  return path.size() == names.size() && std::equal(path.begin(), path.end(), names.begin());
}

// Status for a document whose root is `root` where `expected` was wanted.
Status WrongRoot(std::string_view xml, std::string_view where, std::string_view root,
                 std::string_view expected) {
  if (root == "Error") return S3ErrorBodyToStatus(ParseS3Error(xml), where);
  return DataLossError(
      StrCat(where, ": expected an XML <", expected, "> document, got <", EscapeBytes(root), ">"));
}

Result<bool> ParseBool(std::string_view text, std::string_view element, std::string_view where) {
  const std::string_view value = TrimSpace(text);
  if (value == "true" || value == "True" || value == "TRUE") return true;
  if (value == "false" || value == "False" || value == "FALSE") return false;
  return DataLossError(
      StrCat(where, ": <", element, "> is \"", EscapeBytes(value), "\", not true or false"));
}

// Whether the listing's <EncodingType> asks for url decoding. DataLoss for an unknown one.
Result<bool> IsUrlEncoding(const std::string& encoding_type, std::string_view where) {
  const std::string_view value = TrimSpace(encoding_type);
  if (value.empty()) return false;
  if (value == "url" || value == "URL") return true;
  return DataLossError(
      StrCat(where, ": unsupported <EncodingType> \"", EscapeBytes(value), "\" in the listing"));
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// S3's url encoding-type: %XX is the byte, '+' a space. DataLoss for a malformed escape.
Status UrlDecodeInPlace(std::string* text, std::string_view element, std::string_view where) {
  std::string out;
  out.reserve(text->size());
  for (size_t i = 0; i < text->size(); ++i) {
    const char c = (*text)[i];
    if (c == '+') {
      out.push_back(' ');
    } else if (c == '%') {
      const int high = i + 2 < text->size() ? HexDigit((*text)[i + 1]) : -1;
      const int low = i + 2 < text->size() ? HexDigit((*text)[i + 2]) : -1;
      if (high < 0 || low < 0) {
        return DataLossError(StrCat(where, ": malformed %-escape in the url-encoded <", element,
                                    "> \"", EscapeBytes(*text), "\""));
      }
      out.push_back(static_cast<char>(high * 16 + low));
      i += 2;
    } else {
      out.push_back(c);
    }
  }
  *text = std::move(out);
  return OkStatus();
}

// Handler for the elements a walk does not look at.
Status IgnoreStart(const XmlPath& /*path*/) { return OkStatus(); }

void AppendXmlEscaped(std::string* out, std::string_view text) {
  for (const char c : text) {
    switch (c) {
      case '&':
        *out += "&amp;";
        break;
      case '<':
        *out += "&lt;";
        break;
      case '>':
        *out += "&gt;";
        break;
      case '"':
        *out += "&quot;";
        break;
      case '\'':
        *out += "&apos;";
        break;
      default:
        out->push_back(c);
    }
  }
}

// The text of the element <root><child>, when `xml` is a <root> document. DataLoss when the
// element is absent or empty; an <Error> document gives S3ErrorBodyToStatus's status.
Result<std::string> ParseSingleValue(std::string_view xml, std::string_view where,
                                     std::string_view root_name, std::string_view child) {
  std::string value;
  const EndHandler on_end = [&](const XmlPath& path, std::string& text) -> Status {
    if (PathIs(path, {root_name, child})) value = std::move(text);
    return OkStatus();
  };
  TS_ASSIGN_OR_RETURN(const std::string root, WalkXml(xml, where, IgnoreStart, on_end));
  if (root != root_name) return WrongRoot(xml, where, root, root_name);
  if (value.empty()) {
    return DataLossError(StrCat(where, ": <", root_name, "> without a <", child, ">"));
  }
  return value;
}

}  // namespace

Result<S3ListPage> ParseListObjectsV2(std::string_view xml, std::string_view where) {
  constexpr std::string_view kRoot = "ListBucketResult";
  S3ListPage page;
  std::string encoding_type;
  bool has_key = false;
  bool has_size = false;
  const StartHandler on_start = [&](const XmlPath& path) -> Status {
    if (PathIs(path, {kRoot, "Contents"})) {
      page.objects.emplace_back();
      has_key = false;
      has_size = false;
    }
    return OkStatus();
  };
  const EndHandler on_end = [&](const XmlPath& path, std::string& text) -> Status {
    if (path.size() == 3 && path[0] == kRoot && path[1] == "Contents") {
      S3ListedObject& object = page.objects.back();
      if (path[2] == "Key") {
        object.key = std::move(text);
        has_key = true;
      } else if (path[2] == "Size") {
        const std::string_view value = TrimSpace(text);
        if (!ParseInt(value, &object.size)) {
          return DataLossError(StrCat(where, ": invalid <Size> \"", EscapeBytes(value),
                                      "\" in <Contents> #", page.objects.size(),
                                      " of the listing"));
        }
        has_size = true;
      } else if (path[2] == "ETag") {
        object.etag = std::move(text);
      } else if (path[2] == "LastModified") {
        object.last_modified = std::move(text);
      }
    } else if (PathIs(path, {kRoot, "Contents"})) {
      if (!has_key) {
        return DataLossError(
            StrCat(where, ": <Contents> #", page.objects.size(), " of the listing has no <Key>"));
      }
      if (!has_size) {
        return DataLossError(StrCat(where, ": <Contents> #", page.objects.size(),
                                    " of the listing (key \"", EscapeBytes(page.objects.back().key),
                                    "\") has no <Size>"));
      }
    } else if (PathIs(path, {kRoot, "CommonPrefixes", "Prefix"})) {
      page.common_prefixes.push_back(std::move(text));
    } else if (PathIs(path, {kRoot, "IsTruncated"})) {
      TS_ASSIGN_OR_RETURN(page.truncated, ParseBool(text, "IsTruncated", where));
    } else if (PathIs(path, {kRoot, "NextContinuationToken"})) {
      page.next_continuation_token = std::move(text);
    } else if (PathIs(path, {kRoot, "EncodingType"})) {
      encoding_type = std::move(text);
    }
    return OkStatus();
  };
  TS_ASSIGN_OR_RETURN(const std::string root, WalkXml(xml, where, on_start, on_end));
  if (root != kRoot) return WrongRoot(xml, where, root, kRoot);
  // EncodingType may come after the keys (AWS sends it after the <Contents>).
  TS_ASSIGN_OR_RETURN(const bool url_encoded, IsUrlEncoding(encoding_type, where));
  if (url_encoded) {
    for (S3ListedObject& object : page.objects) {
      TS_RETURN_IF_ERROR(UrlDecodeInPlace(&object.key, "Key", where));
    }
    for (std::string& prefix : page.common_prefixes) {
      TS_RETURN_IF_ERROR(UrlDecodeInPlace(&prefix, "Prefix", where));
    }
  }
  return page;
}

Result<S3UploadsPage> ParseListMultipartUploads(std::string_view xml, std::string_view where) {
  constexpr std::string_view kRoot = "ListMultipartUploadsResult";
  S3UploadsPage page;
  std::string encoding_type;
  bool has_key = false;
  const StartHandler on_start = [&](const XmlPath& path) -> Status {
    if (PathIs(path, {kRoot, "Upload"})) {
      page.uploads.emplace_back();
      has_key = false;
    }
    return OkStatus();
  };
  const EndHandler on_end = [&](const XmlPath& path, std::string& text) -> Status {
    if (path.size() == 3 && path[0] == kRoot && path[1] == "Upload") {
      S3Upload& upload = page.uploads.back();
      if (path[2] == "Key") {
        upload.key = std::move(text);
        has_key = true;
      } else if (path[2] == "UploadId") {
        upload.upload_id = std::move(text);
      } else if (path[2] == "Initiated") {
        upload.initiated = std::move(text);
      }
    } else if (PathIs(path, {kRoot, "Upload"})) {
      if (!has_key) {
        return DataLossError(StrCat(where, ": <Upload> #", page.uploads.size(),
                                    " of the multipart upload listing has no <Key>"));
      }
      if (page.uploads.back().upload_id.empty()) {
        return DataLossError(StrCat(where, ": <Upload> #", page.uploads.size(), " (key \"",
                                    EscapeBytes(page.uploads.back().key),
                                    "\") of the multipart upload listing has no <UploadId>"));
      }
    } else if (PathIs(path, {kRoot, "IsTruncated"})) {
      TS_ASSIGN_OR_RETURN(page.truncated, ParseBool(text, "IsTruncated", where));
    } else if (PathIs(path, {kRoot, "NextKeyMarker"})) {
      page.next_key_marker = std::move(text);
    } else if (PathIs(path, {kRoot, "NextUploadIdMarker"})) {
      page.next_upload_id_marker = std::move(text);
    } else if (PathIs(path, {kRoot, "EncodingType"})) {
      encoding_type = std::move(text);
    }
    return OkStatus();
  };
  TS_ASSIGN_OR_RETURN(const std::string root, WalkXml(xml, where, on_start, on_end));
  if (root != kRoot) return WrongRoot(xml, where, root, kRoot);
  TS_ASSIGN_OR_RETURN(const bool url_encoded, IsUrlEncoding(encoding_type, where));
  if (url_encoded) {
    for (S3Upload& upload : page.uploads) {
      TS_RETURN_IF_ERROR(UrlDecodeInPlace(&upload.key, "Key", where));
    }
    TS_RETURN_IF_ERROR(UrlDecodeInPlace(&page.next_key_marker, "NextKeyMarker", where));
  }
  return page;
}

Result<std::string> ParseInitiateMultipartUpload(std::string_view xml, std::string_view where) {
  return ParseSingleValue(xml, where, "InitiateMultipartUploadResult", "UploadId");
}

Result<std::string> ParseCompleteMultipartUpload(std::string_view xml, std::string_view where) {
  return ParseSingleValue(xml, where, "CompleteMultipartUploadResult", "ETag");
}

S3Error ParseS3Error(std::string_view body) {
  constexpr size_t kMaxMessage = 200;
  S3Error error;
  bool saw_error = false;
  const StartHandler on_start = [&](const XmlPath& path) -> Status {
    if (path.back() == "Error") saw_error = true;
    return OkStatus();
  };
  const EndHandler on_end = [&](const XmlPath& path, std::string& text) -> Status {
    if (path.size() < 2 || path[path.size() - 2] != "Error") return OkStatus();
    const std::string& name = path.back();
    if (name == "Code") {
      error.code = std::move(text);
    } else if (name == "Message") {
      error.message = std::move(text);
    } else if (name == "RequestId") {
      error.request_id = std::move(text);
    } else if (name == "Resource") {
      error.resource = std::move(text);
    }
    return OkStatus();
  };
  const Result<std::string> root = WalkXml(body, "S3 error body", on_start, on_end);
  if (!root.ok() || !saw_error) {
    error = S3Error();
    error.message = std::string(body.substr(0, kMaxMessage));
  }
  return error;
}

Status S3ErrorBodyToStatus(const S3Error& error, std::string_view where) {
  std::string message =
      StrCat(where, ": S3 answered with error ", error.code.empty() ? "(no code)" : error.code);
  if (!error.message.empty()) message += StrCat(": ", error.message);
  if (!error.resource.empty()) message += StrCat(" (resource ", error.resource, ")");
  if (!error.request_id.empty()) message += StrCat(" (request id ", error.request_id, ")");
  if (error.code == "InternalError" || error.code == "SlowDown" ||
      error.code == "ServiceUnavailable" || error.code == "RequestTimeout") {
    return UnavailableError(message);
  }
  return FailedPreconditionError(message);
}

std::string CompleteMultipartUploadBody(const std::vector<S3CompletedPart>& parts) {
  std::string out = "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">";
  for (const S3CompletedPart& part : parts) {
    out += StrCat("<Part><PartNumber>", part.number, "</PartNumber><ETag>");
    AppendXmlEscaped(&out, part.etag);
    out += "</ETag></Part>";
  }
  out += "</CompleteMultipartUpload>";
  return out;
}

}  // namespace tensorstash
