// refit — the receiver's ZMTP 3.x server (NULL and CURVE mechanisms): the decoder of one connection's
// bytes and the non-blocking server around it. See zmtp.hpp for what it bounds and why.
#include "channel/zmtp.hpp"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <sodium.h>
#include <zmq.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <new>
#include <utility>

#include "model/log.hpp"
#include "model/text.hpp"
#include "refit/error.hpp"

namespace refit::channel::zmtp {
namespace {

constexpr std::uint8_t flag_more = 0x01;
constexpr std::uint8_t flag_long = 0x02;
constexpr std::uint8_t flag_command = 0x04;
constexpr std::size_t mechanism_at = 12;  ///< the greeting's mechanism field: 20 bytes
constexpr std::size_t mechanism_bytes = 20;
/// A body announced at least this large is kept in memory mapped for it (see body_buffer).
constexpr std::uint64_t map_from = 1 << 20;
/// Connections accepted in one service() (the rest wait in the backlog for the next).
constexpr int accepts_per_pass = 64;
/// Bytes read from one connection in one service(), so that one busy peer does not starve others.
constexpr std::size_t read_budget = 4 * read_chunk;
/// After accept() ran out of descriptors: how long the listener rests before it is polled again.
constexpr std::chrono::milliseconds accept_rest{100};
constexpr int listen_backlog = 100;  // libzmq's ZMQ_BACKLOG default

std::mutex defaults_mutex;
options defaults;

std::atomic<std::uint64_t> next_connection{1};

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return (x >= 'A' && x <= 'Z' ? x + 32 : x) == (y >= 'A' && y <= 'Z' ? y + 32 : y);
         });
}

std::string errno_text(int e) { return fmt::format("{} (errno {})", std::strerror(e), e); }

void append_be(std::string& out, std::uint64_t v, int bytes) {
  for (int i = bytes - 1; i >= 0; --i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void append_frame_header(std::string& out, std::uint64_t size, std::uint8_t flags) {
  if (size > 255) {
    out.push_back(static_cast<char>(flags | flag_long));
    append_be(out, size, 8);
  } else {
    out.push_back(static_cast<char>(flags));
    out.push_back(static_cast<char>(size));
  }
}

}  // namespace

options default_options() {
  const std::lock_guard lock(defaults_mutex);
  return defaults;
}

scoped_default_options::scoped_default_options(const options& o) {
  const std::lock_guard lock(defaults_mutex);
  previous_ = std::exchange(defaults, o);
}

scoped_default_options::~scoped_default_options() {
  const std::lock_guard lock(defaults_mutex);
  defaults = previous_;
}

// ------------------------------------------------------------------------------------ encoding

std::string greeting(bool curve) {
  std::string g(greeting_bytes, '\0');
  g[0] = '\xff';
  g[9] = '\x7f';
  g[10] = 3;  // ZMTP 3.1
  g[11] = 1;
  if (curve)
    std::memcpy(g.data() + mechanism_at, "CURVE", 5);
  else
    std::memcpy(g.data() + mechanism_at, "NULL", 4);
  g[32] = 1;  // as-server
  return g;
}

std::string command_body(std::string_view name, std::string_view data) {
  std::string body;
  body.push_back(static_cast<char>(name.size()));
  body.append(name);
  body.append(data);
  return body;
}

std::string command(std::string_view name, std::string_view data) {
  const std::string body = command_body(name, data);
  std::string out;
  append_frame_header(out, body.size(), flag_command);
  return out + body;
}

namespace {
std::string socket_type_property(std::string_view socket_type) {
  std::string props;
  constexpr std::string_view key = "Socket-Type";
  props.push_back(static_cast<char>(key.size()));
  props.append(key);
  append_be(props, socket_type.size(), 4);
  props.append(socket_type);
  return props;
}
}  // namespace

std::string ready_frame(std::string_view socket_type) { return command("READY", socket_type_property(socket_type)); }

std::string reply_header(std::uint64_t body_bytes) {
  std::string out;
  append_frame_header(out, 0, flag_more);
  append_frame_header(out, body_bytes, 0);
  return out;
}

// ------------------------------------------------------------------------------------ decoder

/// A request's body as it arrives. Bodies announced below map_from live in a std::string that grows
/// by doubling up to the announced size; larger ones in an anonymous mapping grown by mremap, so
/// that a peer that announces 64 MiB and sends little holds only what it sent, and what a dropped
/// peer held goes back to the system at once (freed heap memory may stay with the process).
class decoder::body_buffer {
 public:
  explicit body_buffer(std::uint64_t announced) : announced_(announced) {}
  ~body_buffer() {
    if (map_ != nullptr) ::munmap(map_, mapped_);
  }
  body_buffer(const body_buffer&) = delete;
  body_buffer& operator=(const body_buffer&) = delete;

  void append(std::span<const std::uint8_t> bytes) {
    if (announced_ < map_from) {
      if (small_.capacity() < small_.size() + bytes.size())
        small_.reserve(std::min<std::uint64_t>(
            announced_, std::max({small_.capacity() * 2, small_.size() + bytes.size(), std::size_t{4096}})));
      small_.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      return;
    }
    if (size_ + bytes.size() > mapped_) grow(size_ + bytes.size());
    std::memcpy(static_cast<char*>(map_) + size_, bytes.data(), bytes.size());
    size_ += bytes.size();
  }
  /// Bytes [from, from + n) of what arrived (all of it by default), moved out.
  std::string take(std::size_t from = 0, std::size_t n = std::string::npos) {
    if (announced_ < map_from) {
      if (from == 0 && n >= small_.size()) return std::move(small_);
      return small_.substr(from, n);
    }
    std::string out(static_cast<const char*>(map_) + from, std::min(n, size_ - from));
    ::munmap(map_, mapped_);
    map_ = nullptr;
    mapped_ = size_ = 0;
    return out;
  }
  [[nodiscard]] std::uint8_t* data() noexcept {
    return reinterpret_cast<std::uint8_t*>(announced_ < map_from ? small_.data() : static_cast<char*>(map_));
  }
  [[nodiscard]] std::size_t held() const noexcept { return announced_ < map_from ? small_.capacity() : mapped_; }

 private:
  void grow(std::size_t need) {
    const std::size_t page = 4096;
    std::size_t want = std::max<std::size_t>(need, mapped_ == 0 ? map_from : mapped_ * 2);
    want = std::min<std::size_t>(want, announced_);
    want = (want + page - 1) / page * page;
    void* p = map_ == nullptr ? ::mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                              : ::mremap(map_, mapped_, want, MREMAP_MAYMOVE);
    if (p == MAP_FAILED) throw std::bad_alloc();
    map_ = p;
    mapped_ = want;
  }

  std::uint64_t announced_;
  std::string small_;
  void* map_ = nullptr;
  std::size_t mapped_ = 0;
  std::size_t size_ = 0;
};

/// A CURVE connection's state: the handshake's progress, the keys of this connection, the nonces.
struct decoder::curve_state {
  std::shared_ptr<const curve_server_keys> keys;
  bool welcomed = false;  ///< HELLO was answered (WELCOME): INITIATE comes next (then decoder::ready_)
  std::array<std::uint8_t, crypto_box_PUBLICKEYBYTES> client_short{};  ///< C'
  std::array<std::uint8_t, crypto_box_SECRETKEYBYTES> short_secret{};  ///< s'
  std::array<std::uint8_t, 96> cookie{};                               ///< what WELCOME gave, echoed by INITIATE
  std::array<std::uint8_t, crypto_box_BEFORENMBYTES> shared{};         ///< C' and s' precomputed
  std::uint64_t next_nonce = 1;                                        ///< this side's short nonces (READY, MESSAGE)
  std::uint64_t peer_nonce = 0;  ///< the last short nonce the peer used: each must be larger

  ~curve_state() {
    sodium_memzero(short_secret.data(), short_secret.size());
    sodium_memzero(shared.data(), shared.size());
  }

  /// This side's next short nonce (8 bytes, big-endian), then `plain` boxed with the shared key under
  /// the nonce `prefix` + it: what READY and MESSAGE carry after their name.
  std::string box_next(std::string_view prefix, std::string_view plain);
};

namespace {
std::uint64_t load_be64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return v;
}
/// A 24-byte nonce: a 16-byte prefix and a short nonce (big-endian), or a 8-byte prefix and 16 bytes.
std::array<std::uint8_t, crypto_box_NONCEBYTES> nonce_of(std::string_view prefix, const std::uint8_t* rest) {
  std::array<std::uint8_t, crypto_box_NONCEBYTES> n{};
  std::memcpy(n.data(), prefix.data(), prefix.size());
  std::memcpy(n.data() + prefix.size(), rest, n.size() - prefix.size());
  return n;
}
std::string z85_of(const std::uint8_t* key) {
  char text[41] = {};
  zmq_z85_encode(text, key, 32);
  return text;
}
const std::uint8_t* bytes_of(std::string_view s) { return reinterpret_cast<const std::uint8_t*>(s.data()); }
}  // namespace

