#include "wire/wire.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <msgpack.hpp>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>

#include "model/text.hpp"
#include "plan/route.hpp"

namespace refit::wire {

std::string_view to_string(msg_type t) noexcept {
  switch (t) {
    case msg_type::hello: return "HELLO";
    case msg_type::begin: return "BEGIN";
    case msg_type::batch: return "BATCH";
    case msg_type::end: return "END";
    case msg_type::bye: return "BYE";
    case msg_type::ok: return "OK";
    case msg_type::error: return "ERROR";
    case msg_type::abort: return "ABORT";
    case msg_type::commit: return "COMMIT";
  }
  return "UNKNOWN";
}

std::string_view to_string(entry_kind k) noexcept { return k == entry_kind::patch ? "patch" : "bytes"; }

std::string_view to_string(session_mode m) noexcept { return m == session_mode::in_place ? "in place" : "buffers"; }

msg_type type_of(const message& m) noexcept {
  return std::visit(
      [](const auto& v) -> msg_type {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, hello>)
          return msg_type::hello;
        else if constexpr (std::is_same_v<T, begin>)
          return msg_type::begin;
        else if constexpr (std::is_same_v<T, batch>)
          return msg_type::batch;
        else if constexpr (std::is_same_v<T, end>)
          return msg_type::end;
        else if constexpr (std::is_same_v<T, bye>)
          return msg_type::bye;
        else if constexpr (std::is_same_v<T, ok>)
          return msg_type::ok;
        else if constexpr (std::is_same_v<T, error>)
          return msg_type::error;
        else if constexpr (std::is_same_v<T, abort>)
          return msg_type::abort;
        else
          return msg_type::commit;
      },
      m);
}

