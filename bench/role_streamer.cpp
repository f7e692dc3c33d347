// The streamer side of the usual rows: one (transport, engine, model) group of rows (row_group). It
// spawns its receivers as their own processes (bench/spawn.hpp: fork, then execv of this binary with
// "--role receiver --bind EP ..."), or reaches the one started by hand through its report endpoint;
// then one row per (buffers, buffer size, path), every refit verified against the checksums each
// rank's receivers must report (bench/role_report.cpp, count_wrong).
//
// Over nccl it spawns --receivers of them, receiver k on GPU (device + 1 + k) % visible, and every
// one must commit every version; wrong checksums are summed over them. With --layout tpN over
// cuda_ipc and nccl it spawns one receiver per rank and passes all their endpoints to one streamer;
// each rank's checksums are those of its slices, so the streamer expects per rank the checksum of
// the same slice of its source (a slice of dimension 1 gathered first: its bytes are strided in the
// source). host_shm runs one rank (--rank). --no-verify runs a streamer started by hand without a
// report endpoint: unverified, wrong = n/a.
#include <sys/wait.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "bench/roles.hpp"
#include "bench/spawn.hpp"
#include "channel/channel.hpp"
#include "model/text.hpp"
#include "refit/memory.hpp"
#include "refit/error.hpp"
#include "refit/streamer.hpp"
#include "transport/transport.hpp"

namespace refit::bench {
namespace {

using clock = std::chrono::steady_clock;
using nlohmann::json;

// ---------------------------------------------------------------- what each rank should hold

// What the streamer expects of the receivers of one rank (tpN; rank 0 of 1 otherwise): the region
// of each source they take (all of it, or the rank's slice) and, verified, the checksum of those
// bytes, kept up to date as the data changes between refits.
struct expectation {
  int rank = 0;
  std::vector<byte_region> regions;
  std::vector<std::uint64_t> sums;
  std::uint64_t bytes = 0;  // what the rank needs
};

expectation expect_rank(const config& c, const manifest& m, int rank, const tensor_memory& src, bool verify) {
  const engine_layout l = make_layout(m, c.layout, rank);
  expectation e;
  e.rank = rank;
  for (std::size_t i = 0; i < m.entries.size(); ++i) {
    e.regions.push_back(region_of(m.entries[i].meta, l.slices[i]));
    e.bytes += e.regions.back().bytes();
    // A slice of dimension 1 is strided in the source: gathered before its checksum.
    if (verify) e.sums.push_back(l.slices[i] ? src.checksum(i, e.regions.back()) : src.checksum(i));
  }
  return e;
}

// Byte `offset` of source i changed from `old_byte` to `new_byte`: the sums that cover it follow in O(1).
void expect_flip(std::vector<expectation>& expects, std::size_t i, std::uint64_t offset, std::uint8_t old_byte,
                 std::uint8_t new_byte) {
  for (auto& e : expects)
    if (const auto at = region_position(e.regions[i], offset))
      e.sums[i] = checksum_after_flip(e.sums[i], e.regions[i].bytes(), *at, old_byte, new_byte);
}

// ---------------------------------------------------------------- one (transport, model) group

/// The per-iteration samples of one row, in ms.
struct row_samples {
  std::vector<double> times, source, pack, wait, apply, pause, commit;
};

/// One group's run, step by step: start the receivers (or reach the one started by hand), prepare
/// the source tensors and the checksums each rank expects, run one row per (buffers, buffer size,
/// path), then end the receivers.
class group_runner {
 public:
  explicit group_runner(row_group& g)
      : g_(g),
        c_(g.c),
        tname_(to_string(g.kind)),
        endpoint_(c_.connect),
        spawn_(c_.side == role::both),
        verify_((spawn_ || !c_.no_verify) && !c_.convert),
        report_who_(fmt::format("the receiver at report endpoint {}", c_.report)),
        nccl_(g.kind == transport_kind::nccl),
        tp_(c_.layout.tp > 1),
        count_(spawn_ ? receiver_processes(c_, g.kind) : 1),
        several_(nccl_ || count_ > 1) {
    // The rank each receiver holds: every rank when tpN spawns one per rank, else --rank (0 without tpN).
    for (std::size_t k = 0; k < count_; ++k) ranks_.push_back(tp_ ? (count_ > 1 ? static_cast<int>(k) : c_.rank) : 0);
  }

