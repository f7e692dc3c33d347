// refit — the control channel. Every ZeroMQ exception is converted to refit::error here; none
// escapes this file.
#include "channel/channel.hpp"

#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <map>
#include <set>
#include <thread>
#include <utility>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "channel/lane.hpp"
#include "model/log.hpp"

namespace refit::channel {
namespace {

// wire::max_message_bytes; not included to keep the channel below the wire layer.
constexpr std::int64_t max_message_bytes = std::int64_t{64} << 20;
constexpr int reply_send_timeout_ms = 1000;
/// The receiver's socket: requests queued per connection before ZeroMQ stops reading that
/// connection (a REQ streamer has one in flight; a peer that pipelines more waits), so that one
/// connection holds at most this many messages of max_message_bytes, plus the frame it is sending.
constexpr int receiver_rcvhwm = 4;
/// ZMTP heartbeats: a connection that answers no PING for heartbeat_timeout_ms (a dead host, a
/// peer stuck half-way through a frame) is dropped with what it holds; a handshake must end within
/// handshake_ivl_ms.
constexpr int heartbeat_ivl_ms = 1000;
constexpr int heartbeat_timeout_ms = 10000;
constexpr int handshake_ivl_ms = 10000;
constexpr int reconnect_ivl_ms = 50;
constexpr int reconnect_ivl_max_ms = 1000;

using clock = std::chrono::steady_clock;

std::string zmq_reason(const zmq::error_t& e) { return fmt::format("{} (errno {})", e.what(), e.num()); }
std::string errno_reason(int e) { return fmt::format("{} (errno {})", std::strerror(e), e); }

int remaining_ms(clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now()).count();
  if (left <= 0) return 0;
  return left > 0x7fffffff ? 0x7fffffff : static_cast<int>(left);
}

/// How long a wait for a message that is due soon (a reply; the next request of a refit in
/// progress) asks without sleeping before it blocks: waking a thread that sleeps in poll costs
/// tens of microseconds per message on a server CPU, a round trip four such wakes.
constexpr std::chrono::microseconds spin_before_blocking{500};

/// Polls `items` (their `events`) until `deadline`; retries on EINTR. The index of the first ready
/// one, or nullopt. With `spin`, asks without blocking (yielding between asks) for that long first.
std::optional<std::size_t> poll_any(std::span<zmq::pollitem_t> items, clock::time_point deadline,
                                    std::chrono::microseconds spin) {
  const auto ready = [&]() -> std::optional<std::size_t> {
    for (std::size_t k = 0; k < items.size(); ++k)
      if ((items[k].revents & items[k].events) != 0) return k;
    return std::nullopt;
  };
  if (spin.count() > 0) {
    const auto spin_until = std::min(deadline, clock::now() + spin);
    do {
      try {
        if (zmq::poll(items.data(), items.size(), std::chrono::milliseconds(0)) > 0) return ready();
      } catch (const zmq::error_t& e) {
        if (e.num() != EINTR) throw;
      }
      std::this_thread::yield();
    } while (clock::now() < spin_until);
  }
  for (;;) {
    try {
      const int n = zmq::poll(items.data(), items.size(), std::chrono::milliseconds(remaining_ms(deadline)));
      if (n > 0) return ready();
      if (clock::now() >= deadline) return std::nullopt;
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) throw;
      if (clock::now() >= deadline) return std::nullopt;
    }
  }
}

/// Polls `socket` for `events` until `deadline` (see poll_any). True when ready.
bool poll_until(zmq::socket_t& socket, short events, clock::time_point deadline,
                std::chrono::microseconds spin = std::chrono::microseconds{0}) {
  zmq::pollitem_t item{socket.handle(), 0, events, 0};  // on the stack: every receive() passes here
  return poll_any({&item, 1}, deadline, spin).has_value();
}

void set_curve_server(zmq::socket_t& s, const curve_keys& curve) {
  if (curve.secret_key.empty()) return;
  s.set(zmq::sockopt::curve_server, 1);
  s.set(zmq::sockopt::curve_secretkey, curve.secret_key);
}

void set_curve_client(zmq::socket_t& s, const curve_keys& curve) {
  if (curve.server_key.empty()) return;
  s.set(zmq::sockopt::curve_serverkey, curve.server_key);
  s.set(zmq::sockopt::curve_publickey, curve.public_key);
  s.set(zmq::sockopt::curve_secretkey, curve.secret_key);
}

/// True when something accepts connections on the ipc endpoint's path. ZeroMQ replaces an
/// existing socket file on bind, which would silently steal the endpoint from a live receiver.
bool ipc_endpoint_in_use(std::string_view endpoint) {
  constexpr std::string_view scheme = "ipc://";
  if (!endpoint.starts_with(scheme)) return false;
  const std::string_view path = endpoint.substr(scheme.size());
  sockaddr_un addr{};
  if (path.empty() || path.front() == '@' || path.size() >= sizeof addr.sun_path) return false;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool connected = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return connected;
}

