// refit-bench --chaos SPEC: a fleet that changes while it trains (README.md "A fleet that changes").
//
// One streamer in this process serves --receivers receiver processes (spawned as the usual rows'
// are: bench/spawn.hpp, "--role receiver") with on_receiver_failure = drop. Before each counted
// version, with the probabilities of SPEC drawn from --seed's generator, a new receiver is added
// (add_receiver) and a served one removed (remove_receiver: BYE, then its process is ended); during
// it, a served receiver is SIGKILLed when the source has yielded a random number of tensors (the
// source waits until waitpid() says the process is gone, so the death is certain before the next
// tensor), and once the version is done it is started again on its endpoint and served again by
// the streamer's retries (back=rejoin) or by add_receiver() (back=add). Nothing waits on a clock:
// each step waits on a pipe (a receiver's ready or committed line) or on waitpid().
//
// After every version each receiver the streamer still serves must have committed it, and its
// committed line's checksums (one per tensor, computed by the receiver from the bytes it holds)
// are compared with this side's (the "wrong" column, as the usual rows do: bench/role_streamer.cpp).
// The data changes at every version (one byte per tensor), so a receiver that kept an old version
// or took part of one shows up as wrong.
//
// Figures: a version is quiet (no failure, no join), a join (a receiver joined: host_shm opens a
// new session for every receiver then: lib/streamer/fleet.cpp), or failed (a receiver dropped).
// Failover: from the kill to refit() returning with the survivors committed. Join: from the
// receiver being ready and known to the streamer (restarted, or added) to refit() returning with it
// committed. Targets: a failover within one reply timeout plus one version's transfer (to n
// receivers: chaos_row::transfer_for), and no version longer than
// failures x (timeout + transfer) + transfer (two for a join: its new session for every receiver)
// + the grace a drop needs (chaos_grace_ms).
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "bench/bench.hpp"
#include "bench/role_report.hpp"
#include "bench/roles.hpp"
#include "bench/spawn.hpp"
#include "config/config.hpp"
#include "model/text.hpp"
#include "refit/error.hpp"
#include "refit/streamer.hpp"
#include "transport/transport.hpp"

namespace refit::bench {

chaos_spec parse_chaos(std::string_view text) {
  chaos_spec s;
  s.text = std::string(text);
  const auto probability = [&](std::string_view v, std::string_view part) {
    double p = -1;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), p);
    if (ec != std::errc{} || end != v.data() + v.size() || !(p >= 0 && p <= 1))
      throw error(errc::invalid_argument,
                  fmt::format("refit-bench: --chaos {}: {} is not a probability in [0, 1] (kill=P,add=P,remove=P,"
                              "back=rejoin|add, or a bare P for kill=P)",
                              text, part));
    return p;
  };
  if (text.empty()) throw error(errc::invalid_argument, "refit-bench: --chaos: empty (e.g. kill=0.2,add=0.05)");
  if (text.find('=') == std::string_view::npos) {
    s.kill = probability(text, text);
    return s;
  }
  for (std::size_t at = 0; at <= text.size();) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    const std::string_view part = text.substr(at, comma - at);
    at = comma + 1;
    const std::size_t eq = part.find('=');
    const std::string_view key = part.substr(0, eq), value = eq == std::string_view::npos ? "" : part.substr(eq + 1);
    if (key == "kill")
      s.kill = probability(value, part);
    else if (key == "add")
      s.add = probability(value, part);
    else if (key == "remove")
      s.remove = probability(value, part);
    else if (key == "back" && (value == "rejoin" || value == "add"))
      s.rejoin = value == "rejoin";
    else
      throw error(errc::invalid_argument,
                  fmt::format("refit-bench: --chaos {}: cannot read '{}' (kill=P, add=P, remove=P, back=rejoin or "
                              "back=add)",
                              text, part));
  }
  return s;
}

