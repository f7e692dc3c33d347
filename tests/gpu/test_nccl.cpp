// GPU tests of the nccl transport: one streamer (cuda:0) broadcasting to receivers on the other
// GPUs, each process forked from a parent that never touches CUDA. Receivers report every outcome
// (with a byte-for-byte check of their device weights against the committed version's pattern) and
// the streamer reports every refit's result, as lines on signal pipes; the parent asserts on those.
//
// The machines these run on need NCCL_NVLS_ENABLE=0 (every test sets it before forking).
#include <catch2/catch.hpp>

#include "config/config.hpp"

#if !REFIT_HAVE_NCCL

TEST_CASE("the nccl transport is not built: its GPU tests are skipped", "[nccl]") {
  WARN("refit was built without NCCL: the [nccl] tests did not run");
}

#else

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "support/support.hpp"

using namespace std::chrono_literals;
namespace rt = refit::test;

namespace {

constexpr std::uint64_t mib = 1ull << 20;
constexpr std::uint64_t buffer_bytes = 4 * mib;
/// Deadlines of the healthy tests: generous, communicator set-up included.
constexpr refit::milliseconds relaxed{30000};
/// Deadlines of the fault test: the streamer's timeout and the receivers' idle_timeout.
constexpr refit::milliseconds fault_timeout{3000};

/// Sets up the environment of an nccl test of `ranks` processes (a streamer and ranks - 1
/// receivers); false when it cannot run here (see rt::nccl_ranks: ranks share a GPU where there
/// are fewer, unless `distinct`).
bool nccl_gpus(int ranks, bool distinct = false) {
  if (rt::nccl_ranks(ranks, distinct)) return true;
  WARN("this test needs " << (distinct ? ranks : 1) << " GPU" << (distinct ? "s" : "")
                          << (distinct ? " (one per rank)" : "") << "; " << rt::cuda_device_count()
                          << " visible: skipped");
  return false;
}

void cuda_ok(cudaError_t status, const std::string& what) {
  if (status != cudaSuccess)
    throw std::runtime_error(what + ": " + cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
}

/// One device allocation per tensor (at least one byte, so every tensor has a real pointer).
/// Lives in a child process only.
class device_tensors {
 public:
  device_tensors(int device, const std::vector<refit::tensor_meta>& metas) : device_(device), metas_(metas) {
    cuda_ok(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
    ptrs_.reserve(metas_.size());
    for (const auto& m : metas_) {
      void* p = nullptr;
      cuda_ok(cudaMalloc(&p, std::max<std::uint64_t>(m.nbytes(), 1)), "cudaMalloc for " + refit::describe(m));
      ptrs_.push_back(static_cast<std::uint8_t*>(p));
    }
  }
  ~device_tensors() {
    for (auto* p : ptrs_) (void)cudaFree(p);
  }
  device_tensors(const device_tensors&) = delete;
  device_tensors& operator=(const device_tensors&) = delete;

  [[nodiscard]] std::size_t size() const noexcept { return metas_.size(); }
  [[nodiscard]] std::uint8_t* data(std::size_t i) const noexcept { return ptrs_[i]; }
  [[nodiscard]] refit::device dev() const noexcept { return refit::device::cuda(device_); }

  /// Every tensor := the pattern of `version`.
  void fill(std::uint64_t version) {
    std::vector<std::uint8_t> host;
    for (std::size_t i = 0; i < metas_.size(); ++i) {
      const auto n = metas_[i].nbytes();
      if (n == 0) continue;
      host.resize(n);
      rt::fill_pattern(metas_[i].name, version, host.data(), n);
      cuda_ok(cudaMemcpy(ptrs_[i], host.data(), n, cudaMemcpyHostToDevice), "cudaMemcpy (fill)");
    }
  }

  /// "ok" when every tensor holds the pattern of `version`, else the first difference.
  std::string check(std::uint64_t version) const {
    std::vector<std::uint8_t> host;
    for (std::size_t i = 0; i < metas_.size(); ++i) {
      const auto n = metas_[i].nbytes();
      if (n == 0) continue;
      host.resize(n);
      cuda_ok(cudaMemcpy(host.data(), ptrs_[i], n, cudaMemcpyDeviceToHost), "cudaMemcpy (check)");
      auto m = rt::pattern_mismatch(metas_[i], version, host.data());
      if (!m.empty()) return m;
    }
    return "ok";
  }

 private:
  int device_;
  std::vector<refit::tensor_meta> metas_;
  std::vector<std::uint8_t*> ptrs_;
};

using rt::outcome;

std::string event_name(refit::receiver_event e) { return std::string(refit::to_string(e)); }

// ------------------------------------------------------------------------ the receiver child

enum class sink_kind { table, callback };

struct receiver_spec {
  std::string endpoint;
  int device = 1;
  std::vector<refit::tensor_meta> tensors;
  sink_kind sink = sink_kind::table;
  refit::milliseconds idle_timeout = relaxed;
  /// At callback call `block_batch` (from 0) of refit `block_refit` (from 0, counting BEGINs) report
  /// "blocked" and wait until killed; a table sink: after that batch (serve_one's `batch` event).
  int block_refit = -1;
  int block_batch = -1;
  /// Fill the weights with this version's pattern before serving, and after every aborted or
  /// refused refit report "untouched <check>" (whether every byte still holds it).
  std::optional<std::uint64_t> prefill = std::nullopt;
  /// The GPU of the parameter table's tensors; -1: the receiver's own.
  int table_device = -1;
  /// After every commit also report "free <bytes>": the receiver GPU's free memory.
  bool report_free = false;
  /// receiver_options::stage: a prepared version is reported "prepared <v> weights <check>" (whether
  /// the weights still hold the version before it), then applied at once, then reported committed.
  refit::stage_kind stage = refit::stage_kind::none;
};

/// Free memory of the current CUDA device.
std::uint64_t free_device_memory() {
  std::size_t free = 0, total = 0;
  cuda_ok(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return free;
}

// A receiver in a forked child: parameter table or callback sink into device memory of its GPU.
// Reports "ready" once bound, then an outcome() line for every committed, aborted, refused and
// bye event (aborted and refused lines end with " | " and the receiver's last error).
class receiver_child {
 public:
  explicit receiver_child(receiver_spec spec) : spec_(std::move(spec)), proc_([this] { run(); }) {}

  std::string next_report(std::chrono::milliseconds wait = 60s) { return reports_.receive(wait); }
  int stop() {
    stop_.send("stop");
    return proc_.wait(60s);
  }
  void kill() noexcept { proc_.kill(); }

 private:
  void run();

  receiver_spec spec_;
  rt::signal_pipe reports_;  // child → parent
  rt::signal_pipe stop_;     // parent → child
  rt::signal_pipe hold_;     // never written: a blocked callback waits on it
  rt::child proc_;           // last: forks once the rest exists
};

void receiver_child::run() {
  device_tensors dest(spec_.table_device >= 0 ? spec_.table_device : spec_.device, spec_.tensors);
  if (spec_.prefill) dest.fill(*spec_.prefill);
  std::unordered_map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < spec_.tensors.size(); ++i) index.emplace(spec_.tensors[i].name, i);

  refit::receiver_options ro;
  ro.endpoint = spec_.endpoint;
  ro.device = spec_.device;
  ro.idle_timeout = spec_.idle_timeout;
  ro.stage = spec_.stage;
  refit::receiver r(ro);
  int refits = -1;  // BEGINs seen, minus one
  int batch = 0;    // callback calls in this refit
  if (spec_.sink == sink_kind::table) {
    for (std::size_t i = 0; i < dest.size(); ++i)
      r.add_parameter(refit::tensor_dest{spec_.tensors[i], dest.data(i), dest.dev()});
  } else {
    r.on_batch([&](std::span<const refit::tensor_view> views, void* stream) {
      if (refits == spec_.block_refit && batch == spec_.block_batch) {
        reports_.send("blocked");
        (void)hold_.receive(600s);  // until the parent kills this process
      }
      ++batch;
      if (stream == nullptr) throw std::runtime_error("the callback got no stream on a CUDA transport");
      for (const auto& v : views) {
        if (v.meta == nullptr) throw std::runtime_error("a view without metadata");
        const auto it = index.find(v.meta->name);
        if (it == index.end()) throw std::runtime_error("unexpected tensor " + refit::describe(*v.meta));
        if (!(v.dev == dest.dev())) throw std::runtime_error(v.meta->name + " is not on this receiver's GPU");
        if (v.offset + v.bytes > spec_.tensors[it->second].nbytes())
          throw std::runtime_error(v.meta->name + ": a view outside the tensor");
        if (v.bytes == 0) continue;
        cuda_ok(cudaMemcpyAsync(dest.data(it->second) + v.offset, v.data, v.bytes, cudaMemcpyDeviceToDevice,
                                static_cast<cudaStream_t>(stream)),
                "cudaMemcpyAsync (callback)");
      }
    });
  }
  reports_.send("ready");

  auto last_event = std::chrono::steady_clock::now();
  for (;;) {
    const auto e = r.serve_one(100ms);
    const auto now = std::chrono::steady_clock::now();
    if (e == refit::receiver_event::idle) {
      if (stop_.try_receive(0ms)) return;
      if (now - last_event > 300s) throw std::runtime_error("receiver child: no message for 300 s");
      continue;
    }
    last_event = now;
    switch (e) {
      case refit::receiver_event::begin:
        ++refits;
        batch = 0;
        break;
      case refit::receiver_event::batch:
        if (spec_.sink == sink_kind::table && refits == spec_.block_refit && batch++ == spec_.block_batch) {
          reports_.send("blocked");
          (void)hold_.receive(600s);  // until the parent kills this process
        }
        break;
      case refit::receiver_event::prepared: {
        const std::uint64_t before = r.committed_version().value_or(spec_.prefill.value_or(0));
        reports_.send("prepared " + std::to_string(r.prepared_version().value_or(0)) + " weights " +
                      dest.check(before));
        if (!r.apply_prepared()) throw std::runtime_error("prepared, but apply_prepared() applied nothing");
        [[fallthrough]];
      }
      case refit::receiver_event::committed: {
        const auto v = r.committed_version();
        reports_.send(outcome("committed", v, r.dirty(), v ? dest.check(*v) : "no committed version"));
        if (spec_.report_free) {
          cuda_ok(cudaSetDevice(spec_.device), "cudaSetDevice");
          reports_.send("free " + std::to_string(free_device_memory()));
        }
        break;
      }
      case refit::receiver_event::aborted:
      case refit::receiver_event::refused:
      case refit::receiver_event::bye:
        reports_.send(outcome(event_name(e), r.committed_version(), r.dirty()) + " | " + r.last_error());
        if (spec_.prefill && e != refit::receiver_event::bye) reports_.send("untouched " + dest.check(*spec_.prefill));
        break;
      default: break;
    }
  }
}

// ------------------------------------------------------------------------ the streamer child

// The streamer in a forked child, on cuda:0, its tensors on `tensor_device`. Refits on command
// ("refit <version>") and reports "ok <version> ... in_place=<0|1> batches=<n>" or
// "error <code> <milliseconds> <message>". `direct` is streamer_options::direct.
class streamer_child {
 public:
  streamer_child(std::vector<std::string> receivers, std::vector<refit::tensor_meta> tensors,
                 refit::milliseconds timeout, bool direct = true, int tensor_device = 0,
                 std::uint64_t buffers = buffer_bytes, std::size_t count = 2, bool twin = false, bool atomic = false)
      : receivers_(std::move(receivers)),
        tensors_(std::move(tensors)),
        timeout_(timeout),
        direct_(direct),
        tensor_device_(tensor_device),
        buffers_(buffers),
        count_(count),
        twin_(twin),
        atomic_(atomic),
        proc_([this] { run(); }) {}

  /// Starts one refit; result() returns its report.
  void start(std::uint64_t version) { commands_.send("refit " + std::to_string(version)); }
  std::string result(std::chrono::milliseconds wait = 120s) { return reports_.receive(wait); }
  /// Runs one refit and returns the child's report.
  std::string refit(std::uint64_t version) {
    start(version);
    return result();
  }
  int stop() {
    commands_.send("stop");
    return proc_.wait(60s);
  }

 private:
  void run();

  std::vector<std::string> receivers_;
  std::vector<refit::tensor_meta> tensors_;
  refit::milliseconds timeout_;
  bool direct_;
  int tensor_device_;
  std::uint64_t buffers_;
  std::size_t count_;
  bool twin_;
  bool atomic_;
  rt::signal_pipe commands_;  // parent → child
  rt::signal_pipe reports_;   // child → parent
  rt::child proc_;            // last
};

void streamer_child::run() {
  device_tensors src(tensor_device_, tensors_);
  std::vector<refit::tensor_ref> refs;
  for (std::size_t i = 0; i < src.size(); ++i)
    refs.push_back(refit::tensor_ref{tensors_[i], src.data(i), src.dev(), nullptr});

  refit::streamer_options so;
  so.receivers = receivers_;
  so.transport = refit::transport_kind::nccl;
  so.buffer_count = count_;
  so.nccl_twin = twin_;
  so.buffer_bytes = buffers_;
  so.device = 0;
  so.timeout = timeout_;
  so.direct = direct_;
  so.atomic = atomic_;
  refit::streamer s(so);
  for (;;) {
    const std::string command = commands_.receive(600s);
    if (command == "stop") {
      s.close();
      return;
    }
    const std::uint64_t version = std::stoull(command.substr(command.find(' ') + 1));
    src.fill(version);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      const auto stats = s.refit(version, std::span<const refit::tensor_ref>(refs));
      std::ostringstream line;
      // Entries are broadcast from the tensors themselves (rank 0, in place): they must be intact.
      line << "ok " << stats.version << " tensors=" << stats.tensors << " bytes=" << stats.bytes
           << " source=" << src.check(version) << " in_place=" << stats.direct << " batches=" << stats.batches;
      cuda_ok(cudaSetDevice(0), "cudaSetDevice");
      line << " free=" << free_device_memory();
      reports_.send(line.str());
    } catch (const refit::error& e) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
      std::string message = e.what();
      std::replace(message.begin(), message.end(), '\n', ' ');
      reports_.send("error " + std::string(refit::to_string(e.code())) + " " + std::to_string(ms.count()) + " " +
                    message);
    }
  }
}

/// The receiver's next report that is not the end of an earlier session ("bye ...").
std::string next_after_byes(receiver_child& rx, std::chrono::milliseconds wait = 60s) {
  for (;;) {
    std::string line = rx.next_report(wait);
    if (!line.starts_with("bye ")) return line;
  }
}

struct streamer_failure {
  std::string code;
  long long ms = 0;
  std::string message;
};

std::optional<streamer_failure> parse_failure(const std::string& report) {
  std::istringstream in(report);
  std::string word;
  streamer_failure f;
  if (!(in >> word) || word != "error" || !(in >> f.code >> f.ms)) return std::nullopt;
  std::getline(in, f.message);
  return f;
}

std::uint64_t total_bytes(const std::vector<refit::tensor_meta>& metas) {
  std::uint64_t sum = 0;
  for (const auto& m : metas) sum += m.nbytes();
  return sum;
}

/// The streamer's report of a good refit of `metas`, up to its batch count.
std::string ok_line(std::uint64_t version, const std::vector<refit::tensor_meta>& metas, bool in_place) {
  return "ok " + std::to_string(version) + " tensors=" + std::to_string(metas.size()) +
         " bytes=" + std::to_string(total_bytes(metas)) + " source=ok in_place=" + (in_place ? "1" : "0");
}

/// The report without its batch count (" batches=<n>" at the end).
std::string without_batches(const std::string& report) { return report.substr(0, report.rfind(" batches=")); }

/// The "free=<bytes>" (the streamer GPU's free memory after the refit) of a good refit's report.
std::uint64_t free_of(const std::string& report) {
  const auto at = report.rfind(" free=");
  return at == std::string::npos ? 0 : std::stoull(report.substr(at + 6));
}

/// The batch count of a good refit's report.
std::uint64_t batches_of(const std::string& report) {
  const auto at = report.rfind(" batches=");
  return at == std::string::npos ? 0 : std::stoull(report.substr(at + 9));
}

}  // namespace

