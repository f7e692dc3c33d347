#include "model/text.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>

namespace refit {
namespace {

// The length of the valid UTF-8 sequence at the start of `s` (1 to 4) and its code point, or 0
// when the bytes there are not one (a stray continuation byte, an overlong form, a surrogate, a
// code point past U+10FFFF, a sequence cut short). RFC 3629, table 3-7 of the Unicode standard.
std::size_t utf8_length(std::string_view s, char32_t& cp) noexcept {
  const auto at = [&](std::size_t i) { return static_cast<std::uint8_t>(s[i]); };
  const std::uint8_t b0 = at(0);
  if (b0 < 0x80) {
    cp = b0;
    return 1;
  }
  std::size_t n = 0;
  std::uint8_t lo = 0x80, hi = 0xbf;  // the range of the second byte
  if (b0 >= 0xc2 && b0 <= 0xdf) {
    n = 2;
  } else if (b0 >= 0xe0 && b0 <= 0xef) {
    n = 3;
    if (b0 == 0xe0) lo = 0xa0;  // overlong
    if (b0 == 0xed) hi = 0x9f;  // surrogates
  } else if (b0 >= 0xf0 && b0 <= 0xf4) {
    n = 4;
    if (b0 == 0xf0) lo = 0x90;  // overlong
    if (b0 == 0xf4) hi = 0x8f;  // past U+10FFFF
  } else {
    return 0;
  }
  if (s.size() < n || at(1) < lo || at(1) > hi) return 0;
  for (std::size_t i = 2; i < n; ++i)
    if ((at(i) & 0xc0) != 0x80) return 0;
  cp = b0 & (0x7f >> n);
  for (std::size_t i = 1; i < n; ++i) cp = (cp << 6) | (at(i) & 0x3f);
  return n;
}

// Characters that are valid UTF-8 and still change what a reader sees elsewhere on the line: C1
// controls (a terminal may take U+009B as CSI), line and paragraph separators (a line break to
// some viewers), bidirectional embeddings, overrides and isolates (they reorder the text around
// them).
bool hidden_control(char32_t cp) noexcept {
  return (cp >= 0x80 && cp <= 0x9f) || cp == 0x2028 || cp == 0x2029 || (cp >= 0x202a && cp <= 0x202e) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

void escape_bytes(std::string& out, std::string_view bytes) {
  static constexpr char hex[] = "0123456789abcdef";
  for (const char c : bytes) {
    const auto b = static_cast<std::uint8_t>(c);
    out += "\\x";
    out += hex[b >> 4];
    out += hex[b & 0xf];
  }
}

// Appends the shown form of `text` to `out` while `out` stays within `limit` bytes; returns how
// many bytes of `text` it showed (all of them, or up to the first character that did not fit).
std::size_t show(std::string& out, std::string_view text, std::size_t limit) {
  std::size_t i = 0;
  while (i < text.size()) {
    const std::string_view rest = text.substr(i);
    char32_t cp = 0;
    const std::size_t n = utf8_length(rest, cp);
    const std::size_t take = n == 0 ? 1 : n;  // invalid UTF-8: one byte at a time
    const bool escaped = n == 0 || cp < 0x20 || cp == 0x7f || hidden_control(cp);
    const std::size_t width = !escaped ? take : (n == 1 && cp == U'\n') ? 2 : 4 * take;
    if (out.size() + width > limit) break;
    if (!escaped)
      out.append(rest.data(), take);
    else if (n == 1 && cp == U'\n')
      out += "\\n";
    else
      escape_bytes(out, rest.substr(0, take));
    i += take;
  }
  return i;
}

std::string cut_note(std::size_t bytes) { return fmt::format(" … ({} more bytes)", bytes); }

}  // namespace

std::string printable(std::string_view text, std::size_t max_bytes) {
  std::string out;
  out.reserve(std::min(text.size(), max_bytes));
  if (show(out, text, max_bytes) == text.size()) return out;
  // Too long: show less, so that the note fits too. Its count of cut bytes has at most the digits
  // of text.size().
  const std::size_t note = cut_note(text.size()).size();
  out.clear();
  const std::size_t shown = show(out, text, max_bytes > note ? max_bytes - note : 0);
  out += cut_note(text.size() - shown);
  return out;
}

}  // namespace refit
