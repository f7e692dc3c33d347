// refit — GPU copy engines and the device checksum. See copy_cuda.hpp and copy_kernel.hpp.
#include "copy/copy_cuda.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <string_view>
#include <array>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "copy/copy_kernel.hpp"
#include "copy/cuda_check.hpp"
#include "copy/cuda_handles.hpp"
#include "copy/driver.hpp"
#include "copy/wait.hpp"
#include "refit/error.hpp"

namespace refit::copy {
namespace {

int multiprocessors(int device) {
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
             fmt::format("cudaDeviceGetAttribute(multiprocessor count, device {})", device));
  return std::max(sms, 1);
}

std::size_t non_empty(std::span<const op> ops) noexcept {
  return static_cast<std::size_t>(
      std::count_if(ops.begin(), ops.end(), [](const op& o) { return o.bytes != 0 && o.rows != 0; }));
}

/// Conversion on the GPU, shared by every CUDA engine: the converting copies and scale passes
/// (one launch each, kernels in copy_kernel.cu) and the scratch arena of the scales. Plain copies
/// stay with each engine's run(), untouched.
class cuda_copier : public copier {
 public:
  explicit cuda_copier(int device) : device_(device) {}

  void convert(std::span<const convert_op> ops, void* stream) override {
    if (ops.empty()) return;
    device_guard guard(device_);
    const int blocks = max_blocks();
    for (const convert_op& o : ops) {
      if (o.total() == 0) continue;
      const kernel::convert_args a{o.src, o.dst, o.count, o.rows, o.src_pitch, o.dst_pitch, o.first, o.cv};
      check_cuda(kernel::launch_convert(a, blocks, static_cast<cudaStream_t>(stream)),
                 [&] { return fmt::format("conversion kernel launch ({} elements, device {})", o.total(), device_); });
    }
  }

  void scales(std::span<const scale_job> jobs, void* stream) override {
    if (jobs.empty()) return;
    device_guard guard(device_);
    const auto s = static_cast<cudaStream_t>(stream);
    for (const scale_job& j : jobs) {
      const auto from = static_cast<std::uint8_t>(j.from);
      const cvt::conversion c = conversion_of(j.from, quant_dtype(j.q), j.q, j.shape, nullptr);
      const std::uint64_t n = *checked_numel(j.shape);
      if (j.q == quant::tensor) {
        const std::uint64_t wanted = std::max<std::uint64_t>(1, n / (kernel::convert_threads * 16));
        const int blocks = static_cast<int>(std::min<std::uint64_t>(wanted, static_cast<std::uint64_t>(max_blocks())));
        check_cuda(kernel::launch_tensor_scale(j.src, from, n, static_cast<float*>(j.scale), j.mul, blocks, s),
                   [&] { return fmt::format("per-tensor scale kernels ({} elements, device {})", n, device_); });
      } else if (j.q == quant::channel || j.q == quant::mxfp8 || j.q == quant::nvfp4) {
        kernel::row_scale_args a;
        a.src = j.src;
        a.from = from;
        a.q = static_cast<std::uint8_t>(j.q);
        a.rows = c.cols == 0 ? 0 : n / c.cols;
        a.cols = c.cols;
        a.mat_rows = c.rows;
        a.scale = j.scale;
        a.scale_bytes = *checked_numel(scale_shape(j.q, j.shape, j.layout)) * itemsize(scale_dtype(j.q));
        a.layout = static_cast<std::uint8_t>(j.layout);
        a.mul = j.mul;
        a.scale_2 = j.scale_2;
        const std::uint64_t wanted = std::max<std::uint64_t>(1, n / (kernel::convert_threads * 16));
        const int blocks = static_cast<int>(std::min<std::uint64_t>(wanted, static_cast<std::uint64_t>(max_blocks())));
        check_cuda(kernel::launch_row_scales(a, blocks, s),
                   [&] { return fmt::format("row scale kernels ({} elements, device {})", n, device_); });
      } else {
        const std::uint64_t lead = c.rows * c.cols == 0 ? 0 : n / (c.rows * c.cols);
        check_cuda(
            kernel::launch_block_scales(j.src, from, lead, c.rows, c.cols, static_cast<float*>(j.scale), j.mul, s),
            [&] { return fmt::format("block scale kernel ({} elements, device {})", n, device_); });
      }
    }
  }

