// refit — what HELLO carries of an nccl session (wire::hello::session), built with or without NCCL
// so that its decoder is unit-tested and fuzzed everywhere.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace refit::transport {

/// The communicator a receiver joins: NCCL's unique id and the receiver's rank (the streamer is
/// rank 0), and what the streamer can do. Bytes: the id, then rank, nranks and a flags word as
/// 32-bit little-endian.
struct nccl_session {
  static constexpr std::size_t id_bytes = 128;  ///< sizeof(ncclUniqueId)
  std::string id;
  std::uint32_t rank = 0;
  std::uint32_t nranks = 0;
  /// The streamer sends a receiver only its parts of each entry when the receiver describes its
  /// destinations in its OK (transport::sink::parts). Flag bit 0.
  bool parts = false;
};

std::string encode_nccl_session(const nccl_session& s);
/// Validates: exactly id_bytes + 12 bytes (another size: a streamer built against another NCCL, or
/// not nccl's; flag bits other than parts are ignored), 2 ≤ nranks ≤ INT_MAX, 1 ≤ rank < nranks. Throws refit::error(protocol) naming
/// what is wrong.
nccl_session decode_nccl_session(std::string_view bytes);

}  // namespace refit::transport