/// ipc endpoints this process's receivers bound and have released: ZeroMQ closes a socket in its
/// I/O thread after close() returns, so for a moment the old listener still accepts, and a
/// receiver of this process binding the endpoint again would find it "in use" by itself.
/// Trusted for a second: long enough for the I/O thread, too short for another process to have
/// taken the endpoint over in between.
constexpr std::chrono::seconds released_trust{1};
std::mutex released_mutex;
std::map<std::string, clock::time_point, std::less<>> released_endpoints;

void note_released(const std::string& endpoint) {
  if (!endpoint.starts_with("ipc://")) return;
  const auto now = clock::now();
  const std::lock_guard lock(released_mutex);
  // Forget what is past trusting: a process that makes receivers on fresh endpoints keeps none.
  std::erase_if(released_endpoints, [&](const auto& e) { return now - e.second >= released_trust; });
  released_endpoints.insert_or_assign(endpoint, now);
}

/// True (once) when this process released `endpoint` itself within the last second.
bool released_here(std::string_view endpoint) {
  const std::lock_guard lock(released_mutex);
  const auto it = released_endpoints.find(endpoint);
  if (it == released_endpoints.end()) return false;
  const bool recent = clock::now() - it->second < released_trust;
  released_endpoints.erase(it);
  return recent;
}

}  // namespace

zmq::context_t& context() {
  // Heap-allocated and leaked on purpose: no static-destruction order problems with sockets that
  // outlive main(). ZeroMQ is not fork-safe, so a forked child gets its own context and leaves
  // the inherited one (whose I/O threads do not exist in the child) untouched.
  static std::mutex mutex;
  static zmq::context_t* ctx = nullptr;
  static pid_t owner = -1;
  std::lock_guard lock(mutex);
  const pid_t self = ::getpid();
  if (ctx == nullptr || owner != self) {
    try {
      ctx = new zmq::context_t(1);
    } catch (const zmq::error_t& e) {
      throw error(errc::io, fmt::format("cannot create the ZeroMQ context: {}", zmq_reason(e)));
    }
    owner = self;
  }
  return *ctx;
}

// ------------------------------------------------------------------------------------ CURVE

namespace {

/// The process's ZAP handler (ZeroMQ's authentication protocol, RFC 27): a thread answering
/// inproc://zeromq.zap.01 that admits a CURVE client to a receiver socket only when its public key
/// is on that socket's list. Each receiver with a list gets its own ZAP domain; other CURVE
/// sockets (domain "") are admitted as without a handler. Made on first use, never destroyed (as
/// the context), and made afresh in a forked child, whose copy has no thread.
class zap_authority {
 public:
  static zap_authority& instance() {
    static std::mutex mutex;
    static zap_authority* self = nullptr;
    static pid_t owner = -1;
    std::lock_guard lock(mutex);
    if (self == nullptr || owner != ::getpid()) {
      self = new zap_authority();  // leaked on purpose, like the context
      owner = ::getpid();
    }
    return *self;
  }

  /// Registers a list of Z85 public keys; returns the domain to set on the socket.
  std::string add(const std::vector<std::string>& keys) {
    std::lock_guard lock(mutex_);
    std::string domain = fmt::format("refit-{}", next_++);
    domains_.emplace(domain, std::set<std::string>(keys.begin(), keys.end()));
    return domain;
  }
  void remove(const std::string& domain) noexcept {
    std::lock_guard lock(mutex_);
    domains_.erase(domain);
  }

 private:
  zap_authority() : socket_(context(), zmq::socket_type::rep) {
    // Bound before any receiver socket exists, so that no handshake slips past it.
    socket_.bind("inproc://zeromq.zap.01");
    std::thread([this] { serve(); }).detach();
  }

  void serve() noexcept {
    for (;;) {
      try {
        std::vector<zmq::message_t> request;
        if (!zmq::recv_multipart(socket_, std::back_inserter(request))) continue;
        if (request.size() < 6) continue;
        const std::string request_id = request[1].to_string();
        const std::string domain = request[2].to_string();
        const std::string mechanism = request[5].to_string();
        bool allowed = domain.empty();  // not one of ours: as if there were no handler
        std::string client;
        if (!allowed && mechanism == "CURVE" && request.size() >= 7 && request[6].size() == 32) {
          char z85[41] = {};
          zmq_z85_encode(z85, static_cast<const std::uint8_t*>(request[6].data()), 32);
          client = z85;
          std::lock_guard lock(mutex_);
          const auto it = domains_.find(domain);
          allowed = it != domains_.end() && it->second.contains(client);
        }
        if (!allowed)
          REFIT_WARN("refused a CURVE client{} (not in receiver_options.curve.allowed_clients)",
                     client.empty() ? std::string() : " with public key " + client);
        std::array<zmq::const_buffer, 6> reply = {
            zmq::str_buffer("1.0"),
            zmq::buffer(request_id),
            zmq::buffer(std::string_view(allowed ? "200" : "400")),
            zmq::buffer(std::string_view(allowed ? "OK" : "client key not allowed")),
            zmq::str_buffer(""),
            zmq::str_buffer("")};
        zmq::send_multipart(socket_, reply);
      } catch (...) {
        // Keep serving: a failed reply only fails that one handshake.
      }
    }
  }

