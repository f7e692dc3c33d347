// Engine-wide versions (streamer_options::atomic): one streamer, several receivers (the ranks of
// one engine), and a version that reaches every receiver or none. Each receiver answers END once the
// version is prepared, commits (in place) or reports it prepared (staged) only at COMMIT, and
// discards it when another receiver failed before that. Receivers serve on threads of this
// process over host_shm; one of them is made to fail or stall at a chosen point of the version.
#include <algorithm>
#include <array>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <future>
#include <thread>
#include <variant>
#include <vector>

#include "refit/receiver.hpp"
#include "refit/streamer.hpp"

#include "channel/channel.hpp"
#include "transport/transport.hpp"
#include "wire/wire.hpp"
#include "support/serving.hpp"
#include "support/support.hpp"

namespace rt = refit::test;
namespace wire = refit::wire;
using refit::dtype;
using refit::receiver_event;
using refit::tensor_meta;
using rt::serving;
using rt::weights;

namespace {

constexpr std::uint64_t kib = 1ull << 10;

std::vector<tensor_meta> engine_model() {
  return {tensor_meta{"embed", dtype::f32, {64, 32}}, tensor_meta{"layer.0.w", dtype::bf16, {48, 40}},
          tensor_meta{"layer.0.b", dtype::f32, {40}}, tensor_meta{"head", dtype::f32, {32, 70}}};
}

refit::receiver_options rank_options(refit::stage_kind stage, refit::milliseconds idle = refit::milliseconds{60000}) {
  refit::receiver_options o;
  o.stage = stage;
  o.idle_timeout = idle;
  return o;
}

/// `n` receivers (each a rank of one engine) with the model's weights at version 0, serving.
struct engine {
  std::vector<std::unique_ptr<serving>> ranks;
  std::vector<std::unique_ptr<weights>> held;

  engine(std::size_t n, refit::stage_kind stage, refit::milliseconds idle = refit::milliseconds{60000}) {
    for (std::size_t k = 0; k < n; ++k) {
      ranks.push_back(std::make_unique<serving>(rank_options(stage, idle)));
      held.push_back(std::make_unique<weights>(ranks.back()->receiver, engine_model(), 0));
    }
  }
  void start() {
    for (auto& r : ranks) r->start();
  }
  [[nodiscard]] std::vector<std::string> endpoints() const {
    std::vector<std::string> out;
    for (const auto& r : ranks) out.push_back(r->receiver.endpoint());
    return out;
  }
  /// An atomic host_shm streamer to every rank, with small buffers (several batches a version).
  [[nodiscard]] refit::streamer_options streamer(refit::milliseconds timeout = refit::milliseconds{10000}) const {
    auto o = rt::host_shm_streamer(endpoints().front(), 4 * kib, timeout);
    o.transport_name.clear();  // host_shm whatever REFIT_TEST_TRANSPORT says: it serves several receivers
    o.transport = refit::transport_kind::host_shm;
    o.receivers = endpoints();
    o.atomic = true;
    return o;
  }
};

/// A session driven message by message over the library's own channel and host_shm buffers: what
/// a streamer does, with the freedom to stop anywhere (a COMMIT sent to some receivers only).
struct raw_session {
  std::unique_ptr<refit::transport::source> buffers;
  refit::channel::req_channel channel;
  std::string secret;
  std::uint64_t sent = 0;  ///< buffer bytes of the batches sent

