// The two sides of the bench and the process that ties them together.
//
// By default one command is the streamer and spawns the receiver as its own process: fork, then
// execv("/proc/self/exe", "--role receiver --bind EP ...") so the child starts clean (never a
// fork that keeps a CUDA context). The receiver reports each committed refit on its stdout as
// one JSON line: {"event":"committed","version":v,"apply_ms":..,"checksums":[...]}; the streamer
// compares every checksum with the one it expects. Over nccl it spawns --receivers of them, receiver
// k on GPU (device + 1 + k) % visible, and every one must commit every version; wrong checksums are
// summed over them. With --layout tpN over cuda_ipc and nccl it spawns one receiver per rank and
// passes all their endpoints to one streamer; each rank's checksums are those of its slices, so
// the streamer expects per rank the checksum of the same slice of its source (a slice of
// dimension 1 gathered first: its bytes are strided in the source). host_shm runs one rank (--rank).
//
// Started by hand (--role receiver, then --role streamer, on one host or two), the receiver prints
// the same lines and also binds a report endpoint (--report; by default next to --bind): a REP
// socket that answers {"version": v} with its committed line for v. The streamer (--report, the
// endpoint the receiver printed) asks it after every refit and compares the checksums with the
// same code as above (count_wrong), so a wrong byte fails the run in both modes. The receiver
// answers only between refits (serve_one() with a short wait, then the report socket without
// one): a request sent during a refit waits in the socket's queue and never slows the refit.
// --no-verify runs the streamer without a report endpoint: unverified, wrong = n/a.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include "bench/bench.hpp"
#include "channel/channel.hpp"
#include "config/config.hpp"
#include "model/text.hpp"
#include "refit/error.hpp"
#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "transport/transport.hpp"

