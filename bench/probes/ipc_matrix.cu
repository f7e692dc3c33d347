// bench/probes/ipc_matrix.cu — how fast bytes move between two processes on one GPU, by where the source and the
// destination live and who issues the copy. Two processes (this one and a child it forks) each allocate a cudaMalloc
// buffer (exported with cudaIpcGetMemHandle) and a cuMemCreate buffer (exported with cuMemExportToShareableHandle as
// a POSIX fd, passed over a Unix socket with SCM_RIGHTS, imported with cuMemImportFromShareableHandle + cuMemMap +
// cuMemSetAccess), and map the other's two. Seen from the process that issues a copy, a buffer is
//   local  its own cudaMalloc          ipc  the other process's cudaMalloc, opened with cudaIpcOpenMemHandle
//   vmm    the other process's cuMemCreate, imported as above
// Each process in turn (the other one idle, blocked on the socket) copies src -> dst for all 3 x 3 pairs with
//   kernel  a uint4 copy kernel: 16 loads in flight per thread, 256 threads, 2 blocks per SM over 64 KiB tiles
//           (copy_variants' best variant, lib/copy/copy_kernel.cu's choices), one launch over all the pieces
//   memcpy  one cudaMemcpyAsync per piece (the copy engines)
//   bSxCk   bulk_copy.cuh's kbulk: the tensor memory accelerator's bulk copies through shared memory, S stages of
//           C KiB (b4x32k: 1 block per SM; b3x32k, b6x16k: 2)
//   ce-span one cudaMemcpyAsync over the whole span (the pieces and the gaps between them)
//   hyb1/4  the copy engines (a cudaMemcpyAsync per piece, on a second stream) take the first pieces up to a quarter
//           (hyb1/2: a half) of the bytes while the kernel copies the rest, both at once
// The data: llama3-8b's tensors (bf16) from layer 0 on until 1 GiB, as refit groups them into ~1 GB launches: layers
// 0-1 whole and layer 2's q k v o gate, 23 pieces, 1 GiB + 32 KiB, each at a 256-byte aligned offset.
// Timing: cudaEvents around each copy, one warm-up then 5; median_ms and best_ms of the 5. GB/s and ratio come from
// best_ms, ratio against a 1 GiB local -> local cudaMemcpyAsync (best of 5) measured by the parent in the same run.
// who = the process that issued the copy: "push" is the source's owner writing mapped memory (src local, dst ipc|vmm),
// "pull" the destination's owner reading mapped memory (src ipc|vmm, dst local). Each row checks the first and last
// byte of every piece afterwards (BAD after the ratio when they differ from the source). The last line names the
// fastest way found to land bytes in another process's cudaMalloc'd memory.
// Driver functions come through the runtime's entry point (links cudart only). Built and run by
// tools/gpu-check BUNDLE probes (stage probe-ipc-matrix); by hand:
//   nvcc -O3 -std=c++17 -arch=sm_90 -o ipc_matrix bench/probes/ipc_matrix.cu && ./ipc_matrix
#include <cuda.h>  // types and enums only: the functions come through the runtime's driver entry point
#include <cuda_runtime.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "probe.hpp"
#include "bulk_copy.cuh"
#include "tile_copy.cuh"

#define DK(x)                                                         \
  do {                                                                \
    CUresult r_ = (x);                                                \
    if (r_ != CUDA_SUCCESS) {                                         \
      fprintf(stderr, "%s: CUresult %d\n", #x, static_cast<int>(r_)); \
      _exit(1);                                                       \
    }                                                                 \
  } while (0)

/// The driver function `name` (its CUDA 12.0 version), as lib/copy/driver.hpp gets it; ends the process without it.
template <typename Fn>
Fn entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
#else
  const cudaError_t e = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found);
#endif
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    fprintf(stderr, "the CUDA driver has no %s\n", name);
    _exit(1);
  }
  return reinterpret_cast<Fn>(fn);
}

/// The VMM functions used here, looked up once the runtime is up.
struct driver {
  decltype(&::cuMemGetAllocationGranularity) granularity =
      entry<decltype(granularity)>("cuMemGetAllocationGranularity");
  decltype(&::cuMemCreate) create = entry<decltype(create)>("cuMemCreate");
  decltype(&::cuMemRelease) release = entry<decltype(release)>("cuMemRelease");
  decltype(&::cuMemAddressReserve) reserve = entry<decltype(reserve)>("cuMemAddressReserve");
  decltype(&::cuMemAddressFree) address_free = entry<decltype(address_free)>("cuMemAddressFree");
  decltype(&::cuMemMap) map = entry<decltype(map)>("cuMemMap");
  decltype(&::cuMemUnmap) unmap = entry<decltype(unmap)>("cuMemUnmap");
  decltype(&::cuMemSetAccess) set_access = entry<decltype(set_access)>("cuMemSetAccess");
  decltype(&::cuMemExportToShareableHandle) export_handle =
      entry<decltype(export_handle)>("cuMemExportToShareableHandle");
  decltype(&::cuMemImportFromShareableHandle) import_handle =
      entry<decltype(import_handle)>("cuMemImportFromShareableHandle");
};

