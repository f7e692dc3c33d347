// Subset and delta versions over host_shm: the receiver is served on a thread of this
// process until the event a step waits for (joined before anything it wrote is read), the streamer
// runs on the test's thread, or in a forked child where the test kills it.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <future>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "channel/channel.hpp"
#include "delta/base.hpp"
#include "delta/checksum.hpp"
#include "delta/host_apply.hpp"
#include "delta/host_diff.hpp"
#include "delta/patch.hpp"
#include "delta/pool.hpp"
#include "refit/version.hpp"
#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "support/support.hpp"
#include "transport/transport.hpp"
#include "wire/wire.hpp"

using namespace std::chrono_literals;
namespace rt = refit::test;
namespace wire = refit::wire;
using refit::dtype;
using refit::errc;
using refit::receiver_event;

namespace {

constexpr std::uint64_t kib = 1ull << 10;
constexpr std::uint64_t buffer_bytes = 256 * kib;  // patches cover spans of 128 KiB
constexpr refit::milliseconds streamer_timeout{5000};
/// How long the engine waits for the streamer's next message during a refit. A streamer diffs up to
/// 32 MiB of tensor bytes between two batches; under ThreadSanitizer, on CI's two cores shared
/// with other tests, that took over 2 s (the limit was 2 s then, and the receiver aborted the
/// refit). Only the test of a killed streamer waits for this timeout, and sets a short one.
constexpr refit::milliseconds engine_idle{15000};

/// A small model with what a delta must handle: a bf16 tensor of several spans, one whose size is no
/// multiple of 8 (checksum tail bytes), f32 (changes densely: sent as bytes), 1- and 8-byte elements,
/// an empty tensor and one that never changes.
std::vector<refit::tensor_meta> delta_model() {
  return {
      {"embed", dtype::bf16, {300000}},       // 600,000 bytes: 5 spans
      {"layers.0.q", dtype::bf16, {64, 65}},  // 8,320 bytes
      {"layers.0.odd", dtype::bf16, {4097}},  // 8,194 bytes: 2 tail bytes
      {"layers.0.norm", dtype::f32, {1000}}, {"layers.0.bytes", dtype::u8, {333}}, {"layers.0.count", dtype::i64, {17}},
      {"empty", dtype::bf16, {0, 4}},        {"frozen", dtype::bf16, {1000}},
  };
}

/// The trainer's side: every tensor's bytes, changed step by step like an optimizer would: a small
/// fraction of the elements of most tensors, every element of the f32 one.
struct trainer {
  std::vector<refit::tensor_meta> metas;
  std::vector<std::vector<std::uint8_t>> bytes;
  std::mt19937_64 rng{42};

  explicit trainer(std::vector<refit::tensor_meta> m) : metas(std::move(m)) {
    for (const auto& t : metas) {
      bytes.emplace_back(t.nbytes());
      for (auto& b : bytes.back()) b = static_cast<std::uint8_t>(rng());
    }
  }

  /// One optimizer step: ~`fraction` of the elements of every tensor change, except "frozen";
  /// f32 tensors change entirely.
  void step(double fraction = 0.02) {
    for (std::size_t k = 0; k < metas.size(); ++k) {
      if (metas[k].name == "frozen") continue;
      const std::size_t item = refit::itemsize(metas[k].type);
      const std::uint64_t n = bytes[k].size() / item;
      const bool dense = metas[k].type == dtype::f32;
      std::bernoulli_distribution pick(dense ? 1.0 : fraction);
      for (std::uint64_t i = 0; i < n; ++i)
        if (pick(rng)) bytes[k][i * item] = static_cast<std::uint8_t>(bytes[k][i * item] + 1 + rng() % 200);
    }
  }

  [[nodiscard]] std::vector<refit::tensor_ref> refs() const {
    std::vector<refit::tensor_ref> out;
    for (std::size_t k = 0; k < metas.size(); ++k)
      out.push_back(
          refit::tensor_ref{metas[k], const_cast<std::uint8_t*>(bytes[k].data()), refit::device::cpu(), nullptr});
    return out;
  }
  /// Only the tensors whose name contains `part`.
  [[nodiscard]] std::vector<refit::tensor_ref> refs_of(const std::string& part) const {
    std::vector<refit::tensor_ref> out;
    for (const auto& r : refs())
      if (r.meta.name.find(part) != std::string::npos) out.push_back(r);
    return out;
  }
};

/// The engine's side: a parameter table of host tensors.
struct engine {
  std::vector<refit::tensor_meta> metas;
  std::vector<std::vector<std::uint8_t>> bytes;
  refit::receiver r;

  engine(const std::vector<refit::tensor_meta>& m, const std::string& endpoint, std::size_t threads = 0,
         refit::milliseconds idle = engine_idle)
      : metas(m), r(options(endpoint, threads, idle)) {
    for (const auto& t : metas) bytes.emplace_back(t.nbytes(), std::uint8_t{0xee});
    for (std::size_t k = 0; k < metas.size(); ++k)
      r.add_parameter(refit::tensor_dest{metas[k], bytes[k].empty() ? nullptr : bytes[k].data(), refit::device::cpu()});
  }
  static refit::receiver_options options(const std::string& endpoint, std::size_t threads = 0,
                                         refit::milliseconds idle = engine_idle) {
    refit::receiver_options o;
    o.endpoint = endpoint;
    o.delta_threads = threads;
    o.idle_timeout = idle;
    return o;
  }

  /// Empty when every tensor equals the trainer's, else the first that differs.
  [[nodiscard]] std::string differs_from(const trainer& t) const {
    for (std::size_t k = 0; k < metas.size(); ++k)
      if (bytes[k] != t.bytes[k]) return metas[k].name;
    return {};
  }
};

/// Serves `r` on another thread until it reports `stop` (or 20 s pass); returns the events seen.
/// The future's get() joins the thread, so what the receiver wrote may be read after it.
std::future<std::vector<receiver_event>> serve_until(refit::receiver& r, receiver_event stop,
                                                     std::atomic<bool>* cancel = nullptr) {
  return std::async(std::launch::async, [&r, stop, cancel] {
    std::vector<receiver_event> seen;
    const auto start = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - start < 20s && (cancel == nullptr || !cancel->load())) {
      const receiver_event e = r.serve_one(50ms);
      if (e == receiver_event::idle) continue;
      seen.push_back(e);
      if (e == stop) break;
    }
    return seen;
  });
}

refit::streamer_options delta_streamer(const std::string& endpoint) {
  auto o = rt::host_shm_streamer(endpoint, buffer_bytes, streamer_timeout);
  o.delta.enable = true;
  return o;
}

/// Runs one refit of `st` while `e` serves until it commits; returns the streamer's figures.
refit::refit_stats refit_once(refit::streamer& st, engine& e, std::uint64_t version,
                              const std::vector<refit::tensor_ref>& refs,
                              refit::refit_scope scope = refit::refit_scope::whole,
                              std::vector<receiver_event>* events = nullptr) {
  std::atomic<bool> cancel{false};
  auto served = serve_until(e.r, receiver_event::committed, &cancel);
  refit::refit_stats stats;
  try {
    stats = st.refit(version, refs, scope);
  } catch (...) {
    cancel = true;
    served.get();
    throw;
  }
  auto seen = served.get();
  if (events != nullptr) *events = std::move(seen);
  return stats;
}

bool contains(const std::vector<receiver_event>& v, receiver_event e) {
  return std::find(v.begin(), v.end(), e) != v.end();
}

