// Sharded trainers: a group of streamers, one per trainer rank, each holding the
// Shard(0) rows of every tensor, sends one version to the same receivers, which commit it only
// when the shards of every rank cover every tensor exactly once.
//
// The receivers serve on a thread of the test, the streamers run on threads of their own (one
// per rank and receiver: host_shm serves one receiver per streamer); the streamer that dies
// mid-version is a forked child killed with SIGKILL.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "support/support.hpp"

using namespace std::chrono_literals;
namespace rt = refit::test;
using refit::dtype;
using refit::errc;
using refit::tensor_meta;

namespace {

constexpr refit::milliseconds streamer_timeout{10000};

/// Tensors of uneven row counts: rows that do not divide by the group, a tensor with fewer rows
/// than ranks (some ranks hold an empty shard), one without elements, a 1-d one, one larger than
/// a buffer (sent in chunks).
std::vector<tensor_meta> group_model() {
  return {
      {"embed", dtype::bf16, {37, 24}}, {"q", dtype::f32, {16, 16}},   {"norm", dtype::f32, {40}},
      {"tiny", dtype::bf16, {3, 8}},    {"empty", dtype::f16, {0, 8}}, {"big", dtype::bf16, {300, 128}},
  };
}

/// A receiver serving on a thread until destroyed.
struct serving {
  refit::receiver receiver;
  std::atomic<bool> stop{false};
  std::thread thread;

  explicit serving(refit::receiver_options o) : receiver(std::move(o)) {}
  void start() {
    thread = std::thread([this] { receiver.serve([this] { return stop.load(); }, refit::milliseconds{10}); });
  }
  ~serving() {
    stop = true;
    if (thread.joinable()) thread.join();
  }
};

refit::receiver_options group_receiver(std::size_t streamers, refit::milliseconds idle = refit::milliseconds{60000}) {
  refit::receiver_options o;
  o.streamers = streamers;
  o.idle_timeout = idle;
  return o;
}

refit::streamer_options rank_options(const std::string& endpoint, std::size_t r, std::size_t n,
                                     std::uint64_t buffer_bytes = 16u << 10) {
  auto o = rt::host_shm_streamer(endpoint, buffer_bytes, streamer_timeout);
  o.group_rank = r;
  o.group_size = n;
  return o;
}

/// Host destinations for every tensor of `metas`, registered whole.
struct table {
  std::vector<tensor_meta> metas;
  std::vector<std::vector<std::uint8_t>> bytes;

  table(refit::receiver& r, std::vector<tensor_meta> m) : metas(std::move(m)) {
    for (const auto& t : metas) bytes.emplace_back(t.nbytes(), 0xEE);
    for (std::size_t k = 0; k < metas.size(); ++k)
      r.add_parameter(refit::tensor_dest{metas[k], bytes[k].data(), refit::device::cpu()});
  }
  /// Empty when every tensor holds `version`'s pattern, else the first that does not.
  [[nodiscard]] std::string mismatch(std::uint64_t version) const {
    for (std::size_t k = 0; k < metas.size(); ++k)
      if (const auto m = rt::pattern_mismatch(metas[k], version, bytes[k].data()); !m.empty()) return m;
    return {};
  }
};

/// Runs `body(r)` for every rank r on a thread of its own; returns what each one threw.
std::vector<std::optional<rt::failure>> each_rank(std::size_t n, const std::function<void(std::size_t)>& body) {
  std::vector<std::optional<rt::failure>> failed(n);
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        failed[r] = rt::failure_of([&] { body(r); });
      } catch (const std::exception& e) {
        failed[r] = rt::failure{"std::exception", e.what()};
      }
    });
  for (auto& t : threads) t.join();
  return failed;
}

std::string failures_text(const std::vector<std::optional<rt::failure>>& f) {
  std::string out;
  for (std::size_t r = 0; r < f.size(); ++r)
    out += "rank " + std::to_string(r) + ": " + (f[r] ? f[r]->code + ": " + f[r]->message : "ok") + "\n";
  return out;
}

}  // namespace

