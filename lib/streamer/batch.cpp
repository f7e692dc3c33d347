// refit — the batch writer: the open batch's entries and copies, packed into its ping-pong buffer
// (or launched, or sent from where the tensors are) and posted as BATCH.
#include <fmt/format.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "model/log.hpp"
#include "streamer/impl.hpp"

namespace refit {

streamer::impl::batch_writer::batch_writer(impl& s, std::uint64_t v, refit_stats& r)
    : st(s),
      version(v),
      stats(r),
      direct(s.buffers->direct()),
      by_entry(!direct && s.buffers->moves_entries()),
      in_place(by_entry && s.buffers->in_place()),
      parts(in_place && s.buffers->parts()) {
  stats.direct = direct || in_place;
  stats.control_lane =
      std::all_of(s.channels.begin(), s.channels.end(), [](const channel::req_channel& c) { return c.has_lane(); });
  entries = std::move(s.writer_spare.entries);
  ops = std::move(s.writer_spare.ops);
  entries.clear();
  ops.clear();
}

streamer::impl::batch_writer::~batch_writer() {
  entries.clear();
  ops.clear();
  st.writer_spare.entries = std::move(entries);
  st.writer_spare.ops = std::move(ops);
}

/// The planner's options for this session: direct and in-place batches are not buffer-sized,
/// but those of a parts session that gathers are (its gather memory stays within buffer_bytes).
plan_options streamer::impl::batch_writer::plan_for(const plan_options& base) const {
  plan_options p = base;
  if (direct || (in_place && !(parts && st.buffers->gathers()))) p.buffer_bytes = transport::direct_batch_bytes;
  return p;
}

/// Runs (enqueues) the copies planned so far, after the work of their producer streams.
void streamer::impl::batch_writer::run_ops() {
  if (direct)
    REFIT_DEBUG("version {}: launching {} direct copies ({} bytes), the device {}", version, ops.size(), direct_pending,
                st.copier->idle() ? "idle" : "busy");
  for (void* s : streams) st.buffers->after(s);
  // Scales first: the converting copies read their multipliers, the plain copies of the scale
  // tensors their scale_inv.
  if (!jobs.empty()) st.copier->scales(jobs, st.buffers->stream());
  if (!cops.empty()) st.copier->convert(cops, st.buffers->stream());
  if (!fused.empty()) st.copier->fused(fused, st.buffers->stream());
  if (direct && !ops.empty() && st.peer_engine()) {
    // Every destination on another GPU: the contiguous copies go by the copy engines (one
    // batched call), strided runs by the kernel, in stream order.
    peer_ops.clear();
    std::erase_if(ops, [&](const copy::op& o) {
      if (o.rows != 1) return false;
      peer_ops.push_back(o);
      return true;
    });
    st.peer_copier().run(peer_ops, st.buffers->stream());
  }
  // A direct session's launches run beside each other (each destination is written once, and
  // nothing rewrites a source before END): joined before the stream drains (end_tensors).
  if (direct && !st.peer_engine())
    st.copier->run_beside(ops, st.buffers->stream());
  else
    st.copier->run(ops, st.buffers->stream());
  fused.clear();
  jobs.clear();
  cops.clear();
  ops.clear();
  peer_ops.clear();
  streams.clear();
  if (direct) direct_launched += direct_pending;
  direct_pending = 0;
  direct_checked = 0;
}

/// Before packing into `buffer`: where the transport does not order the packing after the
/// receivers' reads of it by itself, the reply to the batch before (still posted) must be in
/// first (it comes once the receivers have read the batch before that one, from this buffer).
void streamer::impl::batch_writer::begin_pack(std::size_t buffer) {
  if (st.flight && !st.buffers->orders_reuse()) {
    const auto tw = clock::now();
    (void)st.collect();
    stats.wait_seconds += seconds_since(tw);
  }
  st.buffers->begin_pack(buffer);
}

/// Packs (or launches) the open batch, sends its BATCH and waits for the replies. `launch`
/// false: a direct session's piece of manifest, sent without launching the copies planned
/// (they go when the device idles, as ever: see note_direct).
void streamer::impl::batch_writer::flush(bool launch) {
  const std::size_t buffer = seq % st.buffers->count();
  auto tp = clock::now();
  // A batch the receiver reads only where the tensors are writes nothing into the buffer, so it
  // neither waits for the receiver's last read of it nor, when the tensors are complete, makes
  // the receiver wait for this process's GPU work: no hand-off between the two.
  const bool packs_nothing = shares && std::none_of(entries.begin(), entries.end(),
                                                    [](const wire::entry& e) { return e.bytes != 0 && e.source == 0; });
  if (!direct && !packs_nothing) begin_pack(buffer);
  if (parts) split_parts(buffer);  // its gathers run with the batch's copies
  if (launch || !direct) run_ops();
  st.launch_delta_writes();
  bool ready = false;
  if (!direct) {
    // A delta's entries (patches, and spans as bytes) all lie in the buffer, packed from its
    // start: one broadcast of the buffer's used part instead of one per entry. The receiver
    // asks for the same (apply()).
    if (by_entry && stats.delta) segments = transport::buffer_prefix(entries);
    if (by_entry) st.buffers->entries(buffer, segments);
    ready = packs_nothing && st.buffers->idle();
    if (!ready) st.buffers->end_pack(buffer);
  }
  stats.pack_seconds += seconds_since(tp);

  wire::batch b;
  b.version = version;
  b.seq = seq;
  b.buffer = static_cast<std::uint32_t>(buffer);
  b.entries = std::move(entries);
  b.sources = std::move(sources);
  b.ready = ready;
  tp = clock::now();
  if (st.flight) (void)st.collect();  // the batch before, posted
  // Its reply is heard at the next batch or before END: meanwhile the receiver checks this
  // manifest (and enqueues its reads of the buffer, or its receives) while this side reads,
  // packs and launches the next batch. One request per receiver at a time, as ever.
  st.post_alike(wire::encode(b, st.secret), fmt::format("BATCH {} of version {}", seq, version));
  stats.wait_seconds += seconds_since(tp);
  // The vectors come back for the next batch: their capacity stays (a large manifest's growth
  // anew at every batch cost page faults).
  entries = std::move(b.entries);
  sources = std::move(b.sources);
  ++stats.batches;
  seq += 1;
  entries.clear();
  segments.clear();
  sources.clear();
  shared_open = 0;
  shared_entries = 0;
  st.recycle_patches(patches);
  covered = 0;
}

/// Adds tensor `t` (its bytes [shift, shift + bytes)) whole to the open batch as an entry the
/// receiver reads where it is (transport::source::share), or returns false (it is planned into
/// the buffers). It takes no room in the buffer, so a batch of shared tensors grows to
/// shared_batch_bytes (or the planner's entry bound): fewer, larger batches, each tensor whole.
bool streamer::impl::batch_writer::share_whole(const tensor_ref& t, std::uint64_t shift, std::uint64_t bytes,
                                               planner& pl) {
  if (!shares || bytes == 0 || !(t.dev == st.buffers->where())) return false;
  const std::uint64_t bound = std::max(shared_batch_bytes, st.buffers->buffer_bytes());
  if ((shared_open != 0 && shared_open + bytes > bound) ||
      pl.open_entries() + shared_entries + 1 > pl.options().max_entries) {
    flush();
    pl = planner(pl.options());  // the planner's open batch went with it
    first_batch = seq;
  }
  const auto* from = static_cast<const std::byte*>(t.data) + shift;
  const auto at = st.buffers->share(from, bytes, sources);
  if (!at) return false;
  add_entry(t, placement{seq, plan_entry{0, shift, bytes, at->offset}});
  entries.back().source = at->source;
  shared_open += bytes;
  shared_entries += 1;
  stats.shared_bytes += bytes;
  return true;
}

/// Adds an entry whose buffer bytes are copied from `from` (host memory valid until the next
/// flush): a delta's patch, or a span of a tensor sent as bytes.
void streamer::impl::batch_writer::add_copied(wire::entry e, const std::byte* from) {
  if (e.bytes != 0)
    ops.push_back(copy::op{from, st.buffers->data(seq % st.buffers->count()) + e.buffer_offset, e.bytes});
  entries.push_back(std::move(e));
}

/// The wire entry of one placed piece of `t` (as bytes), its copies ordered after `t`'s stream.
void streamer::impl::batch_writer::add_entry(const tensor_ref& t, const placement& p) {
  if (t.stream != nullptr && (streams.empty() || streams.back() != t.stream)) streams.push_back(t.stream);
  entries.push_back(wire::entry{t.meta.name, t.meta.type, t.meta.shape, p.entry.tensor_offset, p.entry.bytes,
                                p.entry.buffer_offset, wire::entry_kind::bytes, 0});
}

/// Adds one placed piece of tensor `t` to the open batch: its entry, and the copy or segment
/// that moves its bytes (`targets`: its routes in a direct session).
///
/// With `cv`, `t.meta` is the tensor as sent (the converted dtype) and `t.data` its source,
/// of dtype cv->from: the bytes are converted on their way.
void streamer::impl::batch_writer::add(const tensor_ref& t, const placement& p,
                                       std::span<const transport::routed> targets, const copy::cvt::conversion* cv) {
  add_entry(t, p);
  if (p.entry.bytes == 0) return;
  if (cv != nullptr) {
    add_converted(t, p, targets, *cv);
    return;
  }
  const auto* from = static_cast<const std::byte*>(t.data) + p.entry.tensor_offset;
  const device where = st.buffers->where();
  if (by_entry && t.dev == where) {
    // Sent in place: rank 0 of an in-place broadcast only reads its buffer.
    segments.push_back(transport::segment{const_cast<std::byte*>(from), 0, p.entry.bytes});
    return;
  }
  if (t.dev.kind == device_kind::cuda && !(t.dev == where) && st.copier->kind() == copy::engine::kernel)
    copy::enable_peer_access(where.index, t.dev.index);
  if (direct) {
    for (const transport::routed& target : targets)
      copy::append_route(target.runs, p.entry.tensor_offset, p.entry.bytes, from, target.base, ops, pieces,
                         target.kernel_only);
    note_direct(p.entry.bytes);
    return;
  }
  ops.push_back(copy::op{from, st.buffers->data(seq % st.buffers->count()) + p.entry.buffer_offset, p.entry.bytes});
  if (by_entry) segments.push_back(transport::segment{nullptr, p.entry.buffer_offset, p.entry.bytes});
}

}  // namespace refit
