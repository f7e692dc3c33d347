// refit — the same-host control lane: a streamer's requests and its receiver's replies through
// shared memory instead of ZeroMQ, when both run on one host.
//
// Why: a ZeroMQ round trip passes four threads (each side's I/O thread, twice) and costs 80–150 µs
// on a server VM even when both ends spin, which is most of a small refit's time (BEGIN, the batch
// manifests, END). Through the lane, a message is a copy into a shared segment and a store; a
// waiting end sees it while it spins, and one that sleeps is woken by one byte through a FIFO (a
// single wake-up, where ZeroMQ has two on each way).
//
// What it is: a private directory (mode 0700, on /dev/shm when it can be, else $XDG_RUNTIME_DIR or
// /tmp) made by the receiver, holding the segment (mode 0600), three FIFOs (the doorbells of
// the two ends, and one only the receiver reads, whose end shows the streamer that it died) and
// the socket `fds` of the descriptor link (fd_link.hpp), which the streamer connects to. The
// receiver offers it in its OK to HELLO (wire::ok::lane) to a streamer of its host that asked for
// one (wire::hello::lane); the streamer opens it, checks the segment's random nonce
// against the offer, and from then on sends its requests there. Either end may use ZeroMQ instead
// at any time (the receiver listens to both and answers each request the way it came), so a lane
// that cannot be opened costs nothing but itself. The streamer removes the directory as soon as it
// has opened everything in it (both ends keep what they opened); the receiver removes it when the
// lane is replaced (the next HELLO) or closed before that. Its name carries the receiver's pid:
// the lanes of receivers killed before their streamer opened them are removed by the next lane
// made on the host (create()), never the lane of a live process.
//
// Each direction is one slot of slot_bytes with a posted and a taken counter: the writer waits
// until the slot is free, writes a chunk (a message longer than the slot is sent in order, chunk
// by chunk), then counts it posted; the reader copies it and counts it taken. The request/reply
// discipline of the channel stays as it is: one request, then its reply. Every field read from the
// segment is checked, since the other process writes it. Beside the slots, one word carries the
// streamer's announcements (announce(): a request comes soon, wait for it awake).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "channel/fd_link.hpp"

namespace refit::channel {

class lane {
 public:
  using clock = std::chrono::steady_clock;
  /// Bytes of each direction's slot; longer messages go in chunks.
  static constexpr std::uint64_t slot_bytes = std::uint64_t{1} << 20;
  /// The most bytes of one message: ZeroMQ's limit (wire::max_message_bytes, not included to keep
  /// the channel below the wire layer).
  static constexpr std::uint64_t max_message_bytes = std::uint64_t{64} << 20;
  /// How long a whole message may take once its first chunk arrived, when the caller's deadline
  /// is sooner (64 MiB cross the slot in a few tens of ms).
  static constexpr std::chrono::seconds rest_of_message{5};

  /// Receiver: makes a lane (first removing the lanes dead receivers left behind). Throws
  /// refit::error(errc::io) naming what failed (no room in /dev/shm, no writable directory), in
  /// which case the receiver offers none.
  static std::unique_ptr<lane> create();
  /// Streamer: opens the lane of `offer` (what the receiver's offer() said), then removes its
  /// files: nobody else can open it after. Throws refit::error(errc::io) when it cannot (another
  /// host or mount namespace, a lane already removed) and errc::protocol when the offer or the
  /// segment is not a lane's.
  static std::unique_ptr<lane> open(std::string_view offer);

  ~lane();
  lane(const lane&) = delete;
  lane& operator=(const lane&) = delete;

  /// What the streamer needs to open it: the directory and the nonce.
  [[nodiscard]] const std::string& offer() const noexcept { return offer_; }

  /// The descriptor link to the other end (null when none could be made); it outlives the lane in
  /// whoever holds it.
  [[nodiscard]] const std::shared_ptr<fd_link>& fds() const noexcept { return fds_; }

  /// True when a message for this end (its first chunk) is waiting.
  [[nodiscard]] bool ready() const noexcept;

  /// Sends a whole message (chunk by chunk when longer than the slot), waiting for the slot to be
  /// free at most until `deadline` (spinning for `spin` first). False when the peer did not take a
  /// chunk in time (the message is then incomplete: the lane must not be used again); throws
  /// errc::peer when the receiver closed the lane (see close()) or its process ended: nothing was
  /// delivered, and a new session (HELLO through ZeroMQ) reaches whoever serves the endpoint now.
  bool send(std::string_view bytes, clock::time_point deadline, std::chrono::microseconds spin);

  /// Receives a whole message: nullopt when none began to arrive by `deadline` (spinning for
  /// `spin` first). Once its first chunk is here, the whole message must have arrived by
  /// `deadline` or rest_of_message after that chunk, whichever is later. Every header field of a
  /// chunk is read once from the segment and checked there; a message announced longer than
  /// max_message_bytes is refused before anything is allocated for it.
  /// Throws refit::error(errc::protocol) for a chunk that breaks the rules, errc::timeout when
  /// a message stops half-way or is not whole in time, or (streamer) the receiver's process
  /// ended before answering (at once, not at the deadline), and errc::peer when the receiver
  /// closed the lane (see close()).
  std::optional<std::string> receive(clock::time_point deadline, std::chrono::microseconds spin);

