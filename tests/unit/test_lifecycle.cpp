// The life of a refit as the generation side sees it: every refit that does not
// commit is reported as `aborted` (superseded by a HELLO or BEGIN, given up by the streamer with
// ABORT), the on_begin / on_commit / on_abort hooks fire once each and in order, the parameter
// table may change between refits, and tensors without elements or dimensions follow one rule.
//
// The receiver runs in a forked child that reports every hook call, callback call and event as a
// line, in the order they happened; the parent drives a real streamer or, to send what a real
// streamer never sends in that order, raw messages over its own host_shm buffers.
#include <algorithm>
#include <array>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "channel/channel.hpp"
#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "support/support.hpp"
#include "transport/transport.hpp"
#include "wire/wire.hpp"

using namespace std::chrono_literals;
namespace rt = refit::test;
namespace wire = refit::wire;

namespace {

using clock_type = std::chrono::steady_clock;
using rt::failure_of;
using rt::host_tensors;
using rt::scoped_endpoint;

constexpr std::uint64_t kib = 1ull << 10;
constexpr refit::milliseconds streamer_timeout{5000};
/// The receivers here never give a refit up on their own within a test: an abort that arrives
/// at all arrives because something told the receiver.
constexpr refit::milliseconds long_idle{60000};

std::string vtext(std::optional<std::uint64_t> v) { return v ? std::to_string(*v) : "none"; }

std::string state_of(const refit::receiver& r) {
  return "committed=" + vtext(r.committed_version()) + " dirty=" + (r.dirty() ? "1" : "0");
}

// ------------------------------------------------------------------------------ receiver child

/// What the receiver child does.
struct spec {
  spec(std::string ep, std::vector<refit::tensor_meta> t) : endpoint(std::move(ep)), tensors(std::move(t)) {}

  std::string endpoint;
  std::vector<refit::tensor_meta> tensors;  ///< the parameter table (or what the callback expects)
  bool callback = false;                    ///< a callback sink instead of the table
  std::optional<std::uint64_t> refuse_at;   ///< on_begin throws for this version...
  std::string refusal;                      ///< ...with this message
  bool throwing_hooks = false;              ///< on_commit and on_abort throw after reporting
};

/// A receiver in a forked child. Lines it reports, in order:
///   "hook begin <v>", "hook commit <v> <state>", "hook abort <v> <reason>", "callback <views>",
///   "event <event> <state>" (every event but idle), "event aborted <state> | <last_error>".
/// Commands between messages: "state" (answers "state <state>"), "check <v>" (answers "check ok"
/// or where the table differs from version v's pattern), "unhook" (removes the hooks), "swap"
/// (re-registers every tensor at new memory), "stop".
///
/// The constructor returns once the child serves (its first line, "ready", is taken here): a
/// streamer's deadlines then start with a receiver that can answer. A child forked from a large
/// test process under TSan on a loaded 2-core host took more than a streamer's 5 s to reach its
/// first serve_one() (CI, twice: HELLO timed out); waiting for it here is bounded by next()'s 20 s.
class receiver_child {
 public:
  explicit receiver_child(spec s) : spec_(std::move(s)), proc_([this] { run(); }) {
    const std::string first = next();
    if (first != "ready") throw std::runtime_error("receiver child: said '" + first + "' before it was ready");
  }

  std::string next() { return lines_.receive(20s); }
  /// Lines up to and including the first that starts with `prefix`.
  std::vector<std::string> until(const std::string& prefix) {
    std::vector<std::string> out;
    do out.push_back(next());
    while (!out.back().starts_with(prefix));
    return out;
  }
  std::string command(const std::string& c) {
    commands_.send(c);
    return next();
  }
  int stop() {
    commands_.send("stop");
    return proc_.wait(20s);
  }

 private:
  void run();

