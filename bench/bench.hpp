// refit-bench — shared declarations of the bench library (refit_bench_core). bench/README.md says
// which file does what; in short, from the bottom up:
//   workloads    presets.cpp (built-in models), manifest.cpp (safetensors / JSON manifests),
//                layout.cpp and layout_recorded.cpp (how a receiver holds the model), data.cpp
//   transports   runner_<transport>.cpp (where tensors live for one transport path, its ceiling),
//                ceiling.cpp (the hardware's own copy bandwidth)
//   processes    spawn.hpp / spawn.cpp (every process the bench starts, forks and reaps)
//   roles        role_receiver.cpp, role_streamer.cpp, role_report.hpp / role_report.cpp
//   runs         run.cpp (the usual table), group*.cpp (--streamers), delta.cpp (--delta)
//   output       report.cpp (table, JSON, SVG), cli.cpp (options)
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "refit/model.hpp"
#include "refit/receiver.hpp"
#include "bench/role_report.hpp"
#include "bench/spawn.hpp"
#include "refit/options.hpp"

namespace refit {
class receiver;
}  // namespace refit

namespace refit::bench {

// ---------------------------------------------------------------- workloads

/// One tensor of a workload. `file`/`offset` locate its bytes in a safetensors file (--load);
/// file < 0 for presets and JSON manifests.
struct manifest_entry {
  tensor_meta meta;
  int file = -1;
  std::uint64_t offset = 0;  ///< absolute byte offset of the data in files[file]
};

/// A model: named tensors in the order they are streamed.
struct manifest {
  std::string name;
  std::vector<manifest_entry> entries;
  std::vector<std::string> files;  ///< safetensors files the entries' data lives in
  /// Elements per attention head when known (the built-in models): --layout tpN then splits q and
  /// kv heads, not only rows. 0: unknown (a manifest file), rows only.
  std::int64_t head_dim = 0;

  [[nodiscard]] std::uint64_t bytes() const;
  [[nodiscard]] std::uint64_t params() const;   ///< elements
  [[nodiscard]] std::uint64_t largest() const;  ///< bytes of the largest tensor
};

/// Names of the built-in models.
std::vector<std::string> preset_names();
/// A built-in model with real parameter names and shapes (from its published config).
/// Throws refit::error(invalid_argument) naming the known presets for an unknown name.
manifest preset(std::string_view name, dtype type = dtype::bf16);

/// Parses the header of a safetensors file held in memory (`data`, `size` bytes: at least the
/// 8-byte length and the header; `file_size` is the size of the whole file, for offset checks).
/// `file` names the file in errors. Entries come in data-offset order.
/// Throws refit::error(invalid_argument) "manifest FILE: ...: what is wrong".
manifest parse_safetensors(const void* data, std::uint64_t size, std::uint64_t file_size, const std::string& file);
/// Parses a JSON manifest {name: {dtype, shape}} (dtype optional: `fallback`), or a sharded
/// checkpoint's "model.safetensors.index.json" ({"weight_map": {name: shard}}: the shards'
/// headers, next to the index, are read). Entries keep the file's order.
manifest parse_json_manifest(std::string_view text, const std::string& file, dtype fallback);
/// Reads a manifest file: safetensors (by extension ".safetensors", or when it does not start
/// with '{') or JSON. Throws refit::error(invalid_argument / io) naming the file.
manifest load_manifest(const std::string& path, dtype fallback = dtype::bf16);

/// A read-only view of a file, mapped private and writable (copy on write: the bench perturbs a
/// byte per tensor between refits without touching the file).
class mapped_file {
 public:
  explicit mapped_file(const std::string& path);  ///< throws refit::error(io)
  ~mapped_file();
  mapped_file(mapped_file&& other) noexcept;
  mapped_file& operator=(mapped_file&& other) noexcept;
  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;

  [[nodiscard]] std::byte* data() const noexcept { return data_; }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }

 private:
  std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
};

// ---------------------------------------------------------------- engine layouts (--layout)

/// How the receiver holds the model (--layout): `plain`, one dense tensor per source tensor
/// (what the streamer sends); `fused`, an engine's layout: per layer q/k/v in one `qkv_proj`
/// (rows stacked q, k, v; weights and biases alike) and gate/up in one `gate_up_proj`, and a
/// tied embedding (model.embed_tokens.weight without lm_head.weight) also landing in an engine
/// `lm_head.weight`; `ep`, fused plus every layer's experts stacked into `w13_weight[E, 2I, H]`
/// (expert e's gate rows then its up rows) and `w2_weight[E, H, I]` (its down), as a
/// mixture-of-experts engine holds them.
/// `recorded` (`--layout recorded:FILE[,FILE...]`): the engine tensors and routes of a route table
/// refit.record() wrote (RouteTable.to_json()), one receiver (rank) per file.
enum class layout_kind : std::uint8_t { plain, fused, ep, recorded };

