// plan/route: destination views reduced to runs, checked against a brute-force walk of every
// element, and the checks around them (check_view, route's fit, clip, footprint/overlaps).
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "copy/copy.hpp"
#include "plan/route.hpp"
#include "refit/error.hpp"
#include "refit/model.hpp"

using refit::dtype;
using refit::errc;
using refit::source_slice;
using refit::plan::run;

namespace Catch {
template <>
struct StringMaker<refit::plan::run> {
  static std::string convert(const refit::plan::run& r) {
    std::ostringstream s;
    s << "run{src " << r.src << ", src_pitch " << r.src_pitch << ", dst " << r.dst << ", dst_pitch " << r.dst_pitch
      << ", width " << r.width << ", rows " << r.rows << "}";
    return s.str();
  }
};
}  // namespace Catch

namespace {

using shape_t = std::vector<std::int64_t>;

refit::plan::destination make_dest(const std::string& name, dtype type, shape_t shape, void* data, shape_t strides = {},
                                   std::optional<source_slice> slice = std::nullopt, const void* alloc = nullptr,
                                   std::uint64_t alloc_bytes = 0) {
  refit::tensor_dest d;
  d.meta = refit::tensor_meta{name, type, std::move(shape)};
  d.data = data;
  refit::dest_layout l;
  l.strides = std::move(strides);
  l.slice = slice;
  l.alloc = alloc;
  l.alloc_bytes = alloc_bytes;
  return refit::plan::destination(d, l);
}

std::string str(const shape_t& v) {
  std::ostringstream s;
  s << "(";
  for (std::size_t k = 0; k < v.size(); ++k) s << (k ? ", " : "") << v[k];
  s << ")";
  return s.str();
}

/// Dense row-major strides (elements) of a shape.
shape_t dense_strides(const shape_t& shape) {
  shape_t s(shape.size(), 1);
  for (std::size_t k = s.size(); k-- > 1;) s[k - 1] = s[k] * shape[k];
  return s;
}

std::int64_t numel(const shape_t& shape) {
  return std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
}

/// Calls `f` for every element index of `shape`, row-major (once for a 0-d shape, never when a
/// dimension is 0).
template <class F>
void for_each_index(const shape_t& shape, F&& f) {
  if (numel(shape) == 0) return;
  std::vector<std::int64_t> idx(shape.size(), 0);
  for (;;) {
    f(idx);
    std::size_t k = shape.size();
    for (; k-- > 0;) {
      if (++idx[k] < shape[k]) break;
      idx[k] = 0;
    }
    if (k == static_cast<std::size_t>(-1)) return;
  }
}

template <class F>
void expect_error(F&& f, errc code, const std::string& name) {
  try {
    f();
    FAIL_CHECK("no exception was thrown");
  } catch (const refit::error& e) {
    CHECK(e.code() == code);
    CHECK_THAT(e.what(), Catch::Matchers::Contains(name));
  } catch (const std::exception& e) {
    FAIL_CHECK("an exception other than refit::error: " << e.what());
  }
}

constexpr std::array<std::array<dtype, 3>, 4> by_size{{
    {dtype::u8, dtype::i8, dtype::f8_e4m3},
    {dtype::bf16, dtype::f16, dtype::u16},
    {dtype::f32, dtype::i32, dtype::u32},
    {dtype::f64, dtype::i64, dtype::u64},
}};

std::int64_t uniform(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
}

/// A view into an "engine" buffer as an engine lays it out: a narrowing of a bigger contiguous
/// tensor whose outer dimensions may be stored in another order (the innermost dimension of size
/// > 1 stays innermost, so the view's rows are dense), with an optional slice of its source.
struct view_case {
  dtype type = dtype::u8;
  std::uint64_t item = 1;
  shape_t shape;             // the view
  shape_t strides;           // as registered (empty: dense)
  shape_t eff;               // the view's strides, always filled
  std::uint64_t offset = 0;  // the view's first byte in the engine buffer
  std::uint64_t engine_bytes = 0;
  std::optional<source_slice> slice;
  shape_t source;           // the source's shape
  shape_t big;              // the engine tensor the view narrows
  std::uint64_t front = 0;  // its first byte in the engine buffer

  [[nodiscard]] std::uint64_t source_bytes() const { return static_cast<std::uint64_t>(numel(source)) * item; }

  [[nodiscard]] std::string describe() const {
    std::ostringstream s;
    s << "itemsize " << item << " view " << str(shape) << " strides " << str(strides) << " (effective " << str(eff)
      << ") at byte " << offset << " of " << engine_bytes << ", source " << str(source);
    if (slice) s << " slice (dim " << slice->dim << ", start " << slice->start << ", length " << slice->length << ")";
    return s.str();
  }

