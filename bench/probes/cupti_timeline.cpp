// bench/probes/cupti_timeline.cpp — a GPU timeline where nsys is missing (the GPU machine has none). Built as a
// shared library and named in CUDA_INJECTION64_PATH, it dumps every kernel, memcpy and memset of each CUDA process
// (CUPTI activity records: start and end in ns on the GPU clock) to $CUPTI_OUT.<pid>.csv when the process exits;
// bench/probes/timeline.py summarises refit's copy launches from it (busy time, gaps between launches). Built and
// run by tools/gpu-check BUNDLE probes (against refit-bench's direct rows). CSV: kind (K kernel, C memcpy,
// S memset), start, end, stream, grid x or bytes, block x, name.
#include <cupti.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
      fprintf(out, "K,%llu,%llu,%u,%d,%d,%s\n", (unsigned long long)k->start, (unsigned long long)k->end, k->streamId,
              k->gridX, k->blockX, k->name);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(r);
      fprintf(out, "C,%llu,%llu,%u,%llu,%d,memcpy%d\n", (unsigned long long)m->start, (unsigned long long)m->end,
              m->streamId, (unsigned long long)m->bytes, 0, (int)m->copyKind);
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
  cuptiActivityRegisterCallbacks(request, complete);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
  atexit(finish);
  return 1;
}