TEST_CASE("two and four streamers holding Shard(0) rows commit versions bit-exact into one receiver", "[group]") {
  for (const std::size_t n : {std::size_t{2}, std::size_t{4}}) {
    DYNAMIC_SECTION(n << " streamers") {
      serving s(group_receiver(n));
      table dest(s.receiver, group_model());
      const auto endpoints = s.receiver.endpoints();
      REQUIRE(endpoints.size() == n);
      CHECK(endpoints.front() == s.receiver.endpoint());
      s.start();
      std::vector<std::unique_ptr<refit::streamer>> streamers;
      for (std::size_t r = 0; r < n; ++r)
        streamers.push_back(std::make_unique<refit::streamer>(rank_options(endpoints[r], r, n)));
      for (const std::uint64_t version : {1u, 2u, 5u}) {
        const rt::host_tensors whole(group_model(), version);
        std::vector<refit::refit_stats> stats(n);
        const auto failed = each_rank(n, [&](std::size_t r) {
          const auto shards = rt::rank_shards(whole, r, n);
          stats[r] = streamers[r]->refit(version, shards);
        });
        INFO(failures_text(failed));
        for (const auto& f : failed) CHECK_FALSE(f);
        // Every rank's refit() returned after the version committed.
        CHECK(s.receiver.committed_version() == version);
        CHECK_FALSE(s.receiver.dirty());
        CHECK(dest.mismatch(version).empty());
        std::uint64_t bytes = 0;
        for (const auto& st : stats) bytes += st.bytes;
        CHECK(bytes == [&] {
          std::uint64_t b = 0;
          for (const auto& t : group_model()) b += t.nbytes();
          return b;
        }());
        CHECK(s.receiver.last_stats().bytes == bytes);
        CHECK(s.receiver.last_stats().tensors == n * group_model().size());
      }
    }
  }
}

TEST_CASE("a group of two streamers fills a TP=2 pair of receivers that each take a slice", "[group]") {
  // Each receiver holds half of "col" (rows: column-parallel) and half of "row"'s columns
  // (row-parallel: a strided view), and all of "norm".
  const tensor_meta col{"col", dtype::bf16, {12, 16}};
  const tensor_meta row{"row", dtype::f32, {10, 8}};
  const tensor_meta norm{"norm", dtype::f32, {9}};
  constexpr std::size_t n = 2;
  std::vector<std::unique_ptr<serving>> receivers;
  std::vector<std::vector<std::vector<std::uint8_t>>> held(2);
  for (std::size_t j = 0; j < 2; ++j) {
    receivers.push_back(std::make_unique<serving>(group_receiver(n)));
    auto& r = receivers.back()->receiver;
    auto& h = held[j];
    h.emplace_back(6 * 16 * 2, 0xEE);
    h.emplace_back(10 * 4 * 4, 0xEE);
    h.emplace_back(9 * 4, 0xEE);
    refit::dest_layout c;
    c.slice = refit::source_slice{0, static_cast<std::int64_t>(6 * j), 6};
    r.add_parameter(refit::tensor_dest{{"col", dtype::bf16, {6, 16}}, h[0].data(), refit::device::cpu()}, c);
    refit::dest_layout w;
    w.slice = refit::source_slice{1, static_cast<std::int64_t>(4 * j), 4};
    r.add_parameter(refit::tensor_dest{{"row", dtype::f32, {10, 4}}, h[1].data(), refit::device::cpu()}, w);
    r.add_parameter(refit::tensor_dest{norm, h[2].data(), refit::device::cpu()});
    receivers.back()->start();
  }
  std::vector<std::vector<std::unique_ptr<refit::streamer>>> streamers(n);
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t j = 0; j < 2; ++j)
      streamers[r].push_back(
          std::make_unique<refit::streamer>(rank_options(receivers[j]->receiver.endpoints()[r], r, n)));
  for (const std::uint64_t version : {3u, 4u}) {
    const rt::host_tensors whole({col, row, norm}, version);
    const auto failed = each_rank(n * 2, [&](std::size_t k) {
      const std::size_t r = k / 2;
      const std::size_t j = k % 2;
      const auto shards = rt::rank_shards(whole, r, n);
      streamers[r][j]->refit(version, shards);
    });
    INFO(failures_text(failed));
    for (const auto& f : failed) CHECK_FALSE(f);
    for (std::size_t j = 0; j < 2; ++j) {
      CHECK(receivers[j]->receiver.committed_version() == version);
      // Bit-exact: the rows, the columns and the whole tensor each receiver takes.
      CHECK(std::memcmp(held[j][0].data(), whole.bytes[0].data() + j * 6 * 16 * 2, 6 * 16 * 2) == 0);
      for (std::size_t i = 0; i < 10; ++i)
        CHECK(std::memcmp(held[j][1].data() + i * 16, whole.bytes[1].data() + i * 32 + j * 16, 16) == 0);
      CHECK(std::memcmp(held[j][2].data(), whole.bytes[2].data(), 9 * 4) == 0);
    }
  }
}

