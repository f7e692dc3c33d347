// refit — the generation side: receives batches and applies them into weights.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "refit/error.hpp"
#include "refit/export.hpp"
#include "refit/model.hpp"
#include "refit/options.hpp"

namespace refit {

/// Where a receiver lands a version's bytes before they reach the engine's weights
/// (receiver_options::stage).
enum class stage_kind : std::uint8_t {
  /// Today's in-place writes: every batch is copied into the weights as it arrives, and END commits.
  none,
  /// Host memory the receiver owns: every batch lands in the stage, the weights stay untouched (the
  /// engine keeps reading them), and END *prepares* the version; receiver::apply_prepared() copies
  /// the stage into the weights (one local copy) and commits. Host weights over host_shm, or weights
  /// on one GPU over cuda_ipc and nccl with the stage in page-locked host memory (an engine without
  /// spare GPU memory: the apply is the copy kernel reading host memory, ~1.1 x the H2D floor).
  host,
  /// Memory of the engine's GPU the receiver owns: the same as host, for a parameter table on one
  /// GPU over the CUDA transports (cuda_ipc, whose direct writes then go into the stage, and nccl,
  /// which receives into it in place); apply_prepared() is one launch of the copy kernel, on the
  /// engine's stream when it gives one. Needs a build with CUDA.
  device,
};
REFIT_API std::string_view to_string(stage_kind k) noexcept;

struct receiver_options {
  /// Where to bind. Empty: a fresh "ipc://" socket in a private directory (mode 0700) under
  /// $XDG_RUNTIME_DIR or /tmp. "tcp://*:0" style endpoints bind to 127.0.0.1 unless an address is
  /// given; read the chosen port back from endpoint().
  std::string endpoint;
  /// CUDA device applies run on (cuda_ipc, nccl).
  int device = 0;
  /// How applies are copied on GPU transports.
  copy_engine engine = copy_engine::automatic;
  /// A refit in progress that sees no message for this long is aborted (the streamer is
  /// presumed dead; committed_version() is unchanged and dirty() is true if anything was applied).
  milliseconds idle_timeout{60000};
  /// Session token; empty: the value of REFIT_TOKEN, or none. A HELLO with another token is
  /// refused with errc::unauthorized and does not disturb the session in use.
  std::string token;
  curve_keys curve;
  /// The digest of the engine layout (route table) this receiver's parameter table was registered
  /// from, "" for none. A streamer that says another one at HELLO is refused
  /// (errc::invalid_argument naming both digests) and nothing is exchanged; either side without a
  /// digest accepts any.
  std::string layout;
  /// Streamers that send each version together (sharded trainers: every trainer rank streams its
  /// own shards, tensor_ref::shard), 1 for a streamer alone. The receiver binds one endpoint per
  /// streamer (endpoints()); rank k (streamer_options::group_rank) connects to endpoints()[k]. With
  /// more than one, `endpoint` must be "" (private ipc endpoints), a tcp endpoint with port 0, or
  /// contain "{rank}" (replaced by each rank's number). See receiver::endpoints() for how a group's
  /// version commits.
  std::size_t streamers = 1;
  /// Threads that check and apply a delta's patches into host weights (the serve_one() caller among
  /// them), made at the first such batch and joined when the receiver is destroyed; 0: min(hardware
  /// threads, 8); at most 256 (errc::invalid_argument). What is written and the checksum do not
  /// depend on it. Deltas into GPU weights are applied on the GPU. A host stage of host weights
  /// (receiver_options::stage) copies into the weights on as many threads of its own (the
  /// apply_prepared() caller among them) when a version carries 32 MiB or more.
  std::size_t delta_threads = 0;
  /// Offer a streamer of this host a shared-memory control lane for its requests (see
  /// streamer_options::control_lane): a private directory of mode 0700 holding a 2 MiB segment and
  /// three FIFOs (two doorbells, and one by which a streamer sees the receiver die), on /dev/shm
  /// when it has room (else $XDG_RUNTIME_DIR or /tmp), made at each HELLO that asks for one and
  /// removed once the streamer has opened it. The receiver still listens on
  /// its endpoint for everything else (HELLO, other streamers). false: ZeroMQ only.
  bool control_lane = true;
  /// Bind a tcp endpoint that other hosts can reach (not loopback) without CURVE. Refused by default
  /// (errc::invalid_argument saying how to set CURVE): the token and every message would cross the
  /// network in the clear and any host could try the endpoint. The environment variable
  /// REFIT_ALLOW_INSECURE=1 allows it too.
  bool allow_insecure_tcp = false;
  /// Stage each version instead of writing the weights as batches arrive (see stage_kind and
  /// receiver::apply_prepared()). With stage_kind::host the receiver takes whole versions and subsets
  /// into a parameter table of host memory over host_shm; with stage_kind::device into a parameter
  /// table on one GPU over cuda_ipc and nccl (errc::invalid_argument in a build without CUDA). A
  /// staged receiver offers its weights to no streamer: a device stage offers itself instead, so a
  /// cuda_ipc streamer that writes directly (the default; the only way it serves several TP ranks)
  /// writes each tensor's copy in the stage, and nccl in place receives into it (a TP rank only its
  /// parts); the rest goes through the buffers into it. It refuses a callback sink (on_batch: errc::invalid_argument), and a
  /// session of another kind or a table elsewhere at BEGIN (errc::invalid_argument). A delta is
  /// staged as its patches: each batch's patches are copied into the stage, checked there and their
  /// checksum terms taken against the weights (only read), so END proves the version; apply_prepared()
  /// writes the patches into the weights.
  stage_kind stage = stage_kind::none;
  /// The most memory (host, or the GPU's for a device stage) the stage may take, 0: what the
  /// version needs. The stage holds a copy of
  /// every registered destination's bytes (from its first byte to its last, each rounded up to 64
  /// bytes): the parameter table's bytes, allocated at the first BEGIN after the table changed (a
  /// device stage offered to a cuda_ipc streamer: at its HELLO) and kept. A BEGIN whose version needs more is refused before anything is written
  /// (errc::invalid_argument saying both byte counts).
  std::uint64_t stage_bytes = 0;
};

/// Called with the entries of one batch. Views are valid only during the call. On CUDA
/// transports `stream` is the cudaStream_t the views are ready on; enqueue work on it and return
/// (the buffer is reused once that stream's work completes). On the CPU `stream` is nullptr.
/// Throwing aborts the refit; the streamer sees errc::apply with the exception's message (a
/// refit::error keeps its own code and message).
using batch_callback = std::function<void(std::span<const tensor_view> views, void* stream)>;

/// What serve_one() did.
enum class receiver_event : std::uint8_t {
  idle,       ///< nothing arrived within the wait
  hello,      ///< a session started (buffers mapped)
  begin,      ///< a refit started
  batch,      ///< a batch was applied (or enqueued)
  committed,  ///< END: the version is live
  /// A refit ended without committing: a bad message, a sink error or a refusing on_begin hook,
  /// an incomplete manifest, the idle timeout, the streamer's ABORT (it failed on its side), or a
  /// HELLO, BEGIN or BYE that arrived before END (that message is handled by the next serve_one()).
  /// Also a BEGIN the receiver refused for its version. committed_version() is unchanged; dirty()
  /// says whether the weights were partly overwritten; last_error() says why. In a group, a version
  /// that ends without committing is reported once, by the call that ended it.
  aborted,
  bye,  ///< the session ended
  /// A message was refused or ignored without touching the session: a stranger's or a bad HELLO,
  /// a BEGIN without a session or a sink, a BATCH or END without a refit, an ABORT of no refit in
  /// progress (answered OK: that refit already ended here).
  refused,
  /// One streamer of a group ended its part of the version (END checked, its reply held): the
  /// version commits, and every streamer of the group hears how it ended, when the last one's END
  /// arrives.
  ended,
  /// A staged receiver (receiver_options::stage): END checked out, the version is whole in the stage
  /// and its streamer heard OK; the weights are untouched until the engine calls apply_prepared()
  /// (prepared_version() says which version waits; on_prepared has run).
  prepared,
};
REFIT_API std::string_view to_string(receiver_event e) noexcept;

/// Figures of the last refit the receiver committed.
struct receiver_stats {
  std::uint64_t version = 0;
  std::uint64_t tensors = 0;
  std::uint64_t bytes = 0;
  std::uint64_t batches = 0;
  double seconds = 0;        ///< BEGIN received to END replied
  double apply_seconds = 0;  ///< copying / enqueuing copies and running callbacks
  double drain_seconds = 0;  ///< waiting at END for the device to finish (GPU transports)
  /// A staged receiver: apply_prepared()'s copy of the stage into the weights (the engine's pause);
  /// `seconds` then ends when END was answered (the version prepared), not at this copy.
  double pause_seconds = 0;
};

/// The receiver. Owns one ZeroMQ REP socket and the mappings of the streamer's buffers.
///
/// Thread rules: serve_one() and the registration functions (add_parameter, clear_parameters,
/// on_batch, on_begin, on_commit, on_abort, on_prepared) from one thread at a time; committed_version(),
/// prepared_version(), dirty(), last_error(), last_stats() and endpoint() from any thread;
/// apply_prepared() from any thread, at any time (it waits for a BEGIN or a registration in hand).
///
/// Staged versions (receiver_options::stage): serve_one() writes only the stage, never the weights,
/// so the engine's own threads may read the weights while versions arrive. A version whose END checks
/// out is *prepared*: its streamer's refit() returns as for a commit, serve_one() returns prepared and
/// on_prepared runs; the engine then calls apply_prepared() between two of its steps (from its own
/// thread, from the serving thread, or from on_prepared to apply at once), which copies the stage
/// into the weights and commits: committed_version() moves and on_commit runs, inside that call. A
/// request that the engine runs between its applies therefore sees exactly one committed version.
/// While a version is prepared and not applied, a BEGIN is refused (errc::apply: "version N is
/// prepared and waits for apply_prepared()", serve_one() returns refused, nothing is written): the
/// stage holds one version and a subset must build on the version the streamer last delivered.
/// A refit that fails before it is prepared leaves the weights untouched: not dirty.
///
/// Lifetimes and rules of the parameter table:
/// - Memory: a destination must stay valid, at its address, while it is registered, and after
///   it is removed (clear_parameters(), on_batch()) until the next refit has committed or the
///   session has ended (BYE, a new HELLO). On GPU transports copies are asynchronous (an aborted
///   refit's may still be queued), and with cuda_ipc direct writes the streamer maps the weights
///   at HELLO and writes them from its own process for the whole session. On host_shm nothing
///   touches a destination outside serve_one(), so it may be freed once removed between refits.
/// - Storage identity: refit writes only where a destination was registered and never moves or
///   reallocates it (engines capture CUDA graphs over their weights). At every HELLO the receiver
///   checks that each registered CUDA destination still lies in a live allocation (and in the one
///   `dest_layout::alloc` names); if the engine freed or reallocated it, the HELLO is refused with
///   errc::invalid_argument naming the tensor and nothing is written: register again.
/// - Changes: registering or clearing between refits (no refit in progress, or from on_commit /
///   on_abort) is allowed and takes effect at the next refit. A session laid out from the table at
///   HELLO (cuda_ipc direct, nccl in place) is then replaced: the receiver refuses the next BEGIN
///   with errc::peer, and the streamer says HELLO again and repeats it by itself (serve_one()
///   returns refused, then hello, then begin). Changing the table or the callback while a refit is
///   in progress (BEGIN accepted, not yet committed or aborted; on_begin included) fails that
///   refit at its next message with errc::apply; nothing is committed.
/// - Empty tensors: a tensor with no elements (a 0 in its shape) has no bytes; its pointer may be
///   null and is never read or written, and it still counts in the manifest (it must arrive,
///   exactly once). A 0-d tensor (shape {}) is a scalar of one element and needs memory: a null
///   pointer is refused (errc::invalid_argument), as for any tensor with bytes. The streamer
///   applies the same rule to tensor_ref.
/// - Refusals: errors the receiver reports reach the streamer's refit() with the same code, their
///   message included: errc::apply for a tensor the table does not know, a dtype or shape that differs
///   from its destination's, a destination in the wrong kind of memory for the transport, a
///   throwing callback or on_begin hook, a sink changed mid-refit, or no sink at all;
///   errc::incomplete when END arrives with registered tensors missing; errc::protocol for a
///   malformed or out-of-order message or a version not newer than the committed one;
///   errc::unauthorized for a wrong token; errc::peer for a BEGIN without a session;
///   errc::needs_whole for a subset or delta BEGIN this receiver holds no base for (see below).
/// - Subset and delta versions (refit_scope::subset, streamer_options::delta): a subset commits when
///   every tensor it sent arrived exactly once (END's totals); the tensors it did not send keep their
///   committed values. It needs a whole version committed since the table last changed, and clean
///   weights (not dirty); else BEGIN is refused with errc::needs_whole before anything is written
///   (serve_one() returns refused). A delta also needs the committed version to be its base, that
///   version's checksum (from its END), a parameter table of plain tensors in the memory the session
///   applies into (host_shm: host; cuda_ipc staged: the receiver's GPU); its patches are applied in place, and END's checksum of the whole new version must
///   match the weights' (updated from the old and new bytes of every write) or the version fails.
///   A delta that fails after writing leaves the receiver poisoned (see poisoned()).
///
/// Hooks (on_begin, on_commit, on_abort) run on the thread calling serve_one(), inside it. They
/// must not call serve_one() or serve(); the other member functions may be called (change the
/// table only from on_commit and on_abort, see above). For every refit whose BEGIN was accepted,
/// on_begin runs first, then the batch callback (callback sink) for each batch, then exactly one
/// of on_commit or on_abort. A BEGIN refused for its version or for want of a sink runs no hook;
/// one that on_begin refuses runs no other. on_commit and on_abort run after the reply to the streamer has
/// gone out, just before serve_one() returns committed or aborted, so a slow hook does not hold up
/// the streamer (it does hold up the next message).
/// A staged receiver runs on_prepared instead of on_commit at END (on_abort as above for a refit
/// that fails before it), then on_commit inside apply_prepared(), or on_abort there if the version
/// was dropped (the table changed). They are not called by the destructor: a
/// receiver destroyed during a refit aborts it silently.
class REFIT_API receiver {
 public:
  /// Binds the socket. Throws refit::error(invalid_argument / io) when it cannot.
  explicit receiver(receiver_options options = {});
  ~receiver();
  receiver(receiver&&) noexcept;
  receiver& operator=(receiver&&) noexcept;
  receiver(const receiver&) = delete;
  receiver& operator=(const receiver&) = delete;

