// refit — the receiver: the generation side's state machine.
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
#include "refit/receiver.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
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
#include "transport/transport.hpp"
#include "wire/wire.hpp"

namespace refit {
namespace {

using clock = std::chrono::steady_clock;

double seconds_since(clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); }

/// Compares without an early exit, so the time taken does not tell how much of a guess was right.
bool same_token(std::string_view a, std::string_view b) noexcept {
  const std::size_t n = a.size() > b.size() ? a.size() : b.size();
  unsigned diff = static_cast<unsigned>(a.size() ^ b.size());
  for (std::size_t i = 0; i < n; ++i) {
    const auto x = static_cast<unsigned char>(i < a.size() ? a[i] : 0);
    const auto y = static_cast<unsigned char>(i < b.size() ? b[i] : 0);
    diff |= static_cast<unsigned>(x ^ y);
  }
  return diff == 0;
}

/// The tensor a table name stands for, for messages: "w", or "the scale_inv of 'w'".
std::string shown(const std::string& name) {
  const auto at = name.find(scale_suffix);
  if (at == std::string::npos) return fmt::format("'{}'", name);
  return fmt::format("the scale_inv of '{}'", name.substr(0, at));
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
  std::string reason;  ///< why it aborted
};

/// One registered destination and how its source's bytes reach it.
struct slot {
  plan::destination dest;
  std::vector<plan::run> foot;  ///< the bytes it writes, for overlap checks
  plan::route_cache routes;     ///< computed once: a source keeps its dtype and shape across refits

  /// Makes runs() those of a source of this dtype and shape. Throws errc::apply when it does not fit.
  void route(dtype type, const std::vector<std::int64_t>& shape) { (void)routes.get(dest, type, shape); }
  /// The runs of the source last routed.
  [[nodiscard]] std::span<const plan::run> runs() const noexcept { return routes.runs(); }
};

/// The parameter table: destinations by source name, with an index of the bytes they write.
class table_t {
 public:
  [[nodiscard]] bool empty() const noexcept { return by_name_.empty(); }
  [[nodiscard]] std::size_t names() const noexcept { return by_name_.size(); }
  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  [[nodiscard]] auto begin() { return by_name_.begin(); }
  [[nodiscard]] auto end() { return by_name_.end(); }
  [[nodiscard]] auto begin() const { return by_name_.begin(); }
  [[nodiscard]] auto end() const { return by_name_.end(); }
  std::vector<slot>* find(const std::string& name) {
    const auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &it->second;
  }

  void clear() {
    by_name_.clear();
    spans_.clear();
    count_ = 0;
    longest_ = 0;
  }

  /// A destination checked against the table, ready to insert.
  struct prepared {
    slot s;
    std::uintptr_t lo = 0;
    std::uint64_t reach = 0;
  };

  /// Registers `d` (checked: see receiver::add_parameter). Throws errc::invalid_argument.
  void add(plan::destination d) { insert(prepare(std::move(d))); }

  /// Registers a quantised destination and its scale together, or neither. Throws
  /// errc::invalid_argument.
  void add_pair(plan::destination d, plan::destination scale) {
    prepared a = prepare(std::move(d));
    prepared b = prepare(std::move(scale));
    if (a.reach != 0 && b.reach != 0 && a.s.dest.dev == b.s.dest.dev && plan::overlaps(a.lo, a.s.foot, b.lo, b.s.foot))
      throw error(errc::invalid_argument,
                  fmt::format("add_parameter: the scale of '{}' shares bytes with its destination ({})",
                              a.s.dest.meta.name, describe(a.s.dest.meta)));
    insert(std::move(a));
    insert(std::move(b));
  }

  /// Checks `d` against itself and the table; throws errc::invalid_argument.
  prepared prepare(plan::destination d) {
    std::uint64_t reach = 0;
    try {
      reach = plan::check_view(d).bytes;
    } catch (const error& e) {
      throw error(e.code(), fmt::format("add_parameter: {}", e.what()));
    }
    slot s{std::move(d), {}, {}};
    s.foot = plan::footprint(s.dest);
    std::vector<slot>* same = find(s.dest.meta.name);
    if (same != nullptr) {
      const plan::destination& first = same->front().dest;
      if (first.meta.type != s.dest.meta.type || first.q != s.dest.q)
        throw error(errc::invalid_argument,
                    fmt::format("add_parameter: '{}' is registered as {}{} and again as {}{}: every destination of "
                                "one source has its dtype and quant",
                                s.dest.meta.name, to_string(first.meta.type),
                                first.q == quant::none ? "" : fmt::format(" ({})", to_string(first.q)),
                                to_string(s.dest.meta.type),
                                s.dest.q == quant::none ? "" : fmt::format(" ({})", to_string(s.dest.q))));
      if (plan::is_plain(first) && plan::is_plain(s.dest) && first.meta.shape == s.dest.meta.shape &&
          first.data == s.dest.data)
        throw error(errc::invalid_argument, fmt::format("add_parameter: '{}' is already registered", s.dest.meta.name));
    }
    const auto lo = reinterpret_cast<std::uintptr_t>(s.dest.data);
    if (reach != 0) {
      if (const auto clash = overlapping(s, lo, lo + reach))
        throw error(errc::invalid_argument,
                    fmt::format("add_parameter: the destination of '{}' ({}) writes bytes that the destination of '{}' "
                                "({}) writes too: no two destinations may share a byte",
                                s.dest.meta.name, describe(s.dest.meta), clash->meta.name, describe(clash->meta)));
    }
    return prepared{std::move(s), lo, reach};
  }

  void insert(prepared p) {
    const std::string name = p.s.dest.meta.name;
    auto& slots = by_name_[name];
    slots.push_back(std::move(p.s));
    ++count_;
    if (p.reach != 0) {
      spans_.emplace(p.lo, span{p.lo + p.reach, name, slots.size() - 1});
      longest_ = std::max(longest_, p.reach);
    }
  }

 private:
  struct span {
    std::uintptr_t hi;
    std::string name;
    std::size_t index;
  };

  /// A registered destination sharing a byte with `s` (whose bytes lie in [lo, hi)), or nullopt.
  std::optional<plan::destination> overlapping(const slot& s, std::uintptr_t lo, std::uintptr_t hi) const {
    auto it = spans_.lower_bound(lo > longest_ ? lo - longest_ : 0);
    for (; it != spans_.end() && it->first < hi; ++it) {
      if (it->second.hi <= lo) continue;
      const slot& other = by_name_.at(it->second.name)[it->second.index];
      if (!(other.dest.dev == s.dest.dev)) continue;
      if (plan::overlaps(lo, s.foot, it->first, other.foot)) return other.dest;
    }
    return std::nullopt;
  }

  std::unordered_map<std::string, std::vector<slot>> by_name_;
  std::multimap<std::uintptr_t, span> spans_;  ///< by first byte
  std::uint64_t longest_ = 0;
  std::size_t count_ = 0;
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
  bool direct = false;                   ///< the streamer writes straight into the table (cuda_ipc direct)
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
  [[nodiscard]] bool in_refit() const noexcept { return refit_active() || held.has_value(); }
};

/// The endpoint lane `rank` of `count` binds (see receiver_options::streamers).
std::string lane_endpoint(const std::string& requested, std::size_t rank, std::size_t count) {
  if (count == 1 || requested.empty()) return requested;
  if (const auto at = requested.find("{rank}"); at != std::string::npos)
    return requested.substr(0, at) + std::to_string(rank) + requested.substr(at + 6);
  if (requested.starts_with("tcp://") && (requested.ends_with(":0") || requested.ends_with(":*"))) return requested;
  throw error(errc::invalid_argument,
              fmt::format("receiver_options.endpoint '{}': a receiver of {} streamers binds one endpoint per streamer; "
                          "give \"\" (private ipc endpoints), a tcp endpoint with port 0, or a pattern with "
                          "\"{{rank}}\" in it",
                          requested, count));
}

}  // namespace

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
  std::vector<delta::host_entry> delta_entries;        ///< scratch of host_delta_entries()
  std::vector<std::byte*> delta_dests;                 ///< scratch of host_delta_entries()

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
#if REFIT_HAVE_CUDA
  delta::cuda::workspace& device_workspace() {
    if (!ln->device_delta || ln->device_delta->device() != ln->sink->where().index)
      ln->device_delta = std::make_unique<delta::cuda::workspace>(ln->sink->where().index);
    return *ln->device_delta;
  }
