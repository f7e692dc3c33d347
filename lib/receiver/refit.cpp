// refit — one version through the receiver: BEGIN, BATCH..., END (or ABORT), checked against the
// session's tracker; its commit when every lane's END is in, or its abort.
#include <fmt/format.h>

#include <set>

#include "receiver/impl.hpp"

namespace refit {
namespace {

/// The tensor a table name stands for, for messages: "w", or "the scale_inv of 'w'".
std::string shown(const std::string& name) {
  if (const auto at = name.find(scale_2_suffix); at != std::string::npos)
    return fmt::format("the scale_2 of '{}'", name.substr(0, at));
  const auto at = name.find(scale_suffix);
  if (at == std::string::npos) return fmt::format("'{}'", name);
  return fmt::format("the scale_inv of '{}'", name.substr(0, at));
}

}  // namespace

/// BEGIN: the first of a version starts it (begin_refit()); a later one, from another streamer of
/// the group, joins it (join_refit()).
receiver_event receiver::impl::on_begin(const wire::begin& b) {
  if (const auto refused = check_begin(b)) return *refused;
  if (group_version) return join_refit(b);
  return begin_refit(b);
}

/// Refuses BEGIN `b` when the lane's session cannot take it (none, or laid out from a table that
/// changed since), there is no sink, or the group's version failed before this lane began it;
/// nullopt when it may go on.
std::optional<receiver_event> receiver::impl::check_begin(const wire::begin& b) {
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
  return check_stage(b);
}

/// The version of BEGIN `b` starts: checked by the tracker, against the base a subset or delta
/// needs, and by the on_begin hook.
receiver_event receiver::impl::begin_refit(const wire::begin& b) {
  ln->sink->end_sources();  // what a refit that ended without it mapped
  try {
    ln->tracker->begin(b, committed_version());
  } catch (const error& e) {
    reply_error(e.code(), e.what());
    return receiver_event::aborted;
  }
  if (const auto refused = refuse_base(b)) return *refused;
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
  if (staged()) {  // a new refit: no destination is in the stage yet (slot::staged_in)
    ++stage_serial;
    staged_slots.clear();
    staged_log.clear();
    log_used = 0;
  }
  ln->deferred.reset();
  // Direct writes start as soon as the streamer has this reply (into the weights, unless into the stage).
  if (ln->direct && !ln->into_stage) is_dirty.store(true);
  reply_ok();
  return receiver_event::begin;
}

/// Refuses BEGIN `b` (its tracker reset) when it is a delta of a group, or a subset or delta this
/// receiver holds no base for (no_base_for()); nullopt otherwise.
std::optional<receiver_event> receiver::impl::refuse_base(const wire::begin& b) {
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
      REFIT_INFO("refused BEGIN of {} version {} from {}: {}", b.base ? "delta" : "subset", b.version, ln->peer, *why);
      reply_error(errc::needs_whole, *why);
      return receiver_event::refused;
    }
  }
  return std::nullopt;
}

