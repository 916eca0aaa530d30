#include "tensorstash/kvstore/registry.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "tensorstash/util/str_util.h"

namespace tensorstash {
namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, KvStoreOpener, std::less<>> openers;  // Guarded by mutex.
};

Registry& TheRegistry() {
  static Registry* registry = new Registry();  // never destroyed: used until the process ends
  return *registry;
}

size_t SchemeEnd(std::string_view text) {
  const size_t sep = text.find("://");
  if (sep == std::string_view::npos || sep == 0) return std::string_view::npos;
  if (!(text[0] >= 'a' && text[0] <= 'z')) return std::string_view::npos;
  for (size_t i = 1; i < sep; ++i) {
    const char c = text[i];
    const bool ok =
        (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '+' || c == '.' || c == '-';
    if (!ok) return std::string_view::npos;
  }
  return sep;
}

}  // namespace

bool HasUrlScheme(std::string_view text) { return SchemeEnd(text) != std::string_view::npos; }

Status RegisterKvStoreScheme(std::string scheme, KvStoreOpener opener) {
  Registry& registry = TheRegistry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  if (!registry.openers.emplace(scheme, std::move(opener)).second) {
    return AlreadyExistsError(StrCat("a store is already registered for scheme '", scheme, "'"));
  }
  return OkStatus();
}

KvStoreDriverRegistration::KvStoreDriverRegistration(Status (*register_driver)()) {
  const Status status = register_driver();
  // A scheme taken twice is a build that links a driver twice: fail loudly, at start-up.
  if (!status.ok()) {
    std::fprintf(stderr, "tensorstash: %s\n", status.ToString().c_str());
    std::abort();
  }
}

std::vector<std::string> RegisteredKvStoreSchemes() {
  Registry& registry = TheRegistry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  std::vector<std::string> schemes;
  for (const auto& [scheme, opener] : registry.openers) schemes.push_back(scheme);
  return schemes;
}

Result<std::unique_ptr<KvStore>> OpenKvStore(std::string_view url, OpenStoreOptions options) {
  if (url.empty()) return InvalidArgumentError("empty store URL or path");
  const size_t end = SchemeEnd(url);
  const std::string_view scheme = end == std::string_view::npos ? "file" : url.substr(0, end);
  const std::string_view rest = end == std::string_view::npos ? url : url.substr(end + 3);
  KvStoreOpener opener;
  {
    Registry& registry = TheRegistry();
    std::lock_guard<std::mutex> lock(registry.mutex);
    auto it = registry.openers.find(scheme);
    if (it != registry.openers.end()) opener = it->second;
  }
  if (!opener) {
    return InvalidArgumentError(StrCat(
        "no store serves '", scheme, "://' URLs such as '", url, "'; the schemes there are: ",
        StrJoin(RegisteredKvStoreSchemes(), ", "), " (and plain paths)"));
  }
  return opener(rest, options);
}

Status CheckDriverOptions(std::string_view scheme, std::string_view rest,
                          const OpenStoreOptions& options,
                          std::initializer_list<std::string_view> known) {
  for (const auto& [name, value] : options.driver_options) {
    if (std::find(known.begin(), known.end(), name) != known.end()) continue;
    return InvalidArgumentError(StrCat(
        "opening ", scheme, "://", rest, ": unknown store option '", name, "' (",
        known.size() == 0 ? std::string("this store takes none")
                          : StrCat("it takes ", StrJoin(std::vector<std::string_view>(known), ", ")),
        ")"));
  }
  return OkStatus();
}

Result<StepUrl> SplitStepUrl(std::string_view url) {
  if (url.empty()) return InvalidArgumentError("empty checkpoint path");
  const size_t end = SchemeEnd(url);
  if (end != std::string_view::npos && url.substr(0, end) != "file") {
    std::string_view rest = url.substr(end + 3);
    while (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
    const size_t slash = rest.rfind('/');
    if (rest.empty() || slash == std::string_view::npos || slash + 1 == rest.size()) {
      return InvalidArgumentError(StrCat("'", url, "' names no step folder: give '",
                                         url.substr(0, end + 3), "<root>/<step>'"));
    }
    return StepUrl{StrCat(url.substr(0, end + 3), rest.substr(0, slash)),
                   std::string(rest.substr(slash + 1))};
  }
  const std::string_view path = end == std::string_view::npos ? url : url.substr(end + 3);
  std::error_code error;
  std::filesystem::path full =
      std::filesystem::absolute(std::filesystem::path(std::string(path)), error).lexically_normal();
  if (error) return InvalidArgumentError(StrCat("bad path '", url, "': ", error.message()));
  if (!full.has_filename()) full = full.parent_path();  // "dir/" -> "dir"
  if (!full.has_filename() || full == full.root_path()) {
    return InvalidArgumentError(StrCat("'", url, "' is not a step folder path"));
  }
  return StepUrl{full.parent_path().string(), full.filename().string()};
}

}  // namespace tensorstash
