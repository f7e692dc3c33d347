// libFuzzer target: the bench's manifest parsers (bench/manifest.cpp) on arbitrary bytes.
//
// Byte 0 chooses the entry point, the rest is the content:
//   0  parse_safetensors in memory (the content is the whole file: 8-byte length, header, data)
//   1  parse_json_manifest in memory, as "<tmp>/model.safetensors.index.json": a weight_map
//      index reads its shards next to it, and a valid shard waits there (shard.safetensors)
//   2  load_manifest on a temporary "input.safetensors" (read_safetensors: reads the length,
//      then only the header, from the file)
//   3  load_manifest on a temporary "input" without extension (sniffs JSON by its first '{')
// The parsers must return a manifest or throw refit::error; any other exception, crash or
// sanitizer report is a bug. An accepted manifest is checked for what its users rely on.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "bench/bench.hpp"
#include "refit/error.hpp"

namespace fs = std::filesystem;
namespace bench = refit::bench;

namespace {

fs::path scratch;

[[noreturn]] void property_failed(const char* what) {
  std::fprintf(stderr, "fuzz_manifest: property violated: %s\n", what);
  std::abort();
}

#define FUZZ_ASSERT(cond)                \
  do {                                   \
    if (!(cond)) property_failed(#cond); \
  } while (0)

void write_file(const fs::path& p, std::string_view content) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(content.data(), static_cast<std::streamsize>(content.size()));
  if (!out) property_failed("cannot write the scratch file");
}

// A well-formed shard: two tensors, 8 bytes of data.
std::string shard_bytes() {
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]}})";
  std::string s(8, '\0');
  const std::uint64_t n = header.size();
  std::memcpy(s.data(), &n, 8);
  return s + header + std::string(8, '\x01');
}

void check(const bench::manifest& m, bool with_files) {
  FUZZ_ASSERT(!m.entries.empty());
  for (const auto& e : m.entries) {
    FUZZ_ASSERT(refit::checked_nbytes(e.meta.type, e.meta.shape).has_value());
    if (with_files) FUZZ_ASSERT(e.file >= 0 && static_cast<std::size_t>(e.file) < m.files.size());
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // One directory per process: libFuzzer's -jobs/-fork workers run side by side.
  scratch = fs::temp_directory_path() / ("refit-fuzz-manifest-" + std::to_string(::getpid()));
  fs::create_directories(scratch);
  write_file(scratch / "shard.safetensors", shard_bytes());
  std::atexit([] {
    std::error_code ec;
    fs::remove_all(scratch, ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::string_view content(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (data[0] & 3) {
      case 0: {
        const auto m = bench::parse_safetensors(content.data(), content.size(), content.size(), "fuzz.safetensors");
        check(m, true);
        // Entries come in data-offset order and lie inside the file.
        std::uint64_t last = 0;
        for (const auto& e : m.entries) {
          FUZZ_ASSERT(e.offset >= last || e.meta.nbytes() == 0);
          FUZZ_ASSERT(e.offset + e.meta.nbytes() <= content.size());
          if (e.meta.nbytes() != 0) last = e.offset + e.meta.nbytes();
        }
        break;
      }
      case 1: {
        const auto m = bench::parse_json_manifest(content, (scratch / "model.safetensors.index.json").string(),
                                                  refit::dtype::bf16);
        check(m, !m.files.empty());
        break;
      }
      case 2:
      case 3: {
        const fs::path p = scratch / ((data[0] & 3) == 2 ? "input.safetensors" : "input");
        write_file(p, content);
        const auto m = bench::load_manifest(p.string());
        check(m, !m.files.empty());
        break;
      }
    }
  } catch (const refit::error&) {
    // Rejected with the library's own error, as a bad file should be.
  }
  return 0;
}
