#include <catch2/catch.hpp>

#include <msgpack.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <tuple>
#include <limits>
#include <string>
#include <vector>

#include "refit/error.hpp"
#include "refit/plan.hpp"
#include "wire/wire.hpp"

using namespace std::chrono_literals;
namespace wire = refit::wire;
using refit::dtype;
using refit::errc;
using refit::quant;

namespace {

// ------------------------------------------------------------------------------------ matchers

class error_matcher : public Catch::MatcherBase<refit::error> {
 public:
  error_matcher(errc code, std::string fragment) : code_(code), fragment_(std::move(fragment)) {}
  bool match(const refit::error& e) const override {
    return e.code() == code_ && std::string_view(e.what()).find(fragment_) != std::string_view::npos;
  }
  std::string describe() const override {
    return "is a refit::error(" + std::string(refit::to_string(code_)) + ") containing \"" + fragment_ + "\"";
  }

 private:
  errc code_;
  std::string fragment_;
};

error_matcher is_error(errc code, std::string fragment) { return {code, std::move(fragment)}; }

#define CHECK_REFIT_ERROR(expr, code, fragment) CHECK_THROWS_MATCHES(expr, refit::error, is_error(code, fragment))

// ------------------------------------------------------------------------------ message builder

// Packs arbitrary msgpack, so tests can build messages the encoder would never produce.
class mp {
 public:
  mp& arr(std::uint32_t n) { return p_.pack_array(n), *this; }
  mp& u(std::uint64_t v) { return p_.pack_uint64(v), *this; }
  mp& i(std::int64_t v) { return p_.pack_int64(v), *this; }
  mp& s(std::string_view v) {
    p_.pack_str(static_cast<std::uint32_t>(v.size()));
    p_.pack_str_body(v.data(), static_cast<std::uint32_t>(v.size()));
    return *this;
  }
  mp& b(std::string_view v) {
    p_.pack_bin(static_cast<std::uint32_t>(v.size()));
    p_.pack_bin_body(v.data(), static_cast<std::uint32_t>(v.size()));
    return *this;
  }
  mp& nil() { return p_.pack_nil(), *this; }
  mp& t(bool v) { return (v ? p_.pack_true() : p_.pack_false()), *this; }
  mp& f(double v) { return p_.pack_double(v), *this; }
  mp& map0() { return p_.pack_map(0), *this; }
  [[nodiscard]] std::string str() const { return std::string(buf_.data(), buf_.size()); }

 private:
  msgpack::sbuffer buf_;
  msgpack::packer<msgpack::sbuffer> p_{buf_};
};

using field = std::function<void(mp&)>;

// [type, protocol_version, fields...]
/// [type, pv, fields...] exactly as given.
std::string message_raw(std::uint64_t type, const std::vector<field>& fields,
                        std::uint64_t pv = wire::protocol_version) {
  mp m;
  m.arr(static_cast<std::uint32_t>(2 + fields.size())).u(type).u(pv);
  for (const auto& f : fields) f(m);
  return m.str();
}

/// [type, pv, fields...], and for the requests of a session (BEGIN, BATCH, END, BYE, ABORT, COMMIT) an empty
/// session secret as their last field, as wire::encode(m) writes it.
std::string message(std::uint64_t type, const std::vector<field>& fields, std::uint64_t pv = wire::protocol_version) {
  const bool session_request = type == 2 || type == 3 || type == 4 || type == 5 || type == 8 || type == 9;
  if (!session_request) return message_raw(type, fields, pv);
  std::vector<field> all = fields;
  all.push_back([](mp& m) { m.b(""); });
  return message_raw(type, all, pv);
}

field U(std::uint64_t v) {
  return [v](mp& m) { m.u(v); };
}
field I(std::int64_t v) {
  return [v](mp& m) { m.i(v); };
}
field S(std::string v) {
  return [v](mp& m) { m.s(v); };
}
field B(std::string v) {
  return [v](mp& m) { m.b(v); };
}
field NIL() {
  return [](mp& m) { m.nil(); };
}
field T(bool v) {
  return [v](mp& m) { m.t(v); };
}
field F(double v) {
  return [v](mp& m) { m.f(v); };
}
field MAP() {
  return [](mp& m) { m.map0(); };
}
field ARR(std::vector<field> items) {
  return [items](mp& m) {
    m.arr(static_cast<std::uint32_t>(items.size()));
    for (const auto& f : items) f(m);
  };
}

field good_buffer() { return ARR({U(1024), B("/refit-shm-1"), B(""), B("")}); }

std::vector<field> hello_fields() {
  return {S("token"),
          S("host_shm"),
          S("host:42"),
          S("host-boot"),
          B(std::string(16, '\x7f')),
          U(256),
          ARR({good_buffer(), good_buffer()}),
          B(""),
          U(0),
          S(""),
          U(0),
          U(1),
          U(30000),
          T(true),
          B("secret")};
}

// An entry [name, dtype, shape, tensor_offset, bytes, buffer_offset, kind, span].
field entry(std::string name, std::uint64_t code, std::vector<std::uint64_t> shape, std::uint64_t toff,
            std::uint64_t bytes, std::uint64_t boff, field kind = U(0), field span = U(0), field source = U(0)) {
  std::vector<field> dims;
  for (auto d : shape) dims.push_back(U(d));
  return ARR({S(std::move(name)), U(code), ARR(dims), U(toff), U(bytes), U(boff), std::move(kind), std::move(span),
              std::move(source)});
}

field good_entry() { return entry("w", static_cast<std::uint64_t>(dtype::f32), {10}, 0, 40, 0); }

std::vector<field> batch_fields(std::vector<field> entries, std::vector<field> sources = {}, bool ready = false) {
  return {U(7), U(0), U(1), ARR(std::move(entries)), ARR(std::move(sources)), T(ready)};
}

// Replaces field i of a field list.
std::vector<field> with(std::vector<field> fields, std::size_t i, field f) {
  fields.at(i) = std::move(f);
  return fields;
}

constexpr std::uint64_t HELLO = 1, BEGIN = 2, BATCH = 3, END = 4, BYE = 5, OK = 6, ERROR = 7, ABORT = 8, COMMIT = 9;

wire::message roundtrip(const wire::message& m) {
  const std::string bytes = wire::encode(m);
  return wire::decode(bytes);
}

}  // namespace

// ===================================================================================== round trips

TEST_CASE("every message type survives encode and decode", "[wire]") {
  SECTION("HELLO with buffers and binary handles") {
    wire::hello h;
    h.token = "s3cret";
    h.transport = "cuda_ipc";
    h.peer = "policy-0:1234";
    h.host_id = "node7/boot-abc";
    h.device_uuid = std::string("\x00\x01\x02\xff\x10\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x09", 16);
    h.alignment = 512;
    h.buffers = {{1ull << 30, std::string(64, '\0'), std::string("\x01\x00\x02", 3), "applied"},
                 {(1ull << 30) + 7, "h2", "", ""}};
    h.session = std::string(140, '\x5a');
    const auto m = roundtrip(h);
    REQUIRE(std::holds_alternative<wire::hello>(m));
    CHECK(std::get<wire::hello>(m) == h);
    CHECK(wire::type_of(m) == wire::msg_type::hello);
  }
  SECTION("HELLO asking for a session written in place, with a layout digest") {
    wire::hello h;
    h.transport = "cuda_ipc";
    h.mode = wire::session_mode::in_place;
    h.layout = "sha256:0f3a";
    const auto m = roundtrip(h);
    CHECK(std::get<wire::hello>(m) == h);
  }
  SECTION("OK granting a session written in place") {
    wire::ok ok;
    ok.handles = {"A1234", "T5678"};
    ok.mode = wire::session_mode::in_place;
    CHECK(std::get<wire::ok>(roundtrip(ok)) == ok);
  }
  SECTION("OK asking for conversions") {
    wire::ok ok;
    ok.convert = {{"w", dtype::f8_e4m3, refit::quant::block128},
                  {"v", dtype::f8_e4m3, refit::quant::tensor},
                  {"b", dtype::bf16, refit::quant::none}};
    CHECK(std::get<wire::ok>(roundtrip(ok)) == ok);
  }
  SECTION("HELLO of rank 2 of a group of 4 streamers") {
    wire::hello h;
    h.transport = "cuda_ipc";
    h.group_rank = 2;
    h.group_size = 4;
    h.reply_timeout_ms = 30000;
    h.lane = true;
    CHECK(std::get<wire::hello>(roundtrip(h)) == h);
  }
  SECTION("HELLO with every optional field empty") {
    wire::hello h;
    h.token = "";
    h.alignment = 1;
    const auto m = roundtrip(h);
    CHECK(std::get<wire::hello>(m) == h);
  }
  SECTION("BEGIN") {
    CHECK(std::get<wire::begin>(roundtrip(wire::begin{std::numeric_limits<std::uint64_t>::max(), false, {}})).version ==
          std::numeric_limits<std::uint64_t>::max());
  }
  SECTION("BATCH with chunks, scalars and empty tensors") {
    wire::batch b;
    b.version = 42;
    b.seq = 9;
    b.buffer = 1;
    b.entries = {
        {"model.embed_tokens.weight", dtype::bf16, {128256, 4096}, 1ull << 20, 4096, 0},
        {"scale", dtype::f32, {}, 0, 4, 4096},
        {"empty", dtype::i64, {0, 7}, 0, 0, 0},
        {"mask", dtype::bool_, {3, 5}, 3, 12, 4352},
        {"fp8", dtype::f8_e5m2, {2, 2, 2, 2, 2, 2, 2, 2}, 0, 256, 8192},
    };
    const auto m = roundtrip(b);
    CHECK(std::get<wire::batch>(m) == b);
    CHECK(wire::type_of(m) == wire::msg_type::batch);
    // The streamer encodes its batches without making a message of them first: the same bytes.
    b.sources = {"vmm:0123", "ipc:4567"};
    b.ready = true;
    CHECK(wire::encode(b) == wire::encode(wire::message(b)));
    CHECK(std::get<wire::batch>(wire::decode(wire::encode(b))) == b);
  }
  SECTION("BATCH without entries") {
    wire::batch b{1, 0, 0, {}};
    CHECK(std::get<wire::batch>(roundtrip(b)) == b);
  }
  SECTION("END") {
    wire::end e{3, 291, 16060000000ull, 62, 0x1234567890abcdefull};
    CHECK(std::get<wire::end>(roundtrip(e)) == e);
    wire::end held{4, 1, 2, 3, std::nullopt, true};  // an engine-wide version's: prepare, then COMMIT
    CHECK(std::get<wire::end>(roundtrip(held)) == held);
  }
  SECTION("COMMIT") {
    wire::commit c{~std::uint64_t{0}};
    const auto m = roundtrip(c);
    CHECK(std::get<wire::commit>(m) == c);
    CHECK(wire::type_of(m) == wire::msg_type::commit);
  }
  SECTION("BYE") {
    CHECK(std::holds_alternative<wire::bye>(roundtrip(wire::bye{})));
    CHECK(wire::type_of(wire::bye{}) == wire::msg_type::bye);
  }
  SECTION("OK with and without a committed version") {
    wire::ok none{std::nullopt, false, {}, wire::session_mode::buffers, {}, {}};
    CHECK(std::get<wire::ok>(roundtrip(none)) == none);
    wire::ok some{0,
                  true,
                  {std::string("\x00\xff", 2), "", std::string(4096, 'h')},
                  wire::session_mode::buffers,
                  {},
                  "/dev/shm/refit-lane-abc\n0123"};
    CHECK(std::get<wire::ok>(roundtrip(some)) == some);
  }
  SECTION("ERROR with every code") {
    for (int c = 1; c <= 13; ++c) {
      wire::error e{static_cast<errc>(c), "what to do: " + std::to_string(c)};
      CHECK(std::get<wire::error>(roundtrip(e)) == e);
    }
    wire::error empty{errc::internal, ""};
    CHECK(std::get<wire::error>(roundtrip(empty)) == empty);
  }
  SECTION("ABORT with every code") {
    for (int c = 1; c <= 13; ++c) {
      wire::abort a{static_cast<std::uint64_t>(c) << 40, static_cast<errc>(c),
                    "the source failed: " + std::to_string(c)};
      const auto m = roundtrip(a);
      CHECK(std::get<wire::abort>(m) == a);
      CHECK(wire::type_of(m) == wire::msg_type::abort);
    }
    wire::abort empty{0, errc::invalid_argument, ""};
    CHECK(std::get<wire::abort>(roundtrip(empty)) == empty);
  }
  SECTION("decode accepts bytes as a span") {
    const std::string bytes = wire::encode(wire::begin{5, false, {}});
    const auto span = std::span<const std::byte>(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size());
    CHECK(std::get<wire::begin>(wire::decode(span)).version == 5);
  }
}

