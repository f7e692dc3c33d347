// Command line of refit-bench.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <iostream>

#include "bench/bench.hpp"
#include "config/config.hpp"
#include "refit/error.hpp"

namespace refit::bench {
namespace {

[[noreturn]] void bad(const std::string& what) { throw error(errc::invalid_argument, "refit-bench: " + what); }

void list_models(std::ostream& out) {
  out << fmt::format("{:<16} {:>8} {:>16} {:>10} {:>14}\n", "model", "tensors", "params", "GB (bf16)", "largest (MB)");
  for (const auto& name : preset_names()) {
    const manifest m = preset(name);
    out << fmt::format("{:<16} {:>8} {:>16} {:>10.3f} {:>14.1f}\n", name, m.entries.size(), m.params(), m.bytes() / 1e9,
                       m.largest() / 1e6);
  }
}

/// The models as JSON, [{"name": ..., "tensors": [[name, dtype, shape], ...]}, ...]: what
/// `python3 -m refit.bench` streams through the Python API, so both benches run the same shapes.
void print_manifests(std::ostream& out, const std::vector<std::string>& models, dtype type) {
  out << "[";
  for (std::size_t i = 0; i < models.size(); ++i) {
    const manifest m = preset(models[i], type);
    out << (i == 0 ? "" : ",") << fmt::format("{{\"name\": \"{}\", \"tensors\": [", m.name);
    for (std::size_t k = 0; k < m.entries.size(); ++k) {
      const tensor_meta& t = m.entries[k].meta;
      out << (k == 0 ? "" : ",")
          << fmt::format("[\"{}\", \"{}\", [{}]]", t.name, to_string(t.type), fmt::join(t.shape, ", "));
    }
    out << "]}";
  }
  out << "]\n";
}

}  // namespace

const char* to_string(dest_memory d) noexcept {
  switch (d) {
    case dest_memory::torch: return "torch";
    case dest_memory::arena: return "arena";
    case dest_memory::vmm: return "vmm";
  }
  return "?";
}

namespace {

/// What the command line gives as text, before it is checked and turned into a config.
struct cli_text {
  std::string role_name = "both", dtype_name = "bf16";
  std::vector<std::string> transports{"host_shm"};
  std::vector<std::string> engines{"automatic"};
  std::size_t corrupt = 0;
  bool list = false;
  bool print_manifest = false;
  std::string layout_text = "plain";
  std::string convert_text;
  std::string receiver_devices = "same";
  std::vector<std::string> paths{"direct", "staged"};
  CLI::Option* receivers_opt = nullptr;
  CLI::Option* corrupt_opt = nullptr;
  CLI::Option* receiver_device_opt = nullptr;
  CLI::Option* timeout_opt = nullptr;
  std::string chaos_text;
};

// The options, in the order --help lists them.

/// Which side runs here and how the sides find each other.
void add_endpoint_options(CLI::App& app, config& c, cli_text& t) {
  app.add_option("--role", t.role_name,
                 "both (default: streamer here, receiver spawned as its own process), "
                 "streamer or receiver (run the sides by hand: start the receiver first; it prints the "
                 "streamer's command, with the --connect and --report endpoints to give it)")
      ->check(CLI::IsMember({"both", "streamer", "receiver"}));
  app.add_option("--bind", c.bind,
                 "receiver: endpoint to bind (ipc:///path, tcp://host:port); default: a private ipc socket");
  app.add_option("--connect", c.connect, "streamer: endpoint of a receiver started with --role receiver");
  app.add_option("--curve-public-key", c.curve.public_key,
                 "receiver/streamer by hand: this side's CURVE public key (Z85, from zmq_curve_keypair)");
  app.add_option("--curve-secret-key", c.curve.secret_key,
                 "receiver/streamer by hand: this side's CURVE secret key (Z85); the receiver needs it for "
                 "a tcp address other hosts can reach");
  app.add_option("--curve-server-key", c.curve.server_key, "streamer by hand: the receiver's CURVE public key (Z85)");
  app.add_option("--curve-allowed-client", c.curve.allowed_clients,
                 "receiver by hand: a streamer's CURVE public key that may connect (repeat; none: any that "
                 "knows the receiver's key)");
  app.add_option("--report", c.report,
                 "by hand: receiver: endpoint to bind for the streamer's checksum requests (default: "
                 "ipc://PATH.report for --bind ipc://PATH, tcp://HOST:* for tcp://HOST:PORT); "
                 "streamer: the report endpoint the receiver printed (every refit is verified through it)");
  app.add_flag("--no-verify", c.no_verify,
               "streamer by hand: run without --report; checksums are not compared (wrong = n/a)");
}

/// What is refitted: built-in models or a manifest, and their element type.
void add_model_options(CLI::App& app, config& c, cli_text& t) {
  app.add_option("--model", c.models, "built-in model(s), comma separated (see --list-models)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_flag("--list-models", t.list, "print the built-in models and exit");
  app.add_flag("--print-manifest", t.print_manifest,
               "print the --model(s) as JSON [{name, tensors: [[name, dtype, shape], ...]}] and exit "
               "(python3 -m refit.bench reads it)");
  app.add_option("--manifest", c.manifest_file,
                 "any model: a .safetensors file (its header), a sharded checkpoint's "
                 "model.safetensors.index.json, or a JSON {name: {dtype, shape}}");
  app.add_flag("--load", c.load,
               "refit the tensor data of the --manifest safetensors file(s) (mmap) instead of random data");
  app.add_option("--dtype", t.dtype_name, "element type of the built-in models' tensors")->capture_default_str();
  app.add_option("--convert", t.convert_text,
                 "the receiver registers converted destinations: bf16:fp8-block128 (2-d weights to f8_e4m3 with "
                 "128x128 block scales), bf16:fp8-tensor (per-tensor scale), bf16:fp8-channel (an f32 scale per row), "
                 "bf16:mxfp8 (OCP MXFP8: an E8M0 scale per 32 elements of a row), f32:bf16; sets --dtype to the source "
                 "dtype; --layout plain only; rows are not verified (wrong = n/a: the test suites check the bytes)");
}

/// What one row varies: transports, buffers, and the streamer's settings.
void add_sweep_options(CLI::App& app, config& c, cli_text& t) {
  app.add_option("--transport", t.transports, "host_shm, cuda_ipc, nccl, comma separated, or all (every built one)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--buffer-mb", c.buffer_mb, "buffer size(s) in MiB, comma separated: a sweep")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--buffers", c.buffer_counts, "number of buffers (ping-pong: at least 2), comma separated")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--alignment", c.alignment, "entry alignment in the buffers (power of two)")->capture_default_str();
  app.add_option("--keep-whole", c.keep_whole,
                 "1: a tensor that fits a buffer is never split over two batches (streamer_options::keep_whole); "
                 "0: batches are filled up, tensors chunked at their edges")
      ->capture_default_str();
  app.add_option("--share-tensors", c.share,
                 "cuda_ipc staged rows: 1: the receiver reads the streamer's tensors where they are (mapped through "
                 "CUDA IPC; engine +shared, floor one copy: streamer_options::share_tensors); 0: every tensor is "
                 "packed into the buffers (two copies)")
      ->capture_default_str();
  app.add_flag("--split", c.split,
               "after each row, as many refits of its smallest tensor alone (subset versions, same session): a "
               "line under the row gives the fixed cost of a refit and the rest's speed against the floor");
  app.add_flag("--announce", c.announce,
               "before each refit's new weights are made, the streamer announces it (streamer::announce): its "
               "receivers wait for it spinning instead of asleep (engine +announce)");
  app.add_option("--control-lane", c.lane,
                 "1: requests to a receiver of this host go through the shared-memory control lane it offers "
                 "(streamer_options::control_lane); 0: through ZeroMQ (engine +zmq)")
      ->capture_default_str();
  app.add_option("--nccl-twin", c.twin,
                 "nccl: 1: each session also has a twin communicator that carries the odd buffers' broadcasts "
                 "(streamer_options::nccl_twin, engine +twin); 0: one communicator")
      ->capture_default_str();
  app.add_option("--source-memory", c.vmm_sources,
                 "cuda_ipc: where the streamer's tensors live: 0 (cudamalloc) one cudaMalloc; 1 (vmm) 20 MiB VMM "
                 "chunks exportable as descriptors, as torch's expandable segments hold them (engine +vmm-src)")
      ->transform(CLI::CheckedTransformer(std::map<std::string, bool>{{"cudamalloc", false}, {"vmm", true}}))
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--stage",
         [&c](const std::string& v) {
           c.stage = v == "host" ? stage_kind::host : v == "device" ? stage_kind::device : stage_kind::none;
         },
         "the receivers stage every version (none, host, device: receiver_options::stage) and apply it as soon as "
         "it is prepared; rows report the apply's pause (pause_ms)")
      ->check(CLI::IsMember({"none", "host", "device"}));
  app.add_flag("--atomic", c.atomic,
               "engine-wide versions (streamer_options::atomic): every receiver prepares, then hears COMMIT; rows "
               "report COMMIT's round trip (commit_ms)");
  app.add_option("--dest-memory", c.dests,
                 "cuda_ipc: how the receiver allocates its weights: torch (segments as torch's caching allocator "
                 "makes them, tensor after tensor: up to 1 MiB from 2 MiB segments, up to 10 MiB from 20 MiB ones, "
                 "larger tensors one cudaMalloc each; what vLLM and SGLang hold), arena (one cudaMalloc for every "
                 "tensor; engine +arena-dst) or vmm (20 MiB VMM chunks: an engine under expandable segments; engine "
                 "+vmm-dst)")
      ->transform(CLI::CheckedTransformer(std::map<std::string, dest_memory>{
          {"torch", dest_memory::torch}, {"arena", dest_memory::arena}, {"vmm", dest_memory::vmm}}))
      ->capture_default_str();
}

/// What else a row varies: copy engines, the receivers' layout and GPUs, the path.
void add_placement_options(CLI::App& app, config& c, cli_text& t) {
  app.add_option("--engine", t.engines,
                 "GPU copy engine(s), comma separated: automatic, kernel, memcpy_batch, "
                 "memcpy_each (one row each; host_shm always uses memcpy); PACK/APPLY gives the streamer and the "
                 "receiver different ones, e.g. memcpy_batch/kernel")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--layout", t.layout_text,
                 "how the receiver holds the model: plain (one dense tensor per source "
                 "tensor), fused (an engine's layout: q/k/v into qkv_proj, gate/up into "
                 "gate_up_proj, a tied embedding also into lm_head), ep (fused, and each layer's "
                 "experts stacked into w13_weight[E, 2I, H] and w2_weight[E, H, I]), tpN (fused "
                 "with tensor parallelism of degree N, e.g. tp2, tp4: one receiver per rank, "
                 "q/k/v and gate/up split by rows, o_proj and down_proj by columns, embed_tokens "
                 "and lm_head by vocabulary rows, norms whole on every rank; host_shm runs one "
                 "rank, --rank), recorded:FILE[,FILE...] (the route table(s) refit.record wrote: one engine "
                 "tensor per recorded parameter, one receiver per file); every source tensor is "
                 "verified as it landed in its view(s)")
      ->capture_default_str();
  app.add_option("--rank", c.rank,
                 "--layout tpN (or recorded with several files): the rank host_shm's one receiver holds, or a receiver "
                 "started by hand "
                 "(and its streamer); cuda_ipc and nccl spawn every rank")
      ->capture_default_str();
  app.add_option("--receiver-devices", t.receiver_devices,
                 "cuda_ipc receivers (--layout tpN: one per rank): same (all on one GPU: --device's, or "
                 "--receiver-device's) or spread (rank k on GPU (device + k) % visible; the ceiling is then the "
                 "copy from --device's GPU to every rank's GPU, all at once); nccl receivers are always on GPUs of "
                 "their own (--receivers)")
      ->check(CLI::IsMember({"same", "spread"}))
      ->capture_default_str();
  t.receiver_device_opt = app.add_option(
      "--receiver-device", c.receiver_device,
      "--transport cuda_ipc alone: every receiver the bench spawns (the one receiver, every rank of --layout tpN, "
      "--delta's) on GPU N, and the ceiling the peer copy from --device's GPU to N (cudaMemcpyPeerAsync, same "
      "run) instead of a copy within one GPU; --role streamer: the GPU of the receiver started by hand, for the "
      "ceiling. Default: --device's GPU. Not with --receiver-devices spread or --streamers");
  app.add_flag("--nccl-share-gpus", c.nccl_share_gpus,
               "nccl: let ranks share GPUs (receiver k on GPU (device + 1 + k) % visible, even the streamer's): "
               "every bench process claims an NCCL host of its own (NCCL_HOSTID), so NCCL connects them through "
               "its network transport over loopback; its figures (and its ceiling) are that transport's, not "
               "NVLink's. For nccl on a one-GPU machine");
  app.add_flag("--memory", c.memory,
               "after the table, each row's extra memory per side: the peaks of what refit held beyond the weights "
               "(device, page-locked, pageable host), the streamer's and the largest receiver's (the JSON rows' "
               "\"memory\" has them always)");
  app.add_option("--nccl-library", c.nccl_library,
                 "nccl: the libnccl.so file this process and every rank it spawns load (REFIT_NCCL_LIBRARY; "
                 "default: the loader's libnccl.so.2, include/refit/nccl.hpp). Peers of other NCCL versions are "
                 "refused at HELLO");
  app.add_option("--path", t.paths,
                 "cuda_ipc: direct (the streamer writes into the receiver's weights, one copy), "
                 "staged (through the ping-pong buffers, two copies); nccl: direct (in place: 1 GiB "
                 "batches whatever the buffer size), staged (buffer-sized batches); comma separated: "
                 "one row each")
      ->delimiter(',')
      ->capture_default_str();
}

