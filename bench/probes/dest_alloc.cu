// bench/probes/dest_alloc.cu [llama3-8b|experts] [bulk|engines] — how the allocations behind a model's tensors change the copy
// kernel's speed into and out of another process's memory. ipc_matrix.cu copies 1 GiB between single allocations; an
// engine's weights are 16 GB or more, allocated one way or another. Here a whole model is copied from one source
// cudaMalloc: llama3-8b (291 bf16 tensors, 16.06 GB), or `experts`, 5,120 tensors of 768 x 2048 bf16 (3 MiB each,
// 16.1 GB: the expert weights of qwen3-30b-a3b, which torch puts six to a 20 MiB segment). Into destinations laid
// out as
//   one       one cudaMalloc holding every tensor (256-byte aligned offsets): refit-bench --dest-memory arena
//   each      one cudaMalloc per tensor
//   torch     segments as torch's caching allocator makes them for tensors allocated one after another (sizes rounded
//             to 512 bytes; up to 1 MiB from 2 MiB segments, up to 10 MiB from 20 MiB ones, larger ones a segment
//             each, rounded up to 2 MiB): refit-bench's default, --dest-memory torch
//   N GiB     cudaMallocs of N GiB, tensors laid out in order (one that does not fit goes to the next)
// owned by the copying process (local) or by the other one (ipc: each allocation mapped with cudaIpcOpenMemHandle),
// and copied by
//   push      the source's owner (the parent) writes the other's memory: what refit's direct writes do
//   pull      the destinations' owner (the child) reads the parent's source, mapped with cudaIpcOpenMemHandle
// The kernel is tile_copy.cuh's (64 KiB tiles, 16 uint4 loads in flight, 256 threads, 2 blocks per SM: refit's
// choices; with `bulk`, bulk_copy.cuh's kbulk instead), launched as refit's direct writes go: consecutive tensors grouped until a launch holds >= 1 GiB. Each row:
// one warm-up, then 5 timed whole-model copies (cudaEvents around all launches); median and best ms, and ratio = the
// bench's floor / median, the floor being one 16.06 GB local cudaMemcpyAsync by the parent (best of 3). Every row
// checks the first and last byte of every tensor afterwards (BAD when they differ from the source).
// With `engines`, only the pushes into the other process's torch, one and 8 GiB layouts, once by each way of moving the bytes named at
// `engines` below (the copy kernel, the copy engines on 1-4 streams, both at once split by tensor size).
// Built and run by tools/gpu-check BUNDLE probes (stage probe-dest-alloc); by hand:
//   nvcc -O3 -std=c++17 -arch=sm_90 -o dest_alloc bench/probes/dest_alloc.cu && ./dest_alloc
#include <cuda_runtime.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "probe.hpp"
#include "bulk_copy.cuh"
#include "tile_copy.cuh"

constexpr int U = 16, T = 256, BPS = 2, REPS = 5;
constexpr uint64_t launch_bytes = 1ull << 30, MiB = 1ull << 20, GiB = 1ull << 30;

/// The model's tensors in the order refit sends them (bf16 bytes), and their 256-byte aligned offsets in one buffer.
struct model {
  std::vector<uint64_t> size, at;
  uint64_t bytes = 0, span = 0;
};
static model model_of(bool experts) {
  model m;
  auto add = [&](uint64_t rows, uint64_t cols) {
    m.at.push_back(m.span);
    m.size.push_back(rows * cols * 2);
    m.bytes += rows * cols * 2;
    m.span += (rows * cols * 2 + 255) / 256 * 256;
  };
  if (experts) {
    for (int k = 0; k < 5120; ++k) add(768, 2048);
    return m;
  }
  add(128256, 4096);
  for (int l = 0; l < 32; ++l) {
    add(1, 4096);
    add(4096, 4096), add(1024, 4096), add(1024, 4096), add(4096, 4096);
    add(1, 4096);
    add(14336, 4096), add(14336, 4096), add(4096, 14336);
  }
  add(1, 4096);
  add(128256, 4096);
  return m;
}

static uint64_t align_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

