// refit — the transport registry and the factories that go through it.
#include <algorithm>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "refit/error.hpp"
#include "transport/registry.hpp"
#include "transport/transport.hpp"

namespace refit::transport {
namespace {

struct table {
  std::mutex mutex;
  std::vector<std::unique_ptr<registration>> entries;  // stable addresses: find_transport hands them out
};

table& registry() {
  static table t;  // constructed on first use: registrars run during static initialisation
  return t;
}

/// The registry as it is asked: every built-in transport's registrar is then linked in.
table& lookup() {
  keep_builtin_transports();
  return registry();
}

bool valid_name(std::string_view name) noexcept {
  return !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
}

}  // namespace

void register_transport(const registration& r) {
  if (!valid_name(r.name) || r.make_source == nullptr || r.make_sink == nullptr)
    throw error(errc::internal, fmt::format("transport registration '{}' is malformed (a name of [a-z0-9_], both "
                                            "factories)",
                                            r.name));
  table& t = registry();
  const std::lock_guard lock(t.mutex);
  for (const auto& e : t.entries)
    if (e->name == r.name) throw error(errc::internal, fmt::format("transport '{}' is registered twice", r.name));
  t.entries.push_back(std::make_unique<registration>(r));
}

const registration* find_transport(std::string_view name) noexcept {
  table& t = lookup();
  const std::lock_guard lock(t.mutex);
  for (const auto& e : t.entries)
    if (e->name == name) return e.get();
  return nullptr;
}

std::string registered_transports() {
  table& t = lookup();
  std::vector<std::string_view> names;
  {
    const std::lock_guard lock(t.mutex);
    for (const auto& e : t.entries) names.push_back(e->name);
  }
  std::sort(names.begin(), names.end());
  return fmt::format("{}", fmt::join(names, ", "));
}

capabilities capabilities_of(std::string_view name) noexcept {
  const registration* r = find_transport(name);
  return r != nullptr ? r->can : capabilities{};
}

capabilities capabilities_of(transport_kind kind) noexcept { return capabilities_of(to_string(kind)); }

std::unique_ptr<source> make_source(const source_options& options) {
  if (options.count < 2)
    throw error(errc::invalid_argument,
                fmt::format("buffer_count is {}: refit needs at least 2 buffers (ping-pong)", options.count));
  if (options.bytes == 0) throw error(errc::invalid_argument, "buffer_bytes is 0: give each buffer a capacity");
  const registration* r = find_transport(options.name);
  if (r == nullptr)
    throw error(errc::invalid_argument,
                fmt::format("transport {} is not built into this refit (built: {}); rebuild with "
                            "-Dcuda=enabled / -Dnccl=enabled, or use host_shm",
                            options.name, registered_transports()));
  return r->make_source(options);
}

std::unique_ptr<sink> make_sink(std::string_view transport, int device, milliseconds timeout) {
  const registration* r = find_transport(transport);
  if (r == nullptr)
    throw error(errc::transport, fmt::format("the streamer uses transport '{}', which this receiver does not support "
                                             "(built: {}); start the streamer with one of those",
                                             transport, registered_transports()));
  return r->make_sink(device, timeout);
}

void at_once(std::span<const std::function<void()>> jobs) noexcept {
  if (jobs.empty()) return;
  std::vector<std::thread> others;
  std::size_t started = 1;
  try {
    others.reserve(jobs.size() - 1);
    for (; started < jobs.size(); ++started) others.emplace_back(jobs[started]);
  } catch (...) {
    // No thread to spare: the jobs not started run in turn below.
  }
  jobs[0]();
  for (std::thread& t : others) t.join();
  for (std::size_t k = started; k < jobs.size(); ++k) jobs[k]();
}

std::vector<segment> buffer_prefix(std::span<const wire::entry> entries) {
  std::uint64_t end = 0;
  for (const wire::entry& e : entries)
    if (e.bytes != 0) end = std::max(end, e.buffer_offset + e.bytes);
  if (end == 0) return {};
  return {segment{nullptr, 0, end}};
}

std::string dest_record_of(const plan::destination& d, std::uint64_t allocation, std::uint64_t offset) {
  return "T" + wire::encode_dest(
                   wire::dest_record{d.meta.name, d.meta.type, d.meta.shape, d.strides, d.slice, allocation, offset});
}

plan::destination destination_of(const wire::dest_record& r, device dev) {
  plan::destination d;
  d.meta = tensor_meta{r.name, r.type, r.shape};
  d.strides = r.strides;
  d.slice = r.slice;
  d.dev = dev;
  return d;
}

}  // namespace refit::transport
