// refit — who and where a process is, for same-host checks and messages.
#include <fmt/format.h>
#include <limits.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "transport/transport.hpp"

namespace refit::transport {
namespace {

std::string hostname() {
  char buf[HOST_NAME_MAX + 1] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown-host";
  return buf;
}

std::string trim(std::string s) {
  const auto first = s.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return {};
  const auto last = s.find_last_not_of(" \t\r\n");
  return s.substr(first, last - first + 1);
}

}  // namespace

std::string host_identity() {
  // The boot id changes with every kernel boot, so two containers that share a hostname but not
  // a kernel (and hence not /dev/shm) are told apart; two containers sharing a kernel may still
  // have separate /dev/shm, which attach() reports as a missing segment.
  std::string boot_id;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  if (in) std::getline(in, boot_id);
  boot_id = trim(boot_id);
  if (boot_id.empty()) return hostname();
  return hostname() + "/" + boot_id;
}

std::string process_identity() { return fmt::format("{}:{}", hostname(), ::getpid()); }

}  // namespace refit::transport