  explicit raw_session(const std::string& endpoint, std::string s = "raw-session-secret", bool hello = true,
                       std::uint64_t group_rank = 0, std::uint64_t group_size = 1, std::uint64_t reply_timeout_ms = 0)
      : buffers(make_buffers()), channel(endpoint), secret(std::move(s)) {
    if (!hello) return;
    wire::hello h;
    buffers->open_session(h);
    h.peer = "raw-streamer";
    h.secret = secret;
    h.group_rank = group_rank;
    h.group_size = group_size;
    h.reply_timeout_ms = reply_timeout_ms;
    const wire::message reply = wire::decode(channel.request(wire::encode(h), refit::milliseconds{10000}, "HELLO"));
    REQUIRE(std::holds_alternative<wire::ok>(reply));
    buffers->session_accepted(std::array{std::get<wire::ok>(reply)});
  }
  /// "OK", or "<code>: <message>".
  std::string ask(const wire::message& m) {
    const wire::message reply = wire::decode(
        channel.request(wire::encode(m, secret), refit::milliseconds{10000}, wire::to_string(wire::type_of(m))));
    if (std::holds_alternative<wire::ok>(reply)) return "OK";
    const auto& e = std::get<wire::error>(reply);
    return std::string(refit::to_string(e.code)) + ": " + e.message;
  }
  /// BATCH 0 of `version` in buffer 0: every tensor of `model` whole, with its pattern.
  std::string batch(std::uint64_t version, const std::vector<tensor_meta>& model) {
    wire::batch b{version, 0, 0, {}};
    std::uint64_t offset = 0;
    for (const auto& m : model) {
      rt::fill_pattern(m.name, version, reinterpret_cast<std::uint8_t*>(buffers->data(0)) + offset, m.nbytes());
      b.entries.push_back(wire::entry{m.name, m.type, m.shape, 0, m.nbytes(), offset});
      offset += (m.nbytes() + 255) / 256 * 256;
      sent += m.nbytes();
    }
    return ask(b);
  }

 private:
  static std::unique_ptr<refit::transport::source> make_buffers() {
    refit::transport::source_options o;
    o.name = "host_shm";
    o.bytes = 64 * kib;
    return refit::transport::make_source(o);
  }
};

}  // namespace

TEST_CASE("an engine-wide version commits on every rank, and only after every rank prepared it", "[atomic]") {
  const std::size_t n = GENERATE(2, 4);
  engine e(n, refit::stage_kind::none);
  e.start();
  refit::streamer st(e.streamer());
  const rt::host_tensors v1(engine_model(), 1);
  const auto stats = st.refit(1, v1.refs);
  CHECK(stats.commit_seconds > 0);
  CHECK(stats.commit_seconds <= stats.seconds);
  for (std::size_t k = 0; k < n; ++k) {
    auto& r = *e.ranks[k];
    REQUIRE(r.log.wait_for("event committed"));
    r.finish();
    CHECK(r.receiver.committed_version() == std::optional<std::uint64_t>{1});
    CHECK(e.held[k]->mismatch(1).empty());
    // END was answered without committing (ended); the commit came with COMMIT.
    CHECK(r.log.take() == std::vector<std::string>{"event hello", "event ended", "commit 1", "event committed"});
  }
}

TEST_CASE("staged ranks of an engine-wide version report it prepared only at COMMIT, and each applies it whole",
          "[atomic][stage]") {
  engine e(2, refit::stage_kind::host);
  e.start();
  refit::streamer st(e.streamer());
  st.refit(1, rt::host_tensors(engine_model(), 1).refs);
  for (std::size_t k = 0; k < 2; ++k) {
    auto& r = *e.ranks[k];
    REQUIRE(r.log.wait_for("prepared 1"));
    CHECK(e.held[k]->mismatch(0).empty());  // untouched until the engine applies
    CHECK(r.receiver.apply_prepared() == std::optional<std::uint64_t>{1});
    CHECK(e.held[k]->mismatch(1).empty());
    r.finish();
    CHECK(r.log.take() ==
          std::vector<std::string>{"event hello", "event ended", "prepared 1", "event prepared", "commit 1"});
  }
}

