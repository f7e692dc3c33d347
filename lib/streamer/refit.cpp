// refit — one refit, top to bottom: HELLO once per session, BEGIN (the source read ahead while
// its replies travel), then for each tensor the source yields, the planner places it into the
// open batch; when a batch closes it is packed into its ping-pong buffer with one copy call,
// published, and sent as BATCH; the reply means the receiver has taken it (GPU: enqueued its
// reads; CPU: finished the batch before it), so packing the next batch into the other buffer
// overlaps the receiver applying this one. END commits.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <optional>
#include <utility>
#include <vector>

#include "model/log.hpp"
#include "streamer/impl.hpp"

namespace refit {

refit_stats streamer::impl::run(std::uint64_t version, tensor_source& source, refit_scope scope) {
  const auto t0 = clock::now();
  try_rejoins();
  check_receivers_left();
  dropped.clear();
  version_in_progress = version;
  struct ended {
    std::optional<std::uint64_t>& v;
    ~ended() { v.reset(); }
  } in_progress{version_in_progress};
  ensure_session();
  refit_stats stats;
  stats.version = version;
  read_ahead ahead(source);
  const sending how = begin_refit(version, scope, stats, ahead);
  // From here until END's reply the base is being rewritten: any failure leaves it unusable.
  std::uint64_t checksum = how == sending::delta ? base->checksum() : 0;
  if (base) base->invalidate();
  bool keep = base != nullptr && how != sending::subset;
  if (keep && how == sending::whole) base->begin_whole();  // repacks it if tensors changed size

  receivers_failed = false;
  try {
    send_tensors(version, ahead, stats, how, &checksum, keep);
  } catch (const error& e) {
    abort_everywhere(version, e.code(), e.what());
    throw;
  } catch (const std::exception& e) {
    abort_everywhere(version, errc::invalid_argument, e.what());
    throw;
  } catch (...) {
    abort_everywhere(version, errc::invalid_argument, "a non-standard exception");
    throw;
  }

  wire::end e{version, stats.tensors, stats.bytes, stats.batches, std::nullopt, options.atomic};
  if (keep) e.checksum = checksum;
  const auto tw = clock::now();
  try {
    if (options.atomic) {
      end_engine_wide(e, stats);
    } else {
      request(e, fmt::format("END of version {}", version));
    }
  } catch (...) {
    // A direct session's last copies may still read the source (END left while they ran): they
    // are complete before refit() throws, as they are when it returns.
    if (buffers->direct()) drain_quietly();
    throw;
  }
  buffers->refit_committed();
  stats.wait_seconds += seconds_since(tw);
  const auto td = clock::now();
  buffers->drain();
  REFIT_DEBUG("version {}: drained in {:.0f} us", version, seconds_since(td) * 1e6);
  if (keep) base->commit(version, checksum);
  if (base) stats.base_bytes = base->bytes();
  stats.seconds = seconds_since(t0);
  stats.dropped = std::move(dropped);
  forget_rejoined();
  REFIT_INFO("version {} committed: {} tensors, {:.3f} GB in {} batches, {:.2f} ms", version, stats.tensors,
             static_cast<double>(stats.bytes) / 1e9, stats.batches, stats.seconds * 1e3);
  return stats;
}

/// END of an engine-wide version (streamer_options::atomic): every receiver prepares it, then hears
/// COMMIT. When any receiver refuses END or stays silent, the others, which may have prepared it,
/// are told ABORT before the error is rethrown: the version reaches none of them.
void streamer::impl::end_engine_wide(const wire::end& e, refit_stats& stats) {
  try {
    request(e, fmt::format("END of engine-wide version {}", e.version));
  } catch (const error& ex) {
    tell_abort(e.version, ex.code(),
               fmt::format("another receiver of the engine-wide version failed it: {}", ex.what()));
    throw;
  }
  // Every COMMIT is sent before any reply is awaited (post, then collect): the window in which
  // this process's death leaves some receivers committed and others not is as short as it can be.
  const auto tc = clock::now();
  try {
    request(wire::commit{e.version}, fmt::format("COMMIT of version {}", e.version));
  } catch (const error& ex) {
    throw error(ex.code(), fmt::format("{}\n(every receiver had prepared version {}: those not named committed it, "
                                       "those named did not or cannot tell)",
                                       ex.what(), e.version));
  }
  stats.commit_seconds = seconds_since(tc);
}

/// Says BEGIN, as a delta when the base allows it; a receiver that refuses the delta
/// (errc::needs_whole: it does not hold the base) gets the whole version instead.
streamer::impl::sending streamer::impl::begin_refit(std::uint64_t version, refit_scope scope, refit_stats& stats,
                                                    read_ahead& ahead) {
  sending how = scope == refit_scope::subset ? sending::subset : sending::whole;
  if (base && scope == refit_scope::subset) base->invalidate();  // the receivers' version is no base of ours
  if (base && how == sending::whole && base->version()) how = sending::delta;
  const auto tw = clock::now();
  const double reading = stats.source_seconds;
  try {
    say_begin(version, how, ahead, stats);
  } catch (const error& e) {
    if (how != sending::delta || e.code() != errc::needs_whole) throw;
    REFIT_INFO("{}; sending version {} whole", e.what(), version);
    base->invalidate();
    how = sending::whole;
    stats.whole_after_refusal = true;
    // A transport whose session dies on any refusal (nccl: the communicator is aborted, and
    // receivers that took the delta's BEGIN drop theirs at the next HELLO) needs a new one.
    ensure_session();
    say_begin(version, how, ahead, stats);
  }
  stats.wait_seconds += seconds_since(tw) - (stats.source_seconds - reading);
  stats.subset = how != sending::whole;
  stats.delta = how == sending::delta;
  if (stats.delta) stats.base = *base->version();
  return how;
}

/// Says BEGIN for `how` (a delta names the base); a receiver without a session makes it say HELLO
/// again, once. `ahead` reads the source while the replies are on their way.
void streamer::impl::say_begin(std::uint64_t version, sending how, read_ahead& ahead, refit_stats& stats) {
  wire::begin b{version, how != sending::whole, std::nullopt};
  if (how == sending::delta) b.base = base->version();
  const std::string what = fmt::format("BEGIN of {}version {}", how == sending::delta ? "delta " : "", version);
  // No more ahead than the buffers hold: a source that gathers each tensor (an all-gather) then
  // holds no more than a refit in flight would.
  const std::uint64_t bound = options.buffer_count * options.buffer_bytes;
  // The GPU may be time-sliced with a receiver's process (colocated), whose work ran last: the
  // switch to this process's context (~140 us on the H100 VMs) then happens while BEGIN's replies
  // travel, instead of holding up the first copies. Not where the receivers read the tensors
  // where they are (share_tensors): this side then launches nothing, and a switch here would only
  // delay the receiver's first reads by a switch back. Primed once BEGIN is posted: the launch
  // itself (26-46 us on an H200 VM) overlaps the round trip too.
  const bool prime = !receivers_read_in_place(how);
  const auto read = [&] {
    if (prime) copier->prime(buffers->stream());
    stats.source_seconds += ahead.fill(
        [&] {
          return std::all_of(channels.begin(), channels.end(), [](channel::req_channel& c) { return c.reply_ready(); });
        },
        bound);
  };
  try {
    request(b, what, read);
  } catch (const error& e) {
    // A receiver that restarted since our HELLO has no session with us (or one that must
    // lay the session out anew), or takes this connection for a stranger (it was rebuilt since
    // HELLO, so the receiver sees another peer): start one, once.
    if (e.code() != errc::peer && e.code() != errc::unauthorized) throw;
    REFIT_INFO("{}; saying HELLO again", e.what());
    drop_session();
    ensure_session();
    request(b, what, read);
  }
}

/// Whether a refit sent `how` lets the receivers read the tensors where they are (share_tensors):
/// a staged session of a transport that neither writes the receivers' weights itself (direct)
/// nor moves entries one by one (nccl); never a delta, whose entries travel in the buffers.
bool streamer::impl::receivers_read_in_place(sending how) const {
  return options.share_tensors && how != sending::delta && !buffers->direct() && !buffers->moves_entries();
}

/// Everything between BEGIN and END: plans, packs and sends the batches of `source`. A delta
/// sends patches against the base (and brings it up to date); with `keep` a whole version is
/// copied into the base (false when it outgrew its bound). `checksum`: the version checksum,
/// updated as tensors pass (with a base).
void streamer::impl::send_tensors(std::uint64_t version, tensor_source& source, refit_stats& stats, sending how,
                                  std::uint64_t* checksum, bool& keep) {
  batch_writer w(*this, version, stats);
  w.shares = receivers_read_in_place(how);
  buffers->forget_shared();
  plan_options po = w.plan_for(plan);
  if (how == sending::delta) po.keep_whole = true;  // a patch must never be split (delta::span_bytes)
  planner pl(po);
  delta_scratch& scratch = delta_buffers;
  forget_failed_delta(how, scratch);
  sent_names.clear();
  order.begin(how != sending::subset);
  // The last refit's copies are complete (END drained them), or were abandoned: what this one
  // enqueues comes after them all.
  copier->join(buffers->stream());
  copier->reset_scratch();
  for (;;) {
    auto ts = clock::now();
    std::optional<tensor_ref> t = source.next();
    stats.source_seconds += seconds_since(ts);
    if (!t) break;
    send_tensor(w, pl, *t, how, scratch, checksum, keep);
  }
  order.end();
  if (how == sending::delta) finish_delta(w, pl, scratch);
  end_tensors(w, how, checksum);
}

/// One tensor of the source: checked, taken as its whole when it is a shard, then sent converted,
/// as a delta's patches, or as it is.
void streamer::impl::send_tensor(batch_writer& w, planner& pl, tensor_ref& t, sending how, delta_scratch& scratch,
                                 std::uint64_t* checksum, bool& keep) {
  const std::uint64_t bytes = t.meta.nbytes();
  check_tensor(t, bytes);
  bool twice = false;
  auto* slot = order.take(t.meta.name, sent_names, twice);
  if (twice)
    throw error(errc::invalid_argument,
                fmt::format("the source yielded tensor '{}' twice in version {}", t.meta.name, w.version));
  w.stats.tensor_bytes += bytes;
  std::optional<shard_place> part;
  const std::uint64_t shift = to_whole(t, bytes, how, part);
  route_memo* memo = slot != nullptr ? &slot->data : nullptr;
  if (const wire::conversion* c = conversion_for(t, memo)) {
    if (how == sending::delta)
      throw error(errc::invalid_argument,
                  fmt::format("tensor {}: the receivers ask for it converted, and a delta version patches the "
                              "bytes the trainer holds, not converted ones: send versions whole to receivers "
                              "that convert (streamer_options::delta off)",
                              describe(t.meta)));
    send_converted(w, pl, t, *c, w.stats, part ? &*part : nullptr);
    keep = false;  // the base holds what was sent as it was; a converted tensor is not there
    return;
  }
  // A direct session writes each of the receiver's destinations of this tensor along its route
  // (a view, a slice: plan::route); a misfit throws before anything is written.
  std::span<const transport::routed> targets;
  std::vector<transport::routed> found;
  if (w.direct) {
    if (memo != nullptr && memo->session == session_number && memo->type == t.meta.type &&
        std::ranges::equal(memo->shape, t.meta.shape)) {
      targets = memo->routes;
    } else {
      found = buffers->routes(t.meta);
      if (memo != nullptr) {
        memo->session = session_number;
        memo->type = t.meta.type;
        memo->shape = t.meta.shape;
        memo->routes = std::move(found);
        targets = memo->routes;
      } else {
        targets = found;
      }
    }
  }
  if (w.in_place) check_in_place(t, bytes, w.version);
  if (how == sending::delta) {
    send_delta(w, pl, w.planned++, t, scratch, *checksum);
    return;
  }
  send_as_is(w, pl, t, bytes, shift, targets, checksum, keep);
}

/// A tensor sent as it is (its bytes [shift, shift + bytes) of `t`, the whole): read where it is,
/// or placed into the batches; with `keep`, copied into the delta base too.
void streamer::impl::send_as_is(batch_writer& w, planner& pl, const tensor_ref& t, std::uint64_t bytes,
                                std::uint64_t shift, std::span<const transport::routed> targets,
                                std::uint64_t* checksum, bool& keep) {
  if (!w.share_whole(t, shift, bytes, pl))
    for (placement p : pl.add(w.planned++, bytes)) {
      while (w.first_batch + p.batch > w.seq) w.flush();
      p.entry.tensor_offset += shift;
      w.add(t, p, targets);
    }
  w.stats.tensors += 1;
  w.stats.bytes += bytes;
  if (keep) keep = keep_in_base(t, bytes, *checksum, w.stats);
  // A direct session's manifest goes in pieces, each sent once the receiver has answered the
  // one before: its checks of one piece overlap this side's work on the next, and only the
  // last piece's are left when the source ends.
  const std::size_t piece =
      std::clamp<std::size_t>(w.stats.tensors / 8, direct_manifest_entries, direct_manifest_entries_max);
  if (w.direct && w.entries.size() >= piece && replies_ready()) {
    w.flush(false);
    pl = planner(pl.options());  // the planner's open batch went with it
    w.first_batch = w.seq;
  }
}

/// After the source's last tensor: the last batch sent (or a direct session's copies launched),
/// and every write complete and every reply heard before END.
void streamer::impl::end_tensors(batch_writer& w, sending how, std::uint64_t* checksum) {
  if (!w.entries.empty())
    w.flush();
  else if (w.direct)
    w.launch_direct();  // the last piece of the manifest went without launching its copies
  take_device_terms(how, checksum);

  // Direct writes must be complete before the receivers commit. Where the transport lets them wait
  // for the writes themselves (cuda_ipc), END leaves right after the last launch and its round
  // trip overlaps the copies queued; else (and for the copy engines, whose queue this side does
  // not pace) this side drains first.
  if (w.direct) {
    const auto tp = clock::now();
    copier->join(buffers->stream());
    if (peer_engine() || !buffers->hand_over_writes()) {
      wake_before_end();
      buffers->drain();
    }
    w.stats.pack_seconds += seconds_since(tp);
  }
  if (flight) {
    const auto tw = clock::now();
    (void)collect();  // the last batch, posted
    w.stats.wait_seconds += seconds_since(tw);
  }
}

std::optional<tensor_ref> streamer::impl::read_ahead::next() {
  if (next_ < ahead_.size()) return std::move(ahead_[next_++]);  // read once: its name and shape move on
  if (failed_) std::rethrow_exception(std::exchange(failed_, nullptr));
  if (ended_) return std::nullopt;
  return inner_.next();
}

/// Reads ahead until `arrived()` (asked between tensors), the source ends or the tensors read
/// ahead hold `max_bytes`; returns the seconds spent in the source.
double streamer::impl::read_ahead::fill(const std::function<bool()>& arrived, std::uint64_t max_bytes) {
  const auto t0 = clock::now();
  while (!ended_ && !failed_ && ahead_.size() < max_ahead && bytes_ < max_bytes && !arrived()) {
    try {
      std::optional<tensor_ref> t = inner_.next();
      if (t) {
        bytes_ += t->meta.nbytes();
        ahead_.push_back(std::move(*t));
      } else {
        ended_ = true;
      }
    } catch (...) {
      failed_ = std::current_exception();
    }
  }
  return seconds_since(t0);
}

}  // namespace refit