namespace refit::bench {
namespace {

using clock = std::chrono::steady_clock;
using nlohmann::json;

double ms_since(clock::time_point t0) { return std::chrono::duration<double, std::milli>(clock::now() - t0).count(); }

volatile sig_atomic_t stop_requested = 0;
extern "C" void on_stop_signal(int) { stop_requested = 1; }

void progress(const config& c, const std::string& line) {
  if (!c.quiet) std::cerr << "refit-bench: " << line << std::endl;
}

// One JSON line of ours. It may hold a peer's text (an error quoting a tensor name): bytes that are
// not UTF-8 become U+FFFD instead of an exception that would end the receiver.
std::string dump_line(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// The longest report request a receiver reads: {"version": N} and some spaces.
constexpr std::size_t max_request_bytes = 4096;

// A JSON number that is a non-negative integer (a version, a checksum), else nullopt.
std::optional<std::uint64_t> unsigned_of(const json& j) {
  if (j.is_number_unsigned()) return j.get<std::uint64_t>();
  if (j.is_number_integer() && j.get<std::int64_t>() >= 0) return static_cast<std::uint64_t>(j.get<std::int64_t>());
  return std::nullopt;
}

}  // namespace

// ---------------------------------------------------------------- child processes

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

std::string child_process::describe_exit(int status) {
  if (WIFEXITED(status)) return fmt::format("exit code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("killed by signal {}", WTERMSIG(status));
  return "unknown status";
}

// ---------------------------------------------------------------- verification

std::string default_report_endpoint(std::string_view refit_endpoint) {
  const std::string_view ep = refit_endpoint;
  if (ep.starts_with("ipc://") && ep.size() > 6) return fmt::format("{}.report", ep);
  if (ep.starts_with("tcp://")) {
    // The last ':' separates the port, unless it is inside an IPv6 address ("tcp://[::1]").
    const auto colon = ep.rfind(':');
    if (colon > 5 && colon + 1 < ep.size() && ep.find(']', colon) == std::string_view::npos)
      return fmt::format("{}:*", ep.substr(0, colon));
  }
  throw error(errc::invalid_argument, fmt::format("refit-bench: no default report endpoint for '{}': give --report "
                                                  "ipc:///PATH or tcp://HOST:PORT",
                                                  ep));
}

std::optional<std::string> peer_json_problem(std::string_view text, std::size_t max_bytes) {
  if (text.size() > max_bytes) return fmt::format("of {} bytes, more than the {} it may have", text.size(), max_bytes);
  std::size_t depth = 0;
  bool in_string = false, escaped = false;
  for (const char ch : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (ch == '\\')
        escaped = true;
      else if (ch == '"')
        in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      if (++depth > max_json_depth) return fmt::format("nested deeper than {} levels", max_json_depth);
    } else if ((ch == ']' || ch == '}') && depth > 0) {
      --depth;
    }
  }
  return std::nullopt;
}

json parse_peer_json(std::string_view text, std::size_t max_bytes, std::string_view who) {
  if (const auto problem = peer_json_problem(text, max_bytes))
    throw error(errc::protocol, fmt::format("refit-bench: {} sent JSON {}: refused unread; it begins {}", who, *problem,
                                            printable(text, 200)));
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded())
    throw error(errc::protocol,
                fmt::format("refit-bench: {} sent a line that is not JSON: {}", who, printable(text, 200)));
  return j;
}

namespace {

// excerpt()'s writer. Its recursion ends at depth 8 whatever the value holds.
void excerpt_into(std::string& out, const json& j, std::size_t max_bytes, int depth) {
  const auto scalar = [&](const json& v) {
    // A long string is cut before it is written out: the excerpt shows its start only.
    const json cut = v.is_string() && v.get_ref<const std::string&>().size() > max_bytes
                         ? json(v.get_ref<const std::string&>().substr(0, max_bytes))
                         : json();
    out += (cut.is_null() ? v : cut).dump(-1, ' ', false, json::error_handler_t::replace);
  };
  if (!j.is_structured()) return scalar(j);
  const bool array = j.is_array();
  if (depth >= 8) {
    out += array ? "[…]" : "{…}";
    return;
  }
  out += array ? '[' : '{';
  bool first = true;
  for (const auto& item : j.items()) {
    if (out.size() > max_bytes) break;
    if (!first) out += ',';
    first = false;
    if (!array) {
      scalar(json(item.key()));
      out += ':';
    }
    excerpt_into(out, item.value(), max_bytes, depth + 1);
  }
  out += array ? ']' : '}';
}

}  // namespace

std::string excerpt(const json& j, std::size_t max_bytes) {
  std::string out;
  excerpt_into(out, j, max_bytes, 0);
  return printable(out, max_bytes);
}

std::size_t max_report_bytes(const manifest& m) {
  // A checksum is at most 20 digits and a comma; the rest of the line (and an aborted line's
  // error) fits in the MiB.
  return (std::size_t{1} << 20) + 32 * m.entries.size();
}

std::int64_t count_wrong(const config& c, const json& line, std::uint64_t version, const manifest& m,
                         const std::vector<std::uint64_t>& expected, const std::string& who,
                         const std::string& receiver, std::int64_t& printed, int rank) {
  const auto said = [&] { return excerpt(line); };
  const bool object = line.is_object();
  const auto v = object ? line.find("version") : line.end();
  if (!object || line.value("event", json()) != "committed" || v == line.end() || unsigned_of(*v) != version) {
    const bool unknown = object && line.value("event", json()) == "unknown";
    throw error(errc::protocol,
                fmt::format("refit-bench: {} did not commit version {}: it said {}{}", who, version, said(),
                            unknown ? " (it has no record of that version: is --connect the endpoint of "
                                      "the receiver that printed this report endpoint?)"
                                    : ""));
  }
  // A receiver started by hand with another --layout: its checksums would still match, but the
  // rows would name the wrong layout.
  const auto held = line.find("layout");
  if (held != line.end() && *held != layout_name(c.layout))
    throw error(errc::protocol, fmt::format("refit-bench: {} holds the model in layout {} and this streamer runs with "
                                            "--layout {}: give both sides the same --layout",
                                            who, excerpt(*held), layout_name(c.layout)));
  // A tensor-parallel rank's checksums are of its slices: another rank's would all be wrong.
  const auto held_rank = line.find("rank");
  if (c.layout.tp > 1 && held_rank != line.end() && unsigned_of(*held_rank) != static_cast<std::uint64_t>(rank))
    throw error(errc::protocol,
                fmt::format("refit-bench: {} holds rank {} of --layout {} and this streamer checks rank "
                            "{}: give both sides the same --rank",
                            who, excerpt(*held_rank), layout_name(c.layout), rank));
  const std::size_t n = m.entries.size();
  const auto sums = line.find("checksums");
  if (sums == line.end() || !sums->is_array() || sums->size() != n)
    throw error(errc::protocol, fmt::format("refit-bench: {} sent {} checksums for {} tensors", who,
                                            sums == line.end() || !sums->is_array() ? 0 : sums->size(), n));
  std::int64_t wrong = 0;
  if (expected.size() != n) return 0;  // unverified (--convert): the commit is all that is checked
  for (std::size_t i = 0; i < n; ++i) {
    const auto sum = unsigned_of((*sums)[i]);
    if (!sum)
      throw error(errc::protocol,
                  fmt::format("refit-bench: {} sent checksum {} as {}, not a number", who, i, excerpt((*sums)[i])));
    if (*sum == expected[i]) continue;
    if (printed < 3) {
      progress(c, fmt::format("WRONG: version {}{} tensor {} ({}): checksum {:#018x}, expected {:#018x}", version,
                              receiver, i, describe(m.entries[i].meta), *sum, expected[i]));
      ++printed;
    }
    ++wrong;
  }
  return wrong;
}

report_log::report_log(std::size_t capacity) : capacity_(std::max<std::size_t>(capacity, 1)) {}

void report_log::committed(const json& line) { add(line); }
void report_log::aborted(const json& line) { add(line); }

void report_log::add(const json& line) {
  if (events_.size() == capacity_) {
    events_.erase(events_.begin());
    forgot_ = true;
  }
  events_.push_back(line);
}

std::string report_log::answer(std::string_view request) const {
  // A request is a few bytes: anything longer or nested is refused before it is parsed, so that a
  // request costs at most ~150 KiB of heap to parse (36 bytes a byte) whatever its size.
  const auto problem = peer_json_problem(request, max_request_bytes);
  const json req = problem ? json() : json::parse(request, nullptr, false);
  const auto v = req.is_object() ? req.find("version") : req.end();
  const auto asked = v == req.end() ? std::nullopt : unsigned_of(*v);
  if (!asked)
    return json{{"event", "error"},
                {"error", fmt::format("a report request is {{\"version\": N}}{}",
                                      problem ? fmt::format("; this one, {}, was refused unread", *problem) : "")}}
        .dump();
  const std::uint64_t version = *asked;
  const auto is = [](const json& e, std::string_view event) { return e.value("event", std::string()) == event; };
  for (auto e = events_.rbegin(); e != events_.rend(); ++e)
    if (is(*e, "committed") && e->value("version", std::uint64_t{0}) == version) return dump_line(*e);
  // The first abort after the last commit of an earlier version, and before any later one, ended
  // this version (or the refit that was to be it). Without such a commit in the log, only when
  // nothing was forgotten: an abort could otherwise belong to an older version.
  const json* abort = nullptr;
  bool after_earlier = !forgot_;
  for (const auto& e : events_) {
    if (is(e, "committed")) {
      if (e.value("version", std::uint64_t{0}) > version) break;
      after_earlier = true;
      abort = nullptr;
    } else if (is(e, "aborted") && after_earlier && !abort) {
      abort = &e;
    }
  }
  if (abort) return dump_line(*abort);
  return json{{"event", "unknown"}, {"version", version}}.dump();
}

namespace {

/// A receiver started by hand keeps its committed version between streamer runs, and every run
/// counts versions from 1: the receiver's refusal ("version 1 is not newer than the committed
/// version 6") then needs the way out said.
std::string reused_receiver_hint(const error& e) {
  if (std::string_view(e.what()).find("is not newer than the committed version") == std::string_view::npos) return {};
  return "; that receiver has served an earlier run, and every streamer run counts versions from 1: start a fresh "
         "receiver (refit-bench --role receiver) for each run";
}

// A private directory (mode 0700) for the ipc socket; removed at the end.
struct temp_dir {
  temp_dir() {
    const char* base = std::getenv("XDG_RUNTIME_DIR");
    std::string tmpl = fmt::format("{}/refit-bench-XXXXXX", base && *base && ::access(base, W_OK) == 0 ? base : "/tmp");
    if (!::mkdtemp(tmpl.data()))
      throw error(errc::io, fmt::format("refit-bench: mkdtemp failed: {}", std::strerror(errno)));
    path = tmpl;
  }
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  std::string path;
};

// ---------------------------------------------------------------- workloads

manifest workload(const config& c, const std::string& model) {
  if (!c.manifest_file.empty()) return load_manifest(c.manifest_file, c.type);
  return preset(model, c.type);
}

std::vector<std::string> model_list(const config& c) {
  if (!c.manifest_file.empty()) return {c.manifest_file};
  return c.models;
}

std::string host_name() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

std::string now_text() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::tm tm{};
  ::localtime_r(&t, &tm);
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S %Z", &tm);
  return buf;
}

// ---------------------------------------------------------------- what each rank should hold

// What the streamer expects of the receivers of one rank (tpN; rank 0 of 1 otherwise): the region
// of each source they take (all of it, or the rank's slice) and, verified, the checksum of those
// bytes, kept up to date as the data changes between refits.
struct expectation {
  int rank = 0;
  std::vector<byte_region> regions;
  std::vector<std::uint64_t> sums;
  std::uint64_t bytes = 0;  // what the rank needs
};

expectation expect_rank(const config& c, const manifest& m, int rank, const tensor_memory& src, bool verify) {
  const engine_layout l = make_layout(m, c.layout, rank);
  expectation e;
  e.rank = rank;
  for (std::size_t i = 0; i < m.entries.size(); ++i) {
    e.regions.push_back(region_of(m.entries[i].meta, l.slices[i]));
    e.bytes += e.regions.back().bytes();
    // A slice of dimension 1 is strided in the source: gathered before its checksum.
    if (verify) e.sums.push_back(l.slices[i] ? src.checksum(i, e.regions.back()) : src.checksum(i));
  }
  return e;
}

// Byte `offset` of source i changed from `old_byte` to `new_byte`: the sums that cover it follow in O(1).
void expect_flip(std::vector<expectation>& expects, std::size_t i, std::uint64_t offset, std::uint8_t old_byte,
                 std::uint8_t new_byte) {
  for (auto& e : expects)
    if (const auto at = region_position(e.regions[i], offset))
      e.sums[i] = checksum_after_flip(e.sums[i], e.regions[i].bytes(), *at, old_byte, new_byte);
}

// ---------------------------------------------------------------- one (transport, model) group

struct group {
  const config& c;
  transport_path& path;
  transport_kind kind;
  const manifest& m;
  copy_engine engine;
  copy_engine apply_engine;
  double ceiling;  // bytes/s
  std::vector<mapped_file>* files;
  std::uint64_t& version;
};

/// The per-iteration samples of one row, in ms.
struct row_samples {
  std::vector<double> times, source, pack, wait, apply;
};

/// One group's run, step by step: start the receivers (or reach the one started by hand), prepare
/// the source tensors and the checksums each rank expects, run one row per (buffers, buffer size,
/// path), then end the receivers.
class group_runner {
 public:
  explicit group_runner(group& g)
      : g_(g),
        c_(g.c),
        tname_(to_string(g.kind)),
        endpoint_(c_.connect),
        spawn_(c_.side == role::both),
        verify_((spawn_ || !c_.no_verify) && !c_.convert),
        report_who_(fmt::format("the receiver at report endpoint {}", c_.report)),
        nccl_(g.kind == transport_kind::nccl),
        tp_(c_.layout.tp > 1),
        count_(spawn_ ? receiver_processes(c_, g.kind) : 1),
        several_(nccl_ || count_ > 1) {
    // The rank each receiver holds: every rank when tpN spawns one per rank, else --rank (0 without tpN).
    for (std::size_t k = 0; k < count_; ++k) ranks_.push_back(tp_ ? (count_ > 1 ? static_cast<int>(k) : c_.rank) : 0);
  }

