// refit — a delta version: each tensor diffed against the streamer's base span by span, its
// patches (or, where it changed densely, its bytes) placed into the batches, and the base brought
// up to date; a whole version is copied into the base. The batch writer calls it (send_delta,
// finish_delta) and hears from it at each flush (launch_delta_writes, recycle_patches).
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "delta/checksum.hpp"
#include "model/log.hpp"
#include "streamer/impl.hpp"

namespace refit {

/// Tensor bytes after which a delta's batch is sent (see send_delta): delta_options::batch_bytes,
/// by default what a whole version's batch covers (a buffer) over host_shm and four buffers over
/// the GPU transports, at least 32 MiB. Fewer, larger batches: each costs a round trip and, on the
/// GPU, one wait of the streamer's diff and one of the receiver's patch check (measured on an
/// H100, qwen2.5-0.5b: 31 batches of 32 MiB spent 13 of a delta's 18 ms outside the diff; on
/// 2 × H200 over NVLink, llama3-8b at 2 × 256 MiB: 49 batches of 256 MiB 26.4 ms, 14 of 1 GiB
/// 24.2 ms, against 45.2 ms for the whole version in place). At ~2 % of bf16 elements changed a
/// batch's patches fill about a quarter of a buffer.
std::uint64_t streamer::impl::delta_batch_covers() const noexcept {
  if (options.delta.batch_bytes != 0) return options.delta.batch_bytes;
  const std::uint64_t buffers = options.transport == transport_kind::host_shm ? 1 : 4;
  return std::max<std::uint64_t>(32ull << 20, buffers * options.buffer_bytes);
}

/// Copies a tensor of a whole version into the base and adds its checksum; false (and a warning)
/// when the base would outgrow its bound.
bool streamer::impl::keep_in_base(const tensor_ref& t, std::uint64_t bytes, std::uint64_t& checksum,
                                  refit_stats& stats) {
  const auto td = clock::now();
  delta::base_store::tensor* b = base->place(t.meta);
  if (b == nullptr) {
    if (!warned_base_bound)
      REFIT_WARN(
          "the delta base would take more than its bound of {} bytes (delta_options::max_bytes): versions "
          "are sent whole",
          base->max_bytes());
    warned_base_bound = true;
    return false;
  }
  if (t.dev.kind == device_kind::cuda || base->where() == delta::memory::device) {
#if REFIT_HAVE_CUDA
    delta::cuda::copy_sync(b->data, t.data, bytes, options.device);
#endif
  } else if (bytes != 0) {
    std::memcpy(b->data, t.data, bytes);
  }
  checksum += delta::name_weight(t.meta.name) * copy::checksum(b->data, bytes, base->dev());
  stats.diff_seconds += seconds_since(td);
  stats.pack_seconds += seconds_since(td);
  return true;
}

/// Adds a piece of span [off, ...) of `t` that goes as its plain bytes (it changed densely),
/// copied from `src` (the tensor) when the batch is packed.
void streamer::impl::add_span_bytes(batch_writer& w, const tensor_ref& t, std::uint64_t off, const placement& p,
                                    const std::byte* src) {
  w.add_copied(wire::entry{t.meta.name, t.meta.type, t.meta.shape, off + p.entry.tensor_offset, p.entry.bytes,
                           p.entry.buffer_offset, wire::entry_kind::bytes, 0},
               src + off + p.entry.tensor_offset);
}

/// Patches are small: a batch would hold a large part of the version, and the receiver would
/// start patching only once the streamer had diffed all of it. A batch is sent once it covers
/// delta_batch_covers bytes of tensors (of a host tensor's spans: inside a large tensor too), so
/// that the receiver's patching overlaps the next diffs.
void streamer::impl::close_if_covered(batch_writer& w, planner& pl, std::uint64_t total) const {
  w.covered += total;
  if (w.covered >= delta_batch_covers()) {
    w.flush();
    pl = planner(pl.options());
    w.first_batch = w.seq;
  }
}

/// Diffs one tensor against the base span by span (delta::span_bytes), brings the base up to date
/// and adds the tensor's patches (or, for a span that changed densely, its bytes) to the batches,
/// counting it in stats.tensors. A tensor that did not change is not sent. A host tensor is diffed
/// at once, on the host differ's threads (send_host). A device tensor joins the open group
/// (send_device_group), which is sent once it holds what the open batch still covers, or before a
/// host tensor, or at the end (finish_delta). Throws errc::invalid_argument
/// for a tensor the base does not hold as it is (new, or another dtype or shape).
void streamer::impl::send_delta(batch_writer& w, planner& pl, std::size_t index, const tensor_ref& t, delta_scratch& sc,
                                std::uint64_t& checksum) {
  delta::base_store::tensor* b = base->find(t.meta.name);
  if (b == nullptr || b->meta.type != t.meta.type || b->meta.shape != t.meta.shape)
    throw error(
        errc::invalid_argument,
        fmt::format("tensor {} is {} the delta's base (version {}): a delta carries the tensors of its base "
                    "as they were; the next refit is sent whole",
                    describe(t.meta), b == nullptr ? "not in" : fmt::format("{} in", describe(b->meta)), w.stats.base));
#if REFIT_HAVE_CUDA
  if (t.dev.kind == device_kind::cuda) {
    queue_device(w, pl, index, t, *b, sc);
    return;
  }
  send_device_group(w, pl, sc);  // the device tensors before this one keep their place
#endif
  send_host(w, pl, index, t, *b, sc, checksum);
}

/// Diffs a host tensor against the base span by span (delta::span_bytes), each span cut in chunks
/// diffed on the host differ's threads, bringing the base up to date, and places its patches.
/// Tensor by tensor, as they come: a batch full of patches is sent before the next tensor is
/// asked of the source (whose gathering then overlaps the receiver's patching), and the batches
/// are those of a diff on one thread. A large tensor is diffed a batch at a time: the spans that
/// complete the open batch's coverage (close_if_covered) are diffed, placed and sent before the
/// next ones are diffed, so that the receiver patches the first part of an embedding (a quarter of
/// qwen2.5-0.5b) while the streamer diffs the rest, instead of waiting for all of it.
void streamer::impl::send_host(batch_writer& w, planner& pl, std::size_t index, const tensor_ref& t,
                               delta::base_store::tensor& b, delta_scratch& sc, std::uint64_t& checksum) {
  const std::size_t item = itemsize(t.meta.type);
  const std::uint64_t total = b.bytes;
  const std::uint64_t span = delta::span_bytes(plan.buffer_bytes);
  const auto* src = static_cast<const std::byte*>(t.data);
  sc.spans.clear();
  for (std::uint64_t off = 0; off < total; off += span)
    sc.spans.push_back(delta::host_span{b.data + off, src + off, off, std::min(span, total - off), total, item});
  if (sc.found.size() < sc.spans.size()) sc.found.resize(sc.spans.size());
  if (!host_differ) host_differ = std::make_unique<delta::host_differ>(options.delta.threads);
  const std::span<delta::span_patch> found = std::span<delta::span_patch>(sc.found).first(sc.spans.size());
  const std::uint64_t weight = delta::name_weight(t.meta.name);
  w.stats.elements += total / item;
  std::size_t placed = 0;  // spans placed so far; none until the tensor's first change
  for (std::size_t k = 0; k < sc.spans.size();) {
    // The spans that complete the open batch's coverage, at most a wave of the differ's scratch.
    const std::uint64_t room = delta_batch_covers() - std::min(w.covered, delta_batch_covers());
    std::size_t end = k;
    for (std::uint64_t bytes = 0;
         end < sc.spans.size() &&
         (end == k || (bytes < room && bytes + sc.spans[end].bytes <= delta::host_differ::wave_bytes));)
      bytes += sc.spans[end++].bytes;
    const auto td = clock::now();
    const auto group = std::span<const delta::host_span>(sc.spans).subspan(k, end - k);
    host_differ->count(group, found.subspan(k, end - k));
    w.stats.diff_seconds += seconds_since(td);
    w.stats.pack_seconds += seconds_since(td);
    std::uint64_t changes = 0;
    for (std::size_t s = k; s < end; ++s) {
      checksum += weight * found[s].terms;
      changes += found[s].changes;
    }
    w.stats.changed += changes;
    // Spans that changed nothing before the tensor's first change wait for it (a tensor that did
    // not change is not sent); from then on every span is placed, in order.
    if (changes != 0 || placed != 0) {
      place_spans(w, pl, index, t, found, placed, end, group, k, sc);
      placed = end;
    }
    k = end;
  }
  if (placed != 0) w.stats.tensors += 1;
}

/// Places the patches (or bytes) of spans [from, to) of a diffed host tensor (found[k]: span k;
/// `group`: the spans of the last count(), from span `first`), writes their patches, and sends the
/// batch once it covers delta_batch_covers() bytes. A patch is written straight into the batch's
/// buffer when that is host memory (host_shm: the buffer of the open batch is not the receiver's
/// until its BATCH is sent), else into host memory copied there when the batch is packed.
void streamer::impl::place_spans(batch_writer& w, planner& pl, std::size_t index, const tensor_ref& t,
                                 std::span<delta::span_patch> found, std::size_t from, std::size_t to,
                                 std::span<const delta::host_span> group, std::size_t first, delta_scratch& sc) {
  const std::uint64_t total = t.meta.nbytes();
  const std::uint64_t span = delta::span_bytes(plan.buffer_bytes);
  const std::size_t item = itemsize(t.meta.type);
  const auto* src = static_cast<const std::byte*>(t.data);
  const bool in_buffer = buffers->where().kind == device_kind::cpu;
  sc.targets.clear();
  // The patches placed so far, before their batch is sent.
  const auto write = [&] {
    const auto td = clock::now();
    host_differ->write(group, sc.targets);
    sc.targets.clear();
    w.stats.diff_seconds += seconds_since(td);
    w.stats.pack_seconds += seconds_since(td);
  };
  std::uint64_t covered = 0;
  for (std::size_t k = from; k < to; ++k) {
    const std::uint64_t off = k * span;
    const std::uint64_t n = std::min(span, total - off);
    const bool as_bytes = found[k].as_bytes;
    const std::uint64_t bytes = as_bytes ? n : found[k].changes * delta::record_bytes(item);
    const std::vector<placement> places = pl.add(index, bytes);
    if (places.size() != 1)  // delta::span_bytes: half a buffer at most, so never split
      throw error(errc::internal, fmt::format("tensor {}: a delta's span of {} bytes was split in {} batches",
                                              describe(t.meta), bytes, places.size()));
    const placement& p = places.front();
    if (w.first_batch + p.batch > w.seq) {
      write();
      while (w.first_batch + p.batch > w.seq) w.flush();
    }
    if (as_bytes) {
      add_span_bytes(w, t, off, p, src);
    } else {
      const wire::entry e{t.meta.name,
                          t.meta.type,
                          t.meta.shape,
                          off,
                          p.entry.bytes,
                          p.entry.buffer_offset,
                          wire::entry_kind::patch,
                          n};
      std::byte* to_write = nullptr;
      if (p.entry.bytes == 0) {
        w.entries.push_back(e);
      } else if (in_buffer) {
        // The batch before this buffer's last one is still posted: its reply says the receiver
        // is done reading this buffer (host_shm replies first and copies after), so it is heard
        // before a patch goes in, as before any packing (begin_pack).
        const std::size_t buffer = w.seq % buffers->count();
        w.begin_pack(buffer);
        to_write = buffers->data(buffer) + p.entry.buffer_offset;
        w.entries.push_back(e);
      } else {
        w.patches.push_back(host_differ->patch_memory(p.entry.bytes));
        to_write = w.patches.back().data();
        w.add_copied(e, to_write);
      }
      if (to_write != nullptr) sc.targets.push_back(delta::host_differ::target{k - first, to_write});
    }
    w.stats.bytes += p.entry.bytes;
    covered += n;
  }
  write();
  close_if_covered(w, pl, covered);
}

/// Sends what send_delta() left queued: before the version's last batch.
void streamer::impl::finish_delta(batch_writer& w, planner& pl, delta_scratch& sc) {
#if REFIT_HAVE_CUDA
  send_device_group(w, pl, sc);
#else
  (void)w, (void)pl, (void)sc;
#endif
}

/// At every flush, before the batch is sent: a delta's patches written on the device
/// (send_device_group) are queued until here.
void streamer::impl::launch_delta_writes() {
#if REFIT_HAVE_CUDA
  if (device_delta) delta::cuda::launch_writes(*device_delta);
#endif
}

/// At every flush, once the batch is sent: the host patches of the batch (copied into its buffer
/// when it was packed) go back to the host differ for the next ones.
void streamer::impl::recycle_patches(std::deque<std::vector<std::byte>>& patches) {
  if (host_differ)
    for (std::vector<std::byte>& p : patches) host_differ->recycle(std::move(p));
  patches.clear();
}

/// At the start of a version: what a failed refit left of a device delta (its queued tensors,
/// writes and checksum terms) is dropped.
void streamer::impl::forget_failed_delta(sending how, delta_scratch& scratch) {
#if REFIT_HAVE_CUDA
  scratch.group.clear();  // a failed refit's
  scratch.group_bytes = 0;
  if (device_delta) device_delta->discard_writes();
  if (how == sending::delta && device_delta) (void)device_delta->take_terms(buffers->stream());  // a failed refit's
#else
  (void)how, (void)scratch;
#endif
}

/// After a delta's last batch: the checksum terms of its device tensors, added up on the device
/// (send_device_group), join the version checksum.
void streamer::impl::take_device_terms(sending how, std::uint64_t* checksum) {
#if REFIT_HAVE_CUDA
  if (how == sending::delta && device_delta) *checksum += device_delta->take_terms(buffers->stream());
#else
  (void)how, (void)checksum;
#endif
}

#if REFIT_HAVE_CUDA
delta::cuda::workspace& streamer::impl::device_workspace() {
  if (!device_delta) device_delta = std::make_unique<delta::cuda::workspace>(options.device);
  return *device_delta;
}

/// Queues a device tensor of a delta for its group's diff, ordering the diff after the work its
/// producer stream holds now; sends the group once it holds the bytes the open batch still covers
/// (close_if_covered), so that a group's one wait comes about once per batch.
void streamer::impl::queue_device(batch_writer& w, planner& pl, std::size_t index, const tensor_ref& t,
                                  delta::base_store::tensor& b, delta_scratch& sc) {
  buffers->after(t.stream);
  sc.group.push_back(queued_tensor{index, t, &b});
  sc.group_bytes += b.bytes;
  if (w.covered + sc.group_bytes >= delta_batch_covers()) send_device_group(w, pl, sc);
}

/// send_delta() for the queued tensors in device memory (cuda_ipc staged buffers, nccl buffers):
/// the diff runs on the pack stream (lib/delta/diff_kernel.cu). The changes of every span of the
/// group are counted on the device and read back with one wait (the host places the patches), then
/// each patch is written straight into the staging buffer, after the buffer is free (begin_pack):
/// the writes are queued in the workspace and launched up to kernel::max_writes spans at a time, at
/// the latest when the batch is flushed. The checksum terms add up on the device: send_tensors()
/// reads them before END. The batches are those the tensors would make one by one, each sent
/// before the source is asked for the next tensor.
void streamer::impl::send_device_group(batch_writer& w, planner& pl, delta_scratch& sc) {
  if (sc.group.empty()) return;
  const auto td = clock::now();
  delta::cuda::workspace& ws = device_workspace();
  sc.diffs.clear();
  for (const queued_tensor& q : sc.group)
    sc.diffs.push_back(delta::cuda::diff_tensor{q.base->data, static_cast<const std::byte*>(q.t.data), q.base->bytes,
                                                itemsize(q.t.meta.type)});
  delta::cuda::count(sc.diffs, delta::span_bytes(plan.buffer_bytes), ws, buffers->stream());
  w.stats.diff_seconds += seconds_since(td);
  w.stats.pack_seconds += seconds_since(td);
  for (std::size_t i = 0; i < sc.group.size(); ++i) place_device(w, pl, sc.group[i], i, ws);
  sc.group.clear();
  sc.group_bytes = 0;
}

/// Places the patches (or bytes) of tensor `i` of the counted group and enqueues their writes.
void streamer::impl::place_device(batch_writer& w, planner& pl, const queued_tensor& q, std::size_t i,
                                  delta::cuda::workspace& ws) {
  void* stream = buffers->stream();
  const std::size_t item = itemsize(q.t.meta.type);
  const std::uint64_t total = q.base->bytes;
  const std::uint64_t span = delta::span_bytes(plan.buffer_bytes);
  const auto* src = static_cast<const std::byte*>(q.t.data);
  const std::uint64_t weight = delta::name_weight(q.t.meta.name);
  const std::span<const std::uint64_t> changes = ws.changes(i);
  std::uint64_t sum = 0;
  for (const std::uint64_t c : changes) sum += c;
  w.stats.elements += total / item;
  w.stats.changed += sum;
  if (sum == 0) return;
  for (std::size_t k = 0; k < changes.size(); ++k) {
    const std::uint64_t off = k * span;
    const std::uint64_t n = std::min(span, total - off);
    const std::uint64_t bytes = changes[k] * delta::record_bytes(item);
    const bool as_bytes = bytes >= n;
    for (const placement& p : pl.add(q.index, as_bytes ? n : bytes)) {
      while (w.first_batch + p.batch > w.seq) w.flush();
      if (as_bytes) {
        // Copied from the tensor at flush(), after the pack stream waited for the buffer.
        add_span_bytes(w, q.t, off, p, src);
      } else {
        const std::size_t buffer = w.seq % buffers->count();
        w.begin_pack(buffer);
        // A span without changes has nothing to write, nor anything to bring up to date.
        if (changes[k] != 0)
          delta::cuda::write(i, k, buffers->data(buffer) + p.entry.buffer_offset, weight, ws, stream);
        w.entries.push_back(wire::entry{q.t.meta.name, q.t.meta.type, q.t.meta.shape, off, p.entry.bytes,
                                        p.entry.buffer_offset, wire::entry_kind::patch, n});
      }
      w.stats.bytes += p.entry.bytes;
    }
    // A span sent as bytes still brings the base up to date (and adds its terms).
    if (as_bytes) delta::cuda::write(i, k, nullptr, weight, ws, stream);
  }
  close_if_covered(w, pl, total);
  w.stats.tensors += 1;
}

#endif

}  // namespace refit
