// GPU tests of the copy engines, the device checksum and the cuda_ipc transport.
//
// The parent process never touches CUDA (a forked child cannot use CUDA once its parent has): all
// CUDA work runs in children made with refit::test::child, which coordinate with the parent through
// signal pipes, never sleeps. A child reports a failure by throwing (exit code 1, the message on
// stderr); the parent asserts on exit codes and on the lines children send.
#include <catch2/catch.hpp>

#include "config/config.hpp"

#if !REFIT_HAVE_CUDA

TEST_CASE("the cuda_ipc transport is not built: its GPU tests are skipped", "[cuda_ipc]") {
  WARN("refit was built without CUDA: the [cuda_ipc] tests did not run");
}

#else

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "channel/channel.hpp"
#include "transport/transport.hpp"
#include "wire/wire.hpp"
#include "copy/copy.hpp"
#include "copy/cuda_check.hpp"
#include "copy/cuda_handles.hpp"
#include "copy/driver.hpp"
#include "copy/vmm.hpp"
#include "refit/memory.hpp"
#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "refit/version.hpp"
#include "support/support.hpp"

using namespace std::chrono_literals;
namespace rt = refit::test;

namespace {

constexpr std::uint64_t kib = 1ull << 10;
constexpr std::uint64_t mib = 1ull << 20;
/// Small buffers, so that the 300-tensor model takes many batches and its oversize tensor chunks.
constexpr std::uint64_t buffer_bytes = 4 * mib;
/// Every wait of the healthy tests.
constexpr refit::milliseconds relaxed{30000};
/// The streamer's timeout and the receivers' idle_timeout in the fault tests.
constexpr refit::milliseconds fault_timeout{2000};

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

std::uint64_t round_up(std::uint64_t n, std::uint64_t a) { return (n + a - 1) / a * a; }

/// A model's tensors in one device allocation (each at a 256-byte aligned offset, at least one
/// byte, so that every tensor has a real pointer), zero between the tensors. Lives in a child only.
class device_tensors {
 public:
  /// In an allocation of their own, or at `place` (memory of `device` of at least bytes_for(metas)).
  device_tensors(const std::vector<refit::tensor_meta>& metas, int device, std::byte* place = nullptr)
      : metas_(metas), device_(device) {
    refit::check_cuda(cudaSetDevice(device), "cudaSetDevice");
    std::uint64_t cursor = 0;
    for (const auto& m : metas_) {
      offsets_.push_back(cursor);
      cursor += round_up(std::max<std::uint64_t>(m.nbytes(), 1), 256);
    }
    total_ = std::max<std::uint64_t>(cursor, 256);
    if (place == nullptr) arena_ = refit::cuda::device_buffer(total_);
    base_ = place != nullptr ? place : static_cast<std::byte*>(arena_.handle());
    refit::check_cuda(cudaMemset(base_, 0, total_), "cudaMemset(test tensors)");
  }
  /// Bytes the tensors of `metas` take together.
  static std::uint64_t bytes_for(const std::vector<refit::tensor_meta>& metas) {
    std::uint64_t n = 0;
    for (const auto& m : metas) n += round_up(std::max<std::uint64_t>(m.nbytes(), 1), 256);
    return std::max<std::uint64_t>(n, 256);
  }

  [[nodiscard]] std::size_t size() const noexcept { return metas_.size(); }
  [[nodiscard]] std::uint64_t total() const noexcept { return total_; }  ///< bytes of the allocation
  [[nodiscard]] const refit::tensor_meta& meta(std::size_t i) const { return metas_[i]; }
  [[nodiscard]] std::byte* data(std::size_t i) const { return base_ + offsets_[i]; }

  /// The whole allocation as it must be when every tensor holds `version`'s pattern.
  [[nodiscard]] std::vector<std::uint8_t> image(std::uint64_t version) const {
    std::vector<std::uint8_t> out(total_, 0);
    for (std::size_t i = 0; i < metas_.size(); ++i)
      rt::fill_pattern(metas_[i].name, version, out.data() + offsets_[i], metas_[i].nbytes());
    return out;
  }

  /// Every tensor takes `version`'s pattern (synchronously).
  void upload(std::uint64_t version) {
    const auto host = image(version);
    refit::check_cuda(cudaMemcpy(base_, host.data(), total_, cudaMemcpyHostToDevice), "upload");
  }

  /// Empty when every byte (tensors and the gaps between them) is what `version` makes it; else
  /// the first difference.
  [[nodiscard]] std::string mismatch(std::uint64_t version) const {
    std::vector<std::uint8_t> got(total_);
    refit::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize before checking");
    refit::check_cuda(cudaMemcpy(got.data(), base_, total_, cudaMemcpyDeviceToHost), "download");
    const auto want = image(version);
    const auto [w, g] = std::mismatch(want.begin(), want.end(), got.begin());
    if (w == want.end()) return {};
    const auto at = static_cast<std::uint64_t>(w - want.begin());
    const auto it = std::upper_bound(offsets_.begin(), offsets_.end(), at);
    const auto i = static_cast<std::size_t>(it - offsets_.begin()) - 1;
    const auto within = at - offsets_[i];
    const std::string where = within < metas_[i].nbytes()
                                  ? refit::describe(metas_[i]) + " byte " + std::to_string(within)
                                  : "the gap after " + refit::describe(metas_[i]) + " at +" + std::to_string(within);
    return "version " + std::to_string(version) + ": " + where + " is " + std::to_string(*g) + ", expected " +
           std::to_string(*w);
  }

  [[nodiscard]] std::vector<refit::tensor_ref> refs() const {
    std::vector<refit::tensor_ref> out;
    for (std::size_t i = 0; i < metas_.size(); ++i)
      out.push_back(refit::tensor_ref{metas_[i], data(i), refit::device::cuda(device_), nullptr});
    return out;
  }

  void register_with(refit::receiver& r) const {
    for (std::size_t i = 0; i < metas_.size(); ++i)
      r.add_parameter(refit::tensor_dest{metas_[i], data(i), refit::device::cuda(device_)});
  }

 private:
  std::vector<refit::tensor_meta> metas_;
  int device_;
  std::vector<std::uint64_t> offsets_;
  std::uint64_t total_ = 0;
  refit::cuda::device_buffer arena_;
  std::byte* base_ = nullptr;
};

std::size_t index_of(const std::vector<refit::tensor_meta>& metas, const std::string& name) {
  for (std::size_t i = 0; i < metas.size(); ++i)
    if (metas[i].name == name) return i;
  throw std::runtime_error("no tensor " + name);
}

refit::streamer_options stream_options(const std::string& endpoint, int device, refit::milliseconds timeout) {
  refit::streamer_options o;
  o.endpoint = endpoint;
  o.transport = refit::transport_kind::cuda_ipc;
  o.buffer_count = 2;
  o.buffer_bytes = buffer_bytes;
  o.device = device;
  o.timeout = timeout;
  return o;
}

refit::receiver_options receive_options(const std::string& endpoint, int device, refit::milliseconds idle) {
  refit::receiver_options o;
  o.endpoint = endpoint;
  o.device = device;
  o.idle_timeout = idle;
  return o;
}

/// Serves until the streamer says BYE. Calls on_commit after each commit (with the committed
/// version), on_begin at each BEGIN and on_aborted at each abort. Throws on an aborted (without
/// on_aborted) or refused message, or when nothing arrives for 60 s.
void serve_until_bye(refit::receiver& r, const std::function<void(std::uint64_t)>& on_commit,
                     const std::function<void()>& on_begin = {}, const std::function<void()>& on_aborted = {}) {
  auto last = std::chrono::steady_clock::now();
  for (;;) {
    const auto e = r.serve_one(100ms);
    const auto now = std::chrono::steady_clock::now();
    if (e == refit::receiver_event::idle) {
      expect(now - last < 60s, "receiver: no message for 60 s");
      continue;
    }
    last = now;
    switch (e) {
      case refit::receiver_event::bye: return;
      case refit::receiver_event::begin:
        if (on_begin) on_begin();
        break;
      case refit::receiver_event::committed: {
        const auto v = r.committed_version();
        expect(v.has_value(), "committed without a committed_version()");
        expect(!r.dirty(), "dirty() after a commit");
        on_commit(*v);
        break;
      }
      case refit::receiver_event::aborted:
        if (on_aborted) {
          on_aborted();
          break;
        }
        [[fallthrough]];
      case refit::receiver_event::refused:
        throw std::runtime_error("receiver: " + std::string(refit::to_string(e)) + ": " + r.last_error());
      default: break;
    }
  }
}

/// Blocks the calling process until it is killed (no sleep: pause() returns only on a signal).
[[noreturn]] void block_forever() {
  for (;;) ::pause();
}

/// Holds a stream: what is enqueued on it after the gate runs only once open() is called (the stream
/// waits, on the device, for a flag in mapped host memory: cuStreamWaitValue32), so that a test
/// decides when a process's GPU work completes. No host function: one that blocks may stall the
/// process's other CUDA calls. Must outlive the stream's work.
class stream_gate {
 public:
  explicit stream_gate(void* stream) {
    refit::check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&flag_), sizeof *flag_, cudaHostAllocMapped),
                      "cudaHostAlloc(the gate)");
    *flag_ = 0;
    void* on_device = nullptr;
    refit::check_cuda(cudaHostGetDevicePointer(&on_device, flag_, 0), "cudaHostGetDevicePointer(the gate)");
    using wait_fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
    static const auto wait = refit::copy::driver_entry<wait_fn>("cuStreamWaitValue32");
    expect(wait != nullptr, "the driver has no cuStreamWaitValue32");
    const CUresult r =
        wait(static_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(on_device), 1, CU_STREAM_WAIT_VALUE_GEQ);
    expect(r == CUDA_SUCCESS, "cuStreamWaitValue32 failed: " + std::to_string(static_cast<int>(r)));
  }
  ~stream_gate() {
    open();
    (void)cudaFreeHost(flag_);
  }
  stream_gate(const stream_gate&) = delete;
  stream_gate& operator=(const stream_gate&) = delete;
  void open() noexcept { std::atomic_ref<std::uint32_t>(*flag_).store(1, std::memory_order_release); }

 private:
  std::uint32_t* flag_ = nullptr;
};

/// The code and message of the refit::error `f` throws (errc::internal and "no error" when none).
std::pair<refit::errc, std::string> error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const refit::error& e) {
    return {e.code(), e.what()};
  }
  return {refit::errc::internal, "no error"};
}

/// A thread that calls `open` once `signal` brings a line, or stays silent for 60 s, or is gone.
std::thread opens_on(rt::signal_pipe& signal, std::function<void()> open) {
  return std::thread([&signal, open = std::move(open)] {
    try {
      (void)signal.try_receive(60s);
    } catch (const std::exception&) {  // the other process is gone: open all the same
    }
    open();
  });
}

// ------------------------------------------------------------------------ the two sides

/// Receiver child with a parameter table on `device`: checks every committed version against
/// `versions` in order and every byte of its weights, then returns at BYE.
void table_receiver(const std::string& endpoint, const std::vector<refit::tensor_meta>& metas, int device,
                    const std::vector<std::uint64_t>& versions, rt::signal_pipe& ready, bool vmm = false) {
  // `vmm`: the weights in VMM chunks exportable as descriptors (an engine under expandable segments).
  std::optional<refit::copy::vmm::local_chunks> chunks;
  if (vmm) {
    refit::check_cuda(cudaSetDevice(device), "cudaSetDevice");
    const std::uint64_t chunk = refit::copy::vmm::granularity(device);
    chunks.emplace((device_tensors::bytes_for(metas) + chunk - 1) / chunk, chunk, device);
  }
  device_tensors weights(metas, device, chunks ? chunks->data() : nullptr);
  refit::receiver r(receive_options(endpoint, device, relaxed));
  weights.register_with(r);
  ready.send("ready");
  std::size_t next = 0;
  serve_until_bye(r, [&](std::uint64_t v) {
    expect(next < versions.size(), "an unexpected commit of version " + std::to_string(v));
    expect(v == versions[next],
           "committed version " + std::to_string(v) + ", expected " + std::to_string(versions[next]));
    const auto m = weights.mismatch(v);
    expect(m.empty(), "parameter table: " + m);
    ++next;
  });
  expect(next == versions.size(),
         std::to_string(next) + " of " + std::to_string(versions.size()) + " versions committed");
}

/// Receiver child with a callback sink that copies every view into its own device buffers on the
/// stream it is given, and checks them at every commit. `before_batch`, when given, runs first in
/// each batch's callback (with its stream); `on_aborted`, when given, at each abort (which then
/// does not fail the receiver).
void callback_receiver(const std::string& endpoint, const std::vector<refit::tensor_meta>& metas, int device,
                       const std::vector<std::uint64_t>& versions, rt::signal_pipe& ready,
                       const std::function<void(void*)>& before_batch = {},
                       const std::function<void()>& on_aborted = {}) {
  device_tensors own(metas, device);
  std::unordered_map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < metas.size(); ++i) index.emplace(metas[i].name, i);
  std::vector<std::uint64_t> arrived(metas.size(), 0);
  std::string problem;

  refit::receiver r(receive_options(endpoint, device, relaxed));
  r.on_batch([&](std::span<const refit::tensor_view> views, void* stream) {
    if (before_batch) before_batch(stream);
    if (stream == nullptr && problem.empty()) problem = "the callback got no stream on cuda_ipc";
    for (const auto& v : views) {
      expect(v.meta != nullptr, "a view without metadata");
      const auto it = index.find(v.meta->name);
      expect(it != index.end(), "unexpected tensor " + refit::describe(*v.meta));
      const auto i = it->second;
      expect(*v.meta == metas[i], refit::describe(*v.meta) + " arrived for " + refit::describe(metas[i]));
      expect(v.dev == refit::device::cuda(device),
             v.meta->name + ": the view is not on cuda:" + std::to_string(device));
      expect(v.total == metas[i].nbytes() && v.offset <= v.total && v.bytes <= v.total - v.offset,
             v.meta->name + ": a view outside the tensor");
      if (v.bytes == 0) continue;
      refit::check_cuda(cudaMemcpyAsync(own.data(i) + v.offset, v.data, v.bytes, cudaMemcpyDeviceToDevice,
                                        static_cast<cudaStream_t>(stream)),
                        "callback cudaMemcpyAsync");
      arrived[i] += v.bytes;
    }
  });
  ready.send("ready");
  std::size_t next = 0;
  serve_until_bye(
      r,
      [&](std::uint64_t v) {
        expect(problem.empty(), problem);
        expect(next < versions.size() && v == versions[next], "unexpected commit of version " + std::to_string(v));
        for (std::size_t i = 0; i < metas.size(); ++i)
          expect(arrived[i] == metas[i].nbytes(), metas[i].name + ": " + std::to_string(arrived[i]) + " of " +
                                                      std::to_string(metas[i].nbytes()) + " bytes arrived");
        const auto m = own.mismatch(v);
        expect(m.empty(), "callback sink: " + m);
        ++next;
      },
      [&] { std::fill(arrived.begin(), arrived.end(), 0); }, on_aborted);
  expect(next == versions.size(),
         std::to_string(next) + " of " + std::to_string(versions.size()) + " versions committed");
}