  [[nodiscard]] refit::plan::destination dest(std::uint8_t* engine, bool bounded) const {
    return make_dest("model.layers.0.w", type, shape, engine + offset, strides, slice, bounded ? engine : nullptr,
                     bounded ? engine_bytes : 0);
  }
};

view_case random_view(std::mt19937_64& rng, bool allow_slice = true) {
  view_case c;
  const auto& types = by_size[static_cast<std::size_t>(uniform(rng, 0, 3))];
  c.type = types[static_cast<std::size_t>(uniform(rng, 0, 2))];
  c.item = refit::itemsize(c.type);
  const auto rank = static_cast<std::size_t>(uniform(rng, 1, 4));
  c.shape.resize(rank);
  for (auto& n : c.shape) n = uniform(rng, 1, 7);
  const bool dense = uniform(rng, 0, 7) == 0;
  shape_t big = c.shape;
  if (!dense)
    for (auto& n : big) n += uniform(rng, 0, 3);
  // Storage order: a permutation of the dimensions, the innermost of size > 1 last.
  std::vector<std::size_t> order(rank);
  std::iota(order.begin(), order.end(), std::size_t{0});
  if (!dense) {
    std::shuffle(order.begin(), order.end(), rng);
    for (std::size_t k = rank; k-- > 0;)
      if (c.shape[k] > 1) {
        order.erase(std::find(order.begin(), order.end(), k));
        order.push_back(k);
        break;
      }
  }
  c.eff.assign(rank, 0);
  std::int64_t running = 1;
  for (std::size_t j = rank; j-- > 0;) {
    c.eff[order[j]] = running;
    running *= big[order[j]];
  }
  std::int64_t first = 0;  // element offset of the view in the big tensor
  for (std::size_t k = 0; k < rank; ++k) first += uniform(rng, 0, big[k] - c.shape[k]) * c.eff[k];
  const auto front = static_cast<std::uint64_t>(uniform(rng, 0, 9));
  c.big = big;
  c.front = front;
  c.offset = front + static_cast<std::uint64_t>(first) * c.item;
  const auto back = static_cast<std::uint64_t>(uniform(rng, 0, 9));
  c.engine_bytes = front + static_cast<std::uint64_t>(running) * c.item + back;
  if (!(dense && uniform(rng, 0, 1) == 0)) c.strides = c.eff;  // dense views sometimes give no strides
  c.source = c.shape;
  if (allow_slice && uniform(rng, 0, 1) == 0) {
    const auto dim = static_cast<std::size_t>(uniform(rng, 0, static_cast<std::int64_t>(rank) - 1));
    const std::int64_t extra = uniform(rng, 0, 4);
    c.source[dim] += extra;
    c.slice = source_slice{static_cast<int>(dim), uniform(rng, 0, extra), c.shape[dim]};
  }
  return c;
}

/// Source byte i: a hash, so that a byte moved from the wrong place shows.
std::uint8_t source_byte(std::uint64_t i) {
  std::uint64_t z = i + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return static_cast<std::uint8_t>(z ^ (z >> 31));
}

constexpr std::int64_t unwritten = -1;

/// For each engine byte, the source byte the view holds there (unwritten outside the view): every
/// element of the view in row-major order, the source dense row-major with the slice's offset.
std::vector<std::int64_t> reference_map(const view_case& c) {
  std::vector<std::int64_t> map(c.engine_bytes, unwritten);
  const shape_t ss = dense_strides(c.source);
  const std::int64_t base = c.slice ? c.slice->start * ss[static_cast<std::size_t>(c.slice->dim)] : 0;
  const auto item = static_cast<std::int64_t>(c.item);
  for_each_index(c.shape, [&](const std::vector<std::int64_t>& idx) {
    std::int64_t s = base;
    std::int64_t t = 0;
    for (std::size_t k = 0; k < idx.size(); ++k) {
      s += idx[k] * ss[k];
      t += idx[k] * c.eff[k];
    }
    for (std::int64_t b = 0; b < item; ++b) map.at(c.offset + static_cast<std::uint64_t>(t * item + b)) = s * item + b;
  });
  return map;
}

/// What applying runs did: the source byte each engine byte received, how often each was written,
/// and whether a run reached outside the buffers (then nothing past that point was applied).
struct applied {
  std::vector<std::int64_t> map;
  std::vector<int> writes;
  std::vector<std::uint8_t> bytes;
  bool out_of_bounds = false;
};

applied apply(const view_case& c, const std::vector<run>& runs, const std::vector<std::uint8_t>& source,
              std::uint8_t fill) {
  applied a{std::vector<std::int64_t>(c.engine_bytes, unwritten), std::vector<int>(c.engine_bytes, 0),
            std::vector<std::uint8_t>(c.engine_bytes, fill), false};
  for (const run& r : runs)
    for (std::uint64_t i = 0; i < r.rows; ++i) {
      const std::uint64_t s = r.src + i * r.src_pitch;
      const std::uint64_t t = c.offset + r.dst + i * r.dst_pitch;
      if (s + r.width > source.size() || t + r.width > c.engine_bytes) {
        a.out_of_bounds = true;
        return a;
      }
      std::memcpy(a.bytes.data() + t, source.data() + s, r.width);
      for (std::uint64_t j = 0; j < r.width; ++j) {
        a.map[t + j] = static_cast<std::int64_t>(s + j);
        ++a.writes[t + j];
      }
    }
  return a;
}

std::vector<std::uint8_t> source_bytes(std::uint64_t n) {
  std::vector<std::uint8_t> s(n);
  for (std::uint64_t i = 0; i < n; ++i) s[i] = source_byte(i);
  return s;
}

/// The engine buffer the reference walk leaves: `fill` outside the view, source bytes inside.
std::vector<std::uint8_t> reference_bytes(const std::vector<std::int64_t>& map, const std::vector<std::uint8_t>& source,
                                          std::uint8_t fill) {
  std::vector<std::uint8_t> out(map.size(), fill);
  for (std::size_t i = 0; i < map.size(); ++i)
    if (map[i] != unwritten) out[i] = source[static_cast<std::size_t>(map[i])];
  return out;
}

/// True when the runs read source bytes in increasing order (each row after the previous one).
bool reads_in_order(const std::vector<run>& runs) {
  std::uint64_t end = 0;
  for (const run& r : runs)
    for (std::uint64_t i = 0; i < r.rows; ++i) {
      if (r.src + i * r.src_pitch < end) return false;
      end = r.src + i * r.src_pitch + r.width;
    }
  return true;
}

bool no_empty_run(const std::vector<run>& runs) {
  return std::all_of(runs.begin(), runs.end(), [](const run& r) { return r.rows > 0 && r.width > 0; });
}

}  // namespace

// ------------------------------------------------------------------------------------- route()

TEST_CASE("route moves every element of random strided views and slices where a brute-force walk puts it", "[route]") {
  std::mt19937_64 rng(20240611);
  int sliced = 0;
  int strided = 0;
  int multi_run = 0;
  for (int n = 0; n < 4000; ++n) {
    const view_case c = random_view(rng);
    INFO("case " << n << ": " << c.describe());
    std::vector<std::uint8_t> engine(c.engine_bytes);
    const refit::plan::destination d = c.dest(engine.data(), n % 2 == 0);

    const refit::plan::extent e = refit::plan::check_view(d);
    std::int64_t last = 0;
    for (std::size_t k = 0; k < c.shape.size(); ++k) last += (c.shape[k] - 1) * c.eff[k];
    REQUIRE(e.bytes == static_cast<std::uint64_t>(last + 1) * c.item);

    const std::vector<run> runs = refit::plan::route(d, c.type, c.source);
    INFO("runs: " << Catch::Detail::stringify(runs));
    REQUIRE(no_empty_run(runs));
    REQUIRE(reads_in_order(runs));
    REQUIRE(refit::plan::bytes_of(runs) == static_cast<std::uint64_t>(numel(c.shape)) * c.item);

    const std::vector<std::uint8_t> source = source_bytes(c.source_bytes());
    const applied got = apply(c, runs, source, 0xA5);
    REQUIRE_FALSE(got.out_of_bounds);
    REQUIRE(std::all_of(got.writes.begin(), got.writes.end(), [](int w) { return w <= 1; }));
    const std::vector<std::int64_t> want = reference_map(c);
    REQUIRE(got.map == want);
    REQUIRE(got.bytes == reference_bytes(want, source, 0xA5));  // equal inside, untouched outside

    sliced += c.slice ? 1 : 0;
    strided += c.strides.empty() ? 0 : 1;
    multi_run += runs.size() > 1 || (!runs.empty() && runs[0].rows > 1) ? 1 : 0;
  }
  // The generator reached the cases that matter.
  CHECK(sliced > 1000);
  CHECK(strided > 1000);
  CHECK(multi_run > 1000);
}

// --------------------------------------------------------------------------------------- clip()