  void fused(std::span<const fused_job> jobs, void* stream) override {
    if (jobs.empty()) return;
    device_guard guard(device_);
    for (const fused_job& j : jobs)
      check_cuda(kernel::launch_fused_block128(j.src, static_cast<std::uint8_t>(j.from), j.lead, j.rows, j.cols, j.dst,
                                               j.dst_pitch, j.col_lo, j.col_hi, j.scale, j.scale_pitch,
                                               static_cast<cudaStream_t>(stream)),
                 [&] {
                   return fmt::format("fused block128 kernel ({} × {} × {}, device {})", j.lead, j.rows, j.cols,
                                      device_);
                 });
  }

  void prime(void* stream) override {
    device_guard guard(device_);
    check_cuda(kernel::launch_nothing(static_cast<cudaStream_t>(stream)),
               [&] { return fmt::format("empty kernel launch (device {})", device_); });
  }

  float* scratch(std::size_t n) override {
    n = std::max<std::size_t>(n, 1);
    // Chunks are kept across refits (reset_scratch only rewinds): a steady model allocates once.
    while (chunk_ < chunks_.size() && chunks_[chunk_].used + n > chunks_[chunk_].size) ++chunk_;
    if (chunk_ == chunks_.size()) {
      device_guard guard(device_);
      const std::size_t size = std::max<std::size_t>(n, std::size_t{1} << 20);
      chunks_.push_back(chunk{cuda::device_buffer(size * sizeof(float)), size, 0});
    }
    chunk& c = chunks_[chunk_];
    float* p = static_cast<float*>(c.memory.handle()) + c.used;
    c.used += (n + 63) / 64 * 64;  // 256-byte aligned pieces
    if (c.used > c.size) c.used = c.size;
    return p;
  }

  void reset_scratch() noexcept override {
    // Stream order protects reuse: the next refit's scale passes run on the same stream, after
    // everything that read the last one's.
    for (chunk& c : chunks_) c.used = 0;
    chunk_ = 0;
  }

 protected:
  int device_;

 private:
  int max_blocks() {
    if (max_blocks_ == 0) max_blocks_ = multiprocessors(device_) * 8;
    return max_blocks_;
  }
  struct chunk {
    cuda::device_buffer memory;
    std::size_t size = 0;
    std::size_t used = 0;
  };
  std::vector<chunk> chunks_;
  std::size_t chunk_ = 0;
  int max_blocks_ = 0;
};

/// One launch of the copy kernel per run(). A list of at most kernel::inline_ops_max ops goes in
/// the launch's parameters. A longer one reaches the device through a ring of
/// slots, each a page-locked host array and a device array: run() fills a slot's host array,
/// copies it to the slot's device array on the caller's stream and launches the kernel after it.
/// A slot comes round again after `ring` calls; by then its host array's upload has normally
/// finished (otherwise run() waits for that one copy), and the stream waits (on the device, not
/// the host) for the kernel that last read its device array, in case that ran on another stream.
/// With offload_from, a batch mostly of large copies gives those to the copy engines on two
/// streams of its own beside the launch (make_copier).
class kernel_copier final : public cuda_copier {
 public:
  kernel_copier(int device, milliseconds timeout, std::uint64_t offload_from)
      : cuda_copier(device), timeout_(timeout), offload_from_(offload_from) {
    device_guard guard(device_);
    max_blocks_ = multiprocessors(device_) * kernel::blocks_per_sm;
    for (slot& s : slots_) {
      s.uploaded = cuda::event(cudaEventDisableTiming);
      s.consumed = cuda::event(cudaEventDisableTiming);
      grow(s, initial_capacity);
    }
    if (offload_from_ != 0) {
      fork_ = cuda::event(cudaEventDisableTiming);
      for (side& d : sides_) d = side{cuda::stream(cudaStreamNonBlocking), cuda::event(cudaEventDisableTiming)};
    }
  }

  /// The batch's large copies to the copy engines (see make_copier's offload_from), the rest by
  /// one launch of the kernel, at once; then the kernel's stream waits for both.
  void run(std::span<const op> ops, void* stream) override {
    join(stream);
    run_on(ops, static_cast<cudaStream_t>(stream));
  }