TEST_CASE("shards covering rows twice or leaving rows out fail the version on every streamer", "[group]") {
  constexpr std::size_t n = 2;
  const tensor_meta w{"layers.0.w", dtype::f32, {8, 4}};
  const tensor_meta b{"layers.0.b", dtype::f32, {8}};
  serving s(group_receiver(n));
  table dest(s.receiver, {w, b});
  s.start();
  const auto endpoints = s.receiver.endpoints();
  refit::streamer s0(rank_options(endpoints[0], 0, n));
  refit::streamer s1(rank_options(endpoints[1], 1, n));
  const auto run = [&](std::uint64_t version, std::pair<int, int> w0, std::pair<int, int> w1) {
    const rt::host_tensors whole({w, b}, version);
    return each_rank(n, [&](std::size_t r) {
      const auto [start, count] = r == 0 ? w0 : w1;
      std::vector<refit::tensor_ref> refs{rt::shard_of(w, whole.bytes[0], start, count),
                                          rt::shard_of(b, whole.bytes[1], r == 0 ? 0 : 4, 4)};
      (r == 0 ? s0 : s1).refit(version, refs);
    });
  };
  SECTION("rows [3, 4) sent by rank 0 and by rank 1") {
    const auto failed = run(2, {0, 4}, {3, 5});
    INFO(failures_text(failed));
    for (const auto& f : failed) {
      REQUIRE(f);
      CHECK(f->code == "invalid_argument");
      CHECK_THAT(f->message, Catch::Contains("version 2: tensor 'layers.0.w': rows [3, 4) were sent by rank 0 and by "
                                             "rank 1 (their shards overlap); nothing was committed"));
    }
  }
  SECTION("rows [4, 5) sent by no rank") {
    const auto failed = run(2, {0, 4}, {5, 3});
    INFO(failures_text(failed));
    for (const auto& f : failed) {
      REQUIRE(f);
      CHECK(f->code == "incomplete");
      CHECK_THAT(f->message, Catch::Contains("version 2: tensor 'layers.0.w': rows [4, 5) were sent by no rank (the "
                                             "shards of ranks 0, 1 leave them out)"));
    }
  }
  SECTION("the last rows sent by no rank") {
    const auto failed = run(2, {0, 4}, {4, 3});
    INFO(failures_text(failed));
    for (const auto& f : failed) {
      REQUIRE(f);
      CHECK(f->code == "incomplete");
      CHECK_THAT(f->message, Catch::Contains("tensor 'layers.0.w': rows [7, 8) were sent by no rank"));
    }
  }
  CHECK_FALSE(s.receiver.committed_version());
  CHECK(s.receiver.dirty());  // the shards that arrived were written
  // The next version, sharded right, commits.
  const auto failed = run(3, {0, 4}, {4, 4});
  INFO(failures_text(failed));
  for (const auto& f : failed) CHECK_FALSE(f);
  CHECK(s.receiver.committed_version() == 3);
  CHECK_FALSE(s.receiver.dirty());
  CHECK(dest.mismatch(3).empty());
}