namespace {

using clock = std::chrono::steady_clock;
using nlohmann::json;

/// A version longer than failures x (timeout + transfer) + transfer (a join: two) stalls unless
/// within this much more: a receiver dropped while its lane is open is told ABORT, 100 ms each way
/// (streamer::impl::tell_dropped).
constexpr double chaos_grace_ms = 250;
/// Most receivers the fleet grows to by adds: host_shm's (transport::capabilities::max_receivers).
constexpr std::size_t max_fleet = 64;

/// One receiver process of the fleet, at ipc://DIR/receiver-<id>.
struct member {
  std::size_t id = 0;
  std::string endpoint;
  std::unique_ptr<child_process> proc;  ///< null once killed, until restarted
  /// Ready and known to the streamer (restarted or added), until its first commit.
  std::optional<clock::time_point> joining;
};

/// What one version was.
struct version_record {
  std::uint64_t version = 0;
  double ms = 0;
  std::string kind;  ///< quiet, join, failure
  std::size_t receivers = 0;
  std::vector<std::string> dropped;
  std::int64_t wrong = 0;
  double bound_ms = 0;
  double failover_ms = -1;  ///< with a kill in it
  std::size_t asked = 0;    ///< receivers it went to: `receivers` and those dropped
};

/// The row's figures.
struct chaos_row {
  std::string transport, model;
  std::size_t receivers = 0;  ///< at the start
  std::uint64_t versions = 0, completed = 0, kills = 0, restarts = 0, adds = 0, removes = 0, joins = 0;
  std::uint64_t unexpected = 0;  ///< receivers dropped that were not killed
  std::vector<double> quiet_ms, join_version_ms, failed_ms, failover_ms, join_ms;
  /// One version's transfer to n receivers, max(transfer_ms, n x per_receiver_ms): the quiet
  /// versions' median, and their median per receiver (judge()). On a CPU host every receiver copies
  /// the version with the same cores, so it grows with the fleet.
  double transfer_ms = 0, per_receiver_ms = 0;
  [[nodiscard]] double transfer_for(std::size_t n) const {
    return std::max(transfer_ms, per_receiver_ms * static_cast<double>(n));
  }
  double slowest_ms = 0, timeout_ms = 0;
  std::uint64_t stalled = 0, missed_failover = 0;
  std::int64_t wrong = 0;
  std::vector<version_record> records;
};

double most(const std::vector<double>& v) { return v.empty() ? -1 : *std::max_element(v.begin(), v.end()); }
double mid(const std::vector<double>& v) { return v.empty() ? -1 : median(v); }
std::string ms_text(double ms) { return ms < 0 ? "n/a" : fmt::format("{:.2f}", ms); }

/// The fleet, the streamer and the data of one transport's row.
class chaos_run {
 public:
  chaos_run(const config& c, transport_kind t, const manifest& m)
      : c_(c), receiver_side_(c), spec_(*c.chaos), kind_(t), m_(m), path_(make_path(t, c)), rng_(c.seed) {
    // A receiver's idle timeout (its --timeout-ms) must outlast the streamer waiting one reply
    // timeout for another, dead receiver in the middle of a version: else the survivors abort too.
    receiver_side_.timeout_ms = std::max<std::uint64_t>(5 * c.timeout_ms, 10000);
    row_.transport = to_string(t);
    row_.model = m.name;
    row_.receivers = c.receivers;
    row_.timeout_ms = static_cast<double>(c.timeout_ms);
  }

  chaos_row run() {
    prepare_sources();
    for (std::size_t k = 0; k < c_.receivers; ++k) fleet_.push_back(start_member(next_id_++));
    streamer s(options());
    for (int i = 0; i < c_.warmup; ++i) warm_up(s);
    for (int i = 0; i < c_.iters; ++i) chaos_version(s);
    s.close();
    judge();
    for (member& f : fleet_)
      if (f.proc && !exited_cleanly(f.proc->finish(std::chrono::seconds(30))))
        progress(c_, fmt::format("WARNING: receiver {} (pid {}) did not exit cleanly", f.endpoint, f.proc->pid()));
    return std::move(row_);
  }

 private:
  streamer_options options() const {
    streamer_options so = streamer_options_for(c_, kind_, c_.buffer_mb.front(), c_.buffer_counts.front());
    for (const member& f : fleet_) so.receivers.push_back(f.endpoint);
    so.on_receiver_failure = receiver_failure::drop;
    so.rejoin = spec_.rejoin;
    so.direct = false;
    return so;
  }

