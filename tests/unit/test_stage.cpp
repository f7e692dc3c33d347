// Staged receivers (receiver_options::stage): every batch of a version lands in the receiver's
// stage, the engine's weights stay untouched until it calls apply_prepared(), END reports the
// version prepared (on_prepared), and on_commit fires only at the apply. The receiver serves on a
// thread of this process; the streamer (host_shm) runs on the test's thread.
#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "refit/memory.hpp"
#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "refit/version.hpp"
#include "support/serving.hpp"
#include "support/support.hpp"

using namespace std::chrono_literals;
namespace rt = refit::test;
using refit::dtype;
using refit::tensor_meta;
using rt::serving;
using rt::weights;

namespace {

constexpr std::uint64_t kib = 1ull << 10;
constexpr refit::milliseconds streamer_timeout{10000};

std::vector<tensor_meta> stage_model() {
  return {tensor_meta{"embed", dtype::f32, {64, 32}}, tensor_meta{"layer.0.w", dtype::bf16, {48, 40}},
          tensor_meta{"layer.0.b", dtype::f32, {40}}, tensor_meta{"layer.1.w", dtype::f16, {96, 24}},
          tensor_meta{"head", dtype::f32, {32, 70}}};
}

refit::receiver_options staged(std::uint64_t stage_bytes = 0) {
  refit::receiver_options o;
  o.stage = refit::stage_kind::host;
  o.stage_bytes = stage_bytes;
  o.idle_timeout = refit::milliseconds{60000};
  return o;
}

/// A host_shm streamer with small buffers, so that a version takes several batches.
refit::streamer_options small_buffers(const std::string& endpoint) {
  return rt::host_shm_streamer(endpoint, 4 * kib, streamer_timeout);
}

/// A delta streamer to staged receiver `s` that sent `v` as version 1, applied: its base.
refit::streamer delta_streamer_at_version_1(serving& s, const rt::host_tensors& v) {
  auto so = small_buffers(s.receiver.endpoint());
  so.delta.enable = true;
  refit::streamer st(so);
  st.refit(1, v.refs);
  REQUIRE(s.log.wait_for("prepared 1"));
  REQUIRE(s.receiver.apply_prepared() == std::optional<std::uint64_t>{1});
  return st;
}

/// FNV-1a over every byte of every tensor of `w`, as an engine's check of its weights would read them.
std::uint64_t checksum_of(const std::vector<std::vector<std::uint8_t>>& bytes) {
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& t : bytes)
    for (const std::uint8_t b : t) h = (h ^ b) * 1099511628211ull;
  return h;
}

}  // namespace

TEST_CASE("a staged receiver prepares at END with the weights untouched; apply_prepared commits that version",
          "[stage]") {
  serving s(staged());
  weights w(s.receiver, stage_model(), 0);
  s.start();
  refit::streamer st(small_buffers(s.receiver.endpoint()));
  const rt::host_tensors v1(stage_model(), 1);
  const auto stats = st.refit(1, v1.refs);
  CHECK(stats.batches > 1);
  REQUIRE(s.log.wait_for("prepared 1"));
  // The streamer's refit() returned as for a commit, but the engine's weights are the old ones.
  CHECK(s.receiver.prepared_version() == std::optional<std::uint64_t>{1});
  CHECK_FALSE(s.receiver.committed_version());
  CHECK_FALSE(s.receiver.dirty());
  CHECK(w.mismatch(0).empty());
  CHECK(s.receiver.last_stats().version == 0);
  // The engine applies, from its own thread, between two of its steps.
  CHECK(s.receiver.apply_prepared() == std::optional<std::uint64_t>{1});
  CHECK(w.mismatch(1).empty());
  CHECK(s.receiver.committed_version() == std::optional<std::uint64_t>{1});
  CHECK_FALSE(s.receiver.prepared_version());
  CHECK(s.receiver.last_stats().version == 1);
  CHECK(s.receiver.last_stats().tensors == stage_model().size());
  CHECK(s.receiver.last_stats().pause_seconds >= 0);
  CHECK_FALSE(s.receiver.apply_prepared());  // nothing waits any more
  s.finish();
  // serve_one() said prepared (never committed), after on_prepared; on_commit fired once, at the apply.
  CHECK(s.log.take() == std::vector<std::string>{"event hello", "prepared 1", "event prepared", "commit 1"});
}

