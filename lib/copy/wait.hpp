// refit — the one way a host thread waits for GPU or NCCL work against a deadline.
//
// Every such wait polls (cudaStreamQuery, cudaEventQuery, ncclCommGetAsyncError: no call that
// blocks without a timeout) because a dead peer's work may never complete, and a wait must end
// with a clear error, never a hang. The pause between polls: spin (yielding) for the first 3 ms,
// then sleep in doubling steps from 20 us up to 1 ms. The last waits of a refit are on its
// critical path, where a sleep overshoots by the timer's slack, so short waits spin; long ones
// (communicator set-up, hundreds of ms) need no microsecond reaction and sleep. A wait that is on
// the critical path for longer (a direct receiver's END, waiting for the streamer's last copies:
// cuda_ipc's await_writes) asks for a longer spin.
// bench/results holds the runs that chose these numbers. No CUDA or NCCL header is needed here.
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

namespace refit {

/// A point in time a wait must not pass, and the budget it came from (for messages).
struct deadline {
  std::chrono::steady_clock::time_point at;
  std::chrono::milliseconds budget;

  static deadline after(std::chrono::milliseconds budget) {
    return {std::chrono::steady_clock::now() + budget, budget};
  }
  [[nodiscard]] bool passed() const noexcept { return std::chrono::steady_clock::now() >= at; }
  /// What is left of the budget (at least 1 ms, so that a last poll still happens).
  [[nodiscard]] std::chrono::milliseconds remaining() const noexcept {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at - std::chrono::steady_clock::now());
    return std::max(left, std::chrono::milliseconds{1});
  }
};

/// The pause between two polls: spins (yielding) for its first 3 ms (or `spin`), then sleeps in
/// growing steps up to a millisecond.
class backoff {
 public:
  static constexpr std::chrono::milliseconds default_spin{3};
  explicit backoff(std::chrono::milliseconds spin = default_spin)
      : spin_until_(std::chrono::steady_clock::now() + spin) {}
  void pause() noexcept {
    if (std::chrono::steady_clock::now() < spin_until_) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(sleep_ * 2, std::chrono::microseconds(1000));
  }

 private:
  std::chrono::steady_clock::time_point spin_until_;
  std::chrono::microseconds sleep_{20};
};

/// Asks `done()` until it returns true (then returns true) or `until` has passed after an answer
/// of false (then returns false), pausing with a backoff between asks. `done` may throw (an error
/// seen while polling): the exception passes through. The caller words the timeout.
template <class Done>
bool poll_until(const deadline& until, Done&& done, std::chrono::milliseconds spin = backoff::default_spin) {
  backoff b(spin);
  for (;;) {
    if (done()) return true;
    if (until.passed()) return false;
    b.pause();
  }
}

}  // namespace refit
