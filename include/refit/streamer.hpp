// refit — the policy side: packs tensors into ping-pong buffers and streams them to a receiver.
#pragma once

#include <chrono>
#include <cstddef>
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

/// Where a delta streamer keeps its base (see delta_options).
enum class delta_memory : std::uint8_t {
  host = 0,    ///< host memory (page-locked in a build with CUDA)
  device = 1,  ///< memory of the streamer's GPU (`streamer_options::device`; needs CUDA)
};

/// Delta versions: send only what changed since the last version every receiver committed.
///
/// The streamer keeps its own copy of that version (the base, as large as the version's tensors)
/// and, for each new version, compares every tensor with its base, sends the changed elements as
/// patches (wire::entry_kind::patch; a span that changed densely goes as plain bytes) and updates
/// the base. Unchanged tensors are not sent. END carries a checksum of the whole new version, which
/// each receiver checks after patching. The first version, a version after any failure, and a
/// version for a receiver that does not hold the base (it committed another version, it is dirty or
/// poisoned: it refuses BEGIN with errc::needs_whole before writing anything) are sent whole, by
/// the same refit() call. A delta carries the same tensors (names, dtypes, shapes) as its base: a
/// tensor that is new or changed its shape fails the refit with errc::invalid_argument, and the
/// next refit is whole. Transports: host_shm (host tensors, the diff on the host), and cuda_ipc with
/// direct = false (CUDA tensors, the diff on the streamer's GPU, the receivers patch on theirs: see
/// lib/delta); any other fails construction with errc::invalid_argument.
struct delta_options {
  bool enable = false;
  delta_memory memory = delta_memory::host;
  /// Bound on the base's memory: a version larger than this is always sent whole (a warning says so).
  std::uint64_t max_bytes = 64ull << 30;
  /// Threads that diff host tensors against a host base (the refit()'s caller among them), made at the
  /// first host diff and joined when the streamer is destroyed; 0: min(hardware threads, 8); at
  /// most 256 (errc::invalid_argument). The patches and checksums do not depend on it. Device
  /// tensors are diffed on the GPU.
  std::size_t threads = 0;
  /// Bytes of tensors one delta batch covers before it is sent (its patches, a round trip, and on
  /// the GPU one wait of the diff and one of the receivers' patch check); 0: max(32 MiB,
  /// buffer_bytes) over host_shm, max(32 MiB, 4 × buffer_bytes) over cuda_ipc and nccl. A batch is
  /// also sent when its patches fill a buffer. Larger batches amortise
  /// the per-batch round trips where the patches are small against the link (NVLink); smaller ones
  /// start sending sooner where the link is slow. The patches and checksums do not depend on it.
  std::uint64_t batch_bytes = 0;
};

/// What a refit carries.
enum class refit_scope : std::uint8_t {
  /// Every tensor of the receivers' tables: a version they can commit from nothing.
  whole = 0,
  /// Only some tensors (LoRA adapters, the tensors that changed): each receiver commits it when every
  /// tensor sent arrived exactly once and keeps the others from the version it holds. A receiver
  /// that holds none (it never committed a whole version since its table was registered, or its
  /// weights are dirty) refuses it with errc::needs_whole before anything is written. On a delta
  /// streamer, a subset is sent as plain bytes and the next refit is whole.
  subset = 1,
};

/// What a version does when one of its receivers fails (streamer_options::on_receiver_failure).
enum class receiver_failure : std::uint8_t {
  /// The version fails for every receiver: refit() throws naming each one that failed (see refit()).
  fail = 0,
  /// The receiver that failed leaves the version and the streamer; the others go on and commit.
  drop = 1,
};

