// refit — the nccl transport: one streamer (rank 0) broadcasts each batch to N receivers (ranks
// 1..N). See transport.hpp and lib/README.md. Invariants; the measurements behind them
// are in bench/results/nccl-notes.md.
//
// Entries. A batch is one NCCL group of one ncclBroadcast per entry, from wherever the entry lies
// on the streamer's GPU (else packed into send[i]) into wherever it goes on the receiver's GPU
// (else staged in recv[i], then copied or handed to the callback). Each rank chooses its own
// pointers; only the entries and their order, from the batch's manifest, must agree.
//
// In-place sessions. HELLO asks for wire::session_mode::in_place (streamer_options::direct); a
// receiver whose parameter table is plain and on its GPU grants it in its OK. Only when every
// receiver grants it is the session in place: no buffer holds a batch, and both sides plan
// batches of direct_batch_bytes.
//
// Sessions. Each session has a fresh communicator: the ncclUniqueId travels in HELLO, the
// streamer joins in join(), each receiver in attach(). Both create it non-blocking and poll it
// against a deadline (a missing rank is a timeout, not a hang), then broadcast one warm-up buffer
// while every rank is still in set-up: NCCL connects lazily at the first collective, which needs
// every rank at once.
//
// Ordering, streamer: pack stream → packed[i] → comm stream (broadcasts) → sent[i] → next pack
// into buffer i. Receiver: comm stream → received[i] → apply stream → applied[i] → next broadcast
// into buffer i. Ordinary events only: nothing crosses a process but the bytes. A refit is
// complete on a receiver when its streams have drained (END), on the streamer when its comm
// streams have; only then may the caller change the tensors it sent from.
//
// Paired sessions (streamer_options::nccl_twin, opt-in). The streamer says so in HELLO
// (nccl_session::paired), with a second ncclUniqueId: every rank then also joins a twin
// communicator at set-up, and the broadcasts of odd buffers go on the twin, on a comm stream of
// its own. A buffer-sized broadcast loses ~10 % of the link to its own start and end (64 MiB over
// NVLink: 328 against 369 GB/s); on two communicators the next batch's broadcast runs while the
// one before it drains. Each communicator still sees its broadcasts in manifest order on every
// rank, and buffer reuse is ordered by the same events. Both are aborted together (abort_both).
// (A twin made by ncclCommSplit in non-blocking mode crashed the set-up with NCCL 2.28.3; a second
// id costs HELLO 128 bytes.)
//
// Running ahead. Buffer reuse is ordered on the device, not the host, so every rank has the next
// broadcast queued before the current one ends. The host runs at most `lookahead` batches ahead:
// before batch k it waits, with the session's deadline, for batch k - lookahead. Every host wait
// polls (copy/wait.hpp) with a deadline; nothing here calls cudaStreamSynchronize, so a dead peer
// is errc::timeout.
//
// Priorities. Broadcast streams have the device's greatest priority, pack and apply streams the
// default, so NCCL's kernel never waits for a whole apply that fills every SM.
//
// Timeline. With REFIT_LOG=debug each broadcast (and apply) is bracketed by timing events and
// drain() logs one line per refit: link busy, link idle and where, applies. Otherwise no timing
// event is recorded.
//
// Parts sessions. When some receiver's table has views or slices (a TP shard, a fused tensor) on
// its GPU, that receiver describes its destinations in its OK and the session stays in place: the
// streamer sends each receiver only the bytes its destinations take (ncclSend/ncclRecv, one per
// destination an entry reaches, in an order both sides compute from the manifest and the
// receiver's table), gathering a part first when it is not one range of its tensor (a column
// slice; once for every receiver that takes it alike). A receiver receives a part that is not one
// range of its destination (a view whose rows lie apart) into scatter memory and copies it into
// place. NCCL connects point-to-point channels lazily, at their first use by both
// ranks, and a group of sends would wait for receivers that have not yet seen the batch's manifest;
// so set-up also sends each receiver one byte, while every rank is there.
//
// Ending. A communicator is always ended with ncclCommAbort, also after a clean session:
// ncclCommFinalize waits for every rank, and the ranks leave at different times; aborting a
// quiescent communicator is local and quick.
#include "transport/nccl_library.hpp"
#include "transport/nccl_session.hpp"
#include "transport/registry.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstring>
#include <functional>
#include <optional>
#include <source_location>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "copy/cuda_check.hpp"
#include "copy/cuda_handles.hpp"
#include "copy/unique_handle.hpp"
#include "copy/wait.hpp"
#include "model/log.hpp"
#include "refit/error.hpp"
#include "wire/wire.hpp"

namespace refit::transport {
namespace {

using clock = std::chrono::steady_clock;

constexpr std::string_view transport_name = "nccl";

double ms_since(clock::time_point t0) { return std::chrono::duration<double, std::milli>(clock::now() - t0).count(); }

// ------------------------------------------------------------------------------------ errors

/// The error for an NCCL call that returned `status`: NCCL's name for it and, when it has one,
/// its last error text (which says which peer or resource failed).
error nccl_error(ncclResult_t status, std::string_view what, ncclComm_t comm,
                 std::source_location where = std::source_location::current()) {
  const char* last = ncclGetLastError(comm);
  const std::string detail = last != nullptr && *last != '\0' ? fmt::format(" ({})", last) : std::string();
  // NCCL refuses two ranks of one communicator on one GPU of one host; say what to do instead.
  const std::string_view hint =
      detail.find("Duplicate GPU") != std::string::npos
          ? "; a receiver on the streamer's GPU takes cuda_ipc (one copy, no NCCL), or, for tests, give each "
            "process its own NCCL_HOSTID (NCCL then goes through its network transport over loopback)"
          : "";
  return error(errc::nccl, fmt::format("{}: {}{}{} ({}:{}); set NCCL_DEBUG=WARN for NCCL's own report", what,
                                       ncclGetErrorString(status), detail, hint, where.file_name(), where.line()));
}

/// Throws refit::error(errc::nccl) unless `status` is ncclSuccess. `comm` may be null.
void check_nccl(ncclResult_t status, std::string_view what, ncclComm_t comm = nullptr,
                std::source_location where = std::source_location::current()) {
  if (status != ncclSuccess) throw nccl_error(status, what, comm, where);
}

// ------------------------------------------------------------------------------------ waiting

/// Throws errc::nccl when the communicator holds an asynchronous error; returns its state
/// (ncclSuccess or ncclInProgress) otherwise.
ncclResult_t comm_state(ncclComm_t comm, std::string_view what) {
  ncclResult_t state = ncclSuccess;
  check_nccl(ncclCommGetAsyncError(comm, &state), "ncclCommGetAsyncError", comm);
  if (state != ncclSuccess && state != ncclInProgress) throw nccl_error(state, what, comm);
  return state;
}

/// Waits until the communicator leaves ncclInProgress (its set-up, or a call that returned
/// ncclInProgress). Throws errc::nccl when it fails, errc::timeout past `until` (message: `what`
/// did not complete, then `late`). `on_poll` (when given) runs at each poll and may throw to stop
/// the wait. Aborts nothing: the caller owns the communicator.
void wait_ready(ncclComm_t comm, const deadline& until, std::string_view what, std::string_view late,
                const std::function<void()>& on_poll = {}) {
  if (!poll_until(until, [&] {
        if (on_poll) on_poll();
        return comm_state(comm, what) != ncclInProgress;
      }))
    throw error(errc::timeout, fmt::format("{} did not complete within {} ms: {}", what, until.budget.count(), late));
}

/// Waits until `query` (cudaStreamQuery / cudaEventQuery on one handle) reports the work done,
/// watching the communicator (may be null) for asynchronous errors. Throws errc::cuda, errc::nccl,
/// or errc::timeout past `until`.
template <class Query>
void wait_work(Query query, ncclComm_t comm, const deadline& until, std::string_view what, std::string_view late) {
  const bool done = poll_until(until, [&] {
    const cudaError_t q = query();
    if (q == cudaSuccess) return true;
    if (q != cudaErrorNotReady) check_cuda(q, what);
    if (comm != nullptr) (void)comm_state(comm, what);
    return false;
  });
  if (!done)
    throw error(errc::timeout, fmt::format("{} did not complete within {} ms: {}", what, until.budget.count(), late));
}

void wait_stream(cudaStream_t s, ncclComm_t comm, const deadline& until, std::string_view what, std::string_view late) {
  wait_work([s] { return cudaStreamQuery(s); }, comm, until, what, late);
}

void wait_event(cudaEvent_t e, ncclComm_t comm, const deadline& until, std::string_view what, std::string_view late) {
  wait_work([e] { return cudaEventQuery(e); }, comm, until, what, late);
}

// ------------------------------------------------------------------------------------ handles

/// ncclCommAbort, keeping the caller's current device (NCCL switches to the communicator's
/// device internally).
void abort_comm(ncclComm_t c) noexcept {
  int previous = -1;
  const bool have_previous = cudaGetDevice(&previous) == cudaSuccess;
  (void)ncclCommAbort(c);
  if (have_previous) (void)cudaSetDevice(previous);
}

/// One rank of an NCCL communicator, created non-blocking. cppzmq shape: the constructor joins or
/// throws (leaving nothing behind), copy is deleted, a move empties the source, and the destructor
/// aborts (ncclCommAbort: local, never waits on a peer).
class communicator {
 public:
  communicator() noexcept = default;

