// host_shm path: tensors in host memory on both sides; the ceiling is memcpy bandwidth.
#include <sys/mman.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <string>

#include "bench/bench.hpp"
#include "copy/copy.hpp"
#include "refit/error.hpp"

namespace refit::bench {
namespace {

constexpr std::uint64_t tensor_alignment = 256;

std::uint64_t align_up(std::uint64_t n, std::uint64_t a) { return (n + a - 1) / a * a; }

// MemAvailable from /proc/meminfo, in bytes; 0 when unknown.
std::uint64_t available_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.starts_with("model name")) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "cpu";
}

class host_memory final : public tensor_memory {
 public:
  // Own arena: zeroed and populated pages (no page faults inside timed refits).
  host_memory(const manifest& m, const char* what) {
    std::uint64_t total = 0;
    sizes_.reserve(m.entries.size());
    for (const auto& e : m.entries) {
      offsets_.push_back(total);
      sizes_.push_back(e.meta.nbytes());
      total = align_up(total + sizes_.back(), tensor_alignment);
    }
    const std::uint64_t avail = available_memory();
    if (avail != 0 && total > avail)
      throw error(errc::io, fmt::format("{} of {} need {:.2f} GB of host memory and {:.2f} GB are "
                                        "available: pick a smaller model or run on a larger host",
                                        what, m.name, total / 1e9, avail / 1e9));
    size_ = std::max<std::uint64_t>(total, 1);
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED)
      throw error(errc::io,
                  fmt::format("cannot allocate {:.2f} GB of host memory for the {} of {}", total / 1e9, what, m.name));
    arena_ = static_cast<std::byte*>(p);
    for (const auto off : offsets_) ptrs_.push_back(arena_ + off);
  }
  // Views of mapped safetensors files (--load): no copy.
  host_memory(const manifest& m, const std::vector<mapped_file>& files) {
    for (const auto& e : m.entries) {
      sizes_.push_back(e.meta.nbytes());
      ptrs_.push_back(files.at(static_cast<std::size_t>(e.file)).data() + e.offset);
    }
  }
  ~host_memory() override {
    if (arena_) ::munmap(arena_, size_);
  }
  host_memory(const host_memory&) = delete;
  host_memory& operator=(const host_memory&) = delete;

  [[nodiscard]] device where() const noexcept override { return device::cpu(); }
  [[nodiscard]] std::byte* data(std::size_t i) const noexcept override { return ptrs_[i]; }
  std::uint8_t flip(std::size_t i, std::uint64_t offset, std::uint8_t mask) override {
    auto* p = reinterpret_cast<std::uint8_t*>(ptrs_.at(i)) + offset;
    const std::uint8_t old = *p;
    *p = static_cast<std::uint8_t>(old ^ mask);
    return old;
  }
  [[nodiscard]] std::uint64_t checksum(std::size_t i) const override {
    return copy::checksum(ptrs_.at(i), sizes_.at(i), device::cpu());
  }
  [[nodiscard]] std::uint64_t checksum(std::size_t i, std::uint64_t offset, std::uint64_t bytes) const override {
    check_bytes(sizes_.at(i), offset, bytes);
    return copy::checksum(ptrs_[i] + offset, bytes, device::cpu());
  }
  [[nodiscard]] std::uint64_t checksum(std::size_t i, const byte_region& r) const override {
    if (r.contiguous()) return checksum(i, r.offset, r.bytes());
    check_region(sizes_.at(i), r);
    std::vector<std::byte> gathered(r.bytes());
    for (std::uint64_t k = 0; k < r.rows; ++k)
      std::memcpy(gathered.data() + k * r.width, ptrs_[i] + r.offset + k * r.pitch, r.width);
    return copy::checksum(gathered.data(), gathered.size(), device::cpu());
  }

 private:
  std::byte* arena_ = nullptr;
  std::uint64_t size_ = 0;
  std::vector<std::uint64_t> offsets_;
  std::vector<std::uint64_t> sizes_;
  std::vector<std::byte*> ptrs_;
};

class host_shm_path final : public transport_path {
 public:
  [[nodiscard]] transport_kind kind() const noexcept override { return transport_kind::host_shm; }
  [[nodiscard]] std::string describe_device() const override {
    return fmt::format("{} ({} threads)", cpu_name(), ::sysconf(_SC_NPROCESSORS_ONLN));
  }
  std::unique_ptr<tensor_memory> sources(const manifest& m, std::uint64_t seed,
                                         const std::vector<mapped_file>* files) override {
    if (files && !files->empty()) return std::make_unique<host_memory>(m, *files);
    auto mem = std::make_unique<host_memory>(m, "source tensors");
    for (std::size_t i = 0; i < m.entries.size(); ++i)
      fill_random(mem->data(i), m.entries[i].meta.nbytes(), tensor_seed(seed, i));
    return mem;
  }
  std::unique_ptr<tensor_memory> destinations(const manifest& m) override {
    return std::make_unique<host_memory>(m, "destination tensors");
  }
  double measure_ceiling() override { return host_memcpy_bandwidth(ceiling_bytes); }
  [[nodiscard]] std::string ceiling_method() const override {
    return fmt::format("memcpy of {} MiB, host to host, best of 5", ceiling_bytes >> 20);
  }

 private:
  // Large enough to leave the caches far behind, small enough for a 2 GB machine.
  static constexpr std::uint64_t ceiling_bytes = 256ull << 20;
};

}  // namespace

std::unique_ptr<transport_path> make_host_shm_path() { return std::make_unique<host_shm_path>(); }

}  // namespace refit::bench