#endif
  /// The refit in progress is a delta patched on the GPU.
  [[nodiscard]] bool delta_on_device() const noexcept {
    return refit_delta && ln->sink && ln->sink->where().kind == device_kind::cuda;
  }

  /// Requests refused because they came from a peer that does not own the session (stranger()).
  std::uint64_t strangers_refused = 0;

  // Readable from any thread.
  std::atomic<bool> has_committed{false};
  std::atomic<std::uint64_t> committed{0};
  std::atomic<bool> is_dirty{false};
  mutable std::mutex mutex;  // guards last_error_ and stats_
  std::string last_error_;
  receiver_stats stats_;

  explicit impl(receiver_options o)
      : options(std::move(o)),
        token(options.token.empty() && std::getenv("REFIT_TOKEN") != nullptr ? std::getenv("REFIT_TOKEN")
                                                                             : options.token) {
    if (options.idle_timeout.count() <= 0)
      throw error(errc::invalid_argument, "receiver_options.idle_timeout must be positive");
    if (options.streamers == 0 || options.streamers > wire::max_group_size)
      throw error(errc::invalid_argument, fmt::format("receiver_options.streamers is {}; it must be in [1, {}]",
                                                      options.streamers, wire::max_group_size));
    if (options.delta_threads > delta::max_threads)
      throw error(errc::invalid_argument,
                  fmt::format("receiver_options.delta_threads is {}: a host delta is applied on at most {} threads "
                              "(0: min(hardware threads, 8))",
                              options.delta_threads, delta::max_threads));
    lanes.reserve(options.streamers);
    try {
      for (std::size_t r = 0; r < options.streamers; ++r)
        lanes.emplace_back(r, lane_endpoint(options.endpoint, r, options.streamers), options.curve,
                           options.allow_insecure_tcp);
    } catch (...) {
      remove_endpoints();
      throw;
    }
    ln = &lanes.front();
  }

  ~impl() {
    for (lane& l : lanes) {
      ln = &l;
      end_session();
    }
    remove_endpoints();
  }

  void remove_endpoints() noexcept {
    if (options.endpoint.empty())
      for (const lane& l : lanes) channel::remove_private_endpoint(l.channel.endpoint());
  }

  [[nodiscard]] bool grouped() const noexcept { return lanes.size() > 1; }

  /// A message kept by serve_one() waits for its reply on some lane.
  [[nodiscard]] bool owes() const noexcept {
    return std::any_of(lanes.begin(), lanes.end(),
                       [](const lane& l) { return l.pending.has_value() || l.waiting.has_value(); });
  }

  /// True when HELLO `h` of a group must wait for the sessions of lower ranks: its transport joins a
  /// collective at set-up (nccl: a receiver serves nothing else until every rank of that rank's
  /// communicator is there), and some lower rank has no session of that transport yet. Receivers
  /// that joined two ranks' communicators in opposite orders would wait for each other.
  [[nodiscard]] bool must_wait(const wire::hello& h) const {
    if (!grouped() || !transport::capabilities_of(h.transport).session_dies_on_error) return false;
    return std::any_of(lanes.begin(), lanes.end(), [&](const lane& l) {
      return l.rank < h.group_rank && !(l.sink && l.sink->attached() && l.sink->name() == h.transport);
    });
  }

  /// The reply timeout HELLO `h` says its streamer has (zero when it does not say), bounded.
  static milliseconds reply_timeout_of(const wire::hello& h) {
    return milliseconds{static_cast<std::int64_t>(std::min<std::uint64_t>(h.reply_timeout_ms, std::uint64_t{1} << 40))};
  }

  /// How long a waiting HELLO waits at most: then it is answered whatever the lower ranks do (a rank
  /// that never comes fails the set-up, as before).
  [[nodiscard]] milliseconds wait_bound(const wire::hello& h) const {
    const milliseconds asked = reply_timeout_of(h);
    return asked.count() > 0 ? asked / 2 : options.idle_timeout / 2;
  }

  /// The streamer of lane `l`, for messages: its peer name, and its rank in a group.
  [[nodiscard]] std::string who(const lane& l) const {
    const std::string name = l.peer.empty() ? std::string("a streamer") : printable(l.peer, 256);
    return grouped() ? fmt::format("rank {} ({})", l.rank, name) : name;
  }

  std::optional<std::uint64_t> committed_version() const noexcept {
    if (!has_committed.load(std::memory_order_acquire)) return std::nullopt;
    return committed.load(std::memory_order_acquire);
  }

  void note_error(const std::string& message) {
    std::lock_guard lock(mutex);
    last_error_ = message;
  }

  /// The current lane's part of a refit is in progress.
  bool refit_active() const noexcept { return ln->refit_active(); }

  /// Ends the refit in progress without committing, on every lane (on_abort runs before
  /// serve_one() returns). Lanes whose END waits for the group hear `code` and `why` now; lanes
  /// still sending hear it at their next message of the version (the current lane's caller answers
  /// the message in hand).
  void abort_refit(const std::string& why, errc code = errc::apply) noexcept {
    if (!group_version) return;
    const std::uint64_t version = *group_version;
    group_version.reset();
    // Device work that waits on a peer which will not come (nccl) must not outlive the refit. The
    // lanes' sinks are aborted together (transport::at_once): one lane's abort would otherwise wait
    // for another lane's receive from a streamer rank that died too (a trainer whose ranks all died
    // mid-refit).
    std::vector<std::function<void()>> aborts;
    for (lane& l : lanes) {
      l.took_part = l.in_refit();
      if (l.tracker) l.tracker->reset();
      if (l.sink) l.sink->end_sources();
      l.deferred.reset();
      if (l.sink && l.took_part) {
        try {
          aborts.emplace_back([s = l.sink.get()] { s->abort(); });
        } catch (...) {
          l.sink->abort();  // no memory for the list: this one now
        }
      }
    }
    transport::at_once(aborts);
    for (lane& l : lanes)
      if (l.sink && l.took_part && !l.sink->attached())
        l.tracker.reset();  // the session cannot go on: the next HELLO rebuilds
    // A delta patches in place: once it wrote anything, the weights are neither its base nor the
    // new version, and only a whole version can tell what they are.
    const bool poisons = refit_delta && is_dirty.load();
    if (poisons) is_poisoned.store(true);
    try {
      poison_note = poisons ? fmt::format(
                                  "poisoned: delta version {} failed after patching the weights in place "
                                  "({}); the receiver refuses deltas and subsets until a whole version commits",
                                  version, why)
                            : std::string();
      if (poisons) poison_reason = fmt::format("delta version {}: {}", version, why);
      note_error(poisons ? poison_note : why);
      REFIT_WARN("refit of version {} from {} aborted: {}{}", version, who(*ln), why,
                 poisons           ? " (poisoned: a delta was applied half-way; dirty until a whole version commits)"
                 : is_dirty.load() ? " (weights partly overwritten: dirty until a refit commits)"
                                   : "");
      endings.push_back(ending{version, false, why});
    } catch (...) {
    }
    // The streamers hear it last, once everything they may ask about (last_error(), dirty()) says so.
    for (lane& l : lanes) {
      try {
        if (l.held) {
          l.held.reset();
          l.channel.reply(wire::encode(wire::error{code, why}));
        } else if (grouped() && &l != answering) {
          // Its next message of this version hears why: a BATCH or END if it took part, a BEGIN
          // if it had not begun yet (it must not start the failed version over on its own).
          l.failed.emplace(version, refusal{code, why});
        }
      } catch (...) {
      }
    }
  }

  /// Runs on_commit / on_abort for the refits this serve_one() call ended. Exceptions are logged.
  void run_hooks() noexcept {
    std::vector<ending> ended;
    ended.swap(endings);
    for (const ending& e : ended) {
      const char* name = e.committed ? "on_commit" : "on_abort";
      try {
        if (e.committed && commit_hook) commit_hook(e.version);
        if (!e.committed && abort_hook) abort_hook(e.version, e.reason);
      } catch (const std::exception& ex) {
        try {
          REFIT_WARN("the {} hook threw for version {} (ignored): {}", name, e.version, ex.what());
        } catch (...) {
        }
      } catch (...) {
        try {
          REFIT_WARN("the {} hook threw a non-standard exception for version {} (ignored)", name, e.version);
        } catch (...) {
        }
      }
    }
  }

  /// Ends the current lane's session (and the refit in progress, if the lane takes part in it).
  void end_session() noexcept {
    if (ln->in_refit()) abort_refit(fmt::format("the session with {} ended", who(*ln)), errc::incomplete);
    if (ln->sink) {
      try {
        ln->sink->drain();
      } catch (const std::exception& e) {
        REFIT_WARN("draining the session with {} failed: {}", ln->peer, e.what());
      }
      ln->sink->detach();
    }
    ln->tracker.reset();
    ln->copier.reset();
    ln->peer.clear();
    ln->owned = false;
    ln->owner.clear();
    ln->secret.clear();
    ln->direct = false;
    ln->in_place = false;
    ln->parts = false;
    ln->laid_out = false;
  }

  void reply_ok(std::vector<std::string> handles = {}, wire::session_mode mode = wire::session_mode::buffers,
                std::vector<wire::conversion> convert = {}, std::string lane = {}) {
    wire::ok ok;
    ok.lane = std::move(lane);
    ok.convert = std::move(convert);
    ok.committed = committed_version();
    ok.dirty = is_dirty.load();
    ok.handles = std::move(handles);
    ok.mode = mode;
    ln->channel.reply(wire::encode(ok));
  }

  void reply_error(errc code, const std::string& message) {
    note_error(message);
    ln->channel.reply(wire::encode(wire::error{code, message}));
  }

  /// Ends the refit in progress and says why in the reply (to every lane whose END waits).
  receiver_event fail_refit(errc code, const std::string& message) {
    poison_note.clear();
    const bool owed = !ln->held;  // a held END is answered by abort_refit
    abort_refit(message, code);
    if (owed)
      reply_error(code, message);
    else
      note_error(message);
    if (!poison_note.empty()) note_error(poison_note);  // the streamer hears why; last_error() says poisoned
    return receiver_event::aborted;
  }

  /// A host-side apply that failed after its reply went out fails the refit at the next message.
  std::optional<receiver_event> fail_if_deferred() {
    if (!ln->deferred) return std::nullopt;
    const refusal r = *ln->deferred;
    return fail_refit(r.code, r.message);
  }

  // ------------------------------------------------------------------ messages

  /// Refuses a HELLO without touching the session in use: logs `logged`, replies `message`.
  receiver_event refuse_hello(const wire::hello& h, errc code, const std::string& message, std::string_view logged) {
    REFIT_WARN("refused HELLO from {}: {}", h.peer.empty() ? "an unnamed peer" : h.peer, logged);
    reply_error(code, message);
    return receiver_event::refused;
  }

  receiver_event on_hello(const wire::hello& h) {
    if (!same_token(h.token, token)) {
      const std::string message = fmt::format(
          "session token mismatch: this receiver expects {}; set the same REFIT_TOKEN (or options.token) on "
          "both sides",
          token.empty() ? "no token" : "another token");
      return refuse_hello(h, errc::unauthorized, message, "token mismatch");
    }
    if (h.group_size != lanes.size() || h.group_rank != ln->rank) {
      // Shards of one group assembled with another's, or two streamers on one lane, would commit
      // versions nobody sent whole.
      const std::string message =
          lanes.size() == 1
              ? fmt::format(
                    "this receiver takes one streamer, but the streamer says it is rank {} of a group of {} "
                    "(streamer_options::group_size): give the receiver receiver_options::streamers = {}",
                    h.group_rank, h.group_size, h.group_size)
              : fmt::format(
                    "this endpoint takes rank {} of a group of {} streamers (receiver_options::streamers), but "
                    "the streamer says it is rank {} of {}: rank k connects to the receiver's endpoints()[k]",
                    ln->rank, lanes.size(), h.group_rank, h.group_size);
      return refuse_hello(h, errc::invalid_argument, message, message);
    }
    if (!h.layout.empty() && !options.layout.empty() && h.layout != options.layout) {
      // Bytes laid out for another engine would land in the wrong places: refuse before any move.
      const std::string message = fmt::format(
          "engine layout mismatch: the streamer's tensors were recorded for layout {}, this receiver's parameter "
          "table for layout {}; record the route table again and give both sides the same one",
          h.layout, options.layout);
      return refuse_hello(h, errc::invalid_argument, message, message);
    }
    if (const auto gone = memory_gone()) {
      // Writing into memory the engine freed or reallocated would corrupt whatever lives there now.
      return refuse_hello(h, errc::invalid_argument, *gone, *gone);
    }
    // A new session replaces the old one (its streamer is gone or restarted).
    end_session();
    try {
      if (!ln->sink || ln->sink->name() != h.transport)
        ln->sink = transport::make_sink(h.transport, options.device, options.idle_timeout);
      wire::ok reply;
      ln->sink->attach(h, reply);
      // The session's requests may come through a lane of shared memory from here on (the old
      // session's lane, if any, is replaced: this HELLO's reply still goes the way it came). Its
      // descriptor link serves the transport too (VMM memory), from the offer on.
      std::unique_ptr<channel::lane> lane = offer_lane(h);
      ln->sink->link(lane ? lane->fds() : nullptr);
      if (!callback) reply.convert = conversions();
      ln->asked = reply.convert;
      std::vector<plan::destination> dests;  // none for a callback sink: it cannot be written in place
      if (!callback) {
        dests.reserve(table.size());
        for (const auto& [name, slots] : table)
          for (const slot& sl : slots) dests.push_back(sl.dest);
        ln->direct = ln->sink->offer_direct(h, dests, reply);
      }
      ln->in_place = !ln->direct && ln->sink->offer_in_place(h, dests, reply);
      ln->parts = ln->in_place && ln->sink->parts();
      std::vector<std::uint64_t> sizes;
      for (std::size_t i = 0; i < ln->sink->count(); ++i)
        sizes.push_back(ln->direct || ln->in_place ? transport::direct_batch_bytes : ln->sink->buffer_bytes(i));
      ln->tracker.emplace(std::move(sizes), wire::max_entries, grouped());
      ln->copier =
          copy::make_copier(copy::choose(ln->sink->engine(), options.engine), options.device, options.idle_timeout);
      ln->peer = h.peer;
      ln->owned = true;
      ln->owner = ln->channel.peer_id();
      ln->secret = h.secret;
      ln->reply_timeout = reply_timeout_of(h);
      ln->laid_out = h.mode == wire::session_mode::in_place;
      ln->session_generation = sink_generation;
      REFIT_INFO("session with {}: {} × {} MiB {} buffers{}", who(*ln), ln->sink->count(),
                 ln->sink->buffer_bytes(0) >> 20, h.transport, ln->direct || ln->in_place ? ", written in place" : "");
      reply_ok(std::move(reply.handles), reply.mode, std::move(reply.convert), lane ? lane->offer() : std::string());
      ln->channel.attach_lane(std::move(lane));
      ln->sink->after_reply();
      return receiver_event::hello;
    } catch (const error& e) {
      if (ln->sink) ln->sink->detach();
      ln->tracker.reset();
      REFIT_WARN("refused HELLO from {}: {}", h.peer, e.what());
      reply_error(e.code(), e.what());
      return receiver_event::refused;
    }
  }

  /// A control lane for the session HELLO `h` starts, when its streamer asked for one, runs on this
  /// host and the options allow it; null otherwise (or when none can be made: the session then
  /// goes through ZeroMQ alone).
  std::unique_ptr<channel::lane> offer_lane(const wire::hello& h) {
    if (!h.lane || !options.control_lane || h.host_id != transport::host_identity()) return nullptr;
    try {
      return channel::lane::create();
    } catch (const error& e) {
      REFIT_INFO("no control lane for {} (its requests go through ZeroMQ): {}", who(*ln), e.what());
      return nullptr;
    }
  }

  /// What the table asks the streamer to send each name as: every name whose destinations have a
  /// float dtype the streamer can convert into (f32, bf16, f16, or f8_e4m3 with a quant), since
  /// the source's dtype is only known when it arrives. Scale tensors are never listed.
  std::vector<wire::conversion> conversions() const {
    std::vector<wire::conversion> out;
    for (const auto& [name, slots] : table) {
      const plan::destination& d = slots.front().dest;
      if (name.find(scale_suffix) != std::string::npos) continue;
      const bool cast =
          d.q == quant::none && (d.meta.type == dtype::f32 || d.meta.type == dtype::bf16 || d.meta.type == dtype::f16);
      if (cast || d.q != quant::none) out.push_back(wire::conversion{name, d.meta.type, d.q});
    }
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
    return out;
  }

  /// Why a registered CUDA destination cannot be written any more (its allocation was freed, or
  /// is not the one it was registered in), or nullopt. Asked at every HELLO: engines capture CUDA
  /// graphs over their weights, so refit writes only where they were registered.
  std::optional<std::string> memory_gone() const {
    for (const auto& [name, slots] : table) {
      for (const slot& sl : slots) {
        const plan::destination& d = sl.dest;
        if (d.dev.kind != device_kind::cuda || sl.foot.empty()) continue;
        std::optional<copy::allocation> a;
        try {
          a = copy::cuda_allocation_of(d.data, d.dev.index);
        } catch (const error& e) {
          // The driver cannot tell (an old driver): nothing is known to be wrong; say so once.
          REFIT_WARN("cannot check that the CUDA memory of '{}' is still allocated: {}", name, e.what());
          return std::nullopt;
        }
        const auto lo = reinterpret_cast<std::uintptr_t>(d.alloc_bytes != 0 ? d.alloc : d.data);
        const std::uint64_t need = d.alloc_bytes != 0 ? d.alloc_bytes : 1;
        if (!a || lo < a->base || lo - a->base > a->bytes || need > a->bytes - (lo - a->base))
          return fmt::format(
              "the CUDA memory of '{}' ({}) on cuda:{} is {} since it was registered: refit writes only "
              "where a parameter was registered; register the parameters again (clear_parameters, "
              "add_parameter) after the engine reallocates them",
              name, describe(d.meta), d.dev.index, a ? "in another allocation" : "not allocated any more (freed)");
      }
    }
    return std::nullopt;
  }

  receiver_event on_begin(const wire::begin& b) {
    if (!ln->tracker) {
      // errc::peer tells the streamer that this process has no session with it (it restarted,
      // or ended the session): the streamer then says HELLO again instead of failing.
      reply_error(errc::peer,
                  "no session: BEGIN before HELLO (this receiver restarted or ended the session); the "
                  "streamer must say HELLO again");
      return receiver_event::refused;
    }
    if (ln->session_generation != sink_generation && !ln->laid_out && conversions() != ln->asked) {
      // The streamer converts what the OK to HELLO asked for: new conversions need a new session.
      end_session();
      REFIT_INFO(
          "the parameter table asks for other conversions since the session's HELLO: asking the streamer "
          "for a new session");
      reply_error(errc::peer,
                  "no session: the receiver's parameter table asks for other conversions since HELLO; "
                  "the streamer must say HELLO again");
      return receiver_event::refused;
    }
    if (ln->laid_out && ln->session_generation != sink_generation) {
      // The session was laid out from the table as it was at HELLO (the streamer maps those
      // weights, or receives into them): a new table needs a new session. errc::peer makes the
      // streamer say HELLO again and repeat this BEGIN by itself.
      end_session();
      REFIT_INFO("the parameter table changed since the session's HELLO: asking the streamer for a new session");
      reply_error(errc::peer,
                  "no session: the receiver's parameter table changed since HELLO, which laid the "
                  "session out from it; the streamer must say HELLO again");
      return receiver_event::refused;
    }
    if (table.empty() && !callback) {
      reply_error(errc::apply,
                  "this receiver has no sink: register parameters (add_parameter) or a callback (on_batch) first");
      return receiver_event::refused;
    }
    if (ln->failed && ln->failed->first != b.version) ln->failed.reset();  // another version: moot
    if (ln->failed) {
      // The group's version failed before this streamer began it: it hears why, and the group
      // does not start that version over with it alone.
      const refusal r = ln->failed->second;
      ln->failed.reset();
      reply_error(r.code, fmt::format("version {} failed before {} began it: {}", b.version, who(*ln), r.message));
      return receiver_event::refused;
    }
    if (group_version) return join_refit(b);
    ln->sink->end_sources();  // what a refit that ended without it mapped
    try {
      ln->tracker->begin(b, committed_version());
    } catch (const error& e) {
      reply_error(e.code(), e.what());
      return receiver_event::aborted;
    }
    if (b.base && grouped()) {
      ln->tracker->reset();
      reply_error(errc::protocol, fmt::format("BEGIN of delta version {} from {}: a group of streamers sends whole "
                                              "versions and subsets, not deltas",
                                              b.version, who(*ln)));
      return receiver_event::refused;
    }
    if (b.subset) {
      if (const auto why = no_base_for(b)) {
        ln->tracker->reset();
        REFIT_INFO("refused BEGIN of {} version {} from {}: {}", b.base ? "delta" : "subset", b.version, ln->peer,
                   *why);
        reply_error(errc::needs_whole, *why);
        return receiver_event::refused;
      }
    }
    refit_subset = b.subset;
    refit_delta = b.base.has_value();
    delta_terms = 0;
#if REFIT_HAVE_CUDA
    if (delta_on_device()) {  // what a failed refit left: its applies not launched are dropped, not run
      device_workspace().discard_writes();
      (void)device_workspace().take_terms(ln->sink->stream());
    }
#endif
    refit_generation = sink_generation;
    if (const auto refused = run_begin_hook(b.version)) {
      ln->tracker->reset();
      reply_error(refused->code, refused->message);
      return receiver_event::aborted;
    }
    refit_start = clock::now();
    apply_seconds = 0;
    group_version = b.version;
    ln->deferred.reset();
    // Direct writes start as soon as the streamer has this reply.
    if (ln->direct) is_dirty.store(true);
    reply_ok();
    return receiver_event::begin;
  }

  /// BEGIN from another streamer of the group, for the version in progress: its part joins it. A
  /// streamer of another version is refused (the group never mixes versions); so is a lane that
  /// already sent its part of this one.
  receiver_event join_refit(const wire::begin& b) {
    if (b.version != *group_version || b.subset != refit_subset || b.base) {
      const std::string message = fmt::format(
          "BEGIN of {}version {} from {}, while {}version {} is in progress: every streamer of a group sends the "
          "same versions, whole or subset alike; this one is refused (the group's version goes on)",
          b.base     ? "delta "
          : b.subset ? "subset "
                     : "",
          b.version, who(*ln), refit_subset ? "subset " : "", *group_version);
      REFIT_WARN("{}", message);
      reply_error(errc::protocol, message);
      return receiver_event::refused;
    }
    ln->sink->end_sources();
    try {
      ln->tracker->begin(b, committed_version());
    } catch (const error& e) {
      reply_error(e.code(), e.what());
      return receiver_event::refused;
    }
    ln->deferred.reset();
    ln->failed.reset();
    if (ln->direct) is_dirty.store(true);
    reply_ok();
    return receiver_event::begin;
  }

  /// Why this receiver cannot take subset (or delta) version `b`, or nullopt: it must hold a whole
  /// version of its table as it is, with clean weights; a delta also needs exactly its base, the
  /// base's checksum, and a table it can patch on the host (plain destinations).
  std::optional<std::string> no_base_for(const wire::begin& b) const {
    const std::string what = fmt::format("{} version {}", b.base ? "delta" : "subset", b.version);
    if (callback)
      return fmt::format(
          "{}: this receiver applies through a callback, which keeps no weights to keep the tensors "
          "not sent from; send whole versions",
          what);
    if (!whole_generation || *whole_generation != sink_generation)
      return fmt::format(
          "{}: this receiver has not committed a whole version{}, so it holds no base for the tensors "
          "a subset does not send; send a whole version first",
          what, whole_generation ? " since its parameter table was last changed" : "");
    if (is_poisoned.load())
      return fmt::format(
          "{}: this receiver is poisoned (a delta failed after patching its weights: {}); send a "
          "whole version",
          what, poison_reason);
    if (is_dirty.load())
      return fmt::format(
          "{}: this receiver's weights are dirty (a refit that did not commit overwrote part of them); "
          "send a whole version",
          what);
    if (!b.base) return std::nullopt;
    const auto have = committed_version();
    if (have != b.base)
      return fmt::format("{}: its base is version {}, but this receiver holds version {}; send a whole version", what,
                         *b.base, have ? std::to_string(*have) : std::string("none"));
    if (!known_checksum)
      return fmt::format(
          "{}: this receiver has no checksum of version {} (its END carried none) to check the delta "
          "against; send a whole version",
          what, *b.base);
    const bool gpu = ln->sink->where().kind == device_kind::cuda;
    if (ln->direct || ln->in_place || (gpu && !REFIT_HAVE_CUDA))
      return fmt::format(
          "{}: this receiver's session ({}{}) cannot apply patches, which are applied from the staging "
          "buffers; send a whole version",
          what, ln->sink->name(), ln->direct || ln->in_place ? ", written in place" : "");
    for (const auto& [name, slots] : table)
      for (const slot& sl : slots)
        if (!plan::is_plain(sl.dest) || !(sl.dest.dev == ln->sink->where()))
          return fmt::format(
              "{}: the destination of '{}' ({}) is {}, and patches are applied only to plain tensors "
              "in the memory the session applies into; send a whole version",
              what, name, describe(sl.dest.meta),
              plan::is_plain(sl.dest) ? "elsewhere" : "a view in the engine's layout");
    return std::nullopt;
  }

  /// A delta's batch, before anything of it is written: every patch well formed (check_patches), so
  /// that a corrupt one writes nothing of its batch. Then apply_delta() writes patches and spans
  /// sent as bytes into every destination of their tensor, summing the version checksum's change
  /// as the old bytes are overwritten.
  void check_patches(const wire::batch& b) {
    const std::byte* base = ln->sink->data(b.buffer);
#if REFIT_HAVE_CUDA
    if (delta_on_device()) {
      std::vector<delta::cuda::patch_ref> refs;
      for (const wire::entry& e : b.entries)
        if (e.kind == wire::entry_kind::patch)
          refs.push_back(delta::cuda::patch_ref{base + e.buffer_offset, e.bytes, itemsize(e.type), e.span, e.name});
      delta::cuda::check(refs, device_workspace(), ln->sink->stream());
      return;
    }
#endif
    // A host sink has answered the batch already (on_batch: the streamer diffs the next one while
    // this one is applied), but the answer leaves through ZeroMQ's I/O thread, which the kernel
    // wakes on this core: where every other core is busy, it waited for the whole apply, and the
    // streamer with it (a 2-core VM running a build: every BATCH answered after 3-8 ms, the time of
    // its apply, instead of 0.2 ms; qwen2.5-0.5b delta 191 -> 150 ms). Let it send first.
    std::this_thread::yield();
    host_patcher().check(host_delta_entries(b, base));
  }

  void apply_delta(const wire::batch& b) {
    const std::byte* base = ln->sink->data(b.buffer);
#if REFIT_HAVE_CUDA
    if (delta_on_device()) return apply_delta_device(b, base);
#endif
    delta_terms += host_patcher().apply(host_delta_entries(b, base));
  }

  /// The host patcher (receiver_options::delta_threads), made at the first delta batch applied on
  /// the host.
  delta::host_patcher& host_patcher() {
    if (!delta_patcher) delta_patcher = std::make_unique<delta::host_patcher>(options.delta_threads);
    return *delta_patcher;
  }

  /// The entries of delta batch `b` (in buffer `base`) as the host patcher takes them: every
  /// destination of their tensors, their checksum weights.
  std::span<const delta::host_entry> host_delta_entries(const wire::batch& b, const std::byte* base) {
    delta_dests.clear();
    delta_entries.clear();
    for (const wire::entry& e : b.entries)
      for (const slot& sl : *table.find(e.name)) delta_dests.push_back(static_cast<std::byte*>(sl.dest.data));
    std::size_t d = 0;
    for (const wire::entry& e : b.entries) {
      const std::size_t n = table.find(e.name)->size();
      delta_entries.push_back(delta::host_entry{base + e.buffer_offset, e.bytes, e.kind == wire::entry_kind::patch,
                                                e.span, e.tensor_offset, *checked_nbytes(e.type, e.shape),
                                                itemsize(e.type), delta::name_weight(e.name),
                                                std::span<std::byte* const>(delta_dests).subspan(d, n), e.name});
      d += n;
    }
    return delta_entries;
  }

