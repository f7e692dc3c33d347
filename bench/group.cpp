// refit-bench --streamers N: sharded trainers (issue 12). N streamers, one per trainer rank, each
// holding the Shard(0) rows of every tensor of the model (torch.chunk's split, as FSDP's), send each
// version together to --receivers R receivers, each a full replica (the colocated FSDP case: a
// streamer and a receiver per GPU with --receiver-devices spread). No all-gather: every byte moves
// once per receiver, from the rank that holds it straight into the receiver's weights (cuda_ipc
// direct: a peer write for a receiver on another GPU).
//
// The same run measures the ceiling of that pattern: every rank's shard bytes copied into a
// replica on every receiver's GPU with cudaMemcpyPeerAsync, all at once (the hardware's copy
// engines, no protocol), and reports each refit as a ratio to it. Receivers are forked children;
// after the last version each sends the version checksum of its weights, compared with the one the
// shards were filled to (the "wrong" line).
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <latch>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench.hpp"
#include "config/config.hpp"
#include "copy/copy.hpp"
#include "delta/checksum.hpp"
#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#if REFIT_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "copy/cuda_check.hpp"
#include "copy/cuda_handles.hpp"
#endif

namespace refit::bench {
namespace {

using clock_type = std::chrono::steady_clock;

/// Rows [first, first + count) of `rows` that rank r of n holds (torch.chunk).
std::pair<std::int64_t, std::int64_t> chunk_rows(std::int64_t rows, std::size_t r, std::size_t n) {
  const std::int64_t per = (rows + static_cast<std::int64_t>(n) - 1) / static_cast<std::int64_t>(n);
  const std::int64_t first = std::min<std::int64_t>(rows, per * static_cast<std::int64_t>(r));
  return {first, std::min<std::int64_t>(rows, first + per) - first};
}

std::string endpoint_of(const std::string& pattern, std::size_t rank) {
  const auto at = pattern.find("{rank}");
  return pattern.substr(0, at) + std::to_string(rank) + pattern.substr(at + 6);
}

/// One rank's shards of every tensor: their metas, where each starts in its whole tensor, and their
/// memory (host, or the rank's GPU).
struct rank_shards {
  int gpu = -1;
  std::vector<tensor_ref> refs;
  std::vector<std::uint64_t> offsets;  ///< byte offset of each shard in its whole tensor
  std::vector<std::vector<std::byte>> host;
#if REFIT_HAVE_CUDA
  std::vector<cuda::device_buffer> device;
#endif
};

/// Fills rank r's shards with the bytes the whole tensors of a run seeded `seed` have there (the
/// usual rows' fill_random), and adds their terms to `terms` (per tensor, delta::range_terms).
rank_shards make_shards(const manifest& m, std::size_t r, std::size_t n, int gpu, std::uint64_t seed,
                        std::vector<std::uint64_t>& terms) {
  rank_shards s;
  s.gpu = gpu;
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
    const std::uint64_t total = whole.nbytes();
    const std::int64_t rows = whole.shape.empty() ? 1 : whole.shape[0];
    const auto [first, count] = chunk_rows(rows, r, n);
    const std::uint64_t row = rows == 0 ? 0 : total / static_cast<std::uint64_t>(rows);
    tensor_meta local = whole;
    if (!local.shape.empty()) local.shape[0] = count;
    const std::uint64_t bytes = row * static_cast<std::uint64_t>(count);
    const std::uint64_t offset = row * static_cast<std::uint64_t>(first);
    std::byte* data = nullptr;
#if REFIT_HAVE_CUDA
    if (gpu >= 0) {
      s.device.emplace_back(std::max<std::uint64_t>(bytes, 256));
      data = static_cast<std::byte*>(s.device.back().handle());
      auto* h = static_cast<std::byte*>(staging->handle());
      for (std::uint64_t off = 0; off < bytes; off += chunk) {
        const std::uint64_t len = std::min(chunk, bytes - off);
        fill_random(h, len, tensor_seed(seed, i), offset + off);
        terms[i] += delta::range_terms(h, offset + off, len, total);
        check_cuda(cudaMemcpy(data + off, h, len, cudaMemcpyHostToDevice), "--streamers: filling the shards");
      }
    }
#endif
    if (gpu < 0) {
      s.host.emplace_back(std::max<std::uint64_t>(bytes, 1));
      data = s.host.back().data();
      fill_random(data, bytes, tensor_seed(seed, i), offset);
      terms[i] += delta::range_terms(data, offset, bytes, total);
    }
    tensor_ref ref{local, data, gpu >= 0 ? device::cuda(gpu) : device::cpu(), nullptr};
    if (!whole.shape.empty()) ref.shard = tensor_shard{whole.shape, 0, first};
    s.refs.push_back(std::move(ref));
    s.offsets.push_back(offset);
  }
  return s;
}

/// The receiver child: a full replica (a parameter table of the model on `gpu`, or in host memory),
/// one lane per streamer; says "ready", serves until `in` is readable, then writes the version
/// checksum of its weights and its committed version to `out`.
[[noreturn]] void receiver_child(const manifest& m, const std::string& pattern, std::size_t n, int in, int out,
                                 int gpu) {
  int code = 0;
  try {
    receiver_options o;
    o.endpoint = pattern;
    o.streamers = n;
    o.idle_timeout = milliseconds{120000};
    o.device = gpu < 0 ? 0 : gpu;
    receiver r(o);
    std::vector<std::vector<std::byte>> host;
#if REFIT_HAVE_CUDA
    std::vector<cuda::device_buffer> on_device;
    if (gpu >= 0) check_cuda(cudaSetDevice(gpu), "cudaSetDevice");
#endif
    for (const auto& e : m.entries) {
#if REFIT_HAVE_CUDA
      if (gpu >= 0) {
        on_device.emplace_back(std::max<std::uint64_t>(e.meta.nbytes(), 256));
        check_cuda(cudaMemset(on_device.back().handle(), 0, e.meta.nbytes()), "cudaMemset");
        r.add_parameter(tensor_dest{e.meta, on_device.back().handle(), device::cuda(gpu)});
        continue;
      }
#endif
      host.emplace_back(std::max<std::uint64_t>(e.meta.nbytes(), 1));
      r.add_parameter(tensor_dest{e.meta, host.back().data(), device::cpu()});
    }
    if (::write(out, "ready\n", 6) < 0) code = 1;
    for (;;) {
      (void)r.serve_one(milliseconds{20});
      pollfd p{in, POLLIN, 0};
      if (::poll(&p, 1, 0) > 0) break;
    }
    std::uint64_t sum = 0;
    for (std::size_t k = 0; k < m.entries.size(); ++k) {
      const std::uint64_t bytes = m.entries[k].meta.nbytes();
#if REFIT_HAVE_CUDA
      if (gpu >= 0) {
        sum += delta::name_weight(m.entries[k].meta.name) *
               copy::checksum(on_device[k].handle(), bytes, device::cuda(gpu));
        continue;
      }
#endif
      sum += delta::name_weight(m.entries[k].meta.name) * copy::checksum(host[k].data(), bytes);
    }
    const std::string line = fmt::format("{} {}\n", sum, r.committed_version().value_or(0));
    if (::write(out, line.data(), line.size()) < 0) code = 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "refit-bench group receiver: %s\n", e.what());
    code = 1;
  }
  std::_Exit(code);
}

