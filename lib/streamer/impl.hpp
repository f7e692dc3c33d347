// refit — the streamer's state (streamer::impl), shared by the parts of lib/streamer/.
//
// The struct holds the state; its behaviour lives in the parts, each one concern:
//   options.cpp  the options checked, the transport and copier made (the constructor)
//   session.cpp  HELLO, control lanes, the receivers' conversions, ABORT, the session dropped
//   post.cpp     requests to every receiver: post, collect, settle
//   refit.cpp    one version: BEGIN (with its read-ahead), each tensor of the source, END
//   tensor.cpp   what a tensor of the source must be, and where a shard lies in its whole
//   batch.cpp    the batch writer: entries, copies, packing, BATCH posted
//   direct.cpp   writes into the receivers' memory: direct copies, peer engines, in-place parts
//   convert.cpp  tensors the receivers asked converted (casts, fp8 scales, fused block128)
//   delta.cpp    a delta version: diffs against the base, patches placed, the base kept
//   fleet.cpp    the receivers changing: added and removed between versions, dropped on failure
// Each member function is documented where it is defined.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "refit/streamer.hpp"

#include "channel/channel.hpp"
#include "config/config.hpp"
#include "copy/copy.hpp"
#include "delta/base.hpp"
#include "delta/host_diff.hpp"
#include "delta/patch.hpp"
#if REFIT_HAVE_CUDA
#include "delta/device.hpp"
#endif
#include "refit/plan.hpp"
#include "transport/transport.hpp"
#include "wire/wire.hpp"

namespace refit {

// Hidden by hand: a nested class takes the visibility of the class around it, and streamer is
// REFIT_API, but impl is no API (librefit.so would export its members and lambdas).
struct __attribute__((visibility("hidden"))) streamer::impl {
  streamer_options options;
  std::string token;
  /// The session's secret (new at every HELLO), carried by every later request of the session.
  std::string secret;
  plan_options plan;
  std::unique_ptr<transport::source> buffers;
  transport::capabilities can;  ///< of the transport, asked once
  std::unique_ptr<copy::copier> copier;
  std::unique_ptr<copy::copier>
      engines;  ///< copy engines for direct writes to other GPUs (peer_copier), made when first needed
  std::vector<std::string> endpoints;
  std::vector<channel::req_channel> channels;  ///< one per receiver; made on the first HELLO
  bool in_session = false;
  /// What the session's receivers asked each name to be sent as (their OKs to HELLO), merged.
  std::unordered_map<std::string, wire::conversion> conversions;
  /// Set by request() when it throws: a receiver refused or stayed silent, so the failure is
  /// known on that side (no ABORT needed).
  bool receivers_failed = false;
  /// The delta base (streamer_options::delta), or null.
  std::unique_ptr<delta::base_store> base;
  bool warned_base_bound = false;
  /// The version of the refit under way (add_receiver and remove_receiver are refused meanwhile).
  std::optional<std::uint64_t> version_in_progress;
  /// The receivers changed in a way the open session cannot follow: the next version opens a new one.
  bool membership_changed = false;
  /// The receivers the refit under way dropped (refit_stats::dropped).
  std::vector<dropped_receiver> dropped;
  /// A receiver dropped that is tried again (streamer_options::rejoin): `wait` versions from now,
  /// then after twice `backoff` if it fails again.
  struct rejoining {
    std::string endpoint;
    std::uint64_t wait = 0;
    std::uint64_t backoff = 1;
  };
  static constexpr std::uint64_t max_rejoin_backoff = 64;
  std::vector<rejoining> rejoins;

  explicit impl(streamer_options o);

  using clock = std::chrono::steady_clock;
  static double seconds_since(clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); }

  /// How one refit is sent.
  enum class sending : std::uint8_t { whole, subset, delta };

  // direct.cpp: the copy engines of direct writes to other GPUs.
  [[nodiscard]] bool peer_engine() const noexcept;
  copy::copier& peer_copier();

  // session.cpp
  void drop_session() noexcept;
  std::string who(std::size_t k) const;