TEST_CASE("message type names are upper case", "[wire]") {
  CHECK(wire::to_string(wire::msg_type::hello) == "HELLO");
  CHECK(wire::to_string(wire::msg_type::begin) == "BEGIN");
  CHECK(wire::to_string(wire::msg_type::batch) == "BATCH");
  CHECK(wire::to_string(wire::msg_type::end) == "END");
  CHECK(wire::to_string(wire::msg_type::bye) == "BYE");
  CHECK(wire::to_string(wire::msg_type::ok) == "OK");
  CHECK(wire::to_string(wire::msg_type::error) == "ERROR");
  CHECK(wire::to_string(wire::msg_type::abort) == "ABORT");
  CHECK(wire::to_string(wire::msg_type::commit) == "COMMIT");
}

TEST_CASE("the hand-built good messages of these tests decode", "[wire]") {
  CHECK_NOTHROW(wire::decode(message(HELLO, hello_fields())));
  CHECK_NOTHROW(wire::decode(message(BATCH, batch_fields({good_entry()}))));
  CHECK_NOTHROW(wire::decode(message(OK, {NIL(), T(false), ARR({}), U(0), ARR({}), B("")})));
  CHECK(std::get<wire::abort>(wire::decode(message(ABORT, {U(7), U(1), S("dup")}))) ==
        wire::abort{7, errc::invalid_argument, "dup"});
}

// ============================================================================= malformed framing

TEST_CASE("decode rejects empty input", "[wire]") {
  CHECK_REFIT_ERROR(wire::decode(std::string_view()), errc::protocol, "malformed message: empty");
}

TEST_CASE("decode rejects input over the message size limit", "[wire]") {
  const std::string big(wire::max_message_bytes + 1, '\xc0');
  CHECK_REFIT_ERROR(wire::decode(big), errc::protocol, "more than the limit");
}

TEST_CASE("decode rejects truncated msgpack at every length", "[wire]") {
  wire::batch b{1, 0, 0, {{"a", dtype::f16, {3, 3}, 0, 18, 0}, {"b", dtype::u8, {5}, 0, 5, 256}}};
  const std::string bytes = wire::encode(b);
  for (std::size_t n = 1; n < bytes.size(); ++n) {
    INFO("length " << n << " of " << bytes.size());
    CHECK_REFIT_ERROR(wire::decode(std::string_view(bytes).substr(0, n)), errc::protocol, "malformed message");
  }
  CHECK_REFIT_ERROR(wire::decode(bytes.substr(0, 3)), errc::protocol, "truncated");
}

TEST_CASE("decode rejects invalid msgpack", "[wire]") {
  CHECK_REFIT_ERROR(wire::decode(std::string("\xc1")), errc::protocol, "invalid msgpack");
}

TEST_CASE("decode rejects trailing bytes after the message", "[wire]") {
  const std::string bytes = wire::encode(wire::begin{1, false, {}}) + std::string("\xc0\xc0", 2);
  CHECK_REFIT_ERROR(wire::decode(bytes), errc::protocol, "2 trailing bytes");
}

TEST_CASE("decode rejects a top level that is not an array", "[wire]") {
  CHECK_REFIT_ERROR(wire::decode(mp().u(2).str()), errc::protocol, "top level must be an array");
  CHECK_REFIT_ERROR(wire::decode(mp().map0().str()), errc::protocol, "got map");
}

TEST_CASE("decode rejects a message shorter than type and version", "[wire]") {
  CHECK_REFIT_ERROR(wire::decode(mp().arr(0).str()), errc::protocol, "0 elements");
  CHECK_REFIT_ERROR(wire::decode(mp().arr(1).u(2).str()), errc::protocol, "1 elements");
}

TEST_CASE("decode rejects a type or version that is not an unsigned integer", "[wire]") {
  CHECK_REFIT_ERROR(wire::decode(mp().arr(3).s("BEGIN").u(1).u(5).str()), errc::protocol,
                    "message type must be an unsigned integer, got str");
  CHECK_REFIT_ERROR(wire::decode(mp().arr(3).i(-2).u(1).u(5).str()), errc::protocol, "got negative int");
  CHECK_REFIT_ERROR(wire::decode(mp().arr(3).u(2).i(-1).u(5).str()), errc::protocol,
                    "protocol version must be an unsigned integer");
  CHECK_REFIT_ERROR(wire::decode(mp().arr(3).u(2).f(1.5).u(5).str()), errc::protocol, "got float");
}

TEST_CASE("decode reports a protocol version mismatch with both versions", "[wire]") {
  const auto check_mismatch = [](const std::string& bytes, std::uint64_t theirs) {
    try {
      (void)wire::decode(bytes);
      FAIL("decode accepted protocol version " << theirs);
    } catch (const refit::error& e) {
      CHECK(e.code() == errc::version_mismatch);
      const std::string what = e.what();
      CHECK_THAT(what, Catch::Contains("refit protocol " + std::to_string(theirs)));
      CHECK_THAT(what, Catch::Contains("speaks " + std::to_string(wire::protocol_version)));
      CHECK_THAT(what, Catch::Contains("same refit release"));
    }
  };
  check_mismatch(message(BEGIN, {U(1)}, 1), 1);
  check_mismatch(message(BEGIN, {U(1)}, 2), 2);    // the release before conversions and session data
  check_mismatch(message(BEGIN, {U(1)}, 3), 3);    // the release before groups of streamers
  check_mismatch(message(BEGIN, {U(1)}, 4), 4);    // the release before tensors read in place
  check_mismatch(message(BEGIN, {U(1)}, 5), 5);    // the release before control lanes
  check_mismatch(message(BEGIN, {U(1)}, 6), 6);    // the release before nccl parts sessions
  check_mismatch(message(BEGIN, {U(1)}, 7), 7);    // the release before cuda_ipc offers named their GPUs
  check_mismatch(message(BEGIN, {U(1)}, 8), 8);    // the release before paired nccl sessions
  check_mismatch(message(BEGIN, {U(1)}, 9), 9);    // the release before session secrets
  check_mismatch(message(BEGIN, {U(1)}, 10), 10);  // the release before engine-wide versions (END's hold)
  check_mismatch(message(BEGIN, {U(1)}, 11), 11);  // the release whose direct receivers committed on the
                                                   // streamer's word (it drained before END)
  check_mismatch(message(BEGIN, {U(1)}, 14), 14);
  check_mismatch(message(BEGIN, {U(1)}, 0), 0);
  // A future version may have other fields and other types: the version is checked first.
  check_mismatch(message(BEGIN, {S("x"), U(1), U(2)}, 13), 13);
  check_mismatch(message(99, {}, 13), 13);
}

TEST_CASE("decode rejects unknown message types", "[wire]") {
  CHECK_REFIT_ERROR(wire::decode(message(0, {})), errc::protocol, "unknown message type 0");
  CHECK_REFIT_ERROR(wire::decode(message(10, {})), errc::protocol, "unknown message type 10");
  CHECK_REFIT_ERROR(wire::decode(message(1ull << 40, {})), errc::protocol, "unknown message type");
}

TEST_CASE("decode rejects a wrong field count for the message type", "[wire]") {
  CHECK_REFIT_ERROR(wire::decode(message_raw(BEGIN, {U(1), U(2), U(3)})), errc::protocol,
                    "BEGIN message: 3 fields, expected 4");
  CHECK_REFIT_ERROR(wire::decode(message_raw(BEGIN, {})), errc::protocol, "BEGIN message: 0 fields");
  CHECK_REFIT_ERROR(wire::decode(message_raw(BYE, {B(""), NIL()})), errc::protocol,
                    "BYE message: 2 fields, expected 1");
  // A request without its secret is a message of the release before session secrets.
  CHECK_REFIT_ERROR(wire::decode(message_raw(BYE, {})), errc::protocol, "BYE message: 0 fields, expected 1");
  auto h = hello_fields();
  h.pop_back();
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, h)), errc::protocol, "HELLO message: 14 fields, expected 15");
  CHECK_REFIT_ERROR(wire::decode(message_raw(END, {U(1), U(2), U(3)})), errc::protocol, "END message: 3 fields");
  CHECK_REFIT_ERROR(wire::decode(message(OK, {NIL(), T(true)})), errc::protocol, "OK message: 2 fields");
  CHECK_REFIT_ERROR(wire::decode(message(ERROR, {U(2)})), errc::protocol, "ERROR message: 1 fields");
  CHECK_REFIT_ERROR(wire::decode(message_raw(BATCH, {U(1), U(0), U(0)})), errc::protocol, "BATCH message: 3 fields");
  CHECK_REFIT_ERROR(wire::decode(message_raw(ABORT, {U(1), U(1), S("x")})), errc::protocol,
                    "ABORT message: 3 fields, expected 4");
  CHECK_REFIT_ERROR(wire::decode(message_raw(ABORT, {U(1), U(1), S("x"), B(""), S("y")})), errc::protocol,
                    "ABORT message: 5 fields, expected 4");
}

TEST_CASE("a request's session secret is decoded apart from the message and bounded", "[wire]") {
  std::string secret = "stale";
  const auto b = wire::decode(wire::encode(wire::begin{3, false, {}}, "0123456789abcdef"), &secret);
  CHECK(std::get<wire::begin>(b) == wire::begin{3, false, {}});
  CHECK(secret == "0123456789abcdef");
  (void)wire::decode(wire::encode(wire::ok{}, "ignored"), &secret);
  CHECK(secret.empty());  // replies carry none
  wire::hello h;
  h.secret = std::string(wire::max_secret_bytes, 'k');
  CHECK(std::get<wire::hello>(wire::decode(wire::encode(h))).secret == h.secret);
  h.secret += 'k';
  CHECK_REFIT_ERROR(wire::decode(wire::encode(h)), errc::protocol, "secret");
  CHECK_REFIT_ERROR(wire::decode(wire::encode(wire::bye{}, std::string(wire::max_secret_bytes + 1, 's'))),
                    errc::protocol, "secret");
  CHECK_REFIT_ERROR(wire::decode(message_raw(END, {U(1), U(2), U(3), U(4), NIL(), T(false), S("text, not bin")})),
                    errc::protocol, "secret must be");
}

