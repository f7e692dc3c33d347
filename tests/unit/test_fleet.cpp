// A fleet that changes: receivers SIGKILLed between versions and during one, restarted and added
// back, removed, under streamer_options::on_receiver_failure = drop.
//
// Every process is a child: this process only forks (before and after any of them opened a
// socket: it opens none itself) and talks to them through pipes. The streamer runs in a child that
// takes commands ("refit 3", "refit 4 kill 2", "add EP", "remove EP") and answers one line each;
// each receiver runs in a child that answers "state" with its committed version and whether every
// byte it holds is that version's pattern.
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "support/support.hpp"

using namespace std::chrono_literals;
namespace rt = refit::test;
using refit::dtype;
using refit::tensor_meta;

namespace {

using clock_type = std::chrono::steady_clock;

constexpr refit::milliseconds reply_timeout{1000};
/// The bound a version with failures in it keeps: one reply timeout for each request at which a
/// receiver failed (a receiver killed before BEGIN is heard out at BEGIN, one killed during a
/// version at its next BATCH), plus 1 s for the version's transfer, a dropped receiver's ABORT
/// (100 ms each way) and a loaded 2-core machine.
refit::milliseconds version_bound(std::size_t failed_requests) {
  return reply_timeout * static_cast<int>(failed_requests) + refit::milliseconds{1000};
}
constexpr std::chrono::seconds step_wait{30};  // backstop for one line from a child

std::vector<tensor_meta> fleet_model() {
  return {{"embed", dtype::bf16, {64, 32}}, {"q", dtype::f32, {16, 16}},
          {"k", dtype::f32, {16, 16}},      {"norm", dtype::f32, {40}},
          {"empty", dtype::f16, {0, 8}},    {"big", dtype::bf16, {160, 128}}};  // 40 KiB: chunks through 16 KiB buffers
}

/// Every byte of a table against `version`'s pattern: "ok", or where the first differs.
std::string check_table(const std::vector<tensor_meta>& metas, const std::vector<std::vector<std::uint8_t>>& bytes,
                        std::uint64_t version) {
  for (std::size_t k = 0; k < metas.size(); ++k)
    if (const auto m = rt::pattern_mismatch(metas[k], version, bytes[k].data()); !m.empty()) return m;
  return "ok";
}

/// A receiver in a child: binds its endpoint, serves, and answers "state" between messages.
class fleet_receiver {
 public:
  /// `staged`: receiver_options::stage host, each version applied as soon as it is prepared (an
  /// engine between two steps), so that a version aborted after END leaves the weights untouched.
  explicit fleet_receiver(std::string endpoint, bool staged = false) : endpoint_(std::move(endpoint)), staged_(staged) {
    start();
  }

  /// A new process on the same endpoint (after kill()).
  void start() {
    in_ = std::make_unique<rt::signal_pipe>();
    out_ = std::make_unique<rt::signal_pipe>();
    proc_ = std::make_unique<rt::child>([this] { run(); });
    REQUIRE(out_->receive(step_wait) == "ready");
    alive_ = true;
  }
  void kill() {
    proc_->kill();
    alive_ = false;
  }
  /// "<version|none> <check>": check is "ok" when every byte holds the committed version's
  /// pattern, "dirty" after a version aborted part-written, "-" with nothing committed.
  std::string state() {
    in_->send("state");
    const std::string line = out_->receive(step_wait);
    REQUIRE(line.rfind("state ", 0) == 0);
    return line.substr(6);
  }
  void stop() {
    in_->send("stop");
    CHECK(proc_->wait(step_wait) == 0);
    alive_ = false;
  }
  [[nodiscard]] const std::string& endpoint() const { return endpoint_; }
  [[nodiscard]] bool alive() const { return alive_; }
  [[nodiscard]] pid_t pid() const { return proc_->pid(); }

