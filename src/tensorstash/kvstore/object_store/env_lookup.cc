#include "tensorstash/kvstore/object_store/env_lookup.h"

#include <cstdlib>
#include <memory>
#include <utility>

namespace tensorstash {

EnvLookup ProcessEnv() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

EnvLookup FixedEnv(std::map<std::string, std::string> variables) {
  auto shared = std::make_shared<const std::map<std::string, std::string>>(std::move(variables));
  return [shared](const std::string& name) -> std::optional<std::string> {
    const auto it = shared->find(name);
    if (it == shared->end()) return std::nullopt;
    return it->second;
  };
}

}  // namespace tensorstash
