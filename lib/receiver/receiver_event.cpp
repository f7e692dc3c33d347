// refit — the names of the receiver's events (include/refit/receiver.hpp), next to the receiver
// that reports them: lib/model knows nothing above it.
#include "refit/receiver.hpp"

namespace refit {

std::string_view to_string(receiver_event e) noexcept {
  switch (e) {
    case receiver_event::idle: return "idle";
    case receiver_event::hello: return "hello";
    case receiver_event::begin: return "begin";
    case receiver_event::batch: return "batch";
    case receiver_event::committed: return "committed";
    case receiver_event::aborted: return "aborted";
    case receiver_event::bye: return "bye";
    case receiver_event::refused: return "refused";
    case receiver_event::ended: return "ended";
    case receiver_event::prepared: return "prepared";
  }
  return "?";
}

std::string_view to_string(stage_kind k) noexcept {
  switch (k) {
    case stage_kind::none: return "none";
    case stage_kind::host: return "host";
    case stage_kind::device: return "device";
  }
  return "?";
}

}  // namespace refit
