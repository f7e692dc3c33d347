// bench/probes/probe.hpp — what the probes share: a CUDA call that must succeed, and the pipe between a probe and the
// child process it forks (the other process on the GPU). Any failure ends the process at once: a child that ends
// closes its pipe ends, so its parent's next read fails and ends it too.
#pragma once
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>

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
