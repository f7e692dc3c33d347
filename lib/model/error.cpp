#include "refit/error.hpp"

#include <array>

namespace refit {

std::string_view to_string(errc code) noexcept {
  static constexpr std::array<std::string_view, 15> names = {"unknown",      "invalid_argument",
                                                             "protocol",     "version_mismatch",
                                                             "timeout",      "peer",
                                                             "unauthorized", "transport",
                                                             "cuda",         "nccl",
                                                             "apply",        "incomplete",
                                                             "io",           "internal",
                                                             "needs_whole"};
  const auto i = static_cast<std::size_t>(code);
  return i < names.size() ? names[i] : names[0];
}

error::error(errc code, const std::string& message) : std::runtime_error(message), code_(code) {}

}  // namespace refit
