#include "model/log.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "model/text.hpp"

namespace refit::log {
namespace {

struct sink_state {
  level threshold = level::warn;
  std::FILE* file = stderr;
  std::string prefix;
  std::mutex mutex;

  sink_state() {
    if (const char* v = std::getenv("REFIT_LOG")) {
      if (std::strcmp(v, "error") == 0)
        threshold = level::error;
      else if (std::strcmp(v, "info") == 0)
        threshold = level::info;
      else if (std::strcmp(v, "debug") == 0)
        threshold = level::debug;
    }
    if (const char* path = std::getenv("REFIT_LOG_FILE"); path != nullptr && *path != '\0') {
      if (std::FILE* f = std::fopen(path, "a")) file = f;
    }
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "?");
    prefix = fmt::format("{}:{} refit ", host, ::getpid());
  }
};

sink_state& state() {
  static sink_state s;  // never destroyed before the last log line: function-local static
  return s;
}

constexpr const char* names[] = {"ERROR", "WARN", "INFO", "DEBUG"};

// Messages quote what peers sent (tensor and peer names, reasons): each becomes one line of
// printable text, bounded (model/text.hpp), so that no peer can forge or flood a line.
constexpr std::size_t max_line_bytes = 16384;

}  // namespace

bool enabled(level l) noexcept { return static_cast<int>(l) <= static_cast<int>(state().threshold); }

void write(level l, std::string_view message) noexcept {
  try {
    auto& s = state();
    // The pid in the prefix is read once; a forked child logs its own pid.
    // Debug lines carry the monotonic clock (seconds, microsecond digits): equal across the
    // processes of one host, so a streamer's and a receiver's lines interleave into one timeline.
    const std::string when =
        l == level::debug
            ? fmt::format("{:.6f} ",
                          std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count())
            : std::string();
    const std::string line = fmt::format("{}:{} refit {} {}{}\n", s.prefix.substr(0, s.prefix.find(':')), ::getpid(),
                                         names[static_cast<int>(l)], when, printable(message, max_line_bytes));
    std::lock_guard lock(s.mutex);
    std::fwrite(line.data(), 1, line.size(), s.file);
    std::fflush(s.file);
  } catch (...) {
    // Logging never throws.
  }
}

}  // namespace refit::log