  /// Thrown when `give_up` said to stop waiting for the other ranks (the half-made communicator
  /// aborted).
  struct abandoned {};

  /// Joins as `rank` of `nranks` on CUDA device `device`, waiting until `until`. Throws
  /// errc::nccl when NCCL fails, errc::timeout (message ends with `late`) when the other ranks do
  /// not all join in time, `abandoned` as soon as `give_up` (when given) returns true; the
  /// half-made communicator is aborted in every case.
  communicator(int nranks, const ncclUniqueId& id, int rank, int device, const deadline& until, std::string_view late,
               const std::function<bool()>& give_up = {})
      : device_(device) {
    const std::string what = fmt::format("ncclCommInitRankConfig (rank {} of {}, cuda:{})", rank, nranks, device);
    device_guard guard(device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // set-up runs in the background; we poll it against the deadline
    ncclComm_t c = nullptr;
    const ncclResult_t started = ncclCommInitRankConfig(&c, nranks, id, rank, &config);
    c_.reset(c);
    try {
      if (started != ncclSuccess && started != ncclInProgress) throw nccl_error(started, what, c);
      if (c == nullptr) throw error(errc::nccl, fmt::format("{} returned no communicator", what));
      wait_ready(c, until, what, late, [&] {
        if (give_up && give_up()) throw abandoned{};
      });
    } catch (...) {
      abort();  // on this device, while the guard holds it
      throw;
    }
  }

  [[nodiscard]] ncclComm_t handle() const noexcept { return c_.handle(); }
  explicit operator bool() const noexcept { return static_cast<bool>(c_); }

  /// Ends the communicator: stops its kernels (they poll NCCL's abort flag) and frees what it
  /// holds, without waiting for any peer. Safe on an empty one.
  void abort() noexcept { c_.reset(); }

 private:
  unique_handle<ncclComm_t, abort_comm> c_;
  int device_ = 0;
};

/// Aborts a paired session's two communicators together (at_once): a kernel of the one still waiting
/// for a peer that is gone would hold the other's abort forever (the GPU suite's refused-batch case
/// hung so with the twin aborted first).
void abort_both(communicator& first, communicator& twin) noexcept {
  if (!first || !twin) {
    first.abort();
    twin.abort();
    return;
  }
  const std::function<void()> both[] = {[&first] { first.abort(); }, [&twin] { twin.abort(); }};
  at_once(both);
}

/// Enqueues the broadcast of `bytes` bytes from rank 0's `p` into every other rank's `p` on `s`.
/// In non-blocking mode NCCL may answer ncclInProgress: the call is then finished before
/// returning (within `budget`), so that what follows on `s` is ordered after it. `what` names the
/// call in errors; nothing is formatted unless something goes wrong.
void broadcast(const communicator& comm, void* p, std::uint64_t bytes, cudaStream_t s, milliseconds budget,
               std::string_view what, std::string_view late) {
  const ncclResult_t r = ncclBroadcast(p, p, static_cast<std::size_t>(bytes), ncclUint8, 0, comm.handle(), s);
  if (r == ncclSuccess) return;
  const std::string call = fmt::format("{} ({} bytes)", what, bytes);
  if (r != ncclInProgress) throw nccl_error(r, call, comm.handle());
  wait_ready(comm.handle(), deadline::after(budget), call, late);
}

/// How a batch's segments move: one broadcast each (every receiver takes every entry), or, in a
/// parts session, a send from rank 0 to the segment's peer and a receive on that peer.
enum class moves : std::uint8_t { broadcast, send, receive };

/// Enqueues the transfer of a batch on `s`, the batch's as one NCCL group (one launch). Broadcast:
/// one ncclBroadcast per entry, rank 0's bytes into every other rank's, in place; every rank passes
/// the same entries in the same order (both sides take them from the batch's manifest). Parts:
/// rank 0 one ncclSend per segment to its peer, each receiver one ncclRecv per segment of its own,
/// in the order both compute from the manifest and the receiver's table. Where the bytes are is each
/// rank's own business: a segment with data == nullptr is in `buffer` at its offset. In
/// non-blocking mode ncclGroupEnd may answer ncclInProgress: the group is then finished before
/// returning (within `budget`), so that what follows on `s` is ordered after it.
void transfer_entries(const communicator& comm, moves how, std::span<const segment> batch, std::byte* buffer,
                      cudaStream_t s, milliseconds budget, std::string_view late) {
  check_nccl(ncclGroupStart(), "ncclGroupStart", comm.handle());
  ncclResult_t failed = ncclSuccess;
  std::size_t k = 0;
  for (; k < batch.size(); ++k) {
    const segment& e = batch[k];
    if (e.bytes == 0) continue;
    std::byte* p = e.data != nullptr ? e.data : buffer + e.offset;
    const auto n = static_cast<std::size_t>(e.bytes);
    if (how == moves::broadcast)
      failed = ncclBroadcast(p, p, n, ncclUint8, 0, comm.handle(), s);
    else if (how == moves::send)
      failed = ncclSend(p, n, ncclUint8, static_cast<int>(e.peer), comm.handle(), s);
    else
      failed = ncclRecv(p, n, ncclUint8, 0, comm.handle(), s);
    if (failed != ncclSuccess && failed != ncclInProgress) break;
  }
  const ncclResult_t ended = ncclGroupEnd();  // always: the group must be closed
  if (failed != ncclSuccess && failed != ncclInProgress)
    throw nccl_error(failed,
                     fmt::format("{} of segment {} of a batch of {}",
                                 how == moves::broadcast ? "ncclBroadcast"
                                 : how == moves::send    ? "ncclSend"
                                                         : "ncclRecv",
                                 k, batch.size()),
                     comm.handle());
  const std::string what = "ncclGroupEnd (the transfers of a batch)";
  if (ended == ncclInProgress)
    wait_ready(comm.handle(), deadline::after(budget), what, late);
  else if (ended != ncclSuccess)
    throw nccl_error(ended, what, comm.handle());
}

std::string device_uuid(int device) {
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), fmt::format("cudaGetDeviceProperties({})", device));
  return std::string(prop.uuid.bytes, sizeof prop.uuid.bytes);
}

/// Makes `device` current for the scope; a failure becomes errc::cuda naming `who` and host_shm.
device_guard use_device(int device, std::string_view who) {
  int n = 0;
  const cudaError_t status = cudaGetDeviceCount(&n);
  if (status != cudaSuccess || device < 0 || device >= n)
    throw error(
        errc::cuda,
        fmt::format("the nccl transport needs a CUDA device on the {}, but cuda:{} is not available ({}); "
                    "run it on a GPU, or use the host_shm transport",
                    who, device,
                    status != cudaSuccess ? fmt::format("{}: {}", cudaGetErrorName(status), cudaGetErrorString(status))
                                          : fmt::format("{} device(s) visible", n)));
  return device_guard(device);
}

cuda::event make_event() { return cuda::event(cudaEventDisableTiming); }

/// Bytes of the warm-up broadcast (see the top of this file): enough to connect NCCL's rings,
/// from a small scratch buffer of each rank's own, so that no ping-pong buffer is needed for it.
std::uint64_t warm_up_bytes(std::uint64_t first_buffer) { return std::min<std::uint64_t>(first_buffer, 1u << 20); }

/// How many batches a side may enqueue ahead of the broadcasts the device has finished (see
/// "Running ahead" at the top of this file).
constexpr std::size_t lookahead = 4;

/// A ring of `lookahead` events, one recorded after each broadcast: wait() before enqueuing a
/// batch bounds how far the host runs ahead of the link.
class lookahead_ring {
 public:
  lookahead_ring() {
    for (cuda::event& e : ring_) e = make_event();
  }
  /// Starts counting batches again (a new session).
  void reset() noexcept { issued_ = 0; }
  /// Waits (bounded) for the broadcast `lookahead` batches before the next one.
  void wait(ncclComm_t comm, milliseconds timeout, std::string_view late) {
    const cudaEvent_t e = ring_[issued_ % lookahead].handle();
    if (cudaEventQuery(e) == cudaSuccess) return;  // the usual case; also an event never recorded
    wait_event(e, comm, deadline::after(timeout),
               fmt::format("the broadcast of batch {} of this session", issued_ - lookahead), late);
  }
  /// Marks the end of the next batch's broadcast, enqueued on `s`.
  void record(cudaStream_t s) {
    check_cuda(cudaEventRecord(ring_[issued_ % lookahead].handle(), s), "cudaEventRecord(lookahead)");
    ++issued_;
  }

