#include "tensorstash/kvstore/object_store/driver_options.h"

#include "tensorstash/util/str_util.h"

namespace tensorstash {

Result<bool> ParseBoolOption(std::string_view name, std::string_view value,
                             std::string_view where) {
  if (value == "true" || value == "1") return true;
  if (value == "false" || value == "0") return false;
  return InvalidArgumentError(StrCat("opening ", where, ": the store option '", name, "' is '",
                                     value, "', not true or false"));
}

Result<uint64_t> ParseCountOption(std::string_view name, std::string_view value, uint64_t min,
                                  uint64_t max, std::string_view where) {
  uint64_t count = 0;
  if (!ParseInt(value, &count) || count < min || count > max) {
    return InvalidArgumentError(StrCat("opening ", where, ": the store option '", name,
                                       "' is '", value, "', not a whole number from ", min,
                                       " to ", max));
  }
  return count;
}

}  // namespace tensorstash