  /// The batch on the next of two streams of this copier's, after the work on `stream` so far:
  /// consecutive launches alternate between them, so a launch's blocks take the SMs its
  /// predecessor's last wave leaves idle (on one stream, each launch waits for the last block of
  /// the one before, and every launch boundary cost a small refit ~5 us:
  /// bench/results/2026-11-29-h200-small-refit-timeline.txt).
  void run_beside(std::span<const op> ops, void* stream) override {
    if (non_empty(ops) == 0) return;
    device_guard guard(device_);
    if (!lane_fork_.handle()) {
      lane_fork_ = cuda::event(cudaEventDisableTiming);
      for (lane& l : lanes_) l = lane{cuda::stream(cudaStreamNonBlocking), cuda::event(cudaEventDisableTiming), false};
    }
    lane& l = lanes_[lane_turn_++ % lanes_.size()];
    check_cuda(cudaEventRecord(lane_fork_.handle(), static_cast<cudaStream_t>(stream)),
               "cudaEventRecord(before copies beside the stream)");
    check_cuda(cudaStreamWaitEvent(l.stream.handle(), lane_fork_.handle(), 0),
               "cudaStreamWaitEvent(copies beside the stream)");
    l.unjoined = true;
    run_on(ops, l.stream.handle());
  }

  void join(void* stream) override {
    for (lane& l : lanes_) {
      if (!l.unjoined) continue;
      device_guard guard(device_);
      check_cuda(cudaEventRecord(l.joined.handle(), l.stream.handle()), "cudaEventRecord(after copies beside)");
      check_cuda(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), l.joined.handle(), 0),
                 "cudaStreamWaitEvent(copies beside the stream)");
      l.unjoined = false;
    }
  }

  [[nodiscard]] engine kind() const noexcept override { return engine::kernel; }

  // Launches beside each other (run_beside) may end out of order: the last two are asked.
  bool idle() noexcept override { return done(1) && done(2); }
  bool queue_short() noexcept override { return done(2) && done(3); }

 private:
  static constexpr std::size_t initial_capacity = 1024;  // ops; 64 KiB per array
  static constexpr std::size_t sides = 2;                // copy-engine streams
  struct slot;

  void run_on(std::span<const op> ops, cudaStream_t s) {
    const std::size_t count = non_empty(ops);
    if (count == 0) return;
    if (count > std::numeric_limits<std::uint32_t>::max())
      throw error(errc::invalid_argument, fmt::format("a batch of {} copies is too many for one launch", count));
    device_guard guard(device_);
    slot& sl = slots_[next_];
    next_ = (next_ + 1) % slots_.size();
    std::array<bool, sides> used{};
    try {
      enqueue(ops, used, sl, s);
    } catch (...) {
      // The stream still waits for the copies already on the copy engines: what the caller does
      // after the failure (drain, abort) must not overtake them.
      for (std::size_t k = 0; k < sides; ++k)
        if (used[k] && cudaEventRecord(sides_[k].joined.handle(), sides_[k].stream.handle()) == cudaSuccess)
          (void)cudaStreamWaitEvent(s, sides_[k].joined.handle(), 0);
      throw;
    }
    for (std::size_t k = 0; k < sides; ++k) {
      if (!used[k]) continue;
      check_cuda(cudaEventRecord(sides_[k].joined.handle(), sides_[k].stream.handle()),
                 "cudaEventRecord(after copy-engine copies)");
      check_cuda(cudaStreamWaitEvent(s, sides_[k].joined.handle(), 0), "cudaStreamWaitEvent(copy-engine copies)");
    }
    check_cuda(cudaEventRecord(sl.consumed.handle(), s), "cudaEventRecord(copy kernel)");
  }

  /// The batch's large copies on the copy-engine streams (`used`: those that took some, after
  /// waiting for the work on `s` so far) when worth it, and the rest by one launch on `s`.
  void enqueue(std::span<const op> ops, std::array<bool, sides>& used, slot& sl, cudaStream_t s) {
    std::span<const op> rest = ops;
    if (offload_from_ != 0 && worth_offloading(ops)) {
      check_cuda(cudaEventRecord(fork_.handle(), s), "cudaEventRecord(before copy-engine copies)");
      kernel_ops_.clear();
      for (const op& o : ops) {
        if (!offloaded(o)) {
          kernel_ops_.push_back(o);
          continue;
        }
        const std::size_t k = turn_++ % sides;
        const cudaStream_t to = sides_[k].stream.handle();
        if (!used[k]) check_cuda(cudaStreamWaitEvent(to, fork_.handle(), 0), "cudaStreamWaitEvent(copy engines)");
        used[k] = true;
        check_cuda(cudaMemcpyAsync(o.dst, o.src, static_cast<std::size_t>(o.bytes), cudaMemcpyDefault, to),
                   [&] { return fmt::format("cudaMemcpyAsync({} bytes, device {})", o.bytes, device_); });
      }
      rest = kernel_ops_;
    }
    launch(rest, sl, s);
  }

  [[nodiscard]] bool offloaded(const op& o) const noexcept {
    return o.rows == 1 && !o.kernel_only && o.bytes >= offload_from_;
  }

  /// Whether the batch's large copies hold at least half its bytes: a batch of mostly small
  /// copies (an MoE model's experts) gains nothing from a few large ones beside its kernel, and
  /// pays the streams' fork and join at every launch (qwen3-30b-a3b direct: 32.0 ms all by the
  /// kernel, 37.5 ms with its 16 MiB attention weights on the copy engines).
  [[nodiscard]] bool worth_offloading(std::span<const op> ops) const noexcept {
    std::uint64_t large = 0, all = 0;
    for (const op& o : ops) {
      all += o.total();
      if (offloaded(o)) large += o.bytes;
    }
    return large != 0 && large >= all - large;
  }

  /// One launch of the kernel over `ops` (none when they are all empty), its op list passed by
  /// value or uploaded through slot `sl`.
  void launch(std::span<const op> ops, slot& sl, cudaStream_t s) {
    const std::size_t count = non_empty(ops);
    if (count == 0) return;
    if (count <= kernel::inline_ops_max) {
      // A short list goes in the launch's parameters: no upload on the stream between this kernel
      // and the one before it (an upload there left the device idle ~10 us at each launch).
      inline_.resize(count);
      const std::uint64_t tiles = fill(ops, inline_.data());
      const auto blocks = static_cast<int>(std::min<std::uint64_t>(tiles, static_cast<std::uint64_t>(max_blocks_)));
      check_cuda(
          kernel::launch_copy_inline(inline_.data(), static_cast<std::uint32_t>(inline_.size()), tiles, blocks, s),
          [&] {
            return fmt::format("copy kernel launch ({} copies, {} tiles, {} blocks, device {})", inline_.size(), tiles,
                               blocks, device_);
          });
      return;
    }

    // The host array is overwritten below: its last upload must be complete.
    wait(sl.uploaded.handle(), "the upload of a copy op list");
    if (count > sl.capacity) {
      // Both arrays are replaced: the kernel that last read the device array must be done too.
      wait(sl.consumed.handle(), "a copy kernel");
      grow(sl, std::max<std::size_t>(count, 2 * sl.capacity));
    }

    auto* list = static_cast<kernel::device_op*>(sl.host.handle());
    const std::uint64_t tiles = fill(ops, list);
    const std::size_t n = count;

    // The device array may still be read by the previous launch from this slot (another stream).
    check_cuda(cudaStreamWaitEvent(s, sl.consumed.handle(), 0), "cudaStreamWaitEvent(copy kernel)");
    check_cuda(cudaMemcpyAsync(sl.device.handle(), list, n * sizeof(kernel::device_op), cudaMemcpyHostToDevice, s),
               [&] { return fmt::format("cudaMemcpyAsync(op list of {} copies to device {})", n, device_); });
    check_cuda(cudaEventRecord(sl.uploaded.handle(), s), "cudaEventRecord(copy op list upload)");
    const auto blocks = static_cast<int>(std::min<std::uint64_t>(tiles, static_cast<std::uint64_t>(max_blocks_)));
    check_cuda(kernel::launch_copy(static_cast<const kernel::device_op*>(sl.device.handle()),
                                   static_cast<std::uint32_t>(n), tiles, blocks, s),
               [&] {
                 return fmt::format("copy kernel launch ({} copies, {} tiles, {} blocks, device {})", n, tiles, blocks,
                                    device_);
               });
  }

  /// Waits for `e` on the host, at most timeout_: the work before it may wait on a peer's event
  /// (the other process's apply or pack), and a dead peer's event may never complete.
  void wait(cudaEvent_t e, std::string_view what) const {
    if (!device_work_done(
            timeout_, [&] { return cudaEventQuery(e); }, [&] { return fmt::format("cudaEventQuery({})", what); }))
      throw error(errc::timeout, fmt::format("{} on device {} did not complete within {} ms: the GPU work before "
                                             "it waits on the peer process, which may have died",
                                             what, device_, timeout_.count()));
  }

  /// Writes the device ops of `ops` (the empty ones left out: non_empty(ops) of them) from `out`
  /// on; returns their tiles.
  static std::uint64_t fill(std::span<const op> ops, kernel::device_op* out) {
    std::uint64_t tiles = 0;
    for (const op& o : ops) {
      const kernel::tiling cut = kernel::tiles_of(o.bytes, o.rows);
      if (cut.tiles == 0) continue;
      *out++ = kernel::device_op{
          o.src, o.dst, o.bytes, tiles, o.rows, o.src_pitch, o.dst_pitch, cut.tiles_per_row, cut.rows_per_tile};
      tiles += cut.tiles;
    }
    return tiles;
  }

  struct slot {
    cuda::pinned_buffer host;
    cuda::device_buffer device;
    std::size_t capacity = 0;
    cuda::event uploaded;  ///< recorded after the op list's upload: the host array is free
    cuda::event consumed;  ///< recorded after the kernel: the device array is free
  };

  /// True when the kernel launched `back` launches ago (1: the last) has finished: its slot holds
  /// the event recorded after it (never recorded: finished).
  bool done(std::size_t back) noexcept {
    const slot& sl = slots_[(next_ + slots_.size() - back) % slots_.size()];
    const cudaError_t status = cudaEventQuery(sl.consumed.handle());  // any device may ask
    if (status == cudaErrorNotReady) return false;
    (void)cudaGetLastError();  // an error here is reported by the next real call, not by a query
    return status == cudaSuccess;
  }

  static void grow(slot& s, std::size_t capacity) {
    const std::uint64_t bytes = capacity * sizeof(kernel::device_op);
    // Release first: a failed allocation must not leave the slot half replaced.
    s.host = cuda::pinned_buffer();
    s.device = cuda::device_buffer();
    s.capacity = 0;
    s.host = cuda::pinned_buffer(bytes);
    s.device = cuda::device_buffer(bytes);
    s.capacity = capacity;
  }

  milliseconds timeout_;
  int max_blocks_ = 1;
  std::array<slot, 4> slots_;
  std::size_t next_ = 0;
  std::vector<kernel::device_op> inline_;  ///< the op list of a launch that passes it by value

  /// A copy-engine stream, and the event the kernel's stream waits on after a batch.
  struct side {
    cuda::stream stream;
    cuda::event joined;
  };
  std::uint64_t offload_from_ = 0;  ///< 0: every copy by the kernel
  cuda::event fork_;                ///< recorded on run()'s stream before a batch's copy-engine copies
  std::array<side, sides> sides_;
  std::size_t turn_ = 0;        ///< the next copy-engine copy's stream: turn_ % sides
  std::vector<op> kernel_ops_;  ///< the rest of a batch some of whose copies went to the copy engines

  /// A stream of run_beside()'s, and the event join() has the caller's stream wait on.
  struct lane {
    cuda::stream stream;
    cuda::event joined;
    bool unjoined = false;  ///< holds copies the caller's stream does not wait for yet
  };
  cuda::event lane_fork_;  ///< recorded on run_beside()'s stream before each call; made at the first
  std::array<lane, 2> lanes_;
  std::size_t lane_turn_ = 0;
};