// ---------------------------------------------------------------------------------- bytes

TEST_CASE("nccl: one receiver on a second GPU gets three versions of a mixed-dtype model bit-exact", "[nccl]") {
  if (!nccl_gpus(2)) return;
  // 200 small tensors of every dtype (zero-size ones among them) and one three buffers large.
  const auto metas = rt::mixed_model(200, 3 * buffer_bytes);
  const auto ep = rt::temp_endpoint();
  receiver_child rx({.endpoint = ep, .device = rt::gpu_of(1), .tensors = metas});
  REQUIRE(rx.next_report() == "ready");
  streamer_child tx({ep}, metas, relaxed);

  for (std::uint64_t v : {1u, 2u, 3u}) {
    // A parameter table on the receiver's GPU: every entry goes in place, in 1 GiB batches.
    const std::string report = tx.refit(v);
    CHECK(without_batches(report) == ok_line(v, metas, true));
    CHECK(batches_of(report) == 1);
    CHECK(rx.next_report() == outcome("committed", v, false));
  }

  CHECK(tx.stop() == 0);
  CHECK(rx.stop() == 0);
}

TEST_CASE("nccl: three receivers on four GPUs, tables and a callback, all commit bit-exact", "[nccl]") {
  if (!nccl_gpus(4)) return;
  const auto metas = rt::mixed_model(200, 3 * buffer_bytes + 77, 7);
  const std::vector<std::string> eps = {rt::temp_endpoint(), rt::temp_endpoint(), rt::temp_endpoint()};
  receiver_child rx1({.endpoint = eps[0], .device = rt::gpu_of(1), .tensors = metas});
  receiver_child rx2({.endpoint = eps[1], .device = rt::gpu_of(2), .tensors = metas});
  receiver_child rx3({.endpoint = eps[2], .device = rt::gpu_of(3), .tensors = metas, .sink = sink_kind::callback});
  for (auto* rx : {&rx1, &rx2, &rx3}) REQUIRE(rx->next_report() == "ready");
  streamer_child tx(eps, metas, relaxed);

  for (std::uint64_t v : {5u, 6u}) {
    // The callback receiver stages: batches are buffer-sized for everyone.
    const std::string report = tx.refit(v);
    CHECK(without_batches(report) == ok_line(v, metas, false));
    CHECK(batches_of(report) >= (total_bytes(metas) + buffer_bytes - 1) / buffer_bytes);
    for (auto* rx : {&rx1, &rx2, &rx3}) CHECK(rx->next_report() == outcome("committed", v, false));
  }

  CHECK(tx.stop() == 0);
  for (auto* rx : {&rx1, &rx2, &rx3}) CHECK(rx->stop() == 0);
}