 private:
  void run() {
    const auto metas = fleet_model();
    std::vector<std::vector<std::uint8_t>> bytes;
    refit::receiver_options o;
    o.endpoint = endpoint_;
    o.idle_timeout = refit::milliseconds{5000};
    if (staged_) o.stage = refit::stage_kind::host;
    refit::receiver r(o);
    for (const auto& t : metas) bytes.emplace_back(std::max<std::uint64_t>(t.nbytes(), 1), 0xEE);
    for (std::size_t k = 0; k < metas.size(); ++k)
      r.add_parameter(refit::tensor_dest{metas[k], bytes[k].data(), refit::device::cpu()});
    out_->send("ready");
    for (;;) {
      if (r.serve_one(refit::milliseconds{20}) == refit::receiver_event::prepared) (void)r.apply_prepared();
      while (const auto c = in_->try_receive(0ms)) {
        if (*c == "stop") return;
        const auto v = r.committed_version();
        const std::string check = r.dirty() ? "dirty" : v ? check_table(metas, bytes, *v) : "-";
        out_->send("state " + (v ? std::to_string(*v) : "none") + " " + check);
      }
    }
  }

  std::string endpoint_;
  bool staged_ = false;
  std::unique_ptr<rt::signal_pipe> in_, out_;
  std::unique_ptr<rt::child> proc_;
  bool alive_ = false;
};

/// What the streamer child said about one version.
struct version_done {
  bool ok = false;
  double ms = 0;
  std::vector<std::string> dropped;  ///< "endpoint:code"
  std::string error;                 ///< "code message" when !ok
};

/// The streamer in a child, driven by commands.
class fleet_streamer {
 public:
  fleet_streamer(std::vector<std::string> endpoints, bool drop, std::size_t min_receivers = 1, bool rejoin = false)
      : endpoints_(std::move(endpoints)), drop_(drop), min_(min_receivers), rejoin_(rejoin) {
    proc_ = std::make_unique<rt::child>([this] { run(); });
  }
  /// Engines as groups (streamer_options::receiver_groups, the receivers their endpoints), with drop
  /// and engine-wide versions (`atomic`).
  fleet_streamer(std::vector<std::vector<std::string>> groups, bool atomic)
      : drop_(true), min_(1), rejoin_(false), groups_(std::move(groups)), atomic_(atomic) {
    proc_ = std::make_unique<rt::child>([this] { run(); });
  }
  ~fleet_streamer() {
    in_.send("quit");
    (void)proc_->wait(step_wait);
  }

  /// Refits `version`; with `kill_at`, `on_kill` runs (this process kills a receiver) when the
  /// source has yielded that many tensors, the source waiting meanwhile.
  version_done refit(std::uint64_t version, std::optional<std::size_t> kill_at = {},
                     const std::function<void()>& on_kill = {}) {
    in_.send("refit " + std::to_string(version) + (kill_at ? " " + std::to_string(*kill_at) : ""));
    std::string line = out_.receive(step_wait);
    if (line == "kill") {
      on_kill();
      in_.send("killed");
      line = out_.receive(step_wait);
    }
    std::istringstream is(line);
    std::string word;
    is >> word;
    version_done d;
    if (word == "error") {
      std::getline(is, d.error);
      return d;
    }
    REQUIRE(word == "done");
    d.ok = true;
    is >> d.ms;
    while (is >> word) d.dropped.push_back(word);
    return d;
  }
  /// "ok", or "<code> <message>".
  std::string command(const std::string& c) {
    in_.send(c);
    return out_.receive(step_wait);
  }

