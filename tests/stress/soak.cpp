// Soak: 10,000 refits of a small model in one session, then 100 reconnects (a new streamer object,
// so a new session, each time). Both processes measure what they hold — open descriptors, sockets,
// refit shared memory (names in /dev/shm and mappings), resident memory — after a warm-up and
// again at the end of each phase; nothing may grow (resident memory: by less than 4 MiB).
//
// Knobs: REFIT_SOAK_REFITS (10000), REFIT_SOAK_RECONNECTS (100).
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

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
constexpr std::uint64_t buffer_bytes = 256 * kib;
constexpr long rss_slack_kib = 4 * 1024;
constexpr std::uint64_t warmup_refits = 20;
constexpr std::uint64_t warmup_reconnects = 2;
constexpr ms step_wait{20000};

refit::streamer_options stream_options(const std::string& endpoint) {
  return rt::host_shm_streamer(endpoint, buffer_bytes, ms{10000});
}

/// The receiver: serves until "stop". "baseline" → "m <figures>" (settled), "final" → "m
/// <figures>" (once back to the baseline, or as they are after a while); "stats" → "stats <commits>
/// <aborts> <refusals> <last committed> <check of the table against it>".
void receiver_main(const std::string& endpoint, const std::vector<refit::tensor_meta>& metas, rt::signal_pipe& in,
                   rt::signal_pipe& out) {
  refit::receiver_options o;
  o.endpoint = endpoint;
  o.idle_timeout = ms{10000};
  refit::receiver r(o);
  rs::table t(metas);
  t.register_in(r);
  out.send("ready");
  std::uint64_t commits = 0, aborts = 0, refusals = 0;
  rs::process_figures baseline;
  auto last_activity = clock_type::now();
  for (;;) {
    const auto e = r.serve_one(50ms);
    if (e != refit::receiver_event::idle) last_activity = clock_type::now();
    if (e == refit::receiver_event::committed) ++commits;
    if (e == refit::receiver_event::aborted) ++aborts;
    if (e == refit::receiver_event::refused) ++refusals;
    if (e == refit::receiver_event::aborted || e == refit::receiver_event::refused)
      std::cerr << "soak receiver: " << refit::to_string(e) << ": " << r.last_error() << std::endl;
    while (const auto cmd = in.try_receive(0ms)) {
      last_activity = clock_type::now();
      if (*cmd == "baseline") {
        baseline = rs::process_figures::settled();
        out.send("m " + baseline.text());
      } else if (*cmd == "final") {
        out.send("m " + rs::process_figures::back_to(baseline).text());
      } else if (*cmd == "stats") {
        const auto v = r.committed_version();
        out.send("stats " + std::to_string(commits) + " " + std::to_string(aborts) + " " + std::to_string(refusals) +
                 " " + (v ? std::to_string(*v) : std::string("none")) + " " + t.check(v));
      } else if (*cmd == "stop") {
        return;
      } else {
        throw std::runtime_error("soak receiver: unexpected command '" + *cmd + "'");
      }
    }
    if (clock_type::now() - last_activity > 60s) throw std::runtime_error("soak receiver: nothing for 60 s");
  }
}

