// Stores opened by URL, in one place: every front (the CLI, the Python bindings) opens its
// stores here, and no front constructs a backend itself.
//
// A URL is "<scheme>://<rest>", or a plain path, which is a local folder (the file backend).
// Each driver registers its scheme from its own folder, at static initialization, with a
// KvStoreDriverRegistration (file/, memory/, s3/); this file knows none of them. The build links
// the driver libraries whole (CMake's WHOLE_ARCHIVE), so that a static link keeps a driver that
// nothing else refers to; a driver left out of the build (TENSORSTASH_WITH_S3=OFF) is a scheme
// that OpenKvStore reports as unknown.
//
//   file://<path> or <path>   the folder <path> (FileKvStore); relative paths are taken from the
//                             working directory
//   memory://<name>           an in-memory store named <name>, shared by every open of the same
//                             name in the process and kept until the process ends
//
// Thread-safety: every function may be called from any thread.
#ifndef TENSORSTASH_KVSTORE_REGISTRY_H_
#define TENSORSTASH_KVSTORE_REGISTRY_H_

#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tensorstash/kvstore/kvstore.h"
#include "tensorstash/util/status.h"

namespace tensorstash {

struct OpenStoreOptions {
  // Create the store's root when it does not exist (file: mkdir -p). Otherwise a missing root
  // is NotFound.
  bool create = false;
  // Settings for this one store, by name, over the driver's process-wide defaults (s3: endpoint,
  // region, path_style, profile, access_key_id, secret_access_key, session_token, anonymous;
  // kvstore/s3/s3_kvstore.h). Each driver checks them (CheckDriverOptions): a name it does not
  // know, or a value it cannot take, is InvalidArgument naming it. file and memory take none.
  std::map<std::string, std::string> driver_options = {};
};

// For a driver's opener: InvalidArgument naming the first of `options.driver_options` that is
// not in `known` (and the names that are), for the store "<scheme>://<rest>"; else OK.
Status CheckDriverOptions(std::string_view scheme, std::string_view rest,
                          const OpenStoreOptions& options,
                          std::initializer_list<std::string_view> known);

// Opens the store whose root `rest` names (the URL after "<scheme>://").
using KvStoreOpener =
    std::function<Result<std::unique_ptr<KvStore>>(std::string_view rest, const OpenStoreOptions&)>;

// Registers `opener` for URLs "<scheme>://...". AlreadyExists when the scheme is taken.
Status RegisterKvStoreScheme(std::string scheme, KvStoreOpener opener);

// Registers a driver while the program starts: a namespace-scope
//   const KvStoreDriverRegistration kRegistered(&RegisterS3KvStore);
// in the driver's .cc. Aborts with a message when `register_driver` fails (a scheme taken twice).
struct KvStoreDriverRegistration {
  explicit KvStoreDriverRegistration(Status (*register_driver)());
};

// The registered schemes, sorted ("file", "memory", ...).
std::vector<std::string> RegisteredKvStoreSchemes();

// Opens the store at `url`. InvalidArgument for an empty URL, and for a scheme no backend
// serves, naming the schemes there are (so "s3://bucket/run" never becomes a local folder named
// "s3:"); the backend's errors otherwise (file: NotFound for a missing folder without create).
Result<std::unique_ptr<KvStore>> OpenKvStore(std::string_view url, OpenStoreOptions options = {});

// A step's location: the URL of the store holding it, and its key there.
struct StepUrl {
  std::string root;  // a URL or an absolute, normalized path
  std::string step;  // one key segment
};

// Splits the URL of a step folder ("/ckpt/0000001000", "memory://run/0000001000") into its
// root and its last segment. Plain paths are made absolute and normalized first ("." is the
// working directory, under its parent). InvalidArgument when nothing is left for the step (a
// filesystem root, "memory://").
Result<StepUrl> SplitStepUrl(std::string_view url);

// True when `text` starts with "<scheme>://", scheme being [a-z][a-z0-9+.-]*.
bool HasUrlScheme(std::string_view text);

}  // namespace tensorstash

#endif  // TENSORSTASH_KVSTORE_REGISTRY_H_