  void run(std::ostream& out, std::vector<row>& rows) {
    start_receivers();
    prepare_sources();
    for (const std::size_t nbuf : c_.buffer_counts)
      for (const double mb : c_.buffer_mb)
        for (const bool want_direct : row_paths()) {
          const row r = run_row(nbuf, mb, want_direct);
          write_row(out, r);
          rows.push_back(r);
        }
    end_receivers();
  }

 private:
  [[nodiscard]] std::string who(std::size_t k) const {
    return several_ ? fmt::format("{} {} of {} (GPU {}, pid {})", tp_ ? "rank" : "receiver", k, children_.size(),
                                  devices_[k], children_[k]->pid())
                    : fmt::format("the receiver (pid {})", children_[k]->pid());
  }

  /// Spawns the receivers and waits until each is ready, or connects to the report endpoint of a
  /// receiver started by hand (only --no-verify goes without).
  void start_receivers() {
    if (spawn_) {
      dir_ = std::make_unique<temp_dir>();
      const int visible = nccl_ || c_.spread_receivers ? visible_gpus() : 0;
      for (std::size_t k = 0; k < count_; ++k) {
        devices_.push_back(receiver_gpu(c_, g_.kind, k, visible));
        const std::string bind = fmt::format("ipc://{}/receiver-{}", dir_->path, k);
        children_.push_back(std::make_unique<child_process>(
            c_.receiver_exe, receiver_args(c_, g_.kind, g_.m.name, bind, g_.apply_engine, devices_.back(), ranks_[k])));
      }
      // All spawned first, so that they fill their destination tensors in parallel.
      for (std::size_t k = 0; k < count_; ++k) {
        const json ready = parse_peer_json(children_[k]->read_line(std::chrono::minutes(10)), 1 << 20, who(k));
        if (ready.value("event", "") != "ready")
          throw error(errc::protocol, fmt::format("refit-bench: {} said {} instead of ready", who(k), excerpt(ready)));
        endpoints_.push_back(ready.at("endpoint").get<std::string>());
      }
      endpoint_ = endpoints_.front();
    } else if (verify_) {
      try {
        report_ = std::make_unique<channel::req_channel>(c_.report, c_.curve);
      } catch (const error& e) {
        throw error(e.code(), fmt::format("refit-bench: --report {}: {}", c_.report, e.what()));
      }
    } else {
      // Always said, --quiet or not: the table cannot vouch for the data in this mode.
      std::cerr << "refit-bench: WARNING: --no-verify: nothing compares the receiver's checksums with this "
                   "streamer's (wrong = n/a)"
                << std::endl;
    }
  }

  /// The receiver's committed line for version v, from its report endpoint.
  json ask_report(std::uint64_t v, milliseconds timeout) {
    std::string reply;
    try {
      reply = report_->request(json{{"version", v}}.dump(), timeout, fmt::format("the report of version {}", v));
    } catch (const error& e) {
      if (e.code() == errc::timeout)
        throw error(errc::timeout,
                    fmt::format("refit-bench: {} did not answer for version {} within {} ms: is it the "
                                "\"report\" endpoint the receiver printed, and is that receiver running?",
                                report_who_, v, timeout.count()));
      throw error(e.code(), fmt::format("refit-bench: asking {} for version {} failed: {}", report_who_, v, e.what()));
    }
    if (const auto problem = peer_json_problem(reply, max_report_bytes(g_.m)))
      throw error(errc::protocol,
                  fmt::format("refit-bench: {} answered for version {} with JSON {}: refused unread; it "
                              "begins {}",
                              report_who_, v, *problem, printable(reply, 200)));
    json line = json::parse(reply, nullptr, false);
    if (line.is_discarded())
      throw error(
          errc::protocol,
          fmt::format("refit-bench: {} answered for version {} with something that is not JSON "
                      "(is it the refit endpoint, --connect, instead of the report one?): {}",
                      report_who_, v, json(reply.substr(0, 100)).dump(-1, ' ', false, json::error_handler_t::replace)));
    return line;
  }

  /// The source tensors, and one expectation per distinct rank (receiver k checks against
  /// expects_[expect_of_[k]]).
  void prepare_sources() {
    progress(c_, fmt::format("{} {}: preparing {} tensors, {:.3f} GB of source data", tname_, g_.m.name,
                             g_.m.entries.size(), g_.m.bytes() / 1e9));
    const auto t_prep = clock::now();
    src_ = g_.path.sources(g_.m, c_.seed, g_.files);
    n_ = g_.m.entries.size();
    refs_.resize(n_);
    sizes_.resize(n_);
    for (std::size_t i = 0; i < n_; ++i) {
      refs_[i] = tensor_ref{g_.m.entries[i].meta, src_->data(i), src_->where(), nullptr};
      sizes_[i] = g_.m.entries[i].meta.nbytes();
    }
    for (const int rank : ranks_) {
      const auto same =
          std::find_if(expects_.begin(), expects_.end(), [&](const expectation& e) { return e.rank == rank; });
      expect_of_.push_back(static_cast<std::size_t>(same - expects_.begin()));
      if (same == expects_.end()) expects_.push_back(expect_rank(c_, g_.m, rank, *src_, verify_));
    }
    for (const auto& e : expects_) needed_ += e.bytes;
    progress(c_, fmt::format("{} {}: ready in {:.1f} s", tname_, g_.m.name, ms_since(t_prep) / 1e3));
  }

  /// cuda_ipc and nccl have a direct path (nccl: in place); host_shm runs each row once. A
  /// transport that serves several receivers only by direct writes (cuda_ipc, tpN's ranks) has no
  /// staged row then (run() checked that a direct one is left, and said so in the preamble).
  [[nodiscard]] std::vector<bool> row_paths() const {
    std::vector<bool> paths = g_.kind != transport_kind::host_shm ? c_.direct : std::vector<bool>{false};
    if (endpoints_.size() > 1 && transport::capabilities_of(g_.kind).several_need_direct) std::erase(paths, false);
    return paths;
  }

