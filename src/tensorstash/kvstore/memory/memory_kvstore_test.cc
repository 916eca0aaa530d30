// The memory backend runs the conformance suites (kvstore_conformance.h), with and without
// rename support (the latter stands for an object store).
#include "tensorstash/kvstore/memory/memory_kvstore.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tensorstash/testing/kvstore_conformance.h"

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

TS_INSTANTIATE_KVSTORE_READ_CONFORMANCE(
    Memory,
    std::vector<ReadableKvStoreBackend>(
        {{"Memory",
          [](const std::string&,
             const std::map<std::string, std::string>& contents) -> std::unique_ptr<KvStore> {
            auto store = std::make_unique<MemoryKvStore>();
            for (const auto& [key, value] : contents) {
              if (Status written = store->Write(key, value); !written.ok()) {
                ADD_FAILURE() << written;
                return nullptr;
              }
            }
            return store;
          }}}));

}  // namespace tensorstash
