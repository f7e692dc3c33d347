// The host_shm transport: sealed memfds (or named segments), their lifetime and the receiver's
// checks, including against a hostile streamer.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "copy/copy.hpp"
#include "refit/memory.hpp"
#include "support/support.hpp"
#include "transport/transport.hpp"
#include "wire/wire.hpp"

using namespace std::chrono_literals;
namespace tr = refit::transport;

namespace {

tr::source_options shm_options(std::size_t count = 2, std::uint64_t bytes = 64u << 10) {
  tr::source_options o;
  o.name = "host_shm";
  o.count = count;
  o.bytes = bytes;
  return o;
}

std::string shm_path(const std::string& name) { return "/dev/shm" + name; }

/// Entries in /dev/shm created by this process (other test processes may run alongside).
std::size_t own_shm_entries() {
  const std::string prefix = "refit-" + std::to_string(::getpid()) + "-";
  std::size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
    if (e.path().filename().string().starts_with(prefix)) ++n;
  return n;
}

std::size_t open_fds() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

void expect_refused(const refit::wire::hello& h, const std::string& needle) {
  auto sink = tr::make_sink("host_shm", 0);
  refit::wire::ok reply;
  try {
    sink->attach(h, reply);
    FAIL("attach accepted a HELLO it should refuse (" << needle << ")");
  } catch (const refit::error& e) {
    CHECK(e.code() == refit::errc::transport);
    INFO(e.what());
    CHECK(std::string(e.what()).find(needle) != std::string::npos);
  }
  CHECK_FALSE(sink->attached());
  CHECK(sink->count() == 0);
}

/// Sets an environment variable for a scope (REFIT_HOST_SHM: the streamer's sharing).
class scoped_env {
 public:
  scoped_env(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~scoped_env() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

/// This process's pid namespace, as named segments carry it.
std::uint64_t pid_namespace() {
  struct stat st {};
  REQUIRE(::stat("/proc/self/ns/pid", &st) == 0);
  return st.st_ino;
}

/// A name of the form the receiver accepts for a named segment, of process `pid`.
std::string segment_name(pid_t pid, std::uint64_t pidns, std::uint64_t tag) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(tag));
  return "/refit-" + std::to_string(pid) + "-" + std::to_string(pidns) + "-" + hex;
}

/// A file the test makes in /dev/shm as a hostile streamer would (removed at scope exit): a
/// regular file of `bytes` with `mode`, its descriptor kept open read-write.
struct hostile_segment {
  std::string name;
  int fd = -1;
  hostile_segment(std::uint64_t bytes, mode_t mode, std::uint64_t tag)
      : name(segment_name(::getpid(), pid_namespace(), tag)) {
    fd = ::open(shm_path(name).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(::fchmod(fd, mode) == 0);
    REQUIRE(::ftruncate(fd, static_cast<off_t>(bytes)) == 0);
  }
  ~hostile_segment() {
    ::close(fd);
    ::unlink(shm_path(name).c_str());
  }
  hostile_segment(const hostile_segment&) = delete;
  hostile_segment& operator=(const hostile_segment&) = delete;
};

/// A HELLO of this host announcing `handles`, `bytes` each.
refit::wire::hello hello_naming(const std::vector<std::string>& handles, std::uint64_t bytes) {
  refit::wire::hello h;
  h.transport = "host_shm";
  h.host_id = tr::host_identity();
  h.peer = tr::process_identity();
  for (const auto& n : handles) h.buffers.push_back(refit::wire::buffer_desc{bytes, n, "", ""});
  return h;
}

/// The handle of a memfd of this process, as the streamer announces one: descriptor `fd`, whose
/// memfd was made with name `tag`.
std::string memfd_handle(int fd, const std::string& tag) {
  return "/proc/" + std::to_string(::getpid()) + "/fd/" + std::to_string(fd) + ":" + tag;
}

std::string memfd_tag(std::uint64_t n) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(n));
  return "refit-" + std::to_string(::getpid()) + "-" + hex;
}

/// Names in /dev/shm made by process `pid` (refit-<pid>-*).
std::size_t shm_entries_of(pid_t pid) {
  const std::string prefix = "refit-" + std::to_string(pid) + "-";
  std::size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
    if (e.path().filename().string().starts_with(prefix)) ++n;
  return n;
}

}  // namespace