  void prepare_sources() {
    src_ = path_->sources(m_, c_.seed, nullptr);
    for (std::size_t i = 0; i < m_.entries.size(); ++i) {
      refs_.push_back(tensor_ref{m_.entries[i].meta, src_->data(i), src_->where(), nullptr});
      sums_.push_back(src_->checksum(i));
    }
  }

  /// Fresh data for version v: one byte per tensor flipped, the expected checksums following.
  void refresh_sources(std::uint64_t v) {
    const auto mask = static_cast<std::uint8_t>(1 + v % 255);
    for (std::size_t i = 0; i < refs_.size(); ++i) {
      const std::uint64_t size = m_.entries[i].meta.nbytes();
      if (size == 0) continue;
      const std::uint64_t off = (v * 0x9e3779b97f4a7c15ull + i * 0x2545f4914f6cdd1dull) % size;
      const std::uint8_t old = src_->flip(i, off, mask);
      sums_[i] = checksum_after_flip(sums_[i], size, off, old, static_cast<std::uint8_t>(old ^ mask));
    }
  }

  std::string who(const member& f) const {
    return fmt::format("receiver {} (pid {})", f.endpoint, f.proc ? f.proc->pid() : -1);
  }

  /// A receiver process on receiver-<id>'s endpoint, once it said it is ready.
  member start_member(std::size_t id) {
    member f;
    f.id = id;
    f.endpoint = fmt::format("ipc://{}/receiver-{}", dir_.path, id);
    respawn(f);
    return f;
  }

  void respawn(member& f) {
    f.proc =
        std::make_unique<child_process>(c_.receiver_exe, receiver_args(receiver_side_, kind_, m_.name, f.endpoint));
    const json ready = parse_peer_json(f.proc->read_line(std::chrono::minutes(10)), 1 << 20, who(f));
    if (ready.value("event", "") != "ready")
      throw error(errc::protocol, fmt::format("refit-bench: {} said {} instead of ready", who(f), excerpt(ready)));
  }

  /// The committed line of version v from receiver f (its aborted lines, of versions it was dropped
  /// from, passed over); the wrong checksums in it.
  std::int64_t verify(member& f, std::uint64_t v) {
    for (;;) {
      const json line = parse_peer_json(
          f.proc->read_line(std::chrono::milliseconds(std::max<std::uint64_t>(c_.timeout_ms * 4, 60000))),
          max_report_bytes(m_), who(f));
      if (line.value("event", "") == "aborted") continue;
      std::int64_t printed = 0;
      return count_wrong(c_, line, v, m_, sums_, who(f), " " + f.endpoint, printed);
    }
  }

  void warm_up(streamer& s) {
    const std::uint64_t v = version_++;
    if (v > 1) refresh_sources(v);
    const auto t0 = clock::now();
    (void)s.refit(v, std::span<const tensor_ref>(refs_));
    warm_ms_.push_back(ms_since(t0));
    for (member& f : fleet_) row_.wrong += verify(f, v);
  }

  bool chance(double p) { return p > 0 && std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  std::size_t pick(std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng_); }

  /// The members the streamer serves now (alive: a killed one is restarted before the next version).
  std::vector<std::size_t> served(const streamer& s) const {
    std::vector<std::size_t> out;
    const auto eps = s.receivers();
    for (std::size_t k = 0; k < fleet_.size(); ++k)
      if (fleet_[k].proc && std::find(eps.begin(), eps.end(), fleet_[k].endpoint) != eps.end()) out.push_back(k);
    return out;
  }