#if REFIT_HAVE_CUDA
  /// apply_delta() on the GPU, enqueued on the apply stream: patches by the apply kernel (the batch's
  /// in a few launches), spans sent as bytes by the copier, the checksum terms summed on the device
  /// (read at END).
  void apply_delta_device(const wire::batch& b, const std::byte* base) {
    delta::cuda::workspace& ws = device_workspace();
    void* stream = ln->sink->stream();
    std::vector<copy::op> ops;
    for (const wire::entry& e : b.entries) {
      if (e.bytes == 0) continue;
      const std::uint64_t total = *checked_nbytes(e.type, e.shape);
      const std::uint64_t weight = delta::name_weight(e.name);
      const std::byte* from = base + e.buffer_offset;
      const std::vector<slot>& slots = *table.find(e.name);
      if (e.kind == wire::entry_kind::patch) {
        const delta::cuda::patch_ref p{from, e.bytes, itemsize(e.type), e.span, e.name};
        bool first = true;  // tied destinations: the terms are counted once
        for (const slot& sl : slots) {
          delta::cuda::apply(p, e.tensor_offset, total, static_cast<std::byte*>(sl.dest.data), first ? weight : 0, ws,
                             stream);
          first = false;
        }
        continue;
      }
      auto* first = static_cast<std::byte*>(slots.front().dest.data) + e.tensor_offset;
      delta::cuda::add_range_terms(first, e.tensor_offset, e.bytes, total, weight, true, ws, stream);
      delta::cuda::add_range_terms(from, e.tensor_offset, e.bytes, total, weight, false, ws, stream);
      ops.clear();
      for (const slot& sl : slots)
        ops.emplace_back(from, static_cast<std::byte*>(sl.dest.data) + e.tensor_offset, e.bytes);
      ln->copier->run(ops, stream);
    }
    delta::cuda::launch_applies(ws);  // before end_read() hands the buffer back
  }
