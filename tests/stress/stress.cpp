// Helpers of the stress suite.
#include "stress/stress.hpp"

#include <dirent.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <fstream>
#include <sstream>
#include <thread>

namespace refit::stress {

std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  const std::string s(v);
  std::uint64_t out = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  if (ec != std::errc{} || end != s.data() + s.size())
    throw std::runtime_error(std::string(name) + "='" + s + "' is not an unsigned integer");
  return out;
}

host_tensors::host_tensors(const std::vector<tensor_meta>& metas, std::uint64_t version) {
  bytes.reserve(metas.size());
  refs.reserve(metas.size());
  for (const auto& meta : metas) {
    const auto n = meta.nbytes();
    auto& b = bytes.emplace_back(std::max<std::uint64_t>(n, 1), std::uint8_t{0});
    test::fill_pattern(meta.name, version, b.data(), n);
    refs.push_back(tensor_ref{meta, b.data(), device::cpu(), nullptr});
  }
}

table::table(std::vector<tensor_meta> m) : metas(std::move(m)) {
  data.reserve(metas.size());
  for (const auto& meta : metas) data.emplace_back(std::max<std::uint64_t>(meta.nbytes(), 1), std::uint8_t{0});
}

void table::register_in(receiver& r) {
  for (std::size_t i = 0; i < metas.size(); ++i) r.add_parameter(tensor_dest{metas[i], data[i].data(), device::cpu()});
}

std::string table::check(std::optional<std::uint64_t> version) const {
  std::vector<std::uint8_t> want;
  for (std::size_t i = 0; i < metas.size(); ++i) {
    const auto n = metas[i].nbytes();
    want.assign(n, 0);
    if (version) test::fill_pattern(metas[i].name, *version, want.data(), n);
    const auto [w, d] = std::mismatch(want.begin(), want.end(), data[i].data());
    if (w != want.end())
      return describe(metas[i]) + "_differs_from_" + (version ? "version_" + std::to_string(*version) : "zeros") +
             "_at_byte_" + std::to_string(w - want.begin());
  }
  return "ok";
}

namespace {

/// Calls f(name) for every entry of a directory but "." and "..".
template <class F>
void for_each_entry(const char* path, F&& f) {
  DIR* d = ::opendir(path);
  if (d == nullptr) throw std::runtime_error(std::string("cannot open ") + path);
  while (const dirent* e = ::readdir(d)) {
    const std::string_view name(e->d_name);
    if (name == "." || name == "..") continue;
    f(name, ::dirfd(d));
  }
  ::closedir(d);
}

}  // namespace

process_figures process_figures::now() {
  process_figures f;
  for_each_entry("/proc/self/fd", [&](std::string_view name, int dir_fd) {
    const std::string fd_name(name);
    if (std::stoi(fd_name) == dir_fd) return;  // the directory stream's own descriptor
    ++f.fds;
    char target[256] = {};
    const std::string link = "/proc/self/fd/" + fd_name;
    const ssize_t n = ::readlink(link.c_str(), target, sizeof target - 1);
    if (n > 0 && std::string_view(target, static_cast<std::size_t>(n)).starts_with("socket:")) ++f.sockets;
  });
  const std::string own = "refit-" + std::to_string(::getpid()) + "-";
  for_each_entry("/dev/shm", [&](std::string_view name, int) {
    if (name.starts_with("refit-")) ++f.shm_all;
    if (name.starts_with(own)) ++f.shm_own;
  });
  {
    std::ifstream maps("/proc/self/maps");
    for (std::string line; std::getline(maps, line);)
      if (line.find("/dev/shm/refit-") != std::string::npos) ++f.shm_mapped;
  }
  {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);)
      if (line.starts_with("VmRSS:")) f.rss_kib = std::stol(line.substr(6));
  }
  return f;
}

namespace {

bool same_counts(const process_figures& a, const process_figures& b) {
  return a.fds == b.fds && a.sockets == b.sockets && a.shm_own == b.shm_own && a.shm_mapped == b.shm_mapped;
}

bool not_above(const process_figures& f, const process_figures& baseline) {
  return f.fds <= baseline.fds && f.sockets <= baseline.sockets && f.shm_own <= baseline.shm_own &&
         f.shm_mapped <= baseline.shm_mapped;
}

// Between readings: a poll interval while waiting for ZeroMQ's reaper thread, which signals
// nothing this process could wait on.
constexpr std::chrono::milliseconds reading_interval{10};

}  // namespace

process_figures process_figures::settled(std::chrono::milliseconds limit) {
  const auto start = clock_type::now();
  process_figures last = now();
  for (int agreeing = 1; agreeing < 3 && since(start) < limit;) {
    std::this_thread::sleep_for(reading_interval);
    const process_figures f = now();
    agreeing = same_counts(f, last) ? agreeing + 1 : 1;
    last = f;
  }
  return last;
}

process_figures process_figures::back_to(const process_figures& baseline, std::chrono::milliseconds limit) {
  const auto start = clock_type::now();
  process_figures f = now();
  while (!not_above(f, baseline) && since(start) < limit) {
    std::this_thread::sleep_for(reading_interval);
    f = now();
  }
  return f;
}

std::string process_figures::text() const {
  std::ostringstream s;
  s << "fds=" << fds << " sockets=" << sockets << " shm_own=" << shm_own << " shm_all=" << shm_all
    << " shm_mapped=" << shm_mapped << " rss_kib=" << rss_kib;
  return s.str();
}

process_figures process_figures::parse(const std::string& line) {
  process_figures f;
  std::istringstream s(line);
  int seen = 0;
  for (std::string word; s >> word;) {
    const auto eq = word.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = word.substr(0, eq);
    const long value = std::stol(word.substr(eq + 1));
    if (key == "fds")
      f.fds = value, ++seen;
    else if (key == "sockets")
      f.sockets = value, ++seen;
    else if (key == "shm_own")
      f.shm_own = value, ++seen;
    else if (key == "shm_all")
      f.shm_all = value, ++seen;
    else if (key == "shm_mapped")
      f.shm_mapped = value, ++seen;
    else if (key == "rss_kib")
      f.rss_kib = value, ++seen;
  }
  if (seen != 6) throw std::runtime_error("not a line of process figures: '" + line + "'");
  return f;
}

}  // namespace refit::stress