TEST_CASE("host_shm buffers are sealed 0600 memfds that no name in /dev/shm refers to", "[host_shm]") {
  auto src = tr::make_source(shm_options(2, 8192));
  refit::wire::hello h;
  src->open_session(h);
  REQUIRE(h.buffers.size() == 2);
  CHECK(own_shm_entries() == 0);
  const std::string prefix = "/proc/" + std::to_string(::getpid()) + "/fd/";
  for (const auto& b : h.buffers) {
    INFO(b.handle);
    REQUIRE(b.handle.starts_with(prefix));
    const auto colon = b.handle.find(':');
    REQUIRE(colon != std::string::npos);
    const std::string path = b.handle.substr(0, colon);
    const std::string tag = b.handle.substr(colon + 1);
    CHECK(tag.starts_with("refit-" + std::to_string(::getpid()) + "-"));
    const int fd = std::stoi(path.substr(prefix.size()));
    struct stat st {};
    REQUIRE(::fstat(fd, &st) == 0);
    CHECK((st.st_mode & 0777) == 0600);
    CHECK(st.st_size == 8192);
    CHECK(st.st_uid == ::geteuid());
    const int seals = ::fcntl(fd, F_GET_SEALS);
    CHECK((seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) == (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL));
    CHECK(::ftruncate(fd, 4096) != 0);  // nobody can shrink it under a receiver
    CHECK((::fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0);
    CHECK(std::filesystem::read_symlink(path).string() == "/memfd:" + tag + " (deleted)");
  }
  auto sink = tr::make_sink("host_shm", 0);
  refit::wire::ok reply;
  sink->attach(h, reply);
  src->session_accepted({&reply, 1});
  // Accepted: the descriptors are closed, so the handles name nothing of this session any more.
  for (const auto& b : h.buffers) {
    const std::string path = b.handle.substr(0, b.handle.find(':'));
    std::error_code ec;
    CHECK(std::filesystem::read_symlink(path, ec).string() !=
          "/memfd:" + b.handle.substr(b.handle.find(':') + 1) + " (deleted)");
  }
  std::memset(src->data(1), 0x3c, 8192);
  CHECK(sink->data(1)[8191] == std::byte{0x3c});
  src->close_session();
}

TEST_CASE("with REFIT_HOST_SHM=named, segments are private files until the receiver accepts, then unlinked",
          "[host_shm]") {
  const scoped_env named("REFIT_HOST_SHM", "named");
  auto src = tr::make_source(shm_options(3, 4096));
  CHECK(src->name() == "host_shm");
  CHECK(src->count() == 3);
  CHECK(src->buffer_bytes() == 4096);
  CHECK(src->where() == refit::device::cpu());
  CHECK(src->engine() == refit::copy::engine::cpu);
  CHECK(src->stream() == nullptr);
  refit::wire::hello h;
  src->open_session(h);
  CHECK(h.transport == "host_shm");
  CHECK(h.host_id == tr::host_identity());
  CHECK(h.peer == tr::process_identity());
  REQUIRE(h.buffers.size() == 3);
  std::set<std::string> names;
  for (const auto& b : h.buffers) {
    CHECK(b.bytes == 4096);
    CHECK(b.handle.starts_with("/refit-" + std::to_string(::getpid()) + "-" + std::to_string(pid_namespace()) + "-"));
    CHECK(b.packed_event.empty());
    CHECK(b.applied_event.empty());
    names.insert(b.handle);
    struct stat st {};
    REQUIRE(::stat(shm_path(b.handle).c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0600);
    CHECK(st.st_size == 4096);
    CHECK(st.st_uid == ::getuid());
  }
  CHECK(names.size() == 3);
  src->session_accepted(std::array{refit::wire::ok{}});
  for (const auto& b : h.buffers) CHECK_FALSE(std::filesystem::exists(shm_path(b.handle)));
  // The memory itself stays usable.
  std::memset(src->data(0), 0xab, 4096);
  CHECK(static_cast<unsigned char>(src->data(0)[4095]) == 0xab);
  src->close_session();
}

TEST_CASE("closing a session that was never accepted removes its segments", "[host_shm]") {
  const scoped_env named("REFIT_HOST_SHM", "named");
  refit::wire::hello h;
  {
    auto src = tr::make_source(shm_options());
    src->open_session(h);
    for (const auto& b : h.buffers) CHECK(std::filesystem::exists(shm_path(b.handle)));
    src->close_session();
    for (const auto& b : h.buffers) CHECK_FALSE(std::filesystem::exists(shm_path(b.handle)));
  }
  refit::wire::hello h2;
  {
    auto src = tr::make_source(shm_options());
    src->open_session(h2);
  }  // destroyed without close_session()
  for (const auto& b : h2.buffers) CHECK_FALSE(std::filesystem::exists(shm_path(b.handle)));
}

TEST_CASE("a host_shm sink in the same process reads what the source wrote", "[host_shm]") {
  const std::uint64_t bytes = (256u << 10) + 13;
  auto src = tr::make_source(shm_options(2, bytes));
  refit::wire::hello h;
  src->open_session(h);
  for (std::size_t i = 0; i < 2; ++i)
    refit::test::fill_pattern("buf" + std::to_string(i), 3, reinterpret_cast<std::uint8_t*>(src->data(i)), bytes);
  auto sink = tr::make_sink("host_shm", 0);
  CHECK(sink->name() == "host_shm");
  CHECK_FALSE(sink->attached());
  refit::wire::ok reply;
  sink->attach(h, reply);
  src->session_accepted({&reply, 1});
  REQUIRE(sink->attached());
  REQUIRE(sink->count() == 2);
  CHECK_FALSE(sink->asynchronous());
  CHECK(sink->where() == refit::device::cpu());
  CHECK(sink->engine() == refit::copy::engine::cpu);
  CHECK(sink->stream() == nullptr);
  std::vector<std::uint8_t> expect(bytes);
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(sink->buffer_bytes(i) == bytes);
    refit::test::fill_pattern("buf" + std::to_string(i), 3, expect.data(), bytes);
    CHECK(std::memcmp(sink->data(i), expect.data(), bytes) == 0);
  }
  // Writes after mapping are visible too (it is one memory).
  src->begin_pack(0);
  src->data(0)[7] = std::byte{0x5a};
  src->end_pack(0);
  sink->begin_read(0);
  CHECK(sink->data(0)[7] == std::byte{0x5a});
  sink->end_read(0);
  sink->drain();
  src->drain();
  sink->detach();
  CHECK_FALSE(sink->attached());
  CHECK(sink->data(0) == nullptr);
  src->close_session();
}

TEST_CASE(
    "host_shm holds count x buffer_bytes on each side, the receiver while a session lasts, the streamer until it ends",
    "[host_shm][memory]") {
  // The formula of README.md's memory table for host_shm: the streamer's segments (for as long as
  // the streamer lives) and the receiver's mappings of them (for as long as the session does),
  // count × buffer_bytes each.
  const std::uint64_t bytes = (1u << 20) + 4096;
  const refit::memory_usage before = refit::memory_in_use();
  {
    auto src = tr::make_source(shm_options(3, bytes));
    refit::wire::hello h;
    src->open_session(h);
    CHECK(refit::memory_in_use().host == before.host + 3 * bytes);
    auto sink = tr::make_sink("host_shm", 0);
    refit::wire::ok reply;
    sink->attach(h, reply);
    src->session_accepted({&reply, 1});
    const refit::memory_usage during = refit::memory_in_use();
    CHECK(during.host == before.host + 6 * bytes);
    CHECK(during.host_peak >= during.host);
    CHECK(during.device == before.device);
    CHECK(during.pinned == before.pinned);
    sink->detach();
    CHECK(refit::memory_in_use().host == before.host + 3 * bytes);
    src->close_session();
    // The streamer keeps its segments (unlinked, so nothing is left in /dev/shm) until its next
    // session makes fresh ones, or it is destroyed.
    CHECK(refit::memory_in_use().host == before.host + 3 * bytes);
    // A second session replaces them: the same again at most, not more.
    refit::reset_memory_peaks();
    src->open_session(h);
    sink->attach(h, reply);
    src->session_accepted({&reply, 1});
    CHECK(refit::memory_in_use().host_peak == before.host + 6 * bytes);
    sink->detach();
    src->close_session();
  }
  CHECK(refit::memory_in_use().host == before.host);
}

TEST_CASE("each host_shm session gets fresh segment names", "[host_shm]") {
  auto src = tr::make_source(shm_options());
  refit::wire::hello a;
  src->open_session(a);
  src->session_accepted(std::array{refit::wire::ok{}});
  src->close_session();
  refit::wire::hello b;
  src->open_session(b);
  REQUIRE(a.buffers.size() == 2);
  REQUIRE(b.buffers.size() == 2);
  for (const auto& x : a.buffers)
    for (const auto& y : b.buffers) CHECK(x.handle != y.handle);
  auto sink = tr::make_sink("host_shm", 0);
  refit::wire::ok reply;
  CHECK_NOTHROW(sink->attach(b, reply));
  src->session_accepted({&reply, 1});
}

TEST_CASE("a host_shm sink refuses what it cannot or must not map", "[host_shm]") {
  auto src = tr::make_source(shm_options(2, 8192));
  refit::wire::hello good;
  src->open_session(good);

  SECTION("another host") {
    auto h = good;
    h.host_id = "elsewhere/00000000-0000-0000-0000-000000000000";
    expect_refused(h, "nccl");
    expect_refused(h, "elsewhere");
  }
  SECTION("another transport") {
    auto h = good;
    h.transport = "cuda_ipc";
    expect_refused(h, "cuda_ipc");
  }
  SECTION("a size that does not match the segment") {
    auto h = good;
    h.buffers[1].bytes = 4096;
    expect_refused(h, "4096");
    h.buffers[1].bytes = 1u << 20;
    expect_refused(h, good.buffers[1].handle);
  }
  SECTION("a missing segment or memfd") {
    auto h = good;
    h.buffers[1].handle = segment_name(1, 1, 0);
    expect_refused(h, h.buffers[1].handle);
    expect_refused(h, "alive");
    h.buffers[1].handle = "/proc/999999999/fd/3:refit-999999999-0000000000000000";
    expect_refused(h, h.buffers[1].handle);
    expect_refused(h, "REFIT_HOST_SHM=named");
  }
  SECTION("a name that is not one of refit's") {
    for (const char* name :
         {"/etc-passwd", "refit-1-00", "/refit-../../etc/passwd", "/refit-", "", "/dev/shm/refit-1",
          "/refit-1-0123456789abcdef", "/refit-1-2-0123456789abcdeg", "/refit-1-2-0123456789abcdef0",
          "/refit-x-2-0123456789abcdef", "/proc/1/fd/3", "/proc/1/fd/3:refit-2-0123456789abcdef",
          "/proc/self/fd/3:refit-1-0123456789abcdef", "/proc/1/fd/../../etc:refit-1-0123456789abcdef",
          "/proc/1/mem:refit-1-0123456789abcdef", "/proc/1/fd/-3:refit-1-0123456789abcdef"}) {
      auto h = good;
      h.buffers[0].handle = name;
      expect_refused(h, "not a refit shared memory object");
    }
    auto h = good;
    h.buffers[0].handle = "/refit-" + std::string(300, 'a');
    expect_refused(h, "not a refit shared memory object");
  }
  SECTION("no buffers, too many buffers, an empty buffer") {
    auto h = good;
    h.buffers.clear();
    expect_refused(h, "0 buffers");
    h.buffers.assign(65, good.buffers[0]);
    expect_refused(h, "65 buffers");
    h = good;
    h.buffers[0].bytes = 0;
    expect_refused(h, "0 bytes");
  }
  SECTION("a refused HELLO unmaps what an earlier one mapped") {
    auto sink = tr::make_sink("host_shm", 0);
    refit::wire::ok reply;
    sink->attach(good, reply);
    REQUIRE(sink->attached());
    auto h = good;
    h.buffers[1].bytes = 1;
    CHECK_THROWS_AS(sink->attach(h, reply), refit::error);
    CHECK_FALSE(sink->attached());
  }
  src->close_session();
}

TEST_CASE("host_shm sessions do not leak file descriptors or segments", "[host_shm]") {
  auto src = tr::make_source(shm_options(2, 16u << 10));
  auto sink = tr::make_sink("host_shm", 0);
  // One warm-up session, so lazily opened descriptors (e.g. of the logger) are counted before.
  for (int round = 0; round < 2; ++round) {
    const auto fds = open_fds();
    const auto shm = own_shm_entries();
    const int sessions = round == 0 ? 1 : 200;
    for (int i = 0; i < sessions; ++i) {
      refit::wire::hello h;
      src->open_session(h);
      refit::wire::ok reply;
      sink->attach(h, reply);
      src->session_accepted({&reply, 1});
      REQUIRE(sink->data(1)[0] == src->data(1)[0]);
      sink->detach();
      src->close_session();
    }
    if (round == 1) {
      CHECK(open_fds() == fds);
      CHECK(own_shm_entries() == shm);
    }
  }
  src.reset();
  CHECK(own_shm_entries() == 0);
}

TEST_CASE("a host_shm sink in a forked child reads the parent's bytes exactly", "[host_shm]") {
  const std::uint64_t bytes = (1u << 20) + 7;
  auto src = tr::make_source(shm_options(2, bytes));
  refit::wire::hello h;
  src->open_session(h);
  for (std::size_t i = 0; i < 2; ++i)
    refit::test::fill_pattern("fork" + std::to_string(i), 11, reinterpret_cast<std::uint8_t*>(src->data(i)), bytes);
  refit::test::signal_pipe to_parent;
  refit::test::signal_pipe to_child;
  refit::test::child c([&] {
    auto sink = tr::make_sink("host_shm", 0);
    refit::wire::ok reply;
    sink->attach(h, reply);
    to_parent.send("mapped");
    // The parent unlinks the names now; the mapping must stay valid.
    if (to_child.receive(20s) != "unlinked") throw std::runtime_error("unexpected line");
    std::vector<std::uint8_t> expect(bytes);
    for (std::size_t i = 0; i < 2; ++i) {
      refit::test::fill_pattern("fork" + std::to_string(i), 11, expect.data(), bytes);
      if (sink->buffer_bytes(i) != bytes || std::memcmp(sink->data(i), expect.data(), bytes) != 0)
        throw std::runtime_error("buffer " + std::to_string(i) + " differs");
    }
    to_parent.send("verified");
  });
  REQUIRE(to_parent.receive(20s) == "mapped");
  src->session_accepted(std::array{refit::wire::ok{}});  // closes the memfds' descriptors
  CHECK(own_shm_entries() == 0);
  to_child.send("unlinked");
  CHECK(to_parent.receive(20s) == "verified");
  CHECK(c.wait(20s) == 0);
}

TEST_CASE("host and process identities name this host and process", "[host_shm]") {
  const auto host = tr::host_identity();
  CHECK_FALSE(host.empty());
  CHECK(host == tr::host_identity());
  const auto proc = tr::process_identity();
  CHECK(proc.ends_with(":" + std::to_string(::getpid())));
  CHECK(host.starts_with(proc.substr(0, proc.rfind(':'))));
}

TEST_CASE("the segments of a streamer killed before HELLO are removed by the next streamer on the host", "[host_shm]") {
  refit::test::signal_pipe names;
  refit::test::child victim([&] {
    ::setenv("REFIT_HOST_SHM", "named", 1);  // memfds leave no names at all
    auto source = tr::make_source(shm_options());
    refit::wire::hello h;
    source->open_session(h);  // names exist in /dev/shm, not yet accepted by any receiver
    std::string line;
    for (const auto& b : h.buffers) line += b.handle + " ";
    names.send(line);
    for (;;) ::pause();  // until killed
  });
  std::vector<std::string> left;
  {
    std::string line = names.receive();
    for (std::size_t at = 0; (at = line.find('/', at)) != std::string::npos;) {
      const auto space = line.find(' ', at);
      left.push_back(line.substr(at + 1, space - at - 1));
      at = space;
    }
  }
  REQUIRE(left.size() == 2);
  victim.kill();
  for (const auto& n : left) REQUIRE(std::filesystem::exists("/dev/shm/" + n));
  auto next = tr::make_source(shm_options());  // starts by reaping what dead streamers left
  for (const auto& n : left) CHECK_FALSE(std::filesystem::exists("/dev/shm/" + n));
}

// ------------------------------------------------------------------------------------ a hostile streamer
// A process on this host that reaches the receiver's endpoint and makes its own /dev/shm objects.

TEST_CASE("a FIFO named in HELLO is refused at once instead of blocking the receiver in open()",
          "[host_shm][hostile]") {
  const std::string name = segment_name(::getpid(), pid_namespace(), 0x0123456789abcdef);
  REQUIRE(::mkfifo(shm_path(name).c_str(), 0600) == 0);
  struct cleanup {
    std::string path;
    ~cleanup() { ::unlink(path.c_str()); }
  } gone{shm_path(name)};
  // Without O_NONBLOCK this attach would wait forever for a writer.
  expect_refused(hello_naming({name}, 4096), "is a FIFO, not a regular file");
  // The same FIFO behind a /proc/<pid>/fd link: never opened at all (O_PATH first).
  const int fifo = ::open(shm_path(name).c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
  REQUIRE(fifo >= 0);
  const std::string handle = memfd_handle(fifo, memfd_tag(1));
  expect_refused(hello_naming({handle}, 4096), "is a FIFO, not a regular file");
  ::close(fifo);
}

TEST_CASE("a segment open to group or others is refused, naming its mode", "[host_shm][hostile]") {
  for (const mode_t mode : {0644, 0666, 0640, 0604}) {
    const hostile_segment seg(8192, mode, 0xabc0 + mode);
    char text[8];
    std::snprintf(text, sizeof text, "%04o", static_cast<unsigned>(mode));
    INFO(text);
    expect_refused(hello_naming({seg.name}, 8192), std::string("has mode ") + text + ", open to group or others");
  }
  // A memfd as it comes from memfd_create (0777) is refused the same way.
  const std::string tag = memfd_tag(2);
  const int fd = ::memfd_create(tag.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, 8192) == 0);
  REQUIRE(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
  expect_refused(hello_naming({memfd_handle(fd, tag)}, 8192), "open to group or others");
  ::close(fd);
}

TEST_CASE("a segment that belongs to another uid is refused", "[host_shm][hostile]") {
  if (::geteuid() != 0) {
    WARN("not root: no file of another uid can be made here (CI runs this as root)");
    return;
  }
  const hostile_segment seg(8192, 0600, 0xd00d);
  REQUIRE(::fchown(seg.fd, 65534, 65534) == 0);
  expect_refused(hello_naming({seg.name}, 8192), "belongs to uid 65534, not to this process's effective uid 0");
  const std::string tag = memfd_tag(3);
  const int fd = ::memfd_create(tag.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  REQUIRE(fd >= 0);
  REQUIRE(::fchmod(fd, 0600) == 0);
  REQUIRE(::ftruncate(fd, 8192) == 0);
  REQUIRE(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
  REQUIRE(::fchown(fd, 65534, 65534) == 0);
  expect_refused(hello_naming({memfd_handle(fd, tag)}, 8192), "belongs to uid 65534");
  ::close(fd);
}

TEST_CASE("a symbolic link named in HELLO is refused, even to a good segment", "[host_shm][hostile]") {
  const hostile_segment target(8192, 0600, 0x5eed);
  const std::string link = segment_name(::getpid(), pid_namespace(), 0x1111);
  REQUIRE(::symlink(shm_path(target.name).c_str(), shm_path(link).c_str()) == 0);
  struct cleanup {
    std::string path;
    ~cleanup() { ::unlink(path.c_str()); }
  } gone{shm_path(link)};
  expect_refused(hello_naming({link}, 8192), "is a symbolic link: refused");
  // The target itself is acceptable: the link is what was refused.
  auto sink = tr::make_sink("host_shm", 0);
  refit::wire::ok reply;
  CHECK_NOTHROW(sink->attach(hello_naming({target.name}, 8192), reply));
  CHECK(sink->attached());
  // ...and the receiver removed its name once mapped.
  CHECK_FALSE(std::filesystem::exists(shm_path(target.name)));
}

TEST_CASE("a memfd that is unsealed, or not the one the handle's tag names, is refused", "[host_shm][hostile]") {
  const std::string tag = memfd_tag(4);
  const int fd = ::memfd_create(tag.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  REQUIRE(fd >= 0);
  REQUIRE(::fchmod(fd, 0600) == 0);
  REQUIRE(::ftruncate(fd, 8192) == 0);
  expect_refused(hello_naming({memfd_handle(fd, tag)}, 8192),
                 "is not sealed against shrinking and growing (F_GET_SEALS: 0x0): refused");
  REQUIRE(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
  expect_refused(hello_naming({memfd_handle(fd, tag)}, 8192), "is not sealed against shrinking and growing");
  REQUIRE(::fcntl(fd, F_ADD_SEALS, F_SEAL_GROW) == 0);
  expect_refused(hello_naming({memfd_handle(fd, memfd_tag(5))}, 8192), "is not the streamer's buffer");
  expect_refused(hello_naming({memfd_handle(fd, tag)}, 4096), "has 8192 bytes but HELLO announced 4096 bytes");
  // A regular file of the right size behind the descriptor is not a memfd at all.
  const hostile_segment plain(8192, 0600, 0xf11e);
  expect_refused(hello_naming({memfd_handle(plain.fd, tag)}, 8192), "is not the streamer's buffer");
  // Sealed against both, it is accepted.
  auto sink = tr::make_sink("host_shm", 0);
  refit::wire::ok reply;
  CHECK_NOTHROW(sink->attach(hello_naming({memfd_handle(fd, tag)}, 8192), reply));
  ::close(fd);
}

namespace {

/// Throws unless `f` throws refit::error(transport) whose message holds `needle`.
template <class F>
void expect_transport_error(F&& f, const std::string& needle) {
  try {
    f();
  } catch (const refit::error& e) {
    if (e.code() != refit::errc::transport || std::string(e.what()).find(needle) == std::string::npos)
      throw std::runtime_error(std::string("unexpected error: ") + e.what());
    return;
  }
  throw std::runtime_error("no error; expected one saying: " + needle);
}

/// ThreadSanitizer intercepts the process's signal handling: a SIGBUS reaches neither the guard's
/// handler nor its jump (lib/copy/bus_guard.hpp), so under it the guard cases check nothing and
/// say so; the normal and the ASan+UBSan builds run them.
bool signals_intercepted() {
#if defined(__SANITIZE_THREAD__)
  WARN("ThreadSanitizer owns SIGBUS here: the SIGBUS guard cases run in the other builds");
  return true;
#else
  return false;
#endif
}

}  // namespace

TEST_CASE("a segment shrunk under the receiver fails the copy with errc::transport, and the receiver lives",
          "[host_shm][hostile]") {
  if (signals_intercepted()) return;
  // In a child, so that a regression shows as its death by SIGBUS, not as the end of this run.
  refit::test::child receiver([] {
    const std::uint64_t bytes = 64u << 10;
    const hostile_segment a(bytes, 0600, 0xb05);
    const hostile_segment b(bytes, 0600, 0xb06);
    auto sink = tr::make_sink("host_shm", 0);
    refit::wire::ok reply;
    sink->attach(hello_naming({a.name, b.name}, bytes), reply);
    // The streamer (this test, holding the descriptors) shrinks both after the receiver mapped them.
    if (::ftruncate(a.fd, 4096) != 0 || ::ftruncate(b.fd, 0) != 0) throw std::runtime_error("ftruncate");
    std::vector<std::byte> dest(bytes);
    auto copier = refit::copy::make_copier(refit::copy::engine::cpu);
    // The receiver's apply: its copies out of buffer 0, through the copier's guard.
    const std::vector<refit::copy::op> one{refit::copy::op(sink->data(0) + 8197, dest.data(), 1)};
    sink->begin_read(0);
    expect_transport_error([&] { copier->run(one, nullptr); },
                           "the streamer's shared memory " + a.name +
                               " shrank under the receiver (SIGBUS reading byte 8197 of buffer 0): the streamer is "
                               "broken or hostile; the refit was aborted");
    // A whole batch faults the same way; the buffer stays refused for the rest of the session.
    const std::vector<refit::copy::op> batch{refit::copy::op(sink->data(0), dest.data(), 4096),
                                             refit::copy::op(sink->data(0) + 4096, dest.data(), bytes - 4096)};
    expect_transport_error([&] { copier->run(batch, nullptr); }, "of buffer 0");
    expect_transport_error([&] { sink->begin_read(0); }, "shrank under the receiver");
    // A read outside the copier (a batch callback's view) reads zeros instead of dying, and the
    // batch fails at end_read.
    sink->begin_read(1);
    const volatile std::byte* view = sink->data(1);
    if (view[100] != std::byte{0}) throw std::runtime_error("a faulted page did not read as zero");
    expect_transport_error([&] { sink->end_read(1); }, "SIGBUS reading byte 100 of buffer 1");
    // Copies that read no peer memory are not affected, and the process goes on.
    std::vector<std::byte> mine(64, std::byte{7});
    copier->run(std::vector<refit::copy::op>{refit::copy::op(mine.data(), dest.data(), 64)}, nullptr);
    if (dest[63] != std::byte{7}) throw std::runtime_error("a plain copy failed");
    sink->detach();
  });
  CHECK(receiver.wait(30s) == 0);
}

TEST_CASE("a SIGBUS outside the streamer's memory still ends the process as it did", "[host_shm][hostile]") {
  if (signals_intercepted()) return;
  refit::test::child victim([] {
    const rlimit no_core{0, 0};
    ::setrlimit(RLIMIT_CORE, &no_core);
    const hostile_segment peer(8192, 0600, 0xc0de);
    auto sink = tr::make_sink("host_shm", 0);  // installs the handler
    refit::wire::ok reply;
    sink->attach(hello_naming({peer.name}, 8192), reply);
    const hostile_segment own(8192, 0600, 0xc0df);
    void* p = ::mmap(nullptr, 8192, PROT_READ, MAP_SHARED, own.fd, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap");
    if (::ftruncate(own.fd, 0) != 0) throw std::runtime_error("ftruncate");
    std::vector<std::byte> dest(16);
    auto copier = refit::copy::make_copier(refit::copy::engine::cpu);
    // Guarded or not, a fault in memory that is not a peer's is not the guard's business.
    copier->run(std::vector<refit::copy::op>{refit::copy::op(static_cast<std::byte*>(p) + 16, dest.data(), 16)},
                nullptr);
  });
  const int status = victim.wait(30s);
#if defined(__SANITIZE_ADDRESS__)
  // The handler before the guard's is AddressSanitizer's: it reports the fault and exits (1).
  CHECK(status == 1);
#else
  CHECK(status == -SIGBUS);
#endif
}

TEST_CASE("a streamer SIGKILLed after its receiver mapped its buffers leaves nothing in /dev/shm",
          "[host_shm][hostile]") {
  const bool named = GENERATE(false, true);
  INFO((named ? "named segments" : "memfds"));
  const std::uint64_t bytes = 32u << 10;
  refit::test::signal_pipe to_parent;
  refit::test::child streamer([&] {
    if (named) ::setenv("REFIT_HOST_SHM", "named", 1);
    auto source = tr::make_source(shm_options(2, bytes));
    refit::wire::hello h;
    source->open_session(h);
    for (std::size_t i = 0; i < 2; ++i)
      refit::test::fill_pattern("kill" + std::to_string(i), 5, reinterpret_cast<std::uint8_t*>(source->data(i)), bytes);
    std::string line;
    for (const auto& b : h.buffers) line += b.handle + " ";
    to_parent.send(line);
    for (;;) ::pause();  // until killed, before it hears the OK that would unlink or close anything
  });
  std::vector<std::string> handles;
  {
    const std::string line = to_parent.receive(20s);
    for (std::size_t at = 0, space; (space = line.find(' ', at)) != std::string::npos; at = space + 1)
      handles.push_back(line.substr(at, space - at));
  }
  REQUIRE(handles.size() == 2);
  CHECK(shm_entries_of(streamer.pid()) == (named ? 2u : 0u));
  auto sink = tr::make_sink("host_shm", 0);
  refit::wire::ok reply;
  refit::wire::hello h = hello_naming(handles, bytes);
  h.peer = "somewhere:" + std::to_string(streamer.pid());
  sink->attach(h, reply);
  streamer.kill();
  CHECK(shm_entries_of(streamer.pid()) == 0);
  // The memory lives on in the receiver's mapping until it detaches.
  std::vector<std::uint8_t> expect(bytes);
  for (std::size_t i = 0; i < 2; ++i) {
    refit::test::fill_pattern("kill" + std::to_string(i), 5, expect.data(), bytes);
    CHECK(std::memcmp(sink->data(i), expect.data(), bytes) == 0);
  }
}

TEST_CASE("the reaper removes names of dead streamers of its own pid namespace only", "[host_shm][hostile]") {
  refit::test::child gone([] {});
  REQUIRE(gone.wait(20s) == 0);
  const pid_t dead = gone.pid();
  const std::uint64_t ns = pid_namespace();
  std::vector<std::string> names{segment_name(dead, ns, 1), segment_name(dead, ns + 1, 2),
                                 segment_name(::getpid(), ns, 3)};
  for (const auto& n : names) {
    const int fd = ::open(shm_path(n).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    ::close(fd);
  }
  auto next = tr::make_source(shm_options());                // reaps as it starts
  CHECK_FALSE(std::filesystem::exists(shm_path(names[0])));  // dead, here
  CHECK(std::filesystem::exists(shm_path(names[1])));        // another namespace: its pid says nothing here
  CHECK(std::filesystem::exists(shm_path(names[2])));        // alive
  for (const auto& n : names) ::unlink(shm_path(n).c_str());
}
