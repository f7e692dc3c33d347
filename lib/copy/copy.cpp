#include "copy/copy.hpp"

#include <fmt/format.h>

#include <cstring>

#include "refit/config.hpp"
#include "refit/error.hpp"
#if REFIT_HAVE_CUDA
#include "copy/copy_cuda.hpp"
#endif

namespace refit::copy {
namespace {

class cpu_copier final : public copier {
 public:
  void run(std::span<const op> ops, void* /*stream*/) override {
    for (const op& o : ops)
      if (o.bytes != 0) std::memcpy(o.dst, o.src, o.bytes);
  }
  [[nodiscard]] engine kind() const noexcept override { return engine::cpu; }
};

}  // namespace

std::string_view to_string(engine e) noexcept {
  switch (e) {
    case engine::cpu: return "cpu";
    case engine::kernel: return "kernel";
    case engine::memcpy_batch: return "memcpy_batch";
    case engine::memcpy_each: return "memcpy_each";
  }
  return "?";
}

std::unique_ptr<copier> make_copier(engine e, int device) {
  if (e == engine::cpu) return std::make_unique<cpu_copier>();
#if REFIT_HAVE_CUDA
  return make_cuda_copier(e, device);
#else
  (void)device;
  throw error(errc::invalid_argument,
              fmt::format("copy engine {} needs CUDA, and this refit was built without it", to_string(e)));
#endif
}

}  // namespace refit::copy