TEST_CASE(
    "a BEGIN while a version is prepared is refused with errc::apply and writes nothing; after the apply the "
    "next version stages",
    "[stage]") {
  serving s(staged());
  weights w(s.receiver, stage_model(), 0);
  s.start();
  refit::streamer st(small_buffers(s.receiver.endpoint()));
  const rt::host_tensors v1(stage_model(), 1);
  const rt::host_tensors v2(stage_model(), 2);
  st.refit(1, v1.refs);
  REQUIRE(s.log.wait_for("prepared 1"));
  CHECK_REFIT_ERROR(st.refit(2, v2.refs), refit::errc::apply, "version 1 is prepared and waits for apply_prepared()");
  CHECK(s.receiver.prepared_version() == std::optional<std::uint64_t>{1});
  CHECK(w.mismatch(0).empty());
  CHECK(s.receiver.apply_prepared() == std::optional<std::uint64_t>{1});
  CHECK(w.mismatch(1).empty());
  st.refit(2, v2.refs);
  REQUIRE(s.log.wait_for("prepared 2"));
  CHECK(w.mismatch(1).empty());
  CHECK(s.receiver.apply_prepared() == std::optional<std::uint64_t>{2});
  CHECK(w.mismatch(2).empty());
  CHECK(s.receiver.committed_version() == std::optional<std::uint64_t>{2});
}

TEST_CASE("a staged subset writes only the tensors it sent at the apply; the others keep the committed version",
          "[stage]") {
  serving s(staged());
  weights w(s.receiver, stage_model(), 0);
  s.start();
  refit::streamer st(small_buffers(s.receiver.endpoint()));
  const rt::host_tensors v1(stage_model(), 1);
  st.refit(1, v1.refs);
  REQUIRE(s.log.wait_for("prepared 1"));
  REQUIRE(s.receiver.apply_prepared() == std::optional<std::uint64_t>{1});
  // Version 2 carries two of the five tensors.
  const rt::host_tensors v2(stage_model(), 2);
  const std::vector<refit::tensor_ref> some{v2.refs[1], v2.refs[3]};
  const auto stats = st.refit(2, some, refit::refit_scope::subset);
  CHECK(stats.subset);
  REQUIRE(s.log.wait_for("prepared 2"));
  CHECK(w.mismatch(1).empty());
  REQUIRE(s.receiver.apply_prepared() == std::optional<std::uint64_t>{2});
  CHECK(w.mismatch({1, 2, 1, 2, 1}).empty());
  CHECK(s.receiver.last_stats().tensors == 2);
}

TEST_CASE(
    "staged destinations in the engine's layout are applied through their views; bytes between their rows stay "
    "as they were",
    "[stage]") {
  serving s(staged());
  // One engine tensor [8, 24] f32: "left" fills columns 0..8, "right" (a slice of columns 2..10 of a
  // [8, 12] source) fills columns 12..20; columns 8..12 and 20..24 belong to nobody here.
  constexpr std::size_t rows = 8, cols = 24;
  std::vector<float> engine(rows * cols, -1.0f);
  const tensor_meta left{"left", dtype::f32, {8, 8}};
  const tensor_meta right{"right", dtype::f32, {8, 8}};
  s.receiver.add_parameter(refit::tensor_dest{left, engine.data(), refit::device::cpu()},
                           refit::dest_layout{{24, 1}, std::nullopt, nullptr, 0});
  s.receiver.add_parameter(refit::tensor_dest{right, engine.data() + 12, refit::device::cpu()},
                           refit::dest_layout{{24, 1}, refit::source_slice{1, 2, 8}, nullptr, 0});
  s.start();
  refit::streamer st(small_buffers(s.receiver.endpoint()));
  std::vector<float> l(8 * 8), r(8 * 12);
  for (std::size_t i = 0; i < l.size(); ++i) l[i] = static_cast<float>(i);
  for (std::size_t i = 0; i < r.size(); ++i) r[i] = 1000.0f + static_cast<float>(i);
  const std::vector<refit::tensor_ref> refs{
      refit::tensor_ref{left, l.data(), refit::device::cpu()},
      refit::tensor_ref{tensor_meta{"right", dtype::f32, {8, 12}}, r.data(), refit::device::cpu()}};
  st.refit(1, refs);
  REQUIRE(s.log.wait_for("prepared 1"));
  for (const float x : engine) CHECK(x == -1.0f);  // untouched until the apply
  REQUIRE(s.receiver.apply_prepared() == std::optional<std::uint64_t>{1});
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < cols; ++j) {
      const float x = engine[i * cols + j];
      if (j < 8)
        CHECK(x == l[i * 8 + j]);
      else if (j >= 12 && j < 20)
        CHECK(x == r[i * 12 + (j - 12) + 2]);
      else
        CHECK(x == -1.0f);
    }
}

