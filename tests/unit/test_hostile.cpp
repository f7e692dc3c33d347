// Hostile peers against a receiver: what reaches its endpoint from outside the library — other
// connections speaking the wire format, malformed ZeroMQ envelopes, raw bytes over tcp — must
// neither end, hang nor take over the session of the streamer that opened it. Each case runs a
// receiver on a thread of this process and plays both the legitimate streamer and the stranger
// over ZeroMQ sockets of its own (cppzmq), one request at a time, so that every step is ordered by
// the replies and nothing waits on time.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <csignal>
#include <fstream>
#include <functional>
#include <mutex>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include <fcntl.h>
#include <fmt/format.h>
#include <sodium.h>
#include <sys/stat.h>

#include "channel/channel.hpp"
#include "channel/zmtp.hpp"
#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "support/support.hpp"
#include "support/curve_client.hpp"
#include "support/zmtp_peer.hpp"
#include "transport/transport.hpp"
#include "wire/wire.hpp"

using namespace std::chrono_literals;
namespace rt = refit::test;
namespace wire = refit::wire;

namespace {

constexpr std::uint64_t kib = 1ull << 10;
constexpr int reply_wait_ms = 20000;  // generous: sanitizer builds on two loaded cores
constexpr std::uint64_t max_version = std::numeric_limits<std::uint64_t>::max();

/// A receiver with a table of `model`, served on a thread until destruction.
class served_receiver {
 public:
  served_receiver(const std::string& endpoint, const std::vector<refit::tensor_meta>& model, std::string token = {},
                  const std::function<void(refit::receiver&)>& setup = {}, const refit::curve_keys& curve = {}) {
    refit::receiver_options o;
    o.endpoint = endpoint;
    o.token = std::move(token);
    o.idle_timeout = 60s;
    o.curve = curve;
    rx_ = std::make_unique<refit::receiver>(o);
    for (const auto& m : model) {
      weights_.emplace_back(m.nbytes(), std::uint8_t{0});
      refit::tensor_dest d;
      d.meta = m;
      d.data = weights_.back().data();
      d.dev = refit::device::cpu();
      rx_->add_parameter(d);
    }
    model_ = model;
    if (setup) setup(*rx_);
    thread_ = std::thread([this] { rx_->serve([this] { return stop_.load(); }, 5ms); });
  }
  ~served_receiver() {
    stop_ = true;
    thread_.join();
  }
  served_receiver(const served_receiver&) = delete;
  served_receiver& operator=(const served_receiver&) = delete;

  [[nodiscard]] std::string endpoint() const { return rx_->endpoint(); }
  [[nodiscard]] std::optional<std::uint64_t> committed() const { return rx_->committed_version(); }
  /// True while no byte of any weight was written (they start as zeros).
  [[nodiscard]] bool untouched() const {
    for (const auto& w : weights_)
      if (std::any_of(w.begin(), w.end(), [](std::uint8_t b) { return b != 0; })) return false;
    return true;
  }
  /// "" when every weight holds the pattern of `version`, else where it first differs.
  [[nodiscard]] std::string mismatch(std::uint64_t version) const {
    for (std::size_t i = 0; i < model_.size(); ++i) {
      const std::string m = rt::pattern_mismatch(model_[i], version, weights_[i].data());
      if (!m.empty()) return m;
    }
    return {};
  }

 private:
  std::unique_ptr<refit::receiver> rx_;
  std::vector<refit::tensor_meta> model_;
  std::vector<std::vector<std::uint8_t>> weights_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

/// A peer speaking the wire format over its own socket (REQ, or DEALER to send what REQ never does).
class peer {
 public:
  peer(zmq::context_t& ctx, const std::string& endpoint, zmq::socket_type type = zmq::socket_type::req)
      : socket_(ctx, type) {
    socket_.set(zmq::sockopt::linger, 0);
    socket_.connect(endpoint);
  }
  /// Sends `frames` as one message.
  void send_frames(const std::vector<std::string>& frames) {
    for (std::size_t i = 0; i < frames.size(); ++i)
      REQUIRE(socket_.send(zmq::buffer(frames[i]),
                           i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none));
  }
  /// The next message's last frame (a DEALER also gets the delimiter first); fails the test after
  /// reply_wait_ms.
  std::string receive() {
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    REQUIRE(zmq::poll(&item, 1, std::chrono::milliseconds(reply_wait_ms)) == 1);
    std::string last;
    zmq::message_t m;
    do {
      REQUIRE(socket_.recv(m, zmq::recv_flags::none));
      last = m.to_string();
    } while (m.more());
    return last;
  }
  wire::message request_bytes(const std::string& bytes) {
    if (socket_.get(zmq::sockopt::type) == ZMQ_DEALER)
      send_frames({"", bytes});
    else
      send_frames({bytes});
    return wire::decode(receive());
  }
  wire::message request(const wire::message& m, const std::string& secret) {
    return request_bytes(wire::encode(m, secret));
  }