  /// A request sent to every receiver whose replies are not collected yet (post(), collect()).
  struct failure {
    std::size_t receiver;
    errc code;
    std::string message;
    bool answered = false;  ///< the receiver answered ERROR (it heard the request, and knows)
    /// Not its own failure: dropped with its engine (streamer_options::receiver_groups), which
    /// another rank failed; it heard the request and answered, so it must be told ABORT.
    bool with_engine = false;
  };
  struct in_flight {
    std::string what;
    clock::time_point started;
    clock::time_point deadline;
    std::vector<bool> sent;
    std::vector<failure> failures;
    bool session_lost = false;
  };
  std::optional<in_flight> flight;

  // fleet.cpp: the receivers changing.
  void check_receivers_left() const;
  void check_can_change(std::string_view what) const;
  void add_receiver(std::string endpoint);
  void remove_receiver(std::string_view endpoint);
  [[nodiscard]] bool droppable(const failure& f) const noexcept;
  void drop_failed(std::vector<failure>& failures, std::vector<wire::ok>& oks);
  void add_engine_peers(std::vector<failure>& failures) const;
  [[nodiscard]] std::vector<std::size_t> engine_peers(std::size_t k) const;
  void tell_dropped(std::size_t k, const failure& f) noexcept;
  void forget_receiver(std::size_t k) noexcept;
  void queue_rejoin(const std::string& endpoint);
  void try_rejoins();
  void forget_rejoined() noexcept;

  // post.cpp: one request to every receiver at a time.
  std::vector<wire::ok> request(const std::function<wire::message(std::size_t)>& make, const std::string& what,
                                const std::function<void()>& between = {});
  std::vector<wire::ok> request(const wire::message& m, const std::string& what,
                                const std::function<void()>& between = {});
  void post(const std::function<wire::message(std::size_t)>& make, const std::string& what);
  void post_alike(std::string_view bytes, const std::string& what);
  in_flight& start_flight(const std::string& what);
  void send_posted(in_flight& f, std::size_t k, std::string_view bytes);
  static milliseconds left_of(const in_flight& f);
  [[nodiscard]] bool replies_ready();
  std::vector<wire::ok> collect();
  void settle() noexcept;

  /// The source of one refit, read ahead while BEGIN's replies are on their way (a round trip is
  /// a tenth of a millisecond or more, and a Python source converts a tensor in a microsecond or
  /// two), at most what the buffers hold: the tensors read ahead are handed out first, then the
  /// rest. Tensors stay valid until refit() returns, so nothing read ahead is lost when BEGIN must
  /// be said again (HELLO anew, a delta refused and sent whole). An exception of the source while reading ahead is rethrown
  /// where it would have been, once BEGIN is through (so the receivers hear ABORT).
  class read_ahead final : public tensor_source {
   public:
    explicit read_ahead(tensor_source& inner) : inner_(inner) {}
    std::optional<tensor_ref> next() override;
    double fill(const std::function<bool()>& arrived, std::uint64_t max_bytes);

   private:
    static constexpr std::size_t max_ahead = 1u << 16;
    tensor_source& inner_;
    std::vector<tensor_ref> ahead_;
    std::uint64_t bytes_ = 0;
    std::size_t next_ = 0;
    bool ended_ = false;
    std::exception_ptr failed_;
  };

  // session.cpp: HELLO, lanes, conversions, ABORT.
  void ensure_session();
  void open_lanes(const std::vector<wire::ok>& oks);
  std::unordered_map<std::string, wire::conversion> merge_conversions(const std::vector<wire::ok>& oks) const;
  void abort_everywhere(std::uint64_t version, errc code, const std::string& reason) noexcept;
  void tell_abort(std::uint64_t version, errc code, const std::string& reason) noexcept;

  /// Where a shard (tensor_ref::shard) lies in its whole tensor: the whole tensor's meta, and the
  /// shard's first element and element count (one contiguous range of the whole). Throws
  /// errc::invalid_argument naming the tensor for a shard that does not fit its whole, is not one
  /// contiguous range, or is a part of a tensor while this streamer is alone (group_size 1).
  struct shard_place {
    tensor_meta whole;
    std::uint64_t first = 0;
    std::uint64_t count = 0;
  };

  // tensor.cpp: each tensor of the source.
  shard_place place_shard(const tensor_ref& t) const;
  void check_tensor(const tensor_ref& t, std::uint64_t bytes) const;
  std::uint64_t to_whole(tensor_ref& t, std::uint64_t bytes, sending how, std::optional<shard_place>& part) const;