/// What the diff of one span must give: element by element, as the first single-threaded diff did.
refit::delta::span_patch reference_diff(std::byte* base, const std::byte* next, std::uint64_t off, std::uint64_t n,
                                        std::size_t item, std::uint64_t total) {
  refit::delta::span_patch r;
  std::vector<std::uint32_t> indices;
  std::vector<std::byte> values;
  for (std::uint64_t b = 0; b < n; b += item) {
    if (std::memcmp(base + b, next + b, item) == 0) continue;
    const std::uint64_t o = refit::delta::load_bits(base + b, item);
    const std::uint64_t v = refit::delta::load_bits(next + b, item);
    r.terms +=
        refit::delta::element_term(v, off + b, item, total) - refit::delta::element_term(o, off + b, item, total);
    std::memcpy(base + b, next + b, item);
    indices.push_back(static_cast<std::uint32_t>(b / item));
    values.insert(values.end(), next + b, next + b + item);
    ++r.changes;
  }
  r.as_bytes = r.changes * refit::delta::record_bytes(item) >= n;
  if (!r.as_bytes && r.changes != 0) {
    r.patch.resize(4 * indices.size());
    std::memcpy(r.patch.data(), indices.data(), r.patch.size());
    r.patch.insert(r.patch.end(), values.begin(), values.end());
  }
  return r;
}

}  // namespace

// ================================================================================== patches

TEST_CASE("a patch rebuilds the new span and its checksum terms match a full checksum", "[delta]") {
  std::mt19937_64 rng(7);
  for (const std::size_t item : {1u, 2u, 4u, 8u}) {
    for (const std::uint64_t total : {std::uint64_t{8}, std::uint64_t{1000}, std::uint64_t{4104}}) {
      const std::uint64_t bytes = total / item * item;
      std::vector<std::byte> old_bytes(bytes), next(bytes);
      for (auto& b : old_bytes) b = static_cast<std::byte>(rng());
      next = old_bytes;
      for (std::uint64_t i = 0; i < bytes / item; i += 1 + rng() % 7) next[i * item] = static_cast<std::byte>(rng());
      // Diff the second half only: offsets, tails and the rest of the tensor all count.
      const std::uint64_t off = bytes / item / 2 * item;
      std::vector<std::byte> base = old_bytes;
      std::vector<std::uint32_t> idx(bytes / item);
      std::vector<std::byte> values(bytes);
      const auto r = refit::delta::diff(base.data() + off, next.data() + off, off, bytes - off, item, bytes, idx.data(),
                                        values.data());
      std::vector<std::byte> expect = old_bytes;
      std::copy(next.begin() + static_cast<std::ptrdiff_t>(off), next.end(),
                expect.begin() + static_cast<std::ptrdiff_t>(off));
      CHECK(base == expect);
      CHECK(refit::copy::checksum(old_bytes.data(), bytes) + r.terms == refit::copy::checksum(expect.data(), bytes));
      // The patch, applied to the old bytes, gives the same bytes and the same terms.
      std::vector<std::byte> patch(r.changes * refit::delta::record_bytes(item));
      std::memcpy(patch.data(), idx.data(), 4 * r.changes);
      std::memcpy(patch.data() + 4 * r.changes, values.data(), r.changes * item);
      REQUIRE_NOTHROW(refit::delta::check_patch(patch.data(), patch.size(), item, bytes - off, "t"));
      std::vector<std::byte> applied = old_bytes;
      std::byte* dest = applied.data();
      CHECK(refit::delta::apply_patch(patch.data(), patch.size(), item, off, bytes - off, bytes, {&dest, 1}, "t") ==
            r.terms);
      CHECK(applied == expect);
      // range_terms over any cut adds up to the checksum.
      const std::uint64_t cut = 3 + rng() % (bytes - 3);
      CHECK(refit::delta::range_terms(expect.data(), 0, cut, bytes) +
                refit::delta::range_terms(expect.data() + cut, cut, bytes - cut, bytes) + bytes ==
            refit::copy::checksum(expect.data(), bytes));
    }
  }
}

TEST_CASE("the host diff gives the same patches, checksum terms and base on 1 and on several threads", "[delta]") {
  std::mt19937_64 rng(11);
  // Spans of 1 MiB: several chunks each (host_differ::chunk_bytes), as the streamer cuts them from
  // 2 MiB buffers. Per span, by its number: ~2 % changed, every element (sent as plain bytes),
  // nothing, ~0.05 %.
  const std::uint64_t span = refit::delta::span_bytes(2 << 20);
  REQUIRE(span > 2 * refit::delta::host_differ::chunk_bytes);
  const double density[] = {0.02, 1.0, 0.0, 0.0005};
  for (const std::size_t item : {1u, 2u, 4u, 8u}) {
    // Empty, smaller than 8 bytes, smaller than a chunk with tail bytes, one chunk and a bit, and
    // several spans whose last one ends in the tail.
    for (const std::uint64_t elements : {std::uint64_t{0}, 8 / item - (item < 8 ? 1 : 0), 1001 / item * item + 3,
                                         refit::delta::host_differ::chunk_bytes / item + 5, 4 * span / item + 77}) {
      const std::uint64_t total = elements * item;
      INFO("item " << item << ", " << total << " bytes");
      std::vector<std::byte> old_bytes(total), next(total);
      for (auto& b : old_bytes) b = static_cast<std::byte>(rng());
      next = old_bytes;
      std::bernoulli_distribution coin[4] = {
          std::bernoulli_distribution(density[0]), std::bernoulli_distribution(density[1]),
          std::bernoulli_distribution(density[2]), std::bernoulli_distribution(density[3])};
      for (std::uint64_t e = 0; e < elements; ++e)
        if (coin[(e * item / span) % 4](rng)) next[e * item + rng() % item] ^= static_cast<std::byte>(1 + rng() % 255);
      if (elements != 0) next[total - 1] ^= std::byte{0x5a};  // the last element, in the tail when there is one

      std::vector<std::byte> expect_base = old_bytes;
      std::vector<refit::delta::span_patch> expect;
      for (std::uint64_t off = 0; off < total; off += span)
        expect.push_back(
            reference_diff(expect_base.data() + off, next.data() + off, off, std::min(span, total - off), item, total));
      REQUIRE(expect_base == next);
      std::uint64_t terms = 0;
      for (const auto& r : expect) terms += r.terms;
      CHECK(refit::copy::checksum(old_bytes.data(), total) + terms == refit::copy::checksum(next.data(), total));

      for (const std::size_t threads : {1u, 2u, 5u}) {
        INFO(threads << " threads");
        refit::delta::host_differ d(threads);
        CHECK(d.threads() == threads);
        std::vector<std::byte> base = old_bytes;
        std::vector<refit::delta::host_span> spans;
        for (std::uint64_t off = 0; off < total; off += span)
          spans.push_back({base.data() + off, next.data() + off, off, std::min(span, total - off), total, item});
        std::vector<refit::delta::span_patch> found(spans.size());
        // Twice: the second time over the patches of the first, recycled (as the streamer does once
        // they are sent), in whatever order and capacity.
        for (int round = 0; round < 2; ++round) {
          INFO("round " << round);
          base = old_bytes;
          d.diff(spans, found);
          CHECK(base == next);
          for (std::size_t k = 0; k < spans.size(); ++k) {
            INFO("span " << k);
            CHECK(found[k].changes == expect[k].changes);
            CHECK(found[k].terms == expect[k].terms);
            CHECK(found[k].as_bytes == expect[k].as_bytes);
            CHECK(found[k].patch == expect[k].patch);
          }
          for (std::size_t k = found.size(); k-- > 0;) d.recycle(std::move(found[k].patch));
        }
        // count() and write(), as the streamer does for host buffers: the same figures, and the same
        // patches written where it says (here one buffer, the last span's patch first).
        base = old_bytes;
        d.count(spans, found);
        CHECK(base == next);
        std::vector<refit::delta::host_differ::target> targets;
        std::vector<std::uint64_t> at(spans.size());
        std::uint64_t used = 0;
        for (std::size_t k = spans.size(); k-- > 0;) {
          CHECK(found[k].changes == expect[k].changes);
          CHECK(found[k].terms == expect[k].terms);
          CHECK(found[k].as_bytes == expect[k].as_bytes);
          CHECK(found[k].patch.empty());
          at[k] = used;
          used += expect[k].patch.size();
        }
        std::vector<std::byte> buffer(used + 1, std::byte{0x77});
        for (std::size_t k = 0; k < spans.size(); ++k)
          if (!expect[k].patch.empty()) targets.push_back({k, buffer.data() + at[k]});
        d.write(spans, targets);
        for (std::size_t k = 0; k < spans.size(); ++k) {
          INFO("span " << k << " written");
          const auto from = buffer.begin() + static_cast<std::ptrdiff_t>(at[k]);
          CHECK(std::vector<std::byte>(from, from + static_cast<std::ptrdiff_t>(expect[k].patch.size())) ==
                expect[k].patch);
        }
        CHECK(buffer.back() == std::byte{0x77});
        // Used again, nothing changed: no patches.
        d.diff(spans, found);
        for (const auto& f : found) CHECK((f.changes == 0 && f.terms == 0 && f.patch.empty() && !f.as_bytes));
      }
    }
  }
}

