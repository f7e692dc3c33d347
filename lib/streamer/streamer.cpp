// refit — the streamer: the policy side's state machine, refit::streamer's public methods. The
// state is streamer::impl (impl.hpp, which lists the parts that hold its behaviour); one refit
// reads top to bottom in refit.cpp.
#include "refit/streamer.hpp"

#include <algorithm>
#include <functional>
#include <optional>
#include <span>
#include <utility>

#include "channel/lane.hpp"
#include "model/log.hpp"
#include "streamer/impl.hpp"

namespace refit {
namespace {

class span_source final : public tensor_source {
 public:
  explicit span_source(std::span<const tensor_ref> tensors) : tensors_(tensors) {}
  std::optional<tensor_ref> next() override {
    if (next_ == tensors_.size()) return std::nullopt;
    return tensors_[next_++];
  }

 private:
  std::span<const tensor_ref> tensors_;
  std::size_t next_ = 0;
};

class function_source final : public tensor_source {
 public:
  explicit function_source(const std::function<std::optional<tensor_ref>()>& next) : next_(next) {}
  std::optional<tensor_ref> next() override { return next_(); }

 private:
  const std::function<std::optional<tensor_ref>()>& next_;
};

}  // namespace

streamer::streamer(streamer_options options) : impl_(std::make_unique<impl>(std::move(options))) {}
streamer::~streamer() { close(); }
streamer::streamer(streamer&&) noexcept = default;
streamer& streamer::operator=(streamer&& other) noexcept {
  if (this != &other) {
    close();
    impl_ = std::move(other.impl_);
  }
  return *this;
}

refit_stats streamer::refit(std::uint64_t version, tensor_source& source, refit_scope scope) {
  if (!impl_) throw error(errc::invalid_argument, "refit() on a moved-from streamer");
  return impl_->run(version, source, scope);
}

refit_stats streamer::refit(std::uint64_t version, std::span<const tensor_ref> tensors, refit_scope scope) {
  span_source source(tensors);
  return refit(version, source, scope);
}

refit_stats streamer::refit(std::uint64_t version, const std::function<std::optional<tensor_ref>()>& next,
                            refit_scope scope) {
  function_source source(next);
  return refit(version, source, scope);
}

std::size_t streamer::announce(std::chrono::milliseconds hold) noexcept {
  if (!impl_ || !impl_->in_session) return 0;
  std::size_t told = 0;
  for (channel::req_channel& c : impl_->channels) told += c.announce(hold) ? 1 : 0;
  return told;
}

void streamer::close() noexcept {
  if (!impl_ || !impl_->in_session) return;
  // A polite goodbye to every receiver, each with a short deadline of its own: a dead or slow one
  // must neither delay shutdown much nor keep the others from hearing it.
  const auto bye = [this] { return wire::encode(wire::bye{}, impl_->secret); };
  for (std::size_t k = 0; k < impl_->channels.size(); ++k) {
    try {
      impl_->channels[k].request(bye(), std::min(impl_->options.timeout, milliseconds{1000}), "BYE");
    } catch (const std::exception& e) {
      REFIT_DEBUG("BYE to {} not answered: {}", impl_->endpoints[k], e.what());
    }
    impl_->channels[k].attach_lane(nullptr);  // the session's control lane, unmapped
  }
  impl_->drop_session();
}

void streamer::add_receiver(std::string endpoint) {
  if (!impl_) throw error(errc::invalid_argument, "add_receiver() on a moved-from streamer");
  impl_->add_receiver(std::move(endpoint));
}

void streamer::remove_receiver(std::string_view endpoint) {
  if (!impl_) throw error(errc::invalid_argument, "remove_receiver() on a moved-from streamer");
  impl_->remove_receiver(endpoint);
}

std::vector<std::string> streamer::receivers() const { return impl_ ? impl_->endpoints : std::vector<std::string>{}; }

const streamer_options& streamer::options() const noexcept { return impl_->options; }

}  // namespace refit
