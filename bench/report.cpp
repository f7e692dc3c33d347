// Output: the nccl-tests-style table, its JSON mirror and the throughput plot (SVG).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <ostream>
#include <set>

#include "bench/bench.hpp"

namespace refit::bench {
namespace {

// name, unit, width. Every column is right-aligned to its width and separated by one space.
struct column {
  const char* name;
  const char* unit;
  int width;
};
constexpr column columns[] = {
    {"transport", "", 9}, {"model", "", 14},        {"engine", "", 25},    {"buf_MiB", "", 7}, {"nbuf", "", 4},
    {"tensors", "", 7},   {"bytes", "(GB)", 8},     {"median", "(ms)", 9}, {"min", "(ms)", 9}, {"max", "(ms)", 9},
    {"GB/s", "", 8},      {"ceiling", "(GB/s)", 8}, {"floor", "(ms)", 9},  {"ratio", "", 6},   {"source", "(ms)", 8},
    {"pack", "(ms)", 8},  {"wait", "(ms)", 8},      {"apply", "(ms)", 8},  {"wrong", "", 6},
};

std::string fmt_ms(double ms) { return ms < 0 ? "n/a" : fmt::format("{:.2f}", ms); }

std::string fmt_mb(double mb) { return fmt::format("{:g}", mb); }

std::string xml_escape(std::string_view s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

double nice_step(double range) {
  const double raw = range / 5;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (const double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (raw <= m * mag) return m * mag;
  return 10 * mag;
}

}  // namespace

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::int64_t total_wrong(const std::vector<row>& rows) {
  std::int64_t n = 0;
  for (const auto& r : rows) n += std::max<std::int64_t>(r.wrong, 0);
  return n;
}

void write_preamble(std::ostream& out, const preamble& p) {
  out << fmt::format("# refit-bench: refit {}\n", p.refit_version);
  out << fmt::format("# command   : {}\n", p.command);
  out << fmt::format("# host      : {} (pid {}), {}\n", p.host, p.pid, p.date);
  out << fmt::format("# cpu       : {}\n", p.cpu);
  if (p.gpus.empty()) out << "# gpu       : none used\n";
  for (const auto& g : p.gpus) out << fmt::format("# gpu       : {}\n", g);
  out << fmt::format("# transports: {}\n", fmt::join(p.transports, ", "));
  for (const auto& n : p.notes) out << fmt::format("# note      : {}\n", n);
  for (const auto& m : p.models)
    out << fmt::format("# model     : {}: {} tensors, {} params, {:.3f} GB, largest tensor {:.1f} MB\n", m.name,
                       m.tensors, m.params, m.bytes / 1e9, m.largest / 1e6);
  out << fmt::format("# data      : {}, dtype {}\n", p.data, p.dtype);
  out << fmt::format(
      "# buffers   : {} x {} MiB, alignment {} B, {}\n", fmt::join(p.buffer_counts, "|"), fmt::join(p.buffer_mb, "|"),
      p.alignment, p.keep_whole ? "tensors kept whole where they fit a buffer" : "batches filled up (--keep-whole 0)");
  out << fmt::format("# copy      : engine {}\n", p.engine);
  out << fmt::format("# iterations: {} warm-up + {} counted per row, each a new version with fresh data; {}\n",
                     p.warmup, p.iters, p.verified ? "every refit verified" : "NOT verified (--no-verify)");
  out << "# GB/s = payload bytes / median time; floor = 2 x bytes / ceiling for a staged refit (every byte copied "
         "twice),\n"
         "#   1 x bytes / ceiling for a direct one (engine +direct: written straight into the receiver's weights)\n"
         "#   and for a staged one the receiver read where the tensors are (engine +shared: share_tensors);\n"
         "# ratio = floor / median; source, pack, wait: streamer (medians); apply: receiver; wrong: tensors with a bad "
         "checksum\n";
  if (std::find(p.transports.begin(), p.transports.end(), "nccl") != p.transports.end())
    out << "# nccl rows: ceiling = raw ncclBroadcast among the same GPUs; floor = 1 x bytes / ceiling (one pass: "
           "refit\n"
           "#   broadcasts every byte once, from the tensors into the weights where they are on the GPUs), so ratio =\n"
           "#   refit GB/s / raw broadcast GB/s; +in-place: every entry in place, 1 GiB batches whatever the buffer "
           "size\n"
           "#   (--path direct); without: buffer-sized batches (--path staged); apply = the slowest receiver's; wrong "
           "=\n"
           "#   summed over every receiver\n";
  out << "#\n";
}

void write_header(std::ostream& out) {
  std::string names = "#", units = "#";
  for (const auto& c : columns) {
    names += fmt::format(" {:>{}}", c.name, c.width);
    units += fmt::format(" {:>{}}", c.unit, c.width);
  }
  out << names << '\n' << units << '\n';
}

void write_row(std::ostream& out, const row& r) {
  const std::string cells[] = {
      r.transport,
      r.model,
      r.engine,
      fmt_mb(static_cast<double>(r.buffer_bytes) / (1 << 20)),
      std::to_string(r.buffers),
      std::to_string(r.tensors),
      fmt::format("{:.3f}", r.bytes / 1e9),
      fmt_ms(r.median_ms),
      fmt_ms(r.min_ms),
      fmt_ms(r.max_ms),
      fmt::format("{:.2f}", r.gbps),
      fmt::format("{:.2f}", r.ceiling_gbps),
      fmt_ms(r.floor_ms),
      fmt::format("{:.2f}", r.ratio),
      fmt_ms(r.source_ms),
      fmt_ms(r.pack_ms),
      fmt_ms(r.wait_ms),
      fmt_ms(r.apply_ms),
      r.wrong < 0 ? std::string("n/a") : std::to_string(r.wrong),
  };
  std::string line = " ";
  for (std::size_t i = 0; i < std::size(columns); ++i) {
    // Fixed width: a long model name is cut here (the preamble and the JSON keep it whole).
    const auto width = static_cast<std::size_t>(columns[i].width);
    const std::string& cell = cells[i];
    line += fmt::format(" {:>{}}", cell.size() > width ? cell.substr(0, width - 1) + "~" : cell, width);
  }
  out << line << '\n';
  if (r.fixed_ms >= 0) {
    // --split: a comment line, so that the table's columns stay what parsers expect.
    const double rest = r.median_ms - r.fixed_ms;
    out << fmt::format(
        "#   split: fixed {:.3f} ms a refit (its smallest tensor alone, a subset version, same "
        "session); the rest {}\n",
        r.fixed_ms,
        rest > 0 ? fmt::format("{:.3f} ms: {:.1f} GB/s, {:.2f} of the floor", rest,
                               static_cast<double>(r.bytes) / (rest * 1e6), r.rest_ratio())
                 : std::string("is within the noise"));
  }
  out.flush();
}

void write_footer(std::ostream& out, const std::vector<row>& rows, bool failed) {
  const std::int64_t wrong = total_wrong(rows);
  const bool unverified = std::any_of(rows.begin(), rows.end(), [](const row& r) { return r.wrong < 0; });
  double sum = 0;
  for (const auto& r : rows) sum += r.gbps;
  out << fmt::format("# Wrong values          : {} {}\n", wrong,
                     wrong        ? "FAILED"
                     : failed     ? "(the run FAILED: its error follows on stderr)"
                     : unverified ? "OK (some rows not verified)"
                                  : "OK");
  if (std::any_of(rows.begin(), rows.end(), [](const row& r) { return r.streamer_memory.device >= 0; })) {
    const std::size_t over = rows_over_budget(rows);
    out << fmt::format("# Memory over budget    : {} {}\n", over, over != 0 ? "FAILED (--memory: which)" : "OK");
  }
  out << fmt::format("# Avg throughput (GB/s) : {:.3f}\n", rows.empty() ? 0.0 : sum / static_cast<double>(rows.size()));
  out << "#\n";
  out.flush();
}

/// One side's memory in a JSON row: bytes per kind, null where unknown.
static nlohmann::json side_json(const row::side_memory& m) {
  const auto bytes = [](std::int64_t v) { return v < 0 ? nlohmann::json(nullptr) : nlohmann::json(v); };
  return {{"device", bytes(m.device)}, {"pinned", bytes(m.pinned)}, {"host", bytes(m.host)}};
}

static nlohmann::json driver_json(std::int64_t v) { return v < 0 ? nlohmann::json(nullptr) : nlohmann::json(v); }

void write_memory(std::ostream& out, const std::vector<row>& rows) {
  const auto mib = [](std::int64_t v) { return v < 0 ? std::string("?") : fmt::format("{:.1f}", v / 1048576.0); };
  const auto side = [&](const row::side_memory& m) {
    return fmt::format("{}/{}/{}", mib(m.device), mib(m.pinned), mib(m.host));
  };
  out << "# memory (MiB, peaks of what refit held beyond the weights, device/pinned/host; receiver: the largest of "
         "them),\n"
         "#   each side against its budget (README.md \"Memory\": the formula, + 8 MiB a kind), and the device\n"
         "#   memory the driver saw taken during the row (cudaMemGetInfo, the whole GPU's: NCCL's buffers and the\n"
         "#   context included, and on a GPU both sides share what the other side allocated meanwhile):\n";
  for (const row& r : rows)
    out << fmt::format(
        "#   {} {} {} x {:g} MiB {}: streamer {} (budget {}: {}; driver {}) | receiver {} (budget {}: {}; driver "
        "{}){}\n",
        r.transport, r.model, r.buffers, r.buffer_bytes / 1048576.0, r.engine, side(r.streamer_memory),
        side(r.streamer_budget), r.streamer_formula, mib(r.streamer_driver), side(r.receiver_memory),
        side(r.receiver_budget), r.receiver_formula, mib(r.receiver_driver), over_budget(r) ? "  OVER BUDGET" : "");
}

std::size_t rows_over_budget(const std::vector<row>& rows) {
  return static_cast<std::size_t>(std::count_if(rows.begin(), rows.end(), [](const row& r) { return over_budget(r); }));
}

nlohmann::json to_json(const preamble& p, const std::vector<row>& rows) {
  nlohmann::json j;
  auto& pj = j["preamble"];
  pj["refit_version"] = p.refit_version;
  pj["command"] = p.command;
  pj["host"] = p.host;
  pj["pid"] = p.pid;
  pj["date"] = p.date;
  pj["cpu"] = p.cpu;
  pj["gpus"] = p.gpus;
  pj["transports"] = p.transports;
  pj["notes"] = p.notes;
  pj["models"] = nlohmann::json::array();
  for (const auto& m : p.models)
    pj["models"].push_back({{"name", m.name},
                            {"tensors", m.tensors},
                            {"bytes", m.bytes},
                            {"params", m.params},
                            {"largest_bytes", m.largest}});
  pj["buffer_mb"] = p.buffer_mb;
  pj["buffer_counts"] = p.buffer_counts;
  pj["alignment"] = p.alignment;
  pj["keep_whole"] = p.keep_whole;
  pj["warmup"] = p.warmup;
  pj["iters"] = p.iters;
  pj["dtype"] = p.dtype;
  pj["seed"] = p.seed;
  pj["engine"] = p.engine;
  pj["data"] = p.data;
  auto& rj = j["rows"];
  rj = nlohmann::json::array();
  double sum = 0;
  for (const auto& r : rows) {
    auto opt = [](double v) { return v < 0 ? nlohmann::json(nullptr) : nlohmann::json(v); };
    rj.push_back(
        {{"transport", r.transport},
         {"receivers", r.receivers},
         {"model", r.model},
         {"engine", r.engine},
         {"layout", r.layout},
         {"buffer_bytes", r.buffer_bytes},
         {"buffer_mb", static_cast<double>(r.buffer_bytes) / (1 << 20)},
         {"buffers", r.buffers},
         {"buffer_memory_bytes", r.buffer_memory()},
         {"tensors", r.tensors},
         {"bytes", r.bytes},
         {"batches", r.batches},
         {"iters", r.iters},
         {"time_ms", {{"median", r.median_ms}, {"min", r.min_ms}, {"max", r.max_ms}}},
         {"gbps", r.gbps},
         {"ceiling_gbps", r.ceiling_gbps},
         {"floor_ms", r.floor_ms},
         {"ratio", r.ratio},
         {"source_ms", r.source_ms},
         {"pack_ms", r.pack_ms},
         {"wait_ms", r.wait_ms},
         {"apply_ms", opt(r.apply_ms)},
         {"pause_ms", opt(r.pause_ms)},
         {"commit_ms", opt(r.commit_ms)},
         {"wrong", r.wrong < 0 ? nlohmann::json(nullptr) : nlohmann::json(r.wrong)},
         {"fixed_ms", opt(r.fixed_ms)},
         {"rest_ratio", r.fixed_ms < 0 ? nlohmann::json(nullptr) : nlohmann::json(r.rest_ratio())},
         {"memory",
          {{"streamer", side_json(r.streamer_memory)},
           {"receiver", side_json(r.receiver_memory)},
           {"budget",
            {{"streamer", side_json(r.streamer_budget)},
             {"receiver", side_json(r.receiver_budget)},
             {"streamer_formula", r.streamer_formula},
             {"receiver_formula", r.receiver_formula}}},
           {"driver", {{"streamer", driver_json(r.streamer_driver)}, {"receiver", driver_json(r.receiver_driver)}}},
           {"over_budget", over_budget(r)}}}});
    sum += r.gbps;
  }
  j["wrong"] = total_wrong(rows);
  j["ok"] = total_wrong(rows) == 0;
  j["avg_gbps"] = rows.empty() ? 0.0 : sum / static_cast<double>(rows.size());
  return j;
}

namespace {

// to_svg's steps. The chart: one series per (transport, engine, model, buffers), x = buffer size
// (log2 MiB), y = GB/s, with each transport's ceiling and staged limit as horizontal lines.
constexpr double svg_width = 900, svg_height = 540;
constexpr double svg_left = 80, svg_right = 260, svg_top = 60, svg_bottom = 70;
constexpr double plot_w = svg_width - svg_left - svg_right, plot_h = svg_height - svg_top - svg_bottom;
constexpr const char* palette[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd",
                                   "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};

double log2_mib(std::uint64_t bytes) { return std::log2(static_cast<double>(bytes) / (1 << 20)); }

/// The rows grouped into series, and the extent of the data.
struct chart_data {
  double x_lo = 1e300, x_hi = -1e300, y_hi = 0;
  std::map<std::string, double> ceilings;  // transport → GB/s
  std::vector<std::string> transports;
  std::map<std::string, std::vector<const row*>> series;  // "transport model nbuf" → rows
  std::vector<std::string> order;

  explicit chart_data(const std::vector<row>& rows) {
    for (const auto& r : rows) {
      const double x = log2_mib(r.buffer_bytes);
      x_lo = std::min(x_lo, x);
      x_hi = std::max(x_hi, x);
      y_hi = std::max({y_hi, r.gbps, r.ceiling_gbps});
      ceilings[r.transport] = std::max(ceilings[r.transport], r.ceiling_gbps);
      if (std::find(transports.begin(), transports.end(), r.transport) == transports.end())
        transports.push_back(r.transport);
      const std::string key = fmt::format("{} {} {} x{}", r.transport, r.engine, r.model, r.buffers);
      if (!series.count(key)) order.push_back(key);
      series[key].push_back(&r);
    }
  }

  /// Series k has colour k; a transport's ceilings take the colour of its first series.
  std::string transport_color(const std::string& t) {
    for (std::size_t k = 0; k < order.size(); ++k)
      if (series[order[k]].front()->transport == t) return std::string(palette[k % std::size(palette)]);
    return std::string(palette[0]);
  }
};

/// Both axes' ranges, the y ticks, and the mapping of data to pixels.
struct chart_axes {
  double x_lo, x_hi, y_lo = 0, y_hi;
  bool log_y = false;
  std::vector<double> y_ticks;

  chart_axes(const chart_data& d, const std::vector<row>& rows) : x_lo(d.x_lo), x_hi(d.x_hi), y_hi(d.y_hi) {
    if (rows.empty()) x_lo = x_hi = 6;
    x_lo = std::floor(x_lo);
    x_hi = std::ceil(x_hi);
    if (x_hi - x_lo < 2) {
      x_lo -= 1;
      x_hi += 1;
    }
    if (y_hi <= 0) y_hi = 1;
    // Transports far apart (host memcpy vs HBM) share a log axis; otherwise a linear one from 0.
    double y_min_pos = y_hi;
    for (const auto& r : rows) {
      if (r.gbps > 0) y_min_pos = std::min(y_min_pos, r.gbps);
      if (r.ceiling_gbps > 0) y_min_pos = std::min(y_min_pos, r.ceiling_gbps / 2);
    }
    log_y = y_hi / y_min_pos > 50;
    if (log_y)
      log_ticks(y_min_pos);
    else
      linear_ticks();
  }

  void log_ticks(double y_min_pos) {
    y_lo = std::pow(10.0, std::floor(std::log10(y_min_pos)));
    const double decade = std::pow(10.0, std::floor(std::log10(y_hi * 1.05)));
    for (const double m : {1.0, 2.0, 5.0, 10.0})
      if (m * decade >= y_hi * 1.05) {
        y_hi = m * decade;
        break;
      }
    for (double d = y_lo; d < y_hi * 1.01; d *= 10)
      for (const double m : {1.0, 2.0, 5.0})
        if (d * m <= y_hi * 1.01) y_ticks.push_back(d * m);
  }

  void linear_ticks() {
    const double step = nice_step(y_hi * 1.08);
    y_hi = std::ceil(y_hi * 1.08 / step) * step;
    for (double y = 0; y <= y_hi + step / 2; y += step) y_ticks.push_back(y);
  }

  [[nodiscard]] double X(double lx) const { return svg_left + (lx - x_lo) / (x_hi - x_lo) * plot_w; }
  [[nodiscard]] double Y(double gbps) const {
    if (!log_y) return svg_top + plot_h - gbps / y_hi * plot_h;
    const double v = std::max(gbps, y_lo);
    return svg_top + plot_h - (std::log10(v) - std::log10(y_lo)) / (std::log10(y_hi) - std::log10(y_lo)) * plot_h;
  }
};

/// The document's head, the title and the run's description.
void svg_header(std::string& s, const preamble& p) {
  s += fmt::format(R"svg(<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{0}" height="{1}" viewBox="0 0 {0} {1}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
)svg",
                   svg_width, svg_height);
  std::vector<std::string> names;
  for (const auto& m : p.models) names.push_back(m.name);
  s += fmt::format(
      R"svg(<text x="{}" y="24" font-size="16" font-weight="bold">refit throughput vs buffer size — {}</text>
<text x="{}" y="42" fill="#555">refit {} on {}{}{}; {} warm-up + {} iterations, median</text>
)svg",
      svg_left, xml_escape(fmt::format("{}", fmt::join(names, ", "))), svg_left, xml_escape(p.refit_version),
      xml_escape(p.host), p.gpus.empty() ? "" : ", ", xml_escape(p.gpus.empty() ? "" : p.gpus.front()), p.warmup,
      p.iters);
}

/// Grid and axes.
void svg_axes(std::string& s, const chart_axes& a) {
  for (const double y : a.y_ticks)
    s += fmt::format(
        R"svg(<line x1="{0}" y1="{1:.1f}" x2="{2}" y2="{1:.1f}" stroke="#e5e5e5"/><text x="{3}" y="{4:.1f}" text-anchor="end">{5:g}</text>
)svg",
        svg_left, a.Y(y), svg_left + plot_w, svg_left - 8, a.Y(y) + 4, y);
  for (double lx = a.x_lo; lx <= a.x_hi + 0.5; lx += 1)
    s += fmt::format(
        R"svg(<line x1="{0:.1f}" y1="{1}" x2="{0:.1f}" y2="{2}" stroke="#e5e5e5"/><text x="{0:.1f}" y="{3}" text-anchor="middle">{4:g}</text>
)svg",
        a.X(lx), svg_top, svg_top + plot_h, svg_top + plot_h + 18, std::exp2(lx));
  s += fmt::format(R"svg(<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#333"/>
<text x="{}" y="{}" text-anchor="middle">buffer size (MiB, log2 scale)</text>
<text x="20" y="{}" text-anchor="middle" transform="rotate(-90 20 {})">throughput (GB/s of payload{})</text>
)svg",
                   svg_left, svg_top, plot_w, plot_h, svg_left + plot_w / 2, svg_height - 24, svg_top + plot_h / 2,
                   svg_top + plot_h / 2, a.log_y ? ", log scale" : "");
}

