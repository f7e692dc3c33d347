// Test helpers shared by the unit and gpu suites.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "refit/model.hpp"

namespace refit::test {

/// Number of CUDA devices visible; 0 in a build without CUDA or when the driver has none.
/// Never initialises a CUDA context in a way that breaks a later fork (uses the runtime only
/// when the build has CUDA; call it in the parent before forking only in the gpu suite).
int cuda_device_count();

/// A fresh private ipc endpoint for one test (unique per call).
std::string temp_endpoint();

/// A child process running `body`; its exit code is 0 when body returned normally, 1 when it
/// threw (the message is printed to stderr) and 2 when a Catch2 check failed inside it.
class child {
 public:
  explicit child(const std::function<void()>& body);
  ~child();  ///< kills (SIGKILL) and reaps the child if still running
  child(const child&) = delete;
  child& operator=(const child&) = delete;

  [[nodiscard]] pid_t pid() const noexcept { return pid_; }
  /// Waits up to `timeout` for the child; returns its exit code, or -signal when killed by a
  /// signal. Throws std::runtime_error when it did not exit in time (the child is then killed).
  int wait(std::chrono::milliseconds timeout = std::chrono::seconds(60));
  /// Sends SIGKILL and reaps.
  void kill() noexcept;

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
};

/// A pipe to pass small messages between a parent and a forked child (one direction each way).
/// Used as the synchronisation point of multi-process tests instead of sleeps.
class signal_pipe {
 public:
  signal_pipe();
  ~signal_pipe();
  signal_pipe(const signal_pipe&) = delete;
  signal_pipe& operator=(const signal_pipe&) = delete;
  /// Writes a line.
  void send(const std::string& line);
  /// Reads a line, waiting at most `timeout`; throws std::runtime_error on timeout or EOF.
  std::string receive(std::chrono::milliseconds timeout = std::chrono::seconds(30));

 private:
  int fds_[2] = {-1, -1};
};

/// Deterministic bytes: byte i of tensor `name` in refit `version` (a hash, not zeros).
std::uint8_t pattern_byte(const std::string& name, std::uint64_t version, std::uint64_t i) noexcept;
/// Fills `out` with pattern_byte(name, version, 0..n).
void fill_pattern(const std::string& name, std::uint64_t version, std::uint8_t* out, std::uint64_t n);

/// A mixed-dtype model for end-to-end tests: `count` tensors of varied dtypes and shapes,
/// including zero-size ones, plus one tensor of `oversize_bytes` (if non-zero).
std::vector<tensor_meta> mixed_model(std::size_t count, std::uint64_t oversize_bytes, std::uint64_t seed = 1);

}  // namespace refit::test