 private:
  void run() {
    const auto metas = fleet_model();
    auto o = rt::host_shm_streamer(endpoints_.empty() ? std::string() : endpoints_.front(), 16u << 10, reply_timeout);
    o.receivers = endpoints_;
    o.receiver_groups = groups_;
    o.atomic = atomic_;
    if (drop_) o.on_receiver_failure = refit::receiver_failure::drop;
    o.min_receivers = min_;
    o.rejoin = rejoin_;
    refit::streamer s(o);
    for (;;) {
      std::istringstream is(in_.receive(std::chrono::seconds(120)));
      std::string word, arg;
      is >> word >> arg;
      if (word == "quit") return;
      if (word == "refit") {
        std::size_t kill_at = 0;
        const bool kills = static_cast<bool>(is >> kill_at);
        out_.send(refit_one(s, metas, std::stoull(arg), kills ? std::optional<std::size_t>(kill_at) : std::nullopt));
        continue;
      }
      const auto f = rt::failure_of([&] {
        if (word == "add") s.add_receiver(arg);
        if (word == "remove") s.remove_receiver(arg);
      });
      std::string list;
      for (const auto& ep : s.receivers()) list += (list.empty() ? "" : ",") + ep;
      out_.send(f ? f->code + " " + f->message : "ok " + list);
    }
  }

  std::string refit_one(refit::streamer& s, const std::vector<tensor_meta>& metas, std::uint64_t version,
                        std::optional<std::size_t> kill_at) {
    const rt::host_tensors t(metas, version);
    std::size_t next = 0;
    const auto source = [&]() -> std::optional<refit::tensor_ref> {
      if (kill_at && next == *kill_at) {
        out_.send("kill");
        if (in_.receive(step_wait) != "killed") throw std::runtime_error("streamer child: expected killed");
      }
      if (next == t.refs.size()) return std::nullopt;
      return t.refs[next++];
    };
    const auto t0 = clock_type::now();
    try {
      const refit::refit_stats st = s.refit(version, source);
      const double ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
      std::string line = "done " + std::to_string(ms);
      for (const auto& d : st.dropped) line += " " + d.endpoint + ":" + rt::code_name(d.code);
      return line;
    } catch (const refit::error& e) {
      return "error " + rt::code_name(e.code()) + " " + e.what();
    }
  }

  std::vector<std::string> endpoints_;
  bool drop_;
  std::size_t min_;
  bool rejoin_;
  std::vector<std::vector<std::string>> groups_;
  bool atomic_ = false;
  rt::signal_pipe in_, out_;
  std::unique_ptr<rt::child> proc_;  // last: forks once the rest exists
};

std::string state_of(std::uint64_t version) { return std::to_string(version) + " ok"; }

/// Names in /dev/shm that carry one of `pids` (a lane's directory, a named segment).
std::vector<std::string> shm_leftovers(const std::set<pid_t>& pids) {
  std::vector<std::string> found;
  DIR* d = ::opendir("/dev/shm");
  if (d == nullptr) return found;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.find("refit") == std::string::npos) continue;
    for (const pid_t p : pids)
      if (name.find("-" + std::to_string(p) + "-") != std::string::npos) found.push_back(name);
  }
  ::closedir(d);
  return found;
}

}  // namespace

