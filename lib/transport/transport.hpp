// refit — transports: the buffers batch bytes travel through, how they are shared with the peer,
// and the ordering between the side that writes a buffer and the side that reads it.
//
// Layer 6. Every place CUDA is touched lives here or in lib/copy. The streamer and receiver drive
// a transport through the calls below, in this order per batch:
//   streamer: begin_pack(i) → (copies on stream()) → end_pack(i) → send BATCH
//   receiver: receive BATCH → begin_read(i) → (copies / callback on stream()) → end_read(i)
// A transport where ordering is carried by the REQ/REP messages themselves (host_shm) makes
// these calls no-ops.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "channel/fd_link.hpp"
#include "copy/copy.hpp"
#include "plan/route.hpp"
#include "refit/error.hpp"
#include "refit/model.hpp"
#include "refit/options.hpp"
#include "wire/wire.hpp"

namespace refit::transport {

/// Bytes of one batch in a direct session (cuda_ipc direct). No buffer holds them, so both sides
/// use this size instead of the buffers' when they plan and check batches: a batch is then only
/// a manifest message, and larger ones mean fewer round trips.
inline constexpr std::uint64_t direct_batch_bytes = 1ull << 30;

/// One entry of a batch, for transports that move a batch entry by entry (nccl: one broadcast
/// per entry, the batch's as one group). On the streamer: the bytes to send; on a receiver: where
/// they land. `data` null means "in the batch's buffer at `offset`" (a packed entry on the
/// streamer, a staged one on a receiver); otherwise the entry's own tensor, sent from or received
/// into in place.
///
/// In a parts session (source::parts(), sink::parts()) a segment is one receiver's part of an
/// entry: on the streamer `peer` names that receiver (from 1, its rank), on a receiver it is 0
/// (from the streamer).
struct segment {
  std::byte* data = nullptr;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  std::uint32_t peer = 0;
};

/// Runs every job of `jobs` at once, each on a thread of its own but the first (run on the calling
/// thread), and returns when all have returned; where no thread can be had, the rest run in turn.
/// For aborts of NCCL communicators: an abort frees its communicator's memory, and a free waits for
/// every kernel on the device, so aborting one while another's kernel still waits for a peer that
/// is gone would wait forever. Each abort raises its own communicator's abort flag before it frees
/// anything: with all under way at once, every kernel ends. The jobs must not throw.
void at_once(std::span<const std::function<void()>> jobs) noexcept;

/// The segments of a batch whose entries all lie in its buffer (a delta's): one, from the buffer's
/// start to the end of its last entry, or none when no entry has bytes. Both ends of a transport
/// that moves entries derive it from the batch's manifest, so they agree.
std::vector<segment> buffer_prefix(std::span<const wire::entry> entries);

/// Destination `d` as the "T" record a receiver's reply to HELLO describes it by (wire::dest_record):
/// its view, and where it lies among the memory the reply shares (`allocation`, `offset`;
/// no_allocation where the transport shares none: nccl's parts sessions).
std::string dest_record_of(const plan::destination& d, std::uint64_t allocation = wire::dest_record::no_allocation,
                           std::uint64_t offset = 0);
/// The destination record `r` describes, on `dev`, without memory (data null: the caller's).
plan::destination destination_of(const wire::dest_record& r, device dev);

/// A destination of a direct session: its first byte (in the streamer's mapping of the receiver's
/// weights) and the runs that move a source into it (kept by the source: see source::routes()).
/// In a parts session `base` is null (the receiver writes its own memory) and `receiver` says whose
/// destination it is (from 0).
struct routed {
  std::byte* base = nullptr;
  std::span<const plan::run> runs;
  std::size_t receiver = 0;
  /// The destination lies in memory the copy engines write slowly: its copies go by the kernel
  /// (copy::op::kernel_only).
  bool kernel_only = false;
};

/// What a transport can do: the streamer and the receiver ask this instead of testing for a kind.
struct capabilities {
  /// Receivers one streamer serves at once.
  std::size_t max_receivers = 1;
  /// Serving several needs direct writes: each receiver's weights are written where they are,
  /// nothing is staged in buffers the receivers would share (cuda_ipc).
  bool several_need_direct = false;
  /// A failure at any receiver ends the session everywhere (its collective is gone).
  bool session_dies_on_error = false;
  /// Can write in place, without buffers, when the receivers grant session_mode::in_place
  /// (streamer_options::direct asks for it): cuda_ipc direct, nccl in place.
  bool writes_in_place = false;
  /// Each receiver's part of a session is its own, or shared read-only (host_shm's buffers, which
  /// every receiver maps and the streamer reuses once all have answered): one may leave an open
  /// session, or fail during a version, without the others' session changing.
  bool peers_apart = false;
  /// The source is made for its receivers and cannot serve another set (nccl: one communicator of
  /// receivers + 1 ranks, made with the streamer): the receivers cannot change.
  bool fixed_receivers = false;
};
/// The capabilities of the transport registered under `name` (see registry.hpp); defaults (one
/// receiver, buffers only) for a name nothing registered.
capabilities capabilities_of(std::string_view name) noexcept;
/// The same for a built-in transport (the defaults for one this build lacks).
capabilities capabilities_of(transport_kind kind) noexcept;

/// Options a transport is built from (the subset of streamer/receiver options it needs).
struct source_options {
  std::string name = "host_shm";  ///< the registered transport
  std::size_t count = 2;
  std::uint64_t bytes = 256ull << 20;
  int device = 0;
  /// nccl: receivers (ranks 1..n); the streamer is rank 0.
  std::size_t receivers = 1;
  /// Ask the receivers for session_mode::in_place (transports that write in place).
  bool direct = false;
  /// nccl: a twin communicator per session (streamer_options::nccl_twin).
  bool twin = false;
  /// The longest a host wait on the receivers' GPU work may take (streamer_options::timeout).
  std::chrono::milliseconds timeout{30000};
};

/// Streamer side: owns the buffers.
class source {
 public:
  virtual ~source() = default;
  /// The name it is registered under.
  [[nodiscard]] virtual std::string_view name() const noexcept = 0;
  [[nodiscard]] virtual std::size_t count() const noexcept = 0;
  [[nodiscard]] virtual std::uint64_t buffer_bytes() const noexcept = 0;
  /// Base address of buffer i (a host pointer, or a device pointer for CUDA transports).
  [[nodiscard]] virtual std::byte* data(std::size_t i) noexcept = 0;
  /// Where the buffers live.
  [[nodiscard]] virtual device where() const noexcept = 0;
  /// The copy engine packing into these buffers should use.
  [[nodiscard]] virtual copy::engine engine() const noexcept = 0;
  /// The stream packs are enqueued on (cudaStream_t), nullptr on the CPU.
  [[nodiscard]] virtual void* stream() noexcept = 0;

