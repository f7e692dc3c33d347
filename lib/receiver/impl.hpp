// refit — the receiver: the generation side's state machine. This header holds its state (receiver::impl),
// shared by the files of lib/receiver (internal: not installed).
//
// Sessions: a HELLO (with the right token) maps the streamer's buffers, replacing any earlier
// session. Refits: BEGIN, BATCH..., END (or ABORT from the streamer). Every message is validated
// (wire::decode and wire::refit_tracker) before anything is applied; a bad one gets an ERROR reply
// and aborts the refit, and the receiver stays up. A refit commits at END only when the tracker and
// the parameter table agree that every tensor arrived exactly once.
//
// Every refit that ends without committing is reported as `aborted` by the serve_one() call that
// ended it. A HELLO, BEGIN or BYE that arrives during a refit ends it that way too, and is itself kept
// (unanswered: REP owes it exactly one reply) and handled at the start of the next serve_one().
//
// Hooks: on_begin runs before the reply to BEGIN (it may refuse the refit); on_commit and on_abort
// run once the call's reply is out, just before serve_one() returns, so that a slow hook never holds
// up the streamer.
//
// Replies and overlap: on GPU transports the copies of a batch are enqueued behind the streamer's
// "packed" event and the reply follows at once. On host_shm the reply goes first and the copy
// follows on this thread, overlapping the streamer packing the next batch into the other buffer;
// a failure there is reported in the reply to the next message. Either way, by the time the
// streamer has the reply to batch k+1, batch k is finished with its buffer.
//
// The parts, one concern each (every function is a member of receiver::impl, declared below):
//   table.cpp    the parameter table (table.hpp), the conversions it asks for, memory_gone()
//   session.cpp  lanes, HELLO, ownership (stranger(), from_owner()), replies, end_session()
//   refit.cpp    BEGIN, BATCH, END and ABORT of a version, its commit and its abort; an engine-wide
//                version's END held for COMMIT
//   apply.cpp    a batch's entries checked against the table, copied, or handed to the callback
//   delta.cpp    subset and delta versions: the base (no_base_for()), patches, the checksum
//   group.cpp    a group of streamers: joining a version, held ENDs, the shards, deadlines' reasons
//   stage.cpp    staged versions (receiver_options::stage): the stage, prepare at END, apply_prepared()
//   serve.cpp    the loop: serve_one(), step(), receive(), handle(), dispatch()
//   receiver.cpp the public refit::receiver methods
#pragma once

#include "refit/receiver.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "channel/channel.hpp"
#include "channel/lane.hpp"
#include "config/config.hpp"
#include "copy/copy.hpp"
#include "delta/checksum.hpp"
#include "delta/host_apply.hpp"
#include "delta/patch.hpp"
#if REFIT_HAVE_CUDA
#include "delta/device.hpp"
#endif
#include "model/log.hpp"
#include "model/text.hpp"
#include "plan/route.hpp"
#include "model/memory.hpp"
#include "receiver/table.hpp"
#include "transport/transport.hpp"
#include "wire/wire.hpp"

