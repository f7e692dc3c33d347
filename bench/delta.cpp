// refit-bench --delta STEPS: delta versions against whole ones, host_shm, cuda_ipc staged or nccl
// buffered.
//
// The trainer keeps fp32 master weights and sends their bf16 rounding. Each step adds an fp32
// update of relative size --delta-update (uniform in [-u, u] times the weight's magnitude) and
// rounds again, so the fraction of bf16 elements that change is what such an update gives (about
// 2 % at the default; printed per row, with the fraction of 256- and 4096-byte blocks touched,
// which is why patches are (index, value) records: lib/delta/patch.hpp). The same run first times
// whole refits of the model by a plain streamer (the "whole" rows), then a delta streamer's first
// (whole) refit and STEPS deltas, each after one update (not timed). The receiver is a child
// process with a parameter table of host tensors (device tensors over cuda_ipc and nccl); after the
// last version it sends the version checksum of its weights, compared with the trainer's (the
// "wrong" column). Over nccl the whole rows are in place (the fastest whole refit there), the
// deltas buffered (patches travel in the buffers, and only they cross the link).
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench/bench.hpp"
#include "bench/roles.hpp"
#include "bench/spawn.hpp"
#include "config/config.hpp"
#include "copy/copy.hpp"
#include "delta/checksum.hpp"
#include "delta/pool.hpp"
#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "refit/version.hpp"
#if REFIT_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "copy/cuda_check.hpp"
#include "copy/cuda_handles.hpp"
#endif