 private:
  std::array<cuda::event, lookahead> ring_;
  std::uint64_t issued_ = 0;
};
cuda::stream make_stream() { return cuda::stream(cudaStreamNonBlocking); }

/// The stream that broadcasts: the device's greatest priority (see the top of this file).
cuda::stream make_comm_stream() { return cuda::stream(cudaStreamNonBlocking, cuda::stream::greatest_priority()); }

/// Timing events around the broadcasts (and the applies) of one refit; see the top of this file.
/// Records nothing unless REFIT_LOG=debug.
class timeline {
 public:
  /// Starts a refit's record. Cheap when logging is below debug.
  void reset() {
    on_ = log::enabled(log::level::debug);
    spans_[0].n = spans_[1].n = 0;
    bytes_ = 0;
  }

  /// Brackets a broadcast of `bytes` bytes (or an apply: kind 1) enqueued on `s`.
  void begin(int kind, cudaStream_t s) {
    if (!on_) return;
    span_list& l = spans_[kind];
    if (l.n == l.events.size()) l.events.emplace_back(cuda::event(0), cuda::event(0));
    check_cuda(cudaEventRecord(l.events[l.n].first.handle(), s), "cudaEventRecord(timeline)");
  }
  void end(int kind, cudaStream_t s, std::uint64_t bytes = 0) {
    if (!on_) return;
    span_list& l = spans_[kind];
    if (l.n >= l.events.size()) return;  // no begin() since the last reset()
    check_cuda(cudaEventRecord(l.events[l.n].second.handle(), s), "cudaEventRecord(timeline)");
    ++l.n;
    bytes_ += bytes;
  }

  /// Logs the refit's line; call once its streams are drained. Never throws.
  void report(std::string_view who) noexcept {
    if (!on_ || spans_[0].n == 0) return;
    try {
      // Each broadcast's start and end from the first one's start (a paired session's overlap:
      // busy is the union of the spans, idle the gaps between them).
      const span_list& b = spans_[0];
      struct interval {
        double start, end;
        std::size_t k;
      };
      std::vector<interval> spans(b.n);
      std::vector<double> dur(b.n);
      for (std::size_t k = 0; k < b.n; ++k) {
        spans[k] =
            interval{elapsed(b.events[0].first, b.events[k].first), elapsed(b.events[0].first, b.events[k].second), k};
        dur[k] = spans[k].end - spans[k].start;
      }
      std::sort(spans.begin(), spans.end(), [](const interval& x, const interval& y) { return x.start < y.start; });
      double busy = 0, idle = 0, longest_idle = 0, covered = spans.front().start, last = spans.front().start;
      std::size_t at = 0;
      for (const interval& v : spans) {
        if (v.start > covered) {
          const double gap = v.start - covered;
          idle += gap;
          if (gap > longest_idle) longest_idle = gap, at = v.k;
        }
        busy += std::max(0.0, v.end - std::max(v.start, covered));
        covered = std::max(covered, v.end);
        last = std::max(last, v.end);
      }
      const double span = last - spans.front().start;
      std::sort(dur.begin(), dur.end());
      std::string applies;
      if (const span_list& a = spans_[1]; a.n != 0) {
        double total = 0, longest = 0;
        for (std::size_t k = 0; k < a.n; ++k) {
          const double d = elapsed(a.events[k].first, a.events[k].second);
          total += d;
          longest = std::max(longest, d);
        }
        applies = fmt::format("; {} applies {:.2f} ms (longest {:.3f} ms)", a.n, total, longest);
      }
      REFIT_DEBUG(
          "nccl timeline, {}: {} broadcasts, {:.3f} GB, {:.2f} ms first start to last end; busy {:.2f} ms "
          "({:.1f} GB/s while busy; each {:.3f}/{:.3f}/{:.3f} ms min/median/max), idle between them {:.2f} "
          "ms (longest {:.3f} ms, before batch {}){}",
          who, b.n, static_cast<double>(bytes_) / 1e9, span, busy,
          busy > 0 ? static_cast<double>(bytes_) / (busy * 1e6) : 0.0, dur.front(), dur[dur.size() / 2], dur.back(),
          idle, longest_idle, at, applies);
    } catch (const std::exception& e) {
      REFIT_WARN("nccl timeline: {}", e.what());
    }
  }

 private:
  static double elapsed(const cuda::event& a, const cuda::event& b) {
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, a.handle(), b.handle()), "cudaEventElapsedTime(timeline)");
    return ms;
  }
  struct span_list {
    std::vector<std::pair<cuda::event, cuda::event>> events;
    std::size_t n = 0;
  };
  bool on_ = false;
  std::array<span_list, 2> spans_;
  std::uint64_t bytes_ = 0;
};