  /// Between versions: the killed ones started again (with back=add, added back, as is one dropped
  /// though alive), then maybe one removed and one added.
  void change_fleet(streamer& s) {
    const auto eps = s.receivers();
    for (member& f : fleet_) {
      if (f.proc && (spec_.rejoin || std::find(eps.begin(), eps.end(), f.endpoint) != eps.end())) continue;
      if (!f.proc) {
        respawn(f);
        ++row_.restarts;
      }
      if (!spec_.rejoin) s.add_receiver(f.endpoint);
      f.joining = clock::now();
    }
    if (const auto now = served(s); now.size() > 1 && chance(spec_.remove)) {
      member& f = fleet_[now[pick(now.size())]];
      const std::string gone = f.endpoint;
      s.remove_receiver(gone);
      // Told BYE, it keeps its last version and serves on; its process ends when its stdin closes.
      if (!exited_cleanly(f.proc->finish(std::chrono::seconds(30))))
        throw error(errc::peer, fmt::format("refit-bench: --chaos: {} removed, then did not exit cleanly", who(f)));
      std::erase_if(fleet_, [&](const member& x) { return x.endpoint == gone; });
      ++row_.removes;
    }
    if (fleet_.size() < max_fleet && chance(spec_.add)) {
      fleet_.push_back(start_member(next_id_++));
      s.add_receiver(fleet_.back().endpoint);
      fleet_.back().joining = clock::now();
      ++row_.adds;
    }
  }

  /// The kill of this version, if any: which member, and after how many tensors of the source.
  struct kill_plan {
    std::size_t member = 0;
    std::size_t after = 0;
    std::optional<clock::time_point> at;  ///< when it was sent (the source reached `after`)
  };
  std::optional<kill_plan> plan_kill(const streamer& s) {
    const auto now = served(s);
    // One receiver always survives: min_receivers is 1.
    if (now.size() < 2 || !chance(spec_.kill)) return std::nullopt;
    const std::size_t k = now[pick(now.size())];
    return kill_plan{k, pick(refs_.size() + 1), std::nullopt};
  }

  /// One counted version: the fleet changed, the refit (with its kill), every survivor verified.
  void chaos_version(streamer& s) {
    const std::uint64_t v = version_++;
    change_fleet(s);
    std::optional<kill_plan> kill = plan_kill(s);
    refresh_sources(v);
    std::size_t next = 0;
    const auto source = [&]() -> std::optional<tensor_ref> {
      if (kill && !kill->at && next == kill->after) {
        kill->at = clock::now();
        (void)fleet_[kill->member].proc->kill();  // returns once waitpid() saw it gone
      }
      if (next == refs_.size()) return std::nullopt;
      return refs_[next++];
    };
    ++row_.versions;
    const auto t0 = clock::now();
    refit_stats st;
    try {
      st = s.refit(v, source);
    } catch (const error& e) {
      throw error(e.code(), fmt::format("refit-bench: --chaos: version {} failed: {}", v, e.what()));
    }
    const auto t1 = clock::now();
    ++row_.completed;
    record(s, v, st, kill, std::chrono::duration<double, std::milli>(t1 - t0).count(), t1);
  }

  /// The version's figures: who was dropped, every survivor verified, the times filed.
  void record(const streamer& s, std::uint64_t v, const refit_stats& st, const std::optional<kill_plan>& kill,
              double ms, clock::time_point t1) {
    version_record r{v, ms, "quiet", s.receivers().size(), {}, 0, 0};
    for (const auto& d : st.dropped) r.dropped.push_back(d.endpoint);
    bool joined = false;
    if (kill) {
      member& f = fleet_[kill->member];
      f.proc.reset();  // reaped by kill()
      f.joining.reset();
      ++row_.kills;
      if (std::find(r.dropped.begin(), r.dropped.end(), f.endpoint) == r.dropped.end())
        throw error(errc::internal, fmt::format("refit-bench: --chaos: version {}: {} was killed during it but "
                                                "refit_stats::dropped does not name it",
                                                v, f.endpoint));
      r.failover_ms = std::chrono::duration<double, std::milli>(t1 - *kill->at).count();
      row_.failover_ms.push_back(r.failover_ms);
    }
    row_.unexpected += r.dropped.size() - (kill ? 1 : 0);
    r.asked = r.receivers + r.dropped.size();
    for (const std::size_t k : served(s)) {
      member& f = fleet_[k];
      r.wrong += verify(f, v);
      if (!f.joining) continue;
      row_.join_ms.push_back(std::chrono::duration<double, std::milli>(t1 - *f.joining).count());
      f.joining.reset();
      ++row_.joins;
      joined = true;
    }
    file(r, joined);
  }

