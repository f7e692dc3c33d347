// refit-bench --streamers N: sharded trainers. N streamers, one per trainer rank, each
// holding the Shard(0) rows of every tensor of the model (torch.chunk's split, as FSDP's), send each
// version together to the receivers. No all-gather: every byte moves from the rank that holds it
// straight to the receivers that need it.
//
// The receivers hold the model as --layout says: full replicas (plain, --receivers R of them), an
// engine's fused layout (fused, ep: R replicas of it), or one rank each of --layout tpN (N receivers;
// host_shm serves one receiver, the rank --rank names). Each source tensor is verified after every
// version as it landed in its view(s): the receiver reports the checksum of each source's bytes there
// (view_checksums, as a receiver of the usual rows does), and this process compares it with the CPU
// reference of the mapping: the checksum of the region of the source that rank takes, which every
// streamer rank adds its shard's part to while it fills its shards (checksums are linear in each
// byte, delta/checksum.hpp). The table's "wrong" footer counts the tensors that differ.
//
// Transports and ceilings, each measured in the same run:
// - host_shm (one receiver): one memcpy of the payload on one thread.
// - cuda_ipc: receiver k on the streamer's GPU, or GPU (device + k) % visible with --receiver-devices
//   spread (rank k too: the colocated FSDP case); every rank's shard bytes that a receiver needs copied
//   to that receiver's GPU with cudaMemcpyPeerAsync, all at once (the copy engines, no protocol).
// - nccl: receiver k on GPU (device + 1 + k) % visible, streamer 0 on --device and streamer r > 0 on
//   GPU (device + R + r) % visible, every rank on a GPU of its own unless --nccl-share-gpus. Each
//   streamer rank has a communicator of its own with the receivers (as the library does) and
//   broadcasts its shard bytes there. The ceiling is that pattern in raw NCCL: one communicator per
//   streamer rank with every receiver, all broadcasting at once (nccl_ceiling_ranks, the nccl rows'
//   ceiling with several communicators per process); the slowest receiver's median.
//
// Every receiver is a forked child. Over host_shm and cuda_ipc the streamers are threads of this
// process. Over nccl each streamer rank is a forked child too: NCCL forbids issuing operations in
// parallel from several threads to independent communicators of one device (its "Thread Safety"
// section), which streamer ranks sharing a GPU would do, and with --nccl-share-gpus every rank
// must be a process that claims an NCCL host of its own (claim_nccl_host) anyway. This process then
// touches neither CUDA nor a communicator: it hands out the communicators' ids, starts each version
// on every rank at once and times it.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <latch>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench.hpp"
#include "config/config.hpp"
#include "delta/checksum.hpp"
#include "model/text.hpp"
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

/// The bytes of `whole` that rank r of n holds: {offset, length} in its row-major storage.
std::pair<std::uint64_t, std::uint64_t> shard_bytes(const tensor_meta& whole, std::size_t r, std::size_t n) {
  const std::int64_t rows = whole.shape.empty() ? 1 : whole.shape[0];
  const auto [first, count] = chunk_rows(rows, r, n);
  const std::uint64_t row = rows == 0 ? 0 : whole.nbytes() / static_cast<std::uint64_t>(rows);
  return {row * static_cast<std::uint64_t>(first), row * static_cast<std::uint64_t>(count)};
}

std::string endpoint_of(const std::string& pattern, std::size_t rank) {
  const auto at = pattern.find("{rank}");
  return pattern.substr(0, at) + std::to_string(rank) + pattern.substr(at + 6);
}

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

/// What the receivers hold: receiver k holds rank rank_of[k] of --layout (0 without tpN) and is
/// checked against expectation expect_of[k]; regions[e][i] is the part of source i that the
/// receivers of expectation e take.
struct holdings {
  std::vector<int> rank_of;
  std::vector<std::size_t> expect_of;
  std::vector<int> ranks;  ///< the rank of each expectation
  std::vector<std::vector<byte_region>> regions;
  std::uint64_t payload = 0;  ///< the bytes the distinct ranks need, summed
};

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

