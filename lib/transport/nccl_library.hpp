// refit — the NCCL this process loaded (include/refit/nccl.hpp says which one is chosen, and why).
// Built with or without NCCL's header: the choice and its errors are unit-tested everywhere.
#pragma once

#include <string>

#include "refit/nccl.hpp"

namespace refit::transport {

/// The address of NCCL function `name` in the library chosen (loading it first), or null when
/// NCCL is not available or lacks it. Thread-safe.
[[nodiscard]] void* nccl_symbol(const char* name) noexcept;

/// The library, loaded; throws refit::error(errc::nccl) saying why there is none and what to do
/// (the nccl transport calls this before its first NCCL call).
const nccl_library_info& require_nccl();

/// The words for two peers whose NCCL differ: both versions and paths, and how to match them.
std::string nccl_mismatch(int mine, const std::string& my_path, int theirs, const std::string& their_path,
                          const std::string& theirs_are);

/// "2.28.9" for 22809 (NCCL's encoding since 2.9: major × 10000 + minor × 100 + patch).
std::string nccl_version_text(int version);

}  // namespace refit::transport