  /// Prepares a new session and describes it in `h` (transport, buffers, handles, device).
  /// May recreate buffers (host_shm makes fresh segments: the last session's were unlinked).
  virtual void open_session(wire::hello& h) = 0;
  /// What HELLO to receiver k (from 0) carries of this session beyond what open_session() put in
  /// `h` for all: `h.session` is the transport's own bytes, which only its sink decodes (nccl:
  /// the communicator's id and that receiver's rank). Nothing by default.
  virtual void hello_for(std::size_t k, wire::hello& h) const { (void)k, (void)h; }
  /// Called after HELLO went to every receiver and before their replies are awaited: transports
  /// whose set-up needs every process at once (nccl: ncclCommInitRank) do it here, within
  /// `timeout`. `answered()` is true once some receiver replied: one that refused the session
  /// (nccl: it loaded another NCCL) never joins, so the set-up returns then, built or not, and the
  /// reply says why. Throws refit::error (nccl, timeout) and leaves nothing half-built.
  virtual void join(milliseconds timeout, const std::function<bool()>& answered) { (void)timeout, (void)answered; }
  /// Every receiver replied OK to HELLO (`replies`, one per receiver, in order): everything is
  /// mapped (host_shm unlinks its segments).
  virtual void session_accepted(std::span<const wire::ok> replies) = 0;
  /// The session ended (BYE, or the peer was lost). Never throws.
  virtual void close_session() noexcept = 0;

