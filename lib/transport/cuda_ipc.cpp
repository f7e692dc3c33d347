// refit — the cuda_ipc transport. See transport.hpp and lib/README.md ("Synchronisation
// without host stalls").
//
// The streamer owns `count` device buffers and two interprocess events per buffer: packed[i],
// recorded on its pack stream after packing buffer i, and applied[i], recorded by the receiver on
// its apply stream after reading buffer i. Each side makes its own stream wait on the other
// side's event before touching a buffer, so nothing here blocks the host except drain().
// Buffers and events are exported once and live as long as the source: a new receiver (a new
// session) maps the same ones again.
#include "transport/registry.hpp"
#include "transport/transport.hpp"
#include "transport/vmm_record.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <optional>
#include <span>
#include <unordered_map>
#include <string>
#include <string_view>
#include <utility>
#include <unordered_set>
#include <vector>

#include "channel/unique_fd.hpp"
#include "copy/cuda_check.hpp"
#include "copy/cuda_handles.hpp"
#include "copy/unique_handle.hpp"
#include "copy/vmm.hpp"
#include "copy/wait.hpp"
#include "model/log.hpp"
#include "refit/error.hpp"

namespace refit::transport {
namespace {

constexpr unsigned int ipc_event_flags = cudaEventDisableTiming | cudaEventInterprocess;
constexpr std::string_view transport_name = "cuda_ipc";
/// How long a receiver spins at END for a direct session's last copies before it sleeps between
/// polls (cuda_ipc_sink::await_writes).
constexpr std::chrono::milliseconds writes_spin{50};
// A receiver's direct offer (its reply to a HELLO asking for session_mode::in_place, granting it)
// carries one "A" + cudaIpcMemHandle_t per allocation, then one "T" + wire::encode_dest() record
// per destination.

/// The allocation that holds `p` (on CUDA device `device`): its base, or nullptr when the driver
/// cannot say.
void* allocation_base(const void* p, int device) {
  try {
    const auto a = copy::cuda_allocation_of(p, device);
    return a ? reinterpret_cast<void*>(a->base) : nullptr;
  } catch (const error&) {
    return nullptr;
  }
}

template <typename T>
std::string raw_bytes(const T& value) {
  return std::string(reinterpret_cast<const char*>(&value), sizeof value);
}

template <typename T>
T from_raw_bytes(const std::string& bytes) {
  T value{};
  std::memcpy(&value, bytes.data(), sizeof value);  // callers checked bytes.size() == sizeof value
  return value;
}

std::string human_bytes(std::uint64_t bytes) {
  if (bytes >= (1ull << 30)) return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1ull << 30));
  if (bytes >= (1ull << 20)) return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1ull << 20));
  return fmt::format("{} bytes", bytes);
}

/// The 16 raw bytes of the device's UUID.
std::string device_uuid(int device) {
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), fmt::format("cudaGetDeviceProperties(device {})", device));
  static_assert(sizeof prop.uuid.bytes == 16);
  return std::string(prop.uuid.bytes, sizeof prop.uuid.bytes);
}

/// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" as nvidia-smi prints it; "unknown" unless 16 bytes.
std::string uuid_text(std::string_view raw) {
  if (raw.size() != 16) return "unknown";
  std::string out = "GPU-";
  for (std::size_t i = 0; i < raw.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    out += fmt::format("{:02x}", static_cast<unsigned char>(raw[i]));
  }
  return out;
}

void close_mapping(void* p) noexcept { (void)cudaIpcCloseMemHandle(p); }

/// Another process's device memory, mapped with cudaIpcOpenMemHandle on the current device.
class ipc_mapping : public unique_handle<void*, close_mapping> {
 public:
  ipc_mapping() noexcept = default;
  /// Throws refit::error(errc::transport) naming `what` and the CUDA error.
  ipc_mapping(const cudaIpcMemHandle_t& handle, std::string_view what) : unique_handle(open(handle, what)) {}

 private:
  static void* open(const cudaIpcMemHandle_t& handle, std::string_view what) {
    void* p = nullptr;
    const cudaError_t status = cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: do not let it surface in an unrelated later check
      throw error(errc::transport,
                  fmt::format("cudaIpcOpenMemHandle({}): {}: {}: this process cannot map the peer's GPU "
                              "memory (different container/GPU visibility?); use host_shm or nccl",
                              what, cudaGetErrorName(status), cudaGetErrorString(status)));
    }
    return p;
  }
};

/// Another process's interprocess event, opened with cudaIpcOpenEventHandle.
class ipc_event : public unique_handle<cudaEvent_t, cuda::detail::destroy_event> {
 public:
  ipc_event() noexcept = default;
  /// Throws refit::error(errc::transport) naming `what` and the CUDA error.
  ipc_event(const cudaIpcEventHandle_t& handle, std::string_view what) : unique_handle(open(handle, what)) {}

 private:
  static cudaEvent_t open(const cudaIpcEventHandle_t& handle, std::string_view what) {
    cudaEvent_t e = nullptr;
    const cudaError_t status = cudaIpcOpenEventHandle(&e, handle);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      throw error(errc::transport,
                  fmt::format("cudaIpcOpenEventHandle({}): {}: {}: the receiver cannot open the streamer's "
                              "CUDA events (different container/GPU visibility?); use host_shm or nccl",
                              what, cudaGetErrorName(status), cudaGetErrorString(status)));
    }
    return e;
  }
};

void check_index(std::size_t i, std::size_t count, std::string_view call) {
  if (i >= count)
    throw error(errc::internal, fmt::format("cuda_ipc {}: buffer {} out of range ({} buffers)", call, i, count));
}

/// How long a streamer waits for room in the descriptor link before packing instead, and either
/// side for the descriptors of VMM memory announced to it.
constexpr std::chrono::seconds fd_send_timeout{10};

/// Memory of the other process mapped here: a cudaIpc mapping, or VMM chunks mapped one after the
/// other (their descriptors came through the lane's link). `bytes` bounds every access to it.
struct peer_memory {
  ipc_mapping ipc;
  copy::vmm::mapping vmm;
  std::uint64_t bytes = 0;
  [[nodiscard]] std::byte* data() const noexcept { return ipc ? static_cast<std::byte*>(ipc.handle()) : vmm.data(); }
};

/// The descriptors of `span`'s chunks, in chunk order, through `link` by `deadline`. Throws
/// refit::error(errc::transport) naming the chunk of `what` whose descriptor did not come.
std::vector<channel::unique_fd> receive_chunks(channel::fd_link& link, const vmm_span& span,
                                               std::chrono::steady_clock::time_point deadline, std::string_view what) {
  std::vector<channel::unique_fd> fds;
  for (std::size_t k = 0; k < span.ids.size(); ++k) {
    fds.emplace_back(link.receive(span.ids[k], deadline));
    if (!fds.back())
      throw error(errc::transport, fmt::format("cuda_ipc: the descriptor of chunk {} of {} of {} (VMM memory) did not "
                                               "come in time: is the other process alive?",
                                               k, span.ids.size(), what));
  }
  return fds;
}

