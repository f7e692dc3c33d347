// The one place the bench starts and ends processes (bench/spawn.hpp): the roles it execs
// (child_process: a receiver, an nccl ceiling rank), the children it forks without exec (fork_child:
// --streamers' and --delta's receivers and streamer ranks), the pipes between them, and the private
// directory the spawned receivers bind in.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <thread>
#include <utility>

#include "bench/spawn.hpp"
#include "refit/error.hpp"

namespace refit::bench {
namespace {
using clock = std::chrono::steady_clock;
}  // namespace

// ---------------------------------------------------------------- exec'd roles

child_process::child_process(const std::string& exe, const std::vector<std::string>& args) {
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0)
    throw error(errc::io, fmt::format("refit-bench: pipe failed: {}", std::strerror(errno)));
  // Everything the child needs is prepared before fork: after it, only exec.
  std::vector<std::string> storage{exe};
  storage.insert(storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : storage) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::cout.flush();
  std::cerr.flush();
  pid_ = ::fork();
  if (pid_ < 0) throw error(errc::io, fmt::format("refit-bench: fork failed: {}", std::strerror(errno)));
  if (pid_ == 0) {
    ::dup2(in[0], 0);
    ::dup2(out[1], 1);
    ::execv(exe.c_str(), argv.data());
    const char msg[] = "refit-bench: execv of the receiver failed\n";
    (void)!::write(2, msg, sizeof msg - 1);
    ::_exit(127);
  }
  ::close(in[0]);
  ::close(out[1]);
  stdin_ = in[1];
  stdout_ = out[0];
}

child_process::~child_process() { finish(std::chrono::seconds(30)); }

forked_child fork_child(std::string_view who, const std::function<void(int in, int out)>& body) {
  int down[2], up[2];
  if (::pipe(down) != 0 || ::pipe(up) != 0) throw error(errc::io, fmt::format("{}: pipe() failed", who));
  const pid_t pid = ::fork();
  if (pid < 0) throw error(errc::io, fmt::format("{}: fork() failed", who));
  if (pid == 0) {
    ::close(down[1]);
    ::close(up[0]);
    body(down[0], up[1]);
  }
  ::close(down[0]);
  ::close(up[1]);  // so that reading what the child writes ends when it exits
  return forked_child{pid, down[1], up[0]};
}

int reap(forked_child& k) {
  ::close(k.to);
  ::close(k.from);
  int status = 0;
  ::waitpid(k.pid, &status, 0);
  return status;
}

std::string child_process::read_line(std::chrono::milliseconds timeout) {
  const auto deadline = clock::now() + timeout;
  for (;;) {
    const auto nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()).count();
    if (left <= 0)
      throw error(errc::timeout,
                  fmt::format("refit-bench: the receiver (pid {}) sent no result for {} ms", pid_, timeout.count()));
    if (stdout_ < 0) throw error(errc::peer, fmt::format("refit-bench: the receiver process (pid {}) has ended", pid_));
    pollfd p{stdout_, POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000)));
    if (r < 0 && errno != EINTR)
      throw error(errc::io, fmt::format("refit-bench: poll failed: {}", std::strerror(errno)));
    if (r <= 0) continue;
    char chunk[65536];
    const ssize_t n = ::read(stdout_, chunk, sizeof chunk);
    if (n > 0) {
      buffer_.append(chunk, static_cast<std::size_t>(n));
    } else if (n == 0) {
      throw error(errc::peer, fmt::format("refit-bench: the receiver process (pid {}) exited: {}", pid_,
                                          describe_exit(finish(std::chrono::seconds(5)))));
    } else if (errno != EINTR) {
      throw error(errc::io, fmt::format("refit-bench: read from the receiver failed: {}", std::strerror(errno)));
    }
  }
}

bool child_process::running() noexcept {
  if (pid_ <= 0 || reaped_) return false;
  const pid_t r = ::waitpid(pid_, &status_, WNOHANG);
  if (r == pid_ || (r < 0 && errno != EINTR)) reaped_ = true;
  return !reaped_;
}

int child_process::finish(std::chrono::milliseconds grace) noexcept {
  if (stdin_ >= 0) ::close(std::exchange(stdin_, -1));
  if (pid_ > 0 && !reaped_) {
    const auto deadline = clock::now() + grace;
    for (;;) {
      const pid_t r = ::waitpid(pid_, &status_, WNOHANG);
      if (r == pid_ || (r < 0 && errno != EINTR)) break;
      if (clock::now() >= deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status_, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    reaped_ = true;
  }
  if (stdout_ >= 0) ::close(std::exchange(stdout_, -1));
  return status_;
}

int child_process::kill() noexcept {
  if (stdin_ >= 0) ::close(std::exchange(stdin_, -1));
  if (pid_ > 0 && !reaped_) {
    ::kill(pid_, SIGKILL);
    while (::waitpid(pid_, &status_, 0) < 0 && errno == EINTR) {
    }
    reaped_ = true;
  }
  if (stdout_ >= 0) ::close(std::exchange(stdout_, -1));
  return status_;
}

std::string child_process::describe_exit(int status) {
  if (WIFEXITED(status)) return fmt::format("exit code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("killed by signal {}", WTERMSIG(status));
  return "unknown status";
}

bool exited_cleanly(int status) noexcept { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }

// ---------------------------------------------------------------- pipes

bool stdin_closed(int wait_ms) {
  pollfd p{0, POLLIN, 0};
  if (::poll(&p, 1, wait_ms) <= 0) return false;
  char b[256];
  return ::read(0, b, sizeof b) <= 0;
}

/// A line from `fd` (blocking), without its newline; empty at the end of the pipe.
std::string read_line(int fd) {
  std::string line;
  char ch = 0;
  while (::read(fd, &ch, 1) == 1 && ch != '\n') line.push_back(ch);
  return line;
}

/// Writes `line` (newlines inside it made spaces) and a newline to `fd`.
void write_line(int fd, std::string line) {
  std::replace(line.begin(), line.end(), '\n', ' ');
  line.push_back('\n');
  for (std::size_t done = 0; done < line.size();) {
    const ssize_t w = ::write(fd, line.data() + done, line.size() - done);
    if (w <= 0) throw error(errc::io, "refit-bench: a pipe between the bench's processes broke");
    done += static_cast<std::size_t>(w);
  }
}

/// Throws once the other end of `fd` is gone (the bench's main process ended).
std::function<void()> watch_parent(int fd) {
  return [fd] {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR)) != 0)
      throw error(errc::peer, "the bench's main process went away");
  };
}

/// A child's part of the nccl ceiling: joins `comms` on `gpu`, says "ceiling MEDIAN BEST" (seconds)

// ---------------------------------------------------------------- the private directory

temp_dir::temp_dir() {
  const char* base = std::getenv("XDG_RUNTIME_DIR");
  std::string tmpl = fmt::format("{}/refit-bench-XXXXXX", base && *base && ::access(base, W_OK) == 0 ? base : "/tmp");
  if (!::mkdtemp(tmpl.data()))
    throw error(errc::io, fmt::format("refit-bench: mkdtemp failed: {}", std::strerror(errno)));
  path = tmpl;
}

temp_dir::~temp_dir() {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

}  // namespace refit::bench