  /// True when this session writes straight into the receiver's weights (cuda_ipc direct): the
  /// receiver offered them in its reply to HELLO and session_accepted() mapped them. Then
  /// routes() replace the buffers and begin_pack/end_pack/entries are not called.
  [[nodiscard]] virtual bool direct() const noexcept { return false; }
  /// Where the bytes of a tensor go in a direct session: each of the receiver's destinations of
  /// that name (a base address in the mapped weights) and the runs that reach it (plan::route).
  /// Throws refit::error (errc::apply) when the receiver's table has no such name or the tensor
  /// does not fit a destination (dtype, shape, slice): nothing is written. The runs are the
  /// source's, valid until the session closes or routes() is asked for the same name with another
  /// dtype or shape (a source keeps its shape across refits, so they are computed once).
  virtual std::vector<routed> routes(const tensor_meta& meta) {
    (void)meta;
    throw error(errc::internal, "routes() outside a direct session");
  }
  /// Stops asking for direct sessions (after the receiver's offer could not be mapped).
  virtual void disable_direct() noexcept {}
  /// True in a direct session whose every destination lies on another GPU than the streamer's (a
  /// receiver on a GPU of its own, reached over NVLink or PCIe): there the copy engines write at
  /// the peer link's speed and the copy kernel does not (0.98 against 0.92 of
  /// cudaMemcpyPeerAsync over NVLink), so the streamer's automatic engine sends such writes with
  /// them.
  [[nodiscard]] virtual bool peers_elsewhere() const noexcept { return false; }
  /// True when every receiver of this session receives every entry in place (nccl: each one
  /// granted session_mode::in_place in its reply to HELLO, see sink::offer_in_place). No buffer holds a batch then,
  /// so batches are planned with direct_batch_bytes, and every tensor must be where() the
  /// transport sends from.
  [[nodiscard]] virtual bool in_place() const noexcept { return false; }
  /// True when this in-place session sends each receiver only its part of every entry (nccl: some
  /// receiver's table has views, slices or several destinations of one tensor, and described them
  /// in its reply to HELLO, see sink::parts()). Then routes() says which bytes of a tensor each
  /// receiver takes (`base` null), and each segment passed to entries() is one receiver's part
  /// (segment::peer), sent from where it is or from gather().
  [[nodiscard]] virtual bool parts() const noexcept { return false; }
  /// True when some receiver of this parts session takes parts that do not lie in one range of
  /// their tensor (a column slice of a row-major tensor: a row-parallel shard), which are gathered
  /// before they are sent, or has a view whose rows lie apart (a narrow(1)), which receives its
  /// parts into memory of its own first: its batches are then planned buffer-sized, not
  /// direct_batch_bytes, so that the gather (and scatter) memory of a batch stays within
  /// buffer_bytes (more, only where receivers take different column slices of one tensor).
  [[nodiscard]] virtual bool gathers() const noexcept { return false; }
  /// In a parts session: memory of at least `bytes` bytes on where() for the parts of the batch in
  /// buffer i that do not lie in one range of their tensor (a column slice), gathered there by
  /// copies on stream() after begin_pack(i). Valid until the session closes; nullptr where the
  /// transport has none.
  virtual std::byte* gather(std::size_t i, std::uint64_t bytes) {
    (void)i, (void)bytes;
    return nullptr;
  }
  /// In an in-place session: buffer i, of direct_batch_bytes, for the entries that must be packed
  /// after all (converted ones: the receivers ask for another dtype than the tensor's), made on
  /// first use and ordered like any buffer (begin_pack / entries / end_pack); nullptr where the
  /// transport has none (the streamer then refuses to convert in place).
  [[nodiscard]] virtual std::byte* staging(std::size_t i) {
    (void)i;
    return nullptr;
  }

