// libFuzzer target: the receiver's ZMTP decoder (lib/channel/zmtp.hpp) on arbitrary bytes from a
// connection, greeting to frames.
//
// Input: byte 0's low 7 bits seed how the rest is cut into reads (1 to 64 bytes each, or whole when
// 0), its top bit makes the decoder a CURVE server's (fixed keys: the fuzzer reaches the CURVE
// greeting and the HELLO and INITIATE checks; a box it cannot make stops it there); the rest is
// what the peer sends. Limits: bodies of at most 4096 bytes, so the over-size rule is
// reachable with short inputs.
//
// Properties: feed() never throws (but std::bad_alloc), uses a whole read unless it reports an
// event, consumes nothing after an error; READY comes once and before any message, PING or drop; a
// request's body is at most the limit, and what the decoder holds stays within a body and a command;
// and the events and bodies do not depend on how the bytes were cut (the same input fed whole gives
// the same ones). Any crash or sanitizer report is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "channel/zmtp.hpp"

namespace zmtp = refit::channel::zmtp;

namespace {

constexpr std::uint64_t max_body = 4096;

[[noreturn]] void property_failed(const char* what) {
  std::fprintf(stderr, "fuzz_zmtp: property violated: %s\n", what);
  std::abort();
}

#define FUZZ_ASSERT(cond)                \
  do {                                   \
    if (!(cond)) property_failed(#cond); \
  } while (0)

struct trace {
  std::vector<zmtp::event> events;
  std::vector<std::string> details;  ///< a body, a PING context, a drop's frame count, an error
};

/// A CURVE server's keys, the same for every input.
std::shared_ptr<const zmtp::curve_server_keys> curve_keys() {
  static const auto keys = [] {
    auto k = std::make_shared<zmtp::curve_server_keys>();
    for (std::size_t i = 0; i < 32; ++i) k->secret_key[i] = static_cast<std::uint8_t>(i * 7 + 1);
    return k;
  }();
  return keys;
}

/// Feeds `bytes` in reads of the sizes `cut` gives (0: whole), checking every step.
trace play(std::span<const std::uint8_t> bytes, std::uint8_t cut, bool curve) {
  zmtp::decoder d(max_body, curve ? curve_keys() : nullptr);
  trace t;
  std::uint32_t state = cut;
  std::size_t at = 0;
  bool ready = false;
  bool failed = false;
  std::uint64_t progress = 0;
  while (at < bytes.size()) {
    state = state * 1103515245u + 12345u;
    const std::size_t want = cut == 0 ? bytes.size() - at : 1 + (state >> 16) % 64;
    auto piece = bytes.subspan(at, std::min(want, bytes.size() - at));
    while (!piece.empty()) {
      const auto r = d.feed(piece);
      FUZZ_ASSERT(r.consumed <= piece.size());
      FUZZ_ASSERT(d.progress() >= progress);
      progress = d.progress();
      if (failed) FUZZ_ASSERT(r.consumed == 0 && r.what == zmtp::event::none);
      if (r.what == zmtp::event::none && !failed) FUZZ_ASSERT(r.consumed == piece.size());
      FUZZ_ASSERT(d.held_bytes() <= 2 * (max_body + zmtp::curve_overhead) + zmtp::max_command_bytes);
      piece = piece.subspan(r.consumed);
      at += r.consumed;
      if (r.what == zmtp::event::none) {
        if (failed) return t;
        continue;
      }
      t.events.push_back(r.what);
      switch (r.what) {
        case zmtp::event::ready:
          FUZZ_ASSERT(!ready);
          ready = true;
          t.details.push_back(d.socket_type());
          break;
        case zmtp::event::request: {
          FUZZ_ASSERT(ready);
          std::string body = d.take_body();
          FUZZ_ASSERT(body.size() <= max_body);
          t.details.push_back(std::move(body));
          break;
        }
        case zmtp::event::ping:
          FUZZ_ASSERT(ready);
          FUZZ_ASSERT(d.ping_context().size() <= 16);
          t.details.emplace_back(d.ping_context());
          break;
        case zmtp::event::dropped:
          FUZZ_ASSERT(ready);
          FUZZ_ASSERT(d.dropped_frames() >= 1);
          t.details.push_back(std::to_string(d.dropped_frames()));
          break;
        case zmtp::event::error:
          FUZZ_ASSERT(!d.reason().empty());
          t.details.push_back(d.reason());
          failed = true;
          break;
        case zmtp::event::none: break;
      }
    }
  }
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::span<const std::uint8_t> bytes(data + 1, size - 1);
  const bool curve = (data[0] & 0x80) != 0;
  const trace cut = play(bytes, data[0] & 0x7f, curve);
  const trace whole = play(bytes, 0, curve);
  FUZZ_ASSERT(cut.events == whole.events);
  FUZZ_ASSERT(cut.details == whole.details);
  return 0;
}