 private:
  zmq::socket_t socket_;
};

/// The legitimate streamer: host_shm buffers of its own and a session secret, over a REQ socket.
class streamer_peer {
 public:
  streamer_peer(zmq::context_t& ctx, const std::string& endpoint, const std::string& token)
      : src_(make_source()), peer_(ctx, endpoint) {
    wire::hello h;
    src_->open_session(h);
    h.peer = "legitimate-streamer";
    h.token = token;
    h.secret = secret_;
    const auto reply = peer_.request(h, {});
    REQUIRE(error_text(reply) == "OK");
    src_->session_accepted(std::array{std::get<wire::ok>(reply)});
  }
  wire::message request(const wire::message& m) { return peer_.request(m, secret_); }
  /// BATCH `seq` of `version` with `tensors` whole, each filled with its pattern for `version`.
  wire::message batch(std::uint64_t version, std::uint64_t seq, const std::vector<refit::tensor_meta>& tensors) {
    wire::batch b{version, seq, static_cast<std::uint32_t>(seq % 2), {}};
    std::uint64_t offset = 0;
    for (const auto& m : tensors) {
      rt::fill_pattern(m.name, version, reinterpret_cast<std::uint8_t*>(src_->data(b.buffer)) + offset, m.nbytes());
      b.entries.push_back(wire::entry{m.name, m.type, m.shape, 0, m.nbytes(), offset});
      offset += (m.nbytes() + 255) / 256 * 256;
    }
    return request(b);
  }
  [[nodiscard]] const std::string& secret() const { return secret_; }
  peer& socket() { return peer_; }

  static std::string error_text(const wire::message& m) {
    if (std::holds_alternative<wire::ok>(m)) return "OK";
    if (const auto* e = std::get_if<wire::error>(&m)) return std::string(refit::to_string(e->code)) + ": " + e->message;
    return "neither OK nor ERROR";
  }

 private:
  static std::unique_ptr<refit::transport::source> make_source() {
    refit::transport::source_options o;
    o.name = "host_shm";
    o.bytes = 64 * kib;
    return refit::transport::make_source(o);
  }
  std::unique_ptr<refit::transport::source> src_;
  std::string secret_ = "legitimate-secret";
  peer peer_;
};

std::string text(const wire::message& m) { return streamer_peer::error_text(m); }

std::vector<refit::tensor_meta> two_tensors() {
  return {{"a.weight", refit::dtype::f32, {256}}, {"b.weight", refit::dtype::bf16, {64, 8}}};
}

/// Writes `bytes` to a fresh tcp connection to `endpoint` (tcp://127.0.0.1:PORT) and closes it at once.
void raw_tcp(const std::string& endpoint, const std::string& bytes) {
  const auto colon = endpoint.rfind(':');
  const int port = std::stoi(endpoint.substr(colon + 1));
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0);
  std::size_t sent = 0;
  while (sent < bytes.size()) {
    const auto n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the receiver may close a connection that speaks nonsense: fine
    sent += static_cast<std::size_t>(n);
  }
  ::close(fd);
}

/// A HELLO that is refused for its token, from a fresh REQ connection: its answer proves the
/// receiver still answers new peers.
std::string hello_answer(zmq::context_t& ctx, const std::string& endpoint) {
  peer p(ctx, endpoint);
  wire::hello h;
  h.transport = "host_shm";
  h.token = "not-the-token";
  return text(p.request(h, {}));
}

/// The resident memory of this process (/proc/self/statm).
std::uint64_t rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::uint64_t size = 0;
  std::uint64_t resident = 0;
  statm >> size >> resident;
  return resident * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
}

/// Version `v` of `model` through `s` in one batch, committed bit-exact.
void refit_checked(streamer_peer& s, const served_receiver& rx, const std::vector<refit::tensor_meta>& model,
                   std::uint64_t v) {
  INFO("version " << v);
  REQUIRE(text(s.request(wire::begin{v, false, {}})) == "OK");
  REQUIRE(text(s.batch(v, 0, model)) == "OK");
  REQUIRE(text(s.request(wire::end{v, 2, 2048, 1, {}})) == "OK");
  CHECK(rx.committed() == v);
  CHECK(rx.mismatch(v).empty());
}

}  // namespace

// ============================================================================ session theft

TEST_CASE("a stranger's BEGIN, BATCH, END, ABORT and BYE are refused as unauthorized and the session's version commits",
          "[hostile]") {
  const auto model = two_tensors();
  const rt::scoped_endpoint endpoint;
  served_receiver rx(endpoint.name, model, "the-token");
  zmq::context_t ctx;
  streamer_peer s(ctx, endpoint.name, "the-token");
  REQUIRE(text(s.request(wire::begin{1, false, {}})) == "OK");
  REQUIRE(text(s.batch(1, 0, {model[0]})) == "OK");

  // A stranger on a connection of its own, never past HELLO, tries every request of a session,
  // with no secret and with a guessed one: each is refused, and nothing of the session changes.
  peer stranger(ctx, endpoint.name);
  for (const std::string& secret : {std::string(), std::string("guess"), s.secret()}) {
    for (const wire::message& m : std::vector<wire::message>{
             wire::begin{max_version, false, {}},
             wire::batch{1, 1, 1, {wire::entry{"b.weight", refit::dtype::bf16, {64, 8}, 0, 1024, 0}}},
             wire::end{1, 2, 2048, 2, {}}, wire::abort{1, refit::errc::cuda, "stranger"},
             wire::abort{max_version, refit::errc::cuda, "stranger"}, wire::bye{}}) {
      const std::string answer = text(stranger.request(m, secret));
      INFO(wire::to_string(wire::type_of(m)) << " with secret '" << secret << "'");
      CHECK(answer == "unauthorized: " + std::string(wire::to_string(wire::type_of(m))) +
                          " refused: it does not come from the peer that opened the session with "
                          "legitimate-streamer (another connection, or not the session's secret); say HELLO first");
    }
  }
  CHECK(rx.committed() == std::nullopt);

  // The session carries on: its second batch and END commit version 1 bit-exact.
  REQUIRE(text(s.batch(1, 1, {model[1]})) == "OK");
  REQUIRE(text(s.request(wire::end{1, 2, 2048, 2, {}})) == "OK");
  CHECK(rx.committed() == 1);
  CHECK(rx.mismatch(1).empty());
  // And the next version still begins (a stranger's BEGIN 2^64-1 did not take the version space).
  REQUIRE(text(s.request(wire::begin{2, false, {}})) == "OK");
}