#endif

  /// Runs on_begin; what it threw, as the refusal to send (a refit::error keeps its code, anything
  /// else is errc::apply, as from the batch callback).
  std::optional<refusal> run_begin_hook(std::uint64_t version) {
    if (!begin_hook) return std::nullopt;
    try {
      begin_hook(version);
      return std::nullopt;
    } catch (const error& e) {
      return refusal{e.code(), e.what()};
    } catch (const std::exception& e) {
      return refusal{errc::apply, fmt::format("the on_begin hook refused version {}: {}", version, e.what())};
    } catch (...) {
      return refusal{errc::apply,
                     fmt::format("the on_begin hook refused version {} (a non-standard exception)", version)};
    }
  }

  /// The sink changed since BEGIN: the batches so far went by the old one, so the refit cannot
  /// be trusted to commit.
  std::optional<refusal> sink_changed() const {
    if (refit_generation == sink_generation) return std::nullopt;
    return refusal{errc::apply,
                   fmt::format("the receiver's parameter table or callback changed while version {} was in progress "
                               "(change it only between refits); nothing was committed",
                               group_version.value_or(0))};
  }

  /// Builds the copies of a batch into the parameter table, checking every entry against it
  /// (all of them before anything is copied: a refused batch writes nothing). With `segments` (a
  /// sink that moves entries one by one), an entry that lands whole in one dense destination on the
  /// sink's device is received straight into it (a segment, no copy); the others are staged in the
  /// buffer (a segment there, and copies along their routes). With `check_only` (a direct session:
  /// the streamer wrote the bytes) nothing is built, the entries are only checked.
  std::vector<copy::op> table_ops(const wire::batch& b, const std::byte* base,
                                  std::vector<transport::segment>* segments, bool check_only = false) {
    std::vector<copy::op> ops;
    ops.reserve(b.entries.size());
    const device_kind where = ln->sink->where().kind;
    std::vector<plan::run> pieces;
    // A parts session's parts that do not land in one range of their destination: their segments,
    // their bytes in the scatter memory, and the copies that unpack them (index in ops, offset of
    // their first byte in the scatter memory).
    std::vector<std::size_t> scattered;
    std::uint64_t scatter_bytes = 0;
    std::vector<std::pair<std::size_t, std::uint64_t>> unpack;
    for (std::size_t k = 0; k < b.entries.size(); ++k) {
      const wire::entry& e = b.entries[k];
      std::vector<slot>* slots = table.find(e.name);
      if (slots == nullptr)
        throw error(errc::apply,
                    fmt::format("tensor '{}' (BATCH {} entry {}) is not in this receiver's parameter table",
                                printable(e.name), b.seq, k));
      for (slot& sl : *slots) {
        route_converted(sl, e);
        if (e.bytes != 0 && sl.dest.dev.kind != where && !sl.runs().empty())
          throw error(errc::apply,
                      fmt::format("tensor '{}': its destination is in {} memory, but the {} transport applies into {} "
                                  "memory",
                                  e.name, sl.dest.dev.kind == device_kind::cuda ? "CUDA" : "host", ln->sink->name(),
                                  where == device_kind::cuda ? "CUDA" : "host"));
      }
      if (e.bytes == 0 || check_only) continue;
      if (segments != nullptr && ln->parts) {
        // Each destination's bytes of the entry, in table order (none where it takes nothing):
        // received straight into it where they are one range of it, else into the sink's scatter
        // memory, packed run by run as the streamer sends them, and copied into place.
        for (const slot& sl : *slots) {
          pieces.clear();
          for (const plan::run& r : sl.runs()) plan::clip(r, e.tensor_offset, e.tensor_offset + e.bytes, pieces);
          if (pieces.empty()) continue;
          const std::uint64_t n = plan::bytes_of(pieces);
          if (const auto at = plan::contiguous(pieces, false)) {
            segments->push_back(transport::segment{static_cast<std::byte*>(sl.dest.data) + *at, 0, n});
            continue;
          }
          scattered.push_back(segments->size());
          segments->push_back(transport::segment{nullptr, scatter_bytes, n});
          for (const plan::run& r : pieces) {
            unpack.emplace_back(ops.size(), scatter_bytes);
            ops.emplace_back(nullptr, static_cast<std::byte*>(sl.dest.data) + r.dst, r.width, r.rows, r.width,
                             r.dst_pitch);
            scatter_bytes += r.width * r.rows;
          }
        }
        continue;
      }
      const slot& only = slots->front();
      if (segments != nullptr && slots->size() == 1 && plan::is_plain(only.dest) &&
          only.dest.dev == ln->sink->where()) {
        segments->push_back(transport::segment{static_cast<std::byte*>(only.dest.data) + e.tensor_offset, 0, e.bytes});
        continue;
      }
      for (const slot& sl : *slots) {
        const bool copies = copy::append_route(sl.runs(), e.tensor_offset, e.bytes, entry_data(e, base),
                                               static_cast<std::byte*>(sl.dest.data), ops, pieces);
        if (copies && where == device_kind::cuda && !(sl.dest.dev == ln->sink->where()) &&
            ln->copier->kind() == copy::engine::kernel)
          copy::enable_peer_access(ln->sink->where().index, sl.dest.dev.index);
      }
      if (segments != nullptr) segments->push_back(transport::segment{nullptr, e.buffer_offset, e.bytes});
    }
    if (scatter_bytes != 0) {
      // The parts received apart: their segments, and the copies that unpack them (the only copies
      // of a parts session), point into the sink's scatter memory, asked for once its size is known.
      std::byte* memory = ln->sink->scatter(b.buffer, scatter_bytes);
      if (memory == nullptr)
        throw error(errc::internal, fmt::format("BATCH {}: a parts session without scatter memory", b.seq));
      for (const std::size_t s : scattered)
        (*segments)[s] = transport::segment{memory + (*segments)[s].offset, 0, (*segments)[s].bytes};
      for (const auto& [op, at] : unpack) ops[op].src = memory + at;
    }
    return ops;
  }

  /// slot::route for entry `e`, with what a converting destination adds: an entry of another
  /// dtype is a streamer that did not convert, and a block128 shard must end on a block boundary
  /// unless it ends where its source does. Throws errc::apply.
  static void route_converted(slot& sl, const wire::entry& e) {
    const plan::destination& d = sl.dest;
    if (d.q != quant::none && e.type != d.meta.type)
      throw error(errc::apply,
                  fmt::format("tensor '{}': the streamer sends it as {}, but its destination asks for {} quantised "
                              "({}): the streamer did not convert it (an older refit?)",
                              e.name, to_string(e.type), to_string(d.meta.type), to_string(d.q)));
    sl.route(e.type, e.shape);
    if (d.q != quant::block128 || !d.slice) return;
    const auto dim = static_cast<std::size_t>(d.slice->dim);
    if (dim + 2 < e.shape.size() || d.slice->length % 128 == 0) return;
    const std::int64_t end = d.slice->start + d.slice->length;
    if (end != e.shape[dim])
      throw error(errc::apply,
                  fmt::format("tensor '{}': the destination takes [{}:{}] of dimension {} of a source of {} there; "
                              "block128 scales are computed over the global tensor's 128 × 128 blocks, so a shard "
                              "must end on a block boundary (a multiple of 128) or at the source's end, not at {}",
                              e.name, d.slice->start, end, dim, e.shape[dim], end));
  }

  /// The first byte of entry `e` of a batch in the buffer at `base`: there, or in the streamer's
  /// memory the sink mapped (wire::entry::source). Throws errc::protocol for a range outside it.
  const std::byte* entry_data(const wire::entry& e, const std::byte* base) const {
    return e.source == 0 ? base + e.buffer_offset : ln->sink->source_data(e.source, e.buffer_offset, e.bytes);
  }

  /// Copies (or enqueues the copies of) one batch, or runs the callback over it.
  void apply(const wire::batch& b, std::vector<copy::op>& ops, std::vector<transport::segment>& segments) {
    const auto t0 = clock::now();
    if (ln->sink->moves_entries()) {
      if (callback)  // the callback reads every entry from the buffer
        for (const wire::entry& e : b.entries)
          if (e.bytes != 0) segments.push_back(transport::segment{nullptr, e.buffer_offset, e.bytes});
      // A delta's entries are patched from the buffer: its used part, as the streamer sends it.
      if (refit_delta) segments = transport::buffer_prefix(b.entries);
      ln->sink->entries(b.buffer, segments);
    }
    // A ready batch reads only memory the streamer's GPU work had finished with (wire::batch::ready).
    if (!(b.ready && ln->sink->maps_sources())) ln->sink->begin_read(b.buffer);
    if (refit_delta) check_patches(b);  // a corrupt patch is refused before its batch writes anything
    is_dirty.store(true);               // from here on the weights may be partly overwritten
    if (callback) {
      const std::byte* base = ln->sink->data(b.buffer);
      std::vector<tensor_meta> metas;
      metas.reserve(b.entries.size());
      std::vector<tensor_view> views;
      views.reserve(b.entries.size());
      for (const wire::entry& e : b.entries) {
        metas.push_back(tensor_meta{e.name, e.type, e.shape});
        const std::uint64_t total = *checked_nbytes(e.type, e.shape);  // validated by wire::decode
        views.push_back(tensor_view{nullptr, entry_data(e, base), e.tensor_offset, e.bytes, total, ln->sink->where()});
      }
      for (std::size_t i = 0; i < views.size(); ++i) views[i].meta = &metas[i];
      try {
        callback(views, ln->sink->stream());
      } catch (const error&) {
        throw;
      } catch (const std::exception& ex) {
        throw error(errc::apply, fmt::format("the batch callback failed on BATCH {}: {}", b.seq, ex.what()));
      } catch (...) {
        throw error(errc::apply, fmt::format("the batch callback threw a non-standard exception on BATCH {}", b.seq));
      }
    } else if (refit_delta) {
      apply_delta(b);
    } else {
      ln->copier->run(ops, ln->sink->stream());
    }
    ln->sink->end_read(b.buffer);
    apply_seconds += seconds_since(t0);
  }

  /// A message of version `version` from a lane whose part of it ended without it (another rank
  /// failed the group's version): answered with why, once.
  std::optional<receiver_event> refuse_failed(std::uint64_t version) {
    if (!ln->failed || ln->failed->first != version) return std::nullopt;
    const refusal r = ln->failed->second;
    ln->failed.reset();
    reply_error(r.code, r.message);
    return receiver_event::refused;
  }

  receiver_event on_batch(const wire::batch& b) {
    if (!refit_active())
      if (const auto refused = refuse_failed(b.version)) return *refused;
    if (!refit_active()) {
      reply_error(errc::protocol, fmt::format("BATCH {} of version {} without a refit in progress (no BEGIN, or the "
                                              "refit was aborted: see the receiver's log)",
                                              b.seq, b.version));
      return receiver_event::refused;
    }
    if (const auto failed = fail_if_deferred()) return *failed;
    if (const auto changed = sink_changed()) return fail_refit(changed->code, changed->message);
    std::vector<copy::op> ops;
    std::vector<transport::segment> segments;
    try {
      ln->tracker->check(b);
      if (refit_delta)
        for (const wire::entry& e : b.entries)
          if (e.source != 0)
            throw error(errc::protocol, fmt::format("BATCH {}: tensor '{}' is read in place from the streamer's "
                                                    "memory in a delta version, whose entries travel in the buffer",
                                                    b.seq, e.name));
      ln->sink->map_sources(b.sources);
      if (!callback)
        ops = table_ops(b, ln->sink->data(b.buffer), ln->sink->moves_entries() && !ln->direct ? &segments : nullptr,
                        ln->direct || refit_delta);
    } catch (const error& e) {
      return fail_refit(e.code(), e.what());
    }
    if (ln->direct) {
      // The streamer has written the bytes already; what is left is the manifest, checked above.
      is_dirty.store(true);
      reply_ok();
    } else if (ln->sink->asynchronous()) {
      try {
        apply(b, ops, segments);
      } catch (const error& e) {
        return fail_refit(e.code(), e.what());
      }
      reply_ok();
    } else {
      reply_ok();
      try {
        apply(b, ops, segments);
      } catch (const error& e) {
        ln->deferred = refusal{e.code(), e.what()};
      }
    }
    return receiver_event::batch;
  }

  receiver_event on_end(const wire::end& e) {
    if (!refit_active())
      if (const auto refused = refuse_failed(e.version)) return *refused;
    if (!refit_active()) {
      reply_error(errc::protocol, fmt::format("END of version {} without a refit in progress", e.version));
      return receiver_event::refused;
    }
    if (const auto failed = fail_if_deferred()) return *failed;
    if (const auto changed = sink_changed()) return fail_refit(changed->code, changed->message);
    try {
      ln->tracker->finish(e);
    } catch (const error& ex) {
      return fail_refit(ex.code(), ex.what());
    }
    // Answered when the version ends: now for a streamer alone, at the last END of a group.
    ln->held = e;
    ln->held_since = clock::now();
    for (const lane& l : lanes)
      if (!l.held) {
        REFIT_DEBUG("END of version {} from {}: waiting for the other streamers of the group", e.version, who(*ln));
        return receiver_event::ended;
      }
    return finish_refit();
  }

  /// Every lane's END arrived: checks the version as a whole, commits it, and answers every END.
  receiver_event finish_refit() {
    const std::uint64_t version = *group_version;
    double drain_seconds = 0;
    for (lane& l : lanes)
      if (l.deferred) {
        const refusal r = *l.deferred;
        return fail_refit(r.code, r.message);
      }
    try {
#if REFIT_HAVE_CUDA
      if (delta_on_device()) {
        ln->sink->drain();  // deadline-bounded; then the device's terms are final
        delta_terms += device_workspace().take_terms(ln->sink->stream());
      }
#endif
      if (refit_delta) check_delta(*ln->held);
      // A streamer alone: the names its tracker saw complete (not copied); a group: check_shards's.
      const std::set<std::string, std::less<>> shards = grouped() ? check_shards(version) : decltype(shards){};
      const auto arrived = [&](const std::string& name) {
        return grouped() ? shards.contains(name) : ln->tracker->completed().contains(name);
      };
      // Every entry's name was found in the table as its batch was checked (table_ops), so a
      // streamer alone delivered every registered tensor exactly when it completed as many names
      // as the table has: the names are looked up one by one only to say which are missing.
      const bool all_there = !grouped() && ln->tracker->completed().size() == table.names();
      if (!callback && !refit_subset && !all_there) {
        std::size_t missing = 0;
        std::string first;
        for (const auto& [name, slots] : table) {
          if (!arrived(name)) {
            if (missing++ == 0) first = name;
          }
        }
        if (missing != 0)
          throw error(errc::incomplete,
                      fmt::format("version {} is missing {} of the {} registered tensors (first: {}{}); nothing was "
                                  "committed",
                                  version, missing, table.names(), shown(first), grouped() ? ", sent by no rank" : ""));
      }
      const auto td = clock::now();
      for (lane& l : lanes) l.sink->drain();
      drain_seconds = seconds_since(td);
    } catch (const error& ex) {
      return fail_refit(ex.code(), ex.what());
    }
    receiver_stats figures{version, 0, 0, 0, seconds_since(refit_start), apply_seconds, drain_seconds};
    for (const lane& l : lanes) {
      figures.tensors += l.held->tensors;
      figures.bytes += l.held->bytes;
      figures.batches += l.held->batches;
    }
    const std::optional<std::uint64_t> checksum = lanes.front().held->checksum;
    committed.store(version, std::memory_order_release);
    has_committed.store(true, std::memory_order_release);
    is_dirty.store(false);
    group_version.reset();
    // What the new version is a base for: a whole version for subsets, and for deltas when its END
    // carried a checksum (trusted: re-reading every byte would cost what a delta saves); a delta's
    // was checked above; a subset's is unknown (it did not carry the other tensors). A group's
    // streamers keep no base.
    if (!refit_subset) {
      whole_generation = sink_generation;
      is_poisoned.store(false);
    }
    known_checksum = (refit_subset && !refit_delta) || grouped() ? std::nullopt : checksum;
    {
      std::lock_guard lock(mutex);
      stats_ = figures;
    }
    REFIT_INFO("committed version {} from {}: {} tensors, {:.3f} GB", version,
               grouped() ? fmt::format("{} streamers", lanes.size()) : who(*ln), figures.tensors,
               static_cast<double>(figures.bytes) / 1e9);
    endings.push_back(ending{version, true, {}});
    // The streamers hear it first; what is only tidying up follows (the next request waits for
    // it all the same, but a streamer's refit() returns meanwhile).
    lane* const current = ln;
    for (lane& l : lanes) {
      l.held.reset();
      ln = &l;
      reply_ok();
    }
    ln = current;
    for (lane& l : lanes) {
      l.tracker->reset();
      if (l.sink) l.sink->end_sources();  // drained: what this version did not read is unmapped
    }
    return receiver_event::committed;
  }

  /// A group's version: the byte ranges its streamers sent of each tensor must cover the tensor
  /// exactly once, with one dtype and shape. Returns the names that arrived. Throws
  /// errc::invalid_argument (ranks disagree on a tensor, or their shards overlap) or
  /// errc::incomplete (bytes no rank sent), naming the tensor and the ranks.
  std::set<std::string, std::less<>> check_shards(std::uint64_t version) const {
    struct piece {
      std::uint64_t first, next;
      std::size_t rank;
      const wire::refit_tracker::range* r;
    };
    std::map<std::string_view, std::vector<piece>> by_name;
    for (const lane& l : lanes)
      for (const auto& [name, r] : l.tracker->ranges()) by_name[name].push_back(piece{r.first, r.next, l.rank, &r});
    std::set<std::string, std::less<>> arrived;
    for (auto& entry : by_name) {
      // Not a structured binding: the lambdas below use both, which clang before 16 cannot capture.
      const std::string_view name = entry.first;
      std::vector<piece>& pieces = entry.second;
      std::sort(pieces.begin(), pieces.end(), [](const piece& x, const piece& y) {
        return x.first != y.first ? x.first < y.first : x.next < y.next;
      });
      const wire::refit_tracker::range& one = *pieces.front().r;
      // Rows when the ranges fall on rows (shards of dimension 0), bytes otherwise.
      const std::uint64_t row =
          one.shape.empty() || one.shape.front() <= 0 ? 0 : one.total / static_cast<std::uint64_t>(one.shape.front());
      const auto span = [&](std::uint64_t lo, std::uint64_t hi) {
        if (row != 0 && lo % row == 0 && hi % row == 0) return fmt::format("rows [{}, {})", lo / row, hi / row);
        return fmt::format("bytes [{}, {})", lo, hi);
      };
      const auto unsent = [&](std::uint64_t lo, std::uint64_t hi) {
        throw error(errc::incomplete,
                    fmt::format("version {}: tensor '{}': {} were sent by no rank (the shards of ranks {} leave them "
                                "out); nothing was committed",
                                version, name, span(lo, hi), ranks_of(pieces)));
      };
      std::uint64_t cursor = 0;
      std::size_t last_rank = pieces.front().rank;
      for (const piece& p : pieces) {
        if (p.r->type != one.type || p.r->shape != one.shape)
          throw error(errc::invalid_argument,
                      fmt::format("version {}: tensor '{}' is {} from rank {} but {} from rank {}; nothing was "
                                  "committed",
                                  version, name, describe(tensor_meta{std::string(name), one.type, one.shape}),
                                  pieces.front().rank, describe(tensor_meta{std::string(name), p.r->type, p.r->shape}),
                                  p.rank));
        if (p.first == p.next) continue;  // an empty shard covers nothing
        if (p.first < cursor)
          throw error(errc::invalid_argument,
                      fmt::format("version {}: tensor '{}': {} were sent by rank {} and by rank {} (their shards "
                                  "overlap); nothing was committed",
                                  version, name, span(p.first, std::min(cursor, p.next)), last_rank, p.rank));
        if (p.first > cursor) unsent(cursor, p.first);
        cursor = p.next;
        last_rank = p.rank;
      }
      if (cursor != one.total) unsent(cursor, one.total);
      arrived.emplace(name);
    }
    return arrived;
  }

  template <typename Pieces>
  static std::string ranks_of(const Pieces& pieces) {
    std::vector<std::size_t> ranks;
    for (const auto& p : pieces) ranks.push_back(p.rank);
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
    return fmt::format("{}", fmt::join(ranks, ", "));
  }

  /// A delta's END: the checksum the streamer computed of the whole new version must be the one the
  /// receiver's weights now have (the base's, changed by what the patches wrote). Throws errc::apply.
  void check_delta(const wire::end& e) const {
    if (!e.checksum) throw error(errc::protocol, fmt::format("END of delta version {} carries no checksum", e.version));
    const std::uint64_t mine = *known_checksum + delta_terms;
    if (mine != *e.checksum)
      throw error(errc::apply,
                  fmt::format("delta version {} does not check out: the streamer's checksum of the whole version is "
                              "{:#018x}, the weights here now sum to {:#018x} (a corrupted patch, or weights that were "
                              "not the base); nothing was committed",
                              e.version, *e.checksum, mine));
  }

  /// The streamer gave up the refit on its side (ABORT).
  receiver_event on_abort(const wire::abort& a) {
    if (ln->failed && ln->failed->first == a.version) ln->failed.reset();  // it knows: it gave up itself
    if (!refit_active() || ln->tracker->version() != a.version) {
      // Nothing to abort: the refit already ended here (refused, timed out, superseded) or never
      // began. The streamer only wants to know that it need not wait.
      REFIT_INFO("ABORT of version {} from {} ignored: {}", a.version, ln->peer.empty() ? "a streamer" : ln->peer,
                 refit_active() ? fmt::format("version {} is in progress", ln->tracker->version())
                                : std::string("no refit in progress"));
      reply_ok();
      return receiver_event::refused;
    }
    abort_refit(
        fmt::format("the streamer {} aborted version {} ({}): {}", who(*ln), a.version, to_string(a.code), a.reason),
        grouped() ? errc::incomplete : errc::apply);
    reply_ok();
    return receiver_event::aborted;
  }

  /// Why `m` ends the refit in progress before it is handled (a new session or a new refit), or
  /// nullopt. A HELLO with the wrong token does not: it is refused without touching the session.
  std::optional<std::string> supersedes(const wire::message& m) const {
    if (!refit_active()) return std::nullopt;
    if (const auto* b = std::get_if<wire::begin>(&m))
      return fmt::format("BEGIN of version {} arrived before END of version {}", b->version, ln->tracker->version());
    if (const auto* h = std::get_if<wire::hello>(&m); h != nullptr && same_token(h->token, token))
      return fmt::format("a new session (HELLO from {}) replaced the session with {} before END of version {}",
                         h->peer.empty() ? "an unnamed peer" : h->peer, who(*ln), ln->tracker->version());
    if (std::holds_alternative<wire::bye>(m))
      return fmt::format("the streamer {} ended the session (BYE) before END of version {}", who(*ln),
                         ln->tracker->version());
    return std::nullopt;
  }

  /// True when the request in hand came from the peer that owns the lane's session: through its
  /// control lane, or through the connection its HELLO came by while it has not moved to the lane.
  [[nodiscard]] bool from_owner() const {
    if (!ln->owned) return false;
    if (ln->channel.last_from_lane()) return true;
    return !ln->channel.on_lane() && ln->channel.peer_id() == ln->owner;
  }

  /// Why request `m` (which carried `secret`) may not act in the lane's session, or nullopt. A HELLO
  /// may always try (its token decides); every other request of a session must come from the
  /// session's owner and carry its secret. Without a session, the handlers refuse what needs one.
  std::optional<std::string> stranger(const wire::message& m, const std::string& secret) const {
    if (std::holds_alternative<wire::hello>(m) || !ln->owned) return std::nullopt;
    if (from_owner() && same_token(secret, ln->secret)) return std::nullopt;
    const std::string_view what = wire::to_string(wire::type_of(m));
    if (!ln->channel.last_from_lane() && ln->channel.on_lane())
      return fmt::format(
          "{} refused: the session with {} moved to its control lane; over ZeroMQ this receiver "
          "takes only a new HELLO",
          what, who(*ln));
    return fmt::format(
        "{} refused: it does not come from the peer that opened the session with {} (another "
        "connection, or not the session's secret); say HELLO first",
        what, who(*ln));
  }

  receiver_event handle(const std::string& bytes) {
    wire::message m;
    std::string secret;
    try {
      m = wire::decode(bytes, &secret);
    } catch (const error& e) {
      // Only the session's owner can break its refit with bytes that do not decode; a stranger
      // hears why and the refit goes on.
      const bool was_active = refit_active() && from_owner();
      answering = ln;
      if (was_active) abort_refit(e.what(), e.code());
      answering = nullptr;
      reply_error(e.code(), e.what());
      return was_active ? receiver_event::aborted : receiver_event::refused;
    }
    if (const auto why = stranger(m, secret)) {
      ++strangers_refused;
      if ((strangers_refused & (strangers_refused - 1)) == 0)
        REFIT_WARN("{} ({} refused so far)", *why, strangers_refused);
      answering = ln;
      ln->channel.reply(wire::encode(wire::error{errc::unauthorized, *why}));
      answering = nullptr;
      return receiver_event::refused;
    }
    ln->last_message = clock::now();
    if (const auto* h = std::get_if<wire::hello>(&m); h != nullptr && must_wait(*h)) {
      REFIT_DEBUG("HELLO of rank {} waits for the sessions of the lower ranks", h->group_rank);
      ln->waiting = *h;
      ln->waiting_since = clock::now();
      return receiver_event::idle;
    }
    return supersede_or_dispatch(std::move(m));
  }

  /// Handles request `m` of lane `ln`; a request that ends the refit in progress (supersedes()) is
  /// reported on its own, and answered by the next call (lane::pending).
  receiver_event supersede_or_dispatch(wire::message m) {
    if (const auto why = supersedes(m)) {
      answering = ln;
      abort_refit(*why, grouped() ? errc::incomplete : errc::apply);
      answering = nullptr;
      ln->pending = std::move(m);
      return receiver_event::aborted;
    }
    return dispatch(m);
  }

  receiver_event dispatch(const wire::message& m) {
    answering = ln;
    struct done_answering {
      lane*& a;
      ~done_answering() { a = nullptr; }
    } done{answering};
    return std::visit(
        [&](const auto& msg) -> receiver_event {
          using T = std::decay_t<decltype(msg)>;
          if constexpr (std::is_same_v<T, wire::hello>) {
            return on_hello(msg);
          } else if constexpr (std::is_same_v<T, wire::begin>) {
            return on_begin(msg);
          } else if constexpr (std::is_same_v<T, wire::batch>) {
            return on_batch(msg);
          } else if constexpr (std::is_same_v<T, wire::end>) {
            return on_end(msg);
          } else if constexpr (std::is_same_v<T, wire::bye>) {
            end_session();
            reply_ok();
            ln->channel.attach_lane(nullptr);  // the session's lane goes with it (answered first)
            return receiver_event::bye;
          } else if constexpr (std::is_same_v<T, wire::abort>) {
            return on_abort(msg);
          } else {
            reply_error(errc::protocol, fmt::format("{} is a reply, not a request", wire::to_string(wire::type_of(m))));
            return receiver_event::refused;
          }
        },
        m);
  }

  receiver_event serve_one(milliseconds wait) {
    receiver_event e = receiver_event::idle;
    try {
      e = step(wait);
    } catch (...) {
      run_hooks();
      throw;
    }
    run_hooks();
    return e;
  }

  receiver_event step(milliseconds wait) {
    for (lane& l : lanes) {
      if (!l.pending) continue;
      // Received by the last call, which ended the refit it superseded; its streamer is waiting.
      ln = &l;
      const wire::message m = std::move(*l.pending);
      l.pending.reset();
      l.last_message = clock::now();
      return dispatch(m);
    }
    for (lane& l : lanes) {
      if (!l.waiting) continue;
      if (must_wait(*l.waiting) && clock::now() - l.waiting_since < wait_bound(*l.waiting)) {
        wait = std::min(wait, milliseconds{10});  // asked again soon: the lower ranks' HELLOs come on other lanes
        continue;
      }
      ln = &l;
      wire::message m = std::move(*l.waiting);
      l.waiting.reset();
      return supersede_or_dispatch(std::move(m));
    }
    if (group_version) {
      // A refit in progress must not wait forever on a dead streamer: every lane that has not
      // ended its part must say something within the idle timeout (one that has not begun it yet,
      // within the idle timeout of the version's first BEGIN).
      // A lane whose END is held is answered within three quarters of its streamer's reply timeout.
      const auto now = clock::now();
      lane* late = nullptr;
      clock::time_point deadline{};
      for (lane& l : lanes) {
        if (l.held && l.reply_timeout.count() == 0) continue;
        const auto due =
            l.held ? l.held_since + l.reply_timeout * 3 / 4
                   : (l.refit_active() ? l.last_message : std::max(l.last_message, refit_start)) + options.idle_timeout;
        if (late == nullptr || due < deadline) late = &l, deadline = due;
      }
      if (late != nullptr && now >= deadline) {
        ln = late;
        abort_refit(late_reason(*late), errc::timeout);
        return receiver_event::aborted;
      }
      if (late != nullptr) wait = std::min(wait, std::chrono::ceil<milliseconds>(deadline - now));
    }
    const auto request = receive(wait);
    if (!request) return streamer_gone() ? receiver_event::aborted : receiver_event::idle;
    const auto received = clock::now();
    const receiver_event e = handle(*request);
    REFIT_DEBUG("{} handled in {:.0f} us ({} bytes)", to_string(e),
                std::chrono::duration<double, std::micro>(clock::now() - received).count(), request->size());
    return e;
  }

  /// Ends the refit in progress when the streamer of a lane that takes part in it was found gone
  /// through its control lane (channel::rep_channel::lane_gone()): its process ended, so waiting for
  /// receiver_options::idle_timeout would only keep the weights dirty longer. True when it did.
  bool streamer_gone() {
    bool aborted = false;
    for (lane& l : lanes) {
      if (!l.channel.lane_gone() || !l.in_refit() || !group_version) continue;
      ln = &l;
      abort_refit(fmt::format("the streamer {} is gone during version {}: its control lane closed (its process "
                              "ended, or it let go of the session), noticed at once instead of after "
                              "receiver_options.idle_timeout ({} ms)",
                              who(l), *group_version, options.idle_timeout.count()),
                  errc::peer);
      aborted = true;
    }
    return aborted;
  }

  /// Why the group's version fails at lane `l`'s deadline (see step()).
  std::string late_reason(const lane& l) const {
    if (l.refit_active())
      return fmt::format("no message from the streamer {} for {} ms during version {}", who(l),
                         options.idle_timeout.count(), *group_version);
    if (!l.held)
      return fmt::format("the streamer {} did not begin version {} within {} ms of the group's first BEGIN", who(l),
                         *group_version, options.idle_timeout.count());
    std::vector<std::size_t> missing;
    for (const lane& o : lanes)
      if (!o.held) missing.push_back(o.rank);
    return fmt::format(
        "version {} did not end within three quarters of the reply timeout of {} ({} ms): rank {} had not sent its "
        "END",
        *group_version, who(l), l.reply_timeout.count(), fmt::join(missing, ", "));
  }

  /// Waits up to `wait` for a request on any lane that is not holding one (a held END must be
  /// answered first); makes its lane the current one.
  std::optional<std::string> receive(milliseconds wait) {
    if (lanes.size() == 1) {
      ln = &lanes.front();
      return ln->channel.receive(wait, refit_active());
    }
    std::vector<channel::rep_channel*> open;
    std::vector<lane*> owners;
    for (std::size_t k = 0; k < lanes.size(); ++k) {
      lane& l = lanes[(next_lane + k) % lanes.size()];
      if (l.held || l.waiting) continue;  // each answers before its next request
      open.push_back(&l.channel);
      owners.push_back(&l);
    }
    const auto ready = channel::rep_channel::wait_any(open, wait, group_version.has_value());
    if (!ready) return std::nullopt;
    ln = owners[*ready];
    next_lane = (ln->rank + 1) % lanes.size();
    return ln->channel.receive(milliseconds{0});
  }
};