struct streamer_options {
  /// The receiver's endpoint: "ipc:///path" or "tcp://host:port" (what receiver::endpoint() says).
  std::string endpoint;
  /// The endpoints of every receiver (nccl: rank k+1 is receivers[k]; cuda_ipc: receivers of this
  /// host, each written directly); when empty, `endpoint` is the one receiver. host_shm serves up
  /// to 64 receivers, which map the same buffers. streamer::add_receiver() and remove_receiver()
  /// change the list between versions.
  std::vector<std::string> receivers;
  transport_kind transport = transport_kind::host_shm;
  /// A transport added to refit from its own file (lib/transport/README.md), by the name it
  /// registered; when not empty it replaces `transport`.
  std::string transport_name;
  /// Ping-pong buffers: at least 2. A staged session whose receiver shares this GPU hands the GPU
  /// over once per buffer_count batches: 4 took llama3-8b staged through 2 × 256 MiB from 26.7 to
  /// 21.9 ms on an H200 (bench/results/2026-11-29-h200-staged-same-gpu.txt).
  std::size_t buffer_count = 2;
  std::uint64_t buffer_bytes = 256ull << 20;  ///< capacity of each buffer
  std::uint64_t alignment = 256;              ///< power of two; entry offsets are multiples
  /// Keep tensors that fit a buffer whole (see plan_options::keep_whole).
  bool keep_whole = true;
  /// CUDA device of the buffers (cuda_ipc, nccl); ignored by host_shm.
  int device = 0;
  /// How packs are copied on GPU transports.
  copy_engine engine = copy_engine::automatic;
  /// cuda_ipc: when the receiver applies into a parameter table of CUDA memory it can export,
  /// copy straight into its weights — one copy instead of two, all of it in this process, no
  /// per-batch hand-off between the two processes' GPU work. The receiver still validates every
  /// batch and commits only at END. Falls back to staging through the buffers, by itself, when
  /// the receiver does not offer its weights (callback sink, memory it cannot export) or this
  /// process cannot map them. false: always stage. Direct copies start as tensors are read
  /// (whenever the device has finished the copies before), overlapping the source: a tensor the
  /// receiver's table refuses (unknown name, a shape or slice that does not fit) fails the refit
  /// before any of its own bytes are written, but tensors read before it may have landed (the
  /// receiver is dirty from BEGIN in a direct session). Several receivers (TP ranks of one host, in
  /// `receivers`) are served only this way, each written where its weights are.
  /// nccl: ask the receivers to receive every entry in place (each one does when its parameter
  /// table is all on its GPU); when all of them do, batches are 1 GiB whatever buffer_bytes is and
  /// every tensor is sent from where it is, so every tensor must then be on `device` (another
  /// one fails the refit with errc::invalid_argument before it is sent). When a receiver stages
  /// (callback sink), batches are buffer-sized and a tensor on another GPU is packed. false:
  /// always buffer-sized batches (entries still go in place where they can).
  bool direct = true;
  /// cuda_ipc sessions through the buffers (a callback sink, a table it cannot write directly):
  /// the receiver reads each tensor that is in this device's memory where it is (the allocation
  /// holding it, mapped through CUDA IPC) instead of this process packing it into a buffer: one
  /// copy instead of two, done by the receiver's GPU work alone, with no per-batch hand-off
  /// between the two processes' GPU work. VMM memory (torch's expandable segments, cuMemCreate
  /// chunks made with POSIX descriptor handles) is shared chunk by chunk, the descriptors passed
  /// through the control lane (so it needs control_lane on both sides). Converted tensors, delta
  /// versions, tensors on other devices and memory the driver will not export (pools, VMM
  /// without descriptor handles or without a lane) are packed as before. The receiver keeps each
  /// allocation a refit read mapped until a refit that does not read it ends, or the session does
  /// (close()): memory this process frees meanwhile returns to the driver only then. false: every
  /// tensor goes through the buffers.
  bool share_tensors = true;
  /// When the receiver runs on this host (any transport), send the requests of a session (BEGIN,
  /// the batches, END, ABORT, BYE; not HELLO) through a shared-memory lane the receiver offers,
  /// instead of ZeroMQ: a round trip then costs a few microseconds instead of ~100 (ZeroMQ's I/O
  /// threads), which is most of a small refit's fixed cost. Everything else is as through ZeroMQ:
  /// the same messages, checks and timeouts. Falls back to ZeroMQ, by itself, when the receiver
  /// offers no lane (another host, receiver_options::control_lane false, no room in /dev/shm) or
  /// this process cannot open it (another mount namespace). false: always ZeroMQ.
  bool control_lane = true;
  /// nccl, opt-in: each session also has a second (twin) communicator, and the broadcasts of odd
  /// buffers go on it, on a stream of their own, so that a batch's broadcast starts while the one
  /// before it drains (a broadcast of a buffer-sized batch loses ~10 % of the link to its own start
  /// and end). Measured over NVLink (2 × H200, llama3-8b, same call): buffered 2 × 256 MiB 0.99 of
  /// the raw broadcast against 0.96 with one communicator, in place 0.99 against 0.97–0.98;
  /// buffered 2 × 64 MiB 0.95–0.97 in six runs of seven against 0.89–0.90 (0.91 in the seventh), and
  /// qwen3-30b-a3b's 18,867 tensors 0.85–0.88 (0.90 with 4 buffers) against 0.86–0.87, 0.76 once.
  /// Worth it where batches are buffer-sized and small; the twin costs every rank NCCL's own
  /// buffers once more (484 MiB a rank on H200s; in a group, per streamer rank). Receivers follow
  /// the streamer (HELLO says so). false: one communicator per session.
  bool nccl_twin = false;
  /// Longest wait for any reply of the receiver; past it the refit fails with errc::timeout and
  /// the next refit starts a new session.
  milliseconds timeout{30000};
  /// Session token; empty: the value of REFIT_TOKEN, or none.
  std::string token;
  curve_keys curve;
  /// The digest of the engine layout (route table) this trainer's tensors were recorded against
  /// (refit.record in Python), "" for none. A receiver set up with another digest refuses the
  /// session (errc::invalid_argument naming both) before any byte moves.
  std::string layout;
  /// Delta versions (off by default).
  delta_options delta;
  /// Sharded trainers: this streamer is rank `group_rank` of `group_size` streamers (one per
  /// trainer rank) that send each version together, each its own shards (tensor_ref::shard), to the
  /// same receivers; each receiver commits a version when the shards of every rank cover every
  /// tensor exactly once (see receiver::endpoints()). Rank k connects to endpoints()[k] of each
  /// receiver (receiver_options::streamers = group_size); every rank calls refit() with the same
  /// versions, and its refit() returns when the version has ended on every receiver (the last rank's
  /// END), so streamer_options::timeout must cover the slowest rank's part. A group sends whole
  /// versions and subsets: delta is refused (errc::invalid_argument). Over nccl each rank has a
  /// communicator of its own with the receivers, which a receiver joins while it answers that
  /// rank's HELLO; receivers answer a rank's HELLO once the lower ranks have their sessions (at
  /// most half the reply timeout later), so that every receiver joins them in the same order.
  std::size_t group_rank = 0;
  std::size_t group_size = 1;
  /// Engine-wide versions: a version reaches every receiver of this streamer (the TP/EP ranks of
  /// one engine, or its replicas) or none. Each receiver answers END once the version is whole and
  /// checked (*prepared*: in place, or in its stage), without committing; when every receiver has,
  /// the streamer sends each of them COMMIT, and only then do they commit (in place: on_commit) or
  /// report the version prepared to the engine (staged: on_prepared, then apply_prepared()). When
  /// any receiver fails or stays silent before that, every other one is told (ABORT) and discards
  /// the version: committed_version() unchanged everywhere, a staged receiver's weights untouched
  /// (an in-place receiver's are dirty, as after any failed refit). A receiver that prepared and
  /// then hears nothing (this process died) aborts at its idle timeout, at once when its control lane
  /// closes. The one window left: this process dying between two receivers' COMMITs (microseconds
  /// apart: they are sent before any reply is awaited) leaves those that heard it committed and the
  /// others aborted; refit() throws naming them when it is alive to see it. Costs one more round
  /// trip per refit (refit_stats::commit_seconds). A group of streamers (group_size > 1): every rank
  /// sets it; each receiver prepares the version at the group's last END and commits it only when
  /// every rank said COMMIT (one rank's ABORT, or its silence for three quarters of another's reply
  /// timeout, discards it everywhere); each rank's COMMIT is answered when the last arrives.
  bool atomic = false;
  /// What a receiver failing during a version does to the others. `fail` (the default): the version
  /// fails for all of them and refit() throws (see refit()). `drop`: a receiver that is gone, stays
  /// silent past `timeout`, refuses a request or fails its checks leaves that version and this
  /// streamer (it is told ABORT when it can still hear; a restarted engine comes back by
  /// add_receiver()); the others go on and commit the version, refit() returns, and
  /// refit_stats::dropped names each one dropped (a warning is logged at once). An engine-wide
  /// version (`atomic`) is COMMITted to the receivers left when every one of them prepared it.
  /// host_shm only: over cuda_ipc and nccl a session holds every receiver's share of the transport
  /// (mapped weights, one communicator), so a failure ends it for all (errc::invalid_argument).
  receiver_failure on_receiver_failure = receiver_failure::fail;
  /// With `drop`: refit() fails (the code and message of the last failure, and how many are left)
  /// when fewer receivers than this are left; the ones left are told ABORT. At least 1.
  std::size_t min_receivers = 1;
  /// With `drop`: a receiver dropped is tried again at the start of later versions (its endpoint
  /// added back, as add_receiver() does): at the next version, then, while it keeps failing, after
  /// 2, 4, ... up to 64 versions; it is served again once it answers (a restarted engine on the same
  /// endpoint catches up at that version). Each try of an endpoint nobody serves costs that version
  /// one reply timeout (its HELLO) and names it in refit_stats::dropped again; every try makes each
  /// receiver's session anew. add_receiver() and remove_receiver() of the endpoint end its tries.
  /// false: a dropped receiver comes back only by add_receiver().
  bool rejoin = false;
  /// Engines as groups of receivers: each list names the endpoints of one engine's ranks (its
  /// TP/EP ranks); a receiver in no group is an engine of its own. With `receivers` and `endpoint`
  /// empty, the groups' endpoints, in order, are the receivers; otherwise every endpoint of a group
  /// must be one of them. With on_receiver_failure = drop, a rank that fails drops its whole
  /// engine: the other ranks are told ABORT (they discard the version: committed_version()
  /// unchanged, a staged rank's weights untouched) and leave the streamer with it, while the other
  /// engines commit; refit_stats::dropped names every rank, the one that failed first. With
  /// `atomic`, a version so reaches every rank of an engine or none, engine by engine. Groups are
  /// kept by endpoint: a rank served again (add_receiver(), rejoin) is in its group again.
  /// Throws errc::invalid_argument (constructing the streamer) for an empty group, an endpoint in
  /// two groups or twice in one, or one that is not among the receivers.
  std::vector<std::vector<std::string>> receiver_groups;
};

