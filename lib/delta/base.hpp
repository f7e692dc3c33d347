// refit — the streamer's base: its own copy of the last version every receiver committed, which a
// delta is diffed against.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/memory.hpp"
#include "refit/model.hpp"

namespace refit::delta {

/// Where the base lives. host: page-locked when refit is built with CUDA (so a GPU diff can read it
/// without staging), plain memory otherwise; device: memory of the streamer's GPU.
enum class memory : std::uint8_t { host = 0, device = 1 };

/// The base's tensors, by name. Not thread-safe.
class base_store {
 public:
  struct tensor {
    tensor_meta meta;
    std::uint64_t bytes = 0;
    std::byte* data = nullptr;  ///< owned by the store
  };

  /// `max_bytes` bounds the memory the tensors take; `device` is the CUDA ordinal for memory::device.
  base_store(memory where, std::uint64_t max_bytes, int device = 0);
  ~base_store();
  base_store(const base_store&) = delete;
  base_store& operator=(const base_store&) = delete;

  /// The base's tensor of this name, or nullptr.
  [[nodiscard]] tensor* find(const std::string& name) noexcept;
  /// Room for tensor `meta` (reused when it is there with the same byte count): nullptr when it
  /// would take the base past max_bytes (the base is then unusable: invalidate()). Tensors are cut
  /// from slabs of up to 256 MiB, 256-byte aligned, so that thousands of small tensors (a MoE's
  /// experts: 3 MiB each in qwen3-30b-a3b) do not each round up to the allocator's granularity
  /// (2 MiB pages on a GPU: 4 MiB for each 3 MiB expert, +33 %); a tensor of 64 MiB or more has an
  /// allocation of its own.
  tensor* place(const tensor_meta& meta);
  /// A whole version is about to be placed: when tensors changed size since the slabs were cut
  /// (their old room is abandoned), starts over so that the new version packs them again.
  void begin_whole() noexcept {
    if (abandoned_ != 0) clear();
  }

  /// Forgets the version (the tensors' memory is kept for the next whole version).
  void invalidate() noexcept { version_.reset(); }
  /// The base is now `version`, whose version checksum is `checksum`.
  void commit(std::uint64_t version, std::uint64_t checksum) noexcept {
    version_ = version;
    checksum_ = checksum;
  }
  [[nodiscard]] std::optional<std::uint64_t> version() const noexcept { return version_; }
  [[nodiscard]] std::uint64_t checksum() const noexcept { return checksum_; }
  /// Bytes the base's tensors take.
  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }
  /// Bytes the store allocated for them (slabs and tensors of their own).
  [[nodiscard]] std::uint64_t reserved() const noexcept { return reserved_; }
  [[nodiscard]] std::uint64_t max_bytes() const noexcept { return max_bytes_; }
  [[nodiscard]] memory where() const noexcept { return where_; }
  /// The memory of the base's tensors, as a device.
  [[nodiscard]] device dev() const noexcept;
  /// Frees everything.
  void clear() noexcept;

 private:
  /// How a block was allocated, so that it is freed the same way.
  enum class allocator : std::uint8_t { plain, pinned, device };
  struct freer {
    allocator how = allocator::plain;
    ::refit::memory::charge counted;  ///< the block's bytes, counted while the block is held (include/refit/memory.hpp)
    void operator()(std::byte* p) const noexcept;
  };
  std::unique_ptr<std::byte, freer> allocate(std::uint64_t bytes);

  memory where_;
  std::uint64_t max_bytes_;
  int device_;
  std::uint64_t bytes_ = 0;
  std::optional<std::uint64_t> version_;
  std::uint64_t checksum_ = 0;
  std::unordered_map<std::string, tensor> tensors_;
  /// Room for `bytes` bytes: cut from the open slab, a new slab, or an allocation of its own.
  std::byte* carve(std::uint64_t bytes);
  struct slab {
    std::unique_ptr<std::byte, freer> memory;
    std::uint64_t size = 0;
    std::uint64_t used = 0;
  };
  std::vector<slab> slabs_;      ///< the last one is open unless it is a tensor's own
  bool open_ = false;            ///< slabs_.back() takes more tensors
  std::uint64_t reserved_ = 0;   ///< bytes of slabs_
  std::uint64_t abandoned_ = 0;  ///< bytes of tensors placed again with another size
};

}  // namespace refit::delta