  // refit.cpp: one version, BEGIN to END.
  [[nodiscard]] bool receivers_read_in_place(sending how) const;
  void say_begin(std::uint64_t version, sending how, read_ahead& ahead, refit_stats& stats);
  sending begin_refit(std::uint64_t version, refit_scope scope, refit_stats& stats, read_ahead& ahead);
  refit_stats run(std::uint64_t version, tensor_source& source, refit_scope scope);
  void end_engine_wide(const wire::end& e, refit_stats& stats);

  /// Direct writes planned between two questions whether the device is idle (see send_tensors).
  static constexpr std::uint64_t direct_check_bytes = 16ull << 20;
  static constexpr std::uint64_t direct_launch_cap = 256ull << 20;
  /// Entries of a direct session's manifest before a piece of it may be sent (see send_tensors):
  /// a receiver checks an entry in about a microsecond, cold, and a piece costs a round trip. A
  /// long manifest's pieces grow with it (an eighth of the tensors sent, up to the max): each piece
  /// costs both sides an encode, a decode and a reply, and the last one is checked before END.
  static constexpr std::size_t direct_manifest_entries = 32;
  static constexpr std::size_t direct_manifest_entries_max = 128;
  /// Bytes of tensors a batch the receiver reads in place covers at most (unless a buffer is
  /// larger): large enough that a batch's round trip is small beside its copies, small enough that
  /// the receiver's work on one batch overlaps the streamer's on the next (H100: llama3-8b 13.2 ms
  /// at 256 MiB as at 1 GiB; qwen2.5-0.5b 1.5 ms at 256 MiB, 2.1 ms in one 1 GiB batch).
  static constexpr std::uint64_t shared_batch_bytes = 256ull << 20;

  /// The batches of one version as send_tensors() builds them: the open batch (its entries for
  /// the wire and its copies for the packer), the kind of session, and the direct writes planned
  /// but not launched yet.
  struct batch_writer {
    impl& st;
    std::uint64_t version;
    refit_stats& stats;
    // A direct session copies straight into the receiver's weights; the batches then only carry
    // the manifest, and no buffer is reused, so there is nothing to wait for between them.
    bool direct;
    // A transport that moves entries one by one (nccl) sends a tensor already on its device from
    // the tensor itself: only the others are packed. When every receiver receives in place too,
    // no buffer holds a batch, and every tensor must be sent from where it is.
    bool by_entry;
    bool in_place;
    /// In place, and each receiver takes only its parts of every entry (transport::source::parts).
    bool parts;
    /// The receiver reads tensors of the buffers' device where they are (transport::source::share);
    /// set by send_tensors for versions that are not deltas.
    bool shares = false;

    std::uint64_t seq = 0;
    std::size_t planned = 0;  ///< tensors given to the planner, scale tensors included
    /// The batch the planner numbers 0 (a delta starts a new planner when it closes a batch early).
    std::uint64_t first_batch = 0;
    /// Tensor bytes a delta's open batch covers (see send_delta).
    std::uint64_t covered = 0;
    std::vector<wire::entry> entries;
    std::vector<copy::op> ops;
    std::vector<copy::op> peer_ops;      ///< of ops, those the copy engines take (impl::peer_engine)
    std::vector<copy::convert_op> cops;  ///< converting copies (destinations that asked another dtype)
    std::vector<copy::scale_job> jobs;   ///< scale passes of quantised tensors, before their copies
    std::vector<copy::fused_job> fused;  ///< one-pass block128 direct writes
    std::vector<void*> streams;
    std::vector<transport::segment> segments;  ///< by_entry: every entry, packed or in place
    std::vector<std::string> sources;          ///< memory of this process the open batch announces
    std::uint64_t shared_open = 0;             ///< bytes of the open batch read in place
    std::uint64_t shared_entries = 0;          ///< its entries read in place
    std::vector<plan::run> pieces;             ///< scratch of copy::append_route
    /// Patches of the open batch: their copies into the buffer run at flush().
    std::deque<std::vector<std::byte>> patches;