namespace refit {
// Not exported (the library is built with hidden visibility); named, not anonymous, because
// receiver::impl, defined in this header, holds them.
namespace receiver_detail {

using clock = std::chrono::steady_clock;

inline double seconds_since(clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); }

/// Compares without an early exit, so the time taken does not tell how much of a guess was right.
inline bool same_token(std::string_view a, std::string_view b) noexcept {
  const std::size_t n = a.size() > b.size() ? a.size() : b.size();
  unsigned diff = static_cast<unsigned>(a.size() ^ b.size());
  for (std::size_t i = 0; i < n; ++i) {
    const auto x = static_cast<unsigned char>(i < a.size() ? a[i] : 0);
    const auto y = static_cast<unsigned char>(i < b.size() ? b[i] : 0);
    diff |= static_cast<unsigned>(x ^ y);
  }
  return diff == 0;
}

/// A failure to report in an ERROR reply.
struct refusal {
  errc code;
  std::string message;
};

/// A refit that ended, for the on_commit / on_abort hooks.
struct ending {
  std::uint64_t version = 0;
  bool committed = false;
  std::string reason;     ///< why it aborted
  bool prepared = false;  ///< staged: END prepared it (on_prepared), it is not committed yet
};

/// One entry of a staged delta (stage.cpp): its bytes (a patch's records, or a span sent as bytes)
/// copied into the stage, checked there and their checksum terms taken against the weights at its
/// batch; apply_prepared() writes it into every destination of its tensor.
struct staged_entry {
  std::uint64_t at = 0;     ///< its bytes' offset in the stage
  std::uint64_t bytes = 0;  ///< stage bytes
  bool patch = false;       ///< a patch, else the span's plain bytes
  std::uint64_t span = 0;   ///< a patch: the tensor bytes it covers
  std::uint64_t off = 0;    ///< the tensor byte it starts at
  std::uint64_t total = 0;  ///< the tensor's bytes
  std::size_t item = 1;
  std::vector<slot>* slots = nullptr;  ///< the tensor's destinations (the table the version was prepared from)
  std::string name;
};

/// A staged version whose END checked out, waiting in the stage for apply_prepared().
struct prepared_state {
  std::uint64_t version = 0;
  bool subset = false;
  bool delta = false;                     ///< a delta's patches, applied in the stage
  std::optional<std::uint64_t> checksum;  ///< END's version checksum
  receiver_stats figures;
  std::uint64_t generation = 0;   ///< sink_generation the stage was laid out from
  std::vector<slot*> slots;       ///< the destinations it wrote into the stage
  std::vector<staged_entry> log;  ///< a delta: its entries in the stage (the destinations are not copied)
};

/// An engine-wide version (end::hold) whose END checked out here: what its commit needs, kept until
/// the streamer's COMMIT (or its abort).
struct voted_version {
  std::uint64_t version = 0;
  receiver_stats figures;
  std::optional<std::uint64_t> checksum;  ///< END's version checksum
};

/// One streamer's session with the receiver: its channel, the transport's sink of its buffers, and
/// the state of its part of the refit in progress. A receiver has one lane per streamer of a group
/// (receiver_options::streamers; one for a streamer alone), each bound at its own endpoint.
struct lane {
  std::size_t rank = 0;
  channel::rep_channel channel;
  std::unique_ptr<transport::sink> sink;
  std::unique_ptr<copy::copier> copier;
  std::optional<wire::refit_tracker> tracker;
  std::string peer;
  bool direct = false;  ///< the streamer writes straight into the table (cuda_ipc direct)
  /// With `direct` or `in_place`: a device-staged receiver offered its stage, not its weights
  /// (stage_offer()): each destination's copy in the stage is written (by the streamer, or received in
  /// place), and apply_prepared() alone writes the weights.
  bool into_stage = false;
  /// The device stage this lane's streamer was offered for direct writes (and maps), if any.
  const copy::device_area* offered_stage = nullptr;
  bool in_place = false;                 ///< every entry is received straight into the table (nccl)
  bool parts = false;                    ///< in place, each destination's own bytes only (sink::parts)
  bool laid_out = false;                 ///< the session's HELLO asked for a layout from the table (direct, in place)
  std::vector<wire::conversion> asked;   ///< the conversions the session's OK asked for
  std::uint64_t session_generation = 0;  ///< sink_generation when the session was set up
  /// A HELLO, BEGIN or BYE that superseded a refit in progress: received, not yet answered,
  /// handled at the start of the next serve_one().
  std::optional<wire::message> pending;
  /// A group's HELLO over a transport whose set-up waits for every rank (nccl), received before the
  /// lanes of lower ranks had their sessions: answered once they have (or after a bound), so that
  /// every receiver of the group joins the ranks' communicators in the same order.
  std::optional<wire::hello> waiting;
  clock::time_point waiting_since{};
  clock::time_point last_message{};
  std::optional<refusal> deferred;  ///< a host-side apply that failed after its reply went out
  /// The END of this lane's part, checked and not answered yet: a group's version commits (and
  /// every lane hears how it ended) when the last lane's END arrives.
  std::optional<wire::end> held;
  clock::time_point held_since{};
  /// The streamer's reply timeout (HELLO), zero when it did not say: a held END is answered
  /// within three quarters of it, so that the streamer hears how the version ended.
  milliseconds reply_timeout{0};
  /// The group's version ended without this lane's part (another rank failed it): the lane's next
  /// message of that version hears why: a BATCH or END if it had begun (instead of "no refit in
  /// progress"), its BEGIN if not (so that a rank late for a failed version does not start it over
  /// alone). Kept across sessions; dropped once heard, or at a BEGIN of another version.
  std::optional<std::pair<std::uint64_t, refusal>> failed;
  bool took_part = false;  ///< scratch of abort_refit(): the lane was in the refit it ends
  /// Its END of an engine-wide version (end::hold) was checked and answered: the version waits for
  /// the streamer's COMMIT (receiver::impl::voted).
  bool awaits_commit = false;
  /// A group's engine-wide version: this lane's COMMIT came and waits, unanswered, for the other
  /// streamers' (held_since: when it came); answered when the last arrives, or with the abort.
  bool commit_held = false;
#if REFIT_HAVE_CUDA
  std::unique_ptr<delta::cuda::workspace> device_delta;  ///< patches applied on the GPU (cuda_ipc staged)
#endif