TEST_CASE("the host diff of a tensor larger than one wave gives the patches of one thread", "[delta]") {
  // Spans of 16 MiB (64 MiB buffers), three of them and a bit: two waves (host_differ::wave_bytes).
  const std::uint64_t span = refit::delta::span_bytes(64 << 20);
  const std::uint64_t total = 3 * span + 1000;
  REQUIRE(total > refit::delta::host_differ::wave_bytes);
  std::mt19937_64 rng(5);
  std::vector<std::byte> old_bytes(total);
  for (std::uint64_t i = 0; i + 8 <= total; i += 8) {
    const std::uint64_t v = rng();
    std::memcpy(old_bytes.data() + i, &v, 8);
  }
  std::vector<std::byte> next = old_bytes;
  for (std::uint64_t k = 0; k < total / 2 / 50; ++k) next[2 * (rng() % (total / 2))] ^= std::byte{1};
  std::vector<std::byte> expect_base = old_bytes;
  std::vector<refit::delta::span_patch> expect;
  for (std::uint64_t off = 0; off < total; off += span)
    expect.push_back(
        reference_diff(expect_base.data() + off, next.data() + off, off, std::min(span, total - off), 2, total));
  for (const std::size_t threads : {1u, 3u}) {
    INFO(threads << " threads");
    refit::delta::host_differ d(threads);
    std::vector<std::byte> base = old_bytes;
    std::vector<refit::delta::host_span> spans;
    for (std::uint64_t off = 0; off < total; off += span)
      spans.push_back({base.data() + off, next.data() + off, off, std::min(span, total - off), total, 2});
    std::vector<refit::delta::span_patch> found(spans.size());
    d.diff(spans, found);
    CHECK(base == next);
    for (std::size_t k = 0; k < spans.size(); ++k) {
      INFO("span " << k);
      CHECK(found[k].changes == expect[k].changes);
      CHECK(found[k].terms == expect[k].terms);
      CHECK(found[k].as_bytes == expect[k].as_bytes);
      CHECK(found[k].patch == expect[k].patch);
    }
  }
}

TEST_CASE("a job that throws on the diff's threads reaches the caller as a refit::error after every job ran",
          "[delta]") {
  refit::delta::worker_pool pool(4);
  REQUIRE(pool.size() == 4);
  std::vector<std::atomic<int>> ran(200);
  const auto run = [&](std::size_t bad, bool refit_error) {
    for (auto& r : ran) r = 0;
    pool.run(ran.size(), [&](std::size_t k) {
      ran[k] += 1;
      if (k != bad) return;
      if (refit_error) throw refit::error(errc::apply, "job 37 failed");
      throw std::runtime_error("job 37 broke");
    });
  };
  try {
    run(37, false);
    FAIL("no exception");
  } catch (const refit::error& e) {
    CHECK(e.code() == errc::internal);
    CHECK_THAT(e.what(), Catch::Contains("job 37 broke"));
  }
  for (const auto& r : ran) CHECK(r == 1);
  try {
    run(37, true);
    FAIL("no exception");
  } catch (const refit::error& e) {
    CHECK(e.code() == errc::apply);
    CHECK_THAT(e.what(), Catch::Contains("job 37 failed"));
  }
  for (const auto& r : ran) CHECK(r == 1);
  CHECK_NOTHROW(run(ran.size(), false));  // a failed run leaves the pool usable
  for (const auto& r : ran) CHECK(r == 1);
  pool.run(0, [](std::size_t) { FAIL("a run of no jobs ran one"); });
}

TEST_CASE("a corrupt patch is refused before it writes", "[delta]") {
  std::vector<std::byte> patch(3 * 6);
  const auto set_index = [&](int k, std::uint32_t i) { std::memcpy(patch.data() + 4 * k, &i, 4); };
  set_index(0, 1), set_index(1, 5), set_index(2, 9);
  CHECK_NOTHROW(refit::delta::check_patch(patch.data(), patch.size(), 2, 20, "w"));
  CHECK_THROWS_WITH(refit::delta::check_patch(patch.data(), patch.size(), 2, 18, "w"),
                    Catch::Contains("names element 9 (out of the span)"));
  set_index(2, 5);
  CHECK_THROWS_WITH(refit::delta::check_patch(patch.data(), patch.size(), 2, 20, "w"),
                    Catch::Contains("names element 5 (not after the one before)"));
  CHECK_THROWS_WITH(refit::delta::check_patch(patch.data(), 17, 2, 20, "w"), Catch::Contains("not whole 6-byte"));
}

