// refit-bench: manifests, presets, report formats and short end-to-end runs of the bench binary.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "bench/bench.hpp"
#include "bench/json_outline.hpp"
#include "channel/channel.hpp"
#include "copy/copy.hpp"
#include "config/config.hpp"
#include "refit/error.hpp"
#include "refit/streamer.hpp"

namespace fs = std::filesystem;
using namespace refit;
using namespace refit::bench;
using nlohmann::json;

namespace {

// A directory of its own for each test, removed at the end.
struct scratch {
  scratch() {
    std::string t = (fs::temp_directory_path() / "refit-bench-test-XXXXXX").string();
    REQUIRE(::mkdtemp(t.data()) != nullptr);
    dir = t;
  }
  ~scratch() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  [[nodiscard]] std::string file(const std::string& name) const { return (dir / name).string(); }
  fs::path dir;
};

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A safetensors file: length, header, data.
std::string safetensors(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const std::uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

// The error message load_manifest() throws for these bytes ("" when none).
std::string manifest_error(const std::string& path, const std::string& bytes) {
  write_file(path, bytes);
  try {
    (void)load_manifest(path);
  } catch (const refit::error& e) {
    CHECK(e.code() == errc::invalid_argument);
    return e.what();
  }
  return "";
}

std::string bench_binary() {
  if (const char* p = std::getenv("REFIT_BENCH")) return p;
  return (fs::read_symlink("/proc/self/exe").parent_path().parent_path() / "bench" / "refit-bench").string();
}

config short_run(const std::string& model) {
  config c;
  c.models = {model};
  c.buffer_mb = {0.25, 1};
  c.warmup = 1;
  c.iters = 2;
  c.quiet = true;
  c.receiver_exe = bench_binary();
  c.argv = {"refit-bench", "(test)"};
  return c;
}

// Runs the bench binary with these arguments; returns its exit code, stdout in `out` (and stderr
// in the file `err_file` when given).
int run_binary(const std::vector<std::string>& args, std::string& out, const std::string& err_file = "") {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  std::vector<std::string> storage{bench_binary()};
  storage.insert(storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : storage) argv.push_back(s.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::close(fds[0]);
    if (!err_file.empty()) {
      const int err = ::open(err_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (err >= 0) ::dup2(err, 2);
    }
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// A receiver started by hand (--role receiver, not --spawned) in its own process, as a user
// would: the bench binary, its stdout (JSON lines) read here, its stderr (the banner) in the file
// NAME.err of the scratch directory. Stopped with SIGTERM, as Ctrl-C would.
struct hand_receiver {
  hand_receiver(const scratch& s, const std::string& name, const std::vector<std::string>& args)
      : err_file(s.file(name + ".err")), process("/bin/sh", shell_args(err_file, args)) {
    ready = json::parse(process.read_line(std::chrono::seconds(60)));
    REQUIRE(ready["event"] == "ready");
  }
  ~hand_receiver() { (void)stop(); }
  hand_receiver(const hand_receiver&) = delete;
  hand_receiver& operator=(const hand_receiver&) = delete;

  // Its wait status.
  int stop() {
    if (!stopped) {
      ::kill(process.pid(), SIGTERM);
      status = process.finish(std::chrono::seconds(10));
      stopped = true;
    }
    return status;
  }
  [[nodiscard]] std::string endpoint() const { return ready["endpoint"].get<std::string>(); }
  [[nodiscard]] std::string report() const { return ready.value("report", std::string()); }
  [[nodiscard]] std::string banner() const { return read_file(err_file); }

  // sh execs the bench in its own place (same pid), with stderr redirected.
  static std::vector<std::string> shell_args(const std::string& err_file, const std::vector<std::string>& args) {
    std::vector<std::string> a{"-c", "exec \"$0\" \"$@\" 2>'" + err_file + "'", bench_binary(), "--role", "receiver"};
    a.insert(a.end(), args.begin(), args.end());
    return a;
  }

  std::string err_file;
  child_process process;
  json ready;
  bool stopped = false;
  int status = 0;
};

// A streamer started by hand against `rx`, run in this process.
config hand_streamer(const hand_receiver& rx) {
  config c = short_run("tiny");
  c.side = role::streamer;
  c.connect = rx.endpoint();
  c.report = rx.report();
  return c;
}

// The lines of the table that are rows (not '#').
std::vector<std::string> table_rows(const std::string& out) {
  std::vector<std::string> rows;
  std::istringstream in(out);
  for (std::string l; std::getline(in, l);)
    if (!l.empty() && !l.starts_with("#")) rows.push_back(l);
  return rows;
}

std::string last_word(const std::string& line) {
  const auto end = line.find_last_not_of(' ');
  const auto start = line.find_last_of(' ', end);
  return line.substr(start + 1, end - start);
}

}  // namespace

// ---------------------------------------------------------------- safetensors

TEST_CASE("a good safetensors header gives every tensor in file order with its data offset", "[bench]") {
  scratch s;
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"b.weight":{"dtype":"F32","shape":[2,3],"data_offsets":[8,32]},)"
      R"("a.bias":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]},"c.empty":{"dtype":"I64","shape":[0],"data_offsets":[32,32]}})";
  const std::string path = s.file("model.safetensors");
  write_file(path, safetensors(header, std::string(32, 'x')));
  const manifest m = load_manifest(path);
  REQUIRE(m.entries.size() == 3);
  CHECK(m.entries[0].meta == tensor_meta{"a.bias", dtype::bf16, {4}});
  CHECK(m.entries[1].meta == tensor_meta{"b.weight", dtype::f32, {2, 3}});
  CHECK(m.entries[2].meta.name == "c.empty");
  CHECK(m.entries[0].offset == 8 + header.size());
  CHECK(m.entries[1].offset == 8 + header.size() + 8);
  CHECK(m.entries[1].file == 0);
  CHECK(m.files == std::vector<std::string>{path});
  CHECK(m.bytes() == 32);
  CHECK(m.name == "model.safetensors");
}

TEST_CASE("each kind of bad safetensors file gets an error naming the file, the entry and the fault", "[bench]") {
  scratch s;
  const std::string path = s.file("bad.safetensors");
  auto with = [](const std::string& entry, std::size_t data = 64) {
    return safetensors("{\"w\":" + entry + "}", std::string(data, 'x'));
  };

  SECTION("a file shorter than the length field") {
    const auto msg = manifest_error(path, "abc");
    CHECK_THAT(msg, Catch::Contains("truncated") && Catch::Contains(path));
  }
  SECTION("a length past the end of the file") {
    std::string bytes = safetensors("{}", "");
    const std::uint64_t n = 4096;
    std::memcpy(bytes.data(), &n, 8);
    CHECK_THAT(manifest_error(path, bytes), Catch::Contains("header length 4096 runs past the end of the file"));
  }
  SECTION("a length past the format's limit") {
    std::string bytes(16, '\0');
    const std::uint64_t n = 1ull << 40;
    std::memcpy(bytes.data(), &n, 8);
    CHECK_THAT(manifest_error(path, bytes), Catch::Contains("100 MB limit"));
  }
  SECTION("a header that is not JSON") {
    CHECK_THAT(manifest_error(path, safetensors("{\"w\": [1, 2", "")), Catch::Contains("header is not valid JSON"));
  }
  SECTION("an unknown dtype") {
    const auto msg = manifest_error(path, with(R"({"dtype":"Q7","shape":[2],"data_offsets":[0,2]})"));
    CHECK_THAT(msg, Catch::Contains("tensor 'w'") && Catch::Contains("unknown dtype 'Q7'") && Catch::Contains(path));
  }
  SECTION("a shape whose size is not the span of its offsets") {
    const auto msg = manifest_error(path, with(R"({"dtype":"F16","shape":[3,4],"data_offsets":[0,20]})"));
    CHECK_THAT(msg, Catch::Contains("tensor 'w'") && Catch::Contains("size mismatch") && Catch::Contains("24 bytes") &&
                        Catch::Contains("span 20 bytes"));
  }
  SECTION("offsets past the end of the data") {
    const auto msg = manifest_error(path, with(R"({"dtype":"U8","shape":[100],"data_offsets":[0,100]})", 64));
    CHECK_THAT(msg, Catch::Contains("tensor 'w'") && Catch::Contains("out of range") && Catch::Contains("64 bytes"));
  }
  SECTION("two tensors sharing bytes") {
    const std::string header =
        R"({"x":{"dtype":"U8","shape":[16],"data_offsets":[0,16]},"y":{"dtype":"U8","shape":[8],"data_offsets":[8,16]}})";
    CHECK_THAT(manifest_error(path, safetensors(header, std::string(16, 'x'))),
               Catch::Contains("tensor 'y'") && Catch::Contains("overlap") && Catch::Contains("'x'"));
  }
  SECTION("an entry without offsets") {
    CHECK_THAT(manifest_error(path, with(R"({"dtype":"U8","shape":[1]})")),
               Catch::Contains("missing \"data_offsets\""));
  }
  SECTION("a negative dimension") {
    CHECK_THAT(manifest_error(path, with(R"({"dtype":"U8","shape":[-1],"data_offsets":[0,0]})")),
               Catch::Contains("not a non-negative integer"));
  }
  SECTION("offsets that end before they begin") {
    CHECK_THAT(manifest_error(path, with(R"({"dtype":"U8","shape":[0],"data_offsets":[9,1]})")),
               Catch::Contains("end before they begin"));
  }
}

// ---------------------------------------------------------------- JSON manifests

TEST_CASE("a JSON manifest keeps its order and takes --dtype where an entry has none", "[bench]") {
  const manifest m = parse_json_manifest(
      R"({"z.weight": {"dtype": "float32", "shape": [8, 2]}, "a.weight": {"shape": [3]}, "m": {"dtype": "torch.bfloat16", "shape": []}})",
      "m.json", dtype::f16);
  REQUIRE(m.entries.size() == 3);
  CHECK(m.entries[0].meta == tensor_meta{"z.weight", dtype::f32, {8, 2}});
  CHECK(m.entries[1].meta == tensor_meta{"a.weight", dtype::f16, {3}});
  CHECK(m.entries[2].meta == tensor_meta{"m", dtype::bf16, {}});
  CHECK(m.entries[0].file == -1);
  CHECK(m.name == "m");
  CHECK(m.bytes() == 64 + 6 + 2);
}

TEST_CASE("a bad JSON manifest is refused with the file, the entry and the fault", "[bench]") {
  auto err = [](const std::string& text) {
    try {
      (void)parse_json_manifest(text, "bad.json", dtype::bf16);
    } catch (const refit::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK_THAT(err("{\"a\": "), Catch::Contains("manifest bad.json: not valid JSON"));
  CHECK_THAT(err("[1]"), Catch::Contains("must be a JSON object"));
  CHECK_THAT(err(R"({"a": {"dtype": "int3", "shape": [1]}})"), Catch::Contains("tensor 'a': unknown dtype 'int3'"));
  CHECK_THAT(err(R"({"a": {"dtype": "bf16"}})"), Catch::Contains("tensor 'a': missing \"shape\""));
  CHECK_THAT(err(R"({"a": {"shape": [2, "x"]}})"), Catch::Contains("tensor 'a'"));
  CHECK_THAT(err("{}"), Catch::Contains("no tensors"));
}

TEST_CASE("a sharded checkpoint's index reads every shard's header", "[bench]") {
  scratch s;
  write_file(s.file("m-1.safetensors"),
             safetensors(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", "abcd"));
  write_file(s.file("m-2.safetensors"), safetensors(R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "ef"));
  write_file(s.file("model.safetensors.index.json"),
             R"({"metadata": {}, "weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}})");
  const manifest m = load_manifest(s.file("model.safetensors.index.json"));
  REQUIRE(m.entries.size() == 2);
  CHECK(m.files.size() == 2);
  CHECK(m.entries[1].meta.name == "b");
  CHECK(m.entries[1].file == 1);
}

TEST_CASE("the JSON outline gives the keys' order, those of the objects asked for, and each fault", "[bench]") {
  const json_outline o = outline_json(
      R"({"z": 1, "weight_map": {"y": "a", "b": "c"}, "m": [{"k": 1}], "s": {"q": 2}, "weight": {"x": 0}})",
      {"weight_map", "m", "weight"}, 64);
  CHECK(o.keys == std::vector<std::string>{"z", "weight_map", "m", "s", "weight"});
  CHECK(o.under.at("weight_map") == std::vector<std::string>{"y", "b"});
  CHECK(o.under.at("weight") == std::vector<std::string>{"x"});
  CHECK(o.under.count("m") == 0);  // an array's objects are not the key's object
  CHECK(o.under.count("s") == 0);  // not asked for
  CHECK_FALSE(o.repeated);
  CHECK_FALSE(o.too_deep);
  CHECK_FALSE(o.invalid);

  CHECK(outline_json(R"({"a": 1, "b": {"a": 2}, "a": 3})", {}, 64).repeated ==
        std::make_pair(std::string("a"), std::string()));
  CHECK(outline_json(R"({"w": {"a": 1, "a": 2}})", {"w"}, 64).repeated ==
        std::make_pair(std::string("a"), std::string("w")));
  CHECK_FALSE(outline_json(R"({"w": {"a": 1, "a": 2}})", {}, 64).repeated);  // not looked into

  CHECK(outline_json("[[[1]]]", {}, 3).keys.empty());
  CHECK_FALSE(outline_json("[[[1]]]", {}, 3).too_deep);
  CHECK(outline_json("[[[[1]]]]", {}, 3).too_deep);
  const std::string bad = R"({"a": [1, })";
  std::string parse_what;
  try {
    const json parsed = json::parse(bad);
    FAIL("parsed: " << parsed.dump());
  } catch (const json::exception& e) {
    parse_what = e.what();
  }
  REQUIRE_FALSE(parse_what.empty());
  CHECK(outline_json(bad, {}, 64).invalid == parse_what);
}

TEST_CASE("manifests of tens of thousands of tensors keep the text's order; a name given twice is refused", "[bench]") {
  // Names in an order no sort gives: a document of sorted maps would lose it.
  const std::size_t n = 20'000;
  std::vector<std::string> names;
  for (std::size_t i = 0; i < n; ++i) names.push_back(fmt::format("layers.{}.w", (i * 7919) % n));
  std::string text = "{";
  std::string header = "{";
  for (std::size_t i = 0; i < n; ++i) {
    text += fmt::format("{}\"{}\": {{\"dtype\": \"F32\", \"shape\": [2]}}", i ? ", " : "", names[i]);
    header += fmt::format(R"({}"{}":{{"dtype":"F32","shape":[2],"data_offsets":[{},{}]}})", i ? "," : "", names[i],
                          8 * i, 8 * i + 8);
  }
  text += "}";
  header += "}";
  const manifest m = parse_json_manifest(text, "big.json", dtype::bf16);
  const std::string file = safetensors(header, std::string(8 * n, 'x'));
  const manifest st = parse_safetensors(file.data(), file.size(), file.size(), "big.safetensors");
  REQUIRE(m.entries.size() == n);
  REQUIRE(st.entries.size() == n);
  std::size_t out_of_order = 0;
  for (std::size_t i = 0; i < n; ++i) {
    out_of_order += m.entries[i].meta.name != names[i] ? 1 : 0;
    out_of_order += st.entries[i].meta.name != names[i] ? 1 : 0;
  }
  CHECK(out_of_order == 0);
  CHECK(m.entries[n - 1].meta == tensor_meta{names[n - 1], dtype::f32, {2}});
  CHECK(st.entries[n - 1].offset == 8 + header.size() + 8 * (n - 1));

  const auto refused = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const refit::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(refused([] {
          (void)parse_json_manifest(R"({"a": {"shape": [1]}, "b": {"shape": [1]}, "a": {"shape": [2]}})", "m.json",
                                    dtype::bf16);
        }) == "manifest m.json: 'a' is a key twice: a tensor is listed once");
  CHECK(refused([] {
          (void)parse_json_manifest(R"({"weight_map": {"a": "m-1.safetensors", "a": "m-2.safetensors"}})",
                                    "/ckpt/i.json", dtype::bf16);
        }) == "manifest /ckpt/i.json: 'a' is a key twice in \"weight_map\": a tensor is listed once");
  const std::string twice =
      safetensors(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],)"
                  R"("data_offsets":[1,2]}})",
                  "xy");
  CHECK(refused([&] { (void)parse_safetensors(twice.data(), twice.size(), twice.size(), "t.safetensors"); }) ==
        "manifest t.safetensors: 'a' is a key twice: a tensor is listed once");
}

TEST_CASE("a sharded checkpoint's shards come in the order the index first names them", "[bench]") {
  scratch s;
  write_file(s.file("m-1.safetensors"),
             safetensors(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", "abcd"));
  write_file(s.file("m-2.safetensors"), safetensors(R"({"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                                                    R"("c":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}})",
                                                    "efg"));
  write_file(s.file("model.safetensors.index.json"),
             R"({"weight_map": {"x": "m-2.safetensors", "a": "m-1.safetensors", "c": "m-2.safetensors"}})");
  const manifest m = load_manifest(s.file("model.safetensors.index.json"));
  REQUIRE(m.entries.size() == 3);
  CHECK(m.files == std::vector<std::string>{s.file("m-2.safetensors"), s.file("m-1.safetensors")});
  CHECK(m.entries[0].meta.name == "x");
  CHECK(m.entries[1].meta.name == "c");
  CHECK(m.entries[2].meta.name == "a");
  CHECK(m.entries[2].file == 1);
}

// ---------------------------------------------------------------- presets

TEST_CASE("built-in models add up to their published parameter counts", "[bench]") {
  CHECK(preset("qwen2.5-0.5b").params() == 494'032'768ull);
  CHECK(preset("llama3-8b").params() == 8'030'261'248ull);
  CHECK(preset("qwen2.5-7b").params() == 7'615'616'512ull);
  CHECK(preset("qwen3-30b-a3b").params() == 30'532'122'624ull);
  CHECK(preset("mixtral-8x7b").params() == 46'702'792'704ull);

  const manifest qwen = preset("qwen2.5-0.5b");
  CHECK(qwen.entries.size() == 290);  // tied embeddings: no lm_head
  CHECK(qwen.bytes() == 2 * 494'032'768ull);
  CHECK(std::none_of(qwen.entries.begin(), qwen.entries.end(),
                     [](const manifest_entry& e) { return e.meta.name == "lm_head.weight"; }));
  const manifest llama = preset("llama3-8b");
  CHECK(llama.entries.size() == 291);
  CHECK(llama.bytes() == 16'060'522'496ull);
  CHECK(llama.entries.front().meta == tensor_meta{"model.embed_tokens.weight", dtype::bf16, {128256, 4096}});
  CHECK(preset("qwen3-30b-a3b").entries.size() > 10000);
  CHECK(preset("qwen2.5-0.5b", dtype::f32).bytes() == 4 * 494'032'768ull);
}

TEST_CASE("an unknown model name is refused with the list of built-in ones", "[bench]") {
  CHECK_THROWS_WITH(preset("gpt-5"), Catch::Contains("unknown model 'gpt-5'") && Catch::Contains("llama3-8b"));
}

// ---------------------------------------------------------------- data

TEST_CASE("random tensor data is deterministic, not zeros, and the same when filled in pieces", "[bench]") {
  std::vector<std::byte> a(1000), b(1000), c(1000);
  fill_random(a.data(), a.size(), 7);
  fill_random(b.data(), b.size(), 7);
  CHECK(a == b);
  fill_random(c.data(), 13, 7);
  fill_random(c.data() + 13, 1000 - 13, 7, 13);
  CHECK(a == c);
  fill_random(b.data(), b.size(), 8);
  CHECK(a != b);
  CHECK(std::count(a.begin(), a.end(), std::byte{0}) < 20);
}

TEST_CASE("the checksum update after a flipped byte equals the checksum of the flipped data", "[bench]") {
  for (const std::uint64_t n : {1ull, 7ull, 8ull, 13ull, 4096ull + 5}) {
    std::vector<std::byte> v(n);
    fill_random(v.data(), n, n);
    std::uint64_t sum = copy::checksum(v.data(), n);
    for (std::uint64_t off : {std::uint64_t{0}, n / 2, n - 1}) {
      const auto old = static_cast<std::uint8_t>(v[off]);
      const auto now = static_cast<std::uint8_t>(old ^ 0xa7);
      v[off] = std::byte{now};
      sum = checksum_after_flip(sum, n, off, old, now);
      CHECK(sum == copy::checksum(v.data(), n));
    }
  }
}

// ---------------------------------------------------------------- command line

TEST_CASE("the command line defaults to host_shm, qwen2.5-0.5b and 2 x 64 MiB, and sweeps lists", "[bench]") {
  int code = -1;
  const char* none[] = {"refit-bench"};
  const auto d = parse_args(static_cast<int>(std::size(none)), none, code);
  REQUIRE(d);
  CHECK(d->transports == std::vector<transport_kind>{transport_kind::host_shm});
  CHECK(d->models == std::vector<std::string>{"qwen2.5-0.5b"});
  CHECK(d->buffer_mb == std::vector<double>{64});
  CHECK(d->buffer_counts == std::vector<std::size_t>{2});
  CHECK(d->warmup == 1);
  CHECK(d->iters == 5);
  CHECK(d->side == role::both);

  const char* sweep[] = {"refit-bench", "--buffer-mb", "16,64,256,1024", "--transport",   "all",
                         "--buffers",   "2,3",         "--model",        "llama3-8b,tiny"};
  const auto s = parse_args(static_cast<int>(std::size(sweep)), sweep, code);
  REQUIRE(s);
  CHECK(s->buffer_mb == std::vector<double>{16, 64, 256, 1024});
  CHECK(s->transports == built_transports());
  CHECK(s->buffer_counts == std::vector<std::size_t>{2, 3});
  CHECK(s->models.size() == 2);

  const char* engines[] = {"refit-bench", "--engine", "kernel,memcpy_batch,memcpy_each"};
  const auto e = parse_args(static_cast<int>(std::size(engines)), engines, code);
  REQUIRE(e);
  CHECK(e->engines ==
        std::vector<copy_engine>{copy_engine::kernel, copy_engine::memcpy_batch, copy_engine::memcpy_each});
  CHECK(d->engines == std::vector<copy_engine>{copy_engine::automatic});
  const char* bad_engine[] = {"refit-bench", "--engine", "warp"};
  CHECK_THROWS_WITH(parse_args(static_cast<int>(std::size(bad_engine)), bad_engine, code),
                    Catch::Contains("--engine warp"));
  const char* bad_align[] = {"refit-bench", "--alignment", "100"};
  CHECK_THROWS_WITH(parse_args(static_cast<int>(std::size(bad_align)), bad_align, code),
                    Catch::Contains("power of two"));
  const char* one_buffer[] = {"refit-bench", "--buffers", "1"};
  CHECK_THROWS_WITH(parse_args(static_cast<int>(std::size(one_buffer)), one_buffer, code),
                    Catch::Contains("at least 2"));
  CHECK_FALSE(d->vmm_sources);
  CHECK(d->dests == dest_memory::torch);
  const char* vmm[] = {"refit-bench", "--source-memory", "vmm", "--dest-memory", "vmm"};
  const auto v = parse_args(static_cast<int>(std::size(vmm)), vmm, code);
  REQUIRE(v);
  CHECK(v->vmm_sources);
  CHECK(v->dests == dest_memory::vmm);
  const char* arena[] = {"refit-bench", "--dest-memory", "arena"};
  const auto a = parse_args(static_cast<int>(std::size(arena)), arena, code);
  REQUIRE(a);
  CHECK(a->dests == dest_memory::arena);
  CHECK(std::string(to_string(a->dests)) == "arena");
  // The weights are the receiver's to allocate: a spawned receiver is told how, unless torch's way.
  const auto spawned = receiver_args(*a, transport_kind::cuda_ipc, "tiny", "ipc:///x");
  const auto flag = std::find(spawned.begin(), spawned.end(), "--dest-memory");
  REQUIRE(flag != spawned.end());
  CHECK(*std::next(flag) == "arena");
  const auto plain_args = receiver_args(*d, transport_kind::cuda_ipc, "tiny", "ipc:///x");
  CHECK(std::find(plain_args.begin(), plain_args.end(), "--dest-memory") == plain_args.end());
  const char* old_name[] = {"refit-bench", "--dest-memory", "cudamalloc"};  // ambiguous now: torch's or one arena
  code = 0;
  CHECK_FALSE(parse_args(static_cast<int>(std::size(old_name)), old_name, code));
  CHECK(code != 0);
  const char* bad_memory[] = {"refit-bench", "--source-memory", "pinned"};
  code = 0;
  CHECK_FALSE(parse_args(static_cast<int>(std::size(bad_memory)), bad_memory, code));  // CLI11 says why
  CHECK(code != 0);
  const char* nccl[] = {"refit-bench", "--transport", "nccl"};
  const auto n = parse_args(static_cast<int>(std::size(nccl)), nccl, code);
  REQUIRE(n);
  CHECK(n->transports == std::vector<transport_kind>{transport_kind::nccl});
#if !REFIT_HAVE_NCCL
  CHECK_THROWS_WITH(make_path(n->transports.front(), *n), Catch::Contains("not built into this bench"));
#endif
}

TEST_CASE("--receivers spreads nccl receivers over the GPUs after the streamer's, and all runs nccl only where it can",
          "[bench]") {
  int code = -1;
  const char* none[] = {"refit-bench"};
  const auto d = parse_args(static_cast<int>(std::size(none)), none, code);
  REQUIRE(d);
  CHECK(d->receivers == 1);
  const char* three[] = {"refit-bench", "--transport", "nccl", "--receivers", "3", "--device", "1"};
  const auto t = parse_args(static_cast<int>(std::size(three)), three, code);
  REQUIRE(t);
  CHECK(t->receivers == 3);
  CHECK_FALSE(t->nccl_optional);  // named: it must run (or fail saying why)
  const char* all[] = {"refit-bench", "--transport", "all"};
  const auto a = parse_args(static_cast<int>(std::size(all)), all, code);
  REQUIRE(a);
  CHECK(a->nccl_optional);  // from "all": skipped with a note below 2 GPUs
  const char* zero[] = {"refit-bench", "--transport", "nccl", "--receivers", "0"};
  CHECK_THROWS_WITH(parse_args(static_cast<int>(std::size(zero)), zero, code), Catch::Contains("--receivers"));

  // Receiver k sits on the k-th GPU after the streamer's, wrapping around.
  CHECK(receiver_device(0, 0, 2) == 1);
  CHECK(receiver_device(0, 2, 4) == 3);
  CHECK(receiver_device(1, 0, 4) == 2);
  CHECK(receiver_device(1, 2, 4) == 0);
  CHECK(receiver_device(3, 0, 4) == 0);

  // Each spawned receiver gets its own GPU; the ceiling ranks get the communicator's id and their rank.
  const auto args = receiver_args(*t, transport_kind::nccl, "tiny", "ipc:///x/receiver-2", copy_engine::kernel, 0);
  const auto dev = std::find(args.begin(), args.end(), "--device");
  REQUIRE(dev != args.end());
  CHECK(*std::next(dev) == "0");
  const auto own = receiver_args(*t, transport_kind::nccl, "tiny", "ipc:///x/receiver-0");
  CHECK(*std::next(std::find(own.begin(), own.end(), "--device")) == "1");
  const auto ceil = ceiling_args(*t, "00ff", 2, 4, 3);
  const std::vector<std::string> expect_tail{"--nccl-ceiling", "00ff", "--nccl-rank", "2", "--nccl-ranks", "4"};
  CHECK(std::search(ceil.begin(), ceil.end(), expect_tail.begin(), expect_tail.end()) != ceil.end());
  std::vector<const char*> ceil_argv{"refit-bench"};
  for (const auto& s : ceil) ceil_argv.push_back(s.c_str());
  const auto back = parse_args(static_cast<int>(ceil_argv.size()), ceil_argv.data(), code);
  REQUIRE(back);
  CHECK(back->side == role::receiver);
  CHECK(back->nccl_ceiling_id == "00ff");
  CHECK(back->nccl_rank == 2);
  CHECK(back->nccl_ranks == 4);
  CHECK(back->device == 3);
  CHECK(back->spawned);

  // The ncclUniqueId travels as hex.
  unsigned char id[128];
  for (std::size_t i = 0; i < sizeof id; ++i) id[i] = static_cast<unsigned char>(i * 37 + 11);
  const std::string hex = to_hex(id, sizeof id);
  CHECK(hex.size() == 256);
  const auto raw = from_hex(hex);
  REQUIRE(raw);
  CHECK(std::memcmp(raw->data(), id, sizeof id) == 0);
  CHECK(from_hex("abc") == std::nullopt);
  CHECK(from_hex("zz") == std::nullopt);
  CHECK(from_hex("A0") == std::string("\xa0"));
}

TEST_CASE("the preamble says how nccl rows are floored and lists the notes; JSON rows carry the receiver count",
          "[bench]") {
  preamble p;
  p.transports = {"nccl"};
  p.notes = {"nccl: 3 receiver processes (--receivers), one GPU each"};
  std::ostringstream out;
  write_preamble(out, p);
  CHECK_THAT(out.str(), Catch::Contains("# note      : nccl: 3 receiver processes"));
  CHECK_THAT(out.str(), Catch::Contains("floor = 1 x bytes / ceiling (one pass"));
  CHECK_THAT(out.str(), Catch::Contains("+in-place: every entry in place, 1 GiB batches"));
  row r;
  r.transport = "nccl";
  r.receivers = 3;
  r.model = "tiny";
  r.median_ms = r.min_ms = r.max_ms = 1;
  const json j = to_json(p, {r});
  CHECK(j["rows"][0]["receivers"] == 3);
  CHECK(j["preamble"]["notes"].size() == 1);
  std::ostringstream shm;
  preamble q;
  q.transports = {"host_shm"};
  write_preamble(shm, q);
  CHECK_THAT(shm.str(), !Catch::Contains("nccl rows"));
}

// ---------------------------------------------------------------- report

TEST_CASE("the table has a preamble, two header rows, fixed-width rows and a footer; JSON and SVG mirror it",
          "[bench]") {
  preamble p;
  p.refit_version = "0.1.0";
  p.host = "h";
  p.transports = {"host_shm"};
  p.models = {{"tiny", 27, 3977728, 1988864, 512000}};
  std::vector<row> rows;
  for (const std::uint64_t mb : {1, 4, 16}) {
    row r;
    r.transport = "host_shm";
    r.model = "tiny";
    r.buffer_bytes = mb << 20;
    r.buffers = 2;
    r.tensors = 27;
    r.bytes = 3977728;
    r.median_ms = 1.5;
    r.min_ms = 1.25;
    r.max_ms = 2;
    r.gbps = 2.65;
    r.ceiling_gbps = 10;
    r.floor_ms = 0.8;
    r.ratio = 0.53;
    r.apply_ms = mb == 16 ? -1 : 0.5;
    rows.push_back(r);
  }
  std::ostringstream out;
  write_preamble(out, p);
  write_header(out);
  for (const auto& r : rows) write_row(out, r);
  write_footer(out, rows);
  std::vector<std::string> lines;
  std::istringstream in(out.str());
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  std::vector<std::string> data;
  for (const auto& l : lines)
    if (!l.starts_with("#")) data.push_back(l);
  REQUIRE(data.size() == 3);
  CHECK(data[0].size() == data[1].size());
  CHECK(data[1].size() == data[2].size());
  CHECK_THAT(data[2], Catch::Contains("n/a"));
  CHECK_THAT(out.str(), Catch::Contains("# Wrong values          : 0 OK"));
  CHECK_THAT(out.str(), Catch::Contains("(GB/s)"));

  const json j = to_json(p, rows);
  CHECK(j["rows"].size() == 3);
  CHECK(j["wrong"] == 0);
  CHECK(j["rows"][1]["buffer_memory_bytes"] == 8ull << 20);
  CHECK(j["rows"][2]["apply_ms"].is_null());
  CHECK(j["preamble"]["models"][0]["name"] == "tiny");

  const std::string svg = to_svg(p, rows);
  CHECK(svg.starts_with("<?xml"));
  CHECK_THAT(svg, Catch::Contains("<svg") && Catch::Contains("</svg>") && Catch::Contains("ceiling") &&
                      Catch::Contains("<polyline"));

  CHECK_THAT(svg, !Catch::Contains("log scale"));
  // A transport 100 times faster than another: the y axis turns logarithmic, and long model
  // names are cut to keep the rows fixed-width.
  auto wide = rows;
  wide[0].transport = "cuda_ipc";
  wide[0].gbps = 600;
  wide[0].ceiling_gbps = 1500;
  wide[0].model = "a-very-long-model-name.safetensors";
  CHECK_THAT(to_svg(p, wide), Catch::Contains("log scale"));
  std::ostringstream long_row, short_row;
  write_row(long_row, wide[0]);
  write_row(short_row, wide[1]);
  CHECK(long_row.str().size() == short_row.str().size());

  rows[1].wrong = 3;
  std::ostringstream bad;
  write_footer(bad, rows);
  CHECK_THAT(bad.str(), Catch::Contains("3 FAILED"));
}

// ---------------------------------------------------------------- end to end

TEST_CASE("a short host_shm run prints a row per buffer size and verifies every refit", "[bench][e2e]") {
  scratch s;
  config c = short_run("tiny");
  c.json_file = s.file("out.json");
  c.plot_file = s.file("out.svg");
  std::ostringstream out;
  CHECK(run(c, out) == 0);
  INFO(out.str());
  CHECK_THAT(out.str(), Catch::Contains("# Wrong values          : 0 OK"));
  CHECK_THAT(out.str(), Catch::Contains("host_shm") && Catch::Contains("tiny"));
  std::ifstream f(c.json_file);
  const json j = json::parse(f);
  REQUIRE(j["rows"].size() == 2);
  for (const auto& r : j["rows"]) {
    CHECK(r["wrong"] == 0);
    CHECK(r["tensors"] == 27);
    CHECK(r["time_ms"]["median"].get<double>() > 0);
    CHECK(r["ceiling_gbps"].get<double>() > 0);
    CHECK(r["batches"].get<std::uint64_t>() >= 1);
  }
  CHECK(j["rows"][0]["buffer_bytes"] == 256 << 10);
  CHECK(j["ok"] == true);
  CHECK(fs::file_size(c.plot_file) > 1000);
}

namespace {

/// Runs `c` (the tiny model, one 1 MiB row) with its JSON in `s`; checks that it verified, and
/// returns the row; `text` gets the table.
json one_tiny_row(config c, scratch& s, const std::string& name, std::string& text) {
  c.buffer_mb = {1};
  c.json_file = s.file(name);
  std::ostringstream out;
  CHECK(run(c, out) == 0);
  text = out.str();
  CHECK_THAT(text, Catch::Contains("# Wrong values          : 0 OK"));
  std::ifstream f(c.json_file);
  const json j = json::parse(f);
  REQUIRE(j["rows"].size() == 1);
  return j["rows"][0];
}

}  // namespace

TEST_CASE("--split times each row's smallest tensor alone as subset versions, verified, under the row",
          "[bench][e2e]") {
  scratch s;
  config c = short_run("tiny");
  c.split = true;
  std::string text;
  const json r = one_tiny_row(c, s, "out.json", text);
  INFO(text);
  CHECK_THAT(text, Catch::Contains("#   split: fixed ") &&
                       Catch::Contains(" ms a refit (its smallest tensor alone, a subset version, same session)"));
  CHECK(r["wrong"] == 0);
  CHECK(r["fixed_ms"].get<double>() > 0);
  CHECK(r["rest_ratio"].get<double>() >= 0);
  // Without --split the row says nothing of it.
  const json plain = one_tiny_row(short_run("tiny"), s, "plain.json", text);
  CHECK_THAT(text, !Catch::Contains("split:"));
  CHECK(plain["fixed_ms"].is_null());
}

TEST_CASE("--control-lane 0 sends the requests through ZeroMQ and labels the row +zmq", "[bench][e2e]") {
  scratch s;
  config c = short_run("tiny");
  c.lane = false;
  std::string text;
  const json r = one_tiny_row(c, s, "out.json", text);
  INFO(text);
  CHECK(r["engine"] == "memcpy+zmq");
  CHECK(r["wrong"] == 0);
  // Through the lane (the default) the label says nothing of it.
  CHECK(one_tiny_row(short_run("tiny"), s, "lane.json", text)["engine"] == "memcpy");
}

TEST_CASE("a tensor larger than the buffer and odd sizes from a JSON manifest arrive intact", "[bench][e2e]") {
  scratch s;
  write_file(s.file("odd.json"),
             R"({"big": {"dtype": "f32", "shape": [1000, 1001]}, "odd": {"dtype": "u8", "shape": [13]},
                 "empty": {"dtype": "bf16", "shape": [0, 4]}, "scalar": {"dtype": "f64", "shape": []}})");
  config c = short_run("tiny");
  c.manifest_file = s.file("odd.json");
  c.buffer_mb = {1};
  c.json_file = s.file("out.json");
  std::ostringstream out;
  CHECK(run(c, out) == 0);
  std::ifstream f(c.json_file);
  const json j = json::parse(f);
  REQUIRE(j["rows"].size() == 1);
  CHECK(j["rows"][0]["wrong"] == 0);
  CHECK(j["rows"][0]["batches"].get<std::uint64_t>() >= 4);
}

TEST_CASE("--keep-whole 0 fills every batch up, chunking tensors at its edges, and still verifies", "[bench][e2e]") {
  // Three 600 KiB tensors in 1 MiB buffers: kept whole they need three batches; filled up, two.
  scratch s;
  write_file(s.file("three.json"), R"({"a": {"dtype": "u8", "shape": [614400]}, "b": {"dtype": "u8", "shape": [614400]},
                                       "c": {"dtype": "u8", "shape": [614400]}})");
  for (const bool whole : {true, false}) {
    config c = short_run("tiny");
    c.manifest_file = s.file("three.json");
    c.buffer_mb = {1};
    c.keep_whole = whole;
    c.json_file = s.file("out.json");
    std::ostringstream out;
    CHECK(run(c, out) == 0);
    CHECK_THAT(out.str(), Catch::Contains(whole ? "tensors kept whole where they fit a buffer"
                                                : "batches filled up (--keep-whole 0)"));
    std::ifstream f(c.json_file);
    const json j = json::parse(f);
    REQUIRE(j["rows"].size() == 1);
    CHECK(j["rows"][0]["wrong"] == 0);
    CHECK(j["rows"][0]["batches"] == (whole ? 3 : 2));
    CHECK(j["preamble"]["keep_whole"] == whole);
  }
  int code = -1;
  const char* argv[] = {"refit-bench", "--keep-whole", "0"};
  const auto parsed = parse_args(static_cast<int>(std::size(argv)), argv, code);
  REQUIRE(parsed);
  CHECK_FALSE(parsed->keep_whole);
}

TEST_CASE("--load refits the data of a safetensors file", "[bench][e2e]") {
  scratch s;
  std::string data(4096 + 6, '\0');
  fill_random(reinterpret_cast<std::byte*>(data.data()), data.size(), 3);
  const std::string path = s.file("w.safetensors");
  write_file(path, safetensors(R"({"a":{"dtype":"BF16","shape":[2048],"data_offsets":[0,4096]},)"
                               R"("b":{"dtype":"U8","shape":[6],"data_offsets":[4096,4102]}})",
                               data));
  config c = short_run("tiny");
  c.manifest_file = path;
  c.load = true;
  c.buffer_mb = {1};
  c.json_file = s.file("out.json");
  std::ostringstream out;
  CHECK(run(c, out) == 0);
  CHECK_THAT(out.str(), Catch::Contains("loaded from"));
  std::ifstream f(c.json_file);
  CHECK(json::parse(f)["wrong"] == 0);
  // The file itself is never written.
  std::ifstream back(path, std::ios::binary);
  std::string again((std::istreambuf_iterator<char>(back)), std::istreambuf_iterator<char>());
  CHECK(again.substr(again.size() - data.size()) == data);
}

TEST_CASE("a byte corrupted on the receiver is reported as wrong and fails the run", "[bench][e2e]") {
  scratch s;
  config c = short_run("tiny");
  c.buffer_mb = {1};
  c.corrupt_tensor = 5;
  c.json_file = s.file("out.json");
  std::ostringstream out;
  CHECK(run(c, out) == 1);
  CHECK_THAT(out.str(), Catch::Contains("FAILED"));
  std::ifstream f(c.json_file);
  const json j = json::parse(f);
  CHECK(j["rows"][0]["wrong"] == c.warmup + c.iters);  // one tensor per refit
  CHECK(j["ok"] == false);

  // The binary's exit code says so too.
  std::string stdout_text;
  const int code = run_binary(
      {"--model", "tiny", "--buffer-mb", "1", "--iters", "1", "--warmup", "0", "--quiet", "--corrupt-byte", "0"},
      stdout_text);
  CHECK(code == 1);
  CHECK_THAT(stdout_text, Catch::Contains("1 FAILED"));
}

TEST_CASE("the bench binary with a good run exits 0 and prints the table on stdout", "[bench][e2e]") {
  std::string stdout_text;
  const int code = run_binary({"--model", "tiny", "--buffer-mb", "1,2", "--iters", "2", "--quiet"}, stdout_text);
  CHECK(code == 0);
  CHECK_THAT(stdout_text, Catch::Contains("# refit-bench") && Catch::Contains("median") &&
                              Catch::Contains("# Wrong values          : 0 OK"));
}

TEST_CASE("--delta refits whole versions, then deltas of a fraction of the bytes, and checks the receiver's sum",
          "[bench][e2e]") {
  std::string out;
  const int code = run_binary({"--delta", "3", "--model", "tiny", "--buffer-mb", "1", "--iters", "2", "--warmup", "0",
                               "--delta-threads", "2", "--quiet"},
                              out);
  INFO(out);
  CHECK(code == 0);
  CHECK_THAT(out, Catch::Contains("# refit-bench --delta 3: tiny") && Catch::Contains("host_shm"));
  CHECK_THAT(out, Catch::Contains("(receiver's version checksum after version 6 matches)"));
  CHECK_THAT(out, Catch::Contains("# out of bounds/wrong values: 0"));
  // Three delta rows, each changing about 2 % of the elements and sending well under the version.
  std::istringstream lines(out);
  int deltas = 0;
  for (std::string line; std::getline(lines, line);) {
    std::istringstream row(line);
    std::string kind, step;
    double changed = 0, blk256 = 0, blk4k = 0, wire = 0, fraction = 0;
    if (!(row >> kind >> step >> changed >> blk256 >> blk4k >> wire >> fraction) || kind != "delta") continue;
    ++deltas;
    CHECK(changed > 0.5);
    CHECK(changed < 5);
    CHECK(fraction < 0.2);
  }
  CHECK(deltas == 3);
}

TEST_CASE("--delta-batch-mb sets the tensor bytes a delta batch covers; the receiver's sum still matches",
          "[bench][e2e]") {
  std::string out;
  const int code = run_binary({"--delta", "2", "--model", "tiny", "--buffer-mb", "1", "--iters", "1", "--warmup", "0",
                               "--delta-batch-mb", "0.0625", "--quiet"},
                              out);
  INFO(out);
  CHECK(code == 0);
  CHECK_THAT(out, Catch::Contains("; a delta batch covers 0.0625 MiB of tensors"));
  CHECK_THAT(out, Catch::Contains("(receiver's version checksum after version 4 matches)"));
  std::string defaulted;
  CHECK(run_binary({"--delta", "1", "--model", "tiny", "--buffer-mb", "1", "--iters", "1", "--warmup", "0", "--quiet"},
                   defaulted) == 0);
  CHECK_THAT(defaulted, Catch::Contains("; a delta batch covers 32 MiB of tensors (the default)"));
  scratch s;
  const std::string err = s.file("err.txt");
  std::string refused;
  CHECK(run_binary({"--delta", "1", "--model", "tiny", "--delta-batch-mb", "-1", "--quiet"}, refused, err) != 0);
  std::ifstream f(err);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  CHECK_THAT(text, Catch::Contains("--delta-batch-mb") && Catch::Contains("-1"));  // CLI11 says why
}

TEST_CASE("--delta is refused for more than one model, naming what it takes", "[bench]") {
  scratch s;
  const std::string err = s.file("err.txt");
  std::string out;
  CHECK(run_binary({"--delta", "2", "--model", "tiny,qwen2.5-0.5b", "--quiet"}, out, err) == 2);
  std::ifstream f(err);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  CHECK_THAT(text, Catch::Contains("refit-bench: error (invalid_argument): --delta: exactly one built-in --model"));
}

// ---------------------------------------------------------------- by hand: --role receiver / streamer

TEST_CASE("the default report endpoint sits next to an ipc endpoint and on a free port of a tcp one's host",
          "[bench]") {
  CHECK(default_report_endpoint("ipc:///run/user/1/refit-ab/receiver.sock") ==
        "ipc:///run/user/1/refit-ab/receiver.sock.report");
  CHECK(default_report_endpoint("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:*");
  CHECK(default_report_endpoint("tcp://gpu-node-7:40001") == "tcp://gpu-node-7:*");
  CHECK(default_report_endpoint("tcp://[::1]:5555") == "tcp://[::1]:*");
  for (const char* bad : {"ipc://", "tcp://", "tcp://[::1]", "inproc://x", "receiver.sock"})
    CHECK_THROWS_WITH(default_report_endpoint(bad),
                      Catch::Contains("no default report endpoint") && Catch::Contains("--report"));
}

TEST_CASE("a streamer started by hand without --report is refused and told what to pass", "[bench]") {
  int code = -1;
  const std::string expected =
      "refit-bench: --role streamer needs --report ENDPOINT, the report endpoint the receiver printed (\"report\" in "
      "its ready line and its banner), to verify every refit; or --no-verify to run unverified";
  const char* bare[] = {"refit-bench", "--role", "streamer", "--connect", "ipc:///x"};
  CHECK_THROWS_WITH(parse_args(static_cast<int>(std::size(bare)), bare, code), expected);
  // The same for a caller that builds the config itself.
  config c = short_run("tiny");
  c.side = role::streamer;
  c.connect = "ipc:///x";
  std::ostringstream out;
  CHECK_THROWS_WITH(run(c, out), expected);
  CHECK(out.str().empty());

  // The binary says so and exits 2, before measuring anything.
  scratch s;
  std::string stdout_text;
  CHECK(run_binary({"--role", "streamer", "--connect", "ipc:///x"}, stdout_text, s.file("err")) == 2);
  CHECK(stdout_text.empty());
  CHECK_THAT(read_file(s.file("err")),
             Catch::Contains("error (invalid_argument): --role streamer needs --report ENDPOINT"));

  const char* report[] = {"refit-bench", "--role", "streamer", "--connect", "ipc:///x", "--report", "ipc:///x.report"};
  const auto r = parse_args(static_cast<int>(std::size(report)), report, code);
  REQUIRE(r);
  CHECK(r->report == "ipc:///x.report");
  CHECK_FALSE(r->no_verify);
  const char* unverified[] = {"refit-bench", "--role", "streamer", "--connect", "ipc:///x", "--no-verify"};
  const auto u = parse_args(static_cast<int>(std::size(unverified)), unverified, code);
  REQUIRE(u);
  CHECK(u->no_verify);
  const char* both[] = {"refit-bench", "--role",   "streamer", "--connect",
                        "ipc:///x",    "--report", "ipc:///r", "--no-verify"};
  CHECK_THROWS_WITH(parse_args(static_cast<int>(std::size(both)), both, code), Catch::Contains("exclude each other"));
  const char* spawned[] = {"refit-bench", "--report", "ipc:///r"};
  CHECK_THROWS_WITH(parse_args(static_cast<int>(std::size(spawned)), spawned, code),
                    Catch::Contains("--report and --no-verify are for the sides run by hand"));
  const char* receiver[] = {"refit-bench", "--role", "receiver", "--report", "ipc:///r"};
  const auto rx = parse_args(static_cast<int>(std::size(receiver)), receiver, code);
  REQUIRE(rx);
  CHECK(rx->report == "ipc:///r");
}

TEST_CASE("the report log answers with a version's committed line, its abort or unknown, and keeps the last few",
          "[bench]") {
  report_log log(3);
  const auto committed = [](std::uint64_t v) {
    return json{{"event", "committed"}, {"version", v}, {"apply_ms", 0.5}, {"checksums", {v, v + 1}}};
  };
  const auto ask = [&](std::uint64_t v) { return json::parse(log.answer(json{{"version", v}}.dump())); };
  CHECK(ask(1) == json{{"event", "unknown"}, {"version", 1}});
  log.committed(committed(1));
  log.committed(committed(2));
  CHECK(ask(1) == committed(1));
  CHECK(ask(2) == committed(2));
  CHECK(ask(3)["event"] == "unknown");
  log.aborted(json{{"event", "aborted"}, {"error", "no message from the streamer for 100 ms"}});
  // The abort came after version 2's commit: it ended version 3.
  CHECK(ask(3) == json{{"event", "aborted"}, {"error", "no message from the streamer for 100 ms"}});
  CHECK(ask(2) == committed(2));
  log.committed(committed(4));
  CHECK(ask(3)["event"] == "aborted");
  CHECK(ask(4) == committed(4));
  CHECK(ask(5)["event"] == "unknown");  // nothing went wrong after 4
  // Three events kept: version 1 is forgotten, then version 2.
  CHECK(ask(1)["event"] == "unknown");
  CHECK(ask(2) == committed(2));
  log.committed(committed(5));
  CHECK(ask(2)["event"] == "unknown");
  CHECK(ask(4) == committed(4));
  CHECK(ask(5) == committed(5));
  CHECK(ask(3)["event"] == "unknown");  // its abort is still there, but not version 2's commit before it

  // An abort before any commit ended the first version.
  report_log fresh;
  fresh.aborted(json{{"event", "aborted"}, {"error", "BEGIN of version 1 arrived before END"}});
  CHECK(json::parse(fresh.answer(R"({"version": 1})"))["event"] == "aborted");
  for (const char* bad : {"", "[1]", "{\"version\": -1}", "{\"v\": 1}", "{\"version\": \"1\"}"})
    CHECK(json::parse(log.answer(bad))["event"] == "error");
}

TEST_CASE(
    "a receiver's report counts each checksum unlike the expected one and refuses anything but that version's commit",
    "[bench]") {
  manifest m;
  m.name = "two";
  m.entries = {{tensor_meta{"a", dtype::u8, {4}}}, {tensor_meta{"b", dtype::u8, {2}}}};
  const std::vector<std::uint64_t> expected{11, 22};
  config c;
  c.quiet = true;
  std::int64_t printed = 0;
  const auto line = [](std::uint64_t v, json sums) {
    return json{{"event", "committed"}, {"version", v}, {"checksums", std::move(sums)}};
  };
  CHECK(count_wrong(c, line(7, {11, 22}), 7, m, expected, "rx", "", printed) == 0);
  CHECK(count_wrong(c, line(7, {11, 23}), 7, m, expected, "rx", "", printed) == 1);
  CHECK(count_wrong(c, line(7, {10, 23}), 7, m, expected, "rx", "", printed) == 2);
  const auto refused = [&](const json& l) {
    try {
      (void)count_wrong(c, l, 7, m, expected, "the receiver at report endpoint ipc:///r", "", printed);
    } catch (const refit::error& e) {
      CHECK(e.code() == errc::protocol);
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK_THAT(refused(line(6, {11, 22})),
             Catch::Contains("the receiver at report endpoint ipc:///r did not commit version 7"));
  CHECK_THAT(refused(json{{"event", "unknown"}, {"version", 7}}),
             Catch::Contains("ipc:///r did not commit version 7: it said {\"event\":\"unknown\",\"version\":7}") &&
                 Catch::Contains("no record of that version"));
  CHECK_THAT(refused(json{{"event", "aborted"}, {"error", "sink threw"}}), Catch::Contains("sink threw"));
  CHECK_THAT(refused(line(7, {11})), Catch::Contains("sent 1 checksums for 2 tensors"));
  CHECK_THAT(refused(line(7, {11, "x"})), Catch::Contains("checksum 1"));
  CHECK_THAT(refused(json::array()), Catch::Contains("did not commit version 7"));
}

TEST_CASE("a streamer started by hand verifies every refit through the receiver's report endpoint", "[bench][e2e]") {
  scratch s;
  const std::string bind = "ipc://" + s.file("x");
  hand_receiver rx(s, "receiver", {"--bind", bind, "--model", "tiny"});
  CHECK(rx.endpoint() == bind);
  CHECK(rx.report() == bind + ".report");
  CHECK_THAT(rx.banner(), Catch::Contains("refit-bench --role streamer --connect " + bind + " --report " + bind +
                                          ".report --transport host_shm --model tiny"));

  config c = hand_streamer(rx);
  c.json_file = s.file("out.json");
  std::ostringstream out;
  CHECK(run(c, out) == 0);
  INFO(out.str());
  // Every row verified: 0 wrong, not n/a (and the receiver's apply time, from its report).
  const auto rows = table_rows(out.str());
  REQUIRE(rows.size() == 2);
  for (const auto& row : rows) {
    CHECK(last_word(row) == "0");
    CHECK_THAT(row, !Catch::Contains("n/a"));
  }
  CHECK_THAT(out.str(), Catch::Contains("# Wrong values          : 0 OK\n"));
  CHECK_THAT(out.str(), Catch::Contains("every refit verified through its report endpoint " + bind + ".report"));
  std::ifstream f(c.json_file);
  const json j = json::parse(f);
  REQUIRE(j["rows"].size() == 2);
  for (const auto& r : j["rows"]) {
    CHECK(r["wrong"] == 0);
    CHECK(r["apply_ms"].is_number());
  }
  CHECK(j["ok"] == true);

  // Ctrl-C ends the receiver cleanly, and its report socket file goes with it.
  const int status = rx.stop();
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK_FALSE(fs::exists(s.file("x.report")));
}

TEST_CASE("a byte corrupted on a receiver started by hand is reported as wrong and fails the streamer's run",
          "[bench][e2e]") {
  scratch s;
  hand_receiver rx(s, "receiver", {"--bind", "ipc://" + s.file("x"), "--model", "tiny", "--corrupt-byte", "0"});
  std::string stdout_text;
  const int code =
      run_binary({"--role", "streamer", "--connect", rx.endpoint(), "--report", rx.report(), "--model", "tiny",
                  "--buffer-mb", "1", "--warmup", "0", "--iters", "2", "--json", s.file("out.json")},
                 stdout_text, s.file("streamer.err"));
  INFO(stdout_text);
  CHECK(code == 1);
  CHECK_THAT(stdout_text, Catch::Contains("# Wrong values          : 2 FAILED"));
  const std::string err = read_file(s.file("streamer.err"));
  CHECK_THAT(err, Catch::Contains("WRONG: version 1 tensor 0 (model.embed_tokens.weight") &&
                      Catch::Contains("WRONG: version 2 tensor 0"));
  std::ifstream f(s.file("out.json"));
  const json j = json::parse(f);
  CHECK(j["rows"][0]["wrong"] == 2);  // one tensor per refit
  CHECK(j["ok"] == false);
}

TEST_CASE("a report endpoint nobody serves fails the run within the timeout, naming the endpoint", "[bench][e2e]") {
  scratch s;
  hand_receiver rx(s, "receiver", {"--bind", "ipc://" + s.file("x"), "--model", "tiny"});
  config c = hand_streamer(rx);
  c.report = "ipc://" + s.file("nobody");
  c.timeout_ms = 1500;
  c.buffer_mb = {1};
  std::ostringstream out;
  const auto t0 = std::chrono::steady_clock::now();
  std::string what;
  try {
    (void)run(c, out);
  } catch (const refit::error& e) {
    CHECK(e.code() == errc::timeout);
    what = e.what();
  }
  const auto waited = std::chrono::steady_clock::now() - t0;
  CHECK_THAT(what, Catch::Contains("the receiver at report endpoint " + c.report +
                                   " did not answer for version 1 within 1500 ms"));
  // Set-up, one refit and one unanswered request: nowhere near the default --timeout-ms (120 s),
  // with room for a sanitizer build.
  CHECK(waited < std::chrono::seconds(20));
  CHECK(table_rows(out.str()).empty());
}

TEST_CASE("another receiver's report endpoint answers unknown and the run fails quoting it", "[bench][e2e]") {
  scratch s;
  hand_receiver rx(s, "receiver", {"--bind", "ipc://" + s.file("x"), "--model", "tiny"});
  hand_receiver other(s, "other", {"--bind", "ipc://" + s.file("y"), "--model", "tiny"});
  config c = hand_streamer(rx);
  c.report = other.report();
  c.buffer_mb = {1};
  std::ostringstream out;
  std::string what;
  try {
    (void)run(c, out);
  } catch (const refit::error& e) {
    CHECK(e.code() == errc::protocol);
    what = e.what();
  }
  CHECK_THAT(what, Catch::Contains("the receiver at report endpoint " + other.report() +
                                   " did not commit version 1: it said {\"event\":\"unknown\",\"version\":1}"));
}

TEST_CASE("a receiver started by hand on tcp reports on a free port of its own, and the streamer verifies through it",
          "[bench][e2e]") {
  scratch s;
  hand_receiver rx(s, "receiver", {"--bind", "tcp://127.0.0.1:0", "--model", "tiny"});
  const std::string ep = rx.endpoint(), report = rx.report();
  REQUIRE(ep.starts_with("tcp://127.0.0.1:"));
  REQUIRE(report.starts_with("tcp://127.0.0.1:"));
  const std::string port = report.substr(std::string("tcp://127.0.0.1:").size());
  CHECK(std::all_of(port.begin(), port.end(), [](char ch) { return ch >= '0' && ch <= '9'; }));
  CHECK(report != ep);
  config c = hand_streamer(rx);
  c.buffer_mb = {1};
  c.warmup = 0;
  c.iters = 1;
  c.json_file = s.file("out.json");
  std::ostringstream out;
  CHECK(run(c, out) == 0);
  std::ifstream f(c.json_file);
  CHECK(json::parse(f)["rows"][0]["wrong"] == 0);
}

TEST_CASE(
    "a CURVE receiver started by hand is refit and verified by a streamer with its key, and refuses one "
    "without it",
    "[bench][e2e][hostile]") {
  const auto pair = [] {
    char pub[41] = {}, sec[41] = {};
    REQUIRE(zmq_curve_keypair(pub, sec) == 0);
    return std::pair<std::string, std::string>{pub, sec};
  };
  const auto [rx_pub, rx_sec] = pair();
  const auto [tx_pub, tx_sec] = pair();
  scratch s;
  hand_receiver rx(s, "receiver",
                   {"--bind", "tcp://127.0.0.1:0", "--model", "tiny", "--curve-public-key", rx_pub,
                    "--curve-secret-key", rx_sec, "--curve-allowed-client", tx_pub});
  CHECK_THAT(rx.banner(), Catch::Contains("--curve-server-key " + rx_pub));
  config c = hand_streamer(rx);
  c.buffer_mb = {1};
  c.warmup = 0;
  c.iters = 1;
  c.curve = curve_keys{tx_pub, tx_sec, rx_pub, {}};
  c.json_file = s.file("out.json");
  std::ostringstream out;
  CHECK(run(c, out) == 0);
  std::ifstream f(c.json_file);
  CHECK(json::parse(f)["rows"][0]["wrong"] == 0);

  // A streamer whose key the receiver does not allow never gets past the handshake.
  const auto [other_pub, other_sec] = pair();
  config stranger = hand_streamer(rx);
  stranger.buffer_mb = {1};
  stranger.warmup = 0;
  stranger.iters = 1;
  stranger.timeout_ms = 1500;
  stranger.curve = curve_keys{other_pub, other_sec, rx_pub, {}};
  std::ostringstream refused;
  CHECK_THROWS_WITH(run(stranger, refused),
                    Catch::Contains("no reply from the receiver at " + rx.endpoint() + " to HELLO"));
}

TEST_CASE("--no-verify runs a streamer started by hand unverified, and says so", "[bench][e2e]") {
  scratch s;
  hand_receiver rx(s, "receiver", {"--bind", "ipc://" + s.file("x"), "--model", "tiny", "--corrupt-byte", "0"});
  config c = hand_streamer(rx);
  c.report.clear();
  c.no_verify = true;
  c.buffer_mb = {1};
  c.json_file = s.file("out.json");
  std::ostringstream out;
  CHECK(run(c, out) == 0);  // the corruption goes unseen: that is what --no-verify means
  CHECK_THAT(out.str(), Catch::Contains("OK (some rows not verified)") && Catch::Contains("--no-verify"));
  CHECK_THAT(out.str(), Catch::Contains("NOT verified (--no-verify)") && !Catch::Contains("every refit verified"));
  std::ifstream f(c.json_file);
  CHECK(json::parse(f)["rows"][0]["wrong"].is_null());
}

// ---------------------------------------------------------------- engine layouts (--layout)

namespace {

// The engine tensor of this name in a layout (REQUIREd to exist).
const tensor_meta& engine_tensor(const engine_layout& l, const std::string& name) {
  const auto it = std::find_if(l.tensors.entries.begin(), l.tensors.entries.end(),
                               [&](const manifest_entry& e) { return e.meta.name == name; });
  REQUIRE(it != l.tensors.entries.end());
  return it->meta;
}

// The views of the source of this name.
std::vector<layout_view> views_of(const manifest& m, const engine_layout& l, const std::string& name) {
  std::vector<layout_view> out;
  for (std::size_t i = 0; i < m.entries.size(); ++i)
    if (m.entries[i].meta.name == name)
      for (const auto k : l.of_source[i]) out.push_back(l.views[k]);
  return out;
}

// A small tied mixture-of-experts model as a JSON manifest: embed_tokens without lm_head, q/k/v
// with biases, 4 experts per layer.
std::string tied_moe_manifest() {
  std::string j = R"({"model.embed_tokens.weight": {"dtype": "bf16", "shape": [100, 64]})";
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    j += ", \"" + p + R"(self_attn.q_proj.weight": {"shape": [64, 64]})";
    j += ", \"" + p + R"(self_attn.k_proj.weight": {"shape": [32, 64]})";
    j += ", \"" + p + R"(self_attn.v_proj.weight": {"shape": [32, 64]})";
    j += ", \"" + p + R"(self_attn.q_proj.bias": {"shape": [64]})";
    j += ", \"" + p + R"(self_attn.k_proj.bias": {"shape": [32]})";
    j += ", \"" + p + R"(self_attn.v_proj.bias": {"shape": [32]})";
    j += ", \"" + p + R"(mlp.gate.weight": {"shape": [4, 64]})";
    for (int e = 0; e < 4; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      j += ", \"" + x + R"(gate_proj.weight": {"shape": [48, 64]})";
      j += ", \"" + x + R"(up_proj.weight": {"shape": [48, 64]})";
      j += ", \"" + x + R"(down_proj.weight": {"shape": [64, 48]})";
    }
  }
  return j + R"(, "model.norm.weight": {"shape": [64]}})";
}

}  // namespace