    // Direct writes need nothing from the receiver until the batch's manifest is sent, so they may
    // be launched as they are planned: when the source is slower than the copies (a Python
    // state_dict's conversion, a generator's all-gather), copying the first tensors overlaps
    // gathering the next ones. They are launched when the device has finished what was launched
    // before but the last (asked every direct_check_bytes, without waiting), so a fast source
    // still makes a few large launches (each ends in a partly idle wave of the copy kernel, which
    // the next launch fills only when it runs beside: copier::run_beside; 64 MiB launches in order
    // throughout cost llama3-8b 14% on an H100).
    // A launch also waits until what it carries is at least a quarter of what this refit launched
    // before (at most direct_launch_cap): launches grow as the refit goes on, instead of staying at
    // the check's size when the device keeps up with the planning (qwen3-30b-a3b's 18,867 tensors
    // then went in ~3,100 launches of ~20 MB, half the refit idle between them:
    // bench/results/2026-11-28-h200-moe-direct-timeline.txt).
    std::uint64_t direct_pending = 0;
    std::uint64_t direct_checked = 0;
    std::uint64_t direct_launched = 0;  ///< bytes of direct writes launched in this refit
    batch_writer(impl& s, std::uint64_t v, refit_stats& r);
    ~batch_writer();
    batch_writer(const batch_writer&) = delete;
    batch_writer& operator=(const batch_writer&) = delete;

    // batch.cpp: the open batch, packed and posted.
    [[nodiscard]] plan_options plan_for(const plan_options& base) const;
    void run_ops();
    void begin_pack(std::size_t buffer);
    void flush(bool launch = true);
    bool share_whole(const tensor_ref& t, std::uint64_t shift, std::uint64_t bytes, planner& pl);
    void add_copied(wire::entry e, const std::byte* from);
    void add_entry(const tensor_ref& t, const placement& p);
    void add(const tensor_ref& t, const placement& p, std::span<const transport::routed> targets,
             const copy::cvt::conversion* cv = nullptr);

    // direct.cpp: direct writes launched as they are planned; a parts session's segments.
    void launch_direct();
    void note_direct(std::uint64_t bytes);
    void split_parts(std::size_t buffer);

    // convert.cpp: converted tensors.
    [[noreturn]] void refuse_unconverted(const tensor_ref& t) const;
    void add_fused(const tensor_ref& t, const placement& p, copy::fused_job job, device src_dev);
    void add_converted(const tensor_ref& t, const placement& p, std::span<const transport::routed> targets,
                       const copy::cvt::conversion& cv);
  };

#if REFIT_HAVE_CUDA
  /// A device tensor of a delta waiting for its group's diff (see send_device_group).
  struct queued_tensor {
    std::size_t index;  ///< the planner's index
    tensor_ref t;
    delta::base_store::tensor* base;
  };
#endif
  /// Scratch of send_delta(): a host tensor's spans and what their diff found (its patches until
  /// placed); the device tensors of the open group.
  struct delta_scratch {
    std::vector<delta::host_span> spans;
    std::vector<delta::span_patch> found;
    std::vector<delta::host_differ::target> targets;  ///< patches placed, to write before their batch is sent
#if REFIT_HAVE_CUDA
    std::vector<queued_tensor> group;
    std::vector<delta::cuda::diff_tensor> diffs;
    std::uint64_t group_bytes = 0;
#endif
  };
  delta_scratch delta_buffers;  ///< kept between refits
  /// The batch writer's manifest and copy list, kept between refits with their capacity: a large
  /// batch's vectors grown anew at every refit cost page faults.
  struct writer_scratch {
    std::vector<wire::entry> entries;
    std::vector<copy::op> ops;
  };
  writer_scratch writer_spare;
  /// The names a version's source yielded so far (each at most once), kept between refits.
  wire::recycled_names sent_names;
  /// A direct session's routes of one tensor, as routes() gave them for its type and shape in
  /// session `session` (their runs stay valid while the session lasts: each destination's route
  /// cache is only recomputed for another type or shape, when this memo is too).
  struct route_memo {
    std::uint64_t session = 0;  ///< 0: none
    dtype type = dtype::u8;
    std::vector<std::int64_t> shape;
    std::vector<transport::routed> routes;
    /// The receivers' conversion of the name (an element of `conversions`, or null), looked up in
    /// session `conversion_session` (0: not yet): a lookup in a table of every float destination's
    /// name cost qwen3-30b-a3b's streamer ~0.4 of its host time per tensor.
    std::uint64_t conversion_session = 0;
    const wire::conversion* conversion = nullptr;
  };
  /// The last refit's tensors in the order they came (see wire::yield_order): a refit of the same
  /// tensors in the same order checks their names and finds their routes without a lookup.
  wire::yield_order<route_memo> order;
  std::uint64_t session_number = 0;  ///< counts the sessions made (route_memo::session)
  /// The host diff's threads and scratch, made at the first host diff (options.delta.threads).
  std::unique_ptr<delta::host_differ> host_differ;
#if REFIT_HAVE_CUDA
  std::unique_ptr<delta::cuda::workspace> device_delta;  ///< the device diff's scratch (made with a delta streamer)
  delta::cuda::workspace& device_workspace();
#endif