/// How a cuda_ipc receiver allocates its weights (--dest-memory). bench/probes/dest_alloc.cu measures why it matters:
/// the copy kernel writes a 16 GB cudaMalloc mapped from another process at ~0.81 of the D2D floor on an H200, and
/// per-tensor allocations (or torch's segments) at ~0.91.
enum class dest_memory : std::uint8_t {
  torch,  ///< segments as torch's caching allocator makes them, tensor after tensor: what vLLM and SGLang hold
  arena,  ///< one cudaMalloc for every tensor, each its own aligned range (engine +arena-dst)
  vmm,    ///< 20 MiB VMM chunks: an engine under expandable segments, written through descriptors (+vmm-dst)
};
[[nodiscard]] const char* to_string(dest_memory d) noexcept;

/// "plain", "fused", "ep".
std::string_view layout_name(layout_kind k) noexcept;

/// A layout with its tensor-parallel degree: `tp` ranks (1: none). tpN (`--layout tpN`) is fused
/// sharded over N ranks, each receiver one rank r of them: column-parallel q/k/v (q and kv heads
/// split evenly; the rank's q, k and v rows stacked into its qkv_proj, biases alike) and gate/up
/// (into its gate_up_proj; Mixtral's w1/w3 each alone) take rows source_slice{0, r*n, n};
/// row-parallel o_proj and down_proj (w2) take columns source_slice{1, r*n, n} into a dense local
/// [out, in/N]; embed_tokens and lm_head (a tied one too) are vocab-parallel (rows); every other
/// tensor (norms, routers) is replicated whole on every rank.
struct layout_spec {
  layout_kind kind = layout_kind::plain;
  int tp = 1;
  std::vector<std::string> files;  ///< recorded: the route tables, one per rank (tp of them)
  layout_spec() = default;
  layout_spec(layout_kind k, int degree = 1) : kind(k), tp(degree) {}  // NOLINT: a kind is a layout of degree 1
  friend bool operator==(const layout_spec&, const layout_spec&) = default;
};

/// "plain", "fused", "ep", "tpN", "recorded:FILE[,FILE...]".
std::string layout_name(const layout_spec& l);
/// nullopt for an unknown name; "tpN" for N in 2..64; "recorded:FILE[,FILE...]" (1 to 64 files).
std::optional<layout_spec> parse_layout(std::string_view name) noexcept;

/// Row-major strides (elements) of a dense tensor of this shape.
std::vector<std::int64_t> dense_strides(const std::vector<std::int64_t>& shape);

/// The bytes of a source tensor that one of its slices takes, in its row-major storage: `rows`
/// runs of `width` bytes, `pitch` apart, the first at `offset` (one run for a whole tensor or a
/// slice of dimension 0; a slice of dimension 1 of [R, C] is R runs).
struct byte_region {
  std::uint64_t offset = 0;
  std::uint64_t width = 0;
  std::uint64_t pitch = 0;
  std::uint64_t rows = 1;
  [[nodiscard]] std::uint64_t bytes() const noexcept { return width * rows; }
  [[nodiscard]] bool contiguous() const noexcept { return rows <= 1 || pitch == width; }
};

/// The region `slice` takes of `t` (all of it without one).
byte_region region_of(const tensor_meta& t, const std::optional<source_slice>& slice);
/// Where byte `offset` of the tensor sits among the region's bytes, gathered in order (what the
/// receiver's view holds); nullopt when the region does not take it.
std::optional<std::uint64_t> region_position(const byte_region& r, std::uint64_t offset) noexcept;

/// Where one source tensor lands: a view of an engine tensor, which takes all of its source or
/// a slice of it (tpN). Every view the layouts make is a contiguous byte range of its engine
/// tensor (row ranges of row-major tensors: narrows on dimension 0, one expert's slot, or a
/// whole local shard), `bytes` long from `offset`.
struct layout_view {
  std::size_t source = 0;             ///< index in the manifest
  std::size_t tensor = 0;             ///< index of the engine tensor
  std::uint64_t offset = 0;           ///< first byte of the view in the engine tensor
  std::uint64_t bytes = 0;            ///< the bytes that land (the source's, or its slice's)
  std::vector<std::int64_t> shape;    ///< of the view (the source's, or its slice's)
  std::vector<std::int64_t> strides;  ///< of the view, in elements (the engine tensor's along those dimensions)
  std::optional<source_slice> slice;  ///< the part of the source it takes; none: all of it
};

/// The receiver's model in a layout: its engine tensors (a manifest of their own, allocated like
/// any destinations: transport_path::destinations) and the views the source tensors land in.
struct engine_layout {
  layout_kind kind = layout_kind::plain;
  int tp = 1;                                       ///< tensor-parallel degree
  int rank = 0;                                     ///< the rank this layout holds (of tp)
  manifest tensors;                                 ///< the engine tensors, in the order first written
  std::vector<layout_view> views;                   ///< every destination
  std::vector<std::vector<std::size_t>> of_source;  ///< indices into views, per source (2 for a tied one)
  /// Per source: the part every one of its views takes (none: all of it).
  std::vector<std::optional<source_slice>> slices;

  /// The bytes this rank needs: every source's slice (or all of it) once.
  [[nodiscard]] std::uint64_t needed_bytes(const manifest& m) const;
};