/// cudaMemcpyBatchAsync: one call per run(). The runtime refuses the legacy default stream for
/// batches, so on a null stream this falls back to one cudaMemcpyAsync per op.
class batch_copier final : public cuda_copier {
 public:
  explicit batch_copier(int device) : cuda_copier(device) {}

  void run(std::span<const op> ops, void* stream) override {
    device_guard guard(device_);
    const auto s = static_cast<cudaStream_t>(stream);
    dsts_.clear();
    srcs_.clear();
    sizes_.clear();
    for (const op& o : ops) {
      if (o.bytes == 0) continue;
      for (std::uint64_t r = 0; r < o.rows; ++r) {  // a row each: the batch API copies ranges
        dsts_.push_back(static_cast<std::byte*>(o.dst) + r * o.dst_pitch);
        srcs_.push_back(static_cast<const std::byte*>(o.src) + r * o.src_pitch);
        sizes_.push_back(static_cast<std::size_t>(o.bytes));
      }
    }
    if (dsts_.empty()) return;
    if (s == nullptr) {
      for (std::size_t i = 0; i < dsts_.size(); ++i)
        check_cuda(cudaMemcpyAsync(dsts_[i], srcs_[i], sizes_[i], cudaMemcpyDefault, s),
                   [&] { return fmt::format("cudaMemcpyAsync({} bytes, device {})", sizes_[i], device_); });
      return;
    }
    cudaMemcpyAttributes attributes{};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attributes.srcLocHint.type = cudaMemLocationTypeDevice;
    attributes.srcLocHint.id = device_;
    attributes.dstLocHint.type = cudaMemLocationTypeDevice;
    attributes.dstLocHint.id = device_;
    attributes.flags = cudaMemcpyFlagDefault;
    std::size_t first = 0;  // the one attribute applies to copies [0, count)
    check_cuda(cudaMemcpyBatchAsync(dsts_.data(), srcs_.data(), sizes_.data(), dsts_.size(), &attributes, &first, 1, s),
               [&] { return fmt::format("cudaMemcpyBatchAsync({} copies, device {})", dsts_.size(), device_); });
  }

