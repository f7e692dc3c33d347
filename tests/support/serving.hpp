// A receiver serving on a thread of the test's process, what its hooks and serve_one() reported,
// and host weights registered in its table: the set-up the staged and engine-wide cases share.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "refit/receiver.hpp"
#include "support/support.hpp"

namespace refit::test {

/// Host weights for every tensor of `metas`, registered whole, holding `version`'s pattern.
struct weights {
  std::vector<tensor_meta> metas;
  std::vector<std::vector<std::uint8_t>> bytes;

  weights(refit::receiver& r, std::vector<tensor_meta> m, std::uint64_t version) : metas(std::move(m)) {
    for (const auto& t : metas) {
      bytes.emplace_back(t.nbytes());
      fill_pattern(t.name, version, bytes.back().data(), bytes.back().size());
    }
    for (std::size_t k = 0; k < metas.size(); ++k)
      r.add_parameter(refit::tensor_dest{metas[k], bytes[k].data(), refit::device::cpu()});
  }
  /// Empty when tensor k holds version[k]'s pattern for every k, else the first that does not.
  [[nodiscard]] std::string mismatch(const std::vector<std::uint64_t>& version) const {
    for (std::size_t k = 0; k < metas.size(); ++k)
      if (const auto m = pattern_mismatch(metas[k], version[k], bytes[k].data()); !m.empty()) return m;
    return {};
  }
  [[nodiscard]] std::string mismatch(std::uint64_t version) const {
    return mismatch(std::vector<std::uint64_t>(metas.size(), version));
  }
};

/// What the hooks and serve_one() reported, from whichever thread.
struct journal {
  std::mutex m;
  std::condition_variable changed;
  std::vector<std::string> lines;

  void add(const std::string& line) {
    {
      std::lock_guard lock(m);
      lines.push_back(line);
    }
    changed.notify_all();
  }
  std::vector<std::string> take() {
    std::lock_guard lock(m);
    std::vector<std::string> out;
    out.swap(lines);
    return out;
  }
  /// Waits (bounded) until a line equal to `want` is there.
  bool wait_for(const std::string& want) {
    std::unique_lock lock(m);
    return changed.wait_for(lock, std::chrono::seconds(20), [&] {
      for (const auto& l : lines)
        if (l == want) return true;
      return false;
    });
  }
};

/// A receiver serving on a thread until finish(); its hooks and events go to `log` ("prepared v",
/// "commit v", "abort v", "event <e>"; idle, begin and batch are left out; the last abort's reason
/// in `last_reason`). pause_after(e) makes the thread stop serving once serve_one() returned e,
/// until resume(): a receiver that stalls at a chosen point of a version.
struct serving {
  refit::receiver receiver;
  journal log;
  std::atomic<bool> stop{false};
  std::thread thread;
  std::mutex gate_mutex;
  std::condition_variable gate;
  std::function<bool(refit::receiver_event)> pause_when;
  bool paused = false;
  std::string last_reason;  ///< under gate_mutex

  explicit serving(refit::receiver_options o) : receiver(std::move(o)) {
    receiver.on_prepared([this](std::uint64_t v) { log.add("prepared " + std::to_string(v)); });
    receiver.on_commit([this](std::uint64_t v) { log.add("commit " + std::to_string(v)); });
    receiver.on_abort([this](std::uint64_t v, const std::string& why) {
      {
        std::lock_guard lock(gate_mutex);
        last_reason = why;
      }
      log.add("abort " + std::to_string(v));
    });
  }
  /// Stops serving after the first serve_one() that returns `e` (set before start()).
  void pause_after(refit::receiver_event e) {
    pause_when = [e](refit::receiver_event got) { return got == e; };
  }
  void resume() {
    {
      std::lock_guard lock(gate_mutex);
      paused = false;
      pause_when = nullptr;
    }
    gate.notify_all();
  }
  [[nodiscard]] std::string reason() {
    std::lock_guard lock(gate_mutex);
    return last_reason;
  }
  void start() {
    stop = false;
    thread = std::thread([this] {
      while (!stop.load()) {
        const auto e = receiver.serve_one(refit::milliseconds{10});
        if (e != refit::receiver_event::idle && e != refit::receiver_event::begin && e != refit::receiver_event::batch)
          log.add("event " + std::string(refit::to_string(e)));
        std::unique_lock lock(gate_mutex);
        if (pause_when && pause_when(e)) {
          paused = true;
          log.add("paused");
          gate.wait(lock, [this] { return !paused || stop.load(); });
        }
      }
    });
  }
  /// Stops serving (the receiver's registration functions may then be called from this thread).
  void finish() {
    {
      std::lock_guard lock(gate_mutex);
      stop = true;
      paused = false;
    }
    gate.notify_all();
    if (thread.joinable()) thread.join();
  }
  ~serving() { finish(); }
};

}  // namespace refit::test