TEST_CASE("decode rejects nesting deeper than any message has", "[wire]") {
  mp m;
  m.arr(3).u(BEGIN).u(wire::protocol_version);
  for (int i = 0; i < 40; ++i) m.arr(1);
  m.u(1);
  CHECK_REFIT_ERROR(wire::decode(m.str()), errc::protocol, "malformed message");
}

// ============================================================================= wrong field types

TEST_CASE("decode rejects HELLO fields of the wrong type", "[wire]") {
  const auto h = hello_fields();
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 0, B("token")))), errc::protocol,
                    "HELLO message: token must be a str, got bin");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 1, NIL()))), errc::protocol,
                    "transport must be a str, got nil");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 2, U(5)))), errc::protocol, "peer must be a str");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 3, ARR({})))), errc::protocol, "host_id must be a str");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 4, S("uuid")))), errc::protocol,
                    "device_uuid must be a bin, got str");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 5, I(-256)))), errc::protocol,
                    "alignment must be an unsigned integer, got negative int");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 6, MAP()))), errc::protocol,
                    "buffers must be an array, got map");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 7, S("id")))), errc::protocol, "session must be a bin");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 8, U(2)))), errc::protocol,
                    "HELLO message: mode has unknown value 2");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 8, T(true)))), errc::protocol,
                    "mode must be an unsigned integer, got bool");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 9, B("digest")))), errc::protocol,
                    "layout must be a str, got bin");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 9, S(std::string(5000, 'x'))))), errc::protocol,
                    "layout is 5000 bytes long, more than the limit");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 10, I(-1)))), errc::protocol,
                    "group_rank must be an unsigned integer, got negative int");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 11, S("2")))), errc::protocol,
                    "group_size must be an unsigned integer, got str");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 12, NIL()))), errc::protocol,
                    "reply_timeout_ms must be an unsigned integer, got nil");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 13, U(1)))), errc::protocol,
                    "HELLO message: lane must be a bool, got unsigned int");
}

TEST_CASE("decode rejects a HELLO whose group makes no sense", "[wire]") {
  const auto h = hello_fields();
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 11, U(0)))), errc::protocol,
                    "HELLO message: group_size 0 is not in [1, 4096]");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 11, U(4097)))), errc::protocol,
                    "group_size 4097 is not in [1, 4096]");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(with(h, 10, U(2)), 11, U(2)))), errc::protocol,
                    "HELLO message: group_rank 2 is not below the group's size 2");
  const auto m = wire::decode(message(HELLO, with(with(h, 10, U(1)), 11, U(2))));
  CHECK(std::get<wire::hello>(m).group_rank == 1);
  CHECK(std::get<wire::hello>(m).group_size == 2);
}

TEST_CASE("decode rejects buffer descriptors of the wrong shape or type", "[wire]") {
  const auto h = hello_fields();
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 6, ARR({good_buffer(), U(1)})))), errc::protocol,
                    "buffer 1: descriptor must be an array");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 6, ARR({ARR({U(1), B(""), B("")})})))), errc::protocol,
                    "buffer 0: descriptor must have 4 elements, got 3");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 6, ARR({ARR({S("1"), B(""), B(""), B("")})})))), errc::protocol,
                    "buffer 0: bytes must be an unsigned integer");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 6, ARR({ARR({U(1), S("/shm"), B(""), B("")})})))),
                    errc::protocol, "buffer 0: handle must be a bin, got str");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 6, ARR({ARR({U(1), B(""), NIL(), B("")})})))), errc::protocol,
                    "packed_event must be a bin");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 6, ARR({ARR({U(1), B(""), B(""), U(0)})})))), errc::protocol,
                    "applied_event must be a bin");
}

TEST_CASE("decode rejects BEGIN, END, BATCH header fields of the wrong type", "[wire]") {
  CHECK_REFIT_ERROR(wire::decode(message(BEGIN, {S("1"), T(false), NIL()})), errc::protocol,
                    "BEGIN message: version must be an unsigned integer");
  CHECK_REFIT_ERROR(wire::decode(message(BEGIN, {I(-1), T(false), NIL()})), errc::protocol, "got negative int");
  CHECK_REFIT_ERROR(wire::decode(message(END, {U(1), U(2), T(false), U(4), NIL(), T(false)})), errc::protocol,
                    "END message: bytes must be an unsigned integer, got bool");
  CHECK_REFIT_ERROR(wire::decode(message(END, {U(1), F(2.5), U(3), U(4), NIL(), T(false)})), errc::protocol,
                    "tensors must be");
  const auto b = batch_fields({good_entry()});
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, with(b, 0, NIL()))), errc::protocol, "BATCH message: version must be");
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, with(b, 1, S("0")))), errc::protocol, "BATCH message: seq must be");
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, with(b, 2, I(-1)))), errc::protocol, "BATCH message: buffer must be");
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, with(b, 2, U(1ull << 32)))), errc::protocol, "buffer is 4294967296");
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, with(b, 3, B("entries")))), errc::protocol,
                    "BATCH message: entries must be an array, got bin");
}

TEST_CASE("decode rejects entry fields of the wrong type", "[wire]") {
  const auto bad = [](field e) { return wire::decode(message(BATCH, batch_fields({good_entry(), std::move(e)}))); };
  CHECK_REFIT_ERROR(bad(U(3)), errc::protocol, "entry 1: descriptor must be an array");
  CHECK_REFIT_ERROR(bad(ARR({S("x"), U(8), ARR({U(1)}), U(0), U(4), U(64), U(0)})), errc::protocol,
                    "entry 1: descriptor must have 9 elements, got 7");
  CHECK_REFIT_ERROR(bad(ARR({B("x"), U(8), ARR({U(1)}), U(0), U(4), U(64), U(0), U(0), U(0)})), errc::protocol,
                    "entry 1: name must be a str, got bin");
  CHECK_REFIT_ERROR(bad(ARR({S("x"), S("f32"), ARR({U(1)}), U(0), U(4), U(64), U(0), U(0), U(0)})), errc::protocol,
                    "entry 1 ('x'): dtype must be an unsigned integer, got str");
  CHECK_REFIT_ERROR(bad(ARR({S("x"), U(8), S("[1]"), U(0), U(4), U(64), U(0), U(0), U(0)})), errc::protocol,
                    "entry 1 ('x'): shape must be an array, got str");
  CHECK_REFIT_ERROR(bad(ARR({S("x"), U(8), ARR({U(2), I(-1)}), U(0), U(4), U(64), U(0), U(0), U(0)})), errc::protocol,
                    "entry 1 ('x'): shape[1] must be an unsigned integer, got negative int");
  CHECK_REFIT_ERROR(bad(ARR({S("x"), U(8), ARR({U(1)}), NIL(), U(4), U(64), U(0), U(0), U(0)})), errc::protocol,
                    "entry 1 ('x'): tensor_offset must be");
  CHECK_REFIT_ERROR(bad(ARR({S("x"), U(8), ARR({U(1)}), U(0), S("4"), U(64), U(0), U(0), U(0)})), errc::protocol,
                    "entry 1 ('x'): bytes must be");
  CHECK_REFIT_ERROR(bad(ARR({S("x"), U(8), ARR({U(1)}), U(0), U(4), F(64.5), U(0), U(0), U(0)})), errc::protocol,
                    "entry 1 ('x'): buffer_offset must be an unsigned integer, got float");
  CHECK_REFIT_ERROR(bad(ARR({S("x"), U(8), ARR({U(1)}), U(0), U(4), U(64), U(0), U(0), S("1")})), errc::protocol,
                    "entry 1 ('x'): source must be an unsigned integer, got str");
  CHECK_REFIT_ERROR(bad(ARR({S("x"), U(8), ARR({U(1)}), U(0), U(4), U(64), U(0), U(0), U(1ull << 32)})), errc::protocol,
                    "entry 1 ('x'): source");
}

TEST_CASE("decode checks the memory a batch reads in place", "[wire]") {
  const std::uint64_t f32 = static_cast<std::uint64_t>(dtype::f32);
  // A patch travels in the buffer; bytes may be read where they are.
  CHECK_REFIT_ERROR(
      wire::decode(message(BATCH, batch_fields({entry("x", f32, {10}, 0, 16, 0, U(1), U(40), U(1))}, {B("h")}))),
      errc::protocol, "entry 0 ('x'): source is 1 in a patch entry; a patch travels in the batch's buffer");
  const auto m = wire::decode(message(
      BATCH, batch_fields({entry("x", f32, {10}, 0, 40, 4096, U(0), U(0), U(2))}, {B("first"), B("second")}, true)));
  const auto& b = std::get<wire::batch>(m);
  CHECK(b.entries.at(0).source == 2);
  CHECK(b.entries.at(0).buffer_offset == 4096);
  CHECK(b.sources == std::vector<std::string>{"first", "second"});
  CHECK(b.ready);
  // The records are transport bytes of bounded size, and `ready` a boolean.
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, with(batch_fields({good_entry()}), 4, ARR({S("h")})))), errc::protocol,
                    "sources[0] must be a bin, got str");
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, with(batch_fields({good_entry()}), 4,
                                                     ARR({B(std::string(wire::max_handle_bytes + 1, 'h'))})))),
                    errc::protocol, "sources[0]");
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, with(batch_fields({good_entry()}), 4, U(1)))), errc::protocol,
                    "sources must be an array");
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, with(batch_fields({good_entry()}), 5, U(1)))), errc::protocol,
                    "ready must be a bool");
}

TEST_CASE("decode rejects every bad conversion an OK asks for", "[wire]") {
  const auto ok_with = [](std::vector<field> list) {
    return message(OK, {NIL(), T(false), ARR({}), U(0), ARR(std::move(list)), B("")});
  };
  const auto conv = [](std::string name, std::uint64_t type, std::uint64_t q) {
    return ARR({S(std::move(name)), U(type), U(q)});
  };
  constexpr auto f8 = static_cast<std::uint64_t>(dtype::f8_e4m3);
  constexpr auto bf16 = static_cast<std::uint64_t>(dtype::bf16);
  CHECK_NOTHROW(wire::decode(ok_with({conv("w", f8, 2), conv("b", bf16, 0)})));
  CHECK_REFIT_ERROR(wire::decode(message(OK, {NIL(), T(false), ARR({}), U(0), U(1), B("")})), errc::protocol,
                    "OK message: convert must be an array, got unsigned int");
  CHECK_REFIT_ERROR(wire::decode(ok_with({ARR({S("w"), U(f8)})})), errc::protocol,
                    "OK message: convert[0]: descriptor must have 3 elements, got 2");
  CHECK_REFIT_ERROR(wire::decode(ok_with({conv("", f8, 2)})), errc::protocol, "OK message: convert[0]: name is empty");
  CHECK_REFIT_ERROR(wire::decode(ok_with({ARR({U(1), U(f8), U(2)})})), errc::protocol,
                    "convert[0]: name must be a str, got unsigned int");
  CHECK_REFIT_ERROR(wire::decode(ok_with({conv("w", 99, 2)})), errc::protocol,
                    "convert[0] ('w'): dtype has unknown code 99");
  CHECK_REFIT_ERROR(wire::decode(ok_with({conv("w", static_cast<std::uint64_t>(dtype::i32), 0)})), errc::protocol,
                    "convert[0] ('w'): dtype is i32: refit converts only to f32, bf16, f16, f8_e4m3 and f4_e2m1x2");
  CHECK_REFIT_ERROR(wire::decode(ok_with({conv("w", f8, 6)})), errc::protocol,
                    "convert[0] ('w'): quant has unknown code 6; the peer runs a newer refit or is broken");
  CHECK_REFIT_ERROR(wire::decode(ok_with({conv("w", f8, 5)})), errc::protocol,
                    "convert[0] ('w'): quant is nvfp4 for dtype f8_e4m3: f8_e4m3 needs tensor, block128, channel or "
                    "mxfp8, f4_e2m1x2 nvfp4, other dtypes none");
  CHECK_REFIT_ERROR(wire::decode(ok_with({ARR({S("w"), U(f8), S("block128")})})), errc::protocol,
                    "convert[0] ('w'): quant must be an unsigned integer, got str");
  CHECK_REFIT_ERROR(wire::decode(ok_with({conv("w", f8, 0)})), errc::protocol,
                    "convert[0] ('w'): quant is none for dtype f8_e4m3: f8_e4m3 needs tensor, block128, channel or "
                    "mxfp8, f4_e2m1x2 nvfp4, other dtypes none");
  CHECK_REFIT_ERROR(wire::decode(ok_with({conv("w", bf16, 1)})), errc::protocol,
                    "convert[0] ('w'): quant is tensor for dtype bf16");
  CHECK_REFIT_ERROR(wire::decode(ok_with({conv("w", f8, 2), conv("w", bf16, 0)})), errc::protocol,
                    "convert[1] ('w'): name is listed twice");
}