TEST_CASE("the session's own connection with the wrong secret is refused and the refit goes on", "[hostile]") {
  const auto model = two_tensors();
  const rt::scoped_endpoint endpoint;
  served_receiver rx(endpoint.name, model);
  zmq::context_t ctx;
  streamer_peer s(ctx, endpoint.name, "");
  REQUIRE(text(s.request(wire::begin{1, false, {}})) == "OK");
  CHECK(text(s.socket().request(wire::end{1, 0, 0, 0, {}}, "wrong-secret")) ==
        "unauthorized: END refused: it does not come from the peer that opened the session with legitimate-streamer "
        "(another connection, or not the session's secret); say HELLO first");
  REQUIRE(text(s.batch(1, 0, model)) == "OK");
  REQUIRE(text(s.request(wire::end{1, 2, 2048, 1, {}})) == "OK");
  CHECK(rx.committed() == 1);
  CHECK(rx.mismatch(1).empty());
}

TEST_CASE("bytes that do not decode abort a refit only when the session's owner sends them", "[hostile]") {
  const auto model = two_tensors();
  const rt::scoped_endpoint endpoint;
  served_receiver rx(endpoint.name, model, "the-token");
  zmq::context_t ctx;
  streamer_peer s(ctx, endpoint.name, "the-token");
  REQUIRE(text(s.request(wire::begin{1, false, {}})) == "OK");

  peer stranger(ctx, endpoint.name);
  CHECK(text(stranger.request_bytes(std::string(1, '\xc1'))) ==
        "protocol: malformed message: invalid msgpack (parse error)");
  REQUIRE(text(s.batch(1, 0, model)) == "OK");
  REQUIRE(text(s.request(wire::end{1, 2, 2048, 1, {}})) == "OK");
  CHECK(rx.committed() == 1);

  // The owner's own garbage does end its refit.
  REQUIRE(text(s.request(wire::begin{2, false, {}})) == "OK");
  CHECK(text(s.socket().request_bytes(std::string(1, '\xc1'))) ==
        "protocol: malformed message: invalid msgpack (parse error)");
  CHECK(text(s.batch(2, 0, model)).starts_with("protocol: "));
  CHECK(rx.committed() == 1);
}

TEST_CASE(
    "a HELLO with the wrong token during a refit leaves the session alone, an nccl one (a stranger's unique id) "
    "before any communicator is joined",
    "[hostile]") {
  const auto model = two_tensors();
  const rt::scoped_endpoint endpoint;
  served_receiver rx(endpoint.name, model, "the-token");
  zmq::context_t ctx;
  streamer_peer s(ctx, endpoint.name, "the-token");
  REQUIRE(text(s.request(wire::begin{1, false, {}})) == "OK");
  CHECK(hello_answer(ctx, endpoint.name).starts_with("unauthorized: session token mismatch"));
  peer p(ctx, endpoint.name);
  wire::hello h;
  h.transport = "nccl";
  h.token = "not-the-token";
  h.session = std::string(200, '\x42');  // opaque to the receiver until the token passed
  h.device_uuid = std::string(16, '\x01');
  h.mode = wire::session_mode::in_place;
  CHECK(text(p.request(h, {})).starts_with("unauthorized: session token mismatch"));
  REQUIRE(text(s.batch(1, 0, model)) == "OK");
  REQUIRE(text(s.request(wire::end{1, 2, 2048, 1, {}})) == "OK");
  CHECK(rx.committed() == 1);
  CHECK(rx.mismatch(1).empty());
}

TEST_CASE("a session that moved to its control lane takes nothing but HELLO over ZeroMQ", "[hostile]") {
  const auto model = two_tensors();
  const rt::scoped_endpoint endpoint;
  served_receiver rx(endpoint.name, model);
  refit::streamer_options o = rt::host_shm_streamer(endpoint.name, 64 * kib, 20s);
  o.control_lane = true;
  refit::streamer st(o);
  const rt::host_tensors v1(model, 1);
  st.refit(1, v1.refs);
  REQUIRE(rx.committed() == 1);

  zmq::context_t ctx;
  peer stranger(ctx, endpoint.name);
  const std::string answer = text(stranger.request(wire::begin{2, false, {}}, {}));
  // Over the lane (this host, control_lane on) the stranger hears that ZeroMQ is closed to the
  // session; where no lane was made (a transport registered for tests), that it is a stranger.
  CHECK((answer.find("moved to its control lane; over ZeroMQ this receiver takes only a new HELLO") !=
             std::string::npos ||
         answer.find("does not come from the peer that opened the session") != std::string::npos));
  CHECK(answer.starts_with("unauthorized: BEGIN refused: "));
  const rt::host_tensors v2(model, 2);
  st.refit(2, v2.refs);
  CHECK(rx.committed() == 2);
  CHECK(rx.mismatch(2).empty());
}

