// The receiver side (--role receiver): spawned by a streamer, or started by hand. It holds the model
// as --layout says, reports each committed refit on its stdout as one JSON line
// {"event":"committed","version":v,"apply_ms":..,"checksums":[...]}, and exits when its stdin closes
// (spawned) or on a signal. Started by hand (on one host or two) it prints the same lines and also
// binds a report endpoint (--report; by default next to --bind): a REP socket that answers
// {"version": v} with its committed line for v (report_log, bench/role_report.cpp). It answers only
// between refits (serve_one() with a short wait, then the report socket without one): a request sent
// during a refit waits in the socket's queue and never slows the refit. The same binary, as one rank
// of the nccl ceiling (--nccl-ceiling), only broadcasts (run_ceiling_rank).
//
// Its options from the command line are read in one place, receiver_role_options().
#include <signal.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>

#include "bench/bench.hpp"
#include "bench/roles.hpp"
#include "bench/spawn.hpp"
#include "channel/channel.hpp"
#include "model/text.hpp"
#include "refit/memory.hpp"
#include "refit/error.hpp"
#include "refit/receiver.hpp"

namespace refit::bench {
namespace {

using clock = std::chrono::steady_clock;
using nlohmann::json;

volatile sig_atomic_t stop_requested = 0;
extern "C" void on_stop_signal(int) { stop_requested = 1; }

// One rank (1..) of the nccl ceiling, spawned by the streamer's nccl path: broadcasts with the
// others, says so on stdout, and stays in the communicator until the streamer closes our stdin
// (leaving earlier would look like a failure to rank 0, which may still be finishing).
int run_ceiling_rank(const config& c) {
  const milliseconds timeout(c.timeout_ms);
  if (c.spawned) ::signal(SIGPIPE, SIG_IGN);
  // True once stdin is at its end: the streamer is done, or gone.
  const auto watch = [&] {
    if (c.spawned && stdin_closed(0)) throw error(errc::peer, "the streamer went away (stdin closed)");
  };
  const auto done = [&] {
    std::cout << json{{"event", "ceiling"}, {"rank", c.nccl_rank}, {"pid", ::getpid()}}.dump() << '\n' << std::flush;
    if (!c.spawned) return;
    const auto until = clock::now() + timeout;
    while (clock::now() < until && !stdin_closed(100)) {
    }
  };
  try {
    nccl_ceiling_rank(c.nccl_ceiling_id, c.nccl_rank, c.nccl_ranks, c.device, timeout, watch, done);
  } catch (const error& e) {
    throw error(e.code(), fmt::format("refit-bench: nccl ceiling rank {} of {} on GPU {}: {}", c.nccl_rank,
                                      c.nccl_ranks, c.device, e.what()));
  }
  return 0;
}

// The report endpoint of a receiver started by hand: a REP socket, and for ipc its socket file,
// removed with it. ZeroMQ removes the file too, but later, from its own thread: the receiver's
// private directory, where the default one lives, would still hold it when it is removed.
class report_endpoint {
 public:
  report_endpoint(const std::string& endpoint, const curve_keys& curve) {
    try {
      curve_keys server = curve;
      server.server_key.clear();
      channel_.emplace(endpoint, server);
    } catch (const error& e) {
      throw error(e.code(),
                  fmt::format("refit-bench: the report endpoint {}: {}; choose another with --report ENDPOINT",
                              endpoint, e.what()));
    }
  }
  ~report_endpoint() {
    const std::string bound = channel_->endpoint();
    channel_.reset();
    if (bound.starts_with("ipc://")) ::unlink(bound.c_str() + 6);
  }
  report_endpoint(const report_endpoint&) = delete;
  report_endpoint& operator=(const report_endpoint&) = delete;

  [[nodiscard]] channel::rep_channel& channel() noexcept { return *channel_; }

