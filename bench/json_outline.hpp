// SPDX-License-Identifier: Apache-2.0
#pragma once

// The order of a JSON text's keys, read in one pass before the text is parsed into a document.
//
// A manifest or a recorded layout lists tensors as the keys of an object, and their order is the
// order the bench sends them in. nlohmann's ordered_json keeps that order, but its objects find a
// key by searching every one before it, and a parse with a callback (the bound on nesting) scans
// the enclosing object once more at the end of every value: a manifest of 20,000 tensors
// (qwen3-30b-a3b has 18,770) took seconds to load. So the bench parses into nlohmann::json (sorted
// maps, a lookup costs a logarithm) without a callback, and takes the order, the nesting bound
// and repeated keys from this outline: one SAX pass, in time linear in the text.

#include <cstddef>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

namespace refit::bench {

struct json_outline {
  /// The top-level object's keys, in the text's order (empty where the text is not an object).
  std::vector<std::string> keys;
  /// For each top-level key asked for (see outline_json) whose value is an object: its keys, in order.
  std::unordered_map<std::string, std::vector<std::string>> under;
  /// The first key said twice in one of those objects: the key, and the top-level key whose object
  /// holds it (empty: the top-level object). A document keeps one value of a repeated key, so the
  /// callers refuse the text.
  std::optional<std::pair<std::string, std::string>> repeated;
  /// The text nests objects and arrays deeper than the bound given (the pass stopped there).
  bool too_deep = false;
  /// The text is not JSON (or holds a number no double holds): nlohmann's message, as
  /// nlohmann::json::parse would throw it.
  std::optional<std::string> invalid;

  /// The keys of `key`'s object, in order; none where the key was not asked for or holds no object.
  [[nodiscard]] const std::vector<std::string>& keys_under(const std::string& key) const {
    static const std::vector<std::string> none;
    const auto it = under.find(key);
    return it == under.end() ? none : it->second;
  }
};

namespace detail {

class outline_sax final : public nlohmann::json_sax<nlohmann::json> {
 public:
  outline_sax(json_outline& out, std::initializer_list<std::string_view> nested, std::size_t max_depth)
      : out_(out), max_depth_(max_depth) {
    for (std::string_view n : nested) nested_.emplace(n);
  }

  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool number_integer(number_integer_t) override { return value(); }
  bool number_unsigned(number_unsigned_t) override { return value(); }
  bool number_float(number_float_t, const string_t&) override { return value(); }
  bool string(string_t&) override { return value(); }
  bool binary(binary_t&) override { return value(); }
  bool start_object(std::size_t) override { return open(); }
  bool start_array(std::size_t) override { return open(); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }

  bool key(string_t& k) override {
    if (depth_ == 1) {
      top_ = k;
      follow_ = nested_.count(k) != 0;
      note(top_seen_, out_.keys, k, "");
    } else if (depth_ == 2 && follow_) {  // a key at depth 2 is one of top_'s object
      note(nested_seen_[top_], out_.under[top_], k, top_);
    }
    return !out_.repeated;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    out_.invalid = e.what();
    return false;
  }

 private:
  static bool value() { return true; }
  bool open() {
    if (++depth_ <= max_depth_) return true;
    out_.too_deep = true;
    return false;
  }
  bool close() {
    --depth_;
    return true;
  }
  void note(std::unordered_set<std::string>& seen, std::vector<std::string>& order, const std::string& k,
            const std::string& holder) {
    if (seen.insert(k).second)
      order.push_back(k);
    else if (!out_.repeated)
      out_.repeated.emplace(k, holder);
  }

  json_outline& out_;
  std::size_t max_depth_;
  std::unordered_set<std::string> nested_;
  std::size_t depth_ = 0;
  std::string top_;
  bool follow_ = false;  ///< top_ is one of nested_
  std::unordered_set<std::string> top_seen_;
  std::unordered_map<std::string, std::unordered_set<std::string>> nested_seen_;
};

}  // namespace detail

/// Outlines `text`: the top-level keys, those of the objects under the top-level keys named in
/// `nested`, a repeated key, a nesting deeper than `max_depth` objects and arrays, or the syntax
/// error. Stops at the first of the last three.
inline json_outline outline_json(std::string_view text, std::initializer_list<std::string_view> nested,
                                 std::size_t max_depth) {
  json_outline out;
  detail::outline_sax sax(out, nested, max_depth);
  (void)nlohmann::json::sax_parse(text.begin(), text.end(), &sax);
  return out;
}

}  // namespace refit::bench