  /// Waiting beside other things (the receiver's ZeroMQ sockets): poll doorbell() for POLLIN after
  /// arm(), which asks the peer to ring it for its next chunk; after the wait, disarm() (which
  /// empties the doorbell), then look at ready() again.
  [[nodiscard]] int doorbell() const noexcept { return my_bell_; }
  void arm() noexcept;
  void disarm() noexcept;
  /// Rings the peer's doorbell when it sleeps, posting nothing: a receiver waiting in a version
  /// wakes and spins again (rep_channel::wait_ready), so that a request sent soon after finds it
  /// awake. Costs a load when the peer is awake. Never throws.
  void wake_peer() noexcept { ring_peer(); }
  /// True while the peer waits asleep on its doorbell (armed): a message now pays its wake-up.
  [[nodiscard]] bool peer_asleep() const noexcept;

  /// The most an announcement holds a receiver awake, whatever the streamer asked.
  static constexpr std::chrono::seconds announce_max{10};
  /// Streamer: says a request follows within `hold` (at most announce_max; whole milliseconds):
  /// the receiver, told at once (its doorbell rung when it sleeps), waits for requests spinning
  /// instead of sleeping until one comes or `hold` has passed (awake_until()). Never throws.
  void announce(std::chrono::milliseconds hold) noexcept;
  /// Receiver: until when the streamer's last announcement holds this end awake (a time passed
  /// when there is none, or once a request was taken since: request_taken()). A new announcement
  /// is seen here, and its hold counts from the first look. A load when nothing changed.
  [[nodiscard]] clock::time_point awake_until() noexcept;
  /// Streamer: writes `word` as the announcement (its number times 2^16 plus milliseconds) and
  /// rings; no check. Tests write what a broken peer would.
  void announce_unchecked(std::uint64_t word) noexcept;
  /// Receiver: a request was taken; the announcement it answered holds this end awake no more.
  void request_taken() noexcept { awake_until_ = clock::time_point{}; }

  /// Posts one chunk to the peer with these header fields and `data` in the slot (at most
  /// slot_bytes of it), counting it `posts` times posted; no check, no wait. send() posts each
  /// chunk through it once the slot is free; tests post what a broken peer would.
  void post_unchecked(std::uint64_t total, std::uint64_t offset, std::uint64_t bytes, std::string_view data,
                      std::uint64_t posts = 1) noexcept;

  /// Receiver: true once the streamer that opened the lane has let go of it: its process ended
  /// (SIGKILL, OOM) or it closed the lane. The kernel closes the streamer's end of the `life` FIFO
  /// with its last descriptor, and this end then polls POLLHUP. Never waits.
  [[nodiscard]] bool streamer_gone() const noexcept;
  /// Receiver: a descriptor that polls POLLHUP once streamer_gone() (for waits beside others); -1
  /// on the streamer's side.
  [[nodiscard]] int hangup() const noexcept { return me_ == side::receiver ? life_ : -1; }

  /// Receiver: removes the directory (what is open stays usable). Never throws.
  void remove_files() noexcept;
  /// Receiver: closes the lane (also done by the destructor): the streamer's next send() throws
  /// refit::error(errc::peer) without sending (req_channel then sends through ZeroMQ), and a
  /// receive() waiting for a reply that never came throws errc::peer too (say HELLO again).
  void close() noexcept;

 private:
  struct segment;
  enum class side : std::uint8_t { receiver = 0, streamer = 1 };
  lane() = default;

  /// Waits until `done()` (spinning for `spin`, then sleeping on the doorbell); false at `deadline`.
  template <class Pred>
  bool wait_until(Pred done, clock::time_point deadline, std::chrono::microseconds spin);
  void ring_peer() noexcept;
  /// Streamer: the receiver closed the lane, or its process ended.
  [[nodiscard]] bool closed() const noexcept;
  /// Streamer: throws errc::peer when the receiver closed the lane or its process ended.
  void refuse_if_closed();
  /// Streamer: true once the receiver's process has ended (asked without waiting).
  bool receiver_gone();
  [[nodiscard]] side peer() const noexcept { return me_ == side::receiver ? side::streamer : side::receiver; }

  side me_ = side::receiver;
  segment* seg_ = nullptr;
  std::size_t mapped_ = 0;
  int my_bell_ = -1;
  int peer_bell_ = -1;
  /// A FIFO whose read end only the receiver holds (opened at create()) and whose write end the
  /// streamer holds: when the receiver's process ends, the kernel closes the read end and the
  /// streamer's end polls POLLERR, so a request to a dead receiver fails at once instead of at its
  /// deadline. (A child the receiver forks inherits the read end; the deadline then applies.)
  int life_ = -1;
  bool gone_ = false;                 ///< streamer: the receiver's process has ended
  std::uint64_t announced_ = 0;       ///< streamer: announcements made; receiver: the last one seen
  clock::time_point awake_until_{};   ///< receiver: see awake_until()
  std::shared_ptr<fd_link> fds_;      ///< shared: whoever takes the link keeps it past the lane
  std::string dir_;                   ///< receiver: the directory, until removed
  std::pair<dev_t, ino_t> dir_id_{};  ///< receiver: the directory's device and inode
  std::string offer_;
};

}  // namespace refit::channel