TEST_CASE("a tensor no rank sends fails a whole version of a group", "[group]") {
  constexpr std::size_t n = 2;
  const tensor_meta w{"w", dtype::f32, {4, 4}};
  const tensor_meta v{"v", dtype::f32, {4}};
  serving s(group_receiver(n));
  table dest(s.receiver, {w, v});
  s.start();
  const auto endpoints = s.receiver.endpoints();
  refit::streamer s0(rank_options(endpoints[0], 0, n));
  refit::streamer s1(rank_options(endpoints[1], 1, n));
  const rt::host_tensors whole({w, v}, 1);
  const auto failed = each_rank(n, [&](std::size_t r) {
    std::vector<refit::tensor_ref> refs{rt::shard_of(w, whole.bytes[0], r == 0 ? 0 : 2, 2)};
    (r == 0 ? s0 : s1).refit(1, refs);
  });
  for (const auto& f : failed) {
    REQUIRE(f);
    CHECK(f->code == "incomplete");
    CHECK_THAT(f->message, Catch::Contains("version 1 is missing 1 of the 2 registered tensors (first: 'v', sent by no "
                                           "rank); nothing was committed"));
  }
  CHECK_FALSE(s.receiver.committed_version());
}

TEST_CASE("ranks that disagree on a tensor's dtype fail the version naming both", "[group]") {
  constexpr std::size_t n = 2;
  serving s(group_receiver(n));
  s.receiver.on_batch([](std::span<const refit::tensor_view>, void*) {});
  s.start();
  const auto endpoints = s.receiver.endpoints();
  refit::streamer s0(rank_options(endpoints[0], 0, n));
  refit::streamer s1(rank_options(endpoints[1], 1, n));
  std::vector<std::uint8_t> src(64, 1);
  const auto failed = each_rank(n, [&](std::size_t r) {
    const tensor_meta m{"w", r == 0 ? dtype::f32 : dtype::i32, {4, 4}};
    std::vector<refit::tensor_ref> refs{rt::shard_of(m, src, r == 0 ? 0 : 2, 2)};
    (r == 0 ? s0 : s1).refit(1, refs);
  });
  for (const auto& f : failed) {
    REQUIRE(f);
    CHECK(f->code == "invalid_argument");
    CHECK_THAT(
        f->message,
        Catch::Contains("tensor 'w' is w f32[4, 4] from rank 0 but w i32[4, 4] from rank 1; nothing was committed"));
  }
}

TEST_CASE("a streamer that connects to another rank's endpoint, or alone to a group, is refused", "[group]") {
  serving s(group_receiver(2));
  table dest(s.receiver, {{"w", dtype::f32, {4}}});
  s.start();
  const rt::host_tensors whole({{"w", dtype::f32, {4}}}, 1);
  SECTION("rank 1 at rank 0's endpoint") {
    refit::streamer st(rank_options(s.receiver.endpoints()[0], 1, 2));
    const auto f = rt::failure_of([&] { st.refit(1, whole.refs); });
    REQUIRE(f);
    CHECK(f->code == "invalid_argument");
    CHECK_THAT(f->message, Catch::Contains("this endpoint takes rank 0 of a group of 2 streamers "
                                           "(receiver_options::streamers), but the streamer says it is rank 1 of 2"));
  }
  SECTION("a streamer alone") {
    refit::streamer st(rank_options(s.receiver.endpoints()[1], 0, 1));
    const auto f = rt::failure_of([&] { st.refit(1, whole.refs); });
    REQUIRE(f);
    CHECK(f->code == "invalid_argument");
    CHECK_THAT(f->message, Catch::Contains("this endpoint takes rank 1 of a group of 2 streamers"));
  }
  SECTION("a group at a receiver of one streamer") {
    serving one(group_receiver(1));
    table d1(one.receiver, {{"w", dtype::f32, {4}}});
    one.start();
    refit::streamer st(rank_options(one.receiver.endpoint(), 1, 2));
    const auto f = rt::failure_of([&] { st.refit(1, whole.refs); });
    REQUIRE(f);
    CHECK(f->code == "invalid_argument");
    CHECK_THAT(f->message, Catch::Contains("this receiver takes one streamer, but the streamer says it is rank 1 of a "
                                           "group of 2 (streamer_options::group_size)"));
  }
  CHECK_FALSE(s.receiver.committed_version());
}