decoder::decoder(std::uint64_t max_body, std::shared_ptr<const curve_server_keys> curve) : max_body_(max_body) {
  if (curve) {
    // Idempotent and thread-safe; before the first random bytes (WELCOME's key pair and cookie).
    if (sodium_init() < 0) throw error(errc::internal, "libsodium could not be initialised (sodium_init)");
    curve_ = std::make_unique<curve_state>();
    curve_->keys = std::move(curve);
  }
}
decoder::~decoder() = default;
decoder::decoder(decoder&&) noexcept = default;
decoder& decoder::operator=(decoder&&) noexcept = default;

decoder::result decoder::feed(std::span<const std::uint8_t> in) {
  result r;
  while (r.consumed < in.size() && r.what == event::none) {
    const auto rest = in.subspan(r.consumed);
    switch (state_) {
      case state::greeting: r.consumed += feed_greeting(rest, r.what); break;
      case state::header:
      case state::size: r.consumed += feed_header(rest, r.what); break;
      case state::command:
      case state::frame: r.consumed += feed_body(rest, r.what); break;
      case state::failed: return r;
    }
  }
  return r;
}

std::size_t decoder::feed_greeting(std::span<const std::uint8_t> in, event& what) {
  const std::size_t n = std::min(in.size(), greeting_bytes - greeting_.size());
  greeting_.append(reinterpret_cast<const char*>(in.data()), n);
  const auto at = [&](std::size_t i) { return static_cast<std::uint8_t>(greeting_[i]); };
  // Checked as the bytes come: an old or foreign peer is closed without waiting for 64 bytes it
  // will never send (a ZMTP 1.0 peer waits after its first frame, a 2.0 peer after its signature).
  if (at(0) != 0xff || (greeting_.size() >= 10 && (at(9) & 1) == 0)) {
    what = fail("its greeting is not ZMTP 3 (ZMTP/1.0, or not ZMTP at all): this receiver speaks ZMTP 3.x");
    return n;
  }
  if (greeting_.size() >= 11 && at(10) < 3) {
    what = fail(fmt::format("it speaks ZMTP/{}.0 (revision {}): this receiver speaks ZMTP 3.x (libzmq 4.x)",
                            at(10) == 1 ? 2 : 1, at(10)));
    return n;
  }
  if (greeting_.size() < greeting_bytes) return n;
  major_ = at(10);
  minor_ = at(11);
  const std::string_view mechanism(greeting_.data() + mechanism_at, mechanism_bytes);
  if (curve_ && mechanism != std::string_view("CURVE\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", mechanism_bytes)) {
    what =
        fail(fmt::format("its greeting names the mechanism '{}': this receiver speaks CURVE only (the streamer needs "
                         "streamer_options.curve with the receiver's public key as server_key)",
                         printable(mechanism.substr(0, mechanism.find('\0')), 64)));
    return n;
  }
  if (!curve_ && mechanism != std::string_view("NULL\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", mechanism_bytes)) {
    what = fail(fmt::format("its greeting names the mechanism '{}': this receiver has no CURVE key and speaks NULL",
                            printable(mechanism.substr(0, mechanism.find('\0')), 64)));
    return n;
  }
  greeting_ = std::string();
  state_ = state::header;
  ++progress_;
  return n;
}

