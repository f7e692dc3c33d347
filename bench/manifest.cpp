// Manifests: the header of a .safetensors file, a plain JSON {name: {dtype, shape}}, or a sharded
// checkpoint's index; and the private mappings --load reads tensor data from.
//
// safetensors layout: 8-byte little-endian header length N, N bytes of JSON
// {name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the data; offsets are relative to the first byte after the header.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string_view>
#include <unordered_set>
#include <utility>

#include "bench/bench.hpp"
#include "bench/json_outline.hpp"
#include "refit/error.hpp"

namespace refit::bench {
namespace {

using json = nlohmann::json;

// The safetensors format caps the header at 100 MB; anything larger is a wrong file.
constexpr std::uint64_t max_header = 100'000'000;

[[noreturn]] void fail(const std::string& file, const std::string& what) {
  throw error(errc::invalid_argument, fmt::format("manifest {}: {}", file, what));
}
[[noreturn]] void fail_entry(const std::string& file, const std::string& name, const std::string& what) {
  throw error(errc::invalid_argument, fmt::format("manifest {}: tensor '{}': {}", file, name, what));
}

// A manifest nests 3 levels ({name: {"shape": [dims]}}). Deeper input is refused before it is
// parsed into a document: 200,000 nested arrays overflowed the stack inside ordered_json's parse.
constexpr std::size_t max_json_depth = 64;

// A document and the order of its keys (json_outline.hpp: ordered_json made a manifest of 20,000
// tensors take seconds).
struct parsed {
  json doc;
  json_outline outline;
};

// Parses JSON; every failure (syntax, a number no double holds such as 1e999, nesting, a key given
// twice) comes as refit::error. `invalid` leads the message for bad JSON, `subject` names the text
// for nesting. `nested`: the top-level keys whose objects' order counts too.
parsed parse_json(std::string_view text, const std::string& file, std::string_view invalid, std::string_view subject,
                  std::initializer_list<std::string_view> nested = {}) {
  parsed p{json(), outline_json(text, nested, max_json_depth)};
  const json_outline& o = p.outline;
  if (o.invalid) fail(file, fmt::format("{}: {}", invalid, *o.invalid));
  if (o.too_deep)
    fail(file, fmt::format("{} nests deeper than {} levels (a manifest needs 3)", subject, max_json_depth));
  if (o.repeated) {
    const auto& [key, holder] = *o.repeated;
    if (holder.empty()) fail(file, fmt::format("'{}' is a key twice: a tensor is listed once", key));
    fail(file, fmt::format("'{}' is a key twice in \"{}\": a tensor is listed once", key, holder));
  }
  try {
    p.doc = json::parse(text);
  } catch (const json::exception& e) {  // the outline saw none: kept for the message's sake
    fail(file, fmt::format("{}: {}", invalid, e.what()));
  }
  return p;
}

// A key of `obj` that the outline listed.
const json& member(const json& obj, const std::string& key) { return *obj.find(key); }

std::vector<std::int64_t> parse_shape(const json& v, const std::string& file, const std::string& name) {
  if (!v.is_array()) fail_entry(file, name, fmt::format("\"shape\" must be an array of integers, got {}", v.dump()));
  std::vector<std::int64_t> shape;
  for (const auto& d : v) {
    if (!d.is_number_integer() || (!d.is_number_unsigned() && d.get<std::int64_t>() < 0))
      fail_entry(file, name, fmt::format("\"shape\" {} has a dimension that is not a non-negative integer", v.dump()));
    shape.push_back(d.get<std::int64_t>());
  }
  return shape;
}

dtype parse_entry_dtype(const json& v, const std::string& file, const std::string& name) {
  if (!v.is_string()) fail_entry(file, name, fmt::format("\"dtype\" must be a string, got {}", v.dump()));
  const auto t = parse_dtype(v.get<std::string>());
  if (!t)
    fail_entry(file, name,
               fmt::format("unknown dtype '{}' (known: BOOL U8 I8 I16 I32 I64 F16 BF16 F32 F64 "
                           "F8_E4M3 F8_E5M2 U16 U32 U64)",
                           v.get<std::string>()));
  return *t;
}

std::uint64_t nbytes_of(const tensor_meta& meta, const std::string& file) {
  const auto n = checked_nbytes(meta.type, meta.shape);
  if (!n) fail_entry(file, meta.name, fmt::format("shape {} overflows 64-bit byte counts", fmt::join(meta.shape, "×")));
  return *n;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw error(errc::io, fmt::format("manifest {}: cannot open: {}", path, std::strerror(errno)));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Reads the first bytes of a safetensors file: the length and the header (not the data).
manifest read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw error(errc::io, fmt::format("manifest {}: cannot open: {}", path, std::strerror(errno)));
  std::error_code ec;
  const std::uint64_t file_size = std::filesystem::file_size(path, ec);
  if (ec) throw error(errc::io, fmt::format("manifest {}: cannot stat: {}", path, ec.message()));
  std::string head(static_cast<std::size_t>(std::min<std::uint64_t>(file_size, 8)), '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  std::uint64_t n = 0;
  if (head.size() == 8) {
    std::memcpy(&n, head.data(), 8);
    if (n <= max_header && n <= file_size - 8) {
      head.resize(8 + n);
      in.read(head.data() + 8, static_cast<std::streamsize>(n));
    }
  }
  return parse_safetensors(head.data(), head.size(), file_size, path);
}

bool looks_like_json(const std::string& path) {
  if (path.ends_with(".safetensors")) return false;
  if (path.ends_with(".json")) return true;
  std::ifstream in(path, std::ios::binary);
  char c = 0;
  while (in.get(c))
    if (!std::isspace(static_cast<unsigned char>(c))) return c == '{';
  return false;
}

}  // namespace

manifest parse_safetensors(const void* data, std::uint64_t size, std::uint64_t file_size, const std::string& file) {
  if (size < 8 || file_size < 8)
    fail(file, fmt::format("truncated: {} bytes, shorter than the 8-byte header length every "
                           "safetensors file starts with",
                           std::min(size, file_size)));
  std::uint64_t n = 0;
  std::memcpy(&n, data, 8);  // little-endian, as the format says (x86-64, aarch64 hosts)
  if (n > max_header)
    fail(file, fmt::format("header length {} is larger than the format's 100 MB limit: not a "
                           "safetensors file?",
                           n));
  if (n > file_size - 8)
    fail(file, fmt::format("header length {} runs past the end of the file ({} bytes): the file "
                           "is truncated or not a safetensors file",
                           n, file_size));
  if (size < 8 + n) fail(file, fmt::format("header truncated: {} of {} bytes given", size - 8, n));
  const std::uint64_t data_size = file_size - 8 - n;
  const std::string_view text(static_cast<const char*>(data) + 8, n);

  const parsed p = parse_json(text, file, "header is not valid JSON", "header");
  const json& header = p.doc;
  if (!header.is_object()) fail(file, "header must be a JSON object {name: {dtype, shape, data_offsets}}");

  manifest m;
  m.name = std::filesystem::path(file).filename().string();
  m.files.push_back(file);
  struct span_of {
    std::uint64_t begin, end;
    std::size_t entry;
  };
  std::vector<span_of> spans;
  for (const std::string& name : p.outline.keys) {
    if (name == "__metadata__") continue;
    const json& v = member(header, name);
    if (!v.is_object()) fail_entry(file, name, "must be an object {dtype, shape, data_offsets}");
    for (const char* key : {"dtype", "shape", "data_offsets"})
      if (!v.contains(key)) fail_entry(file, name, fmt::format("missing \"{}\"", key));
    tensor_meta meta{name, parse_entry_dtype(v["dtype"], file, name), parse_shape(v["shape"], file, name)};
    const std::uint64_t bytes = nbytes_of(meta, file);
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail_entry(file, name,
                 fmt::format("\"data_offsets\" must be [begin, end] (non-negative integers), got {}", off.dump()));
    const auto begin = off[0].get<std::uint64_t>();
    const auto end = off[1].get<std::uint64_t>();
    if (end < begin) fail_entry(file, name, fmt::format("data_offsets [{}, {}] end before they begin", begin, end));
    if (end - begin != bytes)
      fail_entry(file, name,
                 fmt::format("size mismatch: shape [{}] × {} bytes ({}) = {} bytes, but data_offsets "
                             "[{}, {}] span {} bytes",
                             fmt::join(meta.shape, ", "), itemsize(meta.type), to_string(meta.type), bytes, begin, end,
                             end - begin));
    if (end > data_size)
      fail_entry(file, name,
                 fmt::format("data_offsets [{}, {}] out of range: the data section after the header "
                             "is {} bytes (file {} bytes)",
                             begin, end, data_size, file_size));
    spans.push_back({begin, end, m.entries.size()});
    m.entries.push_back({std::move(meta), 0, 8 + n + begin});
  }
  // File order; and no two tensors may share bytes.
  std::sort(spans.begin(), spans.end(),
            [](const span_of& a, const span_of& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  const span_of* widest = nullptr;  // the non-empty span reaching furthest so far
  for (const auto& b : spans) {
    if (b.end == b.begin) continue;
    if (widest && b.begin < widest->end) {
      const auto& a = *widest;
      fail_entry(file, m.entries[b.entry].meta.name,
                 fmt::format("data_offsets [{}, {}] overlap those of tensor '{}' [{}, {}]", b.begin, b.end,
                             m.entries[a.entry].meta.name, a.begin, a.end));
    }
    if (!widest || b.end > widest->end) widest = &b;
  }
  std::vector<manifest_entry> ordered;
  ordered.reserve(spans.size());
  for (const auto& s : spans) ordered.push_back(std::move(m.entries[s.entry]));
  m.entries = std::move(ordered);
  if (m.entries.empty()) fail(file, "no tensors in the header");
  return m;
}

manifest parse_json_manifest(std::string_view text, const std::string& file, dtype fallback) {
  const parsed p = parse_json(text, file, "not valid JSON", "JSON", {"weight_map"});
  const json& doc = p.doc;
  if (!doc.is_object()) fail(file, "must be a JSON object {name: {dtype, shape}}");
  manifest m;
  m.name = std::filesystem::path(file).filename().string();
  for (const std::string suffix : {".json", ".index", ".safetensors"})
    if (m.name.ends_with(suffix)) m.name.resize(m.name.size() - suffix.size());

  if (doc.contains("weight_map")) {
    // A sharded checkpoint's index: read each shard's header (next to the index), keep the
    // index's tensors in the shards' order.
    const auto& map = doc["weight_map"];
    if (!map.is_object()) fail(file, "\"weight_map\" must be an object {name: shard file}");
    const std::vector<std::string>& names = p.outline.keys_under("weight_map");
    std::vector<std::string> shards;
    for (const std::string& name : names) {
      const json& shard = member(map, name);
      if (!shard.is_string()) fail_entry(file, name, "weight_map value must be a file name");
      if (std::find(shards.begin(), shards.end(), shard.get<std::string>()) == shards.end())
        shards.push_back(shard.get<std::string>());
    }
    const auto dir = std::filesystem::path(file).parent_path();
    for (const auto& shard : shards) {
      manifest s = read_safetensors((dir / shard).string());
      const int index = static_cast<int>(m.files.size());
      m.files.push_back(s.files.at(0));
      for (auto& e : s.entries) {
        if (!map.contains(e.meta.name)) continue;  // the index is the list of record
        e.file = index;
        m.entries.push_back(std::move(e));
      }
    }
    std::unordered_set<std::string_view> found;
    for (const manifest_entry& e : m.entries) found.insert(e.meta.name);
    for (const std::string& name : names)
      if (found.count(name) == 0)
        fail_entry(file, name,
                   fmt::format("listed in weight_map but not in shard {}", member(map, name).get<std::string>()));
    // As for the other forms: a workload without tensors is a wrong file, not an empty bench.
    if (m.entries.empty()) fail(file, "\"weight_map\" lists no tensors");
    return m;
  }

  for (const std::string& name : p.outline.keys) {
    if (name == "__metadata__") continue;
    const json& v = member(doc, name);
    if (!v.is_object()) fail_entry(file, name, "must be an object {\"dtype\": ..., \"shape\": [...]}");
    if (!v.contains("shape")) fail_entry(file, name, "missing \"shape\"");
    tensor_meta meta{name, v.contains("dtype") ? parse_entry_dtype(v["dtype"], file, name) : fallback,
                     parse_shape(v["shape"], file, name)};
    (void)nbytes_of(meta, file);
    m.entries.push_back({std::move(meta), -1, 0});
  }
  if (m.entries.empty()) fail(file, "no tensors");
  return m;
}

manifest load_manifest(const std::string& path, dtype fallback) {
  if (!std::filesystem::exists(path)) throw error(errc::io, fmt::format("manifest {}: no such file", path));
  if (looks_like_json(path)) return parse_json_manifest(read_all(path), path, fallback);
  return read_safetensors(path);
}

// ---------------------------------------------------------------- mapped_file

mapped_file::mapped_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw error(errc::io, fmt::format("--load {}: cannot open: {}", path, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw error(errc::io, fmt::format("--load {}: cannot stat: {}", path, std::strerror(e)));
  }
  size_ = static_cast<std::uint64_t>(st.st_size);
  if (size_ > 0) {
    // Private and writable: perturbing a byte copies one page, never writes the file.
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      throw error(errc::io, fmt::format("--load {}: cannot map {} bytes: {}", path, size_, std::strerror(e)));
    }
    data_ = static_cast<std::byte*>(p);
  }
  ::close(fd);
}

mapped_file::~mapped_file() {
  if (data_) ::munmap(data_, size_);
}

mapped_file::mapped_file(mapped_file&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

mapped_file& mapped_file::operator=(mapped_file&& other) noexcept {
  if (this != &other) {
    if (data_) ::munmap(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

}  // namespace refit::bench
