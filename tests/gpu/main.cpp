// The gpu suite: every case needs a CUDA device. Without one the executable exits 77, which Meson
// reports as SKIP.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>

#include "config/config.hpp"
#include "support/support.hpp"

int main(int argc, char** argv) {
  const int devices = refit::test::cuda_device_count();
  if (devices <= 0) {
    std::fprintf(stderr, "gpu suite: no CUDA device (%s): skipping\n",
                 REFIT_HAVE_CUDA ? "none visible" : "built without CUDA");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
