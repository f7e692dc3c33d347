// bench/probes/context_switch.cu — the device round trip of a tiny copy (launch + cudaStreamSynchronize) in a
// process that shares the GPU with another (the colocated case: streamer and receiver each with its own context), by
// what the other process does. On the H100 VMs: ~10 us with the other context idle, ~150 us right after the other
// process ran a kernel (the GPU switching contexts); bench/results/2026-11-27-h100-2xh200-fixed-cost-copy-kernel.txt
// has the figures. Built and run by tools/gpu-check BUNDLE probes.
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <unistd.h>
#include <sys/wait.h>
#include <vector>

#include "probe.hpp"
using clk = std::chrono::steady_clock;
static double us(clk::time_point a, clk::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}
__global__ void copy256(const int4* s, int4* d) {
  if (threadIdx.x < 16) d[threadIdx.x] = s[threadIdx.x];
}
static void report(const char* name, std::vector<double>& v) {
  std::sort(v.begin(), v.end());
  printf("%-62s p10 %7.1f  p50 %7.1f  p90 %7.1f us (n=%zu)\n", name, v[v.size() / 10], v[v.size() / 2],
         v[v.size() * 9 / 10], v.size());
  fflush(stdout);
}
int main() {
  int to_child[2], to_parent[2];
  if (pipe(to_child) || pipe(to_parent)) return 1;
  pid_t pid = fork();
  if (pid == 0) {
    close(to_child[1]);
    close(to_parent[0]);
    CK(cudaSetDevice(0));
    CK(cudaFree(0));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    void* mem;
    CK(cudaMalloc(&mem, 64 << 20));
    void* src;
    CK(cudaMalloc(&src, 1 << 20));
    cudaIpcMemHandle_t h;
    CK(cudaIpcGetMemHandle(&h, mem));
    put(to_parent[1], &h, sizeof h);
    for (;;) {
      char c = get(to_child[0]);
      if (c == 'q') break;
      if (c == 'k') {  // one kernel now, then say done
        copy256<<<1, 32, 0, s>>>((const int4*)src, (int4*)mem);
        cudaStreamSynchronize(s);
        put(to_parent[1], 'd');
      }
      if (c == 'a') {  // active: a kernel every ~500 us until told 's'
        put(to_parent[1], 'd');
        for (;;) {
          copy256<<<1, 32, 0, s>>>((const int4*)src, (int4*)mem);
          cudaStreamSynchronize(s);
          usleep(500);
          fd_set f;
          FD_ZERO(&f);
          FD_SET(to_child[0], &f);
          timeval tv{0, 0};
          if (select(to_child[0] + 1, &f, nullptr, nullptr, &tv) > 0) break;
        }
        get(to_child[0]);
        put(to_parent[1], 'd');
      }
    }
    _exit(0);
  }
  close(to_child[0]);
  close(to_parent[1]);  // a child that fails closes its ends: the read below then ends
  cudaIpcMemHandle_t h;
  get(to_parent[0], &h, sizeof h);
  CK(cudaSetDevice(0));
  CK(cudaFree(0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void* src;
  void* local;
  CK(cudaMalloc(&src, 1 << 20));
  CK(cudaMalloc(&local, 1 << 20));
  void* remote = nullptr;
  cudaError_t e = cudaIpcOpenMemHandle(&remote, h, cudaIpcMemLazyEnablePeerAccess);
  printf("ipc open: %s\n", cudaGetErrorString(e));
  auto measure = [&](const char* name, void* dst, bool child_kernel, int gap_us) {
    std::vector<double> v;
    for (int it = 0; it < 1200; ++it) {
      if (child_kernel) {
        put(to_child[1], 'k');
        get(to_parent[0]);
      }
      if (gap_us) usleep(gap_us);
      auto t0 = clk::now();
      copy256<<<1, 32, 0, s>>>((const int4*)src, (int4*)dst);
      cudaStreamSynchronize(s);
      if (it >= 200) v.push_back(us(t0, clk::now()));
    }
    report(name, v);
  };
  measure("P1 other context idle, local dst", local, false, 0);
  measure("P2 other context idle, IPC dst", remote, false, 0);
  measure("P1g other context idle, local dst, 1 ms gap", local, false, 1000);
  measure("P5 other process ran a kernel just before, local dst", local, true, 0);
  measure("P5i other process ran a kernel just before, IPC dst", remote, true, 0);
  put(to_child[1], 'a');
  get(to_parent[0]);
  measure("P3 other process active (kernel per 500 us), local dst", local, false, 0);
  measure("P4 other process active, IPC dst", remote, false, 0);
  put(to_child[1], 's');
  get(to_parent[0]);
  put(to_child[1], 'q');
  waitpid(pid, nullptr, 0);
  measure("P0 other process gone, local dst", local, false, 0);
  return 0;
}