  zmq::socket_t socket_;
  std::mutex mutex_;
  std::map<std::string, std::set<std::string>> domains_;
  std::uint64_t next_ = 0;
};

}  // namespace

/// CURVE key `key` (Z85 text) as its 32 bytes; throws errc::invalid_argument naming `option`.
static std::array<std::uint8_t, 32> z85_key(const std::string& key, std::string_view option) {
  std::array<std::uint8_t, 32> raw{};
  if (key.size() != 40 || zmq_z85_decode(raw.data(), key.c_str()) == nullptr)
    throw error(errc::invalid_argument,
                fmt::format("{} is not a CURVE key: expected 40 characters of Z85 text (zmq_curve_keypair)", option));
  return raw;
}

/// The receiver's CURVE keys as its ZMTP server takes them (binary); `curve` was validated.
static std::shared_ptr<const zmtp::curve_server_keys> server_keys(const curve_keys& curve) {
  auto keys = std::make_shared<zmtp::curve_server_keys>();
  keys->secret_key = z85_key(curve.secret_key, "receiver_options.curve.secret_key");
  char pub[41] = {};
  if (zmq_curve_public(pub, curve.secret_key.c_str()) != 0)
    throw error(errc::invalid_argument, "receiver_options.curve.secret_key makes no public key");
  keys->public_key = z85_key(pub, "receiver_options.curve.secret_key's public key");
  for (const auto& client : curve.allowed_clients)
    keys->allowed.push_back(z85_key(client, "an entry of receiver_options.curve.allowed_clients"));
  return keys;
}

void validate_curve(const curve_keys& curve, bool server) {
  const bool any = !curve.public_key.empty() || !curve.secret_key.empty() || !curve.server_key.empty() ||
                   !curve.allowed_clients.empty();
  if (!any) return;
  if (server) {
    if (curve.secret_key.empty())
      throw error(errc::invalid_argument,
                  "receiver_options.curve has no secret_key: a CURVE receiver needs its secret key (the "
                  "streamers get its public key as their server_key)");
    z85_key(curve.secret_key, "receiver_options.curve.secret_key");
    for (const auto& key : curve.allowed_clients) z85_key(key, "an entry of receiver_options.curve.allowed_clients");
    if (!curve.public_key.empty()) {
      z85_key(curve.public_key, "receiver_options.curve.public_key");
      char derived[41] = {};
      if (zmq_curve_public(derived, curve.secret_key.c_str()) != 0 || curve.public_key != derived)
        throw error(errc::invalid_argument,
                    "receiver_options.curve.public_key does not belong to its secret_key: give the pair that "
                    "zmq_curve_keypair made together");
    }
    return;
  }
  for (const auto& [key, option] : {std::pair{&curve.public_key, "streamer_options.curve.public_key"},
                                    std::pair{&curve.secret_key, "streamer_options.curve.secret_key"},
                                    std::pair{&curve.server_key, "streamer_options.curve.server_key"}}) {
    if (key->empty())
      throw error(errc::invalid_argument,
                  fmt::format("{} is empty: a CURVE streamer needs its own key pair and the receiver's public key "
                              "(server_key)",
                              option));
    z85_key(*key, option);
  }
}

// ------------------------------------------------------------------------------------ rep_channel

bool loopback_only(std::string_view endpoint) {
  if (endpoint.starts_with("ipc://") || endpoint.starts_with("inproc://")) return true;
  if (!endpoint.starts_with("tcp://")) return false;
  std::string_view host = endpoint.substr(6);
  if (host.starts_with("[")) {
    host = host.substr(1, host.find(']') == std::string_view::npos ? host.npos : host.find(']') - 1);
  } else if (const auto colon = host.rfind(':'); colon != std::string_view::npos) {
    host = host.substr(0, colon);
  }
  if (const auto semi = host.find(';'); semi != std::string_view::npos) host = host.substr(semi + 1);  // source;dest
  return host.starts_with("127.") || host == "::1" || host == "localhost" || host == "lo";
}

bool insecure_allowed_by_env() noexcept {
  const char* v = std::getenv("REFIT_ALLOW_INSECURE");
  return v != nullptr && std::string_view(v) == "1";
}

rep_channel::rep_channel(std::string_view endpoint, const curve_keys& curve, bool allow_insecure) {
  open(endpoint, curve, allow_insecure, zmtp::default_options());
}

rep_channel::rep_channel(std::string_view endpoint, const zmtp::options& o) { open(endpoint, {}, false, o); }

