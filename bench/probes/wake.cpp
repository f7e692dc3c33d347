// bench/probes/wake.cpp — what waking a sleeping process costs on this machine: the receiver's wait between refits.
// A receiver's control lane (lib/channel/lane.cpp) sleeps in poll() on a FIFO (its doorbell) once its spin ends; the
// streamer's next request then pays the wake-up. Here a child process waits, by each way in turn, for a word in
// shared memory to change; the parent, after letting it sleep for `gap` (so the CPU the child sleeps on idles as a
// receiver's does between refits), stamps CLOCK_MONOTONIC, changes the word and rings. The child stamps the moment it
// sees the word. Ways:
//   fifo-poll   poll() on a FIFO with no timeout, the parent writes a byte (the lane's doorbell)
//   fifo-1ms    poll() on the FIFO with a 1 ms timeout, again and again (the CPU's idle state is chosen for 1 ms)
//   futex       FUTEX_WAIT on the word (shared, not private), the parent FUTEX_WAKEs it
//   yield       sched_yield() between loads of the word (what a receiver's spin does)
// 120 rounds each; the median, 90th percentile and max of the wake-up in microseconds. Built and run by
// tools/gpu-check BUNDLE probes (stage probe-wake); by hand: g++ -O2 -o wake bench/probes/wake.cpp && ./wake
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

constexpr int rounds = 120;

struct shared {
  std::atomic<uint32_t> word;     // the round the parent has rung
  std::atomic<uint32_t> seen;     // the round the child has seen
  std::atomic<uint32_t> waiting;  // the round the child waits for
  int64_t rang[rounds];
  int64_t woke[rounds];
};

int64_t now_ns() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

void sleep_us(int us) {
  timespec t{us / 1000000, (us % 1000000) * 1000L};
  nanosleep(&t, nullptr);
}

enum way { fifo_poll, fifo_1ms, futex, yield };
const char* const names[] = {"fifo-poll", "fifo-1ms", "futex", "yield"};

void child(shared* s, way w, int fifo) {
  for (int r = 0; r < rounds; ++r) {
    const auto want = static_cast<uint32_t>(r + 1);
    s->waiting.store(want);
    while (s->word.load(std::memory_order_acquire) < want) {
      if (w == yield) {
        sched_yield();
      } else if (w == futex) {
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&s->word), FUTEX_WAIT, want - 1, nullptr, nullptr, 0);
      } else {
        pollfd p{fifo, POLLIN, 0};
        poll(&p, 1, w == fifo_1ms ? 1 : -1);
        char b[64];
        while (read(fifo, b, sizeof b) > 0) {
        }
      }
    }
    s->woke[r] = now_ns();
    s->seen.store(want, std::memory_order_release);
  }
  _exit(0);
}

void run(shared* s, way w, const std::string& path, int gap_us) {
  s->word = 0, s->seen = 0, s->waiting = 0;
  const pid_t pid = fork();
  if (pid == 0) {
    const int fifo = open(path.c_str(), O_RDONLY | O_NONBLOCK);
    child(s, w, fifo);
  }
  const int fifo = open(path.c_str(), O_WRONLY);  // blocks until the child opened its end
  for (int r = 0; r < rounds; ++r) {
    const auto want = static_cast<uint32_t>(r + 1);
    while (s->waiting.load() < want) sched_yield();
    sleep_us(gap_us);
    s->rang[r] = now_ns();
    s->word.store(want, std::memory_order_release);
    if (w == futex) syscall(SYS_futex, reinterpret_cast<uint32_t*>(&s->word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
    if (w == fifo_poll || w == fifo_1ms) {
      const char b = 1;
      if (write(fifo, &b, 1) != 1) _exit(3);
    }
    while (s->seen.load(std::memory_order_acquire) < want) sched_yield();
  }
  int status = 0;
  waitpid(pid, &status, 0);
  close(fifo);
  std::vector<double> us;
  for (int r = 0; r < rounds; ++r) us.push_back((s->woke[r] - s->rang[r]) / 1e3);
  std::sort(us.begin(), us.end());
  printf("%-10s gap %6d us   median %7.1f us   p90 %7.1f us   max %8.1f us\n", names[w], gap_us, us[rounds / 2],
         us[rounds * 9 / 10], us.back());
  fflush(stdout);
}

}  // namespace

int main() {
  char dir[] = "/tmp/refit-wake-XXXXXX";
  if (mkdtemp(dir) == nullptr) return 1;
  const std::string path = std::string(dir) + "/bell";
  if (mkfifo(path.c_str(), 0600) != 0) return 1;
  auto* s =
      static_cast<shared*>(mmap(nullptr, sizeof(shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (s == MAP_FAILED) return 1;
  printf("wake: %d rounds each; the wake-up = the child's stamp on seeing the word - the parent's before ringing\n",
         rounds);
  for (int gap : {1000, 20000})
    for (way w : {fifo_poll, fifo_1ms, futex, yield}) run(s, w, path, gap);
  unlink(path.c_str());
  rmdir(dir);
  return 0;
}
