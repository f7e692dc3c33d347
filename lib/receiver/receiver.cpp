// refit — the receiver's public methods (include/refit/receiver.hpp). The state machine behind them
// is receiver::impl: lib/receiver/impl.hpp says what it does and which file holds which part.
#include <fmt/format.h>

#include "receiver/impl.hpp"

namespace refit {

receiver::receiver(receiver_options options) : impl_(std::make_unique<impl>(std::move(options))) {}
receiver::~receiver() = default;
receiver::receiver(receiver&&) noexcept = default;
receiver& receiver::operator=(receiver&&) noexcept = default;

std::string receiver::endpoint() const { return impl_->lanes.front().channel.endpoint(); }

std::vector<std::string> receiver::endpoints() const {
  std::vector<std::string> out;
  out.reserve(impl_->lanes.size());
  for (const lane& l : impl_->lanes) out.push_back(l.channel.endpoint());
  return out;
}

void receiver::add_parameter(const tensor_dest& dest) { add_parameter(dest, dest_layout{}); }

void receiver::add_parameter(const tensor_dest& dest, const dest_layout& layout) {
  if (impl_->callback)
    throw error(errc::invalid_argument,
                "add_parameter: this receiver applies through a callback (on_batch); use one "
                "sink or the other");
  if (dest.meta.name.empty()) throw error(errc::invalid_argument, "add_parameter: empty tensor name");
  const std::uint64_t bytes = dest.meta.nbytes();  // throws for a bad shape
  if (dest.data == nullptr && bytes != 0)
    throw error(errc::invalid_argument,
                fmt::format("add_parameter: {} has no data (null pointer); only a tensor with no elements may have "
                            "none (a 0-d tensor is one element: {} bytes)",
                            describe(dest.meta), bytes));
  if (dest.meta.name.find('\x1f') != std::string::npos)
    throw error(errc::invalid_argument,
                fmt::format("add_parameter: the name '{}' contains the control character \\x1f, which refit reserves "
                            "for the scale tensors of quantised destinations",
                            dest.meta.name.substr(0, dest.meta.name.find('\x1f'))));
  check_conversion(dest, layout);
  std::lock_guard lock(impl_->stage_mutex);  // apply_prepared() reads the table (see impl.hpp)
  if (dest.q == quant::none) {
    impl_->table.add(plan::destination(dest, layout));
  } else if (dest.q == quant::nvfp4) {
    impl_->table.add_triple(plan::destination(dest, layout), scale_destination(dest, layout),
                            scale_2_destination(dest));
  } else {
    impl_->table.add_pair(plan::destination(dest, layout), scale_destination(dest, layout));
  }
  ++impl_->sink_generation;
}

void receiver::clear_parameters() {
  std::lock_guard lock(impl_->stage_mutex);
  impl_->table.clear();
  ++impl_->sink_generation;
}

void receiver::on_batch(batch_callback callback) {
  if (!callback) throw error(errc::invalid_argument, "on_batch: empty callback");
  if (impl_->staged())
    throw error(errc::invalid_argument,
                fmt::format("on_batch: this receiver stages versions (receiver_options::stage = {}), and a stage is "
                            "a copy of a parameter table: register parameters (add_parameter), or make the "
                            "receiver with stage = none to apply through a callback",
                            to_string(impl_->options.stage)));
  std::lock_guard lock(impl_->stage_mutex);
  impl_->table.clear();
  impl_->callback = std::move(callback);
  ++impl_->sink_generation;
}

void receiver::on_begin(std::function<void(std::uint64_t version)> hook) { impl_->begin_hook = std::move(hook); }

// on_commit and on_abort may run inside apply_prepared(), on another thread: their setters take the
// lock it reads them under.
void receiver::on_commit(std::function<void(std::uint64_t version)> hook) {
  std::lock_guard lock(impl_->stage_mutex);
  impl_->commit_hook = std::move(hook);
}

void receiver::on_abort(std::function<void(std::uint64_t version, const std::string& reason)> hook) {
  std::lock_guard lock(impl_->stage_mutex);
  impl_->abort_hook = std::move(hook);
}

void receiver::on_prepared(std::function<void(std::uint64_t version)> hook) { impl_->prepared_hook = std::move(hook); }

std::optional<std::uint64_t> receiver::apply_prepared(void* stream) { return impl_->apply_prepared(stream); }

std::optional<std::uint64_t> receiver::prepared_version() const noexcept {
  if (!impl_->has_prepared.load(std::memory_order_acquire)) return std::nullopt;
  return impl_->prepared_number.load(std::memory_order_acquire);
}

receiver_event receiver::serve_one(milliseconds wait) { return impl_->serve_one(wait); }

void receiver::serve(const std::function<bool()>& stop, milliseconds poll) {
  // A message kept by the last call is owed its reply, stop or not.
  while (impl_->owes() || !stop()) impl_->serve_one(poll);
}

std::optional<std::uint64_t> receiver::committed_version() const noexcept { return impl_->committed_version(); }
bool receiver::dirty() const noexcept { return impl_->is_dirty.load(); }
bool receiver::poisoned() const noexcept { return impl_->is_poisoned.load(); }

receiver_stats receiver::last_stats() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->stats_;
}

std::string receiver::last_error() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->last_error_;
}

}  // namespace refit