namespace {

/// Destination byte -> source byte for the bytes of `r` whose source is in [from, to).
std::map<std::uint64_t, std::uint64_t> expected_clip(const run& r, std::uint64_t from, std::uint64_t to) {
  std::map<std::uint64_t, std::uint64_t> m;
  for (std::uint64_t i = 0; i < r.rows; ++i)
    for (std::uint64_t j = 0; j < r.width; ++j) {
      const std::uint64_t s = r.src + i * r.src_pitch + j;
      if (s >= from && s < to) m[r.dst + i * r.dst_pitch + j] = s;
    }
  return m;
}

/// Destination byte -> source byte of the runs; false in `once` when a byte is written twice.
std::map<std::uint64_t, std::uint64_t> written(const std::vector<run>& runs, bool& once) {
  std::map<std::uint64_t, std::uint64_t> m;
  once = true;
  for (const run& r : runs)
    for (std::uint64_t i = 0; i < r.rows; ++i)
      for (std::uint64_t j = 0; j < r.width; ++j)
        once = m.emplace(r.dst + i * r.dst_pitch + j, r.src + i * r.src_pitch + j).second && once;
  return m;
}

run random_run(std::mt19937_64& rng) {
  run r;
  r.width = static_cast<std::uint64_t>(uniform(rng, 1, 8));
  r.rows = static_cast<std::uint64_t>(uniform(rng, 1, 6));
  r.src = static_cast<std::uint64_t>(uniform(rng, 0, 20));
  r.dst = static_cast<std::uint64_t>(uniform(rng, 0, 20));
  // As route makes them: rows don't overlap; a one-row run may carry any pitch (0 included).
  if (r.rows == 1 && uniform(rng, 0, 1) == 0) {
    r.src_pitch = static_cast<std::uint64_t>(uniform(rng, 0, 12));
    r.dst_pitch = static_cast<std::uint64_t>(uniform(rng, 0, 12));
  } else {
    r.src_pitch = r.width + static_cast<std::uint64_t>(uniform(rng, 0, 5));
    r.dst_pitch = r.width + static_cast<std::uint64_t>(uniform(rng, 0, 5));
  }
  return r;
}

/// A byte offset around `r`: half the time a row's edge (± 1), else anywhere from 0 to past the end.
std::uint64_t random_cut(std::mt19937_64& rng, const run& r) {
  const std::uint64_t end = r.src + (r.rows - 1) * r.src_pitch + r.width;
  if (uniform(rng, 0, 1) == 0) return static_cast<std::uint64_t>(uniform(rng, 0, static_cast<std::int64_t>(end) + 4));
  const auto i = static_cast<std::uint64_t>(uniform(rng, 0, static_cast<std::int64_t>(r.rows) - 1));
  const std::uint64_t edge = r.src + i * r.src_pitch + (uniform(rng, 0, 1) ? r.width : 0);
  const std::int64_t nudge = uniform(rng, -1, 1);
  return nudge < 0 && edge == 0 ? 0 : edge + static_cast<std::uint64_t>(nudge);
}

}  // namespace

TEST_CASE("clip keeps exactly the bytes of a run whose source lies in a byte range", "[route]") {
  std::mt19937_64 rng(77);
  for (int n = 0; n < 20000; ++n) {
    const run r = random_run(rng);
    std::uint64_t from = random_cut(rng, r);
    std::uint64_t to = random_cut(rng, r);
    if (n % 10 != 0 && from > to) std::swap(from, to);  // one in ten keeps a reversed (empty) range
    INFO("case " << n << ": " << Catch::Detail::stringify(r) << " clipped to [" << from << ", " << to << ")");
    std::vector<run> out;
    refit::plan::clip(r, from, to, out);
    INFO("clipped: " << Catch::Detail::stringify(out));
    REQUIRE(out.size() <= 3);
    REQUIRE(no_empty_run(out));
    // Before walking them byte by byte: no piece wider or taller than the run.
    REQUIRE(std::all_of(out.begin(), out.end(), [&](const run& x) { return x.width <= r.width && x.rows <= r.rows; }));
    bool once = false;
    const auto got = written(out, once);
    REQUIRE(once);
    REQUIRE(got == expected_clip(r, from, to));
    REQUIRE(refit::plan::bytes_of(out) == got.size());
  }
}

TEST_CASE("clip to a range covering a run returns the run itself and to a range outside it nothing", "[route]") {
  const run r{100, 40, 8, 64, 16, 5};  // source bytes [100, 116), [140, 156), ... [260, 276)
  std::vector<run> out;
  refit::plan::clip(r, 0, 1000, out);
  CHECK(out == std::vector<run>{r});
  out.clear();
  refit::plan::clip(r, 100, 276, out);
  CHECK(out == std::vector<run>{r});
  out.clear();
  refit::plan::clip(r, 0, 100, out);
  refit::plan::clip(r, 276, 1000, out);
  refit::plan::clip(r, 116, 140, out);  // the gap between rows 0 and 1
  refit::plan::clip(r, 150, 150, out);  // empty
  refit::plan::clip(r, 200, 150, out);  // reversed
  CHECK(out.empty());
  // Partial first row (0), two whole rows (1, 2), partial last row (3).
  refit::plan::clip(r, 110, 230, out);
  CHECK(out == std::vector<run>{run{110, 40, 18, 64, 6, 1}, run{140, 40, 72, 64, 16, 2}, run{220, 40, 200, 64, 10, 1}});
  // Row edges: whole rows only.
  out.clear();
  refit::plan::clip(r, 140, 236, out);
  CHECK(out == std::vector<run>{run{140, 40, 72, 64, 16, 3}});
  out.clear();
  refit::plan::clip(r, 130, 250, out);  // from and to in the gaps
  CHECK(out == std::vector<run>{run{140, 40, 72, 64, 16, 3}});
  // Inside one row.
  out.clear();
  refit::plan::clip(r, 143, 147, out);
  CHECK(out == std::vector<run>{run{143, 40, 75, 64, 4, 1}});
}

TEST_CASE("clipping a route to consecutive random chunks of its source writes every destination byte once", "[route]") {
  std::mt19937_64 rng(4242);
  for (int n = 0; n < 3000; ++n) {
    const view_case c = random_view(rng);
    std::vector<std::uint8_t> engine(c.engine_bytes);
    const std::vector<run> runs = refit::plan::route(c.dest(engine.data(), false), c.type, c.source);
    const std::uint64_t total = c.source_bytes();
    // Chunks [cuts[i], cuts[i + 1]) of [0, total): some one byte long, some on element edges.
    std::vector<std::uint64_t> cuts{0};
    while (cuts.back() < total) {
      const std::int64_t left = static_cast<std::int64_t>(total - cuts.back());
      std::int64_t step = uniform(rng, 1, std::max<std::int64_t>(1, left / 2));
      if (uniform(rng, 0, 2) == 0)
        step = std::max<std::int64_t>(1, step / static_cast<std::int64_t>(c.item) * static_cast<std::int64_t>(c.item));
      if (uniform(rng, 0, 5) == 0) step = left;
      cuts.push_back(std::min(total, cuts.back() + static_cast<std::uint64_t>(step)));
    }
    std::ostringstream chunks;
    for (const auto x : cuts) chunks << x << ' ';
    INFO("case " << n << ": " << c.describe() << "; runs " << Catch::Detail::stringify(runs) << "; cuts "
                 << chunks.str());

    std::vector<run> pieces;
    bool in_range = true;
    for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
      const std::size_t before = pieces.size();
      for (const run& r : runs) refit::plan::clip(r, cuts[i], cuts[i + 1], pieces);
      for (std::size_t p = before; p < pieces.size(); ++p) {
        const run& x = pieces[p];
        in_range = in_range && x.src >= cuts[i] && x.src + (x.rows - 1) * x.src_pitch + x.width <= cuts[i + 1];
      }
    }
    REQUIRE(in_range);  // a chunk's pieces read only that chunk
    REQUIRE(no_empty_run(pieces));
    const std::vector<std::uint8_t> source = source_bytes(total);
    const applied got = apply(c, pieces, source, 0x3C);
    REQUIRE_FALSE(got.out_of_bounds);
    REQUIRE(std::all_of(got.writes.begin(), got.writes.end(), [](int w) { return w <= 1; }));
    const std::vector<std::int64_t> want = reference_map(c);
    REQUIRE(got.map == want);
    REQUIRE(got.bytes == reference_bytes(want, source, 0x3C));
  }
}