  void file(version_record& r, bool joined) {
    r.kind = !r.dropped.empty() ? "failure" : joined ? "join" : "quiet";
    (!r.dropped.empty() ? row_.failed_ms : joined ? row_.join_version_ms : row_.quiet_ms).push_back(r.ms);
    row_.slowest_ms = std::max(row_.slowest_ms, r.ms);
    row_.wrong += r.wrong;
    progress(c_, fmt::format("--chaos {} v{}: {:.2f} ms, {}, {} receivers{}{}", row_.transport, r.version, r.ms, r.kind,
                             r.receivers, r.dropped.empty() ? "" : fmt::format(", dropped {}", r.dropped.size()),
                             r.wrong ? fmt::format(", {} WRONG", r.wrong) : ""));
    row_.records.push_back(std::move(r));
  }

  /// Once every version is in: one version's transfer (the quiet versions' median, and per
  /// receiver; the warm-up ones' when none was quiet), and each version against its bounds.
  void judge() {
    std::vector<double> per_receiver;
    for (const version_record& r : row_.records)
      if (r.kind == "quiet") per_receiver.push_back(r.ms / static_cast<double>(std::max<std::size_t>(r.receivers, 1)));
    row_.transfer_ms = mid(row_.quiet_ms.empty() ? warm_ms_ : row_.quiet_ms);
    row_.per_receiver_ms = per_receiver.empty() ? 0 : median(per_receiver);
    for (version_record& r : row_.records) {
      const double failures = static_cast<double>(r.dropped.size());
      const double transfer = row_.transfer_for(r.asked);
      // A join makes a new session for every receiver (HELLO, the buffers mapped anew): one more transfer.
      const double transfers = r.kind == "join" ? 2 : 1;
      r.bound_ms = failures * (row_.timeout_ms + transfer) + transfers * transfer + chaos_grace_ms;
      row_.stalled += r.ms > r.bound_ms ? 1 : 0;
      row_.missed_failover += r.failover_ms > row_.timeout_ms + transfer ? 1 : 0;
    }
  }

