// refit — counting the memory refit allocates (include/refit/memory.hpp): each allocation holds a
// memory_charge for as long as it lives.
#pragma once

#include <cstdint>
#include <utility>

namespace refit::memory {

enum class kind : std::uint8_t { device, pinned, host };

void acquired(kind k, std::uint64_t bytes) noexcept;
void released(kind k, std::uint64_t bytes) noexcept;

/// `bytes` of kind `k` counted from construction to destruction (cppzmq's shape: a move empties
/// the source). Charge what was allocated, right after it succeeded.
class charge {
 public:
  charge() noexcept = default;
  charge(kind k, std::uint64_t bytes) noexcept : kind_(k), bytes_(bytes) { acquired(k, bytes); }
  charge(charge&& o) noexcept : kind_(o.kind_), bytes_(std::exchange(o.bytes_, 0)) {}
  charge& operator=(charge&& o) noexcept {
    if (this != &o) {
      reset();
      kind_ = o.kind_;
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  charge(const charge&) = delete;
  charge& operator=(const charge&) = delete;
  ~charge() { reset(); }

  void reset() noexcept {
    if (bytes_ != 0) released(kind_, std::exchange(bytes_, 0));
  }
  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }

 private:
  kind kind_ = kind::host;
  std::uint64_t bytes_ = 0;
};

}  // namespace refit::memory
