// nccl path: tensors in device memory on both sides, as for cuda_ipc; the streamer's on --device,
// receiver k's on GPU (device + 1 + k) % visible, one process each. The ceiling is a raw
// ncclBroadcast of 1 GiB among the same GPUs, one bench process per rank (the streamer's own
// process is rank 0, helpers spawned like the receivers are the others), measured in the same run
// before the refit rows. Every wait is bounded by --timeout-ms.
#include <sys/wait.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.hpp"
#include "config/config.hpp"
#include "refit/error.hpp"

#if REFIT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#if REFIT_HAVE_NCCL
#include <nccl.h>

#include "copy/cuda_check.hpp"
#include "copy/cuda_handles.hpp"
#include "copy/unique_handle.hpp"
#include "copy/wait.hpp"
#endif

namespace refit::bench {

int receiver_device(int streamer_device, std::size_t k, int visible) noexcept {
  if (visible <= 0) return streamer_device;
  return static_cast<int>((static_cast<std::size_t>(streamer_device) + 1 + k) % static_cast<std::size_t>(visible));
}

std::size_t receiver_processes(const config& c, transport_kind t) noexcept {
  if (t != transport_kind::host_shm && c.layout.tp > 1) return static_cast<std::size_t>(c.layout.tp);
  return t == transport_kind::nccl ? c.receivers : 1;
}

int receiver_gpu(const config& c, transport_kind t, std::size_t k, int visible) noexcept {
  if (t == transport_kind::nccl) return receiver_device(c.device, k, visible);
  if (t == transport_kind::cuda_ipc && c.receiver_device >= 0) return c.receiver_device;
  if (t == transport_kind::cuda_ipc && c.spread_receivers && visible > 0)
    return static_cast<int>((static_cast<std::size_t>(c.device) + k) % static_cast<std::size_t>(visible));
  return c.device;
}

gpu_placement cuda_ipc_placement(const config& c, int visible) {
  if (c.receiver_device >= visible)
    throw error(errc::invalid_argument,
                fmt::format("refit-bench: --receiver-device {} but {} visible", c.receiver_device,
                            visible <= 0   ? std::string("no CUDA device is")
                            : visible == 1 ? std::string("1 CUDA device is")
                                           : fmt::format("{} CUDA devices are", visible)));
  // Started by hand, the streamer serves the one receiver it connects to.
  const std::size_t n = c.side == role::both ? receiver_processes(c, transport_kind::cuda_ipc) : 1;
  gpu_placement p{c.device, {}};
  for (std::size_t k = 0; k < n; ++k) p.receivers.push_back(receiver_gpu(c, transport_kind::cuda_ipc, k, visible));
  return p;
}

std::string to_hex(const void* data, std::size_t n) {
  static constexpr char digits[] = "0123456789abcdef";
  const auto* p = static_cast<const unsigned char*>(data);
  std::string s;
  s.reserve(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    s += digits[p[i] >> 4];
    s += digits[p[i] & 15];
  }
  return s;
}

std::optional<std::string> from_hex(std::string_view hex) {
  if (hex.size() % 2 != 0) return std::nullopt;
  const auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(hex.size() / 2);
  for (std::size_t i = 0; i < hex.size(); i += 2) {
    const int hi = nibble(hex[i]), lo = nibble(hex[i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out += static_cast<char>(hi << 4 | lo);
  }
  return out;
}

int visible_gpus() noexcept {
#if REFIT_HAVE_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

#if REFIT_HAVE_NCCL
namespace {

using std::chrono::milliseconds;

error nccl_error(ncclResult_t status, std::string_view what, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  return error(errc::nccl,
               fmt::format("{}: {}{}; set NCCL_DEBUG=WARN for NCCL's own report", what, ncclGetErrorString(status),
                           last != nullptr && *last != '\0' ? fmt::format(" ({})", last) : std::string()));
}

/// Polls `done` (true: finished) until it says so; between polls checks the communicator for an
/// asynchronous error and runs `watch` (which throws when a peer is gone). errc::timeout past `until`.
template <class Done>
void wait_for(Done done, ncclComm_t comm, const deadline& until, std::string_view what,
              const std::function<void()>& watch) {
  const bool finished = poll_until(until, [&] {
    if (done()) return true;
    if (comm != nullptr) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
      if (r != ncclSuccess) throw nccl_error(r, "ncclCommGetAsyncError", comm);
      if (state != ncclSuccess && state != ncclInProgress) throw nccl_error(state, what, comm);
    }
    if (watch) watch();
    return false;
  });
  if (!finished)
    throw error(errc::timeout, fmt::format("{} did not complete within {} ms (--timeout-ms): a rank is stuck or gone",
                                           what, until.budget.count()));
}

/// The communicator's state has left ncclInProgress (non-blocking mode).
bool comm_ready(ncclComm_t comm) {
  ncclResult_t state = ncclSuccess;
  return ncclCommGetAsyncError(comm, &state) == ncclSuccess && state != ncclInProgress;
}

void abort_comm(ncclComm_t c) noexcept { (void)ncclCommAbort(c); }

/// One rank of a non-blocking communicator; the destructor aborts it (local, never waits on a peer).
class communicator {
 public:
  communicator(int nranks, const ncclUniqueId& id, int rank, const deadline& until,
               const std::function<void()>& watch) {
    const std::string what = fmt::format("ncclCommInitRankConfig (rank {} of {})", rank, nranks);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // set-up runs in the background and is polled against the deadline
    ncclComm_t c = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&c, nranks, id, rank, &config);
    c_.reset(c);  // aborted if this constructor throws
    if (r != ncclSuccess && r != ncclInProgress) throw nccl_error(r, what, c);
    if (c == nullptr) throw error(errc::nccl, what + " returned no communicator");
    wait_for([&] { return comm_ready(c); }, c, until, what, watch);
  }

  [[nodiscard]] ncclComm_t handle() const noexcept { return c_.handle(); }

  /// A collective's result: in non-blocking mode ncclInProgress means "finish enqueuing first".
  void enqueued(ncclResult_t r, std::string_view what, const deadline& until, const std::function<void()>& watch) {
    if (r == ncclSuccess) return;
    if (r != ncclInProgress) throw nccl_error(r, what, handle());
    wait_for([&] { return comm_ready(handle()); }, handle(), until, what, watch);
  }

  void abort() noexcept { c_.reset(); }

 private:
  unique_handle<ncclComm_t, abort_comm> c_;
};

}  // namespace

std::string nccl_unique_id_hex() {
  ncclUniqueId id{};
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) throw nccl_error(r, "refit-bench: ncclGetUniqueId", nullptr);
  return to_hex(id.internal, sizeof id.internal);
}

namespace {

ncclUniqueId unique_id_of(const std::string& id_hex) {
  ncclUniqueId id{};
  const auto raw = from_hex(id_hex);
  if (!raw || raw->size() != sizeof id.internal)
    throw error(errc::invalid_argument, "--nccl-ceiling: not the hex of an ncclUniqueId");
  std::memcpy(id.internal, raw->data(), sizeof id.internal);
  return id;
}

/// What one communicator of a ceiling process holds: its buffers, its stream, and the events that
/// tie its stream to the others' (all-reduce done; broadcast done).
struct ceiling_lane {
  explicit ceiling_lane(const ceiling_comm& c)
      : buf(std::max<std::uint64_t>(c.bytes, 256)),
        flag(256),
        s(cudaStreamNonBlocking),
        barrier(cudaEventDisableTiming),
        sent(cudaEventDisableTiming) {
    check_cuda(cudaMemset(buf.handle(), c.rank == 0 ? 0x5a : 0, std::max<std::uint64_t>(c.bytes, 256)),
               "cudaMemset (ceiling buffer)");
    check_cuda(cudaMemset(flag.handle(), 0, 256), "cudaMemset (ceiling flag)");
  }
  cuda::device_buffer buf, flag;
  cuda::stream s;
  cuda::event barrier, sent;
  std::optional<communicator> comm;
};

}  // namespace

double nccl_ceiling_ranks(const std::vector<ceiling_comm>& comms, int device, milliseconds timeout,
                          const std::function<void()>& watch, const std::function<void(double, double)>& done) {
  if (comms.empty()) throw error(errc::invalid_argument, "the nccl ceiling: no communicator to join");
  std::vector<ncclUniqueId> ids;
  for (const auto& c : comms) {
    ids.push_back(unique_id_of(c.id_hex));
    if (c.nranks < 2 || c.rank < 0 || c.rank >= c.nranks)
      throw error(errc::invalid_argument,
                  fmt::format("--nccl-rank {} of --nccl-ranks {}: out of range", c.rank, c.nranks));
  }
  device_guard guard(device);
  std::vector<std::unique_ptr<ceiling_lane>> lanes;
  for (const auto& c : comms) lanes.push_back(std::make_unique<ceiling_lane>(c));
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // local memsets only
  cuda::event go(cudaEventDisableTiming);
  std::vector<cuda::event> start, stop;
  for (int i = 0; i < nccl_ceiling_reps; ++i) {
    start.emplace_back(cudaEventDefault);
    stop.emplace_back(cudaEventDefault);
  }
  // Every process joins its communicators in the order the caller lists them (all processes list
  // them alike), so that none waits for a rank still joining another one.
  for (std::size_t k = 0; k < comms.size(); ++k)
    lanes[k]->comm.emplace(comms[k].nranks, ids[k], comms[k].rank, deadline::after(timeout), watch);
  const deadline until = deadline::after(timeout);
  const cudaStream_t first = lanes.front()->s.handle();
  const auto all_reduce = [&](ceiling_lane& l, std::string_view what) {
    l.comm->enqueued(
        ncclAllReduce(l.flag.handle(), l.flag.handle(), 1, ncclFloat, ncclSum, l.comm->handle(), l.s.handle()), what,
        until, watch);
  };
  for (int i = 0; i < nccl_ceiling_warmup + nccl_ceiling_reps; ++i) {
    const int timed = i - nccl_ceiling_warmup;
    // A one-element all-reduce on every communicator first: it completes only once every rank has
    // reached it, so the timed broadcasts do not include a peer arriving late. The broadcasts start
    // together, once all of this process's all-reduces are done.
    for (auto& l : lanes) {
      all_reduce(*l, "ncclAllReduce (ceiling barrier)");
      check_cuda(cudaEventRecord(l->barrier.handle(), l->s.handle()), "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(first, l->barrier.handle(), 0), "cudaStreamWaitEvent");
    }
    if (timed >= 0) check_cuda(cudaEventRecord(start[timed].handle(), first), "cudaEventRecord");
    check_cuda(cudaEventRecord(go.handle(), first), "cudaEventRecord");
    for (std::size_t k = 0; k < lanes.size(); ++k) {
      ceiling_lane& l = *lanes[k];
      check_cuda(cudaStreamWaitEvent(l.s.handle(), go.handle(), 0), "cudaStreamWaitEvent");
      l.comm->enqueued(
          ncclBroadcast(l.buf.handle(), l.buf.handle(), comms[k].bytes, ncclUint8, 0, l.comm->handle(), l.s.handle()),
          "ncclBroadcast (ceiling)", until, watch);
      check_cuda(cudaEventRecord(l.sent.handle(), l.s.handle()), "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(first, l.sent.handle(), 0), "cudaStreamWaitEvent");
    }
    if (timed >= 0) check_cuda(cudaEventRecord(stop[timed].handle(), first), "cudaEventRecord");
  }
  // A closing barrier: over NCCL's network transport the root's broadcast completes once its bytes
  // are handed to the socket, and a root that then ended its communicator cut the last receive short
  // (rank 1 failed with "Connection closed by remote peer":
  // bench/results/2026-11-25-h100-nccl-shared-gpu-delta-groups.txt). Past this, every rank has received all.
  for (auto& l : lanes) all_reduce(*l, "ncclAllReduce (ceiling end)");
  for (std::size_t k = 0; k < lanes.size(); ++k)
    wait_for(
        [&] {
          const cudaError_t q = cudaStreamQuery(lanes[k]->s.handle());
          if (q == cudaErrorNotReady) return false;
          check_cuda(q, "the ceiling broadcasts");
          return true;
        },
        lanes[k]->comm->handle(), until,
        fmt::format("the ceiling broadcasts of rank {} of {}", comms[k].rank, comms[k].nranks), watch);

  std::vector<double> seconds;
  for (int i = 0; i < nccl_ceiling_reps; ++i) {
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, start[i].handle(), stop[i].handle()), "cudaEventElapsedTime");
    seconds.push_back(static_cast<double>(ms) * 1e-3);
  }
  const double med = median(seconds);
  if (done) done(med, *std::min_element(seconds.begin(), seconds.end()));
  for (auto& l : lanes) l->comm->abort();  // quiescent: local and quick (a finalize would wait for every rank)
  return med;
}

double nccl_ceiling_rank(const std::string& id_hex, int rank, int nranks, int device, milliseconds timeout,
                         const std::function<void()>& watch, const std::function<void()>& done, double* best) {
  double shortest = 0;
  const double med = nccl_ceiling_ranks({ceiling_comm{id_hex, rank, nranks, nccl_ceiling_bytes}}, device, timeout,
                                        watch, [&](double, double least) {
                                          shortest = least;
                                          if (done) done();
                                        });
  if (rank != 0) return 0;
  if (best) *best = static_cast<double>(nccl_ceiling_bytes) / shortest;
  return static_cast<double>(nccl_ceiling_bytes) / med;
}

namespace {

class nccl_path final : public transport_path {
 public:
  explicit nccl_path(const config& c)
      : device_(c.device),
        receivers_(receiver_processes(c, transport_kind::nccl)),
        timeout_(c.timeout_ms),
        exe_(c.receiver_exe),
        config_(c) {
    if (c.side != role::receiver) {
      visible_ = visible_gpus();
      const bool share = c.nccl_share_gpus;
      if (visible_ < (share ? 1 : 2))
        throw error(errc::invalid_argument,
                    fmt::format("refit-bench: --transport nccl needs at least {} visible GPU{} and {} visible; check "
                                "CUDA_VISIBLE_DEVICES, or use --transport cuda_ipc on one GPU",
                                share ? 1 : 2,
                                share ? ""
                                      : "s (the streamer and each receiver on a GPU of its own; "
                                        "--nccl-share-gpus lets them share)",
                                visible_ == 0 ? std::string("none is") : fmt::format("{} is", visible_)));
      if (device_ < 0 || device_ >= visible_)
        throw error(errc::invalid_argument,
                    fmt::format("refit-bench: --device {} but {} CUDA devices are visible", device_, visible_));
      if (receivers_ < 1 || (!share && receivers_ > static_cast<std::size_t>(visible_ - 1)))
        throw error(errc::invalid_argument,
                    fmt::format("refit-bench: --receivers {}: with {} visible GPUs at most {} receivers fit (one GPU "
                                "each, besides the streamer's GPU {}); NCCL allows one rank per GPU of a host "
                                "(--nccl-share-gpus: ranks share GPUs over NCCL's network transport)",
                                receivers_, visible_, visible_ - 1, device_));
      for (std::size_t k = 0; k < receivers_; ++k) devices_.push_back(receiver_device(device_, k, visible_));
    }
    // The receivers' weights in one arena, as the nccl rows of bench/baseline.json were recorded:
    // NCCL receives into them in the receiver's own process, where the layout costs nothing
    // (bench/probes/dest_alloc.cu, local rows); --dest-memory is cuda_ipc's.
    inner_ = make_cuda_ipc_path(device_, false, dest_memory::arena);
  }

