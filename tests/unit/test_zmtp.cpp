// The receiver's ZMTP server (lib/channel/zmtp.hpp): its decoder on bytes alone, then a rep_channel
// served on this thread against raw connections that send what a REQ never does. Each case checks
// what was dropped or closed (and counted), and that a legitimate request is answered afterwards.
#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <sodium.h>
#include <zmq.h>

#include "channel/channel.hpp"
#include "channel/zmtp.hpp"
#include "support/support.hpp"
#include "support/curve_client.hpp"
#include "support/zmtp_peer.hpp"

using namespace std::chrono_literals;
namespace zmtp = refit::channel::zmtp;
using refit::channel::rep_channel;
using refit::channel::req_channel;
using refit::test::zmtp_frame;
using refit::test::zmtp_frame_header;
using refit::test::zmtp_greeting;
using refit::test::zmtp_peer;

namespace {

std::string ready_of(std::string_view socket_type) {
  std::string props = std::string(1, '\x0b') + "Socket-Type";
  for (int i = 3; i >= 0; --i) props.push_back(static_cast<char>((socket_type.size() >> (8 * i)) & 0xff));
  props.append(socket_type);
  return zmtp::command("READY", props);
}

/// Feeds `bytes` one byte at a time (the hardest split) and records each event.
struct fed {
  std::vector<zmtp::event> events;
  std::vector<std::string> bodies;
  std::vector<std::uint64_t> dropped_frames;
  std::string reason;
};
fed feed_bytewise(zmtp::decoder& d, std::string_view bytes) {
  fed out;
  for (char c : bytes) {
    const auto b = static_cast<std::uint8_t>(c);
    const auto r = d.feed({&b, 1});
    if (r.what == zmtp::event::none) continue;
    out.events.push_back(r.what);
    if (r.what == zmtp::event::request) out.bodies.push_back(d.take_body());
    if (r.what == zmtp::event::dropped) out.dropped_frames.push_back(d.dropped_frames());
    if (r.what == zmtp::event::error) {
      out.reason = d.reason();
      break;
    }
  }
  return out;
}

const std::string handshake = zmtp_greeting() + ready_of("REQ");

/// Short intervals, so that stalls are noticed in a test's time.
zmtp::options quick() {
  zmtp::options o;
  o.handshake = 500ms;
  o.heartbeat_ivl = 100ms;
  o.heartbeat_timeout = 500ms;
  return o;
}

/// Serves `rep` on this thread until `done` holds; false when it did not within `wait`.
bool serve_until(rep_channel& rep, const std::function<bool()>& done, std::chrono::milliseconds wait = 10s) {
  const auto until = std::chrono::steady_clock::now() + wait;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    if (auto got = rep.receive(10ms)) rep.reply("re:" + *got);
  }
  return true;
}

/// A legitimate request from a libzmq REQ is answered (served on this thread).
void legitimate_request_answered(rep_channel& rep) {
  req_channel req(rep.endpoint());
  req.send("HELLO", 10s, "HELLO");
  std::optional<std::string> got;  // taken here, not by serve_until() (which would answer it itself)
  for (int i = 0; i < 100 && !got; ++i) got = rep.receive(100ms);
  REQUIRE(got);
  CHECK(*got == "HELLO");
  rep.reply("re:HELLO");
  CHECK(req.receive(10s, "HELLO") == "re:HELLO");
}

}  // namespace

// ============================================================================ the decoder

TEST_CASE("the ZMTP decoder takes a REQ's request after the handshake, split anywhere", "[channel][zmtp]") {
  zmtp::decoder d(1 << 20);
  const std::string request = zmtp_frame("", true) + zmtp_frame("hello", false);
  const std::string big(300, 'b');  // a long frame
  const auto f = feed_bytewise(d, handshake + request + zmtp_frame("", true) + zmtp_frame(big, false));
  REQUIRE(f.events == std::vector{zmtp::event::ready, zmtp::event::request, zmtp::event::request});
  CHECK(d.socket_type() == "REQ");
  CHECK(d.heartbeats());
  CHECK(f.bodies == std::vector<std::string>{"hello", big});
  CHECK_FALSE(d.mid_message());
  CHECK(d.held_bytes() == 0);
}