/// The legend on the right, one line per call.
struct svg_legend {
  std::string& s;
  double y = svg_top + 8;
  void add(const std::string& style, const std::string& color, const std::string& label) {
    const double lx = svg_left + plot_w + 16;
    s += fmt::format(
        R"svg(<line x1="{}" y1="{:.1f}" x2="{}" y2="{:.1f}" stroke="{}" stroke-width="2" {}/><text x="{}" y="{:.1f}">{}</text>
)svg",
        lx, y, lx + 28, y, color, style, lx + 34, y + 4, xml_escape(label));
    y += 20;
  }
};

/// Ceilings: the copy bandwidth (dashed) and the staged limit, ceiling / 2 (dotted).
void svg_ceilings(std::string& s, chart_data& d, const chart_axes& a, svg_legend& legend) {
  for (std::size_t t = 0; t < d.transports.size(); ++t) {
    const std::string color = d.transport_color(d.transports[t]);
    const double c = d.ceilings[d.transports[t]];
    s += fmt::format(
        R"svg(<line x1="{}" y1="{:.1f}" x2="{}" y2="{:.1f}" stroke="{}" stroke-width="1.5" stroke-dasharray="8 4"/>
)svg",
        svg_left, a.Y(c), svg_left + plot_w, a.Y(c), color);
    legend.add(R"(stroke-dasharray="8 4")", color, fmt::format("{} ceiling {:.1f} GB/s", d.transports[t], c));
    if (d.transports[t] == "nccl") continue;  // its ceiling is the broadcast itself: no staged limit
    s += fmt::format(
        R"svg(<line x1="{}" y1="{:.1f}" x2="{}" y2="{:.1f}" stroke="{}" stroke-width="1.5" stroke-dasharray="2 3"/>
)svg",
        svg_left, a.Y(c / 2), svg_left + plot_w, a.Y(c / 2), color);
    legend.add(R"(stroke-dasharray="2 3")", color, fmt::format("{} staged limit {:.1f} GB/s", d.transports[t], c / 2));
  }
}