TEST_CASE(
    "a part sent as an nccl parts session sends it (its source range, or gathered run by run) lands where the "
    "reference walk puts it, received in one range or unpacked run by run",
    "[route]") {
  using refit::plan::contiguous;
  std::mt19937_64 rng(777);
  std::size_t gathered = 0, scattered = 0, straight = 0;
  for (int n = 0; n < 3000; ++n) {
    const view_case c = random_view(rng);
    std::vector<std::uint8_t> engine(c.engine_bytes, 0x3C);
    const std::vector<run> runs = refit::plan::route(c.dest(engine.data(), false), c.type, c.source);
    const std::uint64_t total = c.source_bytes();
    const std::vector<std::uint8_t> source = source_bytes(total);
    // Batch entries: consecutive random ranges of the source.
    std::vector<std::uint64_t> cuts{0};
    while (cuts.back() < total)
      cuts.push_back(
          std::min(total, cuts.back() + static_cast<std::uint64_t>(uniform(
                                            rng, 1, std::max<std::int64_t>(1, static_cast<std::int64_t>(total / 3))))));
    INFO("case " << n << ": " << c.describe() << "; runs " << Catch::Detail::stringify(runs));
    std::vector<run> pieces;
    for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
      pieces.clear();
      for (const run& r : runs) refit::plan::clip(r, cuts[i], cuts[i + 1], pieces);
      if (pieces.empty()) continue;
      const std::uint64_t n_bytes = refit::plan::bytes_of(pieces);
      // The streamer's side (split_parts): one range of the source, sent from there; else each
      // run's rows gathered in order.
      std::vector<std::uint8_t> wire;
      if (const auto lo = contiguous(pieces, true)) {
        wire.assign(source.begin() + static_cast<std::ptrdiff_t>(*lo),
                    source.begin() + static_cast<std::ptrdiff_t>(*lo + n_bytes));
      } else {
        ++gathered;
        for (const run& r : pieces)
          for (std::uint64_t row = 0; row < r.rows; ++row) {
            const auto at = static_cast<std::ptrdiff_t>(r.src + row * r.src_pitch);
            wire.insert(wire.end(), source.begin() + at, source.begin() + at + static_cast<std::ptrdiff_t>(r.width));
          }
      }
      REQUIRE(wire.size() == n_bytes);
      // The receiver's side (table_ops): one range of its destination, received there; else into
      // scatter memory and unpacked run by run.
      std::uint8_t* view = engine.data() + c.offset;
      if (const auto at = contiguous(pieces, false)) {
        ++straight;
        std::memcpy(view + *at, wire.data(), wire.size());
      } else {
        ++scattered;
        std::uint64_t cursor = 0;
        for (const run& r : pieces)
          for (std::uint64_t row = 0; row < r.rows; ++row) {
            std::memcpy(view + r.dst + row * r.dst_pitch, wire.data() + cursor, r.width);
            cursor += r.width;
          }
      }
    }
    REQUIRE(engine == reference_bytes(reference_map(c), source, 0x3C));
  }
  // Every kind was drawn often.
  CHECK(gathered > 300);
  CHECK(scattered > 300);
  CHECK(straight > 300);
}

// --------------------------------------------------------------------------------- check_view()

TEST_CASE("check_view refuses a view that cannot be written and names the tensor", "[route]") {
  std::vector<std::uint8_t> buf(4096);
  std::uint8_t* p = buf.data() + 64;
  const std::string name = "model.layers.3.mlp.down_proj.weight";
  const auto refused = [&](const refit::plan::destination& d) {
    expect_error([&] { (void)refit::plan::check_view(d); }, errc::invalid_argument, name);
  };

  SECTION("a negative stride") {
    refused(make_dest(name, dtype::f32, {4, 3}, p, {-3, 1}));
    refused(make_dest(name, dtype::f32, {4, 3}, p, {-1, 1}));
    refused(make_dest(name, dtype::f32, {4, 1}, p, {1, -1}));  // even on a dimension of size 1
  }
  SECTION("too few or too many strides") {
    refused(make_dest(name, dtype::f32, {4, 3}, p, {1}));
    refused(make_dest(name, dtype::f32, {4, 3}, p, {30, 3, 1}));
  }
  SECTION("a view that overlaps itself") {
    refused(make_dest(name, dtype::f32, {4, 3}, p, {0, 1}));          // stride 0 on a dimension of 4
    refused(make_dest(name, dtype::f32, {4, 3}, p, {2, 1}));          // rows of 3 two elements apart
    refused(make_dest(name, dtype::f32, {2, 4, 3}, p, {13, 12, 1}));  // (1, 0, 0) and (0, 1, 1) are one element
  }
  SECTION("a slice of a dimension the view does not have") {
    refused(make_dest(name, dtype::f32, {4, 3}, p, {}, source_slice{2, 0, 3}));
    refused(make_dest(name, dtype::f32, {4, 3}, p, {}, source_slice{-1, 0, 4}));
  }
  SECTION("a slice with a negative start") {
    refused(make_dest(name, dtype::f32, {4, 3}, p, {}, source_slice{0, -1, 4}));
  }
  SECTION("a slice whose end overflows a 64-bit index") {
    const std::int64_t start = std::numeric_limits<std::int64_t>::max() - 3;
    refused(make_dest(name, dtype::f32, {4, 3}, p, {}, source_slice{0, start, 4}));
  }
  SECTION("a slice whose length is not the view's size along its dimension") {
    refused(make_dest(name, dtype::f32, {4, 3}, p, {}, source_slice{0, 0, 3}));
    refused(make_dest(name, dtype::f32, {4, 3}, p, {3, 1}, source_slice{1, 2, 4}));
  }
  SECTION("strides whose span overflows") {
    refused(make_dest(name, dtype::f64, {2, 2}, p, {std::int64_t{1} << 62, 1}));
  }
  SECTION("a view that leaves its allocation") {
    // [4, 3] f32 with strides (10, 1): 132 bytes from its first.
    refused(make_dest(name, dtype::f32, {4, 3}, p, {10, 1}, std::nullopt, p, 131));      // one byte past the end
    refused(make_dest(name, dtype::f32, {4, 3}, p, {10, 1}, std::nullopt, p + 8, 200));  // starts before it
    refused(make_dest(name, dtype::f32, {4, 3}, p + 100, {10, 1}, std::nullopt, p, 200));
  }
}