  [[nodiscard]] streamer_options options_for(std::size_t nbuf, double mb, bool want_direct) const {
    streamer_options so;
    so.direct = want_direct;
    so.endpoint = endpoint_;
    // Several receivers (nccl --receivers, tpN's ranks): one streamer serves them all.
    if (endpoints_.size() > 1) so.receivers = endpoints_;
    so.transport = g_.kind;
    so.buffer_count = nbuf;
    so.buffer_bytes = static_cast<std::uint64_t>(std::llround(mb * (1 << 20)));
    so.alignment = c_.alignment;
    so.keep_whole = c_.keep_whole;
    so.share_tensors = c_.share;
    so.control_lane = c_.lane;
    so.nccl_twin = c_.twin;
    so.device = c_.device;
    so.timeout = milliseconds(c_.timeout_ms);
    so.engine = g_.engine;
    if (!c_.connect.empty()) so.curve = c_.curve;  // a receiver started by hand
    return so;
  }

  /// A row's fixed columns, before any refit.
  [[nodiscard]] row row_head(const streamer_options& so) const {
    row r;
    r.transport = tname_;
    r.receivers = spawn_ ? endpoints_.size() : 1;
    r.model = g_.m.name;
    r.engine = g_.kind == transport_kind::host_shm ? "memcpy"
               : g_.engine == g_.apply_engine      ? std::string(to_string(g_.engine))
                                              : fmt::format("{}/{}", to_string(g_.engine), to_string(g_.apply_engine));
    r.buffer_bytes = so.buffer_bytes;
    r.buffers = so.buffer_count;
    r.tensors = n_;
    r.bytes = needed_;
    r.iters = c_.iters;
    r.wrong = verify_ ? 0 : -1;
    r.layout = layout_name(c_.layout);
    return r;
  }

  /// One row: warm-up and counted refits with one streamer, then the row's statistics.
  row run_row(std::size_t nbuf, double mb, bool want_direct) {
    const streamer_options so = options_for(nbuf, mb, want_direct);
    streamer s(so);
    row r = row_head(so);
    row_samples samples;
    bool went_direct = false;
    bool lane = true;
    std::uint64_t shared = 0;
    const int total = c_.warmup + c_.iters;
    for (int it = 0; it < total; ++it) {
      const std::uint64_t v = g_.version++;
      if (!first_) refresh_sources(v);
      first_ = false;
      const auto t0 = clock::now();
      const refit_stats st = refit_once(s, v, mb, nbuf);
      const double ms = ms_since(t0);
      r.batches = st.batches;
      double apply_ms = -1;
      const std::int64_t wrong_now = check_receivers(v, apply_ms);
      if (verify_) r.wrong += wrong_now;
      const bool counted = it >= c_.warmup;
      progress(c_, fmt::format("{} {} {} {:g} MiB x{} {} {}/{}: {:.2f} ms, {:.2f} GB/s{}", tname_, r.engine, g_.m.name,
                               mb, nbuf, counted ? "iter" : "warm-up", counted ? it - c_.warmup + 1 : it + 1,
                               counted ? c_.iters : c_.warmup, ms, r.bytes / (ms * 1e6),
                               wrong_now ? fmt::format(", {} WRONG", wrong_now) : ""));
      went_direct = st.direct;
      shared = st.shared_bytes;
      lane = st.control_lane;
      if (!counted) continue;
      samples.times.push_back(ms);
      samples.source.push_back(st.source_seconds * 1e3);
      samples.pack.push_back(st.pack_seconds * 1e3);
      samples.wait.push_back(st.wait_seconds * 1e3);
      if (apply_ms >= 0) samples.apply.push_back(apply_ms);
    }
    if (c_.split) r.fixed_ms = fixed_cost(s, mb, nbuf, r);
    s.close();
    finish_row(r, samples, went_direct, shared);
    // Requests through ZeroMQ (--control-lane 0, or no lane offered): labelled, since a small
    // refit's fixed cost differs.
    if (!lane) r.engine += "+zmq";
    if (nccl_ && c_.twin) r.engine += "+twin";
    if (c_.vmm_sources && !nccl_) r.engine += "+vmm-src";
    if (c_.vmm_dests && !nccl_) r.engine += "+vmm-dst";
    return r;
  }

  /// --split: the median of warm-up + iters refits of the smallest tensor with bytes alone, each a
  /// subset version in the row's session (verified like the others: the source is unchanged, so
  /// every receiver still holds what it expects); -1 when the model has no such tensor.
  double fixed_cost(streamer& s, double mb, std::size_t nbuf, row& r) {
    std::size_t smallest = n_;
    for (std::size_t i = 0; i < n_; ++i)
      if (sizes_[i] != 0 && (smallest == n_ || sizes_[i] < sizes_[smallest])) smallest = i;
    if (smallest == n_) return -1;
    std::vector<double> times;
    for (int it = 0; it < c_.warmup + c_.iters; ++it) {
      const std::uint64_t v = g_.version++;
      const auto t0 = clock::now();
      try {
        (void)s.refit(v, std::span<const tensor_ref>(&refs_[smallest], 1), refit_scope::subset);
      } catch (const error& e) {
        throw error(e.code(), fmt::format("refit-bench: {} {} {} MiB x{}: --split refit of version {} ({} alone) "
                                          "failed: {}{}",
                                          tname_, g_.m.name, mb, nbuf, v, refs_[smallest].meta.name, e.what(),
                                          reused_receiver_hint(e)));
      }
      const double ms = ms_since(t0);
      double apply_ms = -1;
      const std::int64_t wrong_now = check_receivers(v, apply_ms);
      if (verify_) r.wrong += wrong_now;
      if (it >= c_.warmup) times.push_back(ms);
    }
    return median(times);
  }

  /// Fresh data for every refit: one byte per tensor changes, expected sums follow in O(1).
  void refresh_sources(std::uint64_t v) {
    const auto mask = static_cast<std::uint8_t>(1 + v % 255);
    for (std::size_t i = 0; i < n_; ++i) {
      if (sizes_[i] == 0) continue;
      const std::uint64_t off = (v * 0x9e3779b97f4a7c15ull + i * 0x2545f4914f6cdd1dull) % sizes_[i];
      const std::uint8_t old = src_->flip(i, off, mask);
      if (verify_) expect_flip(expects_, i, off, old, static_cast<std::uint8_t>(old ^ mask));
    }
  }

  /// Refits version v; a failure is reported with what the receivers said about it.
  refit_stats refit_once(streamer& s, std::uint64_t v, double mb, std::size_t nbuf) {
    try {
      return s.refit(v, std::span<const tensor_ref>(refs_));
    } catch (const error& e) {
      std::string detail;
      for (std::size_t k = 0; k < children_.size(); ++k) {
        try {
          const json line =
              parse_peer_json(children_[k]->read_line(std::chrono::seconds(2)), max_report_bytes(g_.m), who(k));
          if (line.value("event", "") == "aborted")
            detail += fmt::format("; {} says: {}", who(k), printable(line.value("error", ""), 1024));
        } catch (...) {
        }
      }
      if (report_) {
        try {
          const json line = ask_report(v, std::chrono::seconds(2));
          if (line.value("event", "") == "aborted")
            detail += fmt::format("; {} says: {}", report_who_, printable(line.value("error", ""), 1024));
        } catch (...) {
        }
      }
      throw error(e.code(), fmt::format("refit-bench: {} {} {} MiB x{}: refit of version {} failed: {}{}{}", tname_,
                                        g_.m.name, mb, nbuf, v, e.what(), detail, reused_receiver_hint(e)));
    }
  }