void rep_channel::open(std::string_view endpoint, const curve_keys& curve, bool allow_insecure,
                       const zmtp::options& o) {
  validate_curve(curve, true);
  const std::string target = bind_endpoint(endpoint);
  const bool owns = endpoint.empty();
  if (curve.secret_key.empty() && !loopback_only(target) && !allow_insecure && !insecure_allowed_by_env())
    throw error(errc::invalid_argument,
                fmt::format("refusing to bind the receiver to {} without CURVE: other hosts could reach it and "
                            "every byte (the session token included) would cross the network in the clear. Set "
                            "receiver_options.curve (a key pair from zmq_curve_keypair; give the streamers its "
                            "public key as server_key), bind a loopback address (tcp://127.0.0.1:PORT), or, on a "
                            "network you trust, set receiver_options.allow_insecure_tcp or REFIT_ALLOW_INSECURE=1",
                            target));
  if (!released_here(target) && ipc_endpoint_in_use(target)) {
    if (owns) remove_private_endpoint(target);
    throw error(errc::io, fmt::format("cannot bind the receiver to {}: another process is serving it already "
                                      "(Address already in use)",
                                      target));
  }
  // The receiver reads ZMTP itself (zmtp.hpp), NULL or CURVE. An endpoint its server does not bind
  // (an interface or host name, an abstract ipc name) stays with libzmq's ROUTER.
  if (zmtp::server::handles(target)) {
    zmtp::options limits = o;
    limits.max_body = static_cast<std::uint64_t>(max_message_bytes);
    if (!curve.secret_key.empty()) limits.curve = server_keys(curve);
    try {
      server_ = std::make_unique<zmtp::server>(target, limits);
    } catch (...) {
      if (owns) remove_private_endpoint(target);
      throw;
    }
    endpoint_ = server_->endpoint();
  } else {
    open_zmq(target, curve, owns);
  }
  owns_endpoint_ = owns;
}

void rep_channel::open_zmq(const std::string& target, const curve_keys& curve, bool owns) {
  try {
    socket_ = std::make_unique<zmq::socket_t>(context(), zmq::socket_type::router);
    socket_->set(zmq::sockopt::linger, 0);
    socket_->set(zmq::sockopt::maxmsgsize, max_message_bytes);
    socket_->set(zmq::sockopt::rcvhwm, receiver_rcvhwm);
    socket_->set(zmq::sockopt::heartbeat_ivl, heartbeat_ivl_ms);
    socket_->set(zmq::sockopt::heartbeat_timeout, heartbeat_timeout_ms);
    socket_->set(zmq::sockopt::handshake_ivl, handshake_ivl_ms);
    if (!curve.allowed_clients.empty()) {
      auto& authority = zap_authority::instance();
      const std::string domain = authority.add(curve.allowed_clients);
      zap_ = std::shared_ptr<const void>(nullptr, [&authority, domain](const void*) { authority.remove(domain); });
      socket_->set(zmq::sockopt::zap_domain, domain);
    }
    set_curve_server(*socket_, curve);
  } catch (const zmq::error_t& e) {
    socket_.reset();
    if (owns) remove_private_endpoint(target);
    throw error(errc::io, fmt::format("cannot create the receiver socket for {}: {}", target, zmq_reason(e)));
  }
  try {
    socket_->bind(target);
  } catch (const zmq::error_t& e) {
    socket_.reset();
    if (owns) remove_private_endpoint(target);
    throw error(errc::io, fmt::format("cannot bind the receiver to {}: {}; is another receiver already "
                                      "serving it, or is the directory missing?",
                                      target, zmq_reason(e)));
  }
  try {
    endpoint_ = socket_->get(zmq::sockopt::last_endpoint);
  } catch (const zmq::error_t&) {
    endpoint_ = target;
  }
  if (endpoint_.empty()) endpoint_ = target;
}

rep_channel::~rep_channel() {
  if (socket_) note_released(endpoint_);
  socket_.reset();
  server_.reset();
  zap_.reset();
  if (owns_endpoint_) remove_private_endpoint(endpoint_);
}

rep_channel::rep_channel(rep_channel&& other) noexcept
    : zap_(std::move(other.zap_)),
      socket_(std::move(other.socket_)),
      server_(std::move(other.server_)),
      endpoint_(std::move(other.endpoint_)),
      owns_endpoint_(other.owns_endpoint_),
      lane_(std::move(other.lane_)),
      answer_lane_(std::move(other.answer_lane_)),
      lane_heard_(other.lane_heard_),
      answer_to_(std::exchange(other.answer_to_, std::string())),
      lane_gone_(std::exchange(other.lane_gone_, false)),
      dropped_(other.dropped_) {
  other.endpoint_.clear();
  other.owns_endpoint_ = false;
}

rep_channel& rep_channel::operator=(rep_channel&& other) noexcept {
  if (this != &other) {
    socket_.reset();
    server_.reset();
    if (owns_endpoint_) remove_private_endpoint(endpoint_);
    socket_ = std::move(other.socket_);
    server_ = std::move(other.server_);
    zap_ = std::move(other.zap_);
    endpoint_ = std::move(other.endpoint_);
    owns_endpoint_ = other.owns_endpoint_;
    lane_ = std::move(other.lane_);
    answer_lane_ = std::move(other.answer_lane_);
    lane_heard_ = other.lane_heard_;
    answer_to_ = std::exchange(other.answer_to_, std::string());
    lane_gone_ = std::exchange(other.lane_gone_, false);
    dropped_ = other.dropped_;
    other.endpoint_.clear();
    other.owns_endpoint_ = false;
  }
  return *this;
}

