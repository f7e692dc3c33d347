// Each row's memory budget: README.md "Memory" as code. What refit may hold beyond the weights on
// each side, a formula of the row's options (buffers, their size, the path the session took, the
// stage, the conversion) and of the model's bytes; the measured peaks (refit::memory_in_use()) are
// held to it, and a row over it fails the run as a wrong value does.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "bench/bench.hpp"
#include "config/config.hpp"
#include "refit/model.hpp"
#include "transport/transport.hpp"

#if REFIT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace refit::bench {
namespace {

constexpr std::uint64_t mib = 1ull << 20;
/// Events, lanes, descriptors and the copy kernel's small tables: measured at 0.2–0.3 MiB a side
/// (bench/results/2026-12-07-h100-nccl-library-memory-gpu-suite.txt); every kind gets this much.
constexpr std::uint64_t slack = 8 * mib;
/// nccl's warm-up broadcast of each session (lib/transport/nccl.cpp, warm_up_bytes).
std::uint64_t warm_up(std::uint64_t buffer_bytes) { return std::min<std::uint64_t>(buffer_bytes, mib); }

/// The conversion's scale scratch on the streamer's GPU (lib/streamer/convert.cpp): two floats per
/// scale group (the scale and its multiplier), in 256-byte pieces, for every tensor of a refit (the
/// scratch rewinds once per refit), in chunks of at least 1 Mi floats (lib/copy/copy_cuda.cpp). A
/// piece that does not fit the rest of a chunk starts the next one, leaving that rest unused: the
/// waste is less than the pieces that caused it, so at most twice what the pieces take, plus the
/// first chunk.
std::uint64_t scale_scratch(const config& c, const manifest& m) {
  if (!c.convert || c.convert->q == quant::none) return 0;
  std::uint64_t floats = 0;
  for (const auto& e : m.entries) {
    if (!converted_scale_offset(*c.convert, e.meta)) continue;
    const auto groups = checked_numel(scale_shape(c.convert->q, e.meta.shape)).value_or(0);
    floats += 2 * ((groups + 63) / 64 * 64);
  }
  return floats == 0 ? 0 : 2 * floats * sizeof(float) + 4 * mib;
}

/// Bytes the receiver's largest table takes: each distinct rank's share is at most the row's.
std::uint64_t table_bytes(const config& c, const manifest& m, const row& r) {
  if (!c.convert) return r.bytes;
  std::uint64_t b = 0;
  for (const auto& e : m.entries) b += converted_bytes(*c.convert, e.meta);
  return b;
}

void add(row::side_memory& s, std::int64_t row::side_memory::*kind, std::uint64_t bytes) {
  s.*kind += static_cast<std::int64_t>(bytes);
}

}  // namespace

std::int64_t driver_used() {
#if REFIT_HAVE_CUDA
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    (void)cudaGetLastError();
    return -1;
  }
  std::size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return static_cast<std::int64_t>(total - free);
#else
  return -1;
#endif
}

void set_memory_budget(const config& c, const manifest& m, row& r, bool went_direct) {
  using s = row::side_memory;
  const std::uint64_t n = r.buffers, b = r.buffer_bytes, buffers = n * b;
  row::side_memory st{0, 0, 0}, rx{0, 0, 0};
  std::string fs, fr;
  const std::uint64_t scales = scale_scratch(c, m);
  if (r.transport == "host_shm") {
    add(st, &s::host, buffers);
    add(rx, &s::host, buffers);
    fs = "n x b host";
    fr = "n x b host (mapped)";
  } else if (r.transport == "cuda_ipc") {
    add(st, &s::device, buffers + scales);
    fs = scales != 0 ? "n x b + scales device" : "n x b device";
    fr = "0";
  } else {
    // nccl: in place sends from the tensors and receives into the weights (no buffers) unless the
    // receivers hold views (parts: areas of a batch, buffer-sized) or the streamer converts.
    const bool parts = went_direct && c.layout != layout_kind::plain;
    const std::uint64_t warm = warm_up(b);
    if (went_direct) {
      add(st, &s::device, warm + (parts ? buffers : 0) + (c.convert ? n * transport::direct_batch_bytes + scales : 0));
      add(rx, &s::device, warm + (parts ? buffers : 0));
      fs = parts ? "n x b + 1 MiB device" : c.convert ? "n x 1 GiB + scales + 1 MiB device" : "1 MiB device";
      fr = parts ? "n x b + 1 MiB device" : "1 MiB device";
    } else {
      add(st, &s::device, buffers + warm + scales);
      add(rx, &s::device, buffers + warm);
      fs = scales != 0 ? "n x b + scales + 1 MiB device" : "n x b + 1 MiB device";
      fr = "n x b + 1 MiB device";
    }
  }
  const std::uint64_t table = table_bytes(c, m, r);
  if (c.stage == stage_kind::device) {
    add(rx, &s::device, table);
    fr += " + table device";
  } else if (c.stage == stage_kind::host) {
    // A GPU table's host stage is page-locked (its apply reads it over the bus); a CPU table's is
    // plain host memory.
    add(rx, r.transport == "host_shm" ? &s::host : &s::pinned, table);
    fr += r.transport == "host_shm" ? " + table host" : " + table pinned";
  }
  for (row::side_memory* side : {&st, &rx}) {
    side->device += static_cast<std::int64_t>(slack);
    side->pinned += static_cast<std::int64_t>(slack);
    side->host += static_cast<std::int64_t>(slack);
  }
  r.streamer_budget = st;
  r.receiver_budget = rx;
  r.streamer_formula = fs;
  r.receiver_formula = fr;
}

bool over_budget(const row& r) {
  const auto over = [](const row::side_memory& held, const row::side_memory& budget) {
    return (held.device >= 0 && budget.device >= 0 && held.device > budget.device) ||
           (held.pinned >= 0 && budget.pinned >= 0 && held.pinned > budget.pinned) ||
           (held.host >= 0 && budget.host >= 0 && held.host > budget.host);
  };
  return over(r.streamer_memory, r.streamer_budget) || over(r.receiver_memory, r.receiver_budget);
}

}  // namespace refit::bench