/// One rank's shards of every tensor: their metas, where each starts in its whole tensor, their
/// memory (host, or the rank's GPU), and the terms they add to each expectation's checksums.
struct rank_shards {
  int gpu = -1;
  std::vector<tensor_ref> refs;
  std::vector<std::uint64_t> offsets;  ///< byte offset of each shard in its whole tensor
  std::uint64_t bytes = 0;
  std::vector<std::vector<std::uint64_t>> terms;  ///< per expectation, per source (delta::range_terms)
  std::vector<std::vector<std::byte>> host;
#if REFIT_HAVE_CUDA
  std::vector<cuda::device_buffer> device;
#endif
};

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

// ---------------------------------------------------------------- the children's lines

/// A line from `fd` (blocking), without its newline; empty at the end of the pipe.
std::string read_line(int fd) {
  std::string line;
  char ch = 0;
  while (::read(fd, &ch, 1) == 1 && ch != '\n') line.push_back(ch);
  return line;
}

/// Writes `line` (newlines inside it made spaces) and a newline to `fd`.
void write_line(int fd, std::string line) {
  std::replace(line.begin(), line.end(), '\n', ' ');
  line.push_back('\n');
  for (std::size_t done = 0; done < line.size();) {
    const ssize_t w = ::write(fd, line.data() + done, line.size() - done);
    if (w <= 0) throw error(errc::io, "--streamers: a pipe between the bench's processes broke");
    done += static_cast<std::size_t>(w);
  }
}

/// Throws once the other end of `fd` is gone (the bench's main process ended).
std::function<void()> watch_parent(int fd) {
  return [fd] {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR)) != 0)
      throw error(errc::peer, "the bench's main process went away");
  };
}

/// A child's part of the nccl ceiling: joins `comms` on `gpu`, says "ceiling MEDIAN BEST" (seconds)
/// and stays in them until the main process says "on" (every rank has then finished).
void join_ceiling(const config& c, const std::vector<ceiling_comm>& comms, int gpu, int in, int out) {
  (void)nccl_ceiling_ranks(comms, gpu, milliseconds(c.timeout_ms), watch_parent(in), [&](double med, double best) {
    write_line(out, fmt::format("ceiling {} {}", med, best));
    (void)read_line(in);
  });
}

/// Where a child runs and what it serves.
struct child_plan {
  transport_kind kind = transport_kind::host_shm;
  std::string base;           ///< receiver k binds base-k-{rank}, one endpoint per streamer rank
  std::size_t streamers = 1;  ///< N
  std::size_t receivers = 1;  ///< R
  std::size_t index = 0;      ///< this child's receiver k or streamer rank r
  int gpu = -1;               ///< -1: host memory
};

std::string receiver_pattern(const child_plan& p, std::size_t k) { return fmt::format("{}-{}-{{rank}}", p.base, k); }

/// The receiver's side of a version: serves until `in` is readable, and after every version says
/// "committed V SUM..." (view_checksums) or "aborted WHY".
void serve(const config& c, const manifest& m, const child_plan& p, int rank, int in, int out) {
  const engine_layout layout = make_layout(m, c.layout, rank);
  auto memory = p.gpu < 0 ? make_host_shm_path() : make_cuda_ipc_path(p.gpu);
  auto dest = memory->destinations(layout.tensors);
  receiver_options o;
  o.endpoint = receiver_pattern(p, p.index);
  o.streamers = p.streamers;
  o.idle_timeout = milliseconds{std::max<std::uint64_t>(c.timeout_ms, 120000)};
  o.device = std::max(p.gpu, 0);
  receiver r(o);
  register_views(r, c, m, layout, *dest);
  write_line(out, "ready");
  for (;;) {
    const receiver_event e = r.serve_one(milliseconds{20});
    if (e == receiver_event::committed) {
      corrupt_after_commit(c, m, layout, *dest);
      std::string line = fmt::format("committed {}", r.committed_version().value_or(0));
      for (const std::uint64_t sum : view_checksums(m, layout, *dest)) line += fmt::format(" {}", sum);
      write_line(out, line);
    } else if (e == receiver_event::aborted) {
      write_line(out, "aborted " + printable(r.last_error()));  // it may quote a streamer's bytes
    } else if (p.kind == transport_kind::nccl && (e == receiver_event::hello || e == receiver_event::refused)) {
      write_line(out, e == receiver_event::hello ? std::string("hello") : "refused " + printable(r.last_error()));
    }
    pollfd q{in, POLLIN, 0};
    if (::poll(&q, 1, 0) > 0) break;
  }
}