  spec spec_;
  rt::signal_pipe lines_;     // child → parent
  rt::signal_pipe commands_;  // parent → child
  rt::child proc_;            // last: forks once the rest exists
};

void receiver_child::run() {
  refit::receiver_options o;
  o.endpoint = spec_.endpoint;
  o.idle_timeout = long_idle;
  refit::receiver r(o);
  const auto& ts = spec_.tensors;

  // The table's memory; "swap" moves it to fresh vectors (the old ones stay until the child ends).
  std::vector<std::vector<std::vector<std::uint8_t>>> generations(1);
  const auto register_all = [&] {
    auto& data = generations.back();
    data.clear();
    for (const auto& m : ts) data.emplace_back(m.nbytes(), std::uint8_t{0});
    r.clear_parameters();
    for (std::size_t i = 0; i < ts.size(); ++i)
      r.add_parameter(refit::tensor_dest{ts[i], data[i].empty() ? nullptr : data[i].data(), refit::device::cpu()});
  };
  const auto check = [&](std::uint64_t v) -> std::string {
    for (std::size_t i = 0; i < ts.size(); ++i) {
      const auto m = rt::pattern_mismatch(ts[i], v, generations.back()[i].data());
      if (!m.empty()) return m;
    }
    return "ok";
  };

  if (spec_.callback) {
    r.on_batch([&](std::span<const refit::tensor_view> views, void*) {
      lines_.send("callback " + std::to_string(views.size()));
    });
  } else {
    register_all();
  }
  const auto hook = [&] {
    r.on_begin([&](std::uint64_t v) {
      lines_.send("hook begin " + std::to_string(v));
      if (spec_.refuse_at == v) throw std::runtime_error(spec_.refusal);
    });
    r.on_commit([&](std::uint64_t v) {
      lines_.send("hook commit " + std::to_string(v) + " " + state_of(r));
      if (spec_.throwing_hooks) throw std::runtime_error("on_commit hook failed on purpose");
    });
    r.on_abort([&](std::uint64_t v, const std::string& reason) {
      lines_.send("hook abort " + std::to_string(v) + " " + reason);
      if (spec_.throwing_hooks) throw 42;  // not even a std::exception
    });
  };
  hook();
  lines_.send("ready");

  auto last = clock_type::now();
  for (;;) {
    const auto e = r.serve_one(50ms);
    if (e != refit::receiver_event::idle) {
      last = clock_type::now();
      std::string line = "event " + std::string(refit::to_string(e)) + " " + state_of(r);
      if (e == refit::receiver_event::aborted) line += " | " + r.last_error();
      lines_.send(line);
      continue;
    }
    if (clock_type::now() - last > 30s) throw std::runtime_error("receiver child: nothing for 30 s");
    const auto c = commands_.try_receive(0ms);
    if (!c) continue;
    if (*c == "stop") return;
    if (*c == "state") {
      lines_.send("state " + state_of(r));
    } else if (c->starts_with("check ")) {
      lines_.send("check " + check(std::stoull(c->substr(6))));
    } else if (*c == "unhook") {
      r.on_begin({});
      r.on_commit({});
      r.on_abort({});
      lines_.send("unhooked");
    } else if (*c == "swap") {
      generations.emplace_back();
      register_all();
      lines_.send("swapped");
    } else {
      throw std::runtime_error("receiver child: unknown command " + *c);
    }
    last = clock_type::now();
  }
}

refit::streamer_options stream_options(const std::string& endpoint, std::uint64_t buffer_bytes = 64 * kib) {
  return rt::host_shm_streamer(endpoint, buffer_bytes, streamer_timeout);
}

/// A model of `n` f32 tensors of `bytes` bytes each.
std::vector<refit::tensor_meta> flat_model(std::size_t n, std::uint64_t bytes) {
  std::vector<refit::tensor_meta> out;
  for (std::size_t i = 0; i < n; ++i)
    out.push_back(
        {"layers." + std::to_string(i) + ".weight", refit::dtype::f32, {static_cast<std::int64_t>(bytes / 4)}});
  return out;
}

// ------------------------------------------------------------------------------ raw streamer

/// A streamer built from the parts (host_shm buffers and a REQ channel), to send messages in
/// orders refit::streamer never does: a BEGIN in the middle of a refit, a stray ABORT.
class raw_streamer {
 public:
  explicit raw_streamer(const std::string& endpoint, std::uint64_t buffer_bytes = 64 * kib)
      : src_(make_source(buffer_bytes)), channel_(endpoint) {
    wire::hello h;
    src_->open_session(h);
    h.peer = "raw-streamer";
    if (const char* token = std::getenv("REFIT_TOKEN")) h.token = token;
    // The receiver child may still be starting (a forked process under TSan on a 2-core machine
    // took over 5 s once): its first answer gets the receivers' long deadline.
    const auto reply = request(h, long_idle);
    REQUIRE(std::holds_alternative<wire::ok>(reply));
    src_->session_accepted(std::array{std::get<wire::ok>(reply)});
  }

