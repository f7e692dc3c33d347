// refit — a small persistent pool of worker threads for the host diff (lib/delta/host_diff.hpp)
// and the receiver's host apply (lib/delta/host_apply.hpp).
//
// Why a pool of its own: a host diff reads the base and the new version once (2 GB for a 1 GB
// model), which one core does at a fraction of the memory bandwidth of a many-core host; the
// streamer's delta state owns one pool and hands it the chunks of each group of tensors. The
// threads are made once (the first host diff), wait on a condition variable between runs, and are
// joined by the destructor: nothing is detached. The streamer diffs tensor by tensor, so runs come
// back to back (290 of them for qwen2.5-0.5b): a worker spins briefly (spin_time) before it sleeps,
// so that most runs start without a wake-up through the kernel (~20 µs each, measured on a 2-core VM).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace refit::delta {

/// Most threads a pool may be asked for (streamer_options::delta.threads,
/// receiver_options::delta_threads): a typo would otherwise start thousands of threads.
inline constexpr std::size_t max_threads = 256;

/// Threads a pool of `asked` threads gets: `asked`, or when 0, min(hardware_concurrency, 8) (at
/// least 1).
[[nodiscard]] std::size_t pool_threads(std::size_t asked) noexcept;

/// A fixed set of threads that run the jobs of one run() at a time, the calling thread among them.
///
/// Thread rules: run() from one thread at a time (the streamer's); the destructor joins every
/// worker and must not run while run() does.
class worker_pool {
 public:
  /// How long a worker looks for the next run before it sleeps.
  static constexpr std::chrono::microseconds spin_time{50};

  /// Starts `threads - 1` workers (the caller of run() is the last one). Throws refit::error(internal)
  /// when a thread cannot be started (the ones started are joined first).
  explicit worker_pool(std::size_t threads);
  ~worker_pool();
  worker_pool(const worker_pool&) = delete;
  worker_pool& operator=(const worker_pool&) = delete;

  /// Threads that run jobs, the caller included.
  [[nodiscard]] std::size_t size() const noexcept { return workers_.size() + 1; }

  /// Runs job(0) … job(jobs - 1), each once, on the pool's threads and the caller's, and returns when
  /// all have returned. Which thread runs which job is not fixed: a job must write only what is its
  /// own. A job that throws does not stop the others; after all returned, run() throws
  /// refit::error (the first failure's code when it was a refit::error, errc::internal otherwise)
  /// with the first failure's message: no exception leaves a worker thread as it was thrown.
  void run(std::size_t jobs, const std::function<void(std::size_t)>& job);

 private:
  void stop_and_join() noexcept;
  void work() noexcept;
  /// Runs jobs of the current run until none is left.
  void drain() noexcept;

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;  ///< workers: a run started, or the pool stops
  std::condition_variable done_;  ///< run(): every job returned
  const std::function<void(std::size_t)>* job_ = nullptr;
  std::size_t jobs_ = 0;
  std::size_t next_ = 0;      ///< the next job to hand out
  std::size_t finished_ = 0;  ///< jobs that returned
  /// Counts runs: a worker that sees it move has a run to join. Written under mutex_, read by the
  /// workers' short spin without it.
  std::atomic<std::uint64_t> generation_ = 0;
  std::atomic<bool> stop_ = false;
  bool failed_ = false;
  int failure_code_ = 0;
  std::string failure_;
};

}  // namespace refit::delta