TEST_CASE("a streamer killed mid-refit is noticed through its control lane, long before the idle timeout",
          "[hostile][lane]") {
  const auto model = two_tensors();
  const rt::scoped_endpoint endpoint;
  // The streamer first (a fork before this process serves on a thread): it begins version 1, sends
  // nothing more, and waits to be killed.
  rt::child streamer([&] {
    refit::streamer_options o = rt::host_shm_streamer(endpoint.name, 64 * kib, 60s);
    o.control_lane = true;
    refit::streamer s(o);
    const rt::host_tensors v1(model, 1);
    std::size_t given = 0;
    (void)s.refit(1, [&]() -> std::optional<refit::tensor_ref> {
      if (given == 0) return v1.refs[given++];
      for (;;) ::pause();  // mid-refit until SIGKILL
    });
  });
  std::mutex m;
  std::condition_variable cv;
  bool begun = false;
  std::optional<std::string> aborted;
  served_receiver rx(endpoint.name, model, {}, [&](refit::receiver& r) {
    r.on_begin([&](std::uint64_t) {
      const std::lock_guard lock(m);
      begun = true;
      cv.notify_all();
    });
    r.on_abort([&](std::uint64_t, const std::string& why) {
      const std::lock_guard lock(m);
      aborted = why;
      cv.notify_all();
    });
  });
  std::unique_lock lock(m);
  REQUIRE(cv.wait_for(lock, 50s, [&] { return begun; }));
  lock.unlock();
  const auto killed = std::chrono::steady_clock::now();
  streamer.kill();
  lock.lock();
  // The idle timeout is 60 s: the lane must tell long before.
  REQUIRE(cv.wait_for(lock, 30s, [&] { return aborted.has_value(); }));
  CHECK(std::chrono::steady_clock::now() - killed < 30s);
  CHECK_THAT(*aborted, Catch::Contains("is gone during version 1: its control lane closed"));
  CHECK_THAT(*aborted, Catch::Contains("receiver_options.idle_timeout (60000 ms)"));
  CHECK(rx.committed() == std::nullopt);
}

// ========================================================================= the envelope

TEST_CASE("messages that are not a REQ's request are dropped whole and never answered", "[hostile]") {
  const auto model = two_tensors();
  const rt::scoped_endpoint endpoint;
  served_receiver rx(endpoint.name, model);
  zmq::context_t ctx;
  peer dealer(ctx, endpoint.name, zmq::socket_type::dealer);
  // No delimiter; a delimiter that is not empty; two body frames; 10,000 frames.
  dealer.send_frames({wire::encode(wire::bye{})});
  dealer.send_frames({"x", wire::encode(wire::bye{})});
  dealer.send_frames({"", wire::encode(wire::bye{}), wire::encode(wire::bye{})});
  dealer.send_frames(std::vector<std::string>(10000, std::string("f")));
  // The first answer this connection gets is the one to its first well-formed request.
  wire::hello h;
  h.transport = "host_shm";
  h.token = "not-the-token";  // refused for the token: an answer that no other request would get
  dealer.send_frames({"", wire::encode(h)});
  CHECK(text(wire::decode(dealer.receive())).starts_with("unauthorized: session token mismatch"));

  // And the legitimate streamer's session works as ever.
  streamer_peer s(ctx, endpoint.name, "");
  REQUIRE(text(s.request(wire::begin{1, false, {}})) == "OK");
  REQUIRE(text(s.batch(1, 0, model)) == "OK");
  REQUIRE(text(s.request(wire::end{1, 2, 2048, 1, {}})) == "OK");
  CHECK(rx.committed() == 1);
}