  /// The endpoint to give the streamer (ports resolved); a group's rank 0's.
  [[nodiscard]] std::string endpoint() const;
  /// The endpoint of each streamer of the group (receiver_options::streamers): rank k connects to
  /// endpoints()[k]. A streamer that says another rank or group size at HELLO is refused
  /// (errc::invalid_argument).
  ///
  /// How a group's version commits: every streamer says BEGIN, its batches and END for the same
  /// version (a BEGIN of another version while one is in progress is refused with errc::protocol;
  /// the group never mixes versions). Each streamer's END is checked and held: its refit() returns
  /// when the version ends. It commits when the last END arrives and the byte ranges of every
  /// tensor that the streamers sent cover it exactly once, with one dtype and shape (else
  /// errc::invalid_argument for ranks that disagree or overlap, errc::incomplete for rows no rank
  /// sent, naming the tensor and the ranks), and, for a whole version, every registered tensor
  /// arrived. A streamer that fails (ABORT, a new session, a bad message) or is silent for the idle
  /// timeout (or does not begin within it) fails the version on every lane: each streamer hears it,
  /// with the rank, in the reply to its END or to its next message of that version, its BEGIN
  /// included (errc::incomplete, or errc::timeout for the silent one); a failed version is never
  /// started over by the ranks that had not begun it. A held END is answered within three quarters
  /// of its streamer's reply timeout (streamer_options::timeout, said at HELLO): if the other ranks
  /// have not all ended by then, the version fails (errc::timeout, naming them), so a streamer never
  /// gives up on a version that then commits. The next version starts clean. A group sends whole
  /// versions or subsets, not deltas.
  [[nodiscard]] std::vector<std::string> endpoints() const;

