// refit — reading memory another process can take away: a SIGBUS there fails the copy, not the
// process.
//
// A receiver maps the streamer's shared memory. Where that memory is a file the streamer can still
// truncate (a named /dev/shm segment: see lib/transport/host_shm.cpp), a read past its new end is
// not an error the read returns but a SIGBUS, whose default action ends the process. While a
// peer_memory exists for a range, a SIGBUS at an address inside it does not:
//   - inside guarded() on the faulting thread (the CPU copier's run(), which the receiver's apply
//     calls once per batch), the copy stops and guarded() returns the fault;
//   - anywhere else (a batch callback reading a view, the host delta apply), the faulting pages and
//     the rest of the range are replaced by zero pages and the read goes on; the range is marked
//     faulted, and the transport fails the refit at the next begin_read/end_read.
// A SIGBUS anywhere else behaves as it did before the first peer_memory: the handler chains to
// the one it replaced, or restores the default action and lets the fault kill the process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace refit::copy {

/// A range of memory of another process mapped here (one buffer of the streamer's). Registered
/// for its lifetime in a process-wide table the SIGBUS handler reads (at most max_peer_memory at
/// once); the handler is installed with the first one. Neither copyable nor movable: the table
/// points at it. Unregister it before unmapping the range.
class peer_memory {
 public:
  /// Ranges that may be registered at once (64 buffers for each of 16 sessions).
  static constexpr std::size_t max_ranges = 1024;

  /// Registers [base, base + bytes), named `name` (for messages), buffer `index` of its
  /// session. Throws refit::error(transport) when max_ranges are registered already, or the
  /// SIGBUS handler cannot be installed.
  peer_memory(const void* base, std::uint64_t bytes, std::string name, std::size_t index);
  ~peer_memory();
  peer_memory(const peer_memory&) = delete;
  peer_memory& operator=(const peer_memory&) = delete;

  /// The offset of the first byte a SIGBUS was taken at, if one was; it stays.
  [[nodiscard]] std::optional<std::uint64_t> fault() const noexcept;
  /// What to say about that fault: the streamer's memory shrank under the receiver (errc::transport).
  [[nodiscard]] std::string fault_message() const;

 private:
  std::size_t slot_;
  std::string name_;
  std::size_t index_;
};

/// True while any peer_memory exists (one atomic load): the copier then guards its host copies.
[[nodiscard]] bool peer_memory_mapped() noexcept;

/// Runs body(arg) so that a SIGBUS in peer memory on this thread ends it early: returns nullopt
/// when it ran to its end, else the message of the fault (peer_memory::fault_message()). `body`
/// must be plain copying: it is left by siglongjmp, so no C++ object with a destructor may live in
/// it, and it must take no lock and allocate nothing. Nested calls are allowed.
std::optional<std::string> guarded(void (*body)(const void*), const void* arg);

}  // namespace refit::copy