  /// Every receiver must have committed v: returns the wrong checksums summed over the receivers,
  /// and sets `apply_ms` to the slowest receiver's apply.
  std::int64_t check_receivers(std::uint64_t v, double& apply_ms) {
    std::int64_t wrong_now = 0, printed = 0;
    for (std::size_t k = 0; k < children_.size(); ++k) {
      const json line =
          parse_peer_json(children_[k]->read_line(milliseconds(std::max<std::uint64_t>(c_.timeout_ms, 600000))),
                          max_report_bytes(g_.m), who(k));
      const std::string label = !several_ ? std::string() : fmt::format(" {} {}", tp_ ? "rank" : "receiver", k);
      wrong_now += count_wrong(c_, line, v, g_.m, expects_[expect_of_[k]].sums, who(k), label, printed, ranks_[k]);
      apply_ms = std::max(apply_ms, line.value("apply_ms", -1.0));
    }
    if (report_) {
      const json line = ask_report(v, milliseconds(c_.timeout_ms));
      wrong_now +=
          count_wrong(c_, line, v, g_.m, expects_.front().sums, report_who_, std::string(), printed, ranks_.front());
      apply_ms = line.value("apply_ms", -1.0);
    }
    return wrong_now;
  }

  /// The row's statistics from its counted refits.
  /// `shared`: bytes of a staged refit the receiver read where they were (copied once).
  void finish_row(row& r, const row_samples& samples, bool went_direct, std::uint64_t shared = 0) const {
    r.median_ms = median(samples.times);
    r.min_ms = *std::min_element(samples.times.begin(), samples.times.end());
    r.max_ms = *std::max_element(samples.times.begin(), samples.times.end());
    r.gbps = r.bytes / (r.median_ms * 1e6);
    r.ceiling_gbps = g_.ceiling / 1e9;
    // A direct refit copies every byte once, a staged one twice: each is held to its own floor.
    if (went_direct) r.engine += nccl_ ? "+in-place" : "+direct";
    // A recorded layout's files stay out of the engine column (the JSON row's layout names them).
    if (c_.layout != layout_kind::plain)
      r.engine += "+" + (c_.layout.kind == layout_kind::recorded ? std::string("recorded") : layout_name(c_.layout));
    // Over nccl the ceiling is itself the transfer (a raw broadcast), which refit makes once, with
    // packing and applying overlapping it: one pass too.
    r.floor_ms = (went_direct || nccl_ ? 1.0 : 2.0) * static_cast<double>(r.bytes) / g_.ceiling * 1e3;
    if (!went_direct && !nccl_ && shared != 0) {
      // Read in place by the receiver: those bytes are copied once, the others twice.
      r.engine += shared == r.bytes ? "+shared" : "+part-shared";
      r.floor_ms = (2.0 * static_cast<double>(r.bytes) - static_cast<double>(shared)) / g_.ceiling * 1e3;
    }
    if (c_.convert) {
      // Its own floor: the bytes read and written at the device-copy speed (a copy of B bytes
      // reads B and writes B). Direct: the source read once, the converted bytes written once;
      // staged: then those copied again from the buffer.
      double read = 0, written = 0;
      for (const auto& e : g_.m.entries) {
        read += static_cast<double>(e.meta.nbytes());
        written += static_cast<double>(converted_bytes(*c_.convert, e.meta));
      }
      const double traffic = went_direct ? read + written : read + 3 * written;
      // Over nccl the ceiling is the link's broadcast, which carries the converted bytes once.
      r.floor_ms = (nccl_ ? written : traffic / 2) / g_.ceiling * 1e3;
      r.engine += "+cvt:" + c_.convert->name.substr(c_.convert->name.find(':') + 1);
    }
    r.ratio = r.floor_ms / r.median_ms;
    r.source_ms = median(samples.source);
    r.pack_ms = median(samples.pack);
    r.wait_ms = median(samples.wait);
    r.apply_ms = samples.apply.empty() ? -1 : median(samples.apply);
  }

  void end_receivers() {
    for (auto& child : children_) {
      const int status = child->finish(std::chrono::seconds(30));
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        progress(c_, fmt::format("WARNING: the receiver process (pid {}) ended with {}", child->pid(),
                                 child_process::describe_exit(status)));
    }
  }

  group& g_;
  const config& c_;
  const std::string tname_;
  // Declared in the order the steps make them, so that they are released in the reverse order.
  std::unique_ptr<temp_dir> dir_;
  // One receiver process, or for nccl --receivers of them, or one per rank of --layout tpN over
  // cuda_ipc and nccl: receiver k on GPU devices_[k], holding rank ranks_[k].
  std::vector<std::unique_ptr<child_process>> children_;
  std::vector<int> devices_;
  std::vector<std::string> endpoints_;
  std::string endpoint_;
  const bool spawn_;
  // Started by hand, the receiver answers for its checksums on its report endpoint; only
  // --no-verify goes without.
  const bool verify_;
  std::unique_ptr<channel::req_channel> report_;
  const std::string report_who_;
  const bool nccl_;
  const bool tp_;
  const std::size_t count_;
  std::vector<int> ranks_;
  const bool several_;
  std::unique_ptr<tensor_memory> src_;
  std::size_t n_ = 0;
  std::vector<tensor_ref> refs_;
  std::vector<std::uint64_t> sizes_;
  std::vector<expectation> expects_;
  std::vector<std::size_t> expect_of_;
  std::uint64_t needed_ = 0;  // the bytes the receivers need, summed over the distinct ranks
  bool first_ = true;
};

void run_group(group& g, std::ostream& out, std::vector<row>& rows) { group_runner(g).run(out, rows); }

void write_outputs(const config& c, const preamble& p, const std::vector<row>& rows) {
  if (!c.json_file.empty()) {
    std::ofstream f(c.json_file);
    f << to_json(p, rows).dump(2, ' ', false, json::error_handler_t::replace) << '\n';
    if (!f) throw error(errc::io, fmt::format("refit-bench: cannot write --json {}", c.json_file));
  }
  if (!c.plot_file.empty()) {
    std::ofstream f(c.plot_file);
    f << to_svg(p, rows);
    if (!f) throw error(errc::io, fmt::format("refit-bench: cannot write --plot {}", c.plot_file));
  }
}

}  // namespace

std::vector<transport_kind> built_transports() {
  std::vector<transport_kind> t{transport_kind::host_shm};
#if REFIT_HAVE_CUDA
  t.push_back(transport_kind::cuda_ipc);
#endif
#if REFIT_HAVE_NCCL
  t.push_back(transport_kind::nccl);
#endif
  return t;
}

std::unique_ptr<transport_path> make_path(transport_kind kind, const config& c) {
  switch (kind) {
    case transport_kind::host_shm: return make_host_shm_path();
    case transport_kind::cuda_ipc:
      // The streamer's ceiling follows its receivers' GPUs; a receiver's path only allocates.
      return make_cuda_ipc_path(
          c.device, c.vmm_sources, c.vmm_dests,
          c.side == role::receiver ? std::vector<int>{} : cuda_ipc_placement(c, visible_gpus()).receivers);
    case transport_kind::nccl: return make_nccl_path(c);
  }
  throw error(errc::invalid_argument, "refit-bench: unknown transport");
}

