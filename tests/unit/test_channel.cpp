// The control channel (REQ/REP with deadlines) and the shared test helpers.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <thread>

#include "channel/channel.hpp"
#include "support/support.hpp"

using namespace std::chrono_literals;
using refit::channel::rep_channel;
using refit::channel::req_channel;

namespace {

/// Answers `n` requests with "re:<request>" on a thread; joins on destruction.
class echo_server {
 public:
  echo_server(rep_channel& rep, int n)
      : thread_([&rep, n] {
          for (int i = 0; i < n; ++i) {
            auto got = rep.receive(40s);
            if (!got) return;
            rep.reply("re:" + *got);
          }
        }) {}
  ~echo_server() { thread_.join(); }
  echo_server(const echo_server&) = delete;
  echo_server& operator=(const echo_server&) = delete;

 private:
  std::thread thread_;
};

std::string dir_of(const std::string& endpoint) {
  return std::filesystem::path(endpoint.substr(6)).parent_path().string();
}

}  // namespace

TEST_CASE("a request gets its reply over ipc", "[channel]") {
  const auto ep = refit::test::temp_endpoint();
  {
    rep_channel rep(ep);
    CHECK(rep.endpoint() == ep);
    req_channel req(rep.endpoint());
    echo_server server(rep, 3);
    for (int i = 0; i < 3; ++i)
      CHECK(req.request("ping" + std::to_string(i), 5s, "PING") == "re:ping" + std::to_string(i));
    CHECK(req.resets() == 0);
  }
  refit::channel::remove_private_endpoint(ep);
}

TEST_CASE("a request gets its reply over tcp on an ephemeral loopback port", "[channel]") {
  rep_channel rep("tcp://127.0.0.1:0");
  const auto& ep = rep.endpoint();
  REQUIRE(ep.starts_with("tcp://127.0.0.1:"));
  const auto port = ep.substr(std::string("tcp://127.0.0.1:").size());
  REQUIRE_FALSE(port.empty());
  CHECK(port != "0");
  CHECK(port != "*");
  CHECK(std::stoi(port) > 0);
  req_channel req(ep);
  echo_server server(rep, 1);
  // A generous deadline: under TSan on a loaded 2-core CI machine this 1 MiB round trip once
  // took longer than 5 s; the test is about the endpoint, not the speed.
  CHECK(req.request(std::string(1 << 20, 'x'), 30s, "BIG") == "re:" + std::string(1 << 20, 'x'));
}

TEST_CASE("a request without a receiver times out with a message naming the endpoint and the request", "[channel]") {
  const auto ep = refit::test::temp_endpoint();
  req_channel req(ep);
  const auto start = std::chrono::steady_clock::now();
  try {
    req.request("hello", 200ms, "BATCH 12 of version 7");
    FAIL("request returned without a receiver");
  } catch (const refit::error& e) {
    const auto elapsed = std::chrono::steady_clock::now() - start;
    CHECK(e.code() == refit::errc::timeout);
    CHECK(elapsed >= 150ms);
    CHECK(elapsed < 2s);
    const std::string what = e.what();
    CHECK(what.find(ep) != std::string::npos);
    CHECK(what.find("BATCH 12 of version 7") != std::string::npos);
    CHECK(what.find("200 ms") != std::string::npos);
  }
  CHECK(req.resets() == 1);
  refit::channel::remove_private_endpoint(ep);
}

TEST_CASE("after a timeout the channel reaches a receiver bound later on the same endpoint", "[channel]") {
  const auto ep = refit::test::temp_endpoint();
  req_channel req(ep);
  CHECK_THROWS_AS(req.request("lost", 200ms, "HELLO"), refit::error);
  REQUIRE(req.resets() == 1);
  {
    rep_channel rep(ep);
    echo_server server(rep, 1);
    CHECK(req.request("again", 5s, "HELLO") == "re:again");
  }
  CHECK(req.resets() == 1);
  refit::channel::remove_private_endpoint(ep);
}