  [[nodiscard]] engine kind() const noexcept override { return engine::memcpy_batch; }

 private:
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<std::size_t> sizes_;
};

/// One cudaMemcpyAsync per op: the baseline.
class each_copier final : public cuda_copier {
 public:
  explicit each_copier(int device) : cuda_copier(device) {}

  void run(std::span<const op> ops, void* stream) override {
    device_guard guard(device_);
    const auto s = static_cast<cudaStream_t>(stream);
    for (const op& o : ops) {
      if (o.bytes == 0 || o.rows == 0) continue;
      if (o.rows == 1) {
        check_cuda(cudaMemcpyAsync(o.dst, o.src, static_cast<std::size_t>(o.bytes), cudaMemcpyDefault, s),
                   [&] { return fmt::format("cudaMemcpyAsync({} bytes, device {})", o.bytes, device_); });
        continue;
      }
      check_cuda(
          cudaMemcpy2DAsync(o.dst, static_cast<std::size_t>(o.dst_pitch), o.src, static_cast<std::size_t>(o.src_pitch),
                            static_cast<std::size_t>(o.bytes), static_cast<std::size_t>(o.rows), cudaMemcpyDefault, s),
          [&] { return fmt::format("cudaMemcpy2DAsync({} rows of {} bytes, device {})", o.rows, o.bytes, device_); });
    }
  }