TEST_CASE("a peer that sends a broken request and leaves does not make the receiver lose the next reply", "[hostile]") {
  const auto model = two_tensors();
  served_receiver rx("tcp://127.0.0.1:0", model);
  const std::string endpoint = rx.endpoint();
  zmq::context_t ctx;
  // A ZMTP/1.0 greeting, then a request without the empty delimiter, and gone at once: libzmq's
  // REP socket then swallowed the next peer's reply most of the time.
  const std::string zmtp10("\x01\x00\x02\x01\x41\x02\x00\x42", 8);
  for (int round = 0; round < 8; ++round) {
    raw_tcp(endpoint, zmtp10);
    INFO("round " << round);
    CHECK(hello_answer(ctx, endpoint).starts_with("unauthorized: session token mismatch"));
  }
  std::mt19937_64 rng(35);
  for (int blob = 0; blob < 50; ++blob) {
    std::string bytes(4096, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    raw_tcp(endpoint, bytes);
  }
  CHECK(hello_answer(ctx, endpoint).starts_with("unauthorized: session token mismatch"));
}

// ============================================================================== soak

TEST_CASE("one receiver under every attack in turn keeps committing the legitimate streamer's versions bit-exact",
          "[hostile][soak]") {
  const auto model = two_tensors();
  served_receiver rx("tcp://127.0.0.1:0", model, "the-token");
  const std::string endpoint = rx.endpoint();
  zmq::context_t ctx;
  streamer_peer s(ctx, endpoint, "the-token");
  peer stranger(ctx, endpoint);
  peer dealer(ctx, endpoint, zmq::socket_type::dealer);
  std::mt19937_64 rng(3535);
  const auto attack = [&](int round) {
    INFO("round " << round);
    // A stranger's requests, bytes that do not decode, a HELLO with the wrong token, broken
    // envelopes, random bytes over raw tcp.
    CHECK(text(stranger.request(wire::begin{max_version, false, {}}, s.secret())).starts_with("unauthorized: "));
    CHECK(text(stranger.request(wire::end{static_cast<std::uint64_t>(round), 2, 2048, 1, {}}, {}))
              .starts_with("unauthorized: "));
    CHECK(text(stranger.request(wire::abort{static_cast<std::uint64_t>(round), refit::errc::cuda, "x"}, {}))
              .starts_with("unauthorized: "));
    CHECK(text(stranger.request_bytes(std::string(1, '\xc1'))).starts_with("protocol: "));
    CHECK(hello_answer(ctx, endpoint).starts_with("unauthorized: session token mismatch"));
    dealer.send_frames({"no delimiter"});
    dealer.send_frames({"", "two", "bodies"});
    std::string blob(1024, '\0');
    for (char& c : blob) c = static_cast<char>(rng());
    raw_tcp(endpoint, blob);
  };
  for (int round = 1; round <= 12; ++round) {
    const auto v = static_cast<std::uint64_t>(round);
    attack(round);
    REQUIRE(text(s.request(wire::begin{v, false, {}})) == "OK");
    attack(round);
    REQUIRE(text(s.batch(v, 0, {model[0]})) == "OK");
    attack(round);
    REQUIRE(text(s.batch(v, 1, {model[1]})) == "OK");
    attack(round);
    REQUIRE(text(s.request(wire::end{v, 2, 2048, 2, {}})) == "OK");
    CHECK(rx.committed() == v);
    CHECK(rx.mismatch(v).empty());
  }
  // The dealer's broken messages were never answered: its first answer is to its first request.
  wire::hello h;
  h.transport = "host_shm";
  h.token = "not-the-token";
  dealer.send_frames({"", wire::encode(h)});
  CHECK(text(wire::decode(dealer.receive())).starts_with("unauthorized: session token mismatch"));
}

// ============================================================================ binding

TEST_CASE("a tcp endpoint other hosts can reach is refused without CURVE unless allowed", "[hostile]") {
  using refit::channel::loopback_only;
  CHECK(loopback_only("ipc:///tmp/x/receiver.sock"));
  CHECK(loopback_only("tcp://127.0.0.1:5555"));
  CHECK(loopback_only("tcp://127.3.2.1:0"));
  CHECK(loopback_only("tcp://[::1]:7"));
  CHECK(loopback_only("tcp://localhost:7"));
  CHECK(loopback_only("tcp://lo:7"));
  CHECK_FALSE(loopback_only("tcp://0.0.0.0:7"));
  CHECK_FALSE(loopback_only("tcp://10.1.2.3:7"));
  CHECK_FALSE(loopback_only("tcp://eth0:7"));
  CHECK_FALSE(loopback_only("tcp://[::]:7"));

  ::unsetenv("REFIT_ALLOW_INSECURE");
  refit::receiver_options o;
  o.endpoint = "tcp://0.0.0.0:0";
  CHECK_REFIT_ERROR(refit::receiver(o), refit::errc::invalid_argument,
                    "refusing to bind the receiver to tcp://0.0.0.0:* without CURVE");
  o.allow_insecure_tcp = true;
  {
    refit::receiver r(o);
    CHECK(r.endpoint().starts_with("tcp://0.0.0.0:"));
  }
  o.allow_insecure_tcp = false;
  ::setenv("REFIT_ALLOW_INSECURE", "1", 1);
  {
    refit::receiver r(o);
    CHECK(r.endpoint().starts_with("tcp://0.0.0.0:"));
  }
  ::unsetenv("REFIT_ALLOW_INSECURE");
  // Loopback needs nothing.
  o.endpoint = "tcp://127.0.0.1:0";
  refit::receiver loopback(o);
  CHECK(loopback.endpoint().starts_with("tcp://127.0.0.1:"));
}

// ======================================================================= unfinished messages

namespace {

namespace zmtp = refit::channel::zmtp;
constexpr std::uint64_t mib = std::uint64_t{1} << 20;

/// Polls `done` (what the receiver's thread changes) until it holds or `wait` has passed.
bool eventually(const std::function<bool()>& done, std::chrono::milliseconds wait = 30s) {
  const auto until = std::chrono::steady_clock::now() + wait;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::yield();
  }
  return true;
}

/// A CURVE key pair of the receiver (raw, for curve_client) and its receiver_options.curve, which
/// allows exactly the client keys of `clients`.
struct curve_server {
  rt::curve_client::key public_key{};
  rt::curve_client::key secret_key{};
  curve_server() {
    REQUIRE(sodium_init() >= 0);
    crypto_box_keypair(public_key.data(), secret_key.data());
  }
  static std::string z85(const rt::curve_client::key& k) {
    char text[41] = {};
    REQUIRE(zmq_z85_encode(text, k.data(), k.size()) != nullptr);
    return text;
  }
  [[nodiscard]] refit::curve_keys options(const std::vector<std::unique_ptr<rt::curve_client>>& clients) const {
    refit::curve_keys k{z85(public_key), z85(secret_key), "", {}};
    for (const auto& c : clients) k.allowed_clients.push_back(z85(c->public_key()));
    return k;
  }
};

/// A raw peer past its handshake: NULL, or CURVE with a client key the receiver allows.
struct raw_peer {
  std::unique_ptr<rt::zmtp_peer> socket;
  rt::curve_client* curve = nullptr;

  /// Greeting and READY (NULL), or greeting, HELLO, WELCOME, INITIATE, READY (CURVE, as `client`).
  raw_peer(const std::string& endpoint, rt::curve_client* client) : socket(std::make_unique<rt::zmtp_peer>(endpoint)) {
    curve = client;
    if (curve == nullptr) {
      REQUIRE(socket->handshake());
      return;
    }
    REQUIRE(socket->send(rt::curve_client::greeting() + curve->hello()));
    REQUIRE(socket->wait_received(64 + 2 + 168, 20s));  // the greeting and WELCOME
    REQUIRE(curve->welcome(std::string_view(socket->received()).substr(64)));
    REQUIRE(socket->send(curve->initiate()));
    REQUIRE(socket->wait_received(64 + 2 + 168 + 2 + 52, 20s));  // and READY
    REQUIRE(curve->ready(std::string_view(socket->received()).substr(64)));
  }
  /// The empty delimiter of a request and the header of its body, announcing `announced` bytes
  /// (CURVE: a MESSAGE box that carries that many); what follows is the body's bytes.
  std::string request_head(std::uint64_t announced) {
    if (curve == nullptr) return rt::zmtp_frame("", true) + rt::zmtp_frame_header(announced, false);
    return curve->seal(1, {}) + rt::zmtp_frame_header(announced + zmtp::curve_overhead, false);
  }
};

/// Eight peers each announce a request body of 64 MiB (four times the largest request) and send
/// half of it: each is closed at that header, long before the heartbeat timeout (60 s here), and
/// the receiver never holds a byte of it.
void refused_at_header(const std::string& endpoint, const std::vector<std::unique_ptr<rt::curve_client>>& clients) {
  const std::string half(32 * mib, 'h');
  const std::uint64_t base = zmtp::held_total();
  zmtp::reset_held_peak();
  const auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < 8; ++i) {
    raw_peer p(endpoint, clients.empty() ? nullptr : clients[i].get());
    (void)p.socket->send(p.request_head(64 * mib));
    (void)p.socket->send(half);  // refused at the header: the server may be gone already
    CHECK(p.socket->wait_hung_up(20s));
  }
  CHECK(std::chrono::steady_clock::now() - start < 30s);
  INFO("held before " << base << " bytes, at most " << zmtp::held_peak());
  CHECK(zmtp::held_peak() < base + mib);
}