  /// Before packing into buffer i: orders the packing after the receiver's last read of it.
  virtual void begin_pack(std::size_t i) = 0;
  /// True when begin_pack(i) orders the packing after the receivers' reads of buffer i by itself
  /// (an event each receiver records after enqueuing its reads of a batch, before replying to it;
  /// or the streamer's own stream order): the streamer may then pack a batch before it has heard
  /// the reply to the one before. False (host_shm, whose receivers reply first and then copy):
  /// the reply to batch k - 1 must be in before buffer (k + 1) mod count is packed.
  [[nodiscard]] virtual bool orders_reuse() const noexcept { return false; }
  /// Orders the packing after the work enqueued so far on a producer stream (cudaStream_t).
  virtual void after(void* producer_stream) = 0;
  /// After packing buffer i: makes its bytes visible to the receiver.
  virtual void end_pack(std::size_t i) = 0;
  /// True when the transport moves a batch entry by entry (nccl). An entry whose tensor is
  /// already where() the buffers are is then not packed: it is sent from the tensor itself. The
  /// streamer passes every entry of the batch to entries() before end_pack(i), in entry order.
  [[nodiscard]] virtual bool moves_entries() const noexcept { return false; }
  /// The entries of the batch in buffer i (see segment). Throws refit::error(internal) for a
  /// segment outside buffer i.
  virtual void entries(std::size_t i, std::span<const segment> batch) { (void)i, (void)batch; }
  /// Waits until all local work of this refit is complete.
  virtual void drain() = 0;
  /// A direct session, after its last write is enqueued: marks the writes so far for the
  /// receivers, which wait for them themselves at END before they commit (sink::await_writes),
  /// so END's round trip overlaps the last copies. False (the default) where the transport cannot:
  /// the streamer then drains before END.
  [[nodiscard]] virtual bool hand_over_writes() { return false; }

