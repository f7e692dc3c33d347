// Faults between processes: a peer killed mid-refit, a peer that is not there yet, a stranger.
// Every failure must arrive within its deadline with the right code, and the survivor must go on
// to commit the next refit bit-exactly.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "channel/channel.hpp"
#include "support/support.hpp"

using namespace std::chrono_literals;
namespace rt = refit::test;

namespace {

using rt::code_name;
using rt::failure;
using rt::failure_of;
using rt::host_tensors;
using rt::scoped_endpoint;

using clock_type = std::chrono::steady_clock;

constexpr std::uint64_t kib = 1ull << 10;
constexpr std::uint64_t mib = 1ull << 20;
constexpr refit::milliseconds streamer_timeout{1500};
constexpr refit::milliseconds idle_timeout{1500};
// What a deadline may overrun by on a loaded 2-core machine.
constexpr refit::milliseconds slack{1500};

refit::milliseconds since(clock_type::time_point start) {
  return std::chrono::duration_cast<refit::milliseconds>(clock_type::now() - start);
}

// A receiver's parameter table: one buffer per tensor.
struct table {
  std::vector<refit::tensor_meta> metas;
  std::vector<std::vector<std::uint8_t>> data;

  explicit table(std::vector<refit::tensor_meta> m) : metas(std::move(m)) {
    for (const auto& meta : metas) data.emplace_back(std::max<std::uint64_t>(meta.nbytes(), 1), std::uint8_t{0});
  }
  void register_in(refit::receiver& r) {
    for (std::size_t i = 0; i < metas.size(); ++i)
      r.add_parameter(refit::tensor_dest{metas[i], data[i].data(), refit::device::cpu()});
  }
  /// "ok" when every tensor holds `version`'s pattern, else where the first one differs.
  [[nodiscard]] std::string check(std::uint64_t version) const {
    for (std::size_t i = 0; i < metas.size(); ++i) {
      const auto n = metas[i].nbytes();
      std::vector<std::uint8_t> want(n);
      rt::fill_pattern(metas[i].name, version, want.data(), n);
      const auto [w, d] = std::mismatch(want.begin(), want.end(), data[i].data());
      if (w != want.end())
        return refit::describe(metas[i]) + " differs from version " + std::to_string(version) + " at byte " +
               std::to_string(w - want.begin());
    }
    return "ok";
  }
};

refit::streamer_options stream_options(const std::string& endpoint, std::uint64_t buffer_bytes,
                                       const std::string& token = {}) {
  refit::streamer_options o = rt::host_shm_streamer(endpoint, buffer_bytes, streamer_timeout);
  o.token = token;
  return o;
}

refit::receiver_options receive_options(const std::string& endpoint, const std::string& token = {}) {
  refit::receiver_options o;
  o.endpoint = endpoint;
  o.idle_timeout = idle_timeout;
  o.token = token;
  return o;
}

// Serves until `wanted` (returned) or until `limit` passes (nullopt). Fails on any other outcome
// (committed, aborted, refused) on the way.
std::optional<refit::milliseconds> serve_until(refit::receiver& r, refit::receiver_event wanted,
                                               refit::milliseconds limit) {
  const auto start = clock_type::now();
  while (since(start) < limit) {
    const auto e = r.serve_one(50ms);
    if (e == wanted) return since(start);
    if (e == refit::receiver_event::committed || e == refit::receiver_event::aborted ||
        e == refit::receiver_event::refused)
      FAIL("waiting for " << refit::to_string(wanted) << ", serve_one returned " << refit::to_string(e) << ": "
                          << r.last_error());
  }
  return std::nullopt;
}

// A receiver with a parameter table in a forked child. When `gated`, it binds only once the
// parent calls go(). It reports "ready" once bound, then "<event> <committed version> <check>" for
// every commit, abort and refusal (check: the table's bytes against the committed version, for a
// commit), and serves until the parent calls stop().
class receiver_child {
 public:
  receiver_child(std::string endpoint, std::vector<refit::tensor_meta> metas, std::string token = {},
                 bool gated = false)
      : endpoint_(std::move(endpoint)),
        metas_(std::move(metas)),
        token_(std::move(token)),
        gated_(gated),
        proc_([this] { run(); }) {}

