// End-to-end refits in two processes over host_shm: the receiver runs in a forked child and
// reports every outcome (with a byte-for-byte check of what it holds) to the streamer in the
// parent, which asserts on its own results and on those reports.
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
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

#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "refit/version.hpp"
#include "channel/channel.hpp"
#include "support/support.hpp"

using namespace std::chrono_literals;
namespace rt = refit::test;

namespace {

using rt::code_name;
using rt::failure;
using rt::failure_of;
using rt::host_tensors;
using rt::pattern_mismatch;
using rt::scoped_endpoint;

constexpr std::uint64_t kib = 1ull << 10;
constexpr std::uint64_t mib = 1ull << 20;
constexpr refit::milliseconds streamer_timeout{2000};

std::uint64_t total_bytes(const std::vector<refit::tensor_meta>& metas) {
  std::uint64_t sum = 0;
  for (const auto& m : metas) sum += m.nbytes();
  return sum;
}

// A private endpoint for one test; its socket file and directory go when the test ends.

refit::streamer_options stream_options(const std::string& endpoint, std::size_t buffer_count,
                                       std::uint64_t buffer_bytes) {
  return rt::host_shm_streamer(endpoint, buffer_bytes, streamer_timeout, buffer_count);
}

// ------------------------------------------------------------------------ the receiver child

enum class sink_kind { table, callback };

// What the receiver child does.
struct receiver_spec {
  receiver_spec(std::string ep, std::vector<refit::tensor_meta> t) : endpoint(std::move(ep)), tensors(std::move(t)) {}

  std::string endpoint;
  /// Registered in the parameter table, or (callback sink) the tensors the callback expects.
  std::vector<refit::tensor_meta> tensors;
  sink_kind sink = sink_kind::table;
  refit::milliseconds idle_timeout{3000};
  std::string layout;        ///< receiver_options::layout
  bool control_lane = true;  ///< receiver_options::control_lane
  // Callback sink only ------------------------------------------------------------------------
  /// The streamer's buffer size: tensors larger than it must arrive in chunks; with keep_whole,
  /// tensors that fit must arrive whole. 0: not checked.
  std::uint64_t buffer_bytes = 0;
  bool keep_whole = true;
  /// Every view's data pointer must be a multiple of this (0: not checked).
  std::uint64_t alignment = 0;
  /// keep_whole=false: at least one tensor that fits a buffer must have been split.
  bool expect_small_splits = false;
  /// The callback throws std::runtime_error(fail_message) at batch `fail_batch` (from 0) of refit
  /// `fail_refit` (from 0, counting BEGINs).
  int fail_refit = -1;
  int fail_batch = -1;
  std::string fail_message;
};

std::string event_name(refit::receiver_event e) {
  switch (e) {
    case refit::receiver_event::idle: return "idle";
    case refit::receiver_event::hello: return "hello";
    case refit::receiver_event::begin: return "begin";
    case refit::receiver_event::batch: return "batch";
    case refit::receiver_event::committed: return "committed";
    case refit::receiver_event::aborted: return "aborted";
    case refit::receiver_event::bye: return "bye";
    case refit::receiver_event::refused: return "refused";
    case refit::receiver_event::ended: return "ended";
    case refit::receiver_event::prepared: return "prepared";
  }
  return "unknown";
}

using rt::outcome;

// A receiver in a forked child. It reports every committed, aborted and refused event as an
// outcome() line, answers state() between messages, and serves until the parent calls stop().
class receiver_child {
 public:
  explicit receiver_child(receiver_spec spec) : spec_(std::move(spec)), proc_([this] { run(); }) {}

  /// The next outcome line.
  std::string next_report() { return reports_.receive(20s); }
  /// committed_version() and dirty() as an outcome("state", ...) line, once no message has
  /// arrived for a moment (so that what was sent before has been applied).
  std::string state() {
    to_child_.send("state");
    return reports_.receive(20s);
  }
  /// Lets the child finish serving; returns its exit code.
  int stop() {
    to_child_.send("stop");
    return proc_.wait(20s);
  }

 private:
  void run();