  /// Where a receiver can read bytes of the streamer's own memory itself (see share()).
  struct shared {
    std::uint32_t source = 0;  ///< wire::entry::source: from 1, in the order announced in this refit
    std::uint64_t offset = 0;  ///< of the bytes in that memory
  };
  /// A buffers session of a transport whose receivers can map the streamer's memory (cuda_ipc on one
  /// host): where the receiver reads the `bytes` bytes at `p` (memory of where()) itself, instead
  /// of the streamer packing them into a buffer. Memory shared for the first time in this refit
  /// appends its record to `announce` (wire::batch::sources). nullopt when it cannot be shared (the
  /// streamer then packs the bytes): the default, and memory the driver will not export.
  virtual std::optional<shared> share(const void* p, std::uint64_t bytes, std::vector<std::string>& announce) {
    (void)p, (void)bytes, (void)announce;
    return std::nullopt;
  }
  /// A new refit starts: what share() announced is numbered from 1 again.
  virtual void forget_shared() noexcept {}
  /// The refit in progress was committed by every receiver (END answered): what share() announced
  /// in it is what they hold from now on. Nothing by default.
  virtual void refit_committed() noexcept {}
  /// The links that carry file descriptors to the receivers of this session, one per receiver in
  /// order (their control lanes', see channel/fd_link.hpp; null where there is none): memory shared
  /// as descriptors (VMM) needs them, and is packed (or, offered for direct writes, staged)
  /// without. Ignored by default.
  virtual void link(std::vector<std::shared_ptr<channel::fd_link>> fds) { (void)fds; }
  /// True when the work enqueued on stream() so far is complete (packs, and the producer streams
  /// after() ordered it after): a batch that packed nothing is then wire::batch::ready.
  [[nodiscard]] virtual bool idle() { return true; }
};

/// Receiver side: maps the streamer's buffers.
class sink {
 public:
  virtual ~sink() = default;
  /// The name it is registered under (what HELLO's `transport` names).
  [[nodiscard]] virtual std::string_view name() const noexcept = 0;
  /// Maps what `h` describes and puts what the streamer needs back into `reply.handles`.
  /// Throws refit::error (transport, cuda, peer) with a message that names the alternative
  /// transport when this one cannot work between these two processes.
  virtual void attach(const wire::hello& h, wire::ok& reply) = 0;
  /// Unmaps everything attach() mapped. Never throws.
  virtual void detach() noexcept = 0;
  /// After attach(): when `h` asks for session_mode::in_place and the streamer can write every
  /// destination of `table` itself (cuda_ipc: CUDA memory it can export; views and slices
  /// included), describes them in `reply.handles`, sets `reply.mode` to in_place and returns true;
  /// the receiver then only validates batches (the streamer writes the bytes). Returns false,
  /// changing nothing, otherwise. Never throws for memory it cannot share (that just means
  /// staging).
  virtual bool offer_direct(const wire::hello& h, std::span<const plan::destination> table, wire::ok& reply) {
    (void)h, (void)table, (void)reply;
    return false;
  }
  /// The reply to HELLO went out: sends what must follow it to the streamer (cuda_ipc: the
  /// descriptors of VMM weights offered for direct writes, through the link). Never throws.
  virtual void after_reply() noexcept {}
  /// Called once per session after attach() (and offer_direct() when that declined; `table` is
  /// empty for a callback sink). For a transport that moves entries one by one (nccl): when `h`
  /// asks for session_mode::in_place and every destination of `table` can be received into in
  /// place (on the sink's device; dense, whole and one per name, or else the streamer sends each
  /// receiver its parts: see parts()), sets `reply.mode` to in_place and
  /// returns true; batches are then planned with direct_batch_bytes, every entry lands in its
  /// destination, and no buffer exists (data() is null). Otherwise returns false, having made the
  /// buffers batches are staged in. Throws refit::error(cuda) when those cannot be allocated.
  virtual bool offer_in_place(const wire::hello& h, std::span<const plan::destination> table, wire::ok& reply) {
    (void)h, (void)table, (void)reply;
    return false;
  }
  /// True when the in-place session offer_in_place() granted receives only the bytes this
  /// receiver's destinations take (nccl: the table has views, slices or several destinations of
  /// one tensor, on the sink's GPU). The receiver then passes entries() one segment per
  /// destination an entry reaches (in table order, none where it takes nothing of the entry),
  /// each received straight into that destination where its part is one range of it, else into
  /// scatter() memory, from which the receiver copies it into place after begin_read().
  [[nodiscard]] virtual bool parts() const noexcept { return false; }
  /// In a parts session: memory of at least `bytes` bytes on where() for the parts of the batch in
  /// buffer i that do not land in one range of their destination (a view whose rows lie apart),
  /// received there and copied into place on stream() between begin_read(i) and end_read(i).
  /// Valid until the next session; nullptr where the transport has none.
  virtual std::byte* scatter(std::size_t i, std::uint64_t bytes) {
    (void)i, (void)bytes;
    return nullptr;
  }
  [[nodiscard]] virtual bool attached() const noexcept = 0;
  [[nodiscard]] virtual std::size_t count() const noexcept = 0;
  [[nodiscard]] virtual std::uint64_t buffer_bytes(std::size_t i) const noexcept = 0;
  [[nodiscard]] virtual const std::byte* data(std::size_t i) const noexcept = 0;
  [[nodiscard]] virtual device where() const noexcept = 0;
  [[nodiscard]] virtual copy::engine engine() const noexcept = 0;
  [[nodiscard]] virtual void* stream() noexcept = 0;
  /// True when copies are only enqueued (GPU), so the reply can be sent after enqueuing them;
  /// false when they run on the host, so the reply goes first and the copy overlaps the
  /// streamer packing the next batch.
  [[nodiscard]] virtual bool asynchronous() const noexcept = 0;