/// `span`'s chunks mapped for `device` from their descriptors (receive_chunks()). Throws like
/// copy::vmm::mapping.
peer_memory map_chunks(const std::vector<channel::unique_fd>& fds, const vmm_span& span, int device) {
  std::vector<int> raw;
  for (const channel::unique_fd& fd : fds) raw.push_back(fd.get());
  peer_memory m;
  m.vmm = copy::vmm::mapping(raw, span.sizes, device);
  m.bytes = span.bytes;
  return m;
}

class cuda_ipc_source final : public source {
 public:
  explicit cuda_ipc_source(const source_options& options)
      : device_(options.device), bytes_(options.bytes), want_direct_(options.direct), timeout_(options.timeout) {
    device_guard guard(device_);
    uuid_ = device_uuid(device_);
    buffers_.reserve(options.count);
    packed_.reserve(options.count);
    applied_.reserve(options.count);
    for (std::size_t i = 0; i < options.count; ++i) {
      try {
        buffers_.emplace_back(bytes_);
      } catch (const error& e) {
        throw error(errc::cuda,
                    fmt::format("cannot allocate cuda_ipc buffer {} of {} ({} of {} bytes) on device {}: {}; use "
                                "a smaller buffer_bytes (or fewer buffers)",
                                i, options.count, human_bytes(bytes_), bytes_, device_, e.what()));
      }
      packed_.emplace_back(ipc_event_flags);
      applied_.emplace_back(ipc_event_flags);
    }
    stream_ = cuda::stream(cudaStreamNonBlocking);
    REFIT_DEBUG("cuda_ipc: {} buffers of {} on device {} ({})", options.count, human_bytes(bytes_), device_,
                uuid_text(uuid_));
  }

  [[nodiscard]] std::string_view name() const noexcept override { return transport_name; }
  [[nodiscard]] std::size_t count() const noexcept override { return buffers_.size(); }
  [[nodiscard]] std::uint64_t buffer_bytes() const noexcept override { return bytes_; }
  [[nodiscard]] std::byte* data(std::size_t i) noexcept override {
    return i < buffers_.size() ? static_cast<std::byte*>(buffers_[i].handle()) : nullptr;
  }
  [[nodiscard]] device where() const noexcept override { return device::cuda(device_); }
  [[nodiscard]] copy::engine engine() const noexcept override { return copy::engine::kernel; }
  [[nodiscard]] void* stream() noexcept override { return stream_.handle(); }

  void open_session(wire::hello& h) override {
    if (exported_.empty()) {
      // Exported once: handles stay valid as long as the allocations and events do.
      device_guard guard(device_);
      std::vector<wire::buffer_desc> descs;
      descs.reserve(buffers_.size());
      for (std::size_t i = 0; i < buffers_.size(); ++i) {
        cudaIpcMemHandle_t memory{};
        cudaIpcEventHandle_t packed{};
        cudaIpcEventHandle_t applied{};
        check_cuda(cudaIpcGetMemHandle(&memory, buffers_[i].handle()),
                   fmt::format("cudaIpcGetMemHandle(buffer {})", i));
        check_cuda(cudaIpcGetEventHandle(&packed, packed_[i].handle()),
                   fmt::format("cudaIpcGetEventHandle(packed[{}])", i));
        check_cuda(cudaIpcGetEventHandle(&applied, applied_[i].handle()),
                   fmt::format("cudaIpcGetEventHandle(applied[{}])", i));
        descs.push_back(wire::buffer_desc{bytes_, raw_bytes(memory), raw_bytes(packed), raw_bytes(applied)});
      }
      exported_ = std::move(descs);
    }
    h.transport = std::string(transport_name);
    h.mode = want_direct_ ? wire::session_mode::in_place : wire::session_mode::buffers;
    h.host_id = host_identity();
    h.peer = process_identity();
    h.device_uuid = uuid_;
    h.buffers = exported_;
  }

  void session_accepted(std::span<const wire::ok> replies) override {
    direct_ = false;
    hand_over_ = false;
    receivers_.clear();
    vmm_held_.clear();
    vmm_announced_.clear();
    vmm_committed_ = false;
    if (replies.empty()) return;
    const auto offered = [](const wire::ok& r) { return r.mode == wire::session_mode::in_place; };
    if (replies.size() > 1) {
      // Several receivers (TP ranks of one host) share no buffer: each is written where it is.
      for (std::size_t k = 0; k < replies.size(); ++k)
        if (!want_direct_ || !offered(replies[k]))
          throw error(errc::invalid_argument,
                      fmt::format("cuda_ipc serves several receivers only by writing straight into their weights, but "
                                  "receiver {} of {} did not offer its parameter table (a callback sink, a table not "
                                  "all in CUDA memory, memory it cannot export, or a stage it could not offer: its log "
                                  "says why): give every receiver a CUDA parameter table, or use nccl",
                                  k, replies.size()));
    } else if (!want_direct_ || !offered(replies.front())) {
      // Staged through the buffers: a receiver on this GPU says so (sink::attach).
      hand_over_ = std::find(replies.front().handles.begin(), replies.front().handles.end(), "G" + uuid_) !=
                   replies.front().handles.end();
      if (hand_over_)
        REFIT_INFO("cuda_ipc: the receiver shares cuda:{}: the two hand the GPU over at each batch", device_);
      return;
    }
    // Each receiver offered its weights: map each allocation once for the session.
    device_guard guard(device_);
    std::vector<receiver_targets> receivers;
    for (std::size_t k = 0; k < replies.size(); ++k) receivers.push_back(map_offer(replies[k], k));
    receivers_ = std::move(receivers);
    elsewhere_ = std::all_of(receivers_.begin(), receivers_.end(), [&](const receiver_targets& r) {
      return !r.gpus.empty() && std::find(r.gpus.begin(), r.gpus.end(), uuid_) == r.gpus.end();
    });
    if (elsewhere_) REFIT_INFO("cuda_ipc: direct session: every destination is on another GPU than cuda:{}", device_);
    direct_ = true;
  }

  [[nodiscard]] bool peers_elsewhere() const noexcept override { return direct_ && elsewhere_; }

  void close_session() noexcept override {
    direct_ = false;
    elsewhere_ = false;
    hand_over_ = false;
    receivers_.clear();  // cudaIpcCloseMemHandle: nothing of a receiver stays mapped
    links_.clear();
    vmm_held_.clear();
    vmm_announced_.clear();
    vmm_committed_ = false;
  }

  [[nodiscard]] bool direct() const noexcept override { return direct_; }

  std::vector<routed> routes(const tensor_meta& meta) override {
    std::vector<routed> out;
    for (std::size_t k = 0; k < receivers_.size(); ++k) {
      const auto it = receivers_[k].targets.find(meta.name);
      const auto whose = [&] {
        return receivers_.size() == 1 ? std::string("the receiver's") : fmt::format("receiver {}'s", k);
      };
      if (it == receivers_[k].targets.end())
        throw error(errc::apply, fmt::format("tensor '{}' is not in {} parameter table (direct cuda_ipc session: "
                                             "nothing was written)",
                                             meta.name, whose()));
      for (target& d : it->second) {
        try {
          out.push_back(routed{static_cast<std::byte*>(d.dest.data), d.routes.get(d.dest, meta.type, meta.shape), 0,
                               d.kernel_only});
        } catch (const error& e) {
          throw error(e.code(), fmt::format("{} ({} destination; direct cuda_ipc session: nothing was written)",
                                            e.what(), whose()));
        }
      }
    }
    return out;
  }