TEST_CASE("the ZMTP decoder drops whole every message that is not a REQ's request", "[channel][zmtp]") {
  zmtp::decoder d(1 << 20);
  std::string many;
  for (int i = 0; i < 10000; ++i) many += zmtp_frame("f", i + 1 < 10000);
  const auto f = feed_bytewise(d, handshake + zmtp_frame("", true) + zmtp_frame("a", true) + zmtp_frame("b", false) +
                                      zmtp_frame("x", true) + zmtp_frame("body", false) + zmtp_frame("body", false) +
                                      zmtp_frame("", false) + many + zmtp_frame("", true) + zmtp_frame("ok", false));
  using zmtp::event;
  CHECK(f.events == std::vector{event::ready, event::dropped, event::dropped, event::dropped, event::dropped,
                                event::dropped, event::request});
  // Three frames, a non-empty delimiter, one body frame alone, an empty frame alone, 10,000 frames.
  CHECK(f.dropped_frames == std::vector<std::uint64_t>{3, 2, 1, 1, 10000});
  CHECK(f.bodies == std::vector<std::string>{"ok"});
}

TEST_CASE("the ZMTP decoder keeps a body only as it arrives and none of a message it drops", "[channel][zmtp]") {
  zmtp::decoder d(std::uint64_t{64} << 20);
  REQUIRE(feed_bytewise(d, handshake).events == std::vector{zmtp::event::ready});
  // A 64 MiB body announced, 1000 bytes sent: about that much is held, not 64 MiB.
  const std::string head = zmtp_frame("", true) + zmtp_frame_header(std::uint64_t{64} << 20, false);
  const std::string part(1000, 'p');
  const auto r = d.feed({reinterpret_cast<const std::uint8_t*>((head + part).data()), head.size() + part.size()});
  CHECK(r.what == zmtp::event::none);
  CHECK(d.mid_message());
  CHECK(d.held_bytes() <= (std::size_t{1} << 20));
  // A 32 MiB frame flagged MORE where the delimiter belongs: skipped, nothing held.
  zmtp::decoder e(std::uint64_t{64} << 20);
  REQUIRE(feed_bytewise(e, handshake).events == std::vector{zmtp::event::ready});
  const std::string skip = zmtp_frame_header(std::uint64_t{32} << 20, true) + std::string(1 << 20, 's');
  CHECK(e.feed({reinterpret_cast<const std::uint8_t*>(skip.data()), skip.size()}).what == zmtp::event::none);
  CHECK(e.held_bytes() == 0);
}

TEST_CASE("the ZMTP decoder refuses bad greetings, wrong socket types and commands a REQ never sends",
          "[channel][zmtp]") {
  const auto reason_of = [](const std::string& bytes) {
    zmtp::decoder d(1 << 20);
    const auto f = feed_bytewise(d, bytes);
    return f.events.empty() || f.events.back() != zmtp::event::error ? std::string("(no error)") : f.reason;
  };
  CHECK_THAT(reason_of(std::string("\x01\x00\x02\x01\x41", 5)), Catch::Contains("not ZMTP 3 (ZMTP/1.0"));
  CHECK_THAT(reason_of(zmtp_greeting(1, 0).substr(0, 11)), Catch::Contains("ZMTP/2.0"));
  CHECK_THAT(reason_of(zmtp_greeting(3, 0, "CURVE")), Catch::Contains("mechanism 'CURVE'"));
  CHECK_THAT(reason_of(zmtp_greeting() + ready_of("PUB")), Catch::Contains("Socket-Type is 'PUB'"));
  CHECK_THAT(reason_of(zmtp_greeting() + zmtp::command("READY", "")), Catch::Contains("without a Socket-Type"));
  CHECK_THAT(reason_of(zmtp_greeting() + zmtp::command("READY", "\x0bSocket-Type\x00\x00\x00\x09REQ")),
             Catch::Contains("metadata is malformed"));
  CHECK_THAT(reason_of(zmtp_greeting() + zmtp_frame("", true)), Catch::Contains("before the handshake ended"));
  CHECK_THAT(reason_of(handshake + zmtp::command("SUBSCRIBE", "topic")), Catch::Contains("'SUBSCRIBE'"));
  CHECK_THAT(reason_of(handshake + std::string("\x05\x01x", 3)), Catch::Contains("flagged MORE"));
  CHECK_THAT(reason_of(handshake + std::string("\x08\x01x", 3)), Catch::Contains("reserved flag bits"));
  CHECK_THAT(reason_of(handshake + zmtp_frame_header((1 << 20) + 1, true)), Catch::Contains("over the limit"));
  CHECK_THAT(reason_of(handshake + zmtp::command("ERROR",
                                                 "\x03"
                                                 "bad")),
             Catch::Contains("ERROR 'bad'"));
  // A ZMTP 3.0 peer is taken (without heartbeats).
  zmtp::decoder d(1 << 20);
  CHECK(feed_bytewise(d, zmtp_greeting(3, 0) + ready_of("DEALER")).events == std::vector{zmtp::event::ready});
  CHECK_FALSE(d.heartbeats());
}