/// Streamer child: refits `versions` in turn from device tensors on `device`.
/// How a refit must travel: straight into the receiver's weights, or through the buffers.
enum class path { direct, staged };

/// Streams `versions` in turn. `want`, when given, is the path every refit must take;
/// `force_staged` turns the streamer's direct option off.
/// `share`: streamer_options::share_tensors; a staged refit of tensors on the buffers' device is
/// then read by the receiver where they are, every byte of it.
void streamer_of(const std::string& endpoint, const std::vector<refit::tensor_meta>& metas, int device,
                 const std::vector<std::uint64_t>& versions, std::optional<path> want = std::nullopt,
                 bool force_staged = false, bool share = true) {
  device_tensors weights(metas, device);
  auto options = stream_options(endpoint, device, relaxed);
  options.direct = !force_staged;
  options.share_tensors = share;
  refit::streamer s(options);
  for (const auto v : versions) {
    weights.upload(v);
    const auto refs = weights.refs();
    const auto stats = s.refit(v, refs);
    expect(stats.version == v, "stats.version " + std::to_string(stats.version));
    expect(stats.tensors == metas.size(), "stats.tensors " + std::to_string(stats.tensors));
    expect(!want || stats.direct == (want == path::direct),
           std::string("version ") + std::to_string(v) + " travelled " + (stats.direct ? "direct" : "staged") +
               ", expected " + (want == path::direct ? "direct" : "staged"));
    const std::uint64_t shared = share && !stats.direct ? stats.bytes : 0;
    expect(stats.shared_bytes == shared, "version " + std::to_string(v) + ": " + std::to_string(stats.shared_bytes) +
                                             " of " + std::to_string(stats.bytes) + " bytes read in place, expected " +
                                             std::to_string(shared));
  }
  s.close();
}

/// Runs a receiver child (ready once bound) and then a streamer child; both must exit 0.
void two_processes(const std::function<void(rt::signal_pipe&)>& receiver_body,
                   const std::function<void()>& streamer_body) {
  rt::signal_pipe ready;
  rt::child rx([&] { receiver_body(ready); });
  REQUIRE(ready.receive(60s) == "ready");
  rt::child tx(streamer_body);
  CHECK(tx.wait(180s) == 0);
  CHECK(rx.wait(60s) == 0);
}

// ------------------------------------------------------------------------ resource counts

std::size_t open_fds() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

std::size_t map_lines() {
  std::ifstream maps("/proc/self/maps");
  std::size_t n = 0;
  for (std::string line; std::getline(maps, line);) ++n;
  return n;
}

struct resources {
  std::size_t free_device = 0;
  std::size_t fds = 0;
  std::size_t maps = 0;

  static resources now() {
    resources r;
    std::size_t total = 0;
    refit::check_cuda(cudaMemGetInfo(&r.free_device, &total), "cudaMemGetInfo");
    r.fds = open_fds();
    r.maps = map_lines();
    return r;
  }
};

/// Throws unless `later` holds no more than `earlier` (device memory within a little slack for
/// the driver's own bookkeeping, mappings within 2 lines).
void expect_no_growth(const std::string& who, const resources& earlier, const resources& later) {
  constexpr std::size_t device_slack = 4 * mib;
  const std::string figures = who + ": at refit 10 / 1000: free device memory " + std::to_string(earlier.free_device) +
                              " / " + std::to_string(later.free_device) + ", fds " + std::to_string(earlier.fds) +
                              " / " + std::to_string(later.fds) + ", maps lines " + std::to_string(earlier.maps) +
                              " / " + std::to_string(later.maps);
  expect(later.free_device + device_slack >= earlier.free_device, "device memory grew: " + figures);
  expect(later.fds <= earlier.fds, "file descriptors grew: " + figures);
  expect(later.maps <= earlier.maps + 2, "mappings grew: " + figures);
}

// ------------------------------------------------------------------------ copy engines

/// A random 2-D op (rows with their own pitches, as a view or a column slice makes) at `cursor`:
/// short rows (grouped into a tile), rows around a tile and long rows (cut into tiles), aligned
/// to 16 bytes on every row or not; the destination's gaps between rows stay untouched.
std::optional<refit::copy::op> random_rows(std::mt19937_64& rng, const std::byte* src, std::uint64_t src_bytes,
                                           std::byte* dst, std::uint64_t dst_bytes, std::uint64_t& cursor) {
  const auto kind = rng() % 3;
  const std::uint64_t width = kind == 0   ? 1 + rng() % 2048
                              : kind == 1 ? 60 * kib + rng() % (8 * kib)
                                          : 64 * kib + rng() % (200 * kib);
  const std::uint64_t rows = 2 + rng() % (kind == 0 ? 300 : 6);
  const bool aligned = rng() % 2 == 0;
  std::uint64_t w = aligned ? (width + 15) / 16 * 16 : width;
  std::uint64_t src_pitch = w + rng() % 64;
  std::uint64_t dst_pitch = w + rng() % 64;
  std::uint64_t from = rng() % 4096;
  cursor += rng() % 32;
  if (aligned) {
    src_pitch = (src_pitch + 15) / 16 * 16;
    dst_pitch = (dst_pitch + 15) / 16 * 16;
    from = from / 16 * 16;
    cursor = (cursor + 15) / 16 * 16;
  }
  const std::uint64_t dst_span = (rows - 1) * dst_pitch + w;
  if (cursor + dst_span > dst_bytes || from + (rows - 1) * src_pitch + w > src_bytes) return std::nullopt;
  refit::copy::op o(src + from, dst + cursor, w, rows, src_pitch, dst_pitch);
  cursor += dst_span;
  return o;
}

/// Random ops between two device buffers, with random sizes (0 to a few MiB) and misalignments,
/// destinations disjoint; about half of them equally misaligned on both sides (the vector path);
/// one in twenty has several rows with pitches (random_rows).
std::vector<refit::copy::op> random_ops(std::mt19937_64& rng, const std::byte* src, std::uint64_t src_bytes,
                                        std::byte* dst, std::uint64_t dst_bytes, std::size_t count) {
  std::vector<refit::copy::op> ops;
  std::uint64_t cursor = 0;
  for (std::size_t k = 0; k < count; ++k) {
    if (rng() % 20 == 0) {
      const auto o = random_rows(rng, src, src_bytes, dst, dst_bytes, cursor);
      if (!o) break;
      ops.push_back(*o);
      continue;
    }
    const auto kind = rng() % 100;
    std::uint64_t bytes = 0;
    if (kind < 5)
      bytes = 0;
    else if (kind < 50)
      bytes = 1 + rng() % 256;
    else if (kind < 80)
      bytes = 257 + rng() % (16 * kib);
    else if (kind < 95)
      bytes = 16 * kib + rng() % (128 * kib);
    else if (kind < 99)
      bytes = 128 * kib + rng() % mib;
    else
      bytes = mib + rng() % (3 * mib);
    cursor += rng() % 32;  // a gap and a misalignment
    if (cursor + bytes > dst_bytes) break;
    std::uint64_t from = rng() % (src_bytes - bytes + 1);
    if (rng() % 2 == 0) {  // same misalignment modulo 16 as the destination, where it fits
      from = from - from % 16 + cursor % 16;
      if (from + bytes > src_bytes) from -= 16;
    }
    ops.push_back(refit::copy::op{src + from, dst + cursor, bytes});
    cursor += bytes;
  }
  return ops;
}