  receiver_spec spec_;
  rt::signal_pipe reports_;   // child → parent
  rt::signal_pipe to_child_;  // parent → child: "state" or "stop"
  rt::child proc_;            // last: forks once the rest exists
};

void receiver_child::run() {
  const auto& tensors = spec_.tensors;
  refit::receiver_options ro;
  ro.endpoint = spec_.endpoint;
  ro.idle_timeout = spec_.idle_timeout;
  ro.layout = spec_.layout;
  ro.control_lane = spec_.control_lane;
  refit::receiver r(ro);

  std::vector<std::vector<std::uint8_t>> data(tensors.size());
  std::unordered_map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    data[i].assign(std::max<std::uint64_t>(tensors[i].nbytes(), 1), std::uint8_t{0});
    index.emplace(tensors[i].name, i);
  }

  // Callback bookkeeping, reset at every BEGIN.
  int refits = -1;  // BEGINs seen, minus one
  int batch = 0;    // callback calls in this refit
  std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>> ranges(tensors.size());
  std::vector<int> lasts(tensors.size());
  std::uint64_t small_splits = 0;
  std::string problem;  // the first thing found wrong in this refit
  auto note = [&](const std::string& what) {
    if (problem.empty()) problem = what;
  };

  if (spec_.sink == sink_kind::table) {
    for (std::size_t i = 0; i < tensors.size(); ++i)
      r.add_parameter(refit::tensor_dest{tensors[i], data[i].data(), refit::device::cpu()});
  } else {
    r.on_batch([&](std::span<const refit::tensor_view> views, void* stream) {
      if (refits == spec_.fail_refit && batch == spec_.fail_batch) throw std::runtime_error(spec_.fail_message);
      ++batch;
      if (stream != nullptr) note("the callback got a stream on the CPU");
      for (const auto& v : views) {
        if (v.meta == nullptr) {
          note("a view without metadata");
          continue;
        }
        const auto it = index.find(v.meta->name);
        if (it == index.end()) {
          note("unexpected tensor " + refit::describe(*v.meta));
          continue;
        }
        const auto i = it->second;
        const auto& meta = tensors[i];
        const auto total = meta.nbytes();
        const std::string where = meta.name + " [" + std::to_string(v.offset) + ", +" + std::to_string(v.bytes) + ")";
        if (!(*v.meta == meta)) {
          note(refit::describe(*v.meta) + " arrived for " + refit::describe(meta));
          continue;
        }
        if (v.total != total) note(where + ": total " + std::to_string(v.total) + " != " + std::to_string(total));
        if (v.offset > total || v.bytes > total - v.offset) {
          note(where + " is outside the tensor");
          continue;
        }
        if (!(v.dev == refit::device::cpu())) note(where + " is not on the CPU");
        if (v.bytes > 0 && v.data == nullptr) note(where + " has no data");
        if (v.whole() && !v.last()) note(where + " is whole but not last");
        if (spec_.alignment != 0 && v.bytes > 0 && reinterpret_cast<std::uintptr_t>(v.data) % spec_.alignment != 0)
          note(where + " is not aligned to " + std::to_string(spec_.alignment));
        if (spec_.buffer_bytes != 0) {
          if (total > spec_.buffer_bytes && v.whole()) note(where + " is larger than a buffer but arrived whole");
          if (total <= spec_.buffer_bytes && !v.whole()) {
            ++small_splits;
            if (spec_.keep_whole) note(where + " fits a buffer but arrived split (keep_whole)");
          }
        }
        if (v.bytes > 0 && v.data != nullptr) std::memcpy(data[i].data() + v.offset, v.data, v.bytes);
        ranges[i].emplace_back(v.offset, v.bytes);
        if (v.last()) ++lasts[i];
      }
    });
  }

  // After a commit: every destination holds the committed version's bytes, and (callback) every
  // byte arrived exactly once, each tensor's last chunk once.
  auto check = [&](std::uint64_t version) -> std::string {
    for (std::size_t i = 0; i < tensors.size() && problem.empty(); ++i) {
      const auto& meta = tensors[i];
      if (spec_.sink == sink_kind::callback) {
        auto& rs = ranges[i];
        std::sort(rs.begin(), rs.end());
        std::uint64_t cursor = 0;
        for (const auto& [offset, bytes] : rs) {
          if (offset != cursor)
            note(meta.name + ": byte " + std::to_string(std::min(offset, cursor)) + " arrived " +
                 (offset < cursor ? "twice" : "never"));
          cursor = std::max(cursor, offset + bytes);
        }
        if (cursor != meta.nbytes()) note(meta.name + ": bytes from " + std::to_string(cursor) + " never arrived");
        if (lasts[i] != 1) note(meta.name + ": " + std::to_string(lasts[i]) + " views flagged last()");
      }
      const auto m = pattern_mismatch(meta, version, data[i].data());
      if (!m.empty()) note(m);
    }
    if (spec_.expect_small_splits && small_splits == 0)
      note("no tensor that fits a buffer was split (keep_whole=false)");
    return problem.empty() ? "ok" : problem;
  };