  void disable_direct() noexcept override { want_direct_ = false; }

  void begin_pack(std::size_t i) override {
    check_index(i, buffers_.size(), "begin_pack");
    device_guard guard(device_);
    // Where the receiver shares this GPU, the packing is enqueued only once its reads of the
    // buffer have completed: see the sink's wait_for_packing.
    if (hand_over_) wait_for_reads(i);
    // A never-recorded event is complete: the first pack of each buffer does not wait.
    check_cuda(cudaStreamWaitEvent(stream_.handle(), applied_[i].handle(), 0),
               [&] { return fmt::format("cudaStreamWaitEvent(pack stream, applied[{}])", i); });
  }

  /// Waits until the receiver's reads of buffer i (its applied event) have completed. Throws
  /// errc::timeout past the timeout: a receiver that died or hangs with its reads queued.
  void wait_for_reads(std::size_t i) const {
    if (!device_work_done(
            timeout_, [&] { return cudaEventQuery(applied_[i].handle()); },
            [&] { return fmt::format("cudaEventQuery(applied[{}])", i); }))
      throw error(errc::timeout, fmt::format("the receiver's reads of cuda_ipc buffer {} did not complete within {} "
                                             "ms (is the generation process alive?)",
                                             i, timeout_.count()));
  }

  /// The applied event of buffer i is recorded by the receiver before it replies to the batch.
  [[nodiscard]] bool orders_reuse() const noexcept override { return true; }

  void after(void* producer_stream) override {
    device_guard guard(device_);
    const auto producer = static_cast<cudaStream_t>(producer_stream);
    int producer_device = device_;
    if (producer != nullptr)
      check_cuda(cudaStreamGetDevice(producer, &producer_device), "cudaStreamGetDevice(tensor's producer stream)");
    cudaEvent_t e = next_local_event(producer_device);
    // Recorded on the producer's device (an event must be recorded on a stream of its own
    // device); the pack stream may wait on an event of any device.
    {
      device_guard on_producer(producer_device);
      check_cuda(cudaEventRecord(e, producer), "cudaEventRecord(tensor's producer stream)");
    }
    check_cuda(cudaStreamWaitEvent(stream_.handle(), e, 0), "cudaStreamWaitEvent(pack stream, producer stream)");
  }

  void end_pack(std::size_t i) override {
    check_index(i, buffers_.size(), "end_pack");
    device_guard guard(device_);
    check_cuda(cudaEventRecord(packed_[i].handle(), stream_.handle()),
               [&] { return fmt::format("cudaEventRecord(packed[{}])", i); });
  }

  void drain() override {
    device_guard guard(device_);
    check_cuda(cudaStreamSynchronize(stream_.handle()), "cudaStreamSynchronize(cuda_ipc pack stream)");
  }

  /// packed[0], recorded after every write of the refit, is what each receiver of a direct
  /// session asks at END (cuda_ipc_sink::await_writes): no buffer is packed in such a session
  /// but a delta's, whose reads captured the event's earlier record when they were enqueued.
  bool hand_over_writes() override {
    if (!direct_ || packed_.empty()) return false;
    end_pack(0);
    return true;
  }

  /// An allocation exported once: its range, the driver's id for it and its record (handle,
  /// bytes, id), empty when the driver would not export it.
  struct exported {
    std::uintptr_t base = 0;
    std::uint64_t bytes = 0;
    std::uint64_t id = 0;
    std::string record;
  };

  std::optional<shared> share(const void* p, std::uint64_t bytes, std::vector<std::string>& announce) override {
    if (direct_) return std::nullopt;
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    // A tensor stays valid until the refit returns, so an allocation of this refit cannot be freed
    // and replaced meanwhile: its range is enough to recognise it.
    const auto in = [&](const numbered& n) { return at >= n.base && at - n.base + bytes <= n.bytes; };
    if (last_ != nullptr && in(*last_)) return shared{last_->source, at - last_->base};
    if (auto it = numbered_.upper_bound(at); it != numbered_.begin() && in((--it)->second)) {
      last_ = &it->second;
      return shared{last_->source, at - last_->base};
    }
    const exported* e = known(p, at, bytes);
    if (e == nullptr || e->record.empty()) return share_vmm(p, at, bytes, announce);
    announce.push_back(e->record);
    const std::uint32_t source = ++announced_;
    last_ = &numbered_.insert_or_assign(e->base, numbered{e->base, e->bytes, source}).first->second;
    return shared{source, at - e->base};
  }