TEST_CASE("nccl: with direct = false the same model goes through the buffers in buffer-sized batches, bit-exact",
          "[nccl]") {
  if (!nccl_gpus(2)) return;
  const auto metas = rt::mixed_model(200, 3 * buffer_bytes, 5);
  const auto ep = rt::temp_endpoint();
  receiver_child rx({.endpoint = ep, .device = rt::gpu_of(1), .tensors = metas});
  REQUIRE(rx.next_report() == "ready");
  streamer_child tx({ep}, metas, relaxed, /*direct=*/false);
  for (std::uint64_t v : {1u, 2u}) {
    const std::string report = tx.refit(v);
    CHECK(without_batches(report) == ok_line(v, metas, false));
    CHECK(batches_of(report) >= (total_bytes(metas) + buffer_bytes - 1) / buffer_bytes);  // not one 1 GiB batch
    CHECK(rx.next_report() == outcome("committed", v, false));
  }
  CHECK(tx.stop() == 0);
  CHECK(rx.stop() == 0);
}

TEST_CASE(
    "nccl: an engine-wide version to two device-staged ranks is prepared on both with the weights untouched, then "
    "applied bit-exact; a rank that fails it at END leaves the other on its old version, untouched",
    "[nccl][stage]") {
  if (!nccl_gpus(3)) return;
  const auto metas = rt::mixed_model(120, 3 * buffer_bytes, 11);
  const std::vector<std::string> eps = {rt::temp_endpoint(), rt::temp_endpoint()};
  auto extra = metas;  // rank 2 registers one tensor more than is sent: its END finds it missing
  extra.push_back(refit::tensor_meta{"only.on.rank2", refit::dtype::f32, {64}});
  receiver_child rx1({.endpoint = eps[0],
                      .device = rt::gpu_of(1),
                      .tensors = metas,
                      .prefill = 0,
                      .stage = refit::stage_kind::device});
  receiver_child rx2({.endpoint = eps[1],
                      .device = rt::gpu_of(2),
                      .tensors = metas,
                      .prefill = 0,
                      .stage = refit::stage_kind::device});
  for (auto* rx : {&rx1, &rx2}) REQUIRE(rx->next_report() == "ready");
  streamer_child tx(eps, metas, relaxed, true, 0, buffer_bytes, 2, false, /*atomic=*/true);
  for (std::uint64_t v : {1u, 2u}) {
    // Each staged rank offers its stage in place of its weights: every entry is received straight
    // into the stage, in 1 GiB batches.
    const std::string report = tx.refit(v);
    CHECK(without_batches(report) == ok_line(v, metas, true));
    for (auto* rx : {&rx1, &rx2}) {
      CHECK(rx->next_report() == "prepared " + std::to_string(v) + " weights ok");
      CHECK(rx->next_report() == outcome("committed", v, false));
    }
  }
  CHECK(tx.stop() == 0);
  CHECK(rx1.stop() == 0);
  CHECK(rx2.stop() == 0);

  const std::vector<std::string> eps2 = {rt::temp_endpoint(), rt::temp_endpoint()};
  receiver_child ok_rank({.endpoint = eps2[0],
                          .device = rt::gpu_of(1),
                          .tensors = metas,
                          .prefill = 7,
                          .stage = refit::stage_kind::device});
  receiver_child bad_rank({.endpoint = eps2[1],
                           .device = rt::gpu_of(2),
                           .tensors = extra,
                           .prefill = 7,
                           .stage = refit::stage_kind::device});
  for (auto* rx : {&ok_rank, &bad_rank}) REQUIRE(rx->next_report() == "ready");
  streamer_child tx2(eps2, metas, relaxed, true, 0, buffer_bytes, 2, false, /*atomic=*/true);
  const std::string failed = tx2.refit(8);
  CHECK_THAT(failed, Catch::StartsWith("error ") && Catch::Contains("'only.on.rank2'"));
  // The other rank discards the version, told by the streamer's ABORT, or failing END itself when the
  // failed rank's aborted communicator reached it first (NCCL: one rank's failure ends the collective):
  // either way not committed, its weights untouched and clean.
  const std::string aborted = next_after_byes(ok_rank);
  CHECK_THAT(aborted, Catch::StartsWith(outcome("aborted", std::nullopt, false, "-")));
  CHECK(ok_rank.next_report() == "untouched ok");
  CHECK_THAT(next_after_byes(bad_rank), Catch::StartsWith(outcome("aborted", std::nullopt, false, "-")));
  CHECK(bad_rank.next_report() == "untouched ok");
  CHECK(tx2.stop() == 0);
  CHECK(ok_rank.stop() == 0);
  CHECK(bad_rank.stop() == 0);
}