TEST_CASE("the host patcher checks and applies a batch as one thread does, on 1 and several threads", "[delta]") {
  std::mt19937_64 rng(13);
  // A bf16 patch of several pieces (host_patcher::piece_records), a small u8 one, a span sent as
  // bytes of several pieces ending in the tensor's tail bytes, and a tied tensor (two destinations).
  struct tensor {
    std::size_t item;
    std::uint64_t total;
    int dests;
  };
  const std::uint64_t records = 2 * refit::delta::host_patcher::piece_records + 123;
  const tensor tensors[] = {{2, 400 * records, 1},
                            {1, 5000, 1},
                            {4, 2 * refit::delta::host_patcher::piece_bytes + 4100, 1},
                            {2, 64 * records, 2}};
  std::vector<std::vector<std::byte>> old_w, new_w, buffers;
  std::vector<refit::delta::host_entry> entries;
  std::uint64_t expect_terms = 0;
  for (std::size_t k = 0; k < std::size(tensors); ++k) {
    const tensor& t = tensors[k];
    old_w.emplace_back(t.total);
    for (auto& b : old_w.back()) b = static_cast<std::byte>(rng());
    new_w.push_back(old_w.back());
    const std::uint64_t weight = refit::delta::name_weight("t" + std::to_string(k));
    // The tensor's second half: a patch, except the third tensor, sent as bytes.
    const std::uint64_t off = t.total / t.item / 2 * t.item;
    const std::uint64_t span = t.total - off;
    std::vector<std::byte> next(new_w.back().begin() + static_cast<std::ptrdiff_t>(off), new_w.back().end());
    for (std::uint64_t e = 0; e < span / t.item; ++e)
      if (k == 2 || rng() % 50 == 0) next[e * t.item] ^= static_cast<std::byte>(1 + rng() % 255);
    std::vector<std::byte> base(new_w.back().begin() + static_cast<std::ptrdiff_t>(off), new_w.back().end());
    std::vector<std::uint32_t> idx(span / t.item + 1);
    std::vector<std::byte> values(span + 8);
    const auto r = refit::delta::diff(base.data(), next.data(), off, span, t.item, t.total, idx.data(), values.data());
    std::copy(next.begin(), next.end(), new_w.back().begin() + static_cast<std::ptrdiff_t>(off));
    expect_terms += weight * r.terms;
    if (k == 2) {
      buffers.push_back(next);
    } else {
      std::vector<std::byte> patch(r.changes * refit::delta::record_bytes(t.item));
      std::memcpy(patch.data(), idx.data(), 4 * r.changes);
      std::memcpy(patch.data() + 4 * r.changes, values.data(), r.changes * t.item);
      buffers.push_back(std::move(patch));
    }
    refit::delta::host_entry e;
    e.from = buffers.back().data();
    e.bytes = buffers.back().size();
    e.patch = k != 2;
    e.span = e.patch ? span : 0;
    e.off = off;
    e.total = t.total;
    e.item = t.item;
    e.weight = weight;
    e.name = k == 0 ? "t0" : "t";
    entries.push_back(e);
  }
  REQUIRE(entries[0].bytes / 6 > 2 * refit::delta::host_patcher::piece_records);
  for (const std::size_t threads : {1u, 2u, 5u}) {
    INFO(threads << " threads");
    refit::delta::host_patcher p(threads);
    CHECK(p.threads() == threads);
    std::vector<std::vector<std::byte>> w = old_w;
    std::vector<std::byte> tied = old_w[3];
    std::vector<std::vector<std::byte*>> dests;
    for (std::size_t k = 0; k < w.size(); ++k) dests.push_back({w[k].data()});
    dests[3].push_back(tied.data());
    for (std::size_t k = 0; k < w.size(); ++k) entries[k].dests = dests[k];
    CHECK_NOTHROW(p.check(entries));
    CHECK(p.apply(entries) == expect_terms);
    CHECK(w == new_w);
    CHECK(tied == new_w[3]);

    // Corrupt indices: the first in the batch's order is refused, with check_patch's message, however
    // the pieces fell on the threads; nothing is written.
    std::vector<std::byte> bad0 = buffers[0], bad3 = buffers[3];
    const std::uint64_t late = 2 * refit::delta::host_patcher::piece_records + 7;  // in entry 0's third piece
    const std::uint32_t huge = 0xffffffffu;
    std::memcpy(bad0.data() + 4 * late, &huge, 4);
    std::memcpy(bad3.data(), &huge, 4);  // entry 3's first record
    std::vector<refit::delta::host_entry> bad = entries;
    bad[0].from = bad0.data();
    bad[3].from = bad3.data();
    std::string expect;
    try {
      refit::delta::check_patch(bad0.data(), bad[0].bytes, 2, bad[0].span, "t0");
    } catch (const refit::error& e) {
      expect = e.what();
    }
    REQUIRE_THAT(expect, Catch::Contains(fmt::format("change {} names element 4294967295 (out of the span)", late)));
    const std::vector<std::vector<std::byte>> before = w;
    CHECK_THROWS_WITH(p.check(bad), expect);
    // Records not after the one before, in a piece's first record (its neighbour is in the piece
    // before): refused as one thread would.
    std::vector<std::byte> dup = buffers[0];
    const std::uint64_t first_of_second = refit::delta::host_patcher::piece_records;
    std::memcpy(dup.data() + 4 * first_of_second, dup.data() + 4 * (first_of_second - 1), 4);
    bad = entries;
    bad[0].from = dup.data();
    CHECK_THROWS_WITH(p.check(bad), Catch::Contains(fmt::format("change {} names element", first_of_second)) &&
                                        Catch::Contains("(not after the one before)"));
    // An entry of broken records after one with a bad index: the bad index, first in order.
    bad = entries;
    bad[0].from = bad0.data();
    bad[1].bytes -= 1;
    CHECK_THROWS_WITH(p.check(bad), expect);
    bad[0].from = buffers[0].data();
    CHECK_THROWS_WITH(p.check(bad), Catch::Contains("the patch of 't' has") && Catch::Contains("not whole 5-byte"));
    CHECK(w == before);
  }
}

TEST_CASE(
    "a patch whose index a peer changes between the check and the apply is refused without a write "
    "outside its span",
    "[delta][hostile]") {
  // A host_shm delta's records lie in the streamer's buffer, which the receiver maps shared while
  // the streamer can still write it: the receiver checks the batch (host_patcher::check), then
  // applies it (host_patcher::apply), and a racing peer flips an index in between.
  // Several pieces (host_patcher::piece_records), so the bad record is in the last piece of one
  // patch applied by several threads; record k names element k, the last one the span's last.
  constexpr std::size_t item = 2;
  constexpr std::uint64_t n = 3 * refit::delta::host_patcher::piece_records + 5;
  constexpr std::uint64_t elements = n;  // the span: the whole tensor
  constexpr std::uint64_t guard = 4096;  // bytes each side of the tensor that must stay as they are
  std::vector<std::byte> patch(n * refit::delta::record_bytes(item), std::byte{0xab});
  for (std::uint64_t k = 0; k < n; ++k) {
    const auto i = static_cast<std::uint32_t>(k);
    std::memcpy(patch.data() + 4 * k, &i, 4);
  }

  for (const std::uint32_t flipped : {std::uint32_t{elements}, std::uint32_t{elements + 1}, 0xffffffffu}) {
    for (const std::size_t threads : {1u, 3u}) {
      INFO("index flipped to " << flipped << ", " << threads << " threads");
      // The tensor with guard bytes around it, in one allocation, so that ASan sees any write
      // into them as well as this check does.
      std::vector<std::byte> memory(guard + elements * item + guard, std::byte{0x11});
      std::byte* dest = memory.data() + guard;
      std::vector<std::byte> shared = patch;  // the buffer the peer writes
      refit::delta::host_entry e;
      e.from = shared.data();
      e.bytes = shared.size();
      e.patch = true;
      e.span = elements * item;
      e.off = 0;
      e.total = elements * item;
      e.item = item;
      e.weight = 1;
      e.dests = {&dest, 1};
      e.name = "w";
      refit::delta::host_patcher p(threads);
      REQUIRE_NOTHROW(p.check({&e, 1}));
      std::memcpy(shared.data() + 4 * (n - 1), &flipped, 4);  // the peer's write, after the check
      try {
        (void)p.apply({&e, 1});
        FAIL("a patch with an index outside its span was applied");
      } catch (const refit::error& err) {
        CHECK(err.code() == refit::errc::apply);
        CHECK_THAT(err.what(), Catch::Contains(fmt::format("the patch of 'w' is corrupt: change {} names element {} "
                                                           "(out of the span), in a span of {} elements",
                                                           n - 1, flipped, elements)) &&
                                   Catch::Contains("changed after it was checked"));
      }
      const auto unchanged = [](auto first, auto last) {
        return std::all_of(first, last, [](std::byte b) { return b == std::byte{0x11}; });
      };
      CHECK(unchanged(memory.begin(), memory.begin() + guard));
      CHECK(unchanged(memory.end() - guard, memory.end()));
    }
  }
  // apply_patch (one thread) refuses it the same way.
  std::vector<std::byte> w(elements * item);
  std::byte* dest = w.data();
  const std::uint32_t huge = 0xffffffffu;
  std::memcpy(patch.data() + 4 * (n - 1), &huge, 4);
  CHECK_THROWS_MATCHES(
      refit::delta::apply_patch(patch.data(), patch.size(), item, 0, w.size(), w.size(), {&dest, 1}, "w"), refit::error,
      Catch::Matchers::Predicate<refit::error>([](const refit::error& e) { return e.code() == refit::errc::apply; }));
}