  /// An allocation exported before, or now: the one holding [p, p + bytes), or nullptr when the
  /// driver knows none or does not give its identity (a receiver could not tell it from a freed
  /// one at the same address that it still maps). One seen in an earlier refit is the same when
  /// the driver gives it the same id: one driver call instead of two.
  const exported* known(const void* p, std::uintptr_t at, std::uint64_t bytes) {
    try {
      if (auto it = exports_.upper_bound(at); it != exports_.begin()) {
        const exported& e = std::prev(it)->second;
        if (at - e.base + bytes <= e.bytes && copy::cuda_allocation_id(p, device_) == e.id) return &e;
      }
      const std::optional<copy::allocation> a = copy::cuda_allocation_of(p, device_);
      if (!a || a->id == 0 || at - a->base + bytes > a->bytes) return nullptr;
      // What it replaced (freed allocations overlapping it) is forgotten.
      auto lo = exports_.lower_bound(a->base);
      if (lo != exports_.begin() && std::prev(lo)->second.base + std::prev(lo)->second.bytes > a->base) --lo;
      exports_.erase(lo, exports_.lower_bound(a->base + a->bytes));
      if (exports_.size() >= max_exports) exports_.clear();
      exported e{a->base, a->bytes, a->id, {}};
      device_guard guard(device_);
      cudaIpcMemHandle_t handle{};
      const cudaError_t status = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(a->base));
      if (status != cudaSuccess) {
        (void)cudaGetLastError();  // memory the driver will not export (a pool, VMM): packed instead
        REFIT_DEBUG("cuda_ipc: the allocation at {:#x} ({} bytes) cannot be shared ({}): its tensors are packed",
                    a->base, a->bytes, cudaGetErrorName(status));
      } else {
        e.record = raw_bytes(handle) + raw_bytes(a->bytes) + raw_bytes(a->id);
      }
      return &exports_.insert_or_assign(a->base, std::move(e)).first->second;
    } catch (const error&) {
      return nullptr;  // the driver could not say: packed
    }
  }

  void forget_shared() noexcept override {
    numbered_.clear();
    announced_ = 0;
    last_ = nullptr;
    // The receiver keeps mapped exactly what the last refit read (see the sink's end_sources());
    // after a refit that failed, this side cannot tell what that was, so it sends every
    // descriptor again (a receiver that holds a span already just closes them).
    if (!vmm_committed_) vmm_held_.clear();
    vmm_committed_ = false;
    vmm_announced_.clear();
  }

  void refit_committed() noexcept override {
    vmm_held_ = std::move(vmm_announced_);
    vmm_announced_.clear();
    vmm_committed_ = true;
  }

  void link(std::vector<std::shared_ptr<channel::fd_link>> fds) override { links_ = std::move(fds); }

  [[nodiscard]] bool idle() override {
    device_guard guard(device_);
    const cudaError_t status = cudaStreamQuery(stream_.handle());
    if (status == cudaErrorNotReady) return false;
    check_cuda(status, "cudaStreamQuery(cuda_ipc pack stream)");
    return true;
  }

 private:
  /// share() for memory cudaIpc cannot export: VMM chunks (torch's expandable segments), when the
  /// session has a descriptor link. The span is the chunks covering the tensor; their descriptors
  /// go through the link unless the receiver holds the span from the last refit.
  std::optional<shared> share_vmm(const void* p, std::uintptr_t at, std::uint64_t bytes,
                                  std::vector<std::string>& announce) {
    // A buffers session has one receiver (several are written directly).
    const std::shared_ptr<channel::fd_link> link = links_.size() == 1 ? links_.front() : nullptr;
    if (!link) return std::nullopt;
    const std::optional<std::vector<copy::vmm::chunk>> chunks = copy::vmm::chunks_of(p, bytes, device_);
    if (!chunks || chunks->size() > max_vmm_chunks) return std::nullopt;
    std::string key = encode_vmm_record(*chunks, false);
    const bool held = vmm_held_.contains(key);
    if (!held) {
      const auto deadline = std::chrono::steady_clock::now() + fd_send_timeout;
      for (const copy::vmm::chunk& c : *chunks) {
        const channel::unique_fd fd(copy::vmm::export_fd(c.base, device_));
        if (fd.get() < 0 || !link->send(c.id, fd.get(), deadline)) {
          // What was sent of this span is skipped by the receiver (another tag comes first).
          REFIT_DEBUG("cuda_ipc: the VMM chunk at {:#x} ({} bytes) cannot be {}: its tensors are packed", c.base,
                      c.bytes, fd.get() < 0 ? "exported" : "sent to the receiver");
          return std::nullopt;
        }
      }
    }
    announce.push_back(held ? key : encode_vmm_record(*chunks, true));
    vmm_announced_.insert(std::move(key));
    const std::uintptr_t base = chunks->front().base;
    std::uint64_t total = 0;
    for (const copy::vmm::chunk& c : *chunks) total += c.bytes;
    const std::uint32_t source = ++announced_;
    last_ = &numbered_.insert_or_assign(base, numbered{base, total, source}).first->second;
    return shared{source, at - base};
  }

  /// The session's descriptor links, one per receiver (null: none; VMM memory is packed, VMM
  /// weights offered are staged into).
  std::vector<std::shared_ptr<channel::fd_link>> links_;
  /// VMM spans (their records' keys) the receiver holds: those the last committed refit read.
  std::set<std::string> vmm_held_;
  std::set<std::string> vmm_announced_;  ///< by the refit in progress
  bool vmm_committed_ = false;           ///< the last refit was committed (refit_committed())

  /// An allocation shared in this refit: its range and its number (wire::entry::source).
  struct numbered {
    std::uintptr_t base = 0;
    std::uint64_t bytes = 0;
    std::uint32_t source = 0;
  };
  /// By base (a later span from the same chunk replaces an earlier one: entries keep its number).
  std::map<std::uintptr_t, numbered> numbered_;
  std::uint32_t announced_ = 0;     ///< sources announced in this refit (the last one's number)
  const numbered* last_ = nullptr;  ///< the last one a tensor was found in
  /// By base. Bounded: forgotten wholesale past max_exports.
  std::map<std::uintptr_t, exported> exports_;
  static constexpr std::size_t max_exports = 1u << 16;

  /// Events that order the pack stream after producer streams, round robin per device. Waiting
  /// captures the event's state at the time of the call, so re-recording one is always safe; a
  /// few of them merely keep that independent of how the runtime implements it.
  cudaEvent_t next_local_event(int device) {
    auto& pool = pools_[device];
    if (!pool.events[0]) {
      device_guard on(device);
      for (auto& e : pool.events) e = cuda::event(cudaEventDisableTiming);
    }
    const cudaEvent_t e = pool.events[pool.next].handle();
    pool.next = (pool.next + 1) % pool.events.size();
    return e;
  }

  struct event_pool {
    std::array<cuda::event, 4> events;
    std::size_t next = 0;
  };

  int device_;
  std::uint64_t bytes_;
  bool want_direct_;
  bool direct_ = false;
  /// One receiver of a direct session: its weight allocations, mapped here, and its destinations
  /// by source name (their data in those mappings).
  /// One destination of a receiver, with its runs (computed once per session, not once per refit).
  struct target {
    plan::destination dest;
    plan::route_cache routes;
    bool kernel_only = false;  ///< in a cudaMalloc allocation larger than copy::engines_slow_above
  };
  struct receiver_targets {
    std::vector<std::string> gpus;    ///< the UUIDs of the GPUs its weights are on (its offer's 'G' record)
    std::vector<peer_memory> mapped;  ///< the allocations of its weights: every destination lies inside one
    std::unordered_map<std::string, std::vector<target>> targets;
  };
  std::vector<receiver_targets> receivers_;  ///< direct sessions: one per receiver, in order
  bool elsewhere_ = false;                   ///< peers_elsewhere(), set when the session's offers are mapped
  bool hand_over_ = false;  ///< a staged session whose receiver shares this GPU (begin_pack waits on the host)
  milliseconds timeout_;

  /// Maps what one receiver's direct offer describes (must be under a device_guard).
  receiver_targets map_offer(const wire::ok& reply, std::size_t receiver) const {
    receiver_targets out;
    std::size_t count = 0;
    for (std::size_t k = 0; k < reply.handles.size(); ++k) {
      const std::string& rec = reply.handles[k];
      if (rec.size() == 1 + sizeof(cudaIpcMemHandle_t) && rec[0] == 'A') {
        peer_memory m;
        m.ipc = ipc_mapping(from_raw_bytes<cudaIpcMemHandle_t>(rec.substr(1)),
                            fmt::format("allocation {} of the receiver's weights", out.mapped.size()));
        // The mapping's own size bounds every destination, whatever the records claim.
        std::optional<copy::allocation> a;
        try {
          a = copy::cuda_allocation_of(m.ipc.handle(), device_);
        } catch (const error&) {
        }
        if (!a || a->base != reinterpret_cast<std::uintptr_t>(m.ipc.handle()))
          throw error(errc::transport, fmt::format("direct offer: the driver cannot say how large allocation {} of "
                                                   "the receiver's weights is",
                                                   out.mapped.size()));
        m.bytes = a->bytes;
        out.mapped.push_back(std::move(m));
        continue;
      }
      if (!rec.empty() && rec[0] == 'G') {  // the UUIDs of the GPUs the weights are on
        if ((rec.size() - 1) % 16 != 0)
          throw error(errc::protocol,
                      fmt::format("direct offer: GPU record {} of {} bytes is malformed", k, rec.size()));
        for (std::size_t at = 1; at < rec.size(); at += 16) out.gpus.push_back(rec.substr(at, 16));
        continue;
      }
      if (!rec.empty() && rec[0] == 'V') {
        out.mapped.push_back(map_vmm_weights(std::string(rec.substr(1)), out.mapped.size(),
                                             receiver < links_.size() ? links_[receiver].get() : nullptr));
        continue;
      }
      if (rec.empty() || rec[0] != 'T')
        throw error(errc::protocol, fmt::format("direct offer: record {} of {} bytes is malformed", k, rec.size()));
      wire::dest_record r;
      try {
        r = wire::decode_dest(std::string_view(rec).substr(1));
      } catch (const error& e) {
        throw error(errc::protocol, fmt::format("direct offer: record {}: {}", k, e.what()));
      }
      plan::destination d = destination_of(r, device::cuda(device_));
      bool kernel_only = false;
      if (r.allocation != wire::dest_record::no_allocation) {  // none: nothing to write
        if (r.allocation >= out.mapped.size())
          throw error(errc::protocol, fmt::format("direct offer: tensor record {} names allocation {} of {}", k,
                                                  r.allocation, out.mapped.size()));
        const peer_memory& m = out.mapped[r.allocation];
        std::uint64_t extent = 0;
        try {
          extent = plan::check_view(d).bytes;
        } catch (const error& e) {
          throw error(errc::protocol, fmt::format("direct offer: record {}: {}", k, e.what()));
        }
        std::uint64_t last = 0;
        if (__builtin_add_overflow(r.offset, extent, &last) || last > m.bytes)
          throw error(errc::protocol, fmt::format("direct offer: '{}' spans bytes [{}, {}) of allocation {}, which has "
                                                  "{}",
                                                  r.name, r.offset, r.offset + extent, r.allocation, m.bytes));
        d.data = m.data() + r.offset;
        kernel_only = m.ipc.handle() != nullptr && m.bytes > copy::engines_slow_above;
      }
      out.targets[d.meta.name].push_back(target{std::move(d), {}, kernel_only});
      ++count;
    }
    REFIT_INFO("cuda_ipc: direct session: {} destinations of {} tensors in {} allocations of a receiver's weights",
               count, out.targets.size(), out.mapped.size());
    return out;
  }

  /// A "V" record of a direct offer: VMM weights of the receiver, whose chunks' descriptors follow
  /// the offer through the lane's link. Throws refit::error (protocol for a malformed record,
  /// transport when there is no link, a descriptor does not come or the chunks cannot be mapped:
  /// the streamer then stages instead).
  peer_memory map_vmm_weights(const std::string& record, std::size_t index, channel::fd_link* link) const {
    const std::string what = fmt::format("allocation {} of the receiver's weights", index);
    const vmm_span span = decode_vmm_record(record, what);
    if (link == nullptr)
      throw error(errc::transport, fmt::format("{} is VMM memory, whose descriptors come through the control lane, and "
                                               "this session has none",
                                               what));
    return map_chunks(receive_chunks(*link, span, std::chrono::steady_clock::now() + fd_send_timeout, what), span,
                      device_);
  }
  std::string uuid_;
  std::vector<cuda::device_buffer> buffers_;
  std::vector<cuda::event> packed_;
  std::vector<cuda::event> applied_;
  std::map<int, event_pool> pools_;
  std::vector<wire::buffer_desc> exported_;
  cuda::stream stream_;  // last member: destroyed first, before the memory its work touches
};