TEST_CASE("streamers of one group that send different versions never mix them", "[group]") {
  constexpr std::size_t n = 2;
  serving s(group_receiver(n, refit::milliseconds{400}));
  table dest(s.receiver, {{"w", dtype::f32, {4, 2}}});
  s.start();
  const auto endpoints = s.receiver.endpoints();
  refit::streamer s0(rank_options(endpoints[0], 0, n));
  refit::streamer s1(rank_options(endpoints[1], 1, n));
  const rt::host_tensors v2({{"w", dtype::f32, {4, 2}}}, 2);
  const rt::host_tensors v3({{"w", dtype::f32, {4, 2}}}, 3);
  const auto failed = each_rank(n, [&](std::size_t r) {
    const auto shards = rt::rank_shards(r == 0 ? v2 : v3, r, n);
    (r == 0 ? s0 : s1).refit(r == 0 ? 2 : 3, shards);
  });
  INFO(failures_text(failed));
  // Whichever BEGIN came first started its version; the other rank was refused, and the version
  // in progress then failed for want of its part.
  REQUIRE(failed[0]);
  REQUIRE(failed[1]);
  const bool first0 = failed[1]->code == "protocol";
  const auto& refused = *failed[first0 ? 1 : 0];
  const auto& waited = *failed[first0 ? 0 : 1];
  CHECK(refused.code == "protocol");
  CHECK_THAT(refused.message, Catch::Contains("every streamer of a group sends the same versions"));
  CHECK(waited.code == "timeout");
  CHECK_THAT(waited.message, Catch::Contains("did not begin version"));
  CHECK_FALSE(s.receiver.committed_version());
  // The next version, sent by both, commits.
  const rt::host_tensors v4({{"w", dtype::f32, {4, 2}}}, 4);
  const auto again = each_rank(n, [&](std::size_t r) {
    const auto shards = rt::rank_shards(v4, r, n);
    (r == 0 ? s0 : s1).refit(4, shards);
  });
  INFO(failures_text(again));
  for (const auto& f : again) CHECK_FALSE(f);
  CHECK(s.receiver.committed_version() == 4);
  CHECK(dest.mismatch(4).empty());
}

TEST_CASE("a streamer that fails its part tells the whole group, and the next version commits", "[group]") {
  constexpr std::size_t n = 2;
  serving s(group_receiver(n));
  table dest(s.receiver, group_model());
  s.start();
  const auto endpoints = s.receiver.endpoints();
  refit::streamer s0(rank_options(endpoints[0], 0, n));
  refit::streamer s1(rank_options(endpoints[1], 1, n));
  const rt::host_tensors whole(group_model(), 7);
  const auto failed = each_rank(n, [&](std::size_t r) {
    const auto shards = rt::rank_shards(whole, r, n);
    if (r == 0) {
      s0.refit(7, shards);
      return;
    }
    std::size_t k = 0;
    s1.refit(7, [&]() -> std::optional<refit::tensor_ref> {
      if (k == 2)
        throw refit::error(errc::invalid_argument, "all-gather of q failed: rank 1's optimizer state is gone");
      return shards[k++];
    });
  });
  INFO(failures_text(failed));
  REQUIRE(failed[1]);
  CHECK(failed[1]->code == "invalid_argument");  // its own error, unchanged
  REQUIRE(failed[0]);
  // Rank 0 hears it in the reply to its END, or to its BEGIN when rank 1 gave up first.
  CHECK(failed[0]->code == "incomplete");
  CHECK_THAT(failed[0]->message, Catch::Contains("the streamer rank 1"));
  CHECK_THAT(failed[0]->message, Catch::Contains("aborted version 7"));
  CHECK_FALSE(s.receiver.committed_version());
  const rt::host_tensors next(group_model(), 8);
  const auto again = each_rank(n, [&](std::size_t r) {
    const auto shards = rt::rank_shards(next, r, n);
    (r == 0 ? s0 : s1).refit(8, shards);
  });
  INFO(failures_text(again));
  for (const auto& f : again) CHECK_FALSE(f);
  CHECK(s.receiver.committed_version() == 8);
  CHECK(dest.mismatch(8).empty());
}

