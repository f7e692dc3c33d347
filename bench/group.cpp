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
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench/group.hpp"
#include "bench/roles.hpp"
#include "bench/spawn.hpp"

namespace refit::bench {
namespace {

using namespace sharded;

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

namespace {

/// A group's processes and threads as run_group() starts them, and the ceiling measured among them.
struct group_run {
  std::vector<forked_child> receivers;
  std::vector<int> rgpus, sgpus;
  std::unique_ptr<rank_set> ranks;
  std::string ceiling_what;
  double ceiling = 0;
};

/// Every receiver, forked before this process touches CUDA or opens a socket.
void fork_receivers(const config& c, const group_plan& p, group_run& g) {
  const bool nccl = p.kind == transport_kind::nccl;
  for (std::size_t k = 0; k < p.receivers; ++k) {
    const int gpu = nccl || !p.gpu ? receiver_gpu_of(c, p, k) : -2;  // cuda_ipc: asked in the child
    g.receivers.push_back(fork_child("--streamers", [&, k, gpu](int in, int up) {
      receiver_child(c, p.m, plan_child(p, k, gpu == -2 ? receiver_gpu_of(c, p, k) : gpu), p.h.rank_of[k], in, up);
    }));
  }
}

/// nccl: the streamer ranks as forked children, then the ceiling among them and the receivers.
void start_process_ranks(const config& c, const group_plan& p, group_run& g) {
  std::vector<forked_child> children;
  for (std::size_t r = 0; r < p.n; ++r) {
    g.sgpus.push_back(streamer_gpu_of(c, p, r));
    children.push_back(fork_child("--streamers", [&, r](int in, int up) {
      streamer_child(c, p.m, p.h, plan_child(p, r, g.sgpus[r]), p.direct, in, up);
    }));
  }
  auto procs = std::make_unique<process_ranks>(std::move(children), g.receivers);
  progress(c, "--streamers: measuring the ceiling (raw ncclBroadcast of every rank's shards, all at once)");
  g.ceiling = nccl_pattern_seconds(p, g.receivers, procs->children());
  g.ceiling_what = fmt::format(
      "raw ncclBroadcast of each rank's shard bytes to the {} receiver(s), one communicator per rank, all at "
      "once ({} warm-up + median of {}, CUDA events on each receiver; the slowest receiver's)",
      p.receivers, nccl_ceiling_warmup, nccl_ceiling_reps);
  procs->read_terms(p.h.regions.size(), p.m.entries.size());
  g.ranks = std::move(procs);
}

/// Every receiver's "ready".
void await_receivers(const config& c, const group_plan& p, group_run& g) {
  for (std::size_t k = 0; k < p.receivers; ++k) {
    g.rgpus.push_back(receiver_gpu_of(c, p, k));
    if (read_line(g.receivers[k].from) != "ready")
      throw error(errc::io, fmt::format("--streamers: receiver {} did not start (its error is on stderr)", k));
  }
}

/// host_shm, cuda_ipc: the streamer ranks as threads of this process, then the ceiling (the same
/// bytes copied by memcpy or the copy engines).
void start_thread_ranks(const config& c, const group_plan& p, group_run& g) {
  for (std::size_t r = 0; r < p.n; ++r) g.sgpus.push_back(streamer_gpu_of(c, p, r));
  auto threads = std::make_unique<thread_ranks>(c, p.m, p.h, plan_child(p, 0, -1), g.sgpus, p.direct);
#if REFIT_HAVE_CUDA
  if (p.gpu) {
    progress(c, "--streamers: measuring the ceiling (every shard copied to every receiver that needs it, all at once)");
    g.ceiling = peer_pattern_seconds(p.h, threads->shards, g.rgpus, 3);
    g.ceiling_what =
        "cudaMemcpyPeerAsync of every rank's shard bytes to every receiver's GPU that needs them, all at once";
  }
#endif
  if (!p.gpu) {
    g.ceiling =
        static_cast<double>(p.h.payload) / host_memcpy_bandwidth(std::clamp<std::uint64_t>(p.h.payload, 1, 1ull << 30));
    g.ceiling_what = "one memcpy of the payload on one thread";
  }
  g.ranks = std::move(threads);
}

/// The versions, one line each; the counted ones' times go to `times`. Returns the wrong values.
std::int64_t run_versions(const config& c, const group_plan& p, group_run& g, std::ostream& out,
                          std::vector<double>& times) {
  std::int64_t wrong = 0;
  std::uint64_t version = 0;
  for (int it = 0; it < c.warmup + c.iters; ++it) {
    ++version;
    const group_times t = g.ranks->refit(version);
    const double ms = t.ms;
    wrong += check_version(c, p, *g.ranks, g.receivers, version);
    const bool counted = it >= c.warmup;
    if (counted) times.push_back(ms);
    out << fmt::format("{:>8} {:>8} {:>10.2f} {:>10.2f} {:>10.2f} {:>8.3f}\n", version, counted ? "yes" : "warm-up", ms,
                       *std::max_element(t.rank_ms.begin(), t.rank_ms.end()), p.h.payload / (ms * 1e6),
                       g.ceiling * 1e3 / ms);
    out.flush();
  }
  return wrong;
}

/// Closes the ranks and ends the receivers; each receiver that failed counts one wrong value.
std::int64_t end_group(group_run& g) {
  g.ranks->close();
  g.ranks.reset();
  std::int64_t failed = 0;
  for (auto& k : g.receivers) {
    write_line(k.to, "x");
    if (!exited_cleanly(reap(k))) ++failed;
  }
  return failed;
}

}  // namespace

int run_group(const config& c, std::ostream& out) {
  const group_plan p = plan_group(c);
  group_run g;
  fork_receivers(c, p, g);
  progress(c,
           fmt::format("--streamers {}: filling {} ({:.2f} GB) as {} shards", p.n, p.m.name, p.m.bytes() / 1e9, p.n));
  if (p.kind == transport_kind::nccl) start_process_ranks(c, p, g);
  await_receivers(c, p, g);
  if (p.kind != transport_kind::nccl) start_thread_ranks(c, p, g);
  write_group_preamble(out, c, p, g.sgpus, g.rgpus, g.ceiling_what, g.ceiling);

  std::vector<double> times;
  std::int64_t wrong = run_versions(c, p, g, out, times);
  wrong += end_group(g);
  const double med = median(times);
  out << fmt::format("# median {:.2f} ms = {:.3f} x the ceiling {:.2f} ms ({:.2f} GB/s of payload)\n", med,
                     g.ceiling > 0 ? med / (g.ceiling * 1e3) : 0.0, g.ceiling * 1e3, p.h.payload / (med * 1e6));
  out << fmt::format(
      "# out of bounds/wrong values: {} (source tensors whose checksum in a receiver's view(s) differed from the CPU "
      "reference, over every version and receiver; a receiver that failed counts one)\n",
      wrong);
  return wrong == 0 ? 0 : 1;
}

}  // namespace refit::bench
