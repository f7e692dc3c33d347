// refit — a receiver of a group of streamers (receiver_options::streamers): HELLOs that wait for
// the lower ranks, BEGINs that join the version in progress, lanes whose part failed elsewhere,
// the shards checked at the last END, and why a lane was late.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <set>

#include "receiver/impl.hpp"

namespace refit {
namespace {

template <typename Pieces>
std::string ranks_of(const Pieces& pieces) {
  std::vector<std::size_t> ranks;
  for (const auto& p : pieces) ranks.push_back(p.rank);
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  return fmt::format("{}", fmt::join(ranks, ", "));
}

}  // namespace

/// True when HELLO `h` of a group must wait for the sessions of lower ranks: its transport joins a
/// collective at set-up (nccl: a receiver serves nothing else until every rank of that rank's
/// communicator is there), and some lower rank has no session of that transport yet. Receivers
/// that joined two ranks' communicators in opposite orders would wait for each other.
bool receiver::impl::must_wait(const wire::hello& h) const {
  if (!grouped() || !transport::capabilities_of(h.transport).session_dies_on_error) return false;
  return std::any_of(lanes.begin(), lanes.end(), [&](const lane& l) {
    return l.rank < h.group_rank && !(l.sink && l.sink->attached() && l.sink->name() == h.transport);
  });
}

/// How long a waiting HELLO waits at most: then it is answered whatever the lower ranks do (a rank
/// that never comes fails the set-up, as before).
milliseconds receiver::impl::wait_bound(const wire::hello& h) const {
  const milliseconds asked = reply_timeout_of(h);
  return asked.count() > 0 ? asked / 2 : options.idle_timeout / 2;
}

/// BEGIN from another streamer of the group, for the version in progress: its part joins it. A
/// streamer of another version is refused (the group never mixes versions); so is a lane that
/// already sent its part of this one.
receiver_event receiver::impl::join_refit(const wire::begin& b) {
  if (b.version != *group_version || b.subset != refit_subset || b.base) {
    const std::string message = fmt::format(
        "BEGIN of {}version {} from {}, while {}version {} is in progress: every streamer of a group sends the "
        "same versions, whole or subset alike; this one is refused (the group's version goes on)",
        b.base     ? "delta "
        : b.subset ? "subset "
                   : "",
        b.version, who(*ln), refit_subset ? "subset " : "", *group_version);
    REFIT_WARN("{}", message);
    reply_error(errc::protocol, message);
    return receiver_event::refused;
  }
  ln->sink->end_sources();
  try {
    ln->tracker->begin(b, committed_version());
  } catch (const error& e) {
    reply_error(e.code(), e.what());
    return receiver_event::refused;
  }
  ln->deferred.reset();
  ln->failed.reset();
  if (ln->direct && !ln->into_stage) is_dirty.store(true);
  reply_ok();
  return receiver_event::begin;
}

/// A message of version `version` from a lane whose part of it ended without it (another rank
/// failed the group's version): answered with why, once.
std::optional<receiver_event> receiver::impl::refuse_failed(std::uint64_t version) {
  if (!ln->failed || ln->failed->first != version) return std::nullopt;
  const refusal r = ln->failed->second;
  ln->failed.reset();
  reply_error(r.code, r.message);
  return receiver_event::refused;
}

/// A group's version: the byte ranges its streamers sent of each tensor must cover the tensor
/// exactly once, with one dtype and shape. Returns the names that arrived. Throws
/// errc::invalid_argument (ranks disagree on a tensor, or their shards overlap) or
/// errc::incomplete (bytes no rank sent), naming the tensor and the ranks.
std::set<std::string, std::less<>> receiver::impl::check_shards(std::uint64_t version) const {
  struct piece {
    std::uint64_t first, next;
    std::size_t rank;
    const wire::refit_tracker::range* r;
  };
  std::map<std::string_view, std::vector<piece>> by_name;
  for (const lane& l : lanes)
    for (const auto& [name, r] : l.tracker->ranges()) by_name[name].push_back(piece{r.first, r.next, l.rank, &r});
  std::set<std::string, std::less<>> arrived;
  for (auto& entry : by_name) {
    // Not a structured binding: the lambdas below use both, which clang before 16 cannot capture.
    const std::string_view name = entry.first;
    std::vector<piece>& pieces = entry.second;
    std::sort(pieces.begin(), pieces.end(),
              [](const piece& x, const piece& y) { return x.first != y.first ? x.first < y.first : x.next < y.next; });
    const wire::refit_tracker::range& one = *pieces.front().r;
    // Rows when the ranges fall on rows (shards of dimension 0), bytes otherwise.
    const std::uint64_t row =
        one.shape.empty() || one.shape.front() <= 0 ? 0 : one.total / static_cast<std::uint64_t>(one.shape.front());
    const auto span = [&](std::uint64_t lo, std::uint64_t hi) {
      if (row != 0 && lo % row == 0 && hi % row == 0) return fmt::format("rows [{}, {})", lo / row, hi / row);
      return fmt::format("bytes [{}, {})", lo, hi);
    };
    const auto unsent = [&](std::uint64_t lo, std::uint64_t hi) {
      throw error(errc::incomplete,
                  fmt::format("version {}: tensor '{}': {} were sent by no rank (the shards of ranks {} leave them "
                              "out); nothing was committed",
                              version, name, span(lo, hi), ranks_of(pieces)));
    };
    std::uint64_t cursor = 0;
    std::size_t last_rank = pieces.front().rank;
    for (const piece& p : pieces) {
      if (p.r->type != one.type || p.r->shape != one.shape)
        throw error(
            errc::invalid_argument,
            fmt::format("version {}: tensor '{}' is {} from rank {} but {} from rank {}; nothing was "
                        "committed",
                        version, name, describe(tensor_meta{std::string(name), one.type, one.shape}),
                        pieces.front().rank, describe(tensor_meta{std::string(name), p.r->type, p.r->shape}), p.rank));
      if (p.first == p.next) continue;  // an empty shard covers nothing
      if (p.first < cursor)
        throw error(errc::invalid_argument,
                    fmt::format("version {}: tensor '{}': {} were sent by rank {} and by rank {} (their shards "
                                "overlap); nothing was committed",
                                version, name, span(p.first, std::min(cursor, p.next)), last_rank, p.rank));
      if (p.first > cursor) unsent(cursor, p.first);
      cursor = p.next;
      last_rank = p.rank;
    }
    if (cursor != one.total) unsent(cursor, one.total);
    arrived.emplace(name);
  }
  return arrived;
}

/// Why the group's version fails at lane `l`'s deadline (see step()).
std::string receiver::impl::late_reason(const lane& l) const {
  if (l.refit_active())
    return fmt::format("no message from the streamer {} for {} ms during version {}", who(l),
                       options.idle_timeout.count(), *group_version);
  if (l.commit_held) {
    std::vector<std::size_t> silent;
    for (const lane& o : lanes)
      if (o.awaits_commit) silent.push_back(o.rank);
    return fmt::format(
        "engine-wide version {} was prepared and {} said COMMIT, but rank {} said neither COMMIT nor ABORT within "
        "three quarters of {}'s reply timeout ({} ms): the version was discarded",
        *group_version, who(l), fmt::join(silent, ", "), who(l), l.reply_timeout.count());
  }
  if (l.awaits_commit)
    return fmt::format(
        "version {} was prepared engine-wide and the streamer {} sent no COMMIT (nor ABORT) within "
        "receiver_options.idle_timeout ({} ms) and its reply timeout ({} ms): the version was discarded",
        *group_version, who(l), options.idle_timeout.count(), l.reply_timeout.count());
  if (!l.held)
    return fmt::format("the streamer {} did not begin version {} within {} ms of the group's first BEGIN", who(l),
                       *group_version, options.idle_timeout.count());
  std::vector<std::size_t> missing;
  for (const lane& o : lanes)
    if (!o.held) missing.push_back(o.rank);
  return fmt::format(
      "version {} did not end within three quarters of the reply timeout of {} ({} ms): rank {} had not sent its "
      "END",
      *group_version, who(l), l.reply_timeout.count(), fmt::join(missing, ", "));
}

}  // namespace refit