TEST_CASE("check_view returns the bytes a valid view spans", "[route]") {
  std::vector<std::uint8_t> buf(4096);
  std::uint8_t* p = buf.data();
  const std::string name = "w";
  CHECK(refit::plan::check_view(make_dest(name, dtype::f32, {4, 3}, p, {10, 1})).bytes == (3 * 10 + 2 + 1) * 4);
  CHECK(refit::plan::check_view(make_dest(name, dtype::f32, {4, 3}, p)).bytes == 48);
  CHECK(refit::plan::check_view(make_dest(name, dtype::bf16, {4, 3}, p, {3, 1})).bytes == 24);
  CHECK(refit::plan::check_view(make_dest(name, dtype::bf16, {2, 4, 3}, p, {3, 6, 1})).bytes == (3 + 18 + 2 + 1) * 2);
  CHECK(refit::plan::check_view(make_dest(name, dtype::f64, {}, p)).bytes == 8);
  CHECK(refit::plan::check_view(make_dest(name, dtype::f64, {}, p, {}, std::nullopt, p, 8)).bytes == 8);
  CHECK(refit::plan::check_view(make_dest(name, dtype::f32, {4, 0}, nullptr, {10, 1})).bytes == 0);
  // Size-1 dimensions take any stride, the last one included.
  CHECK(refit::plan::check_view(make_dest(name, dtype::f32, {1, 4, 1}, p, {0, 1, 123})).bytes == 4 * 4);
  CHECK(refit::plan::check_view(make_dest(name, dtype::f32, {3, 1}, p, {1, 0})).bytes == 3 * 4);
  // A slice of the right length.
  CHECK(refit::plan::check_view(make_dest(name, dtype::f32, {4, 3}, p, {10, 1}, source_slice{1, 5, 3})).bytes == 132);
  // Exactly filling its allocation, from its first byte or from further in.
  CHECK(refit::plan::check_view(make_dest(name, dtype::f32, {4, 3}, p, {10, 1}, std::nullopt, p, 132)).bytes == 132);
  CHECK(refit::plan::check_view(make_dest(name, dtype::f32, {4, 3}, p + 68, {10, 1}, std::nullopt, p, 200)).bytes ==
        132);
}

// ---------------------------------------------------------------------------- route()'s errors

TEST_CASE("route refuses a source that does not fit the view and names the tensor", "[route]") {
  std::vector<std::uint8_t> buf(4096);
  const std::string name = "lm_head.weight";
  const auto d = make_dest(name, dtype::bf16, {4, 6}, buf.data(), {8, 1});
  const auto sliced = make_dest(name, dtype::bf16, {4, 6}, buf.data(), {8, 1}, source_slice{1, 2, 6});
  const auto refused = [&](const refit::plan::destination& dest, dtype t, const shape_t& shape) {
    expect_error([&] { (void)refit::plan::route(dest, t, shape); }, errc::apply, name);
  };
  SECTION("another dtype") {
    refused(d, dtype::f16, {4, 6});
    refused(sliced, dtype::f32, {4, 8});
  }
  SECTION("another rank") {
    refused(d, dtype::bf16, {24});
    refused(d, dtype::bf16, {1, 4, 6});
    refused(sliced, dtype::bf16, {4, 8, 1});
  }
  SECTION("a dimension outside the slice's differs") {
    refused(d, dtype::bf16, {4, 7});
    refused(d, dtype::bf16, {5, 6});
    refused(sliced, dtype::bf16, {5, 8});
    refused(sliced, dtype::bf16, {3, 8});
  }
  SECTION("a slice past the source's end") {
    refused(sliced, dtype::bf16, {4, 7});  // needs [2, 8)
    refused(sliced, dtype::bf16, {4, 6});
    CHECK(refit::plan::route(sliced, dtype::bf16, shape_t{4, 8}).size() == 1);  // [2, 8) of 8 fits
    // Not checked by check_view first: a start that would overflow, or a negative one.
    refused(make_dest(name, dtype::bf16, {4, 6}, buf.data(), {8, 1},
                      source_slice{1, std::numeric_limits<std::int64_t>::max() - 2, 6}),
            dtype::bf16, {4, 8});
    refused(make_dest(name, dtype::bf16, {4, 6}, buf.data(), {8, 1}, source_slice{1, -1, 6}), dtype::bf16, {4, 8});
  }
}

TEST_CASE("route gives no runs for a view without elements and one item for a 0-d view", "[route]") {
  std::vector<std::uint8_t> buf(64);
  CHECK(refit::plan::route(make_dest("e", dtype::f32, {3, 0}, nullptr), dtype::f32, shape_t{3, 0}).empty());
  CHECK(refit::plan::route(make_dest("e", dtype::f32, {0}, nullptr, {1}), dtype::f32, shape_t{0}).empty());
  CHECK(refit::plan::route(make_dest("e", dtype::f32, {0, 5}, nullptr, {9, 1}, source_slice{1, 2, 5}), dtype::f32,
                           shape_t{0, 9})
            .empty());
  CHECK(refit::plan::footprint(make_dest("e", dtype::f32, {3, 0}, nullptr)).empty());
  for (const dtype t : {dtype::u8, dtype::bf16, dtype::f32, dtype::f64}) {
    const auto d = make_dest("scalar", t, {}, buf.data());
    CHECK(refit::plan::route(d, t, shape_t{}) == std::vector<run>{run{0, 0, 0, 0, refit::itemsize(t), 1}});
    CHECK(refit::plan::footprint(d) == std::vector<run>{run{0, 0, 0, 0, refit::itemsize(t), 1}});
  }
}

TEST_CASE("route refuses a view split into more than max_runs blocks", "[route]") {
  // [257, 257, 2, 2] out of [257, 257, 4, 4]: 257 · 257 blocks of 2 rows.
  const auto many = make_dest("experts", dtype::u8, {257, 257, 2, 2}, nullptr, {257 * 16, 16, 4, 1});
  expect_error(
      [&] {
        (void)refit::plan::route(many, dtype::u8, shape_t{257, 257, 2, 2});
      },
      errc::invalid_argument, "experts");
  // 65,537 blocks, one past the limit.
  const auto one_more = make_dest("experts", dtype::u8, {65537, 2, 2}, nullptr, {16, 4, 1});
  expect_error(
      [&] {
        (void)refit::plan::route(one_more, dtype::u8, shape_t{65537, 2, 2});
      },
      errc::invalid_argument, "experts");
  const auto most = make_dest("experts", dtype::u8, {256, 256, 2, 2}, nullptr, {256 * 16, 16, 4, 1});
  const auto runs = refit::plan::route(most, dtype::u8, shape_t{256, 256, 2, 2});
  REQUIRE(runs.size() == refit::plan::max_runs);
  CHECK(runs[1] == run{4, 2, 16, 4, 2, 2});
  CHECK(runs.back() == run{(65536 - 1) * 4, 2, (255 * 256 + 255) * 16, 4, 2, 2});
}