  void run(std::ostream& out, std::vector<row>& rows) {
    start_receivers();
    prepare_sources();
    for (const std::size_t nbuf : c_.buffer_counts)
      for (const double mb : c_.buffer_mb)
        for (const bool want_direct : row_paths()) {
          const row r = run_row(nbuf, mb, want_direct);
          write_row(out, r);
          rows.push_back(r);
        }
    end_receivers();
  }

 private:
  row::side_memory receiver_memory_;   ///< the row so far: take_memory()
  std::int64_t receiver_driver_ = -1;  ///< the row so far: the largest receiver driver view (take_memory)
  [[nodiscard]] std::string who(std::size_t k) const {
    return several_ ? fmt::format("{} {} of {} (GPU {}, pid {})", tp_ ? "rank" : "receiver", k, children_.size(),
                                  devices_[k], children_[k]->pid())
                    : fmt::format("the receiver (pid {})", children_[k]->pid());
  }

  /// Spawns the receivers and waits until each is ready, or connects to the report endpoint of a
  /// receiver started by hand (only --no-verify goes without).
  void start_receivers() {
    if (spawn_) {
      dir_ = std::make_unique<temp_dir>();
      const int visible = nccl_ || c_.spread_receivers ? visible_gpus() : 0;
      for (std::size_t k = 0; k < count_; ++k) {
        devices_.push_back(receiver_gpu(c_, g_.kind, k, visible));
        const std::string bind = fmt::format("ipc://{}/receiver-{}", dir_->path, k);
        children_.push_back(std::make_unique<child_process>(
            c_.receiver_exe, receiver_args(c_, g_.kind, g_.m.name, bind, g_.apply_engine, devices_.back(), ranks_[k])));
      }
      // All spawned first, so that they fill their destination tensors in parallel.
      for (std::size_t k = 0; k < count_; ++k) {
        const json ready = parse_peer_json(children_[k]->read_line(std::chrono::minutes(10)), 1 << 20, who(k));
        if (ready.value("event", "") != "ready")
          throw error(errc::protocol, fmt::format("refit-bench: {} said {} instead of ready", who(k), excerpt(ready)));
        endpoints_.push_back(ready.at("endpoint").get<std::string>());
      }
      endpoint_ = endpoints_.front();
    } else if (verify_) {
      try {
        report_ = std::make_unique<channel::req_channel>(c_.report, c_.curve);
      } catch (const error& e) {
        throw error(e.code(), fmt::format("refit-bench: --report {}: {}", c_.report, e.what()));
      }
    } else {
      // Always said, --quiet or not: the table cannot vouch for the data in this mode.
      std::cerr << "refit-bench: WARNING: --no-verify: nothing compares the receiver's checksums with this "
                   "streamer's (wrong = n/a)"
                << std::endl;
    }
  }

  /// The receiver's committed line for version v, from its report endpoint.
  json ask_report(std::uint64_t v, milliseconds timeout) {
    std::string reply;
    try {
      reply = report_->request(json{{"version", v}}.dump(), timeout, fmt::format("the report of version {}", v));
    } catch (const error& e) {
      if (e.code() == errc::timeout)
        throw error(errc::timeout,
                    fmt::format("refit-bench: {} did not answer for version {} within {} ms: is it the "
                                "\"report\" endpoint the receiver printed, and is that receiver running?",
                                report_who_, v, timeout.count()));
      throw error(e.code(), fmt::format("refit-bench: asking {} for version {} failed: {}", report_who_, v, e.what()));
    }
    if (const auto problem = peer_json_problem(reply, max_report_bytes(g_.m)))
      throw error(errc::protocol,
                  fmt::format("refit-bench: {} answered for version {} with JSON {}: refused unread; it "
                              "begins {}",
                              report_who_, v, *problem, printable(reply, 200)));
    json line = json::parse(reply, nullptr, false);
    if (line.is_discarded())
      throw error(
          errc::protocol,
          fmt::format("refit-bench: {} answered for version {} with something that is not JSON "
                      "(is it the refit endpoint, --connect, instead of the report one?): {}",
                      report_who_, v, json(reply.substr(0, 100)).dump(-1, ' ', false, json::error_handler_t::replace)));
    return line;
  }