/// The streamer: warm-up, "warm-session <figures>", wait "go", the refits, "after-session
/// <figures> <seconds>", wait "go"; the same for reconnects ("warm-reconnect", "after-reconnect").
/// A failure is reported as "fail <message>".
void streamer_main(const std::string& endpoint, const std::vector<refit::tensor_meta>& metas, std::uint64_t refits,
                   std::uint64_t reconnects, rt::signal_pipe& in, rt::signal_pipe& out) {
  if (in.receive(60s) != "go") throw std::runtime_error("soak streamer: expected go");
  const auto go_on = [&] {
    if (in.receive(60s) != "go") throw std::runtime_error("soak streamer: expected go");
  };
  std::uint64_t version = 0;
  try {
    {
      refit::streamer s(stream_options(endpoint));
      const auto one = [&] {
        const rs::host_tensors tensors(metas, ++version);
        s.refit(version, tensors.refs);
      };
      for (std::uint64_t i = 0; i < warmup_refits; ++i) one();
      const auto session_baseline = rs::process_figures::settled();
      out.send("warm-session " + session_baseline.text());
      go_on();
      const auto start = clock_type::now();
      for (std::uint64_t i = 0; i < refits; ++i) one();
      const auto seconds = static_cast<double>(since(start).count()) / 1000.0;
      out.send("after-session " + rs::process_figures::back_to(session_baseline).text() +
               " seconds=" + std::to_string(seconds));
      go_on();
      s.close();
    }
    const auto reconnect = [&] {
      refit::streamer s(stream_options(endpoint));
      const rs::host_tensors tensors(metas, ++version);
      s.refit(version, tensors.refs);
      s.close();
    };
    for (std::uint64_t i = 0; i < warmup_reconnects; ++i) reconnect();
    const auto reconnect_baseline = rs::process_figures::settled();
    out.send("warm-reconnect " + reconnect_baseline.text());
    go_on();
    const auto start = clock_type::now();
    for (std::uint64_t i = 0; i < reconnects; ++i) reconnect();
    const auto seconds = static_cast<double>(since(start).count()) / 1000.0;
    out.send("after-reconnect " + rs::process_figures::back_to(reconnect_baseline).text() +
             " seconds=" + std::to_string(seconds));
    go_on();
  } catch (const refit::error& e) {
    out.send("fail at version " + std::to_string(version) + ": " + e.what());
    throw;
  }
}

std::string expect_prefix(rt::signal_pipe& pipe, const std::string& prefix, ms wait, const std::string& who) {
  std::string line;
  try {
    line = pipe.receive(wait);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(who + " said nothing within " + std::to_string(wait.count()) + " ms: " + e.what());
  }
  if (!line.starts_with(prefix + " "))
    throw std::runtime_error(who + ": expected '" + prefix + " ...', got '" + line + "'");
  return line.substr(prefix.size() + 1);
}

double seconds_of(const std::string& line) {
  const auto pos = line.find("seconds=");
  return pos == std::string::npos ? 0.0 : std::stod(line.substr(pos + 8));
}

std::string row(const std::string& who, const std::string& phase, const rs::process_figures& f) {
  std::ostringstream s;
  s << "  " << std::left << std::setw(9) << who << std::setw(26) << phase << std::right << std::setw(5) << f.fds
    << std::setw(9) << f.sockets << std::setw(9) << f.shm_own << std::setw(9) << f.shm_all << std::setw(12)
    << f.shm_mapped << std::setw(10) << f.rss_kib;
  return s.str();
}

void require_no_growth(const std::string& what, const rs::process_figures& before, const rs::process_figures& after) {
  INFO(what << ": before " << before.text() << ", after " << after.text());
  CHECK(after.fds - before.fds <= 0);
  CHECK(after.sockets - before.sockets <= 0);
  CHECK(after.shm_own - before.shm_own <= 0);
  CHECK(after.shm_mapped - before.shm_mapped <= 0);
  CHECK(after.rss_kib - before.rss_kib < rss_slack_kib);
}

}  // namespace