TEST_CASE("a receiver that stopped answering does not poison the next request", "[channel]") {
  const auto ep = refit::test::temp_endpoint();
  rep_channel rep(ep);
  req_channel req(ep);
  // The receiver takes the request but never replies in time.
  std::thread slow([&] {
    if (!rep.receive(5s)) return;        // (no Catch2 assertions off the main thread)
    std::this_thread::sleep_for(400ms);  // simulates a stuck peer: it replies after the deadline
    rep.reply("late");
  });
  CHECK_THROWS_AS(req.request("first", 200ms, "BEGIN 1"), refit::error);
  slow.join();
  echo_server server(rep, 1);
  CHECK(req.request("second", 5s, "BEGIN 2") == "re:second");
  refit::channel::remove_private_endpoint(ep);
}

TEST_CASE("send and receive split a request across several receivers", "[channel]") {
  rep_channel a("tcp://127.0.0.1:0");
  rep_channel b("tcp://127.0.0.1:0");
  req_channel ra(a.endpoint());
  req_channel rb(b.endpoint());
  echo_server sa(a, 1);
  echo_server sb(b, 1);
  ra.send("to a", 5s, "BATCH 0");
  rb.send("to b", 5s, "BATCH 0");
  CHECK(rb.receive(5s, "BATCH 0") == "re:to b");
  CHECK(ra.receive(5s, "BATCH 0") == "re:to a");
  // A receive without a reply times out and resets like request().
  req_channel lost(refit::test::temp_endpoint());
  lost.send("x", 100ms, "END 3");
  try {
    (void)lost.receive(100ms, "END 3");
    FAIL("receive returned without a receiver");
  } catch (const refit::error& e) {
    CHECK(e.code() == refit::errc::timeout);
    CHECK(std::string(e.what()).find("END 3") != std::string::npos);
  }
  CHECK(lost.resets() == 1);
  refit::channel::remove_private_endpoint(lost.endpoint());
}

TEST_CASE("receive returns nothing when no request comes", "[channel]") {
  rep_channel rep("tcp://127.0.0.1:0");
  const auto start = std::chrono::steady_clock::now();
  CHECK_FALSE(rep.receive(50ms).has_value());
  const auto elapsed = std::chrono::steady_clock::now() - start;
  CHECK(elapsed >= 40ms);
  CHECK(elapsed < 2s);
  CHECK_FALSE(rep.receive(0ms).has_value());
}

TEST_CASE("a reply to a vanished requester is dropped without an exception", "[channel]") {
  rep_channel rep("tcp://127.0.0.1:0");
  {
    req_channel req(rep.endpoint());
    CHECK_THROWS_AS(req.request("x", 300ms, "HELLO"), refit::error);
  }
  // The request may or may not have arrived before the requester went away.
  if (rep.receive(200ms)) CHECK_NOTHROW(rep.reply("nobody listens"));
  CHECK_NOTHROW(rep.reply("no request pending"));
}

TEST_CASE("binding an endpoint that is already bound fails with errc::io", "[channel]") {
  SECTION("tcp") {
    rep_channel first("tcp://127.0.0.1:0");
    try {
      rep_channel second(first.endpoint());
      FAIL("second bind succeeded");
    } catch (const refit::error& e) {
      CHECK(e.code() == refit::errc::io);
      CHECK(std::string(e.what()).find(first.endpoint()) != std::string::npos);
    }
  }
  SECTION("ipc") {
    const auto ep = refit::test::temp_endpoint();
    {
      rep_channel first(ep);
      try {
        rep_channel second(ep);
        FAIL("second bind succeeded");
      } catch (const refit::error& e) {
        CHECK(e.code() == refit::errc::io);
        CHECK(std::string(e.what()).find(ep) != std::string::npos);
      }
      // The first receiver still serves its endpoint.
      req_channel req(ep);
      echo_server server(first, 1);
      CHECK(req.request("still", 5s, "PING") == "re:still");
    }
    refit::channel::remove_private_endpoint(ep);
  }
}

