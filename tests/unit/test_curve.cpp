// ZeroMQ CURVE on tcp endpoints: a receiver with a key pair, streamers that know (or do not know)
// its public key. Skipped with a warning when libzmq was built without CURVE.
#include <zmq.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "support/support.hpp"

using namespace std::chrono_literals;
namespace rt = refit::test;

namespace {

using rt::host_tensors;

using clock_type = std::chrono::steady_clock;

constexpr refit::milliseconds streamer_timeout{1500};
// What a deadline may overrun by on a loaded 2-core machine.
constexpr refit::milliseconds slack{1500};

refit::milliseconds since(clock_type::time_point start) {
  return std::chrono::duration_cast<refit::milliseconds>(clock_type::now() - start);
}

bool have_curve() {
  if (zmq_has("curve") != 0) return true;
  WARN("libzmq was built without CURVE (zmq_has(\"curve\") is false): CURVE tests skipped");
  return false;
}

struct key_pair {
  std::string public_key;
  std::string secret_key;
};

key_pair make_key_pair() {
  char pub[41] = {};
  char sec[41] = {};
  if (zmq_curve_keypair(pub, sec) != 0) throw std::runtime_error("zmq_curve_keypair failed");
  return {pub, sec};
}

/// Client keys: the streamer's own pair and the receiver's public key.
refit::curve_keys client_keys(const key_pair& mine, const std::string& server_public) {
  return refit::curve_keys{mine.public_key, mine.secret_key, server_public, {}};
}

refit::streamer_options stream_options(const std::string& endpoint, refit::curve_keys curve,
                                       const std::string& token = {}) {
  refit::streamer_options o = rt::host_shm_streamer(endpoint, 256 << 10, streamer_timeout);
  o.token = token;
  o.curve = std::move(curve);
  return o;
}

std::optional<std::string> failure_code(const std::function<void()>& f) {
  try {
    f();
  } catch (const refit::error& e) {
    return std::string(refit::to_string(e.code()));
  }
  return std::nullopt;
}

// A CURVE receiver with a parameter table in a forked child, on tcp://127.0.0.1 with a port of
// the system's choice. Reports "ready <endpoint>", then "<event> <committed version> <check>" for
// every commit, abort and refusal; serves until the parent calls stop().
class curve_receiver {
 public:
  curve_receiver(std::vector<refit::tensor_meta> metas, key_pair keys, std::string token = {},
                 std::vector<std::string> allowed = {}, std::string bind = "tcp://127.0.0.1:0")
      : metas_(std::move(metas)),
        keys_(std::move(keys)),
        token_(std::move(token)),
        allowed_(std::move(allowed)),
        bind_(std::move(bind)),
        proc_([this] { run(); }) {
    const std::string ready = from_child_.receive(20s);
    if (!ready.starts_with("ready ")) throw std::runtime_error("curve receiver: " + ready);
    endpoint_ = ready.substr(6);
  }

  [[nodiscard]] const std::string& endpoint() const noexcept { return endpoint_; }
  std::string next_report() { return from_child_.receive(20s); }
  /// The next report within `wait`, or nullopt.
  std::optional<std::string> report_within(std::chrono::milliseconds wait) {
    try {
      return from_child_.receive(wait);
    } catch (const std::runtime_error&) {
      return std::nullopt;
    }
  }
  int stop() {
    to_child_.send("stop");
    return proc_.wait(20s);
  }

 private:
  void run() {
    refit::receiver_options o;
    o.endpoint = bind_;
    o.idle_timeout = refit::milliseconds{1500};
    o.token = token_;
    o.curve = refit::curve_keys{keys_.public_key, keys_.secret_key, {}, allowed_};
    refit::receiver r(o);
    std::vector<std::vector<std::uint8_t>> data;
    for (const auto& m : metas_) {
      auto& d = data.emplace_back(std::max<std::uint64_t>(m.nbytes(), 1), std::uint8_t{0});
      r.add_parameter(refit::tensor_dest{m, d.data(), refit::device::cpu()});
    }
    const auto check = [&](std::uint64_t version) -> std::string {
      for (std::size_t i = 0; i < metas_.size(); ++i) {
        std::vector<std::uint8_t> want(metas_[i].nbytes());
        rt::fill_pattern(metas_[i].name, version, want.data(), want.size());
        if (!std::equal(want.begin(), want.end(), data[i].begin()))
          return refit::describe(metas_[i]) + " differs from version " + std::to_string(version);
      }
      return "ok";
    };
    from_child_.send("ready " + r.endpoint());
    const auto start = clock_type::now();
    for (;;) {
      if (since(start) > 120s) throw std::runtime_error("curve receiver: still running after 120 s");
      const auto e = r.serve_one(50ms);
      if (e == refit::receiver_event::committed || e == refit::receiver_event::aborted ||
          e == refit::receiver_event::refused) {
        const auto v = r.committed_version();
        std::string line = std::string(refit::to_string(e)) + " " + (v ? std::to_string(*v) : "none");
        if (e == refit::receiver_event::committed) line += " " + check(*v);
        from_child_.send(line);
      }
      try {
        if (to_child_.receive(0ms) == "stop") return;
      } catch (const std::runtime_error&) {
        // nothing from the parent yet
      }
    }
  }