/// The receiver child: over nccl first its part of the ceiling (rank k + 1 of every streamer rank's
/// communicator, the line "ceiling ID BYTES ID BYTES ..." names them), then serve().
[[noreturn]] void receiver_child(const config& c, const manifest& m, const child_plan& p, int rank, int in, int out) {
  int code = 0;
  ::signal(SIGPIPE, SIG_IGN);  // a broken pipe is an error of write_line(), not the end
  try {
    if (p.kind == transport_kind::nccl) {
      claim_nccl_host(false);  // a host of its own when ranks share GPUs
      std::istringstream line(read_line(in));
      std::string word;
      line >> word;
      std::vector<ceiling_comm> comms;
      ceiling_comm one;
      while (line >> one.id_hex >> one.bytes) {
        one.rank = static_cast<int>(p.index) + 1;
        one.nranks = static_cast<int>(p.receivers) + 1;
        comms.push_back(one);
      }
      join_ceiling(c, comms, p.gpu, in, out);
    }
    serve(c, m, p, rank, in, out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "refit-bench: --streamers: receiver %zu: %s\n", p.index, e.what());
    code = 1;
  }
  std::_Exit(code);
}

/// Streamer rank r's options: one endpoint of each receiver, rank r of the group.
streamer_options rank_options(const config& c, const child_plan& p, bool direct) {
  streamer_options so;
  so.transport = p.kind;
  for (std::size_t k = 0; k < p.receivers; ++k) so.receivers.push_back(endpoint_of(receiver_pattern(p, k), p.index));
  so.endpoint = so.receivers.front();
  so.direct = direct;
  so.control_lane = c.lane;
  so.nccl_twin = c.twin;
  so.device = std::max(p.gpu, 0);
  so.buffer_bytes = static_cast<std::uint64_t>(c.buffer_mb.at(0) * (1 << 20));
  so.buffer_count = c.buffer_counts.at(0);
  so.alignment = c.alignment;
  so.keep_whole = c.keep_whole;
  so.timeout = milliseconds{static_cast<std::int64_t>(c.timeout_ms)};
  so.group_rank = p.index;
  so.group_size = p.streamers;
  return so;
}

/// A streamer rank as a child (nccl): the root of its ceiling communicator ("ceiling ID NRANKS
/// BYTES"), then its shards ("terms T..." per expectation and source), then one refit per "go V"
/// ("done MS" or "fail WHY") until "close" ("closed").
[[noreturn]] void streamer_child(const config& c, const manifest& m, const holdings& h, const child_plan& p,
                                 bool direct, int in, int out) {
  int code = 0;
  ::signal(SIGPIPE, SIG_IGN);
  try {
    claim_nccl_host(false);
    std::istringstream line(read_line(in));
    std::string word;
    ceiling_comm root;
    line >> word >> root.id_hex >> root.nranks >> root.bytes;
    join_ceiling(c, {root}, p.gpu, in, out);
    const rank_shards s = make_shards(m, p.index, p.streamers, p.gpu, c.seed, h);
    std::string terms = "terms";
    for (const auto& of : s.terms)
      for (const std::uint64_t t : of) terms += fmt::format(" {}", t);
    write_line(out, terms);
    streamer st(rank_options(c, p, direct));
    for (std::string cmd = read_line(in); cmd.starts_with("go "); cmd = read_line(in)) {
      try {
        write_line(out, fmt::format("done {}", st.refit(std::stoull(cmd.substr(3)), s.refs).seconds * 1e3));
      } catch (const std::exception& e) {
        write_line(out, fmt::format("fail {}", e.what()));
      }
    }
    st.close();
    write_line(out, "closed");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "refit-bench: --streamers: streamer rank %zu: %s\n", p.index, e.what());
    code = 1;
  }
  std::_Exit(code);
}

/// CUDA devices visible, counted in a child: this process forks its ranks later, and a process
/// forked after CUDA was initialised cannot use it.
int count_gpus_apart() {
  if (!REFIT_HAVE_CUDA) return 0;
  forked_child k = fork_child("--streamers", [](int, int out) {
    try {
      write_line(out, std::to_string(visible_gpus()));
    } catch (...) {
    }
    std::_Exit(0);
  });
  const std::string line = read_line(k.from);
  (void)reap(k);
  return line.empty() ? 0 : std::stoi(line);
}

// ---------------------------------------------------------------- the streamer ranks

