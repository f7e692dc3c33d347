// refit — errors.
//
// Every failure the C++ API reports is a refit::error: a std::runtime_error carrying an errc code
// and a message that says what went wrong and what to check.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

#include "refit/export.hpp"

namespace refit {

/// What kind of failure an error is. Values are stable: they travel in ERROR replies.
enum class errc : int {
  invalid_argument = 1,  ///< the caller passed something unusable (bad option, bad tensor)
  protocol = 2,          ///< a message was malformed or out of order
  version_mismatch = 3,  ///< the peers speak different protocol versions
  timeout = 4,           ///< a deadline passed while waiting for the peer
  peer = 5,              ///< the peer is gone, or refused the request
  unauthorized = 6,      ///< session token mismatch
  transport = 7,         ///< buffers could not be created, shared or mapped
  cuda = 8,              ///< a CUDA call failed
  nccl = 9,              ///< an NCCL call failed
  apply = 10,            ///< the receiver's sink (table or callback) failed
  incomplete = 11,       ///< END arrived but the manifest was not complete: nothing committed
  io = 12,               ///< a file or system call failed
  internal = 13,         ///< a bug in refit
  /// The receiver refused a subset or delta version: it holds no base for it (it never committed a
  /// whole version, committed another version than the delta's base, its weights are dirty, or a
  /// delta failed half-way and left it poisoned). Nothing was written; send a whole version (a delta
  /// streamer does so by itself, within the same refit()).
  needs_whole = 14,
};

/// Lower-case name of a code ("timeout"); "unknown" for values outside the enum.
REFIT_API std::string_view to_string(errc code) noexcept;

/// The one exception type of the library.
class REFIT_API error : public std::runtime_error {
 public:
  error(errc code, const std::string& message);
  [[nodiscard]] errc code() const noexcept { return code_; }

 private:
  errc code_;
};

}  // namespace refit
