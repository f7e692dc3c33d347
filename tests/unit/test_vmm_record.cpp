// The VMM records of the cuda_ipc transport (transport/vmm_record.hpp): what a reader accepts of
// the other process's bytes, and how a direct offer cuts its weights' chunks into records.
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "support/support.hpp"
#include "transport/vmm_record.hpp"

using refit::errc;
using refit::copy::vmm::chunk;
using namespace refit::transport;

namespace {

constexpr std::uint64_t mib = 1ull << 20;

/// Checks that decoding `record` throws errc::protocol with a message containing `fragment`.
void check_refused(const std::string& record, const std::string& fragment) {
  const auto f = refit::test::failure_of([&] { (void)decode_vmm_record(record, "source 3"); });
  REQUIRE(f);
  CHECK(f->code == refit::test::code_name(errc::protocol));
  CHECK_THAT(f->message, Catch::Contains("cuda_ipc: source 3 is a malformed VMM record") && Catch::Contains(fragment));
}

template <typename T>
void poke(std::string& r, std::size_t at, T v) {
  std::memcpy(r.data() + at, &v, sizeof v);
}

/// `n` adjacent chunks of `size` from `base`, ids from `id`.
std::map<std::uintptr_t, chunk> run_of(std::uintptr_t base, std::size_t n, std::uint64_t size, std::uint64_t id) {
  std::map<std::uintptr_t, chunk> out;
  for (std::size_t k = 0; k < n; ++k) out.emplace(base + k * size, chunk{base + k * size, size, id + k});
  return out;
}

}  // namespace

TEST_CASE("a VMM record round-trips its chunks and its flag, and its key ignores the flag", "[vmm]") {
  const std::vector<chunk> chunks = {{0x1000, 20 * mib, 7}, {0x1000 + 20 * mib, 2 * mib, 9}};
  const std::string with = encode_vmm_record(chunks, true);
  const std::string without = encode_vmm_record(chunks, false);
  CHECK(is_vmm_record(with));
  CHECK(with.size() == vmm_head_bytes + 2 * 16);
  const vmm_span a = decode_vmm_record(with, "source 1");
  const vmm_span b = decode_vmm_record(without, "source 1");
  CHECK(a.fds_follow);
  CHECK_FALSE(b.fds_follow);
  CHECK(a.ids == std::vector<std::uint64_t>{7, 9});
  CHECK(a.sizes == std::vector<std::uint64_t>{20 * mib, 2 * mib});
  CHECK(a.bytes == 22 * mib);
  CHECK(a.key == b.key);
  CHECK(a.key == without);
  // A cudaIpc source record (handle, size, id: 80 bytes of anything) is not one.
  CHECK_FALSE(is_vmm_record(std::string(80, '\0')));
}

TEST_CASE("every malformed VMM record is refused with what is wrong", "[vmm]") {
  const std::vector<chunk> one = {{0x1000, 2 * mib, 1}};
  const std::string good = encode_vmm_record(one, true);
  check_refused(good.substr(0, vmm_head_bytes - 1), "shorter than its header");
  check_refused("XMM1" + good.substr(4), "shorter than its header, or not one");
  std::string flag = good;
  flag[vmm_flag_at] = 2;
  check_refused(flag, "flag is neither 0 nor 1");
  std::string none = good;
  poke(none, vmm_flag_at + 1, std::uint32_t{0});
  check_refused(none.substr(0, vmm_head_bytes), "0 chunks (1 to 255 allowed)");
  std::string many = good;
  poke(many, vmm_flag_at + 1, std::uint32_t{max_vmm_chunks + 1});
  check_refused(many, "256 chunks (1 to 255 allowed)");
  check_refused(good + std::string(16, '\0'), "1 chunks do not fill it");
  check_refused(good.substr(0, good.size() - 1), "1 chunks do not fill it");
  std::string empty_chunk = good;
  poke(empty_chunk, vmm_head_bytes + 8, std::uint64_t{0});
  check_refused(empty_chunk, "chunk 0 has no size");
  const std::vector<chunk> two = {{0x1000, 2 * mib, 1}, {0x1000 + 2 * mib, 2 * mib, 2}};
  std::string overflow = encode_vmm_record(two, true);
  poke(overflow, vmm_head_bytes + 8, ~std::uint64_t{0});
  check_refused(overflow, "chunk 1 has no size, or the chunks overflow");
  // The largest record fits a wire handle with the offer's "V" before it.
  CHECK(1 + encode_vmm_record(std::vector<chunk>(max_vmm_chunks, chunk{0, 1, 1}), true).size() <=
        refit::wire::max_handle_bytes);
}