  wire::message request(const wire::message& m, refit::milliseconds timeout = streamer_timeout) {
    return wire::decode(channel_.request(wire::encode(m), timeout, wire::to_string(wire::type_of(m))));
  }
  /// Sends BATCH `seq` of `version` in buffer `seq % 2` holding `tensors` whole, each filled with
  /// its pattern for `version`.
  wire::message batch(std::uint64_t version, std::uint64_t seq, const std::vector<refit::tensor_meta>& tensors) {
    wire::batch b{version, seq, static_cast<std::uint32_t>(seq % 2), {}};
    std::uint64_t offset = 0;
    for (const auto& m : tensors) {
      rt::fill_pattern(m.name, version, reinterpret_cast<std::uint8_t*>(src_->data(b.buffer)) + offset, m.nbytes());
      b.entries.push_back(wire::entry{m.name, m.type, m.shape, 0, m.nbytes(), offset});
      offset += (m.nbytes() + 255) / 256 * 256;
    }
    return request(b);
  }

 private:
  static std::unique_ptr<refit::transport::source> make_source(std::uint64_t bytes) {
    refit::transport::source_options o;
    o.name = "host_shm";
    o.bytes = bytes;
    return refit::transport::make_source(o);
  }
  std::unique_ptr<refit::transport::source> src_;
  refit::channel::req_channel channel_;
};

bool is_ok(const wire::message& m) { return std::holds_alternative<wire::ok>(m); }

std::string error_text(const wire::message& m) {
  if (const auto* e = std::get_if<wire::error>(&m)) return std::string(refit::to_string(e->code)) + ": " + e->message;
  return "not an ERROR";
}

/// Yields `refs`; throws `what` when asked for tensor `throw_at`.
class throwing_source final : public refit::tensor_source {
 public:
  throwing_source(std::span<const refit::tensor_ref> refs, std::size_t throw_at, std::string what)
      : refs_(refs), throw_at_(throw_at), what_(std::move(what)) {}
  std::optional<refit::tensor_ref> next() override {
    if (i_ == throw_at_) throw std::runtime_error(what_);
    if (i_ == refs_.size()) return std::nullopt;
    return refs_[i_++];
  }

 private:
  std::span<const refit::tensor_ref> refs_;
  std::size_t throw_at_;
  std::string what_;
  std::size_t i_ = 0;
};

}  // namespace

// ======================================================================= superseded refits

TEST_CASE("a BEGIN during a refit is reported as aborted, then handled as begin by the next serve_one", "[lifecycle]") {
  const auto model = flat_model(2, 1 * kib);
  const scoped_endpoint endpoint;
  receiver_child rx(spec{endpoint.name, model});
  raw_streamer s(endpoint.name);
  CHECK(rx.next() == "event hello committed=none dirty=0");

  REQUIRE(is_ok(s.request(wire::begin{1, false, {}})));
  CHECK(rx.until("event begin") == std::vector<std::string>{"hook begin 1", "event begin committed=none dirty=0"});
  REQUIRE(is_ok(s.batch(1, 0, {model[0]})));  // half of version 1 applied
  CHECK(rx.next() == "event batch committed=none dirty=1");

  // BEGIN 2 before END 1: version 1 is aborted first, then version 2 begins, and the BEGIN is
  // answered (once) by the call that handles it.
  const auto reply = s.request(wire::begin{2, false, {}});
  CHECK(is_ok(reply));
  CHECK(rx.next() == "hook abort 1 BEGIN of version 2 arrived before END of version 1");
  CHECK(rx.next() == "event aborted committed=none dirty=1 | BEGIN of version 2 arrived before END of version 1");
  CHECK(rx.next() == "hook begin 2");
  CHECK(rx.next() == "event begin committed=none dirty=1");

  // Version 2 completes: committed and clean.
  REQUIRE(is_ok(s.batch(2, 0, {model[0]})));
  REQUIRE(is_ok(s.batch(2, 1, {model[1]})));
  REQUIRE(is_ok(s.request(wire::end{2, 2, 2 * kib, 2, {}})));
  CHECK(rx.until("event committed") ==
        std::vector<std::string>{"event batch committed=none dirty=1", "event batch committed=none dirty=1",
                                 "hook commit 2 committed=2 dirty=0", "event committed committed=2 dirty=0"});
  CHECK(rx.command("check 2") == "check ok");
  CHECK(rx.stop() == 0);
}