TEST_CASE(
    "a rank that fails an engine-wide version at END makes every other rank discard it: the old version stays "
    "bit-exact and each says why",
    "[atomic][stage]") {
  const auto stage = GENERATE(refit::stage_kind::host, refit::stage_kind::none);
  const std::size_t n = GENERATE(2, 4);
  CAPTURE(refit::to_string(stage), n);
  engine e(n, stage);
  // The last rank's table has one tensor more than the streamer sends: its END finds it missing,
  // after every batch was taken everywhere and the other ranks prepared the version.
  std::vector<float> extra(8, 0.0f);
  e.ranks.back()->receiver.add_parameter(
      refit::tensor_dest{tensor_meta{"extra", dtype::f32, {8}}, extra.data(), refit::device::cpu()});
  e.start();
  refit::streamer st(e.streamer());
  const auto f = rt::failure_of([&] { st.refit(1, rt::host_tensors(engine_model(), 1).refs); });
  REQUIRE(f);
  CHECK(f->code == rt::code_name(refit::errc::incomplete));
  CHECK_THAT(f->message, Catch::Contains("receiver " + std::to_string(n) + " of " + std::to_string(n)) &&
                             Catch::Contains("missing 1 of the 5 registered tensors"));
  for (std::size_t k = 0; k < n; ++k) {
    auto& r = *e.ranks[k];
    REQUIRE(r.log.wait_for("abort 1"));
    r.finish();
    CHECK_FALSE(r.receiver.committed_version());
    CHECK_FALSE(r.receiver.prepared_version());
    if (k + 1 < n) {
      CHECK_THAT(r.reason(), Catch::Contains("aborted version 1") &&
                                 Catch::Contains("another receiver of the engine-wide version failed it"));
      CHECK(r.log.take() == std::vector<std::string>{"event hello", "event ended", "abort 1", "event aborted"});
    }
    // A staged rank's weights were never touched; an in-place rank's were written and are dirty.
    if (stage == refit::stage_kind::host) {
      CHECK(e.held[k]->mismatch(0).empty());
      CHECK_FALSE(r.receiver.dirty());
    } else {
      CHECK(r.receiver.dirty());
    }
  }
}

TEST_CASE("a rank that refuses a batch of an engine-wide version leaves every staged rank on its old version",
          "[atomic][stage]") {
  engine e(3, refit::stage_kind::host);
  // Rank 1 registers "head" with another shape: its BATCH carrying head is refused.
  std::vector<float> other(70 * 32);
  refit::receiver& odd = e.ranks[1]->receiver;
  odd.clear_parameters();
  e.held[1] = std::make_unique<weights>(
      odd, std::vector<tensor_meta>{engine_model()[0], engine_model()[1], engine_model()[2]}, 0);
  odd.add_parameter(refit::tensor_dest{tensor_meta{"head", dtype::f32, {70, 32}}, other.data(), refit::device::cpu()});
  e.start();
  refit::streamer st(e.streamer());
  CHECK_REFIT_ERROR(st.refit(1, rt::host_tensors(engine_model(), 1).refs), refit::errc::apply,
                    "receiver 2 of 3 (" + e.endpoints()[1] + ") refused BATCH");
  for (std::size_t k = 0; k < 3; ++k) {
    auto& r = *e.ranks[k];
    REQUIRE(r.log.wait_for("abort 1"));
    r.finish();
    // Every rank says why: the one that refused its own reason, the others the streamer's ABORT naming it.
    CHECK_THAT(r.reason(), Catch::Contains("'head'"));
    if (k != 1) CHECK_THAT(r.reason(), Catch::Contains("aborted version 1") && Catch::Contains("receiver 2 of 3"));
    CHECK_FALSE(r.receiver.committed_version());
    CHECK_FALSE(r.receiver.prepared_version());
    CHECK_FALSE(r.receiver.dirty());
    CHECK(e.held[k]->mismatch(0).empty());
  }
}

TEST_CASE(
    "a rank that stalls before preparing fails the engine-wide version on the streamer; the others discard it at "
    "once, the stalled one at its idle timeout, and the next version commits everywhere",
    "[atomic]") {
  engine e(2, refit::stage_kind::host, refit::milliseconds{1000});
  e.start();
  refit::streamer st(e.streamer(refit::milliseconds{3000}));
  st.refit(1, rt::host_tensors(engine_model(), 1).refs);
  for (auto& r : e.ranks) {
    REQUIRE(r->log.wait_for("prepared 1"));
    REQUIRE(r->receiver.apply_prepared() == std::optional<std::uint64_t>{1});
  }
  const std::uint64_t batches = st.refit(2, rt::host_tensors(engine_model(), 2).refs).batches;
  for (auto& r : e.ranks) {
    REQUIRE(r->log.wait_for("prepared 2"));
    REQUIRE(r->receiver.apply_prepared() == std::optional<std::uint64_t>{2});
  }
  // Version 3: rank 1 stops serving after its last batch, so its END waits unread past the
  // streamer's timeout (3 s) and its own idle timeout (1 s).
  auto& stalled = *e.ranks[1];
  {
    std::lock_guard lock(stalled.gate_mutex);
    stalled.pause_when = [&, seen = std::uint64_t{0}](receiver_event ev) mutable {
      return ev == receiver_event::batch && ++seen == batches;
    };
  }
  CHECK_REFIT_ERROR(st.refit(3, rt::host_tensors(engine_model(), 3).refs), refit::errc::timeout, "END");
  REQUIRE(e.ranks[0]->log.wait_for("abort 3"));
  CHECK_THAT(e.ranks[0]->reason(), Catch::Contains("another receiver of the engine-wide version failed it"));
  stalled.resume();
  REQUIRE(stalled.log.wait_for("abort 3"));
  CHECK_THAT(stalled.reason(), Catch::Contains("no message from the streamer"));
  for (std::size_t k = 0; k < 2; ++k) {
    CHECK(e.ranks[k]->receiver.committed_version() == std::optional<std::uint64_t>{2});
    CHECK_FALSE(e.ranks[k]->receiver.prepared_version());
    CHECK(e.held[k]->mismatch(2).empty());
  }
  // The streamer's next refit says HELLO again and the version reaches both.
  st.refit(4, rt::host_tensors(engine_model(), 4).refs);
  for (std::size_t k = 0; k < 2; ++k) {
    REQUIRE(e.ranks[k]->log.wait_for("prepared 4"));
    REQUIRE(e.ranks[k]->receiver.apply_prepared() == std::optional<std::uint64_t>{4});
    CHECK(e.held[k]->mismatch(4).empty());
  }
}