  const config& c_;
  config receiver_side_;  ///< what the receivers are started with
  const chaos_spec spec_;
  const transport_kind kind_;
  const manifest& m_;
  std::unique_ptr<transport_path> path_;
  std::mt19937_64 rng_;
  temp_dir dir_;
  std::unique_ptr<tensor_memory> src_;
  std::vector<tensor_ref> refs_;
  std::vector<std::uint64_t> sums_;
  std::vector<member> fleet_;
  std::size_t next_id_ = 0;
  std::uint64_t version_ = 1;
  std::vector<double> warm_ms_;
  chaos_row row_;
};

// ---------------------------------------------------------------- the table

// name, unit, width: right-aligned, one space apart, as the usual table (bench/report.cpp).
struct chaos_column {
  const char* name;
  const char* unit;
  int width;
};
constexpr chaos_column chaos_columns[] = {
    {"transport", "", 9},    {"model", "", 14},     {"rcv", "", 4},         {"versions", "", 8},
    {"done", "", 6},         {"kills", "", 5},      {"adds", "", 4},        {"rms", "", 4},
    {"joins", "", 5},        {"quiet", "(ms)", 9},  {"joinver", "(ms)", 9}, {"failed", "(ms)", 9},
    {"failover", "(ms)", 9}, {"fo_max", "(ms)", 9}, {"join", "(ms)", 9},    {"join_max", "(ms)", 9},
    {"slowest", "(ms)", 9},  {"stalled", "", 7},    {"wrong", "", 6},
};

void write_chaos_header(std::ostream& out) {
  std::string names = "#", units = "#";
  for (const auto& col : chaos_columns) {
    names += fmt::format(" {:>{}}", col.name, col.width);
    units += fmt::format(" {:>{}}", col.unit, col.width);
  }
  out << names << '\n' << units << '\n';
}

void write_chaos_row(std::ostream& out, const chaos_row& r) {
  const std::vector<std::string> cells{r.transport,
                                       r.model,
                                       std::to_string(r.receivers),
                                       std::to_string(r.versions),
                                       std::to_string(r.completed),
                                       std::to_string(r.kills),
                                       std::to_string(r.adds),
                                       std::to_string(r.removes),
                                       std::to_string(r.joins),
                                       ms_text(mid(r.quiet_ms)),
                                       ms_text(mid(r.join_version_ms)),
                                       ms_text(mid(r.failed_ms)),
                                       ms_text(mid(r.failover_ms)),
                                       ms_text(most(r.failover_ms)),
                                       ms_text(mid(r.join_ms)),
                                       ms_text(most(r.join_ms)),
                                       ms_text(r.slowest_ms),
                                       std::to_string(r.stalled),
                                       std::to_string(r.wrong)};
  std::string line = " ";
  for (std::size_t i = 0; i < cells.size(); ++i) line += fmt::format(" {:>{}}", cells[i], chaos_columns[i].width);
  out << line << '\n';
}

void write_chaos_preamble(std::ostream& out, const config& c, const manifest& m) {
  const chaos_spec& s = *c.chaos;
  out << fmt::format("# refit-bench --chaos: refit {}\n", REFIT_VERSION);
  out << fmt::format("# command   : {}\n", fmt::join(c.argv, " "));
  out << fmt::format("# host      : {} (pid {}), {}\n", host_name(), ::getpid(), now_text());
  out << fmt::format("# cpu       : {}\n", make_host_shm_path()->describe_device());
  out << fmt::format("# model     : {}: {} tensors, {:.3f} GB, largest tensor {:.1f} MB\n", m.name, m.entries.size(),
                     m.bytes() / 1e9, m.largest() / 1e6);
  out << fmt::format(
      "# chaos     : per version kill={:g} add={:g} remove={:g}, back={} (seed {}); {} receivers at the start; "
      "{} quiet warm-up versions, then {} with chaos\n",
      s.kill, s.add, s.remove, s.rejoin ? "rejoin" : "add", c.seed, c.receivers, c.warmup, c.iters);
  out << fmt::format("# streamer  : on_receiver_failure=drop{}, min_receivers=1, reply timeout {} ms, {} x {:g} MiB\n",
                     s.rejoin ? ", rejoin" : "", c.timeout_ms, c.buffer_counts.front(), c.buffer_mb.front());
  out << "# note      : quiet = no failure and no join; joinver = a receiver joined (host_shm: a new session for "
         "all); failed = a receiver dropped; failover = SIGKILL to the survivors committed; join = ready "
         "(restarted or added) to first commit; every served receiver's every commit verified\n";
  out << "#\n";
}

void write_chaos_footer(std::ostream& out, const std::vector<chaos_row>& rows) {
  std::int64_t wrong = 0;
  std::uint64_t stalled = 0;
  for (const chaos_row& r : rows) {
    const std::size_t within = r.failover_ms.size() - r.missed_failover;
    out << fmt::format(
        "# {}: transfer to n receivers = max({:.2f} ms, n x {:.2f} ms) (the quiet versions' median, and per "
        "receiver); reply timeout {:.0f} ms\n",
        r.transport, r.transfer_ms, r.per_receiver_ms, r.timeout_ms);
    out << fmt::format("# {}: target failover <= timeout + transfer: {} of {} within, max {} ms: {}\n", r.transport,
                       within, r.failover_ms.size(), ms_text(most(r.failover_ms)),
                       r.missed_failover == 0 ? "OK" : "MISSED");
    out << fmt::format(
        "# {}: target no stall (failures x (timeout + transfer) + transfer, a join 2, + {:.0f} ms): {} of {} stalled "
        "{}; "
        "receivers dropped that were not killed: {}\n",
        r.transport, chaos_grace_ms, r.stalled, r.completed, r.stalled == 0 ? "OK" : "MISSED", r.unexpected);
    wrong += r.wrong;
    stalled += r.stalled;
  }
  out << fmt::format("# Wrong values          : {} {}\n", wrong, wrong == 0 ? "OK" : "FAILED");
  (void)stalled;
}

json chaos_json(const config& c, const manifest& m, const std::vector<chaos_row>& rows) {
  json j{{"refit_version", REFIT_VERSION},
         {"command", fmt::format("{}", fmt::join(c.argv, " "))},
         {"host", host_name()},
         {"model", {{"name", m.name}, {"tensors", m.entries.size()}, {"bytes", m.bytes()}}},
         {"chaos",
          {{"kill", c.chaos->kill},
           {"add", c.chaos->add},
           {"remove", c.chaos->remove},
           {"back", c.chaos->rejoin ? "rejoin" : "add"},
           {"seed", c.seed}}},
         {"rows", json::array()}};
  std::int64_t wrong = 0;
  for (const chaos_row& r : rows) {
    json versions = json::array();
    for (const version_record& v : r.records)
      versions.push_back({{"version", v.version},
                          {"ms", v.ms},
                          {"kind", v.kind},
                          {"receivers", v.receivers},
                          {"dropped", v.dropped},
                          {"bound_ms", v.bound_ms},
                          {"failover_ms", v.failover_ms},
                          {"wrong", v.wrong}});
    j["rows"].push_back({{"transport", r.transport},
                         {"receivers", r.receivers},
                         {"versions", r.versions},
                         {"completed", r.completed},
                         {"kills", r.kills},
                         {"restarts", r.restarts},
                         {"adds", r.adds},
                         {"removes", r.removes},
                         {"joins", r.joins},
                         {"unexpected_drops", r.unexpected},
                         {"timeout_ms", r.timeout_ms},
                         {"transfer_ms", r.transfer_ms},
                         {"transfer_per_receiver_ms", r.per_receiver_ms},
                         {"missed_failover", r.missed_failover},
                         {"quiet_ms", r.quiet_ms},
                         {"join_version_ms", r.join_version_ms},
                         {"failed_ms", r.failed_ms},
                         {"failover_ms", r.failover_ms},
                         {"join_ms", r.join_ms},
                         {"slowest_ms", r.slowest_ms},
                         {"stalled", r.stalled},
                         {"wrong", r.wrong},
                         {"by_version", std::move(versions)}});
    wrong += r.wrong;
  }
  j["ok"] = wrong == 0;
  return j;
}

/// Every transport of the run must let its streamer drop a receiver: the streamer's own refusal
/// is what the user reads for one that does not (before any process is spawned).
void check_chaos_transports(const config& c) {
  for (const transport_kind t : c.transports) {
    if (transport::capabilities_of(t).peers_apart) continue;
    streamer_options so = streamer_options_for(c, t, c.buffer_mb.front(), c.buffer_counts.front());
    so.endpoint = "ipc:///nonexistent/refit-bench-chaos";
    so.on_receiver_failure = receiver_failure::drop;
    std::string why = "its streamer does not drop a receiver that fails";
    try {
      streamer probe(so);
    } catch (const error& e) {
      why = e.what();
    }
    throw error(errc::invalid_argument,
                fmt::format("refit-bench: --chaos over {}: {}; --chaos runs over host_shm", to_string(t), why));
  }
}

}  // namespace

int run_chaos(const config& c, std::ostream& out) {
  check_chaos_transports(c);
  const manifest m = workload(c, model_list(c).front());
  write_chaos_preamble(out, c, m);
  write_chaos_header(out);
  std::vector<chaos_row> rows;
  for (const transport_kind t : c.transports) {
    rows.push_back(chaos_run(c, t, m).run());
    write_chaos_row(out, rows.back());
    out.flush();
  }
  write_chaos_footer(out, rows);
  if (!c.json_file.empty()) {
    std::ofstream f(c.json_file);
    f << chaos_json(c, m, rows).dump(2, ' ', false, json::error_handler_t::replace) << '\n';
    if (!f) throw error(errc::io, fmt::format("refit-bench: cannot write --json {}", c.json_file));
  }
  std::int64_t wrong = 0;
  for (const chaos_row& r : rows) wrong += r.wrong;
  return wrong > 0 ? 1 : 0;
}

}  // namespace refit::bench
