// A standalone driver for a fuzz target's LLVMFuzzerTestOneInput: runs it once on every file of
// the directories (or files) given, in name order, the way libFuzzer replays a corpus before it
// starts mutating. Linked into each target in the normal build (no clang, no libFuzzer), so the
// unit suite replays every seed and every earlier finding on every run (tests/fuzz/replay).
//
//   replay_TARGET PATH... [--optional PATH...]
//
// A PATH before --optional must exist and, all of them together, hold at least one file: an
// empty or mistyped corpus must not pass as "nothing failed". A PATH after --optional may be
// missing (tests/fuzz/regressions/TARGET exists only once the target found something).
// A property violation aborts inside the target, as under libFuzzer; the input being run is
// printed first, so the log names it.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);
// Optional in a target (fuzz_manifest has one); libFuzzer calls it once before any input.
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);

namespace fs = std::filesystem;

namespace {

/// The files of `path` (itself when it is a file; a directory's regular files, sorted by name).
bool collect(const fs::path& path, bool optional, std::vector<fs::path>& out) {
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (!fs::exists(st)) {
    if (optional) return true;
    std::fprintf(stderr, "replay: %s does not exist\n", path.c_str());
    return false;
  }
  if (fs::is_regular_file(st)) {
    out.push_back(path);
    return true;
  }
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(path, ec))
    if (e.is_regular_file()) files.push_back(e.path());
  if (ec) {
    std::fprintf(stderr, "replay: cannot list %s: %s\n", path.c_str(), ec.message().c_str());
    return false;
  }
  std::sort(files.begin(), files.end());
  out.insert(out.end(), files.begin(), files.end());
  return true;
}

bool read_file(const fs::path& p, std::vector<std::uint8_t>& bytes) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return false;
  bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return !in.bad();
}

}  // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize != nullptr) (void)LLVMFuzzerInitialize(&argc, &argv);
  std::vector<fs::path> required, optional;
  bool after_optional = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--optional") {
      after_optional = true;
      continue;
    }
    if (!collect(arg, after_optional, after_optional ? optional : required)) return 2;
  }
  if (required.empty()) {
    std::fprintf(stderr, "replay: no input files (usage: %s PATH... [--optional PATH...])\n", argv[0]);
    return 2;
  }
  required.insert(required.end(), optional.begin(), optional.end());
  std::vector<std::uint8_t> bytes;
  for (const auto& p : required) {
    if (!read_file(p, bytes)) {
      std::fprintf(stderr, "replay: cannot read %s\n", p.c_str());
      return 2;
    }
    std::fprintf(stderr, "replay: %s (%zu bytes)\n", p.c_str(), bytes.size());
    // A copy the size of the input exactly, as libFuzzer gives it, so ASan sees a read past it.
    const std::vector<std::uint8_t> input(bytes);
    (void)LLVMFuzzerTestOneInput(input.data(), input.size());
  }
  std::fprintf(stderr, "replay: %zu inputs passed\n", required.size());
  return 0;
}