/// Measured series: a line through each series' points, a dot per row (black when it had wrong values).
void svg_series(std::string& s, chart_data& d, const chart_axes& a, svg_legend& legend) {
  for (std::size_t k = 0; k < d.order.size(); ++k) {
    auto& pts = d.series[d.order[k]];
    std::sort(pts.begin(), pts.end(), [](const row* x, const row* y) { return x->buffer_bytes < y->buffer_bytes; });
    const std::string color = palette[k % std::size(palette)];
    std::string poly;
    for (const row* r : pts) poly += fmt::format("{:.1f},{:.1f} ", a.X(log2_mib(r->buffer_bytes)), a.Y(r->gbps));
    s += fmt::format(R"svg(<polyline points="{}" fill="none" stroke="{}" stroke-width="2.5"/>
)svg",
                     poly, color);
    for (const row* r : pts) {
      const double x = a.X(log2_mib(r->buffer_bytes));
      s += fmt::format(
          R"svg(<circle cx="{:.1f}" cy="{:.1f}" r="4" fill="{}"><title>{} {} MiB x{}: {:.2f} GB/s, {:.2f} ms ({:.0f}% of floor){}</title></circle>
)svg",
          x, a.Y(r->gbps), r->wrong > 0 ? "black" : color, xml_escape(r->transport),
          fmt_mb(static_cast<double>(r->buffer_bytes) / (1 << 20)), r->buffers, r->gbps, r->median_ms, r->ratio * 100,
          r->wrong > 0 ? ", WRONG VALUES" : "");
    }
    legend.add("", color, d.order[k]);
  }
}

}  // namespace

std::string to_svg(const preamble& p, const std::vector<row>& rows) {
  chart_data data(rows);
  const chart_axes axes(data, rows);
  std::string s;
  svg_header(s, p);
  svg_axes(s, axes);
  svg_legend legend{s};
  svg_ceilings(s, data, axes, legend);
  svg_series(s, data, axes, legend);
  s += "</svg>\n";
  return s;
}

}  // namespace refit::bench