std::size_t decoder::feed_header(std::span<const std::uint8_t> in, event& what) {
  std::size_t used = 0;
  if (state_ == state::header) {
    flags_ = in[used++];
    if ((flags_ & 0xf8) != 0) {
      what = fail(fmt::format("a frame with reserved flag bits set ({:#04x})", flags_));
      return used;
    }
    size_ = 0;
    size_bytes_ = 0;
    state_ = state::size;
  }
  const std::uint8_t need = (flags_ & flag_long) != 0 ? 8 : 1;
  while (used < in.size() && size_bytes_ < need) {
    size_ = (size_ << 8) | in[used++];
    ++size_bytes_;
  }
  if (size_bytes_ == need) what = header_done();
  return used;
}

event decoder::header_done() {
  const bool more = (flags_ & flag_more) != 0;
  left_ = size_;
  if ((flags_ & flag_command) != 0) {
    if (curve_ && ready_) return fail("a command outside its CURVE box after the handshake");
    if (more) return fail("a command frame flagged MORE");
    if (size_ == 0 || size_ > max_command_bytes)
      return fail(fmt::format("a command of {} bytes (1 to {} allowed)", size_, max_command_bytes));
    command_.clear();
    state_ = state::command;
    return event::none;
  }
  if (!ready_) return fail("a message frame before the handshake ended (READY)");
  state_ = state::frame;
  if (curve_) {
    // Every frame is one MESSAGE box, read whole (its MAC covers all of it): sealed_done().
    if (more) return fail("a frame flagged MORE outside its CURVE box (libzmq seals every frame alone)");
    if (size_ < curve_overhead || size_ > max_body_ + curve_overhead)
      return fail(fmt::format("a CURVE frame of {} bytes ({} to {} allowed: a body of at most {} and {} more)", size_,
                              curve_overhead, max_body_ + curve_overhead, max_body_, curve_overhead));
    sealed_ = std::make_unique<body_buffer>(size_);
    return event::none;
  }
  if (const event e = message_frame(more, size_); e != event::none) return e;
  if (body_) {
    body_from_ = 0;
    body_bytes_ = size_;
  }
  return left_ == 0 ? frame_done() : event::none;
}

/// A message frame of `size` bytes begins (NULL: its header; CURVE: its box opened): counted, and a
/// request's body given a buffer (NULL), or the whole message marked to skip.
event decoder::message_frame(bool more, std::uint64_t size) {
  if (size > max_body_)
    return fail(fmt::format("a frame of {} bytes, over the limit of {} (wire::max_message_bytes)", size, max_body_));
  ++frames_;
  // A REQ's request is [empty delimiter, MORE][body, last]: the first frame that breaks that shape
  // makes the whole message one to skip, whatever follows.
  if (!discarding_) {
    const bool fits = frames_ == 1 ? size == 0 && more : frames_ == 2 && !more;
    if (!fits) {
      discarding_ = true;
      body_.reset();
    } else if (frames_ == 2 && !curve_) {
      body_ = std::make_unique<body_buffer>(size);
    }
  }
  return event::none;
}

std::size_t decoder::feed_body(std::span<const std::uint8_t> in, event& what) {
  const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(left_, in.size()));
  if (state_ == state::command) {
    command_.append(reinterpret_cast<const char*>(in.data()), n);
  } else if (sealed_) {
    sealed_->append(in.first(n));
  } else if (!discarding_ && body_) {
    body_->append(in.first(n));
  }
  left_ -= n;
  if (left_ == 0) what = state_ == state::command ? command_done() : sealed_ ? sealed_done() : frame_done();
  return n;
}

/// A CURVE MESSAGE frame is complete: its nonce must be the peer's next, its box must open with this
/// connection's keys (in place), and what it carries is read as the frame it is: a command (PING,
/// PONG), or a message frame (the envelope's rules, as over NULL).
event decoder::sealed_done() {
  std::unique_ptr<body_buffer> box = std::move(sealed_);
  std::uint8_t* d = box->data();
  const std::uint64_t n = size_;
  if (std::memcmp(d, "\x07MESSAGE", 8) != 0) return fail("a CURVE frame that is not a MESSAGE");
  const std::uint64_t nonce = load_be64(d + 8);
  if (nonce <= curve_->peer_nonce)
    return fail("a CURVE MESSAGE whose nonce is not larger than the one before (replayed or reordered)");
  curve_->peer_nonce = nonce;
  const auto full = nonce_of("CurveZMQMESSAGEC", d + 8);
  if (crypto_box_open_easy_afternm(d + 16, d + 16, n - 16, full.data(), curve_->shared.data()) != 0)
    return fail("a CURVE MESSAGE that does not open with this connection's keys (forged or corrupted)");
  const std::uint8_t inner = d[16];
  const std::uint64_t size = n - curve_overhead;
  if ((inner & ~(sealed_more | sealed_command)) != 0)
    return fail(fmt::format("a CURVE MESSAGE with reserved flag bits set ({:#04x})", inner));
  if ((inner & sealed_command) != 0) {
    if ((inner & sealed_more) != 0) return fail("a command frame flagged MORE");
    if (size == 0 || size > max_command_bytes)
      return fail(fmt::format("a command of {} bytes (1 to {} allowed)", size, max_command_bytes));
    command_.assign(reinterpret_cast<const char*>(d + 17), size);
    return command_done();
  }
  flags_ = (inner & sealed_more) != 0 ? flag_more : 0;  // read on as a frame header's flags
  if (const event e = message_frame((inner & sealed_more) != 0, size); e != event::none) return e;
  if (!discarding_ && frames_ == 2) {  // the request's body: kept where it was opened
    body_ = std::move(box);
    body_from_ = 17;
    body_bytes_ = size;
  }
  return frame_done();
}