class cuda_ipc_sink final : public sink {
 public:
  cuda_ipc_sink(int device, milliseconds timeout) : device_(device), timeout_(timeout) {}
  ~cuda_ipc_sink() override { detach(); }
  cuda_ipc_sink(const cuda_ipc_sink&) = delete;
  cuda_ipc_sink& operator=(const cuda_ipc_sink&) = delete;

  [[nodiscard]] std::string_view name() const noexcept override { return transport_name; }

  void attach(const wire::hello& h, wire::ok& reply) override {
    detach();
    if (h.transport != transport_name)
      throw error(errc::protocol,
                  fmt::format("a HELLO for transport '{}' reached the cuda_ipc receiver side", h.transport));
    const std::string local_host = host_identity();
    if (h.host_id != local_host)
      throw error(errc::transport,
                  fmt::format("cuda_ipc needs both processes on one host (streamer on {}, receiver on {}): use the "
                              "nccl transport",
                              h.host_id, local_host));
    if (h.buffers.empty()) throw error(errc::protocol, "cuda_ipc HELLO announces no buffers");
    for (std::size_t i = 0; i < h.buffers.size(); ++i) {
      const wire::buffer_desc& b = h.buffers[i];
      if (b.handle.size() != sizeof(cudaIpcMemHandle_t) || b.packed_event.size() != sizeof(cudaIpcEventHandle_t) ||
          b.applied_event.size() != sizeof(cudaIpcEventHandle_t))
        throw error(
            errc::protocol,
            fmt::format("cuda_ipc HELLO buffer {}: handle sizes {}/{}/{} bytes (memory/packed/applied), "
                        "expected {}/{}/{}",
                        i, b.handle.size(), b.packed_event.size(), b.applied_event.size(), sizeof(cudaIpcMemHandle_t),
                        sizeof(cudaIpcEventHandle_t), sizeof(cudaIpcEventHandle_t)));
      if (b.bytes == 0) throw error(errc::protocol, fmt::format("cuda_ipc HELLO buffer {} has 0 bytes", i));
    }

    // Left current on purpose: the receiver's thread applies on this device, and a batch callback
    // may launch kernels on stream(), which must belong to the current device.
    check_cuda(cudaSetDevice(device_), fmt::format("cudaSetDevice({}) (receiver_options.device)", device_));
    const std::string own_uuid = device_uuid(device_);
    // Everything is built in locals and moved in at the end: a failure unmaps what was mapped.
    std::vector<ipc_mapping> maps;
    std::vector<std::uint64_t> sizes;
    std::vector<ipc_event> packed;
    std::vector<ipc_event> applied;
    maps.reserve(h.buffers.size());
    sizes.reserve(h.buffers.size());
    packed.reserve(h.buffers.size());
    applied.reserve(h.buffers.size());
    for (std::size_t i = 0; i < h.buffers.size(); ++i) {
      const wire::buffer_desc& b = h.buffers[i];
      maps.emplace_back(from_raw_bytes<cudaIpcMemHandle_t>(b.handle),
                        fmt::format("buffer {} of {} from {}", i, human_bytes(b.bytes), h.peer));
      // The mapping's own size bounds every read of the buffer, whatever HELLO claims: a read past
      // it would be an illegal address, which ends the engine's CUDA context.
      std::optional<copy::allocation> a;
      try {
        a = copy::cuda_allocation_of(maps.back().handle(), device_);
      } catch (const error&) {
      }
      if (!a || a->base != reinterpret_cast<std::uintptr_t>(maps.back().handle()) || a->bytes < b.bytes)
        throw error(errc::transport, fmt::format("cuda_ipc HELLO buffer {}: announced as {} bytes, but the memory its "
                                                 "handle maps has {} bytes; refused before anything was read",
                                                 i, b.bytes, a ? a->bytes : 0));
      sizes.push_back(b.bytes);
      packed.emplace_back(from_raw_bytes<cudaIpcEventHandle_t>(b.packed_event), fmt::format("packed[{}]", i));
      applied.emplace_back(from_raw_bytes<cudaIpcEventHandle_t>(b.applied_event), fmt::format("applied[{}]", i));
    }
    cuda::stream stream(cudaStreamNonBlocking);

    maps_ = std::move(maps);
    sizes_ = std::move(sizes);
    packed_ = std::move(packed);
    applied_ = std::move(applied);
    stream_ = std::move(stream);
    same_gpu_ = h.device_uuid == own_uuid;
    // The GPU this receiver reads on: a streamer on the same one hands it over at each batch
    // (wait_for_packing). A direct offer replaces the records with its own.
    reply.handles = {"G" + own_uuid};
    attached_ = true;
    REFIT_INFO("cuda_ipc: mapped {} buffers from {} on device {}: {} (streamer {}, receiver {})", maps_.size(), h.peer,
               device_, h.device_uuid == own_uuid ? "same GPU" : "peer GPU", uuid_text(h.device_uuid),
               uuid_text(own_uuid));
  }