/// Device memory per buffer slot for the parts of a batch that do not lie in one range (gathered
/// on the streamer, received apart on a receiver): grown to what a batch needs, never shrunk
/// within a session. An outgrown area may still be read by work in flight and is kept until
/// clear() (the next session).
class slot_areas {
 public:
  /// At least `bytes` bytes on `device` for slot i of `count`; a failed allocation throws
  /// errc::cuda saying what the memory was `for_what` and, after its cause, `advice`.
  std::byte* at_least(std::size_t i, std::size_t count, std::uint64_t bytes, int device, std::string_view for_what,
                      std::string_view advice = {}) {
    if (areas_.size() < count) areas_.resize(count);
    if (areas_[i].bytes() < bytes) {
      device_guard guard(device);
      if (areas_[i].bytes() != 0) outgrown_.push_back(std::move(areas_[i]));
      try {
        areas_[i] = cuda::device_buffer(bytes);
      } catch (const error& e) {
        throw error(errc::cuda, fmt::format("nccl: cannot allocate {} bytes on cuda:{} {}: {}{}", bytes, device,
                                            for_what, e.what(), advice));
      }
    }
    return static_cast<std::byte*>(areas_[i].handle());
  }
  void clear() noexcept {
    areas_.clear();
    outgrown_.clear();
  }

 private:
  std::vector<cuda::device_buffer> areas_;
  std::vector<cuda::device_buffer> outgrown_;
};

/// The entries of the next batch (see transport::segment), from entries() to the broadcast of
/// the batch in end_pack() / begin_read().
class pending_batch {
 public:
  /// Keeps `batch`, checking the entries staged in buffer i (of `buffer_bytes`) against its size.
  void take(std::span<const segment> batch, std::uint64_t buffer_bytes, std::size_t i) {
    entries_.assign(batch.begin(), batch.end());
    total_ = 0;
    for (const segment& s : entries_) {
      if (s.data == nullptr && (s.offset > buffer_bytes || s.bytes > buffer_bytes - s.offset))
        throw error(errc::internal, fmt::format("nccl: an entry of {} bytes at offset {} of buffer {} ({} bytes)",
                                                s.bytes, s.offset, i, buffer_bytes));
      total_ += s.bytes;
    }
  }

  /// Enqueues the batch's transfers on `s` (nothing for a batch of empty entries: both sides see
  /// the same entries), bracketed in `tl`, and forgets the batch.
  void transfer(const communicator& comm, moves how, std::byte* buffer, cudaStream_t s, milliseconds budget,
                std::string_view late, timeline& tl) {
    if (total_ != 0) {
      tl.begin(0, s);
      transfer_entries(comm, how, entries_, buffer, s, budget, late);
      tl.end(0, s, total_);
    }
    entries_.clear();
    total_ = 0;
  }

 private:
  std::vector<segment> entries_;
  std::uint64_t total_ = 0;
};

/// The ncclUniqueId whose bytes HELLO carried (nccl_session: id_bytes each, checked by its decoder).
ncclUniqueId unique_id_of(const std::string& bytes) {
  static_assert(sizeof(ncclUniqueId) == nccl_session::id_bytes);
  ncclUniqueId id{};
  std::memcpy(id.internal, bytes.data(), sizeof id.internal);
  return id;
}

/// The bytes of `id` as HELLO carries them.
std::string bytes_of(const ncclUniqueId& id) { return std::string(id.internal, sizeof id.internal); }

/// Whether buffer i's transfers go on the twin communicator (nccl_session::paired): a paired
/// session's broadcasts of odd buffers do, so that consecutive batches' broadcasts run on two
/// communicators and streams and one starts while the one before it drains (a broadcast of a
/// buffer-sized batch loses ~10 % to its start and end: bench/results/nccl-notes.md). Point-to-point
/// parts stay on the first. Every rank decides alike: the buffer and the kind of transfer come
/// from the batch's manifest and the session.
bool on_twin(const communicator& twin, std::size_t i, moves how) noexcept {
  return static_cast<bool>(twin) && how == moves::broadcast && i % 2 == 1;
}

/// Joins `twin` as `rank` of `nranks` from `id` (every rank of a paired session does it at set-up,
/// after the first communicator) and connects it by a warm-up broadcast of `bytes` from `scratch`
/// on `s`, waited for. Returns about how much device memory it took (the device's free memory
/// before and after: for the log).
std::uint64_t join_twin(communicator& twin, const cuda::stream& s, int nranks, const ncclUniqueId& id, int rank,
                        int device, const cuda::device_buffer& scratch, std::uint64_t bytes, const deadline& until,
                        std::string_view late) {
  std::size_t before = 0, after = 0, total = 0;
  const bool measured = cudaMemGetInfo(&before, &total) == cudaSuccess;
  twin = communicator(nranks, id, rank, device, until, late);
  broadcast(twin, scratch.handle(), bytes, s.handle(), until.remaining(),
            "the twin's warm-up broadcast (ncclBroadcast)", late);
  wait_stream(s.handle(), twin.handle(), until, "the twin's warm-up broadcast", late);
  return measured && cudaMemGetInfo(&after, &total) == cudaSuccess && before > after ? before - after : 0;
}

/// The log's note of a twin that took `bytes`.
std::string twin_note(bool paired, std::uint64_t bytes) {
  return paired ? fmt::format(", paired (the twin communicator took {} MiB)", bytes >> 20) : std::string();
}

// ------------------------------------------------------------------------------------ streamer

class nccl_source final : public source {
 public:
  explicit nccl_source(const source_options& o)
      : device_(o.device),
        bytes_(o.bytes),
        count_(o.count),
        receivers_(o.receivers),
        want_in_place_(o.direct),
        paired_(o.twin && o.count >= 2) {
    if (o.receivers < 1 || o.receivers >= static_cast<std::size_t>(INT_MAX))
      throw error(errc::invalid_argument,
                  fmt::format("the nccl transport needs at least one receiver (got {})", o.receivers));
    if (o.count > wire::max_buffers)
      throw error(errc::invalid_argument,
                  fmt::format("buffer_count is {}: at most {} buffers", o.count, wire::max_buffers));
    auto guard = use_device(device_, "streamer");
    uuid_ = device_uuid(device_);
    pack_ = make_stream();
    comm_stream_ = make_comm_stream();
    if (paired_) twin_stream_ = make_comm_stream();
    ahead_.emplace();
    producer_ = make_event();
    for (std::size_t i = 0; i < o.count; ++i) {
      packed_.push_back(make_event());
      sent_.push_back(make_event());
    }
    // The send buffers are made when a session needs them (session_accepted).
    scratch_ = cuda::device_buffer(warm_up_bytes(bytes_));
  }

  ~nccl_source() override { close_session(); }
  nccl_source(const nccl_source&) = delete;
  nccl_source& operator=(const nccl_source&) = delete;

  [[nodiscard]] std::string_view name() const noexcept override { return transport_name; }
  [[nodiscard]] std::size_t count() const noexcept override { return count_; }
  [[nodiscard]] std::uint64_t buffer_bytes() const noexcept override { return bytes_; }
  /// Null in an in-place session (no send buffer exists then).
  [[nodiscard]] std::byte* data(std::size_t i) noexcept override {
    return i < send_.size() ? static_cast<std::byte*>(send_[i].handle()) : nullptr;
  }
  [[nodiscard]] device where() const noexcept override { return device::cuda(device_); }
  [[nodiscard]] copy::engine engine() const noexcept override { return copy::engine::kernel; }
  [[nodiscard]] void* stream() noexcept override { return pack_.handle(); }

  void open_session(wire::hello& h) override {
    close_session();  // a session that was never closed ends here
    auto guard = use_device(device_, "streamer");
    ncclUniqueId id{};
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    id_ = id;
    if (paired_) {
      check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId (the twin communicator)");
      twin_id_ = id;
    }
    h.transport = std::string(transport_name);
    h.mode = want_in_place_ ? wire::session_mode::in_place : wire::session_mode::buffers;
    h.peer = process_identity();
    h.host_id = host_identity();
    h.device_uuid = uuid_;
    h.buffers.assign(count_, wire::buffer_desc{bytes_, {}, {}, {}});
    ahead_->reset();
    timeline_.reset();
  }