/// A version sent by every rank at once: from the start to the last rank's return, and each rank's
/// refit() alone (ms).
struct group_times {
  double ms = 0;
  std::vector<double> rank_ms;
};

/// The N streamer ranks, seen from this process.
class rank_set {
 public:
  virtual ~rank_set() = default;
  rank_set() = default;
  rank_set(const rank_set&) = delete;
  rank_set& operator=(const rank_set&) = delete;
  /// Every rank refits version v at once. Throws naming a rank that failed.
  virtual group_times refit(std::uint64_t v) = 0;
  virtual void close() = 0;
  /// Per expectation, per source: every rank's terms, summed.
  std::vector<std::vector<std::uint64_t>> terms;
};

[[noreturn]] void rank_failed(std::size_t r, std::uint64_t v, const std::string& why) {
  throw error(errc::internal, fmt::format("--streamers: rank {} failed version {}: {}", r, v, why));
}

/// Streamers as threads of this process (host_shm, cuda_ipc).
class thread_ranks final : public rank_set {
 public:
  thread_ranks(const config& c, const manifest& m, const holdings& h, const child_plan& p, const std::vector<int>& gpus,
               bool direct) {
    terms.assign(h.regions.size(), std::vector<std::uint64_t>(m.entries.size(), 0));
    for (std::size_t r = 0; r < p.streamers; ++r) {
      shards.push_back(make_shards(m, r, p.streamers, gpus[r], c.seed, h));
      for (std::size_t e = 0; e < terms.size(); ++e)
        for (std::size_t i = 0; i < m.entries.size(); ++i) terms[e][i] += shards.back().terms[e][i];
      child_plan rank = p;
      rank.index = r;
      rank.gpu = gpus[r];
      streamers_.push_back(std::make_unique<streamer>(rank_options(c, rank, direct)));
    }
  }

  group_times refit(std::uint64_t v) override {
    const std::size_t n = streamers_.size();
    std::latch go(static_cast<std::ptrdiff_t>(n) + 1);
    std::vector<std::optional<std::string>> failed(n);
    group_times t;
    t.rank_ms.assign(n, 0);
    std::vector<std::thread> threads;
    for (std::size_t r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        go.arrive_and_wait();
        try {
          t.rank_ms[r] = streamers_[r]->refit(v, shards[r].refs).seconds * 1e3;
        } catch (const std::exception& e) {
          failed[r] = e.what();
        }
      });
    go.arrive_and_wait();  // timed from when every thread is there
    const auto t0 = clock_type::now();
    for (auto& th : threads) th.join();
    t.ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
    for (std::size_t r = 0; r < n; ++r)
      if (failed[r]) rank_failed(r, v, *failed[r]);
    return t;
  }

  void close() override {
    for (auto& s : streamers_) s->close();
  }

  std::vector<rank_shards> shards;

 private:
  std::vector<std::unique_ptr<streamer>> streamers_;
};

/// Streamers as forked children (nccl): streamer_child() on the other end of each pipe.
///
/// Their first version starts rank by rank, each once every receiver has said "hello" for the one
/// before: a receiver joins a streamer's communicator while it handles that streamer's HELLO and
/// serves nothing else meanwhile, so two receivers that took the HELLOs of two ranks in opposite
/// orders would each wait for the other to join (seen on the H200 with two ranks into a tp2 pair:
/// both inits ran out of time). The sessions then stay, and later versions start together.
class process_ranks final : public rank_set {
 public:
  process_ranks(std::vector<forked_child> ranks, std::vector<forked_child>& receivers)
      : ranks_(std::move(ranks)), receivers_(receivers) {}
  ~process_ranks() override {
    for (auto& k : ranks_) (void)reap(k);
  }

