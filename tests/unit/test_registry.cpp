// The transport registry and the session data of a transport that only it decodes (nccl's).
#include <catch2/catch.hpp>

#include <array>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "config/config.hpp"
#include "support/support.hpp"
#include "transport/nccl_session.hpp"
#include "transport/registry.hpp"
#include "transport/transport.hpp"

namespace tr = refit::transport;
using refit::test::failure_of;

namespace {

std::unique_ptr<tr::source> no_source(const tr::source_options&) { return nullptr; }
std::unique_ptr<tr::sink> no_sink(int, refit::milliseconds) { return nullptr; }

}  // namespace

TEST_CASE("the registry holds the built transports and refuses malformed or repeated registrations", "[registry]") {
  REQUIRE(tr::find_transport("host_shm") != nullptr);
  CHECK((tr::find_transport("cuda_ipc") != nullptr) == (REFIT_HAVE_CUDA != 0));
  CHECK((tr::find_transport("nccl") != nullptr) == (REFIT_HAVE_NCCL != 0));
  CHECK(tr::find_transport("rdma") == nullptr);
  CHECK(tr::registered_transports() ==
        std::string(REFIT_HAVE_CUDA ? "cuda_ipc, " : "") + "host_shm" + (REFIT_HAVE_NCCL ? ", nccl" : ""));
  CHECK(tr::capabilities_of("host_shm").max_receivers == 64);
  CHECK_FALSE(tr::capabilities_of("host_shm").writes_in_place);
  // A transport this build lacks has the defaults (one receiver, buffers only).
  CHECK(tr::capabilities_of(refit::transport_kind::nccl).session_dies_on_error == (REFIT_HAVE_NCCL != 0));
  CHECK(tr::capabilities_of(refit::transport_kind::cuda_ipc).writes_in_place == (REFIT_HAVE_CUDA != 0));

  auto f = failure_of([] { tr::register_transport({"host_shm", {}, no_source, no_sink}); });
  REQUIRE(f);
  CHECK(f->code == "internal");
  CHECK(f->message == "transport 'host_shm' is registered twice");
  f = failure_of([] { tr::register_transport({"Bad-Name", {}, no_source, no_sink}); });
  REQUIRE(f);
  CHECK(f->message == "transport registration 'Bad-Name' is malformed (a name of [a-z0-9_], both factories)");
  f = failure_of([] { tr::register_transport({"no_sink", {}, no_source, nullptr}); });
  REQUIRE(f);
  CHECK(tr::find_transport("no_sink") == nullptr);

  // A streamer naming an unregistered transport, and a receiver asked for one.
  f = failure_of([] {
    refit::streamer_options o;
    o.endpoint = "ipc:///nowhere";
    o.transport_name = "rdma";
    refit::streamer s(o);
  });
  REQUIRE(f);
  CHECK(f->code == "invalid_argument");
  CHECK_THAT(f->message, Catch::StartsWith("transport rdma is not built into this refit (built: "));
  f = failure_of([] { (void)tr::make_sink("rdma", 0); });
  REQUIRE(f);
  CHECK(f->code == "transport");
  CHECK_THAT(f->message, Catch::StartsWith("the streamer uses transport 'rdma', which this receiver does not support"));
}