/// The layout `spec` of `m`, rank `rank` of spec.tp. q/k/v (gate/up) of a layer are fused only
/// when all are there, of one dtype and alike but for dimension 0; other tensors stay dense.
/// Throws refit::error(invalid_argument) for `ep` on a model without experts
/// (PREFIX.experts.E.gate_proj/up_proj/down_proj.weight, or Mixtral's w1/w3/w2) or whose experts
/// do not stack (missing, or of different shapes or dtypes), naming them; for tpN, a rank out of
/// range or a sharded size (rows, columns, q or kv heads, vocabulary) that does not divide by N,
/// naming the tensor.
/// For `recorded`, the table spec.files[rank] (read here): its parameters are the engine tensors and
/// every route a view; refused (naming the file) when a source is unrecorded, when the model lacks a
/// source of the table or its dtype or shape differs, when a route's view does not fit its parameter
/// or is not a contiguous run of it, or when a source's routes take different slices of it.
engine_layout make_layout(const manifest& m, const layout_spec& spec, int rank = 0);
/// make_layout for a route table given as JSON text; `file` names it in errors.
engine_layout recorded_layout(const manifest& m, std::string_view text, const std::string& file, int rank = 0,
                              int tp = 1);

/// The checksum the receiver reports for source i: copy::checksum of its bytes as they landed
/// in its view; for a source with several views (a tied one) the common checksum when they all
/// agree, otherwise a value unlike every one of them (so that a wrong byte in any view shows up
/// as a wrong checksum, whichever view holds it).
std::uint64_t fold_view_checksums(const std::vector<std::uint64_t>& sums) noexcept;

// ---------------------------------------------------------------- tensor memory per transport

/// The tensors of a workload on one side, in the memory a transport path uses (host memory for
/// host_shm, device memory for cuda_ipc).
class tensor_memory {
 public:
  virtual ~tensor_memory() = default;
  [[nodiscard]] virtual device where() const noexcept = 0;
  [[nodiscard]] virtual std::byte* data(std::size_t i) const noexcept = 0;
  /// Flips the bits of `mask` in byte `offset` of tensor i; returns the old byte.
  virtual std::uint8_t flip(std::size_t i, std::uint64_t offset, std::uint8_t mask) = 0;
  /// copy::checksum of tensor i.
  [[nodiscard]] virtual std::uint64_t checksum(std::size_t i) const = 0;
  /// copy::checksum of `bytes` bytes of tensor i from byte `offset` (a view of an engine tensor).
  [[nodiscard]] virtual std::uint64_t checksum(std::size_t i, std::uint64_t offset, std::uint64_t bytes) const = 0;
  /// copy::checksum of the bytes of region `r` of tensor i gathered in order (a source slice, as
  /// the receiver's view holds it): strided runs are first copied into a scratch buffer.
  [[nodiscard]] virtual std::uint64_t checksum(std::size_t i, const byte_region& r) const = 0;

 protected:
  /// Throws refit::error(invalid_argument) unless `bytes` bytes from byte `offset` lie in a
  /// `size`-byte tensor.
  static void check_bytes(std::uint64_t size, std::uint64_t offset, std::uint64_t bytes);
  /// The same for every run of region `r`.
  static void check_region(std::uint64_t size, const byte_region& r);
};

/// How tensors are allocated and filled, and the ceiling measured, for one transport.
class transport_path {
 public:
  virtual ~transport_path() = default;
  [[nodiscard]] virtual transport_kind kind() const noexcept = 0;
  /// "cpu" or the device's name.
  [[nodiscard]] virtual std::string describe_device() const = 0;
  /// Streamer side: tensors filled with deterministic random bytes (seed), or with the data of
  /// the manifest's files when `files` is not empty (--load).
  virtual std::unique_ptr<tensor_memory> sources(const manifest& m, std::uint64_t seed,
                                                 const std::vector<mapped_file>* files) = 0;
  /// Receiver side: destination tensors (zeroed).
  virtual std::unique_ptr<tensor_memory> destinations(const manifest& m) = 0;
  /// Payload bandwidth (bytes/s) of the copy a refit through this path is bound by.
  virtual double measure_ceiling() = 0;
  /// What measure_ceiling() measures, for the preamble.
  [[nodiscard]] virtual std::string ceiling_method() const = 0;
};

std::unique_ptr<transport_path> make_host_shm_path();
/// Tensors on GPU `device`; its ceiling follows `receiver_gpus`, the GPUs of the receivers its
/// streamer serves (copy_ceiling(); none: one on `device`). Throws refit::error(invalid_argument)
/// in a build without CUDA, or when `device` is not a visible GPU.
std::unique_ptr<transport_path> make_cuda_ipc_path(int device, bool vmm_sources = false,
                                                   dest_memory dests = dest_memory::torch,
                                                   std::vector<int> receiver_gpus = {});
