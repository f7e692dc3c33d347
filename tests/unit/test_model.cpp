#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "config/config.hpp"
#include "model/text.hpp"
#include "refit/error.hpp"
#include "refit/model.hpp"
#include "refit/version.hpp"

using refit::dtype;

TEST_CASE("itemsize knows every dtype", "[model]") {
  CHECK(refit::itemsize(dtype::bool_) == 1);
  CHECK(refit::itemsize(dtype::u8) == 1);
  CHECK(refit::itemsize(dtype::i8) == 1);
  CHECK(refit::itemsize(dtype::i16) == 2);
  CHECK(refit::itemsize(dtype::i32) == 4);
  CHECK(refit::itemsize(dtype::i64) == 8);
  CHECK(refit::itemsize(dtype::f16) == 2);
  CHECK(refit::itemsize(dtype::bf16) == 2);
  CHECK(refit::itemsize(dtype::f32) == 4);
  CHECK(refit::itemsize(dtype::f64) == 8);
  CHECK(refit::itemsize(dtype::f8_e4m3) == 1);
  CHECK(refit::itemsize(dtype::f8_e5m2) == 1);
  CHECK(refit::itemsize(dtype::u16) == 2);
  CHECK(refit::itemsize(dtype::u32) == 4);
  CHECK(refit::itemsize(dtype::u64) == 8);
  CHECK(refit::itemsize(dtype::f8_e8m0) == 1);
  CHECK(refit::itemsize(dtype::f4_e2m1x2) == 1);  // two elements a byte
}

TEST_CASE("every dtype round-trips through its canonical name and its wire code", "[model]") {
  for (std::uint64_t code = 0; code <= 16; ++code) {
    const auto t = refit::dtype_from_code(code);
    REQUIRE(t);
    CHECK(static_cast<std::uint64_t>(*t) == code);
    CHECK(refit::parse_dtype(refit::to_string(*t)) == t);
  }
  CHECK_FALSE(refit::dtype_from_code(17));
  CHECK_FALSE(refit::dtype_from_code(std::numeric_limits<std::uint64_t>::max()));
}

TEST_CASE("parse_dtype accepts canonical, safetensors and torch names", "[model]") {
  CHECK(refit::parse_dtype("bf16") == dtype::bf16);
  CHECK(refit::parse_dtype("f8_e4m3") == dtype::f8_e4m3);
  CHECK(refit::parse_dtype("BF16") == dtype::bf16);
  CHECK(refit::parse_dtype("F8_E4M3") == dtype::f8_e4m3);
  CHECK(refit::parse_dtype("BOOL") == dtype::bool_);
  CHECK(refit::parse_dtype("F32") == dtype::f32);
  CHECK(refit::parse_dtype("I64") == dtype::i64);
  CHECK(refit::parse_dtype("bfloat16") == dtype::bf16);
  CHECK(refit::parse_dtype("float16") == dtype::f16);
  CHECK(refit::parse_dtype("float32") == dtype::f32);
  CHECK(refit::parse_dtype("int64") == dtype::i64);
  CHECK(refit::parse_dtype("uint8") == dtype::u8);
  CHECK(refit::parse_dtype("float8_e4m3fn") == dtype::f8_e4m3);
  CHECK(refit::parse_dtype("float8_e5m2") == dtype::f8_e5m2);
  CHECK(refit::parse_dtype("torch.bfloat16") == dtype::bf16);
  CHECK(refit::parse_dtype("f8_e8m0") == dtype::f8_e8m0);
  CHECK(refit::parse_dtype("F8_E8M0") == dtype::f8_e8m0);
  CHECK(refit::parse_dtype("float8_e8m0fnu") == dtype::f8_e8m0);
  CHECK(refit::parse_dtype("torch.float8_e8m0fnu") == dtype::f8_e8m0);
  CHECK(refit::parse_dtype("f4_e2m1x2") == dtype::f4_e2m1x2);
  CHECK(refit::parse_dtype("float4_e2m1fn_x2") == dtype::f4_e2m1x2);
}