  /// The source tensors, and one expectation per distinct rank (receiver k checks against
  /// expects_[expect_of_[k]]).
  void prepare_sources() {
    progress(c_, fmt::format("{} {}: preparing {} tensors, {:.3f} GB of source data", tname_, g_.m.name,
                             g_.m.entries.size(), g_.m.bytes() / 1e9));
    const auto t_prep = clock::now();
    src_ = g_.path.sources(g_.m, c_.seed, g_.files);
    n_ = g_.m.entries.size();
    refs_.resize(n_);
    sizes_.resize(n_);
    for (std::size_t i = 0; i < n_; ++i) {
      refs_[i] = tensor_ref{g_.m.entries[i].meta, src_->data(i), src_->where(), nullptr};
      sizes_[i] = g_.m.entries[i].meta.nbytes();
    }
    for (const int rank : ranks_) {
      const auto same =
          std::find_if(expects_.begin(), expects_.end(), [&](const expectation& e) { return e.rank == rank; });
      expect_of_.push_back(static_cast<std::size_t>(same - expects_.begin()));
      if (same == expects_.end()) expects_.push_back(expect_rank(c_, g_.m, rank, *src_, verify_));
    }
    for (const auto& e : expects_) needed_ += e.bytes;
    progress(c_, fmt::format("{} {}: ready in {:.1f} s", tname_, g_.m.name, ms_since(t_prep) / 1e3));
  }

  /// cuda_ipc and nccl have a direct path (nccl: in place); host_shm runs each row once. A
  /// transport that serves several receivers only by direct writes (cuda_ipc, tpN's ranks) has no
  /// staged row then (run() checked that a direct one is left, and said so in the preamble).
  [[nodiscard]] std::vector<bool> row_paths() const {
    std::vector<bool> paths = g_.kind != transport_kind::host_shm ? c_.direct : std::vector<bool>{false};
    if (endpoints_.size() > 1 && transport::capabilities_of(g_.kind).several_need_direct) std::erase(paths, false);
    return paths;
  }

  [[nodiscard]] streamer_options options_for(std::size_t nbuf, double mb, bool want_direct) const {
    streamer_options so = streamer_options_for(c_, g_.kind, mb, nbuf);
    so.direct = want_direct;
    so.endpoint = endpoint_;
    // Several receivers (nccl --receivers, tpN's ranks): one streamer serves them all.
    if (endpoints_.size() > 1) so.receivers = endpoints_;
    so.alignment = c_.alignment;
    so.keep_whole = c_.keep_whole;
    so.share_tensors = c_.share;
    so.engine = g_.engine;
    if (!c_.connect.empty()) so.curve = c_.curve;  // a receiver started by hand
    return so;
  }

  /// A row's fixed columns, before any refit.
  [[nodiscard]] row row_head(const streamer_options& so) const {
    row r;
    r.transport = tname_;
    r.receivers = spawn_ ? endpoints_.size() : 1;
    r.model = g_.m.name;
    r.engine = g_.kind == transport_kind::host_shm ? "memcpy"
               : g_.engine == g_.apply_engine      ? std::string(to_string(g_.engine))
                                              : fmt::format("{}/{}", to_string(g_.engine), to_string(g_.apply_engine));
    r.buffer_bytes = so.buffer_bytes;
    r.buffers = so.buffer_count;
    r.tensors = n_;
    r.bytes = needed_;
    r.iters = c_.iters;
    r.wrong = verify_ ? 0 : -1;
    r.layout = layout_name(c_.layout);
    return r;
  }

  /// The largest of the receivers' memory peaks (their committed lines' "memory") in the row.
  void take_memory(const json& line) {
    const auto it = line.find("memory");
    if (it == line.end() || !it->is_object()) return;
    const auto most = [&](std::int64_t& into, const char* key) {
      const auto v = it->find(key);
      if (v != it->end() && v->is_number_unsigned()) into = std::max(into, v->get<std::int64_t>());
    };
    most(receiver_memory_.device, "device");
    most(receiver_memory_.pinned, "pinned");
    most(receiver_memory_.host, "host");
    const auto driver = it->find("driver");
    if (driver != it->end() && driver->is_number_integer())
      receiver_driver_ = std::max(receiver_driver_, driver->get<std::int64_t>());
  }