/// --convert: the receiver registers converted destinations (lib/README.md, Conversion): "bf16:fp8-block128",
/// "bf16:fp8-tensor", "f32:bf16".
struct conversion_spec {
  std::string name;
  dtype from = dtype::bf16;
  dtype to = dtype::f8_e4m3;
  quant q = quant::block128;
};
/// nullopt for an unknown name.
std::optional<conversion_spec> parse_conversion(std::string_view name);

/// --chaos SPEC (bench/chaos.cpp): what happens to the fleet at each version, each a probability
/// per version drawn from --seed's generator: `kill` a served receiver (SIGKILL at a random tensor
/// of the version, then a new process on its endpoint once the version is done), `add` a new
/// receiver, `remove` one. `back`: how a restarted receiver is served again, by the streamer's
/// retries (rejoin) or by add_receiver() (add).
struct chaos_spec {
  double kill = 0, add = 0, remove = 0;
  bool rejoin = true;
  std::string text;  ///< as given
};
/// "kill=P,add=P,remove=P,back=rejoin|add" (any subset, in any order; P in [0, 1]) or a bare
/// number P (kill=P). Throws refit::error(invalid_argument) naming the part it cannot read.
chaos_spec parse_chaos(std::string_view text);
/// Where a converted destination of source `meta` keeps its scales: `offset` bytes into the
/// destination memory allocated for the source (which is larger than the converted bytes); 0 for
/// no scale. nullopt when the tensor is sent as it is (another dtype; fp8 of fewer than 2
/// dimensions; scales that would not fit behind the codes).
std::optional<std::uint64_t> converted_scale_offset(const conversion_spec& s, const tensor_meta& meta);
/// Bytes the receiver gets of `meta` under `s` (converted bytes and scales, or the source's).
std::uint64_t converted_bytes(const conversion_spec& s, const tensor_meta& meta);

struct config;
/// Device tensors like cuda_ipc; the streamer's on c.device, receiver k's on receiver_device(). On the
/// streamer side its ceiling spawns c.receivers helper processes and times a raw ncclBroadcast among
/// them (see runner_nccl.cpp). Throws refit::error(invalid_argument) in a build without NCCL, and
/// on the streamer side when fewer than 2 GPUs are visible or c.receivers does not fit on them.
std::unique_ptr<transport_path> make_nccl_path(const config& c);
/// Registers every source tensor's view(s) of `layout`'s engine tensors, held in `dest`, as
/// parameters of `r` (dense ones for plain, converted ones for --convert).
void register_views(receiver& r, const config& c, const manifest& m, const engine_layout& layout, tensor_memory& dest);
/// --corrupt-byte N: deliberate damage after a commit, to prove the verification catches it: flips a
/// bit of the first byte of the last view of source N (the next one with bytes); nothing without it.
void corrupt_after_commit(const config& c, const manifest& m, const engine_layout& layout, tensor_memory& dest);
/// What a receiver reports of each source after a commit: the checksum of its bytes as they landed in
/// its view(s) of `dest` (fold_view_checksums), one per source of m.
std::vector<std::uint64_t> view_checksums(const manifest& m, const engine_layout& layout, const tensor_memory& dest);
/// The path of `kind` for the side `c` describes (c.device, c.receivers, ...).
std::unique_ptr<transport_path> make_path(transport_kind kind, const config& c);
/// Transports this build of the bench can run (nccl included when built, whatever the GPU count).
std::vector<transport_kind> built_transports();
/// CUDA devices visible to this process; 0 without CUDA or without a device.
int visible_gpus() noexcept;
/// --nccl-share-gpus (`share`), or a process spawned or forked by one: claims an NCCL host of this
/// process's own (NCCL_HOSTID), so that ranks on one GPU may join one communicator.
void claim_nccl_host(bool share);
/// The GPU of nccl receiver k (0-based): the next GPUs after the streamer's, wrapping around.
int receiver_device(int streamer_device, std::size_t k, int visible) noexcept;
/// Receiver processes the streamer spawns for transport t: one per rank of --layout tpN over
/// cuda_ipc and nccl, --receivers over nccl otherwise, one else.
std::size_t receiver_processes(const config& c, transport_kind t) noexcept;
/// The GPU of receiver k for transport t: nccl as receiver_device(); cuda_ipc --receiver-device's
/// when given, else the streamer's (--receiver-devices same) or (device + k) % visible (spread);
/// host_shm c.device.
int receiver_gpu(const config& c, transport_kind t, std::size_t k, int visible) noexcept;
/// Where a cuda_ipc refit's bytes go: from the streamer's GPU to each receiver's, one entry per
/// receiver (none: one receiver on the streamer's GPU). Its ceiling follows it (copy_ceiling()).
struct gpu_placement {
  int streamer = 0;
  std::vector<int> receivers;
  /// Every receiver on the streamer's GPU.
  [[nodiscard]] bool local() const noexcept;
  friend bool operator==(const gpu_placement&, const gpu_placement&) = default;
};
/// The cuda_ipc placement of the streamer side of `c` with `visible` GPUs: receiver_gpu() of every
/// receiver it spawns (receiver_processes()), or of the one receiver started by hand (--role
/// streamer). Throws refit::error(invalid_argument) when --receiver-device names a GPU that is not
/// visible ("--receiver-device 1 but 1 CUDA device is visible").
gpu_placement cuda_ipc_placement(const config& c, int visible);
/// Lowercase hex of `n` bytes, and back (nullopt for odd length or a non-hex character).
std::string to_hex(const void* data, std::size_t n);
std::optional<std::string> from_hex(std::string_view hex);