  void hello_for(std::size_t k, wire::hello& h) const override {
    if (!id_) throw error(errc::internal, "nccl: hello_for() without open_session()");
    const nccl_library_info& nccl = require_nccl();
    h.session = encode_nccl_session(nccl_session{
        bytes_of(*id_), static_cast<std::uint32_t>(k + 1), static_cast<std::uint32_t>(receivers_ + 1), true, paired_,
        twin_id_ ? bytes_of(*twin_id_) : std::string(), static_cast<std::uint32_t>(nccl.version), nccl.path});
  }

  void join(milliseconds timeout, const std::function<bool()>& answered) override {
    if (!id_) throw error(errc::internal, "nccl: join() without open_session()");
    timeout_ = timeout;
    const auto t0 = clock::now();
    const deadline until = deadline::after(timeout);
    const int nranks = static_cast<int>(receivers_ + 1);
    const std::string late = fmt::format(
        "a receiver did not join the communicator ({} receivers expected); check that every receiver is running, "
        "answered HELLO without an error (see its log), has a free GPU and can reach this host "
        "(NCCL_SOCKET_IFNAME)",
        receivers_);
    std::uint64_t twin_bytes = 0;
    try {
      auto guard = use_device(device_, "streamer");
      // A receiver answers HELLO only once the communicator is complete, or when it refused the
      // session (another NCCL version, a bad HELLO): then stop waiting for it, and let its
      // reply say why (session_accepted() is never reached).
      comm_ = communicator(nranks, *id_, 0, device_, until, late, answered);
      // The warm-up broadcast (see the top of this file). Its bytes are whatever the scratch holds.
      broadcast(comm_, scratch_.handle(), warm_up_bytes(bytes_), comm_stream_.handle(), until.remaining(),
                "the warm-up broadcast (ncclBroadcast)", late);
      wait_stream(comm_stream_.handle(), comm_.handle(), until, "the warm-up broadcast", late);
      // And a byte to each receiver, which connects the point-to-point channels a parts session
      // sends on (see the top of this file).
      std::vector<segment> bytes;
      for (std::size_t k = 1; k <= receivers_; ++k)
        bytes.push_back(segment{static_cast<std::byte*>(scratch_.handle()), 0, 1, static_cast<std::uint32_t>(k)});
      transfer_entries(comm_, moves::send, bytes, nullptr, comm_stream_.handle(), until.remaining(), late);
      wait_stream(comm_stream_.handle(), comm_.handle(), until, "the warm-up sends", late);
      if (paired_)
        twin_bytes =
            join_twin(twin_, twin_stream_, nranks, *twin_id_, 0, device_, scratch_, warm_up_bytes(bytes_), until, late);
    } catch (const communicator::abandoned&) {
      end_comm();
      REFIT_DEBUG("nccl: a receiver answered HELLO before the communicator was complete: set-up abandoned");
      return;
    } catch (const error& e) {
      end_comm();
      throw error(e.code(), fmt::format("nccl: the streamer (rank 0 of {} on cuda:{}) could not set up the session: {}",
                                        nranks, device_, e.what()));
    }
    late_ = fmt::format(
        "a receiver of this session ({} in all) is stuck or gone; the communicator was aborted and "
        "the next refit builds a new one",
        receivers_);
    REFIT_INFO("nccl: communicator ready: rank 0 of {} on cuda:{}, {} receivers{}, in {:.1f} ms", nranks, device_,
               receivers_, twin_note(paired_, twin_bytes), ms_since(t0));
  }

  void session_accepted(std::span<const wire::ok> replies) override {
    if (!comm_)
      throw error(errc::internal, "nccl: a receiver accepted the session before join() built the communicator");
    // In place only when every receiver offered it: one that stages needs buffer-sized batches.
    in_place_ = want_in_place_ && !replies.empty() &&
                std::all_of(replies.begin(), replies.end(),
                            [](const wire::ok& r) { return r.mode == wire::session_mode::in_place; });
    tables_.assign(replies.size(), {});
    described_.assign(replies.size(), false);
    parts_ = false;
    gathers_ = false;
    if (in_place_)
      for (std::size_t k = 0; k < replies.size(); ++k) read_table(replies[k], k);
    if (parts_ && !std::all_of(described_.begin(), described_.end(), [](bool d) { return d; })) {
      // A receiver of a plain table receives by broadcast, one of views by point-to-point: neither
      // serves both. The streamer starts over buffered (disable_direct()): whole tensors broadcast,
      // the views applied on their receivers.
      std::vector<std::size_t> plain;
      for (std::size_t k = 0; k < described_.size(); ++k)
        if (!described_[k]) plain.push_back(k);
      throw error(errc::transport,
                  fmt::format("nccl: receivers {} hold plain tables (received by broadcast) and the others views "
                              "(sent their parts point-to-point), which one in-place session cannot serve together",
                              fmt::join(plain, ", ")));
    }
    if (in_place_) {
      send_.clear();  // nothing is packed in this session (unless converted: staging()): the memory goes back
      send_bytes_ = 0;
    } else if (send_.empty() || send_bytes_ != bytes_) {
      device_guard guard(device_);
      send_.clear();
      send_bytes_ = bytes_;
      try {
        for (std::size_t i = 0; i < count_; ++i) send_.emplace_back(bytes_);
      } catch (const error& e) {
        send_.clear();
        throw error(errc::cuda, fmt::format("nccl: cannot allocate the streamer's {} send buffers of {} bytes on "
                                            "cuda:{}: {}; use a smaller buffer_bytes (receivers whose parameter "
                                            "tables are on their GPUs need none)",
                                            count_, bytes_, device_, e.what()));
      }
    }
    REFIT_INFO("nccl: {} session with {} receiver(s){}",
               parts_      ? "in-place parts"
               : in_place_ ? "in-place"
                           : "buffered",
               replies.size(), in_place_ ? "" : fmt::format(", {} × {} MiB send buffers", count_, bytes_ >> 20));
  }

  [[nodiscard]] bool in_place() const noexcept override { return in_place_; }
  [[nodiscard]] bool parts() const noexcept override { return parts_; }
  [[nodiscard]] bool gathers() const noexcept override { return gathers_; }
  /// After a session that could not be in place (receivers of plain tables and of views together):
  /// later sessions are buffered.
  void disable_direct() noexcept override { want_in_place_ = false; }

  std::vector<routed> routes(const tensor_meta& meta) override {
    if (!parts_) throw error(errc::internal, "nccl: routes() outside a parts session");
    std::vector<routed> out;
    for (std::size_t k = 0; k < tables_.size(); ++k) {
      if (!described_[k]) {
        // A receiver of a plain table takes every tensor whole, into its own destination.
        plan::run& whole = whole_[meta.name];
        whole = plan::run{0, 0, 0, 0, meta.nbytes(), 1};
        out.push_back(routed{nullptr, std::span<const plan::run>(&whole, 1), k});
        continue;
      }
      const auto it = tables_[k].find(meta.name);
      if (it == tables_[k].end())
        throw error(errc::apply, fmt::format("tensor '{}' is not in receiver {}'s parameter table (nccl parts "
                                             "session: nothing of it was sent)",
                                             meta.name, k));
      for (target& d : it->second) {
        try {
          out.push_back(routed{nullptr, d.routes.get(d.dest, meta.type, meta.shape), k});
        } catch (const error& e) {
          throw error(e.code(), fmt::format("{} (receiver {}'s destination; nccl parts session: nothing of it was "
                                            "sent)",
                                            e.what(), k));
        }
      }
    }
    return out;
  }