TEST_CASE(
    "10,000 refits in one session and 100 reconnects grow neither descriptors, sockets, shared memory nor "
    "resident memory on either side",
    "[stress][soak]") {
  const std::uint64_t refits = rs::env_u64("REFIT_SOAK_REFITS", 10000);
  const std::uint64_t reconnects = rs::env_u64("REFIT_SOAK_RECONNECTS", 100);
  const auto metas = rt::mixed_model(12, 0, 7);
  std::uint64_t model_bytes = 0;
  for (const auto& m : metas) model_bytes += m.nbytes();

  const rs::scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  rt::signal_pipe r_in, r_out, s_in, s_out;
  rt::child rx([&] { receiver_main(ep, metas, r_in, r_out); });
  rt::child sx([&] { streamer_main(ep, metas, refits, reconnects, s_in, s_out); });
  REQUIRE(r_out.receive(step_wait) == "ready");
  s_in.send("go");

  // Each phase: the streamer's figure, then the receiver's at the same point.
  const auto receiver_figures = [&](const std::string& which) {
    r_in.send(which);
    return rs::process_figures::parse(expect_prefix(r_out, "m", step_wait, "the receiver"));
  };
  const auto streamer_figures = [&](const std::string& tag, ms wait) {
    std::string line;
    try {
      line = s_out.receive(wait);
    } catch (const std::runtime_error& e) {
      FAIL("the streamer said nothing within " << wait.count() << " ms waiting for " << tag << ": " << e.what());
    }
    INFO("streamer: " << line);
    REQUIRE(line.starts_with(tag + " "));
    return line.substr(tag.size() + 1);
  };
  // 10,000 refits take seconds; the bound only turns a hang into a failure.
  const ms long_wait{600000};

  const auto s_before_session = rs::process_figures::parse(streamer_figures("warm-session", step_wait));
  const auto r_before_session = receiver_figures("baseline");
  s_in.send("go");
  const auto after_session_line = streamer_figures("after-session", long_wait);
  const auto s_after_session = rs::process_figures::parse(after_session_line);
  const auto r_after_session = receiver_figures("final");
  s_in.send("go");
  const auto s_before_reconnect = rs::process_figures::parse(streamer_figures("warm-reconnect", step_wait));
  const auto r_before_reconnect = receiver_figures("baseline");
  s_in.send("go");
  const auto after_reconnect_line = streamer_figures("after-reconnect", long_wait);
  const auto s_after_reconnect = rs::process_figures::parse(after_reconnect_line);
  const auto r_after_reconnect = receiver_figures("final");
  s_in.send("go");
  CHECK(sx.wait(step_wait) == 0);

  r_in.send("stats");
  const auto stats = expect_prefix(r_out, "stats", step_wait, "the receiver");
  r_in.send("stop");
  CHECK(rx.wait(step_wait) == 0);

  const std::uint64_t total = warmup_refits + refits + warmup_reconnects + reconnects;
  std::cout << "soak: model of " << metas.size() << " tensors, " << model_bytes << " bytes, 2 x " << buffer_bytes / kib
            << " KiB host_shm buffers\n"
            << "  " << refits << " refits in one session in " << seconds_of(after_session_line) << " s, " << reconnects
            << " reconnects in " << seconds_of(after_reconnect_line) << " s (after " << warmup_refits
            << " warm-up refits and " << warmup_reconnects << " warm-up reconnects)\n"
            << "  receiver: " << stats << " (commits aborts refusals last-version check)\n"
            << "  process  phase                       fds  sockets  shm_own  shm_all  shm_mapped   rss_kib\n"
            << row("streamer", "session: before", s_before_session) << "\n"
            << row("streamer", "session: after " + std::to_string(refits), s_after_session) << "\n"
            << row("receiver", "session: before", r_before_session) << "\n"
            << row("receiver", "session: after " + std::to_string(refits), r_after_session) << "\n"
            << row("streamer", "reconnects: before", s_before_reconnect) << "\n"
            << row("streamer", "reconnects: after " + std::to_string(reconnects), s_after_reconnect) << "\n"
            << row("receiver", "reconnects: before", r_before_reconnect) << "\n"
            << row("receiver", "reconnects: after " + std::to_string(reconnects), r_after_reconnect) << std::endl;

  CHECK(stats == std::to_string(total) + " 0 0 " + std::to_string(total) + " ok");
  require_no_growth("streamer, one session", s_before_session, s_after_session);
  require_no_growth("receiver, one session", r_before_session, r_after_session);
  require_no_growth("streamer, reconnects", s_before_reconnect, s_after_reconnect);
  require_no_growth("receiver, reconnects", r_before_reconnect, r_after_reconnect);
  // A closed session leaves nothing mapped or named on either side.
  CHECK(s_after_reconnect.shm_own == 0);
  CHECK(s_after_reconnect.shm_mapped == 0);
  CHECK(r_after_reconnect.shm_mapped == 0);
}