std::optional<std::string> rep_channel::receive(std::chrono::milliseconds wait, bool soon) {
  if (!is_open()) throw error(errc::internal, "receive() on a moved-from rep_channel");
  rep_channel* self = this;
  const auto deadline = clock::now() + (wait.count() < 0 ? std::chrono::milliseconds(0) : wait);
  if (!wait_ready({&self, 1}, deadline, soon ? spin_before_blocking : std::chrono::microseconds{0}))
    return std::nullopt;
  return take();
}

std::optional<std::string> rep_channel::take() {
  if (lane_ && !lane_->ready() && lane_->streamer_gone()) {
    // Its streamer ended (or let go of it) with nothing more to say: the receiver hears it now
    // (lane_gone()) instead of at its idle timeout.
    REFIT_INFO("the streamer of the control lane on {} is gone (its process ended or it closed the lane)", endpoint_);
    lane_.reset();
    lane_gone_ = true;
    return std::nullopt;
  }
  if (lane_ && lane_->ready()) {
    std::optional<std::string> msg;
    try {
      msg = lane_->receive(clock::now(), std::chrono::microseconds{0});
    } catch (const error& e) {
      // The streamer broke off (or broke) the lane: drop it; the streamer's next session says
      // HELLO through ZeroMQ and gets a new one.
      REFIT_WARN("the control lane on {} failed and was closed: {}", endpoint_, e.what());
      lane_.reset();
      return std::nullopt;
    }
    if (!msg) return std::nullopt;
    lane_->request_taken();
    if (!lane_heard_) {
      lane_->remove_files();  // the streamer has it open: nobody else needs the files
      lane_heard_ = true;
    }
    answer_lane_ = lane_;
    answer_to_.clear();
    return msg;
  }
  try {
    auto msg = take_from_socket();
    if (msg) answer_lane_.reset();
    return msg;
  } catch (const zmq::error_t& e) {
    throw error(errc::io, fmt::format("receiving a request on {} failed: {}", endpoint_, zmq_reason(e)));
  }
}

std::optional<std::string> rep_channel::take_from_socket() {
  if (server_) return server_->take(answer_to_);  // it dropped and counted the malformed ones
  // ZeroMQ delivers a multipart message whole or not at all, so every frame of one is here.
  for (;;) {
    zmq::message_t id;
    if (!socket_->recv(id, zmq::recv_flags::dontwait)) return std::nullopt;
    // A REQ's request: [routing id] [empty delimiter] [body], nothing after.
    zmq::message_t frame;
    bool more = id.more();
    bool good = more;
    std::size_t frames = 1;
    std::optional<std::string> body;
    while (more) {
      if (!socket_->recv(frame, zmq::recv_flags::dontwait)) break;  // cannot happen: the message is whole
      more = frame.more();
      ++frames;
      if (frames == 2) {
        good = good && frame.size() == 0 && more;
      } else if (frames == 3) {
        good = good && !more;
        if (good) body = frame.to_string();
      } else {
        good = false;
      }
    }
    if (good && body) {
      answer_to_ = id.to_string();  // never empty: ZeroMQ gives every connection an id
      return body;
    }
    // Dropped whole and unanswered: a reply would reach no REQ, or the wrong one.
    ++dropped_;
    if (std::has_single_bit(dropped_))  // 1, 2, 4, 8, ...: a flood does not flood the log
      REFIT_WARN(
          "dropped a message of {} frame(s) on {} that is not a request (a REQ's is a delimiter and one "
          "body frame); {} dropped so far",
          frames - 1, endpoint_, dropped_);
  }
}

std::optional<std::size_t> rep_channel::wait_any(std::span<rep_channel* const> channels, std::chrono::milliseconds wait,
                                                 bool soon) {
  for (rep_channel* c : channels)
    if (!c->is_open()) throw error(errc::internal, "wait_any() on a moved-from rep_channel");
  if (channels.empty()) return std::nullopt;
  const auto deadline = clock::now() + (wait.count() < 0 ? std::chrono::milliseconds(0) : wait);
  return wait_ready(channels, deadline, soon ? spin_before_blocking : std::chrono::microseconds{0});
}

namespace {

short to_zmq_events(short events) {
  return static_cast<short>(((events & POLLIN) != 0 ? ZMQ_POLLIN : 0) | ((events & POLLOUT) != 0 ? ZMQ_POLLOUT : 0));
}

short from_zmq_events(short revents) {
  return static_cast<short>(((revents & ZMQ_POLLIN) != 0 ? POLLIN : 0) | ((revents & ZMQ_POLLOUT) != 0 ? POLLOUT : 0) |
                            ((revents & ZMQ_POLLERR) != 0 ? POLLERR : 0));
}

}  // namespace

