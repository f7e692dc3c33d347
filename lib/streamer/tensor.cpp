// refit — what each tensor of the streamer's source must be (a name, a rank, data where the
// transport packs from), and where a shard lies in its whole tensor.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "streamer/impl.hpp"

namespace refit {

streamer::impl::shard_place streamer::impl::place_shard(const tensor_ref& t) const {
  const tensor_shard& sh = *t.shard;
  shard_place out{tensor_meta{t.meta.name, t.meta.type, sh.global_shape}, 0, t.meta.numel()};
  const auto what = [&] {
    return fmt::format("tensor {}, a shard of {} at [{}] along dimension {}", describe(t.meta), describe(out.whole),
                       sh.start, sh.dim);
  };
  const std::size_t rank = sh.global_shape.size();
  if (rank != t.meta.shape.size() || sh.dim < 0 || static_cast<std::size_t>(sh.dim) >= std::max<std::size_t>(rank, 1))
    throw error(errc::invalid_argument,
                fmt::format("{}: the shard and the whole must have the same number of dimensions, and the "
                            "dimension must be one of them",
                            what()));
  if (!checked_numel(sh.global_shape))
    throw error(errc::invalid_argument, fmt::format("{}: the whole's shape is not valid", what()));
  const auto dim = static_cast<std::size_t>(sh.dim);
  std::uint64_t inner = 1;
  for (std::size_t d = 0; d < rank; ++d) {
    if (d != dim && sh.global_shape[d] != t.meta.shape[d])
      throw error(errc::invalid_argument,
                  fmt::format("{}: the shard's size along dimension {} must be the whole's", what(), d));
    if (d < dim && sh.global_shape[d] != 1)
      throw error(errc::invalid_argument,
                  fmt::format("{}: a shard along dimension {} of a tensor whose dimension {} is {} is not one "
                              "contiguous range of it; shard along dimension 0 (FSDP's Shard(0))",
                              what(), dim, d, sh.global_shape[d]));
    if (d > dim) inner *= static_cast<std::uint64_t>(sh.global_shape[d]);
  }
  if (sh.start < 0 || sh.start > sh.global_shape[dim] - t.meta.shape[dim])
    throw error(errc::invalid_argument,
                fmt::format("{}: [{}, {}) is not inside the whole's {} along dimension {}", what(), sh.start,
                            sh.start + t.meta.shape[dim], sh.global_shape[dim], dim));
  out.first = static_cast<std::uint64_t>(sh.start) * inner;
  if (options.group_size == 1 && out.count != out.whole.numel())
    throw error(errc::invalid_argument,
                fmt::format("{}: this streamer is alone (streamer_options::group_size 1), so nobody sends the "
                            "rest; give each trainer rank its own streamer of a group (group_rank, group_size)",
                            what()));
  return out;
}

void streamer::impl::check_tensor(const tensor_ref& t, std::uint64_t bytes) const {
  if (t.meta.name.empty()) throw error(errc::invalid_argument, "a tensor of the source has an empty name");
  if (t.meta.name.find('\x1f') != std::string::npos)
    throw error(errc::invalid_argument,
                fmt::format("tensor name '{}' contains the control character \\x1f, which refit reserves for the "
                            "scale tensors of quantised destinations",
                            t.meta.name.substr(0, t.meta.name.find('\x1f'))));
  if (t.meta.name.size() > wire::max_name_bytes)
    throw error(errc::invalid_argument, fmt::format("tensor name of {} bytes is too long (at most {})",
                                                    t.meta.name.size(), wire::max_name_bytes));
  if (t.meta.shape.size() > wire::max_rank)
    throw error(errc::invalid_argument, fmt::format("tensor {} has {} dimensions: at most {}", describe(t.meta),
                                                    t.meta.shape.size(), wire::max_rank));
  if (t.data == nullptr && bytes != 0)
    throw error(errc::invalid_argument,
                fmt::format("tensor {} has no data (null pointer); only a tensor with no elements may have none "
                            "(a 0-d tensor is one element: {} bytes)",
                            describe(t.meta), bytes));
  const device where = buffers->where();
  if (bytes != 0 && t.dev.kind != where.kind)
    throw error(errc::invalid_argument,
                fmt::format("tensor {} is in {} memory, but the {} transport packs from {} memory; {}",
                            describe(t.meta), t.dev.kind == device_kind::cuda ? "CUDA" : "host",
                            to_string(options.transport), where.kind == device_kind::cuda ? "CUDA" : "host",
                            where.kind == device_kind::cuda ? "move it to the GPU first"
                                                            : "use the cuda_ipc or nccl transport for GPU tensors"));
}

/// A shard goes as the byte range it is of its whole tensor: from here on `t` is the whole,
/// its data shifted to where the whole would start (only the shard's bytes are ever read), and
/// every placement moves by the `shift` returned (0 for a tensor that is no shard). `part`: where
/// the shard lies in the whole.
std::uint64_t streamer::impl::to_whole(tensor_ref& t, std::uint64_t bytes, sending how,
                                       std::optional<shard_place>& part) const {
  std::uint64_t shift = 0;
  if (t.shard) {
    part = place_shard(t);
    shift = part->first * itemsize(t.meta.type);
    t.meta = part->whole;
    t.data = reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(t.data) - shift);
    t.shard.reset();
    if (how == sending::delta && (part->first != 0 || bytes != t.meta.nbytes()))
      throw error(errc::internal, fmt::format("tensor {}: a delta of a shard", describe(t.meta)));
  }
  return shift;
}

}  // namespace refit
