#include "tensorstash/format/dcp/pickle.h"

#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tensorstash/testing/status_test_macros.h"
#include "tensorstash/testing/test_files.h"

namespace tensorstash {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using std::string_literals::operator""s;

// The data.pkl torch 2.13's torch.save wrote for torch.arange(20)[5:9] inside a DCP checkpoint
// (tests/tools/make_dcp_checkpoints.py, "model.view").
constexpr char kViewDataPkl[] =
    "\x80\x02\x63\x74\x6f\x72\x63\x68\x2e\x5f\x75\x74\x69\x6c\x73\x0a\x5f\x72\x65\x62\x75\x69"
    "\x6c\x64\x5f\x74\x65\x6e\x73\x6f\x72\x5f\x76\x32\x0a\x71\x00\x28\x28\x58\x07\x00\x00\x00"
    "\x73\x74\x6f\x72\x61\x67\x65\x71\x01\x63\x74\x6f\x72\x63\x68\x0a\x4c\x6f\x6e\x67\x53\x74"
    "\x6f\x72\x61\x67\x65\x0a\x71\x02\x58\x01\x00\x00\x00\x30\x71\x03\x58\x03\x00\x00\x00\x63"
    "\x70\x75\x71\x04\x4b\x04\x74\x71\x05\x51\x4b\x00\x4b\x04\x85\x71\x06\x4b\x01\x85\x71\x07"
    "\x89\x63\x63\x6f\x6c\x6c\x65\x63\x74\x69\x6f\x6e\x73\x0a\x4f\x72\x64\x65\x72\x65\x64\x44"
    "\x69\x63\x74\x0a\x71\x08\x29\x52\x71\x09\x74\x71\x0a\x52\x71\x0b\x2e";

std::string_view View() { return std::string_view(kViewDataPkl, sizeof(kViewDataPkl) - 1); }

Result<PickleTree> Decode(std::string_view bytes) {
  return DecodePickle(bytes, DcpPickleGlobals(), "test.pkl");
}

TEST(Pickle, DecodesTorchSaveTensorDescription) {
  Result<PickleTree> tree = Decode(View());
  TS_ASSERT_OK(tree.status());
  const PickleValue& root = tree->root();
  ASSERT_TRUE(root.IsObjectOf("torch._utils._rebuild_tensor_v2"));
  ASSERT_EQ(root.args->items.size(), 6u);
  const PickleValue* storage = root.args->items[0];
  ASSERT_TRUE(storage->Is(PickleKind::kPersistentId));
  const PickleValue* pid = storage->args;
  ASSERT_TRUE(pid->Is(PickleKind::kTuple));
  ASSERT_EQ(pid->items.size(), 5u);
  EXPECT_EQ(pid->items[0]->text, "storage");
  EXPECT_EQ(pid->items[1]->text, "torch.LongStorage");
  EXPECT_EQ(pid->items[2]->text, "0");
  EXPECT_EQ(pid->items[3]->text, "cpu");
  EXPECT_EQ(pid->items[4]->integer, 4);
  EXPECT_EQ(root.args->items[1]->integer, 0);                // storage offset
  EXPECT_EQ(root.args->items[2]->items[0]->integer, 4);      // size
  EXPECT_EQ(root.args->items[3]->items[0]->integer, 1);      // stride
  EXPECT_FALSE(root.args->items[4]->boolean);                // requires_grad
  EXPECT_TRUE(root.args->items[5]->IsObjectOf("collections.OrderedDict"));
}

TEST(Pickle, DecodesRealDcpMetadata) {
  std::string bytes =
      ReadFileToString(std::string(TS_TEST_DATA_DIR) + "/dcp/two_ranks/.metadata");
  ASSERT_FALSE(bytes.empty());
  Result<PickleTree> tree = Decode(bytes);
  TS_ASSERT_OK(tree.status());
  const PickleValue& root = tree->root();
  ASSERT_TRUE(root.IsObjectOf("torch.distributed.checkpoint.metadata.Metadata"));
  ASSERT_NE(root.state, nullptr);
  const PickleValue* sd = root.state->Find("state_dict_metadata");
  ASSERT_NE(sd, nullptr);
  const PickleValue* sharded = sd->Find("sharded");
  ASSERT_NE(sharded, nullptr);
  ASSERT_TRUE(sharded->IsObjectOf("torch.distributed.checkpoint.metadata.TensorStorageMetadata"));
  const PickleValue* chunks = sharded->state->Find("chunks");
  ASSERT_NE(chunks, nullptr);
  EXPECT_EQ(chunks->items.size(), 2u);
  const PickleValue* step = sd->Find("step");
  ASSERT_NE(step, nullptr);
  EXPECT_TRUE(step->IsObjectOf("torch.distributed.checkpoint.metadata.BytesStorageMetadata"));
  ASSERT_NE(root.state->Find("version"), nullptr);
  EXPECT_EQ(root.state->Find("version")->text, "1.0.0");
  const PickleValue* meta = root.state->Find("storage_meta");
  ASSERT_NE(meta, nullptr);
  EXPECT_TRUE(meta->state->Find("checkpoint_id")->IsObjectOf("pathlib.PosixPath"));
}

TEST(Pickle, EveryTruncationIsAnErrorNotACrash) {
  std::string bytes =
      ReadFileToString(std::string(TS_TEST_DATA_DIR) + "/dcp/single/.metadata");
  ASSERT_GT(bytes.size(), 100u);
  for (size_t n = 0; n < bytes.size(); ++n) {
    Result<PickleTree> tree = Decode(std::string_view(bytes).substr(0, n));
    ASSERT_FALSE(tree.ok()) << n;
    EXPECT_EQ(tree.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(tree.status().message(), HasSubstr("test.pkl"));
  }
  TS_EXPECT_OK(Decode(bytes).status());
}

TEST(Pickle, RefusesAGlobalOutsideTheAllowList) {
  // The classic: pickle.dumps of an object whose __reduce__ is (os.system, ("echo hi",)).
  std::string evil = "\x80\x02" "cos\nsystem\n" "X\x07\x00\x00\x00" "echo hi" "\x85R."s;
  Result<PickleTree> tree = Decode(evil);
  ASSERT_FALSE(tree.ok());
  EXPECT_EQ(tree.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tree.status().message(),
              AllOf(HasSubstr("test.pkl"), HasSubstr("os.system"), HasSubstr("at byte 2")));
  // The same through STACK_GLOBAL (protocol 4), hidden in a dict value.
  std::string evil4 = "\x80\x04\x95\x20\x00\x00\x00\x00\x00\x00\x00}\x8c\x01k"
                      "\x8c\x08" "builtins" "\x8c\x04" "eval" "\x93" "\x8c\x01x\x85R" "s."s;
  tree = Decode(evil4);
  ASSERT_FALSE(tree.ok());
  EXPECT_THAT(tree.status().message(), AllOf(HasSubstr("builtins.eval"), HasSubstr("at byte 31")));
  // A name that only starts like an allowed one.
  tree = Decode("\x80\x02" "ctorch\nSizeX\n" ")R.");
  ASSERT_FALSE(tree.ok());
  EXPECT_THAT(tree.status().message(), HasSubstr("torch.SizeX"));
}

TEST(Pickle, HostileLengthsAllocateNothing) {
  // BINUNICODE8 / BINBYTES8 / BYTEARRAY8 of 2^62 bytes, BINUNICODE of 4 GiB - 1.
  for (std::string op : {"\x8d"s, "\x8e"s, "\x96"s}) {
    std::string bytes = "\x80\x04" + op + "\x00\x00\x00\x00\x00\x00\x00\x40"s + "ab.";
    Result<PickleTree> tree = Decode(bytes);
    ASSERT_FALSE(tree.ok());
    EXPECT_THAT(tree.status().message(), AllOf(HasSubstr("truncated"), HasSubstr("at byte 2")));
  }
  Result<PickleTree> tree = Decode("\x80\x02X\xff\xff\xff\xff."s);
  ASSERT_FALSE(tree.ok());
  EXPECT_THAT(tree.status().message(), HasSubstr("truncated"));
  // LONG4 of 2^31 - 1 bytes and a 9-byte LONG1: ints past 64 bits.
  tree = Decode("\x80\x02\x8b\xff\xff\xff\x7f."s);
  ASSERT_FALSE(tree.ok());
  EXPECT_THAT(tree.status().message(), HasSubstr("past 64 bits"));
  tree = Decode("\x80\x02\x8a\x09\x01\x02\x03\x04\x05\x06\x07\x08\x09."s);
  ASSERT_FALSE(tree.ok());
  EXPECT_THAT(tree.status().message(), HasSubstr("past 64 bits"));
  // A memo index far out, stored then fetched, is fine (a map, not an array); one never
  // stored is an error.
  tree = Decode("\x80\x02N\x72\xff\xff\xff\xff" "0j\xff\xff\xff\xff."s);
  TS_ASSERT_OK(tree.status());
  EXPECT_TRUE(tree->root().Is(PickleKind::kNone));
  tree = Decode("\x80\x02j\x05\x00\x00\x00."s);
  ASSERT_FALSE(tree.ok());
  EXPECT_THAT(tree.status().message(), HasSubstr("memo index 5 was never stored"));
}

TEST(Pickle, Scalars) {
  // (None, True, False, -2 (BININT), 255 (BININT1), 65535 (BININT2), -129 (LONG1), 1.5, b'ab')
  std::string bytes =
      "\x80\x02(N\x88\x89J\xfe\xff\xff\xffK\xffM\xff\xff\x8a\x02\x7f\xff"
      "G\x3f\xf8\x00\x00\x00\x00\x00\x00" "C\x02" "abt."s;
  Result<PickleTree> tree = Decode(bytes);
  TS_ASSERT_OK(tree.status());
  const PickleValue& t = tree->root();
  ASSERT_TRUE(t.Is(PickleKind::kTuple));
  ASSERT_EQ(t.items.size(), 9u);
  EXPECT_TRUE(t.items[0]->Is(PickleKind::kNone));
  EXPECT_TRUE(t.items[1]->boolean);
  EXPECT_FALSE(t.items[2]->boolean);
  EXPECT_EQ(t.items[3]->integer, -2);
  EXPECT_EQ(t.items[4]->integer, 255);
  EXPECT_EQ(t.items[5]->integer, 65535);
  EXPECT_EQ(t.items[6]->integer, -129);
  EXPECT_EQ(t.items[7]->real, 1.5);
  EXPECT_EQ(t.items[8]->text, "ab");
  EXPECT_TRUE(t.items[8]->Is(PickleKind::kBytes));
  // An 8-byte LONG1: INT64_MIN.
  tree = Decode("\x80\x02\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80."s);
  TS_ASSERT_OK(tree.status());
  EXPECT_EQ(tree->root().integer, INT64_MIN);
}

TEST(Pickle, RefusesWhatItDoesNotSupport) {
  struct Case {
    std::string bytes;
    std::string message;
  };
  const Case cases[] = {
      {"\x80\x01N."s, "protocol 1"},
      {"\x80\x06N."s, "protocol 6"},
      {"\x80\x04\x8f."s, "opcode 0x8f"},       // EMPTY_SET
      {"\x80\x04\x82\x01."s, "opcode 0x82"},   // EXT1
      {"\x80\x05\x97."s, "opcode 0x97"},       // NEXT_BUFFER
      {"\x80\x02I1\n."s, "opcode 0x49"},       // text INT
      {"\x80\x02N"s, "no STOP"},
      {"\x80\x02NN."s, "STOP with 2 values"},
      {"\x80\x02(N."s, "1 marks"},
      {"\x80\x02]a."s, "stack underflow"},
      {"\x80\x02Na."s, "stack underflow"},
      {"\x80\x02)Na."s, "APPEND onto a tuple"},
      {"\x80\x02]NNs."s, "SETITEM onto a list"},
      {"\x80\x02}(Nu."s, "odd number"},
      {"\x80\x02X\x01\x00\x00\x00x)R."s, "a call of a str"},
      {"\x80\x02\x63torch\nSize\nNR."s, "arguments are a None"},
      {"\x80\x02N}b."s, "BUILD of a None"},
      {"\x80\x02\x63torch\nSize\n)R}b}b."s, "already built"},
      {"\x80\x02t."s, "no MARK"},
      {"\x80\x02\x63torch\nSize"s, "newline"},
      {"\x80\x04NN\x93."s, "not strings"},
  };
  for (const Case& c : cases) {
    Result<PickleTree> tree = Decode(c.bytes);
    ASSERT_FALSE(tree.ok()) << c.message;
    EXPECT_EQ(tree.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(tree.status().message(), HasSubstr(c.message));
  }
}

TEST(Pickle, HoldsACycleWithoutLeaking) {
  // l = []; l.append(l): EMPTY_LIST, BINPUT 0, BINGET 0, APPEND, STOP.
  Result<PickleTree> tree = Decode("\x80\x02]q\x00h\x00" "a."s);
  TS_ASSERT_OK(tree.status());
  const PickleValue& l = tree->root();
  ASSERT_EQ(l.items.size(), 1u);
  EXPECT_EQ(l.items[0], &l);
}

TEST(Pickle, SharedMemoizedValuesAreNotCopied) {
  // A tuple memoized once and used as the arguments of many calls: one node.
  std::string bytes = "\x80\x02(\x63torch\nSize\nq\x00K\x01K\x02\x86q\x01R"s;
  for (int i = 0; i < 100; ++i) bytes += "h\x00h\x01R"s;
  bytes += "l.";
  Result<PickleTree> tree = Decode(bytes);
  TS_ASSERT_OK(tree.status());
  ASSERT_EQ(tree->root().items.size(), 101u);
  EXPECT_EQ(tree->root().items[0]->args, tree->root().items[100]->args);
  EXPECT_LT(tree->node_count(), 250u);
}

}  // namespace
}  // namespace tensorstash