  /// The session's owner: the connection its HELLO came through (channel::rep_channel::peer_id(),
  /// "" through the control lane) and the secret it chose. Only it may act in the session.
  bool owned = false;
  std::string owner;
  std::string secret;

  lane(std::size_t r, const std::string& endpoint, const curve_keys& curve, bool allow_insecure)
      : rank(r), channel(endpoint, curve, allow_insecure) {}

  /// This lane's part of a refit is in progress: begun, not ended.
  [[nodiscard]] bool refit_active() const noexcept { return tracker && tracker->active(); }
  /// This lane takes part in the refit in progress: begun, and not answered at its END yet.
  [[nodiscard]] bool in_refit() const noexcept {
    return refit_active() || held.has_value() || awaits_commit || commit_held;
  }
};

}  // namespace receiver_detail

// The receiver's files name these unqualified (this header is theirs alone).
using namespace receiver_detail;

// Hidden by hand: a nested class takes the visibility of the class around it, and receiver is
// REFIT_API, but impl is no API (librefit.so would export its members and lambdas).
struct __attribute__((visibility("hidden"))) receiver::impl {
  receiver_options options;
  std::string token;
  /// One per streamer of the group (receiver_options::streamers), never resized: `ln` points into it.
  std::vector<lane> lanes;
  /// The lane whose message is being handled.
  lane* ln = nullptr;
  /// The lane whose message is being answered (null while no message is in hand: a timeout).
  lane* answering = nullptr;
  std::size_t next_lane = 0;  ///< where the next wait for a message starts looking (fairness)

  // Sinks: a parameter table or a callback (exclusive).
  table_t table;
  batch_callback callback;
  /// Counts changes of the sink (add_parameter, clear_parameters, on_batch), so that a session or
  /// refit can tell whether the table it was built from is still the one registered.
  std::uint64_t sink_generation = 0;

  // Lifecycle hooks.
  std::function<void(std::uint64_t)> begin_hook;
  std::function<void(std::uint64_t)> commit_hook;
  std::function<void(std::uint64_t, const std::string&)> abort_hook;
  std::function<void(std::uint64_t)> prepared_hook;
  std::vector<ending> endings;  ///< refits ended by this serve_one() call, for the hooks

  // Refit in progress (of the whole group: every lane sends its part of this version).
  std::optional<std::uint64_t> group_version;  ///< the version in progress, from its first BEGIN to its end
  std::uint64_t refit_generation = 0;          ///< sink_generation at its BEGIN
  clock::time_point refit_start{};
  double apply_seconds = 0;
  bool refit_subset = false;      ///< BEGIN said subset: tensors not sent keep their committed values
  bool refit_delta = false;       ///< BEGIN named a base: patches, and a checksum at END
  std::uint64_t delta_terms = 0;  ///< the version checksum's change by what the delta wrote so far
  std::unique_ptr<delta::host_patcher> delta_patcher;  ///< made at the first host delta batch
  std::vector<delta::host_entry> delta_entries;        ///< scratch of host_delta_entries(), stage_delta()
  std::vector<std::byte*> delta_dests;                 ///< scratch of host_delta_entries(), stage_delta()

  // What the committed version is a base for (subset and delta versions).
  /// sink_generation when a whole version last committed, if one did: a subset needs one committed
  /// since the table was registered as it is.
  std::optional<std::uint64_t> whole_generation;
  /// The version checksum of the committed version (what its END said, or what a delta proved).
  std::optional<std::uint64_t> known_checksum;
  /// A delta failed after writing: the weights are neither the base nor the new version.
  std::atomic<bool> is_poisoned{false};
  std::string poison_note;    ///< what last_error() says once abort_refit() poisoned the receiver
  std::string poison_reason;  ///< why the receiver is poisoned (for the refusals that follow)

  /// The engine-wide version prepared here and waiting for COMMIT, if any (a streamer alone: see
  /// on_commit()).
  std::optional<voted_version> voted;

  /// Requests refused because they came from a peer that does not own the session (stranger()).
  std::uint64_t strangers_refused = 0;