/// How long and where it runs, what it writes, and the hidden options of spawned processes.
void add_run_options(CLI::App& app, config& c, cli_text& t) {
  app.add_option("--warmup", c.warmup, "refits before the counted ones, per row")->capture_default_str();
  app.add_option("--iters", c.iters, "counted refits per row")->capture_default_str();
  app.add_option("--delta", c.delta_steps,
                 "STEPS delta versions (host_shm, one --model), each after an fp32 "
                 "update rounded to bf16, against whole refits of the same run")
      ->check(CLI::PositiveNumber);
  app.add_option("--streamers", c.streamers,
                 "N streamers (one per trainer rank), each holding the Shard(0) rows of every tensor, send each "
                 "version together to the receivers (one --model, the first --path): --receivers full replicas, or "
                 "the model in --layout (fused, ep: each receiver; tpN: one receiver per rank; host_shm: one "
                 "receiver, the rank --rank names), every tensor verified after every version. host_shm and "
                 "cuda_ipc run the streamers as threads of this process (cuda_ipc --receiver-devices spread: rank k "
                 "and receiver k on GPU (device + k) % visible), timed against the same copies made by memcpy or "
                 "the copy engines; nccl runs each streamer as a process with a communicator of its own (receiver "
                 "k on GPU (device + 1 + k) % visible, streamer 0 on --device, streamer r on GPU (device + R + r) % "
                 "visible; --nccl-share-gpus lets ranks share GPUs), timed against raw ncclBroadcasts of the same "
                 "shards on one communicator per rank, all at once")
      ->check(CLI::PositiveNumber);
  app.add_option("--delta-update", c.delta_update,
                 "--delta: relative size of one step's update (w += u * |w| * "
                 "U[-1, 1)); about 2 % of bf16 elements change at the default")
      ->capture_default_str();
  app.add_option("--delta-batch-mb", c.delta_batch_mb,
                 "--delta: MiB of tensors one delta batch covers (delta_options::batch_bytes); 0: max(32 MiB, "
                 "--buffer-mb)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--delta-threads", c.delta_threads,
                 "--delta: threads of the streamer's host diff and of the receiver's apply (delta_options::threads, "
                 "receiver_options::delta_threads); 0: min(hardware threads, 8)")
      ->capture_default_str();
  app.add_option("--seed", c.seed, "seed of the random tensor data")->capture_default_str();
  app.add_option("--device", c.device, "CUDA device (cuda_ipc; nccl: the streamer's, receivers on the next ones)")
      ->capture_default_str();
  t.receivers_opt = app.add_option("--receivers", c.receivers,
                                   "nccl: receiver processes, one GPU each after --device's "
                                   "(wrapping around the visible GPUs; --layout tpN: N, one per "
                                   "rank; --streamers: full replicas, on cuda_ipc too); other transports ignore it")
                        ->capture_default_str();
  t.timeout_opt = app.add_option("--timeout-ms", c.timeout_ms,
                                 "longest wait for the peer (--chaos: 1000 unless given; a failure costs one)")
                      ->capture_default_str();
  app.add_option("--chaos", t.chaos_text,
                 "a fleet that changes while it trains (host_shm): --receivers receiver processes served with "
                 "on_receiver_failure=drop, and at each of --iters versions (after --warmup quiet ones), with "
                 "the probabilities of SPEC = kill=P,add=P,remove=P,back=rejoin|add (any of them; a bare P is "
                 "kill=P), drawn from --seed: a served receiver SIGKILLed at a random tensor of the version "
                 "and restarted on its endpoint after it (back=rejoin: the streamer's retries take it back; "
                 "back=add: add_receiver()), a new receiver added, one removed. One row per transport: versions "
                 "done, refit time without and with a failure, failover (death to the survivors committed) and "
                 "join (ready to first commit) times, every receiver's every commit verified (bench/README.md)");
  app.add_option("--json", c.json_file, "write every row and the preamble as JSON to FILE");
  app.add_option("--plot", c.plot_file, "write throughput vs buffer size as an SVG to FILE");
  app.add_flag("-q,--quiet", c.quiet, "no progress lines on stderr");
  // Hidden: for the tests and for the spawned receiver.
  t.corrupt_opt =
      app.add_option("--corrupt-byte", t.corrupt, "receiver: corrupt tensor N after every commit")->group("");
  app.add_flag("--spawned", c.spawned, "receiver started by refit-bench: exit when stdin closes")->group("");
  app.add_option("--receiver-exe", c.receiver_exe, "the binary the streamer spawns as receiver")->group("");
  app.add_option("--nccl-ceiling", c.nccl_ceiling_id, "receiver: be a rank of the nccl ceiling (hex ncclUniqueId)")
      ->group("");
  app.add_option("--nccl-rank", c.nccl_rank, "nccl ceiling: this rank")->group("");
  app.add_option("--nccl-ranks", c.nccl_ranks, "nccl ceiling: number of ranks")->group("");
}