/// Sixteen peers each send 12 MiB of a request body announced at the largest request's size
/// (zmtp::max_request_bytes) and stall: 192 MiB would be held without a bound. The bound is the
/// budget (128 MiB with room for one read): ten peers' 120 MiB fit, and each peer after the tenth
/// makes the receiver close the one that stalled longest, so the six oldest are closed and the ten
/// newest kept. Nothing waits on the heartbeats (60 s here).
void bounded_by_budget(const std::string& endpoint, const std::vector<std::unique_ptr<rt::curve_client>>& clients) {
  constexpr std::size_t peers_count = 16;
  constexpr std::size_t kept = 10;
  const std::string part(12 * mib, 'u');
  const std::uint64_t base = zmtp::held_total();
  zmtp::reset_held_peak();
  const std::uint64_t rss_before = rss_bytes();
  std::vector<raw_peer> peers;
  for (std::size_t i = 0; i < peers_count; ++i) {
    peers.emplace_back(endpoint, clients.empty() ? nullptr : clients[i].get());
    REQUIRE(peers.back().socket->send(peers.back().request_head(zmtp::max_request_bytes)));
    REQUIRE(peers.back().socket->send(part));
    // Read by the receiver before the next peer comes: what it holds for this one is counted.
    const std::uint64_t expect = base + std::min(i + 1, kept) * part.size();
    INFO("peer " << i);
    REQUIRE(eventually([&] { return zmtp::held_total() == expect; }));
  }
  const std::uint64_t rss_held = rss_bytes();
  for (std::size_t i = 0; i < peers_count; ++i) {
    INFO("peer " << i);
    if (i < peers_count - kept)
      CHECK(peers[i].socket->wait_hung_up(20s));
    else
      CHECK_FALSE(peers[i].socket->hung_up());
  }
  INFO("held before " << base << " bytes, at most " << zmtp::held_peak() << "; resident before " << rss_before
                      << ", with ten peers held " << rss_held);
  CHECK(zmtp::held_peak() <= zmtp::default_held_budget);
  CHECK(zmtp::held_total() == base + kept * part.size());
  CHECK(rss_held < rss_before + zmtp::default_held_budget + 16 * mib);
  peers.clear();
  CHECK(eventually([&] { return zmtp::held_total() == base; }));
}