 private:
  std::optional<channel::rep_channel> channel_;
};

void emit(const json& j) {
  std::cout << dump_line(j) << '\n';
  std::cout.flush();
}

/// The line that tells the streamer (or the user) where this receiver listens and what it holds.
json ready_line(const config& c, const manifest& m, const engine_layout& layout, receiver& r, const std::string& device,
                report_endpoint* reports) {
  json ready{{"event", "ready"},
             {"endpoint", r.endpoint()},
             {"pid", ::getpid()},
             {"device", device},
             {"tensors", m.entries.size()},
             {"bytes", m.bytes()},
             {"layout", layout_name(c.layout)},
             {"engine_tensors", layout.tensors.entries.size()},
             {"views", layout.views.size()}};
  if (c.layout.tp > 1) ready["rank"] = c.rank;
  if (reports) ready["report"] = reports->channel().endpoint();
  return ready;
}

/// Started by hand: tells the user, on stderr, the streamer's command line.
void print_banner(const config& c, const manifest& m, const std::string& model, receiver& r, report_endpoint& reports) {
  const std::string transport(to_string(c.transports.front()));
  std::string same =
      fmt::format("--transport {} {} {}", transport, c.manifest_file.empty() ? "--model" : "--manifest", model);
  if (c.type != dtype::bf16) same += fmt::format(" --dtype {}", to_string(c.type));
  if (c.layout != layout_kind::plain) same += fmt::format(" --layout {}", layout_name(c.layout));
  if (c.layout.tp > 1) same += fmt::format(" --rank {}", c.rank);
  if (!c.curve.secret_key.empty())
    same += fmt::format(" --curve-server-key {} --curve-public-key <yours> --curve-secret-key <yours>",
                        c.curve.public_key.empty() ? std::string("<this receiver's public key>") : c.curve.public_key);
  const std::string& report_ep = reports.channel().endpoint();
  const bool wildcard =
      r.endpoint().find("//0.0.0.0:") != std::string::npos || report_ep.find("//0.0.0.0:") != std::string::npos;
  // This executable's own path: `tools/dev build` leaves refit-bench in build/bench, not on PATH.
  std::error_code ec;
  std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  if (ec || self.empty()) self = "refit-bench";
  std::cerr << fmt::format(
      "refit-bench: receiver for {} over {} listening on {}, checksums on {} (Ctrl-C to stop)\n"
      "refit-bench: start the streamer with:\n"
      "  {} --role streamer --connect {} --report {} {}\n{}",
      m.name, transport, r.endpoint(), report_ep, self, r.endpoint(), report_ep, same,
      wildcard ? "refit-bench: (from another host, put this host's address in place of 0.0.0.0)\n" : "");
}

/// The committed line for the version just committed: each source's bytes as they landed in its
/// view(s), after the deliberate damage --corrupt-byte asks for.
/// `driver_base`: driver_used() once the weights were allocated (-1: unknown).
json committed_line(const config& c, const manifest& m, const engine_layout& layout, tensor_memory& dest, receiver& r,
                    std::int64_t driver_base) {
  const receiver_stats st = r.last_stats();
  const std::uint64_t v = r.committed_version().value_or(0);
  corrupt_after_commit(c, m, layout, dest);
  const auto t1 = clock::now();
  json sums = view_checksums(m, layout, dest);
  // apply: copying into the weights, plus the wait at END for the device to finish them.
  json line{{"event", "committed"},
            {"version", v},
            {"apply_ms", (st.apply_seconds + st.drain_seconds) * 1e3},
            {"receiver_ms", st.seconds * 1e3},
            {"batches", st.batches},
            {"checksum_ms", ms_since(t1)},
            {"layout", layout_name(c.layout)},
            {"checksums", std::move(sums)}};
  if (c.layout.tp > 1) line["rank"] = c.rank;
  if (c.stage != stage_kind::none) line["pause_ms"] = st.pause_seconds * 1e3;
  // What refit held at most since the last commit (this refit): the bench's memory columns.
  const memory_usage held = memory_in_use();
  line["memory"] = {{"device", held.device_peak}, {"pinned", held.pinned_peak}, {"host", held.host_peak}};
  // The driver's view: device memory this process took since its weights were allocated (refit's,
  // NCCL's buffers, the context's growth), now that the version is committed.
  const std::int64_t driver_now = driver_used();
  if (driver_base >= 0 && driver_now >= 0)
    line["memory"]["driver"] = std::max<std::int64_t>(0, driver_now - driver_base);
  reset_memory_peaks();
  return line;
}

}  // namespace

void register_views(receiver& r, const config& c, const manifest& m, const engine_layout& layout, tensor_memory& dest) {
  for (const layout_view& v : layout.views) {
    const tensor_meta& src = m.entries[v.source].meta;
    tensor_dest d{tensor_meta{src.name, src.type, v.shape}, dest.data(v.tensor) + v.offset, dest.where()};
    if (c.convert && c.layout == layout_kind::plain) {
      // The codes at the start of the source-sized memory, the scales behind them.
      if (const auto scale_at = converted_scale_offset(*c.convert, src)) {
        d.meta.type = c.convert->to;
        d.q = c.convert->q;
        if (d.q != quant::none) d.scale = d.data == nullptr ? nullptr : static_cast<std::byte*>(d.data) + *scale_at;
      }
    }
    if (c.layout == layout_kind::plain) {
      r.add_parameter(d);  // dense, one tensor per source: as before layouts existed
    } else {
      const tensor_meta& engine = layout.tensors.entries[v.tensor].meta;
      r.add_parameter(d, dest_layout{v.strides, v.slice, dest.data(v.tensor), engine.nbytes()});
    }
  }
}

void corrupt_after_commit(const config& c, const manifest& m, const engine_layout& layout, tensor_memory& dest) {
  if (!c.corrupt_tensor || m.bytes() == 0) return;
  // The first byte of the tensor's last view (a tied embedding's engine lm_head).
  std::size_t i = *c.corrupt_tensor % m.entries.size();
  while (m.entries[i].meta.nbytes() == 0) i = (i + 1) % m.entries.size();
  const layout_view& v = layout.views[layout.of_source[i].back()];
  dest.flip(v.tensor, v.offset, 0x01);
}

std::vector<std::uint64_t> view_checksums(const manifest& m, const engine_layout& layout, const tensor_memory& dest) {
  std::vector<std::uint64_t> sums, of_views;
  for (std::size_t i = 0; i < m.entries.size(); ++i) {
    of_views.clear();
    for (const std::size_t k : layout.of_source[i]) {
      const layout_view& v = layout.views[k];
      of_views.push_back(dest.checksum(v.tensor, v.offset, v.bytes));
    }
    sums.push_back(fold_view_checksums(of_views));
  }
  return sums;
}

receiver_options receiver_role_options(const config& c) {
  receiver_options ro;
  ro.endpoint = c.bind;
  ro.device = c.device;
  ro.engine = c.engines.front();
  ro.idle_timeout = milliseconds(c.timeout_ms);
  ro.stage = c.stage;
  if (!c.spawned) {
    ro.curve = c.curve;
    ro.curve.server_key.clear();
  }
  return ro;
}

namespace {

/// The receiver role's process: the model as it holds it, the receiver, and (started by hand) the
/// report endpoint and what it answers with. Made in this order, released in the reverse one.
class receiver_role {
 public:
  explicit receiver_role(const config& c)
      : c_(c),
        model_(one_model(c)),
        m_(workload(c, model_)),
        path_(make_path(c.transports.front(), c)),
        // The model as the receiver holds it (--layout): engine tensors, allocated like any
        // destinations (over cuda_ipc as --dest-memory says: torch's segments by default; host
        // memory in one arena), and every source tensor's view of them.
        layout_(make_layout(m_, c.layout, c.rank)),
        dest_(path_->destinations(layout_.tensors)),
        r_(receiver_role_options(c)) {
    register_views(r_, c, m_, layout_, *dest_);
    driver_base_ = driver_used();
    // Started by hand: the streamer asks for our checksums here (a spawned one reads our stdout).
    // Made after the receiver, so that it goes first: its ipc file may sit in the receiver's
    // private directory.
    if (!c.spawned) reports_.emplace(c.report.empty() ? default_report_endpoint(r_.endpoint()) : c.report, c.curve);
  }

