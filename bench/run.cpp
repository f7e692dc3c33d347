// refit-bench as a whole: what run() does for the command line it was given. The receiver role
// (bench/role_receiver.cpp), --delta (bench/delta.cpp) and --streamers (bench/group.cpp) each take
// over; otherwise the usual table: the transports resolved, the models laid out, the preamble, the
// ceilings, then one group of rows per (transport, engine, model) (bench/role_streamer.cpp).
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "bench/roles.hpp"
#include "config/config.hpp"
#include "refit/error.hpp"
#include "refit/nccl.hpp"
#include "transport/transport.hpp"

namespace refit::bench {

using nlohmann::json;

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

void progress(const config& c, const std::string& line) {
  if (!c.quiet) std::cerr << "refit-bench: " << line << std::endl;
}

std::string dump_line(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

/// A receiver started by hand keeps its committed version between streamer runs, and every run
/// counts versions from 1: the receiver's refusal ("version 1 is not newer than the committed
/// version 6") then needs the way out said.
std::string reused_receiver_hint(const error& e) {
  if (std::string_view(e.what()).find("is not newer than the committed version") == std::string_view::npos) return {};
  return "; that receiver has served an earlier run, and every streamer run counts versions from 1: start a fresh "
         "receiver (refit-bench --role receiver) for each run";
}

// ---------------------------------------------------------------- workloads

manifest workload(const config& c, const std::string& model) {
  if (!c.manifest_file.empty()) return load_manifest(c.manifest_file, c.type);
  return preset(model, c.type);
}

std::vector<std::string> model_list(const config& c) {
  if (!c.manifest_file.empty()) return {c.manifest_file};
  return c.models;
}

std::string host_name() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

std::string now_text() {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::tm tm{};
  ::localtime_r(&t, &tm);
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S %Z", &tm);
  return buf;
}

std::vector<transport_kind> built_transports() {
  std::vector<transport_kind> t{transport_kind::host_shm};
#if REFIT_HAVE_CUDA
  t.push_back(transport_kind::cuda_ipc);
#endif
#if REFIT_HAVE_NCCL
  t.push_back(transport_kind::nccl);
#endif
  return t;
}

std::unique_ptr<transport_path> make_path(transport_kind kind, const config& c) {
  switch (kind) {
    case transport_kind::host_shm: return make_host_shm_path();
    case transport_kind::cuda_ipc:
      // The streamer's ceiling follows its receivers' GPUs; a receiver's path only allocates.
      return make_cuda_ipc_path(
          c.device, c.vmm_sources, c.dests,
          c.side == role::receiver ? std::vector<int>{} : cuda_ipc_placement(c, visible_gpus()).receivers);
    case transport_kind::nccl: return make_nccl_path(c);
  }
  throw error(errc::invalid_argument, "refit-bench: unknown transport");
}

namespace {

void write_outputs(const config& c, const preamble& p, const std::vector<row>& rows) {
  if (!c.json_file.empty()) {
    std::ofstream f(c.json_file);
    f << to_json(p, rows).dump(2, ' ', false, json::error_handler_t::replace) << '\n';
    if (!f) throw error(errc::io, fmt::format("refit-bench: cannot write --json {}", c.json_file));
  }
  if (!c.plot_file.empty()) {
    std::ofstream f(c.plot_file);
    f << to_svg(p, rows);
    if (!f) throw error(errc::io, fmt::format("refit-bench: cannot write --plot {}", c.plot_file));
  }
}

// The preamble's note for a tensor-parallel layout of m: what each rank holds and needs. Lays out
// every rank, so that a model that does not shard fails before anything is measured.
std::string tp_note(const config& c, const manifest& m) {
  std::vector<std::string> needs;
  std::size_t tensors = 0, views = 0;
  for (int rank = 0; rank < c.layout.tp; ++rank) {
    const engine_layout l = make_layout(m, c.layout, rank);
    tensors = l.tensors.entries.size();
    views = l.views.size();
    needs.push_back(fmt::format("{:.3f}", l.needed_bytes(m) / 1e9));
  }
  return fmt::format(
      "--layout {}: each rank holds {} in {} engine tensors: {} views of {} source tensors; a rank "
      "needs {} GB of the {:.3f} GB (ranks 0..{})",
      layout_name(c.layout), m.name, tensors, views, m.entries.size(), fmt::join(needs, "|"), m.bytes() / 1e9,
      c.layout.tp - 1);
}
/// The transport paths to measure, resolved before anything is measured (a transport that is not
/// built fails here); what the preamble must say about them goes to `notes`.
std::vector<std::unique_ptr<transport_path>> resolve_paths(const config& c, std::vector<std::string>& notes) {
  std::vector<std::unique_ptr<transport_path>> paths;
  for (const auto t : c.transports) {
    if (t == transport_kind::nccl && c.nccl_optional) {
      // From "--transport all": nccl needs a GPU for the streamer and one per receiver.
      const int visible = visible_gpus();
      if (visible < (c.nccl_share_gpus ? 1 : 2)) {
        notes.push_back(fmt::format("nccl skipped: it needs at least 2 visible GPUs and {} visible", visible));
        std::cerr << "refit-bench: " << notes.back() << std::endl;
        continue;
      }
    }
    if (receiver_processes(c, t) > 1 && transport::capabilities_of(t).several_need_direct &&
        std::find(c.direct.begin(), c.direct.end(), false) != c.direct.end()) {
      if (std::find(c.direct.begin(), c.direct.end(), true) == c.direct.end())
        throw error(
            errc::invalid_argument,
            fmt::format("refit-bench: --path staged with --layout {} over {}: one streamer serves its {} receivers "
                        "only by writing into each one's weights; use --path direct",
                        layout_name(c.layout), to_string(t), receiver_processes(c, t)));
      notes.push_back(
          fmt::format("{}: direct rows only: one streamer serves {} receivers (--layout {}) only by writing "
                      "into each one's weights (--path staged skipped)",
                      to_string(t), receiver_processes(c, t), layout_name(c.layout)));
    }
    paths.push_back(make_path(t, c));
    if (t == transport_kind::nccl) {
      const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
      const std::size_t receivers = receiver_processes(c, t);
      notes.push_back(fmt::format("nccl: {} receiver process{} ({}), {}; NCCL_NVLS_ENABLE={}", receivers,
                                  receivers == 1 ? "" : "es", c.layout.tp > 1 ? "one per rank" : "--receivers",
                                  c.nccl_share_gpus ? "sharing GPUs (--nccl-share-gpus): each process its own "
                                                      "NCCL_HOSTID, so every byte goes through NCCL's network "
                                                      "transport over loopback, ceiling included (not NVLink figures)"
                                                    : "one GPU each",
                                  nvls ? nvls : "(unset)"));
      notes.push_back(
          fmt::format("nccl: {} (every process the bench spawns loads the same: --nccl-library, "
                      "REFIT_NCCL_LIBRARY)",
                      describe(nccl_library())));
    }
  }
  if (c.convert)
    notes.push_back(
        fmt::format("--convert {}: the receiver holds {} {} tensors as {}; floor = (bytes read + written) / "
                    "(2 x ceiling), over nccl converted bytes / ceiling; not verified here (wrong = n/a): "
                    "the test suites check converted bytes",
                    c.convert->name, c.convert->q == quant::none ? "every" : "the 2-d", to_string(c.convert->from),
                    to_string(c.convert->to)));
  if (c.side == role::streamer)
    notes.push_back(
        c.no_verify
            ? std::string("--no-verify: the receiver's checksums are not compared here (wrong = n/a)")
            : fmt::format("receiver started by hand: every refit verified through its report endpoint {}", c.report));
  return paths;
}

/// The receiver's layout of each model, made here too so that one that cannot be laid out fails
/// before anything is measured; its description goes to `notes`.
void lay_out_models(const config& c, const std::vector<manifest>& models, std::vector<std::string>& notes) {
  for (const auto& m : models) {
    if (c.layout.tp > 1) {
      notes.push_back(tp_note(c, m));
      continue;
    }
    const engine_layout l = make_layout(m, c.layout);
    if (c.layout != layout_kind::plain)
      notes.push_back(
          fmt::format("--layout {}: the receiver holds {} in {} engine tensors: {} views of {} source tensors",
                      layout_name(c.layout), m.name, l.tensors.entries.size(), l.views.size(), m.entries.size()));
  }
  if (c.layout.tp > 1)
    notes.push_back(fmt::format(
        "+{0} rows: bytes (and GB/s, floor, ratio) = what the receivers need, summed over the ranks "
        "they hold (each rank's slices, replicated tensors once per rank), not the source bytes "
        "streamed; cuda_ipc and nccl run all {1} ranks, one receiver each, host_shm rank {2} (--rank)",
        c.layout.kind == layout_kind::recorded ? std::string("recorded") : layout_name(c.layout), c.layout.tp, c.rank));
}

/// --load: the mapped safetensors files of the (one) model.
std::vector<mapped_file> load_files(const config& c, const std::vector<manifest>& models) {
  std::vector<mapped_file> files;
  if (c.load) {
    if (c.manifest_file.empty())
      throw error(errc::invalid_argument, "refit-bench: --load needs --manifest FILE.safetensors");
    for (const auto& e : models.front().entries)
      if (e.file < 0)
        throw error(errc::invalid_argument,
                    fmt::format("refit-bench: --load needs a .safetensors manifest (or a sharded "
                                "checkpoint's index); {} has no tensor data",
                                c.manifest_file));
    for (const auto& f : models.front().files) files.emplace_back(f);
  }
  return files;
}

preamble make_preamble(const config& c, const std::vector<std::unique_ptr<transport_path>>& paths,
                       const std::vector<manifest>& models, const std::vector<std::string>& notes) {
  preamble p;
  p.refit_version = REFIT_VERSION;
  p.host = host_name();
  p.pid = ::getpid();
  p.date = now_text();
  p.cpu = make_host_shm_path()->describe_device();
  for (const auto& path : paths) {
    p.transports.emplace_back(to_string(path->kind()));
    if (path->kind() != transport_kind::host_shm) p.gpus.push_back(path->describe_device());
  }
  p.notes = notes;
  p.verified = !(c.side == role::streamer && c.no_verify);
  for (const auto& m : models) p.models.push_back({m.name, m.entries.size(), m.bytes(), m.params(), m.largest()});
  p.buffer_mb = c.buffer_mb;
  p.buffer_counts = c.buffer_counts;
  p.alignment = c.alignment;
  p.keep_whole = c.keep_whole;
  p.warmup = c.warmup;
  p.iters = c.iters;
  p.dtype = c.manifest_file.empty() ? std::string(to_string(c.type)) : "from the manifest";
  p.seed = c.seed;
  std::vector<std::string> engine_names;
  for (const auto e : c.engines) engine_names.emplace_back(to_string(e));
  p.engine = fmt::format("{} on GPU transports (automatic: the transport's choice), memcpy on host_shm",
                         fmt::join(engine_names, ", "));
  p.data = c.load ? fmt::format("loaded from {} (mmap)", c.manifest_file) : fmt::format("random (seed {})", c.seed);
  p.command = fmt::format("{}", fmt::join(c.argv, " "));
  return p;
}

/// The ceilings first, in the same run as the refits they are compared with, then one group of
/// rows per (transport, engine, model).
void measure(const config& c, std::ostream& out, const std::vector<std::unique_ptr<transport_path>>& paths,
             const std::vector<manifest>& models, std::vector<mapped_file>& files, std::vector<row>& rows) {
  std::uint64_t version = 1;
  std::vector<double> ceilings;
  for (const auto& path : paths) {
    progress(c, fmt::format("{}: measuring the ceiling ({})", to_string(path->kind()), path->ceiling_method()));
    ceilings.push_back(path->measure_ceiling());
    out << fmt::format("# ceiling   : {}: {:.2f} GB/s ({})\n", to_string(path->kind()), ceilings.back() / 1e9,
                       path->ceiling_method());
  }
  out << "#\n";
  write_header(out);
  for (std::size_t t = 0; t < paths.size(); ++t) {
    // host_shm copies with memcpy whatever the engine: one pass there.
    const std::size_t engines = paths[t]->kind() == transport_kind::host_shm ? 1 : c.engines.size();
    for (std::size_t e = 0; e < engines; ++e)
      for (const auto& m : models) {
        row_group g{c,
                    *paths[t],
                    paths[t]->kind(),
                    m,
                    c.engines[e],
                    c.apply_engines[e],
                    ceilings[t],
                    c.load ? &files : nullptr,
                    version};
        run_row_group(g, out, rows);
      }
  }
}

}  // namespace

int run(const config& c, std::ostream& out) {
  check_role(c);
  if (c.side == role::receiver) return run_receiver(c);
  if (c.delta_steps > 0) return run_delta(c, out);
  if (c.streamers > 0) return run_group(c, out);
  if (c.chaos) return run_chaos(c, out);

  std::vector<std::string> notes;
  const auto paths = resolve_paths(c, notes);
  std::vector<manifest> models;
  for (const auto& name : model_list(c)) models.push_back(workload(c, name));
  lay_out_models(c, models, notes);
  std::vector<mapped_file> files = load_files(c, models);
  const preamble p = make_preamble(c, paths, models, notes);

  write_preamble(out, p);
  std::vector<row> rows;
  try {
    measure(c, out, paths, models, files, rows);
  } catch (...) {
    write_footer(out, rows, /*failed=*/true);
    write_outputs(c, p, rows);
    throw;
  }
  write_footer(out, rows);
  if (c.memory) write_memory(out, rows);
  write_outputs(c, p, rows);
  return total_wrong(rows) > 0 || rows_over_budget(rows) > 0 ? 1 : 0;
}

}  // namespace refit::bench