/// A receiver dropped from a version (streamer_options::on_receiver_failure = drop).
struct dropped_receiver {
  std::string endpoint;
  errc code = errc::peer;  ///< errc::timeout for a silent one, errc::peer for one gone, else what it said
  std::string reason;      ///< the error, as refit() would have thrown it
};

/// Figures of one refit.
struct refit_stats {
  std::uint64_t version = 0;
  std::uint64_t tensors = 0;
  std::uint64_t bytes = 0;
  std::uint64_t batches = 0;
  double seconds = 0;              ///< whole refit, BEGIN to END's reply
  double source_seconds = 0;       ///< in the tensor source's next()
  double pack_seconds = 0;         ///< enqueuing (cuda) or doing (cpu) the copies into buffers
  double wait_seconds = 0;         ///< waiting for the receiver's replies
  bool direct = false;             ///< into the weights or device stage (cuda_ipc direct), in place (nccl)
  std::uint64_t shared_bytes = 0;  ///< of `bytes`, read by the receiver where they are (share_tensors)
  /// nccl in place with receivers of views (a parts session): the bytes sent, every receiver's
  /// parts together (a receiver of a TP shard takes only its slice; a tensor two destinations take
  /// is sent twice). 0 in other sessions.
  std::uint64_t parts_bytes = 0;
  bool control_lane = false;  ///< the requests went through each receiver's control lane (not ZeroMQ)
  // Subset and delta versions. `bytes` is what moved through the buffers (on the wire).
  bool subset = false;               ///< sent as a subset (refit_scope::subset, or a delta)
  bool delta = false;                ///< sent as patches against version `base`
  std::uint64_t base = 0;            ///< the delta's base version
  bool whole_after_refusal = false;  ///< a receiver refused the delta (errc::needs_whole): sent whole
  std::uint64_t tensor_bytes = 0;    ///< bytes of the tensors the source yielded
  std::uint64_t elements = 0;        ///< elements of those tensors (delta)
  std::uint64_t changed = 0;         ///< elements that differed from the base (delta)
  std::uint64_t base_bytes = 0;      ///< memory of the streamer's base (delta streamers)
  double diff_seconds = 0;           ///< comparing with (and updating) the base; part of pack_seconds
  /// An engine-wide version (streamer_options::atomic): COMMIT's round trip, from every receiver
  /// prepared to every receiver committed; part of `seconds`.
  double commit_seconds = 0;
  /// The receivers this version dropped (streamer_options::on_receiver_failure = drop), in the
  /// order they failed; none of them committed it, and none is asked again.
  std::vector<dropped_receiver> dropped;
};