TEST_CASE(
    "a rank that prepared and never hears COMMIT discards the version at its timeout while the rank that heard it "
    "commits",
    "[atomic]") {
  // The one window engine-wide versions leave: a streamer that dies between its COMMITs (here a
  // session driven message by message, which sends COMMIT to rank 0 only). Rank 0 commits; rank 1
  // waits its idle timeout (this streamer named no reply timeout) and discards the version.
  engine e(2, refit::stage_kind::none, refit::milliseconds{1000});
  e.start();
  std::vector<std::unique_ptr<raw_session>> sessions;
  for (const auto& ep : e.endpoints()) sessions.push_back(std::make_unique<raw_session>(ep));
  const auto model = engine_model();
  for (auto& s : sessions) {
    REQUIRE(s->ask(wire::begin{1, false, std::nullopt}) == "OK");
    REQUIRE(s->batch(1, model) == "OK");
    REQUIRE(s->ask(wire::end{1, model.size(), s->sent, 1, std::nullopt, true}) == "OK");
  }
  for (auto& r : e.ranks) REQUIRE(r->log.wait_for("event ended"));
  CHECK_FALSE(e.ranks[0]->receiver.committed_version());  // prepared, not committed
  CHECK(sessions[0]->ask(wire::commit{1}) == "OK");
  REQUIRE(e.ranks[0]->log.wait_for("commit 1"));
  CHECK(e.ranks[0]->receiver.committed_version() == std::optional<std::uint64_t>{1});
  CHECK(e.held[0]->mismatch(1).empty());
  auto& silent = *e.ranks[1];
  REQUIRE(silent.log.wait_for("abort 1"));
  CHECK_THAT(silent.reason(), Catch::Contains("prepared engine-wide") && Catch::Contains("sent no COMMIT"));
  CHECK_FALSE(silent.receiver.committed_version());
  CHECK(silent.receiver.dirty());
  // A COMMIT after that is refused, and one said twice where it committed is answered OK.
  CHECK_THAT(sessions[1]->ask(wire::commit{1}), Catch::Contains("protocol: COMMIT of version 1 without it prepared"));
  CHECK(sessions[0]->ask(wire::commit{1}) == "OK");
  CHECK(e.ranks[0]->receiver.committed_version() == std::optional<std::uint64_t>{1});
}

TEST_CASE("COMMIT from a peer that does not own the session is refused with unauthorized and commits nothing",
          "[atomic]") {
  engine e(1, refit::stage_kind::none);
  e.start();
  raw_session owner(e.endpoints().front());
  raw_session stranger(e.endpoints().front(), "another-secret", false);
  const auto model = engine_model();
  REQUIRE(owner.ask(wire::begin{1, false, std::nullopt}) == "OK");
  REQUIRE(owner.batch(1, model) == "OK");
  REQUIRE(owner.ask(wire::end{1, model.size(), owner.sent, 1, std::nullopt, true}) == "OK");
  CHECK_THAT(stranger.ask(wire::commit{1}), Catch::StartsWith("unauthorized: COMMIT refused"));
  CHECK_FALSE(e.ranks[0]->receiver.committed_version());
  CHECK(owner.ask(wire::commit{1}) == "OK");
  REQUIRE(e.ranks[0]->log.wait_for("commit 1"));
  CHECK(e.held[0]->mismatch(1).empty());
}

