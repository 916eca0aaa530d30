// The bodies of the libFuzzer targets, one function per parser of stored bytes. Each fuzz/*_fuzzer.cc
// is a thin LLVMFuzzerTestOneInput around one of them; the normal test suite
// (src/tensorstash/format/fuzz_replay_test.cc) replays the seed corpora and every regression
// input through the same functions, so a crash found once stays fixed without clang.
//
// Each function returns normally for any input; a bug shows up as a crash, a sanitizer report,
// or a failed TS_FUZZ_CHECK (which aborts with a message).
#ifndef TENSORSTASH_FUZZ_FUZZ_TARGETS_H_
#define TENSORSTASH_FUZZ_FUZZ_TARGETS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

namespace tensorstash {
namespace fuzz {

// DecodeIndex; a decoded index re-encodes to the same bytes.
void FuzzIndex(const uint8_t* data, size_t size);
// DecodeTreeJson and TreeNodeFromJson; what decodes re-encodes and decodes to the same arrays.
void FuzzTreeJson(const uint8_t* data, size_t size);
// DecodeCommitRecord; a decoded record re-encodes and decodes to an equal record.
void FuzzCommitRecord(const uint8_t* data, size_t size);
// DecodeChunk (zstd, none): the first 3 bytes give the raw size (<= 256 KiB), the rest the frame.
void FuzzChunkCodec(const uint8_t* data, size_t size);
// A whole step folder: the input is a bundle of files (EncodeBundle) put into a MemoryKvStore
// under "step/"; CheckpointReader opens it, and if that succeeds reads every array and verifies.
void FuzzStep(const uint8_t* data, size_t size);
// An OCDBT database: the input is a bundle (EncodeBundle) of files put under "db/";
// OcdbtKvStore opens it, and if that succeeds lists and reads every key.
void FuzzOcdbt(const uint8_t* data, size_t size);
// A foreign step (Orbax _METADATA over OCDBT or zarr folders, or a zarr group; zarr v2/v3
// metadata and codecs): the input is a bundle put under "step/"; OpenStepSource opens it, and if
// that succeeds reads every array and verifies.
void FuzzForeignStep(const uint8_t* data, size_t size);
// A safetensors file: ParseSafetensorsHeaderLength and ParseSafetensorsHeader; a parsed header's
// tensors tile the data section, and re-encode (EncodeSafetensorsHeader) to a header that parses
// to the same tensors. Then the file as `step/model.safetensors`, opened and read through
// OpenStepSource.
void FuzzSafetensorsHeader(const uint8_t* data, size_t size);
// A pickle (DCP's .metadata, torch.save's data.pkl): DecodePickle with DcpPickleGlobals; a
// decoded tree is walked (depth-bounded: a pickle can make cycles) and every node is reachable
// and of a known kind. Seeds: real DCP files from tests/tools/make_dcp_checkpoints.py.
void FuzzDcpPickle(const uint8_t* data, size_t size);
// A torch.save zip archive (one DCP .distcp item): ReadStoredZip; every entry listed lies
// inside the archive, and its CRC was checked.
void FuzzTorchZip(const uint8_t* data, size_t size);

// The bundle format of FuzzStep: repeated [u16 key length][key][u32 value length][value],
// little-endian. Decoding stops at the first record that does not fit.
std::string EncodeBundle(const std::map<std::string, std::string>& files);
std::map<std::string, std::string> DecodeBundle(std::string_view bytes);

}  // namespace fuzz
}  // namespace tensorstash

#endif  // TENSORSTASH_FUZZ_FUZZ_TARGETS_H_