/// --transport: names, or "all" (every built one); "all" runs nccl only where it can (2 GPUs or
/// more: checked at run time), named it must.
void parse_transports(config& c, const std::vector<std::string>& transports) {
  c.transports.clear();
  bool nccl_named = false;
  for (const auto& name : transports) {
    if (name == "all") {
      for (const auto k : built_transports())
        if (std::find(c.transports.begin(), c.transports.end(), k) == c.transports.end()) c.transports.push_back(k);
      continue;
    }
    const auto k = parse_transport(name);
    if (!k) bad(fmt::format("--transport {}: unknown (host_shm, cuda_ipc, nccl or all)", name));
    nccl_named |= *k == transport_kind::nccl;
    if (std::find(c.transports.begin(), c.transports.end(), *k) == c.transports.end()) c.transports.push_back(*k);
  }
  c.nccl_optional = !nccl_named;
}

/// Receivers, buffers, iterations and models: each in range.
void check_sizes(const config& c) {
  if (c.receivers < 1) bad("--receivers must be at least 1");
  if (c.transports.empty()) bad("--transport: none given");
  if (c.alignment == 0 || !std::has_single_bit(c.alignment))
    bad(fmt::format("--alignment {}: must be a power of two", c.alignment));
  if (c.buffer_mb.empty()) bad("--buffer-mb: none given");
  for (const double mb : c.buffer_mb)
    if (!(mb > 0) || !std::isfinite(mb) || mb * (1 << 20) < static_cast<double>(c.alignment))
      bad(fmt::format("--buffer-mb {}: each buffer must hold at least the alignment ({} bytes)", mb, c.alignment));
  if (c.buffer_counts.empty()) bad("--buffers: none given");
  for (const auto n : c.buffer_counts)
    if (n < 2) bad(fmt::format("--buffers {}: refit needs at least 2 buffers (ping-pong)", n));
  if (c.iters < 1) bad("--iters must be at least 1");
  if (c.warmup < 0) bad("--warmup must be 0 or more");
  if (c.manifest_file.empty()) {
    if (c.models.empty()) bad("--model: none given");
    for (const auto& m : c.models) (void)preset(m, c.type);  // an unknown name fails here, with the list
  }
  if (c.load && c.manifest_file.empty()) bad("--load needs --manifest FILE.safetensors");
}