bool rep_channel::poll_once(std::span<rep_channel* const> channels, clock::time_point until, bool with_lanes,
                            poll_state& st) {
  // The ZMTP servers' descriptors, then (when asleep) the lanes' doorbells and hang-up descriptors
  // (POLLHUP once the lane's streamer is gone: see lane::streamer_gone()); libzmq sockets apart.
  st.fds.clear();
  st.slices.clear();
  st.sockets.clear();
  for (rep_channel* c : channels) {
    const std::size_t from = st.fds.size();
    if (c->server_) c->server_->poll_fds(st.fds);
    st.slices.emplace_back(from, st.fds.size());
    if (c->socket_) st.sockets.push_back(zmq::pollitem_t{c->socket_->handle(), 0, ZMQ_POLLIN, 0});
  }
  if (with_lanes) {
    for (rep_channel* c : channels) {
      if (!c->lane_) continue;
      st.fds.push_back(pollfd{c->lane_->doorbell(), POLLIN, 0});
      if (c->lane_->hangup() >= 0) st.fds.push_back(pollfd{c->lane_->hangup(), 0, 0});
    }
  }
  const int timeout = remaining_ms(until);
  int n = 0;
  if (st.sockets.empty()) {
    n = ::poll(st.fds.data(), st.fds.size(), timeout);
    if (n < 0 && errno != EINTR) throw poll_failure(channels, errno_reason(errno));
  } else {
    // zmq_poll takes raw descriptors beside its sockets.
    std::vector<zmq::pollitem_t>& items = st.sockets;
    const std::size_t sockets = items.size();
    for (const pollfd& p : st.fds) items.push_back(zmq::pollitem_t{nullptr, p.fd, to_zmq_events(p.events), 0});
    try {
      n = zmq::poll(items.data(), items.size(), std::chrono::milliseconds(timeout));
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) throw poll_failure(channels, zmq_reason(e));
    }
    for (std::size_t k = 0; k < st.fds.size(); ++k) st.fds[k].revents = from_zmq_events(items[sockets + k].revents);
    items.resize(sockets);
  }
  for (std::size_t k = 0; k < channels.size(); ++k)
    if (channels[k]->server_)
      channels[k]->server_->service(
          std::span(st.fds).subspan(st.slices[k].first, st.slices[k].second - st.slices[k].first));
  return n > 0;
}

error rep_channel::poll_failure(std::span<rep_channel* const> channels, const std::string& reason) {
  return error(errc::io, fmt::format("waiting for a request on {} failed: {}",
                                     channels.size() == 1 ? channels.front()->endpoint_
                                                          : fmt::format("{} endpoints", channels.size()),
                                     reason));
}

std::optional<std::size_t> rep_channel::wait_ready(std::span<rep_channel* const> channels, clock::time_point deadline,
                                                   std::chrono::microseconds spin) {
  std::vector<lane*> lanes;
  for (rep_channel* c : channels)
    if (c->lane_) lanes.push_back(c->lane_.get());
  poll_state st;
  // A request is ready: on a lane (asked first: a load), queued by a ZMTP server, or on a libzmq
  // socket (as the last poll found it). The first channel in order wins (wait_any's fairness).
  const auto ready = [&](bool polled) -> std::optional<std::size_t> {
    for (std::size_t k = 0; k < channels.size(); ++k)
      if (channels[k]->lane_ && channels[k]->lane_->ready()) return k;
    for (std::size_t k = 0, s = 0; k < channels.size(); ++k) {
      if (channels[k]->server_ && channels[k]->server_->ready()) return k;
      if (channels[k]->socket_ && polled && (st.sockets[s++].revents & ZMQ_POLLIN) != 0) return k;
    }
    return std::nullopt;
  };
  const auto lane_hung_up = [&]() -> std::optional<std::size_t> {
    for (std::size_t k = 0; k < channels.size(); ++k)
      if (channels[k]->lane_ && channels[k]->lane_->streamer_gone()) return k;
    return std::nullopt;
  };
  // When the servers need serving without I/O (a heartbeat, a timeout), or the deadline.
  const auto wake = [&] {
    auto t = deadline;
    for (rep_channel* c : channels)
      if (c->server_) t = std::min(t, c->server_->next_timer());
    return t;
  };
  // Until when a streamer's announcement (lane::announce: a request comes soon) holds the wait
  // spinning, whatever `spin` says; at most the deadline.
  const auto held = [&] {
    auto t = clock::time_point{};
    for (lane* l : lanes) t = std::max(t, l->awake_until());
    return std::min(deadline, t);
  };
  auto spin_until = std::min(deadline, clock::now() + spin);
  std::uint32_t turn = 0;
  for (;;) {
    for (rep_channel* c : channels)
      if (c->server_) c->server_->pump();
    if (const auto k = ready(false)) return k;
    const auto now = clock::now();
    if (now < spin_until || now < held()) {
      // Spinning: a lane is asked at every turn, the sockets at every eighth when there is one (a
      // system call).
      if ((lanes.empty() || turn++ % 8 == 0) && poll_once(channels, clock::now(), false, st))
        if (const auto k = ready(true)) return k;
      std::this_thread::yield();
      continue;
    }
    for (lane* l : lanes) l->arm();
    if (const auto k = ready(false)) {
      for (lane* l : lanes) l->disarm();
      return k;
    }
    const bool any = poll_once(channels, wake(), true, st);
    for (lane* l : lanes) l->disarm();
    if (const auto k = ready(true)) return k;
    if (any)
      if (const auto k = lane_hung_up()) return k;  // take() reports it
    if (clock::now() >= deadline) return std::nullopt;
    // Woken with nothing to take: a streamer saying a request comes soon (req_channel::
    // wake_receiver), so spin again: it then finds this side awake.
    if (any && spin.count() > 0) spin_until = std::min(deadline, clock::now() + spin);
  }
}