constexpr int U = 16, T = 256, BPS = 2, REPS = 5;

enum { LOCAL = 0, IPC = 1, VMM = 2 };
const char* const kind_name[] = {"local", "ipc", "vmm"};
const char* const engine_name[] = {"kernel", "memcpy", "b4x32k", "b3x32k", "b6x16k", "ce-span", "hyb1/4", "hyb1/2"};
constexpr int ENGINES = 8;
struct row {
  int src, dst, eng;
  float med, best;
  int bad;
};
struct turn {  // one process's rows, sent from the child to the parent in one message
  float ceil_gbs;
  row r[3 * 3 * ENGINES];
};
struct hello {  // what each process sends the other, with its VMM fd alongside (SCM_RIGHTS)
  cudaIpcMemHandle_t ipc;
  uint64_t vmm_bytes;
};

/// llama3-8b's tensors (bf16) from layer 0 on until 1 GiB: sizes and 256-byte aligned offsets; span = the extent
/// rounded up to 2 MiB (a buffer holds a source half and a destination half of span bytes each).
struct pieces {
  std::vector<uint64_t> size, at;
  uint64_t bytes = 0, span = 0;
};
static pieces llama_slice() {
  pieces p;
  uint64_t end = 0;
  auto mb = [](uint64_t r, uint64_t c) { return r * c * 2; };
  for (int l = 0; p.bytes < (1ull << 30); ++l)
    for (uint64_t b : {mb(4096, 4096), mb(1024, 4096), mb(1024, 4096), mb(4096, 4096), mb(14336, 4096), mb(14336, 4096),
                       mb(4096, 14336), mb(1, 4096), mb(1, 4096)}) {
      if (p.bytes >= (1ull << 30)) break;
      p.at.push_back(end);
      p.size.push_back(b);
      p.bytes += b;
      end += (b + 255) / 256 * 256;
    }
  p.span = (end + (2ull << 20) - 1) / (2ull << 20) * (2ull << 20);
  return p;
}

/// Sends / receives one message with a file descriptor alongside (SOCK_SEQPACKET: one message per call).
/// A one-message header with room for one descriptor: `iov` and `ctl` must outlive it.
static msghdr fd_message(iovec& iov, char (&ctl)[CMSG_SPACE(sizeof(int))]) {
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = ctl;
  m.msg_controllen = sizeof ctl;
  return m;
}
static void send_with_fd(int s, const void* p, size_t n, int fd) {
  iovec iov{const_cast<void*>(p), n};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))] = {};
  msghdr m = fd_message(iov, ctl);
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &fd, sizeof fd);
  if (sendmsg(s, &m, 0) != static_cast<ssize_t>(n)) _exit(3);
}
static int recv_with_fd(int s, void* p, size_t n) {
  iovec iov{p, n};
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int))] = {};
  msghdr m = fd_message(iov, ctl);
  if (recvmsg(s, &m, 0) != static_cast<ssize_t>(n)) _exit(4);
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  if (c == nullptr || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) _exit(4);
  int fd = -1;
  memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

/// One process's view: its stream, the three buffers as it sees them, and the byte each source half holds.
struct ctx {
  int sms = 0;
  cudaStream_t st{}, ce{};  // ce: the hybrids' copy-engine half
  cudaEvent_t a{}, b{}, fork{}, join{};
  op* ops = nullptr;
  op* kernel_ops = nullptr;  // the hybrids' kernel half
  char* base[3]{};
  unsigned char fill[3]{};
  pieces pc;
};

/// GB/s of a 1 GiB local -> local cudaMemcpyAsync, best of REPS.
static float ceiling(ctx& c) {
  float med = 0, best = 0;
  char* l = c.base[LOCAL];
  time_reps(
      c.st, c.a, c.b, REPS, [&] { CK(cudaMemcpyAsync(l + c.pc.span, l, 1ull << 30, cudaMemcpyDeviceToDevice, c.st)); },
      med, best);
  return static_cast<float>((1ull << 30) / (best * 1e-3) / 1e9);
}