  void go() { to_child_.send("go"); }
  std::string next_report() { return from_child_.receive(20s); }
  int stop() {
    to_child_.send("stop");
    return proc_.wait(20s);
  }

 private:
  void run() {
    if (gated_ && to_child_.receive(60s) != "go") throw std::runtime_error("receiver child: expected go");
    refit::receiver r(receive_options(endpoint_, token_));
    table t(metas_);
    t.register_in(r);
    from_child_.send("ready");
    auto last_event = clock_type::now();
    for (;;) {
      const auto e = r.serve_one(100ms);
      if (e == refit::receiver_event::idle) {
        if (to_child_.try_receive(0ms)) return;
        if (clock_type::now() - last_event > 30s) throw std::runtime_error("receiver child: no message for 30 s");
        continue;
      }
      last_event = clock_type::now();
      if (e != refit::receiver_event::committed && e != refit::receiver_event::aborted &&
          e != refit::receiver_event::refused)
        continue;
      const auto v = r.committed_version();
      std::string line = std::string(refit::to_string(e)) + " " + (v ? std::to_string(*v) : "none");
      if (e == refit::receiver_event::committed) line += " " + (v ? t.check(*v) : "nothing committed");
      from_child_.send(line);
    }
  }

  std::string endpoint_;
  std::vector<refit::tensor_meta> metas_;
  std::string token_;
  bool gated_;
  rt::signal_pipe to_child_;
  rt::signal_pipe from_child_;
  rt::child proc_;  // last: forks once the rest exists
};

// Yields tensors from a list; at tensor `block_at` tells the parent "blocked" and blocks until
// the process is killed.
class blocking_source final : public refit::tensor_source {
 public:
  blocking_source(std::span<const refit::tensor_ref> refs, std::size_t block_at, rt::signal_pipe& to_parent)
      : refs_(refs), block_at_(block_at), to_parent_(to_parent) {}
  std::optional<refit::tensor_ref> next() override {
    if (i_ == block_at_) {
      to_parent_.send("blocked");
      for (;;) ::pause();
    }
    if (i_ == refs_.size()) return std::nullopt;
    return refs_[i_++];
  }

 private:
  std::span<const refit::tensor_ref> refs_;
  std::size_t block_at_;
  rt::signal_pipe& to_parent_;
  std::size_t i_ = 0;
};

}  // namespace

TEST_CASE(
    "a receiver killed mid-refit fails the streamer with errc::timeout in time; a new receiver on the "
    "same endpoint takes the next refit",
    "[faults]") {
  const auto metas = rt::mixed_model(60, 3 * mib + 11);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;

  // Receiver A applies one batch, then blocks inside its callback on the second one.
  rt::signal_pipe from_a;
  rt::child a([&] {
    refit::receiver r(receive_options(ep));
    int batches = 0;
    r.on_batch([&](std::span<const refit::tensor_view>, void*) {
      if (++batches == 2) {
        from_a.send("blocked");
        for (;;) ::pause();
      }
    });
    const auto start = clock_type::now();
    while (clock_type::now() - start < 60s) r.serve_one(100ms);
    throw std::runtime_error("receiver A was not killed");
  });
  // Receiver B, forked now (before this process opens any socket), binds the same endpoint later.
  receiver_child b(ep, metas, {}, /*gated=*/true);

  refit::streamer s(stream_options(ep, 1 * mib));
  const host_tensors v1(metas, 1);

  // Kill A while the streamer waits for its reply.
  std::atomic<bool> refit_returned{false};
  bool killed_during_refit = false;
  std::thread killer([&] {
    if (from_a.try_receive(20s) == std::optional<std::string>("blocked")) {
      killed_during_refit = !refit_returned.load();
      a.kill();
    }
  });
  const auto start = clock_type::now();
  const auto f = failure_of([&] { s.refit(1, v1.refs); });
  const auto elapsed = since(start);
  refit_returned = true;
  killer.join();

  CHECK(killed_during_refit);
  CHECK(a.wait(5s) == -SIGKILL);
  REQUIRE(f);
  CHECK(f->code == code_name(refit::errc::timeout));
  CHECK_THAT(f->message, Catch::Contains(ep));
  CHECK(elapsed < streamer_timeout + slack);

  // The same streamer object, a new receiver process on the same endpoint.
  b.go();
  REQUIRE(b.next_report() == "ready");
  const host_tensors v2(metas, 2);
  const auto stats = s.refit(2, v2.refs);
  CHECK(stats.version == 2);
  CHECK(stats.tensors == metas.size());
  CHECK(b.next_report() == "committed 2 ok");

  s.close();
  CHECK(b.stop() == 0);
}