  /// The ready line (and, started by hand, the banner before it).
  void announce() {
    const json ready = ready_line(c_, m_, layout_, r_, path_->describe_device(), reports_ ? &*reports_ : nullptr);
    // The banner before the ready line: whoever has seen that line can read the banner too.
    if (reports_) print_banner(c_, m_, model_, r_, *reports_);
    emit(ready);
  }

  /// Serves until a signal, or (spawned) until the streamer closes our stdin (done, or dead).
  void serve() {
    // Started by hand we also watch the report endpoint, between messages: a short wait here keeps
    // its answers prompt, and a message of a refit still ends the wait at once.
    const milliseconds wait(reports_ ? 10 : 100);
    while (!stop_requested && !(c_.spawned && stdin_closed(0))) {
      const receiver_event event = r_.serve_one(wait);
      // Staged (--stage): applied as soon as prepared, as an engine between two steps would.
      if (event == receiver_event::prepared && r_.apply_prepared()) on_committed();
      if (event == receiver_event::committed) on_committed();
      if (event == receiver_event::aborted) on_aborted();
      // Not in the middle of a refit: a report request sent during one waits in the socket's queue.
      if (reports_ && event != receiver_event::hello && event != receiver_event::begin &&
          event != receiver_event::batch)
        while (const auto request = reports_->channel().receive(milliseconds(0)))
          reports_->channel().reply(log_.answer(*request));
    }
  }

 private:
  static std::string one_model(const config& c) {
    if (c.transports.size() != 1)
      throw error(errc::invalid_argument, "refit-bench: --role receiver serves one --transport");
    const auto models = model_list(c);
    if (models.size() != 1) throw error(errc::invalid_argument, "refit-bench: --role receiver serves one --model");
    return models.front();
  }

  void on_committed() {
    const json line = committed_line(c_, m_, layout_, *dest_, r_, driver_base_);
    if (!reports_) return emit(line);
    // Started by hand, stdout is a terminal: the checksums (one per tensor) are for the streamer,
    // which asks for them on the report endpoint.
    json shown = line;
    shown.erase("checksums");
    shown["tensors"] = m_.entries.size();
    emit(shown);
    log_.committed(line);
  }

  void on_aborted() {
    // The error may quote what the streamer sent (a tensor name of any bytes): one printable line.
    const json line{{"event", "aborted"}, {"error", printable(r_.last_error())}};
    emit(line);
    if (reports_) log_.aborted(line);
  }

  const config& c_;
  const std::string model_;
  const manifest m_;
  std::unique_ptr<transport_path> path_;
  const engine_layout layout_;
  std::unique_ptr<tensor_memory> dest_;
  receiver r_;
  std::optional<report_endpoint> reports_;
  report_log log_;
  std::int64_t driver_base_ = -1;  ///< driver_used() with the weights allocated (committed_line)
};

}  // namespace

int run_receiver(const config& c) {
  if (!c.nccl_ceiling_id.empty()) return run_ceiling_rank(c);
  receiver_role role(c);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  if (c.spawned) ::signal(SIGPIPE, SIG_IGN);
  role.announce();
  role.serve();
  return 0;
}

}  // namespace refit::bench