TEST_CASE("a host stage holds the table's bytes beside host_shm's buffers, as README.md's memory table says",
          "[stage][memory]") {
  // One process holds both sides here: the streamer's segments (n x b), the receiver's mappings of
  // them (n x b) and the stage (the table's bytes), plus at most the 8 MiB a kind every mode may
  // take for itself (bench/memory.cpp).
  const std::vector<tensor_meta> model{tensor_meta{"big", dtype::f32, {3 << 20}},
                                       tensor_meta{"odd", dtype::bf16, {12345}}};
  std::uint64_t table = 0;
  for (const auto& m : model) table += m.nbytes();
  const std::uint64_t buffers = 2 * (1ull << 20);
  refit::reset_memory_peaks();
  const refit::memory_usage before = refit::memory_in_use();
  serving s(staged());
  weights w(s.receiver, model, 0);
  s.start();
  auto so = rt::host_shm_streamer(s.receiver.endpoint(), 1ull << 20, streamer_timeout);
  so.buffer_count = 2;
  refit::streamer st(so);
  st.refit(1, rt::host_tensors(model, 1).refs);
  REQUIRE(s.log.wait_for("prepared 1"));
  const refit::memory_usage held = refit::memory_in_use();
  const std::uint64_t extra = held.host_peak - before.host;
  INFO("host memory held: " << extra << " bytes, table " << table << ", buffers " << buffers);
  CHECK(extra >= table + 2 * buffers);
  CHECK(extra <= table + 2 * buffers + (8ull << 20));
  CHECK(held.device == before.device);
  CHECK(held.pinned == before.pinned);
  REQUIRE(s.receiver.apply_prepared() == std::optional<std::uint64_t>{1});
  CHECK(w.mismatch(1).empty());
}

TEST_CASE("a staged version of 45 MiB is applied on the stage's threads, bit-exact", "[stage]") {
  // 32 MiB or more: apply_prepared() splits the copy into pieces for the stage's worker threads.
  const std::vector<tensor_meta> model{tensor_meta{"big", dtype::f32, {9 << 20}},
                                       tensor_meta{"odd", dtype::bf16, {12345}},
                                       tensor_meta{"mid", dtype::u8, {(9 << 20) + 7}}};
  auto o = staged();
  o.delta_threads = 3;
  serving s(o);
  weights w(s.receiver, model, 0);
  s.start();
  refit::streamer st(rt::host_shm_streamer(s.receiver.endpoint(), 8 << 20, streamer_timeout));
  st.refit(1, rt::host_tensors(model, 1).refs);
  REQUIRE(s.log.wait_for("prepared 1"));
  CHECK(w.mismatch(0).empty());
  REQUIRE(s.receiver.apply_prepared() == std::optional<std::uint64_t>{1});
  CHECK(w.mismatch(1).empty());
}

TEST_CASE(
    "a version that needs more than stage_bytes is refused at BEGIN, saying both byte counts, before anything "
    "is written",
    "[stage]") {
  serving s(staged(1000));
  weights w(s.receiver, stage_model(), 0);
  s.start();
  refit::streamer st(small_buffers(s.receiver.endpoint()));
  const rt::host_tensors v1(stage_model(), 1);
  const auto f = rt::failure_of([&] { st.refit(1, v1.refs); });
  REQUIRE(f);
  CHECK(f->code == rt::code_name(refit::errc::invalid_argument));
  CHECK_THAT(f->message, Catch::Contains("version 1 needs a stage of ") &&
                             Catch::Contains("more than receiver_options::stage_bytes (1000 bytes)") &&
                             Catch::Contains("nothing was written"));
  s.finish();
  CHECK(s.log.take() == std::vector<std::string>{"event hello", "event refused"});
  CHECK(w.mismatch(0).empty());
  CHECK_FALSE(s.receiver.dirty());
  CHECK_FALSE(s.receiver.prepared_version());
  CHECK_FALSE(s.receiver.committed_version());
}

