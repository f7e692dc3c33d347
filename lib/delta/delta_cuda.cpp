#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "copy/cuda_check.hpp"
#include "copy/cuda_handles.hpp"
#include "delta/device.hpp"
#include "delta/diff_kernel.hpp"
#include "refit/error.hpp"

namespace refit::delta::cuda {
namespace {

cudaStream_t as_stream(void* s) noexcept { return static_cast<cudaStream_t>(s); }

}  // namespace

struct workspace::impl {
  refit::cuda::device_buffer terms{sizeof(unsigned long long)};
  std::array<refit::cuda::device_buffer, 4> slots;
  // The last count()'s group: its spans (host copy for write()), each tensor's first span (and one
  // past the last), each span's changed elements.
  std::vector<kernel::span_desc> spans;
  std::vector<std::size_t> first_span;
  std::vector<std::uint64_t> changes;
  // Grown, never shrunk (see grow()).
  refit::cuda::pinned_buffer host_spans;  ///< the span list, uploaded from here
  refit::cuda::device_buffer device_spans;
  refit::cuda::device_buffer counts;       ///< u32 per chunk of the group
  refit::cuda::device_buffer firsts;       ///< u32 per chunk: its first slot in its span's patch
  refit::cuda::device_buffer totals;       ///< u64 per span: its changed elements
  refit::cuda::pinned_buffer host_totals;  ///< read back here
  /// A count() threw between its upload and its wait: the upload from host_spans may be in flight.
  bool in_flight = false;
  /// Writes queued by write(), not launched yet, and their stream.
  kernel::write_list pending;
  cudaStream_t pending_stream = nullptr;
  /// Applies queued by apply(), not launched yet, and their stream.
  kernel::apply_list applies;
  cudaStream_t applies_stream = nullptr;
};

workspace::workspace(int device) : device_(device) {
  device_guard guard(device);
  // Loaded now rather than at their first launch, in the middle of a refit (see kernel::load_all).
  check_cuda(kernel::load_all(), [&] { return fmt::format("loading refit's delta kernels on device {}", device); });
  impl_ = new impl;
  check_cuda(cudaMemset(impl_->terms.handle(), 0, sizeof(unsigned long long)), "delta workspace: cudaMemset");
}

workspace::~workspace() {
  try {
    device_guard guard(device_);
    delete impl_;
  } catch (...) {
    delete impl_;
  }
}

unsigned long long* workspace::terms() noexcept { return static_cast<unsigned long long*>(impl_->terms.handle()); }

std::uint64_t workspace::take_terms(void* stream) {
  device_guard guard(device_);
  launch_writes(*this);
  launch_applies(*this);
  unsigned long long t = 0;
  check_cuda(cudaMemcpyAsync(&t, terms(), sizeof t, cudaMemcpyDeviceToHost, as_stream(stream)), "delta: reading terms");
  check_cuda(cudaMemsetAsync(terms(), 0, sizeof t, as_stream(stream)), "delta: zeroing terms");
  check_cuda(cudaStreamSynchronize(as_stream(stream)), "delta: cudaStreamSynchronize");
  return t;
}

void workspace::discard_writes() noexcept {
  impl_->pending.n = 0;
  impl_->pending.first[0] = 0;
  impl_->applies.n = 0;
  impl_->applies.first[0] = 0;
}

void* workspace::scratch(int slot, std::uint64_t bytes) {
  auto& b = impl_->slots.at(static_cast<std::size_t>(slot));
  if (b.bytes() < bytes) {
    device_guard guard(device_);
    b = refit::cuda::device_buffer(std::max<std::uint64_t>(bytes, 256));
  }
  return b.handle();
}

std::span<const std::uint64_t> workspace::changes(std::size_t i) const {
  if (i + 1 >= impl_->first_span.size())
    throw error(errc::internal, fmt::format("delta: changes of tensor {} of a group of {}", i,
                                            impl_->first_span.empty() ? 0 : impl_->first_span.size() - 1));
  return std::span<const std::uint64_t>(impl_->changes)
      .subspan(impl_->first_span[i], impl_->first_span[i + 1] - impl_->first_span[i]);
}

namespace {

/// Makes `b` hold at least `bytes` (twice what it held when it must grow, so that a growing group
/// reallocates rarely). The memory it replaces may still be read by work queued on `stream` (the
/// last group's writes read the slots): that work is waited for first.
template <typename Buffer>
void grow(Buffer& b, std::uint64_t bytes, cudaStream_t stream) {
  if (b.bytes() >= bytes) return;
  if (b) check_cuda(cudaStreamSynchronize(stream), "delta: cudaStreamSynchronize before growing the scratch");
  b = Buffer(std::max<std::uint64_t>({bytes, 2 * b.bytes(), 256}));
}

/// Appends the spans of `span` bytes of `bytes` bytes at `base` and `next` (tensor byte `off` of a
/// tensor of `total` bytes) to the group; returns its chunks after them.
std::uint64_t add_spans(std::vector<kernel::span_desc>& spans, std::byte* base, const std::byte* next,
                        std::uint64_t bytes, std::uint64_t span, std::size_t item, std::uint64_t off,
                        std::uint64_t total, std::uint64_t chunks) {
  for (std::uint64_t at = 0; at < bytes; at += span) {
    const std::uint64_t elements = std::min(span, bytes - at) / item;
    if (elements > 0xffffffffull)
      throw error(
          errc::invalid_argument,
          fmt::format("delta: a span of {} elements: a patch indexes at most 2^32 - 1 (use smaller spans)", elements));
    kernel::span_desc d;
    d.base = base + at;
    d.next = next + at;
    d.elements = elements;
    d.first_chunk = chunks;
    d.chunks = (elements + kernel::chunk_elements - 1) / kernel::chunk_elements;
    d.off = off + at;
    d.total = total;
    d.item = static_cast<std::uint32_t>(item);
    spans.push_back(d);
    chunks += d.chunks;
  }
  return chunks;
}

/// Pass 1 over the group in the workspace (its spans and first_span set): uploads the span list,
/// counts and scans on the device, reads every span's total with one copy and one wait.
void count_group(workspace& ws, std::uint64_t chunks, cudaStream_t stream) {
  workspace::impl& st = ws.state();
  const std::uint64_t n = st.spans.size();
  st.changes.assign(n, 0);
  if (n == 0) return;
  if (st.in_flight) check_cuda(cudaStreamSynchronize(stream), "delta: cudaStreamSynchronize after a failed count");
  st.in_flight = false;
  const std::uint64_t list_bytes = n * sizeof(kernel::span_desc);
  grow(st.host_spans, list_bytes, stream);
  grow(st.device_spans, list_bytes, stream);
  grow(st.counts, chunks * 4, stream);
  grow(st.firsts, chunks * 4, stream);
  grow(st.totals, n * 8, stream);
  grow(st.host_totals, n * 8, stream);
  // The last group's upload from host_spans finished before its count returned (its wait).
  std::memcpy(st.host_spans.handle(), st.spans.data(), list_bytes);
  st.in_flight = true;
  auto* spans = static_cast<kernel::span_desc*>(st.device_spans.handle());
  check_cuda(cudaMemcpyAsync(spans, st.host_spans.handle(), list_bytes, cudaMemcpyHostToDevice, stream),
             "delta: uploading the span list");
  auto* totals = static_cast<unsigned long long*>(st.totals.handle());
  check_cuda(kernel::launch_count(spans, n, chunks, static_cast<std::uint32_t*>(st.counts.handle()),
                                  static_cast<std::uint32_t*>(st.firsts.handle()), totals, stream),
             "delta count kernel launch");
  check_cuda(cudaMemcpyAsync(st.host_totals.handle(), totals, n * 8, cudaMemcpyDeviceToHost, stream),
             "delta: reading the spans' counts");
  check_cuda(cudaStreamSynchronize(stream), "delta: cudaStreamSynchronize");
  st.in_flight = false;
  std::memcpy(st.changes.data(), st.host_totals.handle(), n * 8);
}

}  // namespace

void count(std::span<const diff_tensor> tensors, std::uint64_t span, workspace& ws, void* stream) {
  device_guard guard(ws.device());
  launch_writes(ws);  // the last group's: they read the slots this count overwrites
  workspace::impl& st = ws.state();
  st.spans.clear();
  st.first_span.clear();
  if (span == 0) throw error(errc::invalid_argument, "delta: spans of 0 bytes");
  std::uint64_t chunks = 0;
  for (const diff_tensor& t : tensors) {
    st.first_span.push_back(st.spans.size());
    chunks = add_spans(st.spans, t.base, t.next, t.total, span, t.item, 0, t.total, chunks);
  }
  st.first_span.push_back(st.spans.size());
  count_group(ws, chunks, as_stream(stream));
}

void write(std::size_t i, std::size_t k, std::byte* out, std::uint64_t weight, workspace& ws, void* stream) {
  workspace::impl& st = ws.state();
  const std::uint64_t n = ws.changes(i).size();
  if (k >= n) throw error(errc::internal, fmt::format("delta: span {} of tensor {}, which has {}", k, i, n));
  const std::size_t s = st.first_span[i] + k;
  const kernel::span_desc& d = st.spans[s];
  if (d.chunks == 0) return;
  kernel::write_list& l = st.pending;
  if (l.n == kernel::max_writes || (l.n != 0 && st.pending_stream != as_stream(stream))) launch_writes(ws);
  kernel::write_desc& w = l.at[l.n];
  w.base = d.base;
  w.next = d.next;
  w.elements = d.elements;
  w.firsts = static_cast<const std::uint32_t*>(st.firsts.handle()) + d.first_chunk;
  // The patch's values follow its indices: its size is the span's count, which the caller placed.
  w.indices = out != nullptr ? reinterpret_cast<std::uint32_t*>(out) : nullptr;
  w.values = out != nullptr ? out + 4 * st.changes[s] : nullptr;
  w.off = d.off;
  w.total = d.total;
  w.weight = weight;
  w.item = d.item;
  l.first[l.n + 1] = l.first[l.n] + d.chunks;
  l.n += 1;
  st.pending_stream = as_stream(stream);
}

void launch_writes(workspace& ws) {
  kernel::write_list& l = ws.state().pending;
  if (l.n == 0) return;
  device_guard guard(ws.device());
  const cudaError_t status = kernel::launch_writes(l, ws.terms(), ws.state().pending_stream);
  ws.discard_writes();
  check_cuda(status, "delta write kernel launch");
}

void check(std::span<const patch_ref> patches, workspace& ws, void* stream) {
  if (patches.empty()) return;
  device_guard guard(ws.device());
  auto* bad = static_cast<unsigned int*>(ws.scratch(3, patches.size() * sizeof(unsigned int)));
  check_cuda(cudaMemsetAsync(bad, 0, patches.size() * sizeof(unsigned int), as_stream(stream)), "delta: cudaMemset");
  // Up to kernel::max_checks patches a launch (a batch's are usually one launch).
  kernel::check_list list;
  std::size_t from = 0;
  const auto launch = [&] {
    check_cuda(kernel::launch_check(list, bad + from, as_stream(stream)), "delta check kernel launch");
    from += list.n;
    list.n = 0;
  };
  for (std::size_t k = 0; k < patches.size(); ++k) {
    const patch_ref& p = patches[k];
    if (p.bytes % record_bytes(p.item) != 0)
      throw error(errc::apply, fmt::format("the patch of '{}' has {} bytes, not whole {}-byte records", p.name, p.bytes,
                                           record_bytes(p.item)));
    if (list.n == kernel::max_checks) launch();
    const std::uint64_t records = p.bytes / record_bytes(p.item);
    list.at[list.n] = kernel::check_desc{reinterpret_cast<const std::uint32_t*>(p.data), records, p.span / p.item};
    list.first[list.n + 1] = list.first[list.n] + kernel::check_tiles(records);
    list.n += 1;
  }
  launch();
  std::vector<unsigned int> host(patches.size());
  check_cuda(
      cudaMemcpyAsync(host.data(), bad, host.size() * sizeof(unsigned int), cudaMemcpyDeviceToHost, as_stream(stream)),
      "delta: reading the checks");
  check_cuda(cudaStreamSynchronize(as_stream(stream)), "delta: cudaStreamSynchronize");
  for (std::size_t k = 0; k < patches.size(); ++k)
    if (host[k] != 0)
      throw error(errc::apply, fmt::format("the patch of '{}' is corrupt: an index is out of its span of {} elements "
                                           "or not after the one before; nothing of its batch was written",
                                           patches[k].name, patches[k].span / patches[k].item));
}

void apply(const patch_ref& patch, std::uint64_t off, std::uint64_t total, std::byte* dest, std::uint64_t weight,
           workspace& ws, void* stream, apply_mode mode) {
  const std::uint64_t n = patch.bytes / record_bytes(patch.item);
  if (n == 0) return;
  workspace::impl& st = ws.state();
  kernel::apply_list& l = st.applies;
  if (l.n == kernel::max_applies || (l.n != 0 && st.applies_stream != as_stream(stream))) launch_applies(ws);
  l.at[l.n] = kernel::apply_desc{reinterpret_cast<const std::uint32_t*>(patch.data),
                                 patch.data + 4 * n,
                                 n,
                                 dest,
                                 off,
                                 total,
                                 weight,
                                 static_cast<std::uint32_t>(patch.item),
                                 mode == apply_mode::terms_only   ? kernel::apply_no_store
                                 : mode == apply_mode::store_only ? kernel::apply_no_terms
                                                                  : 0u};
  l.first[l.n + 1] = l.first[l.n] + kernel::check_tiles(n);
  l.n += 1;
  st.applies_stream = as_stream(stream);
}

void launch_applies(workspace& ws) {
  workspace::impl& st = ws.state();
  kernel::apply_list& l = st.applies;
  if (l.n == 0) return;
  device_guard guard(ws.device());
  const cudaError_t status = kernel::launch_apply(l, ws.terms(), st.applies_stream);
  l.n = 0;
  l.first[0] = 0;
  check_cuda(status, "delta apply kernel launch");
}

void add_range_terms(const std::byte* p, std::uint64_t off, std::uint64_t n, std::uint64_t total, std::uint64_t weight,
                     bool negate, workspace& ws, void* stream) {
  device_guard guard(ws.device());
  check_cuda(kernel::launch_range_terms(p, off, n, total, weight, negate, ws.terms(), as_stream(stream)),
             "delta range-terms kernel launch");
}

diff_result diff(std::byte* base, const std::byte* next, std::uint64_t off, std::uint64_t span, std::size_t item,
                 std::uint64_t total, std::byte* out, int device) {
  workspace ws(device);
  diff_result r;
  if (span / item == 0) return r;
  device_guard guard(device);
  // One span at tensor byte `off`: a group of one span, whose terms are those of the real tensor.
  workspace::impl& st = ws.state();
  const std::uint64_t chunks = add_spans(st.spans, base, next, span, span, item, off, total, 0);
  st.first_span = {0, st.spans.size()};
  count_group(ws, chunks, nullptr);
  r.changes = st.changes.at(0);
  write(0, 0, r.changes != 0 ? out : nullptr, 1, ws, nullptr);
  r.terms = ws.take_terms(nullptr);
  return r;
}

std::uint64_t apply(const std::byte* patch, std::uint64_t bytes, std::size_t item, std::uint64_t span,
                    std::uint64_t off, std::uint64_t total, std::byte* dest, int device, std::string_view name) {
  workspace ws(device);
  const patch_ref p{patch, bytes, item, span, std::string(name)};
  check({&p, 1}, ws, nullptr);
  apply(p, off, total, dest, 1, ws, nullptr);
  return ws.take_terms(nullptr);
}

}  // namespace refit::delta::cuda

namespace refit::delta::cuda {
void copy_sync(void* dst, const void* src, std::uint64_t bytes, int device) {
  if (bytes == 0) return;
  device_guard guard(device);
  check_cuda(cudaDeviceSynchronize(), "delta: cudaDeviceSynchronize before copying into the base");
  check_cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "delta: copying a tensor into the base");
}
}  // namespace refit::delta::cuda