  /// One row: warm-up and counted refits with one streamer, then the row's statistics.
  row run_row(std::size_t nbuf, double mb, bool want_direct) {
    const streamer_options so = options_for(nbuf, mb, want_direct);
    reset_memory_peaks();  // the row's streamer from here (the sources are the caller's: not counted)
    receiver_memory_ = {};
    receiver_driver_ = -1;
    const std::int64_t driver_before = driver_used();
    streamer s(so);
    row r = row_head(so);
    row_samples samples;
    bool went_direct = false;
    bool lane = true;
    std::uint64_t shared = 0;
    const int total = c_.warmup + c_.iters;
    for (int it = 0; it < total; ++it) {
      const std::uint64_t v = g_.version++;
      if (c_.announce) (void)s.announce();  // as a trainer would, before its step makes the weights
      if (!first_) refresh_sources(v);
      first_ = false;
      const auto t0 = clock::now();
      const refit_stats st = refit_once(s, v, mb, nbuf);
      const double ms = ms_since(t0);
      r.batches = st.batches;
      double apply_ms = -1, pause_ms = -1;
      const std::int64_t wrong_now = check_receivers(v, apply_ms, pause_ms);
      if (verify_) r.wrong += wrong_now;
      const bool counted = it >= c_.warmup;
      progress(c_, fmt::format("{} {} {} {:g} MiB x{} {} {}/{}: {:.2f} ms, {:.2f} GB/s{}", tname_, r.engine, g_.m.name,
                               mb, nbuf, counted ? "iter" : "warm-up", counted ? it - c_.warmup + 1 : it + 1,
                               counted ? c_.iters : c_.warmup, ms, r.bytes / (ms * 1e6),
                               wrong_now ? fmt::format(", {} WRONG", wrong_now) : ""));
      went_direct = st.direct;
      shared = st.shared_bytes;
      lane = st.control_lane;
      if (!counted) continue;
      samples.times.push_back(ms);
      samples.source.push_back(st.source_seconds * 1e3);
      samples.pack.push_back(st.pack_seconds * 1e3);
      samples.wait.push_back(st.wait_seconds * 1e3);
      if (apply_ms >= 0) samples.apply.push_back(apply_ms);
      if (pause_ms >= 0) samples.pause.push_back(pause_ms);
      if (c_.atomic) samples.commit.push_back(st.commit_seconds * 1e3);
    }
    if (c_.split) r.fixed_ms = fixed_cost(s, mb, nbuf, r);
    const memory_usage held = memory_in_use();
    r.streamer_memory = {static_cast<std::int64_t>(held.device_peak), static_cast<std::int64_t>(held.pinned_peak),
                         static_cast<std::int64_t>(held.host_peak)};
    r.receiver_memory = receiver_memory_;
    const std::int64_t driver_after = driver_used();
    if (driver_before >= 0 && driver_after >= 0)
      r.streamer_driver = std::max<std::int64_t>(0, driver_after - driver_before);
    r.receiver_driver = receiver_driver_;
    s.close();
    finish_row(r, samples, went_direct, shared);
    set_memory_budget(c_, g_.m, r, went_direct);
    // Requests through ZeroMQ (--control-lane 0, or no lane offered): labelled, since a small
    // refit's fixed cost differs.
    if (!lane) r.engine += "+zmq";
    if (c_.announce) r.engine += "+announce";
    if (nccl_ && c_.twin) r.engine += "+twin";
    if (c_.vmm_sources && !nccl_) r.engine += "+vmm-src";
    if (c_.dests != dest_memory::torch && !nccl_) r.engine += fmt::format("+{}-dst", to_string(c_.dests));
    return r;
  }

  /// --split: the median of warm-up + iters refits of the smallest tensor with bytes alone, each a
  /// subset version in the row's session (verified like the others: the source is unchanged, so
  /// every receiver still holds what it expects); -1 when the model has no such tensor.
  double fixed_cost(streamer& s, double mb, std::size_t nbuf, row& r) {
    std::size_t smallest = n_;
    for (std::size_t i = 0; i < n_; ++i)
      if (sizes_[i] != 0 && (smallest == n_ || sizes_[i] < sizes_[smallest])) smallest = i;
    if (smallest == n_) return -1;
    std::vector<double> times;
    for (int it = 0; it < c_.warmup + c_.iters; ++it) {
      const std::uint64_t v = g_.version++;
      const auto t0 = clock::now();
      try {
        (void)s.refit(v, std::span<const tensor_ref>(&refs_[smallest], 1), refit_scope::subset);
      } catch (const error& e) {
        throw error(e.code(), fmt::format("refit-bench: {} {} {} MiB x{}: --split refit of version {} ({} alone) "
                                          "failed: {}{}",
                                          tname_, g_.m.name, mb, nbuf, v, refs_[smallest].meta.name, e.what(),
                                          reused_receiver_hint(e)));
      }
      const double ms = ms_since(t0);
      // The next refit announced before this one is checked (as the row's are before their new weights).
      if (c_.announce) (void)s.announce();
      double apply_ms = -1, pause_ms = -1;
      const std::int64_t wrong_now = check_receivers(v, apply_ms, pause_ms);
      if (verify_) r.wrong += wrong_now;
      if (it >= c_.warmup) times.push_back(ms);
    }
    return median(times);
  }

