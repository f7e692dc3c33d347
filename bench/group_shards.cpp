// refit-bench --streamers N: each streamer rank's shards (Shard(0) rows, torch.chunk's split) and
// what the receivers hold of them; the CPU reference of every receiver's checksums (terms each rank
// adds while it fills its shards: checksums are linear in each byte, delta/checksum.hpp); and the
// cuda_ipc ceiling, the same shard bytes copied by the copy engines.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "bench/group.hpp"
#include "delta/checksum.hpp"
#if REFIT_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "copy/cuda_check.hpp"
#endif

namespace refit::bench::sharded {
namespace {

using clock_type = std::chrono::steady_clock;

/// Calls f(source offset, bytes, position) for each run of bytes [off, off + n) of a tensor that
/// region `r` takes; position: where the run starts among the region's bytes gathered in order.
template <class F>
void for_each_piece(const byte_region& r, std::uint64_t off, std::uint64_t n, F f) {
  if (r.width == 0 || n == 0) return;
  const std::uint64_t end = off + n;
  const std::uint64_t pitch = r.rows <= 1 ? r.width : r.pitch;
  for (std::uint64_t k = off > r.offset ? (off - r.offset) / pitch : 0; k < r.rows; ++k) {
    const std::uint64_t run = r.offset + k * pitch;
    if (run >= end) break;
    const std::uint64_t lo = std::max(run, off), hi = std::min(run + r.width, end);
    if (lo < hi) f(lo, hi - lo, k * r.width + (lo - run));
  }
}

/// Adds the terms of `len` bytes `p` of source i, from byte `off`, to every expectation's checksum.
void add_terms(rank_shards& s, const holdings& h, std::size_t i, const std::byte* p, std::uint64_t off,
               std::uint64_t len) {
  for (std::size_t e = 0; e < h.regions.size(); ++e) {
    const byte_region& r = h.regions[e][i];
    for_each_piece(r, off, len, [&](std::uint64_t at, std::uint64_t n, std::uint64_t pos) {
      s.terms[e][i] += delta::range_terms(p + (at - off), pos, n, r.bytes());
    });
  }
}

}  // namespace

/// Rows [first, first + count) of `rows` that rank r of n holds (torch.chunk).
std::pair<std::int64_t, std::int64_t> chunk_rows(std::int64_t rows, std::size_t r, std::size_t n) {
  const std::int64_t per = (rows + static_cast<std::int64_t>(n) - 1) / static_cast<std::int64_t>(n);
  const std::int64_t first = std::min<std::int64_t>(rows, per * static_cast<std::int64_t>(r));
  return {first, std::min<std::int64_t>(rows, first + per) - first};
}

/// The bytes of `whole` that rank r of n holds: {offset, length} in its row-major storage.
std::pair<std::uint64_t, std::uint64_t> shard_bytes(const tensor_meta& whole, std::size_t r, std::size_t n) {
  const std::int64_t rows = whole.shape.empty() ? 1 : whole.shape[0];
  const auto [first, count] = chunk_rows(rows, r, n);
  const std::uint64_t row = rows == 0 ? 0 : whole.nbytes() / static_cast<std::uint64_t>(rows);
  return {row * static_cast<std::uint64_t>(first), row * static_cast<std::uint64_t>(count)};
}

holdings hold(const config& c, const manifest& m, std::size_t receivers, bool one_receiver) {
  holdings h;
  for (std::size_t k = 0; k < receivers; ++k) {
    const int rank = c.layout.tp > 1 ? (one_receiver ? c.rank : static_cast<int>(k)) : 0;
    h.rank_of.push_back(rank);
    const auto same = std::find(h.ranks.begin(), h.ranks.end(), rank);
    h.expect_of.push_back(static_cast<std::size_t>(same - h.ranks.begin()));
    if (same != h.ranks.end()) continue;
    h.ranks.push_back(rank);
    const engine_layout l = make_layout(m, c.layout, rank);
    h.regions.emplace_back();
    for (std::size_t i = 0; i < m.entries.size(); ++i)
      h.regions.back().push_back(region_of(m.entries[i].meta, l.slices[i]));
    h.payload += l.needed_bytes(m);
  }
  return h;
}

/// Fills rank r's shards with the bytes the whole tensors of a run seeded `seed` have there (the
/// usual rows' fill_random), adding their terms as it goes.
rank_shards make_shards(const manifest& m, std::size_t r, std::size_t n, int gpu, std::uint64_t seed,
                        const holdings& h) {
  rank_shards s;
  s.gpu = gpu;
  s.terms.assign(h.regions.size(), std::vector<std::uint64_t>(m.entries.size(), 0));
#if REFIT_HAVE_CUDA
  constexpr std::uint64_t chunk = 64ull << 20;
  std::optional<cuda::pinned_buffer> staging;
  if (gpu >= 0) {
    check_cuda(cudaSetDevice(gpu), "cudaSetDevice");
    staging.emplace(chunk);
  }
#endif
  for (std::size_t i = 0; i < m.entries.size(); ++i) {
    const tensor_meta& whole = m.entries[i].meta;
    const auto [offset, bytes] = shard_bytes(whole, r, n);
    const std::int64_t rows = whole.shape.empty() ? 1 : whole.shape[0];
    tensor_meta local = whole;
    if (!local.shape.empty()) local.shape[0] = chunk_rows(rows, r, n).second;
    std::byte* data = nullptr;
#if REFIT_HAVE_CUDA
    if (gpu >= 0) {
      s.device.emplace_back(std::max<std::uint64_t>(bytes, 256));
      data = static_cast<std::byte*>(s.device.back().handle());
      auto* p = static_cast<std::byte*>(staging->handle());
      for (std::uint64_t off = 0; off < bytes; off += chunk) {
        const std::uint64_t len = std::min(chunk, bytes - off);
        fill_random(p, len, tensor_seed(seed, i), offset + off);
        add_terms(s, h, i, p, offset + off, len);
        check_cuda(cudaMemcpy(data + off, p, len, cudaMemcpyHostToDevice), "--streamers: filling the shards");
      }
    }
#endif
    if (gpu < 0) {
      s.host.emplace_back(std::max<std::uint64_t>(bytes, 1));
      data = s.host.back().data();
      fill_random(data, bytes, tensor_seed(seed, i), offset);
      add_terms(s, h, i, data, offset, bytes);
    }
    tensor_ref ref{local, data, gpu >= 0 ? device::cuda(gpu) : device::cpu(), nullptr};
    if (!whole.shape.empty()) ref.shard = tensor_shard{whole.shape, 0, chunk_rows(rows, r, n).first};
    s.refs.push_back(std::move(ref));
    s.offsets.push_back(offset);
    s.bytes += bytes;
  }
  return s;
}

#if REFIT_HAVE_CUDA
/// The cuda_ipc ceiling: every rank's shard bytes that a receiver needs copied to that receiver's
/// GPU, all at once, with cudaMemcpyPeerAsync from each rank's GPU (one stream per rank and
/// receiver). Best of `reps`; seconds.
double peer_pattern_seconds(const holdings& h, const std::vector<rank_shards>& ranks, const std::vector<int>& gpus,
                            int reps) {
  std::vector<cuda::device_buffer> replicas;
  std::vector<std::vector<std::uint64_t>> slot(gpus.size());  // per receiver, per source
  for (std::size_t j = 0; j < gpus.size(); ++j) {
    std::uint64_t total = 0;
    for (const auto& r : h.regions[h.expect_of[j]]) {
      slot[j].push_back(total);
      total += (r.bytes() + 255) & ~std::uint64_t{255};
    }
    check_cuda(cudaSetDevice(gpus[j]), "cudaSetDevice");
    replicas.emplace_back(std::max<std::uint64_t>(total, 256));
  }
  // What each copy moves: the bytes of rank r's shard of source i that receiver j takes, contiguous,
  // to where the first of them lands.
  struct copy_job {
    std::size_t stream;
    int from, to;
    const std::byte* src;
    std::byte* dst;
    std::uint64_t bytes;
  };
  std::vector<copy_job> jobs;
  std::vector<cudaStream_t> streams;
  for (const auto& r : ranks)
    for (std::size_t j = 0; j < gpus.size(); ++j) {
      check_cuda(cudaSetDevice(r.gpu), "cudaSetDevice");
      if (r.gpu != gpus[j]) (void)cudaDeviceEnablePeerAccess(gpus[j], 0), (void)cudaGetLastError();
      cudaStream_t s = nullptr;
      check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
      streams.push_back(s);
      for (std::size_t i = 0; i < r.refs.size(); ++i) {
        std::uint64_t bytes = 0, first = 0;
        for_each_piece(h.regions[h.expect_of[j]][i], r.offsets[i], r.refs[i].meta.nbytes(),
                       [&](std::uint64_t, std::uint64_t n, std::uint64_t pos) {
                         if (bytes == 0) first = pos;
                         bytes += n;
                       });
        if (bytes == 0) continue;
        jobs.push_back({streams.size() - 1, r.gpu, gpus[j], static_cast<const std::byte*>(r.refs[i].data),
                        static_cast<std::byte*>(replicas[j].handle()) + slot[j][i] + first, bytes});
      }
    }
  double best = 0;
  for (int rep = 0; rep <= reps; ++rep) {  // the first is a warm-up
    const auto t0 = clock_type::now();
    for (const auto& j : jobs) {
      check_cuda(cudaSetDevice(j.from), "cudaSetDevice");
      check_cuda(cudaMemcpyPeerAsync(j.dst, j.to, j.src, j.from, j.bytes, streams[j.stream]),
                 "cudaMemcpyPeerAsync (ceiling)");
    }
    for (cudaStream_t s : streams) check_cuda(cudaStreamSynchronize(s), "sync");
    const double sec = std::chrono::duration<double>(clock_type::now() - t0).count();
    if (rep > 0 && (best == 0 || sec < best)) best = sec;
  }
  for (cudaStream_t s : streams) (void)cudaStreamDestroy(s);
  return best;
}
#endif

}  // namespace refit::bench::sharded