/// --engine: names, each "pack" or "pack/apply" (the streamer and the receiver different ones).
void parse_engines(config& c, const std::vector<std::string>& engines) {
  c.engines.clear();
  c.apply_engines.clear();
  const auto engine_named = [&](std::string_view name) {
    const auto e = parse_copy_engine(name == "auto" ? "automatic" : name);
    if (!e) bad(fmt::format("--engine {}: unknown (automatic, kernel, memcpy_batch, memcpy_each)", name));
    return *e;
  };
  for (const auto& name : engines) {
    const auto slash = name.find('/');
    const copy_engine pack = engine_named(std::string_view(name).substr(0, slash));
    const copy_engine apply =
        slash == std::string::npos ? pack : engine_named(std::string_view(name).substr(slash + 1));
    bool seen = false;
    for (std::size_t i = 0; i < c.engines.size(); ++i) seen |= c.engines[i] == pack && c.apply_engines[i] == apply;
    if (!seen) {
      c.engines.push_back(pack);
      c.apply_engines.push_back(apply);
    }
  }
  if (c.engines.empty()) bad("--engine: none given");
}

/// --path: direct, staged.
void parse_paths(config& c, const std::vector<std::string>& paths) {
  c.direct.clear();
  for (const auto& name : paths) {
    if (name != "direct" && name != "staged") bad(fmt::format("--path {}: unknown (direct, staged)", name));
    const bool d = name == "direct";
    if (std::find(c.direct.begin(), c.direct.end(), d) == c.direct.end()) c.direct.push_back(d);
  }
  if (c.direct.empty()) bad("--path: none given");
}

