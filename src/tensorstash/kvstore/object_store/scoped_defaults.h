// Process-wide settings of a driver scoped by URL prefix (tensorstash.configure_s3(prefix=...)):
// a URL gets the settings of the longest prefix it lies under, and the ones set without a prefix
// when none covers it. "s3://b" covers "s3://b/run", not "s3://bb".
//
// Thread-safety: every method may be called from several threads at once.
#ifndef TENSORSTASH_KVSTORE_OBJECT_STORE_SCOPED_DEFAULTS_H_
#define TENSORSTASH_KVSTORE_OBJECT_STORE_SCOPED_DEFAULTS_H_

#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

namespace tensorstash {

// Whether `url` is `prefix` or lies under it; every URL lies under "".
inline bool UnderUrlPrefix(std::string_view url, std::string_view prefix) {
  if (prefix.empty()) return true;
  if (!url.starts_with(prefix)) return false;
  return url.size() == prefix.size() || prefix.ends_with('/') || url[prefix.size()] == '/';
}

template <typename Defaults>
class ScopedDefaults {
 public:
  // Replaces the settings of `url_prefix` ("" = every URL without settings of its own; trailing
  // '/' ignored).
  void Set(std::string url_prefix, Defaults defaults) {
    while (url_prefix.ends_with('/')) url_prefix.pop_back();
    std::lock_guard<std::mutex> lock(mu_);
    by_prefix_[std::move(url_prefix)] = std::move(defaults);
  }
  // The settings of the longest prefix `url` lies under; Defaults() when none.
  Defaults For(std::string_view url) const {
    std::lock_guard<std::mutex> lock(mu_);
    const Defaults* best = nullptr;
    size_t best_size = 0;
    for (const auto& [prefix, defaults] : by_prefix_) {
      if (!UnderUrlPrefix(url, prefix)) continue;
      if (best == nullptr || prefix.size() > best_size) {
        best = &defaults;
        best_size = prefix.size();
      }
    }
    return best == nullptr ? Defaults() : *best;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, Defaults> by_prefix_;  // guarded by mu_
};

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_OBJECT_STORE_SCOPED_DEFAULTS_H_