event decoder::frame_done() {
  ++progress_;
  state_ = state::header;
  if ((flags_ & flag_more) != 0) return event::none;
  dropped_frames_ = frames_;
  frames_ = 0;
  if (std::exchange(discarding_, false)) return event::dropped;
  return event::request;
}

event decoder::command_done() {
  ++progress_;
  state_ = state::header;
  const std::string cmd = std::exchange(command_, std::string());
  const std::size_t name_size = static_cast<std::uint8_t>(cmd[0]);
  if (name_size == 0 || cmd.size() < 1 + name_size) return fail("a command whose name does not fit in it");
  const std::string_view name(cmd.data() + 1, name_size);
  const std::string_view data = std::string_view(cmd).substr(1 + name_size);
  if (name == "ERROR")
    return fail(fmt::format("it sent ERROR '{}'", printable(data.empty() ? data : data.substr(1), 256)));
  if (!ready_ && curve_) return curve_handshake(name, cmd);
  if (!ready_) {
    if (name == "READY") return ready_command(data);
    return fail(fmt::format("its first command is '{}', not READY", printable(name, 64)));
  }
  if (name == "PING") {
    if (data.size() < 2) return fail("a PING without its TTL");
    ping_context_ = std::string(data.substr(2, 16));  // ZMTP 3.1: at most 16 bytes of context
    return event::ping;
  }
  if (name == "PONG") return event::none;
  return fail(fmt::format("the command '{}', which a REQ never sends", printable(name, 64)));
}

event decoder::ready_command(std::string_view data) {
  bool typed = false;
  std::size_t at = 0;
  while (at < data.size()) {
    const std::size_t name_size = static_cast<std::uint8_t>(data[at]);
    if (name_size == 0 || data.size() - at < 1 + name_size + 4) return fail("a READY whose metadata is malformed");
    const std::string_view name = data.substr(at + 1, name_size);
    at += 1 + name_size;
    std::uint64_t value_size = 0;
    for (int i = 0; i < 4; ++i) value_size = (value_size << 8) | static_cast<std::uint8_t>(data[at + i]);
    at += 4;
    if (value_size > data.size() - at) return fail("a READY whose metadata is malformed");
    if (iequals(name, "Socket-Type")) {
      if (typed) return fail("a READY with two Socket-Types");
      typed = true;
      socket_type_ = std::string(data.substr(at, value_size));
    }
    at += value_size;
  }
  if (!typed) return fail("a READY without a Socket-Type");
  if (socket_type_ != "REQ" && socket_type_ != "DEALER")
    return fail(fmt::format("its Socket-Type is '{}': only a REQ (a streamer) or a DEALER talks to this receiver",
                            printable(socket_type_, 64)));
  ready_ = true;
  return event::ready;
}

/// The CURVE handshake's commands: HELLO (answered with WELCOME), then INITIATE (answered with
/// READY). `cmd` is the whole command body, name included (CurveZMQ's offsets count from there).
event decoder::curve_handshake(std::string_view name, std::string_view cmd) {
  if (!curve_->welcomed) {
    if (name != "HELLO") return fail(fmt::format("its first CURVE command is '{}', not HELLO", printable(name, 64)));
    return curve_hello(cmd);
  }
  if (name != "INITIATE")
    return fail(fmt::format("its CURVE command after HELLO is '{}', not INITIATE", printable(name, 64)));
  return curve_initiate(cmd);
}

event decoder::curve_hello(std::string_view cmd) {
  // "\x05HELLO", version 1.0, 72 bytes of padding, C', short nonce, box[64 zero bytes](C' -> S).
  if (cmd.size() != 200) return fail(fmt::format("a CURVE HELLO of {} bytes (200 expected)", cmd.size()));
  const std::uint8_t* h = bytes_of(cmd);
  if (h[6] != 1 || h[7] != 0) return fail(fmt::format("a CURVE HELLO of version {}.{} (1.0 expected)", h[6], h[7]));
  curve_state& c = *curve_;
  std::memcpy(c.client_short.data(), h + 80, 32);
  c.peer_nonce = load_be64(h + 112);
  const auto nonce = nonce_of("CurveZMQHELLO---", h + 112);
  std::array<std::uint8_t, 64> zeros{};
  if (crypto_box_open_easy(zeros.data(), h + 120, 80, nonce.data(), c.client_short.data(), c.keys->secret_key.data()) !=
      0)
    return fail(
        "its CURVE HELLO does not open with this receiver's key: the streamer holds another server key "
        "(streamer_options.curve.server_key must be this receiver's public key)");
  if (!std::all_of(zeros.begin(), zeros.end(), [](std::uint8_t b) { return b == 0; }))
    return fail("its CURVE HELLO's signature is not 64 zero bytes");
  // WELCOME: a fresh short-term pair of this connection (S' goes in it; s' is kept), and a cookie
  // INITIATE must echo.
  std::array<std::uint8_t, 128> plain{};
  crypto_box_keypair(plain.data(), c.short_secret.data());
  randombytes_buf(c.cookie.data(), c.cookie.size());
  std::memcpy(plain.data() + 32, c.cookie.data(), 96);
  std::array<std::uint8_t, 16> suffix{};
  randombytes_buf(suffix.data(), suffix.size());
  std::string data(16 + crypto_box_MACBYTES + plain.size(), '\0');
  std::memcpy(data.data(), suffix.data(), 16);
  const auto welcome_nonce = nonce_of("WELCOME-", suffix.data());
  if (crypto_box_easy(reinterpret_cast<std::uint8_t*>(data.data()) + 16, plain.data(), plain.size(),
                      welcome_nonce.data(), c.client_short.data(), c.keys->secret_key.data()) != 0)
    return fail("its CURVE HELLO names a short-term key no box can be made for");
  output_ += command("WELCOME", data);
  c.welcomed = true;
  return event::none;
}

