// refit-bench --streamers N (bench/group.cpp): the parts its files share. group_shards.cpp makes each
// streamer rank's shards and what the receivers hold; group_ranks.cpp runs the ranks (threads or
// forked children) and the receivers (forked children).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench.hpp"
#include "config/config.hpp"
#include "refit/streamer.hpp"
#if REFIT_HAVE_CUDA
#include "copy/cuda_handles.hpp"
#endif

namespace refit::bench::sharded {

// ---------------------------------------------------------------- shards (group_shards.cpp)

/// Rows [first, first + count) of `rows` that rank r of n holds (torch.chunk).
std::pair<std::int64_t, std::int64_t> chunk_rows(std::int64_t rows, std::size_t r, std::size_t n);
/// The bytes of `whole` that rank r of n holds: {offset, length} in its row-major storage.
std::pair<std::uint64_t, std::uint64_t> shard_bytes(const tensor_meta& whole, std::size_t r, std::size_t n);

/// What the receivers hold: receiver k holds rank rank_of[k] of --layout (0 without tpN) and is
/// checked against expectation expect_of[k]; regions[e][i] is the part of source i that the
/// receivers of expectation e take.
struct holdings {
  std::vector<int> rank_of;
  std::vector<std::size_t> expect_of;
  std::vector<int> ranks;  ///< the rank of each expectation
  std::vector<std::vector<byte_region>> regions;
  std::uint64_t payload = 0;  ///< the bytes the distinct ranks need, summed
};
/// What `receivers` receivers hold (`one_receiver`: host_shm's, which holds --rank).
holdings hold(const config& c, const manifest& m, std::size_t receivers, bool one_receiver);

/// One rank's shards of every tensor: their metas, where each starts in its whole tensor, their
/// memory (host, or the rank's GPU), and the terms they add to each expectation's checksums.
struct rank_shards {
  int gpu = -1;
  std::vector<tensor_ref> refs;
  std::vector<std::uint64_t> offsets;  ///< byte offset of each shard in its whole tensor
  std::uint64_t bytes = 0;
  std::vector<std::vector<std::uint64_t>> terms;  ///< per expectation, per source (delta::range_terms)
  std::vector<std::vector<std::byte>> host;
#if REFIT_HAVE_CUDA
  std::vector<cuda::device_buffer> device;
#endif
};
/// Fills rank r's shards with the bytes the whole tensors of a run seeded `seed` have there (the
/// usual rows' fill_random), adding their terms as it goes.
rank_shards make_shards(const manifest& m, std::size_t r, std::size_t n, int gpu, std::uint64_t seed,
                        const holdings& h);

#if REFIT_HAVE_CUDA
/// The cuda_ipc ceiling: every rank's shard bytes that a receiver needs copied to that receiver's
/// GPU, all at once, with cudaMemcpyPeerAsync from each rank's GPU (one stream per rank and
/// receiver). Best of `reps`; seconds.
double peer_pattern_seconds(const holdings& h, const std::vector<rank_shards>& ranks, const std::vector<int>& gpus,
                            int reps);
#endif

// ---------------------------------------------------------------- the children (group_ranks.cpp)

/// Where a child runs and what it serves.
struct child_plan {
  transport_kind kind = transport_kind::host_shm;
  std::string base;           ///< receiver k binds base-k-{rank}, one endpoint per streamer rank
  std::size_t streamers = 1;  ///< N
  std::size_t receivers = 1;  ///< R
  std::size_t index = 0;      ///< this child's receiver k or streamer rank r
  int gpu = -1;               ///< -1: host memory
};

/// The receiver child: over nccl first its part of the ceiling (rank k + 1 of every streamer rank's
/// communicator, the line "ceiling ID BYTES ID BYTES ..." names them), then it serves: "ready", and
/// after every version "committed V SUM..." (view_checksums) or "aborted WHY", until `in` is readable.
[[noreturn]] void receiver_child(const config& c, const manifest& m, const child_plan& p, int rank, int in, int out);
/// A streamer rank as a child (nccl): the root of its ceiling communicator ("ceiling ID NRANKS
/// BYTES"), then its shards ("terms T..." per expectation and source), then one refit per "go V"
/// ("done MS" or "fail WHY") until "close" ("closed").
[[noreturn]] void streamer_child(const config& c, const manifest& m, const holdings& h, const child_plan& p,
                                 bool direct, int in, int out);
/// CUDA devices visible, counted in a child: this process forks its ranks later, and a process
/// forked after CUDA was initialised cannot use it.
int count_gpus_apart();

// ---------------------------------------------------------------- the streamer ranks (group_ranks.cpp)

/// A version sent by every rank at once: from the start to the last rank's return, and each rank's
/// refit() alone (ms).
struct group_times {
  double ms = 0;
  std::vector<double> rank_ms;
};

/// The N streamer ranks, seen from this process.
class rank_set {
 public:
  virtual ~rank_set() = default;
  rank_set() = default;
  rank_set(const rank_set&) = delete;
  rank_set& operator=(const rank_set&) = delete;
  /// Every rank refits version v at once. Throws naming a rank that failed.
  virtual group_times refit(std::uint64_t v) = 0;
  virtual void close() = 0;
  /// Per expectation, per source: every rank's terms, summed.
  std::vector<std::vector<std::uint64_t>> terms;
};

/// Streamers as threads of this process (host_shm, cuda_ipc).
class thread_ranks final : public rank_set {
 public:
  thread_ranks(const config& c, const manifest& m, const holdings& h, const child_plan& p, const std::vector<int>& gpus,
               bool direct);
  group_times refit(std::uint64_t v) override;
  void close() override;

  std::vector<rank_shards> shards;

 private:
  std::vector<std::unique_ptr<streamer>> streamers_;
};

/// Streamers as forked children (nccl): streamer_child() on the other end of each pipe.
///
/// Their first version starts rank by rank, each once every receiver has said "hello" for the one
/// before: a receiver joins a streamer's communicator while it handles that streamer's HELLO and
/// serves nothing else meanwhile, so two receivers that took the HELLOs of two ranks in opposite
/// orders would each wait for the other to join (seen on the H200 with two ranks into a tp2 pair:
/// both inits ran out of time). The sessions then stay, and later versions start together.
class process_ranks final : public rank_set {
 public:
  process_ranks(std::vector<forked_child> ranks, std::vector<forked_child>& receivers)
      : ranks_(std::move(ranks)), receivers_(receivers) {}
  ~process_ranks() override;

  /// After the ceiling: every rank's terms line.
  void read_terms(std::size_t expectations, std::size_t sources);
  group_times refit(std::uint64_t v) override;
  void close() override;
  std::vector<forked_child>& children() { return ranks_; }

 private:
  /// Every receiver's "hello" for rank r's session.
  void await_hellos(std::ptrdiff_t r);

  std::vector<forked_child> ranks_;
  std::vector<forked_child>& receivers_;
  bool opened_ = false;
};

}  // namespace refit::bench::sharded