// ------------------------------------------------------------------------------------- encoding
namespace {

using packer = msgpack::packer<msgpack::sbuffer>;

void pack_str(packer& p, std::string_view s) {
  p.pack_str(static_cast<std::uint32_t>(s.size()));
  p.pack_str_body(s.data(), static_cast<std::uint32_t>(s.size()));
}

void pack_bin(packer& p, std::string_view s) {
  p.pack_bin(static_cast<std::uint32_t>(s.size()));
  p.pack_bin_body(s.data(), static_cast<std::uint32_t>(s.size()));
}

void pack_uint(packer& p, std::uint64_t v) { p.pack_uint64(v); }

void head(packer& p, msg_type t, std::uint32_t fields) {
  p.pack_array(2 + fields);
  pack_uint(p, static_cast<std::uint64_t>(t));
  pack_uint(p, protocol_version);
}

void pack_bool(packer& p, bool v) {
  if (v)
    p.pack_true();
  else
    p.pack_false();
}

void encode_body(packer& p, const hello& m, std::string_view) {
  head(p, msg_type::hello, 15);
  pack_str(p, m.token);
  pack_str(p, m.transport);
  pack_str(p, m.peer);
  pack_str(p, m.host_id);
  pack_bin(p, m.device_uuid);
  pack_uint(p, m.alignment);
  p.pack_array(static_cast<std::uint32_t>(m.buffers.size()));
  for (const auto& b : m.buffers) {
    p.pack_array(4);
    pack_uint(p, b.bytes);
    pack_bin(p, b.handle);
    pack_bin(p, b.packed_event);
    pack_bin(p, b.applied_event);
  }
  pack_bin(p, m.session);
  pack_uint(p, static_cast<std::uint8_t>(m.mode));
  pack_str(p, m.layout);
  pack_uint(p, m.group_rank);
  pack_uint(p, m.group_size);
  pack_uint(p, m.reply_timeout_ms);
  pack_bool(p, m.lane);
  pack_bin(p, m.secret);
}

void pack_optional(packer& p, const std::optional<std::uint64_t>& v) {
  if (v)
    pack_uint(p, *v);
  else
    p.pack_nil();
}

void encode_body(packer& p, const begin& m, std::string_view secret) {
  head(p, msg_type::begin, 4);
  pack_uint(p, m.version);
  pack_bool(p, m.subset);
  pack_optional(p, m.base);
  pack_bin(p, secret);
}

void encode_body(packer& p, const batch& m, std::string_view secret) {
  head(p, msg_type::batch, 7);
  pack_uint(p, m.version);
  pack_uint(p, m.seq);
  pack_uint(p, m.buffer);
  p.pack_array(static_cast<std::uint32_t>(m.entries.size()));
  for (const auto& e : m.entries) {
    p.pack_array(9);
    pack_str(p, e.name);
    pack_uint(p, static_cast<std::uint64_t>(e.type));
    p.pack_array(static_cast<std::uint32_t>(e.shape.size()));
    for (const std::int64_t d : e.shape) pack_uint(p, static_cast<std::uint64_t>(d));
    pack_uint(p, e.tensor_offset);
    pack_uint(p, e.bytes);
    pack_uint(p, e.buffer_offset);
    pack_uint(p, static_cast<std::uint8_t>(e.kind));
    pack_uint(p, e.kind == entry_kind::patch ? e.span : 0);
    pack_uint(p, e.source);
  }
  p.pack_array(static_cast<std::uint32_t>(m.sources.size()));
  for (const std::string& s : m.sources) pack_bin(p, s);
  pack_bool(p, m.ready);
  pack_bin(p, secret);
}

void encode_body(packer& p, const end& m, std::string_view secret) {
  head(p, msg_type::end, 7);
  pack_uint(p, m.version);
  pack_uint(p, m.tensors);
  pack_uint(p, m.bytes);
  pack_uint(p, m.batches);
  pack_optional(p, m.checksum);
  pack_bool(p, m.hold);
  pack_bin(p, secret);
}

void encode_body(packer& p, const commit& m, std::string_view secret) {
  head(p, msg_type::commit, 2);
  pack_uint(p, m.version);
  pack_bin(p, secret);
}

void encode_body(packer& p, const bye&, std::string_view secret) {
  head(p, msg_type::bye, 1);
  pack_bin(p, secret);
}

void encode_body(packer& p, const ok& m, std::string_view) {
  head(p, msg_type::ok, 6);
  pack_optional(p, m.committed);
  pack_bool(p, m.dirty);
  p.pack_array(static_cast<std::uint32_t>(m.handles.size()));
  for (const auto& h : m.handles) pack_bin(p, h);
  pack_uint(p, static_cast<std::uint8_t>(m.mode));
  p.pack_array(static_cast<std::uint32_t>(m.convert.size()));
  for (const auto& c : m.convert) {
    // A fourth element only for a scale layout other than row-major: a peer that knows no layouts
    // refuses it by the descriptor's length instead of writing row-major scales.
    const bool layout = c.layout != scale_layout::row_major;
    p.pack_array(layout ? 4 : 3);
    pack_str(p, c.name);
    pack_uint(p, static_cast<std::uint64_t>(c.type));
    pack_uint(p, static_cast<std::uint64_t>(c.q));
    if (layout) pack_uint(p, static_cast<std::uint64_t>(c.layout));
  }
  pack_bin(p, m.lane);
}

void encode_body(packer& p, const error& m, std::string_view) {
  head(p, msg_type::error, 2);
  p.pack_int(static_cast<int>(m.code));
  pack_str(p, printable(m.message, max_text_bytes));  // it may quote a peer's bytes: a msgpack str is UTF-8
}

void encode_body(packer& p, const abort& m, std::string_view secret) {
  head(p, msg_type::abort, 4);
  pack_uint(p, m.version);
  p.pack_int(static_cast<int>(m.code));
  pack_str(p, printable(m.reason, max_text_bytes));
  pack_bin(p, secret);
}

}  // namespace

std::string encode(const message& m, std::string_view secret) {
  msgpack::sbuffer buf;
  packer p(buf);
  std::visit([&](const auto& v) { encode_body(p, v, secret); }, m);
  return std::string(buf.data(), buf.size());
}

std::string encode(const batch& b, std::string_view secret) {
  msgpack::sbuffer buf;
  packer p(buf);
  encode_body(p, b, secret);
  return std::string(buf.data(), buf.size());
}

std::string encode_dest(const dest_record& d) {
  msgpack::sbuffer buf;
  packer p(buf);
  p.pack_array(7);
  pack_str(p, d.name);
  pack_uint(p, static_cast<std::uint8_t>(d.type));
  for (const auto* dims : {&d.shape, &d.strides}) {
    p.pack_array(static_cast<std::uint32_t>(dims->size()));
    for (const std::int64_t v : *dims) pack_uint(p, static_cast<std::uint64_t>(v));
  }
  if (d.slice) {
    p.pack_array(3);
    pack_uint(p, static_cast<std::uint64_t>(d.slice->dim));
    pack_uint(p, static_cast<std::uint64_t>(d.slice->start));
    pack_uint(p, static_cast<std::uint64_t>(d.slice->length));
  } else {
    p.pack_nil();
  }
  pack_uint(p, d.allocation);
  pack_uint(p, d.offset);
  return std::string(buf.data(), buf.size());
}