/// Yields the tensors of one refit one at a time, so that the caller can gather tensor k+1 while
/// the receiver applies earlier batches. Return nullopt after the last one. A tensor returned by
/// next() must stay valid until refit() returns (or throws). next() may throw: refit() then tells
/// the receivers (ABORT) and rethrows the exception unchanged. The first calls may come while the
/// receivers are still answering BEGIN (up to buffer_count × buffer_bytes of tensors are read
/// ahead meanwhile); if BEGIN is refused, refit() throws and the source is not read further.
class REFIT_API tensor_source {
 public:
  virtual ~tensor_source() = default;
  virtual std::optional<tensor_ref> next() = 0;
};

/// The streamer. Owns one ZeroMQ REQ socket and the buffers of its transport.
///
/// Thread rules: one thread at a time; a streamer may move between threads between calls.
class REFIT_API streamer {
 public:
  /// Validates the options and creates the buffers; connects lazily (the first refit says HELLO).
  /// Throws refit::error(invalid_argument) for bad options, (transport/cuda) if buffers cannot
  /// be created.
  explicit streamer(streamer_options options);
  ~streamer();
  streamer(streamer&&) noexcept;
  streamer& operator=(streamer&&) noexcept;
  streamer(const streamer&) = delete;
  streamer& operator=(const streamer&) = delete;

