// A policy worker and a generation worker written against refit's public headers alone, as a
// user of the installed library writes them. tests/consumer/check_consumer.sh compiles this file
// with nothing but what refit.pc says (or `-I include` from the source tree), links it against
// librefit and runs it: one host_shm refit of one CPU tensor, in chunks, checked byte for byte.
#include <refit/refit.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <vector>

int main() {
  using namespace std::chrono_literals;
  std::printf("consumer: librefit %.*s\n", static_cast<int>(refit::version().size()), refit::version().data());
  if (!refit::has_transport(refit::transport_kind::host_shm)) {
    std::fprintf(stderr, "consumer: has_transport(host_shm) is false\n");
    return 1;
  }
  const refit::tensor_meta meta{"layers.0.weight", refit::dtype::f32, {16, 256}};

  // Generation worker: a parameter table of one tensor, on a private ipc:// endpoint.
  std::vector<float> weights(16 * 256, 0.0f);
  refit::receiver receiver;
  receiver.add_parameter({meta, weights.data(), refit::device::cpu()});

  // Policy worker, on its own thread: streams its tensor as version 1 through buffers smaller
  // than the tensor, so it travels as several chunks.
  std::vector<float> trained(weights.size());
  std::iota(trained.begin(), trained.end(), 0.25f);
  std::atomic<bool> policy_done{false};
  std::string policy_error;  // written by the policy thread, read after join()
  std::thread policy([&, endpoint = receiver.endpoint()] {
    try {
      refit::streamer_options opts;
      opts.endpoint = endpoint;
      opts.transport = refit::transport_kind::host_shm;
      opts.buffer_bytes = 4096;
      refit::streamer streamer(opts);
      const refit::tensor_ref tensor{meta, trained.data(), refit::device::cpu()};
      streamer.refit(1, std::span(&tensor, 1));
      streamer.close();
    } catch (const std::exception& e) {
      policy_error = e.what();
    }
    policy_done = true;
  });

  // Serve until the policy worker has finished (its BYE included), with a deadline.
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!policy_done && std::chrono::steady_clock::now() < deadline) receiver.serve_one(50ms);
  if (!policy_done) {
    std::fprintf(stderr, "consumer: the refit did not finish within 60 s\n");
    std::_Exit(1);  // the policy thread is stuck: do not wait for it
  }
  policy.join();

  if (!policy_error.empty()) {
    std::fprintf(stderr, "consumer: streamer: %s\n", policy_error.c_str());
    return 1;
  }
  if (receiver.committed_version() != 1u) {
    std::fprintf(stderr, "consumer: committed_version is not 1 (last error: %s)\n", receiver.last_error().c_str());
    return 1;
  }
  if (std::memcmp(weights.data(), trained.data(), weights.size() * sizeof(float)) != 0) {
    std::fprintf(stderr, "consumer: the weights differ from what the policy worker sent\n");
    return 1;
  }
  std::printf("consumer: version 1 committed, %zu bytes equal\n", weights.size() * sizeof(float));
  return 0;
}
