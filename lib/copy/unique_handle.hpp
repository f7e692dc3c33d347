// refit — the one owner of a C handle (CUDA memory, event, stream, IPC mapping, NCCL
// communicator): cppzmq's shape, written once.
//
// The owning type acquires (or throws) and hands the handle over; copy is deleted; a move leaves
// the source empty; the destructor is noexcept and calls `Destroy` on a non-empty handle, ignoring
// its result (it may run after the runtime has shut down); handle() is the escape hatch. No CUDA
// or NCCL header is needed here: `Destroy` brings its own.
#pragma once

#include <utility>

namespace refit {

/// Owns one `Handle`; `Destroy(handle)` releases it. `Handle{}` is the empty value.
template <class Handle, auto Destroy>
class unique_handle {
 public:
  unique_handle() noexcept = default;
  /// Takes ownership of `h` (which may be empty).
  explicit unique_handle(Handle h) noexcept : h_(h) {}
  ~unique_handle() { reset(); }
  unique_handle(unique_handle&& o) noexcept : h_(o.release()) {}
  unique_handle& operator=(unique_handle&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  unique_handle(const unique_handle&) = delete;
  unique_handle& operator=(const unique_handle&) = delete;

  [[nodiscard]] Handle handle() const noexcept { return h_; }
  explicit operator bool() const noexcept { return h_ != Handle{}; }

  /// Gives the handle up without releasing it; the owner is empty afterwards.
  [[nodiscard]] Handle release() noexcept { return std::exchange(h_, Handle{}); }

  /// Releases the handle held (if any) and takes `h` instead.
  void reset(Handle h = Handle{}) noexcept {
    const Handle old = std::exchange(h_, h);
    if (old != Handle{}) Destroy(old);
  }

 private:
  Handle h_{};
};

}  // namespace refit