/// The options of these tests: the defaults, with heartbeats that never close a peer during one.
zmtp::options slow_heartbeats() {
  zmtp::options o;
  o.heartbeat_timeout = 60s;
  return o;
}

}  // namespace

TEST_CASE("a peer sending 8 MiB frames flagged MORE and never a last one grows the receiver by less than two frames",
          "[hostile][zmtp]") {
  const auto model = two_tensors();
  served_receiver rx("tcp://127.0.0.1:0", model);
  zmq::context_t ctx;
  streamer_peer s(ctx, rx.endpoint(), "");
  refit_checked(s, rx, model, 1);
  constexpr std::uint64_t frame = zmtp::max_request_bytes / 2;
  const std::string header = rt::zmtp_frame_header(frame, true);
  const std::string body(frame, 'm');
  const std::uint64_t before = rss_bytes();
  rt::zmtp_peer p(rx.endpoint());
  REQUIRE(p.handshake());
  // Each send returns once the receiver has read all but what the kernel buffers: ten frames, with
  // a refit in the middle of them, are read and skipped, none kept (libzmq kept every one).
  for (int i = 0; i < 10; ++i) {
    REQUIRE(p.send(header));
    REQUIRE(p.send(body));
    if (i == 4) refit_checked(s, rx, model, 2);
  }
  refit_checked(s, rx, model, 3);
  const std::uint64_t during = rss_bytes();
  INFO("resident before " << before << " bytes, after ten frames " << during);
  CHECK(during < before + 2 * frame);
  CHECK_FALSE(p.hung_up());  // read, not dropped: what it sends costs nothing to keep
  p.close();
  refit_checked(s, rx, model, 4);
}

TEST_CASE("the largest BATCH refit sends fits in the request limit, and a streamer refuses a larger request unsent",
          "[hostile][zmtp]") {
  // wire::max_batch_entries entries, each with a name of 128 bytes, a shape of wire::max_rank
  // dimensions and every number at its widest encoding.
  wire::batch b{std::uint64_t{1} << 40, std::uint64_t{1} << 40, 1, {}};
  for (std::size_t i = 0; i < wire::max_batch_entries; ++i) {
    std::string name = fmt::format("model.layers.{}.mlp.experts.{}.", i / 512, i % 512);
    name.resize(128, 'w');
    b.entries.push_back(wire::entry{name, refit::dtype::f32, std::vector<std::int64_t>(wire::max_rank, 1ll << 40),
                                    std::uint64_t{1} << 40, std::uint64_t{1} << 40, std::uint64_t{1} << 40,
                                    wire::entry_kind::bytes, 0, 0x7fffffff});
  }
  const std::string bytes = wire::encode(b, std::string(wire::max_secret_bytes, 's'));
  INFO("the widest BATCH of " << b.entries.size() << " entries is " << bytes.size() << " bytes");
  CHECK(bytes.size() <= zmtp::max_request_bytes);

  refit::channel::req_channel req("ipc:///nonexistent/refit-test.sock");
  const std::string larger(zmtp::max_request_bytes + 1, 'x');
  CHECK_REFIT_ERROR(req.send(larger, 1s, "BATCH 3 of version 7"), refit::errc::invalid_argument,
                    "BATCH 3 of version 7 is 16777217 bytes, more than the 16777216 a receiver takes in one request: "
                    "lower plan_options::max_entries (its entries, or their names, are too many for one BATCH)");
}

TEST_CASE("eight peers announcing a 64 MiB request are closed at its header, and the receiver holds nothing of them",
          "[hostile][zmtp]") {
  const zmtp::scoped_default_options slow(slow_heartbeats());
  const auto model = two_tensors();
  served_receiver rx("tcp://127.0.0.1:0", model);
  zmq::context_t ctx;
  streamer_peer s(ctx, rx.endpoint(), "");
  refit_checked(s, rx, model, 1);
  refused_at_header(rx.endpoint(), {});
  refit_checked(s, rx, model, 2);
}

TEST_CASE(
    "sixteen peers stalled in unfinished requests hold at most the 128 MiB budget together, the oldest closed "
    "first, and the streamer's versions commit",
    "[hostile][zmtp]") {
  const zmtp::scoped_default_options slow(slow_heartbeats());
  const auto model = two_tensors();
  served_receiver rx("tcp://127.0.0.1:0", model);
  zmq::context_t ctx;
  streamer_peer s(ctx, rx.endpoint(), "");
  refit_checked(s, rx, model, 1);
  bounded_by_budget(rx.endpoint(), {});
  refit_checked(s, rx, model, 2);
}

