// The host_shm transport: POSIX shared memory segments, their lifetime and the receiver's checks.
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

}  // namespace

TEST_CASE("host_shm segments are private files until the receiver accepts, then unlinked", "[host_shm]") {
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
    CHECK(b.handle.starts_with("/refit-" + std::to_string(::getpid()) + "-"));
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
  SECTION("a missing segment") {
    auto h = good;
    h.buffers[1].handle = "/refit-1-0000000000000000";
    expect_refused(h, "/refit-1-0000000000000000");
    expect_refused(h, "alive");
  }
  SECTION("a name that is not one of refit's") {
    for (const char* name :
         {"/etc-passwd", "refit-1-00", "/refit-../../etc/passwd", "/refit-", "", "/dev/shm/refit-1"}) {
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
  src->session_accepted(std::array{refit::wire::ok{}});
  for (const auto& b : h.buffers) CHECK_FALSE(std::filesystem::exists(shm_path(b.handle)));
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
