// refit — moving bytes: pack (sources → buffer) and apply (buffer → destinations).
//
// Layer 5. One call per batch: on the CPU a memcpy per op; on the GPU one batched launch per batch
// (a vectorised copy kernel over a device-side op list, with a batch's large copies on the copy
// engines beside it when the engine is automatic; or cudaMemcpyBatchAsync).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "copy/convert.hpp"
#include "plan/route.hpp"
#include "refit/model.hpp"
#include "refit/options.hpp"

namespace refit::copy {

/// One copy: `rows` rows of `bytes` bytes, row r from src + r·src_pitch to dst + r·dst_pitch (a
/// plain copy is one row). Rows of one op never overlap each other on the destination side.
struct op {
  const void* src = nullptr;
  void* dst = nullptr;
  std::uint64_t bytes = 0;  ///< of one row
  std::uint64_t rows = 1;
  std::uint64_t src_pitch = 0;
  std::uint64_t dst_pitch = 0;
  /// Never handed to the copy engines (make_copier's offload_from): its destination lies in memory
  /// they write slowly (see engines_slow_above).
  bool kernel_only = false;

  op() = default;
  op(const void* s, void* d, std::uint64_t n) noexcept : src(s), dst(d), bytes(n) {}
  op(const void* s, void* d, std::uint64_t row_bytes, std::uint64_t row_count, std::uint64_t s_pitch,
     std::uint64_t d_pitch) noexcept
      : src(s), dst(d), bytes(row_bytes), rows(row_count), src_pitch(s_pitch), dst_pitch(d_pitch) {}
  /// Bytes the op moves.
  [[nodiscard]] std::uint64_t total() const noexcept { return bytes * rows; }
};

/// A converting copy (see refit::quant): `rows` rows of `count` elements; row r reads elements of
/// cv.from at src + r·src_pitch elements and writes elements of cv.to at dst + r·dst_pitch
/// elements. `first` is the index, in the whole tensor, of the element row 0 starts at, and each
/// row starts src_pitch elements of the tensor after the one before (the source is the dense
/// tensor), so the group of every element is known however the tensor was cut into ops.
struct convert_op {
  const void* src = nullptr;
  void* dst = nullptr;
  std::uint64_t count = 0;  ///< elements of one row
  std::uint64_t rows = 1;
  std::uint64_t src_pitch = 0;  ///< elements
  std::uint64_t dst_pitch = 0;  ///< elements
  std::uint64_t first = 0;
  cvt::conversion cv;
  /// Elements the op writes.
  [[nodiscard]] std::uint64_t total() const noexcept { return count * rows; }
};

/// The scale pass of a quantised tensor (source `src` of `from` with `shape`, quantised as `q`):
/// for every group, its scale (what the scale tensor holds: f32 scale_inv = amax / 448, or an E8M0
/// code for mxfp8; cvt::write_scale) and its multiplier s (what convert_op::cv.mul points at),
/// numel(scale_shape(q, shape)) of each. nvfp4 (cvt::write_nvfp4_scale): the per-tensor scale
/// into `scale_2` first, then the blocks' e4m3 codes and their divisors. `scale` is in `layout`:
/// for swizzled_128x4, numel(scale_shape(q, shape, layout)) bytes, its padding written as 0.
struct scale_job {
  const void* src = nullptr;
  dtype from = dtype::f32;
  std::vector<std::int64_t> shape;  ///< elements (nvfp4: the source's, not the packed one)
  quant q = quant::tensor;
  void* scale = nullptr;  ///< the scale tensor, of scale_dtype(q)
  float* mul = nullptr;
  float* scale_2 = nullptr;  ///< nvfp4: the per-tensor scale (one f32)
  scale_layout layout = scale_layout::row_major;
};

/// The fused one-pass block128 quantisation of a direct write (see
/// kernel::launch_fused_block128): a [lead, rows, cols] source of `from` into codes at `dst` (row
/// pitch `dst_pitch` bytes; where source element (0, 0) would land; columns [col_lo, col_hi)
/// written) and the scale_inv of those columns' blocks at `scale` (row pitch `scale_pitch`
/// floats), reading the source once.
struct fused_job {
  const void* src = nullptr;
  dtype from = dtype::bf16;
  std::uint64_t lead = 1;
  std::uint64_t rows = 0;
  std::uint64_t cols = 0;
  std::uint8_t* dst = nullptr;
  std::uint64_t dst_pitch = 0;
  std::uint64_t col_lo = 0;
  std::uint64_t col_hi = 0;
  float* scale = nullptr;
  std::uint64_t scale_pitch = 0;
};

/// The conversion of a source of `from` with `shape` into `to` quantised as `q`, with the group
/// multipliers at `mul` (quantised only).
cvt::conversion conversion_of(dtype from, dtype to, quant q, std::span<const std::int64_t> shape,
                              const float* mul) noexcept;

/// Appends the converting copies that move the converted tensor's bytes [from, from + bytes)
/// along `runs` (plan::route of one destination, over the converted dtype) into the destination
/// whose first byte is `dst`; `src` is the source tensor's first element. Like append_route; every
/// clipped run must start and end on element boundaries of cv.to (the caller checks `from` and
/// `bytes`).
bool append_convert_route(std::span<const plan::run> runs, std::uint64_t from, std::uint64_t bytes, const void* src,
                          std::byte* dst, const cvt::conversion& cv, std::vector<convert_op>& ops,
                          std::vector<plan::run>& scratch);

enum class engine : std::uint8_t {
  cpu = 0,           ///< memcpy on the calling thread
  kernel = 1,        ///< one launch of refit's vectorised copy kernel per batch
  memcpy_batch = 2,  ///< cudaMemcpyBatchAsync per batch
  memcpy_each = 3,   ///< one cudaMemcpyAsync per op (the baseline the others beat)
};
std::string_view to_string(engine e) noexcept;

/// Copies a batch of ops. GPU engines enqueue on `stream` (a cudaStream_t) and return without
/// waiting; the CPU engine copies before returning and ignores `stream`.
class copier {
 public:
  virtual ~copier() = default;
  virtual void run(std::span<const op> ops, void* stream) = 0;
  /// Like run(), except that nothing later on `stream` waits for these copies until join(stream):
  /// they start after the work enqueued on `stream` so far, beside the copies of this copier's
  /// earlier run_beside() calls. For copies whose destinations no other copy writes and whose
  /// sources nothing writes before join() (a direct session's writes: the kernel engine starts
  /// each launch while the one before finishes its last, partly idle wave). Engines without
  /// streams of their own run().
  virtual void run_beside(std::span<const op> ops, void* stream) { run(ops, stream); }
  /// Makes the work enqueued on `stream` from now on wait for every copy of run_beside(); run()
  /// does it first by itself.
  virtual void join(void* stream) { (void)stream; }
  /// Converting copies, like run(). Engines without conversion throw errc::invalid_argument.
  virtual void convert(std::span<const convert_op> ops, void* stream) = 0;
  /// Scale passes (the source's memory where this engine reads, the outputs where it writes), in
  /// stream order before the converting copies that use them.
  virtual void scales(std::span<const scale_job> jobs, void* stream) = 0;
  /// Fused block128 quantisations (direct writes), in stream order.
  virtual void fused(std::span<const fused_job> jobs, void* stream) = 0;
  /// `n` floats of scratch memory where this engine writes (host for the CPU engine, its device
  /// for the GPU ones), valid until reset_scratch(); never moved.
  virtual float* scratch(std::size_t n) = 0;
  /// Makes all scratch memory free again (the work using it has finished).
  virtual void reset_scratch() noexcept = 0;
  [[nodiscard]] virtual engine kind() const noexcept = 0;
  /// True when every copy this copier enqueued has finished (the device would idle without more
  /// work), asked without waiting. Engines that cannot tell say false.
  [[nodiscard]] virtual bool idle() noexcept { return false; }
  /// True when at most one launch of this copier's is unfinished (the device has the last one, at
  /// most, left to run), asked without waiting. Engines that cannot tell say idle().
  [[nodiscard]] virtual bool queue_short() noexcept { return idle(); }
  /// Enqueues work that does nothing on `stream`, so that a GPU time-sliced with another process
  /// (a colocated engine whose kernels ran last) switches to this process's context now rather than
  /// at the first real launch: a switch costs ~140 us on an H100 VM (bench/probes/context_switch.cu;
  /// bench/results/2026-11-27-h100-2xh200-fixed-cost-copy-kernel.txt).
  /// Nothing for the CPU engine.
  virtual void prime(void* stream) { (void)stream; }
};

/// Appends the copies that move source bytes [from, from + bytes) along `runs` (plan::route of
/// one destination) into that destination, whose first byte is `dst`; `src` points at source byte
/// `from` (in a staging buffer, or in the tensor itself): one op per clipped run, each marked
/// `kernel_only` as asked (op::kernel_only). Returns whether any op was appended. `scratch` is only
/// reused between calls, to spare an allocation.
bool append_route(std::span<const plan::run> runs, std::uint64_t from, std::uint64_t bytes, const std::byte* src,
                  std::byte* dst, std::vector<op>& ops, std::vector<plan::run>& scratch, bool kernel_only = false);

/// The engine to use for buffers whose transport prefers `preferred`: the user's choice on GPU
/// transports, memcpy on the CPU.
engine choose(engine preferred, copy_engine requested) noexcept;

/// The contiguous copies the kernel engine hands to the copy engines when the choice is refit's
/// (copy_engine::automatic): those of at least 16 MiB. A copy engine moves a large range at the
/// device-copy speed, where the kernel's tiles reach ~0.90 of it; each copy costs it a few
/// microseconds more, and below a few MiB it is much slower than the kernel. llama3-8b's tensors
/// into another process's torch-allocated weights on an H200: the kernel alone 0.904 of a local
/// cudaMemcpyAsync, tensors of 16 MiB or more on two copy-engine streams beside it 0.987, of 64
/// MiB 0.975, every tensor on four streams 0.977; 3 MiB tensors by copy engines 0.34-0.40, by the
/// kernel 0.96 (bench/probes/dest_alloc.cu engines;
/// bench/results/2026-11-29-h200-copy-engines-announce.txt). Between two addresses of one GPU that
/// "copy engine" is cudaMemcpyAsync as the driver runs it, which does not run beside a kernel (a
/// kernel launched meanwhile starts as it ends: bench/results/2026-11-29-h200-small-refit-timeline.txt):
/// what it adds is its speed on large ranges, not bandwidth beside the kernel's.
inline constexpr std::uint64_t offload_from_automatic = std::uint64_t{16} << 20;
/// A cudaMalloc allocation larger than this is written by the kernel alone (copy::op::kernel_only):
/// the copy engines write one of 16 GB, mapped from another process, at 0.67-0.74 of the floor
/// where the kernel reaches 0.82 (its tensors in allocations of 8 GiB: 0.98 with the copy engines);
/// why that mapping is slow is not known (bench/probes/dest_alloc.cu engines;
/// bench/results/2026-11-29-h200-copy-engines-announce.txt).
inline constexpr std::uint64_t engines_slow_above = std::uint64_t{8} << 30;

/// offload_from_automatic when `requested` leaves the engine to refit, else 0 (none handed over).
std::uint64_t offload_for(copy_engine requested) noexcept;

/// Throws refit::error(invalid_argument) for a GPU engine in a build without CUDA.
/// `device` is the CUDA ordinal GPU engines work on. `timeout` bounds the one host wait a GPU
/// engine may do (the kernel engine reusing an op-list slot whose upload is still queued behind
/// work of a peer); past it, run() throws errc::timeout. `offload_from` (kernel engine only; 0:
/// none): in a batch where such copies hold at least half the bytes, each op of one row and at
/// least that many bytes goes to the copy engines, dealt in turn to two streams of the copier's own,
/// which start after the work enqueued on run()'s stream so far and which that stream waits for
/// after the batch's kernel: in stream order with everything else (on one GPU those copies and the
/// kernel run one after the other, not at once: see offload_from_automatic).
std::unique_ptr<copier> make_copier(engine e, int device = 0, milliseconds timeout = milliseconds{60000},
                                    std::uint64_t offload_from = 0);

/// Lets kernels on CUDA device `device` read and write memory of device `peer`
/// (cudaDeviceEnablePeerAccess), once per pair per process; nothing when they are the same.
/// refit's copy kernel needs it to copy between a tensor on one GPU and buffers on another (the
/// memcpy engines do not). Throws refit::error(cuda) when the two cannot access each other,
/// naming them and what to do; (invalid_argument) in a build without CUDA. Thread-safe.
void enable_peer_access(int device, int peer);

/// A device allocation: its first byte and its size.
struct allocation {
  std::uintptr_t base = 0;
  std::uint64_t bytes = 0;
  /// The driver's process-wide unique id of the allocation (CU_POINTER_ATTRIBUTE_BUFFER_ID; 0 when it
  /// does not say): a new allocation at a freed one's address has another.
  std::uint64_t id = 0;
};
/// The CUDA allocation holding `p`, memory of CUDA device `device` (cuMemGetAddressRange in that
/// device's primary context, through the runtime's driver entry point: refit links no libcuda),
/// or nullopt when the driver knows no allocation there (it was freed). Throws
/// refit::error(invalid_argument) in a build without CUDA, (cuda) when the driver cannot answer
/// (no such entry point, another error). Thread-safe; any thread may ask.
std::optional<allocation> cuda_allocation_of(const void* p, int device);
/// Only the id of the allocation holding `p` (allocation::id; 0 when the driver knows none): one
/// driver call where cuda_allocation_of makes two. Throws like it.
std::uint64_t cuda_allocation_id(const void* p, int device);

/// Device memory a receiver owns (its device stage), with a stream of its own on that device: the
/// transports' copies write it, copier::run() on stream() copies out of it. Needs no CUDA header.
class device_area {
 public:
  /// `bytes` bytes of memory of CUDA device `device` (with `pinned_host`: page-locked host memory,
  /// which that device's kernels read and write). Throws refit::error(errc::cuda) when they cannot
  /// be allocated (naming the bytes and the driver's answer), (invalid_argument) in a build without
  /// CUDA.
  device_area(std::uint64_t bytes, int device, bool pinned_host = false);
  ~device_area();
  device_area(const device_area&) = delete;
  device_area& operator=(const device_area&) = delete;