TEST_CASE("a staged refit that fails half-way leaves the weights untouched and clean; the next version stages",
          "[stage]") {
  serving s(staged());
  weights w(s.receiver, stage_model(), 0);
  s.start();
  refit::streamer st(small_buffers(s.receiver.endpoint()));
  // The last tensor is unknown to the table: the batches before it land in the stage, then the refit
  // fails. An in-place receiver would be dirty here, its weights partly overwritten.
  const rt::host_tensors v1(stage_model(), 1);
  const rt::host_tensors stranger({tensor_meta{"not.registered", dtype::f32, {16}}}, 1);
  std::vector<refit::tensor_ref> refs = v1.refs;
  refs.push_back(stranger.refs.front());
  CHECK_REFIT_ERROR(st.refit(1, refs), refit::errc::apply, "'not.registered'");
  REQUIRE(s.log.wait_for("abort 1"));
  CHECK(w.mismatch(0).empty());
  CHECK_FALSE(s.receiver.dirty());
  CHECK_FALSE(s.receiver.prepared_version());
  st.refit(2, rt::host_tensors(stage_model(), 2).refs);
  REQUIRE(s.log.wait_for("prepared 2"));
  REQUIRE(s.receiver.apply_prepared() == std::optional<std::uint64_t>{2});
  CHECK(w.mismatch(2).empty());
}

TEST_CASE(
    "a staged receiver takes delta versions: the patches wait in the stage, the weights stay the base until the "
    "apply, and the version checks out bit-exact",
    "[stage][delta]") {
  serving s(staged());
  weights w(s.receiver, stage_model(), 0);
  s.start();
  rt::host_tensors v(stage_model(), 1);
  refit::streamer st = delta_streamer_at_version_1(s, v);
  // Version 2 changes a few bytes of two tensors: sent as patches against version 1.
  const std::vector<std::uint8_t> before0 = v.bytes[0], before3 = v.bytes[3];
  v.bytes[0][5] ^= 0x5a;
  v.bytes[0][777] ^= 0x01;
  v.bytes[3][100] ^= 0xff;
  const auto stats = st.refit(2, v.refs);
  CHECK(stats.delta);
  CHECK_FALSE(stats.whole_after_refusal);
  CHECK(stats.bytes < stage_model()[0].nbytes());  // patches, not tensors
  REQUIRE(s.log.wait_for("prepared 2"));
  CHECK(w.mismatch(1).empty());  // the base, untouched
  REQUIRE(s.receiver.apply_prepared() == std::optional<std::uint64_t>{2});
  for (std::size_t k = 0; k < v.bytes.size(); ++k) CHECK(w.bytes[k] == v.bytes[k]);
  CHECK(w.bytes[0] != before0);
  CHECK(w.bytes[3] != before3);
  // Version 3 patches version 2 (its checksum known from the staged delta): a delta again.
  v.bytes[1][3] ^= 0x10;
  CHECK(st.refit(3, v.refs).delta);
  REQUIRE(s.log.wait_for("prepared 3"));
  REQUIRE(s.receiver.apply_prepared() == std::optional<std::uint64_t>{3});
  for (std::size_t k = 0; k < v.bytes.size(); ++k) CHECK(w.bytes[k] == v.bytes[k]);
  CHECK_FALSE(s.receiver.dirty());
}

TEST_CASE(
    "a staged delta writes every destination of a tied tensor at the apply, spans sent as bytes and patches alike, "
    "and nothing before it",
    "[stage][delta]") {
  serving s(staged());
  weights w(s.receiver, stage_model(), 0);
  // "head" has a second destination (tied weights): both must take every version.
  std::vector<std::uint8_t> tied(stage_model()[4].nbytes());
  s.receiver.add_parameter(refit::tensor_dest{stage_model()[4], tied.data(), refit::device::cpu()});
  s.start();
  rt::host_tensors v(stage_model(), 1);
  refit::streamer st = delta_streamer_at_version_1(s, v);
  CHECK(tied == v.bytes[4]);
  for (int version = 2; version <= 4; ++version) {
    // A sparse change in "embed" (a patch), every byte of "layer.0.b" changed (its span goes as bytes,
    // smaller than its patch), and a few bytes of the tied "head".
    v.bytes[0][static_cast<std::size_t>(version) * 31] ^= 0x21;
    for (auto& b : v.bytes[2]) b = static_cast<std::uint8_t>(b + 1);
    v.bytes[4][static_cast<std::size_t>(version) * 101] ^= 0x80;
    v.bytes[4][v.bytes[4].size() - 1] ^= 0x04;
    const std::vector<std::uint8_t> head_before = w.bytes[4], bias_before = w.bytes[2];
    const auto stats = st.refit(static_cast<std::uint64_t>(version), v.refs);
    CHECK(stats.delta);
    REQUIRE(s.log.wait_for("prepared " + std::to_string(version)));
    CHECK(w.bytes[4] == head_before);  // nothing reaches the weights before the apply
    CHECK(tied == head_before);
    CHECK(w.bytes[2] == bias_before);
    REQUIRE(s.receiver.apply_prepared() == std::optional<std::uint64_t>{static_cast<std::uint64_t>(version)});
    for (std::size_t k = 0; k < v.bytes.size(); ++k) CHECK(w.bytes[k] == v.bytes[k]);
    CHECK(tied == v.bytes[4]);
  }
  CHECK_FALSE(s.receiver.dirty());
}