  /// Streams every tensor of `source` as version `version` and returns when the receiver has
  /// committed it. Throws refit::error: the receiver's own code and message when it refused
  /// (errc::apply when its sink failed, errc::incomplete when its manifest was not satisfied, ...),
  /// errc::timeout when it did not answer within options.timeout (the socket is rebuilt and the
  /// next refit starts a new session). After any error the receiver has not committed `version`.
  /// With streamer_options::on_receiver_failure = drop, a receiver that fails is dropped instead
  /// (refit_stats::dropped) and the others commit; refit() then throws only when fewer than
  /// min_receivers are left (the failure's code; the ones left are told ABORT), or, before
  /// anything is sent, errc::invalid_argument when that many were not left to begin with.
  ///
  /// Every tensor must have a name, at most wire limits of rank and name length, memory of the
  /// transport's kind (host for host_shm, CUDA otherwise) and a pointer unless it has no elements
  /// (a 0 in its shape: its pointer may be null and is never read; a 0-d tensor is one element and
  /// needs one); a name may appear once per version. A tensor that breaks these rules fails the
  /// refit with errc::invalid_argument. When the refit fails on this side after the receivers
  /// accepted BEGIN — such a tensor, the source throwing, a copy failing — every receiver is told
  /// at once (an ABORT message, answered within at most 1 s; a receiver that misses it aborts at
  /// its idle timeout), and then the original exception is rethrown unchanged: the receivers
  /// report the refit aborted, with committed_version() unchanged.
  ///
  /// `scope`: refit_scope::subset sends only the tensors of `source` and asks each receiver to keep
  /// its others (a receiver without a whole version refuses with errc::needs_whole). On a delta
  /// streamer (streamer_options::delta) a whole refit is sent as a delta when it can be.
  refit_stats refit(std::uint64_t version, tensor_source& source, refit_scope scope = refit_scope::whole);
  /// Same, over a list of tensors.
  refit_stats refit(std::uint64_t version, std::span<const tensor_ref> tensors, refit_scope scope = refit_scope::whole);
  /// Same, over a callback that yields the tensors one at a time.
  refit_stats refit(std::uint64_t version, const std::function<std::optional<tensor_ref>()>& next,
                    refit_scope scope = refit_scope::whole);