/// Where each tensor lies in a layout: its allocation and offset there; the allocations' sizes.
struct layout {
  std::vector<uint64_t> alloc_bytes;
  std::vector<uint32_t> alloc;
  std::vector<uint64_t> offset;
};
/// 'o' one, 'e' each, 't' torch, '1' '2' '4' '8': chunks of that many GiB.
static layout plan(const model& m, char kind) {
  layout l;
  auto place = [&](uint32_t a, uint64_t off) { l.alloc.push_back(a), l.offset.push_back(off); };
  if (kind == 'o') {
    l.alloc_bytes.push_back(m.span);
    for (uint64_t at : m.at) place(0, at);
  } else if (kind == 'e') {
    for (uint64_t s : m.size) place(static_cast<uint32_t>(l.alloc_bytes.size()), 0), l.alloc_bytes.push_back(s);
  } else if (kind == 't') {
    struct open_segment {
      int64_t a = -1;
      uint64_t used = 0, cap = 0;
    } small, medium;
    for (uint64_t s : m.size) {
      const uint64_t r = align_up(std::max<uint64_t>(s, 1), 512);
      if (r >= 10 * MiB) {
        place(static_cast<uint32_t>(l.alloc_bytes.size()), 0);
        l.alloc_bytes.push_back(align_up(r, 2 * MiB));
        continue;
      }
      open_segment& o = r <= MiB ? small : medium;
      if (o.a < 0 || o.used + r > o.cap) {
        o = open_segment{static_cast<int64_t>(l.alloc_bytes.size()), 0, r <= MiB ? 2 * MiB : 20 * MiB};
        l.alloc_bytes.push_back(o.cap);
      }
      place(static_cast<uint32_t>(o.a), o.used);
      o.used += r;
    }
  } else {
    const uint64_t chunk = static_cast<uint64_t>(kind - '0') * GiB;
    uint64_t used = chunk;
    for (uint64_t s : m.size) {
      if (used + s > chunk) l.alloc_bytes.push_back(chunk), used = 0;
      place(static_cast<uint32_t>(l.alloc_bytes.size() - 1), used);
      used = align_up(used + s, 256);
    }
  }
  return l;
}
static std::string name_of(char kind) {
  switch (kind) {
    case 'o': return "one";
    case 'e': return "each";
    case 't': return "torch";
    default: return std::string(1, kind) + " GiB";
  }
}

static bool use_bulk = false;  // bulk_copy.cuh's kbulk<4, 32 KiB>, a block per SM, for kcopy
// only the pushes into the other's torch, one and 8 GiB layouts, by each of `engines`
static bool engines_mode = false;

/// `engines`: how the bytes move, for the rows of that mode (push into the other's torch layout).
///   kernel     the copy kernel alone, as every other row
///   ceN        the copy engines: one cudaMemcpyAsync per tensor, tensors dealt round-robin to N streams
///   mixT-N     tensors of T MiB or more to the copy engines (N streams), the others to the kernel on its own
///              stream, all at once
struct engine {
  const char* name;
  int streams;           // copy-engine streams; 0: kernel alone
  uint64_t ce_from = 0;  // bytes from which a tensor goes to the copy engines
};
constexpr engine engines[] = {
    {"kernel", 0},           {"ce1", 1}, {"ce2", 2}, {"ce4", 4}, {"mix16-2", 2, 16 << 20}, {"mix64-2", 2, 64 << 20},
    {"mix64-1", 1, 64 << 20}};
constexpr int max_streams = 4;

struct ctx {
  model m;
  int sms = 0;
  cudaStream_t st{};
  cudaStream_t ce[max_streams]{};
  cudaEvent_t fork{}, join[max_streams]{};
  cudaEvent_t a{}, b{};
  op* ops = nullptr;  // device op list, room for every tensor
};

struct result {
  float med = 0, best = 0;
  bool bad = false;
};

