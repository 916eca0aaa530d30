// Parsing of the values of OpenStoreOptions::driver_options (kvstore/registry.h) that
// object-store drivers share; an unknown name is CheckDriverOptions' (registry.h). A value that
// does not parse is InvalidArgument naming the option, its value and the store `where`.
//
// Thread-safety: pure functions.
#ifndef TENSORSTASH_KVSTORE_OBJECT_STORE_DRIVER_OPTIONS_H_
#define TENSORSTASH_KVSTORE_OBJECT_STORE_DRIVER_OPTIONS_H_

#include <cstdint>
#include <string_view>

#include "tensorstash/util/status.h"

namespace tensorstash {

// "true"/"1" or "false"/"0".
Result<bool> ParseBoolOption(std::string_view name, std::string_view value,
                             std::string_view where);
// A decimal count in [min, max].
Result<uint64_t> ParseCountOption(std::string_view name, std::string_view value, uint64_t min,
                                  uint64_t max, std::string_view where);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_OBJECT_STORE_DRIVER_OPTIONS_H_