namespace {

// One rank (1..) of the nccl ceiling, spawned by the streamer's nccl path: broadcasts with the
// others, says so on stdout, and stays in the communicator until the streamer closes our stdin
// (leaving earlier would look like a failure to rank 0, which may still be finishing).
/// Whether stdin was closed (a spawned process's streamer is done, or died), waiting up to
/// `wait_ms` for it to say anything.
bool stdin_closed(int wait_ms) {
  pollfd p{0, POLLIN, 0};
  if (::poll(&p, 1, wait_ms) <= 0) return false;
  char b[256];
  return ::read(0, b, sizeof b) <= 0;
}

int run_ceiling_rank(const config& c) {
  const milliseconds timeout(c.timeout_ms);
  if (c.spawned) ::signal(SIGPIPE, SIG_IGN);
  // True once stdin is at its end: the streamer is done, or gone.
  const auto watch = [&] {
    if (c.spawned && stdin_closed(0)) throw error(errc::peer, "the streamer went away (stdin closed)");
  };
  const auto done = [&] {
    std::cout << json{{"event", "ceiling"}, {"rank", c.nccl_rank}, {"pid", ::getpid()}}.dump() << '\n' << std::flush;
    if (!c.spawned) return;
    const auto until = clock::now() + timeout;
    while (clock::now() < until && !stdin_closed(100)) {
    }
  };
  try {
    nccl_ceiling_rank(c.nccl_ceiling_id, c.nccl_rank, c.nccl_ranks, c.device, timeout, watch, done);
  } catch (const error& e) {
    throw error(e.code(), fmt::format("refit-bench: nccl ceiling rank {} of {} on GPU {}: {}", c.nccl_rank,
                                      c.nccl_ranks, c.device, e.what()));
  }
  return 0;
}

// The report endpoint of a receiver started by hand: a REP socket, and for ipc its socket file,
// removed with it. ZeroMQ removes the file too, but later, from its own thread: the receiver's
// private directory, where the default one lives, would still hold it when it is removed.
class report_endpoint {
 public:
  report_endpoint(const std::string& endpoint, const curve_keys& curve) {
    try {
      curve_keys server = curve;
      server.server_key.clear();
      channel_.emplace(endpoint, server);
    } catch (const error& e) {
      throw error(e.code(),
                  fmt::format("refit-bench: the report endpoint {}: {}; choose another with --report ENDPOINT",
                              endpoint, e.what()));
    }
  }
  ~report_endpoint() {
    const std::string bound = channel_->endpoint();
    channel_.reset();
    if (bound.starts_with("ipc://")) ::unlink(bound.c_str() + 6);
  }
  report_endpoint(const report_endpoint&) = delete;
  report_endpoint& operator=(const report_endpoint&) = delete;

  [[nodiscard]] channel::rep_channel& channel() noexcept { return *channel_; }

 private:
  std::optional<channel::rep_channel> channel_;
};

void emit(const json& j) {
  std::cout << dump_line(j) << '\n';
  std::cout.flush();
}

/// The line that tells the streamer (or the user) where this receiver listens and what it holds.
json ready_line(const config& c, const manifest& m, const engine_layout& layout, receiver& r, const std::string& device,
                report_endpoint* reports) {
  json ready{{"event", "ready"},
             {"endpoint", r.endpoint()},
             {"pid", ::getpid()},
             {"device", device},
             {"tensors", m.entries.size()},
             {"bytes", m.bytes()},
             {"layout", layout_name(c.layout)},
             {"engine_tensors", layout.tensors.entries.size()},
             {"views", layout.views.size()}};
  if (c.layout.tp > 1) ready["rank"] = c.rank;
  if (reports) ready["report"] = reports->channel().endpoint();
  return ready;
}

/// Started by hand: tells the user, on stderr, the streamer's command line.
void print_banner(const config& c, const manifest& m, const std::string& model, receiver& r, report_endpoint& reports) {
  const std::string transport(to_string(c.transports.front()));
  std::string same =
      fmt::format("--transport {} {} {}", transport, c.manifest_file.empty() ? "--model" : "--manifest", model);
  if (c.type != dtype::bf16) same += fmt::format(" --dtype {}", to_string(c.type));
  if (c.layout != layout_kind::plain) same += fmt::format(" --layout {}", layout_name(c.layout));
  if (c.layout.tp > 1) same += fmt::format(" --rank {}", c.rank);
  if (!c.curve.secret_key.empty())
    same += fmt::format(" --curve-server-key {} --curve-public-key <yours> --curve-secret-key <yours>",
                        c.curve.public_key.empty() ? std::string("<this receiver's public key>") : c.curve.public_key);
  const std::string& report_ep = reports.channel().endpoint();
  const bool wildcard =
      r.endpoint().find("//0.0.0.0:") != std::string::npos || report_ep.find("//0.0.0.0:") != std::string::npos;
  // This executable's own path: `tools/dev build` leaves refit-bench in build/bench, not on PATH.
  std::error_code ec;
  std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  if (ec || self.empty()) self = "refit-bench";
  std::cerr << fmt::format(
      "refit-bench: receiver for {} over {} listening on {}, checksums on {} (Ctrl-C to stop)\n"
      "refit-bench: start the streamer with:\n"
      "  {} --role streamer --connect {} --report {} {}\n{}",
      m.name, transport, r.endpoint(), report_ep, self, r.endpoint(), report_ep, same,
      wildcard ? "refit-bench: (from another host, put this host's address in place of 0.0.0.0)\n" : "");
}

/// The committed line for the version just committed: each source's bytes as they landed in its
/// view(s), after the deliberate damage --corrupt-byte asks for.
json committed_line(const config& c, const manifest& m, const engine_layout& layout, tensor_memory& dest, receiver& r) {
  const receiver_stats st = r.last_stats();
  const std::uint64_t v = r.committed_version().value_or(0);
  corrupt_after_commit(c, m, layout, dest);
  const auto t1 = clock::now();
  json sums = view_checksums(m, layout, dest);
  // apply: copying into the weights, plus the wait at END for the device to finish them.
  json line{{"event", "committed"},
            {"version", v},
            {"apply_ms", (st.apply_seconds + st.drain_seconds) * 1e3},
            {"receiver_ms", st.seconds * 1e3},
            {"batches", st.batches},
            {"checksum_ms", ms_since(t1)},
            {"layout", layout_name(c.layout)},
            {"checksums", std::move(sums)}};
  if (c.layout.tp > 1) line["rank"] = c.rank;
  return line;
}

}  // namespace

void register_views(receiver& r, const config& c, const manifest& m, const engine_layout& layout, tensor_memory& dest) {
  for (const layout_view& v : layout.views) {
    const tensor_meta& src = m.entries[v.source].meta;
    tensor_dest d{tensor_meta{src.name, src.type, v.shape}, dest.data(v.tensor) + v.offset, dest.where()};
    if (c.convert && c.layout == layout_kind::plain) {
      // The codes at the start of the source-sized memory, the scales behind them.
      if (const auto scale_at = converted_scale_offset(*c.convert, src)) {
        d.meta.type = c.convert->to;
        d.q = c.convert->q;
        if (d.q != quant::none) d.scale = d.data == nullptr ? nullptr : static_cast<std::byte*>(d.data) + *scale_at;
      }
    }
    if (c.layout == layout_kind::plain) {
      r.add_parameter(d);  // dense, one tensor per source: as before layouts existed
    } else {
      const tensor_meta& engine = layout.tensors.entries[v.tensor].meta;
      r.add_parameter(d, dest_layout{v.strides, v.slice, dest.data(v.tensor), engine.nbytes()});
    }
  }
}