/// --layout, --rank and --receiver-devices: a tensor-parallel layout runs one receiver per rank.
void parse_layout_options(config& c, const cli_text& t) {
  const auto layout = parse_layout(t.layout_text);
  if (!layout)
    bad(
        fmt::format("--layout {}: unknown (plain, fused, ep, tpN for N from 2 to 64: tp2, tp4, ..., "
                    "recorded:FILE[,FILE...] for route tables of refit.record)",
                    t.layout_text));
  c.layout = *layout;
  c.spread_receivers = t.receiver_devices == "spread";
  if (c.layout.tp > 1) {
    if (c.rank < 0 || c.rank >= c.layout.tp)
      bad(fmt::format("--rank {}: out of range for --layout {} (ranks 0 to {})", c.rank, t.layout_text,
                      c.layout.tp - 1));
    // One nccl receiver per rank.
    if (*t.receivers_opt && c.receivers != static_cast<std::size_t>(c.layout.tp))
      bad(
          fmt::format("--receivers {} with --layout {}: tensor parallelism runs one receiver per rank ({}); leave "
                      "--receivers out",
                      c.receivers, t.layout_text, c.layout.tp));
    c.receivers = static_cast<std::size_t>(c.layout.tp);
  } else if (c.rank != 0) {
    bad(fmt::format("--rank {} is for --layout tpN or recorded with several files (a tensor-parallel rank)", c.rank));
  }
}