namespace {

/// The conversion a destination asks for must be one refit does (see tensor_dest). Throws
/// errc::invalid_argument naming the tensor.
void check_conversion(const tensor_dest& d, const dest_layout& layout) {
  const std::string what = fmt::format("add_parameter: '{}' ({})", d.meta.name, describe(d.meta));
  if (d.q == quant::none) {
    if (d.scale != nullptr)
      throw error(errc::invalid_argument,
                  fmt::format("{} has a scale but no quant: a scale belongs to an f8_e4m3 destination quantised per "
                              "tensor or per 128 × 128 block (set quant)",
                              what));
    return;
  }
  if (static_cast<std::uint8_t>(d.q) > static_cast<std::uint8_t>(quant::block128))
    throw error(errc::invalid_argument,
                fmt::format("{} has an unknown quant (code {})", what, static_cast<unsigned>(d.q)));
  if (d.meta.type != dtype::f8_e4m3)
    throw error(errc::invalid_argument,
                fmt::format("{} asks for quant {}, which quantises to f8_e4m3: register the destination as f8_e4m3, "
                            "not {}",
                            what, to_string(d.q), to_string(d.meta.type)));
  const std::size_t rank = d.meta.shape.size();
  if (d.q == quant::block128 && rank < 2)
    throw error(errc::invalid_argument,
                fmt::format("{} asks for quant block128, which quantises 128 × 128 blocks of the last two dimensions: "
                            "it needs at least 2 dimensions, not {}",
                            what, rank));
  const auto scale_numel = checked_numel(scale_shape(d.q, d.meta.shape));
  if (d.scale == nullptr && scale_numel.value_or(0) != 0)
    throw error(errc::invalid_argument,
                fmt::format("{} is quantised ({}) but has no scale: pass its f32 scale_inv tensor of shape [{}]", what,
                            to_string(d.q), fmt::join(scale_shape(d.q, d.meta.shape), ", ")));
  if (d.q == quant::block128 && layout.slice && layout.slice->dim >= 0 &&
      static_cast<std::size_t>(layout.slice->dim) + 2 >= rank && layout.slice->start % 128 != 0)
    // Blocks are those of the global tensor: a shard starting inside one would need the amax of
    // elements it does not hold.
    throw error(errc::invalid_argument,
                fmt::format("{}: block128 scales are computed over the global tensor's 128 × 128 blocks, so a slice "
                            "of dimension {} must start on a block boundary (a multiple of 128); this one starts at "
                            "{}",
                            what, layout.slice->dim, layout.slice->start));
}

/// The hidden destination of a quantised destination's scales: dense f32 at `d.scale`, taking the
/// part of the source's scale grid that the destination's slice takes of the source.
plan::destination scale_destination(const tensor_dest& d, const dest_layout& layout) {
  plan::destination s;
  s.meta = tensor_meta{d.meta.name + std::string(scale_suffix), dtype::f32, scale_shape(d.q, d.meta.shape)};
  s.data = d.scale;
  s.dev = d.dev;
  if (d.q == quant::block128 && layout.slice) {
    source_slice sl = *layout.slice;
    const auto dim = static_cast<std::size_t>(sl.dim);
    if (dim + 2 >= d.meta.shape.size()) sl.start /= 128;
    sl.length = s.meta.shape[dim];
    s.slice = sl;
  }
  return s;
}

}  // namespace

