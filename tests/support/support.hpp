// Test helpers shared by the unit and gpu suites.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "refit/error.hpp"
#include "refit/model.hpp"
#include "refit/streamer.hpp"

namespace refit::test {

/// Number of CUDA devices visible; 0 in a build without CUDA or when the driver has none.
/// Never initialises a CUDA context in a way that breaks a later fork (uses the runtime only
/// when the build has CUDA; call it in the parent before forking only in the gpu suite).
int cuda_device_count();

/// NCCL ranks for a test of `ranks` processes (a streamer and receivers), one GPU each where there
/// are enough. Where there are fewer GPUs than ranks, the ranks share them (gpu_of()) and every
/// child this process forks from now on claims a host of its own (NCCL_HOSTID: refit-test-<pid>),
/// since NCCL refuses two ranks of one communicator on one GPU of one host ("Duplicate GPU
/// detected"); it then connects them through its network transport over loopback: slow, but the
/// same protocol, so the nccl tests run on a one-GPU machine. Returns false (after saying why)
/// only when refit was built without nccl, when there is no GPU, or when `distinct` asks for a GPU
/// per rank (a test of crossing GPUs).
bool nccl_ranks(int ranks, bool distinct = false);

/// The GPU of rank `k` (0: the streamer) after nccl_ranks(): k where there are enough GPUs, else
/// k modulo the GPUs visible.
int gpu_of(int k);

/// nccl_ranks() put ranks on shared GPUs (each child its own NCCL host).
bool nccl_shares_gpus();

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
///
/// Both processes keep both ends open, so a reader never sees end of file while its own
/// signal_pipe exists: a peer that died shows as silence, and every read has a deadline.
class signal_pipe {
 public:
  signal_pipe();
  ~signal_pipe();
  signal_pipe(const signal_pipe&) = delete;
  signal_pipe& operator=(const signal_pipe&) = delete;
  /// Writes a line.
  void send(const std::string& line);
  /// Reads a line, waiting at most `timeout`; throws std::runtime_error on timeout, at end of
  /// file or when reading fails.
  std::string receive(std::chrono::milliseconds timeout = std::chrono::seconds(30));
  /// Reads a line if one arrives within `wait` (0 ms: only a line already there); nullopt when
  /// none does. At end of file or when reading fails it throws std::runtime_error as receive()
  /// does: only silence reads as "no line". Bytes of a line still incomplete at the deadline are
  /// dropped, as by receive() (send() writes a short line in one piece, so a poll sees it whole).
  std::optional<std::string> try_receive(std::chrono::milliseconds wait);

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

/// A temp_endpoint() whose socket file and private directory go at the end of the scope.
struct scoped_endpoint {
  std::string name = temp_endpoint();
  scoped_endpoint() = default;
  scoped_endpoint(const scoped_endpoint&) = delete;
  scoped_endpoint& operator=(const scoped_endpoint&) = delete;
  ~scoped_endpoint();
};

/// The policy side of one version in host memory: every tensor filled with that version's pattern.
struct host_tensors {
  std::vector<tensor_meta> metas;
  std::vector<std::vector<std::uint8_t>> bytes;
  std::vector<tensor_ref> refs;

  host_tensors(std::vector<tensor_meta> m, std::uint64_t version);
};

/// The shard of rows [start, start + count) of `t` (the whole tensor, in `bytes`), as a rank of a
/// group of streamers holds it (tensor_ref::shard: Shard(0)).
refit::tensor_ref shard_of(const tensor_meta& t, const std::vector<std::uint8_t>& bytes, std::int64_t start,
                           std::int64_t count);
/// The rows of every tensor of `whole` that rank r of n holds (torch.chunk, as FSDP's Shard(0)).
std::vector<refit::tensor_ref> rank_shards(const host_tensors& whole, std::size_t r, std::size_t n);

/// Empty when `data` holds the pattern of `meta` for `version`, else where it first differs.
std::string pattern_mismatch(const tensor_meta& meta, std::uint64_t version, const std::uint8_t* data);

/// Options of a host_shm streamer to `endpoint` with `buffer_count` buffers of `buffer_bytes`
/// and `timeout` for every reply: what the CPU tests' streamers share. With REFIT_TEST_TRANSPORT
/// set, the transport registered under that name instead (tests/transport/).
refit::streamer_options host_shm_streamer(const std::string& endpoint, std::uint64_t buffer_bytes,
                                          refit::milliseconds timeout, std::size_t buffer_count = 2);

/// The line a receiver child reports for an outcome: "<event> committed=<version|none>
/// dirty=<0|1> check=<check>", where `check` (what comparing every byte the receiver holds with
/// the committed version's pattern found) stands for a commit only and is "-" for other events.
std::string outcome(const std::string& event, std::optional<std::uint64_t> committed, bool dirty,
                    const std::string& check = "ok");

/// A refit::error as plain strings, so that Catch2 prints both sides of a failed check.
struct failure {
  std::string code;  ///< refit::to_string(errc)
  std::string message;
};

std::string code_name(errc c);

/// What `f` threw as a refit::error; nullopt when it returned normally.
template <class F>
std::optional<failure> failure_of(F&& f) {
  try {
    f();
  } catch (const error& e) {
    return failure{code_name(e.code()), e.what()};
  }
  return std::nullopt;
}

}  // namespace refit::test

/// In a Catch test: checks that `expr` throws refit::error with `want` (an errc) and a message
/// containing `fragment`.
#define CHECK_REFIT_ERROR(expr, want, fragment)                     \
  do {                                                              \
    const auto f = refit::test::failure_of([&] { (void)(expr); });  \
    REQUIRE(f);                                                     \
    CHECK(f->code == refit::test::code_name(want));                 \
    CHECK_THAT(f->message, Catch::Contains(std::string(fragment))); \
  } while (false)