TEST_CASE("the ZMTP decoder answers a PING with its context", "[channel][zmtp]") {
  zmtp::decoder d(1 << 20);
  const auto f = feed_bytewise(d, handshake + zmtp::command("PING", std::string("\x00\x0a", 2) + "ctx"));
  REQUIRE(f.events == std::vector{zmtp::event::ready, zmtp::event::ping});
  CHECK(d.ping_context() == "ctx");
}

// ============================================================================ the server

TEST_CASE("the ZMTP server answers a raw peer's request with the delimiter and the body", "[channel][zmtp][hostile]") {
  rep_channel rep("tcp://127.0.0.1:0", quick());
  zmtp_peer p(rep.endpoint());
  REQUIRE(p.handshake());
  REQUIRE(p.send(zmtp_frame("", true) + zmtp_frame("hi", false)));
  const std::string expected =
      zmtp::greeting() + zmtp::ready_frame("ROUTER") + zmtp_frame("", true) + zmtp_frame("re:hi", false);
  CHECK(serve_until(rep, [&] {
    (void)p.hung_up();
    return p.received().size() >= expected.size();
  }));
  CHECK(p.received().substr(0, expected.size()) == expected);
  CHECK(rep.dropped() == 0);
  CHECK(rep.closed() == 0);
}

TEST_CASE("messages that are not a REQ's request are dropped, counted, and the connection serves on",
          "[channel][zmtp][hostile]") {
  rep_channel rep("tcp://127.0.0.1:0", quick());
  zmtp_peer p(rep.endpoint());
  REQUIRE(p.handshake("DEALER"));
  std::string many;
  for (int i = 0; i < 10000; ++i) many += zmtp_frame("f", i + 1 < 10000);
  REQUIRE(p.send(zmtp_frame("", true) + zmtp_frame("a", true) + zmtp_frame("b", false)));  // 3 frames
  REQUIRE(p.send(zmtp_frame("x", true) + zmtp_frame("body", false)));                      // delimiter not empty
  REQUIRE(p.send(zmtp_frame("body", false)));                                              // 1 frame
  REQUIRE(p.send(many));                                                                   // one drop, not 9,999
  CHECK(serve_until(rep, [&] { return rep.dropped() == 4; }));
  // The same connection's next request is answered (its first answer).
  REQUIRE(p.send(zmtp_frame("", true) + zmtp_frame("next", false)));
  const std::string reply = zmtp_frame("", true) + zmtp_frame("re:next", false);
  CHECK(serve_until(rep, [&] {
    (void)p.hung_up();
    return p.received().ends_with(reply);
  }));
  CHECK(rep.dropped() == 4);
  CHECK(rep.closed() == 0);
  legitimate_request_answered(rep);
}

