// libFuzzer target: wire::decode on arbitrary bytes, and on the same bytes the decoders of what
// transports carry opaquely inside messages: wire::decode_dest (a direct offer's destination
// record), transport::decode_nccl_session (HELLO's session data of an nccl session) and
// transport::decode_vmm_record (cuda_ipc's records of VMM memory, in BATCH sources and offers).
//
// Properties: decode() either returns a message or throws refit::error (any other exception,
// crash or sanitizer report is a bug); and every message it accepts survives a round trip —
// decode(encode(m)) == m, and encoding is stable (encode of the re-decoded message gives the same
// bytes). The input itself need not equal encode(m): msgpack has several encodings of one value.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "refit/error.hpp"
#include "transport/nccl_session.hpp"
#include "transport/vmm_record.hpp"
#include "wire/wire.hpp"

namespace wire = refit::wire;

namespace {

[[noreturn]] void property_failed(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_wire_decode: property violated: %s%s%s\n", what, detail.empty() ? "" : ": ",
               detail.c_str());
  std::abort();
}

}  // namespace

/// The same properties for a destination record.
static void check_dest(const std::uint8_t* data, std::size_t size) {
  wire::dest_record d;
  try {
    d = wire::decode_dest(std::string_view(reinterpret_cast<const char*>(data), size));
  } catch (const refit::error&) {
    return;
  }
  const std::string once = wire::encode_dest(d);
  try {
    if (!(wire::decode_dest(once) == d)) property_failed("decode_dest(encode_dest(d)) != d", d.name);
  } catch (const refit::error& e) {
    property_failed("a decoded destination record does not decode after re-encoding", e.what());
  }
}

/// The same for an nccl session: accepted bytes re-encode to bytes that decode to the same session
/// (unknown flag bits are dropped), and to themselves when no other flag bit than parts and paired
/// is set.
static void check_nccl_session(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  refit::transport::nccl_session s;
  try {
    s = refit::transport::decode_nccl_session(bytes);
  } catch (const refit::error&) {
    return;
  }
  const std::string again = refit::transport::encode_nccl_session(s);
  const auto back = refit::transport::decode_nccl_session(again);
  if (back.id != s.id || back.rank != s.rank || back.nranks != s.nranks || back.parts != s.parts ||
      back.paired != s.paired || back.twin_id != s.twin_id)
    property_failed("decode(encode(decode_nccl_session(b))) != decode_nccl_session(b)", "");
  const bool plain_flags = (data[136] & 0xfc) == 0 && data[137] == 0 && data[138] == 0 && data[139] == 0;
  if (plain_flags && again != bytes) property_failed("encode(decode_nccl_session(b)) != b", "");
}

/// The same for a VMM record: accepted bytes re-encode to themselves, and the key clears the flag.
static void check_vmm_record(const std::uint8_t* data, std::size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  refit::transport::vmm_span s;
  try {
    s = refit::transport::decode_vmm_record(bytes, "fuzz input");
  } catch (const refit::error&) {
    return;
  }
  std::vector<refit::copy::vmm::chunk> chunks;
  for (std::size_t k = 0; k < s.ids.size(); ++k) chunks.push_back({0, s.sizes[k], s.ids[k]});
  if (refit::transport::encode_vmm_record(chunks, s.fds_follow) != bytes)
    property_failed("encode(decode_vmm_record(b)) != b", "");
  if (refit::transport::encode_vmm_record(chunks, false) != s.key)
    property_failed("a VMM record's key is not it unflagged", "");
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  check_dest(data, size);
  check_nccl_session(data, size);
  check_vmm_record(data, size);
  wire::message m;
  std::string secret;
  try {
    m = wire::decode(std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size), &secret);
  } catch (const refit::error&) {
    return 0;  // rejected with the library's own error: what hostile input should get
  }

  // A request's session secret travels beside the message: it round-trips too.
  const std::string once = wire::encode(m, secret);
  wire::message again;
  std::string secret_again;
  try {
    again = wire::decode(once, &secret_again);
  } catch (const refit::error& e) {
    property_failed("a decoded message does not decode after re-encoding", e.what());
  }
  if (!(again == m)) property_failed("decode(encode(m)) != m", std::string(wire::to_string(wire::type_of(m))));
  if (secret_again != secret) property_failed("a request's secret does not survive a round trip", "");
  if (wire::encode(again, secret_again) != once) property_failed("encode is not stable across a round trip", "");
  return 0;
}