// ---------------------------------------------------------------------------------- is_plain()

TEST_CASE("is_plain holds for a dense view taking its whole source and for nothing else", "[route]") {
  std::vector<std::uint8_t> buf(4096);
  void* p = buf.data();
  CHECK(refit::plan::is_plain(make_dest("w", dtype::f32, {4, 3}, p)));
  CHECK(refit::plan::is_plain(make_dest("w", dtype::f32, {}, p)));
  CHECK(refit::plan::is_plain(make_dest("w", dtype::f32, {4, 3}, p, {3, 1})));
  CHECK(refit::plan::is_plain(make_dest("w", dtype::f32, {2, 4, 3}, p, {12, 3, 1})));
  CHECK(refit::plan::is_plain(make_dest("w", dtype::f32, {1, 4, 1, 3}, p, {999, 3, 0, 1})));
  CHECK(refit::plan::is_plain(make_dest("w", dtype::f32, {4, 1}, p, {1, 5})));
  CHECK_FALSE(refit::plan::is_plain(make_dest("w", dtype::f32, {4, 3}, p, {}, source_slice{0, 0, 4})));
  CHECK_FALSE(refit::plan::is_plain(make_dest("w", dtype::f32, {4, 3}, p, {3, 1}, source_slice{1, 0, 3})));
  CHECK_FALSE(refit::plan::is_plain(make_dest("w", dtype::f32, {4, 3}, p, {4, 1})));
  CHECK_FALSE(refit::plan::is_plain(make_dest("w", dtype::f32, {2, 4, 3}, p, {3, 6, 1})));
  // is_dense: the same views, whatever part of the source they take.
  CHECK(refit::plan::is_dense(make_dest("w", dtype::f32, {4, 3}, p, {}, source_slice{0, 0, 4})));
  CHECK(refit::plan::is_dense(make_dest("w", dtype::f32, {4, 3}, p, {3, 1}, source_slice{1, 0, 3})));
  CHECK(refit::plan::is_dense(make_dest("w", dtype::f32, {1, 4, 1, 3}, p, {999, 3, 0, 1})));
  CHECK_FALSE(refit::plan::is_dense(make_dest("w", dtype::f32, {4, 3}, p, {4, 1}, source_slice{1, 0, 3})));
  CHECK_FALSE(refit::plan::is_dense(make_dest("w", dtype::f32, {2, 4, 3}, p, {3, 6, 1})));
}

// ------------------------------------------------------------------------ footprint(), overlaps()

namespace {

/// Another narrowing of the engine tensor `a` narrows, its rows dense as well.
view_case renarrow(std::mt19937_64& rng, const view_case& a) {
  view_case b = a;
  const std::size_t rank = a.shape.size();
  std::size_t inner = rank;  // the dimension of stride 1 that has more than one element
  for (std::size_t k = 0; k < rank; ++k)
    if (a.eff[k] == 1 && a.big[k] > 1) inner = k;
  b.offset = a.front;
  for (std::size_t k = 0; k < rank; ++k) {
    // Dimensions inside the dense one keep one element, so b's rows stay dense.
    const std::int64_t len = k > inner && inner != rank ? 1 : uniform(rng, k == inner ? 2 : 1, a.big[k]);
    b.offset += static_cast<std::uint64_t>(uniform(rng, 0, a.big[k] - len) * a.eff[k]) * a.item;
    b.shape[k] = len;
  }
  if (inner == rank) std::fill(b.shape.begin(), b.shape.end(), 1);
  b.strides = b.eff;
  b.source = b.shape;
  return b;
}

std::uintptr_t at(std::uint64_t byte) { return 0x7f0000000000ull + byte; }

/// The footprint of a [rows, cols] narrowing at (r0, c0) of a row-major [8, 6] f32 tensor.
struct narrowing {
  std::uintptr_t addr;
  std::vector<run> fp;
};

narrowing narrow86(std::int64_t r0, std::int64_t rows, std::int64_t c0, std::int64_t cols) {
  const auto d = make_dest("w", dtype::f32, {rows, cols}, nullptr, {6, 1});
  return {at(static_cast<std::uint64_t>(r0 * 6 + c0) * 4), refit::plan::footprint(d)};
}

bool meet(const narrowing& a, const narrowing& b) {
  const bool ab = refit::plan::overlaps(a.addr, a.fp, b.addr, b.fp);
  const bool ba = refit::plan::overlaps(b.addr, b.fp, a.addr, a.fp);
  CHECK(ab == ba);
  return ab;
}

}  // namespace

TEST_CASE("narrowings of one tensor overlap exactly when they share an element", "[route]") {
  CHECK(narrow86(0, 4, 0, 6).fp == std::vector<run>{run{0, 0, 0, 0, 4 * 6 * 4, 1}});
  CHECK(narrow86(0, 8, 3, 3).fp == std::vector<run>{run{0, 24, 0, 24, 12, 8}});
  CHECK_FALSE(meet(narrow86(0, 4, 0, 6), narrow86(4, 4, 0, 6)));  // rows 0-3 and 4-7
  CHECK_FALSE(meet(narrow86(0, 8, 0, 3), narrow86(0, 8, 3, 3)));  // w[:, 0:3] and w[:, 3:6], interleaved
  CHECK_FALSE(meet(narrow86(2, 3, 0, 3), narrow86(2, 3, 3, 3)));
  CHECK_FALSE(meet(narrow86(0, 4, 0, 3), narrow86(4, 4, 3, 3)));
  CHECK(meet(narrow86(0, 5, 0, 6), narrow86(4, 4, 0, 6)));        // share row 4
  CHECK(meet(narrow86(0, 8, 0, 4), narrow86(0, 8, 3, 3)));        // share column 3
  CHECK(meet(narrow86(7, 1, 5, 1), narrow86(0, 8, 3, 3)));        // the last element
  CHECK(meet(narrow86(0, 1, 0, 1), narrow86(0, 8, 0, 6)));        // the first element
  CHECK_FALSE(meet(narrow86(0, 8, 0, 2), narrow86(0, 8, 3, 3)));  // a column between them
  CHECK_FALSE(meet(narrow86(1, 1, 2, 1), narrow86(0, 8, 3, 3)));
  // The same memory as bytes: one byte of an f32 is enough to overlap.
  const narrowing byte{at(3 * 4 + 3), refit::plan::footprint(make_dest("b", dtype::u8, {1}, nullptr))};
  CHECK(meet(byte, narrow86(0, 8, 3, 3)));
  CHECK_FALSE(meet(byte, narrow86(0, 8, 0, 3)));  // byte 15 is in column 3 of row 0, outside 0:3
}

