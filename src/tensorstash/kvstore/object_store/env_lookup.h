// The environment as object-store drivers read it (credential chains, emulator hosts): a lookup
// function, injectable so that tests do not touch the real environment.
//
// Thread-safety: ProcessEnv's lookup reads the environment with getenv (safe while nothing sets
// variables); FixedEnv's lookup is immutable.
#ifndef TENSORSTASH_KVSTORE_OBJECT_STORE_ENV_LOOKUP_H_
#define TENSORSTASH_KVSTORE_OBJECT_STORE_ENV_LOOKUP_H_

#include <functional>
#include <map>
#include <optional>
#include <string>

namespace tensorstash {

// Reads a variable of the environment: its value, or nullopt when it is not set.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// The process environment (getenv).
EnvLookup ProcessEnv();

// A fixed environment holding exactly `variables` (tests; explicit configurations).
EnvLookup FixedEnv(std::map<std::string, std::string> variables);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_OBJECT_STORE_ENV_LOOKUP_H_
