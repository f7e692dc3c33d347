// refit — the generation side: receives batches and applies them into weights.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "refit/error.hpp"
#include "refit/model.hpp"
#include "refit/options.hpp"

namespace refit {

struct receiver_options {
  /// Where to bind. Empty: a fresh "ipc://" socket in a private directory (mode 0700) under
  /// $XDG_RUNTIME_DIR or /tmp. "tcp://*:0" style endpoints bind to 127.0.0.1 unless an address is
  /// given; read the chosen port back from endpoint().
  std::string endpoint;
  /// CUDA device applies run on (cuda_ipc, nccl).
  int device = 0;
  /// How applies are copied on GPU transports.
  copy_engine engine = copy_engine::automatic;
  /// A refit in progress that sees no message for this long is aborted (the streamer is
  /// presumed dead; committed_version() is unchanged and dirty() is true if anything was applied).
  milliseconds idle_timeout{60000};
  /// Session token; empty: the value of REFIT_TOKEN, or none. A HELLO with another token is
  /// refused with errc::unauthorized and does not disturb the session in use.
  std::string token;
  curve_keys curve;
};

/// Called with the entries of one batch. Views are valid only during the call. On CUDA
/// transports `stream` is the cudaStream_t the views are ready on; enqueue work on it and return
/// (the buffer is reused once that stream's work completes). On the CPU `stream` is nullptr.
/// Throwing aborts the refit; the streamer sees errc::apply with the exception's message.
using batch_callback = std::function<void(std::span<const tensor_view> views, void* stream)>;

/// What serve_one() did.
enum class receiver_event : std::uint8_t {
  idle,       ///< nothing arrived within the wait
  hello,      ///< a session started (buffers mapped)
  begin,      ///< a refit started
  batch,      ///< a batch was applied (or enqueued)
  committed,  ///< END: the version is live
  aborted,    ///< a refit failed (bad message, sink error, incomplete manifest, idle timeout)
  bye,        ///< the session ended
  refused,    ///< a message was refused without touching the session (stranger, bad HELLO)
};
std::string_view to_string(receiver_event e) noexcept;

/// Figures of the last refit the receiver committed.
struct receiver_stats {
  std::uint64_t version = 0;
  std::uint64_t tensors = 0;
  std::uint64_t bytes = 0;
  std::uint64_t batches = 0;
  double seconds = 0;        ///< BEGIN received to END replied
  double apply_seconds = 0;  ///< copying / enqueuing copies and running callbacks
  double drain_seconds = 0;  ///< waiting at END for the device to finish (GPU transports)
};

/// The receiver. Owns one ZeroMQ REP socket and the mappings of the streamer's buffers.
///
/// Thread rules: serve_one() and the registration functions from one thread at a time;
/// committed_version(), dirty() and endpoint() from any thread.
class receiver {
 public:
  /// Binds the socket. Throws refit::error(invalid_argument / io) when it cannot.
  explicit receiver(receiver_options options = {});
  ~receiver();
  receiver(receiver&&) noexcept;
  receiver& operator=(receiver&&) noexcept;
  receiver(const receiver&) = delete;
  receiver& operator=(const receiver&) = delete;

  /// The endpoint to give the streamer (ports resolved).
  [[nodiscard]] std::string endpoint() const;

  /// Parameter-table sink: registers a destination. Incoming tensors are checked against it
  /// (name known, dtype and shape equal) and copied into place; END commits only when every
  /// registered name arrived exactly once. Throws errc::invalid_argument for a duplicate name,
  /// a null pointer or a bad shape, or when a callback sink is set.
  void add_parameter(const tensor_dest& dest);
  /// Removes every registered destination.
  void clear_parameters();
  /// Callback sink; replaces the parameter table (exclusive with add_parameter).
  void on_batch(batch_callback callback);

  /// Waits up to `wait` for one message and handles it.
  receiver_event serve_one(milliseconds wait);
  /// Serves until `stop()` returns true (checked between messages, at least every `poll`).
  void serve(const std::function<bool()>& stop, milliseconds poll = milliseconds{100});

  /// Last version committed; nullopt before the first commit.
  [[nodiscard]] std::optional<std::uint64_t> committed_version() const noexcept;
  /// True when weights were partly overwritten by a refit that did not commit.
  [[nodiscard]] bool dirty() const noexcept;
  /// Figures of the last committed refit (zeros before the first).
  [[nodiscard]] receiver_stats last_stats() const;
  /// Message of the last error this receiver reported (empty if none).
  [[nodiscard]] std::string last_error() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace refit