  // Staged versions (receiver_options::stage; stage.cpp). The serving thread writes the stage only
  // while no version is prepared; apply_prepared() (any thread) reads it, and the table, only while
  // one is; `stage_mutex` orders the two (BEGIN, the registration functions and the hooks' setters
  // take it too).
  std::mutex stage_mutex;
  std::unique_ptr<std::byte[]> stage;               ///< stage_kind::host
  ::refit::memory::charge stage_counted;            ///< its bytes (include/refit/memory.hpp)
  std::unique_ptr<copy::device_area> device_stage;  ///< a CUDA table's stage: device (or page-locked) memory
  /// Device stages replaced while a lane's streamer was offered them (retire_stage()): the serving
  /// thread frees each once no lane's session was (release_retired_stages(), at end_session()).
  std::vector<std::unique_ptr<copy::device_area>> retired_stages;
  bool stage_cuda = false;                     ///< the stage in use is `device_stage` (not `stage`)
  std::unique_ptr<copy::copier> stage_copier;  ///< the device stage's copies into the weights
  std::unique_ptr<delta::worker_pool>
      stage_pool;                    ///< a host stage's apply threads (delta_threads), made when first needed
  std::uint64_t stage_capacity = 0;  ///< bytes allocated at `stage`
  std::uint64_t stage_need = 0;      ///< bytes the table laid out at stage_generation needs
  std::optional<std::uint64_t> stage_generation;       ///< sink_generation the slots' stage_at were laid out from
  std::uint64_t stage_serial = 0;                      ///< counts staged refits (slot::staged_in)
  std::vector<slot*> staged_slots;                     ///< the destinations the refit in progress wrote into the stage
  std::vector<staged_entry> staged_log;                ///< a staged delta in progress: its entries in the stage
  std::uint64_t log_used = 0;                          ///< stage bytes `staged_log` holds
  std::unique_ptr<delta::host_patcher> stage_patcher;  ///< a host stage's delta apply (apply_prepared())
#if REFIT_HAVE_CUDA
  std::unique_ptr<delta::cuda::workspace> stage_delta_ws;  ///< a CUDA stage's delta apply (apply_prepared())
#endif
  std::optional<prepared_state> ready;  ///< the version prepared, under stage_mutex
  std::atomic<bool> has_prepared{false};
  std::atomic<std::uint64_t> prepared_number{0};

  // Readable from any thread.
  std::atomic<bool> has_committed{false};
  std::atomic<std::uint64_t> committed{0};
  std::atomic<bool> is_dirty{false};
  mutable std::mutex mutex;  // guards last_error_ and stats_
  std::string last_error_;
  receiver_stats stats_;

  explicit impl(receiver_options o);
  ~impl();

  // ---------------------------------------------------------------- session.cpp
  void remove_endpoints() noexcept;
  [[nodiscard]] bool grouped() const noexcept { return lanes.size() > 1; }
  [[nodiscard]] bool owes() const noexcept;
  static milliseconds reply_timeout_of(const wire::hello& h);
  [[nodiscard]] std::string who(const lane& l) const;
  std::optional<std::uint64_t> committed_version() const noexcept;
  void note_error(const std::string& message);
  /// The current lane's part of a refit is in progress.
  bool refit_active() const noexcept { return ln->refit_active(); }
  void end_session() noexcept;
  void reply_ok(std::vector<std::string> handles = {}, wire::session_mode mode = wire::session_mode::buffers,
                std::vector<wire::conversion> convert = {}, std::string lane = {});
  void reply_error(errc code, const std::string& message);
  receiver_event refuse_hello(const wire::hello& h, errc code, const std::string& message, std::string_view logged);
  std::optional<receiver_event> check_hello(const wire::hello& h);
  receiver_event on_hello(const wire::hello& h);
  void open_session(const wire::hello& h);
  void offer_placement(const wire::hello& h, wire::ok& reply);
  std::unique_ptr<channel::lane> offer_lane(const wire::hello& h);
  [[nodiscard]] bool from_owner() const;
  std::optional<std::string> stranger(const wire::message& m, const std::string& secret) const;

  // ---------------------------------------------------------------- table.cpp
  std::vector<wire::conversion> conversions() const;
  std::optional<std::string> memory_gone();