TEST_CASE("a streamer killed mid-version fails it on the receiver, naming its rank, and the next version commits",
          "[group]") {
  constexpr std::size_t n = 2;
  const rt::scoped_endpoint base;
  // Endpoints known before the child forks: it must not share the parent's sockets.
  const std::string pattern = base.name + "-{rank}";
  const auto endpoint_of = [&](std::size_t r) { return base.name + "-" + std::to_string(r); };
  rt::signal_pipe to_parent;
  const rt::host_tensors whole(group_model(), 9);
  rt::child killed([&] {
    refit::streamer st(rank_options(endpoint_of(1), 1, n));
    const auto shards = rt::rank_shards(whole, 1, n);
    std::size_t k = 0;
    st.refit(9, [&]() -> std::optional<refit::tensor_ref> {
      if (k == 3) {
        to_parent.send("stuck");
        for (;;) ::pause();  // until killed
      }
      return shards[k++];
    });
  });
  auto o = group_receiver(n, refit::milliseconds{500});
  o.endpoint = pattern;
  serving s(o);
  table dest(s.receiver, group_model());
  CHECK(s.receiver.endpoints() == std::vector<std::string>{endpoint_of(0), endpoint_of(1)});
  s.start();
  refit::streamer s0(rank_options(endpoint_of(0), 0, n));
  std::optional<rt::failure> f0;
  std::thread rank0([&] { f0 = rt::failure_of([&] { s0.refit(9, rt::rank_shards(whole, 0, n)); }); });
  CHECK(to_parent.receive(20s) == "stuck");
  killed.kill();
  rank0.join();
  REQUIRE(f0);
  // Gone with its control lane (peer), or silent past the idle timeout first on a slow machine.
  CHECK((f0->code == "peer" || f0->code == "timeout"));
  // Silent after its BEGIN (or, had rank 0 begun first and the child been slow, never begun).
  CHECK_THAT(f0->message, Catch::Contains("the streamer rank 1"));
  CHECK_THAT(f0->message, Catch::Contains("500 ms") && Catch::Contains("version 9"));
  CHECK_FALSE(s.receiver.committed_version());
  // Dirty when rank 0's batches landed before rank 1's death was noticed (through its control lane,
  // at once): on a slow machine (a sanitizer build) the version may fail first, its weights clean.
  CHECK_THAT(s.receiver.last_error(), Catch::Contains("rank 1"));
  // Rank 1 restarts; version 10 commits.
  refit::streamer s1(rank_options(endpoint_of(1), 1, n));
  const rt::host_tensors next(group_model(), 10);
  const auto again = each_rank(n, [&](std::size_t r) {
    const auto shards = rt::rank_shards(next, r, n);
    (r == 0 ? s0 : s1).refit(10, shards);
  });
  INFO(failures_text(again));
  for (const auto& f : again) CHECK_FALSE(f);
  CHECK(s.receiver.committed_version() == 10);
  CHECK_FALSE(s.receiver.dirty());
  CHECK(dest.mismatch(10).empty());
}

