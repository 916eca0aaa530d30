#include "tensorstash/share/needs_exchange.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "tensorstash/coordination/collectives.h"
#include "tensorstash/util/base64.h"
#include "tensorstash/util/chunk_digest.h"

namespace tensorstash {

std::string NeedsDigest(std::string_view encoded) { return DigestHex(Xxh3Digest(encoded)); }

Result<JobNeeds> ExchangeNeeds(Coordinator& coordinator, std::string_view key_prefix,
                               const ProcessNeeds& mine, const std::vector<SharedArray>& arrays,
                               std::chrono::milliseconds timeout, NeedsExchangeStats* stats) {
  NeedsExchangeStats local;
  const std::string encoded = EncodeNeeds(mine);
  const std::string digest = NeedsDigest(encoded);
  const std::string boxes_prefix = std::string(key_prefix) + "boxes/";
  const std::string digest_prefix = std::string(key_prefix) + "digest/";
  const int n = coordinator.process_count();
  JobNeeds job;
  if (n == 1) {
    job.distinct.push_back(mine);
    job.list_of_process.push_back(0);
    if (stats != nullptr) *stats = NeedsExchangeStats{0, 0, 1};
    return job;
  }
  // The list before its digest: whoever sees the digest finds the list there.
  const std::string text = Base64Encode(encoded);
  TS_RETURN_IF_ERROR(coordinator.KeyValueSet(
      absl::StrCat(boxes_prefix, coordinator.process_index()), text));
  TS_RETURN_IF_ERROR(PublishValue(coordinator, digest_prefix, digest));
  local.bytes_sent = text.size() + digest.size();
  std::vector<int> others;
  for (int p = 0; p < n; ++p) {
    if (p != coordinator.process_index()) others.push_back(p);
  }
  TS_ASSIGN_OR_RETURN(auto digests,
                      CollectValues(coordinator, digest_prefix, others, timeout));
  digests[coordinator.process_index()] = digest;
  std::map<std::string, int> list_of_digest;
  job.list_of_process.resize(n);
  for (int p = 0; p < n; ++p) {
    local.bytes_received += p == coordinator.process_index() ? 0 : digests[p].size();
    auto [it, added] = list_of_digest.emplace(digests[p], static_cast<int>(job.distinct.size()));
    if (added) {
      if (digests[p] == digest) {  // (its own list: not read back)
        job.distinct.push_back(mine);
      } else {
        // Published before its digest, so it is there.
        TS_ASSIGN_OR_RETURN(std::string list_text,
                            coordinator.KeyValueGet(absl::StrCat(boxes_prefix, p), timeout));
        local.bytes_received += list_text.size();
        auto bytes = Base64Decode(list_text);
        if (!bytes.ok()) {
          return InvalidArgumentError(
              absl::StrCat("the boxes process ", p, " needs: ", bytes.status().message()));
        }
        TS_ASSIGN_OR_RETURN(ProcessNeeds needs, DecodeNeeds(*bytes, arrays, p));
        job.distinct.push_back(std::move(needs));
      }
    }
    job.list_of_process[p] = it->second;
  }
  local.distinct_lists = static_cast<int>(job.distinct.size());
  if (stats != nullptr) *stats = local;
  return job;
}

}  // namespace tensorstash
