// nccl path: not built into the bench yet.
#include <fmt/format.h>

#include "bench/bench.hpp"
#include "refit/error.hpp"

namespace refit::bench {

std::unique_ptr<transport_path> make_nccl_path(int /*device*/) {
  // TODO(bench): an nccl path needs device tensors like cuda_ipc plus a raw-broadcast ceiling
  // (ncclBroadcast of ≥ 1 GiB between the two processes); not written yet.
  throw error(errc::invalid_argument,
              "refit-bench: the nccl transport is not built into the bench yet; use "
              "--transport host_shm or cuda_ipc");
}

}  // namespace refit::bench