// ================================================================================== subsets

TEST_CASE("subset versions over host_shm are bit-exact after 20 steps and keep the tensors not sent",
          "[delta][subset]") {
  const rt::scoped_endpoint ep;
  trainer t(delta_model());
  engine e(t.metas, ep.name);
  refit::streamer st(rt::host_shm_streamer(ep.name, buffer_bytes, streamer_timeout));

  // A subset into a receiver that never committed a whole version: refused, nothing written.
  auto served = serve_until(e.r, receiver_event::refused);
  const auto refused = rt::failure_of([&] { st.refit(1, t.refs_of("layers.0"), refit::refit_scope::subset); });
  served.get();
  REQUIRE(refused);
  CHECK(refused->code == "needs_whole");
  CHECK_THAT(refused->message, Catch::Contains("has not committed a whole version"));
  CHECK_FALSE(e.r.committed_version());
  CHECK_FALSE(e.r.dirty());
  CHECK(e.bytes[0] == std::vector<std::uint8_t>(e.bytes[0].size(), 0xee));

  refit_once(st, e, 1, t.refs());
  REQUIRE(e.differs_from(t).empty());
  const trainer v1 = t;
  for (std::uint64_t v = 2; v <= 20; ++v) {
    // The "adapters" (layers.0.*) change and are sent alone; the rest changes too but is not sent.
    t.step(0.05);
    const auto sent = t.refs_of("layers.0");
    const auto stats = refit_once(st, e, v, sent, refit::refit_scope::subset);
    INFO("version " << v);
    CHECK(stats.subset);
    CHECK_FALSE(stats.delta);
    CHECK(stats.tensors == sent.size());
    CHECK(e.r.committed_version() == std::optional<std::uint64_t>(v));
    CHECK_FALSE(e.r.dirty());
    for (std::size_t k = 0; k < t.metas.size(); ++k) {
      INFO(t.metas[k].name);
      const bool adapter = t.metas[k].name.find("layers.0") != std::string::npos;
      CHECK(e.bytes[k] == (adapter ? t.bytes[k] : v1.bytes[k]));
    }
  }
  CHECK(t.bytes[0] != v1.bytes[0]);  // the tensors not sent did change on the trainer's side
}

// ================================================================================== deltas

TEST_CASE("delta versions over host_shm are bit-exact after 20 steps and send a fraction of the bytes", "[delta]") {
  const std::size_t threads = GENERATE(1u, 3u);
  INFO(threads << " diff and apply threads");
  const rt::scoped_endpoint ep;
  trainer t(delta_model());
  engine e(t.metas, ep.name, threads);
  auto so = delta_streamer(ep.name);
  so.delta.threads = threads;
  refit::streamer st(so);

  const auto first = refit_once(st, e, 1, t.refs());
  CHECK_FALSE(first.delta);
  CHECK(first.bytes == first.tensor_bytes);
  CHECK(first.base_bytes == first.tensor_bytes);
  REQUIRE(e.differs_from(t).empty());
  for (std::uint64_t v = 2; v <= 21; ++v) {
    t.step();
    const auto stats = refit_once(st, e, v, t.refs());
    INFO("version " << v);
    CHECK(stats.delta);
    CHECK(stats.base == v - 1);
    CHECK(stats.subset);
    CHECK_FALSE(stats.whole_after_refusal);
    CHECK(stats.changed > 0);
    // "frozen" and "empty" did not change (nor, some steps, the tiny u8 and i64 ones): not sent.
    CHECK(stats.tensors <= t.metas.size() - 2);
    CHECK(stats.tensors >= 4);
    // bf16 at ~2 %: 6-byte records; the f32 tensor goes whole: far less than the whole version.
    CHECK(stats.bytes < stats.tensor_bytes / 4);
    CHECK(e.r.committed_version() == std::optional<std::uint64_t>(v));
    CHECK_FALSE(e.r.dirty());
    REQUIRE(e.differs_from(t) == "");
  }
  // A version that changed nothing commits with nothing sent.
  const auto same = refit_once(st, e, 22, t.refs());
  CHECK(same.delta);
  CHECK(same.tensors == 0);
  CHECK(same.bytes == 0);
  CHECK(e.r.committed_version() == std::optional<std::uint64_t>(22));
  CHECK(e.differs_from(t).empty());
}

TEST_CASE("a delta batch covers delta_options::batch_bytes of tensors: more, smaller batches, the same patches",
          "[delta]") {
  // Two receivers fed the same versions: one by a streamer whose delta batches cover 64 KiB of
  // tensors, one by the default (max(32 MiB, the buffer): the whole model in one batch).
  const rt::scoped_endpoint ep_small, ep_default;
  trainer t(delta_model());
  engine small(t.metas, ep_small.name), whole(t.metas, ep_default.name);
  auto so = delta_streamer(ep_small.name);
  so.delta.batch_bytes = 64 * kib;
  refit::streamer st_small(so), st_default(delta_streamer(ep_default.name));
  refit_once(st_small, small, 1, t.refs());
  refit_once(st_default, whole, 1, t.refs());
  for (std::uint64_t v = 2; v <= 6; ++v) {
    t.step();
    const auto a = refit_once(st_small, small, v, t.refs());
    const auto b = refit_once(st_default, whole, v, t.refs());
    INFO("version " << v);
    CHECK(a.delta);
    CHECK(b.delta);
    CHECK(a.bytes == b.bytes);  // the same patches, cut into other batches
    CHECK(a.changed == b.changed);
    CHECK(b.batches == 1);
    // "embed" alone is 600,000 bytes: its five 128 KiB spans close a 64 KiB batch each.
    CHECK(a.batches >= 5);
    REQUIRE(small.differs_from(t) == "");
    REQUIRE(whole.differs_from(t) == "");
  }
}

TEST_CASE("a delta streamer asked for more than 256 diff threads is refused", "[delta]") {
  const rt::scoped_endpoint ep;
  auto o = delta_streamer(ep.name);
  o.delta.threads = 257;
  CHECK_THROWS_MATCHES(refit::streamer(o), refit::error, Catch::Predicate<refit::error>([](const refit::error& e) {
                         return e.code() == errc::invalid_argument &&
                                std::string(e.what()).find("delta.threads is 257") != std::string::npos;
                       }));
  o.delta.threads = 256;
  CHECK_NOTHROW(refit::streamer(o));  // threads are made at the first host diff only
}

