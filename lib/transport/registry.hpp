// refit — the transport registry: every transport adds itself from its own file, and the streamer
// and the receiver find it by name (HELLO's `transport` string). Nothing outside a transport's
// file names it (see lib/transport/README.md for everything a new one adds).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "transport/transport.hpp"

namespace refit::transport {

/// One transport as it registers itself.
struct registration {
  /// Its name: what streamer_options names it by and HELLO carries (to_string(transport_kind) of
  /// the built-in ones). Lower-case letters, digits and '_'.
  std::string_view name;
  capabilities can;
  /// Streamer side (options.count ≥ 2 and options.bytes > 0 are checked before the call).
  std::unique_ptr<source> (*make_source)(const source_options& options) = nullptr;
  /// Receiver side, unattached, on CUDA device `device` (ignored by host transports); `timeout`
  /// bounds every wait of the sink on its peer.
  std::unique_ptr<sink> (*make_sink)(int device, milliseconds timeout) = nullptr;
};

/// Adds a transport. Throws refit::error(internal) for an empty or malformed name, a missing
/// factory or a name registered already. Thread-safe; meant for static initialisation (registrar).
void register_transport(const registration& r);
/// The transport registered under `name`, nullptr when none is. Thread-safe.
const registration* find_transport(std::string_view name) noexcept;
/// The names of every registered transport, sorted: "cuda_ipc, host_shm, nccl" in a full build.
std::string registered_transports();

/// Refers to the registrar of every transport listed in lib/transport/meson.build that this build
/// has (generated: builtin.cpp.in); the registry calls it.
void keep_builtin_transports() noexcept;

/// Registers a transport when its file's static objects are initialised; see REFIT_TRANSPORT.
struct registrar {
  explicit registrar(const registration& r) { register_transport(r); }
};

}  // namespace refit::transport

/// Registers transport `ident` (its name, as an identifier) from its own file, at namespace scope
/// outside any namespace:
///   REFIT_TRANSPORT(pipe, {"pipe", capabilities{}, make_pipe_source, make_pipe_sink});
/// The registrar is the symbol `refit_transport_<ident>`; for a transport listed in
/// lib/transport/meson.build the build generates a reference to it (builtin.cpp.in), so that a
/// static link keeps the transport.
#define REFIT_TRANSPORT(ident, ...)                                                                    \
  extern "C" {                                                                                         \
  ::refit::transport::registrar refit_transport_##ident{::refit::transport::registration __VA_ARGS__}; \
  }                                                                                                    \
  static_assert(true, "REFIT_TRANSPORT ends with a semicolon")