TEST_CASE("a peer that breaks the ZMTP protocol is closed, counted, and the next request is answered",
          "[channel][zmtp][hostile]") {
  const std::string cut_frame = handshake + zmtp_frame("", true) + zmtp_frame_header(100, false) + "ten bytes.";
  struct attack {
    const char* what;
    std::string bytes;
    bool hang_up;  ///< the peer closes its end after sending
  };
  const std::vector<attack> attacks = {
      {"a command frame a REQ never sends", handshake + zmtp::command("SUBSCRIBE", "x"), false},
      {"a bad greeting (mechanism CURVE)", zmtp_greeting(3, 1, "CURVE"), false},
      {"the wrong Socket-Type (PUB)", zmtp_greeting() + ready_of("PUB"), false},
      {"a ZMTP/1.0 greeting", std::string("\x01\x00\x02\x01\x41\x02\x00\x42", 8), false},
      {"a ZMTP/2.0 greeting", zmtp_greeting(1, 0).substr(0, 12) + std::string("\x05\x00", 2), false},
      {"an over-size frame", handshake + zmtp_frame_header((std::uint64_t{64} << 20) + 1, true), false},
      {"a hang-up mid-greeting", zmtp_greeting().substr(0, 20), true},
      {"a hang-up mid-frame", cut_frame, true},
      {"a stall mid-frame (heartbeat timeout)", cut_frame, false},
      {"a stall mid-greeting (handshake timeout)", zmtp_greeting().substr(0, 20), false},
  };
  for (const auto& a : attacks) {
    INFO(a.what);
    rep_channel rep("tcp://127.0.0.1:0", quick());
    {
      zmtp_peer p(rep.endpoint());
      REQUIRE(p.send(a.bytes));
      if (a.hang_up) p.close();
      CHECK(serve_until(rep, [&] { return rep.closed() == 1; }));
      if (!a.hang_up) CHECK(serve_until(rep, [&] { return p.hung_up(); }));
    }
    CHECK(rep.dropped() == 0);
    legitimate_request_answered(rep);
    CHECK(rep.closed() == 1);
  }
}

TEST_CASE("an idle streamer is kept alive by heartbeats while a stalled peer is dropped", "[channel][zmtp][hostile]") {
  rep_channel rep("tcp://127.0.0.1:0", quick());
  req_channel req(rep.endpoint());
  req.send("first", 10s, "HELLO");
  std::optional<std::string> got;
  REQUIRE(serve_until(rep, [&] { return (got = got ? got : rep.receive(10ms)).has_value(); }));
  rep.reply("re:first");
  REQUIRE(req.receive(10s, "HELLO") == "re:first");
  // Five heartbeat timeouts of silence from the REQ (it answers the PINGs) and a raw peer stalled
  // after its handshake with a message begun: only the raw one goes.
  zmtp_peer stalled(rep.endpoint());
  REQUIRE(stalled.handshake());
  REQUIRE(stalled.send(zmtp_frame("", true)));
  const auto until = std::chrono::steady_clock::now() + 2500ms;
  REQUIRE(serve_until(rep, [&] { return std::chrono::steady_clock::now() >= until; }));
  CHECK(stalled.hung_up());
  CHECK(rep.closed() == 1);
  CHECK(rep.connections() == 1);
  req.send("second", 10s, "BEGIN");
  got.reset();
  REQUIRE(serve_until(rep, [&] { return (got = got ? got : rep.receive(10ms)).has_value(); }));
  CHECK(*got == "second");
  rep.reply("re:second");
  CHECK(req.receive(10s, "BEGIN") == "re:second");
}

TEST_CASE("connections over the limit are closed at once and counted", "[channel][zmtp][hostile]") {
  zmtp::options o = quick();
  o.max_connections = 2;
  rep_channel rep("tcp://127.0.0.1:0", o);
  zmtp_peer a(rep.endpoint()), b(rep.endpoint());
  REQUIRE(a.handshake());
  REQUIRE(b.handshake());
  REQUIRE(serve_until(rep, [&] { return rep.connections() == 2; }));
  zmtp_peer c(rep.endpoint());
  CHECK(serve_until(rep, [&] { return c.hung_up(); }));
  CHECK(rep.closed() == 1);
  a.close();
  REQUIRE(serve_until(rep, [&] { return rep.connections() == 1; }));
  legitimate_request_answered(rep);
  CHECK(rep.closed() == 1);  // a left at a message's boundary: not counted
}

TEST_CASE("the ZMTP server serves ipc endpoints and refuses a path another receiver serves", "[channel][zmtp]") {
  const refit::test::scoped_endpoint ep;
  rep_channel rep(ep.name, quick());
  CHECK(rep.endpoint() == ep.name);
  CHECK_REFIT_ERROR(rep_channel(ep.name, quick()), refit::errc::io, "another process is serving it already");
  legitimate_request_answered(rep);
}

// ============================================================================ CURVE

namespace {
struct z85_pair {
  std::string public_key, secret_key;
};
z85_pair curve_pair() {
  char pub[41] = {}, sec[41] = {};
  REQUIRE(zmq_curve_keypair(pub, sec) == 0);
  return {pub, sec};
}
}  // namespace