TEST_CASE("a delta streamer over cuda_ipc or nccl writing directly is refused, saying the patches need buffers",
          "[delta]") {
  for (const auto t : {refit::transport_kind::cuda_ipc, refit::transport_kind::nccl}) {
    if (!refit::has_transport(t)) continue;  // a build without it refuses the transport first
    refit::streamer_options o;
    o.endpoint = "ipc:///nowhere";
    o.transport = t;
    o.direct = true;
    o.delta.enable = true;
    INFO(refit::to_string(t));
    const auto f = rt::failure_of([&] { refit::streamer s(o); });
    REQUIRE(f);
    CHECK(f->code == "invalid_argument");
    CHECK(f->message == fmt::format("streamer_options.delta needs the host_shm transport, or cuda_ipc or nccl with "
                                    "direct = false (patches travel in the buffers) in a build with CUDA, not {}{}",
                                    refit::to_string(t), " with direct = true"));
  }
}

TEST_CASE("a receiver asked for more than 256 delta threads is refused", "[delta]") {
  const rt::scoped_endpoint ep;
  CHECK_THROWS_MATCHES(refit::receiver(engine::options(ep.name, 257)), refit::error,
                       Catch::Predicate<refit::error>([](const refit::error& e) {
                         return e.code() == errc::invalid_argument &&
                                std::string(e.what()).find("delta_threads is 257") != std::string::npos;
                       }));
  CHECK_NOTHROW(refit::receiver(engine::options(ep.name, 256)));  // threads are made at the first delta batch
}

TEST_CASE(
    "a tensor larger than a delta batch's coverage is sent over several batches, bit-exact, its unchanged "
    "first spans included",
    "[delta]") {
  // 8 MiB buffers: spans of 4 MiB; a batch is sent every 32 MiB of tensor bytes covered (the
  // streamer's delta_batch_covers), inside a tensor too. "big" is 80 MB of bf16; its patches (0.1 %
  // changed) would fit one buffer.
  const rt::scoped_endpoint ep;
  const std::vector<refit::tensor_meta> metas = {{"small", dtype::bf16, {1000}}, {"big", dtype::bf16, {40000000}}};
  trainer t(metas);
  engine e(t.metas, ep.name, 2);
  auto o = rt::host_shm_streamer(ep.name, 8ull << 20, streamer_timeout);
  o.delta.enable = true;
  o.delta.threads = 2;
  refit::streamer st(o);
  refit_once(st, e, 1, t.refs());
  REQUIRE(e.differs_from(t).empty());
  // Every 1000th element of "big" from `from` on, and element 7 of "small".
  const auto change = [&](std::uint64_t from, std::uint8_t by) {
    t.bytes[0][14] = static_cast<std::uint8_t>(t.bytes[0][14] + by);
    for (std::uint64_t i = from; i < t.bytes[1].size() / 2; i += 1000)
      t.bytes[1][2 * i] = static_cast<std::uint8_t>(t.bytes[1][2 * i] + by);
  };
  change(0, 1);
  const auto all = refit_once(st, e, 2, t.refs());
  CHECK(all.delta);
  CHECK(all.tensors == 2);
  CHECK(all.changed == 1 + 40000);
  CHECK(all.bytes < (4ull << 20));
  CHECK(all.batches >= 3);  // 80 MB of "big" in batches of 32 MiB covered
  CHECK(e.r.committed_version() == std::optional<std::uint64_t>(2));
  REQUIRE(e.differs_from(t).empty());
  // Only the last quarter of "big" changes: its first spans (no change) are sent as empty patches
  // once its first change is found, in order, and the tensor counts once.
  change(30000000, 3);
  const auto tail = refit_once(st, e, 3, t.refs());
  CHECK(tail.delta);
  CHECK(tail.tensors == 2);
  CHECK(tail.changed == 1 + 10000);
  CHECK(e.r.committed_version() == std::optional<std::uint64_t>(3));
  REQUIRE(e.differs_from(t).empty());
  // Nothing changed: nothing sent.
  const auto none = refit_once(st, e, 4, t.refs());
  CHECK(none.tensors == 0);
  CHECK(none.bytes == 0);
  CHECK(e.differs_from(t).empty());
}

TEST_CASE("the base cuts small tensors from shared slabs, large ones alone, and repacks after a size change",
          "[delta]") {
  refit::delta::base_store b(refit::delta::memory::host, 1ull << 40);
  // 40 experts of 3 MiB + 1 byte (each rounded to 256 bytes, not to a page), one 100 MiB tensor.
  std::vector<std::pair<std::byte*, std::uint64_t>> placed;
  std::uint64_t tensor_bytes = 0;
  for (int k = 0; k < 40; ++k) {
    const refit::tensor_meta m{"expert." + std::to_string(k), refit::dtype::u8, {(3 << 20) + 1}};
    auto* t = b.place(m);
    REQUIRE(t != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(t->data) % 256 == 0);
    std::memset(t->data, k, t->bytes);  // every byte of it is writable
    placed.emplace_back(t->data, t->bytes);
    tensor_bytes += t->bytes;
    if (k == 19) {
      const std::uint64_t before = b.reserved();
      auto* big = b.place(refit::tensor_meta{"embed", refit::dtype::u8, {100 << 20}});
      REQUIRE(big != nullptr);
      CHECK(b.reserved() == before + (100u << 20));  // an allocation of its own
      placed.emplace_back(big->data, big->bytes);
      tensor_bytes += big->bytes;
    }
  }
  CHECK(b.bytes() == tensor_bytes);
  // Packed: most experts follow the one before at 3 MiB + 256 bytes (a new slab breaks the run).
  int packed = 0;
  for (int k = 1; k < 40; ++k)
    packed +=
        b.find("expert." + std::to_string(k))->data - b.find("expert." + std::to_string(k - 1))->data == (3 << 20) + 256
            ? 1
            : 0;
  CHECK(packed >= 30);
  CHECK(b.reserved() <= tensor_bytes + (256u << 20));  // at most one slab's tail unused
  std::sort(placed.begin(), placed.end());
  for (std::size_t k = 1; k < placed.size(); ++k)
    CHECK(placed[k - 1].first + placed[k - 1].second <= placed[k].first);  // no two overlap
  CHECK(b.find("expert.7")->data[0] == std::byte{7});
  CHECK(b.find("expert.7")->data[(3 << 20)] == std::byte{7});

  // The same sizes again: the same room. Another size: new room, the old abandoned until the next
  // whole version repacks (begin_whole), which starts an empty base.
  auto* again = b.place(refit::tensor_meta{"expert.3", refit::dtype::u8, {(3 << 20) + 1}});
  CHECK(again->data == b.find("expert.3")->data);
  const std::uint64_t reserved = b.reserved();
  b.begin_whole();  // nothing abandoned: kept
  CHECK(b.find("expert.3") != nullptr);
  CHECK(b.reserved() == reserved);
  REQUIRE(b.place(refit::tensor_meta{"expert.3", refit::dtype::u8, {1 << 20}}) != nullptr);
  CHECK(b.bytes() == tensor_bytes - 2048 * 1024 - 1);
  b.begin_whole();
  CHECK(b.find("expert.3") == nullptr);
  CHECK(b.bytes() == 0);
  CHECK(b.reserved() == 0);
  CHECK(!b.version().has_value());
}

TEST_CASE("a version larger than the base's bound is always sent whole", "[delta]") {
  const rt::scoped_endpoint ep;
  trainer t(delta_model());
  engine e(t.metas, ep.name);
  auto o = delta_streamer(ep.name);
  o.delta.max_bytes = 100 * kib;  // the model takes more than 600 KB
  refit::streamer st(o);
  for (std::uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) t.step();
    const auto stats = refit_once(st, e, v, t.refs());
    CHECK_FALSE(stats.delta);
    CHECK(stats.bytes == stats.tensor_bytes);
    CHECK(stats.base_bytes <= 100 * kib);
    CHECK(e.differs_from(t).empty());
  }
}