TEST_CASE("an OK may ask for f8_e4m3 per channel and as mxfp8, never for the scale or packed dtypes", "[wire]") {
  const auto ok_with = [](std::vector<field> list) {
    return message(OK, {NIL(), T(false), ARR({}), U(0), ARR(std::move(list)), B("")});
  };
  const auto conv = [](std::string name, std::uint64_t type, std::uint64_t q) {
    return ARR({S(std::move(name)), U(type), U(q)});
  };
  constexpr auto f8 = static_cast<std::uint64_t>(dtype::f8_e4m3);
  constexpr auto bf16 = static_cast<std::uint64_t>(dtype::bf16);
  const auto decoded = wire::decode(ok_with({conv("a", f8, 3), conv("b", f8, 4)}));
  const auto& o = std::get<wire::ok>(decoded);
  REQUIRE(o.convert.size() == 2);
  CHECK(o.convert[0] == wire::conversion{"a", dtype::f8_e4m3, quant::channel});
  CHECK(o.convert[1] == wire::conversion{"b", dtype::f8_e4m3, quant::mxfp8});
  CHECK_REFIT_ERROR(wire::decode(ok_with({conv("w", bf16, 3)})), errc::protocol,
                    "convert[0] ('w'): quant is channel for dtype bf16: f8_e4m3 needs tensor, block128, channel or "
                    "mxfp8, f4_e2m1x2 nvfp4, other dtypes none");
  CHECK_REFIT_ERROR(wire::decode(ok_with({conv("w", bf16, 4)})), errc::protocol,
                    "convert[0] ('w'): quant is mxfp8 for dtype bf16");
  CHECK_REFIT_ERROR(wire::decode(ok_with({conv("w", static_cast<std::uint64_t>(dtype::f8_e8m0), 4)})), errc::protocol,
                    "convert[0] ('w'): dtype is f8_e8m0: refit converts only to f32, bf16, f16, f8_e4m3 and f4_e2m1x2");
  CHECK_REFIT_ERROR(wire::decode(ok_with({conv("w", static_cast<std::uint64_t>(dtype::f4_e2m1x2), 0)})), errc::protocol,
                    "convert[0] ('w'): quant is none for dtype f4_e2m1x2");
  CHECK_REFIT_ERROR(wire::decode(ok_with({conv("w", 17, 0)})), errc::protocol,
                    "convert[0] ('w'): dtype has unknown code 17; the peer runs a newer refit or is broken");
}

TEST_CASE("an OK may ask for nvfp4 and for swizzled scales, as a fourth descriptor element only when swizzled",
          "[wire][nvfp4]") {
  const auto ok_with = [](std::vector<field> list) {
    return message(OK, {NIL(), T(false), ARR({}), U(0), ARR(std::move(list)), B("")});
  };
  constexpr auto f8 = static_cast<std::uint64_t>(dtype::f8_e4m3);
  constexpr auto f4 = static_cast<std::uint64_t>(dtype::f4_e2m1x2);
  wire::ok ok;
  ok.convert = {wire::conversion{"a", dtype::f4_e2m1x2, quant::nvfp4},
                wire::conversion{"b", dtype::f4_e2m1x2, quant::nvfp4, refit::scale_layout::swizzled_128x4},
                wire::conversion{"c", dtype::f8_e4m3, quant::mxfp8, refit::scale_layout::swizzled_128x4}};
  CHECK(std::get<wire::ok>(roundtrip(ok)) == ok);
  // A row-major conversion stays three elements long: peers that know no layouts read it.
  const auto decoded = wire::decode(ok_with({ARR({S("a"), U(f4), U(5)}), ARR({S("b"), U(f4), U(5), U(1)})}));
  CHECK(std::get<wire::ok>(decoded).convert[0].layout == refit::scale_layout::row_major);
  CHECK(std::get<wire::ok>(decoded).convert[1].layout == refit::scale_layout::swizzled_128x4);
  CHECK_REFIT_ERROR(wire::decode(ok_with({ARR({S("w"), U(f8), U(3), U(1)})})), errc::protocol,
                    "convert[0] ('w'): scale_layout is swizzled_128x4 for quant channel: only mxfp8 and nvfp4 scales "
                    "are swizzled");
  CHECK_REFIT_ERROR(wire::decode(ok_with({ARR({S("w"), U(f4), U(5), U(0)})})), errc::protocol,
                    "convert[0] ('w'): scale_layout has code 0; 1 (swizzled_128x4) is the only one sent");
  CHECK_REFIT_ERROR(wire::decode(ok_with({ARR({S("w"), U(f4), U(5), U(2)})})), errc::protocol,
                    "convert[0] ('w'): scale_layout has code 2");
  CHECK_REFIT_ERROR(wire::decode(ok_with({ARR({S("w"), U(f4), U(5), U(1), U(1)})})), errc::protocol,
                    "OK message: convert[0]: descriptor must have 3 elements, got 5");
}

TEST_CASE("decode rejects OK and ERROR fields of the wrong type", "[wire]") {
  CHECK_REFIT_ERROR(wire::decode(message(OK, {S("3"), T(false), ARR({}), U(0), ARR({}), B("")})), errc::protocol,
                    "OK message: committed must be nil or an unsigned integer, got str");
  CHECK_REFIT_ERROR(wire::decode(message(OK, {I(-3), T(false), ARR({}), U(0), ARR({}), B("")})), errc::protocol,
                    "committed must be nil");
  CHECK_REFIT_ERROR(wire::decode(message(OK, {NIL(), U(0), ARR({}), U(0), ARR({}), B("")})), errc::protocol,
                    "OK message: dirty must be a bool, got unsigned int");
  CHECK_REFIT_ERROR(wire::decode(message(OK, {NIL(), T(true), NIL(), U(0), ARR({}), B("")})), errc::protocol,
                    "handles must be an array");
  CHECK_REFIT_ERROR(wire::decode(message(OK, {NIL(), T(true), ARR({}), U(7), ARR({}), B("")})), errc::protocol,
                    "OK message: mode has unknown value 7");
  CHECK_REFIT_ERROR(wire::decode(message(OK, {NIL(), T(true), ARR({}), S("in place"), ARR({}), B("")})), errc::protocol,
                    "mode must be an unsigned integer");
  CHECK_REFIT_ERROR(wire::decode(message(OK, {NIL(), T(true), ARR({B("a"), S("b")}), U(0), ARR({}), B("")})),
                    errc::protocol, "handles[1] must be a bin, got str");
  CHECK_REFIT_ERROR(wire::decode(message(ERROR, {S("protocol"), S("x")})), errc::protocol,
                    "ERROR message: code must be an unsigned integer, got str");
  CHECK_REFIT_ERROR(wire::decode(message(OK, {NIL(), T(true), ARR({}), U(0)})), errc::protocol,
                    "OK message: 4 fields, expected 6");
  CHECK_REFIT_ERROR(wire::decode(message(OK, {NIL(), T(true), ARR({}), U(0), ARR({}), S("/dev/shm/x")})),
                    errc::protocol, "OK message: lane must be a bin, got str");
  CHECK_REFIT_ERROR(wire::decode(message(OK, {NIL(), T(true), ARR({}), U(0), ARR({}), B(std::string(5000, 'x'))})),
                    errc::protocol, "OK message: lane is 5000 bytes long, more than the limit");
  CHECK_REFIT_ERROR(wire::decode(message(ERROR, {U(2), B("x")})), errc::protocol,
                    "ERROR message: message must be a str");
}

TEST_CASE("decode rejects END's hold and COMMIT fields of the wrong type or count", "[wire]") {
  CHECK_REFIT_ERROR(wire::decode(message(END, {U(1), U(2), U(3), U(4), NIL(), U(1)})), errc::protocol,
                    "END message: hold must be a bool, got unsigned int");
  CHECK_REFIT_ERROR(wire::decode(message(COMMIT, {S("7")})), errc::protocol,
                    "COMMIT message: version must be an unsigned integer, got str");
  CHECK_REFIT_ERROR(wire::decode(message(COMMIT, {I(-1)})), errc::protocol,
                    "COMMIT message: version must be an unsigned integer, got negative int");
  CHECK_REFIT_ERROR(wire::decode(message_raw(COMMIT, {U(1)})), errc::protocol, "COMMIT message: 1 fields, expected 2");
  CHECK_REFIT_ERROR(wire::decode(message_raw(COMMIT, {U(1), U(2)})), errc::protocol, "secret must be");
  std::string secret;
  CHECK(std::get<wire::commit>(wire::decode(wire::encode(wire::commit{5}, "s3cret"), &secret)).version == 5);
  CHECK(secret == "s3cret");
}

TEST_CASE("decode rejects ABORT fields of the wrong type", "[wire]") {
  const std::vector<field> a = {U(7), U(1), S("the source threw")};
  CHECK_REFIT_ERROR(wire::decode(message(ABORT, with(a, 0, S("7")))), errc::protocol,
                    "ABORT message: version must be an unsigned integer, got str");
  CHECK_REFIT_ERROR(wire::decode(message(ABORT, with(a, 0, I(-7)))), errc::protocol,
                    "ABORT message: version must be an unsigned integer, got negative int");
  CHECK_REFIT_ERROR(wire::decode(message(ABORT, with(a, 1, S("invalid_argument")))), errc::protocol,
                    "ABORT message: code must be an unsigned integer, got str");
  CHECK_REFIT_ERROR(wire::decode(message(ABORT, with(a, 1, NIL()))), errc::protocol,
                    "ABORT message: code must be an unsigned integer, got nil");
  CHECK_REFIT_ERROR(wire::decode(message(ABORT, with(a, 2, B("the source threw")))), errc::protocol,
                    "ABORT message: reason must be a str, got bin");
  CHECK_REFIT_ERROR(wire::decode(message(ABORT, with(a, 2, NIL()))), errc::protocol,
                    "ABORT message: reason must be a str, got nil");
}

// ============================================================================== limits and ranges

TEST_CASE("decode rejects an ABORT code outside the errc range", "[wire]") {
  CHECK_REFIT_ERROR(wire::decode(message(ABORT, {U(7), U(0), S("x")})), errc::protocol,
                    "ABORT message: code 0 is not an error code (1..14)");
  CHECK_REFIT_ERROR(wire::decode(message(ABORT, {U(7), U(15), S("x")})), errc::protocol, "15 is not an error code");
  CHECK_REFIT_ERROR(wire::decode(message(ABORT, {U(7), I(-5), S("x")})), errc::protocol, "-5 is not an error code");
  CHECK(std::get<wire::abort>(wire::decode(message(ABORT, {U(7), U(13), S("x")}))).code == errc::internal);
}