TEST_CASE("the ZMTP server speaks CURVE with a libzmq REQ: the handshake, a request and its reply, sealed",
          "[channel][zmtp][curve]") {
  const z85_pair server = curve_pair(), client = curve_pair();
  rep_channel rep("tcp://127.0.0.1:*", refit::curve_keys{server.public_key, server.secret_key, "", {}});
  req_channel req(rep.endpoint(), refit::curve_keys{client.public_key, client.secret_key, server.public_key, {}});
  for (const std::string& body : {std::string("HELLO"), std::string(3 << 20, 'b')}) {
    INFO("a request of " << body.size() << " bytes");
    req.send(body, 10s, "HELLO");
    std::optional<std::string> got;
    for (int i = 0; i < 100 && !got; ++i) got = rep.receive(100ms);
    REQUIRE(got);
    CHECK(*got == body);
    rep.reply("re:" + body.substr(0, 8));
    CHECK(req.receive(10s, "HELLO") == "re:" + body.substr(0, 8));
  }
}

TEST_CASE(
    "a libzmq CURVE REQ idle for many heartbeat intervals answers the server's sealed PINGs and keeps its connection",
    "[channel][zmtp][curve]") {
  // The PINGs are sealed commands: sealed as data, the first one ended the connection (libzmq's REQ
  // session refuses a data frame outside a reply), and the next request was never answered.
  const z85_pair server = curve_pair(), client = curve_pair();
  const zmtp::scoped_default_options quick_heartbeats(quick());
  rep_channel rep("tcp://127.0.0.1:*", refit::curve_keys{server.public_key, server.secret_key, "", {}});
  req_channel req(rep.endpoint(), refit::curve_keys{client.public_key, client.secret_key, server.public_key, {}});
  req.send("HELLO", 10s, "HELLO");
  std::optional<std::string> got;
  REQUIRE(serve_until(rep, [&] { return (got = got ? got : rep.receive(10ms)).has_value(); }));
  rep.reply("re:HELLO");
  REQUIRE(req.receive(10s, "HELLO") == "re:HELLO");
  // Served for five heartbeat timeouts (fifty PING intervals) while the REQ says nothing but PONG.
  const auto until = std::chrono::steady_clock::now() + 2500ms;
  REQUIRE(serve_until(rep, [&] { return std::chrono::steady_clock::now() >= until; }));
  CHECK(rep.connections() == 1);
  CHECK(rep.closed() == 0);
  req.send("BEGIN", 10s, "BEGIN");
  got.reset();
  REQUIRE(serve_until(rep, [&] { return (got = got ? got : rep.receive(10ms)).has_value(); }));
  CHECK(*got == "BEGIN");
  rep.reply("re:BEGIN");
  CHECK(req.receive(10s, "BEGIN") == "re:BEGIN");
  CHECK(req.resets() == 0);
}

namespace {

/// A CURVE server decoder (its keys, and `allowed` client keys) and a client that completed the
/// handshake with it, every step checked.
struct sealed_pair {
  std::shared_ptr<zmtp::curve_server_keys> keys = std::make_shared<zmtp::curve_server_keys>();
  std::unique_ptr<zmtp::decoder> dec;
  std::unique_ptr<refit::test::curve_client> client;

  explicit sealed_pair(bool handshake = true, std::uint64_t max_body = 1 << 20) {
    REQUIRE(sodium_init() >= 0);
    crypto_box_keypair(keys->public_key.data(), keys->secret_key.data());
    dec = std::make_unique<zmtp::decoder>(max_body, keys);
    client = std::make_unique<refit::test::curve_client>(keys->public_key);
    if (handshake) complete();
  }
  /// Feeds `bytes` at once; the event it stopped at (error: the reason in `why`).
  zmtp::event feed(std::string_view bytes, std::string* why = nullptr) {
    std::size_t at = 0;
    zmtp::event last = zmtp::event::none;
    while (at < bytes.size()) {
      const auto r = dec->feed({reinterpret_cast<const std::uint8_t*>(bytes.data()) + at, bytes.size() - at});
      at += r.consumed;
      if (r.what == zmtp::event::none) continue;
      last = r.what;
      if (r.what == zmtp::event::error) {
        if (why != nullptr) *why = dec->reason();
        break;
      }
      if (r.what == zmtp::event::request || r.what == zmtp::event::dropped) break;
    }
    return last;
  }
  void complete() {
    REQUIRE(feed(refit::test::curve_client::greeting() + client->hello()) == zmtp::event::none);
    REQUIRE(client->welcome(dec->take_output()));
    REQUIRE(feed(client->initiate()) == zmtp::event::ready);
    REQUIRE(client->ready(dec->take_output()));
  }
};

}  // namespace

