// refit — the streamer: the policy side's state machine.
//
// One refit: HELLO once per session, BEGIN, then for each tensor the source yields, the planner
// places it into the open batch; when a batch closes it is packed into its ping-pong buffer with
// one copy call, published, and sent as BATCH; the reply means the receiver has taken it (GPU:
// enqueued its reads; CPU: finished the batch before it), so packing the next batch into the other
// buffer overlaps the receiver applying this one. END commits.
//
// A refit that fails on this side after BEGIN (a tensor it cannot send, the source throwing, a
// copy failing) sends ABORT to every receiver, best effort with a short deadline, so that none is
// left holding a half-applied refit until its idle timeout; then the caller gets the original
// error. A refit that fails because a receiver refused or stayed silent needs none: that receiver
// knows, and the session is rebuilt.
#include "refit/streamer.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <exception>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <random>
#include <unordered_set>
#include <utility>
#include <vector>

#include "channel/channel.hpp"
#include "channel/lane.hpp"
#include "config/config.hpp"
#include "copy/copy.hpp"
#include "delta/base.hpp"
#include "delta/checksum.hpp"
#include "delta/host_diff.hpp"
#include "delta/patch.hpp"
#if REFIT_HAVE_CUDA
#include "delta/device.hpp"
#endif
#include "model/log.hpp"
#include "model/text.hpp"
#include "refit/plan.hpp"
#include "transport/registry.hpp"
#include "transport/transport.hpp"
#include "wire/wire.hpp"

namespace refit {
namespace {

using clock = std::chrono::steady_clock;

double seconds_since(clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); }

std::string token_from(const std::string& configured) {
  if (!configured.empty()) return configured;
  const char* env = std::getenv("REFIT_TOKEN");
  return env != nullptr ? std::string(env) : std::string();
}

/// A fresh session secret (wire::hello::secret): 16 bytes from the system's random source. Every
/// request of the session carries it, so that no other peer of the receiver can act in it.
std::string new_secret() {
  std::random_device rd;
  std::string s(16, '\0');
  for (std::size_t i = 0; i < s.size(); i += 4) {
    const std::uint32_t v = rd();
    std::memcpy(s.data() + i, &v, 4);
  }
  return s;
}

plan_options plan_from(const streamer_options& o) {
  plan_options p;
  p.buffer_bytes = o.buffer_bytes;
  p.alignment = o.alignment;
  p.keep_whole = o.keep_whole;
  return p;
}

/// The receivers' endpoints: options.receivers, or the one options.endpoint.
std::vector<std::string> endpoints_of(const streamer_options& o) {
  if (!o.receivers.empty()) return o.receivers;
  return {o.endpoint};
}

/// The registered name of the transport the options ask for.
std::string transport_name_of(const streamer_options& o) {
  return o.transport_name.empty() ? std::string(to_string(o.transport)) : o.transport_name;
}

/// Most threads a host diff may have (delta_options::threads).
constexpr std::size_t max_delta_threads = delta::max_threads;

void validate(const streamer_options& o) {
  const auto endpoints = endpoints_of(o);
  for (const auto& ep : endpoints)
    if (ep.empty())
      throw error(errc::invalid_argument,
                  "streamer_options.endpoint is empty: pass the receiver's endpoint() (ipc://... or tcp://host:port)");
  const std::string name = transport_name_of(o);
  if (transport::find_transport(name) == nullptr)
    throw error(errc::invalid_argument,
                fmt::format("transport {} is not built into this refit (built: {}); rebuild with -Dcuda=enabled / "
                            "-Dnccl=enabled, or use host_shm",
                            name, transport::registered_transports()));
  const transport::capabilities can = transport::capabilities_of(name);
  if (endpoints.size() > can.max_receivers)
    throw error(errc::invalid_argument,
                fmt::format("{} receivers given, but the {} transport serves {} receiver{} per streamer; use cuda_ipc "
                            "(receivers on this host) or nccl to serve several",
                            endpoints.size(), name, can.max_receivers, can.max_receivers == 1 ? "" : "s"));
  if (endpoints.size() > 1 && can.several_need_direct && !o.direct)
    throw error(
        errc::invalid_argument,
        fmt::format("{} receivers given with direct = false, but the {} transport serves several receivers only "
                    "by writing straight into each one's parameter table: set direct = true",
                    endpoints.size(), name));
  if (o.buffer_count < 2)
    throw error(
        errc::invalid_argument,
        fmt::format("streamer_options.buffer_count is {}: refit needs at least 2 buffers (ping-pong)", o.buffer_count));
  if (o.buffer_count > wire::max_buffers)
    throw error(errc::invalid_argument, fmt::format("streamer_options.buffer_count is {}: at most {} buffers",
                                                    o.buffer_count, wire::max_buffers));
  if (o.timeout.count() <= 0) throw error(errc::invalid_argument, "streamer_options.timeout must be positive");
  channel::validate_curve(o.curve, false);
  refit::validate(plan_from(o));
  const bool buffered_gpu =
      (o.transport == transport_kind::cuda_ipc || o.transport == transport_kind::nccl) && REFIT_HAVE_CUDA;
  if (o.delta.enable && o.transport != transport_kind::host_shm && !(buffered_gpu && !o.direct))
    throw error(errc::invalid_argument,
                fmt::format("streamer_options.delta needs the host_shm transport, or cuda_ipc or nccl with direct = "
                            "false (patches travel in the buffers) in a build with CUDA, not {}{}",
                            to_string(o.transport), buffered_gpu ? " with direct = true" : ""));
  if (o.group_size == 0 || o.group_size > wire::max_group_size || o.group_rank >= o.group_size)
    throw error(errc::invalid_argument,
                fmt::format("streamer_options: group_rank {} of group_size {}: the size must be in [1, {}] and the "
                            "rank below it",
                            o.group_rank, o.group_size, wire::max_group_size));
  if (o.group_size > 1 && o.delta.enable)
    throw error(errc::invalid_argument,
                "streamer_options.delta with group_size > 1: a group of streamers sends whole versions (each rank's "
                "shards); turn delta off");
  if (o.delta.enable && o.delta.memory == delta_memory::device && o.transport == transport_kind::host_shm)
    throw error(errc::invalid_argument,
                "streamer_options.delta.memory is device, but the host_shm transport sends host tensors: keep the "
                "base in host memory");
  if (o.delta.threads > max_delta_threads)
    throw error(errc::invalid_argument,
                fmt::format("streamer_options.delta.threads is {}: the host diff takes at most {} threads (0: "
                            "min(hardware threads, 8)); beyond the memory bandwidth more only cost",
                            o.delta.threads, max_delta_threads));
}

/// How one refit is sent.
enum class sending : std::uint8_t { whole, subset, delta };

class span_source final : public tensor_source {
 public:
  explicit span_source(std::span<const tensor_ref> tensors) : tensors_(tensors) {}
  std::optional<tensor_ref> next() override {
    if (next_ == tensors_.size()) return std::nullopt;
    return tensors_[next_++];
  }

 private:
  std::span<const tensor_ref> tensors_;
  std::size_t next_ = 0;
};

class function_source final : public tensor_source {
 public:
  explicit function_source(const std::function<std::optional<tensor_ref>()>& next) : next_(next) {}
  std::optional<tensor_ref> next() override { return next_(); }