// ---------------------------------------------------------------- raw NCCL broadcast (the nccl ceiling)

/// A fresh ncclUniqueId as hex (to_hex). Throws refit::error(nccl / invalid_argument without NCCL).
std::string nccl_unique_id_hex();
/// One rank of the nccl ceiling: joins the communicator `id_hex` as `rank` of `nranks` on `device`,
/// broadcasts nccl_ceiling_bytes from rank 0 (warm-up, then nccl_ceiling_reps timed ones, each
/// behind a one-element all-reduce so that every rank starts together), then calls `done` with the
/// communicator still alive and aborts it. `watch` is called while waiting and may throw to give up.
/// Every wait ends within `timeout` (errc::timeout). Returns, on rank 0, the payload bandwidth
/// (bytes/s) of the median broadcast timed with CUDA events, and stores the best in *best; 0 elsewhere.
double nccl_ceiling_rank(const std::string& id_hex, int rank, int nranks, int device, std::chrono::milliseconds timeout,
                         const std::function<void()>& watch, const std::function<void()>& done, double* best = nullptr);
/// One communicator a process of the nccl ceiling joins: its id (hex), this process's rank in it, its
/// size, and the bytes its rank 0 broadcasts.
struct ceiling_comm {
  std::string id_hex;
  int rank = 0;
  int nranks = 0;
  std::uint64_t bytes = 0;
};
/// One process of the nccl ceiling over several communicators at once (refit-bench --streamers: a
/// receiver is a rank of every streamer's communicator), on `device`: per repetition, every
/// communicator's one-element all-reduce, then, once all of them have completed here, every
/// broadcast, each on a stream of its own. nccl_ceiling_rank() is this with one communicator. Returns
/// the median of this process's times from its all-reduces' end to its last broadcast's end, in
/// seconds (CUDA events), after calling `done(median, shortest)` with the communicators still alive;
/// `watch` and `timeout` as there.
double nccl_ceiling_ranks(const std::vector<ceiling_comm>& comms, int device, std::chrono::milliseconds timeout,
                          const std::function<void()>& watch, const std::function<void(double, double)>& done);
inline constexpr std::uint64_t nccl_ceiling_bytes = 1ull << 30;
inline constexpr int nccl_ceiling_warmup = 3;
inline constexpr int nccl_ceiling_reps = 10;

// ---------------------------------------------------------------- test data

/// Deterministic random bytes: byte i of a tensor seeded `seed` (not zeros; cheap, parallel).
void fill_random(std::byte* out, std::uint64_t n, std::uint64_t seed, std::uint64_t first = 0);
/// Seed of tensor i of a run seeded `seed`.
std::uint64_t tensor_seed(std::uint64_t seed, std::size_t i) noexcept;
/// copy::checksum after byte `offset` of a `bytes`-byte tensor changed from `old_byte` to
/// `new_byte`, given its checksum before: O(1), no pass over the data.
std::uint64_t checksum_after_flip(std::uint64_t sum, std::uint64_t bytes, std::uint64_t offset, std::uint8_t old_byte,
                                  std::uint8_t new_byte) noexcept;

// ---------------------------------------------------------------- ceiling

/// Best payload bandwidth (bytes/s) of memcpy between two host buffers of `bytes` bytes.
double host_memcpy_bandwidth(std::uint64_t bytes, int reps = 5);
/// Same for cudaMemcpyAsync device to device on `device`, timed with events (needs CUDA).
double device_copy_bandwidth(int device, std::uint64_t bytes, int reps = 5);
/// Best payload bandwidth (bytes/s) of `bytes` bytes copied from GPU `from` to the GPUs `to`, all
/// at once: one equal share (bytes / to.size()) per entry of `to`, each from its own slice of a
/// buffer on `from` into a buffer on its GPU, on a non-blocking stream of its own:
/// cudaMemcpyPeerAsync where the GPUs differ (peer access enabled first), cudaMemcpyAsync where
/// they do not. Timed with CUDA events from one start to the last share's end; one warm-up, then
/// the best of `reps`. Throws refit::error(cuda) when a call fails (peer access refused included),
/// errc::invalid_argument for no GPU in `to` or in a build without CUDA.
double peer_copy_bandwidth(int from, const std::vector<int>& to, std::uint64_t bytes, int reps = 5);
/// The ceiling of a cuda_ipc refit placed as `p`, copying `bytes` in all: device_copy_bandwidth()
/// on the streamer's GPU when every receiver is there, else peer_copy_bandwidth() to them all.
double copy_ceiling(const gpu_placement& p, std::uint64_t bytes, int reps = 5);
/// What copy_ceiling(p, bytes, reps) measures, for the preamble's "# ceiling" line.
std::string copy_ceiling_method(const gpu_placement& p, std::uint64_t bytes, int reps = 5);

