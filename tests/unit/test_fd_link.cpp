// The descriptor link (channel/fd_link.hpp): descriptors both ways, by tag, the deadlines, a peer
// that goes or breaks the rules, and the link every lane carries.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "channel/fd_link.hpp"
#include "channel/lane.hpp"
#include "support/support.hpp"

using namespace std::chrono_literals;
using refit::errc;
using refit::channel::fd_link;
using refit::channel::lane;

namespace {

fd_link::clock::time_point in(std::chrono::milliseconds d) { return fd_link::clock::now() + d; }

/// A descriptor the test owns, closed at the end of the scope.
struct owned_fd {
  int fd = -1;
  explicit owned_fd(int f) : fd(f) {}
  ~owned_fd() {
    if (fd >= 0) ::close(fd);
  }
  owned_fd(owned_fd&& o) noexcept : fd(std::exchange(o.fd, -1)) {}
  owned_fd(const owned_fd&) = delete;
  owned_fd& operator=(const owned_fd&) = delete;
  owned_fd& operator=(owned_fd&&) = delete;
  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

/// A private directory for the test's socket files, removed with what is in it.
struct temp_dir {
  std::string path;
  temp_dir() {
    std::string p = (std::filesystem::temp_directory_path() / "refit-fdlink-XXXXXX").string();
    if (::mkdtemp(p.data()) == nullptr) throw std::runtime_error("mkdtemp: " + std::string(std::strerror(errno)));
    path = p;
  }
  ~temp_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
};

/// An anonymous file holding `text`.
owned_fd memfd_with(std::string_view text) {
  owned_fd f(::memfd_create("refit-test", MFD_CLOEXEC));
  REQUIRE(f.fd >= 0);
  REQUIRE(::write(f.fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  return f;
}

/// What `fd` holds from its start.
std::string contents(int fd) {
  std::array<char, 256> buf{};
  const ssize_t n = ::pread(fd, buf.data(), buf.size(), 0);
  return n < 0 ? std::string("<pread failed>") : std::string(buf.data(), static_cast<std::size_t>(n));
}

bool same_file(int a, int b) {
  struct stat sa {};
  struct stat sb {};
  return ::fstat(a, &sa) == 0 && ::fstat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

/// A pipe whose read end does not block: read() gives 0 once every write end is closed, -1 before.
struct pipe_pair {
  owned_fd read_end{-1};
  owned_fd write_end{-1};
  pipe_pair() {
    std::array<int, 2> p{};
    REQUIRE(::pipe2(p.data(), O_CLOEXEC | O_NONBLOCK) == 0);
    read_end.fd = p[0];
    write_end.fd = p[1];
  }
  /// True when no write end is open anywhere (end of file).
  [[nodiscard]] bool writers_gone() const {
    char c = 0;
    return ::read(read_end.fd, &c, 1) == 0;
  }
};

/// A listening link at `dir`/fds and a link connected to it.
struct linked_pair {
  std::shared_ptr<fd_link> rx;
  std::shared_ptr<fd_link> tx;
  explicit linked_pair(const temp_dir& dir)
      : rx(fd_link::listen(dir.path + "/fds")), tx(fd_link::connect(dir.path + "/fds")) {}
};

/// A socket connected by hand to the link listening at `path`: what a broken peer could send.
owned_fd raw_connect(const std::string& path) {
  owned_fd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  REQUIRE(s.fd >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  REQUIRE(path.size() < sizeof(addr.sun_path));
  std::memcpy(addr.sun_path, path.data(), path.size());
  REQUIRE(::connect(s.fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0);
  return s;
}

/// Sends `bytes` with `fds` attached (none: no control data) through the raw socket `s`.
void send_raw(int s, std::string_view bytes, std::initializer_list<int> fds) {
  std::vector<char> data(bytes.begin(), bytes.end());
  iovec iov{data.data(), data.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) std::array<char, CMSG_SPACE(sizeof(int) * 4)> control{};
  if (fds.size() != 0) {
    REQUIRE(fds.size() <= 4);
    msg.msg_control = control.data();
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), std::data(fds), sizeof(int) * fds.size());
  }
  REQUIRE(::sendmsg(s, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size()));
}

std::string tag_bytes(std::uint64_t tag) { return {reinterpret_cast<const char*>(&tag), sizeof(tag)}; }

}  // namespace

TEST_CASE("a descriptor sent either way arrives as the same file, and the sender keeps its own", "[fd_link]") {
  temp_dir dir;
  linked_pair link(dir);
  const owned_fd file = memfd_with("from the streamer");

  CHECK(link.tx->send(7, file.fd, in(5s)));
  const owned_fd got(link.rx->receive(7, in(5s)));
  REQUIRE(got.fd >= 0);
  CHECK(got.fd != file.fd);
  CHECK(same_file(got.fd, file.fd));
  CHECK(contents(got.fd) == "from the streamer");
  CHECK((::fcntl(got.fd, F_GETFD) & FD_CLOEXEC) != 0);  // no child inherits it
  // The sender's descriptor is still its own: written through it, read through the one received.
  REQUIRE(::pwrite(file.fd, "FROM", 4, 0) == 4);
  CHECK(contents(got.fd) == "FROM the streamer");

  const owned_fd back = memfd_with("from the receiver");
  CHECK(link.rx->send(8, back.fd, in(5s)));
  const owned_fd got_back(link.tx->receive(8, in(5s)));
  REQUIRE(got_back.fd >= 0);
  CHECK(same_file(got_back.fd, back.fd));
  REQUIRE(::pwrite(got_back.fd, "FROM", 4, 0) == 4);
  CHECK(contents(back.fd) == "FROM the receiver");
}

TEST_CASE("descriptors sent in a row are received by tag, in order", "[fd_link]") {
  temp_dir dir;
  linked_pair link(dir);
  std::vector<owned_fd> files;
  files.reserve(6);
  for (int i = 0; i < 6; ++i) files.push_back(memfd_with("file " + std::to_string(i)));
  // Tags 1, 2, 3 once each, then tag 9 three times: the same tag again is the next one sent.
  const std::array<std::uint64_t, 6> tags{1, 2, 3, 9, 9, 9};
  for (std::size_t i = 0; i < files.size(); ++i) CHECK(link.tx->send(tags[i], files[i].fd, in(5s)));
  for (std::size_t i = 0; i < files.size(); ++i) {
    INFO("descriptor " << i << ", tag " << tags[i]);
    const owned_fd got(link.rx->receive(tags[i], in(5s)));
    REQUIRE(got.fd >= 0);
    CHECK(same_file(got.fd, files[i].fd));
    CHECK(contents(got.fd) == "file " + std::to_string(i));
  }
  CHECK(link.rx->receive(1, in(10ms)) == -1);
}

TEST_CASE("descriptors of other tags before the wanted one are closed and skipped", "[fd_link]") {
  temp_dir dir;
  linked_pair link(dir);
  pipe_pair stale;
  const owned_fd wanted = memfd_with("wanted");
  CHECK(link.tx->send(1, stale.write_end.fd, in(5s)));  // for a refit that failed meanwhile
  CHECK(link.tx->send(2, wanted.fd, in(5s)));
  stale.write_end.close();
  CHECK_FALSE(stale.writers_gone());  // the one in flight is still open

  const owned_fd got(link.rx->receive(2, in(5s)));
  REQUIRE(got.fd >= 0);
  CHECK(same_file(got.fd, wanted.fd));
  CHECK(stale.writers_gone());  // the skipped one was closed, not leaked
}

TEST_CASE("receive returns -1 at its deadline when nothing comes", "[fd_link]") {
  temp_dir dir;
  linked_pair link(dir);
  for (const auto& end : {link.rx, link.tx}) {
    const auto t0 = fd_link::clock::now();
    CHECK(end->receive(1, t0 + 50ms) == -1);
    CHECK(fd_link::clock::now() - t0 >= 50ms);
  }
  // Still usable after a wait that ended.
  const owned_fd file = memfd_with("late");
  CHECK(link.tx->send(1, file.fd, in(5s)));
  const owned_fd got(link.rx->receive(1, in(5s)));
  CHECK(same_file(got.fd, file.fd));

  // A listening end that nobody connects to waits as long.
  temp_dir lonely_dir;
  const auto lonely = fd_link::listen(lonely_dir.path + "/fds");
  const auto t0 = fd_link::clock::now();
  CHECK(lonely->receive(1, t0 + 50ms) == -1);
  CHECK(fd_link::clock::now() - t0 >= 50ms);
}

TEST_CASE("receive returns -1 at once when the peer's link is destroyed", "[fd_link]") {
  temp_dir dir;
  SECTION("the streamer's, before the receiver accepted it") {
    linked_pair link(dir);
    link.tx.reset();
    const auto t0 = fd_link::clock::now();
    CHECK(link.rx->receive(1, in(20s)) == -1);
    CHECK(fd_link::clock::now() - t0 < 10s);
  }
  SECTION("the receiver's, after it accepted") {
    linked_pair link(dir);
    const owned_fd file = memfd_with("x");
    CHECK(link.tx->send(1, file.fd, in(5s)));
    CHECK(owned_fd(link.rx->receive(1, in(5s))).fd >= 0);
    link.rx.reset();
    const auto t0 = fd_link::clock::now();
    CHECK(link.tx->receive(1, in(20s)) == -1);
    CHECK(fd_link::clock::now() - t0 < 10s);
    CHECK_FALSE(link.tx->send(2, file.fd, in(5s)));  // and nothing more goes
  }
}

TEST_CASE("send on a listening end that nobody connects to returns false at its deadline", "[fd_link]") {
  temp_dir dir;
  const auto rx = fd_link::listen(dir.path + "/fds");
  const owned_fd file = memfd_with("x");
  const auto t0 = fd_link::clock::now();
  CHECK_FALSE(rx->send(1, file.fd, t0 + 50ms));
  CHECK(fd_link::clock::now() - t0 >= 50ms);
}

TEST_CASE("a link that cannot be made is an io error naming its path", "[fd_link]") {
  temp_dir dir;
  const std::string nothing = dir.path + "/nothing";
  CHECK_REFIT_ERROR(fd_link::connect(nothing), errc::io, "cannot connect the descriptor link to " + nothing);
  const auto first = fd_link::listen(dir.path + "/fds");
  CHECK_REFIT_ERROR(fd_link::listen(dir.path + "/fds"), errc::io,
                    "cannot listen for a descriptor link at " + dir.path + "/fds");
  const std::string long_path = dir.path + "/" + std::string(200, 'x');
  CHECK_REFIT_ERROR(fd_link::listen(long_path), errc::io, long_path);
  CHECK_REFIT_ERROR(fd_link::connect(long_path), errc::io, "use a shorter directory");
}

TEST_CASE("a message that breaks the link's rules makes receive return -1 and closes what it carried", "[fd_link]") {
  temp_dir dir;
  const std::string path = dir.path + "/fds";
  SECTION("a short tag and no descriptor") {
    const auto rx = fd_link::listen(path);
    const owned_fd raw = raw_connect(path);
    send_raw(raw.fd, "abc", {});
    CHECK(rx->receive(1, in(5s)) == -1);
  }
  SECTION("a tag and no descriptor") {
    const auto rx = fd_link::listen(path);
    const owned_fd raw = raw_connect(path);
    send_raw(raw.fd, tag_bytes(1), {});
    CHECK(rx->receive(1, in(5s)) == -1);
  }
  SECTION("a short tag with a descriptor") {
    const auto rx = fd_link::listen(path);
    const owned_fd raw = raw_connect(path);
    pipe_pair carried;
    send_raw(raw.fd, "abc", {carried.write_end.fd});
    carried.write_end.close();
    CHECK(rx->receive(1, in(5s)) == -1);
    CHECK(carried.writers_gone());
  }
  SECTION("a tag too long with a descriptor") {
    const auto rx = fd_link::listen(path);
    const owned_fd raw = raw_connect(path);
    pipe_pair carried;
    send_raw(raw.fd, tag_bytes(1) + "x", {carried.write_end.fd});
    carried.write_end.close();
    CHECK(rx->receive(1, in(5s)) == -1);
    CHECK(carried.writers_gone());
  }
  SECTION("two descriptors: the first is handed out, the other closed") {
    const auto rx = fd_link::listen(path);
    const owned_fd raw = raw_connect(path);
    const owned_fd file = memfd_with("first");
    pipe_pair extra;
    send_raw(raw.fd, tag_bytes(1), {file.fd, extra.write_end.fd});
    extra.write_end.close();
    const owned_fd got(rx->receive(1, in(5s)));
    REQUIRE(got.fd >= 0);
    CHECK(same_file(got.fd, file.fd));
    CHECK(extra.writers_gone());
  }
}

TEST_CASE("a lane carries descriptors both ways through its link, also after its files are removed",
          "[fd_link][lane]") {
  auto rx = lane::create();
  const std::string dir = rx->offer().substr(0, rx->offer().rfind('\n'));
  struct stat st {};
  REQUIRE(::stat((dir + "/fds").c_str(), &st) == 0);
  CHECK(S_ISSOCK(st.st_mode));
  auto tx = lane::open(rx->offer());
  REQUIRE(rx->fds());
  REQUIRE(tx->fds());
  // Removed (by the streamer's open) before the receiver's first use of the link: the streamer's
  // connection waits in the listening socket, which stays open.
  rx->remove_files();
  CHECK_FALSE(std::filesystem::exists(dir));

  const owned_fd there = memfd_with("to the receiver");
  CHECK(tx->fds()->send(11, there.fd, in(5s)));
  const owned_fd got(rx->fds()->receive(11, in(5s)));
  REQUIRE(got.fd >= 0);
  CHECK(same_file(got.fd, there.fd));

  const owned_fd back = memfd_with("to the streamer");
  CHECK(rx->fds()->send(12, back.fd, in(5s)));
  // The link outlives the lane in whoever holds it.
  const auto streamer_link = tx->fds();
  tx.reset();
  const owned_fd got_back(streamer_link->receive(12, in(5s)));
  REQUIRE(got_back.fd >= 0);
  CHECK(same_file(got_back.fd, back.fd));
}