  [[nodiscard]] std::byte* data() const noexcept;
  [[nodiscard]] std::uint64_t bytes() const noexcept;
  [[nodiscard]] int device() const noexcept;
  /// A non-blocking stream of the device, for the copies out of the area.
  [[nodiscard]] void* stream() const noexcept;
  /// Waits until the work enqueued on stream() has finished, at most `timeout`: throws
  /// refit::error(errc::timeout) past it, (cuda) when the work failed.
  void synchronize(milliseconds timeout) const;
  /// Marks the end of work enqueued on `stream` (another stream of the device) that reads the area:
  /// wait_readers() waits for it before the area is written again.
  void read_on(void* stream);
  /// Waits (at most `timeout`, errors as synchronize()) until the work marked by read_on() finished.
  void wait_readers(milliseconds timeout);

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

/// Position-dependent checksum of `bytes` bytes at `p`, identical on every device:
///   sum over 8-byte little-endian words w_k (k from 0) of w_k * (2k + 1), plus, for the tail
///   bytes b_j (j from 0) after the last whole word, b_j * (2j + 3) * 0x100000001b3, plus `bytes`;
///   all modulo 2^64. Order-independent, so a GPU computes it in parallel. For CUDA memory
///   (`dev.kind == cuda`) it runs on that device and waits for the result (a build without CUDA
///   throws errc::invalid_argument). Used by the bench and the tests to compare the two sides.
std::uint64_t checksum(const void* p, std::uint64_t bytes, device dev = device::cpu());

}  // namespace refit::copy