  /// After the ceiling: every rank's terms line.
  void read_terms(std::size_t expectations, std::size_t sources) {
    terms.assign(expectations, std::vector<std::uint64_t>(sources, 0));
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      std::istringstream line(read_line(ranks_[r].from));
      std::string word;
      line >> word;
      if (word != "terms") throw error(errc::io, fmt::format("--streamers: rank {} did not fill its shards", r));
      for (auto& of : terms)
        for (auto& t : of) {
          std::uint64_t x = 0;
          line >> x;
          t += x;
        }
    }
  }

  group_times refit(std::uint64_t v) override {
    group_times t;
    const auto t0 = clock_type::now();
    for (auto& k : ranks_) {
      write_line(k.to, fmt::format("go {}", v));
      if (!opened_) await_hellos(&k - ranks_.data());
    }
    opened_ = true;
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      const std::string line = read_line(ranks_[r].from);
      if (!line.starts_with("done ")) rank_failed(r, v, line.empty() ? "it exited" : line.substr(line.find(' ') + 1));
      t.rank_ms.push_back(std::stod(line.substr(5)));
    }
    t.ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
    return t;
  }

  void close() override {
    for (auto& k : ranks_) write_line(k.to, "close");
    for (auto& k : ranks_) (void)read_line(k.from);
  }

  std::vector<forked_child>& children() { return ranks_; }

 private:
  /// Every receiver's "hello" for rank r's session.
  void await_hellos(std::ptrdiff_t r) {
    for (std::size_t k = 0; k < receivers_.size(); ++k) {
      const std::string line = read_line(receivers_[k].from);
      if (line != "hello")
        throw error(errc::nccl, fmt::format("--streamers: receiver {} did not open rank {}'s session: '{}'", k, r,
                                            line.empty() ? std::string("it exited") : line.substr(0, 300)));
    }
  }

  std::vector<forked_child> ranks_;
  std::vector<forked_child>& receivers_;
  bool opened_ = false;
};

// ---------------------------------------------------------------- ceilings

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

// ---------------------------------------------------------------- the run

/// Everything run_group() decides before it forks: the checks, where each rank runs, what each
/// receiver holds.
struct group_plan {
  transport_kind kind = transport_kind::host_shm;
  bool gpu = false;
  std::size_t n = 0, receivers = 1;
  int visible = 0;  ///< nccl: counted before forking
  bool direct = true;
  manifest m;
  holdings h;
  std::string base;
};

group_plan plan_group(const config& c) {
  group_plan p;
  p.n = c.streamers;
  const bool one = c.transports.size() == 1;
  p.kind = one ? c.transports[0] : transport_kind::host_shm;
  p.gpu = p.kind != transport_kind::host_shm;
  if (!one || (p.kind == transport_kind::cuda_ipc && !REFIT_HAVE_CUDA))
    throw error(errc::invalid_argument,
                "--streamers: one --transport: host_shm, cuda_ipc (in a build with CUDA) or nccl (with NCCL)");
  if (c.models.size() != 1 || !c.manifest_file.empty())
    throw error(errc::invalid_argument, "--streamers: exactly one built-in --model");
  if (c.convert)
    throw error(errc::invalid_argument,
                fmt::format("--streamers with --convert {}: a group's receivers hold the model's own dtypes; run "
                            "--convert without --streamers",
                            c.convert->name));
  // tpN over host_shm: its one receiver holds --rank; elsewhere one receiver per rank.
  const bool tp = c.layout.tp > 1;
  if (!p.gpu && !tp && c.receivers != 1)
    throw error(errc::invalid_argument, "--streamers with host_shm: one receiver (--receivers 1)");
  p.receivers = p.gpu ? c.receivers : 1;
  if (p.kind == transport_kind::nccl) {
    p.visible = REFIT_HAVE_NCCL ? count_gpus_apart() : 0;
    check_group_gpus(c, p.n, p.receivers, p.visible);
  }
  p.direct = p.gpu && (c.direct.empty() || c.direct.front());
  p.m = preset(c.models[0], c.type);
  p.h = hold(c, p.m, p.receivers, !p.gpu);
  p.base = fmt::format("ipc:///tmp/refit-bench-group-{}", ::getpid());
  return p;
}

/// nccl: streamer 0 on --device, the receivers on the GPUs after it, the other streamers after those.
int nccl_streamer_gpu(const config& c, const group_plan& p, std::size_t r) {
  if (r == 0) return c.device;
  return static_cast<int>((static_cast<std::size_t>(c.device) + p.receivers + r) % static_cast<std::size_t>(p.visible));
}

/// GPU of receiver k (host_shm: -1). cuda_ipc asks for the visible GPUs in the child or after forking.
int receiver_gpu_of(const config& c, const group_plan& p, std::size_t k) {
  if (!p.gpu) return -1;
  if (p.kind == transport_kind::nccl) return receiver_device(c.device, k, p.visible);
  if (!c.spread_receivers) return c.device;
  return static_cast<int>((static_cast<std::size_t>(c.device) + k) %
                          static_cast<std::size_t>(std::max(visible_gpus(), 1)));
}