  // delta.cpp: a delta version, a strategy the batch writer calls (send_delta, finish_delta) and
  // hears from at each flush (launch_delta_writes, recycle_patches).
  [[nodiscard]] std::uint64_t delta_batch_covers() const noexcept;
  bool keep_in_base(const tensor_ref& t, std::uint64_t bytes, std::uint64_t& checksum, refit_stats& stats);
  static void add_span_bytes(batch_writer& w, const tensor_ref& t, std::uint64_t off, const placement& p,
                             const std::byte* src);
  void close_if_covered(batch_writer& w, planner& pl, std::uint64_t total) const;
  void send_delta(batch_writer& w, planner& pl, std::size_t index, const tensor_ref& t, delta_scratch& sc,
                  std::uint64_t& checksum);
  void send_host(batch_writer& w, planner& pl, std::size_t index, const tensor_ref& t, delta::base_store::tensor& b,
                 delta_scratch& sc, std::uint64_t& checksum);
  void place_spans(batch_writer& w, planner& pl, std::size_t index, const tensor_ref& t,
                   std::span<delta::span_patch> found, std::size_t from, std::size_t to,
                   std::span<const delta::host_span> group, std::size_t first, delta_scratch& sc);
  void finish_delta(batch_writer& w, planner& pl, delta_scratch& sc);
  void forget_failed_delta(sending how, delta_scratch& scratch);
  void take_device_terms(sending how, std::uint64_t* checksum);
  void launch_delta_writes();
  void recycle_patches(std::deque<std::vector<std::byte>>& patches);
#if REFIT_HAVE_CUDA
  void queue_device(batch_writer& w, planner& pl, std::size_t index, const tensor_ref& t, delta::base_store::tensor& b,
                    delta_scratch& sc);
  void send_device_group(batch_writer& w, planner& pl, delta_scratch& sc);
  void place_device(batch_writer& w, planner& pl, const queued_tensor& q, std::size_t i, delta::cuda::workspace& ws);
#endif

  // direct.cpp
  void check_in_place(const tensor_ref& t, std::uint64_t bytes, std::uint64_t version) const;

  // convert.cpp
  const wire::conversion* conversion_for(const tensor_ref& t, route_memo* memo) const;
  void send_converted(batch_writer& w, planner& pl, const tensor_ref& t, const wire::conversion& c, refit_stats& stats,
                      const shard_place* part = nullptr);
  copy::fused_job staged_fused_job(const tensor_ref& t, tensor_ref& scale);
  bool send_striped(batch_writer& w, planner& pl, const tensor_ref& t, const tensor_ref& sent, tensor_ref& scale);
  const float* queue_scale_pass(batch_writer& w, const tensor_ref& t, const wire::conversion& c, tensor_ref& scale,
                                tensor_ref* scale_2);
  void send_scale(batch_writer& w, planner& pl, const tensor_ref& scale,
                  std::span<const transport::routed> scale_targets, refit_stats& stats);
  static std::vector<copy::fused_job> fused_jobs(const tensor_ref& t, std::span<const transport::routed> targets,
                                                 std::span<const transport::routed> scale_targets);

  // refit.cpp: the tensors between BEGIN and END.
  void send_tensors(std::uint64_t version, tensor_source& source, refit_stats& stats, sending how,
                    std::uint64_t* checksum, bool& keep);
  void send_tensor(batch_writer& w, planner& pl, tensor_ref& t, sending how, delta_scratch& scratch,
                   std::uint64_t* checksum, bool& keep);
  void send_as_is(batch_writer& w, planner& pl, const tensor_ref& t, std::uint64_t bytes, std::uint64_t shift,
                  std::span<const transport::routed> targets, std::uint64_t* checksum, bool& keep);
  void end_tensors(batch_writer& w, sending how, std::uint64_t* checksum);
  void wake_before_end();
  void drain_quietly() noexcept;
};

}  // namespace refit