TEST_CASE("decode rejects an error code outside the errc range", "[wire]") {
  CHECK_REFIT_ERROR(wire::decode(message(ERROR, {U(0), S("x")})), errc::protocol, "0 is not an error code (1..14)");
  CHECK_REFIT_ERROR(wire::decode(message(ERROR, {U(15), S("x")})), errc::protocol, "15 is not an error code");
  CHECK_REFIT_ERROR(wire::decode(message(ERROR, {I(-5), S("x")})), errc::protocol, "-5 is not an error code");
  CHECK(std::get<wire::error>(wire::decode(message(ERROR, {U(13), S("x")}))).code == errc::internal);
}

TEST_CASE("decode rejects an alignment that is not a power of two", "[wire]") {
  const auto h = hello_fields();
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 5, U(384)))), errc::protocol,
                    "alignment 384 is not a power of two");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 5, U(0)))), errc::protocol, "alignment 0 is not a power");
}

TEST_CASE("decode rejects more buffers than the limit", "[wire]") {
  std::vector<field> buffers(wire::max_buffers + 1, good_buffer());
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(hello_fields(), 6, ARR(buffers)))), errc::protocol,
                    "buffers has 65 elements, more than the limit of 64");
  buffers.pop_back();
  CHECK(std::get<wire::hello>(wire::decode(message(HELLO, with(hello_fields(), 6, ARR(buffers))))).buffers.size() ==
        wire::max_buffers);
}

TEST_CASE("decode rejects handles longer than the limit", "[wire]") {
  const std::string long_handle(wire::max_handle_bytes + 1, 'h');
  const auto h = hello_fields();
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 0, S(long_handle)))), errc::protocol,
                    "token is 4097 bytes long, more than the limit of 4096");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 7, B(long_handle)))), errc::protocol, "session is 4097 bytes");
  CHECK_REFIT_ERROR(wire::decode(message(HELLO, with(h, 6, ARR({ARR({U(1), B(long_handle), B(""), B("")})})))),
                    errc::protocol, "buffer 0: handle is 4097 bytes");
  CHECK_REFIT_ERROR(wire::decode(message(OK, {NIL(), T(false), ARR({B(long_handle)}), U(0), ARR({}), B("")})),
                    errc::protocol, "handles[0] is 4097 bytes");
}

TEST_CASE("decode rejects more entries than the limit", "[wire]") {
  // Each entry a nil: the count is checked before any entry is looked at.
  mp m;
  m.arr(9)
      .u(BATCH)
      .u(wire::protocol_version)
      .u(1)
      .u(0)
      .u(0)
      .arr(static_cast<std::uint32_t>(wire::max_batch_entries + 1));
  for (std::size_t i = 0; i < wire::max_batch_entries + 1; ++i) m.nil();
  m.arr(0).t(false).b("");
  CHECK_REFIT_ERROR(wire::decode(m.str()), errc::protocol, "entries has 65537 elements, more than the limit of 65536");
}

TEST_CASE("decode rejects empty and over-long tensor names", "[wire]") {
  const auto bad = [](std::string name) {
    return wire::decode(message(BATCH, batch_fields({entry(std::move(name), 8, {1}, 0, 4, 0)})));
  };
  CHECK_REFIT_ERROR(bad(""), errc::protocol, "entry 0: name is empty");
  CHECK_REFIT_ERROR(bad(std::string(wire::max_name_bytes + 1, 'n')), errc::protocol,
                    "entry 0: name is 4097 bytes long, more than the limit of 4096");
  CHECK_NOTHROW(bad(std::string(wire::max_name_bytes, 'n')));
}

TEST_CASE("decode rejects an unknown dtype code", "[wire]") {
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, batch_fields({entry("x", 17, {1}, 0, 1, 0)}))), errc::protocol,
                    "entry 0 ('x'): dtype has unknown code 17");
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, batch_fields({entry("y", 1ull << 60, {1}, 0, 1, 0)}))), errc::protocol,
                    "unknown code 1152921504606846976");
}

TEST_CASE("decode rejects shapes with too many dimensions", "[wire]") {
  const std::vector<std::uint64_t> nine(wire::max_rank + 1, 1);
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, batch_fields({entry("deep", 1, nine, 0, 1, 0)}))), errc::protocol,
                    "entry 0 ('deep'): shape has 9 elements, more than the limit of 8");
  const std::vector<std::uint64_t> eight(wire::max_rank, 1);
  CHECK_NOTHROW(wire::decode(message(BATCH, batch_fields({entry("ok", 1, eight, 0, 1, 0)}))));
}

TEST_CASE("decode rejects dimensions and byte counts that do not fit", "[wire]") {
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, batch_fields({entry("x", 1, {1ull << 63}, 0, 1, 0)}))), errc::protocol,
                    "entry 0 ('x'): shape[0] is 9223372036854775808, which does not fit");
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, batch_fields({entry("x", 8, {1ull << 31, 1ull << 31, 8}, 0, 1, 0)}))),
                    errc::protocol, "entry 0 ('x'): shape f32[2147483648, 2147483648, 8] has more bytes than fit");
}

TEST_CASE("decode rejects a byte range past the end of the tensor", "[wire]") {
  // shape × itemsize = 40, but the entry claims 48 bytes.
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, batch_fields({good_entry(), entry("x", 8, {10}, 0, 48, 64)}))),
                    errc::protocol,
                    "BATCH message: entry 1 ('x'): byte range [0, 48) exceeds the tensor's 40 bytes (f32[10])");
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, batch_fields({entry("x", 7, {4, 4}, 30, 4, 0)}))), errc::protocol,
                    "byte range [30, 34) exceeds the tensor's 32 bytes (bf16[4, 4])");
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, batch_fields({entry("x", 1, {0}, 0, 1, 0)}))), errc::protocol,
                    "exceeds the tensor's 0 bytes");
  // The last bytes exactly: fine.
  CHECK_NOTHROW(wire::decode(message(BATCH, batch_fields({entry("x", 7, {4, 4}, 28, 4, 0)}))));
}

TEST_CASE("decode rejects offsets whose sum overflows", "[wire]") {
  const std::uint64_t max = std::numeric_limits<std::uint64_t>::max();
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, batch_fields({entry("x", 1, {16}, max, 2, 0)}))), errc::protocol,
                    "entry 0 ('x'): tensor_offset 18446744073709551615 + bytes 2 overflows");
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, batch_fields({entry("x", 1, {16}, 0, 16, max - 3)}))), errc::protocol,
                    "entry 0 ('x'): buffer_offset 18446744073709551612 + bytes 16 overflows");
}

// ======================================================================================= tracker

namespace {

wire::entry E(std::string name, dtype t, std::vector<std::int64_t> shape, std::uint64_t toff, std::uint64_t bytes,
              std::uint64_t boff) {
  return {std::move(name), t, std::move(shape), toff, bytes, boff};
}

wire::batch BT(std::uint64_t version, std::uint64_t seq, std::uint32_t buffer, std::vector<wire::entry> entries) {
  return {version, seq, buffer, std::move(entries)};
}

// A tracker for two buffers of 1024 bytes, in refit 5.
wire::refit_tracker started(std::uint64_t max_entries = wire::max_batch_entries) {
  wire::refit_tracker t({1024, 1024}, max_entries);
  t.begin({5, false, {}}, std::nullopt);
  return t;
}

}  // namespace

TEST_CASE("tracker accepts a chunked refit over many batches", "[wire]") {
  // Plan a model with the real planner, send every batch through the wire, check it.
  const std::vector<std::uint64_t> sizes{40, 4096, 0, 12, 1000, 1024, 2, 3000};
  refit::plan_options o;
  o.buffer_bytes = 1024;
  o.alignment = 64;
  const auto plan = refit::make_plan(sizes, o);
  std::vector<refit::tensor_meta> metas;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    metas.push_back({"layer." + std::to_string(i), dtype::u8, {static_cast<std::int64_t>(sizes[i])}});
  metas[1] = {"layer.1", dtype::f32, {32, 32}};  // 4096 bytes
  metas[7] = {"layer.7", dtype::bf16, {1500}};   // 3000 bytes

  wire::refit_tracker t({1024, 1024});
  std::optional<std::uint64_t> committed = 3;
  t.begin({4, false, {}}, committed);
  CHECK(t.active());
  CHECK(t.version() == 4);
  for (std::size_t b = 0; b < plan.size(); ++b) {
    wire::batch msg{4, b, static_cast<std::uint32_t>(b % 2), {}};
    for (const auto& e : plan[b].entries)
      msg.entries.push_back({metas[e.tensor].name, metas[e.tensor].type, metas[e.tensor].shape, e.tensor_offset,
                             e.bytes, e.buffer_offset});
    const auto decoded = std::get<wire::batch>(wire::decode(wire::encode(msg)));
    REQUIRE_NOTHROW(t.check(decoded));
  }
  std::uint64_t total = 0;
  for (auto s : sizes) total += s;
  CHECK(t.batches() == plan.size());
  CHECK(t.bytes() == total);
  CHECK(t.tensors_completed() == sizes.size());
  REQUIRE_NOTHROW(t.finish({4, sizes.size(), total, plan.size(), {}}));
  CHECK_FALSE(t.active());
  CHECK(t.completed().size() == sizes.size());
  CHECK(t.completed().contains("layer.1"));
  CHECK(t.completed().contains("layer.2"));
}

TEST_CASE("tracker rejects a BATCH without BEGIN", "[wire]") {
  wire::refit_tracker t({1024});
  CHECK_REFIT_ERROR(t.check(BT(1, 0, 0, {})), errc::protocol, "BATCH without BEGIN");
  // Also after the refit finished.
  t.begin({1, false, {}}, std::nullopt);
  t.check(BT(1, 0, 0, {E("a", dtype::u8, {4}, 0, 4, 0)}));
  t.finish({1, 1, 4, 1, {}});
  CHECK_REFIT_ERROR(t.check(BT(1, 1, 0, {})), errc::protocol, "BATCH without BEGIN");
  CHECK_REFIT_ERROR(t.finish({1, 1, 4, 1, {}}), errc::protocol, "END without BEGIN");
}

TEST_CASE("tracker rejects a BEGIN version not newer than the committed one", "[wire]") {
  wire::refit_tracker t({1024});
  CHECK_REFIT_ERROR(t.begin({7, false, {}}, 7), errc::protocol, "version 7 is not newer than the committed version 7");
  CHECK_REFIT_ERROR(t.begin({3, false, {}}, 7), errc::protocol, "version 3 is not newer than the committed version 7");
  CHECK_FALSE(t.active());
  CHECK_NOTHROW(t.begin({8, false, {}}, 7));
  CHECK_NOTHROW(t.begin({0, false, {}}, std::nullopt));
  CHECK(t.active());
}

TEST_CASE("tracker restarts on a BEGIN during a refit", "[wire]") {
  auto t = started();
  t.check(BT(5, 0, 0, {E("a", dtype::u8, {2048}, 0, 1024, 0)}));
  t.begin({6, false, {}}, std::nullopt);
  CHECK(t.version() == 6);
  CHECK(t.batches() == 0);
  CHECK(t.bytes() == 0);
  // The partial tensor of the aborted refit is forgotten: it may start again from 0.
  CHECK_NOTHROW(t.check(BT(6, 0, 0, {E("a", dtype::u8, {2048}, 0, 1024, 0)})));
}