 private:
  const std::function<std::optional<tensor_ref>()>& next_;
};

}  // namespace

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

  explicit impl(streamer_options o) : options(std::move(o)) {
    validate(options);
    token = token_from(options.token);
    plan = plan_from(options);
    transport::source_options so;
    so.name = transport_name_of(options);
    can = transport::capabilities_of(so.name);
    so.count = options.buffer_count;
    so.bytes = options.buffer_bytes;
    so.device = options.device;
    endpoints = endpoints_of(options);
    so.receivers = endpoints.size();
    so.direct = options.direct && can.writes_in_place;
    so.twin = options.nccl_twin;
    buffers = transport::make_source(so);
    copier = copy::make_copier(copy::choose(buffers->engine(), options.engine), options.device, options.timeout);
    if (options.delta.enable)
      base = std::make_unique<delta::base_store>(
          options.delta.memory == delta_memory::device ? delta::memory::device : delta::memory::host,
          options.delta.max_bytes, options.device);
  }

  /// Whether this session's direct writes go by the copy engines: the engine is automatic and every
  /// destination lies on another GPU (transport::source::peers_elsewhere).
  [[nodiscard]] bool peer_engine() const noexcept {
    return options.engine == copy_engine::automatic && copier->kind() == copy::engine::kernel &&
           buffers->peers_elsewhere();
  }
  copy::copier& peer_copier() {
    if (!engines) engines = copy::make_copier(copy::engine::memcpy_batch, options.device, options.timeout);
    return *engines;
  }

  /// Forgets the session: the next refit says HELLO again.
  void drop_session() noexcept {
    in_session = false;
    buffers->close_session();
  }

  /// "the receiver at EP" or "receiver 2 of 3 (EP)".
  std::string who(std::size_t k) const {
    if (endpoints.size() == 1) return fmt::format("the receiver at {}", endpoints[k]);
    return fmt::format("receiver {} of {} ({})", k + 1, endpoints.size(), endpoints[k]);
  }

  /// A request sent to every receiver whose replies are not collected yet (post(), collect()).
  struct failure {
    std::size_t receiver;
    errc code;
    std::string message;
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

  /// Sends a message to every receiver (made per receiver by `make`), runs `between` (the
  /// transport's join at HELLO), then collects every reply, and returns the OKs. When any receiver
  /// refuses or stays silent, throws refit::error naming each one that did (with the first
  /// failure's code), after hearing out all the others, so every REQ socket stays usable. A silent,
  /// lost or confused receiver also ends the session; so does any failure on nccl, whose
  /// communicator cannot be trusted after one.
  std::vector<wire::ok> request(const std::function<wire::message(std::size_t)>& make, const std::string& what,
                                const std::function<void()>& between = {}) {
    post(make, what);
    if (between && flight->failures.empty()) {
      try {
        between();
      } catch (const error& e) {
        flight->failures.push_back({channels.size(), e.code(), e.what()});
        flight->session_lost = true;
      }
    }
    return collect();
  }

  /// The first half of request(): sends to every receiver and returns; collect() hears the
  /// replies. Nothing else may be sent meanwhile (one request at a time per channel).
  void post(const std::function<wire::message(std::size_t)>& make, const std::string& what) {
    in_flight& f = start_flight(what);
    for (std::size_t k = 0; k < channels.size(); ++k) send_posted(f, k, wire::encode(make(k), secret));
  }

  /// post() of one message every receiver gets alike, encoded once by the caller.
  void post_alike(std::string_view bytes, const std::string& what) {
    in_flight& f = start_flight(what);
    for (std::size_t k = 0; k < channels.size(); ++k) send_posted(f, k, bytes);
  }

  in_flight& start_flight(const std::string& what) {
    if (flight) throw error(errc::internal, fmt::format("{} while {} waits for its replies", what, flight->what));
    // Assigned, not emplace()d: clang (before 16) cannot tell a nested struct with member
    // initializers default-constructible inside its enclosing class.
    flight = in_flight{};
    in_flight& f = *flight;
    f.what = what;
    f.started = clock::now();
    f.deadline = f.started + options.timeout;
    f.sent.assign(channels.size(), false);
    return f;
  }

  /// Sends the request posted as `f` to receiver k; a failure is counted in `f`.
  void send_posted(in_flight& f, std::size_t k, std::string_view bytes) {
    try {
      channels[k].send(bytes, left_of(f), f.what);
      f.sent[k] = true;
    } catch (const error& e) {
      f.failures.push_back({k, e.code(), e.what()});
      f.session_lost = true;
    }
  }

  static milliseconds left_of(const in_flight& f) {
    return std::max(milliseconds{1}, std::chrono::ceil<milliseconds>(f.deadline - clock::now()));
  }

  /// True when every reply of the request posted has arrived (collect() would not wait).
  [[nodiscard]] bool replies_ready() {
    if (!flight) return true;
    for (std::size_t k = 0; k < channels.size(); ++k)
      if (flight->sent[k] && !channels[k].reply_ready()) return false;
    return true;
  }

  /// The second half of request(): the replies to the request posted, as request() returns them
  /// or throws.
  std::vector<wire::ok> collect() {
    if (!flight) throw error(errc::internal, "collect() without a request posted");
    in_flight f = std::move(*flight);
    flight.reset();
    const std::string& what = f.what;
    std::vector<failure>& failures = f.failures;
    bool session_lost = f.session_lost;
    std::vector<wire::ok> oks(channels.size());
    for (std::size_t k = 0; k < channels.size(); ++k) {
      if (!f.sent[k]) continue;
      try {
        const wire::message reply = wire::decode(channels[k].receive(left_of(f), what));
        if (const auto* ok = std::get_if<wire::ok>(&reply)) {
          oks[k] = *ok;
        } else if (const auto* err = std::get_if<wire::error>(&reply)) {
          failures.push_back({k, err->code, fmt::format("{} refused {}: {}", who(k), what, err->message)});
        } else {
          channels[k].reset();
          session_lost = true;
          failures.push_back({k, errc::protocol,
                              fmt::format("{} answered {} with {}, not OK or ERROR", who(k), what,
                                          wire::to_string(wire::type_of(reply)))});
        }
      } catch (const error& e) {
        // A timeout (the channel rebuilt itself) or a reply that does not decode.
        if (e.code() != errc::timeout) channels[k].reset();
        session_lost = true;
        failures.push_back({k, e.code(),
                            e.code() == errc::timeout
                                ? std::string(e.what())
                                : fmt::format("bad reply from {} to {}: {}", who(k), what, printable(e.what()))});
      }
    }
    if (failures.empty()) {
      REFIT_DEBUG("{}: answered by {} receiver(s) in {:.0f} us", what, channels.size(), seconds_since(f.started) * 1e6);
      return oks;
    }
    receivers_failed = true;
    if (session_lost || can.session_dies_on_error) drop_session();
    if (failures.size() == 1) throw error(failures.front().code, failures.front().message);
    std::string message = fmt::format("{} of {} receivers failed {}:", failures.size(), channels.size(), what);
    for (const auto& fl : failures) message += fmt::format("\n  - {}", fl.message);
    throw error(failures.front().code, message);
  }

  /// Hears out a request still posted (a refit that failed on this side with a batch in flight),
  /// so that the channels can be used again; what the receivers said is only logged.
  void settle() noexcept {
    if (!flight) return;
    try {
      (void)collect();  // takes the flight whatever it hears
    } catch (const std::exception& e) {
      REFIT_DEBUG("a request posted before the failure: {}", e.what());
    }
  }

  /// The same message to every receiver.
  std::vector<wire::ok> request(const wire::message& m, const std::string& what,
                                const std::function<void()>& between = {}) {
    return request([&](std::size_t) { return m; }, what, between);
  }

  /// The source of one refit, read ahead while BEGIN's replies are on their way (a round trip is
  /// a tenth of a millisecond or more, and a Python source converts a tensor in a microsecond or
  /// two), at most what the buffers hold: the tensors read ahead are handed out first, then the
  /// rest. Tensors stay valid until refit() returns, so nothing read ahead is lost when BEGIN must
  /// be said again (HELLO anew, a delta refused and sent whole). An exception of the source while reading ahead is rethrown
  /// where it would have been, once BEGIN is through (so the receivers hear ABORT).
  class read_ahead final : public tensor_source {
   public:
    explicit read_ahead(tensor_source& inner) : inner_(inner) {}
    std::optional<tensor_ref> next() override {
      if (next_ < ahead_.size()) return ahead_[next_++];
      if (failed_) std::rethrow_exception(std::exchange(failed_, nullptr));
      if (ended_) return std::nullopt;
      return inner_.next();
    }
    /// Reads ahead until `arrived()` (asked between tensors), the source ends or the tensors read
    /// ahead hold `max_bytes`; returns the seconds spent in the source.
    double fill(const std::function<bool()>& arrived, std::uint64_t max_bytes) {
      const auto t0 = clock::now();
      while (!ended_ && !failed_ && ahead_.size() < max_ahead && bytes_ < max_bytes && !arrived()) {
        try {
          std::optional<tensor_ref> t = inner_.next();
          if (t) {
            bytes_ += t->meta.nbytes();
            ahead_.push_back(std::move(*t));
          } else {
            ended_ = true;
          }
        } catch (...) {
          failed_ = std::current_exception();
        }
      }
      return seconds_since(t0);
    }

   private:
    static constexpr std::size_t max_ahead = 1u << 16;
    tensor_source& inner_;
    std::vector<tensor_ref> ahead_;
    std::uint64_t bytes_ = 0;
    std::size_t next_ = 0;
    bool ended_ = false;
    std::exception_ptr failed_;
  };

  void ensure_session() {
    if (in_session) return;
    if (channels.empty())
      for (const auto& ep : endpoints) channels.emplace_back(ep, options.curve);
    wire::hello h;
    h.token = token;
    secret = new_secret();
    h.secret = secret;
    h.alignment = options.alignment;
    h.layout = options.layout;
    h.group_rank = options.group_rank;
    h.group_size = options.group_size;
    h.reply_timeout_ms = static_cast<std::uint64_t>(options.timeout.count());
    h.lane = options.control_lane;
    buffers->open_session(h);
    if (h.host_id.empty()) h.host_id = transport::host_identity();  // a transport that does not say
    // HELLO starts a session afresh, through ZeroMQ: the receiver makes a new lane for it.
    for (channel::req_channel& c : channels) c.attach_lane(nullptr);
    try {
      const auto hello_to = [&](std::size_t k) {
        wire::hello mine = h;
        buffers->hello_for(k, mine);
        return wire::message(std::move(mine));
      };
      const auto oks = request(hello_to, "HELLO", [&] { buffers->join(options.timeout); });
      conversions = merge_conversions(oks);
      // The lanes first: memory shared as descriptors (VMM weights offered for direct writes, and
      // this side's VMM tensors later) needs each lane's descriptor link.
      open_lanes(oks);
      std::vector<std::shared_ptr<channel::fd_link>> links;
      for (const channel::req_channel& c : channels) links.push_back(c.fds());
      buffers->link(std::move(links));
      try {
        buffers->session_accepted(oks);
      } catch (const error& e) {
        // The receivers offered their weights for direct or in-place writes, but that cannot be done
        // from here: start over with a session that stages through the buffers (not where several
        // receivers need direct writes: cuda_ipc).
        if (e.code() != errc::transport || (endpoints.size() > 1 && can.several_need_direct)) throw;
        REFIT_WARN("cannot write straight into the weights of {}: {}; staging through the buffers instead",
                   endpoints.size() > 1 ? std::string("the receivers") : who(0), e.what());
        buffers->disable_direct();
        drop_session();
        ensure_session();
        return;
      }
    } catch (...) {
      drop_session();
      throw;
    }
    in_session = true;
    REFIT_INFO("session with {} receiver(s) at {}: {} × {} MiB {} buffers", endpoints.size(),
               fmt::join(endpoints, ", "), options.buffer_count, options.buffer_bytes >> 20,
               to_string(options.transport));
  }

  /// Sends the session's requests to each receiver through the control lane it offered, when it
  /// offered one and it opens here (otherwise through ZeroMQ, as before).
  void open_lanes(const std::vector<wire::ok>& oks) {
    if (!options.control_lane) return;
    for (std::size_t k = 0; k < oks.size() && k < channels.size(); ++k) {
      if (oks[k].lane.empty()) continue;
      try {
        channels[k].attach_lane(channel::lane::open(oks[k].lane));
      } catch (const error& e) {
        REFIT_INFO("cannot open the control lane of {} (requests go through ZeroMQ): {}", who(k), e.what());
      }
    }
  }

  /// The conversions every receiver asked for, one per name. Two receivers asking one name as
  /// different things cannot both be served by one stream of bytes: errc::invalid_argument.
  std::unordered_map<std::string, wire::conversion> merge_conversions(const std::vector<wire::ok>& oks) const {
    std::unordered_map<std::string, wire::conversion> merged;
    std::unordered_map<std::string, std::size_t> asked_by;
    for (std::size_t k = 0; k < oks.size(); ++k) {
      for (const wire::conversion& c : oks[k].convert) {
        const auto [it, fresh] = merged.emplace(c.name, c);
        if (fresh) {
          asked_by.emplace(c.name, k);
          continue;
        }
        if (it->second == c) continue;
        const auto describe_one = [](const wire::conversion& x) {
          return x.q == quant::none ? std::string(to_string(x.type))
                                    : fmt::format("{} ({})", to_string(x.type), to_string(x.q));
        };
        throw error(errc::invalid_argument,
                    fmt::format("tensor '{}': {} asks for it as {} and {} as {}: one streamer sends one conversion of "
                                "a tensor to all its receivers; register the same dtype and quant everywhere",
                                printable(c.name), who(asked_by.at(c.name)), describe_one(it->second), who(k),
                                describe_one(c)));
      }
    }
    return merged;
  }

  /// Where a shard (tensor_ref::shard) lies in its whole tensor: the whole tensor's meta, and the
  /// shard's first element and element count (one contiguous range of the whole). Throws
  /// errc::invalid_argument naming the tensor for a shard that does not fit its whole, is not one
  /// contiguous range, or is a part of a tensor while this streamer is alone (group_size 1).
  struct shard_place {
    tensor_meta whole;
    std::uint64_t first = 0;
    std::uint64_t count = 0;
  };
  shard_place place_shard(const tensor_ref& t) const {
    const tensor_shard& sh = *t.shard;
    shard_place out{tensor_meta{t.meta.name, t.meta.type, sh.global_shape}, 0, t.meta.numel()};
    const auto what = [&] {
      return fmt::format("tensor {}, a shard of {} at [{}] along dimension {}", describe(t.meta), describe(out.whole),
                         sh.start, sh.dim);
    };
    const std::size_t rank = sh.global_shape.size();
    if (rank != t.meta.shape.size() || sh.dim < 0 || static_cast<std::size_t>(sh.dim) >= std::max<std::size_t>(rank, 1))
      throw error(errc::invalid_argument,
                  fmt::format("{}: the shard and the whole must have the same number of dimensions, and the "
                              "dimension must be one of them",
                              what()));
    if (!checked_numel(sh.global_shape))
      throw error(errc::invalid_argument, fmt::format("{}: the whole's shape is not valid", what()));
    const auto dim = static_cast<std::size_t>(sh.dim);
    std::uint64_t inner = 1;
    for (std::size_t d = 0; d < rank; ++d) {
      if (d != dim && sh.global_shape[d] != t.meta.shape[d])
        throw error(errc::invalid_argument,
                    fmt::format("{}: the shard's size along dimension {} must be the whole's", what(), d));
      if (d < dim && sh.global_shape[d] != 1)
        throw error(errc::invalid_argument,
                    fmt::format("{}: a shard along dimension {} of a tensor whose dimension {} is {} is not one "
                                "contiguous range of it; shard along dimension 0 (FSDP's Shard(0))",
                                what(), dim, d, sh.global_shape[d]));
      if (d > dim) inner *= static_cast<std::uint64_t>(sh.global_shape[d]);
    }
    if (sh.start < 0 || sh.start > sh.global_shape[dim] - t.meta.shape[dim])
      throw error(errc::invalid_argument,
                  fmt::format("{}: [{}, {}) is not inside the whole's {} along dimension {}", what(), sh.start,
                              sh.start + t.meta.shape[dim], sh.global_shape[dim], dim));
    out.first = static_cast<std::uint64_t>(sh.start) * inner;
    if (options.group_size == 1 && out.count != out.whole.numel())
      throw error(errc::invalid_argument,
                  fmt::format("{}: this streamer is alone (streamer_options::group_size 1), so nobody sends the "
                              "rest; give each trainer rank its own streamer of a group (group_rank, group_size)",
                              what()));
    return out;
  }

  void check_tensor(const tensor_ref& t, std::uint64_t bytes) const {
    if (t.meta.name.empty()) throw error(errc::invalid_argument, "a tensor of the source has an empty name");
    if (t.meta.name.find('\x1f') != std::string::npos)
      throw error(errc::invalid_argument,
                  fmt::format("tensor name '{}' contains the control character \\x1f, which refit reserves for the "
                              "scale tensors of quantised destinations",
                              t.meta.name.substr(0, t.meta.name.find('\x1f'))));
    if (t.meta.name.size() > wire::max_name_bytes)
      throw error(errc::invalid_argument, fmt::format("tensor name of {} bytes is too long (at most {})",
                                                      t.meta.name.size(), wire::max_name_bytes));
    if (t.meta.shape.size() > wire::max_rank)
      throw error(errc::invalid_argument, fmt::format("tensor {} has {} dimensions: at most {}", describe(t.meta),
                                                      t.meta.shape.size(), wire::max_rank));
    if (t.data == nullptr && bytes != 0)
      throw error(errc::invalid_argument,
                  fmt::format("tensor {} has no data (null pointer); only a tensor with no elements may have none "
                              "(a 0-d tensor is one element: {} bytes)",
                              describe(t.meta), bytes));
    const device where = buffers->where();
    if (bytes != 0 && t.dev.kind != where.kind)
      throw error(errc::invalid_argument,
                  fmt::format("tensor {} is in {} memory, but the {} transport packs from {} memory; {}",
                              describe(t.meta), t.dev.kind == device_kind::cuda ? "CUDA" : "host",
                              to_string(options.transport), where.kind == device_kind::cuda ? "CUDA" : "host",
                              where.kind == device_kind::cuda ? "move it to the GPU first"
                                                              : "use the cuda_ipc or nccl transport for GPU tensors"));
  }

  /// Whether a refit sent `how` lets the receivers read the tensors where they are (share_tensors):
  /// a staged session of a transport that neither writes the receivers' weights itself (direct)
  /// nor moves entries one by one (nccl); never a delta, whose entries travel in the buffers.
  [[nodiscard]] bool receivers_read_in_place(sending how) const {
    return options.share_tensors && how != sending::delta && !buffers->direct() && !buffers->moves_entries();
  }

  /// Says BEGIN for `how` (a delta names the base); a receiver without a session makes it say HELLO
  /// again, once. `ahead` reads the source while the replies are on their way.
  void say_begin(std::uint64_t version, sending how, read_ahead& ahead, refit_stats& stats) {
    wire::begin b{version, how != sending::whole, std::nullopt};
    if (how == sending::delta) b.base = base->version();
    const std::string what = fmt::format("BEGIN of {}version {}", how == sending::delta ? "delta " : "", version);
    // No more ahead than the buffers hold: a source that gathers each tensor (an all-gather) then
    // holds no more than a refit in flight would.
    const std::uint64_t bound = options.buffer_count * options.buffer_bytes;
    const auto read = [&] {
      stats.source_seconds += ahead.fill(
          [&] {
            return std::all_of(channels.begin(), channels.end(),
                               [](channel::req_channel& c) { return c.reply_ready(); });
          },
          bound);
    };
    // The GPU may be time-sliced with a receiver's process (colocated), whose work ran last: the
    // switch to this process's context (~140 us on the H100 VMs) then happens now, while BEGIN's
    // replies travel, instead of holding up the first copies. Not where the receivers read the
    // tensors where they are (share_tensors): this side then launches nothing, and a switch here
    // would only delay the receiver's first reads by a switch back.
    if (!receivers_read_in_place(how)) copier->prime(buffers->stream());
    try {
      request(b, what, read);
    } catch (const error& e) {
      // A receiver that restarted since our HELLO has no session with us (or one that must
      // lay the session out anew), or takes this connection for a stranger (it was rebuilt since
      // HELLO, so the receiver sees another peer): start one, once.
      if (e.code() != errc::peer && e.code() != errc::unauthorized) throw;
      REFIT_INFO("{}; saying HELLO again", e.what());
      drop_session();
      ensure_session();
      request(b, what, read);
    }
  }

  /// Says BEGIN, as a delta when the base allows it; a receiver that refuses the delta
  /// (errc::needs_whole: it does not hold the base) gets the whole version instead.
  sending begin_refit(std::uint64_t version, refit_scope scope, refit_stats& stats, read_ahead& ahead) {
    sending how = scope == refit_scope::subset ? sending::subset : sending::whole;
    if (base && scope == refit_scope::subset) base->invalidate();  // the receivers' version is no base of ours
    if (base && how == sending::whole && base->version()) how = sending::delta;
    const auto tw = clock::now();
    const double reading = stats.source_seconds;
    try {
      say_begin(version, how, ahead, stats);
    } catch (const error& e) {
      if (how != sending::delta || e.code() != errc::needs_whole) throw;
      REFIT_INFO("{}; sending version {} whole", e.what(), version);
      base->invalidate();
      how = sending::whole;
      stats.whole_after_refusal = true;
      // A transport whose session dies on any refusal (nccl: the communicator is aborted, and
      // receivers that took the delta's BEGIN drop theirs at the next HELLO) needs a new one.
      ensure_session();
      say_begin(version, how, ahead, stats);
    }
    stats.wait_seconds += seconds_since(tw) - (stats.source_seconds - reading);
    stats.subset = how != sending::whole;
    stats.delta = how == sending::delta;
    if (stats.delta) stats.base = *base->version();
    return how;
  }

  refit_stats run(std::uint64_t version, tensor_source& source, refit_scope scope) {
    const auto t0 = clock::now();
    ensure_session();
    refit_stats stats;
    stats.version = version;
    read_ahead ahead(source);
    const sending how = begin_refit(version, scope, stats, ahead);
    // From here until END's reply the base is being rewritten: any failure leaves it unusable.
    std::uint64_t checksum = how == sending::delta ? base->checksum() : 0;
    if (base) base->invalidate();
    bool keep = base != nullptr && how != sending::subset;
    if (keep && how == sending::whole) base->begin_whole();  // repacks it if tensors changed size

    receivers_failed = false;
    try {
      send_tensors(version, ahead, stats, how, &checksum, keep);
    } catch (const error& e) {
      if (!receivers_failed) abort_everywhere(version, e.code(), e.what());
      throw;
    } catch (const std::exception& e) {
      if (!receivers_failed) abort_everywhere(version, errc::invalid_argument, e.what());
      throw;
    } catch (...) {
      if (!receivers_failed) abort_everywhere(version, errc::invalid_argument, "a non-standard exception");
      throw;
    }

    wire::end e{version, stats.tensors, stats.bytes, stats.batches, std::nullopt};
    if (keep) e.checksum = checksum;
    const auto tw = clock::now();
    request(e, fmt::format("END of version {}", version));
    buffers->refit_committed();
    stats.wait_seconds += seconds_since(tw);
    const auto td = clock::now();
    buffers->drain();
    REFIT_DEBUG("version {}: drained in {:.0f} us", version, seconds_since(td) * 1e6);
    if (keep) base->commit(version, checksum);
    if (base) stats.base_bytes = base->bytes();
    stats.seconds = seconds_since(t0);
    REFIT_INFO("version {} committed: {} tensors, {:.3f} GB in {} batches, {:.2f} ms", version, stats.tensors,
               static_cast<double>(stats.bytes) / 1e9, stats.batches, stats.seconds * 1e3);
    return stats;
  }

  /// Tells every receiver that this side gave up refit `version` (ABORT), within a short
  /// deadline, and ignores their answers: a receiver that misses it still aborts at its idle
  /// timeout. A silent one ends the session; so does nccl, whose receivers drop their
  /// communicator when they abort.
  void abort_everywhere(std::uint64_t version, errc code, const std::string& reason) noexcept {
    settle();
    if (receivers_failed) return;  // a receiver refused the batch in flight: it knows
    try {
      REFIT_INFO("version {} failed on the streamer's side: {}; telling {} receiver(s)", version, reason,
                 channels.size());
      const std::string bytes = wire::encode(wire::abort{version, code, reason}, secret);
      const std::string what = fmt::format("ABORT of version {}", version);
      const auto deadline = clock::now() + std::min(options.timeout, milliseconds{1000});
      const auto left = [&] {
        return std::max(milliseconds{1}, std::chrono::ceil<milliseconds>(deadline - clock::now()));
      };
      bool lost = can.session_dies_on_error;
      std::vector<bool> sent(channels.size(), false);
      for (std::size_t k = 0; k < channels.size(); ++k) {
        try {
          channels[k].send(bytes, left(), what);
          sent[k] = true;
        } catch (const std::exception& e) {
          REFIT_DEBUG("{} to {} not sent: {}", what, who(k), e.what());
          lost = true;
        }
      }
      for (std::size_t k = 0; k < channels.size(); ++k) {
        if (!sent[k]) continue;
        try {
          (void)channels[k].receive(left(), what);  // OK, or ERROR from a receiver too old to know ABORT
        } catch (const std::exception& e) {
          REFIT_DEBUG("{} not answered by {}: {}", what, who(k), e.what());
          lost = true;  // the channel rebuilt itself
        }
      }
      if (lost) drop_session();
    } catch (...) {
      drop_session();
    }
  }

  /// Direct writes planned between two questions whether the device is idle (see send_tensors).
  static constexpr std::uint64_t direct_check_bytes = 16ull << 20;
  /// Entries of a direct session's manifest before a piece of it may be sent (see send_tensors):
  /// a receiver checks an entry in about a microsecond, cold, and a piece costs a round trip.
  static constexpr std::size_t direct_manifest_entries = 32;
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
    // still makes a few large launches (each ends in a partly idle wave of the copy kernel: 64 MiB
    // launches throughout cost llama3-8b 14% on an H100).
    std::uint64_t direct_pending = 0;
    std::uint64_t direct_checked = 0;

    batch_writer(impl& s, std::uint64_t v, refit_stats& r)
        : st(s),
          version(v),
          stats(r),
          direct(s.buffers->direct()),
          by_entry(!direct && s.buffers->moves_entries()),
          in_place(by_entry && s.buffers->in_place()),
          parts(in_place && s.buffers->parts()) {
      stats.direct = direct || in_place;
      stats.control_lane =
          std::all_of(s.channels.begin(), s.channels.end(), [](const channel::req_channel& c) { return c.has_lane(); });
      entries = std::move(s.writer_spare.entries);
      ops = std::move(s.writer_spare.ops);
      entries.clear();
      ops.clear();
    }
    ~batch_writer() {
      entries.clear();
      ops.clear();
      st.writer_spare.entries = std::move(entries);
      st.writer_spare.ops = std::move(ops);
    }
    batch_writer(const batch_writer&) = delete;
    batch_writer& operator=(const batch_writer&) = delete;

    /// The planner's options for this session: direct and in-place batches are not buffer-sized,
    /// but those of a parts session that gathers are (its gather memory stays within buffer_bytes).
    [[nodiscard]] plan_options plan_for(const plan_options& base) const {
      plan_options p = base;
      if (direct || (in_place && !(parts && st.buffers->gathers()))) p.buffer_bytes = transport::direct_batch_bytes;
      return p;
    }

    /// Runs (enqueues) the copies planned so far, after the work of their producer streams.
    void run_ops() {
      if (direct)
        REFIT_DEBUG("version {}: launching {} direct copies ({} bytes), the device {}", version, ops.size(),
                    direct_pending, st.copier->idle() ? "idle" : "busy");
      for (void* s : streams) st.buffers->after(s);
      // Scales first: the converting copies read their multipliers, the plain copies of the scale
      // tensors their scale_inv.
      if (!jobs.empty()) st.copier->scales(jobs, st.buffers->stream());
      if (!cops.empty()) st.copier->convert(cops, st.buffers->stream());
      if (!fused.empty()) st.copier->fused(fused, st.buffers->stream());
      if (direct && !ops.empty() && st.peer_engine()) {
        // Every destination on another GPU: the contiguous copies go by the copy engines (one
        // batched call), strided runs by the kernel, in stream order.
        peer_ops.clear();
        std::erase_if(ops, [&](const copy::op& o) {
          if (o.rows != 1) return false;
          peer_ops.push_back(o);
          return true;
        });
        st.peer_copier().run(peer_ops, st.buffers->stream());
      }
      st.copier->run(ops, st.buffers->stream());
      fused.clear();
      jobs.clear();
      cops.clear();
      ops.clear();
      peer_ops.clear();
      streams.clear();
      direct_pending = 0;
      direct_checked = 0;
    }

    /// Before packing into `buffer`: where the transport does not order the packing after the
    /// receivers' reads of it by itself, the reply to the batch before (still posted) must be in
    /// first (it comes once the receivers have read the batch before that one, from this buffer).
    void begin_pack(std::size_t buffer) {
      if (st.flight && !st.buffers->orders_reuse()) {
        const auto tw = clock::now();
        (void)st.collect();
        stats.wait_seconds += seconds_since(tw);
      }
      st.buffers->begin_pack(buffer);
    }

    void launch_direct() {
      const auto tp = clock::now();
      run_ops();
      stats.pack_seconds += seconds_since(tp);
    }

    /// Packs (or launches) the open batch, sends its BATCH and waits for the replies. `launch`
    /// false: a direct session's piece of manifest, sent without launching the copies planned
    /// (they go when the device idles, as ever: see note_direct).
    void flush(bool launch = true) {
      const std::size_t buffer = seq % st.buffers->count();
      auto tp = clock::now();
      // A batch the receiver reads only where the tensors are writes nothing into the buffer, so it
      // neither waits for the receiver's last read of it nor, when the tensors are complete, makes
      // the receiver wait for this process's GPU work: no hand-off between the two.
      const bool packs_nothing = shares && std::none_of(entries.begin(), entries.end(), [](const wire::entry& e) {
                                   return e.bytes != 0 && e.source == 0;
                                 });
      if (!direct && !packs_nothing) begin_pack(buffer);
      if (parts) split_parts(buffer);  // its gathers run with the batch's copies
      if (launch || !direct) run_ops();
#if REFIT_HAVE_CUDA
      // A delta's patches written on the device (send_device_group) are queued until here.
      if (st.device_delta) delta::cuda::launch_writes(*st.device_delta);
#endif
      bool ready = false;
      if (!direct) {
        // A delta's entries (patches, and spans as bytes) all lie in the buffer, packed from its
        // start: one broadcast of the buffer's used part instead of one per entry. The receiver
        // asks for the same (apply()).
        if (by_entry && stats.delta) segments = transport::buffer_prefix(entries);
        if (by_entry) st.buffers->entries(buffer, segments);
        ready = packs_nothing && st.buffers->idle();
        if (!ready) st.buffers->end_pack(buffer);
      }
      stats.pack_seconds += seconds_since(tp);

      wire::batch b;
      b.version = version;
      b.seq = seq;
      b.buffer = static_cast<std::uint32_t>(buffer);
      b.entries = std::move(entries);
      b.sources = std::move(sources);
      b.ready = ready;
      tp = clock::now();
      if (st.flight) (void)st.collect();  // the batch before, posted
      // Its reply is heard at the next batch or before END: meanwhile the receiver checks this
      // manifest (and enqueues its reads of the buffer, or its receives) while this side reads,
      // packs and launches the next batch. One request per receiver at a time, as ever.
      st.post_alike(wire::encode(b, st.secret), fmt::format("BATCH {} of version {}", seq, version));
      stats.wait_seconds += seconds_since(tp);
      // The vectors come back for the next batch: their capacity stays (a large manifest's growth
      // anew at every batch cost page faults).
      entries = std::move(b.entries);
      sources = std::move(b.sources);
      ++stats.batches;
      seq += 1;
      entries.clear();
      segments.clear();
      sources.clear();
      shared_open = 0;
      shared_entries = 0;
      if (st.host_differ)
        for (std::vector<std::byte>& p : patches) st.host_differ->recycle(std::move(p));
      patches.clear();
      covered = 0;
    }

    /// A parts session: replaces the segment of each entry (the whole entry, in place or in the
    /// staging buffer) with one segment per receiver destination it reaches, holding that
    /// destination's bytes of it: sent from where they lie when they are one range of the tensor
    /// (rows: a column-parallel shard, a fused narrow(0)), else gathered first into the
    /// transport's gather memory (a column slice's rows), by copies that run with the batch's.
    /// Receivers compute the same segments from the manifest and their tables, in the same order.
    void split_parts(std::size_t buffer) {
      std::vector<transport::segment> whole = std::move(segments);
      segments.clear();
      // The gathered parts, in one pass: their segments and copies count from the gather memory,
      // asked for once their total is known.
      struct gathered_run {
        const std::byte* src;
        std::uint64_t at;
        plan::run r;
      };
      std::vector<gathered_run> runs;
      std::vector<std::size_t> gathered;  // their segments
      std::uint64_t cursor = 0;
      std::size_t next = 0;
      // This entry's gathered parts (their runs, where they start): a part several receivers take
      // alike (the same TP rank of two replicas) is gathered once and sent from there to each.
      std::vector<std::pair<std::vector<plan::run>, std::uint64_t>> alike;
      for (const wire::entry& e : entries) {
        if (e.bytes == 0) continue;
        alike.clear();
        if (next == whole.size())
          throw error(errc::internal, fmt::format("version {}: a batch of {} entries has {} segments", version,
                                                  entries.size(), whole.size()));
        const transport::segment& seg = whole[next++];
        const std::byte* base =
            seg.data != nullptr ? seg.data : st.buffers->staging(buffer) + seg.offset;  // converted: in staging
        for (const transport::routed& target : st.buffers->routes(tensor_meta{e.name, e.type, e.shape})) {
          pieces.clear();
          for (const plan::run& r : target.runs) plan::clip(r, e.tensor_offset, e.tensor_offset + e.bytes, pieces);
          if (pieces.empty()) continue;
          const std::uint64_t n = plan::bytes_of(pieces);
          const auto peer = static_cast<std::uint32_t>(target.receiver + 1);
          stats.parts_bytes += n;
          if (const auto lo = plan::contiguous(pieces, true)) {
            segments.push_back(transport::segment{const_cast<std::byte*>(base + (*lo - e.tensor_offset)), 0, n, peer});
            continue;
          }
          gathered.push_back(segments.size());
          // The bytes gathered depend on the source side of the runs only.
          const auto same = std::find_if(alike.begin(), alike.end(), [&](const auto& a) {
            return std::ranges::equal(a.first, pieces, [](const plan::run& x, const plan::run& y) {
              return x.src == y.src && x.src_pitch == y.src_pitch && x.width == y.width && x.rows == y.rows;
            });
          });
          if (same != alike.end()) {
            segments.push_back(transport::segment{nullptr, same->second, n, peer});
            continue;
          }
          alike.emplace_back(pieces, cursor);
          segments.push_back(transport::segment{nullptr, cursor, n, peer});
          for (const plan::run& r : pieces) {
            runs.push_back(gathered_run{base + (r.src - e.tensor_offset), cursor, r});
            cursor += r.width * r.rows;
          }
        }
      }
      if (cursor == 0) return;
      std::byte* memory = st.buffers->gather(buffer, cursor);
      if (memory == nullptr) throw error(errc::internal, "a parts session without gather memory");
      for (const std::size_t k : gathered)
        segments[k] = transport::segment{memory + segments[k].offset, 0, segments[k].bytes, segments[k].peer};
      for (const gathered_run& g : runs)
        ops.emplace_back(g.src, memory + g.at, g.r.width, g.r.rows, g.r.src_pitch, g.r.width);
    }

    /// Adds tensor `t` (its bytes [shift, shift + bytes)) whole to the open batch as an entry the
    /// receiver reads where it is (transport::source::share), or returns false (it is planned into
    /// the buffers). It takes no room in the buffer, so a batch of shared tensors grows to
    /// shared_batch_bytes (or the planner's entry bound): fewer, larger batches, each tensor whole.
    bool share_whole(const tensor_ref& t, std::uint64_t shift, std::uint64_t bytes, planner& pl) {
      if (!shares || bytes == 0 || !(t.dev == st.buffers->where())) return false;
      const std::uint64_t bound = std::max(shared_batch_bytes, st.buffers->buffer_bytes());
      if ((shared_open != 0 && shared_open + bytes > bound) ||
          pl.open_entries() + shared_entries + 1 > pl.options().max_entries) {
        flush();
        pl = planner(pl.options());  // the planner's open batch went with it
        first_batch = seq;
      }
      const auto* from = static_cast<const std::byte*>(t.data) + shift;
      const auto at = st.buffers->share(from, bytes, sources);
      if (!at) return false;
      add_entry(t, placement{seq, plan_entry{0, shift, bytes, at->offset}});
      entries.back().source = at->source;
      shared_open += bytes;
      shared_entries += 1;
      stats.shared_bytes += bytes;
      return true;
    }

    /// Adds an entry whose buffer bytes are copied from `from` (host memory valid until the next
    /// flush): a delta's patch, or a span of a tensor sent as bytes.
    void add_copied(wire::entry e, const std::byte* from) {
      if (e.bytes != 0)
        ops.push_back(copy::op{from, st.buffers->data(seq % st.buffers->count()) + e.buffer_offset, e.bytes});
      entries.push_back(std::move(e));
    }

    /// The wire entry of one placed piece of `t` (as bytes), its copies ordered after `t`'s stream.
    void add_entry(const tensor_ref& t, const placement& p) {
      if (t.stream != nullptr && (streams.empty() || streams.back() != t.stream)) streams.push_back(t.stream);
      entries.push_back(wire::entry{t.meta.name, t.meta.type, t.meta.shape, p.entry.tensor_offset, p.entry.bytes,
                                    p.entry.buffer_offset, wire::entry_kind::bytes, 0});
    }

    /// Adds one placed piece of tensor `t` to the open batch: its entry, and the copy or segment
    /// that moves its bytes (`targets`: its routes in a direct session).
    ///
    /// With `cv`, `t.meta` is the tensor as sent (the converted dtype) and `t.data` its source,
    /// of dtype cv->from: the bytes are converted on their way.
    void add(const tensor_ref& t, const placement& p, std::span<const transport::routed> targets,
             const copy::cvt::conversion* cv = nullptr) {
      add_entry(t, p);
      if (p.entry.bytes == 0) return;
      if (cv != nullptr) {
        add_converted(t, p, targets, *cv);
        return;
      }
      const auto* from = static_cast<const std::byte*>(t.data) + p.entry.tensor_offset;
      const device where = st.buffers->where();
      if (by_entry && t.dev == where) {
        // Sent in place: rank 0 of an in-place broadcast only reads its buffer.
        segments.push_back(transport::segment{const_cast<std::byte*>(from), 0, p.entry.bytes});
        return;
      }
      if (t.dev.kind == device_kind::cuda && !(t.dev == where) && st.copier->kind() == copy::engine::kernel)
        copy::enable_peer_access(where.index, t.dev.index);
      if (direct) {
        for (const transport::routed& target : targets)
          copy::append_route(target.runs, p.entry.tensor_offset, p.entry.bytes, from, target.base, ops, pieces);
        note_direct(p.entry.bytes);
        return;
      }
      ops.push_back(copy::op{from, st.buffers->data(seq % st.buffers->count()) + p.entry.buffer_offset, p.entry.bytes});
      if (by_entry) segments.push_back(transport::segment{nullptr, p.entry.buffer_offset, p.entry.bytes});
    }

    /// A converted tensor in an in-place session without staging buffers. Throws.
    [[noreturn]] void refuse_unconverted(const tensor_ref& t) const {
      throw error(errc::invalid_argument,
                  fmt::format("tensor {}: the receivers ask for it as {}, but this {} session sends every tensor in "
                              "place, unconverted (nothing of it was sent; receivers that took earlier batches of "
                              "version {} stay dirty until a refit commits): set streamer_options::direct = false "
                              "so that it is converted into the send buffers",
                              describe(t.meta), to_string(t.meta.type), to_string(st.options.transport), version));
    }

    /// Adds one whole block128 tensor of a staged session, written by `job` (one pass, its scales
    /// into scratch) at its place in the open batch's buffer (in place: the staging buffer). `t`
    /// is the tensor as sent (f8_e4m3), `src_dev` where its source is.
    void add_fused(const tensor_ref& t, const placement& p, copy::fused_job job, device src_dev) {
      std::byte* base =
          in_place ? st.buffers->staging(seq % st.buffers->count()) : st.buffers->data(seq % st.buffers->count());
      if (base == nullptr) refuse_unconverted(t);
      add_entry(t, p);
      if (src_dev.kind == device_kind::cuda && !(src_dev == st.buffers->where()))
        copy::enable_peer_access(st.buffers->where().index, src_dev.index);
      job.dst = reinterpret_cast<std::uint8_t*>(base + p.entry.buffer_offset);
      fused.push_back(job);
      if (by_entry) segments.push_back(transport::segment{nullptr, p.entry.buffer_offset, p.entry.bytes});
    }

    /// Counts `bytes` of direct writes planned, launching what is planned once the device has at
    /// most one launch left to run: the next one is queued before the device idles (launching only
    /// at idle left qwen2.5-0.5b's copies ~100 us of gaps on an H100), and launches stay large
    /// while the device is behind.
    void note_direct(std::uint64_t bytes) {
      direct_pending += bytes;
      if (direct_pending - direct_checked >= direct_check_bytes) {
        direct_checked = direct_pending;
        // Copy engines (peer_engine) say nothing of their queue: their copies go with each piece of
        // the manifest, as with engine memcpy_batch.
        if (!st.peer_engine() && st.copier->queue_short()) launch_direct();
      }
    }

    /// The converting half of add(): converted bytes [tensor_offset, + bytes) of `t` into the
    /// buffer (staged; a transport moving entries sends them from there, never from the source,
    /// which holds the other dtype) or along the routes (direct).
    void add_converted(const tensor_ref& t, const placement& p, std::span<const transport::routed> targets,
                       const copy::cvt::conversion& cv) {
      const std::uint64_t di = copy::cvt::item(cv.to);
      if (p.entry.tensor_offset % di != 0 || p.entry.bytes % di != 0)
        throw error(
            errc::invalid_argument,
            fmt::format("tensor {}: a batch boundary at byte {} splits one of its converted elements ({} "
                        "bytes each): give the streamer buffer_bytes and alignment that are multiples of 4",
                        describe(t.meta),
                        p.entry.tensor_offset % di != 0 ? p.entry.tensor_offset : p.entry.tensor_offset + p.entry.bytes,
                        di));
      if (t.dev.kind == device_kind::cuda && !(t.dev == st.buffers->where()))
        copy::enable_peer_access(st.buffers->where().index, t.dev.index);
      if (direct) {
        for (const transport::routed& target : targets)
          copy::append_convert_route(target.runs, p.entry.tensor_offset, p.entry.bytes, t.data, target.base, cv, cops,
                                     pieces);
        note_direct(p.entry.bytes);
        return;
      }
      const std::uint64_t first = p.entry.tensor_offset / di;
      // An in-place session packs converted entries after all, into its staging buffers (the
      // planned offsets fit: they are an in-place batch's).
      std::byte* base =
          in_place ? st.buffers->staging(seq % st.buffers->count()) : st.buffers->data(seq % st.buffers->count());
      if (base == nullptr) refuse_unconverted(t);
      cops.push_back(copy::convert_op{static_cast<const std::byte*>(t.data) + first * copy::cvt::item(cv.from),
                                      base + p.entry.buffer_offset, p.entry.bytes / di, 1, 0, 0, first, cv});
      if (by_entry) segments.push_back(transport::segment{nullptr, p.entry.buffer_offset, p.entry.bytes});
    }
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
  /// The host diff's threads and scratch, made at the first host diff (options.delta.threads).
  std::unique_ptr<delta::host_differ> host_differ;
#if REFIT_HAVE_CUDA
  std::unique_ptr<delta::cuda::workspace> device_delta;  ///< the device diff's scratch, made when first needed
  delta::cuda::workspace& device_workspace() {
    if (!device_delta) device_delta = std::make_unique<delta::cuda::workspace>(options.device);
    return *device_delta;
  }
#endif

  /// Copies a tensor of a whole version into the base and adds its checksum; false (and a warning)
  /// when the base would outgrow its bound.
  bool keep_in_base(const tensor_ref& t, std::uint64_t bytes, std::uint64_t& checksum, refit_stats& stats) {
    const auto td = clock::now();
    delta::base_store::tensor* b = base->place(t.meta);
    if (b == nullptr) {
      if (!warned_base_bound)
        REFIT_WARN(
            "the delta base would take more than its bound of {} bytes (delta_options::max_bytes): versions "
            "are sent whole",
            base->max_bytes());
      warned_base_bound = true;
      return false;
    }
    if (t.dev.kind == device_kind::cuda || base->where() == delta::memory::device) {
#if REFIT_HAVE_CUDA
      delta::cuda::copy_sync(b->data, t.data, bytes, options.device);
#endif
    } else if (bytes != 0) {
      std::memcpy(b->data, t.data, bytes);
    }
    checksum += delta::name_weight(t.meta.name) * copy::checksum(b->data, bytes, base->dev());
    stats.diff_seconds += seconds_since(td);
    stats.pack_seconds += seconds_since(td);
    return true;
  }

  /// Adds a piece of span [off, ...) of `t` that goes as its plain bytes (it changed densely),
  /// copied from `src` (the tensor) when the batch is packed.
  static void add_span_bytes(batch_writer& w, const tensor_ref& t, std::uint64_t off, const placement& p,
                             const std::byte* src) {
    w.add_copied(wire::entry{t.meta.name, t.meta.type, t.meta.shape, off + p.entry.tensor_offset, p.entry.bytes,
                             p.entry.buffer_offset, wire::entry_kind::bytes, 0},
                 src + off + p.entry.tensor_offset);
  }

  /// Patches are small: a batch would hold a large part of the version, and the receiver would
  /// start patching only once the streamer had diffed all of it. A batch is sent once it covers
  /// delta_batch_covers bytes of tensors (of a host tensor's spans: inside a large tensor too), so
  /// that the receiver's patching overlaps the next diffs.
  void close_if_covered(batch_writer& w, planner& pl, std::uint64_t total) const {
    w.covered += total;
    if (w.covered >= delta_batch_covers()) {
      w.flush();
      pl = planner(pl.options());
      w.first_batch = w.seq;
    }
  }

  /// Diffs one tensor against the base span by span (delta::span_bytes), brings the base up to date
  /// and adds the tensor's patches (or, for a span that changed densely, its bytes) to the batches,
  /// counting it in stats.tensors. A tensor that did not change is not sent. A host tensor is diffed
  /// at once, on the host differ's threads (send_host). A device tensor joins the open group
  /// (send_device_group), which is sent once it holds what the open batch still covers, or before a
  /// host tensor, or at the end (finish_delta). Throws errc::invalid_argument
  /// for a tensor the base does not hold as it is (new, or another dtype or shape).
  void send_delta(batch_writer& w, planner& pl, std::size_t index, const tensor_ref& t, delta_scratch& sc,
                  std::uint64_t& checksum) {
    delta::base_store::tensor* b = base->find(t.meta.name);
    if (b == nullptr || b->meta.type != t.meta.type || b->meta.shape != t.meta.shape)
      throw error(errc::invalid_argument,
                  fmt::format("tensor {} is {} the delta's base (version {}): a delta carries the tensors of its base "
                              "as they were; the next refit is sent whole",
                              describe(t.meta), b == nullptr ? "not in" : fmt::format("{} in", describe(b->meta)),
                              w.stats.base));
#if REFIT_HAVE_CUDA
    if (t.dev.kind == device_kind::cuda) {
      queue_device(w, pl, index, t, *b, sc);
      return;
    }
    send_device_group(w, pl, sc);  // the device tensors before this one keep their place
#endif
    send_host(w, pl, index, t, *b, sc, checksum);
  }

  /// Diffs a host tensor against the base span by span (delta::span_bytes), each span cut in chunks
  /// diffed on the host differ's threads, bringing the base up to date, and places its patches.
  /// Tensor by tensor, as they come: a batch full of patches is sent before the next tensor is
  /// asked of the source (whose gathering then overlaps the receiver's patching), and the batches
  /// are those of a diff on one thread. A large tensor is diffed a batch at a time: the spans that
  /// complete the open batch's coverage (close_if_covered) are diffed, placed and sent before the
  /// next ones are diffed, so that the receiver patches the first part of an embedding (a quarter of
  /// qwen2.5-0.5b) while the streamer diffs the rest, instead of waiting for all of it.
  void send_host(batch_writer& w, planner& pl, std::size_t index, const tensor_ref& t, delta::base_store::tensor& b,
                 delta_scratch& sc, std::uint64_t& checksum) {
    const std::size_t item = itemsize(t.meta.type);
    const std::uint64_t total = b.bytes;
    const std::uint64_t span = delta::span_bytes(plan.buffer_bytes);
    const auto* src = static_cast<const std::byte*>(t.data);
    sc.spans.clear();
    for (std::uint64_t off = 0; off < total; off += span)
      sc.spans.push_back(delta::host_span{b.data + off, src + off, off, std::min(span, total - off), total, item});
    if (sc.found.size() < sc.spans.size()) sc.found.resize(sc.spans.size());
    if (!host_differ) host_differ = std::make_unique<delta::host_differ>(options.delta.threads);
    const std::span<delta::span_patch> found = std::span<delta::span_patch>(sc.found).first(sc.spans.size());
    const std::uint64_t weight = delta::name_weight(t.meta.name);
    w.stats.elements += total / item;
    std::size_t placed = 0;  // spans placed so far; none until the tensor's first change
    for (std::size_t k = 0; k < sc.spans.size();) {
      // The spans that complete the open batch's coverage, at most a wave of the differ's scratch.
      const std::uint64_t room = delta_batch_covers() - std::min(w.covered, delta_batch_covers());
      std::size_t end = k;
      for (std::uint64_t bytes = 0;
           end < sc.spans.size() &&
           (end == k || (bytes < room && bytes + sc.spans[end].bytes <= delta::host_differ::wave_bytes));)
        bytes += sc.spans[end++].bytes;
      const auto td = clock::now();
      const auto group = std::span<const delta::host_span>(sc.spans).subspan(k, end - k);
      host_differ->count(group, found.subspan(k, end - k));
      w.stats.diff_seconds += seconds_since(td);
      w.stats.pack_seconds += seconds_since(td);
      std::uint64_t changes = 0;
      for (std::size_t s = k; s < end; ++s) {
        checksum += weight * found[s].terms;
        changes += found[s].changes;
      }
      w.stats.changed += changes;
      // Spans that changed nothing before the tensor's first change wait for it (a tensor that did
      // not change is not sent); from then on every span is placed, in order.
      if (changes != 0 || placed != 0) {
        place_spans(w, pl, index, t, found, placed, end, group, k, sc);
        placed = end;
      }
      k = end;
    }
    if (placed != 0) w.stats.tensors += 1;
  }

  /// Places the patches (or bytes) of spans [from, to) of a diffed host tensor (found[k]: span k;
  /// `group`: the spans of the last count(), from span `first`), writes their patches, and sends the
  /// batch once it covers delta_batch_covers() bytes. A patch is written straight into the batch's
  /// buffer when that is host memory (host_shm: the buffer of the open batch is not the receiver's
  /// until its BATCH is sent), else into host memory copied there when the batch is packed.
  void place_spans(batch_writer& w, planner& pl, std::size_t index, const tensor_ref& t,
                   std::span<delta::span_patch> found, std::size_t from, std::size_t to,
                   std::span<const delta::host_span> group, std::size_t first, delta_scratch& sc) {
    const std::uint64_t total = t.meta.nbytes();
    const std::uint64_t span = delta::span_bytes(plan.buffer_bytes);
    const std::size_t item = itemsize(t.meta.type);
    const auto* src = static_cast<const std::byte*>(t.data);
    const bool in_buffer = buffers->where().kind == device_kind::cpu;
    sc.targets.clear();
    // The patches placed so far, before their batch is sent.
    const auto write = [&] {
      const auto td = clock::now();
      host_differ->write(group, sc.targets);
      sc.targets.clear();
      w.stats.diff_seconds += seconds_since(td);
      w.stats.pack_seconds += seconds_since(td);
    };
    std::uint64_t covered = 0;
    for (std::size_t k = from; k < to; ++k) {
      const std::uint64_t off = k * span;
      const std::uint64_t n = std::min(span, total - off);
      const bool as_bytes = found[k].as_bytes;
      const std::uint64_t bytes = as_bytes ? n : found[k].changes * delta::record_bytes(item);
      const std::vector<placement> places = pl.add(index, bytes);
      if (places.size() != 1)  // delta::span_bytes: half a buffer at most, so never split
        throw error(errc::internal, fmt::format("tensor {}: a delta's span of {} bytes was split in {} batches",
                                                describe(t.meta), bytes, places.size()));
      const placement& p = places.front();
      if (w.first_batch + p.batch > w.seq) {
        write();
        while (w.first_batch + p.batch > w.seq) w.flush();
      }
      if (as_bytes) {
        add_span_bytes(w, t, off, p, src);
      } else {
        const wire::entry e{t.meta.name,
                            t.meta.type,
                            t.meta.shape,
                            off,
                            p.entry.bytes,
                            p.entry.buffer_offset,
                            wire::entry_kind::patch,
                            n};
        std::byte* to_write = nullptr;
        if (p.entry.bytes == 0) {
          w.entries.push_back(e);
        } else if (in_buffer) {
          // The batch before this buffer's last one is still posted: its reply says the receiver
          // is done reading this buffer (host_shm replies first and copies after), so it is heard
          // before a patch goes in, as before any packing (begin_pack).
          const std::size_t buffer = w.seq % buffers->count();
          w.begin_pack(buffer);
          to_write = buffers->data(buffer) + p.entry.buffer_offset;
          w.entries.push_back(e);
        } else {
          w.patches.push_back(host_differ->patch_memory(p.entry.bytes));
          to_write = w.patches.back().data();
          w.add_copied(e, to_write);
        }
        if (to_write != nullptr) sc.targets.push_back(delta::host_differ::target{k - first, to_write});
      }
      w.stats.bytes += p.entry.bytes;
      covered += n;
    }
    write();
    close_if_covered(w, pl, covered);
  }

  /// Sends what send_delta() left queued: before the version's last batch.
  void finish_delta(batch_writer& w, planner& pl, delta_scratch& sc) {
#if REFIT_HAVE_CUDA
    send_device_group(w, pl, sc);
#else
    (void)w, (void)pl, (void)sc;
#endif
  }

#if REFIT_HAVE_CUDA
  /// Queues a device tensor of a delta for its group's diff, ordering the diff after the work its
  /// producer stream holds now; sends the group once it holds the bytes the open batch still covers
  /// (close_if_covered), so that a group's one wait comes about once per batch.
  void queue_device(batch_writer& w, planner& pl, std::size_t index, const tensor_ref& t, delta::base_store::tensor& b,
                    delta_scratch& sc) {
    buffers->after(t.stream);
    sc.group.push_back(queued_tensor{index, t, &b});
    sc.group_bytes += b.bytes;
    if (w.covered + sc.group_bytes >= delta_batch_covers()) send_device_group(w, pl, sc);
  }

  /// send_delta() for the queued tensors in device memory (cuda_ipc staged buffers, nccl buffers):
  /// the diff runs on the pack stream (lib/delta/diff_kernel.cu). The changes of every span of the
  /// group are counted on the device and read back with one wait (the host places the patches), then
  /// each patch is written straight into the staging buffer, after the buffer is free (begin_pack):
  /// the writes are queued in the workspace and launched up to kernel::max_writes spans at a time, at
  /// the latest when the batch is flushed. The checksum terms add up on the device: send_tensors()
  /// reads them before END. The batches are those the tensors would make one by one, each sent
  /// before the source is asked for the next tensor.
  void send_device_group(batch_writer& w, planner& pl, delta_scratch& sc) {
    if (sc.group.empty()) return;
    const auto td = clock::now();
    delta::cuda::workspace& ws = device_workspace();
    sc.diffs.clear();
    for (const queued_tensor& q : sc.group)
      sc.diffs.push_back(delta::cuda::diff_tensor{q.base->data, static_cast<const std::byte*>(q.t.data), q.base->bytes,
                                                  itemsize(q.t.meta.type)});
    delta::cuda::count(sc.diffs, delta::span_bytes(plan.buffer_bytes), ws, buffers->stream());
    w.stats.diff_seconds += seconds_since(td);
    w.stats.pack_seconds += seconds_since(td);
    for (std::size_t i = 0; i < sc.group.size(); ++i) place_device(w, pl, sc.group[i], i, ws);
    sc.group.clear();
    sc.group_bytes = 0;
  }

  /// Places the patches (or bytes) of tensor `i` of the counted group and enqueues their writes.
  void place_device(batch_writer& w, planner& pl, const queued_tensor& q, std::size_t i, delta::cuda::workspace& ws) {
    void* stream = buffers->stream();
    const std::size_t item = itemsize(q.t.meta.type);
    const std::uint64_t total = q.base->bytes;
    const std::uint64_t span = delta::span_bytes(plan.buffer_bytes);
    const auto* src = static_cast<const std::byte*>(q.t.data);
    const std::uint64_t weight = delta::name_weight(q.t.meta.name);
    const std::span<const std::uint64_t> changes = ws.changes(i);
    std::uint64_t sum = 0;
    for (const std::uint64_t c : changes) sum += c;
    w.stats.elements += total / item;
    w.stats.changed += sum;
    if (sum == 0) return;
    for (std::size_t k = 0; k < changes.size(); ++k) {
      const std::uint64_t off = k * span;
      const std::uint64_t n = std::min(span, total - off);
      const std::uint64_t bytes = changes[k] * delta::record_bytes(item);
      const bool as_bytes = bytes >= n;
      for (const placement& p : pl.add(q.index, as_bytes ? n : bytes)) {
        while (w.first_batch + p.batch > w.seq) w.flush();
        if (as_bytes) {
          // Copied from the tensor at flush(), after the pack stream waited for the buffer.
          add_span_bytes(w, q.t, off, p, src);
        } else {
          const std::size_t buffer = w.seq % buffers->count();
          w.begin_pack(buffer);
          // A span without changes has nothing to write, nor anything to bring up to date.
          if (changes[k] != 0)
            delta::cuda::write(i, k, buffers->data(buffer) + p.entry.buffer_offset, weight, ws, stream);
          w.entries.push_back(wire::entry{q.t.meta.name, q.t.meta.type, q.t.meta.shape, off, p.entry.bytes,
                                          p.entry.buffer_offset, wire::entry_kind::patch, n});
        }
        w.stats.bytes += p.entry.bytes;
      }
      // A span sent as bytes still brings the base up to date (and adds its terms).
      if (as_bytes) delta::cuda::write(i, k, nullptr, weight, ws, stream);
    }
    close_if_covered(w, pl, total);
    w.stats.tensors += 1;
  }
#endif

  /// Tensor bytes after which a delta's batch is sent (see send_delta): delta_options::batch_bytes,
  /// by default what a whole version's batch covers (a buffer) over host_shm and four buffers over
  /// the GPU transports, at least 32 MiB. Fewer, larger batches: each costs a round trip and, on the
  /// GPU, one wait of the streamer's diff and one of the receiver's patch check (measured on an
  /// H100, qwen2.5-0.5b: 31 batches of 32 MiB spent 13 of a delta's 18 ms outside the diff; on
  /// 2 × H200 over NVLink, llama3-8b at 2 × 256 MiB: 49 batches of 256 MiB 26.4 ms, 14 of 1 GiB
  /// 24.2 ms, against 45.2 ms for the whole version in place). At ~2 % of bf16 elements changed a
  /// batch's patches fill about a quarter of a buffer.
  [[nodiscard]] std::uint64_t delta_batch_covers() const noexcept {
    if (options.delta.batch_bytes != 0) return options.delta.batch_bytes;
    const std::uint64_t buffers = options.transport == transport_kind::host_shm ? 1 : 4;
    return std::max<std::uint64_t>(32ull << 20, buffers * options.buffer_bytes);
  }

  /// An in-place nccl session sends every tensor from the streamer's GPU: throws for one elsewhere.
  void check_in_place(const tensor_ref& t, std::uint64_t bytes, std::uint64_t version) const {
    if (bytes != 0 && !(t.dev == buffers->where()))
      throw error(errc::invalid_argument,
                  fmt::format("tensor {} is on cuda:{}, but this nccl session sends every tensor in place from the "
                              "streamer's GPU, cuda:{} (nothing of it was sent; receivers that took earlier "
                              "batches of version {} stay dirty until a refit commits): move it there, or set "
                              "streamer_options::direct = false to pack such tensors",
                              describe(t.meta), t.dev.index, buffers->where().index, version));
  }

  /// The conversion the receivers asked for `t`, or nullptr when it is sent as it is (nothing
  /// asked, or the source already has the dtype asked for, or a cast from a dtype refit does not
  /// convert: the receiver refuses it). Throws errc::apply for a quantisation of such a source,
  /// errc::invalid_argument for block128 of a tensor of rank < 2.
  const wire::conversion* conversion_for(const tensor_ref& t) const {
    if (conversions.empty()) return nullptr;
    const auto it = conversions.find(t.meta.name);
    if (it == conversions.end()) return nullptr;
    const wire::conversion& c = it->second;
    if (c.type == t.meta.type && c.q == quant::none) return nullptr;
    const std::string asked = c.q == quant::none ? std::string(to_string(c.type))
                                                 : fmt::format("{} quantised per {}", to_string(c.type),
                                                               c.q == quant::tensor ? "tensor" : "128 × 128 block");
    if (t.meta.type != dtype::f32 && t.meta.type != dtype::bf16 && t.meta.type != dtype::f16) {
      // A cast asked of an integer or f64 source: sent as it is, the receiver refuses the dtype
      // (errc::apply) as it always did. A quantisation: refused here, naming both.
      if (c.q == quant::none) return nullptr;
      throw error(
          errc::apply,
          fmt::format("tensor {}: the receiver asks for it as {}, but refit converts only from f32, bf16 and "
                      "f16, not from {}: send it as {} or register the destination as {}",
                      describe(t.meta), asked, to_string(t.meta.type), to_string(c.type), to_string(t.meta.type)));
    }
    if (c.q == quant::block128 && t.meta.shape.size() < 2)
      throw error(errc::invalid_argument,
                  fmt::format("tensor {}: the receiver asks for {}, which needs at least 2 dimensions",
                              describe(t.meta), asked));
    return &c;
  }

  /// Sends `t` converted as `c` asks: the tensor as `c.type` (same shape) and, quantised, its
  /// scale tensor `name` + scale_suffix, computed by a scale pass over the source first.
  ///
  /// With `part`, `t` is the whole tensor (its data shifted to where the whole would start) and only
  /// the shard's elements are sent (casts only: a quantisation needs the whole tensor).
  void send_converted(batch_writer& w, planner& pl, const tensor_ref& t, const wire::conversion& c, refit_stats& stats,
                      const shard_place* part = nullptr) {
    tensor_ref sent = t;
    sent.meta.type = c.type;
    if (part != nullptr && c.q != quant::none)
      throw error(errc::invalid_argument,
                  fmt::format("tensor {} is sent as a shard (elements [{}, {})), but the receiver asks for it "
                              "quantised to f8_e4m3 per {}, which needs the amax of the whole tensor: send it whole, "
                              "or register the destination as a cast (bf16)",
                              describe(t.meta), part->first, part->first + part->count,
                              c.q == quant::tensor ? "tensor" : "128 × 128 block"));
    const std::uint64_t bytes = part != nullptr ? part->count * itemsize(c.type) : sent.meta.nbytes();
    const std::uint64_t shift = part != nullptr ? part->first * itemsize(c.type) : 0;
    std::optional<tensor_ref> scale;
    if (c.q != quant::none) {
      scale.emplace();
      scale->meta = tensor_meta{t.meta.name + std::string(scale_suffix), dtype::f32, scale_shape(c.q, t.meta.shape)};
      scale->dev = buffers->where();
    }
    const std::vector<transport::routed> targets =
        w.direct ? buffers->routes(sent.meta) : std::vector<transport::routed>{};
    const std::vector<transport::routed> scale_targets =
        w.direct && scale ? buffers->routes(scale->meta) : std::vector<transport::routed>{};
    const std::vector<placement> placed = pl.add(w.planned++, bytes);
    if (t.stream != nullptr) w.streams.push_back(t.stream);

    // Block128 of a whole tensor placed in one piece: one pass (copy::fused_job) writes the codes
    // and the scales. Direct: into plain or column-shard destinations, codes and scales where they
    // go. Staged: the codes into the buffer, the scales into scratch, sent from there as the scale
    // tensor. Otherwise a scale pass into scratch, then converting copies, then the scale tensor.
    std::vector<copy::fused_job> fused;
    const bool whole_block128 = c.q == quant::block128 && part == nullptr && placed.size() == 1 &&
                                placed[0].entry.tensor_offset == 0 && placed[0].entry.bytes == bytes;
    if (w.direct && whole_block128) fused = fused_jobs(t, targets, scale_targets);
    const bool staged_fused = !w.direct && whole_block128 && t.meta.numel() != 0;
    if (staged_fused) {
      const auto& shape = t.meta.shape;
      copy::fused_job j;
      j.src = t.data;
      j.from = t.meta.type;
      j.cols = static_cast<std::uint64_t>(shape[shape.size() - 1]);
      j.rows = static_cast<std::uint64_t>(shape[shape.size() - 2]);
      j.lead = t.meta.numel() / (j.rows * j.cols);
      j.col_hi = j.cols;
      j.dst_pitch = j.cols;
      j.scale = copier->scratch(scale->meta.numel());
      j.scale_pitch = (j.cols + 127) / 128;
      scale->data = j.scale;
      fused.push_back(j);  // its dst is the buffer's, known once its batch is open
    }
    const float* mul = nullptr;
    if (scale && fused.empty()) {
      const std::uint64_t groups = scale->meta.numel();
      float* inv = copier->scratch(groups);
      float* m = copier->scratch(groups);
      scale->data = inv;
      mul = m;
      // Even with no elements: a per-tensor scale is then that of amax 0 (clamped).
      w.jobs.push_back(copy::scale_job{t.data, t.meta.type, t.meta.shape, c.q, inv, m});
    }
    const copy::cvt::conversion cv = copy::conversion_of(t.meta.type, c.type, c.q, t.meta.shape, mul);
    for (placement p : placed) {
      while (w.first_batch + p.batch > w.seq) w.flush();
      p.entry.tensor_offset += shift;
      if (fused.empty()) {
        w.add(sent, p, targets, &cv);
      } else if (staged_fused) {
        w.add_fused(sent, p, fused.front(), t.dev);
      } else {
        w.add(sent, p, {}, &cv);  // the entry only: the fused jobs write it
        w.fused.insert(w.fused.end(), fused.begin(), fused.end());
      }
    }
    stats.tensors += 1;
    stats.bytes += bytes;
    if (!scale) return;
    const std::uint64_t scale_bytes = scale->meta.nbytes();
    for (const placement& p : pl.add(w.planned++, scale_bytes)) {
      while (w.first_batch + p.batch > w.seq) w.flush();
      w.add(*scale, p,
            fused.empty() ? std::span<const transport::routed>(scale_targets) : std::span<const transport::routed>());
    }
    stats.tensors += 1;
    stats.bytes += scale_bytes;
  }

  /// The fused jobs that write `t` (block128, whole) along `targets` and its scales along
  /// `scale_targets` (the same destinations, in the same order), or none when some destination
  /// is neither dense nor a column shard of dense rows (those take the two-pass way).
  static std::vector<copy::fused_job> fused_jobs(const tensor_ref& t, std::span<const transport::routed> targets,
                                                 std::span<const transport::routed> scale_targets) {
    std::vector<copy::fused_job> out;
    if (targets.size() != scale_targets.size() || t.meta.numel() == 0) return {};
    const auto& shape = t.meta.shape;
    const auto cols = static_cast<std::uint64_t>(shape[shape.size() - 1]);
    const auto rows = static_cast<std::uint64_t>(shape[shape.size() - 2]);
    const std::uint64_t lead = t.meta.numel() / (rows * cols);
    const std::uint64_t grid_rows = (rows + 127) / 128;
    const std::uint64_t grid_cols = (cols + 127) / 128;
    for (std::size_t k = 0; k < targets.size(); ++k) {
      if (targets[k].runs.size() != 1 || scale_targets[k].runs.size() != 1) return {};
      const plan::run& r = targets[k].runs.front();
      const plan::run& s = scale_targets[k].runs.front();
      copy::fused_job j;
      j.src = t.data;
      j.from = t.meta.type;
      j.lead = lead;
      j.rows = rows;
      j.cols = cols;
      if (r.rows == 1 && r.src == 0 && r.width == lead * rows * cols) {
        j.col_lo = 0;
        j.col_hi = cols;
        j.dst_pitch = cols;
      } else if ((r.rows == lead * rows && r.src_pitch == cols) || (r.rows == 1 && lead * rows == 1)) {
        j.col_lo = r.src;
        j.col_hi = r.src + r.width;
        j.dst_pitch = r.dst_pitch;
        if (j.col_hi > cols || j.col_lo % 128 != 0 || (j.col_hi % 128 != 0 && j.col_hi != cols)) return {};
      } else {
        return {};
      }
      const std::uint64_t b_lo = j.col_lo / 128;
      const std::uint64_t b_hi = (j.col_hi + 127) / 128;
      if (s.rows == 1 && s.src == 0 && s.width == 4 * lead * grid_rows * grid_cols && b_lo == 0 && b_hi == grid_cols) {
        j.scale_pitch = grid_cols;  // the whole grid, dense
      } else if (s.src == 4 * b_lo && s.width == 4 * (b_hi - b_lo) && s.rows == lead * grid_rows && s.rows > 1 &&
                 s.src_pitch == 4 * grid_cols && s.dst_pitch % 4 == 0) {
        j.scale_pitch = s.dst_pitch / 4;  // the shard's columns of every row of blocks
      } else if (s.src == 4 * b_lo && s.width == 4 * (b_hi - b_lo) && s.rows == 1 && lead * grid_rows == 1) {
        j.scale_pitch = 0;  // one row of blocks
      } else {
        return {};
      }
      j.dst = reinterpret_cast<std::uint8_t*>(targets[k].base + r.dst);
      j.scale = reinterpret_cast<float*>(scale_targets[k].base + s.dst);
      out.push_back(j);
    }
    return out;
  }

  /// Everything between BEGIN and END: plans, packs and sends the batches of `source`. A delta
  /// sends patches against the base (and brings it up to date); with `keep` a whole version is
  /// copied into the base (false when it outgrew its bound). `checksum`: the version checksum,
  /// updated as tensors pass (with a base).
  void send_tensors(std::uint64_t version, tensor_source& source, refit_stats& stats, sending how,
                    std::uint64_t* checksum, bool& keep) {
    batch_writer w(*this, version, stats);
    w.shares = receivers_read_in_place(how);
    buffers->forget_shared();
    plan_options po = w.plan_for(plan);
    if (how == sending::delta) po.keep_whole = true;  // a patch must never be split (delta::span_bytes)
    planner pl(po);
    delta_scratch& scratch = delta_buffers;
#if REFIT_HAVE_CUDA
    scratch.group.clear();  // a failed refit's
    scratch.group_bytes = 0;
    if (device_delta) device_delta->discard_writes();
    if (how == sending::delta && device_delta) (void)device_delta->take_terms(buffers->stream());  // a failed refit's
#endif
    sent_names.clear();
    copier->reset_scratch();  // the last refit's copies are complete (END drained them)
    for (;;) {
      auto ts = clock::now();
      std::optional<tensor_ref> t = source.next();
      stats.source_seconds += seconds_since(ts);
      if (!t) break;
      const std::uint64_t bytes = t->meta.nbytes();
      check_tensor(*t, bytes);
      if (!sent_names.insert(t->meta.name))
        throw error(errc::invalid_argument,
                    fmt::format("the source yielded tensor '{}' twice in version {}", t->meta.name, version));
      stats.tensor_bytes += bytes;
      // A shard goes as the byte range it is of its whole tensor: from here on `t` is the whole,
      // its data shifted to where the whole would start (only the shard's bytes are ever read), and
      // every placement moves by `shift`.
      std::optional<shard_place> part;
      std::uint64_t shift = 0;
      if (t->shard) {
        part = place_shard(*t);
        shift = part->first * itemsize(t->meta.type);
        t->meta = part->whole;
        t->data = reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(t->data) - shift);
        t->shard.reset();
        if (how == sending::delta && (part->first != 0 || bytes != t->meta.nbytes()))
          throw error(errc::internal, fmt::format("tensor {}: a delta of a shard", describe(t->meta)));
      }
      if (const wire::conversion* c = conversion_for(*t)) {
        if (how == sending::delta)
          throw error(errc::invalid_argument,
                      fmt::format("tensor {}: the receivers ask for it converted, and a delta version patches the "
                                  "bytes the trainer holds, not converted ones: send versions whole to receivers "
                                  "that convert (streamer_options::delta off)",
                                  describe(t->meta)));
        send_converted(w, pl, *t, *c, stats, part ? &*part : nullptr);
        keep = false;  // the base holds what was sent as it was; a converted tensor is not there
        continue;
      }
      // A direct session writes each of the receiver's destinations of this tensor along its route
      // (a view, a slice: plan::route); a misfit throws before anything is written.
      const std::vector<transport::routed> targets =
          w.direct ? buffers->routes(t->meta) : std::vector<transport::routed>{};
      if (w.in_place) check_in_place(*t, bytes, version);
      if (how == sending::delta) {
        send_delta(w, pl, w.planned++, *t, scratch, *checksum);
        continue;
      }
      if (!w.share_whole(*t, shift, bytes, pl))
        for (placement p : pl.add(w.planned++, bytes)) {
          while (w.first_batch + p.batch > w.seq) w.flush();
          p.entry.tensor_offset += shift;
          w.add(*t, p, targets);
        }
      stats.tensors += 1;
      stats.bytes += bytes;
      if (keep) keep = keep_in_base(*t, bytes, *checksum, stats);
      // A direct session's manifest goes in pieces, each sent once the receiver has answered the
      // one before: its checks of one piece overlap this side's work on the next, and only the
      // last piece's are left when the source ends.
      if (w.direct && w.entries.size() >= direct_manifest_entries && replies_ready()) {
        w.flush(false);
        pl = planner(pl.options());  // the planner's open batch went with it
        w.first_batch = w.seq;
      }
    }
    if (how == sending::delta) finish_delta(w, pl, scratch);
    if (!w.entries.empty())
      w.flush();
    else if (w.direct)
      w.launch_direct();  // the last piece of the manifest went without launching its copies
#if REFIT_HAVE_CUDA
    if (how == sending::delta && device_delta) *checksum += device_delta->take_terms(buffers->stream());
#endif

    // Direct writes must be complete before the receiver commits: it never waits on them itself.
    if (w.direct) {
      const auto tp = clock::now();
      buffers->drain();
      stats.pack_seconds += seconds_since(tp);
    }
    if (flight) {
      const auto tw = clock::now();
      (void)collect();  // the last batch, posted
      stats.wait_seconds += seconds_since(tw);
    }
  }
};

