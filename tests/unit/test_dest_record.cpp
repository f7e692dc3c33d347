// wire::encode_dest / decode_dest: the destination records of a direct offer (cuda_ipc), where a
// receiver tells the streamer which view of its weights each source lands in. Every field and the
// view itself are validated: a record that decodes is one the copies may trust.
#include <catch2/catch.hpp>

#include <msgpack.hpp>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>

#include "refit/error.hpp"
#include "wire/wire.hpp"

namespace wire = refit::wire;
using refit::dtype;
using refit::errc;

namespace {

wire::dest_record shard() {
  return wire::dest_record{"layers.0.o_proj.weight",           dtype::bf16, {4096, 2048}, {2048, 1},
                           refit::source_slice{1, 2048, 2048}, 3,           1ull << 20};
}

/// A record as msgpack, built field by field so that each test can break one.
std::string raw(const std::function<void(msgpack::packer<msgpack::sbuffer>&)>& fields, std::uint32_t n = 7) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> p(buf);
  p.pack_array(n);
  fields(p);
  return std::string(buf.data(), buf.size());
}

void good_fields(msgpack::packer<msgpack::sbuffer>& p) {
  p.pack(std::string("w"));
  p.pack(static_cast<std::uint64_t>(dtype::f32));
  p.pack_array(2), p.pack(4), p.pack(3);
  p.pack_array(2), p.pack(10), p.pack(1);
  p.pack_nil();
  p.pack(0), p.pack(64);
}

std::string refusal(std::string_view bytes) {
  try {
    (void)wire::decode_dest(bytes);
  } catch (const refit::error& e) {
    CHECK(e.code() == errc::protocol);
    return e.what();
  }
  FAIL("decode_dest accepted a bad record");
  return {};
}

}  // namespace

TEST_CASE("a destination record survives encode and decode, slice, strides and empty views included", "[wire][dest]") {
  for (const wire::dest_record& d :
       {shard(), wire::dest_record{"q", dtype::f8_e4m3, {64, 32}, {}, std::nullopt, 0, 0},
        wire::dest_record{"empty", dtype::f32, {0, 8}, {}, std::nullopt, wire::dest_record::no_allocation, 0},
        wire::dest_record{"scalar", dtype::i64, {}, {}, std::nullopt, 1, 8}}) {
    CHECK(wire::decode_dest(wire::encode_dest(d)) == d);
  }
  CHECK(wire::decode_dest(raw(good_fields)).strides == std::vector<std::int64_t>{10, 1});
}

TEST_CASE("decode_dest refuses every malformed field, naming it", "[wire][dest]") {
  CHECK(refusal("").find("invalid msgpack") != std::string::npos);
  CHECK(refusal(raw(
                    [](auto& p) {
                      p.pack(std::string("w"));
                      p.pack(8), p.pack_array(0), p.pack_array(0), p.pack_nil(), p.pack(0);
                    },
                    6))
            .find("must have 7 elements") != std::string::npos);
  CHECK(refusal(raw(good_fields) + "x").find("trailing") != std::string::npos);
  CHECK(refusal(std::string(5000, 'a')).find("limit") != std::string::npos);
  CHECK(refusal(raw([](auto& p) {
          p.pack(std::string(""));
          p.pack(8), p.pack_array(0), p.pack_array(0), p.pack_nil(), p.pack(0), p.pack(0);
        })).find("name is empty") != std::string::npos);
  CHECK(refusal(raw([](auto& p) {
          p.pack(std::string("w"));
          p.pack(99), p.pack_array(0), p.pack_array(0), p.pack_nil(), p.pack(0), p.pack(0);
        })).find("dtype has unknown code 99") != std::string::npos);
  CHECK(refusal(raw([](auto& p) {
          p.pack(std::string("w"));
          p.pack(8), p.pack_array(1), p.pack(-1), p.pack_array(0), p.pack_nil(), p.pack(0), p.pack(0);
        })).find("shape[0]") != std::string::npos);
  CHECK(refusal(raw([](auto& p) {
          p.pack(std::string("w"));
          p.pack(8), p.pack_array(1), p.pack(std::numeric_limits<std::uint64_t>::max()), p.pack_array(0), p.pack_nil(),
              p.pack(0), p.pack(0);
        })).find("does not fit") != std::string::npos);
  CHECK(refusal(raw([](auto& p) {
          p.pack(std::string("w"));
          p.pack(8), p.pack_array(2), p.pack(4), p.pack(3), p.pack_array(1), p.pack(10), p.pack_nil(), p.pack(0),
              p.pack(0);
        })).find("1 strides for a view of 2 dimensions") != std::string::npos);
  CHECK(refusal(raw([](auto& p) {
          p.pack(std::string("w"));
          p.pack(8), p.pack_array(1), p.pack(4), p.pack_array(0), p.pack_array(2), p.pack(0), p.pack(0), p.pack(0),
              p.pack(0);
        })).find("slice must have 3 elements") != std::string::npos);
  CHECK(refusal(raw([](auto& p) {
          p.pack(std::string("w"));
          p.pack(8), p.pack(std::string("x")), p.pack_array(0), p.pack_nil(), p.pack(0), p.pack(0);
        })).find("shape must be an array") != std::string::npos);
  CHECK(refusal(raw([](auto& p) {
          p.pack(std::string("w"));
          p.pack(8), p.pack_array(0), p.pack_array(0), p.pack_nil(), p.pack(-1), p.pack(0);
        })).find("allocation must be an unsigned integer") != std::string::npos);
}

TEST_CASE("decode_dest refuses a record whose view add_parameter would refuse", "[wire][dest]") {
  auto d = shard();
  d.strides = {1, 1};  // overlaps itself
  CHECK(refusal(wire::encode_dest(d)).find("overlaps itself") != std::string::npos);
  d = shard();
  d.slice = refit::source_slice{5, 0, 2048};  // no such dimension
  CHECK(refusal(wire::encode_dest(d)).find("dimension 5") != std::string::npos);
  d = shard();
  d.slice = refit::source_slice{1, std::numeric_limits<std::int64_t>::max(), 2048};  // end overflows
  CHECK(refusal(wire::encode_dest(d)).find("overflows") != std::string::npos);
  d = shard();
  d.strides = {1, 4096};  // last dimension not dense
  CHECK(refusal(wire::encode_dest(d)).find("last dimension") != std::string::npos);
}