TEST_CASE("every quant names its groups, its scale dtype and the shape of its scale tensor", "[model]") {
  using refit::quant;
  for (std::uint64_t code = 0; code <= 5; ++code) {
    const auto q = refit::quant_from_code(code);
    REQUIRE(q);
    CHECK(refit::parse_quant(refit::to_string(*q)) == q);
  }
  CHECK_FALSE(refit::quant_from_code(6));
  CHECK(refit::parse_quant("nvfp4") == quant::nvfp4);
  CHECK(refit::scale_dtype(quant::nvfp4) == dtype::f8_e4m3);
  CHECK(refit::quant_dtype(quant::nvfp4) == dtype::f4_e2m1x2);
  CHECK(refit::quant_dtype(quant::mxfp8) == dtype::f8_e4m3);
  CHECK(refit::block_cols(quant::nvfp4) == 16);
  CHECK(refit::parse_scale_layout("swizzled") == refit::scale_layout::swizzled_128x4);
  CHECK(refit::parse_scale_layout("row_major") == refit::scale_layout::row_major);
  CHECK_FALSE(refit::parse_scale_layout("tiled"));
  CHECK(refit::to_string(refit::scale_layout::swizzled_128x4) == "swizzled_128x4");
  CHECK(refit::parse_quant("per_channel") == quant::channel);
  CHECK(refit::parse_quant("mx") == quant::mxfp8);
  CHECK(refit::to_string(quant::channel) == "channel");
  CHECK(refit::to_string(quant::mxfp8) == "mxfp8");
  CHECK(refit::scale_dtype(quant::channel) == dtype::f32);
  CHECK(refit::scale_dtype(quant::mxfp8) == dtype::f8_e8m0);
  CHECK(refit::scale_dtype(quant::block128) == dtype::f32);
  using shape = std::vector<std::int64_t>;
  CHECK(refit::scale_shape(quant::channel, shape{4096, 1000}) == shape{4096, 1});
  CHECK(refit::scale_shape(quant::channel, shape{8, 64, 100}) == shape{8, 64, 1});
  CHECK(refit::scale_shape(quant::channel, shape{100}) == shape{1});
  CHECK(refit::scale_shape(quant::mxfp8, shape{4096, 1000}) == shape{4096, 32});  // 1000 = 31 · 32 + 8
  CHECK(refit::scale_shape(quant::mxfp8, shape{8, 3, 64}) == shape{8, 3, 2});
  CHECK(refit::scale_shape(quant::mxfp8, shape{1}) == shape{1});
  CHECK(refit::scale_shape(quant::block128, shape{300, 260}) == shape{3, 3});
  CHECK(refit::block_rows(quant::channel) == 1);
  CHECK(refit::block_cols(quant::channel) == 0);
  CHECK(refit::block_rows(quant::mxfp8) == 1);
  CHECK(refit::block_cols(quant::mxfp8) == 32);
  CHECK(refit::min_rank(quant::mxfp8) == 1);
  CHECK(refit::min_rank(quant::block128) == 2);
  CHECK(refit::min_rank(quant::tensor) == 0);
}

TEST_CASE("parse_dtype returns nullopt for unknown names", "[model]") {
  CHECK_FALSE(refit::parse_dtype(""));
  CHECK_FALSE(refit::parse_dtype("f128"));
  CHECK_FALSE(refit::parse_dtype("complex64"));
  CHECK_FALSE(refit::parse_dtype("bf16 "));
}

TEST_CASE("checked_nbytes multiplies the shape by the itemsize and refuses overflow", "[model]") {
  const std::vector<std::int64_t> shape{3, 5, 7};
  CHECK(refit::checked_nbytes(dtype::f32, shape) == 3u * 5 * 7 * 4);
  CHECK(refit::checked_numel(shape) == 105u);
  CHECK(refit::checked_nbytes(dtype::bf16, std::vector<std::int64_t>{}) == 2u);  // a scalar
  CHECK(refit::checked_nbytes(dtype::f64, std::vector<std::int64_t>{4, 0, 9}) == 0u);

  const std::int64_t big = std::numeric_limits<std::int64_t>::max();
  CHECK_FALSE(refit::checked_numel(std::vector<std::int64_t>{big, 3}));
  CHECK_FALSE(refit::checked_nbytes(dtype::f32, std::vector<std::int64_t>{std::int64_t{1} << 62}));
  CHECK_FALSE(refit::checked_nbytes(dtype::u8, std::vector<std::int64_t>{1 << 30, 1 << 30, 1 << 30}));
  CHECK_FALSE(refit::checked_numel(std::vector<std::int64_t>{4, -1}));
  CHECK_FALSE(refit::checked_nbytes(dtype::u8, std::vector<std::int64_t>{-2}));
}