event decoder::curve_initiate(std::string_view cmd) {
  // "\x08INITIATE", the cookie (96), short nonce, box[C, vouch nonce, vouch box, metadata](C' -> S').
  if (cmd.size() < 113 + crypto_box_MACBYTES + 128)
    return fail(fmt::format("a CURVE INITIATE of {} bytes (at least 257 expected)", cmd.size()));
  const std::uint8_t* m = bytes_of(cmd);
  curve_state& c = *curve_;
  if (sodium_memcmp(m + 9, c.cookie.data(), c.cookie.size()) != 0)
    return fail("its CURVE INITIATE does not carry the cookie this receiver's WELCOME gave");
  const std::uint64_t nonce = load_be64(m + 105);
  if (nonce <= c.peer_nonce) return fail("a CURVE INITIATE whose nonce is not larger than its HELLO's");
  c.peer_nonce = nonce;
  const std::size_t clen = cmd.size() - 113;
  std::vector<std::uint8_t> plain(clen - crypto_box_MACBYTES);
  const auto initiate_nonce = nonce_of("CurveZMQINITIATE", m + 105);
  if (crypto_box_open_easy(plain.data(), m + 113, clen, initiate_nonce.data(), c.client_short.data(),
                           c.short_secret.data()) != 0)
    return fail("its CURVE INITIATE does not open with this connection's keys (forged or corrupted)");
  const std::uint8_t* client = plain.data();  // C: the client's long-term public key
  std::array<std::uint8_t, 64> vouch{};
  const auto vouch_nonce = nonce_of("VOUCH---", plain.data() + 32);
  if (crypto_box_open_easy(vouch.data(), plain.data() + 48, 80, vouch_nonce.data(), client, c.short_secret.data()) != 0)
    return fail("its CURVE vouch does not open with the long-term key it names");
  if (sodium_memcmp(vouch.data(), c.client_short.data(), 32) != 0 ||
      sodium_memcmp(vouch.data() + 32, c.keys->public_key.data(), 32) != 0)
    return fail("its CURVE vouch is not for this connection (another short-term key or server)");
  client_key_ = z85_of(client);
  if (!c.keys->allowed.empty() && std::none_of(c.keys->allowed.begin(), c.keys->allowed.end(),
                                               [&](const auto& k) { return sodium_memcmp(k.data(), client, 32) == 0; }))
    return fail(fmt::format("its CURVE public key {} is not in receiver_options.curve.allowed_clients", client_key_));
  if (crypto_box_beforenm(c.shared.data(), c.client_short.data(), c.short_secret.data()) != 0)
    return fail("its CURVE short-term key makes no shared key");
  const std::string_view metadata(reinterpret_cast<const char*>(plain.data()) + 128, plain.size() - 128);
  const event e = ready_command(metadata);
  if (e != event::ready) return e;
  // READY: this side's metadata, boxed with the shared key.
  output_ += command("READY", c.box_next("CurveZMQREADY---", socket_type_property("ROUTER")));
  return e;
}

std::string decoder::curve_state::box_next(std::string_view prefix, std::string_view plain) {
  std::string out;
  append_be(out, next_nonce++, 8);
  const auto nonce = nonce_of(prefix, bytes_of(out));
  out.resize(8 + crypto_box_MACBYTES + plain.size());
  crypto_box_easy_afternm(reinterpret_cast<std::uint8_t*>(out.data()) + 8, bytes_of(plain), plain.size(), nonce.data(),
                          shared.data());
  return out;
}

std::string decoder::seal(std::uint8_t flags, std::string_view payload) {
  std::string plain;
  plain.reserve(1 + payload.size());
  plain.push_back(static_cast<char>(flags));
  plain.append(payload);
  const std::string body = "\x07MESSAGE" + curve_->box_next("CurveZMQMESSAGES", plain);
  std::string out;
  append_frame_header(out, body.size(), 0);
  return out + body;
}

event decoder::fail(std::string why) {
  state_ = state::failed;
  reason_ = std::move(why);
  sealed_.reset();
  body_.reset();
  command_ = std::string();
  greeting_ = std::string();
  return event::error;
}

std::string decoder::take_body() {
  std::string out = body_ ? body_->take(body_from_, body_bytes_) : std::string();
  body_.reset();
  return out;
}

bool decoder::mid_message() const noexcept {
  return state_ == state::size || state_ == state::command || state_ == state::frame || frames_ > 0;
}

std::size_t decoder::held_bytes() const noexcept {
  return (body_ ? body_->held() : 0) + (sealed_ ? sealed_->held() : 0) + command_.size();
}

// ------------------------------------------------------------------------------------ server

struct server::connection {
  connection(std::string i, unique_fd f, std::uint64_t max_body, std::shared_ptr<const curve_server_keys> curve,
             clock::time_point now)
      : id(std::move(i)),
        fd(std::move(f)),
        dec(max_body, std::move(curve)),
        accepted(now),
        last_heard(now),
        last_write(now) {}
  std::string id;
  unique_fd fd;
  decoder dec;
  clock::time_point accepted;
  clock::time_point last_heard;  ///< the last complete frame or command (or when reading resumed)
  clock::time_point last_ping{};
  std::optional<clock::time_point> ping_deadline;  ///< a PING is unanswered: close at this time
  clock::time_point last_write;                    ///< the last time the queue moved (or started)
  std::string out;                                 ///< queued bytes not yet taken by the kernel
  std::size_t out_at = 0;
  std::string ahead;                   ///< bytes read past a request, before it was taken
  std::optional<std::string> request;  ///< a complete request waiting to be taken
  bool closing = false;

