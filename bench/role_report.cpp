// The report side of verification: the checks a streamer makes of every receiver's committed line
// (count_wrong: a spawned receiver's stdout line or a hand-started one's report endpoint reply alike),
// the bounds on JSON from a peer, and what a receiver started by hand remembers to answer with
// (report_log). bench/role_receiver.cpp writes those lines, bench/role_streamer.cpp reads them.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "bench/bench.hpp"
#include "bench/roles.hpp"
#include "model/text.hpp"
#include "refit/error.hpp"

namespace refit::bench {
namespace {

using nlohmann::json;

// The longest report request a receiver reads: {"version": N} and some spaces.
constexpr std::size_t max_request_bytes = 4096;

// A JSON number that is a non-negative integer (a version, a checksum), else nullopt.
std::optional<std::uint64_t> unsigned_of(const json& j) {
  if (j.is_number_unsigned()) return j.get<std::uint64_t>();
  if (j.is_number_integer() && j.get<std::int64_t>() >= 0) return static_cast<std::uint64_t>(j.get<std::int64_t>());
  return std::nullopt;
}

}  // namespace

std::string default_report_endpoint(std::string_view refit_endpoint) {
  const std::string_view ep = refit_endpoint;
  if (ep.starts_with("ipc://") && ep.size() > 6) return fmt::format("{}.report", ep);
  if (ep.starts_with("tcp://")) {
    // The last ':' separates the port, unless it is inside an IPv6 address ("tcp://[::1]").
    const auto colon = ep.rfind(':');
    if (colon > 5 && colon + 1 < ep.size() && ep.find(']', colon) == std::string_view::npos)
      return fmt::format("{}:*", ep.substr(0, colon));
  }
  throw error(errc::invalid_argument, fmt::format("refit-bench: no default report endpoint for '{}': give --report "
                                                  "ipc:///PATH or tcp://HOST:PORT",
                                                  ep));
}

std::optional<std::string> peer_json_problem(std::string_view text, std::size_t max_bytes) {
  if (text.size() > max_bytes) return fmt::format("of {} bytes, more than the {} it may have", text.size(), max_bytes);
  std::size_t depth = 0;
  bool in_string = false, escaped = false;
  for (const char ch : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (ch == '\\')
        escaped = true;
      else if (ch == '"')
        in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      if (++depth > max_json_depth) return fmt::format("nested deeper than {} levels", max_json_depth);
    } else if ((ch == ']' || ch == '}') && depth > 0) {
      --depth;
    }
  }
  return std::nullopt;
}

json parse_peer_json(std::string_view text, std::size_t max_bytes, std::string_view who) {
  if (const auto problem = peer_json_problem(text, max_bytes))
    throw error(errc::protocol, fmt::format("refit-bench: {} sent JSON {}: refused unread; it begins {}", who, *problem,
                                            printable(text, 200)));
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded())
    throw error(errc::protocol,
                fmt::format("refit-bench: {} sent a line that is not JSON: {}", who, printable(text, 200)));
  return j;
}

namespace {

// excerpt()'s writer. Its recursion ends at depth 8 whatever the value holds.
void excerpt_into(std::string& out, const json& j, std::size_t max_bytes, int depth) {
  const auto scalar = [&](const json& v) {
    // A long string is cut before it is written out: the excerpt shows its start only.
    const json cut = v.is_string() && v.get_ref<const std::string&>().size() > max_bytes
                         ? json(v.get_ref<const std::string&>().substr(0, max_bytes))
                         : json();
    out += (cut.is_null() ? v : cut).dump(-1, ' ', false, json::error_handler_t::replace);
  };
  if (!j.is_structured()) return scalar(j);
  const bool array = j.is_array();
  if (depth >= 8) {
    out += array ? "[…]" : "{…}";
    return;
  }
  out += array ? '[' : '{';
  bool first = true;
  for (const auto& item : j.items()) {
    if (out.size() > max_bytes) break;
    if (!first) out += ',';
    first = false;
    if (!array) {
      scalar(json(item.key()));
      out += ':';
    }
    excerpt_into(out, item.value(), max_bytes, depth + 1);
  }
  out += array ? ']' : '}';
}

}  // namespace

std::string excerpt(const json& j, std::size_t max_bytes) {
  std::string out;
  excerpt_into(out, j, max_bytes, 0);
  return printable(out, max_bytes);
}

std::size_t max_report_bytes(const manifest& m) {
  // A checksum is at most 20 digits and a comma; the rest of the line (and an aborted line's
  // error) fits in the MiB.
  return (std::size_t{1} << 20) + 32 * m.entries.size();
}