  [[nodiscard]] engine kind() const noexcept override { return engine::memcpy_each; }

 private:
};

}  // namespace

std::unique_ptr<copier> make_cuda_copier(engine e, int device, milliseconds timeout, std::uint64_t offload_from) {
  load_kernels(device);
  switch (e) {
    case engine::kernel: return std::make_unique<kernel_copier>(device, timeout, offload_from);
    case engine::memcpy_batch: return std::make_unique<batch_copier>(device);
    case engine::memcpy_each: return std::make_unique<each_copier>(device);
    case engine::cpu: break;
  }
  throw error(errc::invalid_argument, fmt::format("copy engine {} is not a CUDA engine", to_string(e)));
}

void load_kernels(int device) {
  static std::mutex mutex;
  static std::set<int> loaded;
  const std::lock_guard lock(mutex);
  if (loaded.contains(device)) return;
  device_guard guard(device);
  check_cuda(kernel::load_all(), [&] { return fmt::format("loading refit's copy kernels on device {}", device); });
  loaded.insert(device);
}

std::uint64_t cuda_checksum(const void* p, std::uint64_t bytes, int device) {
  if (bytes == 0) return 0;  // the empty sum plus bytes
  if (p == nullptr) throw error(errc::invalid_argument, fmt::format("checksum of {} bytes at a null pointer", bytes));
  device_guard guard(device);
  // Synchronous by contract: the bytes are final once the device's queued work is done.
  check_cuda(cudaDeviceSynchronize(), fmt::format("cudaDeviceSynchronize(device {}) before a checksum", device));
  cuda::device_buffer result(sizeof(unsigned long long));
  check_cuda(cudaMemset(result.handle(), 0, sizeof(unsigned long long)), "cudaMemset(checksum accumulator)");
  const std::uint64_t words = bytes / 8;
  const std::uint64_t wanted =
      std::max<std::uint64_t>(1, (words + kernel::checksum_threads - 1) / kernel::checksum_threads);
  const auto blocks =
      static_cast<int>(std::min<std::uint64_t>(wanted, static_cast<std::uint64_t>(multiprocessors(device)) * 4));
  check_cuda(kernel::launch_checksum(p, bytes, static_cast<unsigned long long*>(result.handle()), blocks, nullptr),
             fmt::format("checksum kernel launch ({} bytes, device {})", bytes, device));
  unsigned long long sum = 0;
  check_cuda(cudaMemcpy(&sum, result.handle(), sizeof sum, cudaMemcpyDeviceToHost),
             fmt::format("checksum of {} bytes on device {}", bytes, device));
  return static_cast<std::uint64_t>(sum) + bytes;
}