TEST_CASE("the fused layout stacks q/k/v and gate/up rows into one engine tensor each and ties lm_head", "[bench]") {
  const manifest tiny = preset("tiny");
  const engine_layout plain = make_layout(tiny, layout_kind::plain);
  REQUIRE(plain.tensors.entries.size() == tiny.entries.size());
  for (std::size_t i = 0; i < tiny.entries.size(); ++i) {
    CHECK(plain.tensors.entries[i].meta == tiny.entries[i].meta);
    REQUIRE(plain.of_source[i].size() == 1);
    CHECK(plain.views[plain.of_source[i][0]].offset == 0);
  }

  // tiny: hidden 256, 4 heads and 2 kv heads of 64, intermediate 704, q/k/v biases, lm_head of its own.
  const engine_layout fused = make_layout(tiny, layout_kind::fused);
  CHECK(fused.tensors.entries.size() == 17);  // embed, 2 x (2 norms, qkv, qkv bias, o, gate_up, down), norm, lm_head
  CHECK(fused.views.size() == tiny.entries.size());
  const auto& qkv = engine_tensor(fused, "model.layers.1.self_attn.qkv_proj.weight");
  CHECK(qkv.shape == std::vector<std::int64_t>{512, 256});
  CHECK(engine_tensor(fused, "model.layers.1.self_attn.qkv_proj.bias").shape == std::vector<std::int64_t>{512});
  CHECK(engine_tensor(fused, "model.layers.0.mlp.gate_up_proj.weight").shape == std::vector<std::int64_t>{1408, 256});
  const std::uint64_t row = 256 * 2;  // bytes of a bf16 row of 256
  const auto q = views_of(tiny, fused, "model.layers.1.self_attn.q_proj.weight");
  const auto k = views_of(tiny, fused, "model.layers.1.self_attn.k_proj.weight");
  const auto v = views_of(tiny, fused, "model.layers.1.self_attn.v_proj.weight");
  const auto up = views_of(tiny, fused, "model.layers.0.mlp.up_proj.weight");
  REQUIRE((q.size() == 1 && k.size() == 1 && v.size() == 1 && up.size() == 1));
  CHECK(q[0].tensor == k[0].tensor);
  CHECK(k[0].tensor == v[0].tensor);
  CHECK(q[0].offset == 0);
  CHECK(k[0].offset == 256 * row);
  CHECK(v[0].offset == 384 * row);
  CHECK(v[0].shape == std::vector<std::int64_t>{128, 256});
  CHECK(v[0].strides == std::vector<std::int64_t>{256, 1});
  CHECK(up[0].offset == 704 * row);
  CHECK(views_of(tiny, fused, "model.layers.0.self_attn.k_proj.bias")[0].offset == 256 * 2);
  // Not tied: every source has one view.
  for (const auto& views : fused.of_source) CHECK(views.size() == 1);
  for (const auto& views : make_layout(preset("llama3-8b"), layout_kind::fused).of_source) CHECK(views.size() == 1);

  // qwen2.5-0.5b ties lm_head to embed_tokens: the embedding lands in the engine's lm_head too.
  const manifest qwen = preset("qwen2.5-0.5b");
  const engine_layout tied = make_layout(qwen, layout_kind::fused);
  CHECK(tied.views.size() == qwen.entries.size() + 1);
  CHECK(tied.tensors.entries.back().meta.name == "lm_head.weight");
  const auto embed = views_of(qwen, tied, "model.embed_tokens.weight");
  REQUIRE(embed.size() == 2);
  CHECK(embed[0].tensor != embed[1].tensor);
  CHECK(tied.tensors.entries[embed[1].tensor].meta.shape == std::vector<std::int64_t>{151936, 896});
  CHECK(engine_tensor(tied, "model.layers.23.self_attn.qkv_proj.weight").shape == std::vector<std::int64_t>{1152, 896});
  // plain keeps today's table: no engine lm_head.
  CHECK(make_layout(qwen, layout_kind::plain).views.size() == qwen.entries.size());
}