std::int64_t count_wrong(const config& c, const json& line, std::uint64_t version, const manifest& m,
                         const std::vector<std::uint64_t>& expected, const std::string& who,
                         const std::string& receiver, std::int64_t& printed, int rank) {
  const auto said = [&] { return excerpt(line); };
  const bool object = line.is_object();
  const auto v = object ? line.find("version") : line.end();
  if (!object || line.value("event", json()) != "committed" || v == line.end() || unsigned_of(*v) != version) {
    const bool unknown = object && line.value("event", json()) == "unknown";
    throw error(errc::protocol,
                fmt::format("refit-bench: {} did not commit version {}: it said {}{}", who, version, said(),
                            unknown ? " (it has no record of that version: is --connect the endpoint of "
                                      "the receiver that printed this report endpoint?)"
                                    : ""));
  }
  // A receiver started by hand with another --layout: its checksums would still match, but the
  // rows would name the wrong layout.
  const auto held = line.find("layout");
  if (held != line.end() && *held != layout_name(c.layout))
    throw error(errc::protocol, fmt::format("refit-bench: {} holds the model in layout {} and this streamer runs with "
                                            "--layout {}: give both sides the same --layout",
                                            who, excerpt(*held), layout_name(c.layout)));
  // A tensor-parallel rank's checksums are of its slices: another rank's would all be wrong.
  const auto held_rank = line.find("rank");
  if (c.layout.tp > 1 && held_rank != line.end() && unsigned_of(*held_rank) != static_cast<std::uint64_t>(rank))
    throw error(errc::protocol,
                fmt::format("refit-bench: {} holds rank {} of --layout {} and this streamer checks rank "
                            "{}: give both sides the same --rank",
                            who, excerpt(*held_rank), layout_name(c.layout), rank));
  const std::size_t n = m.entries.size();
  const auto sums = line.find("checksums");
  if (sums == line.end() || !sums->is_array() || sums->size() != n)
    throw error(errc::protocol, fmt::format("refit-bench: {} sent {} checksums for {} tensors", who,
                                            sums == line.end() || !sums->is_array() ? 0 : sums->size(), n));
  std::int64_t wrong = 0;
  if (expected.size() != n) return 0;  // unverified (--convert): the commit is all that is checked
  for (std::size_t i = 0; i < n; ++i) {
    const auto sum = unsigned_of((*sums)[i]);
    if (!sum)
      throw error(errc::protocol,
                  fmt::format("refit-bench: {} sent checksum {} as {}, not a number", who, i, excerpt((*sums)[i])));
    if (*sum == expected[i]) continue;
    if (printed < 3) {
      progress(c, fmt::format("WRONG: version {}{} tensor {} ({}): checksum {:#018x}, expected {:#018x}", version,
                              receiver, i, describe(m.entries[i].meta), *sum, expected[i]));
      ++printed;
    }
    ++wrong;
  }
  return wrong;
}

report_log::report_log(std::size_t capacity) : capacity_(std::max<std::size_t>(capacity, 1)) {}

void report_log::committed(const json& line) { add(line); }
void report_log::aborted(const json& line) { add(line); }

void report_log::add(const json& line) {
  if (events_.size() == capacity_) {
    events_.erase(events_.begin());
    forgot_ = true;
  }
  events_.push_back(line);
}

std::string report_log::answer(std::string_view request) const {
  // A request is a few bytes: anything longer or nested is refused before it is parsed, so that a
  // request costs at most ~150 KiB of heap to parse (36 bytes a byte) whatever its size.
  const auto problem = peer_json_problem(request, max_request_bytes);
  const json req = problem ? json() : json::parse(request, nullptr, false);
  const auto v = req.is_object() ? req.find("version") : req.end();
  const auto asked = v == req.end() ? std::nullopt : unsigned_of(*v);
  if (!asked)
    return json{{"event", "error"},
                {"error", fmt::format("a report request is {{\"version\": N}}{}",
                                      problem ? fmt::format("; this one, {}, was refused unread", *problem) : "")}}
        .dump();
  const std::uint64_t version = *asked;
  const auto is = [](const json& e, std::string_view event) { return e.value("event", std::string()) == event; };
  for (auto e = events_.rbegin(); e != events_.rend(); ++e)
    if (is(*e, "committed") && e->value("version", std::uint64_t{0}) == version) return dump_line(*e);
  // The first abort after the last commit of an earlier version, and before any later one, ended
  // this version (or the refit that was to be it). Without such a commit in the log, only when
  // nothing was forgotten: an abort could otherwise belong to an older version.
  const json* abort = nullptr;
  bool after_earlier = !forgot_;
  for (const auto& e : events_) {
    if (is(e, "committed")) {
      if (e.value("version", std::uint64_t{0}) > version) break;
      after_earlier = true;
      abort = nullptr;
    } else if (is(e, "aborted") && after_earlier && !abort) {
      abort = &e;
    }
  }
  if (abort) return dump_line(*abort);
  return json{{"event", "unknown"}, {"version", version}}.dump();
}

}  // namespace refit::bench