  std::vector<refit::tensor_meta> metas_;
  key_pair keys_;
  std::string token_;
  std::vector<std::string> allowed_;
  std::string bind_;
  std::string endpoint_;
  rt::signal_pipe to_child_;
  rt::signal_pipe from_child_;
  rt::child proc_;  // last: forks once the rest exists
};

}  // namespace

TEST_CASE("a CURVE receiver on tcp and a streamer that holds its public key refit bit-exactly", "[curve]") {
  if (!have_curve()) return;
  const auto metas = rt::mixed_model(40, 600 << 10);
  const key_pair server = make_key_pair();
  const key_pair client = make_key_pair();
  curve_receiver rx(metas, server);
  REQUIRE(rx.endpoint().starts_with("tcp://127.0.0.1:"));

  refit::streamer s(stream_options(rx.endpoint(), client_keys(client, server.public_key)));
  const host_tensors v1(metas, 1);
  const auto stats = s.refit(1, v1.refs);
  CHECK(stats.version == 1);
  CHECK(stats.tensors == metas.size());
  CHECK(rx.next_report() == "committed 1 ok");
  const host_tensors v2(metas, 2);
  CHECK(s.refit(2, v2.refs).version == 2);
  CHECK(rx.next_report() == "committed 2 ok");

  s.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE(
    "a streamer with the wrong CURVE server key, or none, fails with errc::timeout in time and the receiver "
    "goes on to commit the right streamer's refit",
    "[curve]") {
  if (!have_curve()) return;
  const auto metas = rt::mixed_model(30, 0);
  const key_pair server = make_key_pair();
  const key_pair client = make_key_pair();
  const key_pair impostor = make_key_pair();  // its public key is not the receiver's
  curve_receiver rx(metas, server);
  const host_tensors v1(metas, 1);

  SECTION("wrong server key") {
    refit::streamer wrong(stream_options(rx.endpoint(), client_keys(client, impostor.public_key)));
    const auto start = clock_type::now();
    const auto code = failure_code([&] { wrong.refit(1, v1.refs); });
    const auto elapsed = since(start);
    REQUIRE(code);
    CHECK(*code == std::string(refit::to_string(refit::errc::timeout)));
    CHECK(elapsed < streamer_timeout + slack);
  }
  SECTION("no CURVE on the streamer") {
    refit::streamer plain(stream_options(rx.endpoint(), {}));
    const auto start = clock_type::now();
    const auto code = failure_code([&] { plain.refit(1, v1.refs); });
    const auto elapsed = since(start);
    REQUIRE(code);
    CHECK(*code == std::string(refit::to_string(refit::errc::timeout)));
    CHECK(elapsed < streamer_timeout + slack);
  }
  // The handshake failed below the REP socket: the receiver saw no message at all.
  CHECK_FALSE(rx.report_within(0ms));

  refit::streamer right(stream_options(rx.endpoint(), client_keys(client, server.public_key)));
  CHECK(right.refit(1, v1.refs).version == 1);
  CHECK(rx.next_report() == "committed 1 ok");
  right.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE(
    "under CURVE a stranger that knows the receiver's public key but not the session token is refused with "
    "errc::unauthorized",
    "[curve]") {
  // CURVE here authenticates the receiver to the streamer and encrypts; with no ZAP handler any
  // client key pair completes the handshake, so the token is what keeps strangers out.
  if (!have_curve()) return;
  const auto metas = rt::mixed_model(20, 0);
  const key_pair server = make_key_pair();
  const key_pair client = make_key_pair();
  const key_pair stranger_keys = make_key_pair();
  curve_receiver rx(metas, server, "curve-token-51c2");

  refit::streamer legit(stream_options(rx.endpoint(), client_keys(client, server.public_key), "curve-token-51c2"));
  const host_tensors v1(metas, 1);
  CHECK(legit.refit(1, v1.refs).version == 1);
  CHECK(rx.next_report() == "committed 1 ok");

  {
    refit::streamer stranger(
        stream_options(rx.endpoint(), client_keys(stranger_keys, server.public_key), "guessed-token"));
    const host_tensors v2(metas, 2);
    const auto code = failure_code([&] { stranger.refit(2, v2.refs); });
    REQUIRE(code);
    CHECK(*code == std::string(refit::to_string(refit::errc::unauthorized)));
  }
  CHECK(rx.next_report() == "refused 1");

  const host_tensors v3(metas, 3);
  CHECK(legit.refit(3, v3.refs).version == 3);
  CHECK(rx.next_report() == "committed 3 ok");
  legit.close();
  CHECK(rx.stop() == 0);
}

TEST_CASE("incomplete or mismatched CURVE keys are refused when the streamer or receiver is built", "[curve]") {
  if (!have_curve()) return;
  const key_pair server = make_key_pair();
  const key_pair client = make_key_pair();
  const auto code_and_message = [](const std::function<void()>& make) -> std::pair<refit::errc, std::string> {
    try {
      make();
    } catch (const refit::error& e) {
      return {e.code(), e.what()};
    }
    return {refit::errc::internal, "nothing was thrown"};
  };
  const auto receiver_with = [&](refit::curve_keys keys) {
    return [keys] {
      refit::receiver_options o;
      o.endpoint = "tcp://127.0.0.1:0";
      o.curve = keys;
      refit::receiver r(o);
    };
  };
  const auto streamer_with = [&](refit::curve_keys keys) {
    return [keys] {
      refit::streamer_options o;
      o.endpoint = "tcp://127.0.0.1:1";
      o.curve = keys;
      refit::streamer s(o);
    };
  };
  SECTION("a receiver with a public key but no secret key") {
    const auto [code, message] = code_and_message(receiver_with({server.public_key, "", "", {}}));
    CHECK(code == refit::errc::invalid_argument);
    CHECK_THAT(message, Catch::Contains("no secret_key"));
  }
  SECTION("a receiver whose public key is not its secret key's") {
    const auto [code, message] = code_and_message(receiver_with({client.public_key, server.secret_key, "", {}}));
    CHECK(code == refit::errc::invalid_argument);
    CHECK_THAT(message, Catch::Contains("does not belong to its secret_key"));
  }
  SECTION("a receiver with a malformed secret key") {
    const auto [code, message] = code_and_message(receiver_with({"", "not-a-key", "", {}}));
    CHECK(code == refit::errc::invalid_argument);
    CHECK_THAT(message, Catch::Contains("receiver_options.curve.secret_key is not a CURVE key"));
  }
  SECTION("a streamer with its own pair but no server key") {
    const auto [code, message] = code_and_message(streamer_with({client.public_key, client.secret_key, "", {}}));
    CHECK(code == refit::errc::invalid_argument);
    CHECK_THAT(message, Catch::Contains("streamer_options.curve.server_key is empty"));
  }
  SECTION("a streamer with a server key but no pair of its own") {
    const auto [code, message] = code_and_message(streamer_with({"", "", server.public_key, {}}));
    CHECK(code == refit::errc::invalid_argument);
    CHECK_THAT(message, Catch::Contains("streamer_options.curve.public_key is empty"));
  }
}

TEST_CASE("a CURVE receiver with allowed client keys refuses any other streamer key and commits a listed one",
          "[curve]") {
  if (!have_curve()) return;
  // On a numeric address refit's own ZMTP server checks the key in INITIATE; bound by interface name
  // ("lo", which that server does not bind: zmtp::server::handles) libzmq's ROUTER and its ZAP handler do.
  const std::string bind = GENERATE(std::string("tcp://127.0.0.1:0"), std::string("tcp://lo:0"));
  INFO("bound to " << bind);
  const auto metas = rt::mixed_model(30, 0);
  const key_pair server = make_key_pair();
  const key_pair listed = make_key_pair();
  const key_pair stranger = make_key_pair();  // knows the server key, but is not on the list
  curve_receiver rx(metas, server, {}, {listed.public_key}, bind);
  REQUIRE(rx.endpoint().starts_with("tcp://127.0.0.1:"));
  const host_tensors v1(metas, 1);

  refit::streamer refused(stream_options(rx.endpoint(), client_keys(stranger, server.public_key)));
  const auto start = clock_type::now();
  const auto code = failure_code([&] { refused.refit(1, v1.refs); });
  REQUIRE(code);
  CHECK(*code == std::string(refit::to_string(refit::errc::timeout)));
  CHECK(since(start) < streamer_timeout + slack);
  CHECK_FALSE(rx.report_within(0ms));  // refused in the handshake: no message reached the receiver

  refit::streamer allowed(stream_options(rx.endpoint(), client_keys(listed, server.public_key)));
  CHECK(allowed.refit(1, v1.refs).version == 1);
  CHECK(rx.next_report() == "committed 1 ok");
  allowed.close();
  CHECK(rx.stop() == 0);
}