TEST_CASE("the ep layout stacks every layer's experts into w13[E, 2I, H] and w2[E, H, I]", "[bench]") {
  const manifest moe = preset("qwen3-30b-a3b");
  const engine_layout ep = make_layout(moe, layout_kind::ep);
  CHECK(ep.views.size() == moe.entries.size());
  const auto& w13 = engine_tensor(ep, "model.layers.47.mlp.experts.w13_weight");
  CHECK(w13.shape == std::vector<std::int64_t>{128, 1536, 2048});
  CHECK(engine_tensor(ep, "model.layers.47.mlp.experts.w2_weight").shape == std::vector<std::int64_t>{128, 2048, 768});
  const std::uint64_t half = 768ull * 2048 * 2;  // one expert's gate (or up) in bf16
  const auto gate = views_of(moe, ep, "model.layers.3.mlp.experts.5.gate_proj.weight");
  const auto up = views_of(moe, ep, "model.layers.3.mlp.experts.5.up_proj.weight");
  const auto down = views_of(moe, ep, "model.layers.3.mlp.experts.5.down_proj.weight");
  REQUIRE((gate.size() == 1 && up.size() == 1 && down.size() == 1));
  CHECK(gate[0].tensor == up[0].tensor);
  CHECK(gate[0].offset == 5 * 2 * half);
  CHECK(up[0].offset == 5 * 2 * half + half);
  CHECK(down[0].offset == 5 * half);
  CHECK(up[0].strides == std::vector<std::int64_t>{2048, 1});
  CHECK(down[0].strides == std::vector<std::int64_t>{768, 1});
  CHECK(ep.tensors.entries[down[0].tensor].meta.name == "model.layers.3.mlp.experts.w2_weight");
  // 48 layers: embed, lm_head, norm; per layer 2 norms, qkv, o, q_norm, k_norm, router, w13, w2.
  CHECK(ep.tensors.entries.size() == 3 + 48 * 9);

  // Mixtral's names: w1 (gate), w3 (up), w2 (down).
  const manifest mixtral = preset("mixtral-8x7b");
  const engine_layout mx = make_layout(mixtral, layout_kind::ep);
  CHECK(engine_tensor(mx, "model.layers.0.block_sparse_moe.experts.w13_weight").shape ==
        std::vector<std::int64_t>{8, 2 * 14336, 4096});
  const auto w3 = views_of(mixtral, mx, "model.layers.0.block_sparse_moe.experts.7.w3.weight");
  REQUIRE(w3.size() == 1);
  CHECK(w3[0].offset == (7 * 2 + 1) * 14336ull * 4096 * 2);

  // A model without experts cannot be laid out so.
  try {
    (void)make_layout(preset("tiny"), layout_kind::ep);
    FAIL("no error");
  } catch (const refit::error& e) {
    CHECK(e.code() == errc::invalid_argument);
    CHECK(std::string(e.what()) ==
          "refit-bench: --layout ep stacks the experts of a mixture-of-experts model and tiny has none "
          "(PREFIX.experts.E.gate_proj/up_proj/down_proj.weight, or w1/w3/w2); use --layout fused or plain");
  }
  // Nor experts that do not stack.
  manifest gap;
  gap.name = "gap";
  for (const int e : {0, 2})
    for (const char* part : {"gate_proj", "up_proj", "down_proj"})
      gap.entries.push_back({tensor_meta{
          fmt::format("m.experts.{}.{}.weight", e, part), dtype::bf16,
          part == std::string("down_proj") ? std::vector<std::int64_t>{8, 4} : std::vector<std::int64_t>{4, 8}}});
  CHECK_THROWS_WITH(make_layout(gap, layout_kind::ep),
                    Catch::Contains("the experts of m.experts. do not stack: expert 1 is missing"));
}

