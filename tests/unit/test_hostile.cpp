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

#include "channel/channel.hpp"
#include "channel/zmtp.hpp"
#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "support/support.hpp"
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
                  const std::function<void(refit::receiver&)>& setup = {}) {
    refit::receiver_options o;
    o.endpoint = endpoint;
    o.token = std::move(token);
    o.idle_timeout = 60s;
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

TEST_CASE("a peer sending 32 MiB frames flagged MORE and never a last one grows the receiver by less than two frames",
          "[hostile][zmtp]") {
  const auto model = two_tensors();
  served_receiver rx("tcp://127.0.0.1:0", model);
  zmq::context_t ctx;
  streamer_peer s(ctx, rx.endpoint(), "");
  refit_checked(s, rx, model, 1);
  constexpr std::uint64_t frame = std::uint64_t{32} << 20;
  const std::string header = rt::zmtp_frame_header(frame, true);
  const std::string body(frame, 'm');
  const std::uint64_t before = rss_bytes();
  rt::zmtp_peer p(rx.endpoint());
  REQUIRE(p.handshake());
  // Each send returns once the receiver has read all but what the kernel buffers: ten frames, with
  // a refit in the middle of them, are read and skipped, none kept (libzmq kept every one: 12 ->
  // 268 MiB after eight).
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

TEST_CASE(
    "eight peers stalled half-way through a 64 MiB frame are dropped at the heartbeat timeout, their memory "
    "returned",
    "[hostile][zmtp]") {
  refit::channel::zmtp::options quick;
  quick.heartbeat_ivl = 200ms;
  quick.heartbeat_timeout = 2s;
  const refit::channel::zmtp::scoped_default_options shorter(quick);
  const auto model = two_tensors();
  served_receiver rx("tcp://127.0.0.1:0", model);
  zmq::context_t ctx;
  streamer_peer s(ctx, rx.endpoint(), "");
  refit_checked(s, rx, model, 1);
  const std::string half(std::size_t{32} << 20, 'h');
  const std::uint64_t before = rss_bytes();
  std::vector<std::unique_ptr<rt::zmtp_peer>> peers;
  for (int i = 0; i < 8; ++i) {
    peers.push_back(std::make_unique<rt::zmtp_peer>(rx.endpoint()));
    REQUIRE(peers.back()->handshake());
    REQUIRE(peers.back()->send(rt::zmtp_frame("", true) + rt::zmtp_frame_header(std::uint64_t{64} << 20, false)));
    REQUIRE(peers.back()->send(half));
  }
  const auto stalled = std::chrono::steady_clock::now();
  const std::uint64_t held = rss_bytes();
  refit_checked(s, rx, model, 2);
  for (auto& p : peers) CHECK(p->wait_hung_up(30s));
  const auto waited = std::chrono::steady_clock::now() - stalled;
  // The PING after 200 ms of silence, unanswered for 2 s (slack for sanitizer builds).
  CHECK(waited < 10s);
  const std::uint64_t after = rss_bytes();
  INFO("resident before " << before << " bytes, stalled " << held << ", dropped " << after);
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer keeps the shadow of memory unmapped since: resident size cannot tell here.
  WARN("under ThreadSanitizer the memory returned is not measured (its shadow stays resident)");
#else
  CHECK(after < before + (std::uint64_t{64} << 20));
#endif
  refit_checked(s, rx, model, 3);
}