TEST_CASE("a HELLO during a refit is reported as aborted, then handled as hello; the new streamer's refit commits",
          "[lifecycle]") {
  const auto model = flat_model(4, 16 * kib);
  const scoped_endpoint endpoint;
  receiver_child rx(spec{endpoint.name, model});

  {
    // A streamer that dies (here: goes silent) after half a refit of version 1 is committed.
    raw_streamer old(endpoint.name);
    REQUIRE(is_ok(old.request(wire::begin{1, false, {}})));
    REQUIRE(is_ok(old.batch(1, 0, {model[0], model[1]})));
    CHECK(rx.until("event batch").back() == "event batch committed=none dirty=1");
  }

  // Its replacement says HELLO: the half refit is aborted first, dirty; then the session starts
  // and the new streamer's refit commits within its own deadline.
  refit::streamer fresh(stream_options(endpoint.name));
  const host_tensors v1(model, 1);
  const auto start = clock_type::now();
  CHECK(fresh.refit(1, v1.refs).version == 1);
  CHECK(clock_type::now() - start < streamer_timeout);
  const auto lines = rx.until("event committed");
  REQUIRE(lines.size() >= 5);
  CHECK(lines[0].starts_with("hook abort 1 a new session (HELLO from "));
  CHECK_THAT(lines[1], Catch::StartsWith("event aborted committed=none dirty=1 | a new session (HELLO from ") &&
                           Catch::Contains("replaced the session with raw-streamer before END of version 1"));
  CHECK(lines[2] == "event hello committed=none dirty=1");
  CHECK(lines[3] == "hook begin 1");
  CHECK(lines[4] == "event begin committed=none dirty=1");
  CHECK(lines[lines.size() - 2] == "hook commit 1 committed=1 dirty=0");
  CHECK(lines.back() == "event committed committed=1 dirty=0");
  CHECK(rx.command("check 1") == "check ok");

  fresh.close();
  CHECK(rx.next() == "event bye committed=1 dirty=0");
  CHECK(rx.stop() == 0);
}

// ======================================================================= ABORT from the streamer