TEST_CASE("footprint covers exactly a view's bytes and overlaps agrees with marking bytes", "[route]") {
  std::mt19937_64 rng(99);
  int overlapping = 0;
  int interleaved = 0;  // disjoint though their byte ranges cross
  for (int n = 0; n < 3000; ++n) {
    // Two views of one engine buffer: half the time narrowings of the same tensor.
    const view_case a = random_view(rng, false);
    const view_case b = n % 2 == 0 ? renarrow(rng, a) : random_view(rng, false);
    // Both inside one buffer, b shifted by a random amount.
    const std::uint64_t shift = static_cast<std::uint64_t>(uniform(rng, 0, 64));
    const std::uint64_t size = std::max(a.engine_bytes, b.engine_bytes + shift) + 8;
    INFO("case " << n << ": a " << a.describe() << "; b " << b.describe() << " shifted by " << shift);

    std::vector<int> marks(size, 0);
    const auto mark = [&](const view_case& v, std::uint64_t base, int bit) {
      for_each_index(v.shape, [&](const std::vector<std::int64_t>& idx) {
        std::int64_t t = 0;
        for (std::size_t k = 0; k < idx.size(); ++k) t += idx[k] * v.eff[k];
        for (std::uint64_t j = 0; j < v.item; ++j)
          marks.at(base + v.offset + static_cast<std::uint64_t>(t) * v.item + j) |= bit;
      });
    };
    mark(a, 0, 1);
    mark(b, shift, 2);
    const bool brute = std::any_of(marks.begin(), marks.end(), [](int m) { return m == 3; });

    const auto da = make_dest("a", a.type, a.shape, nullptr, a.strides);
    const auto db = make_dest("b", b.type, b.shape, nullptr, b.strides);
    REQUIRE_NOTHROW(refit::plan::check_view(db));
    const std::vector<run> fa = refit::plan::footprint(da);
    const std::vector<run> fb = refit::plan::footprint(db);
    // The footprint marks the same bytes, each once.
    std::vector<int> fp_marks(size, 0);
    for (const run& r : fa)
      for (std::uint64_t i = 0; i < r.rows; ++i)
        for (std::uint64_t j = 0; j < r.width; ++j) fp_marks.at(a.offset + r.dst + i * r.dst_pitch + j) += 1;
    std::vector<int> a_marks(size);
    std::transform(marks.begin(), marks.end(), a_marks.begin(), [](int m) { return m & 1; });
    REQUIRE(fp_marks == a_marks);

    const bool got = refit::plan::overlaps(at(a.offset), fa, at(shift + b.offset), fb);
    REQUIRE(got == brute);
    REQUIRE(refit::plan::overlaps(at(shift + b.offset), fb, at(a.offset), fa) == brute);
    overlapping += brute ? 1 : 0;
    if (!brute) {
      const std::uint64_t a_lo = a.offset;
      const std::uint64_t a_hi = a_lo + refit::plan::check_view(da).bytes;
      const std::uint64_t b_lo = shift + b.offset;
      const std::uint64_t b_hi = b_lo + refit::plan::check_view(db).bytes;
      interleaved += a_lo < b_hi && b_lo < a_hi ? 1 : 0;
    }
  }
  CHECK(overlapping > 500);
  CHECK(3000 - overlapping > 500);
  CHECK(interleaved > 50);
}

// ------------------------------------------------------------------------------ engine layouts

TEST_CASE("engine layouts reduce to the runs a hand computation gives", "[route]") {
  const std::int64_t h = 4096;
  const std::int64_t kv = 1024;
  const std::uint64_t bf = 2;
  SECTION("fused qkv: q, k and v narrow dimension 0 of a [6144, 4096] bf16 tensor, one run each") {
    // From separate q_proj/k_proj/v_proj sources.
    for (const std::int64_t rows : {h, kv, kv}) {
      const auto d = make_dest("q_proj", dtype::bf16, {rows, h}, nullptr, {h, 1});
      CHECK(refit::plan::route(d, dtype::bf16, shape_t{rows, h}) ==
            std::vector<run>{run{0, 0, 0, 0, static_cast<std::uint64_t>(rows * h) * bf, 1}});
    }
    // From one fused qkv source, each view taking its rows.
    for (const auto& [rows, first] : {std::pair{h, std::int64_t{0}}, std::pair{kv, h}, std::pair{kv, h + kv}}) {
      const auto d = make_dest("qkv_proj", dtype::bf16, {rows, h}, nullptr, {h, 1}, source_slice{0, first, rows});
      CHECK(refit::plan::route(d, dtype::bf16, shape_t{6144, h}) ==
            std::vector<run>{run{static_cast<std::uint64_t>(first * h) * bf, 0, 0, 0,
                                 static_cast<std::uint64_t>(rows * h) * bf, 1}});
    }
  }
  SECTION("a row-parallel TP shard: half the columns of [4096, 14336] into a dense [4096, 7168]") {
    const auto d = make_dest("down_proj", dtype::bf16, {4096, 7168}, nullptr, {7168, 1}, source_slice{1, 7168, 7168});
    CHECK(refit::plan::route(d, dtype::bf16, shape_t{4096, 14336}) ==
          std::vector<run>{run{7168 * bf, 14336 * bf, 0, 7168 * bf, 7168 * bf, 4096}});
    const auto rank0 = make_dest("down_proj", dtype::bf16, {4096, 7168}, nullptr, {}, source_slice{1, 0, 7168});
    CHECK(refit::plan::route(rank0, dtype::bf16, shape_t{4096, 14336}) ==
          std::vector<run>{run{0, 14336 * bf, 0, 7168 * bf, 7168 * bf, 4096}});
  }
  SECTION("a column-parallel TP shard: half the rows of [14336, 4096]") {
    const auto d = make_dest("up_proj", dtype::bf16, {7168, 4096}, nullptr, {}, source_slice{0, 7168, 7168});
    CHECK(refit::plan::route(d, dtype::bf16, shape_t{14336, 4096}) ==
          std::vector<run>{run{7168ull * 4096 * bf, 0, 0, 0, 7168ull * 4096 * bf, 1}});
  }
  SECTION("stacked experts: w13[e] of an [E, 2I, H] tensor, and its gate and up halves") {
    const std::int64_t i2 = 2 * 1408;
    const std::int64_t hh = 2048;
    const auto w13 = make_dest("experts.5.w13", dtype::bf16, {i2, hh}, nullptr, {hh, 1});
    CHECK(refit::plan::route(w13, dtype::bf16, shape_t{i2, hh}) ==
          std::vector<run>{run{0, 0, 0, 0, static_cast<std::uint64_t>(i2 * hh) * bf, 1}});
    // The up half w13[e][I:2I] from an up_proj source; the whole stack's strides.
    const auto up = make_dest("experts.5.up_proj", dtype::bf16, {i2 / 2, hh}, nullptr, {hh, 1});
    CHECK(refit::plan::route(up, dtype::bf16, shape_t{i2 / 2, hh}) ==
          std::vector<run>{run{0, 0, 0, 0, static_cast<std::uint64_t>(i2 / 2 * hh) * bf, 1}});
    // w13[e] as a [1, 2I, H] narrowing of the stack, taking expert e of a stacked source.
    const auto one =
        make_dest("experts.w13", dtype::bf16, {1, i2, hh}, nullptr, {i2 * hh, hh, 1}, source_slice{0, 5, 1});
    CHECK(refit::plan::route(one, dtype::bf16, shape_t{8, i2, hh}) ==
          std::vector<run>{run{5ull * static_cast<std::uint64_t>(i2 * hh) * bf, 0, 0, 0,
                               static_cast<std::uint64_t>(i2 * hh) * bf, 1}});
  }
  SECTION("a vocab-parallel embedding shard, padded: rows of a [V, H] source into a wider row") {
    // Rows [1000, 1500) of a [32000, 64] source into a [500, 64] view of a [500, 80] buffer.
    const auto d = make_dest("embed_tokens", dtype::f32, {500, 64}, nullptr, {80, 1}, source_slice{0, 1000, 500});
    CHECK(refit::plan::route(d, dtype::f32, shape_t{32000, 64}) ==
          std::vector<run>{run{1000ull * 64 * 4, 64 * 4, 0, 80 * 4, 64 * 4, 500}});
  }
}