  // ---------------------------------------------------------------- refit.cpp
  receiver_event on_begin(const wire::begin& b);
  std::optional<receiver_event> check_begin(const wire::begin& b);
  receiver_event begin_refit(const wire::begin& b);
  std::optional<receiver_event> refuse_base(const wire::begin& b);
  std::optional<refusal> run_begin_hook(std::uint64_t version);
  std::optional<refusal> sink_changed() const;
  receiver_event on_batch(const wire::batch& b);
  receiver_event on_end(const wire::end& e);
  receiver_event finish_refit();
  void check_complete(std::uint64_t version) const;
  receiver_stats figures_of(std::uint64_t version, double drain_seconds) const;
  void make_live(std::uint64_t version, const receiver_stats& figures, bool subset, bool delta,
                 std::optional<std::uint64_t> checksum, std::uint64_t generation);
  void answer_ends();
  void reply_ok_everywhere();
  void commit(std::uint64_t version, const receiver_stats& figures, std::optional<std::uint64_t> checksum);
  receiver_event hold_for_commit(std::uint64_t version, double drain_seconds);
  receiver_event on_commit(const wire::commit& c);
  receiver_event on_abort(const wire::abort& a);
  void abort_refit(const std::string& why, errc code = errc::apply) noexcept;
  receiver_event fail_refit(errc code, const std::string& message);
  std::optional<receiver_event> fail_if_deferred();
  void run_hooks() noexcept;
  /// Runs `call` (one hook's invocation for `version`); what it throws is logged as hook `name`'s
  /// and ignored.
  static void guard_hook(const char* name, std::uint64_t version, const std::function<void()>& call) noexcept;
  std::optional<std::string> supersedes(const wire::message& m) const;

  // ---------------------------------------------------------------- apply.cpp
  std::vector<copy::op> table_ops(const wire::batch& b, const std::byte* base,
                                  std::vector<transport::segment>* segments, bool check_only = false);
  std::vector<slot>& check_entry(const wire::batch& b, std::size_t k, device_kind where);
  void add_staged(std::vector<slot>& slots, const wire::entry& e, const std::byte* base, device_kind where,
                  std::vector<copy::op>& ops, std::vector<transport::segment>* segments,
                  std::vector<plan::run>& pieces);
  const std::byte* entry_data(const wire::entry& e, const std::byte* base) const;
  void apply(const wire::batch& b, std::vector<copy::op>& ops, std::vector<transport::segment>& segments);
  void run_callback(const wire::batch& b);

  // ---------------------------------------------------------------- delta.cpp
#if REFIT_HAVE_CUDA
  delta::cuda::workspace& device_workspace();
  void apply_delta_device(const wire::batch& b, const std::byte* base);
#endif
  [[nodiscard]] bool delta_on_device() const noexcept;
  std::optional<std::string> no_base_for(const wire::begin& b) const;
  void check_patches(const wire::batch& b);
  void apply_delta(const wire::batch& b);
  delta::host_patcher& host_patcher();
  std::span<const delta::host_entry> host_delta_entries(const wire::batch& b, const std::byte* base);
  void check_delta(const wire::end& e) const;

  // ---------------------------------------------------------------- stage.cpp
  [[nodiscard]] bool staged() const noexcept { return options.stage != stage_kind::none; }
  std::optional<receiver_event> check_stage(const wire::begin& b);
  std::optional<std::string> stage_refusal(const wire::begin& b);
  std::optional<std::string> stage_misfit(std::uint64_t version) const;
  std::optional<std::string> fit_stage(std::string_view what);
  std::optional<std::string> allocate_stage(std::string_view what);
  std::vector<plan::destination> stage_offer();
  void retire_stage();
  void release_retired_stages() noexcept;
  [[nodiscard]] std::byte* stage_base() const noexcept;
  void lay_out_stage();
  std::byte* stage_for(slot& sl);
  std::byte* write_target(slot& sl);
  [[nodiscard]] std::uint64_t stage_size() const noexcept;
  void stage_delta(const wire::batch& b);
  void apply_log(const prepared_state& p, void* stream);
  void prepare(std::uint64_t version, const receiver_stats& figures, std::optional<std::uint64_t> checksum);
  std::optional<std::uint64_t> apply_prepared(void* stream);
  void copy_stage(const prepared_state& p, void* stream);

  // ---------------------------------------------------------------- group.cpp
  [[nodiscard]] bool must_wait(const wire::hello& h) const;
  [[nodiscard]] milliseconds wait_bound(const wire::hello& h) const;
  receiver_event join_refit(const wire::begin& b);
  std::optional<receiver_event> refuse_failed(std::uint64_t version);
  std::set<std::string, std::less<>> check_shards(std::uint64_t version) const;
  std::string late_reason(const lane& l) const;

  // ---------------------------------------------------------------- serve.cpp
  receiver_event serve_one(milliseconds wait);
  receiver_event step(milliseconds wait);
  std::optional<receiver_event> enforce_deadlines(milliseconds& wait);
  bool streamer_gone();
  std::optional<std::string> receive(milliseconds wait);
  receiver_event handle(const std::string& bytes);
  receiver_event supersede_or_dispatch(wire::message m);
  receiver_event dispatch(const wire::message& m);
};

}  // namespace refit
