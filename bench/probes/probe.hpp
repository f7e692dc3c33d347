// bench/probes/probe.hpp — what the probes share: a CUDA call that must succeed, the pipe between a probe and the
// child process it forks (the other process on the GPU), and timing a launch sequence by events. Any failure ends the
// process at once: a child that ends closes its pipe ends, so its parent's next read fails and ends it too.
#pragma once
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <vector>

#define CK(x)                                                  \
  do {                                                         \
    cudaError_t e_ = (x);                                      \
    if (e_ != cudaSuccess) {                                   \
      fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
      _exit(1);                                                \
    }                                                          \
  } while (0)

/// Writes / reads exactly n bytes through a pipe, or ends the process.
inline void put(int fd, const void* p, std::size_t n) {
  if (write(fd, p, n) != static_cast<ssize_t>(n)) _exit(3);
}
inline void get(int fd, void* p, std::size_t n) {
  if (read(fd, p, n) != static_cast<ssize_t>(n)) _exit(4);
}
inline void put(int fd, char c) { put(fd, &c, 1); }
inline char get(int fd) {
  char c = 0;
  get(fd, &c, 1);
  return c;
}

/// One warm-up of issue() on `st`, then `reps` timed by the events a and b: the median and best in ms.
template <typename F>
inline void time_reps(cudaStream_t st, cudaEvent_t a, cudaEvent_t b, int reps, F issue, float& med, float& best) {
  issue();
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a, st));
    issue();
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  best = t[0];
  med = t[reps / 2];
}