/// Copies the model from `src` (one buffer, the model's offsets) to the tensors at `dst` in >= 1 GiB launches;
/// times REPS copies after one warm-up, then checks the first and last byte of each tensor against `fill`.
static result copy_model(ctx& c, const char* src, const std::vector<char*>& dst, unsigned char fill,
                         const engine& how = engines[0]) {
  std::vector<op> host;
  std::vector<std::pair<size_t, uint64_t>> launches;  // first op, tiles
  uint64_t tiles = 0, held = 0;
  size_t first = 0;
  std::vector<size_t> to_ce;  // tensors the copy engines take
  for (size_t k = 0; k < c.m.size.size(); ++k) {
    if (how.streams > 0 && c.m.size[k] >= how.ce_from) {
      to_ce.push_back(k);
      if (k + 1 == c.m.size.size() && held > 0) launches.emplace_back(first, tiles);
      continue;
    }
    host.push_back(
        op{reinterpret_cast<const uint4*>(src + c.m.at[k]), reinterpret_cast<uint4*>(dst[k]), tiles, c.m.size[k] / 16});
    tiles += (c.m.size[k] + tile - 1) / tile;
    held += c.m.size[k];
    if (held >= launch_bytes || k + 1 == c.m.size.size()) {
      launches.emplace_back(first, tiles);
      first = host.size();
      tiles = held = 0;
    }
  }
  if (!host.empty()) CK(cudaMemcpy(c.ops, host.data(), host.size() * sizeof(op), cudaMemcpyHostToDevice));
  auto issue = [&] {
    if (how.streams > 0) {
      CK(cudaEventRecord(c.fork, c.st));
      for (int k = 0; k < how.streams; ++k) CK(cudaStreamWaitEvent(c.ce[k], c.fork, 0));
      for (size_t j = 0; j < to_ce.size(); ++j) {
        const size_t k = to_ce[j];
        CK(cudaMemcpyAsync(dst[k], src + c.m.at[k], c.m.size[k], cudaMemcpyDeviceToDevice, c.ce[j % how.streams]));
      }
    }
    for (size_t l = 0; l < launches.size(); ++l) {
      const size_t end = l + 1 < launches.size() ? launches[l + 1].first : host.size();
      const uint64_t t = launches[l].second;
      const int blocks = static_cast<int>(std::min<uint64_t>(t, static_cast<uint64_t>(c.sms) * BPS));
      if (use_bulk) {
        constexpr int smem = kbulk_smem<4, 32768>();
        const int b = static_cast<int>(std::min<uint64_t>(t, static_cast<uint64_t>(c.sms)));
        kbulk<4, 32768><<<b, 32, smem, c.st>>>(c.ops + launches[l].first, static_cast<int>(end - launches[l].first), t);
      } else {
        kcopy<U, PLAIN>
            <<<blocks, T, 0, c.st>>>(c.ops + launches[l].first, static_cast<int>(end - launches[l].first), t);
      }
    }
    CK(cudaGetLastError());
    for (int k = 0; k < how.streams; ++k) {
      CK(cudaEventRecord(c.join[k], c.ce[k]));
      CK(cudaStreamWaitEvent(c.st, c.join[k], 0));
    }
  };
  for (size_t k = 0; k < dst.size(); ++k) CK(cudaMemsetAsync(dst[k], 0, c.m.size[k], c.st));
  result r;
  time_reps(c.st, c.a, c.b, REPS, issue, r.med, r.best);
  for (size_t k = 0; k < dst.size(); ++k)
    for (uint64_t off : {uint64_t{0}, c.m.size[k] - 1}) {
      unsigned char x = 0;
      CK(cudaMemcpy(&x, dst[k] + off, 1, cudaMemcpyDeviceToHost));
      if (x != fill) r.bad = true;
    }
  return r;
}

/// A layout's allocations in this process, and each tensor's address in them.
struct allocated {
  std::vector<char*> allocs, tensors;
  void release() {
    for (char* p : allocs) CK(cudaFree(p));
    allocs.clear(), tensors.clear();
  }
};
static allocated allocate(const layout& l, unsigned char fill) {
  allocated a;
  for (uint64_t n : l.alloc_bytes) {
    char* p = nullptr;
    CK(cudaMalloc(&p, n));
    CK(cudaMemset(p, fill, n));
    a.allocs.push_back(p);
  }
  for (size_t k = 0; k < l.alloc.size(); ++k) a.tensors.push_back(a.allocs[l.alloc[k]] + l.offset[k]);
  CK(cudaDeviceSynchronize());
  return a;
}