TEST_CASE("tracker rejects a batch of another version", "[wire]") {
  auto t = started();
  CHECK_REFIT_ERROR(t.check(BT(6, 0, 0, {})), errc::protocol,
                    "version 6 does not match the refit in progress, version 5");
}

TEST_CASE("tracker rejects an out-of-order sequence number", "[wire]") {
  auto t = started();
  CHECK_REFIT_ERROR(t.check(BT(5, 1, 0, {})), errc::protocol, "sequence number 1 out of order, expected 0");
  t.check(BT(5, 0, 0, {}));
  CHECK_REFIT_ERROR(t.check(BT(5, 0, 1, {})), errc::protocol, "sequence number 0 out of order, expected 1");
  CHECK_NOTHROW(t.check(BT(5, 1, 1, {})));
}

TEST_CASE("tracker rejects a buffer index out of range", "[wire]") {
  auto t = started();
  CHECK_REFIT_ERROR(t.check(BT(5, 0, 2, {})), errc::protocol, "buffer index 2 out of range: the session has 2 buffers");
}

TEST_CASE("tracker rejects an entry past the end of its buffer", "[wire]") {
  wire::refit_tracker t({1024, 512});
  t.begin({1, false, {}}, std::nullopt);
  CHECK_REFIT_ERROR(t.check(BT(1, 0, 1, {E("a", dtype::u8, {64}, 0, 64, 480)})), errc::protocol,
                    "entry 0 ('a'): buffer range [480, 480 + 64) exceeds buffer 1's 512 bytes");
  const std::uint64_t max = std::numeric_limits<std::uint64_t>::max();
  CHECK_REFIT_ERROR(t.check(BT(1, 0, 0, {E("a", dtype::u8, {64}, 0, 64, max)})), errc::protocol,
                    "exceeds buffer 0's 1024 bytes");
  CHECK_NOTHROW(t.check(BT(1, 0, 1, {E("a", dtype::u8, {64}, 0, 64, 448)})));
}

TEST_CASE("tracker checks entries read in place against the sources announced so far", "[wire]") {
  auto t = started();
  // Read in place: outside every buffer, overlapping nothing in it, from a source announced by
  // this batch or an earlier one of the refit.
  wire::entry a = E("a", dtype::u8, {4096}, 0, 4096, 1 << 20);
  a.source = 1;
  wire::batch b0 = BT(5, 0, 0, {a, E("p", dtype::u8, {64}, 0, 64, 0)});
  b0.sources = {"one"};
  CHECK_NOTHROW(t.check(b0));
  wire::entry c = E("c", dtype::u8, {8}, 0, 8, 0);
  c.source = 2;
  wire::batch b1 = BT(5, 1, 1, {c});
  CHECK_REFIT_ERROR(t.check(b1), errc::protocol, "entry 0 ('c') reads source 2, but 1 sources were announced");
  b1.sources = {"two"};
  CHECK_NOTHROW(t.check(b1));
  c.name = "d";
  c.source = 1;  // an earlier batch's source
  CHECK_NOTHROW(t.check(BT(5, 2, 0, {c})));
  CHECK(t.bytes() == 4096 + 64 + 8 + 8);
  // A new refit numbers its sources afresh.
  t.begin({6, false, {}}, std::nullopt);
  CHECK_REFIT_ERROR(t.check(BT(6, 0, 0, {c})), errc::protocol, "reads source 1, but 0 sources were announced");
}

TEST_CASE("tracker rejects more entries than its limit", "[wire]") {
  auto t = started(2);
  CHECK_REFIT_ERROR(t.check(BT(5, 0, 0,
                               {E("a", dtype::u8, {1}, 0, 1, 0), E("b", dtype::u8, {1}, 0, 1, 64),
                                E("c", dtype::u8, {1}, 0, 1, 128)})),
                    errc::protocol, "3 entries, more than the limit of 2");
}

TEST_CASE("tracker rejects overlapping entries in a batch", "[wire]") {
  auto t = started();
  CHECK_REFIT_ERROR(t.check(BT(5, 0, 0, {E("b", dtype::f32, {10}, 0, 40, 32), E("a", dtype::f32, {10}, 0, 40, 0)})),
                    errc::protocol, "entries 1 ('a') at [0, 40) and 0 ('b') at [32, 72) overlap in buffer 0");
  // Zero-byte entries overlap nothing; touching ranges do not overlap.
  CHECK_NOTHROW(t.check(
      BT(5, 0, 0,
         {E("a", dtype::f32, {10}, 0, 40, 0), E("z", dtype::f32, {0}, 0, 0, 0), E("b", dtype::f32, {10}, 0, 40, 40)})));
}

TEST_CASE("tracker rejects a tensor sent twice", "[wire]") {
  SECTION("in one batch") {
    auto t = started();
    CHECK_REFIT_ERROR(t.check(BT(5, 0, 0, {E("a", dtype::u8, {8}, 0, 8, 0), E("a", dtype::u8, {8}, 0, 8, 64)})),
                      errc::protocol, "entry 1 ('a'): duplicate tensor 'a'");
  }
  SECTION("across batches") {
    auto t = started();
    t.check(BT(5, 0, 0, {E("a", dtype::u8, {8}, 0, 8, 0)}));
    CHECK_REFIT_ERROR(t.check(BT(5, 1, 1, {E("a", dtype::u8, {8}, 0, 8, 0)})), errc::protocol, "duplicate tensor 'a'");
  }
  SECTION("a zero-byte tensor") {
    auto t = started();
    t.check(BT(5, 0, 0, {E("z", dtype::u8, {0}, 0, 0, 0)}));
    CHECK(t.tensors_completed() == 1);
    CHECK_REFIT_ERROR(t.check(BT(5, 1, 0, {E("z", dtype::u8, {0}, 0, 0, 0)})), errc::protocol, "duplicate tensor 'z'");
  }
  SECTION("a chunk after the last one") {
    auto t = started();
    t.check(BT(5, 0, 0, {E("big", dtype::u8, {2048}, 0, 1024, 0)}));
    t.check(BT(5, 1, 1, {E("big", dtype::u8, {2048}, 1024, 1024, 0)}));
    CHECK_REFIT_ERROR(t.check(BT(5, 2, 0, {E("big", dtype::u8, {2048}, 1024, 1024, 0)})), errc::protocol,
                      "duplicate tensor 'big'");
  }
}

TEST_CASE("tracker rejects a first chunk that does not start at 0", "[wire]") {
  auto t = started();
  CHECK_REFIT_ERROR(t.check(BT(5, 0, 0, {E("big", dtype::u8, {2048}, 1024, 1024, 0)})), errc::protocol,
                    "entry 0 ('big'): the first chunk of a tensor must start at offset 0, got 1024");
}

TEST_CASE("tracker rejects a gap or an overlap between chunks", "[wire]") {
  auto t = started();
  t.check(BT(5, 0, 0, {E("big", dtype::f32, {512}, 0, 1024, 0)}));
  CHECK_REFIT_ERROR(t.check(BT(5, 1, 1, {E("big", dtype::f32, {512}, 1040, 512, 0)})), errc::protocol,
                    "chunk starts at byte 1040 but the previous chunk ended at byte 1024");
  CHECK_REFIT_ERROR(t.check(BT(5, 1, 1, {E("big", dtype::f32, {512}, 512, 1024, 0)})), errc::protocol,
                    "chunk starts at byte 512 but");
  CHECK_NOTHROW(t.check(BT(5, 1, 1, {E("big", dtype::f32, {512}, 1024, 1024, 0)})));
}

TEST_CASE("tracker rejects a chunk that changes dtype or shape", "[wire]") {
  auto t = started();
  t.check(BT(5, 0, 0, {E("big", dtype::f32, {512}, 0, 1024, 0)}));
  CHECK_REFIT_ERROR(t.check(BT(5, 1, 1, {E("big", dtype::i32, {512}, 1024, 1024, 0)})), errc::protocol,
                    "entry 0 ('big'): chunk changes the tensor from f32[512] to i32[512]");
  CHECK_REFIT_ERROR(t.check(BT(5, 1, 1, {E("big", dtype::f32, {2, 256}, 1024, 1024, 0)})), errc::protocol,
                    "from f32[512] to f32[2, 256]");
}

TEST_CASE("tracker rejects a chunk past the end of its tensor", "[wire]") {
  auto t = started();
  t.check(BT(5, 0, 0, {E("big", dtype::u8, {1500}, 0, 1024, 0)}));
  CHECK_REFIT_ERROR(t.check(BT(5, 1, 1, {E("big", dtype::u8, {1500}, 1024, 1000, 0)})), errc::protocol,
                    "exceeds the tensor's 1500 bytes");
}

TEST_CASE("tracker state is unchanged by a rejected batch", "[wire]") {
  auto t = started();
  t.check(BT(5, 0, 0, {E("a", dtype::u8, {8}, 0, 8, 0)}));
  // The first entry is good, the second a duplicate: nothing of the batch may stick.
  CHECK_THROWS(t.check(BT(5, 1, 1, {E("b", dtype::u8, {8}, 0, 8, 0), E("a", dtype::u8, {8}, 0, 8, 64)})));
  CHECK(t.batches() == 1);
  CHECK(t.bytes() == 8);
  CHECK(t.tensors_completed() == 1);
  CHECK_NOTHROW(t.check(BT(5, 1, 1, {E("b", dtype::u8, {8}, 0, 8, 0)})));
  CHECK_NOTHROW(t.finish({5, 2, 16, 2, {}}));
}

TEST_CASE("tracker accepts several chunks of one tensor in one batch", "[wire]") {
  auto t = started();
  CHECK_NOTHROW(t.check(BT(5, 0, 0, {E("a", dtype::u8, {100}, 0, 60, 0), E("a", dtype::u8, {100}, 60, 40, 64)})));
  CHECK(t.completed().contains("a"));
  CHECK_NOTHROW(t.finish({5, 1, 100, 1, {}}));
}

TEST_CASE("tracker END fails as incomplete when a chunk is missing", "[wire]") {
  auto t = started();
  t.check(BT(5, 0, 0, {E("small", dtype::u8, {4}, 0, 4, 0)}));
  t.check(BT(5, 1, 1, {E("big", dtype::u8, {2048}, 0, 1024, 0)}));
  CHECK_REFIT_ERROR(t.finish({5, 2, 2052, 2, {}}), errc::incomplete,
                    "tensor 'big' is incomplete: 1024 of 2048 bytes arrived");
  CHECK(t.active());
}

TEST_CASE("tracker END fails as incomplete when the totals differ", "[wire]") {
  auto t = started();
  t.check(BT(5, 0, 0, {E("a", dtype::u8, {4}, 0, 4, 0), E("b", dtype::u8, {6}, 0, 6, 64)}));
  t.check(BT(5, 1, 1, {E("c", dtype::u8, {10}, 0, 10, 0)}));
  CHECK_REFIT_ERROR(t.finish({5, 4, 20, 2, {}}), errc::incomplete, "the streamer sent 4 tensors but 3 arrived");
  CHECK_REFIT_ERROR(t.finish({5, 3, 21, 2, {}}), errc::incomplete, "the streamer sent 21 bytes but 20 arrived");
  CHECK_REFIT_ERROR(t.finish({5, 3, 20, 3, {}}), errc::incomplete, "the streamer sent 3 batches but 2 arrived");
  CHECK_REFIT_ERROR(t.finish({6, 3, 20, 2, {}}), errc::protocol,
                    "END: version 6 does not match the refit in progress, version 5");
  CHECK(t.active());
  CHECK_NOTHROW(t.finish({5, 3, 20, 2, {}}));
  CHECK_FALSE(t.active());
}

