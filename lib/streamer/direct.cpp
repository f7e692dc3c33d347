// refit — writes into the receivers' memory: a direct session's copies along each destination's
// route, launched as they are planned (by the copy kernel, or by the copy engines when every
// destination is on another GPU), and an in-place session's tensors, sent from the streamer's GPU
// (a parts session: each receiver's parts of them).
#include <fmt/format.h>

#include <algorithm>
#include <thread>
#include <utility>
#include <vector>

#include "model/log.hpp"
#include "streamer/impl.hpp"

namespace refit {

/// Whether this session's direct writes go by the copy engines: the engine is automatic and every
/// destination lies on another GPU (transport::source::peers_elsewhere).
bool streamer::impl::peer_engine() const noexcept {
  return options.engine == copy_engine::automatic && copier->kind() == copy::engine::kernel &&
         buffers->peers_elsewhere();
}

copy::copier& streamer::impl::peer_copier() {
  if (!engines) engines = copy::make_copier(copy::engine::memcpy_batch, options.device, options.timeout);
  return *engines;
}

void streamer::impl::batch_writer::launch_direct() {
  const auto tp = clock::now();
  run_ops();
  stats.pack_seconds += seconds_since(tp);
}

/// Counts `bytes` of direct writes planned, launching what is planned once the device has at
/// most one launch left to run: the next one is queued before the device idles (launching only
/// at idle left qwen2.5-0.5b's copies ~100 us of gaps on an H100), and launches stay large
/// while the device is behind.
void streamer::impl::batch_writer::note_direct(std::uint64_t bytes) {
  direct_pending += bytes;
  if (direct_pending - direct_checked >= direct_check_bytes) {
    direct_checked = direct_pending;
    // Copy engines (peer_engine) say nothing of their queue: their copies go with each piece of
    // the manifest, as with engine memcpy_batch.
    const std::uint64_t floor = std::min(direct_launch_cap, std::max(direct_check_bytes, direct_launched / 4));
    if (!st.peer_engine() && direct_pending >= floor && st.copier->queue_short()) launch_direct();
  }
}

/// While a direct session's last launch runs: each receiver that fell asleep waiting (its spin
/// after the manifest's last piece, 500 us, is shorter than a large model's writes) is woken, so
/// that END finds it awake instead of paying its wake-up (~100 us on the H200 VMs, measured in
/// bench/results/2026-11-28-h200-direct-allocations-wake.txt). Returns once the copier is idle
/// (drain() then waits for the rest of the stream and reports any error) or at the timeout.
void streamer::impl::wake_before_end() {
  if (peer_engine()) return;  // the copy engines say nothing of their queue
  const auto deadline = clock::now() + options.timeout;
  while (!copier->idle() && clock::now() < deadline) {
    // Only once the last launch runs: no receiver spins through a whole refit. A receiver awake
    // costs the call a load.
    if (copier->queue_short())
      for (channel::req_channel& c : channels) c.wake_receiver();
    std::this_thread::yield();
  }
}

/// drain() where a failure is already being reported: its own error is only logged.
void streamer::impl::drain_quietly() noexcept {
  try {
    buffers->drain();
  } catch (const std::exception& e) {
    REFIT_WARN("draining the stream after a failed refit: {}", e.what());
  }
}

/// An in-place nccl session sends every tensor from the streamer's GPU: throws for one elsewhere.
void streamer::impl::check_in_place(const tensor_ref& t, std::uint64_t bytes, std::uint64_t version) const {
  if (bytes != 0 && !(t.dev == buffers->where()))
    throw error(errc::invalid_argument,
                fmt::format("tensor {} is on cuda:{}, but this nccl session sends every tensor in place from the "
                            "streamer's GPU, cuda:{} (nothing of it was sent; receivers that took earlier "
                            "batches of version {} stay dirty until a refit commits): move it there, or set "
                            "streamer_options::direct = false to pack such tensors",
                            describe(t.meta), t.dev.index, buffers->where().index, version));
}

/// A parts session: replaces the segment of each entry (the whole entry, in place or in the
/// staging buffer) with one segment per receiver destination it reaches, holding that
/// destination's bytes of it: sent from where they lie when they are one range of the tensor
/// (rows: a column-parallel shard, a fused narrow(0)), else gathered first into the
/// transport's gather memory (a column slice's rows), by copies that run with the batch's.
/// Receivers compute the same segments from the manifest and their tables, in the same order.
void streamer::impl::batch_writer::split_parts(std::size_t buffer) {
  std::vector<transport::segment> whole = std::move(segments);
  segments.clear();
  // The gathered parts, in one pass: their segments and copies count from the gather memory,
  // asked for once their total is known.
  struct gathered_run {
    const std::byte* src;
    std::uint64_t at;
    plan::run r;
  };
  std::vector<gathered_run> runs;
  std::vector<std::size_t> gathered;  // their segments
  std::uint64_t cursor = 0;
  std::size_t next = 0;
  // This entry's gathered parts (their runs, where they start): a part several receivers take
  // alike (the same TP rank of two replicas) is gathered once and sent from there to each.
  std::vector<std::pair<std::vector<plan::run>, std::uint64_t>> alike;
  for (const wire::entry& e : entries) {
    if (e.bytes == 0) continue;
    alike.clear();
    if (next == whole.size())
      throw error(errc::internal, fmt::format("version {}: a batch of {} entries has {} segments", version,
                                              entries.size(), whole.size()));
    const transport::segment& seg = whole[next++];
    const std::byte* base =
        seg.data != nullptr ? seg.data : st.buffers->staging(buffer) + seg.offset;  // converted: in staging
    for (const transport::routed& target : st.buffers->routes(tensor_meta{e.name, e.type, e.shape})) {
      pieces.clear();
      for (const plan::run& r : target.runs) plan::clip(r, e.tensor_offset, e.tensor_offset + e.bytes, pieces);
      if (pieces.empty()) continue;
      const std::uint64_t n = plan::bytes_of(pieces);
      const auto peer = static_cast<std::uint32_t>(target.receiver + 1);
      stats.parts_bytes += n;
      if (const auto lo = plan::contiguous(pieces, true)) {
        segments.push_back(transport::segment{const_cast<std::byte*>(base + (*lo - e.tensor_offset)), 0, n, peer});
        continue;
      }
      gathered.push_back(segments.size());
      // The bytes gathered depend on the source side of the runs only.
      const auto same = std::find_if(alike.begin(), alike.end(), [&](const auto& a) {
        return std::ranges::equal(a.first, pieces, [](const plan::run& x, const plan::run& y) {
          return x.src == y.src && x.src_pitch == y.src_pitch && x.width == y.width && x.rows == y.rows;
        });
      });
      if (same != alike.end()) {
        segments.push_back(transport::segment{nullptr, same->second, n, peer});
        continue;
      }
      alike.emplace_back(pieces, cursor);
      segments.push_back(transport::segment{nullptr, cursor, n, peer});
      for (const plan::run& r : pieces) {
        runs.push_back(gathered_run{base + (r.src - e.tensor_offset), cursor, r});
        cursor += r.width * r.rows;
      }
    }
  }
  if (cursor == 0) return;
  std::byte* memory = st.buffers->gather(buffer, cursor);
  if (memory == nullptr) throw error(errc::internal, "a parts session without gather memory");
  for (const std::size_t k : gathered)
    segments[k] = transport::segment{memory + segments[k].offset, 0, segments[k].bytes, segments[k].peer};
  for (const gathered_run& g : runs)
    ops.emplace_back(g.src, memory + g.at, g.r.width, g.r.rows, g.r.src_pitch, g.r.width);
}

}  // namespace refit
