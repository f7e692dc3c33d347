// refit — subset and delta versions in the receiver: whether it holds their base (no_base_for()),
// a delta's patches checked and applied (on the host or the GPU), and its checksum at END.
#include <fmt/format.h>

#include <thread>

#include "receiver/impl.hpp"

namespace refit {

#if REFIT_HAVE_CUDA
delta::cuda::workspace& receiver::impl::device_workspace() {
  if (!ln->device_delta || ln->device_delta->device() != ln->sink->where().index)
    ln->device_delta = std::make_unique<delta::cuda::workspace>(ln->sink->where().index);
  return *ln->device_delta;
}
#endif

/// The refit in progress is a delta patched on the GPU.
bool receiver::impl::delta_on_device() const noexcept {
  return refit_delta && ln->sink && ln->sink->where().kind == device_kind::cuda;
}

/// Why this receiver cannot take subset (or delta) version `b`, or nullopt: it must hold a whole
/// version of its table as it is, with clean weights; a delta also needs exactly its base, the
/// base's checksum, and a table it can patch on the host (plain destinations).
std::optional<std::string> receiver::impl::no_base_for(const wire::begin& b) const {
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
void receiver::impl::check_patches(const wire::batch& b) {
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

void receiver::impl::apply_delta(const wire::batch& b) {
  const std::byte* base = ln->sink->data(b.buffer);
#if REFIT_HAVE_CUDA
  if (delta_on_device()) return apply_delta_device(b, base);
#endif
  delta_terms += host_patcher().apply(host_delta_entries(b, base));
}

/// The host patcher (receiver_options::delta_threads), made at the first delta batch applied on
/// the host.
delta::host_patcher& receiver::impl::host_patcher() {
  if (!delta_patcher) delta_patcher = std::make_unique<delta::host_patcher>(options.delta_threads);
  return *delta_patcher;
}

/// The entries of delta batch `b` (in buffer `base`) as the host patcher takes them: every
/// destination of their tensors, their checksum weights.
std::span<const delta::host_entry> receiver::impl::host_delta_entries(const wire::batch& b, const std::byte* base) {
  delta_dests.clear();
  delta_entries.clear();
  for (const wire::entry& e : b.entries)
    for (slot& sl : *table.find(e.name)) delta_dests.push_back(static_cast<std::byte*>(sl.dest.data));
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
void receiver::impl::apply_delta_device(const wire::batch& b, const std::byte* base) {
  delta::cuda::workspace& ws = device_workspace();
  void* stream = ln->sink->stream();
  std::vector<copy::op> ops;
  for (const wire::entry& e : b.entries) {
    if (e.bytes == 0) continue;
    const std::uint64_t total = *checked_nbytes(e.type, e.shape);
    const std::uint64_t weight = delta::name_weight(e.name);
    const std::byte* from = base + e.buffer_offset;
    std::vector<slot>& slots = *table.find(e.name);
    if (e.kind == wire::entry_kind::patch) {
      const delta::cuda::patch_ref p{from, e.bytes, itemsize(e.type), e.span, e.name};
      bool first = true;  // tied destinations: the terms are counted once
      for (slot& sl : slots) {
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
    for (slot& sl : slots) {
      ops.emplace_back(from, static_cast<std::byte*>(sl.dest.data) + e.tensor_offset, e.bytes);
      ops.back().kernel_only = sl.kernel_only;
    }
    ln->copier->run(ops, stream);
  }
  delta::cuda::launch_applies(ws);  // before end_read() hands the buffer back
}
#endif

/// A delta's END: the checksum the streamer computed of the whole new version must be the one the
/// receiver's weights now have (the base's, changed by what the patches wrote). Throws errc::apply.
void receiver::impl::check_delta(const wire::end& e) const {
  if (!e.checksum) throw error(errc::protocol, fmt::format("END of delta version {} carries no checksum", e.version));
  const std::uint64_t mine = *known_checksum + delta_terms;
  if (mine != *e.checksum)
    throw error(errc::apply,
                fmt::format("delta version {} does not check out: the streamer's checksum of the whole version is "
                            "{:#018x}, the weights here now sum to {:#018x} (a corrupted patch, or weights that were "
                            "not the base); nothing was committed",
                            e.version, *e.checksum, mine));
}

}  // namespace refit