TEST_CASE(
    "CURVE peers holding allowed keys are refused at a header over the limit and bounded by the budget, as "
    "unauthenticated ones",
    "[hostile][zmtp][curve]") {
  const zmtp::scoped_default_options slow(slow_heartbeats());
  std::vector<std::unique_ptr<rt::curve_client>> clients;
  const curve_server server;
  for (int i = 0; i < 24; ++i) clients.push_back(std::make_unique<rt::curve_client>(server.public_key));
  const auto model = two_tensors();
  served_receiver rx("tcp://127.0.0.1:0", model, {}, {}, server.options(clients));
  std::vector<std::unique_ptr<rt::curve_client>> first(8), rest(16);
  std::move(clients.begin(), clients.begin() + 8, first.begin());
  std::move(clients.begin() + 8, clients.end(), rest.begin());
  SECTION("a frame announced over the limit") { refused_at_header(rx.endpoint(), first); }
  SECTION("unfinished requests over the budget") { bounded_by_budget(rx.endpoint(), rest); }
  // A key the receiver did not allow never gets past INITIATE: it is told so (ERROR "400"), and closed.
  rt::curve_client stranger(server.public_key);
  rt::zmtp_peer p(rx.endpoint());
  REQUIRE(p.send(rt::curve_client::greeting() + stranger.hello()));
  REQUIRE(p.wait_received(64 + 2 + 168, 20s));
  REQUIRE(stranger.welcome(std::string_view(p.received()).substr(64)));
  REQUIRE(p.send(stranger.initiate()));
  CHECK(p.wait_hung_up(20s));
  CHECK(std::string_view(p.received()).substr(64 + 2 + 168) == zmtp::command("ERROR", zmtp::refused_key_error));
}

// ========================================================================= host_shm segments

namespace {

/// A named segment as a hostile streamer of this uid makes one: in /dev/shm under a name the
/// receiver accepts, 0600, its descriptor kept to truncate it later.
struct named_segment {
  std::string name;
  int fd = -1;
  explicit named_segment(std::uint64_t bytes, std::uint64_t tag) {
    struct stat ns {};
    REQUIRE(::stat("/proc/self/ns/pid", &ns) == 0);
    name = fmt::format("/refit-{}-{}-{:016x}", ::getpid(), ns.st_ino, tag);
    fd = ::open(("/dev/shm" + name).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(::ftruncate(fd, static_cast<off_t>(bytes)) == 0);
  }
  ~named_segment() {
    ::close(fd);
    ::unlink(("/dev/shm" + name).c_str());  // the receiver unlinked it once mapped; in case it did not
  }
  named_segment(const named_segment&) = delete;
  named_segment& operator=(const named_segment&) = delete;
};

}  // namespace

TEST_CASE(
    "a named segment truncated after HELLO fails the BATCH that reads it, nothing is read from it, and the "
    "receiver serves the next session",
    "[hostile][host_shm]") {
  const auto model = two_tensors();
  const rt::scoped_endpoint endpoint;
  served_receiver rx(endpoint.name, model);
  zmq::context_t ctx;
  constexpr std::uint64_t bytes = 64 * kib;
  const auto truncated_to = GENERATE(std::uint64_t{0}, std::uint64_t{4096});
  INFO("truncated to " << truncated_to << " bytes");
  const named_segment a(bytes, 0x5e9a), b(bytes, 0x5e9b);
  peer hostile(ctx, endpoint.name);
  wire::hello h;
  h.transport = "host_shm";
  h.host_id = refit::transport::host_identity();
  h.peer = "hostile-streamer";
  h.secret = "hostile-secret";
  h.buffers = {wire::buffer_desc{bytes, a.name, "", ""}, wire::buffer_desc{bytes, b.name, "", ""}};
  REQUIRE(text(hostile.request(h, {})) == "OK");
  REQUIRE(text(hostile.request(wire::begin{1, false, {}}, h.secret)) == "OK");
  // The streamer fills buffer 0, then cuts it under the receiver's mapping. A batch reading only
  // its first 1 KiB, which are still there when it is cut to 4 KiB, is refused as well: the
  // segment is no longer what was mapped.
  const std::vector<std::uint8_t> filled(bytes, 0x5a);
  REQUIRE(::pwrite(a.fd, filled.data(), filled.size(), 0) == static_cast<ssize_t>(filled.size()));
  REQUIRE(::ftruncate(a.fd, static_cast<off_t>(truncated_to)) == 0);
  const wire::batch batch{1, 0, 0, {wire::entry{"a.weight", refit::dtype::f32, {256}, 0, 1024, 0}}};
  CHECK(text(hostile.request(batch, h.secret)) ==
        fmt::format("transport: host_shm: the streamer's shared memory {} (buffer 0) has {} bytes, not the 65536 it "
                    "was mapped with: the streamer truncated it (it is broken or hostile); the batch was refused "
                    "before any byte of it was read and the refit was aborted",
                    a.name, truncated_to));
  CHECK(rx.committed() == std::nullopt);
  CHECK(rx.untouched());
  // The refit is over: its END is refused, and nothing commits.
  CHECK(text(hostile.request(wire::end{1, 1, 1024, 1, {}}, h.secret)).starts_with("protocol: "));
  CHECK(rx.committed() == std::nullopt);
  CHECK(rx.untouched());

  // The next session commits, bit-exact.
  streamer_peer s(ctx, endpoint.name, "");
  refit_checked(s, rx, model, 1);
}
