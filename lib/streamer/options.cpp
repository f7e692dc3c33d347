// refit — the streamer's options checked, and what it makes once: the transport's source (its
// buffers), the copier, the delta base.
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "channel/channel.hpp"
#include "delta/pool.hpp"
#include "streamer/impl.hpp"
#include "transport/registry.hpp"

namespace refit {
namespace {

std::string token_from(const std::string& configured) {
  if (!configured.empty()) return configured;
  const char* env = std::getenv("REFIT_TOKEN");
  return env != nullptr ? std::string(env) : std::string();
}

plan_options plan_from(const streamer_options& o) {
  plan_options p;
  p.buffer_bytes = o.buffer_bytes;
  p.alignment = o.alignment;
  p.keep_whole = o.keep_whole;
  return p;
}

/// The receivers' endpoints: options.receivers, or the one options.endpoint, or (both empty) the
/// endpoints of options.receiver_groups in order.
std::vector<std::string> endpoints_of(const streamer_options& o) {
  if (!o.receivers.empty()) return o.receivers;
  if (o.endpoint.empty() && !o.receiver_groups.empty()) {
    std::vector<std::string> all;
    for (const auto& group : o.receiver_groups) all.insert(all.end(), group.begin(), group.end());
    return all;
  }
  return {o.endpoint};
}

/// streamer_options::receiver_groups: each group a non-empty set of the receivers, no endpoint in two.
void validate_groups(const streamer_options& o, const std::vector<std::string>& endpoints) {
  std::vector<std::string> seen;
  for (std::size_t g = 0; g < o.receiver_groups.size(); ++g) {
    if (o.receiver_groups[g].empty())
      throw error(errc::invalid_argument,
                  fmt::format("streamer_options.receiver_groups[{}] is empty: a group names the endpoints of one "
                              "engine's ranks",
                              g));
    for (const auto& ep : o.receiver_groups[g]) {
      if (std::find(seen.begin(), seen.end(), ep) != seen.end())
        throw error(errc::invalid_argument,
                    fmt::format("streamer_options.receiver_groups: {} is named twice; a receiver is a rank of one "
                                "engine",
                                ep));
      if (std::find(endpoints.begin(), endpoints.end(), ep) == endpoints.end())
        throw error(errc::invalid_argument,
                    fmt::format("streamer_options.receiver_groups[{}] names {}, which is not one of the receivers; "
                                "leave receivers empty to serve the groups' endpoints",
                                g, ep));
      seen.push_back(ep);
    }
  }
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
  validate_groups(o, endpoints);
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
  if (o.on_receiver_failure == receiver_failure::drop && !can.peers_apart)
    throw error(errc::invalid_argument,
                fmt::format("streamer_options.on_receiver_failure is drop, but a {} session holds every receiver's "
                            "share of the transport, so one failing ends it for all: use host_shm, or fail",
                            name));
  if (o.on_receiver_failure == receiver_failure::drop && o.group_size > 1)
    throw error(errc::invalid_argument,
                "streamer_options.on_receiver_failure is drop with group_size > 1: the ranks of a group would drop "
                "receivers each on its own; use fail");
  if (o.rejoin && o.on_receiver_failure != receiver_failure::drop)
    throw error(
        errc::invalid_argument,
        "streamer_options.rejoin tries dropped receivers again, but on_receiver_failure is fail: set it to drop");
  if (o.min_receivers == 0)
    throw error(errc::invalid_argument,
                "streamer_options.min_receivers is 0: a version needs at least one receiver to commit it");
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

}  // namespace

streamer::impl::impl(streamer_options o) : options(std::move(o)) {
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
  so.timeout = options.timeout;
  buffers = transport::make_source(so);
  copier = copy::make_copier(copy::choose(buffers->engine(), options.engine), options.device, options.timeout,
                             copy::offload_for(options.engine));
  if (options.delta.enable)
    base = std::make_unique<delta::base_store>(
        options.delta.memory == delta_memory::device ? delta::memory::device : delta::memory::host,
        options.delta.max_bytes, options.device);
#if REFIT_HAVE_CUDA
  // The device diff's workspace loads its kernels when made: now, not in the first delta refit,
  // where loading could wait for a producer stream held behind that refit (copy::kernel::load_all).
  if (options.delta.enable && copier->kind() != copy::engine::cpu) (void)device_workspace();
#endif
}

}  // namespace refit
