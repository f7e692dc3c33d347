// A CurveZMQ client as bytes (libsodium), for tests of the receiver's ZMTP decoder with CURVE
// (lib/channel/zmtp.hpp): the greeting, HELLO, INITIATE and sealed MESSAGE frames it sends, WELCOME
// and READY read from what the decoder answered, every part of each open to being made wrong.
// Header-only: the unit tests that use it include it.
#pragma once

#include <sodium.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>

#include "channel/zmtp.hpp"
#include "support/zmtp_peer.hpp"

namespace refit::test {

class curve_client {
 public:
  using key = std::array<std::uint8_t, 32>;

  /// `server`: the receiver's long-term public key as the client believes it.
  explicit curve_client(const key& server) : server_(server) {
    if (sodium_init() < 0) throw std::runtime_error("curve_client: sodium_init failed");
    crypto_box_keypair(public_.data(), secret_.data());
    crypto_box_keypair(short_public_.data(), short_secret_.data());
  }

  [[nodiscard]] const key& public_key() const noexcept { return public_; }

  /// The greeting: ZMTP 3.1, CURVE, as-server 0.
  static std::string greeting() {
    std::string g = channel::zmtp::greeting(true);
    g[32] = 0;
    return g;
  }

  /// HELLO: C', a short nonce, and 64 zero bytes boxed from C' to the server's key.
  std::string hello() {
    std::string cmd(200, '\0');
    std::memcpy(cmd.data(), "\x05HELLO", 6);
    cmd[6] = 1;
    std::memcpy(cmd.data() + 80, short_public_.data(), 32);
    const std::string n = be(next_nonce_++);
    std::memcpy(cmd.data() + 112, n.data(), 8);
    const std::array<std::uint8_t, 64> zeros{};
    box(cmd.data() + 120, zeros.data(), zeros.size(), nonce("CurveZMQHELLO---", n), server_.data(),
        short_secret_.data());
    return command_frame(cmd);
  }

  /// Reads WELCOME from `answer` (the decoder's take_output()): the server's short-term key and
  /// cookie. False when it does not open.
  bool welcome(std::string_view answer) {
    const std::string_view cmd = command_of(answer, "\x07WELCOME");
    if (cmd.size() != 168) return false;
    std::array<std::uint8_t, 128> plain{};
    const std::string n = "WELCOME-" + std::string(cmd.substr(8, 16));
    if (crypto_box_open_easy(plain.data(), bytes(cmd.substr(24)), 144, bytes(n), server_.data(),
                             short_secret_.data()) != 0)
      return false;
    std::memcpy(server_short_.data(), plain.data(), 32);
    std::memcpy(cookie_.data(), plain.data() + 32, 96);
    return crypto_box_beforenm(shared_.data(), server_short_.data(), short_secret_.data()) == 0;
  }

  /// INITIATE: the cookie, a short nonce, and C, the vouch (C' and S boxed from C to S') and the
  /// metadata (Socket-Type `socket_type`) boxed from C' to S'.
  std::string initiate(std::string_view socket_type = "REQ") {
    std::string props = std::string(1, '\x0b') + "Socket-Type" + be(socket_type.size()).substr(4);
    props.append(socket_type);
    std::string plain(128 + props.size(), '\0');
    std::memcpy(plain.data(), public_.data(), 32);
    std::array<std::uint8_t, 16> vn{};
    randombytes_buf(vn.data(), vn.size());
    std::memcpy(plain.data() + 32, vn.data(), 16);
    std::array<std::uint8_t, 64> vouch{};
    std::memcpy(vouch.data(), short_public_.data(), 32);
    std::memcpy(vouch.data() + 32, server_.data(), 32);
    box(plain.data() + 48, vouch.data(), vouch.size(),
        nonce("VOUCH---", std::string(reinterpret_cast<const char*>(vn.data()), 16)), server_short_.data(),
        secret_.data());
    std::memcpy(plain.data() + 128, props.data(), props.size());
    std::string cmd(113 + crypto_box_MACBYTES + plain.size(), '\0');
    std::memcpy(cmd.data(), "\x08INITIATE", 9);
    std::memcpy(cmd.data() + 9, cookie_.data(), 96);
    const std::string n = be(next_nonce_++);
    std::memcpy(cmd.data() + 105, n.data(), 8);
    box(cmd.data() + 113, bytes(plain), plain.size(), nonce("CurveZMQINITIATE", n), server_short_.data(),
        short_secret_.data());
    return command_frame(cmd);
  }

  /// Reads READY from `answer`: true when it opens and names Socket-Type ROUTER.
  bool ready(std::string_view answer) {
    const std::string_view cmd = command_of(answer, "\x05READY");
    if (cmd.size() < 6 + 8 + crypto_box_MACBYTES) return false;
    std::string plain(cmd.size() - 14 - crypto_box_MACBYTES, '\0');
    if (crypto_box_open_easy_afternm(reinterpret_cast<std::uint8_t*>(plain.data()), bytes(cmd.substr(14)),
                                     cmd.size() - 14, bytes(nonce("CurveZMQREADY---", std::string(cmd.substr(6, 8)))),
                                     shared_.data()) != 0)
      return false;
    return plain.find("ROUTER") != std::string::npos;
  }