TEST_CASE(
    "a delta to a receiver with another base is refused before writing and the whole version follows "
    "in the same refit",
    "[delta]") {
  const rt::scoped_endpoint ep;
  trainer t(delta_model());
  engine e(t.metas, ep.name);
  refit::streamer st(delta_streamer(ep.name));
  refit_once(st, e, 1, t.refs());

  // Another trainer commits version 2 to the receiver: the delta streamer's base (1) is stale.
  trainer other(delta_model());
  {
    refit::streamer o(rt::host_shm_streamer(ep.name, buffer_bytes, streamer_timeout));
    refit_once(o, e, 2, other.refs());
    auto bye = serve_until(e.r, receiver_event::bye);
    o.close();
    bye.get();
  }
  REQUIRE(e.differs_from(other).empty());

  t.step();
  std::vector<receiver_event> events;
  const auto stats = refit_once(st, e, 3, t.refs(), refit::refit_scope::whole, &events);
  CHECK(stats.whole_after_refusal);
  CHECK_FALSE(stats.delta);
  CHECK(stats.bytes == stats.tensor_bytes);
  CHECK(contains(events, receiver_event::refused));  // the delta's BEGIN
  CHECK(e.r.committed_version() == std::optional<std::uint64_t>(3));
  CHECK_FALSE(e.r.dirty());
  CHECK(e.differs_from(t).empty());
  CHECK_THAT(e.r.last_error(), Catch::Contains("its base is version 1, but this receiver holds version 2"));

  // The whole version is the new base: the next one is a delta again.
  t.step();
  const auto next = refit_once(st, e, 4, t.refs());
  CHECK(next.delta);
  CHECK(next.base == 3);
  CHECK(e.differs_from(t).empty());
}

TEST_CASE("a delta to a receiver that registered its table again is sent whole", "[delta]") {
  const rt::scoped_endpoint ep;
  trainer t(delta_model());
  refit::streamer st(delta_streamer(ep.name));
  engine e(t.metas, ep.name);
  refit_once(st, e, 1, t.refs());
  // The engine reallocated its weights (as a restarted one would): what it holds is no base.
  e.r.clear_parameters();
  for (auto& b : e.bytes) std::fill(b.begin(), b.end(), std::uint8_t{0});
  for (std::size_t k = 0; k < e.metas.size(); ++k)
    e.r.add_parameter(
        refit::tensor_dest{e.metas[k], e.bytes[k].empty() ? nullptr : e.bytes[k].data(), refit::device::cpu()});
  t.step();
  const auto stats = refit_once(st, e, 2, t.refs());
  CHECK(stats.whole_after_refusal);
  CHECK_FALSE(stats.delta);
  CHECK_THAT(e.r.last_error(), Catch::Contains("since its parameter table was last changed"));
  CHECK(e.r.committed_version() == std::optional<std::uint64_t>(2));
  CHECK(e.differs_from(t).empty());
}

TEST_CASE(
    "weights changed behind the receiver's back fail the delta's checksum and poison it; a whole version "
    "cures it",
    "[delta]") {
  const rt::scoped_endpoint ep;
  trainer t(delta_model());
  engine e(t.metas, ep.name);
  refit::streamer st(delta_streamer(ep.name));
  refit_once(st, e, 1, t.refs());

  // Every element of "layers.0.q" changes, so the patch overwrites the byte flipped here.
  for (std::size_t i = 0; i < t.bytes[1].size(); i += 2) t.bytes[1][i] ^= 0x5a;
  e.bytes[1][100] ^= 0x01;
  std::atomic<bool> cancel{false};
  auto served = serve_until(e.r, receiver_event::aborted, &cancel);
  const auto failed = rt::failure_of([&] { st.refit(2, t.refs()); });
  served.get();
  REQUIRE(failed);
  CHECK(failed->code == "apply");
  CHECK_THAT(failed->message, Catch::Contains("delta version 2 does not check out"));
  CHECK(e.r.committed_version() == std::optional<std::uint64_t>(1));
  CHECK(e.r.dirty());
  CHECK(e.r.poisoned());
  CHECK_THAT(e.r.last_error(), Catch::StartsWith("poisoned: delta version 2 failed"));

  // The streamer's base is gone with the failure: the next refit is whole, and cures the receiver.
  const auto stats = refit_once(st, e, 3, t.refs());
  CHECK_FALSE(stats.delta);
  CHECK_FALSE(e.r.dirty());
  CHECK_FALSE(e.r.poisoned());
  CHECK(e.differs_from(t).empty());
}

// ------------------------------------------------------------------ a hand-made corrupt patch

namespace {

/// A streamer built from the parts, to send a patch the real one never would.
class raw_streamer {
 public:
  explicit raw_streamer(const std::string& endpoint) : channel_(endpoint) {
    refit::transport::source_options o;
    o.name = "host_shm";
    o.bytes = buffer_bytes;
    src_ = refit::transport::make_source(o);
    wire::hello h;
    src_->open_session(h);
    h.peer = "raw-streamer";
    const auto reply = request(h);
    REQUIRE(std::holds_alternative<wire::ok>(reply));
    src_->session_accepted(std::array{std::get<wire::ok>(reply)});
  }
  wire::message request(const wire::message& m) {
    return wire::decode(channel_.request(wire::encode(m), streamer_timeout, wire::to_string(wire::type_of(m))));
  }
  std::byte* buffer(std::size_t i) { return src_->data(i); }

 private:
  std::unique_ptr<refit::transport::source> src_;
  refit::channel::req_channel channel_;
};

std::string error_of(const wire::message& m) {
  if (const auto* e = std::get_if<wire::error>(&m)) return std::string(refit::to_string(e->code)) + ": " + e->message;
  return "OK";
}

}  // namespace