namespace {
using get_attribute_fn = int (*)(void*, int, unsigned long long);
constexpr int buffer_id_attribute = 7;  // CU_POINTER_ATTRIBUTE_BUFFER_ID

get_attribute_fn pointer_attribute() {
  static const auto get_attribute = driver_entry<get_attribute_fn>("cuPointerGetAttribute");
  if (get_attribute == nullptr)
    throw error(errc::cuda, "the CUDA driver has no cuPointerGetAttribute entry point (driver older than CUDA 12?)");
  return get_attribute;
}
}  // namespace

std::uint64_t cuda_allocation_id(const void* p, int device) {
  const get_attribute_fn get_attribute = pointer_attribute();
  on_device guard(device);  // a driver call
  unsigned long long id = 0;
  if (get_attribute(&id, buffer_id_attribute, reinterpret_cast<unsigned long long>(p)) != 0) return 0;
  return id;
}

std::optional<allocation> cuda_allocation_of(const void* p, int device) {
  using get_range_fn = int (*)(unsigned long long*, std::size_t*, unsigned long long);
  static const auto get_range = driver_entry<get_range_fn>("cuMemGetAddressRange");
  const get_attribute_fn get_attribute = pointer_attribute();
  if (get_range == nullptr)
    throw error(errc::cuda, "the CUDA driver has no cuMemGetAddressRange entry point (driver older than CUDA 12?)");
  on_device guard(device);  // a driver call
  unsigned long long base = 0;
  std::size_t size = 0;
  const int status = get_range(&base, &size, reinterpret_cast<unsigned long long>(p));
  constexpr int invalid_value = 1;  // CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_FOUND: no allocation there
  constexpr int not_found = 500;
  if (status == invalid_value || status == not_found) return std::nullopt;
  if (status != 0)
    throw error(errc::cuda,
                fmt::format("cuMemGetAddressRange({}) on cuda:{} failed with CUresult {}", p, device, status));
  unsigned long long id = 0;
  if (get_attribute(&id, buffer_id_attribute, reinterpret_cast<unsigned long long>(p)) != 0) id = 0;  // not known
  return allocation{static_cast<std::uintptr_t>(base), static_cast<std::uint64_t>(size), id};
}