// ------------------------------------------------------------------------------------- decoding
namespace {

using msgpack::object;
namespace mt = msgpack::type;

[[noreturn]] void malformed(std::string_view what) {
  throw refit::error(errc::protocol, fmt::format("malformed message: {}", what));
}

std::string_view kind(const object& o) noexcept {
  switch (o.type) {
    case mt::NIL: return "nil";
    case mt::BOOLEAN: return "bool";
    case mt::POSITIVE_INTEGER: return "unsigned int";
    case mt::NEGATIVE_INTEGER: return "negative int";
    case mt::FLOAT32:
    case mt::FLOAT64: return "float";
    case mt::STR: return "str";
    case mt::BIN: return "bin";
    case mt::ARRAY: return "array";
    case mt::MAP: return "map";
    case mt::EXT: return "ext";
  }
  return "unknown";
}

// Walks the fields of one message; every failure names the message type and the field.
class reader {
 public:
  explicit reader(msg_type t) : type_(t) {}

  [[noreturn]] void fail(std::string_view field, std::string_view what) const {
    throw refit::error(errc::protocol,
                       fmt::format("invalid {} message: {}{} {}", to_string(type_), context(), field, what));
  }

  // Prefix for fields of an entry or buffer ("entry 3 ('x'): ").
  void set_context(std::string c) {
    context_ = std::move(c);
    entry_ = std::nullopt;
  }
  // The same for entry `index` (named `name` once its name is read), formatted only when a field
  // fails: a BATCH has an entry per tensor, and formatting its prefix cost more than decoding it.
  // `name` must outlive the context (it points into the message being decoded).
  void set_entry_context(std::size_t index, std::optional<std::string_view> name = std::nullopt) {
    entry_ = std::pair{index, name};
  }

  void expect(const object& o, mt::object_type t, std::string_view field, std::string_view want) const {
    if (o.type != t) fail(field, fmt::format("must be {}, got {}", want, kind(o)));
  }

  std::uint64_t u64(const object& o, std::string_view field) const {
    expect(o, mt::POSITIVE_INTEGER, field, "an unsigned integer");
    return o.via.u64;
  }

  std::uint32_t u32(const object& o, std::string_view field) const {
    const std::uint64_t v = u64(o, field);
    if (v > std::numeric_limits<std::uint32_t>::max())
      fail(field,
           fmt::format("is {}, more than the largest allowed value {}", v, std::numeric_limits<std::uint32_t>::max()));
    return static_cast<std::uint32_t>(v);
  }

  bool boolean(const object& o, std::string_view field) const {
    expect(o, mt::BOOLEAN, field, "a bool");
    return o.via.boolean;
  }

  std::string str(const object& o, std::string_view field, std::size_t max) const {
    expect(o, mt::STR, field, "a str");
    if (o.via.str.size > max)
      fail(field, fmt::format("is {} bytes long, more than the limit of {}", o.via.str.size, max));
    return std::string(o.via.str.ptr, o.via.str.size);
  }

  std::string bin(const object& o, std::string_view field, std::size_t max) const {
    expect(o, mt::BIN, field, "a bin");
    if (o.via.bin.size > max)
      fail(field, fmt::format("is {} bytes long, more than the limit of {}", o.via.bin.size, max));
    return std::string(o.via.bin.ptr, o.via.bin.size);
  }

  std::span<const object> array(const object& o, std::string_view field, std::size_t max) const {
    expect(o, mt::ARRAY, field, "an array");
    if (o.via.array.size > max)
      fail(field, fmt::format("has {} elements, more than the limit of {}", o.via.array.size, max));
    return {o.via.array.ptr, o.via.array.size};
  }

  // An array of exactly n elements (a nested record).
  std::span<const object> record(const object& o, std::string_view field, std::size_t n) const {
    expect(o, mt::ARRAY, field, "an array");
    if (o.via.array.size != n) fail(field, fmt::format("must have {} elements, got {}", n, o.via.array.size));
    return {o.via.array.ptr, o.via.array.size};
  }

 private:
  std::string context() const {
    if (!entry_) return context_;
    if (!entry_->second) return fmt::format("entry {}: ", entry_->first);
    return fmt::format("entry {} ('{}'): ", entry_->first, *entry_->second);
  }