/// --receiver-device N: one GPU for the cuda_ipc receivers the bench spawns (or, by hand, for the
/// streamer's ceiling); refused where another rule places the receivers.
void check_receiver_device(const config& c, const cli_text& t) {
  if (!*t.receiver_device_opt) return;
  const int n = c.receiver_device;
  if (n < 0) bad(fmt::format("--receiver-device {}: a GPU index, 0 or more", n));
  if (c.side == role::receiver)
    bad(fmt::format("--receiver-device {} with --role receiver: a receiver runs on its --device", n));
  if (c.transports != std::vector<transport_kind>{transport_kind::cuda_ipc})
    bad(
        fmt::format("--receiver-device {} with --transport {}: only with --transport cuda_ipc alone (nccl places "
                    "its receivers on GPUs of their own, host_shm has no GPU)",
                    n, fmt::join(t.transports, ",")));
  if (c.spread_receivers)
    bad(
        fmt::format("--receiver-device {} with --receiver-devices spread: every receiver on GPU {}, or rank k on "
                    "GPU (device + k) % visible; give one of them",
                    n, n));
  if (c.streamers > 0)
    bad(
        fmt::format("--receiver-device {} with --streamers {}: the group bench places its receivers itself "
                    "(--receiver-devices spread spreads them); leave --receiver-device out",
                    n, c.streamers));
}