TEST_CASE(
    "with drop, receivers killed between and during versions are dropped, the others commit bit-exact, and "
    "one restarted and added back catches up",
    "[fleet]") {
  std::vector<rt::scoped_endpoint> eps(4);
  std::vector<std::unique_ptr<fleet_receiver>> rx;
  std::vector<std::string> names;
  for (auto& e : eps) {
    rx.push_back(std::make_unique<fleet_receiver>(e.name));
    names.push_back(e.name);
  }
  fleet_streamer st(names, true);

  auto d = st.refit(1);
  REQUIRE(d.ok);
  CHECK(d.dropped.empty());
  for (auto& r : rx) CHECK(r->state() == state_of(1));

  // Killed between versions: version 2 drops it, the others commit.
  rx[0]->kill();
  d = st.refit(2);
  REQUIRE(d.ok);
  CHECK(d.ms < static_cast<double>(version_bound(1).count()));
  REQUIRE(d.dropped.size() == 1);
  CHECK(d.dropped[0].rfind(names[0] + ":", 0) == 0);
  for (std::size_t k = 1; k < 4; ++k) CHECK(rx[k]->state() == state_of(2));

  // Killed while the source still yields (after 3 of its 6 tensors).
  d = st.refit(3, 3, [&] { rx[1]->kill(); });
  REQUIRE(d.ok);
  CHECK(d.ms < static_cast<double>(version_bound(1).count()));
  REQUIRE(d.dropped.size() == 1);
  CHECK(d.dropped[0].rfind(names[1] + ":", 0) == 0);
  for (std::size_t k = 2; k < 4; ++k) CHECK(rx[k]->state() == state_of(3));
  WARN("version 3 (one killed during it) took " << d.ms << " ms; reply timeout " << reply_timeout.count() << " ms");

  // The next version asks neither again.
  d = st.refit(4);
  REQUIRE(d.ok);
  CHECK(d.dropped.empty());
  CHECK(d.ms < 1000.0);
  CHECK(st.command("add " + names[2])
            .rfind("invalid_argument add_receiver(" + names[2] +
                       "): that receiver is "
                       "served already",
                   0) == 0);

  // Restarted and added back: it holds the next version.
  rx[0]->start();
  CHECK(st.command("add " + names[0]) == "ok " + names[2] + "," + names[3] + "," + names[0]);
  d = st.refit(5);
  REQUIRE(d.ok);
  CHECK(d.dropped.empty());
  for (std::size_t k : {0, 2, 3}) CHECK(rx[k]->state() == state_of(5));

  // Removed: it keeps its last version while the others go on.
  CHECK(st.command("remove " + names[3]) == "ok " + names[2] + "," + names[0]);
  d = st.refit(6);
  REQUIRE(d.ok);
  CHECK(rx[3]->state() == state_of(5));
  for (std::size_t k : {0, 2}) CHECK(rx[k]->state() == state_of(6));
  CHECK(st.command("remove " + names[3])
            .rfind("invalid_argument remove_receiver(" + names[3] + "): no such receiver", 0) == 0);
  for (auto& r : rx)
    if (r->alive()) r->stop();
}

TEST_CASE("without drop, a receiver killed between versions fails the version as before and stays a receiver",
          "[fleet]") {
  std::vector<rt::scoped_endpoint> eps(2);
  fleet_receiver a(eps[0].name), b(eps[1].name);
  fleet_streamer st({eps[0].name, eps[1].name}, false);
  REQUIRE(st.refit(1).ok);
  a.kill();
  const auto d = st.refit(2);
  REQUIRE_FALSE(d.ok);
  CHECK((d.error.rfind(" peer ", 0) == 0 || d.error.rfind(" timeout ", 0) == 0));
  CHECK_THAT(d.error, Catch::Contains(eps[0].name));
  CHECK(b.state() == state_of(1));
  CHECK(st.command("remove " + eps[0].name) == "ok " + eps[1].name);
  REQUIRE(st.refit(3).ok);
  CHECK(b.state() == state_of(3));
  b.stop();
}

TEST_CASE("with drop, a version that leaves fewer than min_receivers fails and the one left does not commit it",
          "[fleet]") {
  std::vector<rt::scoped_endpoint> eps(3);
  fleet_receiver a(eps[0].name), b(eps[1].name), c(eps[2].name);
  fleet_streamer st({eps[0].name, eps[1].name, eps[2].name}, true, 2);
  REQUIRE(st.refit(1).ok);
  a.kill();
  auto d = st.refit(2);
  REQUIRE(d.ok);
  CHECK(d.dropped.size() == 1);
  d = st.refit(3, 2, [&] { b.kill(); });
  REQUIRE_FALSE(d.ok);
  CHECK_THAT(d.error,
             Catch::Contains("1 receiver(s) left after dropping " + eps[1].name + ", fewer than min_receivers = 2"));
  // It aborted version 3: committed_version unchanged, its weights dirty when a batch had landed.
  const std::string left = c.state();
  CHECK((left == "2 ok" || left == "2 dirty"));
  d = st.refit(4);
  REQUIRE_FALSE(d.ok);
  CHECK(d.error ==
        " invalid_argument refit() with 1 receiver(s) left, fewer than min_receivers = 2: add_receiver() "
        "first");
  c.stop();
}

