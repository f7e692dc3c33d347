// refit — what HELLO carries of an nccl session (wire::hello::session), built with or without NCCL
// so that its decoder is unit-tested and fuzzed everywhere.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace refit::transport {

/// The communicator a receiver joins: NCCL's unique id and the receiver's rank (the streamer is
/// rank 0), what the streamer can do, and which NCCL it loaded. Bytes: the id, then rank, nranks
/// and a flags word as 32-bit little-endian, then the twin's id when the session is paired, then
/// the streamer's NCCL version and the length of its library's path (32-bit little-endian each),
/// and the path.
struct nccl_session {
  static constexpr std::size_t id_bytes = 128;  ///< sizeof(ncclUniqueId)
  static constexpr std::size_t max_path_bytes = 1024;
  std::string id;
  std::uint32_t rank = 0;
  std::uint32_t nranks = 0;
  /// The streamer sends a receiver only its parts of each entry when the receiver describes its
  /// destinations in its OK (transport::sink::parts). Flag bit 0.
  bool parts = false;
  /// Every rank also joins a twin communicator at set-up, from `twin_id`, with the same rank: the
  /// broadcasts of odd buffers go on it, on a stream of their own, so that one batch's broadcast
  /// starts while the one before it drains. Flag bit 1.
  bool paired = false;
  std::string twin_id;  ///< id_bytes when paired, else empty
  /// The streamer's NCCL (ncclGetVersion(), and the file it loaded): a receiver that loaded another
  /// version refuses the session before it makes a communicator (NCCL itself would fail the
  /// set-up with "Mismatched NCCL version", or worse).
  std::uint32_t nccl_version = 0;
  std::string nccl_path;  ///< at most max_path_bytes (longer: cut, for the message only)
};

std::string encode_nccl_session(const nccl_session& s);
/// Validates: id_bytes + 12 bytes, or 2 × id_bytes + 12 for a paired session, then 8 bytes and the
/// path they announce, at most max_path_bytes (another size: an older refit, one built against
/// another NCCL, or not nccl's; flag bits other than parts and paired are ignored),
/// 2 ≤ nranks ≤ INT_MAX, 1 ≤ rank < nranks. Throws refit::error(protocol) naming what is wrong.
nccl_session decode_nccl_session(std::string_view bytes);

}  // namespace refit::transport
