// refit-bench's processes: the one place the bench starts and ends them (bench/spawn.cpp). A role
// it runs as another process is either exec'd (child_process: this binary again, started clean) or
// forked without exec (fork_child: bench code of this process, forked before any CUDA or zmq use).
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace refit::bench {

/// A bench process spawned by the streamer: fork, then execv(exe, args) at once (never a fork
/// that keeps a CUDA context). Its stdin is a pipe we hold (closing it tells the child to exit),
/// its stdout a pipe we read JSON lines from; stderr is shared. The destructor finishes it.
class child_process {
 public:
  child_process(const std::string& exe, const std::vector<std::string>& args);
  ~child_process();
  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;

  /// The next line the child printed; throws errc::timeout past `timeout`, errc::peer when it exits.
  std::string read_line(std::chrono::milliseconds timeout);
  /// False once the child has exited (reaps it; never blocks).
  bool running() noexcept;
  /// Closes the child's stdin, waits for it (kills it past `grace`); returns its wait status.
  int finish(std::chrono::milliseconds grace) noexcept;
  /// SIGKILL, then waits until it has ended (waitpid: the process is gone when this returns);
  /// returns its wait status.
  int kill() noexcept;
  [[nodiscard]] int pid() const noexcept { return pid_; }
  /// "exit code N" / "killed by signal N" for a wait status.
  static std::string describe_exit(int status);

 private:
  int pid_ = -1;
  int stdin_ = -1;
  int stdout_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::string buffer_;
};

/// A child forked without exec (it runs bench code of this process: a receiver, a streamer rank)
/// and the pipes to it: `to` what it reads, `from` what it writes.
struct forked_child {
  int pid = -1;
  int to = -1, from = -1;
};
/// Forks a child that runs `body(in, out)` (its ends of the two pipes) and never returns. `who`
/// prefixes the errors (errc::io) when the pipes or the fork fail ("--delta: fork() failed").
forked_child fork_child(std::string_view who, const std::function<void(int in, int out)>& body);
/// Ends a child: closes its pipes and waits for it; its wait status.
int reap(forked_child& k);

/// Whether a wait status is a normal exit with code 0.
bool exited_cleanly(int status) noexcept;

/// Whether stdin was closed (a spawned process's streamer is done, or died), waiting up to
/// `wait_ms` for it to say anything.
bool stdin_closed(int wait_ms);
/// A line from `fd` (blocking), without its newline; empty at the end of the pipe.
std::string read_line(int fd);
/// Writes `line` (newlines inside it made spaces) and a newline to `fd`; throws errc::io when the
/// pipe is broken.
void write_line(int fd, std::string line);
/// Throws once the other end of `fd` is gone (the bench's main process ended): a forked child's
/// `watch` while it waits.
std::function<void()> watch_parent(int fd);

/// A private directory (mode 0700) for the spawned receivers' ipc sockets; removed with it.
struct temp_dir {
  temp_dir();
  ~temp_dir();
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  std::string path;
};

}  // namespace refit::bench
