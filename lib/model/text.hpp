// refit — text from a peer, made safe to show.
//
// A peer's strings (tensor names, peer names, ERROR messages, ABORT reasons) are bytes a hostile
// or broken process chose: invalid UTF-8 (a JSON writer throws on it), NULs (C strings end there),
// escape sequences and newlines (they rewrite a terminal, or forge a line of a log or of the
// bench's output), megabytes of it. printable() is what every such string goes through before it
// reaches a person, a log line or a JSON writer.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace refit {

/// The default bound of printable(): a few KiB, enough for any message refit writes itself.
inline constexpr std::size_t printable_bytes = 4096;

/// `text` as one line of valid UTF-8 that a terminal shows as it is:
/// - printable ASCII and valid multi-byte UTF-8 (names in any script) are kept;
/// - a newline becomes the two characters `\n`; every other control character (C0, DEL, C1 also
///   when UTF-8-encoded), bidirectional overrides and line/paragraph separators, and every byte
///   that is not part of valid UTF-8 (NUL included) become `\xNN`, byte by byte;
/// - output longer than `max_bytes` is cut at a character boundary and ends with
///   " … (N more bytes)", N counting the bytes of `text` not shown; the whole result is then at
///   most `max_bytes` long (for max_bytes of at least 64).
/// A backslash is kept as it is, so printable(printable(t, n), n) == printable(t, n): text that
/// went through it once (decoded from the wire, encoded again) does not change a second time.
/// Never throws but std::bad_alloc.
std::string printable(std::string_view text, std::size_t max_bytes = printable_bytes);

}  // namespace refit