/// The bulk (TMA) engines: stages x chunk, blocks per SM as shared memory allows (228 KiB an SM).
template <int S, uint32_t CHUNK>
static void bulk_run(ctx& c, size_t n, uint64_t tiles, int per_sm) {
  constexpr int bytes = kbulk_smem<S, CHUNK>();
  CK(cudaFuncSetAttribute(kbulk<S, CHUNK>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  const int blocks = static_cast<int>(std::min<uint64_t>(tiles, static_cast<uint64_t>(c.sms) * per_sm));
  kbulk<S, CHUNK><<<blocks, 32, bytes, c.st>>>(c.ops, static_cast<int>(n), tiles);
  CK(cudaGetLastError());
}
static void bulk_launch(int eng, ctx& c, size_t n, uint64_t tiles) {
  if (eng == 2) bulk_run<4, 32768>(c, n, tiles, 1);
  if (eng == 3) bulk_run<3, 32768>(c, n, tiles, 2);
  if (eng == 4) bulk_run<6, 16384>(c, n, tiles, 2);
}

/// Copies the pieces from the source half of base[src] to the destination half of base[dst] with engine eng.
static row measure(ctx& c, int src, int dst, int eng) {
  row r{src, dst, eng, 0, 0, 0};
  const pieces& p = c.pc;
  const char* s = c.base[src];
  char* d = c.base[dst] + p.span;
  std::vector<op> ops;
  uint64_t tiles = 0;
  for (size_t k = 0; k < p.size.size(); ++k) {
    ops.push_back(
        op{reinterpret_cast<const uint4*>(s + p.at[k]), reinterpret_cast<uint4*>(d + p.at[k]), tiles, p.size[k] / 16});
    tiles += (p.size[k] + tile - 1) / tile;
  }
  // the hybrids: pieces go to the copy engines (one cudaMemcpyAsync each, on a second stream) while their bytes are
  // under the share, the others to the kernel, both at once
  const double share = eng == 6 ? 0.25 : eng == 7 ? 0.5 : 0;
  std::vector<size_t> to_ce;
  std::vector<op> kops;
  uint64_t ce_bytes = 0, ktiles = 0;
  for (size_t k = 0; k < p.size.size(); ++k) {
    if (share > 0 && ce_bytes + p.size[k] / 2 <= share * p.bytes) {
      to_ce.push_back(k);
      ce_bytes += p.size[k];
      continue;
    }
    kops.push_back(op{ops[k].s, ops[k].d, ktiles, ops[k].vecs});
    ktiles += (p.size[k] + tile - 1) / tile;
  }
  CK(cudaMemsetAsync(d, 0, p.span, c.st));
  CK(cudaMemcpyAsync(c.ops, ops.data(), ops.size() * sizeof(op), cudaMemcpyHostToDevice, c.st));
  if (!kops.empty())
    CK(cudaMemcpyAsync(c.kernel_ops, kops.data(), kops.size() * sizeof(op), cudaMemcpyHostToDevice, c.st));
  CK(cudaStreamSynchronize(c.st));
  const int blocks = static_cast<int>(std::min<uint64_t>(tiles, static_cast<uint64_t>(c.sms) * BPS));
  const int kblocks = static_cast<int>(std::min<uint64_t>(ktiles, static_cast<uint64_t>(c.sms) * BPS));
  auto issue = [&] {
    if (eng == 5) {
      CK(cudaMemcpyAsync(d, s, p.at.back() + p.size.back(), cudaMemcpyDeviceToDevice, c.st));
    } else if (eng >= 6) {
      CK(cudaEventRecord(c.fork, c.st));
      CK(cudaStreamWaitEvent(c.ce, c.fork, 0));
      for (size_t k : to_ce) CK(cudaMemcpyAsync(d + p.at[k], s + p.at[k], p.size[k], cudaMemcpyDeviceToDevice, c.ce));
      kcopy<U, PLAIN><<<kblocks, T, 0, c.st>>>(c.kernel_ops, static_cast<int>(kops.size()), ktiles);
      CK(cudaGetLastError());
      CK(cudaEventRecord(c.join, c.ce));
      CK(cudaStreamWaitEvent(c.st, c.join, 0));
    } else if (eng == 0) {
      kcopy<U, PLAIN><<<blocks, T, 0, c.st>>>(c.ops, static_cast<int>(ops.size()), tiles);
      CK(cudaGetLastError());
    } else if (eng >= 2) {
      bulk_launch(eng, c, ops.size(), tiles);
    } else {
      for (size_t k = 0; k < p.size.size(); ++k)
        CK(cudaMemcpyAsync(d + p.at[k], s + p.at[k], p.size[k], cudaMemcpyDeviceToDevice, c.st));
    }
  };
  time_reps(c.st, c.a, c.b, REPS, issue, r.med, r.best);
  for (size_t k = 0; k < p.size.size(); ++k)
    for (uint64_t off : {p.at[k], p.at[k] + p.size[k] - 1}) {
      unsigned char x = 0;
      CK(cudaMemcpy(&x, d + off, 1, cudaMemcpyDeviceToHost));
      if (x != c.fill[src]) r.bad = 1;
    }
  return r;
}

/// This process's turn: its ceiling, then the rows.
static turn play(ctx& c) {
  turn t{};
  t.ceil_gbs = ceiling(c);
  int n = 0;
  for (int src = 0; src < 3; ++src)
    for (int dst = 0; dst < 3; ++dst)
      for (int eng = 0; eng < ENGINES; ++eng) t.r[n++] = measure(c, src, dst, eng);
  return t;
}

static double gbs_of(const ctx& c, const row& r) { return c.pc.bytes / (r.best * 1e-3) / 1e9; }
static void print_row(const ctx& c, const row& r, const char* who, double ceil_gbs) {
  const double g = gbs_of(c, r);
  printf("%-6s %-6s %-7s %-6s %10.3f %8.3f %8.1f %6.3f%s\n", kind_name[r.src], kind_name[r.dst], engine_name[r.eng],
         who, r.med, r.best, g, g / ceil_gbs, r.bad ? "  BAD (destination differs from the source)" : "");
}

static void run(int s, bool parent, pid_t child) {
  CK(cudaSetDevice(0));
  CK(cudaFree(0));
  const driver d;
  ctx c;
  c.pc = llama_slice();
  const uint64_t bytes = 2 * c.pc.span;
  const unsigned char me = parent ? 0x10 : 0x20, peer = parent ? 0x20 : 0x10;
  // this process's cudaMalloc, and its cuMemCreate mapped here, each with a source half filled
  char* mine = nullptr;
  CK(cudaMalloc(&mine, bytes));
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  size_t g = 0;
  DK(d.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  const uint64_t vbytes = (bytes + g - 1) / g * g;
  CUmemGenericAllocationHandle h{};
  DK(d.create(&h, vbytes, &prop, 0));
  CUdeviceptr vmine = 0;
  DK(d.reserve(&vmine, vbytes, g, 0, 0));
  DK(d.map(vmine, vbytes, 0, h, 0));
  DK(d.set_access(vmine, vbytes, &access, 1));
  int fd = -1;
  DK(d.export_handle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  DK(d.release(h));  // the mapping holds the allocation from here on
  CK(cudaMemset(mine, me | 1, c.pc.span));
  CK(cudaMemset(reinterpret_cast<void*>(vmine), me | 2, c.pc.span));
  CK(cudaDeviceSynchronize());
  // exchange: both send first (a small message does not block), then map the other's two buffers
  hello out{};
  CK(cudaIpcGetMemHandle(&out.ipc, mine));
  out.vmm_bytes = vbytes;
  send_with_fd(s, &out, sizeof out, fd);
  close(fd);
  hello in{};
  const int pfd = recv_with_fd(s, &in, sizeof in);
  char* ipc = nullptr;
  CK(cudaIpcOpenMemHandle(reinterpret_cast<void**>(&ipc), in.ipc, cudaIpcMemLazyEnablePeerAccess));
  CUmemGenericAllocationHandle ph{};
  DK(d.import_handle(&ph, reinterpret_cast<void*>(static_cast<intptr_t>(pfd)),
                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  close(pfd);
  CUdeviceptr vpeer = 0;
  DK(d.reserve(&vpeer, in.vmm_bytes, g, 0, 0));
  DK(d.map(vpeer, in.vmm_bytes, 0, ph, 0));
  DK(d.release(ph));
  DK(d.set_access(vpeer, in.vmm_bytes, &access, 1));
  c.base[LOCAL] = mine;
  c.base[IPC] = ipc;
  c.base[VMM] = reinterpret_cast<char*>(vpeer);
  c.fill[LOCAL] = me | 1;
  c.fill[IPC] = peer | 1;
  c.fill[VMM] = peer | 2;
  CK(cudaDeviceGetAttribute(&c.sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaStreamCreateWithFlags(&c.st, cudaStreamNonBlocking));
  CK(cudaEventCreate(&c.a));
  CK(cudaEventCreate(&c.b));
  CK(cudaMalloc(&c.ops, c.pc.size.size() * sizeof(op)));
  CK(cudaMalloc(&c.kernel_ops, c.pc.size.size() * sizeof(op)));
  CK(cudaStreamCreateWithFlags(&c.ce, cudaStreamNonBlocking));
  CK(cudaEventCreateWithFlags(&c.fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&c.join, cudaEventDisableTiming));
  auto unmap_peer = [&] {
    CK(cudaIpcCloseMemHandle(ipc));
    DK(d.unmap(vpeer, in.vmm_bytes));
    DK(d.address_free(vpeer, in.vmm_bytes));
  };
  if (!parent) {  // ready; wait for the parent's turn to end; play; hand the rows over; unmap when told
    put(s, 'r');
    if (get(s) != 'g') _exit(6);
    const turn t = play(c);
    put(s, &t, sizeof t);
    if (get(s) != 'q') _exit(6);
    unmap_peer();
    _exit(0);
  }
  if (get(s) != 'r') _exit(6);
  const turn tp = play(c);
  put(s, 'g');
  turn tc{};
  get(s, &tc, sizeof tc);
  unmap_peer();
  put(s, 'q');
  int status = 0;
  waitpid(child, &status, 0);

  printf("ipc_matrix: %zu llama3-8b pieces (layers 0-1, layer 2's q k v o gate), %.3f GiB per copy; %d SMs\n",
         c.pc.size.size(), c.pc.bytes / double(1ull << 30), c.sms);
  printf(
      "ceiling (1 GiB local->local cudaMemcpyAsync, best of %d): parent %.1f GB/s, child %.1f GB/s; ratio = "
      "GB/s (from best_ms) / parent's ceiling\n",
      REPS, tp.ceil_gbs, tc.ceil_gbs);
  printf(
      "push = the source's owner writes mapped memory (src local, dst ipc|vmm); pull = the destination's owner "
      "reads mapped memory (src ipc|vmm, dst local)\n");
  printf("%-6s %-6s %-7s %-6s %10s %8s %8s %6s\n", "src", "dst", "engine", "who", "median_ms", "best_ms", "GB/s",
         "ratio");
  for (const row& r : tp.r) print_row(c, r, "parent", tp.ceil_gbs);
  for (const row& r : tc.r) print_row(c, r, "child", tp.ceil_gbs);
  // the ways to land bytes in another process's cudaMalloc: push (local -> ipc), pull (ipc -> local), and pull from
  // a source the other process made with cuMemCreate (vmm -> local)
  struct pick {
    const row* r = nullptr;
    const char* who = "";
  } push, pull, pull_vmm, best;
  bool bad = false;
  for (int w = 0; w < 2; ++w)
    for (const row& r : (w == 0 ? tp : tc).r) {
      bad |= r.bad != 0;
      pick* p = r.src == LOCAL && r.dst == IPC   ? &push
                : r.src == IPC && r.dst == LOCAL ? &pull
                : r.src == VMM && r.dst == LOCAL ? &pull_vmm
                                                 : nullptr;
      if (p == nullptr || r.bad) continue;
      const char* who = w == 0 ? "parent" : "child";
      if (p->r == nullptr || r.best < p->r->best) *p = pick{&r, who};
      if (best.r == nullptr || r.best < best.r->best) best = pick{&r, who};
    }
  auto ratio = [&](const pick& p) { return p.r ? gbs_of(c, *p.r) / tp.ceil_gbs : 0.0; };
  auto eng = [&](const pick& p) { return p.r ? engine_name[p.r->eng] : "-"; };
  if (best.r != nullptr)
    printf(
        "summary: fastest into another process's cudaMalloc: %s %s (src %s, dst %s, by the %s) ratio %.3f, "
        "%.1f GB/s; best push %.3f (%s), pull %.3f (%s), pull from a cuMemCreate source %.3f (%s)\n",
        best.r == push.r ? "push" : "pull", engine_name[best.r->eng], kind_name[best.r->src], kind_name[best.r->dst],
        best.who, ratio(best), gbs_of(c, *best.r), ratio(push), eng(push), ratio(pull), eng(pull), ratio(pull_vmm),
        eng(pull_vmm));
  else
    printf("summary: no row landed the right bytes in another process's cudaMalloc\n");
  fflush(stdout);
  if (bad || !WIFEXITED(status) || WEXITSTATUS(status) != 0) _exit(2);
}

int main() {
  int sv[2];  // SOCK_SEQPACKET: each message arrives whole, and a process that ends ends the other's next read
  if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv)) return 1;
  const pid_t pid = fork();  // before any CUDA call
  if (pid < 0) return 1;
  if (pid == 0) {
    close(sv[0]);
    run(sv[1], false, 0);
    _exit(0);
  }
  close(sv[1]);
  run(sv[0], true, pid);
  return 0;
}