  /// Parameter-table sink: registers a destination. Incoming tensors are checked against it
  /// (name known, dtype and shape equal) and copied into place; END commits only when every
  /// registered name arrived exactly once. Throws errc::invalid_argument for an empty or
  /// duplicate name, a bad shape, a null pointer for a tensor with bytes (see the class comment
  /// for empty and 0-d tensors), or when a callback sink is set. `dest.data` must stay valid as
  /// the class comment says; takes effect at the next refit.
  void add_parameter(const tensor_dest& dest);
  /// The same for a destination in the engine's own layout (see dest_layout): a strided view of an
  /// engine tensor that may take a slice of its source. The same source name may be registered
  /// several times (tied weights, a source split between fused tensors), once per destination.
  /// Throws errc::invalid_argument, naming the tensors, for what add_parameter(dest) refuses and:
  /// strides that are negative, not one per dimension or make the view overlap itself; a slice
  /// whose dimension does not exist, whose start is negative or whose length is not the view's
  /// size along it; a view outside `alloc_bytes` of `alloc`; a destination that writes a byte
  /// another registered destination writes; a name registered before with another dtype. Whether
  /// the source fits (its shape around the slice) is checked when it arrives: errc::apply, before
  /// anything of its batch is written. A version commits when every registered destination was
  /// written exactly once (every registered source name arrived exactly once).
  ///
  /// Conversion (see tensor_dest and refit::quant): a destination whose dtype differs from its
  /// source's is converted by the streamer before the bytes leave it (casts among f32, bf16, f16;
  /// f8_e4m3 quantised per tensor, per 128 × 128 block, per channel or as mxfp8, its scales — of
  /// scale_dtype(q) — written to `dest.scale`).
  /// The receiver asks for it in its reply to HELLO; a streamer serving several receivers refuses
  /// the session (errc::invalid_argument) when two ask one tensor as different things. Also throws
  /// errc::invalid_argument for: a quant on a destination that is not f8_e4m3; a quantised
  /// destination without a scale, or a scale without a quant; fewer dimensions than
  /// min_rank(q) (2 for block128, 1 for channel and mxfp8); a block128 slice along one of the last
  /// two dimensions, or an mxfp8 slice along the last, starting off a multiple of 128 (32) (blocks
  /// are the global tensor's; one ending off a block edge before the source's end fails its refit
  /// with errc::apply); a scale that shares bytes with its destination; a name
  /// containing "\x1f" (reserved: the scale travels as name + scale_suffix); a second
  /// destination of one source with another quant.
  void add_parameter(const tensor_dest& dest, const dest_layout& layout);
  /// Removes every registered destination (their memory: see the class comment). Takes effect
  /// at the next refit.
  void clear_parameters();
  /// Callback sink; replaces the parameter table (exclusive with add_parameter). Throws
  /// errc::invalid_argument for an empty callback, or on a staged receiver (receiver_options::stage:
  /// a stage is a copy of a parameter table). Takes effect at the next refit.
  void on_batch(batch_callback callback);