  msg_type type_;
  std::string context_;
  std::optional<std::pair<std::size_t, std::optional<std::string_view>>> entry_;
};

// Fields of each message, after [type, protocol version].
constexpr std::size_t field_count(msg_type t) noexcept {
  switch (t) {
    case msg_type::hello: return 15;
    case msg_type::begin: return 4;
    case msg_type::batch: return 7;
    case msg_type::end: return 7;
    case msg_type::bye: return 1;
    case msg_type::ok: return 6;
    case msg_type::error: return 2;
    case msg_type::abort: return 4;
    case msg_type::commit: return 2;
  }
  return 0;
}

session_mode decode_mode(reader& r, const object& o) {
  const std::uint64_t v = r.u64(o, "mode");
  if (v > static_cast<std::uint64_t>(session_mode::in_place))
    r.fail("mode", fmt::format("has unknown value {}; the peer runs a newer refit or is broken", v));
  return static_cast<session_mode>(v);
}

hello decode_hello(reader& r, std::span<const object> f) {
  hello m;
  m.token = r.str(f[0], "token", max_handle_bytes);
  m.transport = r.str(f[1], "transport", max_handle_bytes);
  m.peer = r.str(f[2], "peer", max_handle_bytes);
  m.host_id = r.str(f[3], "host_id", max_handle_bytes);
  m.device_uuid = r.bin(f[4], "device_uuid", max_handle_bytes);
  m.alignment = r.u64(f[5], "alignment");
  if (m.alignment == 0 || (m.alignment & (m.alignment - 1)) != 0)
    r.fail("alignment", fmt::format("{} is not a power of two", m.alignment));
  const auto buffers = r.array(f[6], "buffers", max_buffers);
  m.buffers.reserve(buffers.size());
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    r.set_context(fmt::format("buffer {}: ", i));
    const auto b = r.record(buffers[i], "descriptor", 4);
    buffer_desc d;
    d.bytes = r.u64(b[0], "bytes");
    d.handle = r.bin(b[1], "handle", max_handle_bytes);
    d.packed_event = r.bin(b[2], "packed_event", max_handle_bytes);
    d.applied_event = r.bin(b[3], "applied_event", max_handle_bytes);
    m.buffers.push_back(std::move(d));
  }
  r.set_context({});
  m.session = r.bin(f[7], "session", max_handle_bytes);
  m.mode = decode_mode(r, f[8]);
  m.layout = r.str(f[9], "layout", max_handle_bytes);
  m.group_size = r.u64(f[11], "group_size");
  if (m.group_size == 0 || m.group_size > max_group_size)
    r.fail("group_size", fmt::format("{} is not in [1, {}]", m.group_size, max_group_size));
  m.group_rank = r.u64(f[10], "group_rank");
  if (m.group_rank >= m.group_size)
    r.fail("group_rank", fmt::format("{} is not below the group's size {}", m.group_rank, m.group_size));
  m.reply_timeout_ms = r.u64(f[12], "reply_timeout_ms");
  m.lane = r.boolean(f[13], "lane");
  m.secret = r.bin(f[14], "secret", max_secret_bytes);
  return m;
}

std::string describe_type(dtype t, std::span<const std::int64_t> shape) {
  return fmt::format("{}[{}]", to_string(t), fmt::join(shape, ", "));
}

/// A patch entry's stateless rules: its span lies in the tensor on element boundaries, and its bytes
/// hold whole (index, value) records, no more than the span has elements (see entry_kind::patch).
void check_patch_entry(reader& r, entry& e, std::uint64_t total) {
  const std::uint64_t item = itemsize(e.type);
  // The byte range checked above was the buffer bytes; a patch's tensor range is its span.
  std::uint64_t last = 0;
  if (__builtin_add_overflow(e.tensor_offset, e.span, &last) || last > total)
    r.fail("span", fmt::format("[{}, {} + {}) exceeds the tensor's {} bytes ({})", e.tensor_offset, e.tensor_offset,
                               e.span, total, describe_type(e.type, e.shape)));
  if (e.tensor_offset % item != 0 || e.span % item != 0)
    r.fail("span", fmt::format("[{}, {} + {}) is not on {}-byte element boundaries", e.tensor_offset, e.tensor_offset,
                               e.span, item));
  if (e.span / item > std::numeric_limits<std::uint32_t>::max())
    r.fail("span", fmt::format("covers {} elements; a patch indexes at most 2^32 - 1", e.span / item));
  if (e.bytes % (4 + item) != 0)
    r.fail("bytes", fmt::format("{} is not a whole number of {}-byte (index, value) records", e.bytes, 4 + item));
  if (e.bytes / (4 + item) > e.span / item)
    r.fail("bytes",
           fmt::format("hold {} changes, more than the {} elements of the span", e.bytes / (4 + item), e.span / item));
}

