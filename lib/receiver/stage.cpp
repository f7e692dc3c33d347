// refit — staged versions (receiver_options::stage): every batch lands in a copy of the parameter
// table's bytes that the receiver owns, the weights stay untouched while the engine reads them, END
// *prepares* the version, and apply_prepared() copies the stage into the weights and commits.
//
// Why a stage: an in-place receiver writes each batch into the live weights as it arrives, so an
// engine must stop generating for the whole transfer (seconds over a network) or serve requests
// from half-old, half-new weights. With a stage the engine's pause is one local copy, taken when
// the engine chooses (between two of its steps).
//
// The stage mirrors each destination from its first byte to its last (slot::stage_at), so the
// table's routes write it unchanged, at the same offsets; apply_prepared() copies back only each
// destination's footprint (plan::footprint: the bytes its view owns), so bytes between a strided
// view's rows, which another destination or the engine may own, are never written.
#include <fmt/format.h>

#include "receiver/impl.hpp"

namespace refit {
namespace {

constexpr std::uint64_t stage_align = 64;
/// A host apply's unit of work, and the size below which one thread copies it all.
constexpr std::uint64_t piece_bytes = 8ull << 20;
constexpr std::uint64_t parallel_bytes = 32ull << 20;

std::uint64_t round_up(std::uint64_t n) { return (n + stage_align - 1) / stage_align * stage_align; }

/// Staged delta entries `log_entries` (their bytes at `log`) as the host patcher takes them, into
/// `dests` and `out` (cleared first): for the batch's terms (`all` false) each with its tensor's
/// first destination, where the old values are read, and its checksum weight; for the apply (`all`)
/// with every destination its values go to, and no weight (the terms were taken).
void host_entries_of(std::span<const staged_entry> log_entries, const std::byte* log, bool all,
                     std::vector<std::byte*>& dests, std::vector<delta::host_entry>& out) {
  dests.clear();
  out.clear();
  for (const staged_entry& s : log_entries)
    for (const slot& sl : *s.slots) {
      dests.push_back(static_cast<std::byte*>(sl.dest.data));
      if (!all) break;
    }
  std::size_t d = 0;
  for (const staged_entry& s : log_entries) {
    const std::size_t n = all ? s.slots->size() : 1;
    out.push_back(delta::host_entry{log + s.at, s.bytes, s.patch, s.span, s.off, s.total, s.item,
                                    all ? 0 : delta::name_weight(s.name),
                                    std::span<std::byte* const>(dests).subspan(d, n), s.name});
    d += n;
  }
}

}  // namespace

/// Refuses BEGIN `b` when the stage cannot take its version (stage_refusal()); nullopt otherwise,
/// the stage then laid out for the table as it is. Called for every BEGIN: taking `stage_mutex`
/// orders it after an apply_prepared() that just ended (the bases it recorded, the stage it read).
std::optional<receiver_event> receiver::impl::check_stage(const wire::begin& b) {
  if (!staged()) return std::nullopt;
  std::optional<std::string> why;
  errc code = errc::invalid_argument;
  {
    std::lock_guard lock(stage_mutex);
    if (ready) {
      code = errc::apply;
      why = fmt::format(
          "version {} is prepared and waits for apply_prepared(): the engine must apply it before this "
          "receiver stages version {}; nothing was written",
          ready->version, b.version);
    } else {
      why = stage_refusal(b);
    }
  }
  if (!why) return std::nullopt;
  REFIT_INFO("refused BEGIN of version {} from {}: {}", b.version, who(*ln), *why);
  reply_error(code, *why);
  return receiver_event::refused;
}

/// Why the stage cannot take version `b` over this session (a sink of another kind, more bytes
/// than receiver_options::stage_bytes), or nullopt once it is laid out and allocated for it.
/// Holds `stage_mutex`.
std::optional<std::string> receiver::impl::stage_refusal(const wire::begin& b) {
  if (callback)  // on_batch refuses a staged receiver; kept for a callback set before a bug
    return fmt::format("version {}: a staged receiver applies into a parameter table, not a callback", b.version);
  if (auto misfit = stage_misfit(b.version)) return misfit;
  if (ln->into_stage && (stage_generation != sink_generation || !device_stage || device_stage->bytes() < stage_need))
    // Never reached: a new table renews the session (check_begin), and only allocate_stage() frees the
    // stage the streamer was given at HELLO. Refused rather than moved under the streamer's writes.
    return fmt::format(
        "version {}: the stage offered to {} at HELLO is no longer the one laid out; nothing was "
        "written: the streamer must say HELLO again",
        b.version, who(*ln));
  return fit_stage(fmt::format("version {}", b.version));
}

/// Lays the stage out for the table as it is (if it changed) and allocates it; why it cannot be
/// (more bytes than receiver_options::stage_bytes, an allocation that fails), saying it of `what`
/// (the version it is for), or nullopt. Holds `stage_mutex`.
std::optional<std::string> receiver::impl::fit_stage(std::string_view what) {
  if (stage_generation != sink_generation) lay_out_stage();
  if (options.stage_bytes != 0 && stage_need > options.stage_bytes)
    return fmt::format(
        "{} needs a stage of {} bytes (a copy of the {} registered destinations' bytes), more than "
        "receiver_options::stage_bytes ({} bytes); nothing was written: raise stage_bytes (0: what the "
        "version needs) or register fewer parameters",
        what, stage_need, table.size(), options.stage_bytes);
  return allocate_stage(what);
}

/// Why this session cannot bring version `version` into the stage, or nullopt: a host stage takes
/// host bytes through buffers (host_shm) into a host table, or CUDA bytes through buffers (cuda_ipc
/// staged, nccl) into a table on one GPU (the stage then in page-locked host memory); a device stage
/// takes the latter only.
std::optional<std::string> receiver::impl::stage_misfit(std::uint64_t version) const {
  const device where = ln->sink->where();
  const bool fits = options.stage == stage_kind::device ? where.kind == device_kind::cuda : true;
  if (!fits || ((ln->direct || ln->in_place || ln->parts) && !ln->into_stage))
    return fmt::format(
        "version {}: receiver_options::stage = {} takes sessions that bring their bytes through buffers ({}), not "
        "this {} session{}; use stage = {} for it",
        version, to_string(options.stage),
        options.stage == stage_kind::device ? "cuda_ipc, nccl" : "host_shm, cuda_ipc, nccl", ln->sink->name(),
        ln->direct     ? " (direct writes)"
        : ln->in_place ? " (in place)"
                       : "",
        options.stage == stage_kind::device ? "host or none" : "none");
  for (const auto& [name, slots] : table)
    for (const slot& sl : slots)
      if (sl.dest.dev.kind != where.kind || (where.kind == device_kind::cuda && sl.dest.dev.index != where.index))
        return fmt::format(
            "version {}: this {} session applies into {}, but tensor '{}' is registered on {}: a staged receiver "
            "takes a parameter table all there",
            version, ln->sink->name(),
            where.kind == device_kind::cuda ? fmt::format("cuda:{}", where.index) : "the host", printable(name),
            sl.dest.dev.kind == device_kind::cuda ? fmt::format("cuda:{}", sl.dest.dev.index) : "the host");
  return std::nullopt;
}

/// The destinations a device stage offers a streamer at HELLO (cuda_ipc direct writes, nccl in place): each
/// registered destination's copy in the stage (slot::stage_at: same views, from its first byte), in
/// the table's order, the stage laid out and allocated for the table as it is. Empty (the session
/// then brings its bytes through buffers) for a host stage, a callback, a table not all on the
/// sink's GPU, a stage larger than receiver_options::stage_bytes or that cannot be allocated, or a
/// prepared version that waits for apply_prepared() in a stage that would have to be laid out anew.
/// The stage keeps its place for the session: a new table renews the session (check_begin()).
std::vector<plan::destination> receiver::impl::stage_offer() {
  std::vector<plan::destination> dests;
  if (options.stage != stage_kind::device || callback || table.empty() || ln->sink->where().kind != device_kind::cuda ||
      stage_misfit(0))
    return dests;
  std::lock_guard lock(stage_mutex);
  const bool placed = stage_generation == sink_generation && device_stage && device_stage->bytes() >= stage_need &&
                      device_stage->device() == ln->sink->where().index;
  if (ready && !placed) {  // the prepared version's bytes stay where they are
    REFIT_INFO("no stage to offer {}: version {} waits in it for apply_prepared(), laid out for the table before",
               who(*ln), ready->version);
    return dests;
  }
  if (!ready)
    if (const auto why = fit_stage("the next version")) {
      REFIT_INFO("no stage to offer {} (its batches come through buffers): {}", who(*ln), *why);
      return dests;
    }
  dests.reserve(table.size());
  for (const auto& [name, slots] : table)
    for (const slot& sl : slots) {
      plan::destination d = sl.dest;
      d.data = stage_base() + sl.stage_at;
      d.alloc = d.data;  // its copy's bytes, and no others (the copies lie side by side)
      d.alloc_bytes = plan::check_view(sl.dest).bytes;
      dests.push_back(std::move(d));
    }
  return dests;
}

/// Makes the stage hold at least stage_need bytes (kept, grown when the table grows); why not (said of
/// `what`), or nullopt.
std::optional<std::string> receiver::impl::allocate_stage(std::string_view what) {
  // A device stage, or a host stage of a table on a GPU: page-locked host memory the copy kernel
  // reaches (a CUDA area either way, with its own stream).
  stage_cuda = ln->sink->where().kind == device_kind::cuda;
  if (stage_cuda) {
    const bool pinned = options.stage == stage_kind::host;
    const int dev = ln->sink->where().index;
    if (device_stage) {
      // The apply before may still be copying out of the stage on the engine's stream.
      try {
        device_stage->wait_readers(options.idle_timeout);
      } catch (const error& e) {
        return fmt::format("{}: {}; nothing was written", what, e.what());
      }
    }
    if (device_stage && device_stage->bytes() >= stage_need && device_stage->device() == dev) return std::nullopt;
    retire_stage();
    try {
      device_stage = std::make_unique<copy::device_area>(std::max<std::uint64_t>(stage_need, 1), dev, pinned);
      if (!stage_copier) stage_copier = copy::make_copier(copy::engine::kernel, dev, options.idle_timeout);
    } catch (const error& e) {
      device_stage.reset();
      return fmt::format("{}: {}; nothing was written", what, e.what());
    }
    return std::nullopt;
  }
  if (stage_capacity >= stage_need) return std::nullopt;
  stage.reset();
  stage_counted.reset();
  stage_capacity = 0;
  try {
    stage = std::make_unique_for_overwrite<std::byte[]>(stage_need);
    stage_counted = ::refit::memory::charge(::refit::memory::kind::host, stage_need);
  } catch (const std::bad_alloc&) {
    return fmt::format("{}: the stage of {} bytes could not be allocated (out of host memory)", what, stage_need);
  }
  stage_capacity = stage_need;
  return std::nullopt;
}

/// Lets go of the device stage: freed, or kept (retired_stages) while a lane's streamer was offered it
/// for direct writes and may still map it: freeing memory another process maps through CUDA IPC is
/// undefined (a group's other streamers unmap only at their own next HELLO).
void receiver::impl::retire_stage() {
  if (!device_stage) return;
  const copy::device_area* const area = device_stage.get();
  if (std::any_of(lanes.begin(), lanes.end(), [&](const lane& l) { return l.offered_stage == area; }))
    retired_stages.push_back(std::move(device_stage));
  device_stage.reset();
}

/// Frees the retired stages no lane's session was offered any more.
void receiver::impl::release_retired_stages() noexcept {
  std::erase_if(retired_stages, [&](const std::unique_ptr<copy::device_area>& area) {
    return std::none_of(lanes.begin(), lanes.end(), [&](const lane& l) { return l.offered_stage == area.get(); });
  });
}

/// The stage's first byte: host memory, or the CUDA area's (device memory, or page-locked host memory).
std::byte* receiver::impl::stage_base() const noexcept {
  return stage_cuda ? (device_stage ? device_stage->data() : nullptr) : stage.get();
}

/// Gives every destination of the table its place in the stage (slot::stage_at): its bytes from
/// its first byte (plan::check_view), one after the other, each 64-byte aligned.
void receiver::impl::lay_out_stage() {
  std::uint64_t at = 0;
  for (auto& [name, slots] : table)
    for (slot& sl : slots) {
      sl.stage_at = at;
      sl.staged_in = 0;
      at += round_up(plan::check_view(sl.dest).bytes);
    }
  stage_need = at;
  stage_generation = sink_generation;
}

/// The stage's bytes as allocated.
std::uint64_t receiver::impl::stage_size() const noexcept {
  return stage_cuda ? (device_stage ? device_stage->bytes() : 0) : stage_capacity;
}

/// A staged delta's batch: its entries (patches' records, spans sent as bytes) copied from the
/// buffer into the stage, one after the other (a delta's stage is a log, not the destinations'
/// copies), then checked there, where no peer can change them, and their checksum terms taken
/// against the weights' bytes (the base: the weights stay untouched until apply_prepared(), which
/// writes the logged entries alone). So a delta's stage holds its wire bytes, and the engine's
/// pause is the patch apply, not a copy of every tensor the delta touched.
void receiver::impl::stage_delta(const wire::batch& b) {
  const std::byte* base = ln->sink->data(b.buffer);
  std::byte* log = stage_base();
  const std::size_t first = staged_log.size();
  std::vector<copy::op> ops;
  for (const wire::entry& e : b.entries) {
    if (e.bytes == 0) continue;
    const std::uint64_t at = (log_used + 15) / 16 * 16;  // a patch's indices are read as 4-byte words
    if (at + e.bytes > stage_size())
      throw error(errc::apply,
                  fmt::format("delta version {}: its entries need more than the stage's {} bytes (at '{}'); nothing "
                              "was written: send a whole version",
                              b.version, stage_size(), printable(e.name)));
    std::vector<slot>& slots = *table.find(e.name);
    staged_log.push_back(staged_entry{at, e.bytes, e.kind == wire::entry_kind::patch, e.span, e.tensor_offset,
                                      *checked_nbytes(e.type, e.shape), itemsize(e.type), &slots, e.name});
    ops.emplace_back(base + e.buffer_offset, log + at, e.bytes);
    ops.back().kernel_only = true;  // into the stage: the kernel alone (see add_staged)
    log_used = at + e.bytes;
  }
  const std::span<const staged_entry> batch = std::span(staged_log).subspan(first);
#if REFIT_HAVE_CUDA
  if (stage_cuda) {
    void* stream = ln->sink->stream();
    ln->copier->run(ops, stream);
    delta::cuda::workspace& ws = device_workspace();
    std::vector<delta::cuda::patch_ref> refs;
    for (const staged_entry& s : batch)
      if (s.patch) refs.push_back(delta::cuda::patch_ref{log + s.at, s.bytes, s.item, s.span, s.name});
    delta::cuda::check(refs, ws, stream);  // after the copies, on their stream
    for (const staged_entry& s : batch) {
      const std::uint64_t weight = delta::name_weight(s.name);
      auto* weights = static_cast<std::byte*>(s.slots->front().dest.data);
      if (s.patch) {
        delta::cuda::apply(delta::cuda::patch_ref{log + s.at, s.bytes, s.item, s.span, s.name}, s.off, s.total, weights,
                           weight, ws, stream, delta::apply_mode::terms_only);
        continue;
      }
      delta::cuda::add_range_terms(weights + s.off, s.off, s.bytes, s.total, weight, true, ws, stream);
      delta::cuda::add_range_terms(log + s.at, s.off, s.bytes, s.total, weight, false, ws, stream);
    }
    delta::cuda::launch_applies(ws);
    return;
  }
#endif
  for (const copy::op& op : ops) std::memcpy(op.dst, op.src, op.bytes);
  host_entries_of(batch, log, false, delta_dests, delta_entries);
  host_patcher().check(delta_entries);
  delta_terms += host_patcher().apply(delta_entries, delta::apply_mode::terms_only);
}

/// Where the batch being checked writes destination `sl`: its copy in the stage. Notes that the
/// refit in progress wrote it, for apply_prepared().
std::byte* receiver::impl::stage_for(slot& sl) {
  if (sl.staged_in != stage_serial) {
    sl.staged_in = stage_serial;
    staged_slots.push_back(&sl);
  }
  return stage_base() + sl.stage_at;
}

/// Where the batch being checked writes destination `sl`: its weights, or a staged receiver's copy
/// of them in the stage (stage_for()).
std::byte* receiver::impl::write_target(slot& sl) {
  return staged() ? stage_for(sl) : static_cast<std::byte*>(sl.dest.data);
}

/// Every lane's END checked out (finish_refit()), or an engine-wide version's COMMIT came
/// (on_commit()): the version waits in the stage for apply_prepared(); on_prepared runs before
/// serve_one() returns. The caller answers.
void receiver::impl::prepare(std::uint64_t version, const receiver_stats& figures,
                             std::optional<std::uint64_t> checksum) {
  prepared_state p;
  p.version = version;
  p.subset = refit_subset;
  p.delta = refit_delta;
  p.checksum = checksum;
  p.figures = figures;
  p.generation = sink_generation;
  p.slots.swap(staged_slots);
  p.log.swap(staged_log);
  const std::uint64_t tensors = p.figures.tensors;
  const double gb = static_cast<double>(p.figures.bytes) / 1e9;
  {
    std::lock_guard lock(stage_mutex);
    ready = std::move(p);
    prepared_number.store(version, std::memory_order_release);
    has_prepared.store(true, std::memory_order_release);
  }
  group_version.reset();
  REFIT_INFO("prepared version {} from {}: {} tensors, {:.3f} GB in the stage; the weights wait for apply_prepared()",
             version, grouped() ? fmt::format("{} streamers", lanes.size()) : who(*ln), tensors, gb);
  endings.push_back(ending{version, false, {}, true});
}

/// Copies each destination the prepared version wrote from the stage into the weights: its
/// footprint's rows only. A device stage: one launch of the copy kernel, on `stream` (the engine's)
/// without waiting, or on the stage's own stream and waited for.
void receiver::impl::copy_stage(const prepared_state& p, void* stream) {
  if (!p.log.empty()) return apply_log(p, stream);
  const std::byte* base = stage_base();
  if (stage_cuda) {
    std::vector<copy::op> ops;
    for (const slot* sl : p.slots) {
      const std::byte* from = base + sl->stage_at;
      auto* to = static_cast<std::byte*>(sl->dest.data);
      for (const plan::run& r : sl->foot)
        ops.emplace_back(from + r.dst, to + r.dst, r.width, r.rows, r.dst_pitch, r.dst_pitch);
    }
    if (stream != nullptr) {  // the engine's stream: its next step runs after the copy, no host wait
      stage_copier->run(ops, stream);
      device_stage->read_on(stream);  // the next version's writes into the stage wait for this copy
      return;
    }
    stage_copier->run(ops, device_stage->stream());
    device_stage->synchronize(options.idle_timeout);
    return;
  }
  // Host memory: pieces of at most piece_bytes, copied by the stage's threads (one core copies at a
  // fraction of a many-core host's memory bandwidth).
  struct piece {
    const std::byte* from;
    std::byte* to;
    std::uint64_t bytes;
  };
  std::vector<piece> pieces;
  std::uint64_t total = 0;
  for (const slot* sl : p.slots) {
    const std::byte* from = base + sl->stage_at;
    auto* to = static_cast<std::byte*>(sl->dest.data);
    for (const plan::run& r : sl->foot)
      for (std::uint64_t row = 0; row < r.rows; ++row)
        for (std::uint64_t at = r.dst + row * r.dst_pitch, left = r.width; left != 0;) {
          const std::uint64_t n = std::min(left, piece_bytes);
          pieces.push_back(piece{from + at, to + at, n});
          total += n;
          at += n;
          left -= n;
        }
  }
  const auto copy_range = [&](std::size_t first, std::size_t last) {
    for (std::size_t i = first; i < last; ++i) std::memcpy(pieces[i].to, pieces[i].from, pieces[i].bytes);
  };
  if (total < parallel_bytes) return copy_range(0, pieces.size());
  if (!stage_pool) stage_pool = std::make_unique<delta::worker_pool>(delta::pool_threads(options.delta_threads));
  // Jobs of about equal bytes, a few per thread, each a run of consecutive pieces.
  const std::size_t jobs = std::min(pieces.size(), stage_pool->size() * 4);
  std::vector<std::size_t> starts{0};
  std::uint64_t acc = 0;
  for (std::size_t i = 0; i < pieces.size() && starts.size() < jobs; ++i) {
    acc += pieces[i].bytes;
    if (acc * jobs >= total * starts.size()) starts.push_back(i + 1);
  }
  starts.push_back(pieces.size());
  stage_pool->run(starts.size() - 1, [&](std::size_t j) { copy_range(starts[j], starts[j + 1]); });
}

/// copy_stage() of a staged delta: each logged entry written into every destination of its tensor
/// (a patch's values at its indices, a span's bytes), nothing else; its terms were taken at its batch.
/// A CUDA stage: the patch apply kernel (up to kernel::max_applies patches a launch) and one copy
/// kernel launch for the spans, on `stream` without waiting, or on the stage's stream and waited for.
void receiver::impl::apply_log(const prepared_state& p, [[maybe_unused]] void* stream) {
  const std::byte* log = stage_base();
#if REFIT_HAVE_CUDA
  if (stage_cuda) {
    void* on = stream != nullptr ? stream : device_stage->stream();
    if (!stage_delta_ws || stage_delta_ws->device() != device_stage->device())
      stage_delta_ws = std::make_unique<delta::cuda::workspace>(device_stage->device());
    std::vector<copy::op> ops;
    for (const staged_entry& s : p.log)
      for (slot& sl : *s.slots) {
        auto* to = static_cast<std::byte*>(sl.dest.data);
        if (s.patch)
          delta::cuda::apply(delta::cuda::patch_ref{log + s.at, s.bytes, s.item, s.span, s.name}, s.off, s.total, to, 0,
                             *stage_delta_ws, on, delta::apply_mode::store_only);
        else
          ops.emplace_back(log + s.at, to + s.off, s.bytes);
      }
    delta::cuda::launch_applies(*stage_delta_ws);
    if (!ops.empty()) stage_copier->run(ops, on);
    if (stream != nullptr) {
      device_stage->read_on(stream);  // the next version's writes into the stage wait for these
      return;
    }
    device_stage->synchronize(options.idle_timeout);
    return;
  }
#else
  (void)stream;  // a host stage is written on this thread
#endif
  if (!stage_patcher) stage_patcher = std::make_unique<delta::host_patcher>(options.delta_threads);
  std::vector<std::byte*> dests;
  std::vector<delta::host_entry> entries;
  host_entries_of(p.log, log, true, dests, entries);
  (void)stage_patcher->apply(entries, delta::apply_mode::store_only);
}

std::optional<std::uint64_t> receiver::impl::apply_prepared(void* stream) {
  std::function<void(std::uint64_t)> hook;
  std::function<void(std::uint64_t, const std::string&)> dropped_hook;
  std::optional<std::string> dropped;
  std::uint64_t version = 0;
  double pause = 0;
  {
    std::lock_guard lock(stage_mutex);
    if (!ready) return std::nullopt;
    version = ready->version;
    if (ready->generation != sink_generation) {
      // The table changed since the version was prepared: the stage's places are the old table's.
      dropped = fmt::format(
          "version {} was prepared, then the parameter table changed (add_parameter, clear_parameters) before "
          "apply_prepared(): the stage was laid out from the old table, so the version was dropped and nothing "
          "was written; the streamer must send it again",
          version);
      dropped_hook = abort_hook;
    } else {
      const auto t0 = clock::now();
      try {
        copy_stage(*ready, stream);
      } catch (const error& e) {
        // The device refused the copy half-way: the weights are neither version.
        is_dirty.store(true);
        const std::string why = fmt::format(
            "applying version {} from the stage failed (the weights are partly "
            "overwritten: dirty until a version commits): {}",
            version, e.what());
        ready.reset();
        has_prepared.store(false, std::memory_order_release);
        note_error(why);
        throw error(e.code(), why);
      }
      pause = seconds_since(t0);
      ready->figures.pause_seconds = pause;
      make_live(version, ready->figures, ready->subset, ready->delta, ready->checksum, ready->generation);
      hook = commit_hook;
    }
    ready.reset();
    has_prepared.store(false, std::memory_order_release);
  }
  if (dropped) {
    note_error(*dropped);
    REFIT_WARN("{}", *dropped);
    if (dropped_hook) guard_hook("on_abort", version, [&] { dropped_hook(version, *dropped); });
    throw error(errc::apply, *dropped);
  }
  REFIT_INFO("applied version {} from the stage in {:.3f} ms", version, pause * 1e3);
  if (hook) guard_hook("on_commit", version, [&] { hook(version); });
  return version;
}

}  // namespace refit