TEST_CASE("the CPU copier copies an op of several rows row by row, leaving the gaps between them", "[route][copy]") {
  std::vector<std::uint8_t> src(4096), dst(4096, 0xee);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 7 + 1);
  // 5 rows of 24 bytes: read every 40 bytes from byte 3, written every 32 bytes from byte 100.
  const refit::copy::op o(src.data() + 3, dst.data() + 100, 24, 5, 40, 32);
  CHECK(o.total() == 120);
  refit::copy::make_copier(refit::copy::engine::cpu)->run(std::span<const refit::copy::op>(&o, 1), nullptr);
  for (std::size_t i = 0; i < dst.size(); ++i) {
    const bool in_row = i >= 100 && i < 100 + 5 * 32 && (i - 100) % 32 < 24;
    const std::uint8_t want = in_row ? src[3 + (i - 100) / 32 * 40 + (i - 100) % 32] : 0xee;
    REQUIRE(dst[i] == want);
  }
}

TEST_CASE("route_cache gives route()'s runs, recomputes them for another dtype or shape and caches no misfit",
          "[route]") {
  std::vector<std::uint8_t> buf(4096);
  // A slice: the runs depend on the source's shape, not only on the view's.
  const auto d = make_dest("w", dtype::bf16, {4, 6}, buf.data(), {8, 1}, source_slice{1, 2, 6});
  refit::plan::route_cache cache;
  CHECK(cache.runs().empty());
  const auto same = [](std::span<const run> a, const std::vector<run>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  };
  const auto first = cache.get(d, dtype::bf16, shape_t{4, 8});
  CHECK(same(first, refit::plan::route(d, dtype::bf16, shape_t{4, 8})));
  CHECK(cache.get(d, dtype::bf16, shape_t{4, 8}).data() == first.data());  // not recomputed
  // Another source shape: its own runs (another source pitch), not the cached ones.
  const auto wider = refit::plan::route(d, dtype::bf16, shape_t{4, 10});
  REQUIRE_FALSE(same(first, wider));
  CHECK(same(cache.get(d, dtype::bf16, shape_t{4, 10}), wider));
  // A misfit throws what route() throws, every time, and leaves nothing cached.
  std::string expected;
  try {
    (void)refit::plan::route(d, dtype::bf16, shape_t{4, 7});
  } catch (const refit::error& e) {
    expected = e.what();
  }
  REQUIRE_FALSE(expected.empty());
  for (int k = 0; k < 2; ++k) {
    try {
      (void)cache.get(d, dtype::bf16, shape_t{4, 7});
      FAIL("a misfit was routed");
    } catch (const refit::error& e) {
      CHECK(e.code() == errc::apply);
      CHECK(std::string(e.what()) == expected);
    }
    CHECK(cache.runs().empty());
  }
  expect_error([&] { (void)cache.get(d, dtype::f16, shape_t{4, 10}); }, errc::apply, "w");
  CHECK(same(cache.get(d, dtype::bf16, shape_t{4, 10}), wider));
  CHECK(same(cache.get(d, dtype::bf16, shape_t{4, 8}), refit::plan::route(d, dtype::bf16, shape_t{4, 8})));
}

TEST_CASE("contiguous says where the bytes runs read or write lie when they form one range, in order", "[route]") {
  using refit::plan::contiguous;
  // Brute force: the offsets the runs touch, in the order they take them.
  const auto walk = [](const std::vector<run>& runs, bool source) {
    std::vector<std::uint64_t> at;
    for (const run& r : runs)
      for (std::uint64_t i = 0; i < r.rows; ++i)
        for (std::uint64_t b = 0; b < r.width; ++b)
          at.push_back((source ? r.src + i * r.src_pitch : r.dst + i * r.dst_pitch) + b);
    return at;
  };
  std::mt19937_64 rng(91);
  std::size_t ranges = 0;
  for (int n = 0; n < 5000; ++n) {
    // A run clipped to a random range (up to three pieces), or two random runs.
    std::vector<run> runs;
    const run r = random_run(rng);
    std::uint64_t from = random_cut(rng, r), to = random_cut(rng, r);
    if (from > to) std::swap(from, to);
    if (n % 4 == 0)
      runs = {r, random_run(rng)};
    else
      refit::plan::clip(r, from, to, runs);
    for (const bool source : {true, false}) {
      INFO("case " << n << (source ? " (source)" : " (destination)") << ": " << Catch::Detail::stringify(runs));
      const auto at = walk(runs, source);
      bool one = !at.empty();
      for (std::size_t i = 1; one && i < at.size(); ++i) one = at[i] == at[i - 1] + 1;
      const auto got = contiguous(runs, source);
      REQUIRE(got.has_value() == one);
      if (one) {
        REQUIRE(*got == at.front());
        ++ranges;
      }
    }
  }
  CHECK(ranges > 500);  // both outcomes were drawn often

  // A TP rank's column slice of a row-major source: its rows lie apart in the source, and land in
  // one range of a dense shard; a row slice is one range on both sides.
  std::vector<std::uint8_t> engine(64);
  const auto columns = refit::plan::route(make_dest("o", dtype::u16, {4, 4}, engine.data(), {}, source_slice{1, 4, 4}),
                                          dtype::u16, std::vector<std::int64_t>{4, 8});
  CHECK(!contiguous(columns, true));
  CHECK(contiguous(columns, false) == std::optional<std::uint64_t>(0));
  const auto rows = refit::plan::route(make_dest("q", dtype::u16, {2, 8}, engine.data(), {}, source_slice{0, 2, 2}),
                                       dtype::u16, std::vector<std::int64_t>{4, 8});
  CHECK(contiguous(rows, true) == std::optional<std::uint64_t>(32));
  CHECK(contiguous(rows, false) == std::optional<std::uint64_t>(0));
  CHECK(!contiguous({}, true));
}