namespace refit::bench {
namespace {

std::uint16_t to_bf16(float f) noexcept {  // round to nearest even, as torch does
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<std::uint16_t>(u >> 16);
}

/// Leaves the elements of a vector(n) uninitialised (trivial types): the trainer's arrays are first
/// written by its pool, in parallel, instead of zeroed on one thread first (183 GB for
/// qwen3-30b-a3b's masters and weights: minutes).
template <class T>
struct uninit_allocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = uninit_allocator<U>;
  };
  uninit_allocator() noexcept = default;
  template <class U>
  uninit_allocator(const uninit_allocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
template <class T>
using raw_vector = std::vector<T, uninit_allocator<T>>;

#if REFIT_HAVE_CUDA
/// Tensors of `sizes` bytes in one device allocation, each at a multiple of 256 bytes: thousands of
/// small ones (qwen3-30b-a3b's 3 MiB experts) would each round up to whole 2 MiB pages, and its
/// weights and the streamer's base would not fit one H200 beside each other.
struct device_arena {
  cuda::device_buffer memory;
  std::vector<void*> at;
  explicit device_arena(const std::vector<std::uint64_t>& sizes) {
    std::vector<std::uint64_t> offsets;
    std::uint64_t total = 0;
    for (const std::uint64_t n : sizes) {
      offsets.push_back(total);
      total += (std::max<std::uint64_t>(n, 1) + 255) / 256 * 256;
    }
    memory = cuda::device_buffer(std::max<std::uint64_t>(total, 256));
    for (const std::uint64_t o : offsets) at.push_back(static_cast<std::byte*>(memory.handle()) + o);
  }
};
#endif

/// The trainer: fp32 masters and their bf16 copies, one of each per tensor, made and stepped on a
/// pool of threads (a llama3-8b step is 8 G elements: minutes on one). Every chunk of
/// `chunk_elements` of a tensor draws from a random stream of its own, seeded by the step, the
/// tensor and the chunk, so the versions do not depend on the threads.
struct trainer {
  /// Elements of a chunk: whole 4 KiB blocks of bf16 (the block statistics stay exact).
  static constexpr std::uint64_t chunk_elements = 1u << 20;

  std::vector<tensor_meta> metas;
  std::vector<raw_vector<float>> master;
  std::vector<raw_vector<std::uint16_t>> weights;
  /// Every chunk: its tensor and first element (made once: the tensors keep their sizes).
  std::vector<std::pair<std::size_t, std::uint64_t>> chunks;
  delta::worker_pool pool;

  /// xorshift64 from a seed of (step, tensor, chunk), through splitmix64 so that near seeds differ.
  struct stream {
    std::uint64_t state;
    stream(std::uint64_t step, std::uint64_t tensor, std::uint64_t chunk) noexcept {
      std::uint64_t z = step * 0x9e3779b97f4a7c15ull ^ (tensor << 32) ^ chunk;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      state = (z ^ (z >> 31)) | 1;
    }
    float uniform() noexcept {  // in [-1, 1)
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      return static_cast<float>(static_cast<std::int64_t>(state) >> 11) * (1.0f / 4503599627370496.0f);
    }
  };

  /// Runs body(chunk, tensor, first element, end element) over every chunk on the pool.
  template <class Body>
  void each_chunk(Body&& body) {
    pool.run(chunks.size(), [&](std::size_t j) {
      const auto [k, b] = chunks[j];
      body(j, k, b, std::min<std::uint64_t>(master[k].size(), b + chunk_elements));
    });
  }

  trainer(const manifest& m, std::size_t threads) : pool(delta::pool_threads(threads)) {
    for (const auto& e : m.entries) {
      metas.push_back(e.meta);
      master.emplace_back(e.meta.numel());
      weights.emplace_back(e.meta.numel());
    }
    for (std::size_t k = 0; k < master.size(); ++k)
      for (std::uint64_t b = 0; b < master[k].size(); b += chunk_elements) chunks.emplace_back(k, b);
    each_chunk([&](std::size_t, std::size_t k, std::uint64_t b, std::uint64_t end) {
      stream r(0, k, b / chunk_elements);
      for (std::uint64_t i = b; i < end; ++i) {
        master[k][i] = 0.02f * r.uniform();
        weights[k][i] = to_bf16(master[k][i]);
      }
    });
  }

  struct changes {
    std::uint64_t elements = 0, changed = 0, blocks256 = 0, touched256 = 0, blocks4k = 0, touched4k = 0;
  };

  /// Optimizer step `step` (from 1): w += u · |w| · U[-1, 1), then bf16 again.
  changes step(std::uint64_t step, double u) {
    std::vector<changes> parts(chunks.size());
    const float s = static_cast<float>(u);
    each_chunk([&](std::size_t j, std::size_t k, std::uint64_t first, std::uint64_t last) {
      changes& c = parts[j];
      stream r(step, k, first / chunk_elements);
      raw_vector<float>& m = master[k];
      raw_vector<std::uint16_t>& w = weights[k];
      bool touched4k = false;
      for (std::uint64_t b = first; b < last; b += 128) {  // 128 bf16 = 256 bytes
        bool touched = false;
        const std::uint64_t end = std::min<std::uint64_t>(last, b + 128);
        for (std::uint64_t i = b; i < end; ++i) {
          m[i] += s * std::fabs(m[i]) * r.uniform();
          const std::uint16_t v = to_bf16(m[i]);
          if (v != w[i]) {
            w[i] = v;
            ++c.changed;
            touched = true;
          }
        }
        ++c.blocks256;
        c.touched256 += touched ? 1 : 0;
        touched4k = touched4k || touched;
        if ((b / 128) % 16 == 15 || end == last) {
          ++c.blocks4k;
          c.touched4k += touched4k ? 1 : 0;
          touched4k = false;
        }
      }
      c.elements += last - first;
    });
    changes total;
    for (const changes& c : parts) {
      total.elements += c.elements, total.changed += c.changed, total.blocks256 += c.blocks256;
      total.touched256 += c.touched256, total.blocks4k += c.blocks4k, total.touched4k += c.touched4k;
    }
    return total;
  }

  [[nodiscard]] std::vector<tensor_ref> refs() {
    std::vector<tensor_ref> out;
#if REFIT_HAVE_CUDA
    if (on_device) {  // cuda_ipc and nccl: the bf16 weights uploaded (not timed) to the GPU
      for (std::size_t k = 0; k < metas.size(); ++k) {
        check_cuda(cudaMemcpy(on_device->at[k], weights[k].data(), weights[k].size() * 2, cudaMemcpyHostToDevice),
                   "--delta: uploading the weights");
        out.push_back(tensor_ref{metas[k], on_device->at[k], device::cuda(gpu), nullptr});
      }
      return out;
    }
#endif
    for (std::size_t k = 0; k < metas.size(); ++k)
      out.push_back(tensor_ref{metas[k], weights[k].data(), device::cpu(), nullptr});
    return out;
  }
#if REFIT_HAVE_CUDA
  std::optional<device_arena> on_device;
  int gpu = 0;
  void to_device(int d) {
    gpu = d;
    check_cuda(cudaSetDevice(d), "cudaSetDevice");
    std::vector<std::uint64_t> sizes;
    for (const auto& w : weights) sizes.push_back(w.size() * 2);
    on_device.emplace(sizes);
  }
#endif

  [[nodiscard]] std::uint64_t checksum() const {
    std::uint64_t sum = 0;
    for (std::size_t k = 0; k < metas.size(); ++k)
      sum += delta::name_weight(metas[k].name) * copy::checksum(weights[k].data(), weights[k].size() * 2);
    return sum;
  }
};

/// The GPU of the nccl receiver: the next after the streamer's (--nccl-share-gpus: modulo the GPUs
/// visible, so possibly the streamer's). Throws errc::invalid_argument when there is none.
int nccl_receiver_gpu(const config& c) {
  const int visible = visible_gpus();
  if (visible < (c.nccl_share_gpus ? 1 : 2))
    throw error(errc::invalid_argument,
                fmt::format("--delta over nccl: {} GPU(s) visible; the receiver needs a GPU of its own besides the "
                            "streamer's (or --nccl-share-gpus)",
                            visible));
  return receiver_device(c.device, 0, visible);
}

/// The GPU of the receiver over a GPU transport: nccl's (nccl_receiver_gpu), or cuda_ipc's
/// (--receiver-device's, else the streamer's: cuda_ipc_placement, which refuses one not visible).
/// Both count the visible GPUs, so the parent asks only after forking.
int delta_receiver_gpu(const config& c) {
  if (c.transports.front() == transport_kind::nccl) return nccl_receiver_gpu(c);
  return cuda_ipc_placement(c, visible_gpus()).receivers.front();
}

/// The receiver child: a parameter table of the model; serves until told to stop on `in`, then writes
/// the version checksum of its weights and its committed version to `out`. `gpu` -2: the receiver's
/// GPU (delta_receiver_gpu), asked here, since the parent must not use CUDA before forking.
[[noreturn]] void receiver_child(const config& c, const manifest& m, const std::string& endpoint, int in, int out,
                                 int gpu, std::size_t threads) {
  int code = 0;
  try {
    if (gpu == -2) {
      if (c.transports.front() == transport_kind::nccl)
        claim_nccl_host(false);  // a host of its own when ranks share GPUs
      gpu = delta_receiver_gpu(c);
    }
    receiver_options o;
    o.endpoint = endpoint;
    o.idle_timeout = milliseconds{120000};
    o.device = gpu < 0 ? 0 : gpu;
    o.delta_threads = threads;
    o.stage = c.stage;  // --stage: each version applied as soon as it is prepared, its pause kept
    receiver r(o);
    std::vector<double> pauses;  // ms, in version order
    std::vector<std::vector<std::uint16_t>> weights;
#if REFIT_HAVE_CUDA
    std::optional<device_arena> on_device;
    if (gpu >= 0) {
      check_cuda(cudaSetDevice(gpu), "cudaSetDevice");
      std::vector<std::uint64_t> sizes;
      for (const auto& e : m.entries) sizes.push_back(e.meta.nbytes());
      on_device.emplace(sizes);
    }
#endif
    for (const auto& e : m.entries) {
      // Host weights only for a host table (a GPU receiver of qwen3-30b-a3b would zero 61 GB for nothing).
      weights.emplace_back(gpu >= 0 ? 0 : e.meta.numel());
#if REFIT_HAVE_CUDA
      if (gpu >= 0) {
        r.add_parameter(tensor_dest{e.meta, on_device->at[weights.size() - 1], device::cuda(gpu)});
        continue;
      }
#endif
      r.add_parameter(tensor_dest{e.meta, weights.back().data(), device::cpu()});
    }
    for (;;) {
      if (r.serve_one(milliseconds{20}) == receiver_event::prepared && r.apply_prepared())
        pauses.push_back(r.last_stats().pause_seconds * 1e3);
      pollfd p{in, POLLIN, 0};
      if (::poll(&p, 1, 0) > 0) break;
    }
    std::uint64_t sum = 0;
    for (std::size_t k = 0; k < weights.size(); ++k) {
#if REFIT_HAVE_CUDA
      if (gpu >= 0) {
        sum += delta::name_weight(m.entries[k].meta.name) *
               copy::checksum(on_device->at[k], m.entries[k].meta.nbytes(), device::cuda(gpu));
        continue;
      }
#endif
      sum += delta::name_weight(m.entries[k].meta.name) * copy::checksum(weights[k].data(), weights[k].size() * 2);
    }
    write_line(out, fmt::format("{} {} {}", sum, r.committed_version().value_or(0), fmt::join(pauses, " ")));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "refit-bench delta receiver: %s\n", e.what());
    code = 1;
  }
  std::_Exit(code);
}

struct delta_row {
  std::string kind;
  std::string step;
  double changed = 0, touched256 = 0, touched4k = 0;  // fractions
  std::uint64_t wire = 0, version_bytes = 0;
  double ms = 0, diff_ms = 0;
  std::uint64_t batches = 0;
  double wait_ms = 0;  ///< the streamer waiting for the receiver's replies
};

void write_delta_row(std::ostream& out, const delta_row& r, double whole_ms) {
  out << fmt::format(
      "{:>14} {:>6} {:>8.3f} {:>8.2f} {:>8.2f} {:>12} {:>7.3f} {:>9.2f} {:>9.2f} {:>7.3f} {:>7} {:>9.2f}\n", r.kind,
      r.step, 100 * r.changed, 100 * r.touched256, 100 * r.touched4k, r.wire,
      r.version_bytes != 0 ? static_cast<double>(r.wire) / static_cast<double>(r.version_bytes) : 0.0, r.ms, r.diff_ms,
      whole_ms > 0 ? r.ms / whole_ms : 0.0, r.batches, r.wait_ms);
}

/// The transport --delta runs over: host_shm, or a GPU one (cuda_ipc; nccl when `nccl`).
struct delta_transport {
  bool gpu = false;
  bool nccl = false;
};

delta_transport check_delta(const config& c) {
  const bool nccl = c.transports.size() == 1 && c.transports[0] == transport_kind::nccl;
  const bool gpu = c.transports.size() == 1 && (c.transports[0] == transport_kind::cuda_ipc || nccl);
  if (c.transports.size() != 1 || (c.transports[0] != transport_kind::host_shm && !gpu) || (gpu && !REFIT_HAVE_CUDA) ||
      (nccl && !has_transport(transport_kind::nccl)))
    throw error(errc::invalid_argument,
                "--delta: --transport host_shm, or cuda_ipc or nccl (buffers, in a build with CUDA, and NCCL)");
  if (c.models.size() != 1 || !c.manifest_file.empty())
    throw error(errc::invalid_argument, "--delta: exactly one built-in --model");
  return {gpu, nccl};
}

/// The plain streamer's options (the whole rows): cuda_ipc staged, the path deltas take (and the
/// whole rows too); nccl in place.
streamer_options whole_options(const config& c, const delta_transport& t, const std::string& endpoint) {
  streamer_options so = streamer_options_for(c, c.transports[0], c.buffer_mb.at(0), c.buffer_counts.at(0));
  if (t.nccl)
    so.receivers = {endpoint};
  else
    so.endpoint = endpoint;
  so.direct = t.nccl;
  return so;
}

/// The delta streamer's: patches travel in the buffers.
streamer_options delta_options_of(const config& c, const delta_transport& t, streamer_options so) {
  so.delta.enable = true;
  so.direct = false;
  so.delta.memory = t.gpu ? delta_memory::device : delta_memory::host;
  so.delta.threads = c.delta_threads;
  so.delta.batch_bytes = static_cast<std::uint64_t>(c.delta_batch_mb * (1 << 20));
  return so;
}

void write_delta_preamble(std::ostream& out, const config& c, const manifest& m, const delta_transport& t, int rx_gpu,
                          std::size_t buffers) {
  const std::string where =
      t.nccl
          ? fmt::format("nccl from cuda:{} to cuda:{}{}: whole rows in place, deltas buffered, base in device memory",
                        c.device, rx_gpu,
                        c.nccl_share_gpus ? " (--nccl-share-gpus: NCCL's network transport over loopback)" : "")
      : t.gpu ? (rx_gpu == c.device
                     ? fmt::format("cuda_ipc staged on cuda:{}, base in device memory", c.device)
                     : fmt::format("cuda_ipc staged from cuda:{} to cuda:{}, base in device memory", c.device, rx_gpu))
              : std::string("host_shm");
  out << fmt::format("# refit-bench --delta {}: {} ({} tensors, {:.3f} GB bf16), {}, {} x {} MiB buffers\n",
                     c.delta_steps, m.name, m.entries.size(), m.bytes() / 1e9, where, buffers, c.buffer_mb.at(0));
  out << fmt::format(
      "# update per step: fp32 w += {:g} * |w| * U[-1, 1), rounded to bf16; whole rows: a plain "
      "streamer, {} counted refits after {} warm-up; host diff and apply threads: {}; a delta batch covers {}\n",
      c.delta_update, c.iters, c.warmup, delta::pool_threads(c.delta_threads),
      c.delta_batch_mb > 0
          ? fmt::format("{:g} MiB of tensors", c.delta_batch_mb)
          : fmt::format("{} MiB of tensors (the default)", std::max(32.0, (t.gpu ? 4 : 1) * c.buffer_mb.at(0))));
  // diff: the streamer comparing with its base (on a GPU: the diff kernels and the waits for them);
  // wait: the streamer waiting for the receiver's replies; batches: BATCH round trips.
  out << fmt::format("{:>14} {:>6} {:>8} {:>8} {:>8} {:>12} {:>7} {:>9} {:>9} {:>7} {:>7} {:>9}\n", "row", "step",
                     "changed", "blk256", "blk4k", "wire", "wire/v", "time", "diff", "/whole", "batches", "wait");
  out << fmt::format("{:>14} {:>6} {:>8} {:>8} {:>8} {:>12} {:>7} {:>9} {:>9} {:>7} {:>7} {:>9}\n", "", "", "(%)",
                     "(%)", "(%)", "(B)", "", "(ms)", "(ms)", "", "", "(ms)");
}

/// The whole rows: a plain streamer's counted refits; their median.
double whole_rows(const config& c, const streamer_options& so, trainer& t, std::uint64_t& version, std::ostream& out) {
  std::vector<double> whole_ms;
  streamer plain(so);
  for (int i = 0; i < c.warmup + c.iters; ++i) {
    const auto refs = t.refs();
    const refit_stats s = plain.refit(++version, refs);
    if (i < c.warmup) continue;
    whole_ms.push_back(s.seconds * 1e3);
    write_delta_row(out,
                    delta_row{"whole", std::to_string(i - c.warmup), 0, 0, 0, s.bytes, s.tensor_bytes, s.seconds * 1e3,
                              0, s.batches, s.wait_seconds * 1e3},
                    0);
  }
  plain.close();
  const double whole = median(whole_ms);
  out << fmt::format("{:>14} {:>6} {:>8} {:>8} {:>8} {:>12} {:>7} {:>9.2f}\n", "whole median", "", "", "", "", "", "",
                     whole);
  return whole;
}

/// The delta streamer's first (whole) refit, then one delta per step after an update. Their times and
/// the fraction of each version that crossed the wire go to `delta_ms` and `wire_fraction`.
void delta_rows(const config& c, const streamer_options& so, trainer& t, std::uint64_t& version, double whole,
                std::ostream& out, std::vector<double>& delta_ms, std::vector<double>& wire_fraction) {
  streamer ds(so);
  {
    const auto refs = t.refs();
    const refit_stats s = ds.refit(++version, refs);
    write_delta_row(out,
                    delta_row{"delta-first", "0", 1, 1, 1, s.bytes, s.tensor_bytes, s.seconds * 1e3,
                              s.diff_seconds * 1e3, s.batches, s.wait_seconds * 1e3},
                    whole);
    out.flush();
  }
  for (int step = 1; step <= c.delta_steps; ++step) {
    const auto ch = t.step(static_cast<std::uint64_t>(step), c.delta_update);
    const auto refs = t.refs();
    const refit_stats s = ds.refit(++version, refs);
    delta_row r{s.delta ? "delta" : "delta(whole)",
                std::to_string(step),
                static_cast<double>(ch.changed) / static_cast<double>(ch.elements),
                static_cast<double>(ch.touched256) / static_cast<double>(ch.blocks256),
                static_cast<double>(ch.touched4k) / static_cast<double>(ch.blocks4k),
                s.bytes,
                s.tensor_bytes,
                s.seconds * 1e3,
                s.diff_seconds * 1e3,
                s.batches,
                s.wait_seconds * 1e3};
    delta_ms.push_back(r.ms);
    wire_fraction.push_back(static_cast<double>(s.bytes) / static_cast<double>(s.tensor_bytes));
    write_delta_row(out, r, whole);
    out.flush();
  }
  ds.close();
}

/// Stops the receiver and compares the version checksum of its weights with the trainer's, at `version`.
/// `pauses`: what the receiver said after them (--stage: each version's apply_prepared(), in ms).
bool receiver_matches(forked_child& rx, const trainer& t, std::uint64_t version, std::string& pauses) {
  write_line(rx.to, "x");
  const std::string line = read_line(rx.from);
  const auto second = line.find(' ', line.find(' ') + 1);
  pauses = second == std::string::npos ? std::string() : line.substr(second + 1);
  (void)reap(rx);
  std::uint64_t their_sum = 0, their_version = 0;
  const bool parsed = std::sscanf(line.c_str(), "%lu %lu", &their_sum, &their_version) == 2;
  return parsed && their_sum == t.checksum() && their_version == version;
}

}  // namespace