void req_channel::wake_receiver() noexcept {
  if (lane_) lane_->wake_peer();
}

bool req_channel::announce(std::chrono::milliseconds hold) noexcept {
  if (!lane_) return false;
  lane_->announce(hold);
  return true;
}

bool req_channel::receiver_asleep() const noexcept { return lane_ && lane_->peer_asleep(); }

void rep_channel::reply(std::string_view bytes) {
  if (!is_open()) throw error(errc::internal, "reply() on a moved-from rep_channel");
  if (answer_lane_) {
    const std::shared_ptr<lane> through = std::exchange(answer_lane_, nullptr);
    if (through->send(bytes, clock::now() + std::chrono::milliseconds(reply_send_timeout_ms),
                      std::chrono::microseconds{0}))
      return;
    REFIT_WARN("reply on {} not taken through the control lane within {} ms (the streamer is gone?); dropped",
               endpoint_, reply_send_timeout_ms);
    if (through == lane_) lane_.reset();  // a message left half-way: the lane cannot be used again
    return;
  }
  if (answer_to_.empty()) {
    REFIT_WARN("reply on {} without a request in hand; dropped", endpoint_);
    return;
  }
  const std::string to = std::exchange(answer_to_, std::string());
  if (server_) {
    if (!server_->reply(to, bytes)) REFIT_WARN("reply on {} dropped: its connection is gone", endpoint_);
    return;
  }
  try {
    // To the connection the request came from: a ROUTER drops what it cannot route (the peer is
    // gone, or its queue is full) instead of blocking, and never sends it to another peer.
    const auto flags = zmq::send_flags::sndmore | zmq::send_flags::dontwait;
    const bool sent = socket_->send(zmq::buffer(to.data(), to.size()), flags) &&
                      socket_->send(zmq::const_buffer(nullptr, 0), flags) &&
                      socket_->send(zmq::buffer(bytes.data(), bytes.size()), zmq::send_flags::dontwait);
    if (!sent) REFIT_WARN("reply on {} could not be queued (the streamer is gone?); dropped", endpoint_);
  } catch (const zmq::error_t& e) {
    // A vanished peer is not an error of the receiver: the streamer times out and starts over.
    REFIT_WARN("reply on {} dropped: {}", endpoint_, zmq_reason(e));
  }
}

void rep_channel::attach_lane(std::unique_ptr<lane> l) {
  if (lane_) lane_->close();  // its streamer hears it at its next request, and says HELLO again
  lane_ = std::move(l);
  lane_heard_ = false;
}

// ------------------------------------------------------------------------------------ req_channel

req_channel::req_channel(std::string endpoint, const curve_keys& curve)
    : endpoint_(std::move(endpoint)), curve_(curve) {
  if (endpoint_.empty())
    throw error(errc::invalid_argument, "the streamer needs the receiver's endpoint (ipc://... or tcp://host:port)");
  validate_curve(curve_, false);
  connect();
}

req_channel::~req_channel() = default;
req_channel::req_channel(req_channel&&) noexcept = default;
req_channel& req_channel::operator=(req_channel&&) noexcept = default;

void req_channel::connect() {
  try {
    auto s = std::make_unique<zmq::socket_t>(context(), zmq::socket_type::req);
    s->set(zmq::sockopt::linger, 0);
    s->set(zmq::sockopt::reconnect_ivl, reconnect_ivl_ms);
    s->set(zmq::sockopt::reconnect_ivl_max, reconnect_ivl_max_ms);
    s->set(zmq::sockopt::maxmsgsize, max_message_bytes);
    set_curve_client(*s, curve_);
    s->connect(endpoint_);
    socket_ = std::move(s);
  } catch (const zmq::error_t& e) {
    throw error(errc::io, fmt::format("cannot connect to the receiver at {}: {}", endpoint_, zmq_reason(e)));
  }
}

void req_channel::reset() {
  lane_.reset();
  socket_.reset();
  ++resets_;
  connect();
}