entry decode_entry(reader& r, const object& o, std::size_t index) {
  r.set_entry_context(index);
  const auto f = r.record(o, "descriptor", 9);
  entry e;
  e.name = r.str(f[0], "name", max_name_bytes);
  if (e.name.empty()) r.fail("name", "is empty; every tensor needs a name");
  r.set_entry_context(index, std::string_view(f[0].via.str.ptr, f[0].via.str.size));  // the message's bytes

  const std::uint64_t code = r.u64(f[1], "dtype");
  const auto t = dtype_from_code(code);
  if (!t) r.fail("dtype", fmt::format("has unknown code {}; the peer runs a newer refit or is broken", code));
  e.type = *t;

  const auto dims = r.array(f[2], "shape", max_rank);
  e.shape.reserve(dims.size());
  for (std::size_t d = 0; d < dims.size(); ++d) {
    const object& dim = dims[d];
    if (dim.type != mt::POSITIVE_INTEGER ||
        dim.via.u64 > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      const std::string field = fmt::format("shape[{}]", d);  // named only when it fails
      const std::uint64_t v = r.u64(dim, field);
      r.fail(field, fmt::format("is {}, which does not fit a signed 64-bit dimension", v));
    }
    e.shape.push_back(static_cast<std::int64_t>(dim.via.u64));
  }
  const auto total = checked_nbytes(e.type, e.shape);
  if (!total) r.fail("shape", fmt::format("{} has more bytes than fit 64 bits", describe_type(e.type, e.shape)));

  e.tensor_offset = r.u64(f[3], "tensor_offset");
  e.bytes = r.u64(f[4], "bytes");
  e.buffer_offset = r.u64(f[5], "buffer_offset");

  std::uint64_t last = 0;
  const bool patch = f[6].type == mt::POSITIVE_INTEGER && f[6].via.u64 == static_cast<std::uint64_t>(entry_kind::patch);
  if (!patch) {  // a patch's bytes are (index, value) records: its span is checked below
    if (__builtin_add_overflow(e.tensor_offset, e.bytes, &last))
      r.fail("tensor_offset", fmt::format("{} + bytes {} overflows", e.tensor_offset, e.bytes));
    if (last > *total)
      r.fail("byte range", fmt::format("[{}, {}) exceeds the tensor's {} bytes ({})", e.tensor_offset, last, *total,
                                       describe_type(e.type, e.shape)));
  }
  if (__builtin_add_overflow(e.buffer_offset, e.bytes, &last))
    r.fail("buffer_offset", fmt::format("{} + bytes {} overflows", e.buffer_offset, e.bytes));

  const std::uint64_t k = r.u64(f[6], "kind");
  if (k > static_cast<std::uint64_t>(entry_kind::patch))
    r.fail("kind", fmt::format("has unknown value {}; the peer runs a newer refit or is broken", k));
  e.kind = static_cast<entry_kind>(k);
  const std::uint64_t span = r.u64(f[7], "span");
  e.source = r.u32(f[8], "source");
  if (e.source != 0 && e.kind != entry_kind::bytes)
    r.fail("source", fmt::format("is {} in a patch entry; a patch travels in the batch's buffer", e.source));
  if (e.kind == entry_kind::bytes) {
    if (span != 0) r.fail("span", fmt::format("is {} in an entry of kind bytes; only a patch covers a span", span));
    return e;
  }
  e.span = span;
  check_patch_entry(r, e, *total);
  return e;
}

batch decode_batch(reader& r, std::span<const object> f) {
  batch m;
  m.version = r.u64(f[0], "version");
  m.seq = r.u64(f[1], "seq");
  m.buffer = r.u32(f[2], "buffer");
  const auto entries = r.array(f[3], "entries", max_batch_entries);
  m.entries.reserve(entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i) m.entries.push_back(decode_entry(r, entries[i], i));
  r.set_context({});
  const auto sources = r.array(f[4], "sources", max_batch_entries);
  m.sources.reserve(sources.size());
  for (std::size_t i = 0; i < sources.size(); ++i)
    m.sources.push_back(r.bin(sources[i], fmt::format("sources[{}]", i), max_handle_bytes));
  m.ready = r.boolean(f[5], "ready");
  return m;
}