namespace {

/// A sharded trainer of `ranks` streamers and an engine of `n` receivers, each receiver a group of
/// `ranks` lanes; rank r streams its rows to lane r of every receiver, all atomic.
struct sharded_engine {
  std::vector<std::unique_ptr<serving>> receivers;
  std::vector<std::unique_ptr<weights>> held;
  std::vector<std::unique_ptr<refit::streamer>> ranks;

  sharded_engine(std::size_t ranks_n, std::size_t n, refit::stage_kind stage,
                 const std::vector<tensor_meta>& extra_on_last = {}) {
    for (std::size_t j = 0; j < n; ++j) {
      auto o = rank_options(stage);
      o.streamers = ranks_n;
      receivers.push_back(std::make_unique<serving>(o));
      auto model = engine_model();
      if (j + 1 == n) model.insert(model.end(), extra_on_last.begin(), extra_on_last.end());
      held.push_back(std::make_unique<weights>(receivers.back()->receiver, model, 0));
      receivers.back()->start();
    }
    for (std::size_t r = 0; r < ranks_n; ++r) {
      std::vector<std::string> eps;
      for (const auto& rx : receivers) eps.push_back(rx->receiver.endpoints()[r]);
      auto o = rt::host_shm_streamer(eps.front(), 4 * kib, refit::milliseconds{10000});
      o.transport_name.clear();
      o.transport = refit::transport_kind::host_shm;
      o.receivers = eps;
      o.group_rank = r;
      o.group_size = ranks_n;
      o.atomic = true;
      ranks.push_back(std::make_unique<refit::streamer>(o));
    }
  }
  /// Every rank refits `version` of `whole` on a thread of its own; what each threw ("" for none).
  std::vector<std::string> refit(std::uint64_t version, const rt::host_tensors& whole) {
    std::vector<std::string> failed(ranks.size());
    std::vector<std::thread> threads;
    for (std::size_t r = 0; r < ranks.size(); ++r)
      threads.emplace_back([&, r] {
        const auto shards = rt::rank_shards(whole, r, ranks.size());
        if (const auto f = rt::failure_of([&] { ranks[r]->refit(version, shards); }))
          failed[r] = f->code + ": " + f->message;
      });
    for (auto& t : threads) t.join();
    return failed;
  }
};

}  // namespace

TEST_CASE(
    "a group of two streamers sends engine-wide versions to two receivers: each commits only once both ranks said "
    "COMMIT, bit-exact",
    "[atomic][group]") {
  const auto stage = GENERATE(refit::stage_kind::none, refit::stage_kind::host);
  INFO("stage " << refit::to_string(stage));
  sharded_engine e(2, 2, stage);
  for (const std::uint64_t version : {1u, 2u}) {
    const rt::host_tensors whole(engine_model(), version);
    const auto failed = e.refit(version, whole);
    for (const auto& f : failed) CHECK(f.empty());
    for (std::size_t j = 0; j < 2; ++j) {
      auto& rx = *e.receivers[j];
      if (stage == refit::stage_kind::host) {
        REQUIRE(rx.log.wait_for("prepared " + std::to_string(version)));
        CHECK(e.held[j]->mismatch(version - 1).empty());  // prepared at COMMIT, the weights untouched
        REQUIRE(rx.receiver.apply_prepared() == std::optional<std::uint64_t>{version});
      } else {
        REQUIRE(rx.log.wait_for("commit " + std::to_string(version)));
      }
      CHECK(rx.receiver.committed_version() == std::optional<std::uint64_t>{version});
      CHECK(e.held[j]->mismatch(version).empty());
    }
  }
}