TEST_CASE("the ZMTP decoder's CURVE handshake and sealed frames: a request opened, the reply sealed for the client",
          "[channel][zmtp][curve]") {
  sealed_pair p;
  CHECK(p.dec->socket_type() == "REQ");
  CHECK(p.dec->client_key().size() == 40);
  REQUIRE(p.feed(p.client->request("BEGIN 7")) == zmtp::event::request);
  CHECK(p.dec->take_body() == "BEGIN 7");
  // The reply's frames open with the client's keys, in order: the delimiter (MORE), then the body.
  const std::string delimiter = p.dec->seal(1, {});
  const std::string body = p.dec->seal(0, "OK");
  CHECK(p.client->open(delimiter) == std::pair<std::uint8_t, std::string>{1, ""});
  CHECK(p.client->open(body) == std::pair<std::uint8_t, std::string>{0, "OK"});
  // A PING sealed as a command (a MESSAGE's COMMAND bit, 0x02, as libzmq seals it) is answered: its
  // context comes out.
  REQUIRE(p.feed(p.client->seal(zmtp::sealed_command, zmtp::command_body("PING", std::string("\0\0ctx", 5)))) ==
          zmtp::event::ping);
  CHECK(p.dec->ping_context() == "ctx");
  // A message that is not a request is dropped whole, opened frame by frame.
  std::string two = p.client->seal(1, "x");  // sealed in the order sent: nonces rise
  two += p.client->seal(0, "y");
  REQUIRE(p.feed(two) == zmtp::event::dropped);
  CHECK(p.dec->dropped_frames() == 2);
  REQUIRE(p.feed(p.client->request("END")) == zmtp::event::request);
  CHECK(p.dec->take_body() == "END");
}

TEST_CASE("a sealed frame with the frame header's COMMAND bit (0x04) inside its box is refused as reserved bits",
          "[channel][zmtp][curve]") {
  // Inside a MESSAGE box the COMMAND bit is 0x02 (zmtp::sealed_command); 0x04 there is no flag libzmq
  // sends, and a server that took it for one would also send it, which libzmq reads as data.
  sealed_pair p;
  std::string why;
  REQUIRE(p.feed(p.client->seal(0x04, zmtp::command_body("PING", std::string("\0\0", 2))), &why) == zmtp::event::error);
  CHECK(why == "a CURVE MESSAGE with reserved flag bits set (0x04)");
}

TEST_CASE("the ZMTP decoder refuses a CURVE peer that breaks the handshake, with the reason",
          "[channel][zmtp][curve]") {
  std::string why;
  SECTION("a NULL greeting to a CURVE receiver") {
    sealed_pair p(false);
    CHECK(p.feed(zmtp_greeting()) == zmtp::event::error);
    CHECK(p.dec->reason() ==
          "its greeting names the mechanism 'NULL': this receiver speaks CURVE only (the streamer needs "
          "streamer_options.curve with the receiver's public key as server_key)");
  }
  SECTION("a HELLO for another server key") {
    sealed_pair p(false);
    std::array<std::uint8_t, 32> other_pub{}, other_sec{};
    crypto_box_keypair(other_pub.data(), other_sec.data());
    refit::test::curve_client stranger(other_pub);
    CHECK(p.feed(refit::test::curve_client::greeting() + stranger.hello(), &why) == zmtp::event::error);
    CHECK_THAT(why, Catch::StartsWith("its CURVE HELLO does not open with this receiver's key"));
  }
  SECTION("an INITIATE without the cookie WELCOME gave") {
    sealed_pair p(false);
    REQUIRE(p.feed(refit::test::curve_client::greeting() + p.client->hello()) == zmtp::event::none);
    std::string answer = p.dec->take_output();
    REQUIRE(p.client->welcome(answer));
    std::string initiate = p.client->initiate();
    initiate[2 + 9 + 40] ^= 0x01;  // a byte of the echoed cookie
    CHECK(p.feed(initiate, &why) == zmtp::event::error);
    CHECK(why == "its CURVE INITIATE does not carry the cookie this receiver's WELCOME gave");
  }
  SECTION("a client key not in allowed_clients") {
    sealed_pair p(false);
    p.keys->allowed.push_back({});  // only the all-zero key: not this client's
    REQUIRE(p.feed(refit::test::curve_client::greeting() + p.client->hello()) == zmtp::event::none);
    REQUIRE(p.client->welcome(p.dec->take_output()));
    CHECK(p.feed(p.client->initiate(), &why) == zmtp::event::error);
    CHECK_THAT(why, Catch::EndsWith("is not in receiver_options.curve.allowed_clients"));
    CHECK(p.dec->take_output().empty());  // no READY
  }
  SECTION("a PUB's INITIATE") {
    sealed_pair p(false);
    REQUIRE(p.feed(refit::test::curve_client::greeting() + p.client->hello()) == zmtp::event::none);
    REQUIRE(p.client->welcome(p.dec->take_output()));
    CHECK(p.feed(p.client->initiate("PUB"), &why) == zmtp::event::error);
    CHECK_THAT(why, Catch::StartsWith("its Socket-Type is 'PUB'"));
  }
}

