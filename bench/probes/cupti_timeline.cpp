// bench/probes/cupti_timeline.cpp — a GPU timeline where nsys is missing (the GPU machine has none). Built as a
// shared library and named in CUDA_INJECTION64_PATH, it dumps every kernel, memcpy and memset of each CUDA process
// (CUPTI activity records: start and end in ns on the GPU clock) to $CUPTI_OUT.<pid>.csv when the process exits;
// with CUPTI_API=1 also every CUDA runtime and driver call (its start and end on the same clock, so that the host's
// calls of both processes line up with the device's work). bench/probes/timeline.py summarises refit's copy
// launches from it (busy time, gaps between launches; --detail: one refit's calls and device work, both processes).
// Built and run by tools/gpu-check BUNDLE probes (against refit-bench's direct rows). CSV: kind (K kernel, C memcpy,
// S memset, R runtime call, D driver call, T the CUPTI and
// monotonic clocks read together), start, end, stream (a call: its thread), grid x or bytes (a call: its
// correlation id, which a kernel's or copy's record names too), block x (the device work's correlation id), name.
#include <cupti.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <unistd.h>
static FILE* out = nullptr;
static std::mutex mu;
static void CUPTIAPI request(uint8_t** buffer, size_t* size, size_t* max) {
  *size = 8 << 20;
  *buffer = static_cast<uint8_t*>(aligned_alloc(8, *size));
  *max = 0;
}
static void CUPTIAPI complete(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> g(mu);
  CUpti_Activity* r = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(r);
      fprintf(out, "K,%llu,%llu,%u,%d,%u,%s\n", (unsigned long long)k->start, (unsigned long long)k->end, k->streamId,
              k->gridX, k->correlationId, k->name);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(r);
      fprintf(out, "C,%llu,%llu,%u,%llu,%u,memcpy%d\n", (unsigned long long)m->start, (unsigned long long)m->end,
              m->streamId, (unsigned long long)m->bytes, m->correlationId, (int)m->copyKind);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_RUNTIME || r->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
      auto* a = reinterpret_cast<CUpti_ActivityAPI*>(r);
      const bool runtime = r->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
      const char* name = nullptr;
      if (cuptiGetCallbackName(runtime ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &name) !=
              CUPTI_SUCCESS ||
          name == nullptr)
        name = "?";
      fprintf(out, "%c,%llu,%llu,%u,%u,0,%s\n", runtime ? 'R' : 'D', (unsigned long long)a->start,
              (unsigned long long)a->end, a->threadId, a->correlationId, name);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(r);
      fprintf(out, "S,%llu,%llu,%u,%llu,0,memset\n", (unsigned long long)m->start, (unsigned long long)m->end,
              m->streamId, (unsigned long long)m->bytes);
    }
  }
  free(buffer);
}
static void finish() {
  cuptiActivityFlushAll(1);
  if (out) fclose(out);
}
extern "C" int InitializeInjection(void) {
  const char* base = getenv("CUPTI_OUT");
  char path[512];
  snprintf(path, sizeof path, "%s.%d.csv", base ? base : "/tmp/cupti", (int)getpid());
  out = fopen(path, "w");
  if (!out) return 0;
  // The clocks side by side (T): refit's debug lines carry the monotonic clock, and timeline.py --detail places
  // them among the records with this.
  uint64_t now = 0;
  timespec mono{};
  cuptiGetTimestamp(&now);
  clock_gettime(CLOCK_MONOTONIC, &mono);
  fprintf(out, "T,%llu,%llu,0,0,0,clock\n", (unsigned long long)now,
          (unsigned long long)mono.tv_sec * 1000000000ull + (unsigned long long)mono.tv_nsec);
  cuptiActivityRegisterCallbacks(request, complete);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
  if (const char* api = getenv("CUPTI_API"); api != nullptr && strcmp(api, "1") == 0) {
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER);
  }
  atexit(finish);
  return 1;
}
