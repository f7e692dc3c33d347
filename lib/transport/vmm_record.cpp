// refit — VMM records and the cutting of a direct offer's chunks. See vmm_record.hpp.
#include "transport/vmm_record.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "refit/error.hpp"

namespace refit::transport {
namespace {

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);  // little-endian hosts only, like the wire
}

template <typename T>
T get(const std::string& in, std::size_t at) {
  T v{};
  std::memcpy(&v, in.data() + at, sizeof v);
  return v;
}

}  // namespace

std::string encode_vmm_record(std::span<const copy::vmm::chunk> chunks, bool fds_follow) {
  std::string r(vmm_magic);
  r += static_cast<char>(fds_follow ? 1 : 0);
  put(r, static_cast<std::uint32_t>(chunks.size()));
  for (const copy::vmm::chunk& c : chunks) {
    put(r, c.id);
    put(r, c.bytes);
  }
  return r;
}

bool is_vmm_record(std::string_view r) noexcept { return r.substr(0, vmm_magic.size()) == vmm_magic; }

vmm_span decode_vmm_record(const std::string& r, std::string_view what) {
  const auto bad = [&](std::string_view why) {
    return error(errc::protocol,
                 fmt::format("cuda_ipc: {} is a malformed VMM record ({} bytes): {}", what, r.size(), why));
  };
  if (r.size() < vmm_head_bytes || !is_vmm_record(r)) throw bad("shorter than its header, or not one");
  const auto flag = static_cast<unsigned char>(r[vmm_flag_at]);
  if (flag > 1) throw bad("its descriptor flag is neither 0 nor 1");
  const auto count = get<std::uint32_t>(r, vmm_flag_at + 1);
  if (count == 0 || count > max_vmm_chunks)
    throw bad(fmt::format("{} chunks (1 to {} allowed)", count, max_vmm_chunks));
  if (r.size() != vmm_head_bytes + std::size_t{count} * 16) throw bad(fmt::format("{} chunks do not fill it", count));
  vmm_span s;
  s.fds_follow = flag == 1;
  for (std::uint32_t k = 0; k < count; ++k) {
    const std::size_t at = vmm_head_bytes + std::size_t{k} * 16;
    s.ids.push_back(get<std::uint64_t>(r, at));
    s.sizes.push_back(get<std::uint64_t>(r, at + 8));
    if (s.sizes.back() == 0 || __builtin_add_overflow(s.bytes, s.sizes.back(), &s.bytes))
      throw bad(fmt::format("chunk {} has no size, or the chunks overflow", k));
  }
  s.key = r;
  s.key[vmm_flag_at] = 0;
  return s;
}

vmm_windows plan_vmm_windows(std::span<const vmm_region> regions,
                             const std::map<std::uintptr_t, copy::vmm::chunk>& chunks, std::uint32_t max_chunks) {
  vmm_windows out;
  out.place.resize(regions.size());
  // Runs of adjacent chunks; where each chunk is in its run.
  std::vector<std::vector<copy::vmm::chunk>> runs;
  std::map<std::uintptr_t, std::pair<std::size_t, std::size_t>> where;  // base → (run, index)
  for (const auto& [base, c] : chunks) {
    if (runs.empty() || runs.back().back().base + runs.back().back().bytes != base) runs.emplace_back();
    runs.back().push_back(c);
    where.emplace(base, std::pair{runs.size() - 1, runs.back().size() - 1});
  }
  // The chunk holding byte `a`, when one does.
  const auto chunk_at = [&](std::uintptr_t a) -> std::optional<std::pair<std::size_t, std::size_t>> {
    auto it = chunks.upper_bound(a);
    if (it == chunks.begin()) return std::nullopt;
    --it;
    if (a - it->first >= it->second.bytes) return std::nullopt;
    return where.at(it->first);
  };
  std::vector<std::size_t> order(regions.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(),
            [&](std::size_t x, std::size_t y) { return regions[x].start < regions[y].start; });
  struct window {
    std::size_t run, lo, hi;  // chunks [lo, hi) of the run
  };
  std::vector<window> windows;
  for (const std::size_t k : order) {
    const vmm_region& g = regions[k];
    const auto first = chunk_at(g.start);
    const auto last = chunk_at(g.start + std::max<std::uint64_t>(g.extent, 1) - 1);
    if (!first || !last || first->first != last->first || last->second - first->second + 1 > max_chunks) {
      out.too_large = k;
      return out;
    }
    const auto [run, lo] = *first;
    const std::size_t hi = last->second;
    if (windows.empty() || windows.back().run != run || hi >= windows.back().lo + max_chunks)
      windows.push_back(window{run, lo, hi + 1});
    window& w = windows.back();
    w.hi = std::max(w.hi, hi + 1);
    out.place[k] = {windows.size() - 1, g.start - runs[run][w.lo].base};
  }
  for (const window& w : windows)
    out.records.emplace_back(runs[w.run].begin() + static_cast<std::ptrdiff_t>(w.lo),
                             runs[w.run].begin() + static_cast<std::ptrdiff_t>(w.hi));
  return out;
}

}  // namespace refit::transport