std::vector<conversion> decode_conversions(reader& r, const object& o) {
  const auto list = r.array(o, "convert", max_entries);
  std::vector<conversion> out;
  out.reserve(list.size());
  std::set<std::string, std::less<>> seen;
  for (std::size_t i = 0; i < list.size(); ++i) {
    r.set_context(fmt::format("convert[{}]: ", i));
    const auto f = list[i].type == mt::ARRAY && list[i].via.array.size == 4 ? r.record(list[i], "descriptor", 4)
                                                                            : r.record(list[i], "descriptor", 3);
    conversion c;
    c.name = r.str(f[0], "name", max_name_bytes);
    if (c.name.empty()) r.fail("name", "is empty");
    r.set_context(fmt::format("convert[{}] ('{}'): ", i, c.name));
    const std::uint64_t code = r.u64(f[1], "dtype");
    const auto t = dtype_from_code(code);
    if (!t) r.fail("dtype", fmt::format("has unknown code {}; the peer runs a newer refit or is broken", code));
    if (*t != dtype::f32 && *t != dtype::bf16 && *t != dtype::f16 && *t != dtype::f8_e4m3 && *t != dtype::f4_e2m1x2)
      r.fail("dtype",
             fmt::format("is {}: refit converts only to f32, bf16, f16, f8_e4m3 and f4_e2m1x2", to_string(*t)));
    c.type = *t;
    const std::uint64_t qcode = r.u64(f[2], "quant");
    const auto q = quant_from_code(qcode);
    if (!q) r.fail("quant", fmt::format("has unknown code {}; the peer runs a newer refit or is broken", qcode));
    c.q = *q;
    const bool quantised = c.type == dtype::f8_e4m3 || c.type == dtype::f4_e2m1x2;
    if (quantised != (c.q != quant::none) || (c.q != quant::none && quant_dtype(c.q) != c.type))
      r.fail("quant", fmt::format("is {} for dtype {}: f8_e4m3 needs tensor, block128, channel or mxfp8, "
                                  "f4_e2m1x2 nvfp4, other dtypes none",
                                  to_string(c.q), to_string(c.type)));
    if (f.size() == 4) {
      const std::uint64_t lcode = r.u64(f[3], "scale_layout");
      if (lcode != static_cast<std::uint64_t>(scale_layout::swizzled_128x4))
        r.fail("scale_layout",
               fmt::format("has code {}; 1 (swizzled_128x4) is the only one sent, so the peer runs a newer refit or "
                           "is broken",
                           lcode));
      if (c.q != quant::mxfp8 && c.q != quant::nvfp4)
        r.fail("scale_layout", fmt::format("is swizzled_128x4 for quant {}: only mxfp8 and nvfp4 scales are "
                                           "swizzled",
                                           to_string(c.q)));
      c.layout = scale_layout::swizzled_128x4;
    }
    out.push_back(std::move(c));
    if (!seen.insert(out.back().name).second) r.fail("name", "is listed twice");
  }
  r.set_context({});
  return out;
}

std::optional<std::uint64_t> optional_u64(reader& r, const object& o, std::string_view field) {
  if (o.type == mt::NIL) return std::nullopt;
  if (o.type != mt::POSITIVE_INTEGER) r.fail(field, fmt::format("must be nil or an unsigned integer, got {}", kind(o)));
  return o.via.u64;
}

begin decode_begin(reader& r, std::span<const object> f) {
  begin m;
  m.version = r.u64(f[0], "version");
  m.subset = r.boolean(f[1], "subset");
  m.base = optional_u64(r, f[2], "base");
  if (m.base && *m.base >= m.version)
    r.fail("base", fmt::format("{} is not older than the version {} patched from it", *m.base, m.version));
  if (m.base && !m.subset)
    r.fail("subset", "is false in a delta (base given); a delta sends only what changed, so it is a subset");
  return m;
}

ok decode_ok(reader& r, std::span<const object> f) {
  ok m;
  m.committed = optional_u64(r, f[0], "committed");
  m.dirty = r.boolean(f[1], "dirty");
  const auto handles = r.array(f[2], "handles", max_entries);
  m.handles.reserve(handles.size());
  for (std::size_t i = 0; i < handles.size(); ++i) {
    const object& h = handles[i];
    // The field's name is formatted only for the error: a million handles cost a million copies, not
    // a million formatted names.
    if (h.type != mt::BIN || h.via.bin.size > max_handle_bytes)
      (void)r.bin(h, fmt::format("handles[{}]", i), max_handle_bytes);  // throws, naming the handle
    m.handles.emplace_back(h.via.bin.ptr, h.via.bin.size);
  }
  m.mode = decode_mode(r, f[3]);
  m.convert = decode_conversions(r, f[4]);
  m.lane = r.bin(f[5], "lane", max_handle_bytes);
  return m;
}

errc decode_errc(reader& r, const object& o) {
  constexpr auto lo = static_cast<std::int64_t>(errc::invalid_argument);
  constexpr auto hi = static_cast<std::int64_t>(errc::needs_whole);
  if (o.type == mt::NEGATIVE_INTEGER)
    r.fail("code", fmt::format("{} is not an error code ({}..{})", o.via.i64, lo, hi));
  const std::uint64_t code = r.u64(o, "code");
  if (code < static_cast<std::uint64_t>(lo) || code > static_cast<std::uint64_t>(hi))
    r.fail("code", fmt::format("{} is not an error code ({}..{})", code, lo, hi));
  return static_cast<errc>(code);
}