  auto last_event = std::chrono::steady_clock::now();
  for (;;) {
    const auto e = r.serve_one(100ms);
    const auto now = std::chrono::steady_clock::now();
    if (e == refit::receiver_event::idle) {
      if (const auto line = to_child_.try_receive(0ms)) {
        if (*line == "stop") return;
        reports_.send(outcome("state", r.committed_version(), r.dirty()));
      }
      if (now - last_event > 30s) throw std::runtime_error("receiver child: no message for 30 s");
      continue;
    }
    last_event = now;
    switch (e) {
      case refit::receiver_event::begin:
        ++refits;
        batch = 0;
        for (auto& rs : ranges) rs.clear();
        std::fill(lasts.begin(), lasts.end(), 0);
        small_splits = 0;
        problem.clear();
        break;
      case refit::receiver_event::committed: {
        const auto v = r.committed_version();
        reports_.send(outcome("committed", v, r.dirty(), v ? check(*v) : "no committed version"));
        break;
      }
      case refit::receiver_event::aborted:
      case refit::receiver_event::refused:
        reports_.send(outcome(event_name(e), r.committed_version(), r.dirty()));
        break;
      default: break;
    }
  }
}

// Yields tensors from a list, one at a time.
class list_source final : public refit::tensor_source {
 public:
  explicit list_source(std::span<const refit::tensor_ref> refs) : refs_(refs) {}
  std::optional<refit::tensor_ref> next() override {
    if (i_ == refs_.size()) return std::nullopt;
    return refs_[i_++];
  }
  [[nodiscard]] std::size_t yielded() const noexcept { return i_; }

 private:
  std::span<const refit::tensor_ref> refs_;
  std::size_t i_ = 0;
};

// One good refit of `metas` as `version`; checks the streamer's figures and the receiver's report.
void good_refit(refit::streamer& s, receiver_child& rx, const std::vector<refit::tensor_meta>& metas,
                std::uint64_t version) {
  const host_tensors t(metas, version);
  const auto stats = s.refit(version, t.refs);
  CHECK(stats.version == version);
  CHECK(stats.tensors == metas.size());
  CHECK(stats.bytes == total_bytes(metas));
  CHECK(rx.next_report() == outcome("committed", version, false));
}

}  // namespace

// ---------------------------------------------------------------------------------- bytes