  [[nodiscard]] bool writing() const noexcept { return out_at < out.size(); }
  /// Read only while nothing waits: one request held, no reply queued (a peer that does not read
  /// its replies stops being read; what it sends waits in the kernel).
  [[nodiscard]] bool reading() const noexcept { return !closing && !request && !writing(); }
};

bool server::handles(std::string_view endpoint) {
  if (endpoint.starts_with("ipc://")) {
    const auto path = endpoint.substr(6);
    return !path.empty() && path.front() != '@' && path.size() < sizeof(sockaddr_un::sun_path);
  }
  if (!endpoint.starts_with("tcp://")) return false;
  const auto rest = endpoint.substr(6);
  const auto colon = rest.rfind(':');
  if (colon == std::string_view::npos || rest.find(';') != std::string_view::npos) return false;
  std::string host(rest.substr(0, colon));
  const auto port = rest.substr(colon + 1);
  if (port != "*" && (port.empty() || port.size() > 5 ||
                      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })))
    return false;
  unsigned char addr[sizeof(in6_addr)];
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    return ::inet_pton(AF_INET6, host.substr(1, host.size() - 2).c_str(), addr) == 1;
  return ::inet_pton(AF_INET, host.c_str(), addr) == 1;
}

server::server(const std::string& endpoint, const options& o) : options_(o), scratch_(read_chunk) {
  if (options_.curve && sodium_init() < 0)
    throw error(errc::internal, "libsodium could not be initialised (sodium_init): the receiver cannot speak CURVE");
  if (endpoint.starts_with("ipc://")) {
    bind_ipc(endpoint.substr(6));
  } else {
    const auto rest = std::string_view(endpoint).substr(6);
    const auto colon = rest.rfind(':');
    bind_tcp(std::string(rest.substr(0, colon)), std::string(rest.substr(colon + 1)));
  }
}

server::~server() {
  conns_.clear();
  listener_.reset();
  if (ipc_path_.empty()) return;
  // Only the file this server made: a receiver bound on the same path since keeps its own.
  struct stat st {};
  if (::stat(ipc_path_.c_str(), &st) == 0 && st.st_ino == ipc_inode_) ::unlink(ipc_path_.c_str());
}

void server::bind_ipc(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  listener_ = unique_fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  const std::string ep = "ipc://" + path;
  const auto failed = [&](int e) {
    return error(errc::io, fmt::format("cannot bind the receiver to {}: {}; is another receiver already serving it, "
                                       "or is the directory missing?",
                                       ep, errno_text(e)));
  };
  if (!listener_) throw failed(errno);
  // As libzmq does: a stale socket file is replaced (rep_channel refused a live one already).
  ::unlink(path.c_str());
  if (::bind(listener_.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listener_.get(), listen_backlog) != 0)
    throw failed(errno);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) ipc_inode_ = st.st_ino;
  ipc_path_ = path;
  endpoint_ = ep;
}

void server::bind_tcp(const std::string& host, const std::string& port) {
  const bool v6 = host.starts_with('[');
  const std::string address = v6 ? host.substr(1, host.size() - 2) : host;
  const std::string asked = fmt::format("tcp://{}:{}", host, port);
  const auto failed = [&](int e) {
    return error(errc::io, fmt::format("cannot bind the receiver to {}: {}; is another receiver already serving it, "
                                       "or is the directory missing?",
                                       asked, errno_text(e)));
  };
  sockaddr_storage ss{};
  socklen_t len = 0;
  const auto port_number = static_cast<std::uint16_t>(port == "*" ? 0 : std::stoul(port));
  if (v6) {
    auto& a = reinterpret_cast<sockaddr_in6&>(ss);
    a.sin6_family = AF_INET6;
    a.sin6_port = htons(port_number);
    if (::inet_pton(AF_INET6, address.c_str(), &a.sin6_addr) != 1) throw failed(EINVAL);
    len = sizeof a;
  } else {
    auto& a = reinterpret_cast<sockaddr_in&>(ss);
    a.sin_family = AF_INET;
    a.sin_port = htons(port_number);
    if (::inet_pton(AF_INET, address.c_str(), &a.sin_addr) != 1) throw failed(EINVAL);
    len = sizeof a;
  }
  listener_ = unique_fd(::socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!listener_) throw failed(errno);
  const int on = 1;
  ::setsockopt(listener_.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);  // as libzmq: rebind after TIME_WAIT
  if (::bind(listener_.get(), reinterpret_cast<const sockaddr*>(&ss), len) != 0 ||
      ::listen(listener_.get(), listen_backlog) != 0)
    throw failed(errno);
  sockaddr_storage bound{};
  socklen_t bound_len = sizeof bound;
  if (::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&bound), &bound_len) != 0) throw failed(errno);
  const std::uint16_t p =
      ntohs(v6 ? reinterpret_cast<sockaddr_in6&>(bound).sin6_port : reinterpret_cast<sockaddr_in&>(bound).sin_port);
  tcp_ = true;
  endpoint_ = fmt::format("tcp://{}:{}", host, p);
}

void server::pump() {
  const auto now = clock::now();
  for (auto& [id, c] : conns_) {
    if (c->ahead.empty() || !c->reading()) continue;
    std::string bytes = std::exchange(c->ahead, std::string());
    std::size_t used = 0;
    consume(*c, {reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()}, used, now);
    if (used < bytes.size() && !c->closing) c->ahead = bytes.substr(used);
  }
  sweep();
}