TEST_CASE("with rejoin, a dropped receiver is tried again with a backoff and a restarted one catches up", "[fleet]") {
  std::vector<rt::scoped_endpoint> eps(2);
  fleet_receiver a(eps[0].name), b(eps[1].name);
  fleet_streamer st({eps[0].name, eps[1].name}, true, 1, true);
  REQUIRE(st.refit(1).ok);
  a.kill();
  auto d = st.refit(2);
  REQUIRE(d.ok);
  REQUIRE(d.dropped.size() == 1);
  // Tried at the next version: still dead, dropped again (one reply timeout at its HELLO).
  d = st.refit(3);
  REQUIRE(d.ok);
  CHECK(d.ms < static_cast<double>(version_bound(1).count()));
  REQUIRE(d.dropped.size() == 1);
  CHECK(d.dropped[0].rfind(eps[0].name + ":", 0) == 0);
  a.start();
  // Then after two versions: not asked at 4 and 5, served again at 6.
  for (std::uint64_t v : {4, 5}) {
    d = st.refit(v);
    REQUIRE(d.ok);
    CHECK(d.dropped.empty());
    CHECK(a.state() == "none -");
  }
  d = st.refit(6);
  REQUIRE(d.ok);
  CHECK(d.dropped.empty());
  CHECK(a.state() == state_of(6));
  CHECK(b.state() == state_of(6));
  CHECK(st.command("remove " + eps[0].name) == "ok " + eps[1].name);
  a.stop();
  b.stop();
}