streamer::streamer(streamer_options options) : impl_(std::make_unique<impl>(std::move(options))) {}
streamer::~streamer() { close(); }
streamer::streamer(streamer&&) noexcept = default;
streamer& streamer::operator=(streamer&& other) noexcept {
  if (this != &other) {
    close();
    impl_ = std::move(other.impl_);
  }
  return *this;
}

refit_stats streamer::refit(std::uint64_t version, tensor_source& source, refit_scope scope) {
  if (!impl_) throw error(errc::invalid_argument, "refit() on a moved-from streamer");
  return impl_->run(version, source, scope);
}

refit_stats streamer::refit(std::uint64_t version, std::span<const tensor_ref> tensors, refit_scope scope) {
  span_source source(tensors);
  return refit(version, source, scope);
}

refit_stats streamer::refit(std::uint64_t version, const std::function<std::optional<tensor_ref>()>& next,
                            refit_scope scope) {
  function_source source(next);
  return refit(version, source, scope);
}

void streamer::close() noexcept {
  if (!impl_ || !impl_->in_session) return;
  // A polite goodbye to every receiver, each with a short deadline of its own: a dead or slow one
  // must neither delay shutdown much nor keep the others from hearing it.
  const auto bye = [this] { return wire::encode(wire::bye{}, impl_->secret); };
  for (std::size_t k = 0; k < impl_->channels.size(); ++k) {
    try {
      impl_->channels[k].request(bye(), std::min(impl_->options.timeout, milliseconds{1000}), "BYE");
    } catch (const std::exception& e) {
      REFIT_DEBUG("BYE to {} not answered: {}", impl_->endpoints[k], e.what());
    }
    impl_->channels[k].attach_lane(nullptr);  // the session's control lane, unmapped
  }
  impl_->drop_session();
}

const streamer_options& streamer::options() const noexcept { return impl_->options; }

}  // namespace refit