TEST_CASE("the checksum of a tied source is its views' when they agree and unlike all of them when not", "[bench]") {
  CHECK(fold_view_checksums({42}) == 42);
  CHECK(fold_view_checksums({42, 42}) == 42);
  for (const std::vector<std::uint64_t>& sums :
       {std::vector<std::uint64_t>{42, 43}, {43, 42}, {42, ~42ull}, {42, ~42ull, 42 ^ 1}, {0, ~0ull, 1, 2}}) {
    const std::uint64_t f = fold_view_checksums(sums);
    for (const auto s : sums) CHECK(f != s);
  }
}

TEST_CASE("--layout takes plain, fused or ep, passes it to the receiver, and refuses another name", "[bench]") {
  int code = -1;
  const char* none[] = {"refit-bench"};
  const auto plain = parse_args(1, none, code);
  REQUIRE(plain);
  CHECK(plain->layout == layout_kind::plain);
  const auto no_flag = receiver_args(*plain, transport_kind::host_shm, "tiny", "ipc:///x");
  CHECK(std::find(no_flag.begin(), no_flag.end(), "--layout") == no_flag.end());
  const char* fused[] = {"refit-bench", "--layout", "fused"};
  const auto parsed = parse_args(3, fused, code);
  REQUIRE(parsed);
  CHECK(parsed->layout == layout_kind::fused);
  const auto args = receiver_args(*parsed, transport_kind::cuda_ipc, "tiny", "ipc:///x");
  const auto at = std::find(args.begin(), args.end(), "--layout");
  REQUIRE(at != args.end());
  CHECK(*std::next(at) == "fused");
  const char* ep[] = {"refit-bench", "--layout", "ep", "--model", "qwen3-30b-a3b"};
  CHECK(parse_args(5, ep, code)->layout == layout_kind::ep);

  const char* sideways[] = {"refit-bench", "--layout", "sideways"};
  try {
    (void)parse_args(3, sideways, code);
    FAIL("no error");
  } catch (const refit::error& e) {
    CHECK(e.code() == errc::invalid_argument);
    CHECK(std::string(e.what()) ==
          "refit-bench: --layout sideways: unknown (plain, fused, ep, tpN for N from 2 to 64: tp2, tp4, ..., "
          "recorded:FILE[,FILE...] for route tables of refit.record)");
  }
  scratch s;
  std::string stdout_text;
  CHECK(run_binary({"--layout", "sideways"}, stdout_text, s.file("err")) == 2);
  CHECK(read_file(s.file("err")) ==
        "refit-bench: error (invalid_argument): --layout sideways: unknown (plain, fused, ep, "
        "tpN for N from 2 to 64: tp2, tp4, ..., recorded:FILE[,FILE...] for route "
        "tables of refit.record)\n");
  CHECK(stdout_text.empty());
}