/// GPU of streamer rank r (host_shm: -1).
int streamer_gpu_of(const config& c, const group_plan& p, std::size_t r) {
  if (!p.gpu) return -1;
  if (p.kind == transport_kind::nccl) return nccl_streamer_gpu(c, p, r);
  if (!c.spread_receivers) return c.device;
  return static_cast<int>((static_cast<std::size_t>(c.device) + r) %
                          static_cast<std::size_t>(std::max(visible_gpus(), 1)));
}

child_plan plan_child(const group_plan& p, std::size_t index, int gpu) {
  return child_plan{p.kind, p.base, p.n, p.receivers, index, gpu};
}

/// The nccl ceiling: one communicator per streamer rank with every receiver (ids made here, after
/// every child was forked), all broadcasting each rank's shard bytes at once. The slowest receiver's
/// median, in seconds.
double nccl_pattern_seconds(const group_plan& p, std::vector<forked_child>& receivers,
                            std::vector<forked_child>& ranks) {
  std::string to_receivers = "ceiling";
  for (std::size_t r = 0; r < p.n; ++r) {
    std::uint64_t bytes = 0;
    for (const auto& e : p.m.entries) bytes += shard_bytes(e.meta, r, p.n).second;
    const std::string id = nccl_unique_id_hex();
    write_line(ranks[r].to, fmt::format("ceiling {} {} {}", id, p.receivers + 1, bytes));
    to_receivers += fmt::format(" {} {}", id, bytes);
  }
  for (auto& k : receivers) write_line(k.to, to_receivers);
  double slowest = 0;
  for (std::size_t k = 0; k < receivers.size() + ranks.size(); ++k) {
    const bool receiver = k < receivers.size();
    const std::string line = read_line(receiver ? receivers[k].from : ranks[k - receivers.size()].from);
    if (!line.starts_with("ceiling "))
      throw error(errc::nccl,
                  fmt::format("--streamers: the nccl ceiling failed on {} {} (its error is on stderr)",
                              receiver ? "receiver" : "streamer rank", receiver ? k : k - receivers.size()));
    if (receiver) slowest = std::max(slowest, std::stod(line.substr(8)));
  }
  for (auto& k : receivers) write_line(k.to, "on");
  for (auto& k : ranks) write_line(k.to, "on");
  return slowest;
}

/// The preamble: the model, where the ranks run, what the receivers hold, the ceiling.
void write_group_preamble(std::ostream& out, const config& c, const group_plan& p, const std::vector<int>& sgpus,
                          const std::vector<int>& rgpus, const std::string& ceiling_what, double ceiling) {
  const manifest& m = p.m;
  out << fmt::format(
      "# refit-bench --streamers {}: {} ({} tensors, {:.3f} GB {}), Shard(0) rows per rank (torch.chunk)\n", p.n,
      m.name, m.entries.size(), m.bytes() / 1e9, to_string(c.type));
  std::string where_s, where_r;
  for (const int g : sgpus) where_s += (where_s.empty() ? "" : ",") + (g < 0 ? "cpu" : fmt::format("cuda:{}", g));
  for (const int g : rgpus) where_r += (where_r.empty() ? "" : ",") + (g < 0 ? "cpu" : fmt::format("cuda:{}", g));
  const std::string held = c.layout == layout_kind::plain ? "full replicas (plain)"
                           : c.layout.tp > 1              ? fmt::format("{} of --layout {}",
                                                           p.receivers == 1 ? fmt::format("rank {}", p.h.rank_of[0])
                                                                                         : std::string("one rank each"),
                                                                        layout_name(c.layout))
                                             : fmt::format("each the model in --layout {}", layout_name(c.layout));
  out << fmt::format("# {} {}, streamers on {}, {} receiver(s) ({}) on {}, {} x {} MiB buffers{}\n", to_string(p.kind),
                     !p.gpu     ? "(staged)"
                     : p.direct ? (p.kind == transport_kind::nccl ? "in place" : "direct")
                                : "staged",
                     where_s, p.receivers, held, where_r, c.buffer_counts.at(0), c.buffer_mb.at(0),
                     p.kind == transport_kind::nccl && c.nccl_share_gpus
                         ? "; ranks share GPUs (--nccl-share-gpus): each process its own NCCL_HOSTID, every byte "
                           "through NCCL's network transport, ceiling included"
                         : "");
  out << fmt::format("# payload: {:.3f} GB, what the receivers need (each distinct rank's once)\n", p.h.payload / 1e9);
  out << fmt::format("# ceiling: {}: {:.2f} ms\n", ceiling_what, ceiling * 1e3);
  out << fmt::format("{:>8} {:>8} {:>10} {:>10} {:>10} {:>8}\n", "version", "counted", "time", "slowest", "GB/s",
                     "ceil/t");
  out << fmt::format("{:>8} {:>8} {:>10} {:>10} {:>10} {:>8}\n", "", "", "(ms)", "rank(ms)", "(payload)", "");
}