TEST_CASE(
    "a corrupted patch value is caught by the checksum; a corrupt index is refused before anything is "
    "written",
    "[delta]") {
  const rt::scoped_endpoint ep;
  const refit::tensor_meta w{"w", dtype::bf16, {64}};
  std::vector<std::uint8_t> weights(128);
  refit::receiver r(engine::options(ep.name));
  r.add_parameter(refit::tensor_dest{w, weights.data(), refit::device::cpu()});
  std::vector<std::uint8_t> v1(128);
  for (std::size_t i = 0; i < v1.size(); ++i) v1[i] = static_cast<std::uint8_t>(i * 7);
  const std::uint64_t weight = refit::delta::name_weight("w");
  const std::uint64_t sum1 = weight * refit::copy::checksum(v1.data(), v1.size());
  std::vector<std::uint8_t> v2;

  auto served = std::async(std::launch::async, [&] {
    std::vector<receiver_event> seen;
    for (int idle = 0; idle < 200;) {
      const auto e = r.serve_one(50ms);
      if (e == receiver_event::idle)
        ++idle;
      else
        seen.push_back(e);
      if (e == receiver_event::bye) break;
    }
    return seen;
  });
  {
    raw_streamer s(ep.name);
    // Version 1, whole, with its checksum.
    std::memcpy(s.buffer(0), v1.data(), v1.size());
    REQUIRE(error_of(s.request(wire::begin{1, false, {}})) == "OK");
    REQUIRE(error_of(s.request(wire::batch{
                1, 0, 0, {wire::entry{"w", dtype::bf16, {64}, 0, 128, 0, wire::entry_kind::bytes, 0}}})) == "OK");
    REQUIRE(error_of(s.request(wire::end{1, 1, 128, 1, sum1})) == "OK");

    // Version 2 changes elements 3 and 10; the patch carries a wrong value for element 10.
    v2 = v1;
    v2[6] = 1, v2[7] = 0, v2[20] = 2, v2[21] = 0;  // elements 3 and 10 become 1 and 2
    const std::uint64_t sum2 = weight * refit::copy::checksum(v2.data(), v2.size());
    const auto send_patch = [&](std::uint64_t version, std::uint32_t i0, std::uint32_t i1, std::uint16_t x1) {
      std::byte* b = s.buffer(0);
      const std::uint16_t x0 = 1;
      std::memcpy(b, &i0, 4), std::memcpy(b + 4, &i1, 4), std::memcpy(b + 8, &x0, 2), std::memcpy(b + 10, &x1, 2);
      REQUIRE(error_of(s.request(wire::begin{version, true, *r.committed_version()})) == "OK");
      return s.request(
          wire::batch{version, 0, 0, {wire::entry{"w", dtype::bf16, {64}, 0, 12, 0, wire::entry_kind::patch, 128}}});
    };
    REQUIRE(error_of(send_patch(2, 3, 10, 3)) == "OK");  // the batch is applied after its reply
    const std::string end2 = error_of(s.request(wire::end{2, 1, 12, 1, sum2}));
    CHECK_THAT(end2, Catch::StartsWith("apply: delta version 2 does not check out"));

    // The receiver is poisoned now: another delta is refused before anything is written.
    const std::string again = error_of(s.request(wire::begin{3, true, 1}));
    CHECK_THAT(again, Catch::StartsWith("needs_whole: delta version 3: this receiver is poisoned"));

    // A whole version cures it.
    std::memcpy(s.buffer(1), v2.data(), v2.size());
    REQUIRE(error_of(s.request(wire::begin{4, false, {}})) == "OK");
    REQUIRE(error_of(s.request(wire::batch{
                4, 0, 1, {wire::entry{"w", dtype::bf16, {64}, 0, 128, 0, wire::entry_kind::bytes, 0}}})) == "OK");
    REQUIRE(error_of(s.request(wire::end{4, 1, 128, 1, sum2})) == "OK");

    // A patch whose index is out of its span is refused before its batch writes anything: the
    // receiver aborts the delta, but is not poisoned (nothing of the delta was written).
    const std::string bad = error_of(send_patch(5, 3, 64, 2));
    const std::string end5 = bad == "OK" ? error_of(s.request(wire::end{5, 1, 12, 1, sum2})) : bad;
    CHECK_THAT(end5, Catch::Contains("the patch of 'w' is corrupt: change 1 names element 64 (out of the span)"));
    REQUIRE(error_of(s.request(wire::bye{})) == "OK");
  }
  const auto events = served.get();
  CHECK(r.committed_version() == std::optional<std::uint64_t>(4));
  CHECK_FALSE(r.poisoned());
  CHECK_FALSE(r.dirty());
  CHECK(weights == v2);
  CHECK(std::count(events.begin(), events.end(), receiver_event::committed) == 2);
}

// ------------------------------------------------------------------ a streamer killed mid-delta

namespace {

/// Yields `refs`; at tensor `block_at` tells the parent "blocked" and waits to be killed.
class blocking_source final : public refit::tensor_source {
 public:
  blocking_source(std::vector<refit::tensor_ref> refs, std::size_t block_at, rt::signal_pipe& to_parent)
      : refs_(std::move(refs)), block_at_(block_at), to_parent_(to_parent) {}
  std::optional<refit::tensor_ref> next() override {
    if (i_ == block_at_) {
      to_parent_.send("blocked");
      for (;;) ::pause();
    }
    if (i_ == refs_.size()) return std::nullopt;
    return refs_[i_++];
  }

 private:
  std::vector<refit::tensor_ref> refs_;
  std::size_t block_at_;
  rt::signal_pipe& to_parent_;
  std::size_t i_ = 0;
};

}  // namespace

TEST_CASE(
    "a streamer killed mid-delta leaves the receiver poisoned; the next streamer's refit is whole and "
    "cures it",
    "[delta]") {
  const rt::scoped_endpoint ep;
  const std::string& endpoint = ep.name;
  // Three large bf16 tensors: each one's patches fill most of a batch, so the first is applied
  // (in place) before the source blocks at the third.
  std::vector<refit::tensor_meta> metas;
  for (int k = 0; k < 3; ++k) metas.push_back({"layers." + std::to_string(k), dtype::bf16, {200000}});
  trainer t(metas);
  trainer t2 = t;
  t2.step(0.2);

  rt::signal_pipe from_s1;
  rt::child s1([&] {
    refit::streamer s(delta_streamer(endpoint));
    s.refit(1, t.refs());
    blocking_source source(t2.refs(), 2, from_s1);
    s.refit(2, source);
    throw std::runtime_error("the delta returned although its source blocked");
  });
  rt::signal_pipe to_s2;
  rt::child s2([&] {
    if (to_s2.receive(60s) != "go") throw std::runtime_error("streamer 2: expected go");
    refit::streamer s(delta_streamer(endpoint));
    s.refit(2, t2.refs());  // a new streamer holds no base: whole
    s.close();
  });

  engine e(metas, endpoint, 0, 2000ms);  // its idle timeout ends the killed streamer's delta
  std::vector<receiver_event> seen;
  const auto start = std::chrono::steady_clock::now();
  bool blocked = false;
  int batches_of_2 = 0;
  while (!blocked || batches_of_2 == 0) {
    REQUIRE(std::chrono::steady_clock::now() - start < 20s);
    const auto ev = e.r.serve_one(20ms);
    if (ev == receiver_event::aborted) FAIL("aborted: " << e.r.last_error());
    if (ev == receiver_event::batch && e.r.committed_version()) ++batches_of_2;
    if (!blocked) blocked = from_s1.try_receive(0ms) == std::optional<std::string>("blocked");
  }
  REQUIRE(e.r.committed_version() == std::optional<std::uint64_t>(1));
  s1.kill();
  CHECK(s1.wait(5s) == -SIGKILL);

  // The receiver gives the delta up at its idle timeout: poisoned.
  for (auto ev = e.r.serve_one(100ms); ev != receiver_event::aborted; ev = e.r.serve_one(100ms))
    REQUIRE(std::chrono::steady_clock::now() - start < 30s);
  CHECK(e.r.committed_version() == std::optional<std::uint64_t>(1));
  CHECK(e.r.dirty());
  CHECK(e.r.poisoned());
  CHECK_THAT(e.r.last_error(), Catch::StartsWith("poisoned: delta version 2 failed after patching"));

  to_s2.send("go");
  for (auto ev = e.r.serve_one(100ms); ev != receiver_event::committed; ev = e.r.serve_one(100ms))
    REQUIRE(std::chrono::steady_clock::now() - start < 40s);
  CHECK(e.r.committed_version() == std::optional<std::uint64_t>(2));
  CHECK_FALSE(e.r.dirty());
  CHECK_FALSE(e.r.poisoned());
  CHECK(e.differs_from(t2).empty());
  for (auto ev = e.r.serve_one(100ms); ev != receiver_event::bye; ev = e.r.serve_one(100ms))
    REQUIRE(std::chrono::steady_clock::now() - start < 50s);
  CHECK(s2.wait(20s) == 0);
}
