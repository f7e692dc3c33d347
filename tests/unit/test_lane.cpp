// The same-host control lane (channel/lane.hpp): messages both ways, chunked when long, deadlines,
// what open() refuses, and the channels that listen to a lane beside their ZeroMQ socket.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "channel/channel.hpp"
#include "channel/lane.hpp"
#include "support/support.hpp"

using namespace std::chrono_literals;
using refit::errc;
using refit::channel::lane;
using refit::channel::rep_channel;
using refit::channel::req_channel;

namespace {

std::string random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(gen() & 0xff);
  return s;
}

std::string dir_of(const lane& l) { return l.offer().substr(0, l.offer().rfind('\n')); }

lane::clock::time_point in(std::chrono::milliseconds d) { return lane::clock::now() + d; }

/// Joins `req` to `rep` by a fresh lane, as a session's HELLO and its OK do.
void join_by_lane(rep_channel& rep, req_channel& req) {
  auto rx = lane::create();
  req.attach_lane(lane::open(rx->offer()));
  rep.attach_lane(std::move(rx));
}

/// A receiver's channel on a private endpoint (removed after the channels close) and a streamer's
/// joined to it by a lane, and another streamer's through ZeroMQ.
struct lane_pair {
  lane_pair() : rep(ep.name), req(rep.endpoint()), plain(rep.endpoint()) { join_by_lane(rep, req); }
  refit::test::scoped_endpoint ep;  // first: gone last
  rep_channel rep;
  req_channel req;
  req_channel plain;
};

/// Asks `pred` (yielding between asks) until it holds or 20 s have passed; its last answer.
template <class Pred>
bool eventually(Pred pred) {
  const auto end = lane::clock::now() + 20s;
  while (!pred() && lane::clock::now() < end) std::this_thread::yield();
  return pred();
}

}  // namespace

TEST_CASE("a lane carries messages both ways, shorter and longer than its slot", "[lane]") {
  auto rx = lane::create();
  auto tx = lane::open(rx->offer());
  const std::size_t slot = lane::slot_bytes;
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, slot - 1, slot, slot + 1, 3 * slot + 5}) {
    INFO("message of " << n << " bytes");
    const std::string request = random_bytes(n, static_cast<unsigned>(n));
    const std::string reply = random_bytes(n / 2 + 3, static_cast<unsigned>(n + 1));
    // The receiving end runs on its own thread: a message longer than the slot is taken chunk by
    // chunk while it is sent. The receiver waits without spinning, on its doorbell.
    // Catch's assertions are not thread-safe: the thread only records what happened.
    std::optional<std::string> got;
    bool replied = false;
    std::thread server([&] {
      got = rx->receive(in(20s), 0us);
      if (got) replied = rx->send(reply, in(20s), 0us);
    });
    CHECK(tx->send(request, in(20s), 100us));
    const auto answer = tx->receive(in(20s), 100us);
    server.join();
    CHECK(replied);
    REQUIRE(got);
    CHECK(*got == request);
    REQUIRE(answer);
    CHECK(*answer == reply);
    CHECK_FALSE(rx->ready());
    CHECK_FALSE(tx->ready());
  }
}

TEST_CASE("a lane's waits end at their deadline", "[lane]") {
  auto rx = lane::create();
  auto tx = lane::open(rx->offer());
  const auto t0 = lane::clock::now();
  CHECK_FALSE(rx->receive(in(50ms), 10us));
  CHECK(lane::clock::now() - t0 >= 50ms);
  // The first chunk fits the free slot; the second waits for a reader that never comes.
  CHECK_FALSE(tx->send(std::string(lane::slot_bytes + 1, 'x'), in(50ms), 0us));
  CHECK(rx->ready());
}

TEST_CASE("a message that stops half-way is an error, not a wait without end", "[lane]") {
  auto rx = lane::create();
  auto tx = lane::open(rx->offer());
  CHECK_FALSE(tx->send(std::string(2 * lane::slot_bytes, 'y'), in(10ms), 0us));  // one chunk posted
  CHECK_REFIT_ERROR(rx->receive(in(1s), 0us), errc::timeout,
                    "control lane: a message stopped after 1048576 of its "
                    "2097152 bytes");
}