TEST_CASE(
    "a streamer killed mid-refit leaves the receiver on its previous version, dirty, and serving the next "
    "streamer",
    "[faults]") {
  const auto metas = rt::mixed_model(120, 2 * mib + 3);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  constexpr std::uint64_t buffer = 256 * kib;
  // Block at the first tensor by which more than three buffers' worth has been yielded: with two
  // buffers, the streamer must by then have had at least one batch of version 2 applied.
  std::size_t block_at = 0;
  for (std::uint64_t sum = 0; block_at < metas.size() && sum <= 3 * buffer; ++block_at) sum += metas[block_at].nbytes();
  REQUIRE(block_at < metas.size());

  // Both streamers are forked before this process opens any socket.
  rt::signal_pipe from_s1;
  rt::child s1([&] {
    refit::streamer s(stream_options(ep, buffer));
    const host_tensors v1(metas, 1);
    s.refit(1, v1.refs);
    const host_tensors v2(metas, 2);
    blocking_source source(v2.refs, block_at, from_s1);
    s.refit(2, source);
    throw std::runtime_error("the refit of version 2 returned although its source blocked");
  });
  rt::signal_pipe to_s2;
  rt::child s2([&] {
    if (to_s2.receive(60s) != "go") throw std::runtime_error("streamer 2: expected go");
    refit::streamer s(stream_options(ep, buffer));
    const host_tensors v2(metas, 2);  // the trainer retries the step it lost
    s.refit(2, v2.refs);
    s.close();
  });

  refit::receiver r(receive_options(ep));
  table t(metas);
  t.register_in(r);

  // Version 1 commits.
  REQUIRE(serve_until(r, refit::receiver_event::committed, 20s));
  CHECK(r.committed_version() == std::optional<std::uint64_t>(1));
  CHECK_FALSE(r.dirty());
  CHECK(t.check(1) == "ok");

  // Version 2 begins; serve until its streamer blocks with at least one batch applied.
  bool blocked = false;
  int batches = 0;
  const auto start = clock_type::now();
  while (!blocked || batches == 0) {
    if (since(start) > 20s) FAIL("the streamer did not block with a batch of version 2 applied within 20 s");
    const auto e = r.serve_one(20ms);
    if (e == refit::receiver_event::committed || e == refit::receiver_event::aborted)
      FAIL("serve_one returned " << refit::to_string(e) << " during version 2: " << r.last_error());
    if (e == refit::receiver_event::batch) ++batches;
    if (!blocked) blocked = from_s1.try_receive(0ms) == std::optional<std::string>("blocked");
  }
  s1.kill();
  CHECK(s1.wait(5s) == -SIGKILL);

  // The receiver gives version 2 up: at once where the streamer had a control lane (its end closed
  // with the process), else after its idle timeout.
  const auto aborted_after = serve_until(r, refit::receiver_event::aborted, idle_timeout + slack + 2s);
  REQUIRE(aborted_after);
  CHECK(*aborted_after < idle_timeout + slack);
  CHECK(r.committed_version() == std::optional<std::uint64_t>(1));
  CHECK(r.dirty());
  CHECK_THAT(r.last_error(), Catch::Contains("no message from the streamer") ||
                                 Catch::Contains("is gone during version 2: its control lane closed"));

  // A new streamer process: its refit commits and the weights are clean again.
  to_s2.send("go");
  REQUIRE(serve_until(r, refit::receiver_event::committed, 20s));
  CHECK(r.committed_version() == std::optional<std::uint64_t>(2));
  CHECK_FALSE(r.dirty());
  CHECK(t.check(2) == "ok");
  REQUIRE(serve_until(r, refit::receiver_event::bye, 20s));
  CHECK(s2.wait(20s) == 0);
}

