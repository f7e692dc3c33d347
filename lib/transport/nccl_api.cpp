// refit — NCCL's API, forwarded to the library lib/transport/nccl_library.cpp loaded. refit's
// code (nccl.cpp, refit-bench's ceiling) calls NCCL by its own names, declared by nccl.h; these
// definitions, hidden inside librefit (and in every binary that links refit's objects), take
// their place, so that no binary refit builds links libnccl and the process keeps the one NCCL
// it chose. The nccl transport checks require_nccl() before its first call; a function called
// without NCCL answers ncclSystemError (and ncclGetErrorString says so) instead of crashing.
#include <nccl.h>

#include "transport/nccl_library.hpp"

namespace {

template <auto* Declared>
auto* resolve(const char* name) noexcept {
  return reinterpret_cast<decltype(Declared)>(refit::transport::nccl_symbol(name));
}

}  // namespace

// Each forwarder looks its function up once (a function-local static: thread-safe).
#define REFIT_NCCL_FORWARD(name, params, args)      \
  ncclResult_t name params {                        \
    static auto* const f = resolve<&name>(#name);   \
    return f != nullptr ? f args : ncclSystemError; \
  }

extern "C" {

REFIT_NCCL_FORWARD(ncclGetVersion, (int* version), (version))
REFIT_NCCL_FORWARD(ncclGetUniqueId, (ncclUniqueId * id), (id))
REFIT_NCCL_FORWARD(ncclCommInitRankConfig,
                   (ncclComm_t * comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config),
                   (comm, nranks, id, rank, config))
REFIT_NCCL_FORWARD(ncclCommGetAsyncError, (ncclComm_t comm, ncclResult_t* state), (comm, state))
REFIT_NCCL_FORWARD(ncclCommAbort, (ncclComm_t comm), (comm))
REFIT_NCCL_FORWARD(ncclGroupStart, (), ())
REFIT_NCCL_FORWARD(ncclGroupEnd, (), ())
REFIT_NCCL_FORWARD(ncclBroadcast,
                   (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                    ncclComm_t comm, cudaStream_t stream),
                   (sendbuff, recvbuff, count, datatype, root, comm, stream))
REFIT_NCCL_FORWARD(ncclSend,
                   (const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                    cudaStream_t stream),
                   (sendbuff, count, datatype, peer, comm, stream))
REFIT_NCCL_FORWARD(ncclRecv,
                   (void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                    cudaStream_t stream),
                   (recvbuff, count, datatype, peer, comm, stream))
REFIT_NCCL_FORWARD(ncclAllReduce,
                   (const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                    ncclComm_t comm, cudaStream_t stream),
                   (sendbuff, recvbuff, count, datatype, op, comm, stream))

const char* ncclGetErrorString(ncclResult_t result) {
  static auto* const f = resolve<&ncclGetErrorString>("ncclGetErrorString");
  return f != nullptr ? f(result) : "NCCL is not loaded (refit::nccl_library() says why)";
}

const char* ncclGetLastError(ncclComm_t comm) {
  static auto* const f = resolve<&ncclGetLastError>("ncclGetLastError");
  return f != nullptr ? f(comm) : "NCCL is not loaded";
}

}  // extern "C"

#undef REFIT_NCCL_FORWARD