TEST_CASE("a host_shm run with --layout fused verifies every source tensor as it landed in its view", "[bench][e2e]") {
  scratch s;
  config c = short_run("tiny");
  c.layout = layout_kind::fused;
  c.json_file = s.file("out.json");
  std::ostringstream out;
  CHECK(run(c, out) == 0);
  INFO(out.str());
  CHECK_THAT(out.str(),
             Catch::Contains("# Wrong values          : 0 OK") &&
                 Catch::Contains("--layout fused: the receiver holds tiny in 17 engine tensors: 27 views of 27 "
                                 "source tensors"));
  const auto rows = table_rows(out.str());
  REQUIRE(rows.size() == 2);
  for (const auto& row : rows) CHECK_THAT(row, Catch::Contains(" memcpy+fused "));
  std::ifstream f(c.json_file);
  const json j = json::parse(f);
  REQUIRE(j["rows"].size() == 2);
  for (const auto& r : j["rows"]) {
    CHECK(r["wrong"] == 0);
    CHECK(r["layout"] == "fused");
    CHECK(r["engine"] == "memcpy+fused");
  }
  CHECK(j["ok"] == true);

  // plain rows say so in JSON and keep their label.
  config p = short_run("tiny");
  p.buffer_mb = {1};
  p.json_file = s.file("plain.json");
  std::ostringstream plain_out;
  CHECK(run(p, plain_out) == 0);
  std::ifstream pf(p.json_file);
  const json pj = json::parse(pf);
  CHECK(pj["rows"][0]["layout"] == "plain");
  CHECK(pj["rows"][0]["engine"] == "memcpy");
}

TEST_CASE("a tied embedding and stacked experts verify under --layout fused and ep", "[bench][e2e]") {
  scratch s;
  write_file(s.file("moe.json"), tied_moe_manifest());
  for (const auto layout : {layout_kind::fused, layout_kind::ep}) {
    config c = short_run("tiny");
    c.manifest_file = s.file("moe.json");
    c.buffer_mb = {1};
    c.layout = layout;
    c.json_file = s.file("out.json");
    std::ostringstream out;
    CHECK(run(c, out) == 0);
    INFO(out.str());
    // 40 sources, the embedding twice (lm_head); fused: 25 engine tensors, ep: 13.
    CHECK_THAT(out.str(), Catch::Contains(fmt::format("in {} engine tensors: 41 views of 40 source tensors",
                                                      layout == layout_kind::ep ? 13 : 25)));
    std::ifstream f(c.json_file);
    const json j = json::parse(f);
    CHECK(j["rows"][0]["wrong"] == 0);
    CHECK(j["rows"][0]["layout"] == layout_name(layout));
  }
}

TEST_CASE("a byte corrupted in a view fails a --layout fused run, a tied embedding's second view included",
          "[bench][e2e]") {
  scratch s;
  // tensor 2 of tiny: layer 0's q_proj, a view at the start of its qkv_proj.
  config c = short_run("tiny");
  c.buffer_mb = {1};
  c.layout = layout_kind::fused;
  c.corrupt_tensor = 2;
  c.json_file = s.file("out.json");
  std::ostringstream out;
  CHECK(run(c, out) == 1);
  CHECK_THAT(out.str(), Catch::Contains("FAILED"));
  std::ifstream f(c.json_file);
  const json j = json::parse(f);
  CHECK(j["rows"][0]["wrong"] == c.warmup + c.iters);
  CHECK(j["ok"] == false);

  // The binary: a view of v_proj in the middle of the engine tensor (tensor 6: layer 0's v_proj).
  std::string stdout_text;
  CHECK(run_binary({"--model", "tiny", "--buffer-mb", "1", "--iters", "1", "--warmup", "0", "--quiet", "--layout",
                    "fused", "--corrupt-byte", "6"},
                   stdout_text) == 1);
  CHECK_THAT(stdout_text, Catch::Contains("1 FAILED") && Catch::Contains("memcpy+fused"));

  // The embedding's byte flipped in the engine's lm_head only: the embedding itself is intact.
  write_file(s.file("moe.json"), tied_moe_manifest());
  std::string tied_text;
  CHECK(run_binary({"--manifest", s.file("moe.json"), "--buffer-mb", "1", "--iters", "1", "--warmup", "0", "--quiet",
                    "--layout", "ep", "--corrupt-byte", "0"},
                   tied_text) == 1);
  CHECK_THAT(tied_text, Catch::Contains("1 FAILED"));
}

TEST_CASE("a streamer started by hand with another --layout than its receiver's is refused, naming both",
          "[bench][e2e]") {
  scratch s;
  hand_receiver rx(s, "receiver", {"--bind", "ipc://" + s.file("x"), "--model", "tiny", "--layout", "fused"});
  CHECK(rx.ready["layout"] == "fused");
  CHECK_THAT(rx.banner(), Catch::Contains("--transport host_shm --model tiny --layout fused"));
  config c = hand_streamer(rx);
  c.buffer_mb = {1};
  std::ostringstream out;
  try {
    (void)run(c, out);
    FAIL("no error");
  } catch (const refit::error& e) {
    CHECK(e.code() == errc::protocol);
    CHECK_THAT(e.what(),
               Catch::Contains("holds the model in layout \"fused\" and this streamer runs with --layout plain"));
  }
  // Versions count from 1 in every streamer run: a fresh receiver for the next one.
  hand_receiver fresh(s, "fresh", {"--bind", "ipc://" + s.file("y"), "--model", "tiny", "--layout", "fused"});
  config same = hand_streamer(fresh);
  same.buffer_mb = {1};
  same.layout = layout_kind::fused;
  std::ostringstream good;
  CHECK(run(same, good) == 0);
  CHECK_THAT(good.str(), Catch::Contains("# Wrong values          : 0 OK"));
}

// ---------------------------------------------------------------- tensor parallelism (--layout tpN)

