// bench/probes/copy_variants.cu — copy kernel variants over llama3-8b's tensors (bf16, ~1 GB per launch as refit groups them), into local memory and
// into another process's cudaMalloc mapped with cudaIpcOpenMemHandle. Ratio = bytes / time / (1 GiB memcpy speed).
// lib/copy/copy_kernel.cu's choices (2 blocks per SM, 16 loads in flight) come from it (its figures are in
// bench/results/2026-11-27-h100-2xh200-fixed-cost-copy-kernel.txt). Built and run by tools/gpu-check BUNDLE probes.
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <unistd.h>
#include <sys/wait.h>
#include <vector>

#include "probe.hpp"
#include "tile_copy.cuh"
int main() {
  // llama3-8b: embed, 32 x (q k v o gate up down, 2 norms), norm, lm_head; bf16
  std::vector<uint64_t> sizes;
  auto mb = [](uint64_t r, uint64_t c) { return r * c * 2; };
  sizes.push_back(mb(128256, 4096));
  for (int l = 0; l < 32; ++l) {
    for (uint64_t b : {mb(4096, 4096), mb(1024, 4096), mb(1024, 4096), mb(4096, 4096), mb(14336, 4096), mb(14336, 4096),
                       mb(4096, 14336), mb(1, 4096), mb(1, 4096)})
      sizes.push_back(b);
  }
  sizes.push_back(mb(1, 4096));
  sizes.push_back(mb(128256, 4096));
  uint64_t total = 0;
  std::vector<uint64_t> at;
  for (uint64_t b : sizes) {
    at.push_back(total);
    total += (b + 255) / 256 * 256;
  }
  int p2c[2], c2p[2];
  if (pipe(p2c) || pipe(c2p)) return 1;
  pid_t pid = fork();
  if (pid == 0) {
    close(p2c[1]);
    close(c2p[0]);
    CK(cudaSetDevice(0));
    void* m;
    CK(cudaMalloc(&m, total));
    cudaIpcMemHandle_t h;
    CK(cudaIpcGetMemHandle(&h, m));
    put(c2p[1], &h, sizeof h);
    char c;
    get(p2c[0], &c, 1);
    _exit(0);
  }
  close(p2c[0]);
  close(c2p[1]);  // a child that fails closes its ends: the read below then ends
  cudaIpcMemHandle_t h;
  get(c2p[0], &h, sizeof h);
  CK(cudaSetDevice(0));
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  char* src;
  char* local;
  char* remote;
  CK(cudaMalloc(&src, total));
  CK(cudaMalloc(&local, total));
  CK(cudaMemset(src, 7, total));
  CK(cudaIpcOpenMemHandle((void**)&remote, h, cudaIpcMemLazyEnablePeerAccess));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  // ceiling: 1 GiB memcpy, best of 5
  float best = 1e9;
  for (int i = 0; i < 5; ++i) {
    cudaEventRecord(a, st);
    cudaMemcpyAsync(local, src, 1ull << 30, cudaMemcpyDeviceToDevice, st);
    cudaEventRecord(b, st);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    best = std::min(best, ms);
  }
  const double ceil_gbs = (1ull << 30) / (best * 1e-3) / 1e9;
  printf("ceiling %.1f GB/s; llama %.3f GB in %zu tensors; floor %.3f ms\n", ceil_gbs, total / 1e9, sizes.size(),
         total / (ceil_gbs * 1e6));
  // launches of ~1 GB
  for (char* dst : {local, remote}) {
    std::vector<std::vector<op>> launches;
    std::vector<uint64_t> tiles;
    std::vector<op> cur;
    uint64_t tb = 0, bytes = 0;
    for (size_t k = 0; k < sizes.size(); ++k) {
      uint64_t v = (sizes[k] + 15) / 16;
      cur.push_back(op{(const uint4*)(src + at[k]), (uint4*)(dst + at[k]), tb, v});
      tb += (sizes[k] + tile - 1) / tile;
      bytes += sizes[k];
      if (bytes >= (1ull << 30) || k + 1 == sizes.size()) {
        launches.push_back(cur);
        tiles.push_back(tb);
        cur.clear();
        tb = 0;
        bytes = 0;
      }
    }
    std::vector<op*> dev;
    for (auto& l : launches) {
      op* d;
      CK(cudaMalloc(&d, l.size() * sizeof(op)));
      CK(cudaMemcpy(d, l.data(), l.size() * sizeof(op), cudaMemcpyHostToDevice));
      dev.push_back(d);
    }
    auto run = [&](const char* name, auto kern, int bps) {
      std::vector<float> t;
      for (int r = 0; r < 7; ++r) {
        cudaEventRecord(a, st);
        for (size_t l = 0; l < launches.size(); ++l) {
          int blocks = (int)std::min<uint64_t>(tiles[l], (uint64_t)sms * bps);
          kern<<<blocks, 256, 0, st>>>(dev[l], (int)launches[l].size(), tiles[l]);
        }
        cudaEventRecord(b, st);
        CK(cudaEventSynchronize(b));
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        t.push_back(ms);
      }
      std::sort(t.begin(), t.end());
      double floor_ms = total / (ceil_gbs * 1e6);
      printf("%-6s %-28s launches %zu  best %.3f ms (%.3f)  med %.3f ms (%.3f)\n", dst == local ? "local" : "ipc", name,
             launches.size(), t[0], floor_ms / t[0], t[3], floor_ms / t[3]);
      fflush(stdout);
    };
    run("u8 plain 2b/sm", kcopy<8, PLAIN>, 2);
    run("u8 plain 3b/sm", kcopy<8, PLAIN>, 3);
    run("u8 hint 2b/sm", kcopy<8, HINT>, 2);
    run("u8 hint 3b/sm", kcopy<8, HINT>, 3);
    run("u16 plain 2b/sm", kcopy<16, PLAIN>, 2);
    run("u16 hint 2b/sm", kcopy<16, HINT>, 2);
    run("u4 plain 4b/sm", kcopy<4, PLAIN>, 4);
    run("u8 plain 2b/sm again", kcopy<8, PLAIN>, 2);
    // memcpy per tensor
    std::vector<float> t;
    for (int r = 0; r < 5; ++r) {
      cudaEventRecord(a, st);
      for (size_t k = 0; k < sizes.size(); ++k)
        cudaMemcpyAsync(dst + at[k], src + at[k], sizes[k], cudaMemcpyDeviceToDevice, st);
      cudaEventRecord(b, st);
      cudaEventSynchronize(b);
      float ms;
      cudaEventElapsedTime(&ms, a, b);
      t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    printf("%-6s %-28s best %.3f ms (%.3f)\n", dst == local ? "local" : "ipc", "memcpy per tensor", t[0],
           total / (ceil_gbs * 1e6) / t[0]);
  }
  char c = 'q';
  put(p2c[1], &c, 1);
  waitpid(pid, nullptr, 0);
  return 0;
}