  bool offer_direct(const wire::hello& h, std::span<const plan::destination> table, wire::ok& reply) override {
    if (h.mode != wire::session_mode::in_place || table.empty()) return false;
    pending_chunks_.clear();
    std::vector<std::string> records;
    std::map<void*, std::uint64_t> allocations;  // base → index
    // Where each destination lies: its allocation's index and its offset there; VMM destinations
    // are placed once every span is known (spans of adjacent chunks merge into one).
    std::vector<std::pair<std::uint64_t, std::uint64_t>> place(table.size(), {wire::dest_record::no_allocation, 0});
    std::vector<std::size_t> in_vmm;
    std::vector<std::uint64_t> extents;                 // of in_vmm's views
    std::map<std::uintptr_t, copy::vmm::chunk> chunks;  // of every VMM destination, by base
    for (std::size_t i = 0; i < table.size(); ++i) {
      const plan::destination& d = table[i];
      const std::uint64_t bytes = d.meta.nbytes();
      if (d.dev.kind != device_kind::cuda ||
          d.meta.name.size() + 64 + 20 * d.meta.shape.size() > wire::max_handle_bytes)
        return decline(fmt::format("'{}' is not in CUDA memory, or its name is too long", d.meta.name));
      if (bytes == 0) continue;
      device_guard on(d.dev.index);
      void* base = allocation_base(d.data, d.dev.index);
      if (base == nullptr) return decline(fmt::format("the allocation of '{}' is unknown to the driver", d.meta.name));
      auto it = allocations.find(base);
      if (it == allocations.end()) {
        cudaIpcMemHandle_t handle{};
        const cudaError_t status = cudaIpcGetMemHandle(&handle, base);
        if (status != cudaSuccess) {
          (void)cudaGetLastError();
          // VMM memory (an engine under torch's expandable segments): its chunks go as descriptors.
          const std::uint64_t extent = plan::check_view(d).bytes;
          const auto mine = link_ ? copy::vmm::chunks_of(d.data, extent, d.dev.index) : std::nullopt;
          if (!mine)
            return decline(fmt::format("cudaIpcGetMemHandle on the allocation of '{}': {}{}", d.meta.name,
                                       cudaGetErrorName(status),
                                       link_ ? "" : " (VMM memory is offered only through a control lane)"));
          for (const copy::vmm::chunk& c : *mine) {
            const auto [at, fresh] = chunks.emplace(c.base, c);
            if (!fresh && (at->second.id != c.id || at->second.bytes != c.bytes))
              return decline(fmt::format("the VMM chunks of '{}' changed while they were looked up", d.meta.name));
          }
          in_vmm.push_back(i);
          extents.push_back(extent);
          continue;
        }
        it = allocations.emplace(base, allocations.size()).first;
        records.push_back("A" + raw_bytes(handle));
      }
      place[i] = {it->second, static_cast<std::uint64_t>(static_cast<const std::byte*>(d.data) -
                                                         static_cast<const std::byte*>(base))};
    }
    if (!in_vmm.empty() && !offer_vmm_spans(table, in_vmm, extents, chunks, allocations.size(), place, records))
      return false;
    for (std::size_t i = 0; i < table.size(); ++i) {
      const plan::destination& d = table[i];
      records.push_back(dest_record_of(d, place[i].first, place[i].second));
    }
    // The GPUs the weights are on (their UUIDs): the streamer's engine choice for writing them.
    std::set<int> gpus;
    for (const plan::destination& d : table)
      if (d.meta.nbytes() != 0) gpus.insert(d.dev.index);
    std::string where = "G";
    for (const int g : gpus) where += device_uuid(g);
    records.push_back(std::move(where));
    reply.handles = std::move(records);
    reply.mode = wire::session_mode::in_place;
    REFIT_INFO("cuda_ipc: offering {} destinations in {} allocations ({} VMM chunks) for direct writes by {}",
               table.size(), allocations.size(), chunks.size(), h.peer);
    return true;
  }

  void after_reply() noexcept override {
    if (pending_chunks_.empty()) return;
    // The streamer connects to the link as soon as it has the OK, and maps the weights before
    // anything else: a streamer that does not come within this bound stages instead.
    const auto deadline = std::chrono::steady_clock::now() + fd_send_timeout;
    std::size_t sent = 0;
    for (const copy::vmm::chunk& c : pending_chunks_) {
      const channel::unique_fd fd(copy::vmm::export_fd(c.base, device_));
      if (!link_ || fd.get() < 0 || !link_->send(c.id, fd.get(), deadline)) break;
      ++sent;
    }
    if (sent != pending_chunks_.size())
      REFIT_WARN(
          "cuda_ipc: sent {} of the {} descriptors of VMM weights (one could not be exported, or the streamer "
          "did not take them): it will stage through the buffers",
          sent, pending_chunks_.size());
    pending_chunks_.clear();
  }

  void detach() noexcept override {
    if (stream_) {
      device_guard_noexcept guard(device_);
      const cudaError_t status = wait_for_stream();
      if (status == cudaErrorNotReady) {
        // The streamer's GPU work never completed (killed mid-refit?). Unmapping memory that
        // queued work may still touch could block or fault: leave this session's mappings and
        // stream behind rather than hang; the next session maps afresh.
        REFIT_WARN("cuda_ipc: the apply stream did not finish within {} ms; abandoning the session's mappings",
                   timeout_.count());
        // Deliberately leaked: its destructors would close mappings under work that may never end.
        (void)new abandoned{std::move(maps_), std::move(sources_), std::move(packed_), std::move(applied_),
                            std::move(stream_)};
      } else if (status != cudaSuccess) {
        (void)cudaGetLastError();
        REFIT_WARN("cuda_ipc: draining the apply stream before unmapping failed: {}: {}", cudaGetErrorName(status),
                   cudaGetErrorString(status));
      }
    }
    link_.reset();
    pending_chunks_.clear();
    numbered_.clear();
    sources_.clear();
    maps_.clear();
    sizes_.clear();
    packed_.clear();
    applied_.clear();
    stream_ = cuda::stream();
    attached_ = false;
    same_gpu_ = false;
  }

  [[nodiscard]] bool attached() const noexcept override { return attached_; }
  [[nodiscard]] std::size_t count() const noexcept override { return maps_.size(); }
  [[nodiscard]] std::uint64_t buffer_bytes(std::size_t i) const noexcept override {
    return i < sizes_.size() ? sizes_[i] : 0;
  }
  [[nodiscard]] const std::byte* data(std::size_t i) const noexcept override {
    return i < maps_.size() ? static_cast<const std::byte*>(maps_[i].handle()) : nullptr;
  }
  [[nodiscard]] device where() const noexcept override { return device::cuda(device_); }
  [[nodiscard]] copy::engine engine() const noexcept override { return copy::engine::kernel; }
  [[nodiscard]] void* stream() noexcept override { return stream_.handle(); }
  [[nodiscard]] bool asynchronous() const noexcept override { return true; }