TEST_CASE("bad group options and shards are refused with what to do", "[group]") {
  SECTION("receiver options") {
    auto o = group_receiver(0);
    auto f = rt::failure_of([&] { refit::receiver r(o); });
    REQUIRE(f);
    CHECK(f->code == "invalid_argument");
    CHECK_THAT(f->message, Catch::Contains("receiver_options.streamers is 0; it must be in [1, 4096]"));
    o = group_receiver(2);
    o.endpoint = rt::temp_endpoint();
    f = rt::failure_of([&] { refit::receiver r(o); });
    REQUIRE(f);
    CHECK(f->code == "invalid_argument");
    CHECK_THAT(f->message, Catch::Contains("binds one endpoint per streamer"));
  }
  SECTION("streamer options") {
    auto o = rank_options(rt::temp_endpoint(), 2, 2);
    auto f = rt::failure_of([&] { refit::streamer s(o); });
    REQUIRE(f);
    CHECK(f->code == "invalid_argument");
    CHECK_THAT(f->message, Catch::Contains("group_rank 2 of group_size 2"));
    o = rank_options(rt::temp_endpoint(), 0, 2);
    o.delta.enable = true;
    f = rt::failure_of([&] { refit::streamer s(o); });
    REQUIRE(f);
    CHECK(f->code == "invalid_argument");
    CHECK_THAT(f->message, Catch::Contains("streamer_options.delta with group_size > 1"));
  }
  SECTION("shards") {
    serving s(group_receiver(1));
    s.receiver.on_batch([](std::span<const refit::tensor_view>, void*) {});
    s.start();
    refit::streamer alone(rank_options(s.receiver.endpoint(), 0, 1));
    std::vector<std::uint8_t> src(256, 3);
    const tensor_meta w{"w", dtype::f32, {4, 4}};
    const auto refused = [&](refit::tensor_ref ref, const std::string& what) {
      const auto f = rt::failure_of([&] { alone.refit(1, std::vector<refit::tensor_ref>{ref}); });
      REQUIRE(f);
      CHECK(f->code == "invalid_argument");
      CHECK_THAT(f->message, Catch::Contains(what));
    };
    refused(rt::shard_of(w, src, 0, 2),
            "this streamer is alone (streamer_options::group_size 1), so nobody sends the rest");
    refit::tensor_ref past = rt::shard_of(w, src, 0, 2);
    past.shard->start = 3;
    refused(past, "[3, 5) is not inside the whole's 4 along dimension 0");
    refit::tensor_ref cols{{"w", dtype::f32, {4, 2}}, src.data(), refit::device::cpu(), nullptr};
    cols.shard = refit::tensor_shard{{4, 4}, 1, 2};
    refused(cols, "is not one contiguous range of it; shard along dimension 0");
    refit::tensor_ref rank{{"w", dtype::f32, {4, 4}}, src.data(), refit::device::cpu(), nullptr};
    rank.shard = refit::tensor_shard{{4, 4, 1}, 0, 0};
    refused(rank, "the shard and the whole must have the same number of dimensions");
    refit::tensor_ref other{{"w", dtype::f32, {2, 3}}, src.data(), refit::device::cpu(), nullptr};
    other.shard = refit::tensor_shard{{4, 4}, 0, 0};
    refused(other, "the shard's size along dimension 1 must be the whole's");
    // A whole tensor declared as its own only shard goes as it is.
    refit::tensor_ref all{w, src.data(), refit::device::cpu(), nullptr};
    all.shard = refit::tensor_shard{{4, 4}, 0, 0};
    CHECK_NOTHROW(alone.refit(2, std::vector<refit::tensor_ref>{all}));
    CHECK(s.receiver.committed_version() == 2);
  }
}

TEST_CASE("a rank that begins a version the group already failed hears why, and the group does not restart it",
          "[group]") {
  constexpr std::size_t n = 2;
  serving s(group_receiver(n));
  table dest(s.receiver, group_model());
  s.start();
  const auto endpoints = s.receiver.endpoints();
  refit::streamer s0(rank_options(endpoints[0], 0, n));
  refit::streamer s1(rank_options(endpoints[1], 1, n));
  const rt::host_tensors whole(group_model(), 7);
  // Rank 1 alone begins version 7 and gives it up; only then does rank 0 begin it.
  const auto shards1 = rt::rank_shards(whole, 1, n);
  std::size_t k = 0;
  const auto f1 = rt::failure_of([&] {
    s1.refit(7, [&]() -> std::optional<refit::tensor_ref> {
      if (k == 1) throw refit::error(errc::invalid_argument, "rank 1 ran out of memory gathering q");
      return shards1[k++];
    });
  });
  REQUIRE(f1);
  CHECK(f1->code == "invalid_argument");
  const auto f0 = rt::failure_of([&] { s0.refit(7, rt::rank_shards(whole, 0, n)); });
  REQUIRE(f0);
  CHECK(f0->code == "incomplete");
  CHECK_THAT(f0->message, Catch::Contains("version 7 failed before rank 0"));
  CHECK_THAT(f0->message, Catch::Contains("the streamer rank 1") && Catch::Contains("aborted version 7"));
  CHECK_THAT(f0->message, Catch::Contains("rank 1 ran out of memory gathering q"));
  CHECK_FALSE(s.receiver.committed_version());
  // Both retry version 7: it commits.
  const auto again = each_rank(n, [&](std::size_t r) {
    const auto shards = rt::rank_shards(whole, r, n);
    (r == 0 ? s0 : s1).refit(7, shards);
  });
  INFO(failures_text(again));
  for (const auto& f : again) CHECK_FALSE(f);
  CHECK(s.receiver.committed_version() == 7);
  CHECK(dest.mismatch(7).empty());
}