receiver::receiver(receiver_options options) : impl_(std::make_unique<impl>(std::move(options))) {}
receiver::~receiver() = default;
receiver::receiver(receiver&&) noexcept = default;
receiver& receiver::operator=(receiver&&) noexcept = default;

std::string receiver::endpoint() const { return impl_->lanes.front().channel.endpoint(); }

std::vector<std::string> receiver::endpoints() const {
  std::vector<std::string> out;
  out.reserve(impl_->lanes.size());
  for (const lane& l : impl_->lanes) out.push_back(l.channel.endpoint());
  return out;
}

void receiver::add_parameter(const tensor_dest& dest) { add_parameter(dest, dest_layout{}); }

void receiver::add_parameter(const tensor_dest& dest, const dest_layout& layout) {
  if (impl_->callback)
    throw error(errc::invalid_argument,
                "add_parameter: this receiver applies through a callback (on_batch); use one "
                "sink or the other");
  if (dest.meta.name.empty()) throw error(errc::invalid_argument, "add_parameter: empty tensor name");
  const std::uint64_t bytes = dest.meta.nbytes();  // throws for a bad shape
  if (dest.data == nullptr && bytes != 0)
    throw error(errc::invalid_argument,
                fmt::format("add_parameter: {} has no data (null pointer); only a tensor with no elements may have "
                            "none (a 0-d tensor is one element: {} bytes)",
                            describe(dest.meta), bytes));
  if (dest.meta.name.find('\x1f') != std::string::npos)
    throw error(errc::invalid_argument,
                fmt::format("add_parameter: the name '{}' contains the control character \\x1f, which refit reserves "
                            "for the scale tensors of quantised destinations",
                            dest.meta.name.substr(0, dest.meta.name.find('\x1f'))));
  check_conversion(dest, layout);
  if (dest.q == quant::none) {
    impl_->table.add(plan::destination(dest, layout));
  } else {
    impl_->table.add_pair(plan::destination(dest, layout), scale_destination(dest, layout));
  }
  ++impl_->sink_generation;
}