TEST_CASE("a chaos of receivers killed, restarted, added and removed never stalls a version nor commits one wrong",
          "[fleet][chaos]") {
  const char* env = std::getenv("REFIT_CHAOS_SEED");
  const std::uint64_t seed = env != nullptr ? std::strtoull(env, nullptr, 10) : std::random_device{}();
  WARN("chaos seed " << seed << " (REFIT_CHAOS_SEED to repeat)");
  std::mt19937_64 rng(seed);
  const auto chance = [&](double p) { return std::uniform_real_distribution<>(0, 1)(rng) < p; };
  constexpr std::size_t n = 8;
  constexpr std::uint64_t versions = 120;
  std::vector<rt::scoped_endpoint> eps(n);
  std::vector<std::unique_ptr<fleet_receiver>> rx;
  std::vector<std::string> names;
  std::set<pid_t> pids;
  for (auto& e : eps) {
    rx.push_back(std::make_unique<fleet_receiver>(e.name));
    names.push_back(e.name);
    pids.insert(rx.back()->pid());
  }
  std::vector<bool> member(n, true);
  std::vector<std::optional<std::uint64_t>> holds(n);  // what each alive receiver must hold
  fleet_streamer st(names, true);
  double slowest = 0, slowest_one = 0;
  std::size_t kills = 0, mid = 0, joins = 0, leaves = 0;
  const auto pick = [&](auto&& fits) -> std::optional<std::size_t> {
    std::vector<std::size_t> c;
    for (std::size_t k = 0; k < n; ++k)
      if (fits(k)) c.push_back(k);
    if (c.empty()) return std::nullopt;
    return c[std::uniform_int_distribution<std::size_t>(0, c.size() - 1)(rng)];
  };
  const auto members = [&] { return static_cast<std::size_t>(std::count(member.begin(), member.end(), true)); };
  for (std::uint64_t v = 1; v <= versions; ++v) {
    std::size_t failures = 0;  // requests of this version at which a receiver fails
    if (chance(0.12) && members() > 2)
      if (const auto k = pick([&](std::size_t j) { return member[j] && rx[j]->alive(); })) {
        rx[*k]->kill();
        holds[*k].reset();
        ++kills;
        ++failures;
      }
    if (chance(0.12))
      if (const auto k = pick([&](std::size_t j) { return !member[j]; })) {
        if (!rx[*k]->alive()) {
          rx[*k]->start();
          pids.insert(rx[*k]->pid());
          holds[*k].reset();
        }
        REQUIRE(st.command("add " + names[*k]).rfind("ok ", 0) == 0);
        member[*k] = true;
        ++joins;
      }
    if (chance(0.06) && members() > 2)
      if (const auto k = pick([&](std::size_t j) { return member[j] && rx[j]->alive(); })) {
        REQUIRE(st.command("remove " + names[*k]).rfind("ok ", 0) == 0);
        member[*k] = false;
        ++leaves;
      }
    std::optional<std::size_t> victim;
    if (chance(0.08) && members() > 2) victim = pick([&](std::size_t j) { return member[j] && rx[j]->alive(); });
    if (victim) ++failures;
    const auto d = victim ? st.refit(v, std::uniform_int_distribution<std::size_t>(0, 5)(rng),
                                     [&] {
                                       rx[*victim]->kill();
                                       holds[*victim].reset();
                                       ++mid;
                                     })
                          : st.refit(v);
    INFO("version " << v << ", seed " << seed);
    REQUIRE(d.ok);
    CHECK(d.ms < static_cast<double>(version_bound(failures).count()));
    slowest = std::max(slowest, d.ms);
    if (failures == 1) slowest_one = std::max(slowest_one, d.ms);
    std::set<std::string> gone;
    for (const auto& x : d.dropped) gone.insert(x.substr(0, x.rfind(':')));
    for (std::size_t k = 0; k < n; ++k) {
      if (!member[k]) continue;
      if (gone.count(names[k]) != 0) {
        CHECK_FALSE(rx[k]->alive());  // only the dead are dropped
        member[k] = false;
        continue;
      }
      REQUIRE(rx[k]->alive());
      holds[k] = v;
    }
    for (std::size_t k = 0; k < n; ++k)
      if (rx[k]->alive()) CHECK(rx[k]->state() == (holds[k] ? state_of(*holds[k]) : std::string("none -")));
  }
  WARN("chaos: " << versions << " versions, " << kills << " killed between versions, " << mid << " during one, "
                 << joins << " added, " << leaves << " removed; slowest version " << slowest
                 << " ms, slowest with one failure " << slowest_one << " ms (reply timeout " << reply_timeout.count()
                 << " ms)");
  for (auto& r : rx)
    if (r->alive()) r->stop();
  CHECK(shm_leftovers(pids).empty());
}

TEST_CASE(
    "engines as groups: with drop and atomic, an engine that loses a rank mid-version is dropped whole, its other "
    "rank keeps its old version untouched, the other engine commits bit-exact, and the engine comes back whole",
    "[fleet][groups]") {
  std::vector<rt::scoped_endpoint> eps(4);
  std::vector<std::unique_ptr<fleet_receiver>> rx;
  for (auto& e : eps) rx.push_back(std::make_unique<fleet_receiver>(e.name, /*staged=*/true));
  const std::vector<std::string> a{eps[0].name, eps[1].name}, b{eps[2].name, eps[3].name};
  fleet_streamer st({a, b}, /*atomic=*/true);

  auto d = st.refit(1);
  REQUIRE(d.ok);
  CHECK(d.dropped.empty());
  for (auto& r : rx) CHECK(r->state() == state_of(1));

  // Rank 1 of engine a SIGKILLed once the source has yielded its last tensor: every batch is out,
  // so at END rank 0 holds the whole version in its stage, prepared, when it is told ABORT.
  d = st.refit(2, 6, [&] { rx[1]->kill(); });
  REQUIRE(d.ok);
  CHECK(d.ms < static_cast<double>(version_bound(1).count()));
  // Both ranks of engine a named, the one that failed first, with the same code.
  REQUIRE(d.dropped.size() == 2);
  CHECK(d.dropped[0].rfind(a[1] + ":", 0) == 0);
  CHECK(d.dropped[1].rfind(a[0] + ":", 0) == 0);
  CHECK(d.dropped[0].substr(a[1].size()) == d.dropped[1].substr(a[0].size()));
  // Its other rank aborted the version: version 1, every byte of it, not dirty.
  CHECK(rx[0]->state() == state_of(1));
  for (std::size_t k : {2, 3}) CHECK(rx[k]->state() == state_of(2));
  CHECK(st.command("list") == "ok " + b[0] + "," + b[1]);

  // The next version goes to engine b alone.
  d = st.refit(3);
  REQUIRE(d.ok);
  CHECK(d.dropped.empty());
  CHECK(rx[0]->state() == state_of(1));
  for (std::size_t k : {2, 3}) CHECK(rx[k]->state() == state_of(3));

  // Restarted and added back, rank by rank: engine a holds the next version with b.
  rx[1]->start();
  CHECK(st.command("add " + a[0]).rfind("ok ", 0) == 0);
  CHECK(st.command("add " + a[1]) == "ok " + b[0] + "," + b[1] + "," + a[0] + "," + a[1]);
  d = st.refit(4);
  REQUIRE(d.ok);
  CHECK(d.dropped.empty());
  for (auto& r : rx) CHECK(r->state() == state_of(4));
  for (auto& r : rx) r->stop();
}