  [[nodiscard]] transport_kind kind() const noexcept override { return transport_kind::nccl; }
  [[nodiscard]] std::string describe_device() const override {
    std::string s = inner_->describe_device();
    if (devices_.empty()) return s;
    s += fmt::format(" (streamer); {} receiver{} on", receivers_, receivers_ == 1 ? "" : "s");
    for (const int d : devices_) {
      cudaDeviceProp prop{};
      const bool ok = cudaGetDeviceProperties(&prop, d) == cudaSuccess;
      s += fmt::format(" GPU {} ({}){}", d, ok ? prop.name : "?", d == devices_.back() ? "" : ",");
    }
    return s;
  }
  std::unique_ptr<tensor_memory> sources(const manifest& m, std::uint64_t seed,
                                         const std::vector<mapped_file>* files) override {
    return inner_->sources(m, seed, files);
  }
  std::unique_ptr<tensor_memory> destinations(const manifest& m) override { return inner_->destinations(m); }

  double measure_ceiling() override {
    const std::string id = nccl_unique_id_hex();
    const int nranks = static_cast<int>(receivers_) + 1;
    std::vector<std::unique_ptr<child_process>> helpers;
    for (std::size_t k = 0; k < receivers_; ++k)
      helpers.push_back(std::make_unique<child_process>(
          exe_, ceiling_args(config_, id, static_cast<int>(k) + 1, nranks, devices_[k])));
    // A helper that exits before rank 0 is done failed (they wait for their stdin to close).
    const auto watch = [&] {
      for (std::size_t k = 0; k < helpers.size(); ++k)
        if (!helpers[k]->running())
          throw error(errc::peer, fmt::format("rank {} (GPU {}, pid {}) exited: {} (its error is on stderr above)",
                                              k + 1, devices_[k], helpers[k]->pid(),
                                              child_process::describe_exit(helpers[k]->finish(milliseconds(0)))));
    };
    double bandwidth = 0;
    try {
      bandwidth = nccl_ceiling_rank(id, 0, nranks, device_, timeout_, watch, nullptr, &best_);
      for (std::size_t k = 0; k < helpers.size(); ++k) {
        const auto line = nlohmann::json::parse(helpers[k]->read_line(timeout_), nullptr, false);
        if (line.is_discarded() || line.value("event", "") != "ceiling")
          throw error(errc::protocol, fmt::format("rank {} said {} instead of its ceiling result", k + 1,
                                                  line.is_discarded() ? "something else" : excerpt(line)));
      }
    } catch (const error& e) {
      std::string_view what = e.what();
      if (what.starts_with("refit-bench: ")) what.remove_prefix(13);
      throw error(e.code(), fmt::format("refit-bench: nccl ceiling (raw ncclBroadcast among GPU {} and {}) failed: {}",
                                        device_, fmt::join(devices_, ", "), what));
    }
    for (auto& h : helpers) {
      const int status = h->finish(timeout_);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        std::cerr << fmt::format("refit-bench: WARNING: an nccl ceiling rank (pid {}) ended with {}\n", h->pid(),
                                 child_process::describe_exit(status));
    }
    return bandwidth;
  }
  [[nodiscard]] std::string ceiling_method() const override {
    return fmt::format(
        "ncclBroadcast of {} MiB from GPU {} to GPU {} ({} ranks, one process each), {} warm-up + "
        "median of {}, CUDA events on the root{}",
        nccl_ceiling_bytes >> 20, device_, fmt::join(devices_, ", "), receivers_ + 1, nccl_ceiling_warmup,
        nccl_ceiling_reps, best_ > 0 ? fmt::format("; best {:.2f} GB/s", best_ / 1e9) : std::string());
  }

 private:
  int device_;
  std::size_t receivers_;
  milliseconds timeout_;
  std::string exe_;
  config config_;
  int visible_ = 0;
  std::vector<int> devices_;
  std::unique_ptr<transport_path> inner_;
  double best_ = 0;
};

}  // namespace

std::unique_ptr<transport_path> make_nccl_path(const config& c) { return std::make_unique<nccl_path>(c); }

#else

namespace {
[[noreturn]] void not_built() {
  throw error(errc::invalid_argument,
              "refit-bench: the nccl transport is not built into this bench (refit was built without NCCL); "
              "rebuild with -Dnccl=enabled, or use --transport host_shm or cuda_ipc");
}
}  // namespace

std::unique_ptr<transport_path> make_nccl_path(const config& /*c*/) { not_built(); }
std::string nccl_unique_id_hex() { not_built(); }
double nccl_ceiling_rank(const std::string&, int, int, int, std::chrono::milliseconds, const std::function<void()>&,
                         const std::function<void()>&, double*) {
  not_built();
}
double nccl_ceiling_ranks(const std::vector<ceiling_comm>&, int, std::chrono::milliseconds,
                          const std::function<void()>&, const std::function<void(double, double)>&) {
  not_built();
}

#endif

}  // namespace refit::bench