TEST_CASE("a refit of 300 mixed-dtype tensors and one 5x the buffer arrives bit-exact in the parameter table",
          "[refit]") {
  const auto metas = rt::mixed_model(300, 5 * mib + 123);
  const auto total = total_bytes(metas);
  REQUIRE(metas.size() == 301);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  receiver_child rx(receiver_spec(ep, metas));

  refit::streamer s(stream_options(ep, 2, 1 * mib));
  const host_tensors v1(metas, 1);
  const auto stats = s.refit(1, v1.refs);
  CHECK(stats.version == 1);
  CHECK(stats.tensors == 301);
  CHECK(stats.bytes == total);
  CHECK(stats.batches >= (total + mib - 1) / mib);
  CHECK(rx.next_report() == outcome("committed", 1, false));

  s.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE("requests go through the control lane unless the streamer or the receiver says no; each way is bit-exact",
          "[refit]") {
  const auto [streamer_lane, receiver_lane] = GENERATE(table<bool, bool>({{true, true}, {false, true}, {true, false}}));
  INFO("streamer control_lane " << streamer_lane << ", receiver control_lane " << receiver_lane);
  const auto metas = rt::mixed_model(3000, 2 * mib + 5);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  receiver_spec spec(ep, metas);
  spec.control_lane = receiver_lane;
  receiver_child rx(spec);
  auto o = stream_options(ep, 2, 4 * mib);
  o.control_lane = streamer_lane;
  refit::streamer s(o);
  CHECK(s.announce() == 0);  // no session yet: nobody to tell
  for (std::uint64_t v = 1; v <= 3; ++v) {
    const host_tensors data(metas, v);
    const auto stats = s.refit(v, data.refs);
    CHECK(stats.control_lane == (streamer_lane && receiver_lane));
    CHECK(rx.next_report() == outcome("committed", v, false));
    // The next refit announced: told through the lane only; it arrives all the same.
    CHECK(s.announce() == (streamer_lane && receiver_lane ? 1u : 0u));
  }
  s.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE("three consecutive refits with different data commit in turn, each bit-exact (span, source, next())",
          "[refit]") {
  const auto metas = rt::mixed_model(200, 3 * mib + 1);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  receiver_child rx(receiver_spec(ep, metas));
  refit::streamer s(stream_options(ep, 2, 1 * mib));

  // The versions' data really differ (else a stale receiver would pass).
  const host_tensors v3(metas, 3);
  const host_tensors v4(metas, 4);
  const host_tensors v10(metas, 10);
  const auto big =
      static_cast<std::size_t>(std::max_element(metas.begin(), metas.end(),
                                                [](const auto& a, const auto& b) { return a.nbytes() < b.nbytes(); }) -
                               metas.begin());
  const bool differ = v3.bytes[big] != v4.bytes[big] && v4.bytes[big] != v10.bytes[big];
  CHECK(differ);

  // A list.
  CHECK(s.refit(3, std::span<const refit::tensor_ref>(v3.refs)).version == 3);
  CHECK(rx.next_report() == outcome("committed", 3, false));

  // A tensor_source: every tensor asked for exactly once.
  list_source source(v4.refs);
  const auto stats4 = s.refit(4, source);
  CHECK(stats4.version == 4);
  CHECK(stats4.tensors == metas.size());
  CHECK(source.yielded() == metas.size());
  CHECK(rx.next_report() == outcome("committed", 4, false));

  // A next() callback.
  std::size_t i = 0;
  const std::function<std::optional<refit::tensor_ref>()> next = [&]() -> std::optional<refit::tensor_ref> {
    if (i == v10.refs.size()) return std::nullopt;
    return v10.refs[i++];
  };
  const auto stats10 = s.refit(10, next);
  CHECK(stats10.version == 10);
  CHECK(stats10.bytes == total_bytes(metas));
  CHECK(rx.next_report() == outcome("committed", 10, false));

  s.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE("the callback sink sees every byte exactly once, whole tensors whole and the oversize one in chunks",
          "[refit]") {
  const auto metas = rt::mixed_model(300, 3 * mib + 5);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  receiver_spec spec(ep, metas);
  spec.sink = sink_kind::callback;
  spec.buffer_bytes = 1 * mib;
  spec.keep_whole = true;
  receiver_child rx(spec);
  refit::streamer s(stream_options(ep, 2, 1 * mib));

  // Two refits: the callback's bookkeeping starts over at every BEGIN.
  good_refit(s, rx, metas, 1);
  good_refit(s, rx, metas, 2);

  s.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE("keep_whole=false, 4096-byte alignment and three buffers are bit-exact in the parameter table", "[refit]") {
  const auto metas = rt::mixed_model(300, 1 * mib + 77);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  receiver_child rx(receiver_spec(ep, metas));
  auto o = stream_options(ep, 3, 256 * kib);
  o.alignment = 4096;
  o.keep_whole = false;
  refit::streamer s(o);

  const host_tensors v1(metas, 1);
  const auto stats = s.refit(1, v1.refs);
  CHECK(stats.bytes == total_bytes(metas));
  CHECK(stats.batches >= (total_bytes(metas) + 256 * kib - 1) / (256 * kib));
  CHECK(rx.next_report() == outcome("committed", 1, false));
  good_refit(s, rx, metas, 2);

  s.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE("keep_whole=false and 4096-byte alignment hand the callback aligned views, splitting small tensors too",
          "[refit]") {
  const auto metas = rt::mixed_model(300, 1 * mib + 77);
  REQUIRE(total_bytes(metas) > 4 * 256 * kib);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  receiver_spec spec(ep, metas);
  spec.sink = sink_kind::callback;
  spec.buffer_bytes = 256 * kib;
  spec.keep_whole = false;
  spec.alignment = 4096;
  spec.expect_small_splits = true;
  receiver_child rx(spec);
  auto o = stream_options(ep, 3, 256 * kib);
  o.alignment = 4096;
  o.keep_whole = false;
  refit::streamer s(o);

  good_refit(s, rx, metas, 1);

  s.close();
  CHECK(rx.stop() == 0);
}

// ------------------------------------------------------------------- what the sinks refuse

namespace {

// A good refit (version 1), then a refit (version 2) of `sent`, which the parameter table of
// `registered` must refuse with `code` and a message holding every one of `fragments`; then a good refit
// (version 3) in the same session commits and clears dirty. `sent` puts its bad tensor last,
// after more than a buffer of good ones, so that batches were applied before the refusal.
void table_refuses(const std::vector<refit::tensor_meta>& registered, const std::vector<refit::tensor_meta>& sent,
                   refit::errc code, const std::vector<std::string>& fragments) {
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  receiver_child rx(receiver_spec(ep, registered));
  refit::streamer s(stream_options(ep, 2, 256 * kib));

  good_refit(s, rx, registered, 1);

  const host_tensors bad(sent, 2);
  const auto f = failure_of([&] { s.refit(2, bad.refs); });
  REQUIRE(f);
  CHECK(f->code == code_name(code));
  for (const auto& fragment : fragments) CHECK_THAT(f->message, Catch::Contains(fragment));
  CHECK(rx.next_report() == outcome("aborted", 1, true));

  good_refit(s, rx, registered, 3);

  s.close();
  CHECK(rx.stop() == 0);
}

// mixed_model(40, 600 KiB) plus a tensor of known name, dtype and shape at the end.
std::vector<refit::tensor_meta> with_tail(const refit::tensor_meta& tail) {
  auto metas = rt::mixed_model(40, 600 * kib);
  REQUIRE(total_bytes(metas) > 256 * kib);
  metas.push_back(tail);
  return metas;
}

const refit::tensor_meta lm_head{"lm_head.weight", refit::dtype::f32, {64, 32}};

}  // namespace

TEST_CASE("a tensor the parameter table does not know aborts the refit with the receiver's error naming it",
          "[refit]") {
  const auto registered = with_tail(lm_head);
  auto sent = registered;
  sent.back().name = "decoder.extra_head.weight";
  table_refuses(registered, sent, refit::errc::apply, {"'decoder.extra_head.weight'", "parameter table"});
}

TEST_CASE("a dtype different from the parameter table's aborts the refit and commits nothing", "[refit]") {
  const auto registered = with_tail(lm_head);
  auto sent = registered;
  sent.back().type = refit::dtype::i32;  // same bytes, other dtype
  table_refuses(registered, sent, refit::errc::apply, {"lm_head.weight i32[64, 32]", "lm_head.weight f32[64, 32]"});
}

TEST_CASE("a shape different from the parameter table's aborts the refit and commits nothing", "[refit]") {
  const auto registered = with_tail(lm_head);
  auto sent = registered;
  sent.back().shape = {32, 64};  // same bytes, other shape
  table_refuses(registered, sent, refit::errc::apply, {"lm_head.weight f32[32, 64]", "lm_head.weight f32[64, 32]"});
}

TEST_CASE(
    "a streamer recorded for another engine layout is refused at HELLO naming both digests; a matching one and "
    "one without a digest commit",
    "[refit][layout]") {
  const auto metas = rt::mixed_model(20, 0);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  receiver_spec spec(ep, metas);
  spec.layout = "sha256:aaaa";
  receiver_child rx(spec);
  {
    auto o = stream_options(ep, 2, 256 * kib);
    o.layout = "sha256:bbbb";
    refit::streamer s(o);
    const host_tensors t(metas, 1);
    const auto f = failure_of([&] { s.refit(1, t.refs); });
    REQUIRE(f);
    CHECK(f->code == code_name(refit::errc::invalid_argument));
    CHECK_THAT(f->message, Catch::Contains("engine layout mismatch"));
    CHECK_THAT(f->message, Catch::Contains("layout sha256:bbbb"));
    CHECK_THAT(f->message, Catch::Contains("layout sha256:aaaa"));
    CHECK(rx.next_report() == outcome("refused", std::nullopt, false));
  }
  {
    auto o = stream_options(ep, 2, 256 * kib);
    o.layout = "sha256:aaaa";
    refit::streamer s(o);
    good_refit(s, rx, metas, 1);
    s.close();
  }
  {
    refit::streamer s(stream_options(ep, 2, 256 * kib));  // no digest: not checked
    good_refit(s, rx, metas, 2);
    s.close();
  }
  CHECK(rx.stop() == 0);
}

TEST_CASE("a throwing batch callback reaches the streamer as errc::apply with its message; the next refit commits",
          "[refit]") {
  const auto metas = rt::mixed_model(60, 600 * kib);
  REQUIRE(total_bytes(metas) > 2 * 256 * kib);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  receiver_spec spec(ep, metas);
  spec.sink = sink_kind::callback;
  spec.fail_refit = 1;
  spec.fail_batch = 1;
  spec.fail_message = "quantiser rejected layers.3.mlp (scale overflow)";
  receiver_child rx(spec);
  refit::streamer s(stream_options(ep, 2, 256 * kib));

  good_refit(s, rx, metas, 1);

  // The second refit's second batch throws: its first batch was applied, so the receiver is dirty.
  const host_tensors v2(metas, 2);
  const auto f = failure_of([&] { s.refit(2, v2.refs); });
  REQUIRE(f);
  CHECK(f->code == code_name(refit::errc::apply));
  CHECK_THAT(f->message, Catch::Contains("quantiser rejected layers.3.mlp (scale overflow)"));
  CHECK(rx.next_report() == outcome("aborted", 1, true));

  // Same streamer, same session: the next refit commits and clears dirty.
  good_refit(s, rx, metas, 3);

  s.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE("a refit missing one registered tensor does not commit (errc::incomplete naming it)", "[refit]") {
  const auto metas = rt::mixed_model(60, 600 * kib);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  receiver_child rx(receiver_spec(ep, metas));
  refit::streamer s(stream_options(ep, 2, 256 * kib));

  good_refit(s, rx, metas, 1);

  const host_tensors v2(metas, 2);
  constexpr std::size_t missing = 17;
  std::vector<refit::tensor_ref> partial = v2.refs;
  partial.erase(partial.begin() + missing);
  const auto f = failure_of([&] { s.refit(2, partial); });
  REQUIRE(f);
  CHECK(f->code == code_name(refit::errc::incomplete));
  CHECK_THAT(f->message, Catch::Contains("missing 1 of the " + std::to_string(metas.size()) + " registered tensors"));
  CHECK_THAT(f->message, Catch::Contains("'" + metas[missing].name + "'"));
  // Every other tensor was applied: the weights are a mix of versions 1 and 2.
  CHECK(rx.next_report() == outcome("aborted", 1, true));

  good_refit(s, rx, metas, 3);

  s.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE("a version not newer than the committed one is refused, from the same or a fresh streamer", "[refit]") {
  const auto metas = rt::mixed_model(20, 0);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  receiver_child rx(receiver_spec(ep, metas));
  const host_tensors v(metas, 5);

  {
    refit::streamer s(stream_options(ep, 2, 256 * kib));
    good_refit(s, rx, metas, 5);
    for (const std::uint64_t old : {5, 4}) {
      const auto f = failure_of([&] { s.refit(old, v.refs); });
      REQUIRE(f);
      CHECK(f->code == code_name(refit::errc::protocol));
      CHECK_THAT(f->message,
                 Catch::Contains("version " + std::to_string(old) + " is not newer than the committed version 5"));
      CHECK(rx.next_report() == outcome("aborted", 5, false));
    }
    s.close();
  }

  // The receiver, not the streamer, knows what is committed.
  refit::streamer fresh(stream_options(ep, 2, 256 * kib));
  const auto f = failure_of([&] { fresh.refit(3, v.refs); });
  REQUIRE(f);
  CHECK(f->code == code_name(refit::errc::protocol));
  CHECK_THAT(f->message, Catch::Contains("version 3 is not newer than the committed version 5"));
  CHECK(rx.next_report() == outcome("aborted", 5, false));
  good_refit(fresh, rx, metas, 6);

  fresh.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE(
    "a tensor the streamer cannot send fails the refit at the streamer; the receiver, told by ABORT, reports "
    "it aborted and commits nothing of it",
    "[refit]") {
  const auto metas = rt::mixed_model(60, 600 * kib);
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  receiver_child rx(receiver_spec(ep, metas));
  refit::streamer s(stream_options(ep, 2, 256 * kib));

  good_refit(s, rx, metas, 1);

  // The bad tensor comes last, after batches of version 2 were sent and applied.
  const host_tensors v2(metas, 2);
  bool wrote = true;  // batches of version 2 reached the weights before the failure
  SECTION("a name yielded twice") {
    auto refs = v2.refs;
    refs.push_back(refs[3]);
    const auto f = failure_of([&] { s.refit(2, refs); });
    REQUIRE(f);
    CHECK(f->code == code_name(refit::errc::invalid_argument));
    CHECK_THAT(f->message, Catch::Contains("the source yielded tensor '" + metas[3].name + "' twice in version 2"));
  }
  SECTION("a name yielded twice where the last refit had another tensor") {
    // Version 1's order is followed up to the 41st tensor, which repeats the 4th: found all the same.
    auto refs = v2.refs;
    refs[40] = refs[3];
    const auto f = failure_of([&] { s.refit(2, refs); });
    REQUIRE(f);
    CHECK(f->code == code_name(refit::errc::invalid_argument));
    CHECK_THAT(f->message, Catch::Contains("the source yielded tensor '" + metas[3].name + "' twice in version 2"));
  }
  SECTION("a null pointer") {
    auto refs = v2.refs;
    refs.push_back(refit::tensor_ref{refit::tensor_meta{"lm_head.weight", refit::dtype::bf16, {16, 16}}, nullptr,
                                     refit::device::cpu(), nullptr});
    const auto f = failure_of([&] { s.refit(2, refs); });
    REQUIRE(f);
    CHECK(f->code == code_name(refit::errc::invalid_argument));
    CHECK_THAT(f->message, Catch::Contains("lm_head.weight bf16[16, 16] has no data (null pointer)"));
  }
  SECTION("a source that throws while it is read ahead of BEGIN's reply") {
    // The streamer reads the source while BEGIN is on its way: the exception waits until BEGIN is
    // through, so the receiver still hears ABORT, and the caller gets it unchanged.
    std::size_t calls = 0;
    const std::function<std::optional<refit::tensor_ref>()> next = [&]() -> std::optional<refit::tensor_ref> {
      if (calls == 2) throw std::runtime_error("the all-gather of rank 3 failed");
      return v2.refs[calls++];
    };
    CHECK_THROWS_MATCHES(s.refit(2, next), std::runtime_error, Catch::Message("the all-gather of rank 3 failed"));
    CHECK(calls == 2);
    wrote = false;  // no batch was sent: the weights are clean
  }
  // ABORT reached the receiver before refit() threw: the report is there without any timeout.
  CHECK(rx.next_report() == outcome("aborted", 1, wrote));
  CHECK(rx.state() == outcome("state", 1, wrote));

  // The next refit of the same streamer replaces the abandoned one and commits.
  good_refit(s, rx, metas, 3);

  s.close();
  CHECK(rx.stop() == 0);
}

// ------------------------------------------------------------------------- bad options

TEST_CASE("bad streamer options are rejected by the constructor with errc::invalid_argument", "[refit]") {
  const scoped_endpoint endpoint;
  const std::string& ep = endpoint.name;
  struct bad_case {
    const char* what;
    std::function<void(refit::streamer_options&)> spoil;
    const char* fragment;
  };
  const std::vector<bad_case> cases = {
      {"one buffer", [](auto& o) { o.buffer_count = 1; }, "buffer_count"},
      {"no buffers", [](auto& o) { o.buffer_count = 0; }, "buffer_count"},
      {"alignment 3", [](auto& o) { o.alignment = 3; }, "alignment"},
      {"alignment 0", [](auto& o) { o.alignment = 0; }, "alignment"},
      {"empty buffers", [](auto& o) { o.buffer_bytes = 0; }, "buffer_bytes"},
      {"buffers smaller than the alignment", [](auto& o) { o.buffer_bytes = 100; }, "buffer_bytes"},
      {"65 host_shm receivers", [&](auto& o) { o.receivers.assign(65, ep); },
       "65 receivers given, but the host_shm transport serves 64 receivers per streamer"},
      {"two cuda_ipc receivers without direct writes",
       [&](auto& o) {
         o.transport = refit::transport_kind::cuda_ipc;
         o.direct = false;
         o.receivers = {ep, ep + "2"};
       },
       // A build without CUDA says first that it lacks the transport.
       refit::has_transport(refit::transport_kind::cuda_ipc)
           ? "serves several receivers only by writing straight into each one's parameter table: set direct = true"
           : "transport cuda_ipc is not built into this refit (built: host_shm)"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    auto o = stream_options(ep, 2, 1 * mib);
    c.spoil(o);
    const auto f = failure_of([&] { refit::streamer s(o); });
    REQUIRE(f);
    CHECK(f->code == code_name(refit::errc::invalid_argument));
    CHECK_THAT(f->message, Catch::Contains(c.fragment));
  }
}
