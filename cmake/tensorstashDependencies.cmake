# The libraries tensorstash links, found the same way by the build (CMakeLists.txt) and by an
# installed tensorstashConfig.cmake, so that a consumer of the static library links what it was
# built against. All come from Debian's -dev packages (scripts/setup.sh).
find_package(Threads REQUIRED)
find_package(absl REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(ZLIB REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(ZSTD REQUIRED IMPORTED_TARGET libzstd)
# Decoding tree.json (src/tensorstash/format/tree.cc), megabytes for a step of many arrays:
# simdjson parses it in a tenth of nlohmann's time.
pkg_check_modules(SIMDJSON REQUIRED IMPORTED_TARGET simdjson)
# zarr codecs (src/tensorstash/format/zarr/): blosc and gzip/zlib.
pkg_check_modules(BLOSC REQUIRED IMPORTED_TARGET blosc)
# Only for the parts that need them (TENSORSTASH_WITH_S3, TENSORSTASH_WITH_GCS,
# TENSORSTASH_WITH_TIERS; all default to ON, and an installed package records how it was built).
if(NOT DEFINED TENSORSTASH_WITH_S3)
  set(TENSORSTASH_WITH_S3 ON)
endif()
if(NOT DEFINED TENSORSTASH_WITH_GCS)
  set(TENSORSTASH_WITH_GCS ON)
endif()
if(NOT DEFINED TENSORSTASH_WITH_TIERS)
  set(TENSORSTASH_WITH_TIERS ON)
endif()
if(TENSORSTASH_WITH_S3 OR TENSORSTASH_WITH_GCS OR TENSORSTASH_WITH_TIERS)
  # The HTTP transport (src/tensorstash/kvstore/http/): libcurl is the client of S3, GCS and of the
  # peers, libmicrohttpd the server of a process's committed local steps.
  pkg_check_modules(CURL REQUIRED IMPORTED_TARGET libcurl)
  pkg_check_modules(MICROHTTPD REQUIRED IMPORTED_TARGET libmicrohttpd)
endif()
if(TENSORSTASH_WITH_S3 OR TENSORSTASH_WITH_GCS)
  # SHA-256 and HMAC of the S3 request signer (src/tensorstash/kvstore/s3/sigv4.h); the RS256
  # JWTs of GCS service accounts (src/tensorstash/kvstore/gcs/gcs_credentials.cc).
  find_package(OpenSSL REQUIRED COMPONENTS Crypto)
endif()
if(TENSORSTASH_WITH_S3)
  # The XML answers of S3 (listings, multipart uploads, errors): src/tensorstash/kvstore/s3/.
  pkg_check_modules(EXPAT REQUIRED IMPORTED_TARGET expat)
endif()
# xxHash (XXH3-128, the chunk content identity of incremental steps: util/chunk_digest.cc) is used
# header-only (XXH_INLINE_ALL), so nothing is linked and an installed package needs only the header.
if(NOT TENSORSTASH_XXHASH_INCLUDE_DIR)
  find_path(TENSORSTASH_XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
endif()
# ISA-L (CRC-32C) has no CMake or pkg-config files in Debian: an imported target of our own.
if(NOT TARGET tensorstash_deps::isal)
  find_path(TENSORSTASH_ISAL_INCLUDE_DIR isa-l/crc.h REQUIRED)
  find_library(TENSORSTASH_ISAL_LIBRARY NAMES isal REQUIRED)
  add_library(tensorstash_deps::isal UNKNOWN IMPORTED)
  set_target_properties(tensorstash_deps::isal PROPERTIES
    IMPORTED_LOCATION "${TENSORSTASH_ISAL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${TENSORSTASH_ISAL_INCLUDE_DIR}")
endif()
