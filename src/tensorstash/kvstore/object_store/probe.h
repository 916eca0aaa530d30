// What a probe of an object store found (which conditional requests the server honours), kept
// for the process per store scheme, endpoint and bucket: a probe writes and deletes an object, so
// it runs once per server and bucket, not at every open.
//
// Thread-safety: ProbeOnce may be called from several threads at once. One probe of a key runs at
// a time and the others asking for that key wait for it and use what it found; probes of
// different keys run at the same time (a slow or unreachable server delays only its own key).
#ifndef TENSORSTASH_KVSTORE_OBJECT_STORE_PROBE_H_
#define TENSORSTASH_KVSTORE_OBJECT_STORE_PROBE_H_

#include <functional>
#include <string>

#include "tensorstash/util/status.h"

namespace tensorstash {

struct ProbeFindings {
  bool conditional_write = true;  // create-only writes are refused when the object exists
  bool generations = true;        // reads of one version and ranges are honoured
  std::string finding;            // why a capability is off, for errors ("" when none is)
};

// Which server and bucket a probe is about. The scheme ("gs", "s3") is part of it because two
// drivers pointed at one endpoint speak different protocols and may find different things.
struct ProbeKey {
  std::string scheme;
  std::string endpoint;
  std::string bucket;
};

// The findings of this process's probe of `key`, running `probe` when there are none yet. A
// failed probe is not kept (the next call probes again) and its error is returned.
Result<ProbeFindings> ProbeOnce(const ProbeKey& key,
                                const std::function<Result<ProbeFindings>()>& probe);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_OBJECT_STORE_PROBE_H_