error decode_error(reader& r, std::span<const object> f) {
  error m;
  m.code = decode_errc(r, f[0]);
  // A hostile receiver may send anything here: the streamer's caller gets it as refit::error text.
  m.message = printable(r.str(f[1], "message", max_message_bytes), max_text_bytes);
  return m;
}

abort decode_abort(reader& r, std::span<const object> f) {
  abort m;
  m.version = r.u64(f[0], "version");
  m.code = decode_errc(r, f[1]);
  m.reason = printable(r.str(f[2], "reason", max_message_bytes), max_text_bytes);
  return m;
}

/// Parses `bytes` as one msgpack object, allocating no more than the input can justify; no list
/// may hold more than `most` elements.
msgpack::object_handle unpack_bounded(std::span<const std::byte> bytes, std::size_t most = max_entries) {
  if (bytes.empty()) malformed("empty input");
  if (bytes.size() > max_message_bytes)
    malformed(fmt::format("{} bytes, more than the limit of {}", bytes.size(), max_message_bytes));

  // Every element takes at least one byte of input, so no array or map may claim more elements
  // than there are bytes: hostile headers cannot make the parser allocate without bound. The
  // limits are one above ours so that the field checks, which name the field, see them.
  const std::size_t n = bytes.size();
  const std::size_t elements = std::min(n, most + 1);
  const msgpack::unpack_limit limit(elements, elements, max_message_bytes, max_message_bytes, max_message_bytes, 16);
  msgpack::object_handle handle;
  std::size_t off = 0;
  try {
    handle = msgpack::unpack(reinterpret_cast<const char*>(bytes.data()), n, off, nullptr, nullptr, limit);
  } catch (const msgpack::insufficient_bytes&) {
    malformed(fmt::format("truncated msgpack ({} bytes)", n));
  } catch (const msgpack::array_size_overflow&) {
    malformed(fmt::format("truncated or invalid msgpack: an array claims more than {} elements", elements));
  } catch (const msgpack::map_size_overflow&) {
    malformed(fmt::format("truncated or invalid msgpack: a map claims more than {} elements", elements));
  } catch (const std::bad_alloc&) {
    malformed("msgpack claims more memory than it carries");
  } catch (const std::exception& e) {
    malformed(fmt::format("invalid msgpack ({})", e.what()));
  }
  if (off != n) malformed(fmt::format("{} trailing bytes after the message", n - off));
  return handle;
}

/// The envelope every message shares: [type, protocol version, fields...]. Returns the type and
/// checks the version and the number of fields.
std::pair<msg_type, std::span<const object>> open_envelope(const object& top) {
  if (top.type != mt::ARRAY) malformed(fmt::format("top level must be an array, got {}", kind(top)));
  const std::span<const object> all(top.via.array.ptr, top.via.array.size);
  if (all.size() < 2)
    malformed(fmt::format("{} elements; a message needs at least a type and a protocol version", all.size()));
  if (all[0].type != mt::POSITIVE_INTEGER)
    malformed(fmt::format("message type must be an unsigned integer, got {}", kind(all[0])));
  if (all[1].type != mt::POSITIVE_INTEGER)
    malformed(fmt::format("protocol version must be an unsigned integer, got {}", kind(all[1])));

  // Before anything else about the fields: another version may have other fields.
  if (all[1].via.u64 != protocol_version)
    throw refit::error(errc::version_mismatch,
                       fmt::format("protocol version mismatch: the peer speaks refit protocol {}, this side "
                                   "speaks {}; run the same refit release on both sides",
                                   all[1].via.u64, protocol_version));

  const std::uint64_t code = all[0].via.u64;
  if (code < static_cast<std::uint64_t>(msg_type::hello) || code > static_cast<std::uint64_t>(msg_type::commit))
    malformed(fmt::format("unknown message type {}", code));
  const auto t = static_cast<msg_type>(code);
  const auto fields = all.subspan(2);
  if (fields.size() != field_count(t))
    throw refit::error(errc::protocol, fmt::format("invalid {} message: {} fields, expected {}", to_string(t),
                                                   fields.size(), field_count(t)));
  return {t, fields};
}

/// True for the requests of a session after HELLO, which carry its secret as their last field.
constexpr bool carries_secret(msg_type t) noexcept {
  return t == msg_type::begin || t == msg_type::batch || t == msg_type::end || t == msg_type::bye ||
         t == msg_type::abort || t == msg_type::commit;
}

}  // namespace

/// The most elements a list of message `bytes` may hold: a BATCH's (its envelope's first bytes, a
/// fixarray and the type, say so before anything is parsed) are bounded by max_batch_entries, so
/// its entries' objects are never built past that.
static std::size_t list_limit(std::span<const std::byte> bytes) {
  const bool batch = bytes.size() >= 2 && (static_cast<std::uint8_t>(bytes[0]) & 0xf0) == 0x90 &&
                     static_cast<std::uint8_t>(bytes[1]) == static_cast<std::uint8_t>(msg_type::batch);
  return batch ? max_batch_entries : max_entries;
}