TEST_CASE("an offer cuts densely packed weights into records that hold every region whole", "[vmm]") {
  // 600 adjacent 20 MiB chunks (12 GB), weights of 30 MiB back to back: nearly every chunk boundary
  // is straddled, so records overlap rather than cut a region.
  const std::uintptr_t base = 0x7f0000000000;
  const auto chunks = run_of(base, 600, 20 * mib, 100);
  std::vector<vmm_region> regions;
  for (std::uint64_t at = 0; at + 30 * mib <= 600 * 20 * mib; at += 30 * mib) regions.push_back({base + at, 30 * mib});
  const vmm_windows w = plan_vmm_windows(regions, chunks);
  REQUIRE_FALSE(w.too_large);
  REQUIRE(w.place.size() == regions.size());
  CHECK(w.records.size() == 3);
  for (const auto& r : w.records) {
    CHECK(!r.empty());
    CHECK(r.size() <= max_vmm_chunks);
    for (std::size_t k = 1; k < r.size(); ++k) CHECK(r[k].base == r[k - 1].base + r[k - 1].bytes);
  }
  for (std::size_t k = 0; k < regions.size(); ++k) {
    const auto& r = w.records.at(w.place[k].record);
    const std::uintptr_t first = r.front().base;
    const std::uintptr_t end = r.back().base + r.back().bytes;
    INFO("region " << k);
    CHECK(first + w.place[k].offset == regions[k].start);
    CHECK(regions[k].start + regions[k].extent <= end);
  }
}

TEST_CASE("an offer gives each run of adjacent chunks its own records and refuses a region no record holds", "[vmm]") {
  auto chunks = run_of(0x100000000, 3, 2 * mib, 1);
  const auto other = run_of(0x200000000, 2, 2 * mib, 10);
  chunks.insert(other.begin(), other.end());
  const std::vector<vmm_region> regions = {
      {0x200000000 + 1024, 3 * mib}, {0x100000000 + 2 * mib, 2 * mib}, {0x100000000, 16}};
  const vmm_windows w = plan_vmm_windows(regions, chunks);
  REQUIRE_FALSE(w.too_large);
  REQUIRE(w.records.size() == 2);
  CHECK(w.records[0].size() == 2);  // the first run, chunks 0 and 1 (nothing lies in chunk 2)
  CHECK(w.records[1].size() == 2);
  CHECK(w.place[2].record == 0);
  CHECK(w.place[2].offset == 0);
  CHECK(w.place[1].record == 0);
  CHECK(w.place[1].offset == 2 * mib);
  CHECK(w.place[0].record == 1);
  CHECK(w.place[0].offset == 1024);

  // Longer than a record allows, or running past the last chunk, or in no chunk at all.
  CHECK(plan_vmm_windows(std::vector<vmm_region>{{0x100000000, 5 * mib}}, chunks, 2).too_large == 0u);
  CHECK(plan_vmm_windows(std::vector<vmm_region>{{0x100000000 + 5 * mib, 2 * mib}}, chunks).too_large == 0u);
  CHECK(plan_vmm_windows(std::vector<vmm_region>{{0x300000000, 1}}, chunks).too_large == 0u);
}
