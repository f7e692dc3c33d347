#include "transport/nccl_session.hpp"

#include <climits>

#include <fmt/format.h>

#include "refit/error.hpp"

namespace refit::transport {
namespace {

void put_u32(std::string& out, std::uint32_t v) {
  for (int k = 0; k < 4; ++k) out.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}

std::uint32_t get_u32(std::string_view in) {
  std::uint32_t v = 0;
  for (int k = 0; k < 4; ++k) v |= static_cast<std::uint32_t>(static_cast<unsigned char>(in[k])) << (8 * k);
  return v;
}

}  // namespace

std::string encode_nccl_session(const nccl_session& s) {
  std::string out = s.id;
  out.resize(nccl_session::id_bytes, '\0');
  put_u32(out, s.rank);
  put_u32(out, s.nranks);
  put_u32(out, (s.parts ? 1u : 0u) | (s.paired ? 2u : 0u));
  if (s.paired) {
    std::string twin = s.twin_id;
    twin.resize(nccl_session::id_bytes, '\0');
    out += twin;
  }
  const std::string path = s.nccl_path.substr(0, nccl_session::max_path_bytes);
  put_u32(out, s.nccl_version);
  put_u32(out, static_cast<std::uint32_t>(path.size()));
  return out + path;
}

nccl_session decode_nccl_session(std::string_view bytes) {
  constexpr std::size_t size = nccl_session::id_bytes + 12;
  const std::uint32_t flags = bytes.size() >= size ? get_u32(bytes.substr(nccl_session::id_bytes + 8)) : 0;
  const bool paired = (flags & 2u) != 0;
  const std::size_t fixed = paired ? size + nccl_session::id_bytes : size;
  const std::uint64_t path_bytes = bytes.size() >= fixed + 8 ? get_u32(bytes.substr(fixed + 4)) : 0;
  const std::uint64_t expected = fixed + 8 + path_bytes;
  if (bytes.size() != expected || path_bytes > nccl_session::max_path_bytes)
    throw error(errc::protocol,
                fmt::format("nccl: HELLO's session data is {} bytes, but an nccl session is {} (a 128-byte "
                            "ncclUniqueId, rank, nranks, flags{}, the NCCL version, a path of {} bytes, at most {}): "
                            "the streamer is an older refit, or was built against another NCCL",
                            bytes.size(), expected, paired ? ", the twin's ncclUniqueId" : "", path_bytes,
                            nccl_session::max_path_bytes));
  nccl_session s;
  s.id.assign(bytes.substr(0, nccl_session::id_bytes));
  s.rank = get_u32(bytes.substr(nccl_session::id_bytes));
  s.nranks = get_u32(bytes.substr(nccl_session::id_bytes + 4));
  s.parts = (flags & 1u) != 0;
  s.paired = paired;
  if (paired) s.twin_id.assign(bytes.substr(size, nccl_session::id_bytes));
  s.nccl_version = get_u32(bytes.substr(fixed));
  s.nccl_path.assign(bytes.substr(fixed + 8));
  if (s.nranks < 2 || s.rank < 1 || s.rank >= s.nranks || s.nranks > static_cast<std::uint32_t>(INT_MAX))
    throw error(errc::protocol,
                fmt::format("nccl: HELLO gives this receiver rank {} of {}: a receiver's rank is 1..nranks-1", s.rank,
                            s.nranks));
  return s;
}

}  // namespace refit::transport