  /// True when the transport moves a batch entry by entry (nccl). An entry whose destination is
  /// where() the buffers are is then received straight into it, with nothing to apply; the
  /// receiver passes every entry of the batch to entries() before begin_read(i), in entry order,
  /// and copies (or hands to the callback) only those staged in buffer i.
  [[nodiscard]] virtual bool moves_entries() const noexcept { return false; }
  /// Where each entry of the batch in buffer i lands (see segment). Throws refit::error(internal)
  /// for a segment outside buffer i.
  virtual void entries(std::size_t i, std::span<const segment> batch) { (void)i, (void)batch; }
  /// Before reading buffer i: orders the reads after the streamer's packing of it.
  virtual void begin_read(std::size_t i) = 0;
  /// After the reads of buffer i are enqueued: lets the streamer reuse it.
  virtual void end_read(std::size_t i) = 0;
  /// Waits until every read and copy enqueued so far is complete (END, before committing).
  virtual void drain() = 0;
  /// A direct session's END, before committing: waits until the writes the streamer marked before
  /// END (source::hand_over_writes) are complete, at most the receiver's timeout (errc::timeout:
  /// nothing may be committed). Nothing by default.
  virtual void await_writes() {}

  /// True when this sink can read the streamer's memory where it is (source::share): it maps what
  /// batches announce, and a wire::batch::ready batch needs no begin_read().
  [[nodiscard]] virtual bool maps_sources() const noexcept { return false; }
  /// Maps the memory a batch announces (wire::batch::sources), numbered on from what earlier
  /// batches of the refit announced. Throws refit::error (protocol when the sink maps nothing,
  /// transport when the memory cannot be mapped); what it mapped before stays.
  virtual void map_sources(std::span<const std::string> records) {
    if (!records.empty())
      throw error(errc::protocol,
                  "a BATCH announces memory of the streamer to read in place, which this transport "
                  "cannot map");
  }
  /// The first of `bytes` bytes at `offset` of source `index` (wire::entry::source, from 1) in this
  /// process. Throws refit::error(protocol) for a source not announced or a range outside it.
  [[nodiscard]] virtual const std::byte* source_data(std::uint32_t index, std::uint64_t offset,
                                                     std::uint64_t bytes) const {
    (void)offset, (void)bytes;
    throw error(errc::protocol, "an entry reads source " + std::to_string(index) +
                                    " of the streamer in place, which this transport cannot map");
  }
  /// Whether source `index` (announced: source_data) is memory the copy engines read slowly: a
  /// cudaMalloc allocation larger than copy::engines_slow_above, whose copies then go by the kernel
  /// alone (copy::op::kernel_only).
  [[nodiscard]] virtual bool source_kernel_only(std::uint32_t index) const noexcept {
    (void)index;
    return false;
  }
  /// The link that carries file descriptors from the streamer in this session (the control lane's),
  /// or null when there is none. Ignored by default.
  virtual void link(std::shared_ptr<channel::fd_link> fds) { (void)fds; }
  /// The refit ended (committed, failed or aborted; nothing of it is in flight): the next one numbers
  /// its sources from 1 again. Memory no refit since the previous call read may be unmapped.
  virtual void end_sources() noexcept {}
  /// The refit in progress was aborted (bad message, dead peer, idle timeout): transports whose
  /// device work may wait on a peer that will never come (nccl) abort it here so that nothing
  /// hangs; the next HELLO builds afresh. Never throws.
  virtual void abort() noexcept {}
};

/// Creates the streamer side of the transport registered as options.name. Throws
/// refit::error(invalid_argument) for a name nothing registered (naming those that are),
/// (transport/cuda) when buffers cannot be created.
std::unique_ptr<source> make_source(const source_options& options);
/// Creates an unattached receiver side for the transport named in a HELLO ("host_shm", ...).
/// Throws refit::error(transport) naming what is registered when nothing is under that name.
/// `timeout` bounds every wait of the sink on its peer (nccl: communicator set-up and drain).
std::unique_ptr<sink> make_sink(std::string_view transport, int device, milliseconds timeout = milliseconds{60000});

/// "hostname/boot-id": equal on two processes exactly when they run on one host (one kernel).
std::string host_identity();
/// "hostname:pid", for messages.
std::string process_identity();

}  // namespace refit::transport