void receiver::clear_parameters() {
  impl_->table.clear();
  ++impl_->sink_generation;
}

void receiver::on_batch(batch_callback callback) {
  if (!callback) throw error(errc::invalid_argument, "on_batch: empty callback");
  impl_->table.clear();
  impl_->callback = std::move(callback);
  ++impl_->sink_generation;
}

void receiver::on_begin(std::function<void(std::uint64_t version)> hook) { impl_->begin_hook = std::move(hook); }

void receiver::on_commit(std::function<void(std::uint64_t version)> hook) { impl_->commit_hook = std::move(hook); }

void receiver::on_abort(std::function<void(std::uint64_t version, const std::string& reason)> hook) {
  impl_->abort_hook = std::move(hook);
}

receiver_event receiver::serve_one(milliseconds wait) { return impl_->serve_one(wait); }

void receiver::serve(const std::function<bool()>& stop, milliseconds poll) {
  // A message kept by the last call is owed its reply, stop or not.
  while (impl_->owes() || !stop()) impl_->serve_one(poll);
}

std::optional<std::uint64_t> receiver::committed_version() const noexcept { return impl_->committed_version(); }
bool receiver::dirty() const noexcept { return impl_->is_dirty.load(); }
bool receiver::poisoned() const noexcept { return impl_->is_poisoned.load(); }

receiver_stats receiver::last_stats() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->stats_;
}

std::string receiver::last_error() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->last_error_;
}

}  // namespace refit
