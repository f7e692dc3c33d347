// refit — a batch into the receiver's memory: its entries checked against the parameter table and
// turned into copies (or segments the sink receives straight into place), then copied, or handed
// to the batch callback.
#include <fmt/format.h>

#include "receiver/impl.hpp"

namespace refit {
namespace {

/// slot::route for entry `e`, with what a converting destination adds: an entry of another
/// dtype is a streamer that did not convert, and a block128 shard must end on a block boundary
/// unless it ends where its source does. Throws errc::apply.
void route_converted(slot& sl, const wire::entry& e) {
  const plan::destination& d = sl.dest;
  if (d.q != quant::none && e.type != d.meta.type)
    throw error(errc::apply,
                fmt::format("tensor '{}': the streamer sends it as {}, but its destination asks for {} quantised "
                            "({}): the streamer did not convert it (an older refit?)",
                            e.name, to_string(e.type), to_string(d.meta.type), to_string(d.q)));
  sl.route(e.type, e.shape);
  if (d.q == quant::none || d.q == quant::tensor || !d.slice) return;
  const auto dim = static_cast<std::size_t>(d.slice->dim);
  const auto b = static_cast<std::int64_t>(receiver_detail::slice_block(d.q, e.shape.size(), dim));
  if (b <= 1 || d.slice->length % b == 0) return;
  const std::int64_t end = d.slice->start + d.slice->length;
  if (end != e.shape[dim])
    throw error(errc::apply,
                fmt::format("tensor '{}': the destination takes [{}:{}] of dimension {} of a source of {} there; "
                            "{} scales are computed over the global tensor's {}, so a shard must end on a "
                            "block boundary (a multiple of {}) or at the source's end, not at {}",
                            e.name, d.slice->start, end, dim, e.shape[dim], to_string(d.q),
                            receiver_detail::blocks_of(d.q), b, end));
}

/// A parts session's parts that do not land in one range of their destination: their segments,
/// their bytes in the scatter memory, and the copies that unpack them (index in ops, offset of
/// their first byte in the scatter memory).
struct scatter_plan {
  std::vector<std::size_t> scattered;
  std::uint64_t bytes = 0;
  std::vector<std::pair<std::size_t, std::uint64_t>> unpack;
};

/// Entry `e` of a parts session: each destination's bytes of the entry, in table order (none where
/// it takes nothing): received straight into it where they are one range of it, else into the
/// sink's scatter memory, packed run by run as the streamer sends them, and copied into place.
/// `into(slot)`: where the destination's first byte is written (the weights, or its copy in the
/// stage); `kernel_only`: the unpacking copies go to the kernel alone (into the stage).
template <class Into>
void add_parts(std::vector<slot>& slots, const wire::entry& e, Into&& into, bool kernel_only,
               std::vector<copy::op>& ops, std::vector<transport::segment>& segments, std::vector<plan::run>& pieces,
               scatter_plan& scatter) {
  for (slot& sl : slots) {
    pieces.clear();
    for (const plan::run& r : sl.runs()) plan::clip(r, e.tensor_offset, e.tensor_offset + e.bytes, pieces);
    if (pieces.empty()) continue;
    std::byte* const base = into(sl);
    const std::uint64_t n = plan::bytes_of(pieces);
    if (const auto at = plan::contiguous(pieces, false)) {
      segments.push_back(transport::segment{base + *at, 0, n});
      continue;
    }
    scatter.scattered.push_back(segments.size());
    segments.push_back(transport::segment{nullptr, scatter.bytes, n});
    for (const plan::run& r : pieces) {
      scatter.unpack.emplace_back(ops.size(), scatter.bytes);
      ops.emplace_back(nullptr, base + r.dst, r.width, r.rows, r.width, r.dst_pitch);
      ops.back().kernel_only = kernel_only || sl.kernel_only;
      scatter.bytes += r.width * r.rows;
    }
  }
}

/// The parts received apart: their segments, and the copies that unpack them (the only copies of a
/// parts session), point into the sink's scatter memory, asked for once its size is known.
void place_scattered(transport::sink& sink, const wire::batch& b, const scatter_plan& scatter,
                     std::vector<copy::op>& ops, std::vector<transport::segment>& segments) {
  std::byte* memory = sink.scatter(b.buffer, scatter.bytes);
  if (memory == nullptr)
    throw error(errc::internal, fmt::format("BATCH {}: a parts session without scatter memory", b.seq));
  for (const std::size_t s : scatter.scattered)
    segments[s] = transport::segment{memory + segments[s].offset, 0, segments[s].bytes};
  for (const auto& [op, at] : scatter.unpack) ops[op].src = memory + at;
}

}  // namespace

/// Builds the copies of a batch into the parameter table, checking every entry against it
/// (all of them before anything is copied: a refused batch writes nothing). With `segments` (a
/// sink that moves entries one by one), an entry that lands whole in one dense destination on the
/// sink's device is received straight into it (a segment, no copy); the others are staged in the
/// buffer (a segment there, and copies along their routes). With `check_only` (a direct session:
/// the streamer wrote the bytes) nothing is built, the entries are only checked.
std::vector<copy::op> receiver::impl::table_ops(const wire::batch& b, const std::byte* base,
                                                std::vector<transport::segment>* segments, bool check_only) {
  std::vector<copy::op> ops;
  ops.reserve(b.entries.size());
  const device_kind where = ln->sink->where().kind;
  std::vector<plan::run> pieces;
  scatter_plan scatter;
  for (std::size_t k = 0; k < b.entries.size(); ++k) {
    const wire::entry& e = b.entries[k];
    std::vector<slot>& slots = check_entry(b, k, where);
    if (e.bytes == 0) continue;
    if (check_only) {
      // Written into the stage by the streamer: apply_prepared() copies these destinations.
      if (ln->into_stage)
        for (slot& sl : slots) (void)stage_for(sl);
      continue;
    }
    if (segments != nullptr && ln->parts)
      add_parts(
          slots, e, [this](slot& sl) { return write_target(sl); }, staged(), ops, *segments, pieces, scatter);
    else
      add_staged(slots, e, base, where, ops, segments, pieces);
  }
  if (scatter.bytes != 0) place_scattered(*ln->sink, b, scatter, ops, *segments);
  return ops;
}

/// The destinations of entry `k` of batch `b`, routed for it (route_converted()) and checked to be
/// in the memory (`where`) the sink applies into. Throws errc::apply.
std::vector<slot>& receiver::impl::check_entry(const wire::batch& b, std::size_t k, device_kind where) {
  const wire::entry& e = b.entries[k];
  std::vector<slot>* slots = table.find(e.name);
  if (slots == nullptr)
    throw error(errc::apply, fmt::format("tensor '{}' (BATCH {} entry {}) is not in this receiver's parameter table",
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
  return *slots;
}

/// Entry `e` (in the buffer at `base`) of a session that is not a parts session: received straight
/// into its destination when it lands whole in one dense destination on the sink's device (with
/// `segments`), else staged in the buffer (a segment there, with `segments`) and copied along each
/// destination's route. A staged receiver copies into each destination's copy in the stage instead
/// (stage_for()), never into the weights.
void receiver::impl::add_staged(std::vector<slot>& slots, const wire::entry& e, const std::byte* base,
                                device_kind where, std::vector<copy::op>& ops,
                                std::vector<transport::segment>* segments, std::vector<plan::run>& pieces) {
  slot& only = slots.front();
  // Received straight into the weights, or into a device stage (never into page-locked host memory).
  if (segments != nullptr && slots.size() == 1 && plan::is_plain(only.dest) && only.dest.dev == ln->sink->where() &&
      (!staged() || options.stage == stage_kind::device)) {
    segments->push_back(transport::segment{write_target(only) + e.tensor_offset, 0, e.bytes});
    return;
  }
  // Not from a streamer's allocation the copy engines read slowly, nor into one they write slowly, nor
  // into the stage (receiver_options::stage: one allocation as large as the version, not measured
  // with them): the kernel alone.
  const bool kernel_only = staged() || (e.source != 0 && ln->sink->source_kernel_only(e.source));
  for (slot& sl : slots) {
    const bool copies = copy::append_route(sl.runs(), e.tensor_offset, e.bytes, entry_data(e, base), write_target(sl),
                                           ops, pieces, kernel_only || sl.kernel_only);
    if (copies && where == device_kind::cuda && !(sl.dest.dev == ln->sink->where()) &&
        ln->copier->kind() == copy::engine::kernel)
      copy::enable_peer_access(ln->sink->where().index, sl.dest.dev.index);
  }
  if (segments != nullptr) segments->push_back(transport::segment{nullptr, e.buffer_offset, e.bytes});
}

/// The first byte of entry `e` of a batch in the buffer at `base`: there, or in the streamer's
/// memory the sink mapped (wire::entry::source). Throws errc::protocol for a range outside it.
const std::byte* receiver::impl::entry_data(const wire::entry& e, const std::byte* base) const {
  return e.source == 0 ? base + e.buffer_offset : ln->sink->source_data(e.source, e.buffer_offset, e.bytes);
}

/// Copies (or enqueues the copies of) one batch, or runs the callback over it.
void receiver::impl::apply(const wire::batch& b, std::vector<copy::op>& ops,
                           std::vector<transport::segment>& segments) {
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
  if (refit_delta && staged()) {
    stage_delta(b);  // its entries into the stage, checked there: the weights wait for apply_prepared()
  } else {
    if (refit_delta) check_patches(b);    // a corrupt patch is refused before its batch writes anything
    if (!staged()) is_dirty.store(true);  // from here on the weights may be partly overwritten
    if (callback) {
      run_callback(b);
    } else if (refit_delta) {
      apply_delta(b);
    } else {
      ln->copier->run(ops, ln->sink->stream());
    }
  }
  ln->sink->end_read(b.buffer);
  apply_seconds += seconds_since(t0);
}

/// Hands batch `b` to the batch callback, as views of its entries; what the callback throws is
/// a refit::error (errc::apply unless it threw one).
void receiver::impl::run_callback(const wire::batch& b) {
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
}

}  // namespace refit