// ============================================================================= subset and delta (protocol 3)

TEST_CASE("BEGIN carries subset and the delta's base, END the version checksum", "[wire][delta]") {
  const auto b = std::get<wire::begin>(wire::decode(message(BEGIN, {U(9), T(true), U(8)})));
  CHECK(b == wire::begin{9, true, 8});
  CHECK(std::get<wire::begin>(wire::decode(message(BEGIN, {U(9), T(true), NIL()}))) == wire::begin{9, true, {}});
  CHECK(std::get<wire::begin>(wire::decode(wire::encode(wire::begin{9, true, 3}))) == wire::begin{9, true, 3});
  CHECK(std::get<wire::end>(wire::decode(message(END, {U(9), U(1), U(2), U(3), U(77), T(false)}))).checksum == 77u);
  CHECK_FALSE(std::get<wire::end>(wire::decode(message(END, {U(9), U(1), U(2), U(3), NIL(), T(false)}))).checksum);
}

TEST_CASE("decode rejects every bad subset, base and checksum", "[wire][delta]") {
  CHECK_REFIT_ERROR(wire::decode(message(BEGIN, {U(9), U(1), NIL()})), errc::protocol,
                    "BEGIN message: subset must be a bool");
  CHECK_REFIT_ERROR(wire::decode(message(BEGIN, {U(9), NIL(), NIL()})), errc::protocol, "subset must be a bool");
  CHECK_REFIT_ERROR(wire::decode(message(BEGIN, {U(9), T(true), S("8")})), errc::protocol,
                    "BEGIN message: base must be nil or an unsigned integer, got str");
  CHECK_REFIT_ERROR(wire::decode(message(BEGIN, {U(9), T(true), I(-1)})), errc::protocol,
                    "base must be nil or an unsigned integer");
  CHECK_REFIT_ERROR(wire::decode(message(BEGIN, {U(9), T(true), U(9)})), errc::protocol,
                    "base 9 is not older than the version 9");
  CHECK_REFIT_ERROR(wire::decode(message(BEGIN, {U(9), T(true), U(10)})), errc::protocol,
                    "base 10 is not older than the version 9");
  CHECK_REFIT_ERROR(wire::decode(message(BEGIN, {U(9), T(false), U(8)})), errc::protocol, "subset is false in a delta");
  CHECK_REFIT_ERROR(wire::decode(message(END, {U(9), U(1), U(2), U(3), T(true), T(false)})), errc::protocol,
                    "END message: checksum must be nil or an unsigned integer, got bool");
  CHECK_REFIT_ERROR(wire::decode(message(END, {U(9), U(1), U(2), U(3), F(1.5), T(false)})), errc::protocol,
                    "checksum must be nil or an unsigned integer");
}

TEST_CASE("decode accepts a good patch entry", "[wire][delta]") {
  // bf16[100]: 3 changes of 6 bytes each over the span [64, 64 + 128).
  const auto m = wire::decode(message(BATCH, batch_fields({entry("x", 7, {100}, 64, 18, 0, U(1), U(128))})));
  const wire::entry& e = std::get<wire::batch>(m).entries.at(0);
  CHECK(e.kind == wire::entry_kind::patch);
  CHECK(e.span == 128);
  CHECK(e.covered() == 128);
  CHECK(e.bytes == 18);
  wire::batch b{7, 0, 1, {e}};
  CHECK(std::get<wire::batch>(wire::decode(wire::encode(b))) == b);
  CHECK(wire::to_string(wire::entry_kind::patch) == "patch");
}

TEST_CASE("decode rejects every bad entry kind and patch", "[wire][delta]") {
  const auto bad = [](field kind, field span, std::uint64_t toff = 64, std::uint64_t bytes = 18) {
    return wire::decode(message(BATCH, batch_fields({entry("x", 7, {100}, toff, bytes, 0, kind, span)})));
  };
  CHECK_REFIT_ERROR(bad(U(2), U(0)), errc::protocol, "entry 0 ('x'): kind has unknown value 2");
  CHECK_REFIT_ERROR(bad(S("patch"), U(0)), errc::protocol, "kind must be an unsigned integer");
  CHECK_REFIT_ERROR(bad(U(1), S("x")), errc::protocol, "span must be an unsigned integer");
  // A bytes entry covers exactly its bytes.
  CHECK_REFIT_ERROR(bad(U(0), U(18)), errc::protocol, "span is 18 in an entry of kind bytes");
  // The span lies inside the tensor (bf16[100] = 200 bytes), on element boundaries.
  CHECK_REFIT_ERROR(bad(U(1), U(138)), errc::protocol, "span [64, 64 + 138) exceeds the tensor's 200 bytes");
  CHECK_REFIT_ERROR(bad(U(1), U(128), std::numeric_limits<std::uint64_t>::max() - 1, 0), errc::protocol,
                    "exceeds the tensor's 200 bytes");
  CHECK_REFIT_ERROR(bad(U(1), U(127)), errc::protocol, "is not on 2-byte element boundaries");
  CHECK_REFIT_ERROR(bad(U(1), U(128), 63), errc::protocol, "is not on 2-byte element boundaries");
  // Whole (index, value) records, no more than the span's elements.
  CHECK_REFIT_ERROR(bad(U(1), U(128), 64, 17), errc::protocol, "bytes 17 is not a whole number of 6-byte");
  CHECK_REFIT_ERROR(bad(U(1), U(4), 64, 18), errc::protocol, "hold 3 changes, more than the 2 elements of the span");
  // A patch's buffer bytes are not tensor bytes: more of them than the tensor holds is fine.
  CHECK_NOTHROW(bad(U(1), U(128), 64, 6 * 64));
}

TEST_CASE("decode rejects a patch span of more than 2^32 - 1 elements", "[wire][delta]") {
  const std::uint64_t n = 1ull << 33;
  CHECK_REFIT_ERROR(wire::decode(message(BATCH, batch_fields({entry("x", 1, {n}, 0, 5, 0, U(1), U(n))}))),
                    errc::protocol, "covers 8589934592 elements; a patch indexes at most 2^32 - 1");
}

TEST_CASE("tracker counts a patch by its span and refuses one outside a delta", "[wire][delta]") {
  wire::refit_tracker t({1024, 1024});
  const auto patch = [](std::uint64_t off, std::uint64_t bytes, std::uint64_t span, std::uint64_t boff) {
    wire::entry e{"a", dtype::bf16, {100}, off, bytes, boff, wire::entry_kind::patch, span};
    return e;
  };
  t.begin({5, true, std::nullopt}, 4);
  CHECK_REFIT_ERROR(t.check(wire::batch{5, 0, 0, {patch(0, 6, 200, 0)}}), errc::protocol,
                    "a patch entry in version 5, which is not a delta");
  t.begin({6, true, 4}, 4);
  CHECK_NOTHROW(t.check(wire::batch{6, 0, 0, {patch(0, 6, 128, 0)}}));
  CHECK_FALSE(t.completed().contains("a"));
  CHECK_REFIT_ERROR(t.check(wire::batch{6, 1, 1, {patch(64, 6, 72, 0)}}), errc::protocol,
                    "chunk starts at byte 64 but the previous chunk ended at byte 128");
  wire::entry rest{"a", dtype::bf16, {100}, 128, 72, 0, wire::entry_kind::bytes, 0};
  CHECK_NOTHROW(t.check(wire::batch{6, 1, 1, {rest}}));
  CHECK(t.completed().contains("a"));
  CHECK(t.bytes() == 78);
  CHECK_NOTHROW(t.finish({6, 1, 78, 2, 5}));
}

TEST_CASE("a tracker reused for refits of other names keeps no name of an earlier refit", "[wire]") {
  // reset() keeps the nodes of the names that completed for the next refit: none may stay a name.
  wire::refit_tracker t({1024});
  t.begin({1, false, {}}, std::nullopt);
  t.check(BT(1, 0, 0,
             {E("model.layers.0.self_attn.q_proj.weight", dtype::u8, {4}, 0, 4, 0), E("b", dtype::u8, {4}, 0, 4, 256),
              E("c", dtype::u8, {4}, 0, 4, 512)}));
  t.finish({1, 3, 12, 1, {}});
  t.begin({2, false, {}}, 1);
  CHECK(t.completed().empty());
  t.check(BT(2, 0, 0, {E("d", dtype::u8, {4}, 0, 4, 0), E("b", dtype::u8, {8}, 0, 4, 256)}));
  CHECK(t.completed().size() == 1);
  CHECK(t.completed().contains("d"));
  CHECK_FALSE(t.completed().contains("b"));  // half of its 8 bytes
  CHECK_FALSE(t.completed().contains("model.layers.0.self_attn.q_proj.weight"));
  // A name of the earlier refit arrives afresh; one of this refit is a duplicate, with its message.
  t.check(
      BT(2, 1, 0,
         {E("b", dtype::u8, {8}, 4, 4, 0), E("model.layers.0.self_attn.q_proj.weight", dtype::u8, {4}, 0, 4, 256)}));
  try {
    t.check(BT(2, 2, 0, {E("e", dtype::u8, {4}, 0, 4, 0), E("d", dtype::u8, {4}, 0, 4, 256)}));
    FAIL("a duplicate was accepted");
  } catch (const refit::error& e) {
    CHECK(e.code() == errc::protocol);
    CHECK(std::string(e.what()) == "BATCH 2: entry 1 ('d'): duplicate tensor 'd': it already arrived whole");
  }
  // The refused batch recorded nothing: "e" may still come.
  CHECK_FALSE(t.completed().contains("e"));
  t.check(BT(2, 2, 0, {E("e", dtype::u8, {4}, 0, 4, 0), E("e2", dtype::u8, {4}, 0, 4, 256)}));
  try {
    t.check(BT(2, 3, 0, {E("f", dtype::u8, {4}, 0, 4, 0), E("f", dtype::u8, {4}, 0, 4, 256)}));
    FAIL("a duplicate was accepted");
  } catch (const refit::error& e) {
    CHECK(std::string(e.what()) ==
          "BATCH 3: entry 1 ('f'): duplicate tensor 'f': it already arrived whole in this batch");
  }
  CHECK_NOTHROW(t.finish({2, 5, 24, 3, {}}));
  CHECK(t.completed().size() == 5);
  for (const char* n : {"b", "d", "e", "e2", "model.layers.0.self_attn.q_proj.weight"})
    CHECK(t.completed().contains(n));
}

TEST_CASE("a BATCH entry's errors name the entry after a valid entry as before", "[wire]") {
  // decode() formats an entry's prefix only when one of its fields fails.
  wire::batch b{1, 0, 0, {E("good", dtype::u8, {4}, 0, 4, 0), E("bad", dtype::u8, {4}, 0, 8, 256)}};
  try {
    (void)wire::decode(wire::encode(b));
    FAIL("accepted");
  } catch (const refit::error& e) {
    CHECK(std::string(e.what()) ==
          "invalid BATCH message: entry 1 ('bad'): byte range [0, 8) exceeds the tensor's 4 bytes (u8[4])");
  }
}