namespace {

/// The failure of a request step: rebuilds the socket (so the next session can start) and says
/// what happened and what to check.
error request_failure(req_channel& ch, errc code, std::string message) {
  try {
    ch.reset();
  } catch (const error& e) {
    message += fmt::format(" (reconnecting failed too: {})", e.what());
  }
  return error(code, message);
}

std::string timeout_message(std::string_view doing, const std::string& endpoint, std::string_view what,
                            std::chrono::milliseconds timeout, clock::time_point start) {
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - start).count();
  return fmt::format(
      "{} the receiver at {} to {} within {} ms (waited {} ms): is the generation process alive and serving "
      "this endpoint? The session was reset; the next refit starts with HELLO",
      doing, endpoint, what, timeout.count(), waited);
}

}  // namespace

void req_channel::attach_lane(std::unique_ptr<lane> l) { lane_ = std::move(l); }

std::shared_ptr<fd_link> req_channel::fds() const { return lane_ ? lane_->fds() : nullptr; }

void req_channel::send(std::string_view bytes, std::chrono::milliseconds timeout, std::string_view what) {
  if (!socket_) connect();
  const auto start = clock::now();
  const auto deadline = start + std::max(timeout, std::chrono::milliseconds(0));
  if (lane_) {
    // The slot is free unless a long message is still being taken, chunk by chunk.
    bool sent = false;
    try {
      sent = lane_->send(bytes, deadline, spin_before_blocking);
    } catch (const error& e) {
      if (e.code() != errc::peer)
        throw request_failure(*this, e.code(),
                              fmt::format("sending {} to the receiver at {} through the control lane failed: {}", what,
                                          endpoint_, e.what()));
      // The lane's receiver closed it (a new session) or ended: nothing was delivered, and the
      // request goes through ZeroMQ as it would without a lane, to whoever serves the endpoint
      // now (a restarted receiver answers that it has no session, and the streamer says HELLO).
      REFIT_DEBUG("{} goes through ZeroMQ: {}", what, e.what());
      lane_.reset();
    }
    if (lane_) {
      if (!sent)
        throw request_failure(
            *this, errc::timeout,
            timeout_message("could not send through the control lane to", endpoint_, what, timeout, start));
      return;
    }
  }
  try {
    socket_->set(zmq::sockopt::sndtimeo, std::max(remaining_ms(deadline), 1));
    if (!socket_->send(zmq::buffer(bytes.data(), bytes.size()), zmq::send_flags::none))
      throw request_failure(*this, errc::timeout,
                            timeout_message("could not send to", endpoint_, what, timeout, start));
  } catch (const zmq::error_t& e) {
    // The socket may be stuck in the middle of a request (EFSM); rebuild it so the next one works.
    throw request_failure(*this, errc::io,
                          fmt::format("sending {} to the receiver at {} failed: {}; the session was reset", what,
                                      endpoint_, zmq_reason(e)));
  }
}

std::string req_channel::receive(std::chrono::milliseconds timeout, std::string_view what) {
  if (!socket_) throw error(errc::internal, "req_channel::receive() without a send()");
  const auto start = clock::now();
  const auto deadline = start + std::max(timeout, std::chrono::milliseconds(0));
  if (lane_) {
    std::optional<std::string> reply;
    try {
      reply = lane_->receive(deadline, spin_before_blocking);
    } catch (const error& e) {
      throw request_failure(*this, e.code(),
                            fmt::format("receiving the reply to {} from the receiver at {} through the control lane "
                                        "failed: {}; the session was reset",
                                        what, endpoint_, e.what()));
    }
    if (!reply)
      throw request_failure(*this, errc::timeout, timeout_message("no reply from", endpoint_, what, timeout, start));
    return std::move(*reply);
  }
  try {
    zmq::message_t msg;
    if (!poll_until(*socket_, ZMQ_POLLIN, deadline, spin_before_blocking) ||
        !socket_->recv(msg, zmq::recv_flags::dontwait))
      throw request_failure(*this, errc::timeout, timeout_message("no reply from", endpoint_, what, timeout, start));
    return msg.to_string();
  } catch (const zmq::error_t& e) {
    throw request_failure(*this, errc::io,
                          fmt::format("receiving the reply to {} from the receiver at {} failed: {}; the session "
                                      "was reset",
                                      what, endpoint_, zmq_reason(e)));
  }
}

bool req_channel::reply_ready() noexcept {
  if (lane_) return lane_->ready();
  if (!socket_) return false;
  try {
    return (socket_->get(zmq::sockopt::events) & ZMQ_POLLIN) != 0;
  } catch (const zmq::error_t&) {
    return false;
  }
}

std::string req_channel::request(std::string_view bytes, std::chrono::milliseconds timeout, std::string_view what) {
  const auto start = clock::now();
  const auto deadline = start + std::max(timeout, std::chrono::milliseconds(0));
  send(bytes, timeout, what);
  try {
    return receive(
        std::max(std::chrono::milliseconds(1), std::chrono::ceil<std::chrono::milliseconds>(deadline - clock::now())),
        what);
  } catch (const error& e) {
    if (e.code() != errc::timeout) throw;
    // receive() reset the socket already; report the caller's whole deadline, not what was left.
    throw error(errc::timeout, timeout_message("no reply from", endpoint_, what, timeout, start));
  }
}

}  // namespace refit::channel
