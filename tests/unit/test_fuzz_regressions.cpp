// Inputs the fuzz targets (tests/fuzz, `tools/dev fuzz`) found, kept as plain test cases with the
// bytes inline and the exact error now raised. The raw inputs are also in
// tests/fuzz/regressions/<target>/, which every fuzz run replays first.
//
// The manifest cases need the bench's parser: they compile where bench/bench.hpp is on the include
// path (the fuzz build's fuzz_regressions executable; bench_unit if it lists this file), and are
// left out of the `unit` executable, which does not link the bench.
#include <catch2/catch.hpp>

#include <string>
#include <string_view>

#include "refit/error.hpp"
#include "refit/model.hpp"
#include "wire/wire.hpp"

#if __has_include("bench/bench.hpp")
#define REFIT_TEST_MANIFEST 1
#include "bench/bench.hpp"
#endif

namespace wire = refit::wire;
using refit::errc;

namespace {

// Runs `f`, which must throw refit::error; returns its code and full message.
template <class F>
std::pair<errc, std::string> error_of(F&& f) {
  try {
    f();
  } catch (const refit::error& e) {
    return {e.code(), e.what()};
  }
  FAIL("no refit::error was thrown");
  return {};
}

}  // namespace

#if REFIT_TEST_MANIFEST
namespace {

std::string safetensors_of(std::string_view header) {
  std::string s(8, '\0');
  for (std::size_t i = 0; i < 8; ++i) s[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return s.append(header);
}

}  // namespace

// fuzz_manifest, regressions/fuzz_manifest/number_out_of_range (mode byte 1: JSON in memory,
// found by the fuzzer in its first 5-minute run). A number no double holds made nlohmann throw
// json::out_of_range, which the parser did not catch (only parse_error): not a refit::error, and
// refit-bench died in std::terminate.
TEST_CASE("a JSON manifest with a number too large for a double is refused", "[fuzz][bench]") {
  const auto [code, what] =
      error_of([] { (void)refit::bench::parse_json_manifest("4e444", "/ckpt/model.json", refit::dtype::bf16); });
  CHECK(code == errc::invalid_argument);
  CHECK(what ==
        "manifest /ckpt/model.json: not valid JSON: [json.exception.out_of_range.406] number overflow "
        "parsing '4e444'");
}

TEST_CASE("a safetensors header with a number too large for a double is refused", "[fuzz][bench]") {
  const std::string file = safetensors_of(R"({"t":{"dtype":"F32","shape":[1e999],"data_offsets":[0,4]}})");
  const auto [code, what] =
      error_of([&] { (void)refit::bench::parse_safetensors(file.data(), file.size(), file.size(), "m.safetensors"); });
  CHECK(code == errc::invalid_argument);
  CHECK(what ==
        "manifest m.safetensors: header is not valid JSON: [json.exception.out_of_range.406] number "
        "overflow parsing '1e999'");
}

// regressions/fuzz_manifest/deep_nesting (a hand-made input run through fuzz_manifest: the
// fuzzer's inputs stay too short to reach it). 20,000 nested arrays overflowed the stack under
// ASan, inside ojson::parse: ordered_json copies values recursively when an object grows. A
// 100 MB header allows 50 million levels, enough without ASan too.
TEST_CASE("JSON nested deeper than any manifest is refused before it overflows the stack", "[fuzz][bench]") {
  const std::size_t depth = 200'000;
  const std::string nested = std::string(depth, '[') + std::string(depth, ']');
  {
    const std::string text = R"({"t":{"dtype":)" + nested + R"(,"shape":[]}})";
    const auto [code, what] =
        error_of([&] { (void)refit::bench::parse_json_manifest(text, "/ckpt/model.json", refit::dtype::bf16); });
    CHECK(code == errc::invalid_argument);
    CHECK(what == "manifest /ckpt/model.json: JSON nests deeper than 64 levels (a manifest needs 3)");
  }
  {
    const std::string file = safetensors_of(R"({"t":{"dtype":)" + nested + R"(,"shape":[],"data_offsets":[0,0]}})");
    const auto [code, what] = error_of(
        [&] { (void)refit::bench::parse_safetensors(file.data(), file.size(), file.size(), "m.safetensors"); });
    CHECK(code == errc::invalid_argument);
    CHECK(what == "manifest m.safetensors: header nests deeper than 64 levels (a manifest needs 3)");
  }
  // 64 levels still parse (as far as the nesting goes: the dtype is then the wrong type).
  const std::string ok_depth = std::string(62, '[') + std::string(62, ']');
  CHECK_THROWS_WITH(refit::bench::parse_json_manifest(R"({"t":{"dtype":)" + ok_depth + R"(,"shape":[]}})", "m.json",
                                                      refit::dtype::bf16),
                    Catch::Contains("\"dtype\" must be a string"));
}

// fuzz_manifest, regressions/fuzz_manifest/empty_weight_map (mode byte 1: JSON in memory). A
// sharded checkpoint's index with an empty weight_map parsed to a manifest without tensors, which
// every other manifest form refuses ("no tensors"); the bench would have run an empty workload.
TEST_CASE("an index whose weight_map lists no tensors is refused", "[fuzz][bench]") {
  const std::string_view input = R"({"weight_map":{}})";
  const auto [code, what] = error_of([&] {
    (void)refit::bench::parse_json_manifest(input, "/ckpt/model.safetensors.index.json", refit::dtype::bf16);
  });
  CHECK(code == errc::invalid_argument);
  CHECK(what == R"(manifest /ckpt/model.safetensors.index.json: "weight_map" lists no tensors)");
}
#endif
