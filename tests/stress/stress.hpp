// Helpers of the stress suite (fault injection, soak): deterministic tensors on both sides, a
// parameter table that checks itself, environment knobs, and what a process holds (descriptors,
// sockets, shared memory, resident memory).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "channel/channel.hpp"
#include "refit/model.hpp"
#include "refit/receiver.hpp"
#include "support/support.hpp"

namespace refit::stress {

using clock_type = std::chrono::steady_clock;

inline std::chrono::milliseconds since(clock_type::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(clock_type::now() - start);
}

/// An unsigned integer from the environment, or `fallback` when unset or empty. Throws on garbage
/// so that a mistyped knob is not silently ignored.
std::uint64_t env_u64(const char* name, std::uint64_t fallback);

/// A private endpoint for one test or round; its socket file and directory go with it.
struct scoped_endpoint {
  std::string name = test::temp_endpoint();
  scoped_endpoint() = default;
  scoped_endpoint(const scoped_endpoint&) = delete;
  scoped_endpoint& operator=(const scoped_endpoint&) = delete;
  ~scoped_endpoint() { channel::remove_private_endpoint(name); }
};

/// The policy side of one version: every tensor filled with that version's pattern.
struct host_tensors {
  std::vector<std::vector<std::uint8_t>> bytes;
  std::vector<tensor_ref> refs;
  host_tensors(const std::vector<tensor_meta>& metas, std::uint64_t version);
};

/// A receiver's parameter table: one host buffer per tensor, zeros at first.
struct table {
  std::vector<tensor_meta> metas;
  std::vector<std::vector<std::uint8_t>> data;

  explicit table(std::vector<tensor_meta> m);
  void register_in(receiver& r);
  /// "ok" when every tensor holds `version`'s pattern (all zeros for nullopt: nothing was ever
  /// committed), else which tensor differs first and where.
  [[nodiscard]] std::string check(std::optional<std::uint64_t> version) const;
};

/// What a process holds; read from /proc/self and /dev/shm.
struct process_figures {
  long fds = 0;         ///< entries of /proc/self/fd
  long sockets = 0;     ///< of which sockets
  long shm_own = 0;     ///< /dev/shm/refit-<this pid>-* names (segments this process created)
  long shm_all = 0;     ///< /dev/shm/refit-* names, any process (informative: other tests may run)
  long shm_mapped = 0;  ///< mappings of refit shared memory in /proc/self/maps (deleted or not)
  long rss_kib = 0;     ///< VmRSS

  static process_figures now();
  /// ZeroMQ closes a socket's descriptors in a background thread after zmq_close() returns, so a
  /// reading can catch one in flight. A baseline: readings until three in a row agree on the
  /// countable figures (at most `limit`). The end of a run: readings until none of them is above
  /// `baseline` (at most `limit`; a real leak never gets there), the last one returned.
  static process_figures settled(std::chrono::milliseconds limit = std::chrono::milliseconds{3000});
  static process_figures back_to(const process_figures& baseline,
                                 std::chrono::milliseconds limit = std::chrono::milliseconds{5000});
  /// "fds=12 sockets=3 shm_own=0 shm_all=0 shm_mapped=2 rss_kib=5120"
  [[nodiscard]] std::string text() const;
  /// Parses text(); throws std::runtime_error on a malformed line.
  static process_figures parse(const std::string& line);
};

}  // namespace refit::stress