TEST_CASE("a streamer that fails mid-refit tells the receiver at once: aborted long before the idle timeout",
          "[lifecycle]") {
  const auto model = flat_model(12, 16 * kib);  // 192 KiB: several 64 KiB batches
  const scoped_endpoint endpoint;
  receiver_child rx(spec{endpoint.name, model});
  refit::streamer s(stream_options(endpoint.name));

  const host_tensors v1(model, 1);
  s.refit(1, v1.refs);
  CHECK(rx.until("event committed").back() == "event committed committed=1 dirty=0");

  const host_tensors v2(model, 2);
  const auto start = clock_type::now();
  SECTION("a name yielded twice, after batches were applied") {
    auto refs = v2.refs;
    refs.push_back(refs[2]);
    const auto f = failure_of([&] { s.refit(2, refs); });
    REQUIRE(f);
    CHECK(f->code == rt::code_name(refit::errc::invalid_argument));
    CHECK_THAT(f->message, Catch::Contains("the source yielded tensor 'layers.2.weight' twice in version 2"));
    const auto lines = rx.until("event aborted");
    CHECK(lines.front() == "hook begin 2");
    CHECK(std::count(lines.begin(), lines.end(), "event batch committed=1 dirty=1") >= 2);
    CHECK_THAT(lines[lines.size() - 2],
               Catch::StartsWith("hook abort 2 the streamer ") &&
                   Catch::Contains("aborted version 2 (invalid_argument): the source yielded tensor 'layers.2.weight' "
                                   "twice in version 2"));
    CHECK_THAT(lines.back(), Catch::StartsWith("event aborted committed=1 dirty=1 | the streamer ") &&
                                 Catch::Contains("twice in version 2"));
  }
  SECTION("a tensor source that throws") {
    throwing_source source(v2.refs, 9, "all-gather of layers.9 failed: rank 3 is gone");
    try {
      s.refit(2, source);
      FAIL("refit() returned although its source threw");
    } catch (const refit::error& e) {
      FAIL("the source's exception came back as a refit::error: " << e.what());
    } catch (const std::runtime_error& e) {
      CHECK(std::string(e.what()) == "all-gather of layers.9 failed: rank 3 is gone");  // the original
    }
    const auto lines = rx.until("event aborted");
    CHECK(lines.front() == "hook begin 2");
    CHECK_THAT(lines.back(), Catch::StartsWith("event aborted committed=1 dirty=1 | the streamer ") &&
                                 Catch::Contains("aborted version 2 (invalid_argument): all-gather of layers.9 "
                                                 "failed: rank 3 is gone"));
  }
  // Told, not timed out: the receiver's idle timeout is 60 s.
  CHECK(clock_type::now() - start < 10s);
  CHECK(rx.command("state") == "state committed=1 dirty=1");

  // The same streamer's next refit commits and cleans the weights.
  const host_tensors v3(model, 3);
  s.refit(3, v3.refs);
  const auto lines = rx.until("event committed");
  CHECK(lines.front() == "hook begin 3");
  CHECK(lines.back() == "event committed committed=3 dirty=0");
  CHECK(rx.command("check 3") == "check ok");
  s.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE("an ABORT of no refit in progress, or of another version, is answered OK and changes nothing",
          "[lifecycle]") {
  const auto model = flat_model(2, 1 * kib);
  const scoped_endpoint endpoint;
  receiver_child rx(spec{endpoint.name, model});
  raw_streamer s(endpoint.name);
  CHECK(rx.next() == "event hello committed=none dirty=0");

  CHECK(is_ok(s.request(wire::abort{1, refit::errc::invalid_argument, "nothing began"})));
  CHECK(rx.next() == "event refused committed=none dirty=0");

  REQUIRE(is_ok(s.request(wire::begin{1, false, {}})));
  REQUIRE(is_ok(s.batch(1, 0, {model[0]})));
  CHECK(rx.until("event batch").back() == "event batch committed=none dirty=1");
  CHECK(is_ok(s.request(wire::abort{7, refit::errc::invalid_argument, "a version long gone"})));
  CHECK(rx.next() == "event refused committed=none dirty=1");

  // Version 1 is still in progress and commits.
  REQUIRE(is_ok(s.batch(1, 1, {model[1]})));
  REQUIRE(is_ok(s.request(wire::end{1, 2, 2 * kib, 2, {}})));
  CHECK(rx.until("event committed").back() == "event committed committed=1 dirty=0");

  // The ABORT of the refit in progress aborts it and is answered OK.
  REQUIRE(is_ok(s.request(wire::begin{2, false, {}})));
  REQUIRE(is_ok(s.batch(2, 0, {model[0]})));
  CHECK(is_ok(s.request(wire::abort{2, refit::errc::cuda, "cudaMemcpyAsync failed"})));
  const auto lines = rx.until("event aborted");
  CHECK(lines.back() ==
        "event aborted committed=1 dirty=1 | the streamer raw-streamer aborted version 2 (cuda): "
        "cudaMemcpyAsync failed");
  // Its batches are refused from then on.
  const auto late = s.batch(2, 1, {model[1]});
  CHECK_THAT(error_text(late), Catch::StartsWith("protocol: BATCH 1 of version 2 without a refit in progress"));
  CHECK(rx.next() == "event refused committed=1 dirty=1");
  CHECK(rx.stop() == 0);
}

// ======================================================================= hooks

TEST_CASE("hooks fire begin, batches, commit for each of three versions, and not once removed", "[lifecycle]") {
  const auto model = flat_model(6, 16 * kib);  // 96 KiB in 32 KiB buffers: three batches
  const scoped_endpoint endpoint;
  spec sp{endpoint.name, model};
  sp.callback = true;
  receiver_child rx(sp);
  refit::streamer s(stream_options(endpoint.name, 32 * kib));

  std::vector<std::string> callbacks;
  for (const std::uint64_t v : {3, 5, 9}) {
    const host_tensors t(model, v);
    const auto stats = s.refit(v, t.refs);
    REQUIRE(stats.batches == 3);
    std::vector<std::string> hooks_and_calls;
    for (const auto& line : rx.until("event committed"))
      if (!line.starts_with("event")) hooks_and_calls.push_back(line);
    CHECK(hooks_and_calls == std::vector<std::string>{
                                 "hook begin " + std::to_string(v), "callback 2", "callback 2", "callback 2",
                                 "hook commit " + std::to_string(v) + " committed=" + std::to_string(v) + " dirty=0"});
  }

  // An empty function removes each hook.
  CHECK(rx.command("unhook") == "unhooked");
  const host_tensors t(model, 10);
  s.refit(10, t.refs);
  CHECK(rx.until("event committed") ==
        std::vector<std::string>{"event begin committed=9 dirty=0", "callback 2", "event batch committed=9 dirty=1",
                                 "callback 2", "event batch committed=9 dirty=1", "callback 2",
                                 "event batch committed=9 dirty=1", "event committed committed=10 dirty=0"});
  s.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE("a refit the table refuses fires begin, then abort with the reason, and the streamer sees errc::apply",
          "[lifecycle]") {
  auto model = flat_model(8, 16 * kib);
  const scoped_endpoint endpoint;
  receiver_child rx(spec{endpoint.name, model});
  refit::streamer s(stream_options(endpoint.name, 32 * kib));

  const host_tensors v1(model, 1);
  s.refit(1, v1.refs);
  CHECK(rx.until("event committed").back() == "event committed committed=1 dirty=0");

  auto sent = model;
  sent.back().type = refit::dtype::i32;  // same bytes, other dtype, after three batches of good ones
  const host_tensors v2(sent, 2);
  const auto f = failure_of([&] { s.refit(2, v2.refs); });
  REQUIRE(f);
  CHECK(f->code == rt::code_name(refit::errc::apply));
  CHECK_THAT(f->message, Catch::Contains("layers.7.weight i32[4096]") && Catch::Contains("layers.7.weight f32[4096]"));
  const auto lines = rx.until("event aborted");
  REQUIRE(lines.size() >= 4);
  CHECK(lines.front() == "hook begin 2");
  CHECK(lines[1] == "event begin committed=1 dirty=0");
  CHECK(lines[lines.size() - 3] == "event batch committed=1 dirty=1");
  CHECK_THAT(lines[lines.size() - 2], Catch::StartsWith("hook abort 2 tensor 'layers.7.weight': the streamer sends "
                                                        "layers.7.weight i32[4096] but the parameter table holds"));
  CHECK_THAT(lines.back(), Catch::StartsWith("event aborted committed=1 dirty=1 | tensor 'layers.7.weight'"));

  const host_tensors v3(model, 3);
  s.refit(3, v3.refs);
  CHECK(rx.until("event committed").back() == "event committed committed=3 dirty=0");
  s.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE("an on_begin hook that throws refuses the refit with errc::apply and its message; the next one commits",
          "[lifecycle]") {
  const auto model = flat_model(4, 16 * kib);
  const scoped_endpoint endpoint;
  spec sp{endpoint.name, model};
  sp.refuse_at = 2;
  sp.refusal = "generation is mid-request; try again after step 41";
  receiver_child rx(sp);
  refit::streamer s(stream_options(endpoint.name));

  const host_tensors v1(model, 1);
  s.refit(1, v1.refs);
  CHECK(rx.until("event committed").back() == "event committed committed=1 dirty=0");

  const host_tensors v2(model, 2);
  const auto f = failure_of([&] { s.refit(2, v2.refs); });
  REQUIRE(f);
  CHECK(f->code == rt::code_name(refit::errc::apply));
  CHECK_THAT(f->message, Catch::Contains("the on_begin hook refused version 2: generation is mid-request; try again "
                                         "after step 41"));
  // No batch, no on_abort: the refit never started. The weights were not touched.
  CHECK(rx.next() == "hook begin 2");
  CHECK_THAT(rx.next(), Catch::StartsWith("event aborted committed=1 dirty=0 | the on_begin hook refused version 2"));
  CHECK(rx.command("check 1") == "check ok");

  const host_tensors v3(model, 3);
  s.refit(3, v3.refs);
  const auto lines = rx.until("event committed");
  CHECK(lines.front() == "hook begin 3");
  CHECK(lines.back() == "event committed committed=3 dirty=0");
  s.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE("exceptions thrown by on_commit and on_abort do not escape serve_one", "[lifecycle]") {
  const auto model = flat_model(4, 16 * kib);
  const scoped_endpoint endpoint;
  spec sp{endpoint.name, model};
  sp.throwing_hooks = true;
  receiver_child rx(sp);
  refit::streamer s(stream_options(endpoint.name));

  const host_tensors v1(model, 1);
  s.refit(1, v1.refs);
  CHECK(rx.until("event committed") ==
        std::vector<std::string>{"event hello committed=none dirty=0", "hook begin 1",
                                 "event begin committed=none dirty=0", "event batch committed=none dirty=1",
                                 "hook commit 1 committed=1 dirty=0", "event committed committed=1 dirty=0"});

  const host_tensors v2(model, 2);
  auto refs = v2.refs;
  refs.push_back(refs[0]);
  CHECK(failure_of([&] { s.refit(2, refs); }));
  const auto lines = rx.until("event aborted");
  CHECK(lines[lines.size() - 2].starts_with("hook abort 2 "));

  // The receiver still serves.
  const host_tensors v3(model, 3);
  s.refit(3, v3.refs);
  CHECK(rx.until("event committed").back() == "event committed committed=3 dirty=0");
  s.close();
  CHECK(rx.stop() == 0);
}

// ======================================================================= the parameter table

TEST_CASE("a parameter table re-registered at new memory between refits receives the next refit there", "[lifecycle]") {
  const auto model = flat_model(4, 16 * kib);
  const scoped_endpoint endpoint;
  receiver_child rx(spec{endpoint.name, model});
  refit::streamer s(stream_options(endpoint.name));

  const host_tensors v1(model, 1);
  s.refit(1, v1.refs);
  CHECK(rx.until("event committed").back() == "event committed committed=1 dirty=0");
  CHECK(rx.command("swap") == "swapped");  // fresh zeroed memory
  CHECK(rx.command("check 1") != "check ok");

  const host_tensors v2(model, 2);
  s.refit(2, v2.refs);
  CHECK(rx.until("event committed").back() == "event committed committed=2 dirty=0");
  CHECK(rx.command("check 2") == "check ok");
  s.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE("a parameter table changed while a refit is in progress fails that refit with errc::apply", "[lifecycle]") {
  const auto model = flat_model(2, 1 * kib);
  const scoped_endpoint endpoint;
  receiver_child rx(spec{endpoint.name, model});
  raw_streamer s(endpoint.name);

  REQUIRE(is_ok(s.request(wire::begin{1, false, {}})));
  REQUIRE(is_ok(s.batch(1, 0, {model[0]})));
  CHECK(rx.until("event batch").back() == "event batch committed=none dirty=1");
  CHECK(rx.command("swap") == "swapped");
  const auto reply = s.batch(1, 1, {model[1]});
  CHECK_THAT(error_text(reply),
             Catch::StartsWith("apply: the receiver's parameter table or callback changed while version 1 was in "
                               "progress"));
  const auto lines = rx.until("event aborted");
  CHECK(lines.front().starts_with("hook abort 1 the receiver's parameter table or callback changed"));

  // The next refit goes by the new table and commits.
  REQUIRE(is_ok(s.request(wire::begin{2, false, {}})));
  REQUIRE(is_ok(s.batch(2, 0, {model[0], model[1]})));
  REQUIRE(is_ok(s.request(wire::end{2, 2, 2 * kib, 1, {}})));
  CHECK(rx.until("event committed").back() == "event committed committed=2 dirty=0");
  CHECK(rx.command("check 2") == "check ok");
  CHECK(rx.stop() == 0);
}

TEST_CASE("a tensor without elements may have a null pointer on both sides and still counts in the manifest",
          "[lifecycle]") {
  const std::vector<refit::tensor_meta> model = {
      {"experts.empty", refit::dtype::bf16, {0, 128}},  // no elements, no bytes
      {"logit_scale", refit::dtype::f32, {}},           // 0-d: one element, 4 bytes
      {"lm_head.weight", refit::dtype::f32, {64, 16}},
  };
  const scoped_endpoint endpoint;
  receiver_child rx(spec{endpoint.name, model});  // registers experts.empty with a null pointer
  refit::streamer s(stream_options(endpoint.name));

  REQUIRE(model[0].nbytes() == 0);
  host_tensors v1(model, 1);
  v1.refs[0].data = nullptr;
  s.refit(1, v1.refs);
  CHECK(rx.until("event committed").back() == "event committed committed=1 dirty=0");
  CHECK(rx.command("check 1") == "check ok");

  // Left out, it is missing like any other tensor.
  host_tensors v2(model, 2);
  std::vector<refit::tensor_ref> partial(v2.refs.begin() + 1, v2.refs.end());
  const auto f = failure_of([&] { s.refit(2, partial); });
  REQUIRE(f);
  CHECK(f->code == rt::code_name(refit::errc::incomplete));
  CHECK_THAT(f->message, Catch::Contains("'experts.empty'"));
  CHECK(rx.until("event aborted").back().starts_with("event aborted committed=1 dirty=1"));

  // A 0-d tensor is one element: without memory the streamer refuses it before it is sent.
  host_tensors v3(model, 3);
  v3.refs[1].data = nullptr;
  const auto g = failure_of([&] { s.refit(3, v3.refs); });
  REQUIRE(g);
  CHECK(g->code == rt::code_name(refit::errc::invalid_argument));
  CHECK_THAT(g->message, Catch::Contains("tensor logit_scale f32[] has no data (null pointer)") &&
                             Catch::Contains("a 0-d tensor is one element: 4 bytes"));
  CHECK(rx.until("event aborted").back().starts_with("event aborted committed=1 dirty=1 | the streamer "));
  s.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE("add_parameter accepts a null pointer for a tensor without elements and refuses it for a 0-d tensor",
          "[lifecycle]") {
  refit::receiver r;
  CHECK_NOTHROW(r.add_parameter({{"empty", refit::dtype::bf16, {0, 128}}, nullptr, refit::device::cpu()}));
  CHECK_NOTHROW(r.add_parameter({{"empty.too", refit::dtype::u8, {7, 0}}, nullptr, refit::device::cpu()}));
  const auto f = failure_of([&] {
    r.add_parameter({{"scale", refit::dtype::f32, {}}, nullptr, refit::device::cpu()});
  });
  REQUIRE(f);
  CHECK(f->code == rt::code_name(refit::errc::invalid_argument));
  CHECK_THAT(f->message, Catch::Contains("add_parameter: scale f32[] has no data (null pointer)") &&
                             Catch::Contains("only a tensor with no elements may have none"));
  float scale = 0;
  CHECK_NOTHROW(r.add_parameter({{"scale", refit::dtype::f32, {}}, &scale, refit::device::cpu()}));
}