TEST_CASE(
    "a receiver that fails a group's engine-wide version at END makes every rank abort it on the others: no "
    "receiver commits, a staged one's weights untouched",
    "[atomic][group]") {
  // The second receiver registers a tensor nobody sends: its check at the group's last END fails.
  sharded_engine e(2, 2, refit::stage_kind::host, {tensor_meta{"only.on.rank1", dtype::f32, {8}}});
  const rt::host_tensors whole(engine_model(), 1);
  const auto failed = e.refit(1, whole);
  for (const auto& f : failed) {
    CHECK_THAT(f, Catch::Contains("'only.on.rank1'"));
  }
  REQUIRE(e.receivers[0]->log.wait_for("abort 1"));
  REQUIRE(e.receivers[1]->log.wait_for("abort 1"));
  for (std::size_t j = 0; j < 2; ++j) {
    CHECK_FALSE(e.receivers[j]->receiver.committed_version());
    CHECK_FALSE(e.receivers[j]->receiver.prepared_version());
    CHECK_FALSE(e.receivers[j]->receiver.dirty());
    CHECK(e.held[j]->mismatch(0).empty());
  }
}

TEST_CASE(
    "a group's engine-wide version commits at the second rank's COMMIT; a rank silent after another's COMMIT "
    "discards it, and the held COMMIT hears why",
    "[atomic][group]") {
  // Two ranks as raw sessions on one receiver (a group of two): rank 0 sends every tensor whole, rank 1
  // nothing (an empty shard of each), both END engine-wide.
  const auto model = engine_model();
  auto o = rank_options(refit::stage_kind::none);
  o.streamers = 2;
  serving s(o);
  weights w(s.receiver, model, 0);
  s.start();
  std::uint64_t bytes = 0;
  for (const auto& m : model) bytes += m.nbytes();
  const auto eps = s.receiver.endpoints();
  const auto begin_and_end = [&](raw_session& r0, raw_session& r1, std::uint64_t version) {
    REQUIRE(r0.ask(wire::begin{version, false, std::nullopt}) == "OK");
    REQUIRE(r1.ask(wire::begin{version, false, std::nullopt}) == "OK");
    REQUIRE(r0.batch(version, model) == "OK");
    // Rank 1's END is answered once rank 0's arrived: both prepared.
    auto end1 = std::async(std::launch::async, [&] { return r1.ask(wire::end{version, 0, 0, 0, std::nullopt, true}); });
    CHECK(r0.ask(wire::end{version, model.size(), bytes, 1, std::nullopt, true}) == "OK");
    CHECK(end1.get() == "OK");
  };

  SECTION("both ranks COMMIT: the version commits, each COMMIT answered OK") {
    raw_session r0(eps[0], "rank-0-secret", true, 0, 2);
    raw_session r1(eps[1], "rank-1-secret", true, 1, 2);
    begin_and_end(r0, r1, 1);
    CHECK_FALSE(s.receiver.committed_version());  // prepared, not committed: COMMIT has not come
    auto commit0 = std::async(std::launch::async, [&] { return r0.ask(wire::commit{1}); });
    CHECK(r1.ask(wire::commit{1}) == "OK");
    CHECK(commit0.get() == "OK");
    REQUIRE(s.log.wait_for("commit 1"));
    CHECK(s.receiver.committed_version() == std::optional<std::uint64_t>{1});
    CHECK(w.mismatch(1).empty());
  }
  SECTION("rank 0 never says COMMIT: rank 1's COMMIT is answered with the abort within its reply timeout") {
    raw_session r0(eps[0], "rank-0-secret", true, 0, 2, 60000);
    raw_session r1(eps[1], "rank-1-secret", true, 1, 2, 800);
    begin_and_end(r0, r1, 1);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string held = r1.ask(wire::commit{1});
    const auto waited = std::chrono::steady_clock::now() - t0;
    CHECK_THAT(held, Catch::StartsWith("timeout: engine-wide version 1 was prepared and"));
    CHECK_THAT(held, Catch::Contains("but rank 0 said neither COMMIT nor ABORT within three quarters of"));
    CHECK(waited >= std::chrono::milliseconds{600});  // three quarters of rank 1's 800 ms
    REQUIRE(s.log.wait_for("abort 1"));
    CHECK_FALSE(s.receiver.committed_version());
    // Rank 0's COMMIT, late: nothing is prepared any more, nothing commits.
    CHECK_THAT(r0.ask(wire::commit{1}), Catch::StartsWith("protocol: COMMIT of version 1 without it prepared here"));
    CHECK_FALSE(s.receiver.committed_version());
  }
}
