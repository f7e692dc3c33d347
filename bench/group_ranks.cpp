// refit-bench --streamers N: the processes and threads of a group. Every receiver is a forked child
// (receiver_child). Over host_shm and cuda_ipc the streamer ranks are threads of the main process
// (thread_ranks); over nccl each is a forked child too (streamer_child, process_ranks): NCCL forbids
// issuing operations in parallel from several threads to independent communicators of one device
// (its "Thread Safety" section), which streamer ranks sharing a GPU would do, and with
// --nccl-share-gpus every rank must be a process that claims an NCCL host of its own
// (claim_nccl_host) anyway. The children and the main process speak in lines over pipes
// (bench/spawn.hpp: read_line, write_line).
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <latch>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/group.hpp"
#include "bench/roles.hpp"
#include "bench/spawn.hpp"
#include "model/text.hpp"
#include "refit/receiver.hpp"
#include "refit/streamer.hpp"

namespace refit::bench::sharded {
namespace {

using clock_type = std::chrono::steady_clock;

std::string endpoint_of(const std::string& pattern, std::size_t rank) {
  const auto at = pattern.find("{rank}");
  return pattern.substr(0, at) + std::to_string(rank) + pattern.substr(at + 6);
}

/// A child's part of the nccl ceiling: joins `comms` on `gpu`, says "ceiling MEDIAN BEST" (seconds)
/// and stays in them until the main process says "on" (every rank has then finished).
void join_ceiling(const config& c, const std::vector<ceiling_comm>& comms, int gpu, int in, int out) {
  (void)nccl_ceiling_ranks(comms, gpu, milliseconds(c.timeout_ms), watch_parent(in), [&](double med, double best) {
    write_line(out, fmt::format("ceiling {} {}", med, best));
    (void)read_line(in);
  });
}

std::string receiver_pattern(const child_plan& p, std::size_t k) { return fmt::format("{}-{}-{{rank}}", p.base, k); }

/// The receiver's side of a version: serves until `in` is readable, and after every version says
/// "committed V SUM..." (view_checksums) or "aborted WHY".
void serve(const config& c, const manifest& m, const child_plan& p, int rank, int in, int out) {
  const engine_layout layout = make_layout(m, c.layout, rank);
  // The weights as --dest-memory says over cuda_ipc; over nccl in one arena, as the nccl rows were
  // recorded (NCCL receives in this process, where the layout costs nothing: bench/probes/dest_alloc.cu).
  auto memory =
      p.gpu < 0 ? make_host_shm_path()
                : make_cuda_ipc_path(p.gpu, false, p.kind == transport_kind::cuda_ipc ? c.dests : dest_memory::arena);
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

/// Streamer rank r's options: one endpoint of each receiver, rank r of the group.
streamer_options rank_options(const config& c, const child_plan& p, bool direct) {
  streamer_options so = streamer_options_for(c, p.kind, c.buffer_mb.at(0), c.buffer_counts.at(0));
  so.device = std::max(p.gpu, 0);  // the rank's GPU
  for (std::size_t k = 0; k < p.receivers; ++k) so.receivers.push_back(endpoint_of(receiver_pattern(p, k), p.index));
  so.endpoint = so.receivers.front();
  so.direct = direct;
  so.alignment = c.alignment;
  so.keep_whole = c.keep_whole;
  so.group_rank = p.index;
  so.group_size = p.streamers;
  return so;
}

[[noreturn]] void rank_failed(std::size_t r, std::uint64_t v, const std::string& why) {
  throw error(errc::internal, fmt::format("--streamers: rank {} failed version {}: {}", r, v, why));
}

}  // namespace

// ---------------------------------------------------------------- the children

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

thread_ranks::thread_ranks(const config& c, const manifest& m, const holdings& h, const child_plan& p,
                           const std::vector<int>& gpus, bool direct) {
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

group_times thread_ranks::refit(std::uint64_t v) {
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

void thread_ranks::close() {
  for (auto& s : streamers_) s->close();
}

process_ranks::~process_ranks() {
  for (auto& k : ranks_) (void)reap(k);
}

void process_ranks::read_terms(std::size_t expectations, std::size_t sources) {
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

group_times process_ranks::refit(std::uint64_t v) {
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

void process_ranks::close() {
  for (auto& k : ranks_) write_line(k.to, "close");
  for (auto& k : ranks_) (void)read_line(k.from);
}

void process_ranks::await_hellos(std::ptrdiff_t r) {
  for (std::size_t k = 0; k < receivers_.size(); ++k) {
    const std::string line = read_line(receivers_[k].from);
    if (line != "hello")
      throw error(errc::nccl, fmt::format("--streamers: receiver {} did not open rank {}'s session: '{}'", k, r,
                                          line.empty() ? std::string("it exited") : line.substr(0, 300)));
  }
}

}  // namespace refit::bench::sharded
