// refit-bench's verification (bench/role_report.cpp): how a streamer checks each receiver's report
// of a refit, the bounds on JSON from a peer, and what a receiver started by hand remembers to answer
// its streamer with. Included by bench.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace refit::bench {

struct config;
struct manifest;

/// The check of one receiver's report of refit `version`, the same for a spawned receiver (its
/// stdout line) and one started by hand (its report endpoint's reply): `line` must be
/// {"event":"committed","version":version,...,"checksums":[one per tensor of m]} (for tpN, of
/// rank `rank`: the checksums of its slices). Returns how
/// many checksums differ from `expected`, and prints a "WRONG: ..." progress line for each while
/// fewer than 3 were printed for this refit (`printed`, updated; none with --quiet). `receiver`
/// tells receivers apart in those lines (" receiver 2", or empty). Throws
/// refit::error(protocol) naming `who` and quoting the line when it is anything else.
std::int64_t count_wrong(const config& c, const nlohmann::json& line, std::uint64_t version, const manifest& m,
                         const std::vector<std::uint64_t>& expected, const std::string& who,
                         const std::string& receiver, std::int64_t& printed, int rank = 0);

/// JSON from a peer (a report request, a receiver's report or its stdout line) is parsed only
/// after this check. The size bounds the memory: nlohmann's parser (3.11) peaked at up to 36 bytes
/// of heap per byte of input within the depth limit (`[[[...]]],...`; 30 for `[{},{},...]`) and
/// at 43 for input nested 100,000 deep. The depth bounds the recursion: dump() recurses once per
/// level, and a million levels overflowed the stack. Why `text` is refused (longer than
/// `max_bytes`, or arrays and objects nested deeper than max_json_depth), nullopt when it may be
/// parsed. Scans once, allocating nothing.
inline constexpr std::size_t max_json_depth = 32;
std::optional<std::string> peer_json_problem(std::string_view text, std::size_t max_bytes);

/// `text`, from `who`, parsed after peer_json_problem(): throws refit::error(errc::protocol) naming
/// `who`, the problem and a bounded, escaped excerpt of the text when it is refused or not JSON.
nlohmann::json parse_peer_json(std::string_view text, std::size_t max_bytes, std::string_view who);

/// A JSON value for a message: compact JSON as dump() writes it, but at most `max_bytes` of
/// printable text (refit::printable), values nested past 8 levels shown as […] and {…}, strings
/// of invalid UTF-8 with U+FFFD: never throws on a peer's value and never recurses without bound.
std::string excerpt(const nlohmann::json& j, std::size_t max_bytes = 300);

/// The longest report a receiver of `m` sends (its committed line: a checksum per tensor), with
/// room to spare; what the streamer reads from a receiver beyond this is refused unparsed.
std::size_t max_report_bytes(const manifest& m);

/// What a receiver started by hand remembers of its last refits, to answer the streamer's report
/// requests. Bounded: it keeps the last `capacity` events. Not thread-safe (the receiver's loop
/// owns it).
class report_log {
 public:
  explicit report_log(std::size_t capacity = 8);
  /// A committed line, as printed: {"event":"committed","version":v,...}.
  void committed(const nlohmann::json& line);
  /// An aborted line, as printed: {"event":"aborted","error":...}.
  void aborted(const nlohmann::json& line);
  /// The reply to a request {"version": v}: the committed line of v; the aborted line when the
  /// refit after the last commit of an earlier version was aborted (the receiver does not say
  /// which version an abort ended); {"event":"unknown","version":v} otherwise; and
  /// {"event":"error","error":...} for a request that is not of that form.
  [[nodiscard]] std::string answer(std::string_view request) const;

 private:
  void add(const nlohmann::json& line);
  std::size_t capacity_;
  std::vector<nlohmann::json> events_;  ///< oldest first
  bool forgot_ = false;                 ///< events were dropped for capacity
};

}  // namespace refit::bench