TEST_CASE("a staged delta that fails its checksum leaves the weights on the base, clean, and the next version whole",
          "[stage][delta]") {
  serving s(staged());
  weights w(s.receiver, stage_model(), 0);
  s.start();
  rt::host_tensors v(stage_model(), 1);
  refit::streamer st = delta_streamer_at_version_1(s, v);
  s.finish();
  // The engine's weights are no longer the base the streamer diffs against, in the element the delta
  // patches (bytes 8..11 of tensor 0: the delta changes byte 9): the checksum sees the old value.
  w.bytes[0][8] ^= 0x40;
  s.start();
  v.bytes[0][9] ^= 0x33;
  CHECK_REFIT_ERROR(st.refit(2, v.refs), refit::errc::apply, "delta version 2 does not check out");
  REQUIRE(s.log.wait_for("abort 2"));
  CHECK_FALSE(s.receiver.prepared_version());
  CHECK_FALSE(s.receiver.dirty());
  CHECK(s.receiver.committed_version() == std::optional<std::uint64_t>{1});
  CHECK(w.bytes[0][9] != v.bytes[0][9]);   // nothing of version 2 reached the weights
  const auto stats = st.refit(3, v.refs);  // after a failure: whole
  CHECK_FALSE(stats.delta);
  REQUIRE(s.log.wait_for("prepared 3"));
  REQUIRE(s.receiver.apply_prepared() == std::optional<std::uint64_t>{3});
  for (std::size_t k = 0; k < v.bytes.size(); ++k) CHECK(w.bytes[k] == v.bytes[k]);
}

TEST_CASE("apply_prepared after the parameter table changed drops the version with errc::apply and runs on_abort",
          "[stage]") {
  serving s(staged());
  weights w(s.receiver, stage_model(), 0);
  s.start();
  refit::streamer st(small_buffers(s.receiver.endpoint()));
  st.refit(1, rt::host_tensors(stage_model(), 1).refs);
  REQUIRE(s.log.wait_for("prepared 1"));
  s.finish();  // registration runs on the serving thread's turn
  std::vector<float> extra(4);
  s.receiver.add_parameter(
      refit::tensor_dest{tensor_meta{"extra", dtype::f32, {4}}, extra.data(), refit::device::cpu()});
  CHECK_REFIT_ERROR(s.receiver.apply_prepared(), refit::errc::apply, "the parameter table changed");
  CHECK(w.mismatch(0).empty());
  CHECK_FALSE(s.receiver.prepared_version());
  CHECK_FALSE(s.receiver.committed_version());
  CHECK(s.log.take() == std::vector<std::string>{"event hello", "prepared 1", "event prepared", "abort 1"});
}

TEST_CASE("a device stage takes CUDA sessions only: a host_shm version is refused at BEGIN, nothing written",
          "[stage]") {
  refit::receiver_options o = staged();
  o.stage = refit::stage_kind::device;
  if (!refit::has_transport(refit::transport_kind::cuda_ipc)) {
    CHECK_REFIT_ERROR(refit::receiver(o), refit::errc::invalid_argument, "needs CUDA");
    return;
  }
  serving s(o);
  weights w(s.receiver, stage_model(), 0);
  s.start();
  refit::streamer st(small_buffers(s.receiver.endpoint()));
  CHECK_REFIT_ERROR(st.refit(1, rt::host_tensors(stage_model(), 1).refs), refit::errc::invalid_argument,
                    "receiver_options::stage = device takes sessions that bring their bytes through buffers "
                    "(cuda_ipc, nccl), not this host_shm session");
  CHECK(w.mismatch(0).empty());
  CHECK_FALSE(s.receiver.prepared_version());
}

