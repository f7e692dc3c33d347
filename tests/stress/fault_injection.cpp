// Fault injection: hundreds of rounds, each killing (SIGKILL) the streamer or the receiver at a
// random point of a few refits, with a fixed seed. After each round:
//   - no surviving process waits past its deadline (the receiver aborts within its idle timeout,
//     the streamer fails with errc::timeout within its timeout), every wait here being bounded;
//   - the receiver's committed version is the last one whose refit completed, and its weights
//     equal that version's bytes whenever it is not dirty;
//   - the next session succeeds: a fresh streamer (killed streamer) or a fresh receiver on the same
//     endpoint (killed receiver) commits a new version bit-exactly;
//   - nothing the round's streamers created is left in /dev/shm.
//
// Every process of a round is a child; this process only forks, reads progress lines from pipes
// and kills, so it holds no ZeroMQ socket across rounds.
//
// Knobs: REFIT_FAULT_ROUNDS (200), REFIT_FAULT_SEED (printed), REFIT_FAULT_ROUND (run only that
// round of the seed, to reproduce a failure).
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <iostream>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "refit/plan.hpp"
#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "stress/stress.hpp"
#include "support/support.hpp"

using namespace std::chrono_literals;
namespace rs = refit::stress;
namespace rt = refit::test;

namespace {

using rs::clock_type;
using rs::since;
using ms = std::chrono::milliseconds;

constexpr std::uint64_t kib = 1ull << 10;
constexpr std::uint64_t buffer_bytes = 64 * kib;
constexpr std::size_t model_tensors = 60;
constexpr ms streamer_timeout{1000};
constexpr ms idle_timeout{1000};
// What a deadline may overrun by on a loaded 2-core machine.
constexpr ms slack{1500};
// Backstop for any one step of a healthy process (a line on a pipe, an exit).
constexpr ms step_wait{20000};
constexpr std::uint64_t default_seed = 20250601;

std::string vtext(std::optional<std::uint64_t> v) { return v ? std::to_string(*v) : "none"; }

std::optional<std::uint64_t> parse_version(const std::string& s) {
  if (s == "none") return std::nullopt;
  return std::stoull(s);
}

std::vector<std::string> words(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

/// The rest of `line` after its first `n` words (a check result or an error message).
std::string rest_after(const std::string& line, std::size_t n) {
  std::size_t pos = 0;
  for (std::size_t i = 0; i < n && pos != std::string::npos; ++i) {
    pos = line.find_first_not_of(' ', pos);
    pos = pos == std::string::npos ? pos : line.find(' ', pos);
  }
  if (pos == std::string::npos) return {};
  pos = line.find_first_not_of(' ', pos);
  return pos == std::string::npos ? std::string{} : line.substr(pos);
}

/// Names in /dev/shm made by process `pid` (refit-<pid>-*).
std::vector<std::string> shm_left_by(pid_t pid) {
  std::vector<std::string> out;
  const std::string prefix = "refit-" + std::to_string(pid) + "-";
  if (DIR* d = ::opendir("/dev/shm")) {
    while (const dirent* e = ::readdir(d))
      if (std::string_view(e->d_name).starts_with(prefix)) out.emplace_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

refit::streamer_options stream_options(const std::string& endpoint) {
  return rt::host_shm_streamer(endpoint, buffer_bytes, streamer_timeout);
}

// ------------------------------------------------------------------------------------ the plan

/// Everything random about one round, drawn from (seed, round) alone.
struct round_plan {
  std::uint64_t round = 0;
  bool kill_streamer = false;
  /// The victim blocks after each progress line until told to go on, and is killed while blocked
  /// (a known point). Otherwise it runs free and is killed `jitter_us` after the chosen line, at
  /// whatever point it has reached by then.
  bool lockstep = false;
  std::uint64_t refits = 1;
  std::uint64_t model_seed = 1;
  std::uint64_t lines = 0;       ///< progress lines the victim reports if never killed
  std::uint64_t kill_after = 1;  ///< kill once this many were read (1..lines)
  /// Killed streamer: wait for the receiver's idle timeout to abort the refit; otherwise the next
  /// streamer's HELLO replaces the dead session at once.
  bool wait_idle = false;
  unsigned jitter_us = 0;

  [[nodiscard]] std::string text() const {
    std::ostringstream s;
    s << "round " << round << ": kill " << (kill_streamer ? "streamer" : "receiver") << ", "
      << (lockstep ? "lockstep" : "free-running") << ", " << refits << " refit(s), model seed " << model_seed
      << ", kill after progress line " << kill_after << " of " << lines;
    if (!lockstep) s << " + " << jitter_us << " us";
    if (kill_streamer) s << (wait_idle ? ", then wait for the idle abort" : ", then a new session at once");
    return s.str();
  }
};

std::vector<refit::tensor_meta> round_model(const round_plan& p) {
  return rt::mixed_model(model_tensors, 3 * buffer_bytes, p.model_seed);
}

round_plan make_round_plan(std::uint64_t seed, std::uint64_t round) {
  std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                    static_cast<std::uint32_t>(round), static_cast<std::uint32_t>(round >> 32)};
  std::mt19937_64 rng(seq);
  round_plan p;
  p.round = round;
  p.kill_streamer = rng() % 2 == 0;
  p.lockstep = rng() % 2 == 0;
  p.refits = 1 + rng() % 4;
  p.model_seed = 1 + rng() % 1000000;
  p.wait_idle = rng() % 2 == 0;
  p.jitter_us = static_cast<unsigned>(rng() % 500);
  const auto metas = round_model(p);
  if (p.kill_streamer) {
    // Per refit: one line per next() call of the source (each tensor, then the end), then "done".
    p.lines = p.refits * (metas.size() + 2);
  } else {
    // "hello" once; per refit: "begin", one line per batch, "committed".
    std::vector<std::uint64_t> sizes;
    for (const auto& m : metas) sizes.push_back(m.nbytes());
    refit::plan_options po;
    po.buffer_bytes = buffer_bytes;
    const auto batches = refit::make_plan(sizes, po).size();
    p.lines = 1 + p.refits * (batches + 2);
  }
  p.kill_after = 1 + rng() % p.lines;
  return p;
}

// ------------------------------------------------------------------------------------ children

/// A receiver with a parameter table in a child. Reports "ready" once bound, then one line per
/// event: "e <event> <committed> <dirty 0|1>[ <check>]" (check: the table against the committed
/// version, on commits). Commands: "peek" (reply "state <committed> <dirty> <waited ms> <check>"
/// at once), "settle" (the same once no refit is in progress: waited is how long that took),
/// "stop". In lockstep it waits for "go" after each event line. When gated it binds on "go".
void receiver_main(const std::string& endpoint, const std::vector<refit::tensor_meta>& metas, bool lockstep, bool gated,
                   rt::signal_pipe& in, rt::signal_pipe& out) {
  if (gated && in.receive(60s) != "go") throw std::runtime_error("receiver: expected go");
  refit::receiver_options o;
  o.endpoint = endpoint;
  o.idle_timeout = idle_timeout;
  refit::receiver r(o);
  rs::table t(metas);
  t.register_in(r);
  out.send("ready");

  const auto state_line = [&](ms waited) {
    const auto v = r.committed_version();
    const bool dirty = r.dirty();
    return "state " + vtext(v) + " " + (dirty ? "1" : "0") + " " + std::to_string(waited.count()) + " " +
           (dirty ? std::string("-") : t.check(v));
  };
  bool active = false;    // a refit is in progress (BEGIN seen, no commit, abort or new session since)
  bool settling = false;  // a "settle" is waiting for the refit in progress to end
  clock_type::time_point settle_start{};
  const auto born = clock_type::now();
  for (;;) {
    if (since(born) > 120s) throw std::runtime_error("receiver: still running after 120 s; the parent lost it");
    const auto e = r.serve_one(20ms);
    if (e != refit::receiver_event::idle) {
      if (e == refit::receiver_event::begin) active = true;
      if (e == refit::receiver_event::committed || e == refit::receiver_event::aborted ||
          e == refit::receiver_event::hello || e == refit::receiver_event::bye)
        active = false;
      const auto v = r.committed_version();
      std::string line = "e " + std::string(refit::to_string(e)) + " " + vtext(v) + " " + (r.dirty() ? "1" : "0");
      if (e == refit::receiver_event::committed) line += " " + t.check(v);
      if (e == refit::receiver_event::aborted || e == refit::receiver_event::refused) line += " " + r.last_error();
      out.send(line);
      if (lockstep && in.receive(60s) != "go") throw std::runtime_error("receiver: expected go");
    }
    if (settling && !active) {
      out.send(state_line(since(settle_start)));
      settling = false;
    }
    while (const auto cmd = in.try_receive(0ms)) {
      if (*cmd == "peek") {
        out.send(state_line(0ms));
      } else if (*cmd == "settle") {
        settling = true;
        settle_start = clock_type::now();
      } else if (*cmd == "stop") {
        return;
      } else {
        throw std::runtime_error("receiver: unexpected command '" + *cmd + "'");
      }
    }
  }
}

/// Yields one version's tensors and reports every next() call: "t <version> <index>", then
/// "t <version> end". In lockstep it waits for "go" after each line.
class reporting_source final : public refit::tensor_source {
 public:
  reporting_source(const std::vector<refit::tensor_meta>& metas, std::uint64_t version, bool lockstep,
                   rt::signal_pipe& in, rt::signal_pipe& out)
      : tensors_(metas, version), version_(version), lockstep_(lockstep), in_(in), out_(out) {}

  std::optional<refit::tensor_ref> next() override {
    const bool end = i_ == tensors_.refs.size();
    out_.send("t " + std::to_string(version_) + " " + (end ? std::string("end") : std::to_string(i_)));
    if (lockstep_ && in_.receive(60s) != "go") throw std::runtime_error("streamer: expected go");
    if (end) return std::nullopt;
    return tensors_.refs[i_++];
  }

 private:
  rs::host_tensors tensors_;
  std::uint64_t version_;
  bool lockstep_;
  rt::signal_pipe& in_;
  rt::signal_pipe& out_;
  std::size_t i_ = 0;
};

/// The streamer to be killed: refits 1..n with a reporting source, "done <v>" after each (a
/// progress line too), then "finished" and waits to be killed.
void victim_streamer_main(const std::string& endpoint, const std::vector<refit::tensor_meta>& metas,
                          std::uint64_t refits, bool lockstep, rt::signal_pipe& in, rt::signal_pipe& out) {
  refit::streamer s(stream_options(endpoint));
  for (std::uint64_t v = 1; v <= refits; ++v) {
    reporting_source source(metas, v, lockstep, in, out);
    try {
      s.refit(v, source);
    } catch (const refit::error& e) {
      out.send("fail " + std::to_string(v) + " " + std::string(refit::to_string(e.code())) + " 0 " + e.what());
      (void)in.receive(60s);
      return;
    }
    out.send("done " + std::to_string(v));
    if (lockstep && in.receive(60s) != "go") throw std::runtime_error("streamer: expected go");
  }
  out.send("finished");
  (void)in.receive(60s);
}

/// One attempt: "done <v>" or "fail <v> <code> <elapsed ms> <message>". True when it committed.
bool attempt(refit::streamer& s, std::uint64_t version, const std::vector<refit::tensor_meta>& metas,
             rt::signal_pipe& out) {
  const rs::host_tensors tensors(metas, version);
  const auto start = clock_type::now();
  try {
    s.refit(version, tensors.refs);
  } catch (const refit::error& e) {
    out.send("fail " + std::to_string(version) + " " + std::string(refit::to_string(e.code())) + " " +
             std::to_string(since(start).count()) + " " + e.what());
    return false;
  }
  out.send("done " + std::to_string(version));
  return true;
}

/// The streamer that outlives its receiver: on "go", refits 1..n ("done <v>" each), "finished";
/// on "more" one more refit. After a failure it waits for "retry" and tries the same version
/// again. Ends on "exit" (closing the session).
void surviving_streamer_main(const std::string& endpoint, const std::vector<refit::tensor_meta>& metas,
                             std::uint64_t refits, rt::signal_pipe& in, rt::signal_pipe& out) {
  if (in.receive(60s) != "go") throw std::runtime_error("streamer: expected go");
  refit::streamer s(stream_options(endpoint));
  std::uint64_t v = 1;
  bool failed = false;
  for (; v <= refits && !failed; ++v) failed = !attempt(s, v, metas, out);
  if (!failed) {
    out.send("finished");
    const auto cmd = in.receive(60s);
    if (cmd == "exit") return s.close();
    if (cmd != "more") throw std::runtime_error("streamer: expected more or exit, got " + cmd);
    failed = !attempt(s, v++, metas, out);
  }
  const std::uint64_t lost = v - 1;
  for (;;) {
    const auto cmd = in.receive(60s);
    if (cmd == "exit") return s.close();
    if (cmd != "retry") throw std::runtime_error("streamer: expected retry or exit, got " + cmd);
    attempt(s, lost, metas, out);
  }
}

/// A fresh streamer for the next session: on "go", one refit of `version`, then BYE.
void fresh_streamer_main(const std::string& endpoint, const std::vector<refit::tensor_meta>& metas,
                         std::uint64_t version, rt::signal_pipe& in, rt::signal_pipe& out) {
  if (in.receive(60s) != "go") throw std::runtime_error("fresh streamer: expected go");
  refit::streamer s(stream_options(endpoint));
  attempt(s, version, metas, out);
  s.close();
}

// ------------------------------------------------------------------------------------ rounds

struct tally {
  std::uint64_t rounds = 0;
  std::uint64_t killed_streamer = 0, killed_receiver = 0;
  std::uint64_t lockstep = 0, free_running = 0;
  std::uint64_t idle_aborts = 0;         ///< killed streamer, refit in flight, aborted by the idle timeout
  std::uint64_t superseded = 0;          ///< killed streamer, the next HELLO replaced the session at once
  std::uint64_t dirty_after_kill = 0;    ///< the receiver was dirty once the killed streamer's refit ended
  std::uint64_t inflight_committed = 0;  ///< free-running streamer killed after sending END: it committed
  std::uint64_t streamer_timeouts = 0;   ///< killed receiver: the streamer failed with errc::timeout
  std::uint64_t extra_refit = 0;         ///< killed receiver after the streamer had finished: one more refit failed
  ms max_abort{0}, max_streamer_failure{0};
};

/// What a victim streamer reported: versions done, versions whose source ran out ("t v end").
struct streamer_log {
  std::optional<std::uint64_t> last_done;
  std::set<std::uint64_t> ended;
  std::vector<std::string> failures;
  void add(const std::string& line) {
    const auto w = words(line);
    if (w.size() >= 2 && w[0] == "done") last_done = std::stoull(w[1]);
    if (w.size() >= 3 && w[0] == "t" && w[2] == "end") ended.insert(std::stoull(w[1]));
    if (!w.empty() && w[0] == "fail") failures.push_back(line);
  }
};

/// What a receiver reported as events: commits (version → check) and other notable lines.
struct receiver_log {
  std::vector<std::pair<std::uint64_t, std::string>> commits;
  std::uint64_t aborts = 0;
  std::vector<std::string> refusals;
  void add(const std::string& line) {
    const auto w = words(line);
    if (w.size() < 4 || w[0] != "e") return;
    if (w[1] == "committed") commits.emplace_back(std::stoull(w[2]), rest_after(line, 4));
    if (w[1] == "aborted") ++aborts;
    if (w[1] == "refused") refusals.push_back(line);
  }
};

std::string receive_or_fail(rt::signal_pipe& pipe, ms wait, const std::string& who) {
  try {
    return pipe.receive(wait);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(who + " said nothing within " + std::to_string(wait.count()) + " ms: " + e.what());
  }
}

/// Reads receiver lines (keeping events in `log`) until a "state" line; returns its words.
std::vector<std::string> await_state(rt::signal_pipe& pipe, receiver_log& log, ms wait) {
  const auto start = clock_type::now();
  for (;;) {
    const auto left = wait - since(start);
    const auto line = receive_or_fail(pipe, std::max(left, ms{1}), "the receiver (waiting for its state)");
    if (line.starts_with("state ")) return words(line);
    log.add(line);
  }
}

/// Reads receiver lines until a commit; returns its (version, check).
std::pair<std::uint64_t, std::string> await_commit(rt::signal_pipe& pipe, receiver_log& log, ms wait) {
  const auto start = clock_type::now();
  for (;;) {
    const auto left = wait - since(start);
    const auto line = receive_or_fail(pipe, std::max(left, ms{1}), "the receiver (waiting for a commit)");
    const std::size_t before = log.commits.size();
    log.add(line);
    if (log.commits.size() > before) return log.commits.back();
  }
}

void run_killed_streamer(const round_plan& p, tally& t) {
  const auto metas = round_model(p);
  const rs::scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  rt::signal_pipe r_in, r_out, s1_in, s1_out, s2_in, s2_out;
  rt::child rx([&] { receiver_main(ep, metas, false, false, r_in, r_out); });
  REQUIRE(receive_or_fail(r_out, step_wait, "the receiver") == "ready");
  rt::child s1([&] { victim_streamer_main(ep, metas, p.refits, p.lockstep, s1_in, s1_out); });
  const std::uint64_t next_version = p.refits + 1;
  rt::child s2([&] { fresh_streamer_main(ep, metas, next_version, s2_in, s2_out); });

  // Follow the victim until the chosen line, then kill it.
  streamer_log slog;
  for (std::uint64_t lines = 0;;) {
    const auto line = receive_or_fail(s1_out, step_wait, "the streamer");
    slog.add(line);
    INFO("streamer: " << line);
    REQUIRE(slog.failures.empty());
    if (++lines == p.kill_after) {
      // Jitter, not synchronisation: a free-running victim dies wherever it has got to by then.
      if (!p.lockstep) std::this_thread::sleep_for(std::chrono::microseconds(p.jitter_us));
      s1.kill();
      break;
    }
    if (p.lockstep) s1_in.send("go");
  }
  REQUIRE(s1.wait(5s) == -SIGKILL);
  while (const auto line = s1_out.try_receive(0ms)) slog.add(*line);
  INFO("streamer failures: " << slog.failures.size());
  REQUIRE(slog.failures.empty());

  // What the receiver may hold: the last version whose refit completed; a free-running streamer
  // may also have sent END of the next one before it died (its source had run out).
  std::set<std::optional<std::uint64_t>> allowed{slog.last_done};
  const std::uint64_t inflight = slog.last_done.value_or(0) + 1;
  if (!p.lockstep && slog.ended.contains(inflight)) allowed.insert(inflight);

  receiver_log rlog;
  std::vector<std::string> state;
  if (p.wait_idle) {
    r_in.send("settle");
    state = await_state(r_out, rlog, idle_timeout + slack + 2s);
  } else {
    r_in.send("peek");
    state = await_state(r_out, rlog, step_wait);
  }
  REQUIRE(state.size() >= 5);
  const auto committed = parse_version(state[1]);
  const bool dirty = state[2] == "1";
  const ms waited{std::stoll(state[3])};
  const std::string check = state[4];
  INFO("receiver after the kill: committed " << vtext(committed) << (dirty ? ", dirty" : ", clean") << ", waited "
                                             << waited.count() << " ms, check " << check);
  REQUIRE(allowed.contains(committed));
  if (!dirty) REQUIRE(check == "ok");
  if (p.wait_idle) {
    REQUIRE(waited < idle_timeout + slack);
    t.max_abort = std::max(t.max_abort, waited);
    if (rlog.aborts > 0) ++t.idle_aborts;
    if (dirty) ++t.dirty_after_kill;
  } else {
    ++t.superseded;
  }
  if (committed && committed == inflight) ++t.inflight_committed;

  // The next session: a fresh streamer commits a new version bit-exactly.
  s2_in.send("go");
  const auto done = receive_or_fail(s2_out, step_wait, "the fresh streamer");
  INFO("fresh streamer: " << done);
  REQUIRE(done == "done " + std::to_string(next_version));
  r_in.send("peek");
  state = await_state(r_out, rlog, step_wait);
  REQUIRE(state.size() >= 5);
  REQUIRE(state[1] == std::to_string(next_version));
  REQUIRE(state[2] == "0");
  REQUIRE(state[4] == "ok");
  REQUIRE(s2.wait(step_wait) == 0);
  r_in.send("stop");
  REQUIRE(rx.wait(step_wait) == 0);
  while (const auto line = r_out.try_receive(0ms)) rlog.add(*line);
  for (const auto& [v, c] : rlog.commits) {
    INFO("commit of version " << v);
    REQUIRE(c == "ok");
  }
  INFO("refusals: " << (rlog.refusals.empty() ? std::string("none") : rlog.refusals.front()));
  REQUIRE(rlog.refusals.empty());
  REQUIRE(shm_left_by(s1.pid()).empty());
  REQUIRE(shm_left_by(s2.pid()).empty());
  ++t.killed_streamer;
}

void run_killed_receiver(const round_plan& p, tally& t) {
  const auto metas = round_model(p);
  const rs::scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  rt::signal_pipe r1_in, r1_out, r2_in, r2_out, s_in, s_out;
  rt::child r1([&] { receiver_main(ep, metas, p.lockstep, false, r1_in, r1_out); });
  rt::child r2([&] { receiver_main(ep, metas, false, /*gated=*/true, r2_in, r2_out); });
  rt::child s([&] { surviving_streamer_main(ep, metas, p.refits, s_in, s_out); });
  REQUIRE(receive_or_fail(r1_out, step_wait, "receiver 1") == "ready");
  s_in.send("go");

  // Follow the victim until the chosen line, then kill it.
  receiver_log r1log;
  for (std::uint64_t lines = 0;;) {
    const auto line = receive_or_fail(r1_out, step_wait, "receiver 1");
    r1log.add(line);
    INFO("receiver 1: " << line);
    REQUIRE(r1log.refusals.empty());
    if (++lines == p.kill_after) {
      // Jitter, not synchronisation: a free-running victim dies wherever it has got to by then.
      if (!p.lockstep) std::this_thread::sleep_for(std::chrono::microseconds(p.jitter_us));
      r1.kill();
      break;
    }
    if (p.lockstep) r1_in.send("go");
  }
  REQUIRE(r1.wait(5s) == -SIGKILL);
  while (const auto line = r1_out.try_receive(0ms)) r1log.add(*line);

  // The streamer fails with errc::timeout within its deadline (after finishing, if it had).
  std::vector<std::uint64_t> done;
  std::vector<std::string> fail;
  while (fail.empty()) {
    const auto line = receive_or_fail(s_out, streamer_timeout + slack + step_wait, "the streamer");
    const auto w = words(line);
    if (w.at(0) == "done") {
      done.push_back(std::stoull(w.at(1)));
    } else if (w.at(0) == "fail") {
      fail = w;
      fail.push_back(rest_after(line, 4));
    } else if (w.at(0) == "finished") {
      s_in.send("more");
      ++t.extra_refit;
    } else {
      FAIL("the streamer said '" << line << "'");
    }
  }
  const ms failed_after{std::stoll(fail.at(3))};
  INFO("streamer failure: " << fail.back());
  REQUIRE(fail.at(2) == std::string(refit::to_string(refit::errc::timeout)));
  REQUIRE(failed_after < streamer_timeout + slack);
  t.max_streamer_failure = std::max(t.max_streamer_failure, failed_after);
  if (fail.at(2) == "timeout") ++t.streamer_timeouts;

  // Every commit the receiver reported was bit-exact; every refit the streamer saw complete was
  // reported committed (a free-running receiver may have died between its reply to END and its
  // report of the last one).
  std::set<std::uint64_t> committed;
  for (const auto& [v, c] : r1log.commits) {
    INFO("receiver 1 commit of version " << v);
    REQUIRE(c == "ok");
    committed.insert(v);
  }
  for (std::size_t i = 0; i < done.size(); ++i) {
    if (!p.lockstep && i + 1 == done.size()) continue;
    INFO("version " << done[i] << " completed for the streamer");
    REQUIRE(committed.contains(done[i]));
  }

  // The next session: a new receiver on the same endpoint, weights from zeros; the same streamer
  // object retries the version it lost and it commits bit-exactly.
  const std::uint64_t lost = std::stoull(fail.at(1));
  r2_in.send("go");
  REQUIRE(receive_or_fail(r2_out, step_wait, "receiver 2") == "ready");
  s_in.send("retry");
  const auto retried = receive_or_fail(s_out, step_wait, "the streamer (retry)");
  INFO("retry: " << retried);
  REQUIRE(retried == "done " + std::to_string(lost));
  receiver_log r2log;
  if (retried.starts_with("done")) {
    const auto [v, c] = await_commit(r2_out, r2log, step_wait);
    REQUIRE(v == lost);
    REQUIRE(c == "ok");
  }
  s_in.send("exit");
  REQUIRE(s.wait(step_wait) == 0);
  r2_in.send("stop");
  REQUIRE(r2.wait(step_wait) == 0);
  while (const auto line = r2_out.try_receive(0ms)) r2log.add(*line);
  REQUIRE(r2log.refusals.empty());
  REQUIRE(shm_left_by(s.pid()).empty());
  ++t.killed_receiver;
}

}  // namespace

TEST_CASE(
    "hundreds of rounds of SIGKILL at random points of a refit leave the survivor within its deadline, on "
    "the last completed version, and ready for the next session",
    "[stress][faults]") {
  const std::uint64_t seed = rs::env_u64("REFIT_FAULT_SEED", default_seed);
  const std::uint64_t rounds = rs::env_u64("REFIT_FAULT_ROUNDS", 200);
  // REFIT_FAULT_ROUND=k runs round k of the seed alone.
  const char* only_env = std::getenv("REFIT_FAULT_ROUND");
  const bool only = only_env != nullptr && *only_env != '\0';
  const std::uint64_t first = only ? rs::env_u64("REFIT_FAULT_ROUND", 0) : 0;
  const std::uint64_t last = only ? first + 1 : rounds;
  std::cout << "fault injection: seed " << seed << " (REFIT_FAULT_SEED), rounds " << first << ".." << last - 1
            << " (REFIT_FAULT_ROUNDS, REFIT_FAULT_ROUND)" << std::endl;

  tally t;
  const auto start = clock_type::now();
  for (std::uint64_t round = first; round < last; ++round) {
    const round_plan p = make_round_plan(seed, round);
    INFO("reproduce with REFIT_FAULT_SEED=" << seed << " REFIT_FAULT_ROUND=" << round);
    INFO(p.text());
    const auto round_start = clock_type::now();
    if (p.kill_streamer)
      run_killed_streamer(p, t);
    else
      run_killed_receiver(p, t);
    ++t.rounds;
    (p.lockstep ? t.lockstep : t.free_running) += 1;
    std::cout << p.text() << ": ok in " << since(round_start).count() << " ms" << std::endl;
  }
  std::cout << "fault injection summary: seed " << seed << ", " << t.rounds << " rounds in "
            << since(start).count() / 1000.0 << " s (" << t.lockstep << " lockstep, " << t.free_running
            << " free-running)\n"
            << "  killed streamer: " << t.killed_streamer << " rounds; " << t.idle_aborts
            << " refits aborted by the receiver's idle timeout (longest " << t.max_abort.count() << " ms), "
            << t.superseded << " replaced at once by the next session's HELLO, " << t.dirty_after_kill
            << " left the receiver dirty, " << t.inflight_committed
            << " had sent END before dying (that version committed)\n"
            << "  killed receiver: " << t.killed_receiver << " rounds; the streamer failed with errc::timeout in "
            << t.streamer_timeouts << " (longest " << t.max_streamer_failure.count() << " ms), " << t.extra_refit
            << " after it had finished its refits (one more refit failed); every retry committed on a new "
               "receiver\n"
            << "  every round: the next session committed bit-exactly, nothing left in /dev/shm" << std::endl;
}