  /// Says that a refit follows within `hold` (at most 10 s), so that the receivers are awake for
  /// it: call it where the next version's weights are known to come soon (at the start of the
  /// optimizer step), then refit() as usual. A receiver between versions sleeps once its spin
  /// ends (500 us), and a request to a sleeping receiver pays its wake-up: 45–130 us a refit on
  /// the H200 machine (bench/probes/wake.cpp), a third of a small model's refit. Told, each
  /// receiver of this host (reached through its control lane) waits spinning instead — a CPU core
  /// of its host busy — until the refit's first request comes or `hold` has passed. Receivers on
  /// other hosts are not told. Returns how many receivers were told (0 before the first refit:
  /// the session, with its lanes, begins there). Never blocks; never throws.
  std::size_t announce(std::chrono::milliseconds hold = std::chrono::milliseconds{1000}) noexcept;

  /// Ends the session politely (BYE); the receiver unmaps the buffers. Safe to call twice; the
  /// destructor calls it and swallows errors.
  void close() noexcept;

  /// Adds the receiver at `endpoint` from the next version on: that version's BEGIN opens its
  /// session (HELLO), and it gets the version whole (on a delta streamer: a delta when it holds the
  /// base, else the version whole, for every receiver, as refit_stats::whole_after_refusal says).
  /// The other receivers' sessions go on untouched where the transport lets a receiver join an open
  /// session (host_shm's sealed buffers); elsewhere (named host_shm segments, cuda_ipc) every
  /// receiver's session is made anew at the next version. Throws errc::invalid_argument during a
  /// refit (from a tensor source), for an endpoint already served, an empty one, one past the
  /// transport's receivers, in a group of streamers (group_size > 1), or over nccl, whose
  /// communicator has every receiver as a rank.
  void add_receiver(std::string endpoint);
  /// Stops serving the receiver at `endpoint`: it is told BYE (it keeps its last committed version
  /// and serves on) and the next version goes to the others. Throws errc::invalid_argument during a
  /// refit, for an endpoint not served, for the last receiver, in a group of streamers, or over nccl.
  void remove_receiver(std::string_view endpoint);
  /// The endpoints served now, in order (what the next version goes to).
  [[nodiscard]] std::vector<std::string> receivers() const;

  [[nodiscard]] const streamer_options& options() const noexcept;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace refit
