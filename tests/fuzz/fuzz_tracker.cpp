// libFuzzer target: a short session of messages through wire::decode and a refit_tracker.
//
// Input: one flags byte, then msgpack messages back to back (each message is one msgpack array,
// so the encoded messages of a session concatenate without framing). Byte 0: bit 0 says whether
// the receiver has a committed version, bits 1-3 give it. At most max_messages are played.
//
// Each BEGIN, BATCH and END goes to the tracker; BYE resets it. A rule violation must come as
// refit::error and leave the tracker as it was (the tracker stages a batch's changes and applies
// them only when the whole batch passed). After an accepted BATCH the batch and byte counts grow
// by exactly that batch (buffer bytes: a patch entry counts its own `bytes`, as END's total does,
// wire.hpp); after an accepted END the tensor bytes the entries covered (a patch's `span`) are
// exactly the bytes of the completed tensors. Any other exception, crash or sanitizer report is a
// bug.
#include <msgpack.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "refit/error.hpp"
#include "refit/model.hpp"
#include "wire/wire.hpp"

namespace wire = refit::wire;

namespace {

constexpr std::size_t max_messages = 32;
// Fixed session: three buffers of different sizes, and a small entry limit so that rule is
// reachable with short inputs.
const std::vector<std::uint64_t> buffer_sizes = {256, 4096, 1u << 20};
constexpr std::uint64_t entry_limit = 64;

[[noreturn]] void property_failed(const char* what) {
  std::fprintf(stderr, "fuzz_tracker: property violated: %s\n", what);
  std::abort();
}

#define FUZZ_ASSERT(cond)                \
  do {                                   \
    if (!(cond)) property_failed(#cond); \
  } while (0)

// Splits the next msgpack object off the input; nullopt when the rest is not msgpack. Limits as
// in wire::decode, so a hostile length cannot make the splitter allocate without bound.
std::optional<std::span<const std::uint8_t>> next_object(std::span<const std::uint8_t>& rest) {
  if (rest.empty()) return std::nullopt;
  const std::size_t elements = std::min(rest.size(), wire::max_entries + 1);
  const msgpack::unpack_limit limit(elements, elements, wire::max_message_bytes, wire::max_message_bytes,
                                    wire::max_message_bytes, 16);
  std::size_t off = 0;
  try {
    (void)msgpack::unpack(reinterpret_cast<const char*>(rest.data()), rest.size(), off, nullptr, nullptr, limit);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  const auto one = rest.first(off);
  rest = rest.subspan(off);
  return one;
}

std::set<std::string, std::less<>> names_of(const wire::refit_tracker& t) {
  const std::vector<std::string> names = t.completed().list();
  return {names.begin(), names.end()};
}

struct snapshot {
  bool active;
  std::uint64_t version, batches, tensors, bytes;
  std::set<std::string, std::less<>> completed;
  explicit snapshot(const wire::refit_tracker& t)
      : active(t.active()),
        version(t.version()),
        batches(t.batches()),
        tensors(t.tensors_completed()),
        bytes(t.bytes()),
        completed(names_of(t)) {}
  bool operator==(const snapshot&) const = default;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  std::optional<std::uint64_t> committed;
  if (data[0] & 1) committed = (data[0] >> 1) & 7;
  std::span<const std::uint8_t> rest(data + 1, size - 1);

  // Bit 4: a sharded tracker (one lane of a group: ranges that start anywhere, checked at END by
  // the receiver across lanes).
  const bool sharded = (data[0] & 0x10) != 0;
  wire::refit_tracker tracker(buffer_sizes, entry_limit, sharded);
  std::map<std::string, std::uint64_t, std::less<>> totals;  // bytes of each tensor of this refit
  std::uint64_t arrived = 0;  // buffer bytes of the accepted batches (what tracker.bytes() counts)
  std::uint64_t covered = 0;  // tensor bytes they account for (entry::covered(): a patch's span)

  for (std::size_t k = 0; k < max_messages; ++k) {
    const auto one = next_object(rest);
    if (!one) break;
    wire::message m;
    try {
      m = wire::decode(std::span<const std::byte>(reinterpret_cast<const std::byte*>(one->data()), one->size()));
    } catch (const refit::error&) {
      continue;
    }

    const snapshot before(tracker);
    try {
      if (const auto* b = std::get_if<wire::begin>(&m)) {
        tracker.begin(*b, committed);
        FUZZ_ASSERT(tracker.active() && tracker.version() == b->version);
        FUZZ_ASSERT(tracker.batches() == 0 && tracker.bytes() == 0 && tracker.tensors_completed() == 0);
        totals.clear();
        arrived = 0;
        covered = 0;
      } else if (const auto* b = std::get_if<wire::batch>(&m)) {
        tracker.check(*b);
        std::uint64_t sum = 0;
        for (const auto& e : b->entries) {
          sum += e.bytes;
          covered += e.covered();
          const auto n = refit::checked_nbytes(e.type, e.shape);
          FUZZ_ASSERT(n.has_value());
          totals.insert_or_assign(e.name, *n);
        }
        arrived += sum;
        FUZZ_ASSERT(tracker.batches() == before.batches + 1);
        FUZZ_ASSERT(tracker.bytes() == arrived);
        for (const auto& name : before.completed) FUZZ_ASSERT(tracker.completed().contains(name));
        for (const auto& name : tracker.completed().list()) FUZZ_ASSERT(totals.contains(name));
      } else if (const auto* e = std::get_if<wire::end>(&m)) {
        tracker.finish(*e);
        FUZZ_ASSERT(!tracker.active());
        FUZZ_ASSERT(e->version == before.version && e->bytes == before.bytes && e->batches == before.batches);
        if (sharded) {
          // Every name is one range inside its tensor; they count as the tensors END announced.
          FUZZ_ASSERT(tracker.completed().empty() && e->tensors == tracker.ranges().size());
          for (const auto& [name, r] : tracker.ranges())
            FUZZ_ASSERT(r.first <= r.next && r.next <= r.total && totals.at(name) == r.total);
        } else {
          FUZZ_ASSERT(e->tensors == before.tensors);
          // Nothing partial is left, so every tensor byte covered belongs to a completed tensor. A
          // patch covers more tensor bytes (its span) than it holds, so this is not bytes().
          std::uint64_t whole = 0;
          for (const auto& name : tracker.completed().list()) whole += totals.at(name);
          FUZZ_ASSERT(whole == covered);
        }
        committed = e->version;
      } else if (std::holds_alternative<wire::bye>(m)) {
        tracker.reset();
        FUZZ_ASSERT(!tracker.active() && tracker.batches() == 0 && tracker.completed().empty());
        totals.clear();
        arrived = 0;
        covered = 0;
      }
    } catch (const refit::error& err) {
      // A refused message changes nothing.
      FUZZ_ASSERT(snapshot(tracker) == before);
      FUZZ_ASSERT(err.code() == refit::errc::protocol || err.code() == refit::errc::incomplete);
    }
  }
  return 0;
}
