// refit — endpoints: private ipc directories and the bind defaults (loopback for tcp).
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "channel/channel.hpp"

namespace refit::channel {
namespace {

constexpr std::string_view ipc_scheme = "ipc://";
constexpr std::string_view tcp_scheme = "tcp://";

std::string runtime_dir() {
  // $XDG_RUNTIME_DIR is per-user and mode 0700 already; /tmp is the fallback everybody has.
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg != nullptr && *xdg == '/') {
    struct stat st {};
    if (::stat(xdg, &st) == 0 && S_ISDIR(st.st_mode) && ::access(xdg, W_OK | X_OK) == 0) return xdg;
  }
  return "/tmp";
}

bool all_digits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

}  // namespace

std::string make_private_endpoint(std::string_view name) {
  if (name.empty() || name.find('/') != std::string_view::npos)
    throw error(errc::invalid_argument,
                fmt::format("private endpoint name '{}' must be non-empty and contain no '/'", name));
  std::string pattern = runtime_dir() + "/refit-XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    const int e = errno;
    throw error(errc::io, fmt::format("cannot create a private endpoint directory {}: {}", pattern, std::strerror(e)));
  }
  const std::string dir(buf.data());
  // mkdtemp creates 0700 already; the chmod makes it independent of the umask and libc.
  if (::chmod(dir.c_str(), 0700) != 0) {
    const int e = errno;
    ::rmdir(dir.c_str());
    throw error(errc::io, fmt::format("cannot make {} private (chmod 0700): {}", dir, std::strerror(e)));
  }
  return fmt::format("{}{}/{}.sock", ipc_scheme, dir, name);
}

void remove_private_endpoint(std::string_view endpoint) noexcept {
  try {
    if (!endpoint.starts_with(ipc_scheme)) return;
    const std::string path(endpoint.substr(ipc_scheme.size()));
    const auto slash = path.rfind('/');
    if (slash == std::string::npos || slash == 0) return;
    const std::string dir = path.substr(0, slash);
    const std::string file = path.substr(slash + 1);
    const auto dslash = dir.rfind('/');
    const std::string base = dslash == std::string::npos ? dir : dir.substr(dslash + 1);
    // Only what make_private_endpoint() made: ".../refit-XXXXXX/<name>.sock".
    if (!base.starts_with("refit-") || !file.ends_with(".sock") || file.size() <= 5) return;
    ::unlink(path.c_str());
    ::rmdir(dir.c_str());
  } catch (...) {
    // Allocation failure while building paths: nothing to clean up that we could reach.
  }
}

std::string bind_endpoint(std::string_view requested) {
  if (requested.empty()) return make_private_endpoint();
  if (requested.starts_with(ipc_scheme)) {
    if (requested.size() == ipc_scheme.size())
      throw error(errc::invalid_argument, "endpoint 'ipc://' has no path: give ipc:///some/dir/name.sock");
    return std::string(requested);
  }
  if (requested.starts_with(tcp_scheme)) {
    const std::string_view rest = requested.substr(tcp_scheme.size());
    std::string host;
    std::string port;
    const auto colon = rest.rfind(':');
    if (colon == std::string_view::npos) {
      if (!all_digits(rest))
        throw error(
            errc::invalid_argument,
            fmt::format("endpoint '{}' has no port: use tcp://127.0.0.1:PORT (0 for any free port)", requested));
      port = std::string(rest);
    } else {
      host = std::string(rest.substr(0, colon));
      port = std::string(rest.substr(colon + 1));
    }
    if (host.empty() || host == "*") host = "127.0.0.1";
    if (port == "0") port = "*";  // ZeroMQ's syntax for an ephemeral port
    if (port.empty())
      throw error(errc::invalid_argument,
                  fmt::format("endpoint '{}' has no port: use tcp://127.0.0.1:PORT (0 for any free port)", requested));
    return fmt::format("{}{}:{}", tcp_scheme, host, port);
  }
  const auto sep = requested.find("://");
  throw error(errc::invalid_argument,
              fmt::format("endpoint '{}' uses scheme '{}': refit supports ipc:// and tcp:// only", requested,
                          sep == std::string_view::npos ? std::string_view("(none)") : requested.substr(0, sep)));
}

}  // namespace refit::channel
