#include "copy/copy.hpp"

#include <fmt/format.h>

#include <cstddef>
#include <cstring>

#include "config/config.hpp"
#include "refit/error.hpp"
#if REFIT_HAVE_CUDA
#include "copy/copy_cuda.hpp"
#endif

namespace refit::copy {
namespace {

class cpu_copier final : public copier {
 public:
  void run(std::span<const op> ops, void* /*stream*/) override {
    for (const op& o : ops) {
      if (o.bytes == 0) continue;
      for (std::uint64_t r = 0; r < o.rows; ++r)
        std::memcpy(static_cast<std::byte*>(o.dst) + r * o.dst_pitch,
                    static_cast<const std::byte*>(o.src) + r * o.src_pitch, o.bytes);
    }
  }
  [[nodiscard]] engine kind() const noexcept override { return engine::cpu; }
};

}  // namespace

std::uint64_t checksum(const void* p, std::uint64_t bytes, device dev) {
  if (dev.kind == device_kind::cuda) {
#if REFIT_HAVE_CUDA
    return cuda_checksum(p, bytes, dev.index);
#else
    throw error(errc::invalid_argument, "checksum of CUDA memory needs a build with CUDA");
#endif
  }
  const auto* b = static_cast<const unsigned char*>(p);
  const std::uint64_t words = bytes / 8;
  std::uint64_t sum = bytes;
  for (std::uint64_t k = 0; k < words; ++k) {
    std::uint64_t w;
    std::memcpy(&w, b + 8 * k, 8);  // little-endian hosts only (x86-64, aarch64)
    sum += w * (2 * k + 1);
  }
  for (std::uint64_t j = 0; j < bytes % 8; ++j)
    sum += static_cast<std::uint64_t>(b[8 * words + j]) * (2 * j + 3) * 0x100000001b3ull;
  return sum;
}

std::string_view to_string(engine e) noexcept {
  switch (e) {
    case engine::cpu: return "cpu";
    case engine::kernel: return "kernel";
    case engine::memcpy_batch: return "memcpy_batch";
    case engine::memcpy_each: return "memcpy_each";
  }
  return "?";
}

engine choose(engine preferred, copy_engine requested) noexcept {
  if (preferred == engine::cpu || requested == copy_engine::automatic) return preferred;
  switch (requested) {
    case copy_engine::kernel: return engine::kernel;
    case copy_engine::memcpy_batch: return engine::memcpy_batch;
    case copy_engine::memcpy_each: return engine::memcpy_each;
    case copy_engine::automatic: break;
  }
  return preferred;
}

bool append_route(std::span<const plan::run> runs, std::uint64_t from, std::uint64_t bytes, const std::byte* src,
                  std::byte* dst, std::vector<op>& ops, std::vector<plan::run>& scratch) {
  scratch.clear();
  for (const plan::run& r : runs) plan::clip(r, from, from + bytes, scratch);
  for (const plan::run& r : scratch)
    ops.emplace_back(src + (r.src - from), dst + r.dst, r.width, r.rows, r.src_pitch, r.dst_pitch);
  return !scratch.empty();
}

#if !REFIT_HAVE_CUDA
std::optional<allocation> cuda_allocation_of(const void* /*p*/, int /*device*/) {
  throw error(errc::invalid_argument, "CUDA memory needs a build with CUDA, and this refit was built without it");
}

void enable_peer_access(int device, int peer) {
  throw error(errc::invalid_argument,
              fmt::format("copies between cuda:{} and cuda:{} need CUDA, and this refit was built without it", device, peer));
}
#endif

std::unique_ptr<copier> make_copier(engine e, int device, milliseconds timeout) {
  if (e == engine::cpu) return std::make_unique<cpu_copier>();
#if REFIT_HAVE_CUDA
  return make_cuda_copier(e, device, timeout);
#else
  (void)device, (void)timeout;
  throw error(errc::invalid_argument,
              fmt::format("copy engine {} needs CUDA, and this refit was built without it", to_string(e)));
#endif
}

}  // namespace refit::copy