  /// Called on the serving thread when a refit starts (BEGIN accepted), before its first batch.
  /// Throwing refuses the refit: the streamer sees errc::apply with the exception's message.
  /// (A refit::error keeps its own code. Nothing is committed, serve_one() returns aborted, no
  /// on_abort follows, and the receiver keeps serving.) An empty function removes the hook.
  void on_begin(std::function<void(std::uint64_t version)> hook);
  /// Called on the serving thread after `version` is committed (committed_version() already says
  /// so), once END's reply is out, before serve_one() returns committed. What it throws is logged
  /// (REFIT_WARN) and ignored: the version stays committed. An empty function removes the hook.
  void on_commit(std::function<void(std::uint64_t version)> hook);
  /// Called on the serving thread when a refit in progress ends without committing, for any
  /// reason (bad message, sink error, incomplete manifest, idle timeout, superseded, ABORT, session
  /// end); `reason` is what last_error() then says. Runs once the call's reply (if any) is out,
  /// before serve_one() returns aborted. What it throws is logged (REFIT_WARN) and ignored. An
  /// empty function removes the hook.
  void on_abort(std::function<void(std::uint64_t version, const std::string& reason)> hook);
  /// A staged receiver (receiver_options::stage): called on the serving thread when `version` is
  /// prepared (prepared_version() already says so), once END's reply is out, before serve_one()
  /// returns prepared. It may call apply_prepared() (to apply at once) or tell the engine's loop to.
  /// What it throws is logged (REFIT_WARN) and ignored: the version stays prepared. An empty function
  /// removes the hook.
  void on_prepared(std::function<void(std::uint64_t version)> hook);
  /// A staged receiver: copies the prepared version from the stage into the weights (one local copy of
  /// the bytes it carried: every registered destination for a whole version, those it sent for a
  /// subset) and commits it: committed_version() moves, last_stats() is its figures (pause_seconds:
  /// this copy), and on_commit runs on the calling thread before this returns. Returns the version
  /// applied, or nullopt when none is prepared (no stage, none arrived yet, or applied already).
  /// Throws errc::apply when the parameter table changed since the version was prepared (the stage was
  /// laid out from the old one): the version is dropped, nothing is written, and on_abort runs.
  /// Thread rules: see the class comment (any thread; the engine calls it between two of its steps).
  ///
  /// A device stage (stage_kind::device) copies with one launch of refit's copy kernel. `stream` (a
  /// cudaStream_t): the engine's stream, the copy enqueued on it behind the engine's work there and
  /// ahead of its next step, without any host wait (the version is committed when this returns,
  /// and the engine's work on `stream` sees it whole). Null: a stream of the receiver's own, and this
  /// waits for the copy (call it once the engine's work reading the weights has finished). A host
  /// stage ignores `stream`. A copy that fails on the device leaves the weights dirty (errc::cuda).
  std::optional<std::uint64_t> apply_prepared(void* stream = nullptr);
  /// The version waiting in the stage for apply_prepared(); nullopt when none.
  [[nodiscard]] std::optional<std::uint64_t> prepared_version() const noexcept;