namespace {

// The one view of the source of this name (REQUIREd).
layout_view only_view(const manifest& m, const engine_layout& l, const std::string& name) {
  const auto views = views_of(m, l, name);
  REQUIRE(views.size() == 1);
  return views.front();
}

std::optional<source_slice> rows(std::int64_t start, std::int64_t length) { return source_slice{0, start, length}; }
std::optional<source_slice> columns(std::int64_t start, std::int64_t length) { return source_slice{1, start, length}; }

// The refit-bench error make_layout() throws ("" when none).
std::string layout_error(const manifest& m, const layout_spec& spec, int rank = 0) {
  try {
    (void)make_layout(m, spec, rank);
  } catch (const refit::error& e) {
    CHECK(e.code() == errc::invalid_argument);
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("tpN shards q/k/v and gate/up by rows, o_proj and down_proj by columns, the vocabulary by rows, norms whole",
          "[bench]") {
  // tiny: hidden 256, 4 heads and 2 kv heads of 64 (q 256 rows, k and v 128), intermediate 704,
  // vocabulary 1000, q/k/v biases, an lm_head of its own. Rank 1 of 2.
  const manifest tiny = preset("tiny");
  const engine_layout l = make_layout(tiny, layout_spec{layout_kind::fused, 2}, 1);
  CHECK(l.tp == 2);
  CHECK(l.rank == 1);
  CHECK(l.tensors.entries.size() == 17);
  CHECK(l.views.size() == tiny.entries.size());
  const std::uint64_t row = 256 * 2;
  CHECK(engine_tensor(l, "model.layers.0.self_attn.qkv_proj.weight").shape == std::vector<std::int64_t>{256, 256});
  const auto q = only_view(tiny, l, "model.layers.0.self_attn.q_proj.weight");
  const auto k = only_view(tiny, l, "model.layers.0.self_attn.k_proj.weight");
  const auto v = only_view(tiny, l, "model.layers.0.self_attn.v_proj.weight");
  CHECK(q.slice == rows(128, 128));
  CHECK(k.slice == rows(64, 64));
  CHECK(v.slice == rows(64, 64));
  CHECK(q.offset == 0);
  CHECK(k.offset == 128 * row);
  CHECK(v.offset == 192 * row);
  CHECK(v.shape == std::vector<std::int64_t>{64, 256});
  CHECK(v.bytes == 64 * row);
  CHECK(engine_tensor(l, "model.layers.0.self_attn.qkv_proj.bias").shape == std::vector<std::int64_t>{256});
  CHECK(only_view(tiny, l, "model.layers.0.self_attn.k_proj.bias").slice == rows(64, 64));
  CHECK(only_view(tiny, l, "model.layers.0.self_attn.k_proj.bias").offset == 128 * 2);
  // Row-parallel: the rank's columns, into a dense local [out, in/N].
  const auto o = only_view(tiny, l, "model.layers.1.self_attn.o_proj.weight");
  CHECK(o.slice == columns(128, 128));
  CHECK(o.shape == std::vector<std::int64_t>{256, 128});
  CHECK(o.strides == std::vector<std::int64_t>{128, 1});
  CHECK(l.tensors.entries[o.tensor].meta.shape == std::vector<std::int64_t>{256, 128});
  const auto down = only_view(tiny, l, "model.layers.0.mlp.down_proj.weight");
  CHECK(down.slice == columns(352, 352));
  CHECK(down.bytes == 256ull * 352 * 2);
  const auto up = only_view(tiny, l, "model.layers.0.mlp.up_proj.weight");
  CHECK(engine_tensor(l, "model.layers.0.mlp.gate_up_proj.weight").shape == std::vector<std::int64_t>{704, 256});
  CHECK(up.slice == rows(352, 352));
  CHECK(up.offset == 352 * row);
  CHECK(only_view(tiny, l, "model.embed_tokens.weight").slice == rows(500, 500));
  CHECK(only_view(tiny, l, "lm_head.weight").slice == rows(500, 500));
  const auto norm = only_view(tiny, l, "model.layers.1.post_attention_layernorm.weight");
  CHECK(!norm.slice);
  CHECK(norm.shape == std::vector<std::int64_t>{256});
  // The ranks need the model once between them, and the 5 replicated norms once each.
  const engine_layout l0 = make_layout(tiny, layout_spec{layout_kind::fused, 2}, 0);
  CHECK(only_view(tiny, l0, "model.layers.1.self_attn.o_proj.weight").slice == columns(0, 128));
  CHECK(l0.needed_bytes(tiny) + l.needed_bytes(tiny) == tiny.bytes() + 5 * 256 * 2);

  // A tied embedding: the rank's vocabulary rows land in its embedding and its lm_head.
  const manifest qwen = preset("qwen2.5-0.5b");
  const auto embed =
      views_of(qwen, make_layout(qwen, layout_spec{layout_kind::fused, 2}, 1), "model.embed_tokens.weight");
  REQUIRE(embed.size() == 2);
  CHECK(embed[0].slice == rows(75968, 75968));
  CHECK(embed[1].slice == rows(75968, 75968));
  CHECK(embed[0].tensor != embed[1].tensor);

  // The real models shard at the degrees engines run them with.
  for (const auto& [name, tp] : std::vector<std::pair<std::string, int>>{
           {"qwen2.5-7b", 4}, {"llama3-8b", 8}, {"qwen3-30b-a3b", 4}, {"mixtral-8x7b", 8}, {"qwen2.5-0.5b", 2}}) {
    INFO(name << " tp" << tp);
    const manifest m = preset(name);
    for (int r = 0; r < tp; r += tp - 1) CHECK(layout_error(m, layout_spec{layout_kind::fused, tp}, r).empty());
  }
  CHECK_THAT(layout_error(preset("qwen2.5-0.5b"), layout_spec{layout_kind::fused, 4}),
             Catch::Contains("has 14 heads of 64"));
  CHECK(layout_error(tiny, layout_spec{layout_kind::fused, 2}, 2) ==
        "refit-bench: --rank 2: out of range for --layout tp2 "
        "(ranks 0 to 1)");
  CHECK(layout_error(tiny, layout_spec{layout_kind::ep, 2}) ==
        "refit-bench: --layout: tensor parallelism (degree 2) shards the fused layout only");
}

TEST_CASE("a tpN size that does not divide is refused, naming the tensor, its size and the degree", "[bench][e2e]") {
  // tiny has 2 kv heads: they do not split over 4 ranks, though their 128 rows would.
  const std::string heads =
      "refit-bench: --layout tp4: tiny: model.layers.0.self_attn.k_proj.weight bf16[128, 256] has 2 "
      "heads of 64 (128 rows), which do not split over 4 ranks; use a tp degree that divides the q "
      "and kv heads";
  CHECK(layout_error(preset("tiny"), layout_spec{layout_kind::fused, 4}) == heads);
  scratch s;
  std::string out;
  CHECK(run_binary({"--model", "tiny", "--layout", "tp4", "--quiet"}, out, s.file("err")) == 2);
  CHECK(read_file(s.file("err")) == "refit-bench: error (invalid_argument): " + heads.substr(13) + "\n");
  CHECK(table_rows(out).empty());

  // A manifest says nothing of heads: rows and columns must divide.
  write_file(s.file("odd.json"), R"({"model.norm.weight": {"shape": [64]},
                                     "model.layers.0.mlp.down_proj.weight": {"shape": [64, 90]}})");
  const manifest odd = load_manifest(s.file("odd.json"));
  CHECK(layout_error(odd, layout_spec{layout_kind::fused, 2}).empty());
  CHECK(
      layout_error(odd, layout_spec{layout_kind::fused, 4}) ==
      "refit-bench: --layout tp4: odd: model.layers.0.mlp.down_proj.weight bf16[64, 90] has 90 columns (row-parallel), "
      "which do not divide by 4; use a tp degree that divides them");
  std::string odd_out;
  CHECK(run_binary({"--manifest", s.file("odd.json"), "--layout", "tp4", "--quiet"}, odd_out, s.file("odd.err")) == 2);
  CHECK_THAT(read_file(s.file("odd.err")), Catch::Contains("has 90 columns (row-parallel), which do not divide by 4"));
}

TEST_CASE("a source slice's region gathers the bytes a view of that slice holds, in order", "[bench]") {
  // [3, 4, 5] of u16: slices of each dimension against a walk over every element.
  const tensor_meta t{"t", dtype::u16, {3, 4, 5}};
  for (int dim = 0; dim < 3; ++dim) {
    const std::int64_t size = t.shape[static_cast<std::size_t>(dim)];
    for (std::int64_t start = 0; start < size; ++start)
      for (std::int64_t length = 1; start + length <= size; ++length) {
        const byte_region r = region_of(t, source_slice{dim, start, length});
        INFO("dim " << dim << " start " << start << " length " << length);
        std::uint64_t next = 0;  // position of the next byte the slice takes, in row-major order
        for (std::int64_t a = 0; a < 3; ++a)
          for (std::int64_t b = 0; b < 4; ++b)
            for (std::int64_t c = 0; c < 5; ++c) {
              const std::int64_t idx[] = {a, b, c};
              const bool in = idx[dim] >= start && idx[dim] < start + length;
              const auto byte = static_cast<std::uint64_t>(((a * 4 + b) * 5 + c) * 2);
              for (std::uint64_t h = 0; h < 2; ++h) {
                const auto at = region_position(r, byte + h);
                CHECK(at.has_value() == in);
                if (in && at) CHECK(*at == next++);
              }
            }
        CHECK(next == r.bytes());
      }
  }
  CHECK(region_of(t, std::nullopt).bytes() == t.nbytes());
  CHECK(region_of(t, source_slice{0, 1, 2}).contiguous());
  CHECK(!region_of(t, source_slice{1, 1, 2}).contiguous());
  CHECK(region_of(t, source_slice{2, 0, 5}).contiguous());  // all of the last dimension: one run

  // Host memory checksums a strided region as those bytes gathered.
  manifest m;
  m.name = "m";
  m.entries = {{t}};
  const auto mem = make_host_shm_path()->sources(m, 7, nullptr);
  const byte_region r = region_of(t, source_slice{1, 1, 2});
  std::vector<std::byte> gathered;
  for (std::uint64_t b = 0; b < t.nbytes(); ++b)
    if (region_position(r, b)) gathered.push_back(mem->data(0)[b]);
  REQUIRE(gathered.size() == r.bytes());
  CHECK(mem->checksum(0, r) == copy::checksum(gathered.data(), gathered.size()));
}

TEST_CASE("--layout tpN runs one receiver per rank over cuda_ipc and nccl, and --rank picks host_shm's", "[bench]") {
  int code = -1;
  const char* tp2[] = {"refit-bench", "--layout", "tp2", "--rank", "1", "--receiver-devices", "spread"};
  const auto c = parse_args(static_cast<int>(std::size(tp2)), tp2, code);
  REQUIRE(c);
  CHECK(c->layout == layout_spec{layout_kind::fused, 2});
  CHECK(layout_name(c->layout) == "tp2");
  CHECK(c->rank == 1);
  CHECK(c->spread_receivers);
  CHECK(receiver_processes(*c, transport_kind::host_shm) == 1);
  CHECK(receiver_processes(*c, transport_kind::cuda_ipc) == 2);
  CHECK(receiver_processes(*c, transport_kind::nccl) == 2);
  // cuda_ipc spread: rank k on (device + k) % visible; nccl: the GPUs after the streamer's.
  config d = *c;
  d.device = 3;
  CHECK(receiver_gpu(d, transport_kind::cuda_ipc, 0, 4) == 3);
  CHECK(receiver_gpu(d, transport_kind::cuda_ipc, 1, 4) == 0);
  CHECK(receiver_gpu(d, transport_kind::nccl, 0, 8) == 4);
  d.spread_receivers = false;
  CHECK(receiver_gpu(d, transport_kind::cuda_ipc, 1, 4) == 3);
  const auto args = receiver_args(*c, transport_kind::cuda_ipc, "tiny", "ipc:///x", copy_engine::automatic, 1, 0);
  const auto at = std::find(args.begin(), args.end(), "--layout");
  REQUIRE(at != args.end());
  CHECK(*std::next(at) == "tp2");
  const auto rank = std::find(args.begin(), args.end(), "--rank");
  REQUIRE(rank != args.end());
  CHECK(*std::next(rank) == "0");
  const auto own = receiver_args(*c, transport_kind::host_shm, "tiny", "ipc:///x");
  CHECK(*std::next(std::find(own.begin(), own.end(), "--rank")) == "1");
  const char* tp4[] = {"refit-bench", "--layout", "tp4"};
  CHECK(parse_args(3, tp4, code)->receivers == 4);

  const auto refused = [&](std::vector<const char*> argv) {
    argv.insert(argv.begin(), "refit-bench");
    try {
      (void)parse_args(static_cast<int>(argv.size()), argv.data(), code);
    } catch (const refit::error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(refused({"--layout", "tp2", "--rank", "2"}) ==
        "refit-bench: --rank 2: out of range for --layout tp2 (ranks 0 to 1)");
  CHECK(refused({"--rank", "1"}) ==
        "refit-bench: --rank 1 is for --layout tpN or recorded with several files (a tensor-parallel rank)");
  CHECK(refused({"--layout", "tp2", "--receivers", "3"}) ==
        "refit-bench: --receivers 3 with --layout tp2: tensor parallelism runs one receiver per rank (2); leave "
        "--receivers out");
  // cuda_ipc serves several receivers by direct writes only: a staged-only run is refused before anything runs.
  config staged = *c;
  staged.transports = {transport_kind::cuda_ipc};
  staged.direct = {false};
  std::ostringstream out;
  // A build without CUDA has no cuda_ipc transport to refuse it with.
  CHECK_THROWS_WITH(run(staged, out),
                    REFIT_HAVE_CUDA ? "refit-bench: --path staged with --layout tp2 over cuda_ipc: one streamer serves "
                                      "its 2 receivers only by writing into each one's weights; use --path direct"
                                    : "refit-bench: the cuda_ipc transport is not built into this bench (refit was "
                                      "built without CUDA); rebuild with -Dcuda=enabled or use --transport host_shm");
  for (const char* name : {"tp1", "tp0", "tp02", "tp65", "tpx", "tp"})
    CHECK_THAT(refused({"--layout", name}), Catch::Contains(fmt::format("--layout {}: unknown", name)));
}

TEST_CASE("--receiver-device N puts every spawned cuda_ipc receiver on GPU N, and nothing else", "[bench]") {
  int code = -1;
  const auto parsed = [&](std::vector<const char*> argv) {
    argv.insert(argv.begin(), "refit-bench");
    const auto c = parse_args(static_cast<int>(argv.size()), argv.data(), code);
    REQUIRE(c);
    return *c;
  };
  CHECK(parsed({}).receiver_device == -1);
  const config one = parsed({"--transport", "cuda_ipc", "--receiver-device", "1"});
  CHECK(one.receiver_device == 1);
  CHECK(receiver_processes(one, transport_kind::cuda_ipc) == 1);
  CHECK(receiver_gpu(one, transport_kind::cuda_ipc, 0, 2) == 1);
  // Every rank of tpN, whatever the GPUs visible (spread is refused beside it).
  const config tp4 = parsed({"--transport", "cuda_ipc", "--layout", "tp4", "--receiver-device", "2"});
  REQUIRE(receiver_processes(tp4, transport_kind::cuda_ipc) == 4);
  for (std::size_t k = 0; k < 4; ++k) {
    CHECK(receiver_gpu(tp4, transport_kind::cuda_ipc, k, 4) == 2);
    CHECK(receiver_gpu(tp4, transport_kind::cuda_ipc, k, 0) == 2);
  }
  // Only cuda_ipc's receivers: nccl places its own, host_shm stays on --device.
  config d = tp4;
  d.device = 1;
  CHECK(receiver_gpu(d, transport_kind::nccl, 0, 4) == 2);
  CHECK(receiver_gpu(d, transport_kind::nccl, 1, 4) == 3);
  CHECK(receiver_gpu(d, transport_kind::host_shm, 0, 4) == 1);
  // The default changes nothing: the streamer's GPU, or spread.
  config same = parsed({"--transport", "cuda_ipc", "--layout", "tp2", "--device", "1"});
  CHECK(receiver_gpu(same, transport_kind::cuda_ipc, 0, 2) == 1);
  CHECK(receiver_gpu(same, transport_kind::cuda_ipc, 1, 2) == 1);
  same.spread_receivers = true;
  CHECK(receiver_gpu(same, transport_kind::cuda_ipc, 0, 2) == 1);
  CHECK(receiver_gpu(same, transport_kind::cuda_ipc, 1, 2) == 0);
  // By hand, the streamer tells its ceiling where its one receiver runs.
  const config by_hand = parsed({"--role", "streamer", "--connect", "ipc:///x", "--no-verify", "--transport",
                                 "cuda_ipc", "--receiver-device", "3"});
  CHECK(by_hand.receiver_device == 3);

  const auto refused = [&](std::vector<const char*> argv) {
    argv.insert(argv.begin(), "refit-bench");
    try {
      (void)parse_args(static_cast<int>(argv.size()), argv.data(), code);
    } catch (const refit::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(refused({"--transport", "cuda_ipc", "--receiver-device", "-1"}) ==
        "refit-bench: --receiver-device -1: a GPU index, 0 or more");
  CHECK(refused({"--receiver-device", "1"}) ==
        "refit-bench: --receiver-device 1 with --transport host_shm: only with --transport cuda_ipc alone (nccl "
        "places its receivers on GPUs of their own, host_shm has no GPU)");
  CHECK(refused({"--transport", "cuda_ipc,nccl", "--receiver-device", "1"}) ==
        "refit-bench: --receiver-device 1 with --transport cuda_ipc,nccl: only with --transport cuda_ipc alone (nccl "
        "places its receivers on GPUs of their own, host_shm has no GPU)");
  CHECK(refused({"--transport", "nccl", "--receiver-device", "0"}) ==
        "refit-bench: --receiver-device 0 with --transport nccl: only with --transport cuda_ipc alone (nccl places "
        "its receivers on GPUs of their own, host_shm has no GPU)");
  CHECK(refused(
            {"--transport", "cuda_ipc", "--layout", "tp2", "--receiver-devices", "spread", "--receiver-device", "1"}) ==
        "refit-bench: --receiver-device 1 with --receiver-devices spread: every receiver on GPU 1, or rank k on GPU "
        "(device + k) % visible; give one of them");
  CHECK(refused({"--transport", "cuda_ipc", "--streamers", "2", "--receiver-device", "1"}) ==
        "refit-bench: --receiver-device 1 with --streamers 2: the group bench places its receivers itself "
        "(--receiver-devices spread spreads them); leave --receiver-device out");
  CHECK(refused({"--role", "receiver", "--transport", "cuda_ipc", "--receiver-device", "1"}) ==
        "refit-bench: --receiver-device 1 with --role receiver: a receiver runs on its --device");
}

TEST_CASE(
    "a cuda_ipc ceiling is a device copy while every receiver shares the streamer's GPU, else a peer copy to "
    "them all",
    "[bench]") {
  config c;
  c.transports = {transport_kind::cuda_ipc};
  // Default: one receiver on the streamer's GPU, today's device copy and its words.
  CHECK(cuda_ipc_placement(c, 2) == gpu_placement{0, {0}});
  CHECK(cuda_ipc_placement(c, 2).local());
  CHECK(gpu_placement{3, {}}.local());
  CHECK(copy_ceiling_method(cuda_ipc_placement(c, 2), 1ull << 30) ==
        "cudaMemcpyAsync device to device of 1024 MiB on GPU 0, events, best of 5");
  // One receiver on GPU 1: the plain peer copy.
  c.receiver_device = 1;
  const gpu_placement peer = cuda_ipc_placement(c, 2);
  CHECK(peer == gpu_placement{0, {1}});
  CHECK_FALSE(peer.local());
  CHECK(copy_ceiling_method(peer, 1ull << 30) == "cudaMemcpyPeerAsync GPU 0 → GPU 1 of 1024 MiB, events, best of 5");
  // tp2 spread: rank 0 stays on the streamer's GPU, rank 1 crosses; both shares at once.
  c.receiver_device = -1;
  c.layout = layout_spec{layout_kind::fused, 2};
  c.spread_receivers = true;
  const gpu_placement spread = cuda_ipc_placement(c, 2);
  CHECK(spread == gpu_placement{0, {0, 1}});
  CHECK(copy_ceiling_method(spread, 1ull << 30) ==
        "cudaMemcpyPeerAsync from GPU 0 to GPUs 0, 1 at once, 512 MiB each (one stream each; cudaMemcpyAsync "
        "within GPU 0), events, best of 5");
  // tp2 all on the streamer's GPU 1: still the device copy there.
  c.spread_receivers = false;
  c.device = 1;
  CHECK(cuda_ipc_placement(c, 2) == gpu_placement{1, {1, 1}});
  CHECK(copy_ceiling_method(cuda_ipc_placement(c, 2), 1ull << 30) ==
        "cudaMemcpyAsync device to device of 1024 MiB on GPU 1, events, best of 5");
  // tp4 all on another GPU: four shares to it at once.
  c.layout = layout_spec{layout_kind::fused, 4};
  c.device = 0;
  c.receiver_device = 2;
  CHECK(copy_ceiling_method(cuda_ipc_placement(c, 4), 1ull << 30) ==
        "cudaMemcpyPeerAsync from GPU 0 to GPUs 2, 2, 2, 2 at once, 256 MiB each (one stream each), events, best of "
        "5");
  // A streamer started by hand serves one receiver, whatever the layout.
  c.side = role::streamer;
  CHECK(cuda_ipc_placement(c, 4) == gpu_placement{0, {2}});
  // A GPU that is not visible is refused before anything is spawned.
  const auto refused = [](const config& k, int visible) {
    try {
      (void)cuda_ipc_placement(k, visible);
    } catch (const refit::error& e) {
      CHECK(e.code() == errc::invalid_argument);
      return std::string(e.what());
    }
    return std::string();
  };
  c.receiver_device = 1;
  CHECK(refused(c, 1) == "refit-bench: --receiver-device 1 but 1 CUDA device is visible");
  c.receiver_device = 4;
  CHECK(refused(c, 4) == "refit-bench: --receiver-device 4 but 4 CUDA devices are visible");
  CHECK(refused(c, 0) == "refit-bench: --receiver-device 4 but no CUDA device is visible");
  CHECK(refused(c, 5).empty());
}

TEST_CASE("a host_shm run with --layout tp2 verifies rank 1's slices as they landed, and counts the bytes it needs",
          "[bench][e2e]") {
  scratch s;
  config c = short_run("tiny");
  c.layout = layout_spec{layout_kind::fused, 2};
  c.rank = 1;
  c.json_file = s.file("out.json");
  std::ostringstream out;
  CHECK(run(c, out) == 0);
  INFO(out.str());
  CHECK_THAT(out.str(), Catch::Contains("# Wrong values          : 0 OK") &&
                            Catch::Contains("--layout tp2: each rank holds tiny in 17 engine tensors: 27 views of 27 "
                                            "source tensors") &&
                            Catch::Contains("host_shm rank 1 (--rank)"));
  const auto table = table_rows(out.str());
  REQUIRE(table.size() == 2);
  for (const auto& row : table) CHECK_THAT(row, Catch::Contains(" memcpy+tp2 "));
  std::ifstream f(c.json_file);
  const json j = json::parse(f);
  const manifest tiny = preset("tiny");
  for (const auto& r : j["rows"]) {
    CHECK(r["wrong"] == 0);
    CHECK(r["layout"] == "tp2");
    CHECK(r["bytes"] == make_layout(tiny, c.layout, 1).needed_bytes(tiny));
    CHECK(r["receivers"] == 1);
  }
  // Rank 0 too, from the binary; a tied embedding's vocabulary rows in both of its views.
  std::string text;
  CHECK(run_binary({"--model", "tiny", "--buffer-mb", "1", "--iters", "1", "--quiet", "--layout", "tp2"}, text) == 0);
  CHECK_THAT(text, Catch::Contains("# Wrong values          : 0 OK"));
  write_file(s.file("moe.json"), tied_moe_manifest());
  std::string tied;
  CHECK(run_binary({"--manifest", s.file("moe.json"), "--buffer-mb", "1", "--iters", "1", "--quiet", "--layout", "tp2",
                    "--rank", "1"},
                   tied) == 0);
  CHECK_THAT(tied, Catch::Contains("# Wrong values          : 0 OK"));
}

TEST_CASE("a byte corrupted in a row-parallel shard fails a --layout tp2 run with WRONG", "[bench][e2e]") {
  scratch s;
  // tensor 8 of tiny: layer 0's o_proj (its columns are strided in the source); 12: its down_proj.
  for (const char* tensor : {"8", "12"}) {
    std::string text;
    CHECK(run_binary({"--model", "tiny", "--buffer-mb", "1", "--iters", "1", "--warmup", "0", "--layout", "tp2",
                      "--rank", "1", "--corrupt-byte", tensor},
                     text, s.file("err")) == 1);
    CHECK_THAT(text, Catch::Contains("# Wrong values          : 1 FAILED") && Catch::Contains("memcpy+tp2"));
    CHECK_THAT(read_file(s.file("err")),
               Catch::Contains(fmt::format("WRONG: version 1 tensor {} (model.layers.0.{}", tensor,
                                           tensor == std::string("8") ? "self_attn.o_proj" : "mlp.down_proj")));
  }
}

TEST_CASE("a streamer started by hand checking another tp rank than its receiver's is refused, naming both",
          "[bench][e2e]") {
  scratch s;
  hand_receiver rx(s, "receiver",
                   {"--bind", "ipc://" + s.file("x"), "--model", "tiny", "--layout", "tp2", "--rank", "1"});
  CHECK(rx.ready["rank"] == 1);
  CHECK_THAT(rx.banner(), Catch::Contains("--layout tp2 --rank 1"));
  config c = hand_streamer(rx);
  c.buffer_mb = {1};
  c.layout = layout_spec{layout_kind::fused, 2};
  std::ostringstream out;
  try {
    (void)run(c, out);
    FAIL("no error");
  } catch (const refit::error& e) {
    CHECK(e.code() == errc::protocol);
    CHECK_THAT(e.what(), Catch::Contains("holds rank 1 of --layout tp2 and this streamer checks rank 0"));
  }
  hand_receiver fresh(s, "fresh",
                      {"--bind", "ipc://" + s.file("y"), "--model", "tiny", "--layout", "tp2", "--rank", "1"});
  config same = hand_streamer(fresh);
  same.buffer_mb = {1};
  same.layout = layout_spec{layout_kind::fused, 2};
  same.rank = 1;
  std::ostringstream good;
  CHECK(run(same, good) == 0);
  CHECK_THAT(good.str(), Catch::Contains("# Wrong values          : 0 OK"));
}

namespace {

// The source tree's bench/layouts (the recorded route tables shipped as examples): next to the
// bench binary's build tree (its meson-info names the source directory), or above it.
std::string layouts_dir() {
  for (fs::path d = fs::path(bench_binary()).parent_path(); !d.empty() && d != d.root_path(); d = d.parent_path()) {
    if (fs::exists(d / "bench" / "layouts" / "tiny-llama.json")) return (d / "bench" / "layouts").string();
    const fs::path info = d / "meson-info" / "meson-info.json";
    if (fs::exists(info)) {
      std::ifstream f(info);
      const json j = json::parse(f);
      return (fs::path(j["directories"]["source"].get<std::string>()) / "bench" / "layouts").string();
    }
  }
  FAIL("bench/layouts not found");
  return "";
}

}  // namespace

TEST_CASE("--layout recorded:FILE parses, names itself and round-trips; one file per rank", "[bench]") {
  const auto one = parse_layout("recorded:a.json");
  REQUIRE(one);
  CHECK(one->kind == layout_kind::recorded);
  CHECK(one->tp == 1);
  CHECK(layout_name(*one) == "recorded:a.json");
  const auto two = parse_layout("recorded:a.json,b.json");
  REQUIRE(two);
  CHECK(two->tp == 2);
  CHECK(two->files == std::vector<std::string>{"a.json", "b.json"});
  CHECK(parse_layout(layout_name(*two)) == two);
  CHECK_FALSE(parse_layout("recorded:"));
  CHECK_FALSE(parse_layout("recorded:a.json,"));
  const std::string dir = layouts_dir();
  const manifest m = load_manifest(dir + "/tiny-llama.json");
  const std::string r0 = dir + "/tiny-llama-tp2-rank0.json", r1 = dir + "/tiny-llama-tp2-rank1.json";
  const layout_spec both = *parse_layout("recorded:" + r0 + "," + r1);
  for (int rank = 0; rank < 2; ++rank) {
    const engine_layout l = make_layout(m, both, rank);
    CHECK(l.tp == 2);
    CHECK(l.views.size() == m.entries.size());
    for (std::size_t i = 0; i < m.entries.size(); ++i) CHECK(l.of_source[i].size() == 1);
  }
  // Rank 1's o_proj: its columns 16..31 of the source, into its own dense [32, 16].
  const engine_layout l1 = make_layout(m, both, 1);
  for (const auto& v : l1.views)
    if (m.entries[v.source].meta.name == "model.layers.0.self_attn.o_proj.weight") {
      CHECK(v.slice == source_slice{1, 16, 16});
      CHECK(v.shape == std::vector<std::int64_t>{32, 16});
    }
  CHECK(layout_error(m, both, 2) ==
        "refit-bench: --rank 2: out of range for --layout recorded:" + r0 + "," + r1 + " (ranks 0 to 1)");
}

TEST_CASE("--layout recorded:FILE refuses unrecorded sources, sources the model lacks and shapes that differ",
          "[bench]") {
  scratch s;
  const std::string dir = layouts_dir();
  const manifest m = load_manifest(dir + "/tiny-llama.json");
  const json table = json::parse(read_file(dir + "/tiny-llama-tp2-rank0.json"));
  const auto refused = [&](const json& t) {
    const std::string file = s.file("t.json");
    write_file(file, t.dump());
    std::string what = layout_error(m, *parse_layout("recorded:" + file));
    const std::string prefix = "refit-bench: --layout recorded:" + file + ": ";
    CHECK(what.starts_with(prefix));
    return what.starts_with(prefix) ? what.substr(prefix.size()) : what;
  };
  json unrecorded = table;
  unrecorded["entries"].erase("model.norm.weight");
  unrecorded["unrecorded"]["model.norm.weight"] = "used by mul";
  CHECK(refused(unrecorded) ==
        "the table has 1 unrecorded source (refit.record could not follow the loader): "
        "model.norm.weight; a recorded layout needs every source routed");
  json lacking = table;
  lacking["entries"]["model.extra.weight"] = table["entries"]["model.norm.weight"];
  CHECK(refused(lacking) ==
        "the table routes model.extra.weight, which tiny-llama lacks; give the model the table was "
        "recorded for");
  json shape = table;
  shape["sources"]["model.norm.weight"]["shape"] = {64};
  CHECK(refused(shape) ==
        "the table was recorded with model.norm.weight bf16[64] and tiny-llama has "
        "model.norm.weight bf16[32]");
  json outside = table;
  outside["entries"]["model.norm.weight"][0]["offset"] = 1;
  CHECK(refused(outside) ==
        "model.norm.weight lands in model.norm.weight bf16[32] from element 1: 32 elements do not "
        "fit its 32");
  json missing = table;
  missing["entries"].erase("model.norm.weight");
  CHECK(refused(missing) == "tiny-llama has model.norm.weight, which the table does not route");
  // A key twice (a table edited by hand): refused, rather than one of the two kept.
  const std::string twice = s.file("twice.json");
  write_file(twice, R"({"entries": {"a": [], "a": []}, "params": {}, "unrecorded": {}})");
  CHECK(layout_error(m, *parse_layout("recorded:" + twice)) ==
        "refit-bench: --layout recorded:" + twice + ": 'a' is a key twice in \"entries\"");
  // From the binary, before any refit: exit 2 and the message.
  write_file(s.file("u.json"), unrecorded.dump());
  std::string out;
  CHECK(run_binary({"--manifest", dir + "/tiny-llama.json", "--buffer-mb", "1", "--iters", "1", "--quiet", "--layout",
                    "recorded:" + s.file("u.json")},
                   out, s.file("err")) == 2);
  CHECK_THAT(read_file(s.file("err")),
             Catch::Contains("1 unrecorded source (refit.record could not follow the loader): "
                             "model.norm.weight"));
  CHECK(run_binary({"--model", "tiny", "--buffer-mb", "1", "--iters", "1", "--quiet", "--layout",
                    "recorded:" + dir + "/tiny-llama-tp2-rank0.json"},
                   out, s.file("err")) == 2);
  CHECK_THAT(read_file(s.file("err")),
             Catch::Contains("the table was recorded with model.embed_tokens.weight bf16[98, 32] "
                             "and tiny has model.embed_tokens.weight bf16[1000, 256]"));
}

TEST_CASE(
    "a host_shm run with --layout recorded:FILE verifies every source in its recorded views; a wrong byte fails it",
    "[bench][e2e]") {
  scratch s;
  const std::string dir = layouts_dir();
  const std::string r0 = dir + "/tiny-llama-tp2-rank0.json", r1 = dir + "/tiny-llama-tp2-rank1.json";
  std::string text;
  CHECK(run_binary({"--manifest", dir + "/tiny-llama.json", "--buffer-mb", "1", "--iters", "1", "--quiet", "--layout",
                    "recorded:" + r0, "--json", s.file("out.json")},
                   text) == 0);
  INFO(text);
  CHECK_THAT(text, Catch::Contains("# Wrong values          : 0 OK") && Catch::Contains("memcpy+recorded"));
  {
    std::ifstream f(s.file("out.json"));
    const json j = json::parse(f);
    const manifest m = load_manifest(dir + "/tiny-llama.json");
    for (const auto& r : j["rows"]) {
      CHECK(r["wrong"] == 0);
      CHECK(r["layout"] == "recorded:" + r0);
      CHECK(r["bytes"] == make_layout(m, *parse_layout("recorded:" + r0)).needed_bytes(m));
      CHECK(r["bytes"] < m.bytes());
    }
  }
  // Rank 1 of both tables.
  CHECK(run_binary({"--manifest", dir + "/tiny-llama.json", "--buffer-mb", "1", "--iters", "1", "--quiet", "--layout",
                    "recorded:" + r0 + "," + r1, "--rank", "1"},
                   text) == 0);
  CHECK_THAT(text, Catch::Contains("# Wrong values          : 0 OK"));
  // tensor 4 of tiny-llama: layer 0's o_proj (rank 0's columns, strided in the source).
  CHECK(run_binary({"--manifest", dir + "/tiny-llama.json", "--buffer-mb", "1", "--iters", "1", "--warmup", "0",
                    "--layout", "recorded:" + r0, "--corrupt-byte", "4"},
                   text, s.file("err")) == 1);
  CHECK_THAT(text, Catch::Contains("# Wrong values          : 1 FAILED"));
  CHECK_THAT(read_file(s.file("err")), Catch::Contains("WRONG: version 1 tensor 4 (model.layers.0.self_attn.o_proj"));
}

TEST_CASE("--convert parses its three conversions, sets the source dtype and refuses what it cannot run", "[bench]") {
  int code = -1;
  const char* block[] = {"refit-bench", "--convert", "bf16:fp8-block128"};
  const auto b = parse_args(static_cast<int>(std::size(block)), block, code);
  REQUIRE(b);
  REQUIRE(b->convert);
  CHECK(b->convert->q == refit::quant::block128);
  CHECK(b->type == refit::dtype::bf16);
  const char* cast[] = {"refit-bench", "--convert", "f32:bf16"};
  const auto c = parse_args(static_cast<int>(std::size(cast)), cast, code);
  REQUIRE(c);
  CHECK(c->type == refit::dtype::f32);
  CHECK(c->convert->to == refit::dtype::bf16);
  for (const auto& [name, q] :
       {std::pair{"bf16:fp8-channel", refit::quant::channel}, std::pair{"bf16:mxfp8", refit::quant::mxfp8}}) {
    const char* row[] = {"refit-bench", "--convert", name};
    const auto r = parse_args(static_cast<int>(std::size(row)), row, code);
    REQUIRE(r);
    CHECK(r->convert->q == q);
    CHECK(r->convert->to == refit::dtype::f8_e4m3);
  }
  const char* bad[] = {"refit-bench", "--convert", "bf16:int4"};
  CHECK_THROWS_WITH(parse_args(static_cast<int>(std::size(bad)), bad, code),
                    Catch::Contains("--convert bf16:int4: unknown"));
  const char* fused[] = {"refit-bench", "--convert", "bf16:fp8-tensor", "--layout", "fused"};
  CHECK_THROWS_WITH(parse_args(static_cast<int>(std::size(fused)), fused, code),
                    Catch::Contains("only --layout plain"));
  const char* dtype[] = {"refit-bench", "--convert", "bf16:fp8-tensor", "--dtype", "f16"};
  CHECK_THROWS_WITH(parse_args(static_cast<int>(std::size(dtype)), dtype, code),
                    Catch::Contains("--dtype f16 disagrees"));
}

TEST_CASE("a short host_shm run with --convert commits every refit into fp8 destinations, rows with their own floor",
          "[bench][e2e]") {
  const std::string name = GENERATE("bf16:fp8-block128", "bf16:fp8-channel", "bf16:mxfp8");
  INFO(name);
  scratch s;
  config c = short_run("tiny");
  c.convert = parse_conversion(name);
  c.json_file = s.file("out.json");
  std::ostringstream out;
  CHECK(run(c, out) == 0);
  INFO(out.str());
  CHECK_THAT(out.str(), Catch::Contains("+cvt:" + name.substr(5)) && Catch::Contains("--convert " + name));
  std::ifstream f(c.json_file);
  const json j = json::parse(f);
  REQUIRE(j["rows"].size() == 2);
  for (const auto& r : j["rows"]) {
    CHECK(r["wrong"].is_null());  // not verified: n/a
    CHECK(r["floor_ms"].get<double>() > 0);
  }
}

TEST_CASE(
    "a host_shm run with --streamers 3 assembles Shard(0) rows into a verified replica, timed against its ceiling",
    "[bench][e2e]") {
  std::string out;
  const int code = run_binary(
      {"--streamers", "3", "--transport", "host_shm", "--model", "tiny", "--iters", "2", "--warmup", "1", "-q"}, out);
  INFO(out);
  CHECK(code == 0);
  CHECK_THAT(out, Catch::Contains("# refit-bench --streamers 3: tiny"));
  CHECK_THAT(out, Catch::Contains("Shard(0) rows per rank (torch.chunk)"));
  CHECK_THAT(out, Catch::Contains("# ceiling: one memcpy"));
  CHECK_THAT(out, Catch::Contains("x the ceiling"));
  CHECK_THAT(out, Catch::Contains("# out of bounds/wrong values: 0"));
}

namespace {

/// The bench's stderr for `args`, run to its end; CHECKs that it exits with `code`.
std::string bench_error(const std::vector<std::string>& args, int code = 2) {
  scratch s;
  const std::string err = s.file("err.txt");
  std::string out;
  CHECK(run_binary(args, out, err) == code);
  return read_file(err);
}

}  // namespace

TEST_CASE("--streamers 2 into engine layouts over host_shm: a tp2 rank and a fused replica, every tensor verified",
          "[bench][e2e]") {
  for (const std::vector<std::string>& layout : {std::vector<std::string>{"--layout", "tp2", "--rank", "1"},
                                                 {"--layout", "tp2", "--rank", "0"},
                                                 {"--layout", "fused"}}) {
    std::vector<std::string> args{"--streamers", "2", "--transport", "host_shm", "--model", "tiny",
                                  "--iters",     "2", "--warmup",    "1",        "-q"};
    args.insert(args.end(), layout.begin(), layout.end());
    std::string out;
    const int code = run_binary(args, out);
    INFO(out);
    CHECK(code == 0);
    CHECK_THAT(out, Catch::Contains(layout[1] == "fused" ? "(each the model in --layout fused)"
                                                         : "(rank " + layout[3] + " of --layout tp2)"));
    CHECK_THAT(out, Catch::Contains("# out of bounds/wrong values: 0 "));
  }
  // The verification is real: a receiver that damages a tensor after each commit fails the run.
  std::string out;
  CHECK(run_binary({"--streamers", "2", "--transport", "host_shm", "--model", "tiny", "--layout", "tp2", "--rank", "1",
                    "--iters", "2", "--warmup", "0", "--corrupt-byte", "5", "-q"},
                   out) == 1);
  INFO(out);
  CHECK_THAT(out, Catch::Contains("# out of bounds/wrong values: 2 "));
}

TEST_CASE("--streamers refuses what it cannot run, saying what to do", "[bench]") {
  CHECK_THAT(bench_error({"--streamers", "2", "--transport", "host_shm", "--model", "tiny", "--receivers", "2", "-q"}),
             Catch::Contains("error (invalid_argument): --streamers with host_shm: one receiver (--receivers 1)\n"));
  CHECK_THAT(bench_error({"--streamers", "2", "--transport", "host_shm,cuda_ipc", "--model", "tiny", "-q"}),
             Catch::Contains("error (invalid_argument): --streamers: one --transport: host_shm, cuda_ipc (in a build "
                             "with CUDA) or nccl (with NCCL)\n"));
  CHECK_THAT(bench_error({"--streamers", "2", "--model", "tiny", "--convert", "bf16:fp8-tensor", "-q"}),
             Catch::Contains("error (invalid_argument): --streamers with --convert bf16:fp8-tensor: a group's "
                             "receivers hold the model's own dtypes; run --convert without --streamers\n"));
  CHECK_THAT(bench_error({"--streamers", "2", "--model", "tiny,qwen2.5-0.5b", "-q"}),
             Catch::Contains("error (invalid_argument): --streamers: exactly one built-in --model\n"));
  // nccl with no GPU visible (hidden here, whatever the machine has): built without NCCL, or no GPU.
  ::setenv("CUDA_VISIBLE_DEVICES", "", 1);
  const std::string nccl = bench_error({"--streamers", "2", "--transport", "nccl", "--model", "tiny", "-q"});
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  CHECK_THAT(nccl, Catch::Contains(REFIT_HAVE_NCCL
                                       ? "error (invalid_argument): --streamers over nccl needs a visible GPU and none "
                                         "is visible; check CUDA_VISIBLE_DEVICES, or use --transport host_shm\n"
                                       : "error (invalid_argument): --streamers over nccl: this bench was built "
                                         "without NCCL; rebuild with -Dnccl=enabled, or use --transport cuda_ipc or "
                                         "host_shm\n"));
}

TEST_CASE("--streamers over nccl gives every rank a GPU of its own unless --nccl-share-gpus", "[bench]") {
  config c;
  c.streamers = 2;
  if (!REFIT_HAVE_NCCL) {
    CHECK_THROWS_WITH(check_group_gpus(c, 2, 2, 8),
                      "--streamers over nccl: this bench was built without NCCL; rebuild with -Dnccl=enabled, or use "
                      "--transport cuda_ipc or host_shm");
    return;
  }
  CHECK_NOTHROW(check_group_gpus(c, 2, 2, 4));
  CHECK_THROWS_WITH(check_group_gpus(c, 2, 2, 3),
                    "--streamers 2 over nccl with 2 receiver(s): 4 ranks, each on a GPU of its own (NCCL allows one "
                    "rank of a communicator per GPU of a host), and 3 GPU(s) visible; --nccl-share-gpus lets ranks "
                    "share GPUs through NCCL's network transport");
  CHECK_THROWS_WITH(check_group_gpus(c, 2, 1, 0),
                    "--streamers over nccl needs a visible GPU and none is visible; check CUDA_VISIBLE_DEVICES, or "
                    "use --transport host_shm");
  c.device = 3;
  CHECK_THROWS_WITH(check_group_gpus(c, 2, 1, 3), "--streamers over nccl: --device 3 but 3 GPU(s) are visible");
  c.device = 0;
  c.nccl_share_gpus = true;  // four ranks on one GPU, each process an NCCL host of its own
  CHECK_NOTHROW(check_group_gpus(c, 2, 2, 1));
}

// ============================================================================ hostile peers' JSON

namespace {

// `depth` arrays, one inside the other.
std::string nested_json(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// An attacker's report endpoint: answers every request with `answer`, from a thread of its own,
// until destroyed.
struct fake_report_endpoint {
  fake_report_endpoint(const std::string& endpoint, std::string answer_with)
      : channel(endpoint), answer(std::move(answer_with)), thread([this] { serve(); }) {}
  ~fake_report_endpoint() {
    stop = true;
    thread.join();
  }
  fake_report_endpoint(const fake_report_endpoint&) = delete;
  fake_report_endpoint& operator=(const fake_report_endpoint&) = delete;

  void serve() {
    while (!stop)
      if (channel.receive(std::chrono::milliseconds(50))) {
        ++asked;
        channel.reply(answer);
      }
  }

  refit::channel::rep_channel channel;
  std::string answer;
  std::atomic<bool> stop{false};
  std::atomic<int> asked{0};
  std::thread thread;  // last: it starts once the rest is there
};

}  // namespace

TEST_CASE("JSON from a peer is refused unread past its size or 32 levels of nesting, brackets in strings aside",
          "[bench]") {
  CHECK_FALSE(peer_json_problem(R"({"version": 1})", 4096));
  CHECK_FALSE(peer_json_problem(nested_json(max_json_depth), 4096));
  CHECK(peer_json_problem(nested_json(max_json_depth + 1), 4096) == "nested deeper than 32 levels");
  CHECK(peer_json_problem("{\"a\":" + nested_json(max_json_depth), 4096) == "nested deeper than 32 levels");
  // Brackets inside strings, escaped quotes included, are text.
  const std::string in_string = "[\"" + std::string(100, '[') + "\\\"" + std::string(100, '{') + "\"]";
  CHECK_FALSE(peer_json_problem(in_string, 4096));
  CHECK(json::parse(in_string)[0].get<std::string>().size() == 201);
  CHECK(peer_json_problem(std::string(4097, ' '), 4096) == "of 4097 bytes, more than the 4096 it may have");
  CHECK_FALSE(peer_json_problem(std::string(4096, ' '), 4096));
  // A million levels: refused after one scan, with the problem, the peer and the start of the text.
  CHECK_THROWS_MATCHES(parse_peer_json(nested_json(1000000), 4u << 20, "the receiver"), refit::error,
                       Catch::Matchers::Predicate<refit::error>([](const refit::error& e) {
                         const std::string what = e.what();
                         return e.code() == errc::protocol &&
                                what.starts_with(
                                    "refit-bench: the receiver sent JSON nested deeper than 32 levels: "
                                    "refused unread; it begins [[[[") &&
                                what.ends_with(" more bytes)") && what.size() < 400;
                       }));
  CHECK_THROWS_MATCHES(parse_peer_json("\x1b[2Knot json\n", 4096, "rank 1"), refit::error,
                       Catch::Matchers::Predicate<refit::error>([](const refit::error& e) {
                         return std::string(e.what()) ==
                                "refit-bench: rank 1 sent a line that is not JSON: \\x1b[2Knot json\\n";
                       }));
  CHECK(parse_peer_json(R"({"event": "ready"})", 4096, "rank 1")["event"] == "ready");
}

TEST_CASE("an excerpt of a peer's JSON is bounded, printable, cut at depth 8 and never throws on invalid UTF-8",
          "[bench]") {
  CHECK(excerpt(json{{"event", "unknown"}, {"version", 7}}) == R"({"event":"unknown","version":7})");
  json deep = 1;
  for (int i = 0; i < 100; ++i) deep = json::array({deep});
  CHECK(excerpt(deep) == "[[[[[[[[[…]]]]]]]]]");
  json wide = json::array();
  for (int i = 0; i < 10000; ++i) wide.push_back(i);
  const std::string w = excerpt(wide);
  CHECK(w.size() <= 300);
  CHECK(w.starts_with("[0,1,2,3,"));
  CHECK(w.ends_with("more bytes)"));
  // A string that is not UTF-8 (nlohmann's dump() would throw type_error 316) and control bytes.
  CHECK(excerpt(json{{"error", "bad \xff name\x1b[0m"}}) == "{\"error\":\"bad \xef\xbf\xbd name\\u001b[0m\"}");
  CHECK(excerpt(json(std::string(1u << 20, 'z'))).size() <= 300);
}

TEST_CASE("a report line holding invalid UTF-8 is refused quoting it, not by an exception of the JSON writer",
          "[bench]") {
  manifest m;
  m.name = "one";
  m.entries = {{tensor_meta{"a", dtype::u8, {4}}}};
  config c;
  c.quiet = true;
  std::int64_t printed = 0;
  try {
    (void)count_wrong(c, json{{"event", "aborted"}, {"error", "tensor '\xff\xfe' \x1b[1A\n"}}, 1, m, {7}, "rx", "",
                      printed);
    FAIL("count_wrong accepted an aborted line");
  } catch (const refit::error& e) {
    CHECK(e.code() == errc::protocol);
    CHECK_THAT(e.what(), Catch::Contains(R"(it said {"error":"tensor ')"
                                         "\xef\xbf\xbd\xef\xbf\xbd"
                                         R"(' \u001b[1A\n")"));
  }
}

TEST_CASE("a report endpoint answering JSON nested a million levels deep is refused unread; the streamer ends cleanly",
          "[bench][e2e]") {
  scratch s;
  hand_receiver rx(s, "receiver", {"--bind", "ipc://" + s.file("x"), "--model", "tiny"});
  fake_report_endpoint fake("ipc://" + s.file("fake.report"), nested_json(1000000));
  std::string out;
  const int code = run_binary({"--role", "streamer", "--connect", rx.endpoint(), "--report", fake.channel.endpoint(),
                               "--model", "tiny", "--buffer-mb", "1", "--warmup", "0", "--iters", "1"},
                              out, s.file("streamer.err"));
  const std::string err = read_file(s.file("streamer.err"));
  INFO(err);
  CHECK(code == 2);  // an error, said on one line; -1 would be a crash (the stack overflowed in dump())
  CHECK(fake.asked == 1);
  CHECK_THAT(
      err, Catch::Contains("refit-bench: error (protocol): the receiver at report endpoint " + fake.channel.endpoint() +
                           " answered for version 1 with JSON of 2000000 bytes, more than the") &&
               Catch::Contains("it may have: refused unread; it begins [[[[") && Catch::EndsWith("more bytes)\n"));
  CHECK(err.size() < 2000);
}

TEST_CASE("a report endpoint answering a committed line nested 33 levels deep is refused unread", "[bench][e2e]") {
  scratch s;
  hand_receiver rx(s, "receiver", {"--bind", "ipc://" + s.file("x"), "--model", "tiny"});
  fake_report_endpoint fake("ipc://" + s.file("fake.report"),
                            R"({"event":"committed","version":1,"checksums":)" + nested_json(32) + "}");
  config c = hand_streamer(rx);
  c.report = fake.channel.endpoint();
  c.buffer_mb = {1};
  std::ostringstream out;
  std::string what;
  try {
    (void)run(c, out);
  } catch (const refit::error& e) {
    CHECK(e.code() == errc::protocol);
    what = e.what();
  }
  CHECK_THAT(what, Catch::Contains("answered for version 1 with JSON nested deeper than 32 levels: refused unread"));
}

TEST_CASE("a receiver started by hand refuses a nested or oversized report request unread and serves on",
          "[bench][e2e]") {
  scratch s;
  hand_receiver rx(s, "receiver", {"--bind", "ipc://" + s.file("x"), "--model", "tiny"});
  {
    refit::channel::req_channel asker(rx.report());
    const auto ask = [&](const std::string& request) {
      return json::parse(asker.request(request, std::chrono::seconds(30), "a hostile report request"));
    };
    const json huge = ask(nested_json(1000000));
    CHECK(huge["event"] == "error");
    CHECK_THAT(huge["error"].get<std::string>(),
               Catch::Contains("this one, of 2000000 bytes, more than the 4096 it may have, was refused unread"));
    const json deep = ask("{\"version\": 1, \"x\": " + nested_json(40) + "}");
    CHECK(deep["event"] == "error");
    CHECK_THAT(deep["error"].get<std::string>(), Catch::Contains("nested deeper than 32 levels, was refused unread"));
    CHECK(ask(R"({"version": 1})") == json{{"event", "unknown"}, {"version", 1}});
  }
  config c = hand_streamer(rx);
  c.buffer_mb = {1};
  std::ostringstream out;
  CHECK(run(c, out) == 0);
  CHECK(rx.process.running());
}

TEST_CASE(
    "a tensor name of invalid UTF-8 and escapes aborts that refit on a receiver started by hand; its JSON "
    "stays valid and it serves on",
    "[bench][e2e]") {
  scratch s;
  hand_receiver rx(s, "receiver", {"--bind", "ipc://" + s.file("x"), "--model", "tiny"});
  {
    streamer_options so;
    so.endpoint = rx.endpoint();
    so.buffer_bytes = 1 << 20;
    so.timeout = std::chrono::seconds(30);
    streamer attacker(so);
    const std::string name(std::string_view("bad\xff\xfe\x1b[1A\nrefit-bench: ok\0", 26));
    std::vector<std::uint8_t> bytes(64, 7);
    const tensor_ref t{tensor_meta{name, dtype::u8, {64}}, bytes.data()};
    std::string what;
    try {
      (void)attacker.refit(1, std::span<const tensor_ref>(&t, 1));
    } catch (const refit::error& e) {
      what = e.what();
    }
    INFO(what);
    REQUIRE_FALSE(what.empty());
    CHECK(what.find('\x1b') == std::string::npos);
    CHECK(what.find('\0') == std::string::npos);
    CHECK_THAT(what, Catch::Contains("bad\\xff\\xfe\\x1b[1A\\nrefit-bench: ok\\x00"));
  }
  // The receiver said so in one JSON line (json::parse throws on bytes that are not UTF-8).
  const json aborted = json::parse(rx.process.read_line(std::chrono::seconds(30)));
  CHECK(aborted["event"] == "aborted");
  CHECK_THAT(aborted["error"].get<std::string>(), Catch::Contains("bad\\xff\\xfe\\x1b[1A\\nrefit-bench: ok\\x00"));
  // And it is still there: a streamer started by hand verifies every refit through it.
  config c = hand_streamer(rx);
  c.buffer_mb = {1};
  std::ostringstream out;
  CHECK(run(c, out) == 0);
  CHECK(rx.process.running());
}

TEST_CASE("each row's memory budget is README.md's formula for its path; a side over it is counted and fails the run",
          "[bench][memory]") {
  config c;
  const manifest m = preset("tiny");
  const std::uint64_t mib = 1ull << 20, slack = 8 * mib;
  const auto at = [](std::uint64_t v) { return static_cast<std::int64_t>(v); };
  row r;
  r.buffers = 2;
  r.buffer_bytes = 64 * mib;
  r.bytes = 1000 * mib;
  r.transport = "host_shm";
  set_memory_budget(c, m, r, false);
  CHECK(r.streamer_budget.host == at(128 * mib + slack));
  CHECK(r.receiver_budget.host == at(128 * mib + slack));
  CHECK(r.streamer_budget.device == at(slack));
  r.transport = "cuda_ipc";
  set_memory_budget(c, m, r, true);
  CHECK(r.streamer_budget.device == at(128 * mib + slack));
  CHECK(r.receiver_budget.device == at(slack));
  c.stage = refit::stage_kind::device;
  set_memory_budget(c, m, r, true);
  CHECK(r.receiver_budget.device == at(1000 * mib + slack));
  CHECK(r.receiver_formula == "0 + table device");
  c.stage = refit::stage_kind::host;
  set_memory_budget(c, m, r, true);
  CHECK(r.receiver_budget.pinned == at(1000 * mib + slack));
  c.stage = refit::stage_kind::none;
  r.transport = "nccl";
  set_memory_budget(c, m, r, true);  // in place: the warm-up broadcast only
  CHECK(r.streamer_budget.device == at(mib + slack));
  CHECK(r.receiver_budget.device == at(mib + slack));
  set_memory_budget(c, m, r, false);  // buffered
  CHECK(r.streamer_budget.device == at(128 * mib + mib + slack));
  CHECK(r.receiver_budget.device == at(128 * mib + mib + slack));

  r.streamer_memory = {at(128 * mib + mib), 0, 0};
  r.receiver_memory = {at(128 * mib + mib + slack), 0, 0};
  CHECK_FALSE(over_budget(r));
  r.receiver_memory.device += 1;
  CHECK(over_budget(r));
  CHECK(rows_over_budget({r, row{}}) == 1);
}

TEST_CASE("a host_shm run holds both sides to their memory budgets and says so in the footer and the JSON",
          "[bench][memory][e2e]") {
  scratch s;
  config c = short_run("tiny");
  c.json_file = s.file("out.json");
  c.memory = true;
  std::ostringstream out;
  CHECK(run(c, out) == 0);
  INFO(out.str());
  CHECK_THAT(out.str(), Catch::Contains("# Memory over budget    : 0 OK") &&
                            Catch::Contains("(budget 8.0/8.0/8.5: n x b host; driver "));
  std::ifstream f(c.json_file);
  const json j = json::parse(f);
  REQUIRE(j["rows"].size() == 2);
  for (const auto& r : j["rows"]) {
    const auto& mem = r["memory"];
    CHECK(mem["over_budget"] == false);
    const std::int64_t buffers = r["buffers"].get<std::int64_t>() * r["buffer_bytes"].get<std::int64_t>();
    CHECK(mem["budget"]["streamer"]["host"].get<std::int64_t>() == buffers + (8 << 20));
    CHECK(mem["streamer"]["host"].get<std::int64_t>() >= buffers);  // its segments, counted
    CHECK(mem["receiver"]["host"].get<std::int64_t>() >= buffers);  // its mappings of them
    CHECK(mem["budget"]["receiver_formula"] == "n x b host (mapped)");
  }
}

TEST_CASE("--chaos reads kill, add, remove and back, a bare probability as kill, and refuses the rest by name",
          "[bench][chaos]") {
  const chaos_spec s = parse_chaos("add=0.05,kill=0.25,back=add,remove=0.1");
  CHECK(s.kill == 0.25);
  CHECK(s.add == 0.05);
  CHECK(s.remove == 0.1);
  CHECK_FALSE(s.rejoin);
  const chaos_spec bare = parse_chaos("0.2");
  CHECK(bare.kill == 0.2);
  CHECK(bare.add == 0);
  CHECK(bare.rejoin);
  CHECK_THROWS_WITH(parse_chaos("kill=1.5"),
                    "refit-bench: --chaos kill=1.5: kill=1.5 is not a probability in [0, 1] (kill=P,add=P,remove=P,"
                    "back=rejoin|add, or a bare P for kill=P)");
  CHECK_THROWS_WITH(parse_chaos("kill=0.1,back=later"),
                    "refit-bench: --chaos kill=0.1,back=later: cannot read 'back=later' (kill=P, add=P, remove=P, "
                    "back=rejoin or back=add)");

  int code = -1;
  const char* args[] = {"refit-bench", "--chaos", "0.3", "--receivers", "4", "--model", "tiny"};
  const auto c = parse_args(static_cast<int>(std::size(args)), args, code);
  REQUIRE(c);
  REQUIRE(c->chaos);
  CHECK(c->chaos->kill == 0.3);
  CHECK(c->timeout_ms == 1000);  // a failure costs one: not the usual 120 s
  const char* timed[] = {"refit-bench", "--chaos", "0.3", "--timeout-ms", "500"};
  CHECK(parse_args(static_cast<int>(std::size(timed)), timed, code)->timeout_ms == 500);
  const char* with_delta[] = {"refit-bench", "--chaos", "0.3", "--delta", "2"};
  CHECK_THROWS_WITH(parse_args(static_cast<int>(std::size(with_delta)), with_delta, code),
                    "refit-bench: --chaos runs alone: not with --delta or --streamers");
}

TEST_CASE("--chaos over a transport whose streamer refuses drop stops before any process, with its refusal",
          "[bench][chaos]") {
  config c = short_run("tiny");
  c.chaos = parse_chaos("0.5");
  c.transports = {transport_kind::nccl};
  std::ostringstream out;
  try {
    (void)run(c, out);
    FAIL("--chaos over nccl ran");
  } catch (const refit::error& e) {
    CHECK(e.code() == errc::invalid_argument);
    const std::string what = e.what();
    CHECK(what.rfind("refit-bench: --chaos over nccl: ", 0) == 0);
    CHECK_THAT(what, Catch::EndsWith("; --chaos runs over host_shm"));
  }
  CHECK(out.str().empty());
}

TEST_CASE("--chaos kills, restarts, adds and removes receivers over many versions; every commit verified",
          "[bench][e2e][chaos]") {
  scratch s;
  for (const bool rejoin : {true, false}) {
    config c = short_run("tiny");
    c.chaos = parse_chaos(fmt::format("kill=0.3,add=0.15,remove=0.15,back={}", rejoin ? "rejoin" : "add"));
    c.receivers = 4;
    c.iters = 16;
    c.timeout_ms = 1000;
    c.seed = 7;
    c.buffer_mb = {0.25};
    c.json_file = s.file("chaos.json");
    std::ostringstream out;
    CHECK(run(c, out) == 0);
    INFO(out.str());
    CHECK_THAT(out.str(), Catch::Contains("# Wrong values          : 0 OK"));
    CHECK_THAT(out.str(), Catch::Contains("target no stall"));
    std::ifstream f(c.json_file);
    const json j = json::parse(f);
    REQUIRE(j["rows"].size() == 1);
    const json& r = j["rows"][0];
    CHECK(r["completed"] == 16);
    CHECK(r["wrong"] == 0);
    CHECK(r["kills"].get<int>() >= 1);
    // Each killed one started again before the next version (the last version's, if any, not).
    CHECK(r["restarts"].get<int>() >= r["kills"].get<int>() - 1);
    CHECK(r["restarts"].get<int>() <= r["kills"].get<int>());
    CHECK(r["failover_ms"].size() == r["kills"]);
    CHECK(r["unexpected_drops"] == 0);
    CHECK(r["by_version"].size() == 16);
    // Every version with a kill names the killed one, and only it, as dropped.
    for (const auto& v : r["by_version"])
      if (v["kind"] == "failure") CHECK(v["dropped"].size() == 1);
    CHECK(j["ok"] == true);
  }
}