void corrupt_after_commit(const config& c, const manifest& m, const engine_layout& layout, tensor_memory& dest) {
  if (!c.corrupt_tensor || m.bytes() == 0) return;
  // The first byte of the tensor's last view (a tied embedding's engine lm_head).
  std::size_t i = *c.corrupt_tensor % m.entries.size();
  while (m.entries[i].meta.nbytes() == 0) i = (i + 1) % m.entries.size();
  const layout_view& v = layout.views[layout.of_source[i].back()];
  dest.flip(v.tensor, v.offset, 0x01);
}

std::vector<std::uint64_t> view_checksums(const manifest& m, const engine_layout& layout, const tensor_memory& dest) {
  std::vector<std::uint64_t> sums, of_views;
  for (std::size_t i = 0; i < m.entries.size(); ++i) {
    of_views.clear();
    for (const std::size_t k : layout.of_source[i]) {
      const layout_view& v = layout.views[k];
      of_views.push_back(dest.checksum(v.tensor, v.offset, v.bytes));
    }
    sums.push_back(fold_view_checksums(of_views));
  }
  return sums;
}

int run_receiver(const config& c) {
  if (!c.nccl_ceiling_id.empty()) return run_ceiling_rank(c);
  if (c.transports.size() != 1)
    throw error(errc::invalid_argument, "refit-bench: --role receiver serves one --transport");
  const auto models = model_list(c);
  if (models.size() != 1) throw error(errc::invalid_argument, "refit-bench: --role receiver serves one --model");
  const manifest m = workload(c, models.front());
  auto path = make_path(c.transports.front(), c);
  // The model as the receiver holds it (--layout): engine tensors, allocated like any destinations
  // (one arena, each engine tensor its own aligned range), and every source tensor's view of them.
  const engine_layout layout = make_layout(m, c.layout, c.rank);
  auto dest = path->destinations(layout.tensors);

  receiver_options ro;
  ro.endpoint = c.bind;
  ro.device = c.device;
  ro.engine = c.engines.front();
  ro.idle_timeout = milliseconds(c.timeout_ms);
  if (!c.spawned) {
    ro.curve = c.curve;
    ro.curve.server_key.clear();
  }
  receiver r(ro);
  register_views(r, c, m, layout, *dest);
  // Started by hand: the streamer asks for our checksums here (a spawned one reads our stdout).
  // Declared after the receiver, so that it goes first: its ipc file may sit in the receiver's
  // private directory.
  std::optional<report_endpoint> reports;
  if (!c.spawned) reports.emplace(c.report.empty() ? default_report_endpoint(r.endpoint()) : c.report, ro.curve);
  report_log log;

  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  if (c.spawned) ::signal(SIGPIPE, SIG_IGN);

  const json ready = ready_line(c, m, layout, r, path->describe_device(), reports ? &*reports : nullptr);
  // The banner before the ready line: whoever has seen that line can read the banner too.
  if (reports) print_banner(c, m, models.front(), r, *reports);
  emit(ready);

  // Started by hand we also watch the report endpoint, between messages: a short wait here keeps
  // its answers prompt, and a message of a refit still ends the wait at once.
  const milliseconds wait(reports ? 10 : 100);
  for (;;) {
    if (stop_requested) break;
    // The streamer closes our stdin when it is done (or dies): then we are done too.
    if (c.spawned && stdin_closed(0)) break;
    const receiver_event event = r.serve_one(wait);
    switch (event) {
      case receiver_event::committed: {
        const json line = committed_line(c, m, layout, *dest, r);
        if (reports) {
          // Started by hand, stdout is a terminal: the checksums (one per tensor) are for the
          // streamer, which asks for them on the report endpoint.
          json shown = line;
          shown.erase("checksums");
          shown["tensors"] = m.entries.size();
          emit(shown);
          log.committed(line);
        } else {
          emit(line);
        }
        break;
      }
      case receiver_event::aborted: {
        // The error may quote what the streamer sent (a tensor name of any bytes): one printable line.
        const json line{{"event", "aborted"}, {"error", printable(r.last_error())}};
        emit(line);
        if (reports) log.aborted(line);
        break;
      }
      default: break;
    }
    // Not in the middle of a refit: a report request sent during one waits in the socket's queue.
    if (reports && event != receiver_event::hello && event != receiver_event::begin && event != receiver_event::batch)
      while (const auto request = reports->channel().receive(milliseconds(0)))
        reports->channel().reply(log.answer(*request));
  }
  return 0;
}

namespace {

// The preamble's note for a tensor-parallel layout of m: what each rank holds and needs. Lays out
// every rank, so that a model that does not shard fails before anything is measured.
std::string tp_note(const config& c, const manifest& m) {
  std::vector<std::string> needs;
  std::size_t tensors = 0, views = 0;
  for (int rank = 0; rank < c.layout.tp; ++rank) {
    const engine_layout l = make_layout(m, c.layout, rank);
    tensors = l.tensors.entries.size();
    views = l.views.size();
    needs.push_back(fmt::format("{:.3f}", l.needed_bytes(m) / 1e9));
  }
  return fmt::format(
      "--layout {}: each rank holds {} in {} engine tensors: {} views of {} source tensors; a rank "
      "needs {} GB of the {:.3f} GB (ranks 0..{})",
      layout_name(c.layout), m.name, tensors, views, m.entries.size(), fmt::join(needs, "|"), m.bytes() / 1e9,
      c.layout.tp - 1);
}

}  // namespace

