// A set of tensor names emptied in O(1) (see recycled_names).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace refit::wire {

/// Hashes a name, looked up by std::string_view too.
struct name_hash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};

/// A set of names emptied in O(1), for the names of one refit (a streamer's sent names, a
/// receiver's completed tensors): each stored name keeps the generation it was last added in, and
/// clear() starts a new generation. A refit of the same names as the last allocates nothing and
/// frees nothing (clearing 18,867 names one by one cost a refit ~2.4 ms before its first copy).
/// Names of earlier generations stay stored until they outnumber twice the largest generation
/// held (plus 1,024): then clear() drops them all, so a set whose names keep changing stays
/// bounded.
class recycled_names {
 public:
  /// Adds `name`; false when it is there already (nothing changes then).
  bool insert(std::string_view name) {
    const auto it = names_.find(name);
    if (it == names_.end()) {
      names_.emplace(std::string(name), generation_);
    } else if (it->second == generation_) {
      return false;
    } else {
      it->second = generation_;
    }
    ++size_;
    return true;
  }

  /// Empties the set (its names kept for the next generation's inserts).
  void clear() noexcept {
    largest_ = std::max(largest_, size_);
    if (names_.size() > 2 * largest_ + 1024) names_.clear();
    ++generation_;
    size_ = 0;
  }

  [[nodiscard]] bool contains(std::string_view name) const {
    const auto it = names_.find(name);
    return it != names_.end() && it->second == generation_;
  }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  /// Names stored, this generation's and earlier ones' (for tests).
  [[nodiscard]] std::size_t stored() const noexcept { return names_.size(); }
  /// The names in the set, in no particular order (walks every stored name: for tests).
  [[nodiscard]] std::vector<std::string> list() const {
    std::vector<std::string> out;
    for (const auto& [name, generation] : names_)
      if (generation == generation_) out.push_back(name);
    return out;
  }

 private:
  std::unordered_map<std::string, std::uint64_t, name_hash, std::equal_to<>> names_;
  std::uint64_t generation_ = 0;
  std::size_t size_ = 0;
  std::size_t largest_ = 0;  ///< the most names one generation held
};

/// The names of the last refit in the order its source yielded them, each with a `Data` of the
/// caller's (a direct session's routes). A refit that yields the same names in the same order
/// checks each against its slot (one comparison, the slots read in order) instead of looking it up
/// in a hash set: the names met so far are then the last refit's first names, distinct already.
/// At the first name out of order, those names go into the set, which checks every later one; the
/// order recorded then becomes the next refit's. take() costs a hash lookup only after that.
template <class Data>
class yield_order {
 public:
  struct slot {
    std::string name;
    Data data{};
  };

  /// Starts a refit. `follow` false (a subset of the tensors): every name goes through the set, and
  /// the order kept stays as it is.
  void begin(bool follow) {
    if (moved_) slots_.clear();  // a refit that failed after leaving the order took its prefix
    moved_ = false;
    following_ = follow;
    recording_ = follow;
    at_ = 0;
    next_.clear();
  }

  /// Takes `name`: its slot (valid until the next take()), or nullptr where none is kept. Sets
  /// `twice` (and returns nullptr) when the name was taken already in this refit.
  slot* take(std::string_view name, recycled_names& set, bool& twice) {
    twice = false;
    if (following_ && at_ < slots_.size() && slots_[at_].name == name) return &slots_[at_++];
    if (following_) {
      following_ = false;
      for (std::size_t k = 0; k < at_; ++k) (void)set.insert(slots_[k].name);
      // Moved one by one: std::move's algorithm over slots, emitted out of line for some Data,
      // would be a weak symbol of librefit.so named after refit's type (tests/consumer/check_exports.sh).
      next_.clear();
      next_.reserve(at_);
      for (std::size_t k = 0; k < at_; ++k) next_.push_back(std::move(slots_[k]));
      moved_ = true;
    }
    if (!set.insert(name)) {
      twice = true;
      return nullptr;
    }
    if (!recording_) return nullptr;
    next_.push_back(slot{std::string(name), Data{}});
    return &next_.back();
  }

  /// After the refit's last tensor: the order it followed (or recorded) is the next refit's.
  void end() {
    if (!recording_) return;
    if (moved_) {
      slots_ = std::move(next_);
      next_.clear();
      moved_ = false;
    } else if (at_ < slots_.size()) {
      slots_.resize(at_);  // fewer tensors, the same first ones
    }
  }

  [[nodiscard]] std::size_t size() const noexcept { return slots_.size(); }
  /// Whether this refit still follows the last one's order (for tests).
  [[nodiscard]] bool following() const noexcept { return following_; }

 private:
  std::vector<slot> slots_, next_;
  std::size_t at_ = 0;
  bool following_ = false;
  bool recording_ = false;
  bool moved_ = false;  ///< slots_'s first at_ slots moved into next_
};

}  // namespace refit::wire