/// --chaos: its spec, and what it runs with (both sides here, one model, no other mode).
void check_chaos(config& c, const cli_text& t) {
  c.chaos = parse_chaos(t.chaos_text);
  if (c.side != role::both) bad("--chaos spawns its receivers: leave --role out");
  if (c.delta_steps > 0 || c.streamers > 0) bad("--chaos runs alone: not with --delta or --streamers");
  if (c.models.size() != 1 && c.manifest_file.empty()) bad("--chaos: one --model");
  if (c.layout != layout_kind::plain || !t.convert_text.empty())
    bad("--chaos: --layout plain without --convert (every receiver holds the whole model)");
  if (!*t.timeout_opt) c.timeout_ms = 1000;
}

dtype dtype_named(const std::string& name) {
  const auto t = parse_dtype(name);
  if (!t) bad(fmt::format("--dtype {}: unknown (bf16, f16, f32, f8_e4m3, ...)", name));
  return *t;
}

}  // namespace

std::optional<config> parse_args(int argc, const char* const* argv, int& exit_code) {
  config c;
  for (int i = 0; i < argc; ++i) c.argv.emplace_back(argv[i]);
  CLI::App app{
      "refit-bench: measures refit throughput (streamer → receiver) on real model shapes, "
      "against the hardware's own copy bandwidth measured in the same run."};
  app.name("refit-bench");
  cli_text t;
  add_endpoint_options(app, c, t);
  add_model_options(app, c, t);
  add_sweep_options(app, c, t);
  add_placement_options(app, c, t);
  add_run_options(app, c, t);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    exit_code = app.exit(e);
    return std::nullopt;
  }
  if (t.list) {
    list_models(std::cout);
    exit_code = 0;
    return std::nullopt;
  }
  if (t.print_manifest) {
    print_manifests(std::cout, c.models, dtype_named(t.dtype_name));
    exit_code = 0;
    return std::nullopt;
  }
  if (*t.corrupt_opt) c.corrupt_tensor = t.corrupt;
  c.side = t.role_name == "receiver" ? role::receiver : t.role_name == "streamer" ? role::streamer : role::both;

  c.type = dtype_named(t.dtype_name);
  parse_transports(c, t.transports);
  check_sizes(c);
  check_role(c);
  parse_engines(c, t.engines);
  parse_paths(c, t.paths);
  parse_layout_options(c, t);
  check_receiver_device(c, t);
  if (!t.chaos_text.empty()) check_chaos(c, t);
  if (!t.convert_text.empty()) {
    c.convert = parse_conversion(t.convert_text);
    if (!c.convert)
      bad(fmt::format(
          "--convert {}: unknown (bf16:fp8-block128, bf16:fp8-tensor, bf16:fp8-channel, bf16:mxfp8, f32:bf16)",
          t.convert_text));
    if (c.layout != layout_kind::plain)
      bad(fmt::format("--convert with --layout {}: only --layout plain", t.convert_text));
    if (t.dtype_name != "bf16" && dtype_named(t.dtype_name) != c.convert->from)
      bad(fmt::format("--convert {} converts {} sources; --dtype {} disagrees", t.convert_text,
                      to_string(c.convert->from), t.dtype_name));
    c.type = c.convert->from;
  }
  return c;
}

void check_role(const config& c) {
  switch (c.side) {
    case role::streamer:
      if (c.connect.empty()) bad("--role streamer needs --connect ENDPOINT (the receiver prints it when it starts)");
      if (c.report.empty() && !c.no_verify)
        bad("--role streamer needs --report ENDPOINT, the report endpoint the receiver printed (\"report\" in its "
            "ready "
            "line and its banner), to verify every refit; or --no-verify to run unverified");
      if (!c.report.empty() && c.no_verify) bad("--role streamer: --report and --no-verify exclude each other");
      break;
    case role::receiver:
      if (c.no_verify) bad("--no-verify is for --role streamer (the receiver always answers on its report endpoint)");
      break;
    case role::both:
      if (!c.report.empty() || c.no_verify)
        bad("--report and --no-verify are for the sides run by hand (--role streamer / receiver); a spawned receiver "
            "is "
            "always verified");
      break;
  }
}