// ---------------------------------------------------------------- configuration

enum class role : std::uint8_t { both, streamer, receiver };

struct config {
  role side = role::both;
  std::string bind;     ///< receiver: endpoint to bind
  std::string connect;  ///< streamer: endpoint of a receiver started by hand
  /// CURVE keys (Z85) of a role started by hand: its own pair, and (streamer) the receiver's public
  /// key; all empty: no CURVE. The report endpoint uses them too.
  curve_keys curve;
  /// Receiver started by hand: the report endpoint to bind (default: default_report_endpoint() of
  /// the bound --bind). Streamer started by hand: the report endpoint that receiver printed.
  std::string report;
  /// Streamer started by hand: run without --report, unverified (wrong = n/a).
  bool no_verify = false;
  std::vector<std::string> models{"qwen2.5-0.5b"};
  std::string manifest_file;  ///< replaces models
  bool load = false;
  dtype type = dtype::bf16;
  std::vector<transport_kind> transports{transport_kind::host_shm};
  std::vector<double> buffer_mb{64};
  std::vector<std::size_t> buffer_counts{2};
  std::uint64_t alignment = 256;
  /// How the receiver holds the model (--layout); the streamer sends the same tensors whatever it is.
  layout_spec layout = layout_kind::plain;
  /// --convert: destinations in another dtype (plain layout only); verification is then off.
  std::optional<conversion_spec> convert;
  /// --layout tpN: the rank a receiver holds (--rank): host_shm's one receiver, or one started by
  /// hand (and the streamer started against it). cuda_ipc and nccl spawn every rank.
  int rank = 0;
  /// cuda_ipc receivers (tpN: one per rank) all on the streamer's GPU (false), or rank k on GPU
  /// (device + k) % visible (true: --receiver-devices spread).
  bool spread_receivers = false;
  /// cuda_ipc: the GPU of every receiver the streamer spawns (--receiver-device N; --role streamer:
  /// the GPU of the receiver started by hand, for the ceiling); -1: as spread_receivers says.
  int receiver_device = -1;
  /// nccl: ranks may share GPUs (--nccl-share-gpus): every bench process claims a host of its own
  /// (NCCL_HOSTID), so NCCL connects ranks on one GPU through its network transport over loopback.
  bool nccl_share_gpus = false;
  bool memory = false;       ///< --memory: each row's extra memory per side in the table (the JSON has it always)
  std::string nccl_library;  ///< --nccl-library: exported as REFIT_NCCL_LIBRARY (spawned ranks inherit it)
  bool keep_whole = true;    ///< streamer_options::keep_whole (--keep-whole)
  bool share = true;         ///< streamer_options::share_tensors (--share-tensors)
  bool lane = true;          ///< streamer_options::control_lane (--control-lane)
  bool twin = false;         ///< streamer_options::nccl_twin (--nccl-twin)
  /// cuda_ipc: the streamer's tensors in 20 MiB VMM chunks exportable as descriptors, as torch's
  /// expandable segments hold them (--source-memory vmm), instead of one cudaMalloc.
  bool vmm_sources = false;
  /// cuda_ipc: how the receiver's weights are allocated (--dest-memory).
  dest_memory dests = dest_memory::torch;
  /// --stage: the receivers stage each version (receiver_options::stage) and apply it at once when
  /// prepared; rows then report the apply's pause (pause_ms) beside the transfer.
  stage_kind stage = stage_kind::none;
  /// --atomic: engine-wide versions (streamer_options::atomic); rows report COMMIT's round trip (commit_ms).
  bool atomic = false;
  /// --split: after each row's refits, as many of one tensor alone (subset versions, same session):
  /// the refit's fixed cost, and what the rest of the row's time moves its bytes at.
  bool split = false;
  /// --announce: before each refit's new weights are made (the trainer's step), the streamer
  /// announces it (streamer::announce): receivers of this host wait for it awake. Rows +announce.
  bool announce = false;
  /// GPU copy engines to compare (one row each); host_shm always copies with memcpy.
  std::vector<copy_engine> engines{copy_engine::automatic};
  /// The receiver's engine for each entry of `engines` ("--engine pack/apply"; same when not given).
  std::vector<copy_engine> apply_engines{copy_engine::automatic};
  /// cuda_ipc paths to measure: true = direct (into the receiver's weights), false = staged.
  std::vector<bool> direct{true, false};
  int warmup = 1;
  int iters = 5;
  std::uint64_t seed = 1;
  int device = 0;
  /// nccl: receiver processes, one GPU each after --device; other transports ignore it.
  std::size_t receivers = 1;
  /// nccl came from "--transport all" only: dropped (with a note) when fewer than 2 GPUs are visible.
  bool nccl_optional = false;
  std::uint64_t timeout_ms = 120000;
  std::string json_file;
  std::string plot_file;
  std::string receiver_exe = "/proc/self/exe";  ///< what the streamer spawns
  /// Receiver: corrupt one byte of tensor N (in its last view) after every commit (tests the verification).
  std::optional<std::size_t> corrupt_tensor;
  bool spawned = false;  ///< receiver: started by a streamer; exit when stdin closes
  /// Receiver started as one rank of the nccl ceiling (hex ncclUniqueId) instead of a refit receiver.
  std::string nccl_ceiling_id;
  int nccl_rank = 0;
  int nccl_ranks = 0;
  bool quiet = false;  ///< no progress lines
  /// --delta STEPS: delta versions against whole ones (bench/delta.cpp); 0: the usual rows.
  int delta_steps = 0;
  double delta_update = 2.2e-4;   ///< --delta-update: relative size of one step's fp32 update
  std::size_t delta_threads = 0;  ///< --delta-threads: delta_options::threads (host diff), 0: its default
  double delta_batch_mb = 0;      ///< --delta-batch-mb: delta_options::batch_bytes in MiB, 0: its default
  /// --streamers N: a group of N streamers, each holding the Shard(0) rows of every tensor, into
  /// --receivers full replicas (bench/group.cpp); 0: the usual rows.
  std::size_t streamers = 0;
  /// --chaos SPEC: a fleet that changes while it trains (bench/chaos.cpp): --receivers receivers,
  /// --iters versions after --warmup quiet ones; nullopt: the usual rows.
  std::optional<chaos_spec> chaos;
  std::vector<std::string> argv;  ///< the command line, for the preamble
};