/// A line from `fd` (blocking), without its newline.
std::string read_line(int fd) {
  std::string line;
  char ch = 0;
  while (::read(fd, &ch, 1) == 1 && ch != '\n') line.push_back(ch);
  return line;
}

#if REFIT_HAVE_CUDA
/// The ceiling: every rank's shard bytes copied into a replica on every receiver's GPU, all at once,
/// with cudaMemcpyPeerAsync from each rank's GPU (one stream per rank and receiver). Best of `reps`;
/// seconds.
double peer_pattern_seconds(const manifest& m, const std::vector<rank_shards>& ranks, const std::vector<int>& gpus,
                            int reps) {
  std::vector<cuda::device_buffer> replicas;
  std::vector<std::uint64_t> whole_offset;
  std::uint64_t total = 0;
  for (const auto& e : m.entries) {
    whole_offset.push_back(total);
    total += (e.meta.nbytes() + 255) & ~std::uint64_t{255};
  }
  for (const int g : gpus) {
    check_cuda(cudaSetDevice(g), "cudaSetDevice");
    replicas.emplace_back(std::max<std::uint64_t>(total, 256));
  }
  std::vector<cudaStream_t> streams;
  for (const auto& r : ranks)
    for (std::size_t j = 0; j < gpus.size(); ++j) {
      check_cuda(cudaSetDevice(r.gpu), "cudaSetDevice");
      if (r.gpu != gpus[j]) (void)cudaDeviceEnablePeerAccess(gpus[j], 0), (void)cudaGetLastError();
      cudaStream_t s = nullptr;
      check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
      streams.push_back(s);
    }
  double best = 0;
  for (int rep = 0; rep <= reps; ++rep) {  // the first is a warm-up
    const auto t0 = clock_type::now();
    std::size_t k = 0;
    for (const auto& r : ranks) {
      check_cuda(cudaSetDevice(r.gpu), "cudaSetDevice");
      for (std::size_t j = 0; j < gpus.size(); ++j, ++k)
        for (std::size_t i = 0; i < r.refs.size(); ++i) {
          const std::uint64_t bytes = r.refs[i].meta.nbytes();
          if (bytes == 0) continue;
          auto* dst = static_cast<std::byte*>(replicas[j].handle()) + whole_offset[i] + r.offsets[i];
          check_cuda(cudaMemcpyPeerAsync(dst, gpus[j], r.refs[i].data, r.gpu, bytes, streams[k]),
                     "cudaMemcpyPeerAsync (ceiling)");
        }
    }
    for (std::size_t s = 0; s < streams.size(); ++s) check_cuda(cudaStreamSynchronize(streams[s]), "sync");
    const double sec = std::chrono::duration<double>(clock_type::now() - t0).count();
    if (rep > 0 && (best == 0 || sec < best)) best = sec;
  }
  for (cudaStream_t s : streams) (void)cudaStreamDestroy(s);
  return best;
}
#endif

}  // namespace

