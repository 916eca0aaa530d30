// The memory backend runs the conformance suite (kvstore_conformance.h), with and without
// rename support (the latter stands for an object store).
#include "tensorstash/kvstore/memory/memory_kvstore.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tensorstash/kvstore/kvstore_conformance.h"

namespace tensorstash {

TS_INSTANTIATE_KVSTORE_CONFORMANCE(
    Memory, std::vector<KvStoreBackend>(
                {{"Memory",
                  [](const std::string&) -> std::unique_ptr<KvStore> {
                    return std::make_unique<MemoryKvStore>();
                  }},
                 {"MemoryNoRename", [](const std::string&) -> std::unique_ptr<KvStore> {
                    return std::make_unique<MemoryKvStore>(/*supports_rename=*/false);
                  }}}));

}  // namespace tensorstash