  /// Fresh data for every refit: one byte per tensor changes, expected sums follow in O(1).
  void refresh_sources(std::uint64_t v) {
    const auto mask = static_cast<std::uint8_t>(1 + v % 255);
    for (std::size_t i = 0; i < n_; ++i) {
      if (sizes_[i] == 0) continue;
      const std::uint64_t off = (v * 0x9e3779b97f4a7c15ull + i * 0x2545f4914f6cdd1dull) % sizes_[i];
      const std::uint8_t old = src_->flip(i, off, mask);
      if (verify_) expect_flip(expects_, i, off, old, static_cast<std::uint8_t>(old ^ mask));
    }
  }

  /// Refits version v; a failure is reported with what the receivers said about it.
  refit_stats refit_once(streamer& s, std::uint64_t v, double mb, std::size_t nbuf) {
    try {
      return s.refit(v, std::span<const tensor_ref>(refs_));
    } catch (const error& e) {
      std::string detail;
      for (std::size_t k = 0; k < children_.size(); ++k) {
        try {
          const json line =
              parse_peer_json(children_[k]->read_line(std::chrono::seconds(2)), max_report_bytes(g_.m), who(k));
          if (line.value("event", "") == "aborted")
            detail += fmt::format("; {} says: {}", who(k), printable(line.value("error", ""), 1024));
        } catch (...) {
        }
      }
      if (report_) {
        try {
          const json line = ask_report(v, std::chrono::seconds(2));
          if (line.value("event", "") == "aborted")
            detail += fmt::format("; {} says: {}", report_who_, printable(line.value("error", ""), 1024));
        } catch (...) {
        }
      }
      throw error(e.code(), fmt::format("refit-bench: {} {} {} MiB x{}: refit of version {} failed: {}{}{}", tname_,
                                        g_.m.name, mb, nbuf, v, e.what(), detail, reused_receiver_hint(e)));
    }
  }

  /// Every receiver must have committed v: returns the wrong checksums summed over the receivers,
  /// and sets `apply_ms` to the slowest receiver's apply (`pause_ms`: its staged apply, --stage).
  std::int64_t check_receivers(std::uint64_t v, double& apply_ms, double& pause_ms) {
    std::int64_t wrong_now = 0, printed = 0;
    for (std::size_t k = 0; k < children_.size(); ++k) {
      const json line =
          parse_peer_json(children_[k]->read_line(milliseconds(std::max<std::uint64_t>(c_.timeout_ms, 600000))),
                          max_report_bytes(g_.m), who(k));
      const std::string label = !several_ ? std::string() : fmt::format(" {} {}", tp_ ? "rank" : "receiver", k);
      wrong_now += count_wrong(c_, line, v, g_.m, expects_[expect_of_[k]].sums, who(k), label, printed, ranks_[k]);
      apply_ms = std::max(apply_ms, line.value("apply_ms", -1.0));
      pause_ms = std::max(pause_ms, line.value("pause_ms", -1.0));
      take_memory(line);
    }
    if (report_) {
      const json line = ask_report(v, milliseconds(c_.timeout_ms));
      wrong_now +=
          count_wrong(c_, line, v, g_.m, expects_.front().sums, report_who_, std::string(), printed, ranks_.front());
      apply_ms = line.value("apply_ms", -1.0);
      pause_ms = line.value("pause_ms", -1.0);
    }
    return wrong_now;
  }