  void begin_read(std::size_t i) override {
    check_index(i, maps_.size(), "begin_read");
    device_guard guard(device_);
    if (same_gpu_) wait_for_packing(i);
    check_cuda(cudaStreamWaitEvent(stream_.handle(), packed_[i].handle(), 0),
               [&] { return fmt::format("cudaStreamWaitEvent(apply stream, packed[{}])", i); });
  }

  void end_read(std::size_t i) override {
    check_index(i, maps_.size(), "end_read");
    device_guard guard(device_);
    check_cuda(cudaEventRecord(applied_[i].handle(), stream_.handle()),
               [&] { return fmt::format("cudaEventRecord(applied[{}])", i); });
  }

  [[nodiscard]] bool maps_sources() const noexcept override { return true; }

  void link(std::shared_ptr<channel::fd_link> fds) override { link_ = std::move(fds); }

  void map_sources(std::span<const std::string> records) override {
    constexpr std::size_t record_bytes = sizeof(cudaIpcMemHandle_t) + 2 * sizeof(std::uint64_t);
    for (const std::string& record : records) {
      const std::size_t index = numbered_.size() + 1;
      if (record.size() != record_bytes && is_vmm_record(record)) {
        map_vmm(record, index);
        continue;
      }
      if (record.size() != record_bytes)
        throw error(errc::protocol, fmt::format("cuda_ipc: source {} is a record of {} bytes, expected {}", index,
                                                record.size(), record_bytes));
      auto it = sources_.find(record);
      if (it == sources_.end()) {
        if (sources_.size() >= max_sources)
          throw error(errc::protocol, fmt::format("cuda_ipc: the streamer announces more than {} allocations to "
                                                  "read in place",
                                                  max_sources));
        device_guard guard(device_);
        ipc_mapping map(from_raw_bytes<cudaIpcMemHandle_t>(record.substr(0, sizeof(cudaIpcMemHandle_t))),
                        fmt::format("source {} (an allocation holding the streamer's tensors)", index));
        const auto claimed = from_raw_bytes<std::uint64_t>(record.substr(sizeof(cudaIpcMemHandle_t), 8));
        // The mapping's own size bounds every read, whatever the record claims.
        std::optional<copy::allocation> a;
        try {
          a = copy::cuda_allocation_of(map.handle(), device_);
        } catch (const error&) {
        }
        if (!a || a->base != reinterpret_cast<std::uintptr_t>(map.handle()) || a->bytes < claimed)
          throw error(errc::transport, fmt::format("cuda_ipc: source {} maps {} bytes where the streamer announced "
                                                   "{}",
                                                   index, a ? a->bytes : 0, claimed));
        it = sources_
                 .emplace(record, mapped_source{peer_memory{std::move(map), {}, claimed}, false,
                                                a->bytes > copy::engines_slow_above})
                 .first;
      }
      it->second.read = true;
      numbered_.push_back(&it->second);
    }
  }

  [[nodiscard]] const std::byte* source_data(std::uint32_t index, std::uint64_t offset,
                                             std::uint64_t bytes) const override {
    if (index == 0 || index > numbered_.size())
      throw error(errc::protocol,
                  fmt::format("cuda_ipc: an entry reads source {}, but {} were announced", index, numbered_.size()));
    const peer_memory& m = numbered_[index - 1]->mem;
    std::uint64_t last = 0;
    if (__builtin_add_overflow(offset, bytes, &last) || last > m.bytes)
      throw error(errc::protocol, fmt::format("cuda_ipc: an entry reads bytes [{}, {} + {}) of source {}, which has {}",
                                              offset, offset, bytes, index, m.bytes));
    return m.data() + offset;
  }

  /// A trainer's weights in one 16 GB cudaMalloc, read in place by a staged receiver: the copy
  /// engines took llama3-8b's large tensors from it more slowly than the kernel alone
  /// (bench/results/2026-11-29-h200-small-refit-timeline.txt).
  [[nodiscard]] bool source_kernel_only(std::uint32_t index) const noexcept override {
    return index != 0 && index <= numbered_.size() && numbered_[index - 1]->kernel_only;
  }

  void end_sources() noexcept override {
    if (numbered_.empty()) return;
    numbered_.clear();
    // Work still queued may read any of them (a refit that failed undrained): unmapped later.
    device_guard_noexcept guard(device_);
    const cudaError_t status = stream_ ? cudaStreamQuery(stream_.handle()) : cudaSuccess;
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    std::erase_if(sources_, [](auto& kv) { return !kv.second.read; });  // not read by this refit
    for (auto& [record, m] : sources_) m.read = false;
  }

  void drain() override {
    if (!stream_) return;
    device_guard guard(device_);
    const cudaError_t status = wait_for_stream();
    if (status == cudaErrorNotReady)
      throw error(errc::timeout, fmt::format("the cuda_ipc apply stream did not finish within {} ms: it waits on the "
                                             "streamer's GPU work, which never completed (is the policy process "
                                             "alive?); nothing was committed",
                                             timeout_.count()));
    check_cuda(status, "cudaStreamSynchronize(cuda_ipc apply stream)");
  }

  /// Asks the streamer's event from the host, as wait_for_packing does: a wait enqueued on this
  /// process's stream would make the two contexts time-slice the GPU under the last copies (tried
  /// so, with the apply stream waiting on the event and then drained, qwen2.5-0.5b direct took
  /// 1.28 -> 1.53 ms on the H100). END leaves right after the streamer's last launch, so what is
  /// left to wait for is the copies it had queued (milliseconds at most, as the streamer paces its
  /// launches by the device): spun through, as the streamer's own drain did, not slept.
  void await_writes() override {
    if (packed_.empty()) return;
    device_guard guard(device_);
    if (!packed_complete(0, writes_spin))
      throw error(errc::timeout, fmt::format("the streamer's direct writes did not complete within {} ms (is the "
                                             "policy process alive?); nothing was committed",
                                             timeout_.count()));
  }

 private:
  /// device_guard for noexcept paths: switches when it can, restores, never throws.
  class device_guard_noexcept {
   public:
    explicit device_guard_noexcept(int device) noexcept {
      if (cudaGetDevice(&previous_) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
      }
      if (previous_ != device) switched_ = cudaSetDevice(device) == cudaSuccess;
    }
    ~device_guard_noexcept() {
      if (switched_) (void)cudaSetDevice(previous_);
    }
    device_guard_noexcept(const device_guard_noexcept&) = delete;
    device_guard_noexcept& operator=(const device_guard_noexcept&) = delete;

   private:
    int previous_ = 0;
    bool switched_ = false;
  };