TEST_CASE("a recycled name set refuses a name twice and after clear() takes every name anew", "[wire]") {
  wire::recycled_names names;
  CHECK(names.insert("model.layers.0.self_attn.q_proj.weight"));
  CHECK(names.insert("b"));
  CHECK_FALSE(names.insert("b"));
  CHECK(names.size() == 2);
  names.clear();
  CHECK(names.size() == 0);
  CHECK_FALSE(names.contains("b"));
  // The kept nodes take other names, longer and shorter than those they held.
  CHECK(names.insert("c"));
  CHECK(names.insert("model.layers.31.mlp.down_proj.weight_of_a_long_name"));
  CHECK_FALSE(names.insert("c"));
  CHECK(names.insert("b"));
  CHECK(names.size() == 3);
  CHECK(names.contains("model.layers.31.mlp.down_proj.weight_of_a_long_name"));
  CHECK_FALSE(names.contains("model.layers.0.self_attn.q_proj.weight"));
}

TEST_CASE("a yield order follows the last refit's names without the set, and finds a name twice either way", "[wire]") {
  wire::recycled_names set;
  wire::yield_order<int> order;
  bool twice = false;
  const auto take = [&](std::string_view name) { return order.take(name, set, twice); };
  // The first refit records its order through the set.
  order.begin(true);
  for (int k = 0; k < 3; ++k) {
    auto* s = take(std::string(1, static_cast<char>('a' + k)));
    REQUIRE(s != nullptr);
    CHECK_FALSE(twice);
    s->data = 10 + k;
  }
  CHECK(take("b") == nullptr);
  CHECK(twice);
  order.end();
  CHECK(order.size() == 3);
  // The same order: each name its slot, its data kept, the set untouched.
  set.clear();
  order.begin(true);
  for (int k = 0; k < 3; ++k) {
    auto* s = take(std::string(1, static_cast<char>('a' + k)));
    REQUIRE(s != nullptr);
    CHECK(s->data == 10 + k);
  }
  CHECK(order.following());
  CHECK(set.empty());
  // Past the end, or a name met already: the names before go into the set, which finds it.
  CHECK(take("a") == nullptr);
  CHECK(twice);
  CHECK_FALSE(order.following());
  CHECK(set.size() == 3);
  // That refit failed (a name twice throws: no end()), and took the order with it: the next one
  // records anew. Then one in another order: a, c, b after a, b, c.
  set.clear();
  order.begin(true);
  for (const char* name : {"a", "b", "c"}) take(name)->data = 10 + (name[0] - 'a');
  order.end();
  set.clear();
  order.begin(true);
  CHECK(take("a")->data == 10);
  auto* c = take("c");  // out of order: recorded anew, its data fresh
  REQUIRE(c != nullptr);
  CHECK_FALSE(twice);
  CHECK(c->data == 0);
  CHECK(take("a") == nullptr);
  CHECK(twice);
  auto* b = take("b");
  REQUIRE(b != nullptr);
  CHECK(b->data == 0);
  order.end();
  CHECK(order.size() == 3);
  // That order is the next refit's; a shorter refit with the same first names keeps them only.
  set.clear();
  order.begin(true);
  CHECK(take("a")->data == 10);
  CHECK(take("c") != nullptr);
  CHECK(order.following());
  order.end();
  CHECK(order.size() == 2);
  // A subset checks every name by the set and leaves the order as it was.
  set.clear();
  order.begin(false);
  CHECK(take("c") == nullptr);
  CHECK_FALSE(twice);
  CHECK(take("c") == nullptr);
  CHECK(twice);
  order.end();
  CHECK(order.size() == 2);
  // A refit that failed after leaving the order (no end()) leaves none behind.
  set.clear();
  order.begin(true);
  CHECK(take("z") != nullptr);
  set.clear();
  order.begin(true);
  CHECK_FALSE(order.size() == 2);
  CHECK(take("a") != nullptr);
  CHECK_FALSE(twice);
}

TEST_CASE("a recycled name set keeps the names of earlier refits only while they are not too many", "[wire]") {
  wire::recycled_names names;
  for (int k = 0; k < 300; ++k) CHECK(names.insert("layer." + std::to_string(k)));
  names.clear();
  // The same names again: stored once, each taken anew.
  for (int k = 0; k < 300; ++k) CHECK(names.insert("layer." + std::to_string(k)));
  CHECK_FALSE(names.insert("layer.7"));
  CHECK(names.stored() == 300);
  // A one-name refit between two whole ones keeps the whole refit's names (no churn).
  names.clear();
  CHECK(names.insert("layer.3"));
  names.clear();
  CHECK(names.stored() == 300);
  CHECK(names.size() == 0);
  CHECK_FALSE(names.contains("layer.3"));
  // Names that change at every refit are dropped once they outnumber twice the largest refit
  // (300) plus 1,024: the set never holds more than that and one refit's names.
  std::size_t most = 0;
  for (int refit = 0; refit < 20; ++refit) {
    for (int k = 0; k < 300; ++k) CHECK(names.insert("v" + std::to_string(refit) + "." + std::to_string(k)));
    most = std::max(most, names.stored());
    names.clear();
  }
  CHECK(most <= 2 * 300 + 1024 + 300);
  CHECK(names.stored() <= 2 * 300 + 1024);
}

// ================================================================ ERROR and ABORT text from a peer

namespace {

// What an attacker put in an ERROR it sent a streamer: bytes that are not UTF-8, a NUL, escape
// sequences and a newline before a forged last line of the bench.
const std::string hostile_text = std::string(std::string_view("tensor '\xff\xfe\x80' is unknown\0hidden", 30)) +
                                 "\x1b[2K\x1b[1A\r\nrefit-bench: every refit verified, 0 wrong";
const std::string hostile_shown =
    "tensor '\\xff\\xfe\\x80' is unknown\\x00hidden\\x1b[2K\\x1b[1A\\x0d\\nrefit-bench: every refit verified, 0 wrong";

// The str field `k` of an encoded message, as the bytes on the wire.
std::string str_on_wire(const std::string& bytes, std::uint32_t k) {
  const msgpack::object_handle h = msgpack::unpack(bytes.data(), bytes.size());
  const msgpack::object& o = h.get();
  REQUIRE(o.type == msgpack::type::ARRAY);
  REQUIRE(o.via.array.size > k);
  const msgpack::object& s = o.via.array.ptr[k];
  REQUIRE(s.type == msgpack::type::STR);
  return std::string(s.via.str.ptr, s.via.str.size);
}

}  // namespace

TEST_CASE("an ERROR's message and an ABORT's reason of invalid UTF-8, NULs and escapes decode to one printable line",
          "[wire]") {
  REQUIRE(hostile_text.find('\0') != std::string::npos);
  const auto e = std::get<wire::error>(wire::decode(message(ERROR, {U(10), S(hostile_text)})));
  CHECK(e.code == errc::apply);
  CHECK(e.message == hostile_shown);
  const auto a = std::get<wire::abort>(wire::decode(message(ABORT, {U(3), U(13), S(hostile_text)})));
  CHECK(a.version == 3);
  CHECK(a.code == errc::internal);
  CHECK(a.reason == hostile_shown);
  // Valid text in any script arrives as it was sent.
  CHECK(std::get<wire::error>(wire::decode(message(ERROR, {U(10), S("张量 '模型.权重' 不存在")}))).message ==
        "张量 '模型.权重' 不存在");
}

TEST_CASE("an ERROR or ABORT carrying 8 MiB of text decodes to a few KiB that say how much was cut", "[wire]") {
  std::string flood(8u << 20, 'e');
  for (std::size_t i = 0; i < flood.size(); i += 80) flood[i] = '\n';
  for (const bool abort : {false, true}) {
    const wire::message m =
        abort ? wire::decode(message(ABORT, {U(3), U(5), S(flood)})) : wire::decode(message(ERROR, {U(5), S(flood)}));
    const std::string& text = abort ? std::get<wire::abort>(m).reason : std::get<wire::error>(m).message;
    CHECK(text.size() <= wire::max_text_bytes);
    CHECK(text.size() > wire::max_text_bytes - 100);
    CHECK(text.find('\n') == std::string::npos);
    CHECK(text.starts_with("\\neeeeeeeeeeeeeee"));
    const auto note = text.rfind(" … (");
    REQUIRE(note != std::string::npos);
    CHECK_THAT(text.substr(note), Catch::Matches(R"( … \(83\d{5} more bytes\))"));
  }
}

TEST_CASE("an ERROR or ABORT encodes its text as valid, escaped, bounded UTF-8 whatever it was given", "[wire]") {
  const std::string error = wire::encode(wire::error{errc::apply, hostile_text});
  CHECK(str_on_wire(error, 3) == hostile_shown);
  const std::string abort = wire::encode(wire::abort{4, errc::io, hostile_text});
  CHECK(str_on_wire(abort, 4) == hostile_shown);
  // What was escaped once is not escaped again: a decoded message encodes to the same bytes.
  CHECK(wire::encode(wire::decode(error)) == error);
  CHECK(wire::encode(wire::decode(abort)) == abort);
  CHECK(std::get<wire::error>(wire::decode(error)).message == hostile_shown);
  // A receiver's error that quotes a huge name is cut to the bound.
  const std::string huge = wire::encode(wire::error{errc::protocol, std::string(8u << 20, '\x1b')});
  CHECK(str_on_wire(huge, 3).size() <= wire::max_text_bytes);
  CHECK(str_on_wire(huge, 3).ends_with(" more bytes)"));
}

namespace {
/// Peak resident memory of this process so far, in bytes.
std::uint64_t peak_rss() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<std::uint64_t>(u.ru_maxrss) * 1024;
}
}  // namespace

TEST_CASE("decoding the costliest messages of their size stays within a bounded multiple of their bytes", "[wire]") {
  // The worst shapes per byte of wire: a BATCH of as many entries as it may hold, each the smallest
  // an entry can be (a 1-byte name, no dimension), and an OK of 2^20 empty handles. Each decoded in
  // a child of its own, its peak resident memory against the one before: at most 40 x its bytes
  // (measured: 33.5 x, 24 MB, and 28 x, 59 MB; with 2^20 BATCH entries, before max_batch_entries,
  // 389 MB).
  mp batch;
  batch.arr(9)
      .u(BATCH)
      .u(wire::protocol_version)
      .u(1)
      .u(0)
      .u(0)
      .arr(static_cast<std::uint32_t>(wire::max_batch_entries));
  for (std::size_t i = 0; i < wire::max_batch_entries; ++i)
    batch.arr(9).s("x").u(1).arr(0).u(0).u(0).u(0).u(0).u(0).u(0);
  batch.arr(0).t(false).b("");
  mp ok;
  ok.arr(8).u(OK).u(wire::protocol_version).nil().t(false).arr(static_cast<std::uint32_t>(wire::max_entries));
  for (std::size_t i = 0; i < wire::max_entries; ++i) ok.b("");
  ok.u(0).arr(0).b("");
  for (const auto& [what, bytes, most] : {std::tuple{"BATCH", batch.str(), 40}, std::tuple{"OK", ok.str(), 40}}) {
    INFO(what << ": " << bytes.size() << " bytes");
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {  // the child: its peak starts at what it shares with this process
      const std::uint64_t before = peak_rss();
      try {
        (void)wire::decode(bytes);
      } catch (const refit::error&) {
        // Refused after parsing: the parse was paid all the same.
      }
      const std::uint64_t grew = peak_rss() - before;
      std::fprintf(stderr, "%s: decoding %zu bytes grew the peak by %llu bytes (%.1f x)\n", what, bytes.size(),
                   static_cast<unsigned long long>(grew),
                   static_cast<double>(grew) / static_cast<double>(bytes.size()));
#if defined(__SANITIZE_THREAD__)
      // ThreadSanitizer's shadow of every allocation is resident too: the bound cannot be read here.
      ::_exit(0);
#else
      ::_exit(grew > static_cast<std::uint64_t>(most) * bytes.size() + (4u << 20) ? 3 : 0);
#endif
    }
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
}