  std::byte* gather(std::size_t i, std::uint64_t bytes) override {
    if (!parts_ || i >= count_) return nullptr;
    // The old area may still be read by a send in flight.
    return gather_.at_least(i, count_, bytes, device_,
                            "to gather the strided parts (column slices) of a batch for "
                            "their receivers",
                            "; set direct = false to broadcast whole tensors through buffer_bytes "
                            "buffers");
  }

  void close_session() noexcept override {
    end_comm();
    id_.reset();
    twin_id_.reset();
    in_place_ = false;
    parts_ = false;
    gathers_ = false;
    tables_.clear();
    described_.clear();
    whole_.clear();
    gather_.clear();
  }

  void begin_pack(std::size_t i) override {
    require_session("begin_pack");
    or_abort([&] {
      ahead_->wait(comm_.handle(), timeout_, late_);
      check_cuda(cudaStreamWaitEvent(pack_.handle(), sent_[i].handle(), 0), "cudaStreamWaitEvent(sent)");
    });
  }

  /// Buffer i is read only by this process's own sends (stream order: sent_[i]).
  [[nodiscard]] bool orders_reuse() const noexcept override { return true; }

  void after(void* producer_stream) override {
    const auto s = static_cast<cudaStream_t>(producer_stream);
    check_cuda(cudaEventRecord(producer_.handle(), s), "cudaEventRecord(on the tensor's producer stream)");
    check_cuda(cudaStreamWaitEvent(pack_.handle(), producer_.handle(), 0), "cudaStreamWaitEvent(producer)");
  }

  [[nodiscard]] bool moves_entries() const noexcept override { return true; }

  void entries(std::size_t i, std::span<const segment> batch) override {
    if (i >= count_) throw error(errc::internal, fmt::format("nccl: entries of buffer {} of {}", i, count_));
    // Without send buffers (in place, nothing converted) no entry may be packed: a buffer of 0
    // bytes refuses it.
    batch_.take(batch, send_.empty() ? 0 : send_bytes_, i);
  }

  std::byte* staging(std::size_t i) override {
    if (!in_place_ || i >= count_) return nullptr;
    if (send_.empty()) {
      // Converted entries of an in-place session are packed after all: buffers of a whole
      // in-place batch, made the first time one is converted (other sessions never pay for them).
      device_guard guard(device_);
      try {
        for (std::size_t k = 0; k < count_; ++k) send_.emplace_back(direct_batch_bytes);
      } catch (const error& e) {
        send_.clear();
        throw error(errc::cuda, fmt::format("nccl: cannot allocate {} buffers of {} bytes on cuda:{} to convert in "
                                            "place: {}; set direct = false to convert into buffer_bytes buffers",
                                            count_, direct_batch_bytes, device_, e.what()));
      }
      send_bytes_ = direct_batch_bytes;
      REFIT_INFO("nccl: in-place session converts: {} × {} MiB staging buffers on cuda:{}", count_,
                 direct_batch_bytes >> 20, device_);
    }
    return static_cast<std::byte*>(send_[i].handle());
  }

  void end_pack(std::size_t i) override {
    require_session("end_pack");
    or_abort([&] {
      device_guard guard(device_);
      const moves how = parts_ ? moves::send : moves::broadcast;
      const bool twin = on_twin(twin_, i, how);
      const cudaStream_t s = twin ? twin_stream_.handle() : comm_stream_.handle();
      check_cuda(cudaEventRecord(packed_[i].handle(), pack_.handle()), "cudaEventRecord(packed)");
      check_cuda(cudaStreamWaitEvent(s, packed_[i].handle(), 0), "cudaStreamWaitEvent(packed)");
      batch_.transfer(twin ? twin_ : comm_, how, data(i), s, timeout_, late_, timeline_);
      check_cuda(cudaEventRecord(sent_[i].handle(), s), "cudaEventRecord(sent)");
      ahead_->record(s);
    });
  }

  void drain() override {
    const deadline until = deadline::after(timeout_);
    or_abort([&] {
      wait_stream(pack_.handle(), comm_.handle(), until, "the streamer's packing", late_);
      wait_stream(comm_stream_.handle(), comm_.handle(), until, "the streamer's broadcasts", late_);
      if (twin_) wait_stream(twin_stream_.handle(), twin_.handle(), until, "the streamer's broadcasts (twin)", late_);
    });
    timeline_.report(fmt::format("rank 0 (streamer, cuda:{})", device_));
    timeline_.reset();
  }

 private:
  void require_session(std::string_view call) const {
    if (!comm_)
      throw error(errc::transport,
                  fmt::format("nccl: {} without a communicator (the session was aborted or never joined); the next "
                              "refit starts a new session",
                              call));
  }

  /// Runs `f`; on any failure aborts the communicator first (a broadcast may be waiting on the peer
  /// that failed us, and the session cannot go on) and rethrows.
  template <class F>
  void or_abort(F&& f) {
    try {
      f();
    } catch (...) {
      end_comm();
      throw;
    }
  }

  void end_comm() noexcept { abort_both(comm_, twin_); }

  /// Reads the destinations receiver k described in its OK (sink::parts()): a parts session when
  /// any receiver did. Throws errc::protocol for a malformed record.
  void read_table(const wire::ok& reply, std::size_t k) {
    if (reply.handles.empty()) return;
    auto& table = tables_[k];
    for (std::size_t r = 0; r < reply.handles.size(); ++r) {
      const std::string& rec = reply.handles[r];
      if (rec.empty() || rec[0] != 'T')
        throw error(
            errc::protocol,
            fmt::format("nccl: record {} of receiver {}'s reply is not a destination ({} bytes)", r, k, rec.size()));
      wire::dest_record d;
      try {
        d = wire::decode_dest(std::string_view(rec).substr(1));
      } catch (const error& e) {
        throw error(errc::protocol, fmt::format("nccl: receiver {}'s destination record {}: {}", k, r, e.what()));
      }
      plan::destination dest = destination_of(d, device::cuda(device_));
      // A view whose rows lie apart receives its parts into memory of the receiver's, sized by the
      // batch, and copies them into place.
      if (!plan::is_dense(dest)) gathers_ = true;
      // A slice along a dimension after the first, with more than one row before it: its rows lie
      // apart in the source, and are gathered before they are sent.
      if (dest.slice && dest.slice->dim > 0) {
        std::int64_t before = 1;
        for (std::size_t a = 0; a < static_cast<std::size_t>(dest.slice->dim) && a < dest.meta.shape.size(); ++a)
          before *= dest.meta.shape[a];
        if (before > 1) gathers_ = true;
      }
      table[dest.meta.name].push_back(target{std::move(dest), {}});
    }
    described_[k] = true;
    parts_ = true;
  }

  /// A destination a receiver described, and its runs for the source it was last asked for.
  struct target {
    plan::destination dest;
    plan::route_cache routes;
  };

