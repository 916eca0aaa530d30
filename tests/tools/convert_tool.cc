// convert_tool SRC_DTYPE DST_DTYPE IN_FILE OUT_FILE
//
// Converts raw little-endian SRC elements with ConvertElements and writes raw DST bytes, so the
// Python cross-check can compare tensorstash against numpy / ml_dtypes. Exit code 1 on any error,
// with the message on stderr.
#include <bit>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "tensorstash/array/convert.h"
#include "tensorstash/array/dtype.h"

// The files are little-endian and ConvertElements works on host-order values.
static_assert(std::endian::native == std::endian::little, "assumes a little-endian host");

namespace {

int Fail(const std::string& message) {
  std::cerr << "convert_tool: " << message << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) return Fail("usage: convert_tool SRC_DTYPE DST_DTYPE IN_FILE OUT_FILE");
  auto from = tensorstash::ParseDType(argv[1]);
  if (!from.ok()) return Fail(std::string(from.status().message()));
  auto to = tensorstash::ParseDType(argv[2]);
  if (!to.ok()) return Fail(std::string(to.status().message()));

  std::ifstream in(argv[3], std::ios::binary);
  if (!in) return Fail(std::string("cannot open ") + argv[3]);
  const std::vector<char> input((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  if (in.bad()) return Fail(std::string("cannot read ") + argv[3]);

  const size_t in_size = tensorstash::ItemSize(*from);
  if (input.size() % in_size != 0) {
    return Fail(std::string(argv[3]) + ": size " + std::to_string(input.size()) +
                " is not a multiple of the " + argv[1] + " item size");
  }
  const size_t count = input.size() / in_size;
  std::vector<char> output(count * tensorstash::ItemSize(*to));
  const tensorstash::Status status =
      tensorstash::ConvertElements(*from, input.data(), *to, output.data(), count, argv[3]);
  if (!status.ok()) return Fail(status.ToString());

  std::ofstream out(argv[4], std::ios::binary | std::ios::trunc);
  out.write(output.data(), static_cast<std::streamsize>(output.size()));
  out.close();
  if (!out) return Fail(std::string("cannot write ") + argv[4]);
  return 0;
}
