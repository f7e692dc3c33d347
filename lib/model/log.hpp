// refit — logging. REFIT_LOG=warn|info|debug (default warn), REFIT_LOG_FILE=path (default stderr).
// Lines look like "host:pid refit LEVEL message". The library never writes to stdout.
#pragma once

#include <fmt/format.h>

#include <string_view>

namespace refit::log {

enum class level : int { error = 0, warn = 1, info = 2, debug = 3 };

/// True when messages of this level are written.
bool enabled(level l) noexcept;
/// Writes one line (thread-safe): `message` as printable() shows it (model/text.hpp), so a peer's
/// text quoted in it can neither break the line nor flood the log. Never throws.
void write(level l, std::string_view message) noexcept;

}  // namespace refit::log

#define REFIT_LOG_AT(lvl, ...)                                                            \
  do {                                                                                    \
    if (::refit::log::enabled(lvl)) ::refit::log::write(lvl, ::fmt::format(__VA_ARGS__)); \
  } while (0)
#define REFIT_ERROR(...) REFIT_LOG_AT(::refit::log::level::error, __VA_ARGS__)
#define REFIT_WARN(...) REFIT_LOG_AT(::refit::log::level::warn, __VA_ARGS__)
#define REFIT_INFO(...) REFIT_LOG_AT(::refit::log::level::info, __VA_ARGS__)
#define REFIT_DEBUG(...) REFIT_LOG_AT(::refit::log::level::debug, __VA_ARGS__)