  /// One frame (`flags`: zmtp::sealed_more, zmtp::sealed_command) sealed in a MESSAGE with the next
  /// nonce (or `nonce`).
  std::string seal(std::uint8_t flags, std::string_view payload, std::uint64_t nonce_value = 0) {
    const std::uint64_t used = nonce_value != 0 ? nonce_value : next_nonce_++;
    const std::string n = be(used);
    std::string plain = std::string(1, static_cast<char>(flags)) + std::string(payload);
    std::string body(16 + crypto_box_MACBYTES + plain.size(), '\0');
    std::memcpy(body.data(), "\x07MESSAGE", 8);
    std::memcpy(body.data() + 8, n.data(), 8);
    crypto_box_easy_afternm(reinterpret_cast<std::uint8_t*>(body.data()) + 16, bytes(plain), plain.size(),
                            bytes(nonce("CurveZMQMESSAGEC", n)), shared_.data());
    return zmtp_frame(body, false);  // sealed: the flags are inside the box
  }
  /// A REQ's request: the empty delimiter (MORE) and `body`, each sealed.
  std::string request(std::string_view body) {
    std::string out = seal(1, {});
    out += seal(0, body);
    return out;
  }
  /// Opens one MESSAGE frame the server sent (its frame header first): its flags and payload, or
  /// nullopt-like empty flags 0xff when it does not open.
  std::pair<std::uint8_t, std::string> open(std::string_view frame_bytes) const {
    const std::size_t header = (static_cast<std::uint8_t>(frame_bytes[0]) & 2) != 0 ? 9 : 2;
    const std::string_view body = frame_bytes.substr(header);
    if (body.size() < channel::zmtp::curve_overhead || body.substr(0, 8) != "\x07MESSAGE") return {0xff, {}};
    std::string plain(body.size() - 16 - crypto_box_MACBYTES, '\0');
    if (crypto_box_open_easy_afternm(reinterpret_cast<std::uint8_t*>(plain.data()), bytes(body.substr(16)),
                                     body.size() - 16, bytes(nonce("CurveZMQMESSAGES", std::string(body.substr(8, 8)))),
                                     shared_.data()) != 0)
      return {0xff, {}};
    return {static_cast<std::uint8_t>(plain[0]), plain.substr(1)};
  }

  /// A command frame of `cmd` (its name's length, its name, its data), as the server frames one.
  static std::string command_frame(std::string_view cmd) {
    const std::size_t n = static_cast<std::uint8_t>(cmd[0]);
    return channel::zmtp::command(cmd.substr(1, n), cmd.substr(1 + n));
  }

 private:
  static std::string be(std::uint64_t v) {
    std::string out(8, '\0');
    for (int i = 7; i >= 0; --i, v >>= 8) out[static_cast<std::size_t>(i)] = static_cast<char>(v & 0xff);
    return out;
  }
  static std::string nonce(std::string_view prefix, std::string_view rest) {
    return std::string(prefix) + std::string(rest);
  }
  static const std::uint8_t* bytes(std::string_view s) { return reinterpret_cast<const std::uint8_t*>(s.data()); }
  static void box(char* out, const std::uint8_t* m, std::size_t n, const std::string& nonce24, const std::uint8_t* pk,
                  const std::uint8_t* sk) {
    if (crypto_box_easy(reinterpret_cast<std::uint8_t*>(out), m, n, bytes(nonce24), pk, sk) != 0)
      throw std::runtime_error("curve_client: crypto_box_easy failed");
  }
  /// The body of the first command frame in `answer` named by `prefix` (its length byte and name).
  static std::string_view command_of(std::string_view answer, std::string_view prefix) {
    std::size_t at = 0;
    while (at + 2 <= answer.size()) {
      const auto flags = static_cast<std::uint8_t>(answer[at]);
      std::uint64_t size = 0;
      std::size_t header = 2;
      if ((flags & 2) != 0) {
        header = 9;
        for (int i = 1; i <= 8; ++i) size = (size << 8) | static_cast<std::uint8_t>(answer[at + i]);
      } else {
        size = static_cast<std::uint8_t>(answer[at + 1]);
      }
      const std::string_view body = answer.substr(at + header, size);
      if ((flags & 4) != 0 && body.starts_with(prefix)) return body;
      at += header + size;
    }
    return {};
  }

  key server_;
  key public_{}, secret_{}, short_public_{}, short_secret_{}, server_short_{};
  std::array<std::uint8_t, 96> cookie_{};
  std::array<std::uint8_t, crypto_box_BEFORENMBYTES> shared_{};
  std::uint64_t next_nonce_ = 1;
};

}  // namespace refit::test