TEST_CASE("nccl session data round-trips and every malformed one is refused with what is wrong", "[registry]") {
  const std::string path = "/opt/nccl/libnccl.so.2";  // 22 bytes
  const auto session = [&](std::uint32_t rank, std::uint32_t nranks, bool parts = false, std::string twin = {}) {
    tr::nccl_session s;
    s.id = std::string(128, '\x3c');
    s.rank = rank;
    s.nranks = nranks;
    s.parts = parts;
    s.paired = !twin.empty();
    s.twin_id = std::move(twin);
    s.nccl_version = 22809;
    s.nccl_path = path;
    return s;
  };
  const std::string bytes = tr::encode_nccl_session(session(2, 5, true));
  CHECK(bytes.size() == 140 + 8 + 22);
  CHECK(bytes.substr(140, 8) == std::string("\x19\x59\0\0\x16\0\0\0", 8));  // 22809, 22
  const auto back = tr::decode_nccl_session(bytes);
  CHECK(back.id == std::string(128, '\x3c'));
  CHECK(back.rank == 2);
  CHECK(back.nranks == 5);
  CHECK(back.parts);
  CHECK(!back.paired);
  CHECK(back.twin_id.empty());
  CHECK(back.nccl_version == 22809);
  CHECK(back.nccl_path == path);
  CHECK(!tr::decode_nccl_session(tr::encode_nccl_session(session(1, 2))).parts);
  // A paired session (flag bit 1) carries the twin communicator's id after the flags, then the NCCL.
  const std::string twin(128, '\x7e');
  const std::string paired_bytes = tr::encode_nccl_session(session(1, 2, false, twin));
  CHECK(paired_bytes.size() == 268 + 8 + 22);
  CHECK(paired_bytes.substr(136, 4) == std::string("\x02\0\0\0", 4));
  const auto paired = tr::decode_nccl_session(paired_bytes);
  CHECK(paired.paired);
  CHECK(!paired.parts);
  CHECK(paired.twin_id == twin);
  CHECK(paired.id == std::string(128, '\x3c'));
  CHECK((paired.nccl_version == 22809 && paired.nccl_path == path));
  const auto both = tr::decode_nccl_session(tr::encode_nccl_session(session(1, 2, true, twin)));
  CHECK((both.paired && both.parts && both.twin_id == twin));
  // A path longer than max_path_bytes is cut to it (it is only ever printed).
  auto long_path = session(1, 2);
  long_path.nccl_path = std::string(3000, 'p');
  CHECK(tr::decode_nccl_session(tr::encode_nccl_session(long_path)).nccl_path == std::string(1024, 'p'));

  const auto refused = [](const std::string& b) {
    const auto f = failure_of([&] { (void)tr::decode_nccl_session(b); });
    REQUIRE(f);
    CHECK(f->code == "protocol");
    return f->message;
  };
  CHECK(refused(bytes.substr(0, 169)) ==
        "nccl: HELLO's session data is 169 bytes, but an nccl session is 170 (a 128-byte ncclUniqueId, rank, nranks, "
        "flags, the NCCL version, a path of 22 bytes, at most 1024): the streamer is an older refit, or was built "
        "against another NCCL");
  // An older refit's: no NCCL version and path.
  CHECK(refused(bytes.substr(0, 140)) ==
        "nccl: HELLO's session data is 140 bytes, but an nccl session is 148 (a 128-byte ncclUniqueId, rank, nranks, "
        "flags, the NCCL version, a path of 0 bytes, at most 1024): the streamer is an older refit, or was built "
        "against another NCCL");
  CHECK(refused(bytes.substr(0, 136)).find("is 136 bytes") != std::string::npos);
  CHECK(refused(bytes + "x").find("is 171 bytes, but an nccl session is 170") != std::string::npos);
  CHECK(refused("").find("is 0 bytes") != std::string::npos);
  // A path length past the limit, even with the bytes there.
  std::string huge = bytes.substr(0, 144) + std::string("\x01\x04\0\0", 4) + std::string(1025, 'p');
  CHECK(refused(huge).find("a path of 1025 bytes, at most 1024") != std::string::npos);
  // Paired without the twin's id, or with a short one.
  CHECK(refused(paired_bytes.substr(0, 140)) ==
        "nccl: HELLO's session data is 140 bytes, but an nccl session is 276 (a 128-byte ncclUniqueId, rank, nranks, "
        "flags, the twin's ncclUniqueId, the NCCL version, a path of 0 bytes, at most 1024): the streamer is an older "
        "refit, or was built against another NCCL");
  CHECK(refused(paired_bytes.substr(0, 297)).find("is 297 bytes, but an nccl session is 298") != std::string::npos);
  const auto with = [&](std::uint32_t rank, std::uint32_t nranks) {
    return tr::encode_nccl_session(session(rank, nranks));
  };
  CHECK(refused(with(0, 3)) == "nccl: HELLO gives this receiver rank 0 of 3: a receiver's rank is 1..nranks-1");
  CHECK(refused(with(3, 3)) == "nccl: HELLO gives this receiver rank 3 of 3: a receiver's rank is 1..nranks-1");
  CHECK(refused(with(1, 1)) == "nccl: HELLO gives this receiver rank 1 of 1: a receiver's rank is 1..nranks-1");
  CHECK_THAT(refused(with(1, 0x80000000u)), Catch::Contains("rank 1 of 2147483648"));
  CHECK_THAT(refused(tr::encode_nccl_session(session(0, 2, false, twin))), Catch::Contains("rank 0 of 2"));
  CHECK_NOTHROW(tr::decode_nccl_session(with(1, 2)));
}

TEST_CASE("a delta batch's segment is its buffer's used prefix, whatever its entries' order and gaps", "[registry]") {
  using refit::transport::buffer_prefix;
  const auto entry = [](std::uint64_t offset, std::uint64_t bytes) {
    refit::wire::entry e;
    e.name = "t";
    e.buffer_offset = offset;
    e.bytes = bytes;
    return e;
  };
  // None when nothing has bytes (a batch of empty patches), whatever the offsets say.
  CHECK(buffer_prefix({}).empty());
  const std::vector<refit::wire::entry> empty = {entry(0, 0), entry(4096, 0)};
  CHECK(buffer_prefix(empty).empty());
  // From the buffer's start to the furthest end, aligned gaps included, empty entries ignored.
  const std::vector<refit::wire::entry> batch = {entry(512, 100), entry(0, 300), entry(9000, 0), entry(768, 4)};
  const auto s = buffer_prefix(batch);
  REQUIRE(s.size() == 1);
  CHECK(s[0].data == nullptr);
  CHECK(s[0].offset == 0);
  CHECK(s[0].bytes == 772);
}

TEST_CASE("at_once runs every job at the same time and returns once all have returned", "[registry]") {
  // Each job waits until all four are under way: run one after the other, the first would give up
  // at its bound (a failure here, not a hang) and the others would find it gone.
  constexpr int n = 4;
  std::mutex m;
  std::condition_variable cv;
  int arrived = 0;
  std::array<bool, n> met{};
  std::array<std::function<void()>, n> jobs;
  for (int k = 0; k < n; ++k)
    jobs[k] = [&, k] {
      std::unique_lock lock(m);
      ++arrived;
      cv.notify_all();
      met[k] = cv.wait_for(lock, std::chrono::seconds(10), [&] { return arrived == n; });
    };
  tr::at_once(jobs);
  CHECK(arrived == n);
  CHECK(met == std::array<bool, n>{true, true, true, true});
  // None, and one (run on the calling thread), are fine too.
  tr::at_once({});
  std::thread::id ran_on;
  const std::function<void()> one[] = {[&] { ran_on = std::this_thread::get_id(); }};
  tr::at_once(one);
  CHECK(ran_on == std::this_thread::get_id());
}