/// After version v: every receiver's checksums against the expected ones; the wrong ones, counted.
std::int64_t check_version(const config& c, const group_plan& p, const rank_set& ranks,
                           std::vector<forked_child>& receivers, std::uint64_t v) {
  std::int64_t wrong = 0;
  for (std::size_t k = 0; k < receivers.size(); ++k) {
    std::string line = read_line(receivers[k].from);
    while (line == "hello") line = read_line(receivers[k].from);  // a session opened again
    std::istringstream in(line);
    std::string word;
    std::uint64_t said = 0;
    in >> word >> said;
    if (word != "committed" || said != v)
      throw error(errc::protocol, fmt::format("--streamers: receiver {} did not commit version {}: it said '{}'", k, v,
                                              line.substr(0, 300)));
    const std::size_t e = p.h.expect_of[k];
    for (std::size_t i = 0; i < p.m.entries.size(); ++i) {
      std::uint64_t sum = 0;
      in >> sum;
      const std::uint64_t expected = p.h.regions[e][i].bytes() + ranks.terms[e][i];
      if (sum == expected) continue;
      if (wrong < 3 && !c.quiet)
        fmt::print(stderr,
                   "refit-bench: WRONG: version {} receiver {} tensor {} ({}): checksum {:#018x}, expected {:#018x}\n",
                   v, k, i, p.m.entries[i].meta.name, sum, expected);
      ++wrong;
    }
  }
  return wrong;
}

}  // namespace

void check_group_gpus(const config& c, std::size_t n, std::size_t receivers, int visible) {
  if (!REFIT_HAVE_NCCL)
    throw error(errc::invalid_argument,
                "--streamers over nccl: this bench was built without NCCL; rebuild with -Dnccl=enabled, or use "
                "--transport cuda_ipc or host_shm");
  if (visible == 0)
    throw error(errc::invalid_argument,
                "--streamers over nccl needs a visible GPU and none is visible; check CUDA_VISIBLE_DEVICES, or use "
                "--transport host_shm");
  if (c.device < 0 || c.device >= visible)
    throw error(errc::invalid_argument,
                fmt::format("--streamers over nccl: --device {} but {} GPU(s) are visible", c.device, visible));
  if (!c.nccl_share_gpus && n + receivers > static_cast<std::size_t>(visible))
    throw error(errc::invalid_argument,
                fmt::format("--streamers {} over nccl with {} receiver(s): {} ranks, each on a GPU of its own (NCCL "
                            "allows one rank of a communicator per GPU of a host), and {} GPU(s) visible; "
                            "--nccl-share-gpus lets ranks share GPUs through NCCL's network transport",
                            n, receivers, n + receivers, visible));
}