TEST_CASE(
    "nccl: a rank killed in the middle of an engine-wide version leaves the other device-staged rank on its old "
    "version, bit-exact and clean; a new rank and the survivor take the next version together",
    "[nccl][stage]") {
  if (!nccl_gpus(3)) return;
  const auto metas = rt::mixed_model(120, 3 * buffer_bytes, 11);
  const std::vector<std::string> eps = {rt::temp_endpoint(), rt::temp_endpoint()};
  // Both ranks start on version 1's bytes; the victim stops serving after the second batch of the
  // second version (its second BEGIN), and is killed there.
  // The survivor's idle timeout is long: the streamer's ABORT, not its own deadline, ends version 2.
  receiver_child survivor({.endpoint = eps[0],
                           .device = rt::gpu_of(1),
                           .tensors = metas,
                           .idle_timeout = relaxed,
                           .prefill = 1,
                           .stage = refit::stage_kind::device});
  auto victim = std::make_unique<receiver_child>(receiver_spec{.endpoint = eps[1],
                                                               .device = rt::gpu_of(2),
                                                               .tensors = metas,
                                                               .idle_timeout = fault_timeout,
                                                               .block_refit = 1,
                                                               .block_batch = 1,
                                                               .prefill = 1,
                                                               .stage = refit::stage_kind::device});
  for (auto* rx : {&survivor, victim.get()}) REQUIRE(rx->next_report() == "ready");
  // Buffered (direct off): buffer-sized batches, so the victim stops in the middle of version 2, each
  // dense entry received straight into the stage.
  streamer_child tx(eps, metas, fault_timeout, /*direct=*/false, 0, buffer_bytes, 2, false, /*atomic=*/true);
  REQUIRE(without_batches(tx.refit(1)) == ok_line(1, metas, false));
  for (auto* rx : {&survivor, victim.get()}) {
    REQUIRE(rx->next_report() == "prepared 1 weights ok");
    REQUIRE(rx->next_report() == outcome("committed", 1, false));
  }

  tx.start(2);
  REQUIRE(victim->next_report() == "blocked");
  victim->kill();
  const std::string report = tx.result(4 * fault_timeout + 30s);
  const auto failure = parse_failure(report);
  INFO("streamer report: " << report);
  REQUIRE(failure);
  CHECK(failure->message.find(eps[1]) != std::string::npos);
  // The survivor had staged part of version 2 and never prepared it: the streamer's ABORT discards it,
  // its weights version 1 bit for bit, clean.
  const std::string line = next_after_byes(survivor, 4 * fault_timeout + 30s);
  INFO("survivor: " << line);
  CHECK(line.starts_with(outcome("aborted", 1, false, "-")));
  CHECK(survivor.next_report() == "untouched ok");

  // A new rank on the dead one's endpoint (its weights still version 1's) and the survivor: the next
  // engine-wide version reaches both.
  victim = std::make_unique<receiver_child>(receiver_spec{.endpoint = eps[1],
                                                          .device = rt::gpu_of(2),
                                                          .tensors = metas,
                                                          .idle_timeout = fault_timeout,
                                                          .prefill = 1,
                                                          .stage = refit::stage_kind::device});
  REQUIRE(victim->next_report() == "ready");
  CHECK(without_batches(tx.refit(3)) == ok_line(3, metas, false));
  for (auto* rx : {&survivor, victim.get()}) {
    CHECK(next_after_byes(*rx) == "prepared 3 weights ok");
    CHECK(rx->next_report() == outcome("committed", 3, false));
  }
  CHECK(tx.stop() == 0);
  CHECK(survivor.stop() == 0);
  CHECK(victim->stop() == 0);
}

