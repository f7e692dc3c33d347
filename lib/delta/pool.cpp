#include "delta/pool.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <system_error>

#include "refit/error.hpp"

namespace refit::delta {

std::size_t pool_threads(std::size_t asked) noexcept {
  if (asked != 0) return asked;
  return std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, 8);
}

worker_pool::worker_pool(std::size_t threads) {
  const std::size_t n = std::max<std::size_t>(threads, 1) - 1;
  workers_.reserve(n);
  try {
    for (std::size_t k = 0; k < n; ++k) workers_.emplace_back([this] { work(); });
  } catch (const std::system_error& e) {
    stop_and_join();  // the ones started
    throw error(errc::internal, fmt::format("cannot start the host delta's thread {} of {}: {}; set "
                                            "delta_options::threads (streamer) or "
                                            "receiver_options::delta_threads lower",
                                            workers_.size() + 1, n + 1, e.what()));
  }
}

worker_pool::~worker_pool() { stop_and_join(); }

void worker_pool::stop_and_join() noexcept {
  {
    const std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_)
    if (t.joinable()) t.join();
}

void worker_pool::work() noexcept {
  std::uint64_t seen = 0;
  for (;;) {
    const auto until = std::chrono::steady_clock::now() + spin_time;
    while (generation_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_relaxed) &&
           std::chrono::steady_clock::now() < until)
      std::this_thread::yield();
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain();
  }
}

void worker_pool::drain() noexcept {
  std::unique_lock lock(mutex_);
  while (job_ != nullptr && next_ < jobs_) {
    const std::size_t k = next_++;
    const auto* job = job_;
    lock.unlock();
    // Converted here: the failure reaches the caller of run() as a refit::error made on its thread.
    bool failed = false;
    int code = static_cast<int>(errc::internal);
    std::string what;
    try {
      (*job)(k);
    } catch (const error& e) {
      failed = true;
      code = static_cast<int>(e.code());
      what = e.what();
    } catch (const std::exception& e) {
      failed = true;
      what = e.what();
    } catch (...) {
      failed = true;
      what = "an unknown exception";
    }
    lock.lock();
    if (failed && !failed_) {
      failed_ = true;
      failure_code_ = code;
      failure_ = std::move(what);
    }
    if (++finished_ == jobs_) done_.notify_all();
  }
}

void worker_pool::run(std::size_t jobs, const std::function<void(std::size_t)>& job) {
  if (jobs == 0) return;
  {
    const std::lock_guard lock(mutex_);
    job_ = &job;
    jobs_ = jobs;
    next_ = 0;
    finished_ = 0;
    failed_ = false;
    failure_.clear();
    ++generation_;
  }
  if (jobs > 1) wake_.notify_all();
  drain();
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return finished_ == jobs_; });  // the jobs other threads still run
  job_ = nullptr;                                        // a worker that wakes late finds nothing to do
  if (failed_) throw error(static_cast<errc>(failure_code_), fmt::format("in the host delta's threads: {}", failure_));
}

}  // namespace refit::delta