int run_group(const config& c, std::ostream& out) {
  const group_plan p = plan_group(c);
  const bool nccl = p.kind == transport_kind::nccl;
  // Every child is forked before this process touches CUDA or opens a socket.
  std::vector<forked_child> receivers;
  std::vector<int> rgpus, sgpus;
  for (std::size_t k = 0; k < p.receivers; ++k) {
    const int g = nccl || !p.gpu ? receiver_gpu_of(c, p, k) : -2;  // cuda_ipc: asked in the child
    receivers.push_back(fork_child("--streamers", [&, k, g](int in, int up) {
      receiver_child(c, p.m, plan_child(p, k, g == -2 ? receiver_gpu_of(c, p, k) : g), p.h.rank_of[k], in, up);
    }));
  }
  std::unique_ptr<rank_set> ranks;
  std::string ceiling_what;
  double ceiling = 0;
  const auto progress = [&](const std::string& s) {
    if (!c.quiet) std::fprintf(stderr, "refit-bench: %s\n", s.c_str());
  };
  progress(fmt::format("--streamers {}: filling {} ({:.2f} GB) as {} shards", p.n, p.m.name, p.m.bytes() / 1e9, p.n));
  if (nccl) {
    std::vector<forked_child> children;
    for (std::size_t r = 0; r < p.n; ++r) {
      sgpus.push_back(streamer_gpu_of(c, p, r));
      children.push_back(fork_child("--streamers", [&, r](int in, int up) {
        streamer_child(c, p.m, p.h, plan_child(p, r, sgpus[r]), p.direct, in, up);
      }));
    }
    auto procs = std::make_unique<process_ranks>(std::move(children), receivers);
    progress("--streamers: measuring the ceiling (raw ncclBroadcast of every rank's shards, all at once)");
    ceiling = nccl_pattern_seconds(p, receivers, procs->children());
    ceiling_what = fmt::format(
        "raw ncclBroadcast of each rank's shard bytes to the {} receiver(s), one communicator per rank, all at "
        "once ({} warm-up + median of {}, CUDA events on each receiver; the slowest receiver's)",
        p.receivers, nccl_ceiling_warmup, nccl_ceiling_reps);
    procs->read_terms(p.h.regions.size(), p.m.entries.size());
    ranks = std::move(procs);
  }
  for (std::size_t k = 0; k < p.receivers; ++k) {
    rgpus.push_back(receiver_gpu_of(c, p, k));
    if (read_line(receivers[k].from) != "ready")
      throw error(errc::io, fmt::format("--streamers: receiver {} did not start (its error is on stderr)", k));
  }
  if (!nccl) {
    for (std::size_t r = 0; r < p.n; ++r) sgpus.push_back(streamer_gpu_of(c, p, r));
    auto threads = std::make_unique<thread_ranks>(c, p.m, p.h, plan_child(p, 0, -1), sgpus, p.direct);
#if REFIT_HAVE_CUDA
    if (p.gpu) {
      progress("--streamers: measuring the ceiling (every shard copied to every receiver that needs it, all at once)");
      ceiling = peer_pattern_seconds(p.h, threads->shards, rgpus, 3);
      ceiling_what =
          "cudaMemcpyPeerAsync of every rank's shard bytes to every receiver's GPU that needs them, all at once";
    }
#endif
    if (!p.gpu) {
      ceiling = static_cast<double>(p.h.payload) /
                host_memcpy_bandwidth(std::clamp<std::uint64_t>(p.h.payload, 1, 1ull << 30));
      ceiling_what = "one memcpy of the payload on one thread";
    }
    ranks = std::move(threads);
  }
  write_group_preamble(out, c, p, sgpus, rgpus, ceiling_what, ceiling);

  std::vector<double> times;
  std::int64_t wrong = 0;
  std::uint64_t version = 0;
  for (int it = 0; it < c.warmup + c.iters; ++it) {
    ++version;
    const group_times t = ranks->refit(version);
    const double ms = t.ms;
    wrong += check_version(c, p, *ranks, receivers, version);
    const bool counted = it >= c.warmup;
    if (counted) times.push_back(ms);
    out << fmt::format("{:>8} {:>8} {:>10.2f} {:>10.2f} {:>10.2f} {:>8.3f}\n", version, counted ? "yes" : "warm-up", ms,
                       *std::max_element(t.rank_ms.begin(), t.rank_ms.end()), p.h.payload / (ms * 1e6),
                       ceiling * 1e3 / ms);
    out.flush();
  }
  ranks->close();
  ranks.reset();
  for (auto& k : receivers) {
    write_line(k.to, "x");
    const int status = reap(k);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++wrong;
  }
  const double med = median(times);
  out << fmt::format("# median {:.2f} ms = {:.3f} x the ceiling {:.2f} ms ({:.2f} GB/s of payload)\n", med,
                     ceiling > 0 ? med / (ceiling * 1e3) : 0.0, ceiling * 1e3, p.h.payload / (med * 1e6));
  out << fmt::format(
      "# out of bounds/wrong values: {} (source tensors whose checksum in a receiver's view(s) differed from the CPU "
      "reference, over every version and receiver; a receiver that failed counts one)\n",
      wrong);
  return wrong == 0 ? 0 : 1;
}

}  // namespace refit::bench