/// `offload_from`: the kernel engine's copies of at least that many bytes go to the copy engines
/// (make_copier); 0: none. `beside`: the calls are run_beside() (one run() among them), joined
/// before the destination is read, and the source is written on the copier's stream just before
/// them (copies that did not wait for it would read zeros).
void copy_engine_body(refit::copy::engine engine, std::uint64_t offload_from = 0, bool beside = false) {
  refit::check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");
  constexpr std::uint64_t src_bytes = 64 * mib + 13;
  constexpr std::uint64_t dst_bytes = 256 * mib;
  std::mt19937_64 rng(0x5eed + static_cast<unsigned>(engine));

  std::vector<std::uint8_t> src_host(src_bytes);
  for (auto& b : src_host) b = static_cast<std::uint8_t>(rng());
  refit::cuda::device_buffer src(src_bytes);
  refit::cuda::device_buffer dst(dst_bytes);
  refit::cuda::device_buffer src_later(beside ? src_bytes : 1);
  refit::check_cuda(cudaMemcpy((beside ? src_later : src).handle(), src_host.data(), src_bytes, cudaMemcpyHostToDevice),
                    "upload");
  if (beside) refit::check_cuda(cudaMemset(src.handle(), 0, src_bytes), "cudaMemset(source)");
  refit::check_cuda(cudaMemset(dst.handle(), 0xab, dst_bytes), "cudaMemset");
  std::vector<std::uint8_t> want(dst_bytes, 0xab);

  const auto* s = static_cast<const std::byte*>(src.handle());
  auto* d = static_cast<std::byte*>(dst.handle());
  auto ops = random_ops(rng, s, src_bytes, d, dst_bytes, 4000);
  // With copy engines: every third op is marked for the kernel alone (copy::op::kernel_only).
  if (offload_from != 0)
    for (std::size_t k = 0; k < ops.size(); k += 3) ops[k].kernel_only = true;
  expect(ops.size() > 2700, "only " + std::to_string(ops.size()) + " ops fit");
  std::size_t multi_row = 0;
  for (const auto& o : ops) {
    multi_row += o.rows > 1 ? 1 : 0;
    for (std::uint64_t r = 0; r < o.rows && o.bytes != 0; ++r)
      std::memcpy(want.data() + (static_cast<const std::byte*>(o.dst) - d) + r * o.dst_pitch,
                  src_host.data() + (static_cast<const std::byte*>(o.src) - s) + r * o.src_pitch, o.bytes);
  }
  expect(multi_row > 40, "only " + std::to_string(multi_row) + " ops with several rows");

  refit::cuda::stream stream(cudaStreamNonBlocking);
  auto copier = refit::copy::make_copier(engine, 0, refit::milliseconds{60000}, offload_from);
  expect(copier->kind() == engine, "make_copier made another engine");
  // Uneven calls, without waiting in between: more calls than the kernel's ring has slots, lists
  // on each edge of the kernel's by-value sizes (16, 64 and 448 ops: passed in the launch; 449 and
  // more uploaded), one call larger than a slot's first capacity, an empty call and one of
  // zero-byte ops only.
  const std::size_t cuts[] = {1, 7, 16, 17, 64, 65, 448, 449, 1200, 0, 3, 300, 2, 1, 40, 9};
  if (beside)
    refit::check_cuda(
        cudaMemcpyAsync(src.handle(), src_later.handle(), src_bytes, cudaMemcpyDeviceToDevice, stream.handle()),
        "cudaMemcpyAsync(the source, on the copier's stream)");
  const auto run = [&](std::span<const refit::copy::op> part, bool in_order = false) {
    if (beside && !in_order)
      copier->run_beside(part, stream.handle());
    else
      copier->run(part, stream.handle());
  };
  std::size_t at = 0;
  for (std::size_t k = 0; k < std::size(cuts); ++k) {
    const auto take = std::min(cuts[k], ops.size() - at);
    run(std::span<const refit::copy::op>(ops).subspan(at, take), k == 10);  // run() after some run_beside()
    at += take;
  }
  const refit::copy::op nothing[] = {refit::copy::op{s, d, 0}, refit::copy::op{s + 1, d + 1, 0}};
  run(nothing);
  run(std::span<const refit::copy::op>(ops).subspan(at));
  if (beside) copier->join(stream.handle());
  // What the stream does next comes after every copy (those on the copy engines' streams too):
  // the destination is read on it before any host wait.
  refit::cuda::device_buffer after(dst_bytes);
  refit::check_cuda(cudaMemcpyAsync(after.handle(), dst.handle(), dst_bytes, cudaMemcpyDeviceToDevice, stream.handle()),
                    "cudaMemcpyAsync(the destination, on the copier's stream)");
  refit::check_cuda(cudaStreamSynchronize(stream.handle()), "cudaStreamSynchronize");
  if (engine == refit::copy::engine::kernel) expect(copier->idle(), "the kernel engine is not idle after its stream");

  std::vector<std::uint8_t> got(dst_bytes);
  refit::check_cuda(cudaMemcpy(got.data(), after.handle(), dst_bytes, cudaMemcpyDeviceToHost), "download");
  const auto [w, g] = std::mismatch(want.begin(), want.end(), got.begin());
  expect(w == want.end(), std::string(refit::copy::to_string(engine)) + ": byte " + std::to_string(w - want.begin()) +
                              " of the destination is " + std::to_string(*g) + ", expected " + std::to_string(*w));

  // The legacy default stream works too (memcpy_batch falls back to one copy per op there).
  refit::check_cuda(cudaMemset(dst.handle(), 0, dst_bytes), "cudaMemset");
  copier->run(std::span<const refit::copy::op>(ops).subspan(0, 100), nullptr);
  refit::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  for (const auto& o : std::span<const refit::copy::op>(ops).subspan(0, 100)) {
    if (o.bytes == 0) continue;
    std::vector<std::uint8_t> part(o.bytes);
    for (std::uint64_t r = 0; r < o.rows; ++r) {
      refit::check_cuda(cudaMemcpy(part.data(), static_cast<const std::byte*>(o.dst) + r * o.dst_pitch, o.bytes,
                                   cudaMemcpyDeviceToHost),
                        "download");
      expect(std::memcmp(part.data(), src_host.data() + (static_cast<const std::byte*>(o.src) - s) + r * o.src_pitch,
                         o.bytes) == 0,
             std::string(refit::copy::to_string(engine)) + ": a copy on the default stream differs");
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------- tests

TEST_CASE("each GPU copy engine copies thousands of random misaligned ops bit-exact", "[cuda_ipc][copy]") {
  for (const auto engine :
       {refit::copy::engine::kernel, refit::copy::engine::memcpy_batch, refit::copy::engine::memcpy_each}) {
    INFO("engine " << refit::copy::to_string(engine));
    rt::child c([engine] { copy_engine_body(engine); });
    CHECK(c.wait(300s) == 0);
  }
  // The kernel engine handing its copies of 64 KiB and more (a fifth of them) to the copy engines,
  // as it does those of 16 MiB and more when the engine is automatic.
  rt::child c([] { copy_engine_body(refit::copy::engine::kernel, 64 * kib); });
  CHECK(c.wait(300s) == 0);
}

TEST_CASE("a cuda_ipc source holds count x buffer_bytes of device memory and none once closed", "[cuda_ipc][memory]") {
  // README.md's memory table, cuda_ipc staged, the streamer's side: its ping-pong buffers (and a
  // receiver that maps them holds no device memory of its own for them: a mapping is not an
  // allocation). Counted by refit::memory_in_use(), which the driver's view must agree with.
  rt::child c([] {
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
    refit::check_cuda(cudaFree(nullptr), "cudaFree(nullptr)");  // the context, before the baseline
    const refit::memory_usage before = refit::memory_in_use();
    std::size_t free_before = 0, free_during = 0, total = 0;
    refit::check_cuda(cudaMemGetInfo(&free_before, &total), "cudaMemGetInfo");
    {
      refit::transport::source_options o;
      o.name = "cuda_ipc";
      o.count = 3;
      o.bytes = 64 * mib;
      const auto src = refit::transport::make_source(o);
      refit::wire::hello h;
      src->open_session(h);
      const refit::memory_usage during = refit::memory_in_use();
      const std::uint64_t held = during.device - before.device;
      expect(held >= 3 * 64 * mib && held <= 3 * 64 * mib + 8 * mib,
             "device memory held by a 3 x 64 MiB session: " + std::to_string(held));
      expect(during.pinned == before.pinned, "pinned memory: " + std::to_string(during.pinned - before.pinned));
      refit::check_cuda(cudaMemGetInfo(&free_during, &total), "cudaMemGetInfo");
      expect(free_before - free_during >= 3 * 64 * mib,
             "the driver sees " + std::to_string(free_before - free_during) + " bytes taken");
      src->close_session();
    }
    const refit::memory_usage after = refit::memory_in_use();
    expect(after.device == before.device, "left after the source: " + std::to_string(after.device - before.device));
    expect(after.device_peak >= before.device + 3 * 64 * mib, "peak " + std::to_string(after.device_peak));
  });
  CHECK(c.wait(120s) == 0);
}

TEST_CASE("copies run beside the stream start after its work and are complete once joined", "[cuda_ipc][copy]") {
  // Every engine (those without streams of their own run them in order), and the kernel engine
  // with copy engines beside its launches.
  for (const auto engine :
       {refit::copy::engine::kernel, refit::copy::engine::memcpy_batch, refit::copy::engine::memcpy_each}) {
    INFO("engine " << refit::copy::to_string(engine));
    rt::child c([engine] { copy_engine_body(engine, 0, true); });
    CHECK(c.wait(300s) == 0);
  }
  rt::child c([] { copy_engine_body(refit::copy::engine::kernel, 64 * kib, true); });
  CHECK(c.wait(300s) == 0);
}

TEST_CASE("the device checksum equals the CPU checksum for any size and offset", "[cuda_ipc][copy]") {
  rt::child c([] {
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");
    constexpr std::uint64_t bytes = 64 * mib + 7;
    std::mt19937_64 rng(42);
    std::vector<std::uint8_t> host(bytes);
    for (auto& b : host) b = static_cast<std::uint8_t>(rng());
    refit::cuda::device_buffer dev(bytes);
    refit::check_cuda(cudaMemcpy(dev.handle(), host.data(), bytes, cudaMemcpyHostToDevice), "upload");
    const auto* d = static_cast<const std::uint8_t*>(dev.handle());

    std::vector<std::pair<std::uint64_t, std::uint64_t>> cases = {
        {0, 0},        {0, 1}, {3, 7}, {5, 8}, {1, 9}, {0, 4096}, {7, 4096 + 3}, {0, bytes}, {13, 33 * mib + 5},
        {8, bytes - 8}};
    for (int k = 0; k < 200; ++k) {
      const std::uint64_t n = rng() % 3 == 0 ? rng() % 64 : rng() % (4 * mib);
      cases.emplace_back(rng() % (bytes - n + 1), n);
    }
    for (const auto& [offset, n] : cases) {
      const auto cpu = refit::copy::checksum(host.data() + offset, n);
      const auto gpu = refit::copy::checksum(d + offset, n, refit::device::cuda(0));
      expect(cpu == gpu, "checksum of " + std::to_string(n) + " bytes at +" + std::to_string(offset) + ": device " +
                             std::to_string(gpu) + ", CPU " + std::to_string(cpu));
    }
    // Not just a function of the length: one changed byte changes it.
    host[12345] ^= 1;
    expect(refit::copy::checksum(host.data(), bytes) != refit::copy::checksum(d, bytes, refit::device::cuda(0)),
           "the checksum did not see a changed byte");
  });
  CHECK(c.wait(300s) == 0);
}

TEST_CASE("three refits of mixed dtypes over cuda_ipc on one GPU land bit-exact in the parameter table", "[cuda_ipc]") {
  // Direct by default: the streamer writes into the receiver's weights (one arena, so every
  // tensor is an offset into one exported allocation); the check covers the gaps between them.
  const auto metas = rt::mixed_model(300, 3 * buffer_bytes);
  const auto ep = rt::temp_endpoint();
  const std::vector<std::uint64_t> versions = {1, 2, 3};
  two_processes([&](rt::signal_pipe& ready) { table_receiver(ep, metas, 0, versions, ready); },
                [&] { streamer_of(ep, metas, 0, versions, path::direct); });
}

TEST_CASE("a direct cuda_ipc refit commits only once the streamer's writes have landed", "[cuda_ipc]") {
  // Four tensors of 1 GiB, whose last copies run for milliseconds after they are enqueued, and END
  // leaves while they run (the receiver waits for the streamer's event before it commits): what
  // the receiver holds at the commit must be the whole version (its checksum, taken at once on its
  // own stream, that of a buffer filled with the version's byte).
  constexpr std::uint64_t gib = 1ull << 30;
  const std::vector<refit::tensor_meta> metas = {{"a", refit::dtype::u8, {std::int64_t(gib)}},
                                                 {"b", refit::dtype::u8, {std::int64_t(gib)}},
                                                 {"c", refit::dtype::u8, {std::int64_t(gib)}},
                                                 {"d", refit::dtype::u8, {std::int64_t(gib)}}};
  const std::vector<std::uint64_t> versions = {1, 2, 3};
  const auto ep = rt::temp_endpoint();
  two_processes(
      [&](rt::signal_pipe& ready) {
        device_tensors weights(metas, 0);
        refit::cuda::device_buffer reference(weights.total());
        refit::receiver r(receive_options(ep, 0, relaxed));
        weights.register_with(r);
        ready.send("ready");
        std::size_t commits = 0;
        serve_until_bye(r, [&](std::uint64_t v) {
          const std::uint64_t got = refit::copy::checksum(weights.data(0), weights.total(), refit::device::cuda(0));
          refit::check_cuda(cudaMemset(reference.handle(), static_cast<int>(v), weights.total()), "cudaMemset");
          const std::uint64_t want = refit::copy::checksum(reference.handle(), weights.total(), refit::device::cuda(0));
          expect(got == want, "version " + std::to_string(v) + " committed before the streamer's writes landed");
          ++commits;
        });
        expect(commits == versions.size(), std::to_string(commits) + " commits");
      },
      [&] {
        device_tensors weights(metas, 0);
        refit::streamer s(stream_options(ep, 0, relaxed));
        for (const std::uint64_t v : versions) {
          refit::check_cuda(cudaMemset(weights.data(0), static_cast<int>(v), weights.total()), "cudaMemset");
          refit::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
          const auto stats = s.refit(v, weights.refs());
          expect(stats.direct, "version " + std::to_string(v) + " was not written directly");
        }
        s.close();
      });
}

TEST_CASE(
    "a direct cuda_ipc streamer whose marked writes do not complete fails END with a timeout; nothing is committed, "
    "and the next streamer commits bit-exact",
    "[cuda_ipc][hostile]") {
  // A streamer of its own: HELLO asking for direct writes, BEGIN, the manifest, then packed[0]
  // recorded behind a host function that holds its stream until this side lets it go, and END. The
  // receiver (idle timeout 1 s, which bounds its wait for the writes) must answer END with a
  // timeout rather than commit or hang; the hold ends only once that answer is in.
  const auto ep = rt::temp_endpoint();
  const refit::tensor_meta w{"w", refit::dtype::bf16, {4096}};
  two_processes(
      [&](rt::signal_pipe& ready) {
        refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
        device_tensors engine({w}, 0);
        engine.upload(7);
        refit::receiver r(receive_options(ep, 0, 1000ms));
        engine.register_with(r);
        ready.send("ready");
        int aborts = 0;
        std::vector<std::uint64_t> commits;
        for (auto e = r.serve_one(60s); e != refit::receiver_event::bye; e = r.serve_one(60s)) {
          expect(e != refit::receiver_event::idle, "receiver: no message for 60 s");
          expect(e != refit::receiver_event::refused, "receiver: refused: " + r.last_error());
          if (e == refit::receiver_event::aborted) {
            ++aborts;
            expect(r.last_error().find("the streamer's direct writes did not complete within 1000 ms") !=
                       std::string::npos,
                   "last_error: " + r.last_error());
            expect(!r.committed_version().has_value(), "a version was committed");
          }
          if (e == refit::receiver_event::committed) commits.push_back(*r.committed_version());
        }
        expect(aborts == 1, std::to_string(aborts) + " aborts");
        expect(commits == std::vector<std::uint64_t>{2}, std::to_string(commits.size()) + " commits");
        expect(engine.mismatch(2).empty(), "weights after version 2: " + engine.mismatch(2));
      },
      [&] {
        refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
        refit::transport::source_options o;
        o.name = "cuda_ipc";
        o.bytes = 1 * mib;
        o.direct = true;
        const auto src = refit::transport::make_source(o);
        refit::wire::hello h;
        src->open_session(h);
        h.secret = "0123456789abcdef";
        refit::channel::req_channel ch(ep);
        const auto ask = [&](const std::string& bytes, const char* what) {
          return refit::wire::decode(ch.request(bytes, relaxed, what));
        };
        const auto hello = ask(refit::wire::encode(h), "HELLO");
        const auto* ok = std::get_if<refit::wire::ok>(&hello);
        expect(ok != nullptr && ok->mode == refit::wire::session_mode::in_place, "HELLO: no direct offer");
        src->session_accepted(std::span<const refit::wire::ok>(ok, 1));
        expect(src->direct(), "the source did not take the offer");
        const auto expect_ok = [&](const refit::wire::message& m, const char* what) {
          const auto* e = std::get_if<refit::wire::error>(&m);
          expect(e == nullptr, std::string(what) + ": " + (e ? e->message : ""));
        };
        expect_ok(ask(refit::wire::encode(refit::wire::begin{1, false, std::nullopt}, h.secret), "BEGIN"), "BEGIN");
        refit::wire::batch b{1, 0, 0, {{"w", refit::dtype::bf16, {4096}, 0, w.nbytes(), 0}}};
        expect_ok(ask(refit::wire::encode(b, h.secret), "BATCH"), "BATCH");
        static std::atomic<bool> release{false};
        refit::check_cuda(cudaLaunchHostFunc(
                              static_cast<cudaStream_t>(src->stream()),
                              [](void*) {
                                while (!release.load()) std::this_thread::yield();
                              },
                              nullptr),
                          "cudaLaunchHostFunc");
        expect(src->hand_over_writes(), "the source did not mark its writes");
        const auto end =
            ask(refit::wire::encode(refit::wire::end{1, 1, w.nbytes(), 1, std::nullopt, false}, h.secret), "END");
        release.store(true);
        const auto* e = std::get_if<refit::wire::error>(&end);
        expect(e != nullptr && e->code == refit::errc::timeout, "END was not refused with a timeout");
        expect(e->message.find("the streamer's direct writes did not complete within 1000 ms (is the policy process "
                               "alive?); nothing was committed") != std::string::npos,
               "END: " + e->message);
        src->drain();
        // A real streamer takes the receiver over (a new session) and commits bit-exact.
        device_tensors source({w}, 0);
        source.upload(2);
        refit::streamer s(stream_options(ep, 0, relaxed));
        s.refit(2, source.refs());
        s.close();
      });
}

TEST_CASE(
    "a direct cuda_ipc source that fails after pieces of the manifest went out aborts the refit; the next one "
    "commits bit-exact",
    "[cuda_ipc]") {
  // A direct session's manifest goes in pieces, each sent while the next tensors are planned: a
  // failure with a piece in flight must hear its reply before ABORT (one request at a time).
  const auto metas = rt::mixed_model(400, 0);
  const auto ep = rt::temp_endpoint();
  two_processes(
      [&](rt::signal_pipe& ready) {
        device_tensors weights(metas, 0);
        refit::receiver r(receive_options(ep, 0, relaxed));
        weights.register_with(r);
        ready.send("ready");
        int aborts = 0, commits = 0;
        serve_until_bye(
            r,
            [&](std::uint64_t v) {
              ++commits;
              expect(v == 2, "committed version " + std::to_string(v));
              const auto m = weights.mismatch(2);
              expect(m.empty(), "version 2: " + m);
            },
            {},
            [&] {
              ++aborts;
              expect(r.last_error().find("the source gave up at tensor 300") != std::string::npos,
                     "last_error: " + r.last_error());
            });
        expect(aborts == 1 && commits == 1,
               std::to_string(aborts) + " aborts, " + std::to_string(commits) + " commits");
      },
      [&] {
        device_tensors source(metas, 0);
        refit::streamer s(stream_options(ep, 0, relaxed));
        source.upload(1);
        const auto refs = source.refs();
        std::size_t i = 0;
        try {
          s.refit(1, [&]() -> std::optional<refit::tensor_ref> {
            if (i == 300) throw refit::error(refit::errc::invalid_argument, "the source gave up at tensor 300");
            return refs[i++];
          });
          expect(false, "a refit whose source threw succeeded");
        } catch (const refit::error& e) {
          expect(std::string(e.what()).find("the source gave up at tensor 300") != std::string::npos,
                 std::string("message: ") + e.what());
        }
        source.upload(2);
        const auto stats = s.refit(2, source.refs());
        expect(stats.direct, "version 2 was not written directly");
        expect(stats.tensors == metas.size(), std::to_string(stats.tensors) + " tensors");
        s.close();
      });
}

TEST_CASE("with direct writes turned off, cuda_ipc stages through the buffers into the parameter table bit-exact",
          "[cuda_ipc]") {
  const auto metas = rt::mixed_model(300, 3 * buffer_bytes);
  const auto ep = rt::temp_endpoint();
  const std::vector<std::uint64_t> versions = {1, 2, 3};
  two_processes([&](rt::signal_pipe& ready) { table_receiver(ep, metas, 0, versions, ready); },
                [&] { streamer_of(ep, metas, 0, versions, path::staged, true); });
  // Every tensor packed into the buffers (the receiver reads nothing of the streamer's in place).
  const auto ep2 = rt::temp_endpoint();
  two_processes([&](rt::signal_pipe& ready) { table_receiver(ep2, metas, 0, versions, ready); },
                [&] { streamer_of(ep2, metas, 0, versions, path::staged, true, false); });
}

TEST_CASE(
    "a staged cuda_ipc receiver (a device stage, or a host stage in page-locked memory) keeps its weights "
    "untouched until apply_prepared, which lands each version bit-exact on its own stream or the engine's",
    "[cuda_ipc][stage]") {
  // A staged receiver offers its weights to no one. A device stage offers itself: a streamer that asks
  // for direct writes (the default) writes the stage. With direct writes turned off, and into a host
  // stage (page-locked host memory, which no other process maps), every version comes through the
  // buffers (and the streamer's tensors read in place) into the stage.
  const auto metas = rt::mixed_model(300, 3 * buffer_bytes, 3);
  const std::vector<std::uint64_t> versions = {1, 2, 3, 4};
  for (const auto& [kind, force_staged] :
       {std::pair{refit::stage_kind::device, false}, std::pair{refit::stage_kind::device, true},
        std::pair{refit::stage_kind::host, false}}) {
    INFO("stage = " << refit::to_string(kind) << (force_staged ? ", direct writes off" : ""));
    const path want = kind == refit::stage_kind::device && !force_staged ? path::direct : path::staged;
    const auto ep = rt::temp_endpoint();
    two_processes(
        [&](rt::signal_pipe& ready) {
          device_tensors weights(metas, 0);
          weights.upload(0);
          auto o = receive_options(ep, 0, relaxed);
          o.stage = kind;
          refit::receiver r(o);
          weights.register_with(r);
          refit::cuda::stream engine_stream(cudaStreamNonBlocking);
          const refit::memory_usage before = refit::memory_in_use();
          ready.send("ready");
          std::size_t next = 0;
          for (;;) {
            const auto e = r.serve_one(100ms);
            if (e == refit::receiver_event::bye) break;
            if (e == refit::receiver_event::aborted || e == refit::receiver_event::refused)
              throw std::runtime_error("receiver: " + std::string(refit::to_string(e)) + ": " + r.last_error());
            if (e != refit::receiver_event::prepared) continue;
            // README.md "Memory": a stage is the table's bytes (device, or page-locked for a host
            // stage over cuda_ipc), plus the 8 MiB a kind that every mode may take for itself.
            const refit::memory_usage held = refit::memory_in_use();
            const std::uint64_t staged =
                kind == refit::stage_kind::device ? held.device_peak - before.device : held.pinned_peak - before.pinned;
            std::uint64_t table = 0;
            for (const auto& m : metas) table += m.nbytes();
            expect(staged >= table && staged <= weights.total() + 8 * mib,
                   "the stage holds " + std::to_string(staged) + " bytes for a table of " + std::to_string(table));
            expect(next < versions.size() && r.prepared_version() == versions[next], "prepared an unexpected version");
            const std::uint64_t before = next == 0 ? 0 : versions[next - 1];
            const auto untouched = weights.mismatch(before);
            expect(untouched.empty(), "the weights changed before apply_prepared(): " + untouched);
            expect(!r.dirty(), "a staged receiver is dirty before its apply");
            // Odd versions on the receiver's own stream (waited for), even ones on the engine's (not).
            void* stream = versions[next] % 2 == 0 ? static_cast<void*>(engine_stream.handle()) : nullptr;
            expect(r.apply_prepared(stream) == versions[next], "apply_prepared() applied another version");
            if (stream != nullptr)
              refit::check_cuda(cudaStreamSynchronize(engine_stream.handle()), "the engine's stream");
            const auto m = weights.mismatch(versions[next]);
            expect(m.empty(), "after apply_prepared(): " + m);
            expect(r.committed_version() == versions[next], "committed_version() after the apply");
            expect(r.last_stats().pause_seconds > 0, "no pause measured");
            ++next;
          }
          expect(next == versions.size(), std::to_string(next) + " versions applied");
        },
        [&] { streamer_of(ep, metas, 0, versions, want, force_staged); });
  }
}

TEST_CASE("a staged cuda_ipc receiver reads a streamer's reallocated tensors afresh and lets go of the old memory",
          "[cuda_ipc][resources]") {
  // Each version's tensors are a new allocation (often at the freed one's address): the receiver
  // must map the new one, never read the old one through a mapping it kept, and unmap the old one
  // once a refit no longer reads it, so the streamer's freed memory returns to the driver.
  const auto metas = rt::mixed_model(40, 2 * buffer_bytes, 11);
  std::vector<std::uint64_t> versions;
  for (std::uint64_t v = 1; v <= 12; ++v) versions.push_back(v);
  const auto ep = rt::temp_endpoint();
  two_processes([&](rt::signal_pipe& ready) { table_receiver(ep, metas, 0, versions, ready); },
                [&] {
                  auto o = stream_options(ep, 0, relaxed);
                  o.direct = false;
                  refit::streamer s(o);
                  std::size_t free_at_3 = 0;
                  std::uint64_t arena = 0;
                  for (const std::uint64_t v : versions) {
                    {
                      device_tensors weights(metas, 0);
                      weights.upload(v);
                      const auto stats = s.refit(v, weights.refs());
                      expect(stats.shared_bytes == stats.bytes && stats.bytes > 0,
                             "version " + std::to_string(v) + ": " + std::to_string(stats.shared_bytes) + " of " +
                                 std::to_string(stats.bytes) + " bytes read in place");
                      arena = weights.total();
                    }  // freed here: the receiver still maps it until the next refit ends
                    std::size_t free_bytes = 0, total = 0;
                    refit::check_cuda(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
                    if (v == 3) free_at_3 = free_bytes;
                    if (v > 3)
                      expect(free_bytes + arena / 2 >= free_at_3,
                             "version " + std::to_string(v) + ": " + std::to_string((free_at_3 - free_bytes) >> 20) +
                                 " MiB less free device memory than after version 3 (arena " +
                                 std::to_string(arena >> 20) + " MiB): the receiver keeps freed allocations mapped");
                  }
                  s.close();
                });
}

/// A staged streamer whose tensors lie in VMM chunks exportable as descriptors (what torch's
/// expandable segments are), several tensors straddling chunk boundaries. From version `replace_from`
/// on, every chunk is replaced by a new physical allocation at the same addresses before the
/// version is written (an allocator that freed its chunks and grew again): the receiver must read
/// the new chunks, never the old ones through what it kept mapped, and let the old ones go.
void vmm_streamer(const std::string& endpoint, const std::vector<refit::tensor_meta>& metas,
                  const std::vector<std::uint64_t>& versions, bool lane, std::uint64_t replace_from) {
  const std::uint64_t chunk = refit::copy::vmm::granularity(0);
  const std::uint64_t need = device_tensors::bytes_for(metas);
  refit::copy::vmm::local_chunks memory((need + chunk - 1) / chunk, chunk, 0);
  expect(memory.bytes() / chunk >= 3, "the model spans fewer than three chunks");
  device_tensors weights(metas, 0, memory.data());
  auto o = stream_options(endpoint, 0, relaxed);
  o.direct = false;
  o.control_lane = lane;
  refit::streamer s(o);
  std::size_t free_before = 0;
  for (const std::uint64_t v : versions) {
    if (v >= replace_from)
      for (std::size_t k = 0; k < memory.bytes() / chunk; ++k) memory.replace(k);
    weights.upload(v);
    const auto stats = s.refit(v, weights.refs());
    const std::uint64_t shared = lane ? stats.bytes : 0;
    expect(stats.shared_bytes == shared && stats.bytes > 0,
           "version " + std::to_string(v) + ": " + std::to_string(stats.shared_bytes) + " of " +
               std::to_string(stats.bytes) + " bytes read in place, expected " + std::to_string(shared));
    std::size_t free_bytes = 0, total = 0;
    refit::check_cuda(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
    if (v == replace_from) free_before = free_bytes;
    // Each replacement frees memory.bytes(); the receiver may hold the last refit's chunks only.
    if (v > replace_from)
      expect(free_bytes + memory.bytes() + memory.bytes() / 2 >= free_before,
             "version " + std::to_string(v) + ": " + std::to_string((free_before - free_bytes) >> 20) +
                 " MiB less free device memory than at version " + std::to_string(replace_from) +
                 ": the receiver keeps replaced VMM chunks mapped");
  }
  s.close();
}

TEST_CASE("a staged cuda_ipc receiver reads a streamer's VMM tensors in place across chunks, and their replacements",
          "[cuda_ipc][vmm]") {
  // Tensors of up to 64 KiB and one of 5 MiB over 2 MiB chunks: several straddle a boundary.
  const auto metas = rt::mixed_model(60, 5 * mib, 23);
  std::vector<std::uint64_t> versions;
  for (std::uint64_t v = 1; v <= 9; ++v) versions.push_back(v);
  const auto ep = rt::temp_endpoint();
  two_processes([&](rt::signal_pipe& ready) { table_receiver(ep, metas, 0, versions, ready); },
                [&] { vmm_streamer(ep, metas, versions, true, 4); });
}

TEST_CASE("without a control lane a streamer's VMM tensors go through the cuda_ipc buffers, bit-exact",
          "[cuda_ipc][vmm]") {
  const auto metas = rt::mixed_model(30, 5 * mib, 29);
  const std::vector<std::uint64_t> versions = {1, 2, 3};
  const auto ep = rt::temp_endpoint();
  two_processes([&](rt::signal_pipe& ready) { callback_receiver(ep, metas, 0, versions, ready); },
                [&] { vmm_streamer(ep, metas, versions, false, 2); });
}

TEST_CASE(
    "a direct cuda_ipc streamer writes a receiver's VMM weights through descriptors, bit-exact, or stages "
    "without a lane",
    "[cuda_ipc][vmm]") {
  const auto metas = rt::mixed_model(60, 5 * mib, 31);
  const std::vector<std::uint64_t> versions = {1, 2, 3};
  for (const bool lane : {true, false}) {
    INFO("streamer control lane: " << lane);
    const auto ep = rt::temp_endpoint();
    two_processes([&](rt::signal_pipe& ready) { table_receiver(ep, metas, 0, versions, ready, true); },
                  [&] {
                    device_tensors weights(metas, 0);
                    auto o = stream_options(ep, 0, relaxed);
                    o.control_lane = lane;
                    refit::streamer s(o);
                    for (const auto v : versions) {
                      weights.upload(v);
                      const auto stats = s.refit(v, weights.refs());
                      expect(stats.direct == lane,
                             "version " + std::to_string(v) + " went " + (stats.direct ? "direct" : "staged"));
                    }
                    s.close();
                  });
  }
}

// ------------------------------------------------------------------------ engine layouts

/// An engine's own layout of a small model, in one device allocation: fused qkv (GQA: q 64 rows, k
/// and v 16), a row-parallel shard (columns 32..63 of o), tied embeddings (emb into two tensors) and
/// a strided view (w into columns 6..25 of a [64, 40] tensor; left out with `strided` false: every
/// other destination is one dense range). u16 stands for bf16.
struct engine_layout {
  static constexpr std::int64_t h = 32;
  explicit engine_layout(bool with_strided = true) : strided(with_strided) {
    if (!strided) sources.pop_back();
  }
  bool strided;
  std::vector<refit::tensor_meta> sources{{"q", refit::dtype::u16, {64, h}},   {"k", refit::dtype::u16, {16, h}},
                                          {"v", refit::dtype::u16, {16, h}},   {"o", refit::dtype::u16, {h, 64}},
                                          {"emb", refit::dtype::u16, {40, h}}, {"w", refit::dtype::u16, {64, 20}}};
  // Element offsets in the engine allocation: qkv [96, h], o_local [h, h], emb, head [40, h], big [64, 40].
  static constexpr std::int64_t qkv = 0, o_local = 96 * h, emb = o_local + h * h, head = emb + 40 * h,
                                big = head + 40 * h, total = big + 64 * 40;

  /// Registers every destination of the layout, the engine's memory starting at `base`.
  void register_with(refit::receiver& r, std::uint16_t* base, std::uint64_t bytes, int device = 0) const {
    const auto add = [&](const refit::tensor_meta& m, std::int64_t at, refit::dest_layout l) {
      l.alloc = base;
      l.alloc_bytes = bytes;
      r.add_parameter(refit::tensor_dest{m, base + at, refit::device::cuda(device)}, l);
    };
    add(sources[0], qkv, {});
    add(sources[1], qkv + 64 * h, {});
    add(sources[2], qkv + 80 * h, {});
    refit::dest_layout shard;
    shard.slice = refit::source_slice{1, 32, 32};
    add(refit::tensor_meta{"o", refit::dtype::u16, {h, 32}}, o_local, shard);
    add(sources[4], emb, {});
    add(sources[4], head, {});
    if (!strided) return;
    refit::dest_layout view;
    view.strides = {40, 1};
    add(sources[5], big + 6, view);
  }

  /// The engine allocation as it must be after a refit of `version` (zeros where nothing lands).
  [[nodiscard]] std::vector<std::uint16_t> image(std::uint64_t version) const {
    std::vector<std::uint16_t> out(total, 0);
    const auto src = [&](std::size_t i) {
      std::vector<std::uint16_t> v(static_cast<std::size_t>(sources[i].numel()));
      rt::fill_pattern(sources[i].name, version, reinterpret_cast<std::uint8_t*>(v.data()), sources[i].nbytes());
      return v;
    };
    const auto q = src(0), k = src(1), v = src(2), o = src(3), e = src(4);
    std::copy(q.begin(), q.end(), out.begin() + qkv);
    std::copy(k.begin(), k.end(), out.begin() + qkv + 64 * h);
    std::copy(v.begin(), v.end(), out.begin() + qkv + 80 * h);
    for (std::int64_t r = 0; r < h; ++r)
      for (std::int64_t c = 0; c < 32; ++c) out[o_local + r * 32 + c] = o[r * 64 + 32 + c];
    std::copy(e.begin(), e.end(), out.begin() + emb);
    std::copy(e.begin(), e.end(), out.begin() + head);
    if (!strided) return out;
    const auto w = src(5);
    for (std::int64_t r = 0; r < 64; ++r)
      for (std::int64_t c = 0; c < 20; ++c) out[big + r * 40 + 6 + c] = w[r * 20 + c];
    return out;
  }
};

/// `transport` nccl: the receiver on cuda:1. In place (`direct`), the streamer sends it only its
/// parts of each tensor (o's columns gathered first, emb twice): into its views where they are one
/// range of them, and the strided view's rows into the receiver's scatter memory, copied into place
/// from there. Buffered, views and slices are staged there (a broadcast of each whole tensor, then
/// the receiver's own copies into its views).
void engine_layout_refits(bool direct, refit::transport_kind transport = refit::transport_kind::cuda_ipc,
                          bool share = true, bool strided = true) {
  const bool nccl = transport == refit::transport_kind::nccl;
  const int rx_device = nccl ? rt::gpu_of(1) : 0;
  const engine_layout layout(strided);
  const auto ep = rt::temp_endpoint();
  const std::vector<std::uint64_t> versions = {1, 2, 3};
  two_processes(
      [&](rt::signal_pipe& ready) {
        refit::check_cuda(cudaSetDevice(rx_device), "cudaSetDevice");
        const std::uint64_t bytes = engine_layout::total * 2;
        refit::cuda::device_buffer engine(bytes);
        refit::check_cuda(cudaMemset(engine.handle(), 0, bytes), "cudaMemset(engine)");
        refit::receiver r(receive_options(ep, rx_device, relaxed));
        layout.register_with(r, static_cast<std::uint16_t*>(engine.handle()), bytes, rx_device);
        ready.send("ready");
        std::size_t commits = 0;
        serve_until_bye(r, [&](std::uint64_t v) {
          expect(v == versions[commits], "committed version " + std::to_string(v));
          std::vector<std::uint16_t> got(engine_layout::total);
          refit::check_cuda(cudaMemcpy(got.data(), engine.handle(), bytes, cudaMemcpyDeviceToHost), "download");
          const auto want = layout.image(v);
          const auto [w, g] = std::mismatch(want.begin(), want.end(), got.begin());
          expect(w == want.end(),
                 "version " + std::to_string(v) + ": engine element " + std::to_string(w - want.begin()) + " differs");
          ++commits;
        });
        expect(commits == versions.size(), std::to_string(commits) + " commits");
      },
      [&] {
        device_tensors source(layout.sources, 0);
        auto o = stream_options(ep, 0, relaxed);
        o.transport = transport;
        o.direct = direct;
        o.share_tensors = share;
        o.buffer_bytes = 4 * kib;  // staged: rows of the shard and the strided view split across chunks
        refit::streamer s(o);
        for (const std::uint64_t v : versions) {
          source.upload(v);
          const auto stats = s.refit(v, source.refs());
          std::uint64_t total = 0;
          for (const auto& m : layout.sources) total += m.nbytes();
          const bool parts = nccl && direct;
          expect(stats.direct == direct,
                 direct ? "the refit was staged, not direct (in place)" : "the refit was direct");
          // In parts: every tensor once but o, whose half the receiver takes (its columns 32..63),
          // and emb a second time (tied: two destinations).
          const std::uint64_t want = parts ? total - layout.sources[3].nbytes() / 2 + layout.sources[4].nbytes() : 0;
          expect(stats.parts_bytes == want,
                 "parts_bytes " + std::to_string(stats.parts_bytes) + ", not " + std::to_string(want));
        }
        s.close();
      });
}

TEST_CASE(
    "an engine layout (fused GQA qkv, a row-parallel shard, tied embeddings, a strided view) is written "
    "directly over cuda_ipc, bit-exact over three versions",
    "[cuda_ipc][layout]") {
  engine_layout_refits(true);
}

TEST_CASE("the same engine layout staged through 4 KiB cuda_ipc buffers (rows split across chunks) lands bit-exact",
          "[cuda_ipc][layout]") {
  engine_layout_refits(false, refit::transport_kind::cuda_ipc, false);
  // Read where the tensors are: whole, each view applied from the streamer's memory.
  engine_layout_refits(false, refit::transport_kind::cuda_ipc, true);
}

TEST_CASE("the same engine layout over nccl to a receiver on cuda:1, in-place asked and not, lands bit-exact",
          "[nccl][layout]") {
  if (!rt::nccl_ranks(2)) {
    WARN("no nccl or no GPU: the nccl engine-layout test did not run");
    return;
  }
  // In place: only its parts sent, the strided view's through the receiver's scatter memory.
  engine_layout_refits(true, refit::transport_kind::nccl);
  engine_layout_refits(false, refit::transport_kind::nccl);
  // Without the strided view every part lands straight in its destination.
  engine_layout_refits(true, refit::transport_kind::nccl, true, false);
  engine_layout_refits(false, refit::transport_kind::nccl, true, false);
}

/// Tensor parallelism of degree 2 on one host: rank r holds half of q's and k's rows (its local
/// fused qk), half of o's columns (row-parallel: strided in the source), half of emb's rows
/// (vocab-parallel) and all of the 1-D norm.
struct tp_layout {
  std::vector<refit::tensor_meta> sources{{"q", refit::dtype::u16, {64, 32}},
                                          {"k", refit::dtype::u16, {16, 32}},
                                          {"o", refit::dtype::u16, {32, 64}},
                                          {"emb", refit::dtype::u16, {40, 32}},
                                          {"norm", refit::dtype::u16, {32}}};
  // Elements of rank r's engine allocation: qk [40, 32], o_local [32, 32], emb_local [20, 32], norm [32].
  static constexpr std::int64_t qk = 0, o_local = 40 * 32, emb = o_local + 32 * 32, norm = emb + 20 * 32,
                                total = norm + 32;

  void register_with(refit::receiver& r, int rank, std::uint16_t* base, std::uint64_t bytes, int device) const {
    const auto add = [&](const char* name, std::vector<std::int64_t> shape, std::int64_t at,
                         std::optional<refit::source_slice> slice) {
      refit::dest_layout l;
      l.slice = slice;
      l.alloc = base;
      l.alloc_bytes = bytes;
      r.add_parameter(
          refit::tensor_dest{{name, refit::dtype::u16, std::move(shape)}, base + at, refit::device::cuda(device)}, l);
    };
    add("q", {32, 32}, qk, refit::source_slice{0, 32 * rank, 32});
    add("k", {8, 32}, qk + 32 * 32, refit::source_slice{0, 8 * rank, 8});
    add("o", {32, 32}, o_local, refit::source_slice{1, 32 * rank, 32});
    add("emb", {20, 32}, emb, refit::source_slice{0, 20 * rank, 20});
    add("norm", {32}, norm, std::nullopt);
  }

  [[nodiscard]] std::vector<std::uint16_t> image(int rank, std::uint64_t version) const {
    std::vector<std::uint16_t> out(total, 0);
    const auto src = [&](std::size_t i) {
      std::vector<std::uint16_t> v(static_cast<std::size_t>(sources[i].numel()));
      rt::fill_pattern(sources[i].name, version, reinterpret_cast<std::uint8_t*>(v.data()), sources[i].nbytes());
      return v;
    };
    const auto q = src(0), k = src(1), o = src(2), e = src(3), n = src(4);
    std::copy_n(q.begin() + 32 * 32 * rank, 32 * 32, out.begin() + qk);
    std::copy_n(k.begin() + 8 * 32 * rank, 8 * 32, out.begin() + qk + 32 * 32);
    for (std::int64_t row = 0; row < 32; ++row)
      for (std::int64_t c = 0; c < 32; ++c) out[o_local + row * 32 + c] = o[row * 64 + 32 * rank + c];
    std::copy_n(e.begin() + 20 * 32 * rank, 20 * 32, out.begin() + emb);
    std::copy(n.begin(), n.end(), out.begin() + norm);
    return out;
  }
};

/// Receiver child: TP rank `rank` of `layout` on `device` (its engine memory a VMM chunk with `vmm`),
/// checking its engine memory against the layout's image at every commit of `versions`.
void tp_rank_receiver(const tp_layout& layout, int rank, int device, const std::string& endpoint,
                      const std::vector<std::uint64_t>& versions, rt::signal_pipe& ready, bool vmm = false) {
  refit::check_cuda(cudaSetDevice(device), "cudaSetDevice");
  const std::uint64_t bytes = tp_layout::total * 2;
  refit::cuda::device_buffer plain;
  std::optional<refit::copy::vmm::local_chunks> chunks;
  if (vmm)
    chunks.emplace(1, refit::copy::vmm::granularity(device), device);
  else
    plain = refit::cuda::device_buffer(bytes);
  void* const engine = vmm ? static_cast<void*>(chunks->data()) : plain.handle();
  refit::check_cuda(cudaMemset(engine, 0, bytes), "cudaMemset(engine)");
  refit::receiver r(receive_options(endpoint, device, relaxed));
  layout.register_with(r, rank, static_cast<std::uint16_t*>(engine), bytes, device);
  ready.send("ready");
  std::size_t commits = 0;
  serve_until_bye(r, [&](std::uint64_t v) {
    std::vector<std::uint16_t> got(tp_layout::total);
    refit::check_cuda(cudaMemcpy(got.data(), engine, bytes, cudaMemcpyDeviceToHost), "download");
    const auto want = layout.image(rank, v);
    const auto [w, g] = std::mismatch(want.begin(), want.end(), got.begin());
    expect(w == want.end(), "rank " + std::to_string(rank) + " version " + std::to_string(v) + ": element " +
                                std::to_string(w - want.begin()) + " differs");
    ++commits;
  });
  expect(commits == versions.size(), "rank " + std::to_string(rank) + ": " + std::to_string(commits) + " commits");
}

/// `vmm`: each rank's engine memory is a VMM chunk exportable as a descriptor (an engine under
/// expandable segments), written through the descriptors its lane passes. `nccl`: the streamer
/// sends each rank only its parts, in place (rank 0 on gpu_of(1), rank 1 on `second_device`, a
/// third receiver on gpu_of(3)). `replica` (nccl): a third receiver, a second replica of TP rank 0,
/// takes what the first does: o's columns are gathered once and sent to both.
void tp_refits(int second_device, bool vmm = false, bool nccl = false, bool replica = false) {
  const tp_layout layout;
  std::vector<std::string> eps = {rt::temp_endpoint(), rt::temp_endpoint()};
  if (replica) eps.push_back(rt::temp_endpoint());
  const std::vector<std::uint64_t> versions = {1, 2, 3};
  rt::signal_pipe ready0, ready1, ready2;
  rt::child rx0([&] { tp_rank_receiver(layout, 0, nccl ? rt::gpu_of(1) : 0, eps[0], versions, ready0, vmm); });
  REQUIRE(ready0.receive(60s) == "ready");
  rt::child rx1([&] { tp_rank_receiver(layout, 1, second_device, eps[1], versions, ready1, vmm); });
  REQUIRE(ready1.receive(60s) == "ready");
  std::optional<rt::child> rx2;
  if (replica) {
    rx2.emplace([&] { tp_rank_receiver(layout, 0, rt::gpu_of(3), eps[2], versions, ready2, vmm); });
    REQUIRE(ready2.receive(60s) == "ready");
  }
  rt::child tx([&] {
    device_tensors source(layout.sources, 0);
    auto o = stream_options(eps[0], 0, relaxed);
    o.receivers = eps;
    if (nccl) o.transport = refit::transport_kind::nccl;
    refit::streamer s(o);
    std::uint64_t total = 0, half = 0;  // half: what rank 0 takes of every sharded tensor
    for (const auto& m : layout.sources) total += m.nbytes();
    for (std::size_t i = 0; i + 1 < layout.sources.size(); ++i) half += layout.sources[i].nbytes() / 2;
    for (const std::uint64_t v : versions) {
      source.upload(v);
      const auto stats = s.refit(v, source.refs());
      expect(stats.direct, "the refit to the ranks was not direct");
      // Each rank its halves, both the whole norm: every byte once, the norm twice; the replica
      // rank 0's halves and the norm again.
      const std::uint64_t norm = layout.sources[4].nbytes();
      const std::uint64_t want = !nccl ? 0 : total + norm + (replica ? half + norm : 0);
      expect(stats.parts_bytes == want,
             "parts_bytes " + std::to_string(stats.parts_bytes) + ", not " + std::to_string(want));
    }
    s.close();
  });
  CHECK(tx.wait(120s) == 0);
  CHECK(rx0.wait(60s) == 0);
  CHECK(rx1.wait(60s) == 0);
  if (rx2) CHECK(rx2->wait(60s) == 0);
}

TEST_CASE("one cuda_ipc streamer writes two TP ranks on one GPU directly, each only its shards, bit-exact",
          "[cuda_ipc][layout][tp]") {
  tp_refits(0);
}

TEST_CASE(
    "one nccl streamer sends two TP ranks only their shards (row, column and vocab slices, a replicated norm), "
    "received in place, bit-exact",
    "[nccl][layout][tp]") {
  if (!rt::nccl_ranks(3)) {
    WARN("no nccl or no GPU: the nccl TP test did not run");
    return;
  }
  tp_refits(rt::gpu_of(2), false, true);
}

TEST_CASE(
    "one nccl streamer sends two replicas of TP rank 0 and one of rank 1 their shards in place; a column slice two "
    "receivers take alike is gathered once and lands bit-exact in both",
    "[nccl][layout][tp]") {
  if (!rt::nccl_ranks(4)) {
    WARN("no nccl or no GPU: the nccl TP replica test did not run");
    return;
  }
  tp_refits(rt::gpu_of(2), false, true, true);
}

TEST_CASE(
    "an nccl streamer in place to a receiver of a plain table and one of views starts over buffered, and both "
    "commit bit-exact",
    "[nccl][layout][tp]") {
  if (!rt::nccl_ranks(3)) {
    WARN("no nccl or no GPU: the nccl mixed-table test did not run");
    return;
  }
  const tp_layout layout;
  const std::vector<std::string> eps = {rt::temp_endpoint(), rt::temp_endpoint()};
  const std::vector<std::uint64_t> versions = {1, 2};
  rt::signal_pipe ready0, ready1;
  rt::child whole([&] { table_receiver(eps[0], layout.sources, rt::gpu_of(1), versions, ready0); });
  REQUIRE(ready0.receive(60s) == "ready");
  rt::child rank1([&] { tp_rank_receiver(layout, 1, rt::gpu_of(2), eps[1], versions, ready1); });
  REQUIRE(ready1.receive(60s) == "ready");
  rt::child tx([&] {
    device_tensors source(layout.sources, 0);
    auto o = stream_options(eps[0], 0, relaxed);
    o.receivers = eps;
    o.transport = refit::transport_kind::nccl;
    refit::streamer s(o);  // direct (in place) asked
    for (const std::uint64_t v : versions) {
      source.upload(v);
      const auto stats = s.refit(v, source.refs());
      // A broadcast serves the plain table, point-to-point sends the views: not both at once.
      expect(!stats.direct && stats.parts_bytes == 0, "the mixed session was not buffered");
    }
    s.close();
  });
  CHECK(tx.wait(120s) == 0);
  CHECK(whole.wait(60s) == 0);
  CHECK(rank1.wait(60s) == 0);
}

TEST_CASE("one cuda_ipc streamer writes two TP ranks' VMM engine memory on one GPU directly, through each lane",
          "[cuda_ipc][layout][tp][vmm]") {
  tp_refits(0, true);
}

TEST_CASE("one cuda_ipc streamer on cuda:0 writes TP rank 1 on cuda:1 directly over peer access, bit-exact",
          "[cuda_ipc][layout][tp]") {
  if (rt::cuda_device_count() < 2) {
    WARN("one CUDA device: the two-GPU TP test did not run");
    return;
  }
  tp_refits(1);
}

/// Receiver child: TP rank `rank` of `layout` on `device`, its engine memory zeros at first, staged
/// on the device (receiver_options::stage), serving until BYE. Reports each version it prepared
/// ("prepared V, weights W": W "ok" while its engine memory still holds the version it applied before,
/// and "dirty" if it says so), then applies it on its own stream ("applied V ok", or where it differs);
/// an aborted version as "aborted, weights W". With `block_in`, it stops at its first BATCH of that
/// version, reports "blocked" and waits to be killed.
void staged_tp_rank(const tp_layout& layout, int rank, int device, const std::string& endpoint,
                    refit::milliseconds idle, rt::signal_pipe& reports, std::optional<std::uint64_t> block_in = {}) {
  refit::check_cuda(cudaSetDevice(device), "cudaSetDevice");
  const std::uint64_t bytes = tp_layout::total * 2;
  refit::cuda::device_buffer engine(bytes);
  refit::check_cuda(cudaMemset(engine.handle(), 0, bytes), "cudaMemset(engine)");
  auto o = receive_options(endpoint, device, idle);
  o.stage = refit::stage_kind::device;
  refit::receiver r(o);
  layout.register_with(r, rank, static_cast<std::uint16_t*>(engine.handle()), bytes, device);
  std::uint64_t in = 0;  // the version of the last BEGIN
  r.on_begin([&](std::uint64_t v) { in = v; });
  std::uint64_t applied = 0;
  const auto holds = [&](std::uint64_t v) {
    std::vector<std::uint16_t> got(tp_layout::total);
    refit::check_cuda(cudaMemcpy(got.data(), engine.handle(), bytes, cudaMemcpyDeviceToHost), "download");
    const auto want = v == 0 ? std::vector<std::uint16_t>(tp_layout::total, 0) : layout.image(rank, v);
    const auto [w, g] = std::mismatch(want.begin(), want.end(), got.begin());
    return (w == want.end() ? std::string("ok") : "differ at element " + std::to_string(w - want.begin())) +
           (r.dirty() ? " dirty" : "");
  };
  reports.send("ready");
  for (;;) {
    switch (r.serve_one(100ms)) {
      case refit::receiver_event::bye: return;
      case refit::receiver_event::batch:
        if (block_in && in == *block_in) {
          reports.send("blocked");
          block_forever();
        }
        break;
      case refit::receiver_event::prepared: {
        const std::uint64_t v = r.prepared_version().value_or(0);
        reports.send("prepared " + std::to_string(v) + ", weights " + holds(applied));
        expect(r.apply_prepared() == v, "apply_prepared() applied another version");
        applied = v;
        reports.send("applied " + std::to_string(v) + " " + holds(v));
        break;
      }
      case refit::receiver_event::aborted: reports.send("aborted, weights " + holds(applied)); break;
      case refit::receiver_event::refused: throw std::runtime_error("receiver refused: " + r.last_error());
      default: break;
    }
  }
}

/// The GPU of TP rank 1 in the staged TP tests: cuda:1 where there is one, so that the ranks' stages
/// are written across GPUs; cuda:0 otherwise.
int second_rank_gpu() { return rt::cuda_device_count() >= 2 ? 1 : 0; }

/// One streamer on cuda:0 and two device-staged TP ranks, engine-wide, versions 1 to 3: cuda_ipc writes
/// each rank's stage directly (rank 1 on cuda:1 where there is one), nccl sends each rank only its
/// parts, received into its stage in place (ranks on gpu_of(1), gpu_of(2)). Each rank must report
/// every version prepared with its weights untouched, then applied bit-exact.
void staged_tp_refits(bool nccl) {
  const tp_layout layout;
  const std::vector<std::string> eps = {rt::temp_endpoint(), rt::temp_endpoint()};
  const std::vector<std::uint64_t> versions = {1, 2, 3};
  rt::signal_pipe reports0, reports1;
  rt::child rx0([&] { staged_tp_rank(layout, 0, nccl ? rt::gpu_of(1) : 0, eps[0], relaxed, reports0); });
  REQUIRE(reports0.receive(60s) == "ready");
  rt::child rx1(
      [&] { staged_tp_rank(layout, 1, nccl ? rt::gpu_of(2) : second_rank_gpu(), eps[1], relaxed, reports1); });
  REQUIRE(reports1.receive(60s) == "ready");
  rt::child tx([&] {
    device_tensors source(layout.sources, 0);
    auto o = stream_options(eps[0], 0, relaxed);
    o.receivers = eps;
    if (nccl) o.transport = refit::transport_kind::nccl;
    o.atomic = true;
    refit::streamer s(o);
    std::uint64_t total = 0;
    for (const auto& m : layout.sources) total += m.nbytes();
    // nccl: each rank its halves, both the whole norm: every byte once, the norm twice.
    const std::uint64_t parts = nccl ? total + layout.sources[4].nbytes() : 0;
    for (const std::uint64_t v : versions) {
      source.upload(v);
      const auto stats = s.refit(v, source.refs());
      expect(stats.direct, "version " + std::to_string(v) + " was not written (received) straight into the stages");
      expect(stats.commit_seconds > 0, "no COMMIT round trip measured");
      expect(stats.parts_bytes == parts,
             "parts_bytes " + std::to_string(stats.parts_bytes) + ", not " + std::to_string(parts));
    }
    s.close();
  });
  for (const std::uint64_t v : versions)
    for (auto* reports : {&reports0, &reports1}) {
      CHECK(reports->receive(60s) == "prepared " + std::to_string(v) + ", weights ok");
      CHECK(reports->receive(60s) == "applied " + std::to_string(v) + " ok");
    }
  CHECK(tx.wait(120s) == 0);
  CHECK(rx0.wait(60s) == 0);
  CHECK(rx1.wait(60s) == 0);
}

TEST_CASE(
    "one cuda_ipc streamer writes two device-staged TP ranks' stages directly, engine-wide: each rank's weights "
    "stay untouched until it applies, then hold its shards bit-exact",
    "[cuda_ipc][layout][tp][stage]") {
  staged_tp_refits(false);
}

TEST_CASE(
    "one nccl streamer sends two device-staged TP ranks only their parts, received into their stages in place, "
    "engine-wide: each rank's weights stay untouched until it applies, then hold its shards bit-exact",
    "[nccl][layout][tp][stage]") {
  if (!rt::nccl_ranks(3)) {
    WARN("no nccl or no GPU: the nccl staged TP test did not run");
    return;
  }
  staged_tp_refits(true);
}

TEST_CASE(
    "a device-staged TP rank killed in the middle of an engine-wide cuda_ipc version leaves the other rank's "
    "weights on the old version, clean; a new rank and the survivor take the next version together",
    "[cuda_ipc][layout][tp][stage][faults]") {
  const tp_layout layout;
  const std::vector<std::string> eps = {rt::temp_endpoint(), rt::temp_endpoint()};
  rt::signal_pipe reports0, reports1;
  // The survivor's idle timeout is long: the streamer's ABORT, not its own deadline, ends version 2.
  rt::child survivor([&] { staged_tp_rank(layout, 0, 0, eps[0], relaxed, reports0); });
  REQUIRE(reports0.receive(60s) == "ready");
  auto victim = std::make_unique<rt::child>(
      [&] { staged_tp_rank(layout, 1, second_rank_gpu(), eps[1], fault_timeout, reports1, 2); });
  REQUIRE(reports1.receive(60s) == "ready");
  rt::signal_pipe outcome, go;
  rt::child tx([&] {
    device_tensors source(layout.sources, 0);
    auto o = stream_options(eps[0], 0, fault_timeout);
    o.receivers = eps;
    o.atomic = true;
    refit::streamer s(o);
    source.upload(1);
    expect(s.refit(1, source.refs()).direct, "version 1 was not written directly into the stages");
    source.upload(2);
    std::string line = "committed";
    try {
      s.refit(2, source.refs());
    } catch (const refit::error& e) {
      line = rt::code_name(e.code()) + ": " + e.what();
    }
    outcome.send(line);
    expect(go.receive(60s) == "go", "no go");
    source.upload(3);
    expect(s.refit(3, source.refs()).direct, "version 3 was not written directly into the stages");
    s.close();
  });
  for (auto* reports : {&reports0, &reports1}) {
    REQUIRE(reports->receive(60s) == "prepared 1, weights ok");
    REQUIRE(reports->receive(60s) == "applied 1 ok");
  }
  REQUIRE(reports1.receive(60s) == "blocked");
  victim->kill();
  const std::string line = outcome.receive(60s);
  INFO("the streamer's version 2: " << line);
  CHECK((line.starts_with("timeout: ") || line.starts_with("peer: ")));
  CHECK(line.find(eps[1]) != std::string::npos);
  // Part of version 2 may be in the survivor's stage; its weights are version 1's, bit for bit, clean.
  CHECK(reports0.receive(60s) == "aborted, weights ok");

  // A new rank 1 (its weights zeros) on the dead one's endpoint: version 3 reaches both.
  victim =
      std::make_unique<rt::child>([&] { staged_tp_rank(layout, 1, second_rank_gpu(), eps[1], relaxed, reports1); });
  REQUIRE(reports1.receive(60s) == "ready");
  go.send("go");
  CHECK(reports0.receive(60s) == "prepared 3, weights ok");  // still version 1's until it applies
  CHECK(reports0.receive(60s) == "applied 3 ok");
  CHECK(reports1.receive(60s) == "prepared 3, weights ok");  // its zeros
  CHECK(reports1.receive(60s) == "applied 3 ok");
  CHECK(tx.wait(120s) == 0);
  CHECK(survivor.wait(60s) == 0);
  CHECK(victim->wait(60s) == 0);
}

TEST_CASE("a cuda_ipc streamer with two receivers refuses to stage: one with a callback sink fails the HELLO",
          "[cuda_ipc][tp]") {
  const std::vector<std::string> eps = {rt::temp_endpoint(), rt::temp_endpoint()};
  const tp_layout layout;
  rt::signal_pipe ready0, ready1, stop0, stop1;  // the receivers serve until told to stop (no BYE comes)
  rt::child rx0([&] {
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
    refit::cuda::device_buffer engine(tp_layout::total * 2);
    refit::receiver r(receive_options(eps[0], 0, relaxed));
    layout.register_with(r, 0, static_cast<std::uint16_t*>(engine.handle()), tp_layout::total * 2, 0);
    ready0.send("ready");
    while (!stop0.try_receive(0ms)) r.serve_one(20ms);
    expect(!r.committed_version().has_value(), "rank 0 committed");
  });
  REQUIRE(ready0.receive(60s) == "ready");
  rt::child rx1([&] {
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
    refit::receiver r(receive_options(eps[1], 0, relaxed));
    r.on_batch([](std::span<const refit::tensor_view>, void*) {});
    ready1.send("ready");
    while (!stop1.try_receive(0ms)) r.serve_one(20ms);
    expect(!r.committed_version().has_value(), "rank 1 committed");
  });
  REQUIRE(ready1.receive(60s) == "ready");
  rt::child tx([&] {
    device_tensors source(layout.sources, 0);
    source.upload(1);
    auto o = stream_options(eps[0], 0, relaxed);
    o.receivers = eps;
    refit::streamer s(o);
    try {
      s.refit(1, source.refs());
      expect(false, "a refit staged to two cuda_ipc receivers succeeded");
    } catch (const refit::error& e) {
      expect(e.code() == refit::errc::invalid_argument, "error code " + std::string(refit::to_string(e.code())));
      expect(std::string(e.what()).find("receiver 1 of 2 did not offer") != std::string::npos,
             std::string("message: ") + e.what());
    }
    s.close();
  });
  CHECK(tx.wait(120s) == 0);
  stop0.send("stop");
  stop1.send("stop");
  CHECK(rx0.wait(60s) == 0);
  CHECK(rx1.wait(60s) == 0);
}

TEST_CASE(
    "the allocation check works on a thread that made no CUDA call (a Python engine's serving thread): it finds "
    "the allocation and its id, and nothing once it is freed",
    "[cuda_ipc][layout]") {
  rt::child check([] {  // the parent never touches CUDA: its children fork from it
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
    auto buffer = std::make_unique<refit::cuda::device_buffer>(1 << 20);
    auto* inside = static_cast<std::byte*>(buffer->handle()) + 4096;
    const auto ask = [&] {
      std::optional<refit::copy::allocation> found;
      std::uint64_t id = 0;
      std::string failed;
      std::thread fresh([&] {  // no runtime call before: cudaGetDevice() says 0, and no context is current
        try {
          found = refit::copy::cuda_allocation_of(inside, 0);
          id = refit::copy::cuda_allocation_id(inside, 0);
        } catch (const std::exception& e) {
          failed = e.what();
        }
      });
      fresh.join();
      return std::tuple{found, id, failed};
    };
    const auto [found, id, failed] = ask();
    expect(failed.empty(), "failed: " + failed);
    expect(found.has_value() && found->base == reinterpret_cast<std::uintptr_t>(buffer->handle()) &&
               found->bytes >= (1u << 20),
           "the allocation was not found where it is");
    expect(id != 0 && found && found->id == id, "no allocation id, or another one");
    buffer.reset();
    const auto [gone, gone_id, gone_failed] = ask();
    expect(gone_failed.empty() && !gone.has_value(), "a freed allocation was found: " + gone_failed);
  });
  CHECK(check.wait(60s) == 0);
}

TEST_CASE(
    "a receiver whose registered CUDA memory was freed refuses the next HELLO naming the tensor; nothing is "
    "written or committed",
    "[cuda_ipc][layout]") {
  const auto ep = rt::temp_endpoint();
  const refit::tensor_meta w{"w", refit::dtype::u16, {64, 32}};
  rt::signal_pipe ready, stop;
  rt::child rx([&] {
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
    auto engine = std::make_unique<refit::cuda::device_buffer>(w.nbytes());
    refit::receiver r(receive_options(ep, 0, relaxed));
    r.add_parameter(refit::tensor_dest{w, engine->handle(), refit::device::cuda(0)});
    engine.reset();  // the engine reallocated its weights and did not register them again
    ready.send("ready");
    int refused = 0;
    while (!stop.try_receive(0ms))
      if (r.serve_one(20ms) == refit::receiver_event::refused) ++refused;
    expect(refused >= 1, "the HELLO was not refused");
    expect(!r.committed_version().has_value(), "a version was committed");
    expect(r.last_error().find("not allocated any more") != std::string::npos, "last_error: " + r.last_error());
  });
  REQUIRE(ready.receive(60s) == "ready");
  rt::child tx([&] {
    device_tensors source({w}, 0);
    source.upload(1);
    refit::streamer s(stream_options(ep, 0, relaxed));
    try {
      s.refit(1, source.refs());
      expect(false, "a refit into freed memory succeeded");
    } catch (const refit::error& e) {
      expect(e.code() == refit::errc::invalid_argument, "error code " + std::string(refit::to_string(e.code())));
      expect(std::string(e.what()).find("'w'") != std::string::npos &&
                 std::string(e.what()).find("not allocated any more") != std::string::npos,
             std::string("message: ") + e.what());
    }
  });
  CHECK(tx.wait(120s) == 0);
  stop.send("stop");
  CHECK(rx.wait(60s) == 0);
}

TEST_CASE("a direct cuda_ipc source that does not fit its view (slice past the end) fails before writing anything",
          "[cuda_ipc][layout]") {
  const auto ep = rt::temp_endpoint();
  const refit::tensor_meta o{"o", refit::dtype::u16, {32, 40}};  // the view takes columns 32..63: past the end
  two_processes(
      [&](rt::signal_pipe& ready) {
        refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
        refit::cuda::device_buffer engine(32 * 32 * 2);
        refit::check_cuda(cudaMemset(engine.handle(), 0x5a, 32 * 32 * 2), "cudaMemset(engine)");
        refit::receiver r(receive_options(ep, 0, relaxed));
        refit::dest_layout shard;
        shard.slice = refit::source_slice{1, 32, 32};
        r.add_parameter(refit::tensor_dest{{"o", refit::dtype::u16, {32, 32}}, engine.handle(), refit::device::cuda(0)},
                        shard);
        ready.send("ready");
        int aborts = 0;
        serve_until_bye(
            r, [](std::uint64_t v) { expect(false, "committed version " + std::to_string(v)); }, {}, [&] { ++aborts; });
        expect(aborts == 1, std::to_string(aborts) + " aborts reported");
        std::vector<std::uint8_t> got(32 * 32 * 2);
        refit::check_cuda(cudaMemcpy(got.data(), engine.handle(), got.size(), cudaMemcpyDeviceToHost), "download");
        expect(std::all_of(got.begin(), got.end(), [](std::uint8_t b) { return b == 0x5a; }),
               "a refused refit wrote into the engine's memory");
      },
      [&] {
        device_tensors source({o}, 0);
        source.upload(1);
        refit::streamer s(stream_options(ep, 0, relaxed));
        try {
          s.refit(1, source.refs());
          expect(false, "a refit whose slice is past the source's end succeeded");
        } catch (const refit::error& e) {
          expect(e.code() == refit::errc::apply, "error code " + std::string(refit::to_string(e.code())));
          expect(std::string(e.what()).find("tensor 'o'") != std::string::npos, std::string("message: ") + e.what());
        }
        s.close();
      });
}

TEST_CASE(
    "a cuda_ipc HELLO with a forged handle or a buffer larger than its memory is refused, and the next "
    "streamer refits bit-exact",
    "[cuda_ipc][hostile]") {
  const auto ep = rt::temp_endpoint();
  const refit::tensor_meta w{"w", refit::dtype::bf16, {4096}};
  two_processes(
      [&](rt::signal_pipe& ready) {
        refit::check_cuda(cudaSetDevice(0), "cudaSetDevice");
        device_tensors engine({w}, 0);
        refit::receiver r(receive_options(ep, 0, relaxed));
        engine.register_with(r);
        ready.send("ready");
        // Two HELLOs refused, then a whole session: serve until its BYE.
        int refused = 0;
        for (auto e = r.serve_one(60s); e != refit::receiver_event::bye; e = r.serve_one(60s)) {
          expect(e != refit::receiver_event::idle, "receiver: no message for 60 s");
          expect(e != refit::receiver_event::aborted, "receiver: aborted: " + r.last_error());
          if (e == refit::receiver_event::refused) ++refused;
        }
        expect(refused == 2, std::to_string(refused) + " HELLOs refused");
        expect(r.committed_version() == std::optional<std::uint64_t>(1), "no version 1 committed");
        expect(engine.mismatch(1).empty(), "weights after the refit: " + engine.mismatch(1));
      },
      [&] {
        refit::transport::source_options o;
        o.name = "cuda_ipc";
        o.bytes = 1 * mib;
        const auto src = refit::transport::make_source(o);
        refit::wire::hello h;
        src->open_session(h);
        refit::channel::req_channel ch(ep);
        const auto answer = [&](const refit::wire::hello& x) {
          const auto m = refit::wire::decode(ch.request(refit::wire::encode(x), relaxed, "HELLO"));
          const auto* e = std::get_if<refit::wire::error>(&m);
          return e == nullptr ? std::string("OK") : std::string(refit::to_string(e->code)) + ": " + e->message;
        };
        refit::wire::hello big = h;
        big.buffers[0].bytes = 64 * mib;  // its allocation has 1 MiB: reads past it would kill the context
        const std::string too_big = answer(big);
        expect(
            too_big.starts_with("transport: cuda_ipc HELLO buffer 0: announced as 67108864 bytes, but the memory its "
                                "handle maps has"),
            "oversized buffer: " + too_big);
        refit::wire::hello forged = h;
        forged.buffers[1].handle = std::string(forged.buffers[1].handle.size(), '\x5a');
        const std::string bad = answer(forged);
        expect(bad.starts_with("transport: cudaIpcOpenMemHandle(buffer 1 of"), "forged handle: " + bad);
        // The receiver is alive and clean: a real streamer's refit commits bit-exact.
        device_tensors source({w}, 0);
        source.upload(1);
        refit::streamer s(stream_options(ep, 0, relaxed));
        s.refit(1, source.refs());
        s.close();
      });
}

TEST_CASE("a direct cuda_ipc refit of a tensor the receiver lacks fails before writing anything", "[cuda_ipc]") {
  // The first tensor the streamer yields is not in the receiver's table: the streamer must refuse
  // it from the offer alone, so every byte of the receiver's weights keeps its old value. It tells
  // the receiver (ABORT), which reports the refit aborted at once.
  const auto metas = rt::mixed_model(50, 0);
  const std::vector<refit::tensor_meta> registered(metas.begin() + 1, metas.end());
  const auto ep = rt::temp_endpoint();
  two_processes(
      [&](rt::signal_pipe& ready) {
        device_tensors weights(registered, 0);
        weights.upload(7);
        refit::receiver r(receive_options(ep, 0, relaxed));
        weights.register_with(r);
        ready.send("ready");
        int aborts = 0;
        serve_until_bye(
            r, [](std::uint64_t v) { expect(false, "committed version " + std::to_string(v)); }, {},
            [&] {
              ++aborts;
              expect(r.last_error().find("aborted version 1 (apply)") != std::string::npos &&
                         r.last_error().find("not in the receiver's parameter table") != std::string::npos,
                     "last_error: " + r.last_error());
            });
        expect(aborts == 1, std::to_string(aborts) + " aborts reported, expected the streamer's one");
        expect(!r.committed_version().has_value(), "a version was committed");
        const auto m = weights.mismatch(7);
        expect(m.empty(), "a refused direct refit wrote into the weights: " + m);
      },
      [&] {
        device_tensors source(metas, 0);
        source.upload(1);
        refit::streamer s(stream_options(ep, 0, relaxed));
        const auto refs = source.refs();
        try {
          s.refit(1, refs);
          expect(false, "a refit with a tensor the receiver lacks succeeded");
        } catch (const refit::error& e) {
          expect(e.code() == refit::errc::apply, "error code " + std::string(refit::to_string(e.code())));
          expect(std::string(e.what()).find("not in the receiver's parameter table") != std::string::npos,
                 std::string("message: ") + e.what());
        }
        s.close();
      });
}

TEST_CASE(
    "a parameter table moved to new memory between two direct cuda_ipc refits gets the second one there, "
    "and its old memory keeps the first",
    "[cuda_ipc]") {
  // The session's direct offer was made from the first table: the receiver asks for a new
  // session at the next BEGIN (refused, errc::peer), the streamer says HELLO again by itself, and
  // maps the new weights. Nothing of version 2 may reach the memory the table no longer holds.
  const auto metas = rt::mixed_model(80, buffer_bytes + 5);
  const auto ep = rt::temp_endpoint();
  two_processes(
      [&](rt::signal_pipe& ready) {
        device_tensors first(metas, 0);
        device_tensors second(metas, 0);
        refit::receiver r(receive_options(ep, 0, relaxed));
        first.register_with(r);
        r.on_commit([&](std::uint64_t v) {
          if (v != 1) return;
          const auto m = first.mismatch(1);
          expect(m.empty(), "first table: " + m);
          r.clear_parameters();  // allowed from on_commit: between refits
          second.register_with(r);
        });
        ready.send("ready");
        std::vector<std::string> events;
        auto last = std::chrono::steady_clock::now();
        for (;;) {
          const auto e = r.serve_one(100ms);
          if (e == refit::receiver_event::idle) {
            expect(std::chrono::steady_clock::now() - last < 60s, "receiver: no message for 60 s");
            continue;
          }
          last = std::chrono::steady_clock::now();
          if (e == refit::receiver_event::batch) continue;
          events.emplace_back(refit::to_string(e));
          if (e == refit::receiver_event::aborted) throw std::runtime_error("receiver: aborted: " + r.last_error());
          if (e == refit::receiver_event::bye) break;
        }
        const std::vector<std::string> want = {"hello", "begin", "committed", "refused",
                                               "hello", "begin", "committed", "bye"};
        std::string got;
        for (const auto& e : events) got += e + " ";
        expect(events == want, "events: " + got);
        expect(r.committed_version() == std::optional<std::uint64_t>(2), "version 2 not committed");
        auto m = second.mismatch(2);
        expect(m.empty(), "second table: " + m);
        m = first.mismatch(1);
        expect(m.empty(), "the table's old memory was written after it was removed: " + m);
      },
      [&] {
        streamer_of(ep, metas, 0, {1, 2}, path::direct);
      });
}

TEST_CASE("three refits over cuda_ipc reach a callback sink that copies the views on its stream", "[cuda_ipc]") {
  const auto metas = rt::mixed_model(300, 3 * buffer_bytes);
  const auto ep = rt::temp_endpoint();
  const std::vector<std::uint64_t> versions = {4, 5, 9};
  // Views of the streamer's tensors where they are (whole), and views of the buffers (chunks).
  const bool share = GENERATE(true, false);
  two_processes([&](rt::signal_pipe& ready) { callback_receiver(ep, metas, 0, versions, ready); },
                [&] { streamer_of(ep, metas, 0, versions, path::staged, false, share); });
}

TEST_CASE("a receiver on cuda:1 maps the buffers of a streamer on cuda:0 and refits bit-exact", "[cuda_ipc]") {
  if (rt::cuda_device_count() < 2) {
    WARN("one CUDA device: the two-GPU cuda_ipc test did not run");
    return;
  }
  const auto metas = rt::mixed_model(300, 3 * buffer_bytes);
  const std::vector<std::uint64_t> versions = {1, 2};
  {
    const auto ep = rt::temp_endpoint();
    two_processes([&](rt::signal_pipe& ready) { table_receiver(ep, metas, 1, versions, ready); },
                  [&] { streamer_of(ep, metas, 0, versions, path::direct); });
  }
  {
    const auto ep = rt::temp_endpoint();
    two_processes([&](rt::signal_pipe& ready) { callback_receiver(ep, metas, 1, versions, ready); },
                  [&] { streamer_of(ep, metas, 0, versions, path::staged); });
  }
}

TEST_CASE("a receiver killed mid-refit fails the streamer with a timeout, and a new receiver takes the next refit",
          "[cuda_ipc][faults]") {
  const auto metas = rt::mixed_model(300, 3 * buffer_bytes);
  const auto ep = rt::temp_endpoint();
  constexpr int block_at_batch = 3;

  rt::signal_pipe first_ready;
  rt::signal_pipe first_blocked;
  rt::child first([&] {
    refit::check_cuda(cudaSetDevice(0), "cudaSetDevice(0)");
    refit::receiver r(receive_options(ep, 0, relaxed));
    int batch = 0;
    r.on_batch([&](std::span<const refit::tensor_view> /*views*/, void* stream) {
      if (batch++ < block_at_batch) return;
      // Everything this process enqueued so far is done before it dies: the kill lands between
      // batches, as a crash of the host code would.
      refit::check_cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
      first_blocked.send("blocked");
      block_forever();
    });
    first_ready.send("ready");
    for (;;) {
      const auto e = r.serve_one(100ms);
      expect(e != refit::receiver_event::aborted && e != refit::receiver_event::refused, r.last_error());
    }
  });
  REQUIRE(first_ready.receive(60s) == "ready");

  rt::signal_pipe outcome;  // streamer → parent
  rt::signal_pipe go;       // parent → streamer
  rt::child tx([&] {
    device_tensors weights(metas, 0);
    auto o = stream_options(ep, 0, fault_timeout);
    o.share_tensors = false;  // through the buffers: many batches, so the receiver dies after three
    refit::streamer s(o);
    weights.upload(1);
    const auto t0 = std::chrono::steady_clock::now();
    std::string line = "no error";
    try {
      s.refit(1, weights.refs());
    } catch (const refit::error& e) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
      line = rt::code_name(e.code()) + " " + std::to_string(ms.count());
    }
    outcome.send(line);
    expect(go.receive(60s) == "go", "no go");
    weights.upload(2);
    const auto stats = s.refit(2, weights.refs());
    expect(stats.version == 2, "stats.version " + std::to_string(stats.version));
    s.close();
  });

  REQUIRE(first_blocked.receive(60s) == "blocked");
  first.kill();

  const auto line = outcome.receive(60s);
  INFO("the streamer's first refit: " << line);
  REQUIRE(line.rfind("timeout ", 0) == 0);
  // Through ZeroMQ a dead receiver is a reply that never comes: the streamer's timeout. Through
  // the control lane (the default on one host), a reply the streamer waits for fails at once,
  // since the receiver's process ended (and a request not sent yet goes through ZeroMQ: timeout).
  const auto ms = std::stoll(line.substr(8));
  CHECK(ms < 3 * fault_timeout.count());

  rt::signal_pipe second_ready;
  rt::child second([&] { table_receiver(ep, metas, 0, {2}, second_ready); });
  REQUIRE(second_ready.receive(60s) == "ready");
  go.send("go");
  CHECK(tx.wait(120s) == 0);
  CHECK(second.wait(60s) == 0);
}

TEST_CASE("a streamer killed mid-refit leaves the receiver's version and marks it dirty; the next streamer commits",
          "[cuda_ipc][faults]") {
  const auto metas = rt::mixed_model(300, 3 * buffer_bytes);
  const auto ep = rt::temp_endpoint();

  rt::signal_pipe ready;
  rt::signal_pipe reports;  // receiver → parent
  rt::signal_pipe stop;     // parent → receiver
  rt::child rx([&] {
    device_tensors weights(metas, 0);
    refit::receiver r(receive_options(ep, 0, fault_timeout));
    weights.register_with(r);
    ready.send("ready");
    for (;;) {
      const auto e = r.serve_one(100ms);
      const auto committed = r.committed_version();
      const std::string state = " committed=" + (committed ? std::to_string(*committed) : std::string("none")) +
                                " dirty=" + (r.dirty() ? "1" : "0");
      switch (e) {
        case refit::receiver_event::idle:
          if (stop.try_receive(0ms)) return;
          break;
        case refit::receiver_event::committed: {
          const auto m = weights.mismatch(*committed);
          reports.send("committed" + state + " check=" + (m.empty() ? "ok" : m));
          break;
        }
        case refit::receiver_event::aborted:
        case refit::receiver_event::refused: reports.send(std::string(refit::to_string(e)) + state); break;
        default: break;
      }
    }
  });
  REQUIRE(ready.receive(60s) == "ready");

  {
    rt::child tx([&] { streamer_of(ep, metas, 0, {1}); });
    CHECK(tx.wait(120s) == 0);
    CHECK(reports.receive(60s) == "committed committed=1 dirty=0 check=ok");
  }

  {
    // Blocks when asked for the tensor after the oversize one: by then batches of version 2 have
    // been applied, so the receiver's weights are partly overwritten.
    const std::size_t block_at = index_of(metas, "oversize.weight") + 1;
    rt::signal_pipe blocked;
    rt::child tx([&] {
      device_tensors weights(metas, 0);
      weights.upload(2);
      const auto refs = weights.refs();
      refit::streamer s(stream_options(ep, 0, relaxed));
      std::size_t i = 0;
      s.refit(2, [&]() -> std::optional<refit::tensor_ref> {
        if (i == block_at) {
          // Packing enqueued so far is done: the kill lands between GPU work, as a crash of the
          // host code would.
          refit::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
          blocked.send("blocked");
          block_forever();
        }
        if (i == refs.size()) return std::nullopt;
        return refs[i++];
      });
      throw std::runtime_error("the refit that should have been killed returned");
    });
    REQUIRE(blocked.receive(60s) == "blocked");
    tx.kill();
    // The receiver aborts the refit after its idle timeout.
    CHECK(reports.receive(30s) == "aborted committed=1 dirty=1");
  }

  {
    rt::child tx([&] { streamer_of(ep, metas, 0, {3}); });
    CHECK(tx.wait(120s) == 0);
    CHECK(reports.receive(60s) == "committed committed=3 dirty=0 check=ok");
  }
  stop.send("stop");
  CHECK(rx.wait(60s) == 0);
}

TEST_CASE(
    "on the streamer's GPU, a staged receiver reads a batch only once it is packed: a packing that never completes "
    "fails the refit with a timeout and leaves the weights untouched, and the next refit lands bit-exact",
    "[cuda_ipc][faults]") {
  // The two processes share the GPU: the receiver enqueues its reads of a buffer only once the
  // streamer's packing of it has completed (a read queued behind it would hold the GPU). Here the
  // first tensor's producer stream holds the first batch's packing until the receiver has failed.
  // The streamer's first kernel launch comes after the gate shuts: had it loaded the kernel then
  // (CUDA's lazy loading), the load would wait for the held stream and no BATCH would ever go
  // (copy::load_kernels; bench/results/2026-11-29-h200-kernel-loading.txt).
  const auto metas = rt::mixed_model(300, 3 * buffer_bytes);
  const auto ep = rt::temp_endpoint();
  rt::signal_pipe failed;  // receiver → streamer
  two_processes(
      [&](rt::signal_pipe& ready) {
        device_tensors weights(metas, 0);
        weights.upload(7);
        refit::receiver r(receive_options(ep, 0, fault_timeout));
        weights.register_with(r);
        ready.send("ready");
        int failures = 0;
        int commits = 0;
        serve_until_bye(
            r,
            [&](std::uint64_t v) {
              ++commits;
              expect(v == 2, "committed version " + std::to_string(v) + ", expected 2");
              expect(weights.mismatch(2).empty(), "after version 2: " + weights.mismatch(2));
            },
            {},
            [&] {
              ++failures;
              expect(r.last_error().find("the streamer's packing of cuda_ipc buffer 0 did not complete within 2000 "
                                         "ms") != std::string::npos,
                     "receiver: " + r.last_error());
              expect(!r.dirty(), "dirty after a refit whose only batch read nothing");
              expect(!r.committed_version(), "a version committed");
              expect(weights.mismatch(7).empty(), "the weights changed: " + weights.mismatch(7));
              failed.send("failed");
            });
        expect(failures == 1 && commits == 1,
               std::to_string(failures) + " failures, " + std::to_string(commits) + " commits");
      },
      [&] {
        device_tensors weights(metas, 0);
        auto o = stream_options(ep, 0, relaxed);
        o.direct = false;
        o.share_tensors = false;  // every tensor packed into the buffers
        refit::streamer s(o);
        weights.upload(1);
        refit::cuda::stream producer(cudaStreamNonBlocking);
        stream_gate gate(producer.handle());
        auto refs = weights.refs();
        refs.front().stream = producer.handle();
        std::thread opener = opens_on(failed, [&] { gate.open(); });
        const auto [code, what] = error_of([&] { s.refit(1, refs); });
        opener.join();
        expect(code == refit::errc::timeout, "the first refit: " + what);
        expect(what.find("the streamer's packing of cuda_ipc buffer 0 did not complete within 2000 ms") !=
                   std::string::npos,
               "the first refit: " + what);
        refit::check_cuda(cudaStreamSynchronize(producer.handle()), "the producer stream");
        weights.upload(2);
        const auto stats = s.refit(2, weights.refs());
        expect(!stats.direct && stats.shared_bytes == 0, "version 2 did not travel through the buffers");
        s.close();
      });
}

TEST_CASE(
    "on the receiver's GPU, a staged streamer packs a buffer again only once the receiver's reads of it have "
    "completed: reads that never complete fail the refit with a timeout, and the next refit lands bit-exact",
    "[cuda_ipc][faults]") {
  // The receiver's batch callback holds its stream at the first batch, so its reads of buffer 0
  // never complete while the gate is shut: the streamer's third batch (buffer 0 again) must not
  // be packed over them, and the streamer's timeout ends the wait.
  const auto metas = rt::mixed_model(300, 3 * buffer_bytes);
  const auto ep = rt::temp_endpoint();
  rt::signal_pipe failed;  // streamer → receiver
  two_processes(
      [&](rt::signal_pipe& ready) {
        std::optional<stream_gate> gate;
        std::atomic<stream_gate*> shut{nullptr};  // the gate, for the thread that opens it
        std::thread opener = opens_on(failed, [&] {
          if (stream_gate* g = shut.load()) g->open();
        });
        int aborts = 0;
        // Only version 2 commits, every byte of it checked as the callback copied it.
        callback_receiver(
            ep, metas, 0, {2}, ready,
            [&](void* stream) {
              if (!gate) shut.store(&gate.emplace(stream));
            },
            [&] { ++aborts; });
        opener.join();
        expect(aborts == 1, std::to_string(aborts) + " aborts");
      },
      [&] {
        device_tensors weights(metas, 0);
        auto o = stream_options(ep, 0, fault_timeout);
        o.direct = false;
        o.share_tensors = false;
        refit::streamer s(o);
        weights.upload(1);
        const auto [code, what] = error_of([&] { s.refit(1, weights.refs()); });
        failed.send("failed");
        expect(code == refit::errc::timeout, "the first refit: " + what);
        expect(
            what.find("the receiver's reads of cuda_ipc buffer 0 did not complete within 2000 ms") != std::string::npos,
            "the first refit: " + what);
        weights.upload(2);
        s.refit(2, weights.refs());
        s.close();
      });
}

TEST_CASE("a thousand refits in one cuda_ipc session grow neither device memory, descriptors nor mappings",
          "[cuda_ipc][resources]") {
  // Direct, and staged with the receiver reading the streamer's tensors in place.
  const bool staged = GENERATE(false, true);
  const auto metas = rt::mixed_model(20, 0, 7);
  const auto ep = rt::temp_endpoint();
  constexpr std::uint64_t refits = 1000;
  constexpr std::uint64_t early = 10;

  two_processes(
      [&](rt::signal_pipe& ready) {
        device_tensors weights(metas, 0);
        refit::receiver r(receive_options(ep, 0, relaxed));
        weights.register_with(r);
        ready.send("ready");
        std::optional<resources> at_early;
        std::uint64_t expected = 1;
        serve_until_bye(r, [&](std::uint64_t v) {
          expect(v == expected, "committed version " + std::to_string(v) + ", expected " + std::to_string(expected));
          ++expected;
          if (v % 100 == 0 || v == early) {
            const auto m = weights.mismatch(v);
            expect(m.empty(), m);
          }
          if (v == early) at_early = resources::now();
          if (v == refits) expect_no_growth("receiver", *at_early, resources::now());
        });
        expect(expected == refits + 1, "the receiver saw " + std::to_string(expected - 1) + " commits");
      },
      [&] {
        device_tensors weights(metas, 0);
        refit::streamer_options o = stream_options(ep, 0, relaxed);
        o.buffer_bytes = 1 * mib;
        o.direct = !staged;
        refit::streamer s(o);
        const auto refs = weights.refs();
        std::optional<resources> at_early;
        for (std::uint64_t v = 1; v <= refits; ++v) {
          weights.upload(v);
          const auto stats = s.refit(v, refs);
          expect(stats.version == v, "stats.version " + std::to_string(stats.version));
          expect(stats.direct != staged && stats.shared_bytes == (staged ? stats.bytes : 0),
                 "version " + std::to_string(v) + " took another path");
          if (v == early) at_early = resources::now();
        }
        expect_no_growth("streamer", *at_early, resources::now());
        s.close();
      });
}

#endif  // REFIT_HAVE_CUDA