  /// Waits up to `wait` for one message and handles it (or first, without waiting, a message
  /// the previous call kept: see below).
  ///
  /// A HELLO (with the right token), BEGIN or BYE that arrives while a refit is in progress ends
  /// that refit: this call returns aborted without answering it, and the next call handles it
  /// first, without waiting (returning hello, begin, bye or refused). Its streamer waits for that
  /// reply within its own timeout (streamer_options::timeout, 30 s by default), so call
  /// serve_one() again soon after aborted; serve() does.
  receiver_event serve_one(milliseconds wait);
  /// Serves until `stop()` returns true (checked between messages, at least every `poll`); a
  /// message kept by serve_one() (see above) is answered before it returns.
  void serve(const std::function<bool()>& stop, milliseconds poll = milliseconds{100});

  /// Last version committed; nullopt before the first commit.
  [[nodiscard]] std::optional<std::uint64_t> committed_version() const noexcept;
  /// True when weights were partly overwritten by a refit that did not commit.
  [[nodiscard]] bool dirty() const noexcept;
  /// True when a delta version failed after patching the weights in place (an apply that failed
  /// half-way, or a checksum that did not match at END): the weights are neither the base nor the
  /// new version. A poisoned receiver is dirty, refuses deltas and subsets (errc::needs_whole: a
  /// delta streamer then sends the whole version by itself), and last_error() says "poisoned: ...";
  /// a whole version cures it.
  [[nodiscard]] bool poisoned() const noexcept;
  /// Figures of the last committed refit (zeros before the first).
  [[nodiscard]] receiver_stats last_stats() const;
  /// Message of the last error this receiver reported (empty if none).
  [[nodiscard]] std::string last_error() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace refit