/// The report endpoint a receiver started by hand binds when --report is not given, from the
/// endpoint it serves refits on: "ipc://PATH" → "ipc://PATH.report", "tcp://HOST:PORT" →
/// "tcp://HOST:*" (a free port: the receiver prints the one it got). Throws
/// refit::error(invalid_argument) for another scheme or a tcp endpoint without a port.
std::string default_report_endpoint(std::string_view refit_endpoint);
/// Throws refit::error(invalid_argument) when the options of c's --role do not go together: a
/// streamer started by hand without --connect, or with neither --report nor --no-verify (or
/// both); --report or --no-verify without --role. parse_args() and run() both check.
void check_role(const config& c);
/// Parses the command line (argv[0] included). Returns nullopt and sets `exit_code` when the bench
/// should stop (--help, a bad option: the message is printed).
std::optional<config> parse_args(int argc, const char* const* argv, int& exit_code);
/// The arguments a spawned receiver gets for one (transport, model) group; on GPU `device`
/// (default: c.device), holding rank `rank` of --layout tpN (default: c.rank).
std::vector<std::string> receiver_args(const config& c, transport_kind t, const std::string& model,
                                       const std::string& endpoint, copy_engine engine = copy_engine::automatic,
                                       std::optional<int> device = std::nullopt,
                                       std::optional<int> rank = std::nullopt);
/// The arguments of rank `rank` (1..nranks-1) of the nccl ceiling, on GPU `device`.
std::vector<std::string> ceiling_args(const config& c, const std::string& id_hex, int rank, int nranks, int device);

// ---------------------------------------------------------------- results

struct model_info {
  std::string name;
  std::uint64_t tensors = 0;
  std::uint64_t bytes = 0;
  std::uint64_t params = 0;
  std::uint64_t largest = 0;
};

struct preamble {
  std::string refit_version;
  std::string host;
  int pid = 0;
  std::string cpu;
  std::vector<std::string> gpus;
  std::vector<std::string> transports;
  std::vector<std::string> notes;  ///< "# note" lines: where nccl ranks run, transports skipped
  std::vector<model_info> models;
  std::vector<double> buffer_mb;
  std::vector<std::size_t> buffer_counts;
  std::uint64_t alignment = 0;
  bool keep_whole = true;
  int warmup = 0;
  int iters = 0;
  std::string dtype;
  std::uint64_t seed = 0;
  std::string engine;
  std::string data;  ///< "random (seed 1)" or "loaded from FILE"
  std::string command;
  std::string date;
  bool verified = true;  ///< false with --no-verify: the table cannot vouch for the data
};

struct row {
  std::string transport;
  std::size_t receivers = 1;  ///< receiver processes (nccl: --receivers)
  std::string model;
  std::string engine = "automatic";  ///< copy engine (GPU transports); "memcpy" for host_shm; +direct, +LAYOUT
  std::string layout = "plain";      ///< the receiver's --layout
  std::uint64_t buffer_bytes = 0;
  std::size_t buffers = 0;
  std::uint64_t tensors = 0;
  /// The payload the receivers need, summed over the distinct ranks (plain, fused, ep: the model
  /// once, whatever the receiver count; tpN: each rank's slices, replicated tensors once per rank).
  std::uint64_t bytes = 0;
  std::uint64_t batches = 0;
  int iters = 0;
  double median_ms = 0, min_ms = 0, max_ms = 0;
  double gbps = 0;          ///< bytes / median
  double ceiling_gbps = 0;  ///< measured copy bandwidth of this transport, same run
  double floor_ms = 0;      ///< 2 × bytes / ceiling (staged), 1 × bytes / ceiling (direct; nccl: one broadcast pass)
  double ratio = 0;         ///< floor / median
  double source_ms = 0, pack_ms = 0, wait_ms = 0, apply_ms = -1;  ///< medians; apply -1: unknown
  double pause_ms = -1;    ///< --stage: median of the slowest receiver's apply_prepared() copy; -1: not staged
  double commit_ms = -1;   ///< --atomic: median of COMMIT's round trip; -1: not engine-wide
  std::int64_t wrong = 0;  ///< tensors with a wrong checksum over every refit; -1: not verified
  /// --split: median of the row's refits of its smallest tensor alone (a subset version in the
  /// same session), the fixed cost of a refit; -1: not measured.
  double fixed_ms = -1;
  /// floor / (median - fixed): the part of the refit beyond its fixed cost against the floor; 0
  /// when not measured (or the fixed cost is the whole refit).
  [[nodiscard]] double rest_ratio() const noexcept {
    return fixed_ms < 0 || median_ms <= fixed_ms ? 0.0 : floor_ms / (median_ms - fixed_ms);
  }

