// Writes the seed corpus of the fuzz targets: valid messages, sessions and manifests, one file
// each, into DIR/<target>/ (tests/fuzz/corpus in the source tree; the files are committed).
//
//   make_corpus DIR
//
// `meson compile -C build fuzz-corpus` runs it on tests/fuzz/corpus (tests/fuzz/README.md).
//
// Seeds are valid inputs so the fuzzers start from the deep paths (a BATCH that passes every
// rule, a safetensors header that parses) rather than having to discover the format.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "channel/zmtp.hpp"
#include "refit/model.hpp"
#include "transport/nccl_session.hpp"
#include "transport/vmm_record.hpp"
#include "wire/wire.hpp"

namespace fs = std::filesystem;
namespace wire = refit::wire;
using refit::dtype;

namespace {

void write(const fs::path& dir, const std::string& name, const std::string& bytes) {
  fs::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + (dir / name).string());
}

std::string concat(std::uint8_t flags, const std::vector<wire::message>& ms) {
  std::string s(1, static_cast<char>(flags));
  for (const auto& m : ms) s += wire::encode(m);
  return s;
}

std::string safetensors(const std::string& header, std::size_t data_bytes) {
  std::string s(8, '\0');
  const std::uint64_t n = header.size();
  std::memcpy(s.data(), &n, 8);
  return s + header + std::string(data_bytes, '\x5a');
}

wire::hello hello_shm() {
  wire::hello h;
  h.token = "s3cret";
  h.transport = "host_shm";
  h.peer = "policy-0:4242";
  h.host_id = "policy-0/6c1b2f0e";
  h.alignment = 256;
  h.buffers = {{4096, "/refit-4242-0", "", ""}, {1u << 20, "/refit-4242-1", "", ""}};
  return h;
}

wire::hello hello_cuda() {
  wire::hello h;
  h.transport = "cuda_ipc";
  h.peer = "policy-0:4242";
  h.host_id = "policy-0/6c1b2f0e";
  h.device_uuid = std::string(16, '\x11');
  h.alignment = 4096;
  h.mode = wire::session_mode::in_place;
  h.layout = "sha256:5e1f";
  h.buffers = {{1u << 30, std::string(64, '\x22'), std::string(64, '\x33'), std::string(64, '\x44')}};
  return h;
}

wire::hello hello_nccl() {
  wire::hello h;
  h.transport = "nccl";
  h.peer = "policy-0:4242";
  h.host_id = "policy-0/6c1b2f0e";
  h.buffers = {{1u << 24, "", "", ""}};
  h.session = std::string(136, '\x55');
  return h;
}

// Batch 0 of version 7: a whole small tensor, and the first half of a larger one. Batch 1: its
// second half and an empty tensor. Fits buffer 1 (4096 bytes) of the tracker target.
wire::batch batch0() {
  return {7,
          0,
          1,
          {{"model.embed.weight", dtype::bf16, {4, 8}, 0, 64, 0},
           {"model.layers.0.mlp.up_proj.weight", dtype::f32, {16, 16}, 0, 512, 256}}};
}
wire::batch batch1() {
  return {7,
          1,
          2,
          {{"model.layers.0.mlp.up_proj.weight", dtype::f32, {16, 16}, 512, 512, 0},
           {"model.norm.bias", dtype::f16, {0}, 0, 0, 512},
           {"lm_head.scale", dtype::u8, {}, 0, 1, 1024}}};
}
wire::end end7() { return {7, 4, 64 + 512 + 512 + 1, 2, std::nullopt}; }

// Delta version 8 on base 7: a patch of two changes to the bf16 tensor (its whole 64 bytes), and
// END with the version checksum.
wire::batch batch_patch8() {
  return {8, 0, 1, {{"model.embed.weight", dtype::bf16, {4, 8}, 0, 12, 0, wire::entry_kind::patch, 64}}};
}
wire::end end8() { return {8, 1, 12, 1, 0x9e3779b97f4a7c15ull}; }