  /// The row's statistics from its counted refits.
  /// `shared`: bytes of a staged refit the receiver read where they were (copied once).
  void finish_row(row& r, const row_samples& samples, bool went_direct, std::uint64_t shared = 0) const {
    r.median_ms = median(samples.times);
    r.min_ms = *std::min_element(samples.times.begin(), samples.times.end());
    r.max_ms = *std::max_element(samples.times.begin(), samples.times.end());
    r.gbps = r.bytes / (r.median_ms * 1e6);
    r.ceiling_gbps = g_.ceiling / 1e9;
    // A direct refit copies every byte once, a staged one twice: each is held to its own floor.
    if (went_direct) r.engine += nccl_ ? "+in-place" : "+direct";
    // A recorded layout's files stay out of the engine column (the JSON row's layout names them).
    if (c_.layout != layout_kind::plain)
      r.engine += "+" + (c_.layout.kind == layout_kind::recorded ? std::string("recorded") : layout_name(c_.layout));
    // Over nccl the ceiling is itself the transfer (a raw broadcast), which refit makes once, with
    // packing and applying overlapping it: one pass too.
    r.floor_ms = (went_direct || nccl_ ? 1.0 : 2.0) * static_cast<double>(r.bytes) / g_.ceiling * 1e3;
    if (!went_direct && !nccl_ && shared != 0) {
      // Read in place by the receiver: those bytes are copied once, the others twice.
      r.engine += shared == r.bytes ? "+shared" : "+part-shared";
      r.floor_ms = (2.0 * static_cast<double>(r.bytes) - static_cast<double>(shared)) / g_.ceiling * 1e3;
    }
    if (c_.convert) {
      // Its own floor: the bytes read and written at the device-copy speed (a copy of B bytes
      // reads B and writes B). Direct: the source read once, the converted bytes written once;
      // staged: then those copied again from the buffer.
      double read = 0, written = 0;
      for (const auto& e : g_.m.entries) {
        read += static_cast<double>(e.meta.nbytes());
        written += static_cast<double>(converted_bytes(*c_.convert, e.meta));
      }
      const double traffic = went_direct ? read + written : read + 3 * written;
      // Over nccl the ceiling is the link's broadcast, which carries the converted bytes once.
      r.floor_ms = (nccl_ ? written : traffic / 2) / g_.ceiling * 1e3;
      r.engine += "+cvt:" + c_.convert->name.substr(c_.convert->name.find(':') + 1);
    }
    r.ratio = r.floor_ms / r.median_ms;
    r.source_ms = median(samples.source);
    r.pack_ms = median(samples.pack);
    r.wait_ms = median(samples.wait);
    r.apply_ms = samples.apply.empty() ? -1 : median(samples.apply);
    r.pause_ms = samples.pause.empty() ? -1 : median(samples.pause);
    r.commit_ms = samples.commit.empty() ? -1 : median(samples.commit);
  }

  void end_receivers() {
    for (auto& child : children_) {
      const int status = child->finish(std::chrono::seconds(30));
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        progress(c_, fmt::format("WARNING: the receiver process (pid {}) ended with {}", child->pid(),
                                 child_process::describe_exit(status)));
    }
  }

  row_group& g_;
  const config& c_;
  const std::string tname_;
  // Declared in the order the steps make them, so that they are released in the reverse order.
  std::unique_ptr<temp_dir> dir_;
  // One receiver process, or for nccl --receivers of them, or one per rank of --layout tpN over
  // cuda_ipc and nccl: receiver k on GPU devices_[k], holding rank ranks_[k].
  std::vector<std::unique_ptr<child_process>> children_;
  std::vector<int> devices_;
  std::vector<std::string> endpoints_;
  std::string endpoint_;
  const bool spawn_;
  // Started by hand, the receiver answers for its checksums on its report endpoint; only
  // --no-verify goes without.
  const bool verify_;
  std::unique_ptr<channel::req_channel> report_;
  const std::string report_who_;
  const bool nccl_;
  const bool tp_;
  const std::size_t count_;
  std::vector<int> ranks_;
  const bool several_;
  std::unique_ptr<tensor_memory> src_;
  std::size_t n_ = 0;
  std::vector<tensor_ref> refs_;
  std::vector<std::uint64_t> sizes_;
  std::vector<expectation> expects_;
  std::vector<std::size_t> expect_of_;
  std::uint64_t needed_ = 0;  // the bytes the receivers need, summed over the distinct ranks
  bool first_ = true;
};

}  // namespace

streamer_options streamer_options_for(const config& c, transport_kind t, double mb, std::size_t buffers) {
  streamer_options so;
  so.transport = t;
  so.buffer_count = buffers;
  so.buffer_bytes = static_cast<std::uint64_t>(std::llround(mb * (1 << 20)));
  so.control_lane = c.lane;
  so.nccl_twin = c.twin;
  so.atomic = c.atomic;
  so.device = c.device;
  so.timeout = milliseconds(c.timeout_ms);
  return so;
}

void run_row_group(row_group& g, std::ostream& out, std::vector<row>& rows) { group_runner(g).run(out, rows); }

}  // namespace refit::bench