std::vector<std::string> ceiling_args(const config& c, const std::string& id_hex, int rank, int nranks, int device) {
  std::vector<std::string> a{"--role",         "receiver",
                             "--transport",    "nccl",
                             "--device",       std::to_string(device),
                             "--timeout-ms",   std::to_string(c.timeout_ms),
                             "--nccl-ceiling", id_hex,
                             "--nccl-rank",    std::to_string(rank),
                             "--nccl-ranks",   std::to_string(nranks),
                             "--spawned"};
  if (c.quiet) a.emplace_back("--quiet");
  return a;
}

std::vector<std::string> receiver_args(const config& c, transport_kind t, const std::string& model,
                                       const std::string& endpoint, copy_engine engine, std::optional<int> device,
                                       std::optional<int> rank) {
  std::vector<std::string> a{"--role",       "receiver",
                             "--bind",       endpoint,
                             "--transport",  std::string(to_string(t)),
                             "--engine",     std::string(to_string(engine)),
                             "--device",     std::to_string(device.value_or(c.device)),
                             "--timeout-ms", std::to_string(c.timeout_ms),
                             "--spawned"};
  if (!c.manifest_file.empty()) {
    a.insert(a.end(), {"--manifest", c.manifest_file, "--dtype", std::string(to_string(c.type))});
  } else {
    a.insert(a.end(), {"--model", model, "--dtype", std::string(to_string(c.type))});
  }
  if (c.layout != layout_kind::plain) a.insert(a.end(), {"--layout", layout_name(c.layout)});
  if (c.layout.tp > 1) a.insert(a.end(), {"--rank", std::to_string(rank.value_or(c.rank))});
  if (c.corrupt_tensor) a.insert(a.end(), {"--corrupt-byte", std::to_string(*c.corrupt_tensor)});
  if (c.convert) a.insert(a.end(), {"--convert", c.convert->name});
  // The weights are the receiver's to allocate.
  if (c.dests != dest_memory::torch) a.insert(a.end(), {"--dest-memory", to_string(c.dests)});
  if (c.stage != stage_kind::none) a.insert(a.end(), {std::string("--stage"), std::string(to_string(c.stage))});
  if (c.quiet) a.emplace_back("--quiet");
  return a;
}

// --nccl-share-gpus: NCCL refuses two ranks of one communicator on one GPU of one host, and takes
// the host's identity from NCCL_HOSTID. This process and every one it spawns or forks (which inherit
// REFIT_BENCH_NCCL_OWN_HOST) each claim a host of their own.
void claim_nccl_host(bool share) {
  if (share) ::setenv("REFIT_BENCH_NCCL_OWN_HOST", "1", 1);
  if (std::getenv("REFIT_BENCH_NCCL_OWN_HOST") == nullptr) return;
  ::setenv("NCCL_HOSTID", fmt::format("refit-bench-{}", ::getpid()).c_str(), 1);
}

int bench_main(int argc, const char* const* argv) {
  // NVLink SHARP (NVLS) stays off unless the caller says otherwise: the GPU machines require it,
  // and the spawned receivers inherit the environment.
  ::setenv("NCCL_NVLS_ENABLE", "0", 0);
  // Spawned ranks answer on their stdout, so NCCL's own log (NCCL_DEBUG, to stdout unless told
  // otherwise) goes to stderr, where the caller sees it.
  if (std::getenv("NCCL_DEBUG") != nullptr) ::setenv("NCCL_DEBUG_FILE", "/dev/stderr", 0);
  try {
    int code = 0;
    const auto c = parse_args(argc, argv, code);
    if (!c) return code;
    claim_nccl_host(c->nccl_share_gpus);
    if (!c->nccl_library.empty()) ::setenv("REFIT_NCCL_LIBRARY", c->nccl_library.c_str(), 1);
    return run(*c, std::cout);
  } catch (const error& e) {
    std::cout.flush();
    std::string_view what = e.what();
    if (what.starts_with("refit-bench: ")) what.remove_prefix(13);
    std::cerr << "refit-bench: error (" << to_string(e.code()) << "): " << what << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "refit-bench: error: " << e.what() << std::endl;
    return 2;
  }
}

}  // namespace refit::bench