void enable_peer_access(int device, int peer) {
  if (device == peer) return;
  static std::mutex mutex;
  static std::set<std::pair<int, int>> enabled;
  std::lock_guard lock(mutex);
  if (enabled.contains({device, peer})) return;
  int can = 0;
  check_cuda(cudaDeviceCanAccessPeer(&can, device, peer),
             fmt::format("cudaDeviceCanAccessPeer(cuda:{}, cuda:{})", device, peer));
  if (can == 0)
    throw error(errc::cuda, fmt::format("cuda:{} cannot access the memory of cuda:{} (no peer access between these "
                                        "GPUs), which refit's copy kernel needs to copy between them: keep the "
                                        "tensor on cuda:{}, or use copy_engine::memcpy_batch",
                                        device, peer, device));
  device_guard guard(device);
  const cudaError_t status = cudaDeviceEnablePeerAccess(peer, 0);
  if (status == cudaErrorPeerAccessAlreadyEnabled)
    (void)cudaGetLastError();  // enabled by someone else in this process: fine
  else
    check_cuda(status, fmt::format("cudaDeviceEnablePeerAccess(cuda:{} to cuda:{})", device, peer));
  enabled.insert({device, peer});
}

struct device_area::impl {
  int device = 0;
  cuda::device_buffer memory;
  cuda::pinned_buffer host;  ///< pinned_host: the area, instead of `memory`
  cuda::stream stream;
  cuda::event read;      ///< recorded by read_on()
  bool pending = false;  ///< read_on() since the last wait_readers()
};

namespace {

/// Polls `done` (a cudaStreamQuery or cudaEventQuery) until it says the work finished, at most `timeout`.
template <class Query>
void wait_device(int device, milliseconds timeout, Query&& query) {
  if (!device_work_done(timeout, query, "the device stage's copies"))
    throw error(errc::timeout, fmt::format("the device stage's copies on cuda:{} did not finish within {} ms", device,
                                           timeout.count()));
}

}  // namespace

device_area::device_area(std::uint64_t bytes, int device, bool pinned_host) : impl_(std::make_unique<impl>()) {
  on_device here(device);
  impl_->device = device;
  void* p = nullptr;
  const cudaError_t status = pinned_host ? cudaMallocHost(&p, bytes) : cudaMalloc(&p, bytes);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    std::size_t free = 0, total = 0;
    (void)cudaMemGetInfo(&free, &total);
    throw error(errc::cuda,
                pinned_host ? fmt::format("cannot allocate a host stage of {} bytes of page-locked memory for cuda:{} "
                                          "({})",
                                          bytes, device, cudaGetErrorString(status))
                            : fmt::format("cannot allocate a device stage of {} bytes on cuda:{} ({}; {} bytes free "
                                          "of {})",
                                          bytes, device, cudaGetErrorString(status), free, total));
  }
  if (pinned_host)
    impl_->host = cuda::pinned_buffer::adopt(p, bytes);
  else
    impl_->memory = cuda::device_buffer::adopt(p, bytes);
  impl_->stream = cuda::stream(cudaStreamNonBlocking);
}

device_area::~device_area() = default;
std::byte* device_area::data() const noexcept {
  return static_cast<std::byte*>(impl_->host ? impl_->host.handle() : impl_->memory.handle());
}
std::uint64_t device_area::bytes() const noexcept { return impl_->host ? impl_->host.bytes() : impl_->memory.bytes(); }
int device_area::device() const noexcept { return impl_->device; }
void* device_area::stream() const noexcept { return impl_->stream.handle(); }

void device_area::synchronize(milliseconds timeout) const {
  device_guard here(impl_->device);
  auto* s = static_cast<cudaStream_t>(impl_->stream.handle());
  wait_device(impl_->device, timeout, [&] { return cudaStreamQuery(s); });
}

void device_area::read_on(void* stream) {
  device_guard here(impl_->device);
  if (!impl_->read) impl_->read = cuda::event(cudaEventDisableTiming);
  check_cuda(cudaEventRecord(impl_->read.handle(), static_cast<cudaStream_t>(stream)),
             "cudaEventRecord (the device stage's readers)");
  impl_->pending = true;
}

void device_area::wait_readers(milliseconds timeout) {
  if (!impl_->pending) return;
  device_guard here(impl_->device);
  wait_device(impl_->device, timeout, [&] { return cudaEventQuery(impl_->read.handle()); });
  impl_->pending = false;
}

}  // namespace refit::copy