message decode(std::span<const std::byte> bytes, std::string* secret) {
  const msgpack::object_handle handle = unpack_bounded(bytes, list_limit(bytes));
  const auto [t, fields] = open_envelope(handle.get());
  reader r(t);
  if (secret != nullptr) secret->clear();
  if (carries_secret(t)) {
    std::string s = r.bin(fields.back(), "secret", max_secret_bytes);
    if (secret != nullptr) *secret = std::move(s);
  }
  switch (t) {
    case msg_type::hello: return decode_hello(r, fields);
    case msg_type::begin: return decode_begin(r, fields);
    case msg_type::batch: return decode_batch(r, fields);
    case msg_type::end:
      return end{r.u64(fields[0], "version"),
                 r.u64(fields[1], "tensors"),
                 r.u64(fields[2], "bytes"),
                 r.u64(fields[3], "batches"),
                 optional_u64(r, fields[4], "checksum"),
                 r.boolean(fields[5], "hold")};
    case msg_type::bye: return bye{};
    case msg_type::ok: return decode_ok(r, fields);
    case msg_type::error: return decode_error(r, fields);
    case msg_type::abort: return decode_abort(r, fields);
    case msg_type::commit: return commit{r.u64(fields[0], "version")};
  }
  malformed("unknown message type");
}

message decode(std::string_view bytes, std::string* secret) {
  return decode(std::span<const std::byte>(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()), secret);
}

dest_record decode_dest(std::string_view bytes) {
  if (bytes.size() > max_handle_bytes)
    malformed(fmt::format("destination record of {} bytes, more than the limit of {}", bytes.size(), max_handle_bytes));
  const msgpack::unpack_limit limit(bytes.size() + 1, bytes.size() + 1, max_handle_bytes, max_handle_bytes,
                                    max_handle_bytes, 4);
  msgpack::object_handle handle;
  std::size_t off = 0;
  try {
    handle = msgpack::unpack(bytes.data(), bytes.size(), off, nullptr, nullptr, limit);
  } catch (const std::exception& e) {
    malformed(fmt::format("invalid msgpack in a destination record ({})", e.what()));
  }
  if (off != bytes.size()) malformed(fmt::format("{} trailing bytes after a destination record", bytes.size() - off));
  reader r(msg_type::ok);
  r.set_context("destination record: ");
  const auto f = r.record(handle.get(), "descriptor", 7);
  dest_record d;
  d.name = r.str(f[0], "name", max_name_bytes);
  if (d.name.empty()) r.fail("name", "is empty");
  r.set_context(fmt::format("destination record '{}': ", d.name));
  const std::uint64_t code = r.u64(f[1], "dtype");
  const auto t = dtype_from_code(code);
  if (!t) r.fail("dtype", fmt::format("has unknown code {}", code));
  d.type = *t;
  const auto signed_dims = [&](const object& o, std::string_view field, std::vector<std::int64_t>& out) {
    const auto dims = r.array(o, field, max_rank);
    for (std::size_t k = 0; k < dims.size(); ++k) {
      const std::uint64_t v = r.u64(dims[k], fmt::format("{}[{}]", field, k));
      if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        r.fail(field, fmt::format("[{}] is {}, which does not fit a signed 64-bit value", k, v));
      out.push_back(static_cast<std::int64_t>(v));
    }
  };
  signed_dims(f[2], "shape", d.shape);
  signed_dims(f[3], "strides", d.strides);
  if (f[4].type != mt::NIL) {
    std::vector<std::int64_t> s;
    const auto rec = r.record(f[4], "slice", 3);
    signed_dims(f[4], "slice", s);
    (void)rec;
    if (s[0] > std::numeric_limits<int>::max()) r.fail("slice", fmt::format("dimension {} is out of range", s[0]));
    d.slice = source_slice{static_cast<int>(s[0]), s[1], s[2]};
  }
  d.allocation = r.u64(f[5], "allocation");
  d.offset = r.u64(f[6], "offset");
  // The view must be one add_parameter() accepts: the copies that follow trust it.
  plan::destination view;
  view.meta = tensor_meta{d.name, d.type, d.shape};
  view.strides = d.strides;
  view.slice = d.slice;
  try {
    (void)plan::check_view(view);
  } catch (const refit::error& e) {
    r.fail("view", fmt::format("is not a valid destination: {}", e.what()));
  }
  return d;
}

}  // namespace refit::wire