TEST_CASE("a streamer whose receiver is not there yet fails with errc::timeout in time, then refits once it is",
          "[faults]") {
  const auto metas = rt::mixed_model(30, 0);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  receiver_child rx(ep, metas, {}, /*gated=*/true);

  refit::streamer s(stream_options(ep, 256 * kib));
  const host_tensors v1(metas, 1);
  const auto start = clock_type::now();
  const auto f = failure_of([&] { s.refit(1, v1.refs); });
  const auto elapsed = since(start);
  REQUIRE(f);
  CHECK(f->code == code_name(refit::errc::timeout));
  CHECK_THAT(f->message, Catch::Contains(ep));
  CHECK(elapsed < streamer_timeout + slack);

  rx.go();
  REQUIRE(rx.next_report() == "ready");
  CHECK(s.refit(1, v1.refs).version == 1);
  CHECK(rx.next_report() == "committed 1 ok");

  s.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE("a receiver restarted between two refits takes the next refit of the same streamer", "[faults]") {
  // The new process has no session: the streamer must notice at BEGIN and say HELLO again, not
  // fail every refit from then on.
  // With a control lane, the streamer sees that the lane's receiver ended, and sends that BEGIN
  // through ZeroMQ all the same.
  const bool lane = GENERATE(true, false);
  INFO("control_lane " << lane);
  const auto metas = rt::mixed_model(30, 0);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  auto o = stream_options(ep, 256 * kib);
  o.control_lane = lane;
  refit::streamer s(o);
  {
    receiver_child first(ep, metas);
    REQUIRE(first.next_report() == "ready");
    const host_tensors v1(metas, 1);
    CHECK(s.refit(1, v1.refs).control_lane == lane);
    CHECK(first.next_report() == "committed 1 ok");
    CHECK(first.stop() == 0);
  }
  receiver_child second(ep, metas);
  REQUIRE(second.next_report() == "ready");
  const host_tensors v2(metas, 2);
  const auto stats = s.refit(2, v2.refs);
  CHECK(stats.version == 2);
  CHECK(stats.control_lane == lane);
  CHECK(second.next_report() == "refused none");  // the BEGIN without a session
  CHECK(second.next_report() == "committed 2 ok");
  s.close();
  CHECK(second.stop() == 0);
}

TEST_CASE("a stranger with a wrong token is refused with errc::unauthorized and the session in use carries on",
          "[faults]") {
  const auto metas = rt::mixed_model(30, 300 * kib);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  receiver_child rx(ep, metas, "legit-token-7f3a");
  REQUIRE(rx.next_report() == "ready");

  refit::streamer legit(stream_options(ep, 256 * kib, "legit-token-7f3a"));
  const host_tensors v1(metas, 1);
  CHECK(legit.refit(1, v1.refs).version == 1);
  CHECK(rx.next_report() == "committed 1 ok");

  {
    refit::streamer stranger(stream_options(ep, 256 * kib, "guessed-token"));
    const host_tensors v2(metas, 2);
    const auto start = clock_type::now();
    const auto f = failure_of([&] { stranger.refit(2, v2.refs); });
    const auto elapsed = since(start);
    REQUIRE(f);
    CHECK(f->code == code_name(refit::errc::unauthorized));
    CHECK_THAT(f->message, Catch::Contains("token"));
    CHECK(elapsed < streamer_timeout);  // refused at once, not left to time out
  }
  CHECK(rx.next_report() == "refused 1");

  // The legit session was not disturbed: its next refit commits.
  const host_tensors v3(metas, 3);
  CHECK(legit.refit(3, v3.refs).version == 3);
  CHECK(rx.next_report() == "committed 3 ok");

  legit.close();
  CHECK(rx.stop() == 0);
}
