// refit — which NCCL the nccl transport uses.
//
// refit does not link NCCL: it loads it at run time, once, at the first nccl session (or the first
// call below), so that one process holds one NCCL whoever brought it. NCCL refuses peers of other
// versions, and a Python process holding torch already has torch's own (the `nvidia-nccl` wheel,
// often not the system's). The library is chosen, first match wins:
//   1. use_nccl_library(path), or the environment variable REFIT_NCCL_LIBRARY;
//   2. an NCCL this process has loaded already (torch's, when torch was imported first);
//   3. prefer_nccl_library(path): the Python package names torch's wheel NCCL here when it is
//      installed, so refit and a torch imported later share it whatever the import order;
//   4. "libnccl.so.2" from the dynamic loader's search path (LD_LIBRARY_PATH, ldconfig), then the
//      copy this librefit was built against.
// HELLO carries the streamer's NCCL version and path; a receiver that loaded another version
// refuses the session before any communicator exists, naming both.
#pragma once

#include <string>

#include "refit/export.hpp"

namespace refit {

/// The NCCL this process uses for refit's nccl transport.
struct nccl_library_info {
  bool available = false;  ///< loaded, and has every function refit calls
  std::string path;        ///< the file loaded (resolved: the real path of the shared object)
  int version = 0;         ///< ncclGetVersion(): 22809 for 2.28.9
  std::string chosen_by;   ///< "use_nccl_library", "REFIT_NCCL_LIBRARY", "loaded in this process", ...
  std::string error;       ///< when not available: why, and what to do
};

/// Loads NCCL now, if it is not yet, and says which one (never throws; `available` false and
/// `error` set when there is none or it lacks a function refit calls). Without NCCL support in this
/// librefit (has_transport(transport_kind::nccl) false), `available` is false. Thread-safe.
[[nodiscard]] REFIT_API nccl_library_info nccl_library();

/// Names the NCCL to use, before the first nccl session. Calling it again with the same path, or
/// after that library was loaded, does nothing. Throws refit::error: errc::invalid_argument when
/// another NCCL is loaded already (refit cannot switch: communicators of one process share it), or
/// when `path` cannot be loaded (the message holds dlopen's reason). Thread-safe.
REFIT_API void use_nccl_library(const std::string& path);

/// The NCCL to use when nothing was named and the process has none loaded (step 3 above): loaded
/// lazily, only if it comes to that. Never throws; a later failure to load it falls through to the
/// default search. Thread-safe.
REFIT_API void prefer_nccl_library(const std::string& path) noexcept;

/// A human-readable line: "NCCL 2.28.9 (/path/libnccl.so.2, loaded in this process)", or why none.
[[nodiscard]] REFIT_API std::string describe(const nccl_library_info& info);

}  // namespace refit