  [[nodiscard]] std::uint64_t buffer_memory() const noexcept { return buffer_bytes * buffers; }

  /// The memory refit itself held beyond the weights during the row (refit::memory_in_use()'s
  /// peaks), per side: the streamer's (this process), the largest of the receivers'. -1: unknown
  /// (a receiver started by hand does not say).
  struct side_memory {
    std::int64_t device = -1, pinned = -1, host = -1;
  };
  side_memory streamer_memory, receiver_memory;
  /// README.md "Memory": what each side may hold (set_memory_budget), the formula it came from, and
  /// the driver's view of the device memory the side took during the row (cudaMemGetInfo: NCCL's
  /// own buffers and the CUDA context's growth included; -1 unknown).
  side_memory streamer_budget, receiver_budget;
  std::string streamer_formula, receiver_formula;
  std::int64_t streamer_driver = -1, receiver_driver = -1;
};

/// Device memory in use on the current GPU by the driver's count (total - free); -1 without CUDA
/// or a device (bench/memory.cpp).
std::int64_t driver_used();
/// Sets r's memory budgets (README.md "Memory") for the row's path (`went_direct`: in place).
void set_memory_budget(const config& c, const manifest& m, row& r, bool went_direct);
/// True when a side held more of a kind than its budget.
bool over_budget(const row& r);

/// Median of a non-empty list (mean of the middle two for an even count).
double median(std::vector<double> v);
/// refit-bench --delta STEPS (bench/delta.cpp): host_shm, one built-in model.
int run_delta(const config& c, std::ostream& out);
/// refit-bench --streamers N (bench/group.cpp): a group of N shard streamers into the receivers.
int run_group(const config& c, std::ostream& out);
/// refit-bench --chaos SPEC (bench/chaos.cpp): receivers killed, restarted, added and removed while
/// versions go on (host_shm: the one transport whose streamer drops a receiver that fails).
int run_chaos(const config& c, std::ostream& out);
/// --streamers N over nccl with `receivers` receivers and `visible` GPUs: throws
/// refit::error(invalid_argument) saying what to do when NCCL is not built, no GPU is visible, --device
/// is not one of them, or the N + receivers ranks do not each get a GPU of their own without
/// --nccl-share-gpus.
void check_group_gpus(const config& c, std::size_t n, std::size_t receivers, int visible);

void write_preamble(std::ostream& out, const preamble& p);
void write_header(std::ostream& out);
void write_row(std::ostream& out, const row& r);
/// The footer: wrong values ("OK" / "FAILED") and the average throughput.
/// `failed`: the run ended with an error (printed after the table), so its 0 wrong values are no OK.
void write_footer(std::ostream& out, const std::vector<row>& rows, bool failed = false);
/// --memory: a "# memory" line per row, each side's peaks (the JSON rows' "memory" always has them).
void write_memory(std::ostream& out, const std::vector<row>& rows);
/// Rows whose memory is over its budget (over_budget()).
std::size_t rows_over_budget(const std::vector<row>& rows);
nlohmann::json to_json(const preamble& p, const std::vector<row>& rows);
/// Throughput against buffer size (log2 axis), one series per (transport, model), with each
/// transport's staged limit (ceiling / 2) and ceiling. A self-contained SVG document.
std::string to_svg(const preamble& p, const std::vector<row>& rows);

/// Total wrong values (rows with -1 count as 0).
std::int64_t total_wrong(const std::vector<row>& rows);

// ---------------------------------------------------------------- running

/// The whole bench as `c` says (both sides, or one); the table goes to `out`. Returns the exit
/// code: 0 when every refit was verified correct, 1 when a value was wrong. Throws refit::error.
int run(const config& c, std::ostream& out);
/// The receiver side alone (role receiver): serves until stdin closes (spawned) or a signal.
/// Started by hand (not spawned), it also binds c.report (or default_report_endpoint()) and
/// answers report requests there between refits (report_log).
int run_receiver(const config& c);
/// Everything: parse, run, report errors. main() calls this.
int bench_main(int argc, const char* const* argv);

}  // namespace refit::bench