TEST_CASE("nccl: one communicator (nccl_twin off) and three buffers with the twin (odd ones on it), bit-exact",
          "[nccl]") {
  if (!nccl_gpus(2)) return;
  // Buffered batches. Without the twin every batch goes on the one communicator. With 3 buffers,
  // batch k goes on buffer k % 3 and on the twin when that buffer is odd, so each communicator
  // carries runs of one and of two batches in a row.
  const auto metas = rt::mixed_model(200, 5 * buffer_bytes + 3, 9);
  const auto ep = rt::temp_endpoint();
  receiver_child rx({.endpoint = ep, .device = rt::gpu_of(1), .tensors = metas});
  REQUIRE(rx.next_report() == "ready");
  std::uint64_t v = 1;
  for (const auto& [count, twin] : {std::pair{std::size_t{2}, false}, std::pair{std::size_t{3}, true}}) {
    INFO("buffers: " << count << ", twin: " << twin);
    streamer_child tx({ep}, metas, relaxed, /*direct=*/false, 0, buffer_bytes, count, twin);
    for (int k = 0; k < 2; ++k, ++v) {
      const std::string report = tx.refit(v);
      CHECK(without_batches(report) == ok_line(v, metas, false));
      CHECK(batches_of(report) >= 6);  // twice as many batches as buffers: every buffer is reused
      CHECK(next_after_byes(rx) == outcome("committed", v, false));
    }
    CHECK(tx.stop() == 0);
  }
  CHECK(rx.stop() == 0);
}

