// A set of tensor names that keeps its nodes when cleared (see recycled_names).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

namespace refit::wire {

/// A set of names, looked up by std::string_view too.
struct name_hash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
using name_set = std::unordered_set<std::string, name_hash, std::equal_to<>>;

/// A name_set whose clear() keeps the nodes (and their strings' capacity) for the next inserts:
/// a refit of the same names as the last allocates nothing. It keeps at most as many nodes as the
/// set ever held at once.
class recycled_names {
 public:
  /// Adds `name`; false when it is there already (nothing changes then).
  bool insert(std::string_view name) {
    if (spare_.empty()) return names_.emplace(name).second;
    name_set::node_type node = std::move(spare_.back());
    spare_.pop_back();
    node.value().assign(name);  // within the capacity an earlier name left, mostly
    auto placed = names_.insert(std::move(node));
    if (!placed.inserted) spare_.push_back(std::move(placed.node));
    return placed.inserted;
  }

  /// Empties the set, its nodes kept (freed instead where there is no room to keep them).
  void clear() noexcept {
    try {
      while (!names_.empty()) spare_.push_back(names_.extract(names_.begin()));
    } catch (...) {
      names_.clear();
    }
  }

  [[nodiscard]] bool contains(std::string_view name) const { return names_.contains(name); }
  [[nodiscard]] std::size_t size() const noexcept { return names_.size(); }
  [[nodiscard]] const name_set& set() const noexcept { return names_; }

 private:
  name_set names_;
  std::vector<name_set::node_type> spare_;
};

}  // namespace refit::wire