int run_delta(const config& c, std::ostream& out) {
  const delta_transport dt = check_delta(c);
  const manifest m = preset(c.models[0], dtype::bf16);
  const std::string endpoint = fmt::format("ipc:///tmp/refit-bench-delta-{}.sock", ::getpid());

  // The receiver is forked before this process opens any socket.
  forked_child rx = fork_child(
      "--delta", [&](int in, int up) { receiver_child(c, m, endpoint, in, up, dt.gpu ? -2 : -1, c.delta_threads); });
  // Asked at once, so that a receiver GPU that is not there stops the run before the model is made.
  const int rx_gpu = dt.gpu ? delta_receiver_gpu(c) : -1;

  progress(c, fmt::format("--delta: making {} ({:.2f} GB bf16, fp32 masters)", m.name, m.bytes() / 1e9));
  // The trainer's step is not timed: it takes every hardware thread (a llama3-8b step took ~7 s on 8 of a
  // 64-core node, most of a 20-step run), not --delta-threads, which sizes the streamer's diff.
  trainer t(m, std::min<std::size_t>(delta::max_threads, std::max(1u, std::thread::hardware_concurrency())));
#if REFIT_HAVE_CUDA
  if (dt.gpu) t.to_device(c.device);
#endif
  const streamer_options so = whole_options(c, dt, endpoint);
  write_delta_preamble(out, c, m, dt, rx_gpu, so.buffer_count);

  std::uint64_t version = 0;
  const double whole = whole_rows(c, so, t, version, out);
  std::vector<double> delta_ms, wire_fraction;
  delta_rows(c, delta_options_of(c, dt, so), t, version, whole, out, delta_ms, wire_fraction);

  // Verification: the receiver's weights against the trainer's last version.
  std::string pauses;
  const bool right = receiver_matches(rx, t, version, pauses);
  if (c.stage != stage_kind::none) out << fmt::format("# pause (apply_prepared, ms) of each version: {}\n", pauses);
  const double delta_median = median(delta_ms);
  out << fmt::format("# delta median {:.2f} ms = {:.3f} x whole median {:.2f} ms; wire {:.2f} % of the version\n",
                     delta_median, whole > 0 ? delta_median / whole : 0.0, whole, 100 * median(wire_fraction));
  out << fmt::format("# out of bounds/wrong values: {} (receiver's version checksum after version {} {})\n",
                     right ? 0 : 1, version, right ? "matches" : "DIFFERS");
  return right ? 0 : 1;
}

}  // namespace refit::bench