TEST_CASE("bind_endpoint applies the loopback and private-directory defaults", "[channel]") {
  using refit::channel::bind_endpoint;
  CHECK(bind_endpoint("tcp://*:5555") == "tcp://127.0.0.1:5555");
  CHECK(bind_endpoint("tcp://:5555") == "tcp://127.0.0.1:5555");
  CHECK(bind_endpoint("tcp://5555") == "tcp://127.0.0.1:5555");
  CHECK(bind_endpoint("tcp://127.0.0.1:0") == "tcp://127.0.0.1:*");
  CHECK(bind_endpoint("tcp://*:0") == "tcp://127.0.0.1:*");
  CHECK(bind_endpoint("tcp://0") == "tcp://127.0.0.1:*");
  CHECK(bind_endpoint("tcp://10.1.2.3:7000") == "tcp://10.1.2.3:7000");
  CHECK(bind_endpoint("tcp://0.0.0.0:7000") == "tcp://0.0.0.0:7000");
  CHECK(bind_endpoint("ipc:///tmp/some/where.sock") == "ipc:///tmp/some/where.sock");
  for (const char* bad : {"udp://1.2.3.4:5", "inproc://x", "/tmp/x.sock"}) {
    try {
      (void)bind_endpoint(bad);
      FAIL("accepted " << bad);
    } catch (const refit::error& e) {
      CHECK(e.code() == refit::errc::invalid_argument);
      CHECK(std::string(e.what()).find(bad) != std::string::npos);
    }
  }
  const auto ep = bind_endpoint("");
  CHECK(ep.starts_with("ipc://"));
  CHECK(ep.ends_with("/receiver.sock"));
  CHECK(std::filesystem::path(dir_of(ep)).filename().string().starts_with("refit-"));
  refit::channel::remove_private_endpoint(ep);
  CHECK_FALSE(std::filesystem::exists(dir_of(ep)));
}

TEST_CASE("a private endpoint lives in a fresh 0700 directory that remove_private_endpoint removes", "[channel]") {
  const auto a = refit::channel::make_private_endpoint("x");
  const auto b = refit::channel::make_private_endpoint("x");
  CHECK(a != b);
  CHECK(a.ends_with("/x.sock"));
  for (const auto& ep : {a, b}) {
    struct stat st {};
    REQUIRE(::stat(dir_of(ep).c_str(), &st) == 0);
    CHECK(S_ISDIR(st.st_mode));
    CHECK((st.st_mode & 0777) == 0700);
    CHECK(st.st_uid == ::getuid());
  }
  {
    // With a bound socket file inside.
    rep_channel rep(a);
    CHECK(std::filesystem::exists(a.substr(6)));
  }
  refit::channel::remove_private_endpoint(a);
  refit::channel::remove_private_endpoint(b);
  CHECK_FALSE(std::filesystem::exists(dir_of(a)));
  CHECK_FALSE(std::filesystem::exists(dir_of(b)));

  // Anything else is left alone.
  char tmpl[] = "/tmp/notrefit-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::string other = std::string("ipc://") + tmpl + "/x.sock";
  { rep_channel rep(other); }
  refit::channel::remove_private_endpoint(other);
  CHECK(std::filesystem::exists(tmpl));
  std::filesystem::remove_all(tmpl);
  CHECK_NOTHROW(refit::channel::remove_private_endpoint("tcp://127.0.0.1:1"));
  CHECK_NOTHROW(refit::channel::remove_private_endpoint("ipc://"));
  CHECK_NOTHROW(refit::channel::remove_private_endpoint("garbage"));
}

TEST_CASE("a receiver on the default endpoint removes its private directory", "[channel]") {
  std::string dir;
  {
    rep_channel rep("");
    CHECK(rep.endpoint().starts_with("ipc://"));
    dir = dir_of(rep.endpoint());
    CHECK(std::filesystem::exists(dir));
    rep_channel moved(std::move(rep));
    CHECK(std::filesystem::exists(dir));
  }
  CHECK_FALSE(std::filesystem::exists(dir));
}