TEST_CASE("after the CURVE handshake a forged, replayed or unsealed frame closes the connection, with the reason",
          "[channel][zmtp][curve][hostile]") {
  std::string why;
  sealed_pair p;
  SECTION("a MESSAGE with one byte changed") {
    std::string m = p.client->seal(0, "BATCH");
    m.back() ^= 0x20;
    CHECK(p.feed(m, &why) == zmtp::event::error);
    CHECK(why == "a CURVE MESSAGE that does not open with this connection's keys (forged or corrupted)");
  }
  SECTION("a MESSAGE sent again (its nonce reused)") {
    const std::string m = p.client->seal(1, {});
    REQUIRE(p.feed(m) == zmtp::event::none);
    CHECK(p.feed(m, &why) == zmtp::event::error);
    CHECK(why == "a CURVE MESSAGE whose nonce is not larger than the one before (replayed or reordered)");
  }
  SECTION("a plain frame flagged MORE") {
    CHECK(p.feed(zmtp_frame("", true), &why) == zmtp::event::error);
    CHECK(why == "a frame flagged MORE outside its CURVE box (libzmq seals every frame alone)");
  }
  SECTION("a plain command") {
    CHECK(p.feed(zmtp::command("PING", std::string("\0\0", 2)), &why) == zmtp::event::error);
    CHECK(why == "a command outside its CURVE box after the handshake");
  }
  SECTION("a MESSAGE larger than a body and its box") {
    CHECK(p.feed(zmtp_frame_header((1 << 20) + zmtp::curve_overhead + 1, false), &why) == zmtp::event::error);
    CHECK_THAT(why, Catch::StartsWith("a CURVE frame of 1048610 bytes"));
  }
}

TEST_CASE("a CURVE peer sending frames flagged MORE and never a last one holds at most the frame being opened",
          "[channel][zmtp][curve][hostile]") {
  sealed_pair p(true, std::uint64_t{8} << 20);
  const std::string chunk(std::size_t{4} << 20, 'm');
  for (int i = 0; i < 10; ++i) {
    const std::string frame = p.client->seal(1, i == 0 ? std::string_view() : chunk);
    // Half of it: the frame is held as it arrives, at most its size.
    const std::size_t half = frame.size() / 2;
    REQUIRE(p.feed(std::string_view(frame).substr(0, half)) == zmtp::event::none);
    CHECK(p.dec->held_bytes() <= frame.size() + 4096);
    REQUIRE(p.feed(std::string_view(frame).substr(half)) == zmtp::event::none);
    CHECK(p.dec->held_bytes() == 0);  // opened, skipped: nothing kept of a message that is not a request
  }
  CHECK(p.dec->mid_message());
  REQUIRE(p.feed(p.client->seal(0, "end")) == zmtp::event::dropped);
  CHECK(p.dec->dropped_frames() == 11);
  REQUIRE(p.feed(p.client->request("HELLO")) == zmtp::event::request);
  CHECK(p.dec->take_body() == "HELLO");
}