static bool experts = false;

static void setup(ctx& c) {
  CK(cudaSetDevice(0));
  CK(cudaFree(0));
  c.m = model_of(experts);
  CK(cudaDeviceGetAttribute(&c.sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaStreamCreateWithFlags(&c.st, cudaStreamNonBlocking));
  CK(cudaEventCreate(&c.a));
  CK(cudaEventCreate(&c.b));
  CK(cudaMalloc(&c.ops, c.m.size.size() * sizeof(op)));
  for (int k = 0; k < max_streams; ++k) {
    CK(cudaStreamCreateWithFlags(&c.ce[k], cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&c.join[k], cudaEventDisableTiming));
  }
  CK(cudaEventCreateWithFlags(&c.fork, cudaEventDisableTiming));
  CK(cudaFuncSetAttribute(kbulk<4, 32768>, cudaFuncAttributeMaxDynamicSharedMemorySize, kbulk_smem<4, 32768>()));
}

const char layouts[] = {'o', 'e', 't', '1', '2', '4', '8'};

/// Handles travel in messages of at most 1,024 (64 KiB): a socket's message has a size limit.
constexpr size_t handles_per_message = 1024;
static void put_all(int s, const std::vector<cudaIpcMemHandle_t>& h) {
  for (size_t k = 0; k < h.size(); k += handles_per_message)
    put(s, h.data() + k, std::min(handles_per_message, h.size() - k) * sizeof h[0]);
}
static void get_all(int s, std::vector<cudaIpcMemHandle_t>& h) {
  for (size_t k = 0; k < h.size(); k += handles_per_message)
    get(s, h.data() + k, std::min(handles_per_message, h.size() - k) * sizeof h[0]);
}

/// The child: for each layout the parent names, allocates it, sends its handles, frees it when told ('f');
/// then ('p') maps the parent's source and copies it into its own one / each / torch layouts (the pull rows).
static void child(int s) {
  ctx c;
  setup(c);
  for (;;) {
    const char kind = get(s);
    if (kind == 'p') break;
    const layout l = plan(c.m, kind);
    allocated a = allocate(l, 0x22);
    std::vector<cudaIpcMemHandle_t> h(a.allocs.size());
    for (size_t k = 0; k < h.size(); ++k) CK(cudaIpcGetMemHandle(&h[k], a.allocs[k]));
    put_all(s, h);
    if (get(s) != 'f') _exit(6);
    a.release();
  }
  cudaIpcMemHandle_t src_h{};
  get(s, &src_h, sizeof src_h);
  char* src = nullptr;
  CK(cudaIpcOpenMemHandle(reinterpret_cast<void**>(&src), src_h, cudaIpcMemLazyEnablePeerAccess));
  result r[3];
  int n = 0;
  for (char kind : {'o', 'e', 't'}) {
    allocated a = allocate(plan(c.m, kind), 0x22);
    r[n++] = copy_model(c, src, a.tensors, 0x11);
    a.release();
  }
  CK(cudaIpcCloseMemHandle(src));
  put(s, r, sizeof r);
  if (get(s) != 'q') _exit(6);
  _exit(0);
}

static void print(const std::string& name, const result& r, float floor, const model& m) {
  printf("%-36s %9.3f %8.3f %8.1f %6.3f%s\n", name.c_str(), r.med, r.best, m.bytes / (r.med * 1e-3) / 1e9,
         floor / r.med, r.bad ? "  BAD (a destination differs from the source)" : "");
}

int main(int argc, char** argv) {
  for (int k = 1; k < argc; ++k) {
    experts |= std::string(argv[k]) == "experts";
    use_bulk |= std::string(argv[k]) == "bulk";
    engines_mode |= std::string(argv[k]) == "engines";
  }
  int sv[2];  // SOCK_SEQPACKET: a message arrives whole; a process that ends ends the other's next read
  if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv)) return 1;
  const pid_t pid = fork();  // before any CUDA call
  if (pid < 0) return 1;
  if (pid == 0) {
    close(sv[0]);
    child(sv[1]);
  }
  close(sv[1]);
  const int s = sv[0];
  ctx c;
  setup(c);
  char* src = nullptr;
  CK(cudaMalloc(&src, c.m.span));
  CK(cudaMemset(src, 0x11, c.m.span));
  float floor = 1e9f;
  {
    allocated one = allocate(plan(c.m, 'o'), 0x33);
    for (int r = 0; r < 4; ++r) {
      CK(cudaEventRecord(c.a, c.st));
      CK(cudaMemcpyAsync(one.allocs[0], src, c.m.span, cudaMemcpyDeviceToDevice, c.st));
      CK(cudaEventRecord(c.b, c.st));
      CK(cudaEventSynchronize(c.b));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, c.a, c.b));
      if (r > 0) floor = std::min(floor, ms);
    }
    one.release();
  }
  printf("dest_alloc: %s, %zu tensors, %.3f GB; %d SMs; launches of >= 1 GiB of consecutive tensors; kernel %s\n",
         experts ? "experts" : "llama3-8b", c.m.size.size(), c.m.bytes / 1e9, c.sms,
         use_bulk ? "kbulk<4, 32 KiB> (bulk_copy.cuh)" : "kcopy (tile_copy.cuh)");
  printf("floor: one %.3f GB local cudaMemcpyAsync %.3f ms (%.1f GB/s); ratio = floor / median\n", c.m.span / 1e9,
         floor, c.m.span / (floor * 1e-3) / 1e9);
  printf("%-36s %9s %8s %8s %6s\n", "row (who: source -> destinations)", "median_ms", "best_ms", "GB/s", "ratio");
  bool bad = false;
  for (char kind : layouts) {  // local destinations
    if (engines_mode) break;
    allocated a = allocate(plan(c.m, kind), 0x33);
    const result r = copy_model(c, src, a.tensors, 0x11);
    print("push: local -> local " + name_of(kind) + " (" + std::to_string(a.allocs.size()) + ")", r, floor, c.m);
    bad |= r.bad;
    a.release();
  }
  for (char kind : layouts) {  // the child's, mapped here
    if (engines_mode && kind != 't' && kind != 'o' && kind != '8') continue;
    const layout l = plan(c.m, kind);
    put(s, kind);
    std::vector<cudaIpcMemHandle_t> h(l.alloc_bytes.size());
    get_all(s, h);
    std::vector<char*> mapped(h.size()), tensors;
    for (size_t k = 0; k < h.size(); ++k)
      CK(cudaIpcOpenMemHandle(reinterpret_cast<void**>(&mapped[k]), h[k], cudaIpcMemLazyEnablePeerAccess));
    for (size_t k = 0; k < l.alloc.size(); ++k) tensors.push_back(mapped[l.alloc[k]] + l.offset[k]);
    for (const engine& e : engines) {
      if (!engines_mode && e.streams > 0) break;
      const result r = copy_model(c, src, tensors, 0x11, e);
      print("push: local -> ipc " + name_of(kind) + " (" + std::to_string(h.size()) + ")" +
                (engines_mode ? std::string(" ") + e.name : std::string()),
            r, floor, c.m);
      bad |= r.bad;
    }
    for (char* p : mapped) CK(cudaIpcCloseMemHandle(p));
    put(s, 'f');
  }
  put(s, 'p');
  cudaIpcMemHandle_t src_h{};
  CK(cudaIpcGetMemHandle(&src_h, src));
  put(s, &src_h, sizeof src_h);
  result pull[3];
  get(s, pull, sizeof pull);
  put(s, 'q');
  int status = 0;
  waitpid(pid, &status, 0);
  int n = 0;
  for (char kind : {'o', 'e', 't'}) {
    print("pull: ipc one -> local " + name_of(kind) + " (child)", pull[n], floor, c.m);
    bad |= pull[n++].bad;
  }
  fflush(stdout);
  return bad || !WIFEXITED(status) || WEXITSTATUS(status) != 0 ? 2 : 0;
}