void server::poll_fds(std::vector<pollfd>& out) {
  polled_.clear();
  polled_listener_ = clock::now() >= accept_paused_until_;
  if (polled_listener_) out.push_back(pollfd{listener_.get(), POLLIN, 0});
  for (auto& [id, c] : conns_) {
    const short events = static_cast<short>((c->reading() ? POLLIN : 0) | (c->writing() ? POLLOUT : 0));
    // A connection holding a request is left out: a hang-up would wake every poll until it is taken.
    if (events == 0) continue;
    out.push_back(pollfd{c->fd.get(), events, 0});
    polled_.push_back(c.get());
  }
}

void server::service(std::span<const pollfd> polled) {
  const auto now = clock::now();
  std::size_t k = 0;
  if (polled_listener_ && k < polled.size() && (polled[k++].revents & POLLIN) != 0) accept_all(now);
  for (connection* c : polled_) {
    if (k >= polled.size()) break;
    const short revents = polled[k++].revents;
    if (revents == 0 || c->closing) continue;
    if (c->writing() && (revents & (POLLOUT | POLLERR | POLLHUP)) != 0) flush(*c, now);
    if (c->reading() && (revents & (POLLIN | POLLERR | POLLHUP)) != 0) read_from(*c, now);
  }
  polled_.clear();
  for (auto& [id, c] : conns_) timers(*c, now);
  sweep();
}

clock::time_point server::next_timer() const noexcept {
  auto next = std::max(accept_paused_until_, clock::time_point{});
  if (next <= clock::now()) next = clock::time_point::max();
  for (const auto& [id, c] : conns_) {
    if (c->reading() && !c->ahead.empty()) return clock::time_point::min();
    if (c->writing()) next = std::min(next, c->last_write + options_.heartbeat_timeout);
    if (!c->reading()) continue;
    if (c->dec.handshaking()) {
      next = std::min(next, c->accepted + options_.handshake);
    } else if (c->dec.heartbeats()) {
      next = std::min(next, std::max(c->last_heard, c->last_ping) + options_.heartbeat_ivl);
      if (c->ping_deadline) next = std::min(next, *c->ping_deadline);
    } else if (c->dec.mid_message()) {
      next = std::min(next, c->last_heard + options_.heartbeat_timeout);
    }
  }
  return next;
}

void server::accept_all(clock::time_point now) {
  for (int n = 0; n < accepts_per_pass; ++n) {
    unique_fd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd) {
      const int e = errno;
      if (e == EINTR || e == ECONNABORTED || e == EPROTO) continue;
      if (e == EMFILE || e == ENFILE || e == ENOBUFS || e == ENOMEM) {
        // Out of descriptors: the listener would be ready at every poll; let it rest a moment.
        REFIT_WARN("accepting a connection on {} failed: {}; the listener rests {} ms", endpoint_, errno_text(e),
                   accept_rest.count());
        accept_paused_until_ = now + accept_rest;
      }
      return;
    }
    if (conns_.size() >= options_.max_connections) {
      ++closed_;
      if (std::has_single_bit(closed_))
        REFIT_WARN("closed a connection on {} at once: {} are open, the most a receiver keeps; {} closed so far",
                   endpoint_, conns_.size(), closed_);
      continue;  // fd closes here
    }
    if (tcp_) {
      const int on = 1;
      ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);  // requests are small and awaited
    }
    std::string id = fmt::format("zmtp-{}", next_connection.fetch_add(1));
    auto c = std::make_unique<connection>(id, std::move(fd), options_.max_body, options_.curve, now);
    connection& ref = *c;
    conns_.emplace(std::move(id), std::move(c));
    // NULL: READY at once; CURVE: READY ends the handshake, after the peer's INITIATE.
    queue(ref, options_.curve ? greeting(true) : greeting() + ready_frame("ROUTER"), now);
  }
}

void server::read_from(connection& c, clock::time_point now) {
  std::size_t budget = read_budget;
  while (c.reading() && budget > 0) {
    const ssize_t n = ::recv(c.fd.get(), scratch_.data(), std::min(scratch_.size(), budget), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      // Hung up (or reset). At a message's boundary that is a peer leaving; elsewhere it left
      // something unfinished, which counts.
      const bool cut = c.dec.handshaking() || c.dec.mid_message();
      close(c, cut ? (c.dec.handshaking() ? "it hung up during the handshake" : "it hung up in the middle of a message")
                   : std::string_view());
      return;
    }
    budget -= static_cast<std::size_t>(n);
    std::size_t used = 0;
    const std::span<const std::uint8_t> bytes(scratch_.data(), static_cast<std::size_t>(n));
    if (!consume(c, bytes, used, now)) return;
    if (used < bytes.size()) c.ahead.assign(reinterpret_cast<const char*>(bytes.data()) + used, bytes.size() - used);
  }
}

/// Feeds `bytes` to the connection's decoder and acts on what it reports; `used` says how far it
/// got (it stops after a request: the rest waits until that is taken). False when it closed `c`.
bool server::consume(connection& c, std::span<const std::uint8_t> bytes, std::size_t& used, clock::time_point now) {
  const std::uint64_t before = c.dec.progress();
  bool open = true;
  try {
    while (used < bytes.size() && open && !c.request) {
      const auto r = c.dec.feed(bytes.subspan(used));
      used += r.consumed;
      if (c.dec.sealed())
        if (const std::string out = c.dec.take_output(); !out.empty()) queue(c, out, now);  // WELCOME, READY
      switch (r.what) {
        case event::none:
        case event::ready: break;
        case event::ping: queue(c, command_to(c, "PONG", c.dec.ping_context()), now); break;
        case event::request:
          c.request = c.dec.take_body();
          ready_.push_back(c.id);
          break;
        case event::dropped: count_drop(c.dec.dropped_frames()); break;
        case event::error:
          close(c, c.dec.reason());
          open = false;
          break;
      }
      open = open && !c.closing;
    }
  } catch (const std::bad_alloc&) {
    close(c, "no memory for its request");
    open = false;
  }
  if (c.dec.progress() != before) {
    c.last_heard = now;
    c.ping_deadline.reset();
  }
  return open;
}