  int device_;
  std::uint64_t bytes_;
  std::size_t count_;
  std::size_t receivers_;
  bool want_in_place_;     ///< streamer_options::direct: ask the receivers to receive in place
  bool paired_;            ///< sessions have a twin communicator (nccl_session::paired, source_options::twin)
  bool in_place_ = false;  ///< this session: every receiver does (batches of direct_batch_bytes)
  bool parts_ = false;     ///< this in-place session sends each receiver only its parts (see parts())
  bool gathers_ = false;   ///< and some of them are gathered first: buffer-sized batches (gathers())
  /// Per receiver: its destinations by name, as its OK described them (parts sessions; empty for a
  /// receiver of a plain table, which takes every tensor whole: described_ false).
  std::vector<std::unordered_map<std::string, std::vector<target>>> tables_;
  std::vector<bool> described_;
  std::unordered_map<std::string, plan::run> whole_;  ///< routes() of plain receivers
  slot_areas gather_;                                 ///< per buffer slot: gathered parts (gather())
  std::string uuid_;
  milliseconds timeout_{30000};  ///< from join(): every later wait of the session
  std::string late_;             ///< what a timeout of the session means, for messages
  cuda::stream pack_;
  cuda::stream comm_stream_;
  cuda::stream twin_stream_;  ///< the twin communicator's broadcasts (paired_)
  cuda::event producer_;
  std::vector<cuda::device_buffer> send_;  ///< made for buffered sessions, and in-place ones that convert
  std::uint64_t send_bytes_ = 0;           ///< the size of each of send_
  cuda::device_buffer scratch_;            ///< the warm-up broadcast's bytes
  std::vector<cuda::event> packed_;
  std::vector<cuda::event> sent_;
  pending_batch batch_;  ///< the entries of the batch being packed (entries())
  std::optional<ncclUniqueId> id_;
  std::optional<ncclUniqueId> twin_id_;  ///< paired_ sessions
  std::optional<lookahead_ring> ahead_;  // made with the streams (on device_)
  timeline timeline_;
  communicator comm_;  // last: aborted before the buffers and streams it uses are released
  communicator twin_;  ///< paired_ sessions: odd buffers' broadcasts (see on_twin)
};

// ------------------------------------------------------------------------------------ receiver

class nccl_sink final : public sink {
 public:
  nccl_sink(int device, milliseconds timeout) : device_(device), timeout_(timeout) {
    if (timeout.count() <= 0) throw error(errc::invalid_argument, "nccl: the receiver's timeout must be positive");
  }
  ~nccl_sink() override { abort(); }
  nccl_sink(const nccl_sink&) = delete;
  nccl_sink& operator=(const nccl_sink&) = delete;

  [[nodiscard]] std::string_view name() const noexcept override { return transport_name; }

  void attach(const wire::hello& h, wire::ok& reply) override {
    (void)reply;  // nothing to send back: the communicator is the handshake
    if (h.transport != transport_name)
      throw error(errc::protocol, fmt::format("nccl: HELLO names transport '{}'", h.transport));
    const nccl_session session = decode_nccl_session(h.session);
    const nccl_library_info& nccl = require_nccl();
    if (session.nccl_version != static_cast<std::uint32_t>(nccl.version))
      throw error(errc::nccl,
                  fmt::format("nccl: this receiver refuses the session of {} before making a communicator: {}", h.peer,
                              nccl_mismatch(nccl.version, nccl.path, static_cast<int>(session.nccl_version),
                                            session.nccl_path, "the streamer uses")));
    if (h.buffers.empty() || h.buffers.size() > wire::max_buffers)
      throw error(errc::protocol,
                  fmt::format("nccl: HELLO announces {} buffers (1..{})", h.buffers.size(), wire::max_buffers));
    for (std::size_t i = 0; i < h.buffers.size(); ++i)
      if (h.buffers[i].bytes == 0) throw error(errc::protocol, fmt::format("nccl: HELLO buffer {} has 0 bytes", i));

    detach();  // whatever the last session left
    const auto t0 = clock::now();
    auto guard = use_device(device_, "receiver");
    prepare(h);

    const int rank = static_cast<int>(session.rank);
    const int nranks = static_cast<int>(session.nranks);
    const ncclUniqueId id = unique_id_of(session.id);
    const std::string late =
        fmt::format("the streamer {} or another of its {} receivers did not join the communicator", h.peer, nranks - 1);
    std::uint64_t twin_bytes = 0;
    try {
      const deadline until = deadline::after(timeout_);
      comm_ = communicator(nranks, id, rank, device_, until, late);
      // The warm-up broadcast (see the top of this file), into this rank's scratch buffer.
      broadcast(comm_, scratch_.handle(), warm_up_bytes(sizes_[0]), comm_stream_.handle(), until.remaining(),
                "the warm-up broadcast (ncclBroadcast)", late);
      wait_stream(comm_stream_.handle(), comm_.handle(), until, "the warm-up broadcast", late);
      if (session.parts) {  // that streamer also sends each receiver a byte (see join())
        const segment one{static_cast<std::byte*>(scratch_.handle()), 0, 1, 0};
        transfer_entries(comm_, moves::receive, std::span<const segment>(&one, 1), nullptr, comm_stream_.handle(),
                         until.remaining(), late);
        wait_stream(comm_stream_.handle(), comm_.handle(), until, "the warm-up receive", late);
      }
      if (session.paired) {
        if (!twin_stream_) twin_stream_ = make_comm_stream();
        twin_bytes = join_twin(twin_, twin_stream_, nranks, unique_id_of(session.twin_id), rank, device_, scratch_,
                               warm_up_bytes(sizes_[0]), until, late);
      }
    } catch (const error& e) {
      abort();
      throw error(e.code(), fmt::format("nccl: this receiver (rank {} of {} on cuda:{}) could not join the session "
                                        "of {}: {}",
                                        rank, nranks, device_, h.peer, e.what()));
    }
    peer_ = h.peer;
    rank_ = rank;
    streamer_parts_ = session.parts;
    parts_ = false;
    ahead_->reset();
    timeline_.reset();
    late_ = fmt::format(
        "the streamer {} or another receiver of its session is stuck or gone; the communicator of "
        "rank {} was aborted and the next HELLO builds a new one",
        peer_, rank);
    attached_ = true;
    REFIT_INFO(
        "nccl: communicator ready: rank {} of {} on cuda:{} (streamer {}), {} × {} MiB buffers announced{}, in "
        "{:.1f} ms",
        rank, nranks, device_, peer_, sizes_.size(), sizes_[0] >> 20, twin_note(session.paired, twin_bytes),
        ms_since(t0));
  }

  void detach() noexcept override {
    if (attached_) {
      try {
        drain();  // bounded; aborts on failure
      } catch (const std::exception& e) {
        REFIT_WARN("nccl: detaching from {}: {}", peer_, e.what());
      }
    }
    abort();
    // The buffers, streams and events stay for the next session (reused when the sizes match).
  }

  bool offer_in_place(const wire::hello& h, std::span<const plan::destination> table, wire::ok& reply) override {
    parts_ = false;
    bool offer = attached_ && h.mode == wire::session_mode::in_place && !table.empty();
    bool plain = true;  // every destination whole and dense, one per name: a broadcast lands in each
    std::unordered_set<std::string_view> names;
    for (const plan::destination& d : table) {
      if (d.meta.nbytes() != 0 && !(d.dev == device::cuda(device_))) offer = false;
      if (!plan::is_plain(d) || !names.insert(d.meta.name).second) plain = false;
    }
    // Parts land straight in their destinations where they are one range of it (a view of rows,
    // such as a fused tensor's narrow(0) or a TP shard); a view whose rows lie apart (a narrow(1))
    // receives its part into scatter() memory and copies it into place.
    if (offer && !plain && !streamer_parts_) offer = false;  // that streamer broadcasts whole tensors
    scatter_.clear();
    if (offer) {
      recv_.clear();  // nothing is ever staged in this session: the memory goes back
      reply.mode = wire::session_mode::in_place;
      if (!plain) {
        // The streamer sends this receiver only what its destinations take: it needs them.
        reply.handles.clear();
        for (const plan::destination& d : table) reply.handles.push_back(dest_record_of(d));
        parts_ = true;
      }
      return true;
    }
    make_buffers();  // batches will be staged here as they come
    return false;
  }

  [[nodiscard]] bool parts() const noexcept override { return parts_; }

  std::byte* scatter(std::size_t i, std::uint64_t bytes) override {
    if (!parts_ || i >= sizes_.size()) return nullptr;
    // The old area may still be read by a copy in flight.
    return scatter_.at_least(i, sizes_.size(), bytes, device_,
                             "to receive the parts of a batch whose destinations' "
                             "rows lie apart (views such as a narrow(1))");
  }