int run_group(const config& c, std::ostream& out) {
  const std::size_t n = c.streamers;
  const bool gpu = c.transports.size() == 1 && c.transports[0] == transport_kind::cuda_ipc;
  if (c.transports.size() != 1 || (c.transports[0] != transport_kind::host_shm && !gpu) || (gpu && !REFIT_HAVE_CUDA))
    throw error(errc::invalid_argument, "--streamers: --transport host_shm, or cuda_ipc (in a build with CUDA)");
  if (c.models.size() != 1 || !c.manifest_file.empty())
    throw error(errc::invalid_argument, "--streamers: exactly one built-in --model");
  if (c.layout != layout_kind::plain)
    throw error(errc::invalid_argument,
                fmt::format("--streamers with --layout {}: the receivers of a group are full replicas (plain) for "
                            "now; the library takes a group into engine layouts (tests/unit/test_group.cpp), the bench "
                            "does not",
                            layout_name(c.layout)));
  if (!gpu && c.receivers != 1)
    throw error(errc::invalid_argument, "--streamers with host_shm: one receiver (--receivers 1)");
  const manifest m = preset(c.models[0], c.type);
  const std::size_t receivers = c.receivers;
  const std::string base = fmt::format("ipc:///tmp/refit-bench-group-{}", ::getpid());

  // The receivers are forked before this process touches CUDA or opens a socket.
  std::vector<int> to_child(receivers), from_child(receivers);
  std::vector<pid_t> pids;
  for (std::size_t j = 0; j < receivers; ++j) {
    int down[2], up[2];
    if (::pipe(down) != 0 || ::pipe(up) != 0) throw error(errc::io, "--streamers: pipe() failed");
    const pid_t pid = ::fork();
    if (pid < 0) throw error(errc::io, "--streamers: fork() failed");
    if (pid == 0) {
      ::close(down[1]);
      ::close(up[0]);
      const int visible = gpu ? visible_gpus() : 0;
      const int g = !gpu                 ? -1
                    : c.spread_receivers ? static_cast<int>((static_cast<std::size_t>(c.device) + j) %
                                                            static_cast<std::size_t>(std::max(visible, 1)))
                                         : c.device;
      receiver_child(m, fmt::format("{}-{}-{{rank}}", base, j), n, down[0], up[1], g);
    }
    ::close(down[0]);
    ::close(up[1]);
    to_child[j] = down[1];
    from_child[j] = up[0];
    pids.push_back(pid);
  }
  const auto progress = [&](const std::string& s) {
    if (!c.quiet) std::fprintf(stderr, "refit-bench: %s\n", s.c_str());
  };
  for (std::size_t j = 0; j < receivers; ++j)
    if (read_line(from_child[j]) != "ready") throw error(errc::io, "--streamers: a receiver did not start");

  const int visible = gpu ? visible_gpus() : 0;
  const auto place = [&](std::size_t k) {
    if (!gpu) return -1;
    if (!c.spread_receivers) return c.device;
    return static_cast<int>((static_cast<std::size_t>(c.device) + k) % static_cast<std::size_t>(std::max(visible, 1)));
  };
  std::vector<int> receiver_gpus;
  for (std::size_t j = 0; j < receivers; ++j) receiver_gpus.push_back(place(j));

  progress(fmt::format("--streamers {}: filling {} ({:.2f} GB) as {} shards", n, m.name, m.bytes() / 1e9, n));
  std::vector<std::uint64_t> terms(m.entries.size(), 0);
  std::vector<rank_shards> ranks;
  for (std::size_t r = 0; r < n; ++r) ranks.push_back(make_shards(m, r, n, place(r), c.seed, terms));
  std::uint64_t expected = 0;
  for (std::size_t i = 0; i < m.entries.size(); ++i)
    expected += delta::name_weight(m.entries[i].meta.name) * (m.entries[i].meta.nbytes() + terms[i]);

  const bool direct = c.direct.empty() || c.direct.front();
  std::vector<std::unique_ptr<streamer>> streamers;
  for (std::size_t r = 0; r < n; ++r) {
    streamer_options so;
    so.transport = gpu ? transport_kind::cuda_ipc : transport_kind::host_shm;
    for (std::size_t j = 0; j < receivers; ++j)
      so.receivers.push_back(endpoint_of(fmt::format("{}-{}-{{rank}}", base, j), r));
    so.endpoint = so.receivers.front();
    so.direct = direct;
    so.control_lane = c.lane;
    so.device = std::max(place(r), 0);
    so.buffer_bytes = static_cast<std::uint64_t>(c.buffer_mb.at(0) * (1 << 20));
    so.buffer_count = c.buffer_counts.at(0);
    so.timeout = milliseconds{static_cast<std::int64_t>(c.timeout_ms)};
    so.group_rank = r;
    so.group_size = n;
    streamers.push_back(std::make_unique<streamer>(so));
  }

  double ceiling = 0;
  std::string ceiling_what;
#if REFIT_HAVE_CUDA
  if (gpu) {
    progress("--streamers: measuring the ceiling (every shard copied into every replica, all at once)");
    ceiling = peer_pattern_seconds(m, ranks, receiver_gpus, 3);
    ceiling_what = "cudaMemcpyPeerAsync of every rank's shards into a replica on every receiver's GPU, all at once";
  }
#endif
  if (!gpu) {
    ceiling = static_cast<double>(m.bytes()) / host_memcpy_bandwidth(std::min<std::uint64_t>(m.bytes(), 1ull << 30));
    ceiling_what = "one memcpy of the model's bytes on one thread";
  }

  out << fmt::format(
      "# refit-bench --streamers {}: {} ({} tensors, {:.3f} GB {}), Shard(0) rows per rank (torch.chunk)\n", n, m.name,
      m.entries.size(), m.bytes() / 1e9, to_string(c.type));
  std::string where_s, where_r;
  for (std::size_t r = 0; r < n; ++r) where_s += (r ? "," : "") + (gpu ? fmt::format("cuda:{}", place(r)) : "cpu");
  for (std::size_t j = 0; j < receivers; ++j)
    where_r += (j ? "," : "") + (gpu ? fmt::format("cuda:{}", receiver_gpus[j]) : "cpu");
  out << fmt::format("# {} {}, streamers on {}, {} receiver(s) (full replicas) on {}, {} x {} MiB buffers\n",
                     gpu ? "cuda_ipc" : "host_shm",
                     !gpu     ? "(staged)"
                     : direct ? "direct"
                              : "staged",
                     where_s, receivers, where_r, c.buffer_counts.at(0), c.buffer_mb.at(0));
  out << fmt::format("# ceiling: {}: {:.2f} ms\n", ceiling_what, ceiling * 1e3);
  out << fmt::format("{:>8} {:>8} {:>10} {:>10} {:>10} {:>8}\n", "version", "counted", "time", "slowest", "GB/s",
                     "ceil/t");
  out << fmt::format("{:>8} {:>8} {:>10} {:>10} {:>10} {:>8}\n", "", "", "(ms)", "rank(ms)", "(replica)", "");

  std::vector<double> times;
  std::uint64_t version = 0;
  for (int it = 0; it < c.warmup + c.iters; ++it) {
    ++version;
    std::latch go(static_cast<std::ptrdiff_t>(n) + 1);
    std::vector<std::optional<std::string>> failed(n);
    std::vector<double> rank_ms(n, 0);
    std::vector<std::thread> threads;
    for (std::size_t r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        go.arrive_and_wait();
        try {
          rank_ms[r] = streamers[r]->refit(version, ranks[r].refs).seconds * 1e3;
        } catch (const std::exception& e) {
          failed[r] = e.what();
        }
      });
    go.count_down();
    go.wait();
    const auto t0 = clock_type::now();
    for (auto& t : threads) t.join();
    const double ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
    for (std::size_t r = 0; r < n; ++r)
      if (failed[r])
        throw error(errc::internal, fmt::format("--streamers: rank {} failed version {}: {}", r, version, *failed[r]));
    const bool counted = it >= c.warmup;
    if (counted) times.push_back(ms);
    out << fmt::format("{:>8} {:>8} {:>10.2f} {:>10.2f} {:>10.2f} {:>8.3f}\n", version, counted ? "yes" : "warm-up", ms,
                       *std::max_element(rank_ms.begin(), rank_ms.end()), m.bytes() / (ms * 1e6), ceiling * 1e3 / ms);
    out.flush();
  }
  for (auto& s : streamers) s->close();

  int wrong = 0;
  for (std::size_t j = 0; j < receivers; ++j) {
    if (::write(to_child[j], "x", 1) < 0) throw error(errc::io, "--streamers: cannot stop a receiver");
    const std::string line = read_line(from_child[j]);
    int status = 0;
    ::waitpid(pids[j], &status, 0);
    std::uint64_t sum = 0, v = 0;
    const bool right = std::sscanf(line.c_str(), "%lu %lu", &sum, &v) == 2 && sum == expected && v == version;
    wrong += right ? 0 : 1;
  }
  const double med = median(times);
  out << fmt::format("# median {:.2f} ms = {:.3f} x the ceiling {:.2f} ms ({:.2f} GB/s per replica)\n", med,
                     ceiling > 0 ? med / (ceiling * 1e3) : 0.0, ceiling * 1e3, m.bytes() / (med * 1e6));
  out << fmt::format("# out of bounds/wrong values: {} (receivers whose version checksum after version {} differs)\n",
                     wrong, version);
  return wrong == 0 ? 0 : 1;
}

}  // namespace refit::bench