/// Runs on_begin; what it threw, as the refusal to send (a refit::error keeps its code, anything
/// else is errc::apply, as from the batch callback).
std::optional<refusal> receiver::impl::run_begin_hook(std::uint64_t version) {
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
std::optional<refusal> receiver::impl::sink_changed() const {
  if (refit_generation == sink_generation) return std::nullopt;
  return refusal{errc::apply,
                 fmt::format("the receiver's parameter table or callback changed while version {} was in progress "
                             "(change it only between refits); nothing was committed",
                             group_version.value_or(0))};
}

receiver_event receiver::impl::on_batch(const wire::batch& b) {
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
    if (!ln->into_stage) is_dirty.store(true);
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

receiver_event receiver::impl::on_end(const wire::end& e) {
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
  for (const lane& l : lanes)
    if (l.held && l.held->hold != e.hold)
      return fail_refit(
          errc::protocol,
          fmt::format("END of version {} from {} {} engine-wide, but the END of {} {}: the streamers "
                      "of a group must all be atomic or none (streamer_options::atomic); nothing was "
                      "committed",
                      e.version, who(*ln), e.hold ? "is" : "is not", who(l), l.held->hold ? "is" : "is not"));
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
receiver_event receiver::impl::finish_refit() {
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
    check_complete(version);
    const auto td = clock::now();
    // A direct lane's receiver enqueued nothing on its sink's stream in this refit (end_session()
    // drained any earlier session's work): its drain would only query an idle stream, on END's
    // path (12.7 us in a timeline on an H200 VM: bench/results/2026-11-29-h200-direct-launches-beside.txt).
    // What it waits for are the streamer's writes, which END may overtake (sink::await_writes).
    for (lane& l : lanes)
      if (l.direct)
        l.sink->await_writes();
      else
        l.sink->drain();
    drain_seconds = seconds_since(td);
  } catch (const error& ex) {
    return fail_refit(ex.code(), ex.what());
  }
  if (ln->held->hold) return hold_for_commit(version, drain_seconds);
  const receiver_stats figures = figures_of(version, drain_seconds);
  const std::optional<std::uint64_t> checksum = lanes.front().held->checksum;
  if (staged()) {
    prepare(version, figures, checksum);
    answer_ends();
    return receiver_event::prepared;
  }
  commit(version, figures, checksum);
  answer_ends();
  return receiver_event::committed;
}

/// An engine-wide version's END checked out (finish_refit()): its streamer hears OK (prepared) and
/// the version waits, neither committed nor prepared for the engine, for the streamer's COMMIT,
/// which it sends once every receiver has prepared it. ABORT, a new session or version, the
/// streamer gone or the idle timeout end it as any refit in progress (abort_refit()).
receiver_event receiver::impl::hold_for_commit(std::uint64_t version, double drain_seconds) {
  voted = voted_version{version, figures_of(version, drain_seconds), lanes.front().held->checksum};
  // A group: every streamer must say COMMIT (each heard every receiver prepare it; one that did not
  // says ABORT), so that every receiver, seeing the same streamers' word, does the same.
  for (lane& l : lanes) l.awaits_commit = true;
  REFIT_DEBUG("engine-wide version {} from {} prepared: waiting for COMMIT", version, who(*ln));
  answer_ends();
  return receiver_event::ended;
}

/// COMMIT: every receiver of the streamer prepared the engine-wide version held here; it commits
/// (in place) or waits in the stage for apply_prepared() (staged).
receiver_event receiver::impl::on_commit(const wire::commit& c) {
  if (!ln->awaits_commit || !voted || voted->version != c.version) {
    if (committed_version() == c.version) {  // a COMMIT said twice (a streamer's retry): done already
      reply_ok();
      return receiver_event::refused;
    }
    reply_error(
        errc::protocol,
        voted ? fmt::format("COMMIT of version {}: version {} is the one prepared here", c.version, voted->version)
              : fmt::format("COMMIT of version {} without it prepared here (no END of an engine-wide "
                            "version, or it was aborted: see the receiver's log)",
                            c.version));
    return receiver_event::refused;
  }
  ln->awaits_commit = false;
  if (grouped()) {
    // Answered with the others' when the group's last COMMIT arrives (or with the abort's reason).
    ln->commit_held = true;
    ln->held_since = clock::now();
    for (const lane& l : lanes)
      if (l.awaits_commit) {
        REFIT_DEBUG("COMMIT of version {} from {}: waiting for the other streamers' COMMIT", c.version, who(*ln));
        return receiver_event::ended;
      }
  }
  const voted_version v = *voted;
  voted.reset();
  if (staged())
    prepare(v.version, v.figures, v.checksum);
  else
    commit(v.version, v.figures, v.checksum);
  reply_ok_everywhere();  // this COMMIT, and a group's held ones
  return staged() ? receiver_event::prepared : receiver_event::committed;
}

/// Throws errc::incomplete when version `version` lacks a registered tensor (a whole version),
/// or errc::invalid_argument / errc::incomplete when a group's shards do not fit (check_shards()).
void receiver::impl::check_complete(std::uint64_t version) const {
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
}

/// The figures of version `version`, whose every lane's END is held.
receiver_stats receiver::impl::figures_of(std::uint64_t version, double drain_seconds) const {
  receiver_stats figures{version, 0, 0, 0, seconds_since(refit_start), apply_seconds, drain_seconds, 0};
  for (const lane& l : lanes) {
    figures.tensors += l.held->tensors;
    figures.bytes += l.held->bytes;
    figures.batches += l.held->batches;
  }
  return figures;
}

/// Version `version` is what the weights hold now: committed_version() moves, and what it is a base
/// for is recorded (`generation`: the sink_generation its bytes were written by).
void receiver::impl::make_live(std::uint64_t version, const receiver_stats& figures, bool subset, bool delta,
                               std::optional<std::uint64_t> checksum, std::uint64_t generation) {
  committed.store(version, std::memory_order_release);
  has_committed.store(true, std::memory_order_release);
  is_dirty.store(false);
  // What the new version is a base for: a whole version for subsets, and for deltas when its END
  // carried a checksum (trusted: re-reading every byte would cost what a delta saves); a delta's
  // was checked (finish_refit()); a subset's is unknown (it did not carry the other tensors). A group's
  // streamers keep no base.
  if (!subset) {
    whole_generation = generation;
    is_poisoned.store(false);
  }
  known_checksum = (subset && !delta) || grouped() ? std::nullopt : checksum;
  std::lock_guard lock(mutex);
  stats_ = figures;
}

/// Commits version `version` (checked: finish_refit()) and records its figures and what it is a
/// base for; the caller answers (every lane's END, or the COMMIT).
void receiver::impl::commit(std::uint64_t version, const receiver_stats& figures,
                            std::optional<std::uint64_t> checksum) {
  make_live(version, figures, refit_subset, refit_delta, checksum, sink_generation);
  group_version.reset();
  REFIT_INFO("committed version {} from {}: {} tensors, {:.3f} GB", version,
             grouped() ? fmt::format("{} streamers", lanes.size()) : who(*ln), figures.tensors,
             static_cast<double>(figures.bytes) / 1e9);
  endings.push_back(ending{version, true, {}});
}

/// Answers every lane's held END with OK and ends the lanes' parts of the version.
void receiver::impl::answer_ends() {
  // The streamers hear it first; what is only tidying up follows (the next request waits for
  // it all the same, but a streamer's refit() returns meanwhile).
  reply_ok_everywhere();
  for (lane& l : lanes) {
    l.tracker->reset();
    if (l.sink) l.sink->end_sources();  // drained: what this version did not read is unmapped
  }
}

/// Answers OK what every lane's streamer waits on: its END or COMMIT held for the group, or (a
/// streamer alone) the message in hand.
void receiver::impl::reply_ok_everywhere() {
  lane* const current = ln;
  for (lane& l : lanes) {
    l.held.reset();
    l.commit_held = false;
    ln = &l;
    reply_ok();
  }
  ln = current;
}

/// The streamer gave up the refit on its side (ABORT).
receiver_event receiver::impl::on_abort(const wire::abort& a) {
  if (ln->failed && ln->failed->first == a.version) ln->failed.reset();  // it knows: it gave up itself
  const bool held_here = ln->awaits_commit && voted && voted->version == a.version;
  if (!held_here && (!refit_active() || ln->tracker->version() != a.version)) {
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

/// Ends the refit in progress without committing, on every lane (on_abort runs before
/// serve_one() returns). Lanes whose END waits for the group hear `code` and `why` now; lanes
/// still sending hear it at their next message of the version (the current lane's caller answers
/// the message in hand).
void receiver::impl::abort_refit(const std::string& why, errc code) noexcept {
  if (!group_version) return;
  const std::uint64_t version = *group_version;
  group_version.reset();
  // Device work that waits on a peer which will not come (nccl) must not outlive the refit. The
  // lanes' sinks are aborted together (transport::at_once): one lane's abort would otherwise wait
  // for another lane's receive from a streamer rank that died too (a trainer whose ranks all died
  // mid-refit).
  std::vector<std::function<void()>> aborts;
  voted.reset();
  for (lane& l : lanes) {
    l.took_part = l.in_refit();
    l.awaits_commit = false;
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
      if (l.held || l.commit_held) {  // its END (or its COMMIT) waits for the group
        l.held.reset();
        l.commit_held = false;
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

/// Ends the refit in progress and says why in the reply (to every lane whose END waits).
receiver_event receiver::impl::fail_refit(errc code, const std::string& message) {
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
std::optional<receiver_event> receiver::impl::fail_if_deferred() {
  if (!ln->deferred) return std::nullopt;
  const refusal r = *ln->deferred;
  return fail_refit(r.code, r.message);
}

/// Runs on_prepared / on_commit / on_abort for the refits this serve_one() call ended. Exceptions
/// are logged.
void receiver::impl::run_hooks() noexcept {
  std::vector<ending> ended;
  ended.swap(endings);
  for (const ending& e : ended) {
    if (e.prepared) {
      if (prepared_hook) guard_hook("on_prepared", e.version, [&] { prepared_hook(e.version); });
    } else if (e.committed) {
      if (commit_hook) guard_hook("on_commit", e.version, [&] { commit_hook(e.version); });
    } else if (abort_hook) {
      guard_hook("on_abort", e.version, [&] { abort_hook(e.version, e.reason); });
    }
  }
}

void receiver::impl::guard_hook(const char* name, std::uint64_t version, const std::function<void()>& call) noexcept {
  try {
    call();
  } catch (const std::exception& ex) {
    try {
      REFIT_WARN("the {} hook threw for version {} (ignored): {}", name, version, ex.what());
    } catch (...) {
    }
  } catch (...) {
    try {
      REFIT_WARN("the {} hook threw a non-standard exception for version {} (ignored)", name, version);
    } catch (...) {
    }
  }
}

/// Why `m` ends the refit in progress before it is handled (a new session or a new refit), or
/// nullopt. A HELLO with the wrong token does not: it is refused without touching the session.
std::optional<std::string> receiver::impl::supersedes(const wire::message& m) const {
  if (ln->awaits_commit && voted) {
    const std::uint64_t v = voted->version;
    if (const auto* b = std::get_if<wire::begin>(&m))
      return fmt::format("BEGIN of version {} arrived before COMMIT of engine-wide version {}", b->version, v);
    if (const auto* h = std::get_if<wire::hello>(&m); h != nullptr && same_token(h->token, token))
      return fmt::format(
          "a new session (HELLO from {}) replaced the session with {} before COMMIT of engine-wide "
          "version {}",
          h->peer.empty() ? "an unnamed peer" : h->peer, who(*ln), v);
    if (std::holds_alternative<wire::bye>(m))
      return fmt::format("the streamer {} ended the session (BYE) before COMMIT of engine-wide version {}", who(*ln),
                         v);
    return std::nullopt;
  }
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

}  // namespace refit