TEST_CASE("tensor_meta::nbytes throws invalid_argument on a bad shape", "[model]") {
  refit::tensor_meta ok{"w", dtype::bf16, {4096, 1024}};
  CHECK(ok.nbytes() == 4096u * 1024 * 2);
  CHECK(ok.numel() == 4096u * 1024);

  refit::tensor_meta negative{"neg", dtype::f32, {3, -1}};
  refit::tensor_meta huge{"huge", dtype::f64, {std::numeric_limits<std::int64_t>::max(), 2}};
  for (const auto* m : {&negative, &huge}) {
    try {
      (void)m->nbytes();
      FAIL("nbytes() did not throw for " << refit::describe(*m));
    } catch (const refit::error& e) {
      CHECK(e.code() == refit::errc::invalid_argument);
      CHECK_THAT(e.what(), Catch::Contains(m->name));
    }
  }
  CHECK_THROWS_AS(negative.numel(), refit::error);
}

TEST_CASE("describe names the tensor, its dtype and its shape", "[model]") {
  CHECK(refit::describe({"layers.0.w", dtype::bf16, {4096, 4096}}) == "layers.0.w bf16[4096, 4096]");
}

TEST_CASE("version and has_transport report what the library was built with", "[model]") {
  CHECK(refit::version() == REFIT_VERSION);
  CHECK(refit::has_cuda() == (REFIT_HAVE_CUDA != 0));
  CHECK(refit::has_transport(refit::transport_kind::host_shm));
  CHECK(refit::has_transport(refit::transport_kind::cuda_ipc) == (REFIT_HAVE_CUDA != 0));
  CHECK(refit::has_transport(refit::transport_kind::nccl) == (REFIT_HAVE_NCCL != 0));
}

// ==================================================================================== printable

namespace {

// Whether `s` is valid UTF-8, checked by value (the code point a sequence spells must need that
// many bytes, and be no surrogate and at most U+10FFFF), not by printable()'s byte ranges.
bool valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    const std::size_t n = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    std::uint32_t cp = n == 1 ? b : b & (0xffu >> (n + 1));
    for (std::size_t k = 1; k < n; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      if ((c & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3f);
    }
    const std::uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < least[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += n;
  }
  return true;
}

// What a terminal or a log must never get from a peer: a control byte (a newline included).
bool has_control_byte(std::string_view s) {
  return std::any_of(s.begin(), s.end(), [](char c) {
    const auto b = static_cast<unsigned char>(c);
    return b < 0x20 || b == 0x7f;
  });
}

std::string utf8_of(char32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xc0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xe0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    s += static_cast<char>(0xf0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  }
  return s;
}

// "\xNN" for each byte of `bytes`.
std::string escaped(std::string_view bytes) {
  std::string out;
  for (const char c : bytes) out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
  return out;
}

using namespace std::string_view_literals;

}  // namespace

