// refit — staged versions (receiver_options::stage): every batch lands in a copy of the parameter
// table's bytes that the receiver owns, the weights stay untouched while the engine reads them, END
// *prepares* the version, and apply_prepared() copies the stage into the weights and commits.
//
// Why a stage: an in-place receiver writes each batch into the live weights as it arrives, so an
// engine must stop generating for the whole transfer (seconds over a network) or serve requests
// from half-old, half-new weights. With a stage the engine's pause is one local copy, taken when
// the engine chooses (between two of its steps).
//
// The stage mirrors each destination from its first byte to its last (slot::stage_at), so the
// table's routes write it unchanged, at the same offsets; apply_prepared() copies back only each
// destination's footprint (plan::footprint: the bytes its view owns), so bytes between a strided
// view's rows, which another destination or the engine may own, are never written.
#include <fmt/format.h>

#include "receiver/impl.hpp"

namespace refit {
namespace {

constexpr std::uint64_t stage_align = 64;

std::uint64_t round_up(std::uint64_t n) { return (n + stage_align - 1) / stage_align * stage_align; }

}  // namespace

/// Refuses BEGIN `b` when the stage cannot take its version (stage_refusal()); nullopt otherwise,
/// the stage then laid out for the table as it is. Called for every BEGIN: taking `stage_mutex`
/// orders it after an apply_prepared() that just ended (the bases it recorded, the stage it read).
std::optional<receiver_event> receiver::impl::check_stage(const wire::begin& b) {
  if (!staged()) return std::nullopt;
  std::optional<std::string> why;
  errc code = errc::invalid_argument;
  {
    std::lock_guard lock(stage_mutex);
    if (ready) {
      code = errc::apply;
      why = fmt::format(
          "version {} is prepared and waits for apply_prepared(): the engine must apply it before this "
          "receiver stages version {}; nothing was written",
          ready->version, b.version);
    } else if (b.base) {
      // A delta patches the weights in place and proves its checksum from their old bytes: staging
      // its patches alone is not built yet. needs_whole makes a delta streamer send the version whole
      // in the same refit().
      code = errc::needs_whole;
      why = fmt::format(
          "delta version {}: this receiver stages versions (receiver_options::stage) and does not stage a "
          "delta's patches yet; send a whole version",
          b.version);
    } else {
      why = stage_refusal(b);
    }
  }
  if (!why) return std::nullopt;
  REFIT_INFO("refused BEGIN of version {} from {}: {}", b.version, who(*ln), *why);
  reply_error(code, *why);
  return receiver_event::refused;
}

/// Why the stage cannot take version `b` over this session (a sink of another kind, more bytes
/// than receiver_options::stage_bytes), or nullopt once it is laid out and allocated for it.
/// Holds `stage_mutex`.
std::optional<std::string> receiver::impl::stage_refusal(const wire::begin& b) {
  if (callback)  // on_batch refuses a staged receiver; kept for a callback set before a bug
    return fmt::format("version {}: a staged receiver applies into a parameter table, not a callback", b.version);
  if (ln->sink->where().kind != device_kind::cpu || ln->direct || ln->in_place || ln->parts)
    return fmt::format(
        "version {}: receiver_options::stage = host takes sessions that bring host bytes through buffers "
        "(host_shm), not this {} session{}; use stage = none for it",
        b.version, ln->sink->name(),
        ln->direct     ? " (direct writes)"
        : ln->in_place ? " (in place)"
                       : "");
  if (stage_generation != sink_generation) lay_out_stage();
  if (options.stage_bytes != 0 && stage_need > options.stage_bytes)
    return fmt::format(
        "version {} needs a stage of {} bytes (a copy of the {} registered destinations' bytes), more than "
        "receiver_options::stage_bytes ({} bytes); nothing was written: raise stage_bytes (0: what the "
        "version needs) or register fewer parameters",
        b.version, stage_need, table.size(), options.stage_bytes);
  if (stage_capacity < stage_need) {
    stage.reset();
    stage_capacity = 0;
    try {
      stage = std::make_unique_for_overwrite<std::byte[]>(stage_need);
    } catch (const std::bad_alloc&) {
      return fmt::format("version {}: the stage of {} bytes could not be allocated (out of host memory)", b.version,
                         stage_need);
    }
    stage_capacity = stage_need;
  }
  return std::nullopt;
}

/// Gives every destination of the table its place in the stage (slot::stage_at): its bytes from
/// its first byte (plan::check_view), one after the other, each 64-byte aligned.
void receiver::impl::lay_out_stage() {
  std::uint64_t at = 0;
  for (auto& [name, slots] : table)
    for (slot& sl : slots) {
      sl.stage_at = at;
      sl.staged_in = 0;
      at += round_up(plan::check_view(sl.dest).bytes);
    }
  stage_need = at;
  stage_generation = sink_generation;
}

/// Where the batch being checked writes destination `sl`: its copy in the stage. Notes that the
/// refit in progress wrote it, for apply_prepared().
std::byte* receiver::impl::stage_for(slot& sl) {
  if (sl.staged_in != stage_serial) {
    sl.staged_in = stage_serial;
    staged_slots.push_back(&sl);
  }
  return stage.get() + sl.stage_at;
}

/// Every lane's END checked out (finish_refit()): the version waits in the stage for
/// apply_prepared(); every lane's END hears OK, and on_prepared runs before serve_one() returns.
void receiver::impl::prepare(std::uint64_t version, double drain_seconds) {
  prepared_state p;
  p.version = version;
  p.subset = refit_subset;
  p.checksum = lanes.front().held->checksum;
  p.figures = figures_of(version, drain_seconds);
  p.generation = sink_generation;
  p.slots.swap(staged_slots);
  const std::uint64_t tensors = p.figures.tensors;
  const double gb = static_cast<double>(p.figures.bytes) / 1e9;
  {
    std::lock_guard lock(stage_mutex);
    ready = std::move(p);
    prepared_number.store(version, std::memory_order_release);
    has_prepared.store(true, std::memory_order_release);
  }
  group_version.reset();
  REFIT_INFO("prepared version {} from {}: {} tensors, {:.3f} GB in the stage; the weights wait for apply_prepared()",
             version, grouped() ? fmt::format("{} streamers", lanes.size()) : who(*ln), tensors, gb);
  endings.push_back(ending{version, false, {}, true});
  answer_ends();
}

/// Copies each destination the prepared version wrote from the stage into the weights: its
/// footprint's rows only.
void receiver::impl::copy_stage(const prepared_state& p) const {
  for (const slot* sl : p.slots) {
    const std::byte* from = stage.get() + sl->stage_at;
    auto* to = static_cast<std::byte*>(sl->dest.data);
    for (const plan::run& r : sl->foot)
      for (std::uint64_t row = 0; row < r.rows; ++row) {
        const std::uint64_t at = r.dst + row * r.dst_pitch;
        std::memcpy(to + at, from + at, r.width);
      }
  }
}

std::optional<std::uint64_t> receiver::impl::apply_prepared() {
  std::function<void(std::uint64_t)> hook;
  std::function<void(std::uint64_t, const std::string&)> dropped_hook;
  std::optional<std::string> dropped;
  std::uint64_t version = 0;
  double pause = 0;
  {
    std::lock_guard lock(stage_mutex);
    if (!ready) return std::nullopt;
    version = ready->version;
    if (ready->generation != sink_generation) {
      // The table changed since the version was prepared: the stage's places are the old table's.
      dropped = fmt::format(
          "version {} was prepared, then the parameter table changed (add_parameter, clear_parameters) before "
          "apply_prepared(): the stage was laid out from the old table, so the version was dropped and nothing "
          "was written; the streamer must send it again",
          version);
      dropped_hook = abort_hook;
    } else {
      const auto t0 = clock::now();
      copy_stage(*ready);
      pause = seconds_since(t0);
      ready->figures.pause_seconds = pause;
      make_live(version, ready->figures, ready->subset, false, ready->checksum, ready->generation);
      hook = commit_hook;
    }
    ready.reset();
    has_prepared.store(false, std::memory_order_release);
  }
  if (dropped) {
    note_error(*dropped);
    REFIT_WARN("{}", *dropped);
    if (dropped_hook) guard_hook("on_abort", version, [&] { dropped_hook(version, *dropped); });
    throw error(errc::apply, *dropped);
  }
  REFIT_INFO("applied version {} from the stage in {:.3f} ms", version, pause * 1e3);
  if (hook) guard_hook("on_commit", version, [&] { hook(version); });
  return version;
}

}  // namespace refit