TEST_CASE(
    "nccl: tensors and weights on other GPUs than the streamer's and the receiver's are packed and staged, "
    "bit-exact",
    "[nccl]") {
  if (!nccl_gpus(2, /*distinct=*/true)) return;
  // The streamer runs on cuda:0 with its tensors on cuda:1 (packed into its buffers across GPUs);
  // the receiver runs on cuda:1 with its table on cuda:0 (staged, then copied across GPUs). Both
  // copies are refit's kernel, which needs peer access between the two GPUs.
  const auto metas = rt::mixed_model(150, 3 * buffer_bytes, 9);
  const auto ep = rt::temp_endpoint();
  receiver_child rx({.endpoint = ep, .device = rt::gpu_of(1), .tensors = metas, .table_device = 0});
  REQUIRE(rx.next_report() == "ready");
  streamer_child tx({ep}, metas, relaxed, /*direct=*/false, /*tensor_device=*/1);
  for (std::uint64_t v : {1u, 2u}) {
    CHECK(without_batches(tx.refit(v)) == ok_line(v, metas, false));
    CHECK(rx.next_report() == outcome("committed", v, false));
  }
  CHECK(tx.stop() == 0);
  CHECK(rx.stop() == 0);
}

TEST_CASE("nccl: an in-place session holds no ping-pong buffers on either side; a buffered one does", "[nccl]") {
  if (!nccl_gpus(2)) return;
  // 2 x 64 MiB buffers: an in-place session (direct) must leave 128 MiB more free memory than a
  // buffered one (direct = false), on the streamer's GPU and on the receiver's. Each session has a
  // fresh communicator of the same shape, and each streamer is a fresh process on cuda:0.
  constexpr std::uint64_t big = 64 * mib;
  const auto metas = rt::mixed_model(100, 3 * buffer_bytes, 12);
  const auto ep = rt::temp_endpoint();
  receiver_child rx({.endpoint = ep, .device = rt::gpu_of(1), .tensors = metas, .report_free = true});
  REQUIRE(rx.next_report() == "ready");
  const auto free_after = [&](bool direct, std::uint64_t version) {
    streamer_child tx({ep}, metas, relaxed, direct, 0, big);
    const std::string report = tx.refit(version);
    INFO("streamer report: " << report);
    CHECK(without_batches(report) == ok_line(version, metas, direct));
    CHECK(next_after_byes(rx) == outcome("committed", version, false));
    const std::string free_line = rx.next_report();
    REQUIRE(free_line.starts_with("free "));
    CHECK(tx.stop() == 0);
    return std::pair{free_of(report), std::stoull(free_line.substr(5))};
  };
  const auto [streamer_in_place, receiver_in_place] = free_after(true, 1);
  const auto [streamer_buffered, receiver_buffered] = free_after(false, 2);
  INFO("free on the streamer's GPU: in place " << streamer_in_place << ", buffered " << streamer_buffered);
  INFO("free on the receiver's GPU: in place " << receiver_in_place << ", buffered " << receiver_buffered);
  const auto fuzz = 8 * mib;  // allocation granularity and NCCL's own bookkeeping
  CHECK(streamer_in_place + fuzz >= streamer_buffered + 2 * big);
  CHECK(receiver_in_place + fuzz >= receiver_buffered + 2 * big);
  CHECK(rx.stop() == 0);
}