TEST_CASE("printable keeps printable ASCII and valid multi-byte UTF-8 as they are", "[text]") {
  CHECK(refit::printable("") == "");
  CHECK(refit::printable("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight");
  std::string ascii;
  for (char c = 0x20; c < 0x7f; ++c) ascii += c;
  CHECK(refit::printable(ascii) == ascii);
  // Names in other scripts, 2, 3 and 4 bytes a character, and the extremes of each length.
  for (const std::string_view name : {"模型.层.0.权重"sv, "poids_é_ß"sv, "вес.слой"sv, "重み😀🧠"sv, "\xc2\xa0"sv,
                                      "\xdf\xbf"sv, "\xe0\xa0\x80"sv, "\xef\xbf\xbf"sv, "\xf0\x90\x80\x80"sv,
                                      "\xf4\x8f\xbf\xbf"sv, "\xed\x9f\xbf"sv, "\xee\x80\x80"sv})
    CHECK(refit::printable(name) == name);
}

TEST_CASE("printable escapes every control character, a newline as \\n and the others as \\xNN", "[text]") {
  CHECK(refit::printable("a\nb") == "a\\nb");
  CHECK(refit::printable("\x1b[2K\rrefit-bench: every refit verified, 0 wrong\n") ==
        "\\x1b[2K\\x0drefit-bench: every refit verified, 0 wrong\\n");
  CHECK(refit::printable("tab\there") == "tab\\x09here");
  CHECK(refit::printable("del\x7f") == "del\\x7f");
  // A NUL does not end the text: it is shown, and what follows it too.
  CHECK(refit::printable("before\0after"sv) == "before\\x00after");
  CHECK(refit::printable("\0\0"sv) == "\\x00\\x00");
  for (int b = 0; b < 0x20; ++b) {
    const std::string one(1, static_cast<char>(b));
    CHECK(refit::printable(one) == (b == '\n' ? std::string("\\n") : escaped(one)));
  }
}

TEST_CASE("printable escapes C1 controls, bidirectional overrides and line separators byte by byte", "[text]") {
  // U+009B is CSI to a terminal in UTF-8 mode; U+0085 is NEL.
  for (char32_t cp = 0x80; cp <= 0x9f; ++cp) CHECK(refit::printable(utf8_of(cp)) == escaped(utf8_of(cp)));
  for (const char32_t cp : {U'\u2028', U'\u2029', U'\u202a', U'\u202b', U'\u202c', U'\u202d', U'\u202e', U'\u2066',
                            U'\u2067', U'\u2068', U'\u2069'})
    CHECK(refit::printable("a" + utf8_of(cp) + "b") == "a" + escaped(utf8_of(cp)) + "b");
  CHECK(refit::printable(utf8_of(0xa0)) == utf8_of(0xa0));  // the first character after C1 is kept
}

TEST_CASE("printable escapes each byte of invalid UTF-8 and keeps the valid text around it", "[text]") {
  const std::string_view bad[] = {
      "\x80"sv,              // a continuation byte alone
      "\xbf"sv,              //
      "\xff"sv,              // never in UTF-8
      "\xfe"sv,              //
      "\xc0\xaf"sv,          // overlong '/'
      "\xc1\xbf"sv,          // overlong
      "\xe0\x80\xaf"sv,      // overlong, 3 bytes
      "\xe0\x9f\xbf"sv,      //
      "\xf0\x80\x80\xaf"sv,  // overlong, 4 bytes
      "\xf0\x8f\xbf\xbf"sv,  //
      "\xed\xa0\x80"sv,      // a surrogate (U+D800)
      "\xed\xbf\xbf"sv,      // U+DFFF
      "\xf4\x90\x80\x80"sv,  // past U+10FFFF
      "\xf5\x80\x80\x80"sv,  //
      "\xe6\xa8"sv,          // cut short at the end
      "\xf0\x9f\x98"sv,      //
      "\xc3"sv,              //
  };
  for (const std::string_view b : bad) {
    INFO(escaped(b));
    CHECK(refit::printable(b) == escaped(b));
    CHECK(refit::printable("x" + std::string(b) + "模y") == "x" + escaped(b) + "模y");
  }
  // A sequence cut short by ASCII: the lead bytes are escaped, the ASCII kept.
  CHECK(refit::printable("\xe6\xa8"
                         "A") == "\\xe6\\xa8A");
  // A valid character right after an invalid byte is kept whole.
  CHECK(refit::printable("\xff\xe6\xa8\xa1") == "\\xff模");
}

TEST_CASE("printable of any byte, any pair of bytes and any code point is valid UTF-8 without a control byte",
          "[text]") {
  for (int b = 0; b < 256; ++b) {
    const std::string one(1, static_cast<char>(b));
    const std::string shown = refit::printable(one);
    CHECK((b >= 0x20 && b < 0x7f ? shown == one : shown == (b == '\n' ? "\\n" : escaped(one))));
  }
  std::size_t failures = 0;
  for (int a = 0; a < 256; ++a) {
    for (int b = 0; b < 256; ++b) {
      const std::string two{static_cast<char>(a), static_cast<char>(b)};
      const std::string shown = refit::printable(two);
      if (!valid_utf8(shown) || has_control_byte(shown) || refit::printable(shown) != shown) ++failures;
      // Two printable ASCII characters, or one 2-byte character other than a C1 control, are kept;
      // anything else is shown otherwise.
      const bool ascii = a >= 0x20 && a < 0x7f && b >= 0x20 && b < 0x7f;
      const bool one_char = a >= 0xc2 && a <= 0xdf && (b & 0xc0) == 0x80 && !(a == 0xc2 && b < 0xa0);
      const bool keep = ascii || one_char;
      if (keep != (shown == two)) ++failures;
    }
  }
  CHECK(failures == 0);
  failures = 0;
  for (char32_t cp = 0x20; cp <= 0x10ffff; ++cp) {
    if (cp >= 0xd800 && cp <= 0xdfff) continue;
    const std::string s = utf8_of(cp);
    const bool hidden = cp == 0x7f || (cp >= 0x80 && cp <= 0x9f) || cp == 0x2028 || cp == 0x2029 ||
                        (cp >= 0x202a && cp <= 0x202e) || (cp >= 0x2066 && cp <= 0x2069);
    if (refit::printable(s) != (hidden ? escaped(s) : s)) ++failures;
  }
  CHECK(failures == 0);
}

TEST_CASE("printable cuts long text at a character boundary, within max_bytes, and says how many bytes it cut",
          "[text]") {
  const std::string a(100000, 'a');
  const std::string cut = refit::printable(a);
  CHECK(cut.size() <= refit::printable_bytes);
  const auto note = cut.rfind(" … (");
  REQUIRE(note != std::string::npos);
  CHECK(cut.substr(0, note) == std::string(note, 'a'));
  CHECK(cut.substr(note) == fmt::format(" … ({} more bytes)", a.size() - note));
  // The room kept for the note is that of the longest count (all 100000 bytes cut).
  const std::size_t room = 100 - std::string_view(" … (100000 more bytes)").size();
  CHECK(refit::printable(a, 100) == std::string(room, 'a') + fmt::format(" … ({} more bytes)", a.size() - room));
  // Exactly max_bytes is not cut; one more is.
  CHECK(refit::printable(std::string(4096, 'b')) == std::string(4096, 'b'));
  CHECK(refit::printable(std::string(4097, 'b')).ends_with("more bytes)"));
  // Never inside a character or an escape: 3-byte characters, then 4-byte escapes.
  std::string chinese;
  for (int i = 0; i < 3000; ++i) chinese += "模";
  const std::string han = refit::printable(chinese, 1000);
  CHECK(valid_utf8(han));
  const auto han_note = han.rfind(" … (");
  REQUIRE(han_note != std::string::npos);
  CHECK(han_note % 3 == 0);
  CHECK(han.substr(han_note) == fmt::format(" … ({} more bytes)", 9000 - han_note));
  const std::string esc = refit::printable(std::string(5000, '\x1b'), 1000);
  const auto esc_note = esc.rfind(" … (");
  CHECK(esc_note % 4 == 0);
  CHECK(esc.substr(esc_note) == fmt::format(" … ({} more bytes)", 5000 - esc_note / 4));
  CHECK(esc.size() <= 1000);
  // 8 MiB of control bytes, as a hostile peer's ERROR could carry: a few KiB shown.
  const std::string flood(8u << 20, '\n');
  const std::string shown = refit::printable(flood);
  CHECK(shown.size() <= refit::printable_bytes);
  CHECK_FALSE(has_control_byte(shown));
}

TEST_CASE("printable is idempotent, cut or not, so text that crossed the wire twice is unchanged", "[text]") {
  std::uint64_t x = 0x9e3779b97f4a7c15ull;
  const auto next = [&] {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  };
  std::size_t failures = 0;
  for (int round = 0; round < 2000; ++round) {
    std::string s(next() % 600, '\0');
    for (char& c : s) {
      // Mostly bytes that matter: controls, lead and continuation bytes, backslashes, ASCII.
      const std::uint64_t r = next();
      c = static_cast<char>(r % 4 == 0 ? '\\' : r % 4 == 1 ? 0x80 + (r >> 8) % 0x80 : (r >> 8) % 0x100);
    }
    for (const std::size_t max : {std::size_t{64}, std::size_t{300}, std::size_t{4096}}) {
      const std::string once = refit::printable(s, max);
      if (once.size() > max || !valid_utf8(once) || has_control_byte(once) || refit::printable(once, max) != once)
        ++failures;
    }
  }
  CHECK(failures == 0);
}