namespace {

/// The transport paths to measure, resolved before anything is measured (a transport that is not
/// built fails here); what the preamble must say about them goes to `notes`.
std::vector<std::unique_ptr<transport_path>> resolve_paths(const config& c, std::vector<std::string>& notes) {
  std::vector<std::unique_ptr<transport_path>> paths;
  for (const auto t : c.transports) {
    if (t == transport_kind::nccl && c.nccl_optional) {
      // From "--transport all": nccl needs a GPU for the streamer and one per receiver.
      const int visible = visible_gpus();
      if (visible < (c.nccl_share_gpus ? 1 : 2)) {
        notes.push_back(fmt::format("nccl skipped: it needs at least 2 visible GPUs and {} visible", visible));
        std::cerr << "refit-bench: " << notes.back() << std::endl;
        continue;
      }
    }
    if (receiver_processes(c, t) > 1 && transport::capabilities_of(t).several_need_direct &&
        std::find(c.direct.begin(), c.direct.end(), false) != c.direct.end()) {
      if (std::find(c.direct.begin(), c.direct.end(), true) == c.direct.end())
        throw error(
            errc::invalid_argument,
            fmt::format("refit-bench: --path staged with --layout {} over {}: one streamer serves its {} receivers "
                        "only by writing into each one's weights; use --path direct",
                        layout_name(c.layout), to_string(t), receiver_processes(c, t)));
      notes.push_back(
          fmt::format("{}: direct rows only: one streamer serves {} receivers (--layout {}) only by writing "
                      "into each one's weights (--path staged skipped)",
                      to_string(t), receiver_processes(c, t), layout_name(c.layout)));
    }
    paths.push_back(make_path(t, c));
    if (t == transport_kind::nccl) {
      const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
      const std::size_t receivers = receiver_processes(c, t);
      notes.push_back(fmt::format("nccl: {} receiver process{} ({}), {}; NCCL_NVLS_ENABLE={}", receivers,
                                  receivers == 1 ? "" : "es", c.layout.tp > 1 ? "one per rank" : "--receivers",
                                  c.nccl_share_gpus ? "sharing GPUs (--nccl-share-gpus): each process its own "
                                                      "NCCL_HOSTID, so every byte goes through NCCL's network "
                                                      "transport over loopback, ceiling included (not NVLink figures)"
                                                    : "one GPU each",
                                  nvls ? nvls : "(unset)"));
    }
  }
  if (c.convert)
    notes.push_back(
        fmt::format("--convert {}: the receiver holds {} {} tensors as {}; floor = (bytes read + written) / "
                    "(2 x ceiling), over nccl converted bytes / ceiling; not verified here (wrong = n/a): "
                    "the test suites check converted bytes",
                    c.convert->name, c.convert->q == quant::none ? "every" : "the 2-d", to_string(c.convert->from),
                    to_string(c.convert->to)));
  if (c.side == role::streamer)
    notes.push_back(
        c.no_verify
            ? std::string("--no-verify: the receiver's checksums are not compared here (wrong = n/a)")
            : fmt::format("receiver started by hand: every refit verified through its report endpoint {}", c.report));
  return paths;
}

/// The receiver's layout of each model, made here too so that one that cannot be laid out fails
/// before anything is measured; its description goes to `notes`.
void lay_out_models(const config& c, const std::vector<manifest>& models, std::vector<std::string>& notes) {
  for (const auto& m : models) {
    if (c.layout.tp > 1) {
      notes.push_back(tp_note(c, m));
      continue;
    }
    const engine_layout l = make_layout(m, c.layout);
    if (c.layout != layout_kind::plain)
      notes.push_back(
          fmt::format("--layout {}: the receiver holds {} in {} engine tensors: {} views of {} source tensors",
                      layout_name(c.layout), m.name, l.tensors.entries.size(), l.views.size(), m.entries.size()));
  }
  if (c.layout.tp > 1)
    notes.push_back(fmt::format(
        "+{0} rows: bytes (and GB/s, floor, ratio) = what the receivers need, summed over the ranks "
        "they hold (each rank's slices, replicated tensors once per rank), not the source bytes "
        "streamed; cuda_ipc and nccl run all {1} ranks, one receiver each, host_shm rank {2} (--rank)",
        c.layout.kind == layout_kind::recorded ? std::string("recorded") : layout_name(c.layout), c.layout.tp, c.rank));
}

/// --load: the mapped safetensors files of the (one) model.
std::vector<mapped_file> load_files(const config& c, const std::vector<manifest>& models) {
  std::vector<mapped_file> files;
  if (c.load) {
    if (c.manifest_file.empty())
      throw error(errc::invalid_argument, "refit-bench: --load needs --manifest FILE.safetensors");
    for (const auto& e : models.front().entries)
      if (e.file < 0)
        throw error(errc::invalid_argument,
                    fmt::format("refit-bench: --load needs a .safetensors manifest (or a sharded "
                                "checkpoint's index); {} has no tensor data",
                                c.manifest_file));
    for (const auto& f : models.front().files) files.emplace_back(f);
  }
  return files;
}

preamble make_preamble(const config& c, const std::vector<std::unique_ptr<transport_path>>& paths,
                       const std::vector<manifest>& models, const std::vector<std::string>& notes) {
  preamble p;
  p.refit_version = REFIT_VERSION;
  p.host = host_name();
  p.pid = ::getpid();
  p.date = now_text();
  p.cpu = make_host_shm_path()->describe_device();
  for (const auto& path : paths) {
    p.transports.emplace_back(to_string(path->kind()));
    if (path->kind() != transport_kind::host_shm) p.gpus.push_back(path->describe_device());
  }
  p.notes = notes;
  p.verified = !(c.side == role::streamer && c.no_verify);
  for (const auto& m : models) p.models.push_back({m.name, m.entries.size(), m.bytes(), m.params(), m.largest()});
  p.buffer_mb = c.buffer_mb;
  p.buffer_counts = c.buffer_counts;
  p.alignment = c.alignment;
  p.keep_whole = c.keep_whole;
  p.warmup = c.warmup;
  p.iters = c.iters;
  p.dtype = c.manifest_file.empty() ? std::string(to_string(c.type)) : "from the manifest";
  p.seed = c.seed;
  std::vector<std::string> engine_names;
  for (const auto e : c.engines) engine_names.emplace_back(to_string(e));
  p.engine = fmt::format("{} on GPU transports (automatic: the transport's choice), memcpy on host_shm",
                         fmt::join(engine_names, ", "));
  p.data = c.load ? fmt::format("loaded from {} (mmap)", c.manifest_file) : fmt::format("random (seed {})", c.seed);
  p.command = fmt::format("{}", fmt::join(c.argv, " "));
  return p;
}

/// The ceilings first, in the same run as the refits they are compared with, then one group of
/// rows per (transport, engine, model).
void measure(const config& c, std::ostream& out, const std::vector<std::unique_ptr<transport_path>>& paths,
             const std::vector<manifest>& models, std::vector<mapped_file>& files, std::vector<row>& rows) {
  std::uint64_t version = 1;
  std::vector<double> ceilings;
  for (const auto& path : paths) {
    progress(c, fmt::format("{}: measuring the ceiling ({})", to_string(path->kind()), path->ceiling_method()));
    ceilings.push_back(path->measure_ceiling());
    out << fmt::format("# ceiling   : {}: {:.2f} GB/s ({})\n", to_string(path->kind()), ceilings.back() / 1e9,
                       path->ceiling_method());
  }
  out << "#\n";
  write_header(out);
  for (std::size_t t = 0; t < paths.size(); ++t) {
    // host_shm copies with memcpy whatever the engine: one pass there.
    const std::size_t engines = paths[t]->kind() == transport_kind::host_shm ? 1 : c.engines.size();
    for (std::size_t e = 0; e < engines; ++e)
      for (const auto& m : models) {
        group g{c,
                *paths[t],
                paths[t]->kind(),
                m,
                c.engines[e],
                c.apply_engines[e],
                ceilings[t],
                c.load ? &files : nullptr,
                version};
        run_group(g, out, rows);
      }
  }
}

}  // namespace

int run(const config& c, std::ostream& out) {
  check_role(c);
  if (c.side == role::receiver) return run_receiver(c);
  if (c.delta_steps > 0) return run_delta(c, out);
  if (c.streamers > 0) return run_group(c, out);

  std::vector<std::string> notes;
  const auto paths = resolve_paths(c, notes);
  std::vector<manifest> models;
  for (const auto& name : model_list(c)) models.push_back(workload(c, name));
  lay_out_models(c, models, notes);
  std::vector<mapped_file> files = load_files(c, models);
  const preamble p = make_preamble(c, paths, models, notes);

  write_preamble(out, p);
  std::vector<row> rows;
  try {
    measure(c, out, paths, models, files, rows);
  } catch (...) {
    write_footer(out, rows, /*failed=*/true);
    write_outputs(c, p, rows);
    throw;
  }
  write_footer(out, rows);
  write_outputs(c, p, rows);
  return total_wrong(rows) > 0 ? 1 : 0;
}

}  // namespace refit::bench
