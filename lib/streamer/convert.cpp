// refit — tensors the receivers asked for as another dtype: casts on the way, fp8 e4m3 per tensor,
// per row or per MX block of 32 (a scale pass, then converting copies) or per 128 × 128 block (one
// fused pass where it can).
#include <fmt/format.h>

#include <optional>
#include <string>
#include <vector>

#include "streamer/impl.hpp"

namespace refit {

namespace {

/// What one group of `q` is, for messages: "tensor", "128 × 128 block", ...
std::string_view group_name(quant q) {
  switch (q) {
    case quant::block128: return "128 × 128 block";
    case quant::channel: return "row (output channel)";
    case quant::mxfp8: return "MX block of 32 (mxfp8)";
    case quant::nvfp4: return "block of 16 (nvfp4)";
    case quant::none:
    case quant::tensor: break;
  }
  return "tensor";
}

}  // namespace

/// The conversion the receivers asked for `t`, or nullptr when it is sent as it is (nothing
/// asked, or the source already has the dtype asked for, or a cast from a dtype refit does not
/// convert: the receiver refuses it). Throws errc::apply for a quantisation of such a source,
/// errc::invalid_argument for block128 of a tensor of rank < 2.
const wire::conversion* streamer::impl::conversion_for(const tensor_ref& t, route_memo* memo) const {
  if (conversions.empty()) return nullptr;
  const wire::conversion* found = nullptr;
  if (memo != nullptr && memo->conversion_session == session_number) {
    found = memo->conversion;  // conversions is made once per session: its elements stay put
  } else {
    const auto it = conversions.find(t.meta.name);
    if (it != conversions.end()) found = &it->second;
    if (memo != nullptr) {
      memo->conversion_session = session_number;
      memo->conversion = found;
    }
  }
  if (found == nullptr) return nullptr;
  const wire::conversion& c = *found;
  if (c.type == t.meta.type && c.q == quant::none) return nullptr;
  const std::string asked = c.q == quant::none ? std::string(to_string(c.type))
                                               : fmt::format("{} quantised per {}", to_string(c.type), group_name(c.q));
  if (t.meta.type != dtype::f32 && t.meta.type != dtype::bf16 && t.meta.type != dtype::f16) {
    // A cast asked of an integer or f64 source: sent as it is, the receiver refuses the dtype
    // (errc::apply) as it always did. A quantisation: refused here, naming both.
    if (c.q == quant::none) return nullptr;
    throw error(
        errc::apply,
        fmt::format("tensor {}: the receiver asks for it as {}, but refit converts only from f32, bf16 and "
                    "f16, not from {}: send it as {} or register the destination as {}",
                    describe(t.meta), asked, to_string(t.meta.type), to_string(c.type), to_string(t.meta.type)));
  }
  if (t.meta.shape.size() < min_rank(c.q))
    throw error(errc::invalid_argument,
                fmt::format("tensor {}: the receiver asks for {}, which needs at least {} dimension{}",
                            describe(t.meta), asked, min_rank(c.q), min_rank(c.q) == 1 ? "" : "s"));
  if (c.q == quant::nvfp4 && t.meta.shape.back() % 2 != 0)
    throw error(errc::invalid_argument,
                fmt::format("tensor {}: the receiver asks for {}, which packs two elements a byte along the last "
                            "dimension: its length must be even, not {}",
                            describe(t.meta), asked, t.meta.shape.back()));
  return &c;
}

/// Sends `t` converted as `c` asks: the tensor as `c.type` (same shape) and, quantised, its
/// scale tensor `name` + scale_suffix, computed by a scale pass over the source first.
///
/// With `part`, `t` is the whole tensor (its data shifted to where the whole would start) and only
/// the shard's elements are sent (casts only: a quantisation needs the whole tensor).
void streamer::impl::send_converted(batch_writer& w, planner& pl, const tensor_ref& t, const wire::conversion& c,
                                    refit_stats& stats, const shard_place* part) {
  tensor_ref sent = t;
  sent.meta.type = c.type;
  sent.meta.shape = storage_shape(c.type, t.meta.shape);  // nvfp4: [..., in / 2] bytes
  if (part != nullptr && c.q != quant::none)
    throw error(errc::invalid_argument,
                fmt::format("tensor {} is sent as a shard (elements [{}, {})), but the receiver asks for it "
                            "quantised to f8_e4m3 per {}, which needs the amax of the whole tensor: send it whole, "
                            "or register the destination as a cast (bf16)",
                            describe(t.meta), part->first, part->first + part->count, group_name(c.q)));
  const std::uint64_t bytes = part != nullptr ? part->count * itemsize(c.type) : sent.meta.nbytes();
  const std::uint64_t shift = part != nullptr ? part->first * itemsize(c.type) : 0;
  std::optional<tensor_ref> scale;
  if (c.q != quant::none) {
    scale.emplace();
    scale->meta = tensor_meta{t.meta.name + std::string(scale_suffix), scale_dtype(c.q),
                              scale_shape(c.q, t.meta.shape, c.layout)};
    scale->dev = buffers->where();
  }
  std::optional<tensor_ref> scale_2;  // nvfp4's per-tensor scale, a tensor of its own
  if (c.q == quant::nvfp4) {
    scale_2.emplace();
    scale_2->meta = tensor_meta{t.meta.name + std::string(scale_2_suffix), dtype::f32, {1}};
    scale_2->dev = buffers->where();
  }
  const std::vector<transport::routed> targets =
      w.direct ? buffers->routes(sent.meta) : std::vector<transport::routed>{};
  const std::vector<transport::routed> scale_targets =
      w.direct && scale ? buffers->routes(scale->meta) : std::vector<transport::routed>{};
  if (scale && c.q == quant::block128 && part == nullptr && send_striped(w, pl, t, sent, *scale)) {
    stats.tensors += 1;
    stats.bytes += bytes;
    send_scale(w, pl, *scale, {}, stats);
    return;
  }
  const std::vector<placement> placed = pl.add(w.planned++, bytes);
  if (t.stream != nullptr) w.streams.push_back(t.stream);

  // Block128 of a whole tensor placed in one piece: one pass (copy::fused_job) writes the codes
  // and the scales. Direct: into plain or column-shard destinations, codes and scales where they
  // go. Staged: the codes into the buffer, the scales into scratch, sent from there as the scale
  // tensor. Otherwise a scale pass into scratch, then converting copies, then the scale tensor.
  std::vector<copy::fused_job> fused;
  const bool whole_block128 = c.q == quant::block128 && part == nullptr && placed.size() == 1 &&
                              placed[0].entry.tensor_offset == 0 && placed[0].entry.bytes == bytes;
  if (w.direct && whole_block128) fused = fused_jobs(t, targets, scale_targets);
  const bool staged_fused = !w.direct && whole_block128 && t.meta.numel() != 0;
  if (staged_fused)
    fused.push_back(staged_fused_job(t, *scale));  // its dst is the buffer's, known once its batch is open
  const float* mul =
      scale && fused.empty() ? queue_scale_pass(w, t, c, *scale, scale_2 ? &*scale_2 : nullptr) : nullptr;
  const copy::cvt::conversion cv = copy::conversion_of(t.meta.type, c.type, c.q, t.meta.shape, mul);
  for (placement p : placed) {
    while (w.first_batch + p.batch > w.seq) w.flush();
    p.entry.tensor_offset += shift;
    if (fused.empty()) {
      w.add(sent, p, targets, &cv);
    } else if (staged_fused) {
      w.add_fused(sent, p, fused.front(), t.dev);
    } else {
      w.add(sent, p, {}, &cv);  // the entry only: the fused jobs write it
      w.fused.insert(w.fused.end(), fused.begin(), fused.end());
    }
  }
  stats.tensors += 1;
  stats.bytes += bytes;
  if (scale)
    send_scale(w, pl, *scale,
               fused.empty() ? std::span<const transport::routed>(scale_targets) : std::span<const transport::routed>(),
               stats);
  if (scale_2) {
    const std::vector<transport::routed> targets_2 =
        w.direct ? buffers->routes(scale_2->meta) : std::vector<transport::routed>{};
    send_scale(w, pl, *scale_2, targets_2, stats);
  }
}

/// The staged block128 tensor `t`'s one-pass job: the codes into the buffer (its dst, set once
/// its batch is open), the scales into scratch, sent from there as the scale tensor `scale`.
copy::fused_job streamer::impl::staged_fused_job(const tensor_ref& t, tensor_ref& scale) {
  const auto& shape = t.meta.shape;
  copy::fused_job j;
  j.src = t.data;
  j.from = t.meta.type;
  j.cols = static_cast<std::uint64_t>(shape[shape.size() - 1]);
  j.rows = static_cast<std::uint64_t>(shape[shape.size() - 2]);
  j.lead = t.meta.numel() / (j.rows * j.cols);
  j.col_hi = j.cols;
  j.dst_pitch = j.cols;
  j.scale = copier->scratch(scale.meta.numel());
  j.scale_pitch = (j.cols + 127) / 128;
  scale.data = j.scale;
  return j;
}

/// A staged block128 tensor `t` (2-d, whole) larger than a buffer: placed as stripes of whole rows
/// of 128 × 128 blocks, each fitting an empty buffer, so that every stripe takes the one pass
/// (copy::fused_job over its rows) and writes its blocks' scales into the scale tensor's scratch.
/// Split at the buffers' ends instead, it took the two-pass way, which converted llama3-8b's
/// embedding and lm_head at a fraction of the fused pass's speed
/// (bench/results/2026-11-29-h200-staged-same-gpu.txt). `sent` is `t` as sent (f8_e4m3); `scale`
/// gets its data. Returns false, having placed nothing, where stripes do not apply (a direct
/// session, a tensor that fits a buffer, not 2-d, a stripe of 128 rows larger than a buffer, or
/// a planner that splits tensors anywhere).
bool streamer::impl::send_striped(batch_writer& w, planner& pl, const tensor_ref& t, const tensor_ref& sent,
                                  tensor_ref& scale) {
  const plan_options& po = pl.options();
  const auto& shape = t.meta.shape;
  if (w.direct || !po.keep_whole || shape.size() != 2 || t.meta.numel() == 0) return false;
  const auto rows = static_cast<std::uint64_t>(shape[0]);
  const auto cols = static_cast<std::uint64_t>(shape[1]);
  const std::uint64_t block_row = 128 * cols;  // bytes of f8_e4m3 codes
  if (rows * cols <= po.buffer_bytes || block_row > po.buffer_bytes) return false;
  const std::uint64_t stripe_rows = po.buffer_bytes / block_row * 128;
  copy::fused_job whole = staged_fused_job(t, scale);
  const std::size_t index = w.planned++;
  if (t.stream != nullptr) w.streams.push_back(t.stream);
  const std::uint64_t item = itemsize(t.meta.type);
  for (std::uint64_t r0 = 0; r0 < rows; r0 += stripe_rows) {
    const std::uint64_t n = std::min(stripe_rows, rows - r0);
    const std::vector<placement> placed = pl.add(index, n * cols);
    if (placed.size() != 1)
      throw error(errc::internal, fmt::format("tensor {}: a stripe of {} rows was split over {} batches",
                                              describe(t.meta), n, placed.size()));
    placement p = placed.front();
    p.entry.tensor_offset = r0 * cols;
    while (w.first_batch + p.batch > w.seq) w.flush();
    copy::fused_job j = whole;
    j.src = static_cast<const std::byte*>(t.data) + r0 * cols * item;
    j.rows = n;
    j.scale = whole.scale + r0 / 128 * whole.scale_pitch;
    w.add_fused(sent, p, j, t.dev);
  }
  return true;
}

/// Queues the scale pass of a quantised tensor `t` that takes the two-pass way: its scales
/// (of scale_dtype(c.q), sent as `scale`; a float of scratch each holds an E8M0 code too) and its
/// multipliers into scratch; returns the multipliers, which
/// the converting copies read.
/// nvfp4: its per-tensor scale into scratch too, sent as `scale_2`.
const float* streamer::impl::queue_scale_pass(batch_writer& w, const tensor_ref& t, const wire::conversion& c,
                                              tensor_ref& scale, tensor_ref* scale_2) {
  const std::uint64_t groups = *checked_numel(scale_shape(c.q, t.meta.shape));  // row-major: one per group
  float* inv = copier->scratch(std::max(groups, scale.meta.numel()));           // a swizzled grid is padded
  float* m = copier->scratch(groups);
  scale.data = inv;
  float* global = nullptr;
  if (scale_2 != nullptr) {
    global = copier->scratch(1);
    scale_2->data = global;
  }
  // Even with no elements: a per-tensor scale is then that of amax 0 (clamped).
  w.jobs.push_back(copy::scale_job{t.data, t.meta.type, t.meta.shape, c.q, inv, m, global, c.layout});
  return m;
}

/// Places the scale tensor of a quantised tensor after it: plain bytes from scratch, along
/// `scale_targets` in a direct session (none where the fused jobs write the scales).
void streamer::impl::send_scale(batch_writer& w, planner& pl, const tensor_ref& scale,
                                std::span<const transport::routed> scale_targets, refit_stats& stats) {
  const std::uint64_t scale_bytes = scale.meta.nbytes();
  for (const placement& p : pl.add(w.planned++, scale_bytes)) {
    while (w.first_batch + p.batch > w.seq) w.flush();
    w.add(scale, p, scale_targets);
  }
  stats.tensors += 1;
  stats.bytes += scale_bytes;
}

/// The fused jobs that write `t` (block128, whole) along `targets` and its scales along
/// `scale_targets` (the same destinations, in the same order), or none when some destination
/// is neither dense nor a column shard of dense rows (those take the two-pass way).
std::vector<copy::fused_job> streamer::impl::fused_jobs(const tensor_ref& t, std::span<const transport::routed> targets,
                                                        std::span<const transport::routed> scale_targets) {
  std::vector<copy::fused_job> out;
  if (targets.size() != scale_targets.size() || t.meta.numel() == 0) return {};
  const auto& shape = t.meta.shape;
  const auto cols = static_cast<std::uint64_t>(shape[shape.size() - 1]);
  const auto rows = static_cast<std::uint64_t>(shape[shape.size() - 2]);
  const std::uint64_t lead = t.meta.numel() / (rows * cols);
  const std::uint64_t grid_rows = (rows + 127) / 128;
  const std::uint64_t grid_cols = (cols + 127) / 128;
  for (std::size_t k = 0; k < targets.size(); ++k) {
    if (targets[k].runs.size() != 1 || scale_targets[k].runs.size() != 1) return {};
    const plan::run& r = targets[k].runs.front();
    const plan::run& s = scale_targets[k].runs.front();
    copy::fused_job j;
    j.src = t.data;
    j.from = t.meta.type;
    j.lead = lead;
    j.rows = rows;
    j.cols = cols;
    if (r.rows == 1 && r.src == 0 && r.width == lead * rows * cols) {
      j.col_lo = 0;
      j.col_hi = cols;
      j.dst_pitch = cols;
    } else if ((r.rows == lead * rows && r.src_pitch == cols) || (r.rows == 1 && lead * rows == 1)) {
      j.col_lo = r.src;
      j.col_hi = r.src + r.width;
      j.dst_pitch = r.dst_pitch;
      if (j.col_hi > cols || j.col_lo % 128 != 0 || (j.col_hi % 128 != 0 && j.col_hi != cols)) return {};
    } else {
      return {};
    }
    const std::uint64_t b_lo = j.col_lo / 128;
    const std::uint64_t b_hi = (j.col_hi + 127) / 128;
    if (s.rows == 1 && s.src == 0 && s.width == 4 * lead * grid_rows * grid_cols && b_lo == 0 && b_hi == grid_cols) {
      j.scale_pitch = grid_cols;  // the whole grid, dense
    } else if (s.src == 4 * b_lo && s.width == 4 * (b_hi - b_lo) && s.rows == lead * grid_rows && s.rows > 1 &&
               s.src_pitch == 4 * grid_cols && s.dst_pitch % 4 == 0) {
      j.scale_pitch = s.dst_pitch / 4;  // the shard's columns of every row of blocks
    } else if (s.src == 4 * b_lo && s.width == 4 * (b_hi - b_lo) && s.rows == 1 && lead * grid_rows == 1) {
      j.scale_pitch = 0;  // one row of blocks
    } else {
      return {};
    }
    j.dst = reinterpret_cast<std::uint8_t*>(targets[k].base + r.dst);
    j.scale = reinterpret_cast<float*>(scale_targets[k].base + s.dst);
    out.push_back(j);
  }
  return out;
}

/// A converted tensor in an in-place session without staging buffers. Throws.
void streamer::impl::batch_writer::refuse_unconverted(const tensor_ref& t) const {
  throw error(errc::invalid_argument,
              fmt::format("tensor {}: the receivers ask for it as {}, but this {} session sends every tensor in "
                          "place, unconverted (nothing of it was sent; receivers that took earlier batches of "
                          "version {} stay dirty until a refit commits): set streamer_options::direct = false "
                          "so that it is converted into the send buffers",
                          describe(t.meta), to_string(t.meta.type), to_string(st.options.transport), version));
}

/// Adds one whole block128 tensor of a staged session, written by `job` (one pass, its scales
/// into scratch) at its place in the open batch's buffer (in place: the staging buffer). `t`
/// is the tensor as sent (f8_e4m3), `src_dev` where its source is.
void streamer::impl::batch_writer::add_fused(const tensor_ref& t, const placement& p, copy::fused_job job,
                                             device src_dev) {
  std::byte* base =
      in_place ? st.buffers->staging(seq % st.buffers->count()) : st.buffers->data(seq % st.buffers->count());
  if (base == nullptr) refuse_unconverted(t);
  add_entry(t, p);
  if (src_dev.kind == device_kind::cuda && !(src_dev == st.buffers->where()))
    copy::enable_peer_access(st.buffers->where().index, src_dev.index);
  job.dst = reinterpret_cast<std::uint8_t*>(base + p.entry.buffer_offset);
  fused.push_back(job);
  if (by_entry) segments.push_back(transport::segment{nullptr, p.entry.buffer_offset, p.entry.bytes});
}

/// The converting half of add(): converted bytes [tensor_offset, + bytes) of `t` into the
/// buffer (staged; a transport moving entries sends them from there, never from the source,
/// which holds the other dtype) or along the routes (direct).
void streamer::impl::batch_writer::add_converted(const tensor_ref& t, const placement& p,
                                                 std::span<const transport::routed> targets,
                                                 const copy::cvt::conversion& cv) {
  const std::uint64_t di = copy::cvt::item(cv.to);
  if (p.entry.tensor_offset % di != 0 || p.entry.bytes % di != 0)
    throw error(
        errc::invalid_argument,
        fmt::format("tensor {}: a batch boundary at byte {} splits one of its converted elements ({} "
                    "bytes each): give the streamer buffer_bytes and alignment that are multiples of 4",
                    describe(t.meta),
                    p.entry.tensor_offset % di != 0 ? p.entry.tensor_offset : p.entry.tensor_offset + p.entry.bytes,
                    di));
  if (t.dev.kind == device_kind::cuda && !(t.dev == st.buffers->where()))
    copy::enable_peer_access(st.buffers->where().index, t.dev.index);
  if (direct) {
    for (const transport::routed& target : targets)
      copy::append_convert_route(target.runs, p.entry.tensor_offset, p.entry.bytes, t.data, target.base, cv, cops,
                                 pieces);
    note_direct(p.entry.bytes);
    return;
  }
  const std::uint64_t first = copy::cvt::elements_of(cv.to, p.entry.tensor_offset);  // f4_e2m1x2: two a byte
  // An in-place session packs converted entries after all, into its staging buffers (the
  // planned offsets fit: they are an in-place batch's).
  std::byte* base =
      in_place ? st.buffers->staging(seq % st.buffers->count()) : st.buffers->data(seq % st.buffers->count());
  if (base == nullptr) refuse_unconverted(t);
  cops.push_back(copy::convert_op{static_cast<const std::byte*>(t.data) + first * copy::cvt::item(cv.from),
                                  base + p.entry.buffer_offset, copy::cvt::elements_of(cv.to, p.entry.bytes), 1, 0, 0,
                                  first, cv});
  if (by_entry) segments.push_back(transport::segment{nullptr, p.entry.buffer_offset, p.entry.bytes});
}

}  // namespace refit