TEST_CASE("a lane lives in a private directory that remove_files removes, and still works after", "[lane]") {
  auto rx = lane::create();
  const std::string dir = dir_of(*rx);
  struct stat st {};
  REQUIRE(::stat(dir.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  REQUIRE(::stat((dir + "/segment").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  CHECK(static_cast<std::uint64_t>(st.st_size) > 2 * lane::slot_bytes);
  auto tx = lane::open(rx->offer());
  rx->remove_files();
  CHECK_FALSE(std::filesystem::exists(dir));
  CHECK(tx->send("after", in(5s), 0us));
  CHECK(rx->receive(in(5s), 0us) == std::optional<std::string>("after"));
  // Nobody else can open it any more.
  CHECK_REFIT_ERROR(lane::open(rx->offer()), errc::io, "cannot open the control lane " + dir + "/segment");
}

TEST_CASE("a receiver's lane is removed with it", "[lane]") {
  std::string dir;
  {
    auto rx = lane::create();
    dir = dir_of(*rx);
    CHECK(std::filesystem::exists(dir));
  }
  CHECK_FALSE(std::filesystem::exists(dir));
}

TEST_CASE("open refuses an offer that is not the receiver's lane", "[lane]") {
  auto rx = lane::create();
  const std::string dir = dir_of(*rx);
  CHECK_REFIT_ERROR(lane::open("no nonce"), errc::protocol, "the receiver's control lane offer is malformed");
  CHECK_REFIT_ERROR(lane::open(dir + "\nabc"), errc::protocol, "malformed");
  CHECK_REFIT_ERROR(lane::open("relative\n" + std::string(32, '0')), errc::protocol, "malformed");
  // The right directory with another nonce: another receiver's lane, or a stale offer.
  CHECK_REFIT_ERROR(lane::open(dir + "\n" + std::string(32, '0')), errc::protocol,
                    "is not the control lane the receiver offered");
  CHECK_REFIT_ERROR(lane::open("/nonexistent/refit-lane-x\n" + std::string(32, '0')), errc::io,
                    "cannot open the control lane /nonexistent/refit-lane-x/segment");
  CHECK_NOTHROW(lane::open(rx->offer()));
}

TEST_CASE("a channel with a lane answers each request the way it came", "[lane][channel]") {
  const auto ep = refit::test::temp_endpoint();
  {
    rep_channel rep(ep);
    req_channel fast(rep.endpoint());
    join_by_lane(rep, fast);
    CHECK(fast.has_lane());
    req_channel slow(rep.endpoint());  // another streamer, through ZeroMQ
    std::vector<bool> through_lane;
    std::thread server([&] {
      for (int i = 0; i < 4; ++i) {
        const auto got = rep.receive(20s, i % 2 == 0);
        if (!got) return;
        through_lane.push_back(rep.last_from_lane());
        rep.reply("re:" + *got);
      }
    });
    CHECK(fast.request("a", 20s, "A") == "re:a");
    CHECK(slow.request("b", 20s, "B") == "re:b");
    CHECK(fast.request(std::string(lane::slot_bytes + 7, 'c'), 20s, "C") ==
          "re:" + std::string(lane::slot_bytes + 7, 'c'));
    CHECK(slow.request("d", 20s, "D") == "re:d");
    server.join();
    CHECK(through_lane == std::vector<bool>{true, false, true, false});
    // reset() drops the lane: the next request goes through ZeroMQ.
    fast.reset();
    CHECK_FALSE(fast.has_lane());
  }
  refit::channel::remove_private_endpoint(ep);
}

TEST_CASE("a streamer whose receiver stopped answering on the lane times out and resets", "[lane][channel]") {
  const auto ep = refit::test::temp_endpoint();
  {
    rep_channel rep(ep);
    req_channel req(rep.endpoint());
    join_by_lane(rep, req);
    CHECK_REFIT_ERROR(req.request("x", 100ms, "BEGIN of version 3"), errc::timeout,
                      "no reply from the receiver at " + rep.endpoint() + " to BEGIN of version 3 within 100 ms");
    CHECK_FALSE(req.has_lane());
    CHECK(req.resets() == 1);
  }
  refit::channel::remove_private_endpoint(ep);
}

TEST_CASE("wait_any sees a request on a lane among several channels", "[lane][channel]") {
  const auto ep1 = refit::test::temp_endpoint();
  const auto ep2 = refit::test::temp_endpoint();
  {
    rep_channel a(ep1), b(ep2);
    req_channel to_b(b.endpoint());
    join_by_lane(b, to_b);
    rep_channel* both[] = {&a, &b};
    CHECK_FALSE(rep_channel::wait_any(both, 20ms));
    to_b.send("hi", 5s, "HI");
    CHECK(rep_channel::wait_any(both, 5s) == std::optional<std::size_t>(1));
    CHECK(b.receive(0ms) == std::optional<std::string>("hi"));
    CHECK(b.last_from_lane());
    b.reply("ok");
    CHECK(to_b.receive(5s, "HI") == "ok");
  }
  refit::channel::remove_private_endpoint(ep1);
  refit::channel::remove_private_endpoint(ep2);
}

TEST_CASE("a receiver woken without a request wakes, takes no request from it, sleeps again and answers the next",
          "[lane][channel]") {
  lane_pair p;
  rep_channel& rep = p.rep;
  req_channel& req = p.req;
  p.plain.wake_receiver();  // through ZeroMQ: nothing to wake, never an error
  CHECK_FALSE(p.plain.receiver_asleep());
  std::optional<std::string> got;
  std::thread server([&] {
    got = rep.receive(20s, true);  // in a version: spins, then sleeps on the doorbell
    if (got) rep.reply("re:" + *got);
  });
  // The receiver goes to sleep once its spin ends; the wake takes it out of its sleep without a
  // request (it spins again, then sleeps again: the wake is no request). How much the wake saves
  // END is measured by refit-bench (bench/results/2026-11-28-h200-direct-allocations-wake.txt).
  REQUIRE(eventually([&] { return req.receiver_asleep(); }));
  req.wake_receiver();
  CHECK(eventually([&] { return !req.receiver_asleep(); }));
  CHECK(eventually([&] { return req.receiver_asleep(); }));
  CHECK_FALSE(got.has_value());
  CHECK(req.request("END", 20s, "END") == "re:END");
  server.join();
  CHECK(got == std::optional<std::string>("END"));
}

TEST_CASE("a streamer whose lane the receiver closed sends its next request through ZeroMQ", "[lane][channel]") {
  const auto ep = refit::test::temp_endpoint();
  {
    rep_channel rep(ep);
    req_channel req(rep.endpoint());
    join_by_lane(rep, req);
    // Another streamer's HELLO gives the channel a new lane: the old one is closed.
    rep.attach_lane(lane::create());
    bool through_lane = true;
    std::thread server([&] {
      const auto got = rep.receive(20s);
      if (!got) return;
      through_lane = rep.last_from_lane();
      rep.reply("re:" + *got);
    });
    CHECK(req.request("BEGIN", 20s, "BEGIN of version 2") == "re:BEGIN");
    server.join();
    CHECK_FALSE(through_lane);
    CHECK_FALSE(req.has_lane());
    CHECK(req.resets() == 0);
  }
  refit::channel::remove_private_endpoint(ep);
}

TEST_CASE("a streamer waiting for a reply hears that the receiver closed its lane", "[lane]") {
  auto rx = lane::create();
  auto tx = lane::open(rx->offer());
  CHECK(tx->send("END", in(5s), 0us));
  std::optional<std::string> got;  // recorded by the thread, checked after it (Catch is not thread-safe)
  std::thread closer([&] {
    got = rx->receive(in(5s), 0us);
    rx->close();  // no reply: the session was replaced meanwhile
  });
  CHECK_REFIT_ERROR(tx->receive(in(20s), 0us), errc::peer, "the receiver closed the control lane");
  closer.join();
  CHECK(got == std::optional<std::string>("END"));
}

TEST_CASE("a streamer sees at once that the lane's receiver process died", "[lane]") {
  namespace rt = refit::test;
  rt::signal_pipe from_child;
  rt::signal_pipe to_child;
  rt::child receiver([&] {
    auto rx = lane::create();
    std::string offer = rx->offer();
    offer[offer.rfind('\n')] = '|';  // a line of the pipe
    from_child.send(offer);
    // Answers one request, then waits to be killed with the lane open (no close()).
    const auto got = rx->receive(in(20s), 0us);
    if (got) (void)rx->send("re:" + *got, in(20s), 0us);
    (void)to_child.receive(60s);
  });
  std::string offer = from_child.receive(20s);
  offer[offer.rfind('|')] = '\n';
  auto tx = lane::open(offer);
  CHECK(tx->send("BEGIN", in(20s), 0us));
  CHECK(tx->receive(in(20s), 0us) == std::optional<std::string>("re:BEGIN"));
  // Killed while the streamer waits for a reply: the reply never comes, and the wait says so at once.
  CHECK(tx->send("BATCH", in(20s), 0us));
  receiver.kill();
  const auto t0 = lane::clock::now();
  CHECK_REFIT_ERROR(tx->receive(in(20s), 0us), errc::timeout, "the receiver's process ended before it answered");
  CHECK(lane::clock::now() - t0 < 10s);
  // The next request is not sent at all: errc::peer, so that the streamer says HELLO again.
  CHECK_REFIT_ERROR(tx->send("END", in(20s), 0us), errc::peer, "the receiver's process ended");
}

TEST_CASE("a chunk that breaks the lane's rules is refused with what is wrong, never read past the slot", "[lane]") {
  const auto refused = [](auto post, const std::string& why) {
    auto rx = lane::create();
    auto tx = lane::open(rx->offer());
    post(*tx);
    CHECK_REFIT_ERROR(rx->receive(in(1s), 0us), errc::protocol, why);
  };
  const std::uint64_t slot = lane::slot_bytes;
  refused([](lane& l) { l.post_unchecked(std::uint64_t{64} << 20 | 1, 0, 1, "x"); },
          "control lane: a message of 67108865 bytes, more than the limit of 67108864");
  refused([&](lane& l) { l.post_unchecked(3 * slot, 0, slot + 1, "x"); },
          "control lane: a chunk of 1048577 bytes at 0 of a 3145728-byte message, after 0 of 3145728 bytes; the "
          "peer is broken");
  refused([](lane& l) { l.post_unchecked(10, 4, 6, "abcdef"); },
          "control lane: a chunk of 6 bytes at 4 of a 10-byte message, after 0 of 10 bytes");
  refused([](lane& l) { l.post_unchecked(10, 0, 11, "abcdef"); },
          "control lane: a chunk of 11 bytes at 0 of a 10-byte message");
  refused([](lane& l) { l.post_unchecked(10, 0, 0, ""); },
          "control lane: a chunk of 0 bytes at 0 of a 10-byte message");
  refused([](lane& l) { l.post_unchecked(1, 0, 1, "a", 2); },
          "control lane: 2 chunks posted while 0 were taken (one at a time expected); the peer is broken");
}

TEST_CASE("a receiver drops a lane that breaks the rules and goes on through ZeroMQ", "[lane][channel]") {
  const auto ep = refit::test::temp_endpoint();
  {
    rep_channel rep(ep);
    auto rx = lane::create();
    auto broken = lane::open(rx->offer());
    rep.attach_lane(std::move(rx));
    broken->post_unchecked(10, 4, 6, "abcdef");
    CHECK_FALSE(rep.receive(2s));     // the lane is closed, nothing is returned
    req_channel req(rep.endpoint());  // a streamer that says HELLO anew, through ZeroMQ
    std::optional<std::string> got;
    std::thread server([&] {
      got = rep.receive(20s);
      if (got) rep.reply("re:" + *got);
    });
    CHECK(req.request("HELLO", 20s, "HELLO") == "re:HELLO");
    server.join();
    CHECK(got == std::optional<std::string>("HELLO"));
    CHECK_FALSE(rep.last_from_lane());
    // The broken streamer's lane was closed: its next request would go through ZeroMQ.
    CHECK_REFIT_ERROR(broken->send("BEGIN", in(1s), 0us), errc::peer, "the receiver closed the control lane");
  }
  refit::channel::remove_private_endpoint(ep);
}

TEST_CASE("a peer that trickles a message a byte at a time is cut off by the whole message's deadline",
          "[lane][hostile]") {
  auto rx = lane::create();
  auto tx = lane::open(rx->offer());
  // The peer announces 64 MiB and posts one byte whenever the last was taken, every 20 ms: each
  // chunk comes well inside any per-chunk wait. It gives up after 3 × rest_of_message, so that the
  // test ends even where the receive has no bound for the whole message.
  const std::uint64_t total = lane::max_message_bytes;
  std::atomic<bool> stop = false;
  std::thread trickler([&] {
    const auto give_up = lane::clock::now() + 3 * lane::rest_of_message;
    for (std::uint64_t off = 0; !stop && lane::clock::now() < give_up; std::this_thread::sleep_for(20ms)) {
      if (rx->ready()) continue;  // not taken yet
      tx->post_unchecked(total, off, 1, "x");
      ++off;
    }
  });
  const auto t0 = lane::clock::now();
  // The caller's deadline is now, as rep_channel::take() asks once it saw a first chunk.
  while (!rx->ready()) std::this_thread::yield();
  CHECK_REFIT_ERROR(rx->receive(lane::clock::now(), 0us), errc::timeout, "control lane: a message stopped after");
  const auto took = lane::clock::now() - t0;
  stop = true;
  trickler.join();
  CHECK(took >= lane::rest_of_message - 100ms);
  CHECK(took < lane::rest_of_message + 2s);
}

TEST_CASE("a lane message announced longer than the limit is refused before anything is allocated", "[lane][hostile]") {
  for (const std::uint64_t total : {lane::max_message_bytes + 1, ~std::uint64_t{0}}) {
    INFO(total << " bytes announced");
    auto rx = lane::create();
    auto tx = lane::open(rx->offer());
    // 2^64 - 1 bytes: reserving them would throw std::length_error, not refit::error.
    tx->post_unchecked(total, 0, 1, "x");
    CHECK_REFIT_ERROR(
        rx->receive(in(1s), 0us), errc::protocol,
        fmt::format("control lane: a message of {} bytes, more than the limit of {}", total, lane::max_message_bytes));
  }
}

TEST_CASE("a lane's files are gone as soon as the streamer opened it", "[lane]") {
  auto rx = lane::create();
  const std::string dir = dir_of(*rx);
  REQUIRE(std::filesystem::exists(dir + "/segment"));
  auto tx = lane::open(rx->offer());
  CHECK_FALSE(std::filesystem::exists(dir));
  CHECK(tx->send("BEGIN", in(5s), 0us));
  CHECK(rx->receive(in(5s), 0us) == std::optional<std::string>("BEGIN"));
  CHECK(rx->send("OK", in(5s), 0us));
  CHECK(tx->receive(in(5s), 0us) == std::optional<std::string>("OK"));
  rx->remove_files();  // nothing left to remove: no error
}

TEST_CASE("the lane of a receiver killed before its streamer opened it is removed by the next lane made", "[lane]") {
  namespace rt = refit::test;
  // Two receivers in children: one is killed (SIGKILL: no destructor runs), the other lives on.
  const auto receiver = [](rt::signal_pipe& out, rt::signal_pipe& in_) {
    return [&out, &in_] {
      auto rx = lane::create();
      out.send(dir_of(*rx));
      (void)in_.receive(60s);  // held open until told (or killed)
    };
  };
  rt::signal_pipe from_dead, to_dead, from_live, to_live;
  rt::child dead(receiver(from_dead, to_dead));
  rt::child live(receiver(from_live, to_live));
  const std::string dead_dir = from_dead.receive(20s);
  const std::string live_dir = from_live.receive(20s);
  CHECK_THAT(dead_dir, Catch::Contains(fmt::format("/refit-lane-{}-", dead.pid())));
  dead.kill();
  REQUIRE(std::filesystem::exists(dead_dir + "/segment"));  // what SIGKILL leaves behind
  {
    auto rx = lane::create();  // the next lane offer on this host
    CHECK_FALSE(std::filesystem::exists(dead_dir));
    CHECK(std::filesystem::exists(live_dir + "/segment"));  // a live process's lane is never removed
    // A directory named for the dead pid whose life FIFO still has a reader (a receiver of
    // another pid namespace sharing the directory, whose pid means nothing here) is kept; once
    // nobody reads it, it goes too.
    const std::string alias =
        std::filesystem::path(dir_of(*rx)).parent_path() / fmt::format("refit-lane-{}-elsewhere", dead.pid());
    REQUIRE(::mkdir(alias.c_str(), 0700) == 0);
    REQUIRE(::mkfifo((alias + "/life").c_str(), 0600) == 0);
    const int reader = ::open((alias + "/life").c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    REQUIRE(reader >= 0);
    (void)lane::create();
    CHECK(std::filesystem::exists(alias + "/life"));
    ::close(reader);
    (void)lane::create();
    CHECK_FALSE(std::filesystem::exists(alias));
  }
  to_live.send("stop");
  CHECK(live.wait(20s) == 0);
  CHECK_FALSE(std::filesystem::exists(live_dir));
}

TEST_CASE("an announcement holds the receiver awake for its hold from its first look, until a request is taken",
          "[lane]") {
  auto rx = lane::create();
  auto tx = lane::open(rx->offer());
  CHECK(rx->awake_until() <= lane::clock::now());  // none yet
  auto before = lane::clock::now();
  tx->announce(200ms);
  const auto held = rx->awake_until();
  CHECK(held >= before + 200ms);
  CHECK(held <= lane::clock::now() + 200ms);
  CHECK(rx->awake_until() == held);  // the same announcement: its hold counts from the first look
  rx->request_taken();
  CHECK(rx->awake_until() <= lane::clock::now());  // answered: no longer held, and not again
  // A streamer asking for an hour gets announce_max; so does a peer writing the field's most
  // (2^16 - 1 ms, 65 s) itself.
  before = lane::clock::now();
  tx->announce(std::chrono::hours(1));
  auto capped = rx->awake_until();
  CHECK(capped >= before + lane::announce_max);
  CHECK(capped <= lane::clock::now() + lane::announce_max);
  before = lane::clock::now();
  tx->announce_unchecked((std::uint64_t{99} << 16) | 0xffff);
  capped = rx->awake_until();
  CHECK(capped >= before + lane::announce_max);
  CHECK(capped <= lane::clock::now() + lane::announce_max);
  // Zero holds nobody.
  before = lane::clock::now();
  tx->announce(0ms);
  const auto zero = rx->awake_until();
  CHECK(zero >= before);
  CHECK(zero <= lane::clock::now());
}

TEST_CASE("an announced receiver waits awake past its spin, the request ends that, and so does the hold's end",
          "[lane][channel]") {
  lane_pair p;
  rep_channel& rep = p.rep;
  req_channel& req = p.req;
  CHECK_FALSE(p.plain.announce(1s));  // through ZeroMQ: nobody to tell
  std::vector<std::string> got;       // recorded by the thread, checked after it (Catch is not thread-safe)
  std::thread server([&] {
    for (int k = 0; k < 2; ++k) {
      const auto m = rep.receive(20s, false);  // between versions: no spin, asleep at once
      if (!m) return;
      got.push_back(*m);
      rep.reply("re:" + *m);
    }
  });
  REQUIRE(eventually([&] { return req.receiver_asleep(); }));
  REQUIRE(req.announce(60s));
  CHECK(eventually([&] { return !req.receiver_asleep(); }));
  // Held: it does not go back to sleep (a wake without a hold would, at once: it waits with no spin).
  bool slept = false;
  for (int k = 0; k < 20000 && !slept; ++k) {
    slept = req.receiver_asleep();
    std::this_thread::yield();
  }
  CHECK_FALSE(slept);
  CHECK(req.request("BEGIN", 20s, "BEGIN") == "re:BEGIN");
  // The request ended the hold: waiting for the next one, it sleeps (long before 60 s).
  CHECK(eventually([&] { return req.receiver_asleep(); }));
  // A short hold ends by itself.
  REQUIRE(req.announce(30ms));
  CHECK(eventually([&] { return !req.receiver_asleep(); }));
  CHECK(eventually([&] { return req.receiver_asleep(); }));
  CHECK(req.request("END", 20s, "END") == "re:END");
  server.join();
  CHECK(got == std::vector<std::string>{"BEGIN", "END"});
}