TEST_CASE("engines as groups: without atomic, the broken engine's other rank is told ABORT and keeps its version",
          "[fleet][groups]") {
  std::vector<rt::scoped_endpoint> eps(4);
  std::vector<std::unique_ptr<fleet_receiver>> rx;
  for (auto& e : eps) rx.push_back(std::make_unique<fleet_receiver>(e.name, /*staged=*/true));
  const std::vector<std::string> a{eps[0].name, eps[1].name}, b{eps[2].name, eps[3].name};
  fleet_streamer st({a, b}, /*atomic=*/false);
  REQUIRE(st.refit(1).ok);
  // Killed while the source still yields (after 5 of its 6 tensors: the large one, in 3 batches, to come).
  const auto d = st.refit(2, 5, [&] { rx[2]->kill(); });
  REQUIRE(d.ok);
  REQUIRE(d.dropped.size() == 2);
  CHECK(d.dropped[0].rfind(b[0] + ":", 0) == 0);
  CHECK(d.dropped[1].rfind(b[1] + ":", 0) == 0);
  CHECK(rx[3]->state() == state_of(1));
  for (std::size_t k : {0, 1}) CHECK(rx[k]->state() == state_of(2));
  for (std::size_t k : {0, 1, 3}) rx[k]->stop();
}

TEST_CASE("receiver_groups that do not name the receivers once each are refused with what to do", "[fleet][groups]") {
  const auto made = [](std::vector<std::string> receivers, std::vector<std::vector<std::string>> groups) {
    auto o = rt::host_shm_streamer(receivers.empty() ? std::string() : receivers.front(), 16u << 10, reply_timeout);
    o.receivers = std::move(receivers);
    o.receiver_groups = std::move(groups);
    return rt::failure_of([&] { refit::streamer s(o); });
  };
  const std::string x = "ipc:///tmp/refit-groups-x", y = "ipc:///tmp/refit-groups-y";
  auto f = made({x, y}, {{x}, {}});
  REQUIRE(f);
  CHECK(f->code == "invalid_argument");
  CHECK(f->message ==
        "streamer_options.receiver_groups[1] is empty: a group names the endpoints of one engine's ranks");
  f = made({x, y}, {{x, y}, {y}});
  REQUIRE(f);
  CHECK(f->message == "streamer_options.receiver_groups: " + y + " is named twice; a receiver is a rank of one engine");
  f = made({x}, {{x, y}});
  REQUIRE(f);
  CHECK(f->message == "streamer_options.receiver_groups[0] names " + y +
                          ", which is not one of the receivers; leave receivers empty to serve the groups' endpoints");
}