TEST_CASE("a forked child uses the channel after its parent did", "[channel]") {
  const auto ep = refit::test::temp_endpoint();
  {
    rep_channel rep(ep);
    {
      req_channel req(ep);
      echo_server server(rep, 1);
      REQUIRE(req.request("parent", 5s, "PING") == "re:parent");
    }
    refit::test::child c([&] {
      req_channel req(ep);
      if (req.request("child", 5s, "PING") != "re:child") throw std::runtime_error("wrong reply");
      rep_channel own("tcp://127.0.0.1:0");
      req_channel self(own.endpoint());
      std::thread t([&] {
        if (auto got = own.receive(5s)) own.reply(*got);
      });
      const auto r = self.request("loop", 5s, "PING");
      t.join();
      if (r != "loop") throw std::runtime_error("wrong loop reply");
    });
    auto got = rep.receive(10s);
    REQUIRE(got);
    CHECK(*got == "child");
    rep.reply("re:" + *got);
    CHECK(c.wait(30s) == 0);
  }
  refit::channel::remove_private_endpoint(ep);
}

// ------------------------------------------------------------------------------------ support

TEST_CASE("pattern bytes are deterministic, not zero, and differ per version and name", "[support]") {
  using refit::test::fill_pattern;
  using refit::test::pattern_byte;
  std::vector<std::uint8_t> a(1003), b(1003), c(1003), d(1003);
  fill_pattern("w", 1, a.data(), a.size());
  fill_pattern("w", 1, b.data(), b.size());
  fill_pattern("w", 2, c.data(), c.size());
  fill_pattern("v", 1, d.data(), d.size());
  CHECK(a == b);
  CHECK(a != c);
  CHECK(a != d);
  std::size_t zeros = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    REQUIRE(a[i] == pattern_byte("w", 1, i));
    zeros += a[i] == 0;
  }
  CHECK(zeros < 20);
}

TEST_CASE("mixed_model is deterministic and covers every dtype, zero-size and oversize tensors", "[support]") {
  const auto m = refit::test::mixed_model(100, 1 << 20, 7);
  CHECK(m == refit::test::mixed_model(100, 1 << 20, 7));
  CHECK(m != refit::test::mixed_model(100, 1 << 20, 8));
  REQUIRE(m.size() == 101);
  CHECK(m[50].name == "oversize.weight");
  CHECK(m[50].nbytes() == (1u << 20));
  std::set<refit::dtype> types;
  std::set<std::string> names;
  std::size_t empty = 0;
  for (const auto& t : m) {
    types.insert(t.type);
    names.insert(t.name);
    if (t.name != "oversize.weight") CHECK(t.nbytes() <= 64u << 10);
    CHECK(t.shape.size() <= 4);
    empty += t.nbytes() == 0;
  }
  CHECK(types.size() == 15);
  CHECK(names.size() == m.size());
  CHECK(empty >= 4);
  CHECK(refit::test::mixed_model(10, 0).size() == 10);
}

TEST_CASE("child reports a normal return, an exception and a kill", "[support]") {
  refit::test::child ok([] {});
  CHECK(ok.wait(10s) == 0);
  refit::test::child threw([] { throw std::runtime_error("expected in a test"); });
  CHECK(threw.wait(10s) == 1);
  refit::test::child odd([] { throw 42; });
  CHECK(odd.wait(10s) == 2);
  refit::test::signal_pipe never;
  refit::test::child stuck([&] { (void)never.receive(60s); });
  stuck.kill();
  CHECK(stuck.wait(10s) == -9);
  refit::test::child slow([&] { (void)never.receive(60s); });
  CHECK_THROWS_AS(slow.wait(100ms), std::runtime_error);
}

TEST_CASE("signal_pipe carries lines both ways and times out", "[support]") {
  refit::test::signal_pipe to_child;
  refit::test::signal_pipe to_parent;
  refit::test::child c([&] {
    const auto line = to_child.receive(10s);
    to_parent.send("echo " + line);
  });
  to_child.send("hello there");
  CHECK(to_parent.receive(10s) == "echo hello there");
  CHECK(c.wait(10s) == 0);
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(to_parent.receive(50ms), std::runtime_error);
  CHECK(std::chrono::steady_clock::now() - start < 2s);
}

TEST_CASE("cuda_device_count answers without failing", "[support]") {
  const int n = refit::test::cuda_device_count();
  CHECK(n >= 0);
  CHECK(refit::test::cuda_device_count() == n);
}