void server::queue(connection& c, std::string_view bytes, clock::time_point now) {
  if (c.closing) return;
  if (!c.writing()) {
    c.out.clear();
    c.out_at = 0;
    c.last_write = now;
  }
  c.out.append(bytes);
  flush(c, now);
}

void server::flush(connection& c, clock::time_point now) {
  while (c.writing()) {
    const ssize_t n = ::send(c.fd.get(), c.out.data() + c.out_at, c.out.size() - c.out_at, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      close(c, c.dec.mid_message() ? "it hung up in the middle of a message" : "");
      return;
    }
    c.out_at += static_cast<std::size_t>(n);
    c.last_write = now;
  }
  // All taken: let a large reply's memory go.
  if (c.out.capacity() > read_chunk) c.out = std::string();
  c.out.clear();
  c.out_at = 0;
}

bool server::reply(const std::string& peer, std::string_view bytes) {
  const auto it = conns_.find(peer);
  if (it == conns_.end() || it->second->closing) return false;
  connection& c = *it->second;
  const auto now = clock::now();
  if (c.dec.sealed()) {                                // CURVE: the delimiter and the body, each its own MESSAGE
    std::string sealed = c.dec.seal(sealed_more, {});  // first: the nonces must rise in the order sent
    sealed += c.dec.seal(0, bytes);
    queue(c, sealed, now);
    return true;
  }
  const std::string header = reply_header(bytes.size());
  if (!c.writing()) {
    // The usual case: the whole reply goes to the kernel in one call, copied nowhere else.
    iovec iov[2] = {{const_cast<char*>(header.data()), header.size()}, {const_cast<char*>(bytes.data()), bytes.size()}};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = 2;
    ssize_t n;
    do {
      n = ::sendmsg(c.fd.get(), &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      close(c, "");
      sweep();
      return false;
    }
    const std::size_t sent = n < 0 ? 0 : static_cast<std::size_t>(n);
    if (sent == header.size() + bytes.size()) return true;
    c.out.clear();
    c.out_at = 0;
    c.last_write = now;
    if (sent < header.size()) c.out.append(header.substr(sent));
    c.out.append(bytes.substr(sent > header.size() ? sent - header.size() : 0));
    return true;
  }
  c.out.append(header);
  c.out.append(bytes);
  return true;
}

std::optional<std::string> server::take(std::string& peer) {
  while (!ready_.empty()) {
    const std::string id = std::move(ready_.front());
    ready_.pop_front();
    const auto it = conns_.find(id);
    if (it == conns_.end() || !it->second->request) continue;  // closed since
    connection& c = *it->second;
    std::optional<std::string> out = std::exchange(c.request, std::nullopt);
    // Its silence while it waited was ours: its heartbeat clock starts again.
    c.last_heard = clock::now();
    c.ping_deadline.reset();
    peer = id;
    return out;
  }
  return std::nullopt;
}

void server::timers(connection& c, clock::time_point now) {
  if (c.closing) return;
  if (c.writing()) {
    if (now - c.last_write >= options_.heartbeat_timeout)
      close(c, fmt::format("it took none of what was sent to it for {} ms", options_.heartbeat_timeout.count()));
    return;
  }
  if (!c.reading()) return;  // a request waits: whatever it does not send now is not its fault
  if (c.dec.handshaking()) {
    if (now - c.accepted >= options_.handshake)
      close(c, fmt::format("its handshake did not end within {} ms", options_.handshake.count()));
    return;
  }
  if (!c.dec.heartbeats()) {
    // ZMTP 3.0 has no PING: an idle peer cannot be told from a dead one, but one that stopped
    // half-way through a message is holding what it sent.
    if (c.dec.mid_message() && now - c.last_heard >= options_.heartbeat_timeout)
      close(c, fmt::format("it stopped in the middle of a message for {} ms", options_.heartbeat_timeout.count()));
    return;
  }
  if (c.ping_deadline && now >= *c.ping_deadline) {
    close(c, fmt::format("it sent no complete frame for {} ms after a PING{}", options_.heartbeat_timeout.count(),
                         c.dec.mid_message() ? " (it stopped in the middle of a message)" : ""));
    return;
  }
  if (now - std::max(c.last_heard, c.last_ping) >= options_.heartbeat_ivl) {
    c.last_ping = now;
    if (!c.ping_deadline) c.ping_deadline = now + options_.heartbeat_timeout;
    queue(c, command_to(c, "PING", std::string_view("\0\0", 2)), now);  // TTL 0: we never ask the peer to time us out
  }
}

/// A command frame to connection `c`: plain, or sealed in a MESSAGE (CURVE).
std::string server::command_to(connection& c, std::string_view name, std::string_view data) {
  return c.dec.sealed() ? c.dec.seal(sealed_command, command_body(name, data)) : command(name, data);
}

void server::close(connection& c, std::string_view why) {
  if (c.closing) return;
  c.closing = true;
  c.request.reset();
  if (why.empty()) return;
  ++closed_;
  if (std::has_single_bit(closed_))  // 1, 2, 4, ...: a flood does not flood the log
    REFIT_WARN("closed a connection on {}: {}; {} closed so far", endpoint_, why, closed_);
}

void server::count_drop(std::uint64_t frames) {
  ++dropped_;
  if (std::has_single_bit(dropped_))
    REFIT_WARN(
        "dropped a message of {} frame(s) on {} that is not a request (a REQ's is a delimiter and one "
        "body frame); {} dropped so far",
        frames, endpoint_, dropped_);
}

void server::sweep() {
  std::erase_if(conns_, [](const auto& entry) { return entry.second->closing; });
}

}  // namespace refit::channel::zmtp