  /// On the streamer's own GPU, the reads of buffer i are enqueued only once its packing has
  /// completed. The two processes' contexts time-slice that GPU, and a context whose stream waits
  /// on the other's event keeps the GPU until its time slice ends: reads queued behind the next
  /// batch's packing held it ~2 ms after every pair of batches, so a staged llama3-8b took 158 ms
  /// where the device needs 15 (bench/results/2026-11-29-h200-staged-same-gpu.txt). A stream with
  /// nothing left to run hands the GPU back at once. Throws errc::timeout when the packing does
  /// not complete within the timeout (a streamer that died or hangs with work queued).
  void wait_for_packing(std::size_t i) const {
    if (!packed_complete(i))
      throw error(errc::timeout, fmt::format("the streamer's packing of cuda_ipc buffer {} did not complete within "
                                             "{} ms (is the policy process alive?); nothing was committed",
                                             i, timeout_.count()));
  }

  /// Asks packed[i] from the host until it has completed (true) or the timeout has passed (false),
  /// spinning `spin` before it sleeps between asks (copy/wait.hpp).
  bool packed_complete(std::size_t i, std::chrono::milliseconds spin = backoff::default_spin) const {
    return device_work_done(
        timeout_, [&] { return cudaEventQuery(packed_[i].handle()); },
        [&] { return fmt::format("cudaEventQuery(packed[{}])", i); }, spin);
  }

  /// Waits for the apply stream, at most `timeout_` (a peer that died with work queued must not
  /// hang this process): cudaSuccess, an error, or cudaErrorNotReady when time ran out.
  cudaError_t wait_for_stream() const noexcept {
    cudaError_t status = cudaErrorNotReady;
    (void)poll_until(deadline::after(timeout_), [&] {
      status = cudaStreamQuery(stream_.handle());
      return status != cudaErrorNotReady;
    });
    return status;
  }

  /// An allocation of the streamer that entries read in place, mapped here.
  struct mapped_source {
    peer_memory mem;
    bool read = false;         ///< by the refit in progress (or the last one)
    bool kernel_only = false;  ///< a cudaMalloc allocation the copy engines read slowly (source_kernel_only)
  };

  /// map_sources() of a VMM record: the span is mapped from the descriptors that follow through the
  /// link, or found among those the last refit read (the streamer keeps the same account).
  void map_vmm(const std::string& record, std::size_t index) {
    const std::string what = fmt::format("source {}", index);
    const vmm_span span = decode_vmm_record(record, what);
    auto it = sources_.find(span.key);
    if (span.fds_follow) {
      if (!link_)
        throw error(errc::protocol, fmt::format("cuda_ipc: source {} is VMM memory whose descriptors come through the "
                                                "control lane, but this session has no descriptor link",
                                                index));
      const std::vector<channel::unique_fd> fds =
          receive_chunks(*link_, span, std::chrono::steady_clock::now() + timeout_, what);
      if (it == sources_.end()) {  // else: held already; the descriptors are closed unused
        if (sources_.size() >= max_sources)
          throw error(errc::protocol, fmt::format("cuda_ipc: the streamer announces more than {} allocations to "
                                                  "read in place",
                                                  max_sources));
        device_guard guard(device_);
        it = sources_.emplace(span.key, mapped_source{map_chunks(fds, span, device_), false}).first;
      }
    } else if (it == sources_.end()) {
      throw error(errc::protocol, fmt::format("cuda_ipc: source {} is VMM memory of the streamer ({} chunks) that this "
                                              "receiver does not hold, and no descriptors follow (the streamer's "
                                              "next refit sends them)",
                                              index, span.ids.size()));
    }
    it->second.read = true;
    numbered_.push_back(&it->second);
  }

  /// What a session whose GPU work never finished left behind (see detach()).
  struct abandoned {
    std::vector<ipc_mapping> maps;
    std::map<std::string, mapped_source> sources;
    std::vector<ipc_event> packed;
    std::vector<ipc_event> applied;
    cuda::stream stream;
  };

  /// offer_direct() for the destinations in VMM memory (`in_vmm`, their views' extents `extents`,
  /// their chunks `chunks`): one "V" record per window of adjacent chunks (plan_vmm_windows),
  /// numbered from `first`, each destination placed in its record, and every chunk queued for
  /// after_reply(). False (having declined) when one cannot be described.
  bool offer_vmm_spans(std::span<const plan::destination> table, std::span<const std::size_t> in_vmm,
                       std::span<const std::uint64_t> extents, const std::map<std::uintptr_t, copy::vmm::chunk>& chunks,
                       std::uint64_t first, std::vector<std::pair<std::uint64_t, std::uint64_t>>& place,
                       std::vector<std::string>& records) {
    std::vector<vmm_region> regions;
    for (std::size_t k = 0; k < in_vmm.size(); ++k)
      regions.push_back(vmm_region{reinterpret_cast<std::uintptr_t>(table[in_vmm[k]].data), extents[k]});
    const vmm_windows plan = plan_vmm_windows(regions, chunks);
    if (plan.too_large)
      return decline(fmt::format("'{}' spans more than {} VMM chunks, more than a record describes",
                                 table[in_vmm[*plan.too_large]].meta.name, max_vmm_chunks));
    for (std::size_t k = 0; k < in_vmm.size(); ++k)
      place[in_vmm[k]] = {first + plan.place[k].record, plan.place[k].offset};
    // Exported one at a time as they are sent (after_reply()): hundreds held open at once could
    // pass the process's descriptor limit. chunks_of() saw that each one allows it.
    for (const auto& record : plan.records) {
      pending_chunks_.insert(pending_chunks_.end(), record.begin(), record.end());
      records.push_back("V" + encode_vmm_record(record, true));
    }
    return true;
  }

  /// Chunks of the VMM weights offered, whose descriptors after_reply() sends (tag: the chunk's id).
  std::vector<copy::vmm::chunk> pending_chunks_;

  static bool decline(const std::string& why) {
    REFIT_INFO("cuda_ipc: staging through the buffers, not writing directly: {}", why);
    return false;
  }

  /// By record (handle, bytes, the streamer's allocation id): kept from refit to refit while each
  /// refit reads them (a trainer's weights stay where they are), unmapped after one that does not.
  std::map<std::string, mapped_source> sources_;
  std::vector<mapped_source*> numbered_;  ///< this refit's, from source 1
  static constexpr std::size_t max_sources = 1u << 16;
  /// The session's descriptor link (null: none; a VMM record with descriptors is then refused).
  std::shared_ptr<channel::fd_link> link_;

  int device_;
  milliseconds timeout_;
  bool attached_ = false;
  bool same_gpu_ = false;  ///< the streamer's buffers are on this receiver's GPU (wait_for_packing)
  std::vector<ipc_mapping> maps_;
  std::vector<std::uint64_t> sizes_;
  std::vector<ipc_event> packed_;
  std::vector<ipc_event> applied_;
  cuda::stream stream_;
};

std::unique_ptr<source> make_cuda_ipc_source(const source_options& options) {
  return std::make_unique<cuda_ipc_source>(options);
}

std::unique_ptr<sink> make_cuda_ipc_sink(int device, milliseconds timeout) {
  return std::make_unique<cuda_ipc_sink>(device, timeout);
}

}  // namespace

}  // namespace refit::transport

// The registration. Several receivers on one host when each is written directly; writes in place when offered.
REFIT_TRANSPORT(cuda_ipc,
                {refit::transport::transport_name, refit::transport::capabilities{1u << 16, true, false, true},
                 refit::transport::make_cuda_ipc_source, refit::transport::make_cuda_ipc_sink});