  [[nodiscard]] bool attached() const noexcept override { return attached_; }
  [[nodiscard]] std::size_t count() const noexcept override { return sizes_.size(); }
  [[nodiscard]] std::uint64_t buffer_bytes(std::size_t i) const noexcept override { return sizes_[i]; }
  /// Null in an in-place session (no receive buffer exists then).
  [[nodiscard]] const std::byte* data(std::size_t i) const noexcept override {
    return i < recv_.size() ? static_cast<const std::byte*>(recv_[i].handle()) : nullptr;
  }
  [[nodiscard]] device where() const noexcept override { return device::cuda(device_); }
  [[nodiscard]] copy::engine engine() const noexcept override { return copy::engine::kernel; }
  [[nodiscard]] void* stream() noexcept override { return apply_.handle(); }
  [[nodiscard]] bool asynchronous() const noexcept override { return true; }

  [[nodiscard]] bool moves_entries() const noexcept override { return true; }

  void entries(std::size_t i, std::span<const segment> batch) override {
    if (i >= sizes_.size())
      throw error(errc::internal, fmt::format("nccl: entries of buffer {} of {}", i, sizes_.size()));
    // Without receive buffers (in place) no entry may be staged: a buffer of 0 bytes refuses it.
    batch_.take(batch, i < recv_.size() ? sizes_[i] : 0, i);
  }

  void begin_read(std::size_t i) override {
    require_session("begin_read");
    or_abort([&] {
      device_guard guard(device_);
      ahead_->wait(comm_.handle(), timeout_, late_);
      const moves how = parts_ ? moves::receive : moves::broadcast;
      const bool twin = on_twin(twin_, i, how);
      const cudaStream_t s = twin ? twin_stream_.handle() : comm_stream_.handle();
      check_cuda(cudaStreamWaitEvent(s, applied_[i].handle(), 0), "cudaStreamWaitEvent(applied)");
      batch_.transfer(twin ? twin_ : comm_, how,
                      i < recv_.size() ? static_cast<std::byte*>(recv_[i].handle()) : nullptr, s, timeout_, late_,
                      timeline_);
      check_cuda(cudaEventRecord(received_[i].handle(), s), "cudaEventRecord(received)");
      ahead_->record(s);
      check_cuda(cudaStreamWaitEvent(apply_.handle(), received_[i].handle(), 0), "cudaStreamWaitEvent(received)");
      timeline_.begin(1, apply_.handle());
    });
  }

  void end_read(std::size_t i) override {
    require_session("end_read");
    or_abort([&] {
      timeline_.end(1, apply_.handle());
      check_cuda(cudaEventRecord(applied_[i].handle(), apply_.handle()), "cudaEventRecord(applied)");
    });
  }

  void drain() override {
    if (!attached_) return;  // aborted: nothing of the session's is waited for any more
    const deadline until = deadline::after(timeout_);
    or_abort([&] {
      wait_stream(comm_stream_.handle(), comm_.handle(), until, "the receiver's broadcasts", late_);
      if (twin_) wait_stream(twin_stream_.handle(), twin_.handle(), until, "the receiver's broadcasts (twin)", late_);
      wait_stream(apply_.handle(), comm_.handle(), until, "the receiver's applies", late_);
    });
    timeline_.report(fmt::format("rank {} (receiver, cuda:{})", rank_, device_));
    timeline_.reset();
  }

  void abort() noexcept override {
    abort_both(comm_, twin_);
    attached_ = false;
  }

 private:
  void require_session(std::string_view call) const {
    if (!attached_)
      throw error(errc::transport, fmt::format("nccl: {} without a session (it was aborted); the streamer must say "
                                               "HELLO again",
                                               call));
  }

  template <class F>
  void or_abort(F&& f) {
    try {
      f();
    } catch (...) {
      abort();
      throw;
    }
  }

  /// The announced buffer sizes, the warm-up scratch, and the streams and events, made once. The
  /// receive buffers themselves come with offer_in_place() (none for an in-place session); the
  /// last session's are kept when the sizes match and freed first otherwise (two sessions' worth
  /// need not fit at once).
  void prepare(const wire::hello& h) {
    sizes_.clear();
    for (const wire::buffer_desc& b : h.buffers) sizes_.push_back(b.bytes);
    bool same = recv_.size() == sizes_.size();
    for (std::size_t i = 0; same && i < recv_.size(); ++i) same = recv_[i].bytes() == sizes_[i];
    if (!same) recv_.clear();
    if (scratch_.bytes() != warm_up_bytes(sizes_[0])) {
      scratch_ = cuda::device_buffer();
      scratch_ = cuda::device_buffer(warm_up_bytes(sizes_[0]));
    }
    if (!comm_stream_) comm_stream_ = make_comm_stream();
    if (!ahead_) ahead_.emplace();
    if (!apply_) apply_ = make_stream();
    while (received_.size() < sizes_.size()) received_.push_back(make_event());
    while (applied_.size() < sizes_.size()) applied_.push_back(make_event());
  }

  /// The receive buffers of the announced sizes, unless they exist already.
  void make_buffers() {
    if (!recv_.empty()) return;
    device_guard guard(device_);
    try {
      for (const std::uint64_t bytes : sizes_) recv_.emplace_back(bytes);
    } catch (const error& e) {
      recv_.clear();
      throw error(errc::cuda, fmt::format("nccl: cannot allocate this receiver's {} receive buffers of {} bytes on "
                                          "cuda:{}: {}; ask for smaller buffer_bytes on the streamer, or register a "
                                          "parameter table on this GPU (then nothing is staged)",
                                          sizes_.size(), sizes_.empty() ? 0 : sizes_[0], device_, e.what()));
    }
  }

  int device_;
  milliseconds timeout_;
  std::string peer_;
  std::string late_;  ///< what a timeout of the session means, for messages
  bool attached_ = false;
  bool streamer_parts_ = false;  ///< this session's streamer sends parts (nccl_session::parts)
  bool parts_ = false;           ///< this session receives only parts (parts())
  cuda::stream comm_stream_;
  cuda::stream twin_stream_;  ///< the twin communicator's broadcasts (nccl_session::paired)
  cuda::stream apply_;
  std::vector<std::uint64_t> sizes_;       ///< the buffers the streamer announced
  std::vector<cuda::device_buffer> recv_;  ///< made for sessions that stage (make_buffers)
  slot_areas scatter_;                     ///< per buffer slot: parts received apart (scatter())
  cuda::device_buffer scratch_;            ///< the warm-up broadcast's bytes
  std::vector<cuda::event> received_;
  std::vector<cuda::event> applied_;
  pending_batch batch_;  ///< where the entries of the next batch land (entries())
  int rank_ = 0;
  std::optional<lookahead_ring> ahead_;  // made with the streams (needs a device)
  timeline timeline_;
  communicator comm_;  // last: aborted before the buffers and streams it uses are released
  communicator twin_;  ///< paired sessions: odd buffers' broadcasts (see on_twin)
};

std::unique_ptr<source> make_nccl_source(const source_options& options) {
  (void)require_nccl();  // which NCCL, before any call into it: a clear error when there is none
  return std::make_unique<nccl_source>(options);
}

std::unique_ptr<sink> make_nccl_sink(int device, milliseconds timeout) {
  (void)require_nccl();
  return std::make_unique<nccl_sink>(device, timeout);
}

}  // namespace

}  // namespace refit::transport

// The registration. A failure at any rank ends the collective everywhere; receives in place when granted.
REFIT_TRANSPORT(nccl, {refit::transport::transport_name,
                       refit::transport::capabilities{1u << 16, false, true, true, false, true},
                       refit::transport::make_nccl_source, refit::transport::make_nccl_sink});