// Version 9 read in place: batch 0 announces two allocations of the streamer and reads from both
// (one entry still packed in the buffer); batch 1 reads from the first again and packs nothing.
wire::batch batch_shared9() {
  wire::entry a{"model.embed.weight", dtype::bf16, {4, 8}, 0, 64, 4096};
  a.source = 1;
  wire::entry b{"model.layers.0.mlp.up_proj.weight", dtype::f32, {16, 16}, 0, 1024, 0};
  b.source = 2;
  wire::batch m{9, 0, 0, {a, b, {"model.norm.bias", dtype::f16, {4}, 0, 8, 0}}};
  m.sources = {std::string(80, '\x11'), std::string(80, '\x22')};
  return m;
}
wire::batch batch_shared9b() {
  wire::entry c{"lm_head.weight", dtype::bf16, {4, 8}, 0, 64, 8192};
  c.source = 1;
  wire::batch m{9, 1, 1, {c}};
  m.ready = true;
  return m;
}
wire::end end9() { return {9, 4, 64 + 1024 + 8 + 64, 2, std::nullopt}; }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_corpus DIR\n");
    return 2;
  }
  try {
    const fs::path root = argv[1];

    // ------------------------------------------------------------- fuzz_wire_decode
    const fs::path w = root / "fuzz_wire_decode";
    write(w, "hello_host_shm", wire::encode(hello_shm()));
    write(w, "hello_cuda_ipc", wire::encode(hello_cuda()));
    write(w, "hello_nccl", wire::encode(hello_nccl()));
    {
      wire::hello h = hello_cuda();
      h.group_rank = 3;
      h.group_size = 8;
      write(w, "hello_group", wire::encode(h));
    }
    // decode_dest runs on every input too: destination records of a direct offer.
    write(
        w, "dest_shard",
        wire::encode_dest(wire::dest_record{
            "layers.0.o_proj.weight", refit::dtype::bf16, {64, 32}, {64, 1}, refit::source_slice{1, 32, 32}, 0, 4096}));
    refit::transport::nccl_session session;
    session.id = std::string(128, '\x2a');
    session.rank = 2;
    session.nranks = 4;
    write(w, "session_nccl", refit::transport::encode_nccl_session(session));
    session.parts = true;
    session.paired = true;
    session.twin_id = std::string(128, '\x2b');
    write(w, "session_nccl_paired", refit::transport::encode_nccl_session(session));
    // decode_vmm_record too: a span of two chunks, its descriptors following.
    write(w, "vmm_span",
          refit::transport::encode_vmm_record(std::vector<refit::copy::vmm::chunk>{{0, 20u << 20, 7}, {0, 2u << 20, 9}},
                                              true));
    write(w, "dest_dense",
          wire::encode_dest(wire::dest_record{"q", refit::dtype::f32, {8, 4}, {}, std::nullopt, 1, 0}));
    write(w, "begin", wire::encode(wire::begin{7, false, {}}));
    write(w, "batch_0", wire::encode(batch0()));
    write(w, "batch_1", wire::encode(batch1()));
    write(w, "batch_empty", wire::encode(wire::batch{3, 0, 0, {}}));
    write(w, "end", wire::encode(end7()));
    write(w, "bye", wire::encode(wire::bye{}));
    write(w, "begin_subset", wire::encode(wire::begin{7, true, std::nullopt}));
    write(w, "begin_delta", wire::encode(wire::begin{8, true, 7}));
    write(w, "batch_patch", wire::encode(batch_patch8()));
    write(w, "end_checksum", wire::encode(end8()));
    write(w, "batch_shared", wire::encode(batch_shared9()));
    write(w, "batch_ready", wire::encode(batch_shared9b()));
    write(w, "error_needs_whole",
          wire::encode(wire::error{refit::errc::needs_whole,
                                   "delta version 8: its base is version 7, but this "
                                   "receiver holds version 6; send a whole version"}));
    write(
        w, "ok_hello",
        wire::encode(wire::ok{std::nullopt, false, {std::string(64, '\x66'), "h2"}, wire::session_mode::buffers, {}}));
    write(w, "ok_in_place", wire::encode(wire::ok{std::nullopt, false, {"A", "T"}, wire::session_mode::in_place, {}}));
    write(w, "ok_committed", wire::encode(wire::ok{7, false, {}, wire::session_mode::buffers, {}}));
    write(w, "ok_dirty", wire::encode(wire::ok{6, true, {}, wire::session_mode::buffers, {}}));
    write(w, "ok_convert",
          wire::encode(wire::ok{std::nullopt,
                                false,
                                {},
                                wire::session_mode::buffers,
                                {{"w", dtype::f8_e4m3, refit::quant::block128},
                                 {"s", dtype::f8_e4m3, refit::quant::tensor},
                                 {"b", dtype::bf16, refit::quant::none}}}));
    write(w, "error_protocol",
          wire::encode(wire::error{refit::errc::protocol, "BATCH 3: sequence number 4 out of order, expected 3"}));
    write(w, "error_unauthorized", wire::encode(wire::error{refit::errc::unauthorized, "session token mismatch"}));
    write(w, "abort",
          wire::encode(
              wire::abort{7, refit::errc::invalid_argument, "the source yielded tensor 'w' twice in version 7"}));
    write(w, "end_hold", wire::encode(wire::end{7, 2, 4096, 2, std::nullopt, true}, "0123456789abcdef"));
    write(w, "commit", wire::encode(wire::commit{7}, "0123456789abcdef"));

    // ------------------------------------------------------------- fuzz_tracker
    // Byte 0: bit 0 = a committed version exists, bits 1-3 = its value, bit 4 = a sharded tracker.
    const fs::path t = root / "fuzz_tracker";
    write(t, "refit_shard",
          concat(0x10, {wire::begin{3, false, {}}, wire::batch{3, 0, 0, {{"x", dtype::f64, {64}, 256, 128, 0}}},
                        wire::batch{3, 1, 0, {{"x", dtype::f64, {64}, 384, 64, 0}}}, wire::end{3, 1, 192, 2, {}}}));
    write(t, "refit_one", concat(0, {hello_shm(), wire::begin{7, false, {}}, batch0(), batch1(), end7()}));
    write(t, "refit_after_committed_5",
          concat(1 | (5 << 1), {wire::begin{7, false, {}}, batch0(), batch1(), end7(), wire::bye{}}));
    write(t, "refit_two_versions",
          concat(0, {wire::begin{7, false, {}}, batch0(), batch1(), end7(), wire::begin{8, false, {}},
                     wire::batch{8, 0, 0, {{"w", dtype::i32, {2, 3}, 0, 24, 0}}}, wire::end{8, 1, 24, 1, {}}}));
    write(t, "refit_restart",
          concat(0, {wire::begin{7, false, {}}, batch0(), wire::begin{7, false, {}}, batch0(), batch1(), end7()}));
    write(t, "refit_incomplete",
          concat(0, {wire::begin{7, false, {}}, batch0(), wire::end{7, 1, 576, 1, {}}, wire::bye{}}));
    write(t, "refit_delta", concat(1 | (7 << 1), {wire::begin{8, true, 7}, batch_patch8(), end8()}));
    write(t, "refit_shared", concat(0, {wire::begin{9, false, {}}, batch_shared9(), batch_shared9b(), end9()}));
    write(t, "refit_subset", concat(1 | (5 << 1), {wire::begin{7, true, std::nullopt}, batch0(), end7()}));
    write(t, "refit_many_chunks",
          concat(0, {wire::begin{1, false, {}}, wire::batch{1, 0, 0, {{"x", dtype::f64, {64}, 0, 256, 0}}},
                     wire::batch{1, 1, 0, {{"x", dtype::f64, {64}, 256, 256, 0}}}, wire::end{1, 1, 512, 2, {}}}));

    // ------------------------------------------------------------- fuzz_zmtp
    // A cut byte (how the bytes are split into reads), then what a peer sends after connecting.
    {
      namespace zmtp = refit::channel::zmtp;
      const fs::path z = root / "fuzz_zmtp";
      const auto frame = [](const std::string& body, bool more) {
        return std::string(1, more ? '\x01' : '\x00') + std::string(1, static_cast<char>(body.size())) + body;
      };
      const auto ready_of = [](const std::string& type) {
        return zmtp::command("READY", std::string("\x0bSocket-Type\0\0\0", 15) + static_cast<char>(type.size()) + type);
      };
      std::string client = zmtp::greeting();
      client[32] = 0;
      const std::string req = client + ready_of("REQ");
      write(z, "request", "\x07" + req + frame("", true) + frame(wire::encode(wire::bye{}), false));
      write(z, "request_whole", std::string(1, '\0') + req + frame("", true) + frame("hello", false));
      write(z, "drops",
            "\x21" + req + frame("", true) + frame("a", true) + frame("b", false) + frame("x", true) +
                frame("y", false) + frame("z", false) + frame("", true) + frame("ok", false));
      write(z, "ping",
            "\x05" + req +
                zmtp::command("PING", std::string("\0\x0a"
                                                  "ctx",
                                                  5)) +
                zmtp::command("PONG", "c"));
      std::string zmtp30 = client;
      zmtp30[11] = 0;
      write(z, "dealer_zmtp30", "\x09" + zmtp30 + ready_of("DEALER") + frame("", true) + frame("d", false));
      write(z, "long_frame",
            "\x0b" + req + frame("", true) + std::string("\x02\0\0\0\0\0\0\x01\x2c", 9) + std::string(300, 'L'));
      write(z, "wrong_type", "\x03" + client + ready_of("PUB"));
      // Byte 0's top bit: a CURVE server. A CURVE greeting and a HELLO of the right size whose box
      // does not open (the fuzzer cannot make one that does).
      std::string curve_client = zmtp::greeting(true);
      curve_client[32] = 0;
      std::string hello(200, '\0');
      hello.replace(0, 6, "\x05HELLO");
      hello[6] = 1;
      for (std::size_t i = 80; i < hello.size(); ++i) hello[i] = static_cast<char>((i * 13) & 0xff);
      write(z, "curve_hello", "\x85" + curve_client + std::string("\x04\xc8", 2) + hello);
    }

    // ------------------------------------------------------------- fuzz_manifest
    // Byte 0: 0 = safetensors in memory, 1 = JSON in memory (next to shard.safetensors),
    // 2 = a .safetensors file, 3 = a file sniffed by content.
    const fs::path m = root / "fuzz_manifest";
    const std::string st_header =
        R"({"__metadata__":{"format":"pt"},"model.embed.weight":{"dtype":"BF16","shape":[4,8],"data_offsets":[0,64]},)"
        R"("model.norm.weight":{"dtype":"F32","shape":[8],"data_offsets":[64,96]},)"
        R"("empty":{"dtype":"F16","shape":[0,3],"data_offsets":[96,96]},)"
        R"("flag":{"dtype":"BOOL","shape":[],"data_offsets":[96,97]}})";
    const std::string st = safetensors(st_header, 97);
    const std::string st_all_dtypes = safetensors(
        R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"I8","shape":[1],"data_offsets":[1,2]},)"
        R"("c":{"dtype":"I16","shape":[1],"data_offsets":[2,4]},"d":{"dtype":"I32","shape":[1],"data_offsets":[4,8]},)"
        R"("e":{"dtype":"I64","shape":[1],"data_offsets":[8,16]},"f":{"dtype":"F64","shape":[1],"data_offsets":[16,24]},)"
        R"("g":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[24,25]},"h":{"dtype":"F8_E5M2","shape":[1],"data_offsets":[25,26]},)"
        R"("i":{"dtype":"U16","shape":[1],"data_offsets":[26,28]},"j":{"dtype":"U32","shape":[1],"data_offsets":[28,32]},)"
        R"("k":{"dtype":"U64","shape":[1],"data_offsets":[32,40]}})",
        40);
    const std::string json =
        R"({"model.embed.weight":{"dtype":"BF16","shape":[32000,4096]},"model.norm.weight":{"shape":[4096]},)"
        R"("__metadata__":{"total_size":1}})";
    const std::string index =
        R"({"metadata":{"total_size":8},"weight_map":{"a":"shard.safetensors","b":"shard.safetensors"}})";
    write(m, "safetensors_mem", std::string(1, '\0') + st);
    write(m, "safetensors_mem_all_dtypes", std::string(1, '\0') + st_all_dtypes);
    write(m, "json_mem", std::string(1, '\1') + json);
    write(m, "index_mem", std::string(1, '\1') + index);
    write(m, "safetensors_file", std::string(1, '\2') + st);
    write(m, "json_file", std::string(1, '\3') + json);
    write(m, "index_file", std::string(1, '\3') + index);
    // Rewriting files leaves a directory's time as it was: the build's copy (a custom target whose
    // output is DIR) is up to date only when DIR is newer than make_corpus.
    fs::last_write_time(root, fs::file_time_type::clock::now());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_corpus: %s\n", e.what());
    return 1;
  }
  return 0;
}