TEST_CASE("nccl: in an in-place session a tensor on another GPU than the streamer's is refused before it is sent",
          "[nccl]") {
  if (!nccl_gpus(2, /*distinct=*/true)) return;
  // The streamer runs on cuda:0 but its tensors live on cuda:1: nothing can be sent in place.
  const auto metas = rt::mixed_model(40, 0, 8);
  const auto first =
      std::find_if(metas.begin(), metas.end(), [](const refit::tensor_meta& m) { return m.nbytes() > 0; });
  REQUIRE(first != metas.end());
  const auto ep = rt::temp_endpoint();
  receiver_child rx({.endpoint = ep, .device = rt::gpu_of(1), .tensors = metas, .prefill = 4});
  REQUIRE(rx.next_report() == "ready");
  streamer_child tx({ep}, metas, relaxed, /*direct=*/true, /*tensor_device=*/1);
  const std::string report = tx.refit(5);
  const auto failure = parse_failure(report);
  INFO("streamer report: " << report);
  REQUIRE(failure);
  CHECK(failure->code == "invalid_argument");
  CHECK(failure->message.find(refit::describe(*first) + " is on cuda:1") != std::string::npos);
  CHECK(failure->message.find("streamer_options::direct = false") != std::string::npos);
  CHECK(tx.stop() == 0);
  // The streamer told the receiver (ABORT), which aborted the refit at once: nothing was
  // committed and nothing written. The session ended with it (nccl), so no BYE follows.
  const std::string line = rx.next_report();
  INFO("receiver: " << line);
  CHECK(line.starts_with(outcome("aborted", std::nullopt, false)));
  CHECK(line.find("aborted version 5 (invalid_argument)") != std::string::npos);
  CHECK(line.find(refit::describe(*first) + " is on cuda:1") != std::string::npos);
  CHECK(rx.next_report() == "untouched ok");
  CHECK(rx.stop() == 0);
}

TEST_CASE("nccl: a batch the receiver's table refuses is refused before a byte of it lands; nothing is committed",
          "[nccl]") {
  if (!nccl_gpus(2)) return;
  // Entries land straight in the table's tensors, so the check of a batch must come before its
  // broadcast is posted. The receiver's table holds the first non-empty tensor (batch 0) in
  // another shape of the same size: BATCH 0 is refused, and every byte keeps version 9.
  const auto metas = rt::mixed_model(60, 0, 3);
  auto table = metas;
  const auto odd = static_cast<std::size_t>(
      std::find_if(table.begin(), table.end(), [](const refit::tensor_meta& m) { return m.nbytes() > 0; }) -
      table.begin());
  REQUIRE(odd < table.size());
  const auto elements = table[odd].numel();
  table[odd].shape = {1, static_cast<std::int64_t>(elements)};
  if (metas[odd].shape == table[odd].shape) table[odd].shape = {static_cast<std::int64_t>(elements), 1};
  REQUIRE(table[odd].nbytes() == metas[odd].nbytes());

  // With the twin communicator too: the streamer then aborts two communicators, one of them with
  // batch 0's broadcast waiting for a receiver that will never post it (abort_both).
  const bool twin = GENERATE(false, true);
  INFO("nccl_twin: " << twin);
  const auto ep = rt::temp_endpoint();
  receiver_child rx({.endpoint = ep, .device = rt::gpu_of(1), .tensors = table, .prefill = 9});
  REQUIRE(rx.next_report() == "ready");
  streamer_child tx({ep}, metas, relaxed, true, 0, buffer_bytes, 2, twin);

  const std::string report = tx.refit(1);
  const auto failure = parse_failure(report);
  INFO("streamer report: " << report);
  REQUIRE(failure);
  CHECK(failure->code == "apply");
  CHECK(failure->message.find("'" + metas[odd].name + "'") != std::string::npos);
  const std::string line = rx.next_report();
  INFO("receiver: " << line);
  CHECK(line.starts_with(outcome("aborted", std::nullopt, false)));
  CHECK(rx.next_report() == "untouched ok");

  CHECK(tx.stop() == 0);
  CHECK(rx.stop() == 0);
}

