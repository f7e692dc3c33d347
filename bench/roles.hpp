// What the parts of the bench share beyond bench.hpp: progress lines, workloads, and the group of
// rows one (transport, engine, model) gives (bench/role_streamer.cpp), which run() measures
// (bench/run.cpp). Not part of the bench library's interface: its tests use bench.hpp.
#pragma once

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.hpp"
#include "refit/error.hpp"
#include "refit/receiver.hpp"
#include "refit/streamer.hpp"

namespace refit::bench {

double ms_since(std::chrono::steady_clock::time_point t0);
/// "refit-bench: LINE" on stderr, unless --quiet.
void progress(const config& c, const std::string& line);
/// One JSON line of ours. It may hold a peer's text (an error quoting a tensor name): bytes that are
/// not UTF-8 become U+FFFD instead of an exception that would end the receiver.
std::string dump_line(const nlohmann::json& j);
/// A receiver started by hand keeps its committed version between streamer runs, and every run
/// counts versions from 1: the receiver's refusal ("version 1 is not newer than the committed
/// version 6") then needs the way out said. Empty for any other error.
std::string reused_receiver_hint(const error& e);

/// The model named `model` (a preset), or --manifest's.
manifest workload(const config& c, const std::string& model);
/// The models of the run: --model's, or the --manifest file.
std::vector<std::string> model_list(const config& c);
std::string host_name();
std::string now_text();

/// The receiver_options of the receiver role (--role receiver, spawned or started by hand), from
/// the command line: the one place a receiver option of the bench is read (bench/role_receiver.cpp).
receiver_options receiver_role_options(const config& c);

/// The streamer_options every streamer of the bench starts from (the usual rows, --streamers' ranks,
/// --delta's): transport `t`, buffers of `mb` MiB, `buffers` of them, and c's --control-lane,
/// --nccl-twin, --device and --timeout-ms. The one place a streamer option of the command line is
/// read for all of them (bench/role_streamer.cpp).
streamer_options streamer_options_for(const config& c, transport_kind t, double mb, std::size_t buffers);

/// One (transport, engine, model) group of rows of the usual table.
struct row_group {
  const config& c;
  transport_path& path;
  transport_kind kind;
  const manifest& m;
  copy_engine engine;
  copy_engine apply_engine;
  double ceiling;  // bytes/s
  std::vector<mapped_file>* files;
  std::uint64_t& version;
};
/// Starts the group's receivers (or reaches the one started by hand), runs one row per (buffers,
/// buffer size, path), writes each to `out` and appends it to `rows`, then ends the receivers.
void run_row_group(row_group& g, std::ostream& out, std::vector<row>& rows);

}  // namespace refit::bench