TEST_CASE("a staged receiver refuses a callback sink with errc::invalid_argument", "[stage]") {
  refit::receiver r(staged());
  CHECK_REFIT_ERROR(r.on_batch([](auto, void*) {}), refit::errc::invalid_argument, "stage = host");
}

TEST_CASE("an engine thread reading its weights while staged versions arrive sees only whole committed versions",
          "[stage]") {
  // Large enough that every version takes many batches, so the engine reads during transfers.
  const std::vector<tensor_meta> model{tensor_meta{"a", dtype::f32, {256, 64}},
                                       tensor_meta{"b", dtype::bf16, {512, 48}}, tensor_meta{"c", dtype::f32, {3000}}};
  constexpr std::uint64_t versions = 6;
  serving s(staged());
  weights w(s.receiver, model, 0);
  // The checksum of every version the engine may see: only whole ones.
  std::vector<std::uint64_t> expected;
  for (std::uint64_t v = 0; v <= versions; ++v) expected.push_back(checksum_of(rt::host_tensors(model, v).bytes));
  std::atomic<bool> done{false};
  std::atomic<std::uint64_t> reads{0};
  std::atomic<std::uint64_t> wrong{0};
  std::set<std::uint64_t> seen;  // engine thread only, read after join
  std::thread engine([&] {
    std::uint64_t applied = 0;
    for (;;) {
      // One generation step: read every weight.
      const std::uint64_t sum = checksum_of(w.bytes);
      const auto it = std::find(expected.begin(), expected.end(), sum);
      if (it == expected.end() || static_cast<std::uint64_t>(it - expected.begin()) != applied)
        wrong.fetch_add(1);
      else
        seen.insert(applied);
      reads.fetch_add(1);
      if (done.load() && !s.receiver.prepared_version()) break;
      // Between two steps: take the version that waits, if any.
      if (const auto v = s.receiver.apply_prepared()) applied = *v;
    }
  });
  s.start();
  refit::streamer st(small_buffers(s.receiver.endpoint()));
  for (std::uint64_t v = 1; v <= versions; ++v) {
    const rt::host_tensors next(model, v);
    st.refit(v, next.refs);
    // The next BEGIN would be refused while this one waits: the trainer waits for the engine.
    REQUIRE(s.log.wait_for("commit " + std::to_string(v)));
  }
  done = true;
  engine.join();
  s.finish();
  CHECK(wrong.load() == 0);
  CHECK(reads.load() > versions);
  CHECK(seen.size() == versions + 1);
  CHECK(w.mismatch(versions).empty());
  CHECK(s.receiver.committed_version() == std::optional<std::uint64_t>{versions});
}

TEST_CASE("a staged receiver of two streamers prepares the group's version at the last END and applies it whole",
          "[stage]") {
  auto o = staged();
  o.streamers = 2;
  serving s(o);
  weights w(s.receiver, stage_model(), 0);
  s.start();
  const auto endpoints = s.receiver.endpoints();
  refit::streamer s0([&] {
    auto so = small_buffers(endpoints[0]);
    so.group_rank = 0;
    so.group_size = 2;
    return so;
  }());
  refit::streamer s1([&] {
    auto so = small_buffers(endpoints[1]);
    so.group_rank = 1;
    so.group_size = 2;
    return so;
  }());
  // Rank 0 holds the first three tensors, rank 1 the others.
  const rt::host_tensors v1(stage_model(), 1);
  const std::vector<refit::tensor_ref> part0(v1.refs.begin(), v1.refs.begin() + 3);
  const std::vector<refit::tensor_ref> part1(v1.refs.begin() + 3, v1.refs.end());
  std::optional<rt::failure> f1;
  std::thread rank1([&] { f1 = rt::failure_of([&] { s1.refit(1, part1); }); });
  const auto f0 = rt::failure_of([&] { s0.refit(1, part0); });
  rank1.join();
  CHECK_FALSE(f0);
  CHECK_FALSE(f1);
  REQUIRE(s.log.wait_for("prepared 1"));
  CHECK(w.mismatch(0).empty());
  REQUIRE(s.receiver.apply_prepared() == std::optional<std::uint64_t>{1});
  CHECK(w.mismatch(1).empty());
  CHECK(s.receiver.last_stats().tensors == stage_model().size());
}