TEST_CASE("nccl: two ranks on one GPU of one host are refused saying what to do instead", "[nccl]") {
  // Ranks on GPUs of their own (or, with one GPU, none claiming a host of its own): NCCL's
  // "Duplicate GPU detected" reaches the caller with the way out.
  if (!nccl_gpus(1)) return;
  const auto metas = rt::mixed_model(10, 0, 2);
  const auto ep = rt::temp_endpoint();
  receiver_child rx({.endpoint = ep, .device = 0, .tensors = metas, .idle_timeout = fault_timeout});
  REQUIRE(rx.next_report() == "ready");
  streamer_child tx({ep}, metas, fault_timeout);
  const std::string report = tx.refit(1);
  const auto failure = parse_failure(report);
  INFO("streamer report: " << report);
  REQUIRE(failure);
  CHECK(failure->code == "nccl");
  CHECK(failure->message.find("Duplicate GPU") != std::string::npos);
  CHECK(failure->message.find("a receiver on the streamer's GPU takes cuda_ipc") != std::string::npos);
  CHECK(tx.stop() == 0);
  CHECK(rx.stop() == 0);
}

// ---------------------------------------------------------------------------------- faults

TEST_CASE("nccl: a receiver killed mid-refit fails the streamer in time, frees the others, and a new set commits",
          "[nccl]") {
  // Up to 3 receivers (3 when ranks share GPUs); the last one dies. With 2 GPUs there is no
  // survivor to check, but the streamer's failure and the fresh session still are.
  const int devices = rt::cuda_device_count();
  const int receivers = devices >= 4 || devices == 1 ? 3 : std::max(devices - 1, 1);
  if (!nccl_gpus(receivers + 1)) return;
  if (receivers < 2) WARN("only " << devices << " GPUs: no surviving receiver to check (needs 3 GPUs)");
  const auto metas = rt::mixed_model(120, 3 * buffer_bytes, 11);
  std::vector<std::string> eps;
  for (int k = 0; k < receivers; ++k) eps.push_back(rt::temp_endpoint());
  const int victim = receivers - 1;

  std::vector<std::unique_ptr<receiver_child>> rx;
  for (int k = 0; k < receivers; ++k) {
    receiver_spec spec{.endpoint = eps[static_cast<std::size_t>(k)],
                       .device = rt::gpu_of(k + 1),
                       .tensors = metas,
                       .sink = k == victim || k == 1 ? sink_kind::callback : sink_kind::table,
                       .idle_timeout = fault_timeout};
    if (k == victim) {
      spec.block_refit = 1;  // the second refit
      spec.block_batch = 2;  // its third batch
    }
    rx.push_back(std::make_unique<receiver_child>(std::move(spec)));
  }
  for (auto& r : rx) REQUIRE(r->next_report() == "ready");
  streamer_child tx(eps, metas, fault_timeout);

  // A good refit first: the session is up and version 1 is everybody's.
  REQUIRE(without_batches(tx.refit(1)) == ok_line(1, metas, false));
  for (auto& r : rx) REQUIRE(r->next_report() == outcome("committed", 1, false));

  // Version 2: the victim's callback holds its third batch, and is killed there. The streamer
  // waits for its reply to that BATCH and must give up within its deadline, naming it.
  const std::string& victim_ep = eps[static_cast<std::size_t>(victim)];
  tx.start(2);
  REQUIRE(rx[static_cast<std::size_t>(victim)]->next_report() == "blocked");
  rx[static_cast<std::size_t>(victim)]->kill();
  const std::string report = tx.result(4 * fault_timeout + 30s);
  const auto failure = parse_failure(report);
  INFO("streamer report: " << report);
  REQUIRE(failure);
  CHECK(failure->message.find(victim_ep) != std::string::npos);
  // BEGIN, two batches and the wait for the third: within about one deadline, two at most.
  CHECK(failure->ms < 2 * fault_timeout.count() + 1000);

  // The survivors are not left blocked: they give the refit up (idle_timeout, or the streamer's
  // next move) and keep serving with version 1 committed.
  for (int k = 0; k < victim; ++k) {
    const std::string line = rx[static_cast<std::size_t>(k)]->next_report(4 * fault_timeout + 30s);
    INFO("receiver " << k << " on cuda:" << k + 1 << ": " << line);
    CHECK((line.starts_with("aborted committed=1 ") || line.starts_with("bye committed=1 ")));
  }

  // A fresh receiver set: a new process on the dead one's endpoint and GPU, the survivors as they
  // are. The next refit makes a new communicator and commits everywhere.
  rx[static_cast<std::size_t>(victim)] = std::make_unique<receiver_child>(receiver_spec{
      .endpoint = victim_ep, .device = rt::gpu_of(victim + 1), .tensors = metas, .idle_timeout = fault_timeout});
  REQUIRE(rx[static_cast<std::size_t>(victim)]->next_report() == "ready");
  // In place again only where every receiver now has a table (no callback survivor).
  CHECK(without_batches(tx.refit(3)) == ok_line(3, metas, receivers == 1));
  for (int k = 0; k < receivers; ++k) {
    const std::string line = next_after_byes(*rx[static_cast<std::size_t>(k)]);
    INFO("receiver " << k << " on cuda:" << k + 1);
    CHECK(line == outcome("committed", 3, false));
  }

  CHECK(tx.stop() == 0);
  for (auto& r : rx) CHECK(r->stop() == 0);
}

#endif  // REFIT_HAVE_NCCL