TEST_CASE("a rank whose END waits for a rank that never comes hears so within its own reply timeout", "[group]") {
  constexpr std::size_t n = 2;
  serving s(group_receiver(n));  // an idle timeout of a minute: the streamer's own timeout bounds the wait
  table dest(s.receiver, {{"w", dtype::f32, {4, 2}}});
  s.start();
  auto o = rank_options(s.receiver.endpoints()[0], 0, n);
  o.timeout = refit::milliseconds{800};
  refit::streamer s0(o);
  const rt::host_tensors whole({{"w", dtype::f32, {4, 2}}}, 1);
  const auto f = rt::failure_of([&] { s0.refit(1, rt::rank_shards(whole, 0, n)); });
  REQUIRE(f);
  // The receiver's reply (at 600 ms), not the streamer's own timeout: the version is known not to commit.
  CHECK(f->code == "timeout");
  CHECK_THAT(f->message, Catch::Contains("version 1 did not end within three quarters of the reply timeout of rank 0"));
  CHECK_THAT(f->message, Catch::Contains("(800 ms): rank 1 had not sent its END"));
  CHECK_FALSE(s.receiver.committed_version());
  // Rank 1 turns up late with version 1: it is told, and nothing commits from half a version.
  refit::streamer s1(rank_options(s.receiver.endpoints()[1], 1, n));
  const auto late = rt::failure_of([&] { s1.refit(1, rt::rank_shards(whole, 1, n)); });
  REQUIRE(late);
  CHECK(late->code == "timeout");
  CHECK_THAT(late->message, Catch::Contains("version 1 failed before rank 1"));
  CHECK_FALSE(s.receiver.committed_version());
}

TEST_CASE("a group sends a subset version: the tensors it sends are replaced, the others kept", "[group]") {
  constexpr std::size_t n = 2;
  serving s(group_receiver(n));
  table dest(s.receiver, group_model());
  s.start();
  const auto endpoints = s.receiver.endpoints();
  // A shorter reply timeout: the last step's version ends at 3/4 of it (its other rank was refused).
  auto o0 = rank_options(endpoints[0], 0, n);
  auto o1 = rank_options(endpoints[1], 1, n);
  o0.timeout = o1.timeout = refit::milliseconds{4000};
  refit::streamer s0(o0);
  refit::streamer s1(o1);
  const rt::host_tensors v1(group_model(), 1);
  auto ok = each_rank(n, [&](std::size_t r) { (r == 0 ? s0 : s1).refit(1, rt::rank_shards(v1, r, n)); });
  for (const auto& f : ok) CHECK_FALSE(f);
  REQUIRE(s.receiver.committed_version() == 1);
  // Version 2 carries only "q" and "norm" (an adapter's tensors), sharded as before.
  const rt::host_tensors v2(group_model(), 2);
  ok = each_rank(n, [&](std::size_t r) {
    const auto all = rt::rank_shards(v2, r, n);
    const std::vector<refit::tensor_ref> some{all[1], all[2]};
    (r == 0 ? s0 : s1).refit(2, some, refit::refit_scope::subset);
  });
  INFO(failures_text(ok));
  for (const auto& f : ok) CHECK_FALSE(f);
  CHECK(s.receiver.committed_version() == 2);
  for (std::size_t k = 0; k < dest.metas.size(); ++k) {
    const std::uint64_t version = k == 1 || k == 2 ? 2 : 1;
    CHECK(rt::pattern_mismatch(dest.metas[k], version, dest.bytes[k].data()).empty());
  }
  // A rank that sends its part of version 3 whole while the other sends a subset is refused.
  const rt::host_tensors v3(group_model(), 3);
  const auto mixed = each_rank(n, [&](std::size_t r) {
    const auto all = rt::rank_shards(v3, r, n);
    if (r == 0) {
      s0.refit(3, all);
    } else {
      const std::vector<refit::tensor_ref> some{all[1]};
      s1.refit(3, some, refit::refit_scope::subset);
    }
  });
  INFO(failures_text(mixed));
  std::size_t refused = 0;
  for (const auto& f : mixed) {
    REQUIRE(f);
    if (f->code == "protocol") {
      ++refused;
      CHECK_THAT(f->message,
                 Catch::Contains("every streamer of a group sends the same versions, whole or subset alike"));
    }
  }
  CHECK(refused == 1);
  CHECK(s.receiver.committed_version() == 2);
}
