// refit Python binding — the extension module refit._refit.
//
// A thin layer over refit::receiver and refit::streamer: tensors converted without a copy
// (tensors.hpp), the GIL released while bytes move, refit::error raised as refit.RefitError, and
// Python callbacks run with the GIL taken back. No protocol logic lives here.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "refit/error.hpp"
#include "refit/model.hpp"
#include "refit/nccl.hpp"
#include "refit/options.hpp"
#include "refit/receiver.hpp"
#include "refit/streamer.hpp"
#include "refit/version.hpp"
#include "tensors.hpp"

#ifndef REFIT_PY_VERSION
#define REFIT_PY_VERSION "unknown"
#endif

namespace refit::python {
namespace {

using std::chrono::milliseconds;

tensor_world& world() {
  // Made on first use with the GIL held; never destroyed (it holds Python objects, and static
  // destructors run after the interpreter is gone).
  static auto* w = new tensor_world();
  return *w;
}

/// What the refit package defines in Python and hands to this module when it is imported: the
/// error types (refit/_errors.py) and refit.Shard. Unset when this module is imported on its own.
struct package_types {
  py::object refit_error;
  py::object refit_timeout;
  py::object shard;
  py::str shard_marker{"__refit_shard__"};  ///< what any other Shard-like object has
};

package_types& package() {
  static auto* t = new package_types;  // never destroyed: see world()
  return *t;
}

/// Seconds (Python float) to a positive deadline; `what` names the argument in the error.
milliseconds to_deadline(double seconds, const char* what, bool allow_zero = false) {
  if (!std::isfinite(seconds) || seconds < 0 || (!allow_zero && seconds == 0))
    throw py::value_error(std::string(what) + " must be a positive number of seconds, got " + std::to_string(seconds));
  return milliseconds{static_cast<std::int64_t>(std::ceil(seconds * 1000.0))};
}

curve_keys to_curve(const py::object& curve) {
  curve_keys k;
  if (curve.is_none()) return k;
  const auto field = [&](const char* name) -> py::object {
    if (py::isinstance<py::dict>(curve)) {
      const py::dict d = curve;
      return d.contains(name) ? py::object(d[name]) : py::object(py::none());
    }
    return py::getattr(curve, name, py::none());
  };
  const auto text = [&](const char* name) {
    const py::object v = field(name);
    return v.is_none() ? std::string() : v.cast<std::string>();
  };
  k.public_key = text("public_key");
  k.secret_key = text("secret_key");
  k.server_key = text("server_key");
  const py::object allowed = field("allowed_clients");
  if (!allowed.is_none()) k.allowed_clients = allowed.cast<std::vector<std::string>>();
  return k;
}

/// Type and message of a Python exception, as the streamer will read it ("ValueError: bad q").
std::string describe(const py::error_already_set& e) {
  std::string type = "Exception";
  try {
    type = py::str(e.type().attr("__name__"));
  } catch (...) {
  }
  std::string message;
  try {
    message = py::str(e.value());
  } catch (...) {
  }
  return message.empty() ? type : type + ": " + message;
}

bool is_interrupt(const py::error_already_set& e) {
  return e.matches(PyExc_KeyboardInterrupt) || e.matches(PyExc_SystemExit);
}

// ------------------------------------------------------------------------------- views

/// What on_batch hands to Python for one entry. Valid only during the call: `alive` is cleared
/// when the callback returns, after which .tensor raises instead of reading reused memory.
struct view {
  tensor_meta meta;
  const void* data = nullptr;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  std::uint64_t total = 0;
  device dev{};
  std::shared_ptr<bool> alive;
  py::object tensor;  // made on first access

  [[nodiscard]] bool whole() const noexcept { return offset == 0 && bytes == total; }
  [[nodiscard]] bool last() const noexcept { return offset + bytes == total; }

  py::object get_tensor() {
    if (!*alive)
      throw std::runtime_error("refit.View '" + meta.name +
                               "' was used after its on_batch call returned: views alias the receiver's buffer, "
                               "which is reused; copy what you need during the call (view.tensor.clone())");
    if (!tensor) tensor = world().alias(meta, data, bytes, dev, whole());
    return tensor;
  }
};

// ----------------------------------------------------------------------------- receiver

class py_receiver {
 public:
  py_receiver(std::optional<std::string> endpoint, int device, double idle_timeout, std::optional<std::string> token,
              const py::object& curve, const std::string& engine, const std::string& layout, std::size_t streamers,
              std::size_t delta_threads, bool control_lane, bool allow_insecure_tcp, const std::string& stage,
              std::uint64_t stage_bytes) {
    receiver_options o;
    if (stage == "none") {
      o.stage = stage_kind::none;
    } else if (stage == "host") {
      o.stage = stage_kind::host;
    } else if (stage == "device") {
      o.stage = stage_kind::device;
    } else {
      throw py::value_error("stage must be None, 'host' or 'device'; got '" + stage + "'");
    }
    o.stage_bytes = stage_bytes;
    stage_ = o.stage;
    o.control_lane = control_lane;
    o.allow_insecure_tcp = allow_insecure_tcp;
    o.layout = layout;
    o.streamers = streamers;
    o.delta_threads = delta_threads;
    o.endpoint = endpoint.value_or("");
    o.device = device;
    o.idle_timeout = to_deadline(idle_timeout, "idle_timeout");
    o.token = token.value_or("");
    o.curve = to_curve(curve);
    const auto e = parse_copy_engine(engine);
    if (!e)
      throw py::value_error("engine must be one of automatic, kernel, memcpy_batch, memcpy_each; got '" + engine + "'");
    o.engine = *e;
    device_ = device;
    py::gil_scoped_release nogil;  // binding a socket may take a moment
    rx_ = std::make_unique<receiver>(std::move(o));
  }

  ~py_receiver() { close(); }

  void close() {
    if (!rx_) return;
    std::unique_ptr<receiver> rx = std::move(rx_);
    {
      py::gil_scoped_release nogil;  // ends the session: unmaps, drains the device
      rx.reset();
    }
    keep_.clear();
    retired_.clear();
  }

  receiver& rx() {
    if (!rx_) throw error(errc::invalid_argument, "this refit.Receiver is closed");
    return *rx_;
  }

  [[nodiscard]] int device() const noexcept { return device_; }
  std::string endpoint() { return rx().endpoint(); }
  std::vector<std::string> endpoints() { return rx().endpoints(); }

  /// `source_slice`: None or (dim, start, length); dim may be negative (counted from the end).
  void add_parameter(const std::string& name, const py::handle& tensor, const py::object& source_slice,
                     const py::object& scale, const std::optional<std::string>& quant_name,
                     const std::optional<std::string>& dtype_name, const py::object& scale_2,
                     const std::string& scale_layout_name) {
    borrowed_tensor b = world().borrow(tensor, name, /*views=*/true);
    if (dtype_name) {
      // Reinterprets the tensor's bytes: torch without float8 holds f8_e4m3 as uint8.
      const auto t = parse_dtype(*dtype_name);
      if (!t)
        throw py::value_error("tensor '" + name + "': unknown dtype '" + *dtype_name +
                              "' (refit names such as 'f8_e4m3', 'bf16', or torch names)");
      if (itemsize(*t) != itemsize(b.meta.type))
        throw py::value_error("tensor '" + name + "': dtype='" + *dtype_name + "' has " + std::to_string(itemsize(*t)) +
                              "-byte elements, but the tensor's " + std::string(to_string(b.meta.type)) + " has " +
                              std::to_string(itemsize(b.meta.type)) +
                              ": pass a tensor of the same element size (uint8 for f8_e4m3)");
      b.meta.type = *t;
    }
    refit::quant q = refit::quant::none;
    if (quant_name) {
      const auto parsed = parse_quant(*quant_name);
      if (!parsed)
        throw py::value_error("tensor '" + name +
                              "': quant must be 'tensor', 'block128', 'channel', 'mxfp8', 'nvfp4' or 'none', not '" +
                              *quant_name + "'");
      q = *parsed;
    }
    // NVFP4 checkpoints hold the packed weight as uint8: its bytes are the f4_e2m1x2 pairs.
    if (q == refit::quant::nvfp4 && !dtype_name && b.meta.type == dtype::u8) b.meta.type = dtype::f4_e2m1x2;
    const auto layout_code = parse_scale_layout(scale_layout_name);
    if (!layout_code)
      throw py::value_error("tensor '" + name + "': scale_layout must be 'row_major' or 'swizzled' (swizzled_128x4), " +
                            "not '" + scale_layout_name + "'");
    std::optional<borrowed_tensor> sb;
    if (!scale.is_none()) {
      sb = world().borrow(scale, name + " (scale)");
      // A scale of the format's dtype, or its bytes as uint8 (torch without float8_e8m0fnu or
      // float8_e4m3fn).
      const dtype want_type = scale_dtype(q);
      if (sb->meta.type != want_type && !(want_type != dtype::f32 && sb->meta.type == dtype::u8))
        throw py::type_error("tensor '" + name + "': scale must be " +
                             std::string(want_type == dtype::f32 ? "float32"
                                         : want_type == dtype::f8_e8m0
                                             ? "float8_e8m0fnu (or its bytes as uint8) for quant 'mxfp8'"
                                             : "float8_e4m3fn (or its bytes as uint8) for quant 'nvfp4'") +
                             ", not " + std::string(to_string(sb->meta.type)));
      if (!(sb->dev == b.dev))
        throw py::value_error("tensor '" + name + "': scale must be on the destination's device");
      const auto want = scale_shape(q, element_shape(b.meta.type, b.meta.shape), *layout_code);
      if (q != refit::quant::none && sb->meta.numel() != checked_numel(want).value_or(0))
        throw py::value_error("tensor '" + name + "': scale has " + std::to_string(sb->meta.numel()) +
                              " elements, but quant '" + std::string(to_string(q)) + "' of this destination needs " +
                              std::to_string(checked_numel(want).value_or(0)) + " (scales of shape " +
                              std::string(py::str(py::cast(want))) + ")");
    }
    dest_layout layout;
    layout.strides = std::move(b.strides);
    layout.alloc = b.alloc;
    layout.alloc_bytes = b.alloc_bytes;
    if (!source_slice.is_none()) {
      std::tuple<std::int64_t, std::int64_t, std::int64_t> s;
      try {
        if (!py::isinstance<py::tuple>(source_slice) && !py::isinstance<py::list>(source_slice)) throw py::cast_error();
        s = source_slice.cast<std::tuple<std::int64_t, std::int64_t, std::int64_t>>();
      } catch (const py::cast_error&) {
        throw py::type_error("tensor '" + name +
                             "': source_slice must be a tuple (dim, start, length) of three "
                             "ints, got " +
                             std::string(py::repr(source_slice)));
      }
      const auto rank = static_cast<std::int64_t>(b.meta.shape.size());
      const std::int64_t dim = std::get<0>(s) < 0 ? std::get<0>(s) + rank : std::get<0>(s);
      if (dim < 0 || dim >= rank)
        throw py::value_error("tensor '" + name + "': source_slice dimension " + std::to_string(std::get<0>(s)) +
                              " is not one of the view's " + std::to_string(rank) + " dimensions");
      layout.slice = refit::source_slice{static_cast<int>(dim), std::get<1>(s), std::get<2>(s)};
    }
    std::optional<borrowed_tensor> s2;
    if (!scale_2.is_none()) {
      s2 = world().borrow(scale_2, name + " (scale_2)");
      if (s2->meta.type != dtype::f32 || s2->meta.numel() != 1)
        throw py::type_error("tensor '" + name + "': scale_2 must be one float32 element (nvfp4's per-tensor " +
                             "scale, a checkpoint's weight_scale_2), not " + refit::describe(s2->meta));
      if (!(s2->dev == b.dev))
        throw py::value_error("tensor '" + name + "': scale_2 must be on the destination's device");
    }
    tensor_dest d{b.meta, b.data, b.dev};
    d.q = q;
    d.scale = sb ? sb->data : nullptr;
    d.scale_2 = s2 ? s2->data : nullptr;
    d.layout = *layout_code;
    rx().add_parameter(d, layout);
    keep_.emplace(name, std::move(b.keep));
    if (sb) keep_.emplace(name, std::move(sb->keep));
    if (s2) keep_.emplace(name, std::move(s2->keep));
  }

  void clear_parameters() {
    rx().clear_parameters();
    retire();
  }

  /// fn(views: list[View], stream: int); `what` names the Python method that set it (on_tensor or
  /// on_batch), as errors and the streamer will read it.
  void on_batch(py::function fn, const std::string& what) {
    receiver& r = rx();
    // The C++ receiver replaces a table with a callback; a Python engine that registered its
    // parameters and then a loader has made a mistake, and would only learn of it at the first
    // refit (nothing written where it expected).
    if (!keep_.empty())
      throw error(errc::invalid_argument,
                  what + ": this receiver has a parameter table (" + std::to_string(keep_.size()) +
                      " destination(s) registered with add_parameter / add_parameters); a receiver applies "
                      "through its table or through a callback, not both: call rx.clear_parameters() first to "
                      "switch to the callback");
    batch_fn_ = std::move(fn);
    batch_what_ = "the " + what + " callback";
    r.on_batch([this](std::span<const tensor_view> views, void* stream) { run_batch(views, stream); });
    retire();  // the callback replaces the table (empty here)
  }

  void on_begin(py::object fn) { version_hook(begin_fn_, std::move(fn), "on_begin", &receiver::on_begin); }
  void on_commit(py::object fn) { version_hook(commit_fn_, std::move(fn), "on_commit", &receiver::on_commit); }
  void on_prepared(py::object fn) { version_hook(prepared_fn_, std::move(fn), "on_prepared", &receiver::on_prepared); }

  void on_abort(py::object fn) {
    abort_fn_ = std::move(fn);
    if (abort_fn_.is_none()) {
      rx().on_abort({});
      return;
    }
    rx().on_abort([this](std::uint64_t version, const std::string& reason) {
      py::gil_scoped_acquire gil;
      call_hook(abort_fn_, "on_abort", version, reason);
    });
  }

  /// Keeps `fn` in `slot` and makes it the receiver's hook `name` through `set` (None: no hook);
  /// the hook takes the GIL to call it.
  void version_hook(py::object& slot, py::object fn, const char* name,
                    void (receiver::*set)(std::function<void(std::uint64_t)>)) {
    slot = std::move(fn);
    if (slot.is_none()) {
      (rx().*set)({});
      return;
    }
    (rx().*set)([this, &slot, name](std::uint64_t version) {
      py::gil_scoped_acquire gil;
      call_hook(slot, name, version);
    });
  }

  /// The copy of the stage into the weights runs without the GIL (on_commit takes it back).
  std::optional<std::uint64_t> apply_prepared(std::uintptr_t stream) {
    receiver& r = rx();
    std::optional<std::uint64_t> v;
    {
      py::gil_scoped_release nogil;
      v = r.apply_prepared(reinterpret_cast<void*>(stream));
    }
    if (v) {
      retired_.clear();  // committed: nothing writes a tensor removed from the table any more
      error_before_commit_ = r.last_error();
    }
    return v;
  }

  std::optional<std::uint64_t> prepared_version() { return rx().prepared_version(); }

  int serve_one(double timeout) {
    const milliseconds wait = to_deadline(timeout, "timeout", true);
    receiver& r = rx();
    receiver_event e{};
    {
      py::gil_scoped_release nogil;
      e = r.serve_one(wait);
    }
    after(e, wait);
    return static_cast<int>(e);
  }

  void serve(const py::object& stop, double poll) {
    const milliseconds wait = to_deadline(poll, "poll");
    receiver& r = rx();
    for (;;) {
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();  // Ctrl-C within one poll
      if (!stop.is_none() && stop().cast<bool>()) return;
      receiver_event e{};
      try {
        py::gil_scoped_release nogil;
        e = r.serve_one(wait);
      } catch (const error&) {
        // A signal may interrupt the socket's wait: report the signal, not the interrupted wait.
        if (PyErr_CheckSignals() != 0) throw py::error_already_set();
        throw;
      }
      after(e, wait);
    }
  }

  std::optional<std::uint64_t> committed_version() { return rx().committed_version(); }
  [[nodiscard]] std::string stage() { return std::string(to_string(stage_)); }
  bool dirty() { return rx().dirty(); }
  bool poisoned() { return rx().poisoned(); }
  receiver_stats last_stats() { return rx().last_stats(); }
  std::optional<std::string> last_error() {
    std::string e = rx().last_error();
    if (e.empty() || (error_before_commit_ && *error_before_commit_ == e)) return std::nullopt;
    return e;
  }

 private:
  /// What follows an event: tensors removed from the table are let go once nothing can write
  /// them any more (a commit, or the session's end: see receiver.hpp), and a Ctrl-C raised in a
  /// callback is raised here — once the streamer has been told that the refit failed, which the
  /// receiver does in its reply to the streamer's next message.
  void after(receiver_event e, milliseconds wait) {
    if (e == receiver_event::committed || e == receiver_event::bye || e == receiver_event::hello) retired_.clear();
    if (e == receiver_event::committed) error_before_commit_ = rx().last_error();
    if (e == receiver_event::aborted || e == receiver_event::refused) error_before_commit_.reset();
    if (!interrupt_) return;
    receiver& r = rx();
    // Bounded: a streamer that sends nothing more is presumed dead after idle_timeout, and
    // serve_one() then reports the refit aborted.
    const milliseconds step = std::max(wait, milliseconds{10});
    while (e == receiver_event::begin || e == receiver_event::batch || e == receiver_event::idle) {
      py::gil_scoped_release nogil;
      e = r.serve_one(step);
    }
    std::unique_ptr<py::error_already_set> pending = std::move(interrupt_);
    pending->restore();
    throw py::error_already_set();
  }

  /// Registered tensors stop being held by the table but stay alive until after().
  void retire() {
    for (auto& [name, t] : keep_) retired_.push_back(std::move(t));
    keep_.clear();
  }

  void run_batch(std::span<const tensor_view> views, void* stream) {
    py::gil_scoped_acquire gil;
    auto alive = std::make_shared<bool>(true);
    py::list list(views.size());
    for (std::size_t i = 0; i < views.size(); ++i) {
      const tensor_view& v = views[i];
      list[i] = py::cast(view{*v.meta, v.data, v.offset, v.bytes, v.total, v.dev, alive, py::object()});
    }
    try {
      batch_fn_(list, reinterpret_cast<std::uintptr_t>(stream));
    } catch (py::error_already_set& e) {
      *alive = false;
      throw_from_python(std::move(e), batch_what_);
    }
    *alive = false;
  }

  template <typename... Args>
  void call_hook(const py::object& fn, const char* which, Args&&... args) {
    try {
      fn(std::forward<Args>(args)...);
    } catch (py::error_already_set& e) {
      throw_from_python(std::move(e), which);
    }
  }

  /// A Python exception raised inside a callback becomes errc::apply with its type and message,
  /// so the streamer reads it. Ctrl-C and SystemExit are also kept and raised again from serve().
  [[noreturn]] void throw_from_python(py::error_already_set&& e, const std::string& where) {
    const std::string message = where + " raised " + describe(e);
    if (is_interrupt(e)) interrupt_ = std::make_unique<py::error_already_set>(std::move(e));
    throw error(errc::apply, message);
  }

  std::unique_ptr<receiver> rx_;
  int device_ = 0;
  std::unordered_multimap<std::string, py::object> keep_;  ///< registered tensors stay alive
  std::vector<py::object> retired_;                        ///< removed ones, until after() lets go
  py::object batch_fn_, begin_fn_, commit_fn_, abort_fn_, prepared_fn_;
  stage_kind stage_ = stage_kind::none;
  std::string batch_what_ = "the on_batch callback";
  std::unique_ptr<py::error_already_set> interrupt_;
  /// C++ keeps its last error after later versions commit; Python's last_error is the failure of
  /// the refits since the last commit. Set at a commit to the error then held, cleared by any
  /// later failure (which may have the same text).
  std::optional<std::string> error_before_commit_;
};

// ----------------------------------------------------------------------------- streamer

/// The thread that reads a streamer's large containers (python_tensors::start_reader): made at its
/// first such refit and kept until close(), since a thread made and joined per refit cost a
/// refit ~0.1 ms on an H200 VM (the Python API's qwen2.5-0.5b direct row). Between jobs it waits
/// holding no Python state, so that it ends cleanly whenever its streamer is closed. A process
/// forked from the one that made it has no such thread, only a copy of its state (a condition
/// variable with a waiter, which would never let itself be destroyed): there it is left alone,
/// never destroyed (py_streamer::forget_foreign_reader()).
class reader_thread {
 public:
  reader_thread() : owner_(::getpid()), thread_([this] { loop(); }) {}
  reader_thread(const reader_thread&) = delete;
  reader_thread& operator=(const reader_thread&) = delete;
  /// Without the GIL: the last job has finished (python_tensors::stop_reader).
  ~reader_thread() {
    {
      std::lock_guard lock(mutex_);
      quit_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }

  /// Whether this process made the thread (not a child forked since).
  [[nodiscard]] bool owned() const noexcept { return owner_ == ::getpid(); }

  void post(std::function<void()> job) {
    {
      std::lock_guard lock(mutex_);
      job_ = std::move(job);
    }
    wake_.notify_one();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return quit_ || job_; });
        if (!job_) return;
        job = std::move(job_);
        job_ = nullptr;
      }
      job();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::function<void()> job_;
  bool quit_ = false;
  pid_t owner_;
  std::thread thread_;  // last: it starts once the members above exist
};

/// The tensors of one refit and what keeps them alive until refit() returns.
///
/// A container of many tensors (a state_dict) is read by the streamer's reader thread
/// (start_reader()): reading a tensor through the binding costs ~1-2 us under the GIL (torch's
/// attributes), which the refit's thread then spends planning and launching the copies of the
/// tensors before it instead of waiting on it. The reader takes plain torch tensors (and Shards
/// of them) only: reader_takes().
/// A generator, a container of fewer than reader_from pairs, and what the reader leaves are read
/// on the refit's thread, in visits: a generator may gather its next tensor on that thread's CUDA
/// device and stream, which another thread does not have.
class python_tensors final : public tensor_source {
 public:
  /// Containers of at least this many pairs are read by the streamer's reader thread.
  static constexpr Py_ssize_t reader_from = 64;

  python_tensors(const py::object& stream, int default_device) : default_device_(default_device) {
    if (stream.is_none()) return;
    const py::object handle = py::hasattr(stream, "cuda_stream") ? stream.attr("cuda_stream") : stream;
    const auto h = handle.cast<std::uintptr_t>();
    given_stream_ = h == 0 ? reinterpret_cast<void*>(std::uintptr_t{1}) : reinterpret_cast<void*>(h);
  }
  python_tensors(const python_tensors&) = delete;
  python_tensors& operator=(const python_tensors&) = delete;
  ~python_tensors() override {
    if (!posted_) return;
    // Only where refit() did not stop it: the reader needs the GIL to finish.
    py::gil_scoped_release nogil;
    stop_reader();
  }

  /// Reads one (name, tensor) pair. Needs the GIL. On the reader thread, a pair the refit's thread
  /// must read sets `elsewhere` and is not kept: one the reader does not take (reader_takes()), or
  /// a CUDA tensor on a device whose current torch stream that thread has not read (torch's
  /// current stream is per thread).
  tensor_ref take(const py::handle& pair, bool on_reader, bool& elsewhere) {
    PyObject* p = pair.ptr();
    if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 2)
      throw py::type_error("refit(): tensors must be a mapping of name to tensor or (name, tensor) pairs; got a " +
                           std::string(py::str(py::type::handle_of(pair).attr("__name__"))));
    const py::handle key = PyTuple_GET_ITEM(p, 0);
    const py::handle value = PyTuple_GET_ITEM(p, 1);
    if (!PyUnicode_Check(key.ptr()))
      throw py::type_error("refit(): a tensor name must be a str, got " +
                           std::string(py::str(py::type::handle_of(key).attr("__name__"))));
    if (on_reader && !reader_takes(value)) {
      elsewhere = true;
      return {};
    }
    if (!on_reader && ready_.empty()) first_taken_ = reader_takes(value);
    Py_ssize_t length = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(key.ptr(), &length);
    if (utf8 == nullptr) throw py::error_already_set();
    std::string name(utf8, static_cast<std::size_t>(length));
    // A refit.Shard: the tensor is a part of the whole tensor of that name (sharded trainers).
    const bool sharded = is_shard(value);
    const py::object tensor = sharded ? py::object(value.attr("tensor")) : py::reinterpret_borrow<py::object>(value);
    borrowed_tensor b = world().borrow(tensor, std::move(name));
    tensor_ref r{std::move(b.meta), b.data, b.dev, nullptr};
    if (sharded)
      r.shard = tensor_shard{value.attr("global_shape").cast<std::vector<std::int64_t>>(),
                             value.attr("dim").cast<int>(), value.attr("start").cast<std::int64_t>()};
    elsewhere = r.dev.kind == device_kind::cuda && on_reader && !known_stream(r.dev.index);
    if (elsewhere) return r;
    if (r.dev.kind == device_kind::cuda) r.stream = stream_of(r.dev.index);
    keep_.push_back(std::move(b.keep));
    return r;
  }

  /// Pulls from a Python iterator. Up to `ahead` pairs are read per visit under the GIL: more than
  /// one only for containers, whose tensors exist already (1, then 4, 16, ... up to `ahead`, so the
  /// first copy starts after one conversion); a generator gathers its next tensor only when the
  /// streamer asks for it. Every tensor is held until refit() returns (the C++ rule:
  /// copies of it may still be queued on the device), so a generator that gathers fresh tensors
  /// holds all of them by the end of the refit.
  void pull_from(py::iterator it, std::size_t ahead) {
    iterator_ = std::move(it);
    ahead_ = ahead;
    visit_ = 1;
  }

  /// For a container of `pairs` pairs (at least reader_from), has `thread` read what is left of
  /// it, after reading its first pair here (so that its device's stream is known). Needs the
  /// GIL; stop_reader() must run, without it, before refit() returns.
  void start_reader(Py_ssize_t pairs, reader_thread& thread) {
    if (pairs < reader_from) return;
    fill_if_taken();
    // A container whose first pair the reader would not take (a state_dict of tensor
    // subclasses, such as FSDP2's DTensors) is read here throughout.
    if (done_ || failed_ || !first_taken_) return;
    thread.post([this] { read_rest(); });
    posted_ = true;
  }

  /// Ends the reading (at once: the reader stops at its next pair) and waits until the reader
  /// is done with this source. Without the GIL.
  void stop_reader() noexcept {
    if (!posted_) return;
    stop_.store(true, std::memory_order_relaxed);
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        if (finished_) break;
      }
      std::this_thread::yield();
    }
    posted_ = false;
  }

  std::optional<tensor_ref> next() override {
    if (next_ == ready_.size() && posted_) take_read();
    if (next_ == ready_.size()) {
      if (failed_) throw error(errc::invalid_argument, failure_message_);
      if (done_) return std::nullopt;
      fill();
      if (ready_.empty()) return next();
    }
    return std::move(ready_[next_++]);
  }
  /// The device of the first tensor, read ahead (it is still the first one next() returns); None
  /// for no tensors. A source that fails before its first tensor raises here. Needs the GIL.
  std::optional<device> first_device() {
    fill_if_taken();
    if (next_ < ready_.size()) return ready_[next_].dev;
    raise_source_failure();
    return std::nullopt;
  }

  /// Raises the Python exception the source raised, if any. Needs the GIL.
  void raise_source_failure() {
    if (!failure_) return;
    std::unique_ptr<py::error_already_set> e = std::move(failure_);
    e->restore();
    throw py::error_already_set();
  }

  void release() { keep_.clear(); }

 private:
  /// fill(), when every pair read has been taken and the source may have more.
  void fill_if_taken() {
    if (next_ == ready_.size() && !done_ && !failed_) fill();
  }

  /// Replaces the pairs read (all taken) with up to `ahead_` more; a Python exception is kept
  /// (raised again once refit() failed: a generator's own exception reaches the caller unchanged)
  /// and reported to the streamer after the pairs read before it.
  void fill() {
    ready_.clear();
    next_ = 0;
    py::gil_scoped_acquire gil;
    try {
      const std::size_t want = visit_;
      visit_ = std::min(ahead_, visit_ * 4);
      while (ready_.size() < want) {
        if (iterator_ == py::iterator::sentinel()) {
          done_ = true;
          return;
        }
        bool elsewhere = false;
        ready_.push_back(take(*iterator_, false, elsewhere));
        ++iterator_;
      }
    } catch (py::error_already_set& e) {
      fail(std::move(e), false);
    } catch (const py::builtin_exception& e) {
      fail(e, false);
    }
  }

  /// The reader's job: every pair left, each handed over as it is read (read_), the GIL let go
  /// every reader_from pairs so that the program's other threads run. Ends at the iterator's end,
  /// a failure, stop_reader(), or a pair the refit's thread must read (take(): left as the
  /// iterator's current pair, next() reads it and the pairs after it).
  void read_rest() noexcept {
    try {
      py::gil_scoped_acquire gil;
      for (Py_ssize_t n = 1; !stop_.load(std::memory_order_relaxed); ++n) {
        if (n % reader_from == 0) {
          py::gil_scoped_release let_go;
        }
        bool ended = false;
        bool elsewhere = false;
        std::optional<tensor_ref> r;
        try {
          if (iterator_ == py::iterator::sentinel()) {
            ended = true;
          } else {
            r = take(*iterator_, true, elsewhere);
            if (elsewhere)
              r.reset();  // the pair stays the iterator's current one, for next()
            else
              ++iterator_;
          }
        } catch (py::error_already_set& e) {
          fail(std::move(e), true);
        } catch (const py::builtin_exception& e) {
          fail(e, true);
        }
        std::lock_guard lock(mutex_);
        if (r) read_.push_back(std::move(*r));
        if (ended) done_read_ = true;
        // Told before this thread lets go of its Python state (the GIL's release and the state's
        // end run after): the refit's thread need not wait for that. Nothing of this source is
        // touched after.
        if (ended || failed_read_ || elsewhere) {
          finished_ = true;
          return;
        }
      }
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!failed_read_ && !done_read_) {
        failed_read_ = true;
        reader_failure_ = "the tensor source's reader thread failed";
      }
    }
    std::lock_guard lock(mutex_);
    finished_ = true;
  }

  /// next() on the refit's thread, while the reader runs: takes what it has read so far, waiting
  /// for its next pair when there is none yet. Once the reader has finished, what it left (the
  /// iterator's end, a failure, the rest of the pairs) becomes this thread's.
  void take_read() {
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        if (!read_.empty()) {
          ready_.swap(read_);
          read_.clear();
          next_ = 0;
          return;
        }
        if (finished_) {
          if (done_read_) done_ = true;
          if (failed_read_) {
            failed_ = true;
            failure_message_ = reader_failure_;
          }
          break;
        }
      }
      std::this_thread::yield();
    }
    stop_reader();  // finished: returns at once
  }

  /// Keeps a Python exception of the source (GIL held): `on_reader`, under mutex_ for next() to
  /// see; on the refit's thread, directly.
  void fail(py::error_already_set&& e, bool on_reader) {
    std::string message = "the tensor source raised " + describe(e);
    record_failure(std::move(message), std::make_unique<py::error_already_set>(std::move(e)), on_reader);
  }
  void fail(const py::builtin_exception& e, bool on_reader) {
    record_failure(e.what(), std::make_unique<py::error_already_set>(capture(e)), on_reader);
  }
  void record_failure(std::string message, std::unique_ptr<py::error_already_set> kept, bool on_reader) {
    failure_ = std::move(kept);
    if (on_reader) {
      std::lock_guard lock(mutex_);
      reader_failure_ = std::move(message);
      failed_read_ = true;
      return;
    }
    failure_message_ = std::move(message);
    failed_ = true;
  }

  static py::error_already_set capture(const py::builtin_exception& e) {
    e.set_error();
    return py::error_already_set();
  }

  /// What the reader thread takes: a plain torch tensor, or a refit.Shard of one (exactly that type:
  /// its attributes are slots). Reading anything else (a tensor subclass, a DLPack array, another
  /// Shard-like object) may run Python that depends on the calling thread's state (torch's
  /// function modes, its device).
  static bool reader_takes(py::handle value) {
    if (world().is_plain_tensor(value)) return true;
    const package_types& t = package();
    if (!t.shard || Py_TYPE(value.ptr()) != reinterpret_cast<PyTypeObject*>(t.shard.ptr())) return false;
    static const auto* tensor = new py::str("tensor");  // never destroyed: see world()
    PyObject* inner = PyObject_GetAttr(value.ptr(), tensor->ptr());
    if (inner == nullptr) {
      PyErr_Clear();  // the refit's thread reads it again, and raises
      return false;
    }
    const bool plain = world().is_plain_tensor(inner);
    Py_DECREF(inner);
    return plain;
  }

  /// A refit.Shard (exactly, as the package registered it), or any object that says it is one
  /// (`__refit_shard__`); a plain tensor is neither, without looking at its attributes.
  static bool is_shard(py::handle value) {
    if (world().is_plain_tensor(value)) return false;
    const package_types& t = package();
    if (t.shard && Py_TYPE(value.ptr()) == reinterpret_cast<PyTypeObject*>(t.shard.ptr())) return true;
    return has_attr(value, t.shard_marker);
  }

  [[nodiscard]] bool known_stream(int index) const {
    return given_stream_ != nullptr || index == last_device_ || streams_.contains(index);
  }

  void* stream_of(int index) {
    if (given_stream_ != nullptr) return given_stream_;
    if (index == last_device_) return last_stream_;  // a model's tensors share one device
    const auto it = streams_.find(index);
    void* s = it != streams_.end() ? it->second : streams_.emplace(index, world().current_stream(index)).first->second;
    last_device_ = index;
    last_stream_ = s;
    return s;
  }

  [[maybe_unused]] int default_device_;
  void* given_stream_ = nullptr;
  std::unordered_map<int, void*> streams_;  ///< torch's current stream per device, read once per refit
  int last_device_ = -1;
  void* last_stream_ = nullptr;
  std::vector<py::object> keep_;
  py::iterator iterator_;
  std::size_t ahead_ = 1;
  std::size_t visit_ = 1;  ///< pairs the next visit reads
  std::vector<tensor_ref> ready_;
  std::size_t next_ = 0;
  bool done_ = false;
  bool failed_ = false;
  std::string failure_message_;
  std::unique_ptr<py::error_already_set> failure_;

  // The reader thread and what it hands over (under mutex_).
  bool first_taken_ = false;  ///< the first pair read here is one the reader takes (reader_takes())
  bool posted_ = false;       ///< the reader has this source's job: next() takes from it (until stop_reader())
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::vector<tensor_ref> read_;
  bool done_read_ = false;
  bool failed_read_ = false;
  bool finished_ = false;
  std::string reader_failure_;
};

/// What a streamer made with transport="auto" runs on: cuda_ipc for tensors on a GPU of this
/// host, host_shm otherwise (nccl only when asked: it needs a communicator between the processes'
/// GPUs, which "auto" cannot know the trainer wants). Throws, saying what would work, when the
/// tensors are on a GPU and this build has no CUDA.
transport_kind choose_transport(const std::optional<device>& first) {
  if (!first || first->kind != device_kind::cuda) return transport_kind::host_shm;
  if (has_transport(transport_kind::cuda_ipc)) return transport_kind::cuda_ipc;
  throw error(errc::invalid_argument,
              "the tensors are on cuda:" + std::to_string(first->index) +
                  ", but this refit was built without CUDA, so it can only send CPU tensors (host_shm): install a "
                  "build with CUDA (README.md, Install: -Csetup-args=-Dcuda=enabled), or move the tensors to the CPU");
}

class py_streamer {
 public:
  /// `automatic`: the transport is chosen at the first refit, from its first tensor's device
  /// (choose_transport), and the C++ streamer made then.
  py_streamer(streamer_options o, bool automatic) : device_(o.device), options_(std::move(o)), automatic_(automatic) {
    if (!automatic_) make();
  }
  ~py_streamer() { close(); }

  void close() {
    closed_ = true;
    if (!st_ && !reader_) return;
    std::unique_ptr<streamer> st = std::move(st_);
    forget_foreign_reader();
    std::unique_ptr<reader_thread> reader = std::move(reader_);
    py::gil_scoped_release nogil;  // BYE waits up to 1 s for a reply; the reader's end is joined
    st.reset();
    reader.reset();
  }

  /// streamer::announce: `hold` in seconds (at most 10); how many receivers were told.
  std::size_t announce(double hold) {
    if (closed_) throw error(errc::invalid_argument, "this refit.Streamer is closed");
    if (!(hold >= 0) || hold > 10)
      throw error(errc::invalid_argument,
                  "announce(hold=" + std::string(py::str(py::float_(hold))) +
                      "): hold is in seconds, from 0 to 10 (a receiver waits spinning for that long at most)");
    if (!st_) return 0;
    return st_->announce(std::chrono::milliseconds(static_cast<std::int64_t>(hold * 1000 + 0.5)));
  }

  /// streamer::add_receiver; before transport="auto" made the streamer, the list it will be made with.
  void add_receiver(const std::string& endpoint) {
    if (closed_) throw error(errc::invalid_argument, "this refit.Streamer is closed");
    if (st_) {
      py::gil_scoped_release nogil;
      st_->add_receiver(endpoint);
      return;
    }
    std::vector<std::string> list = receivers();
    if (std::ranges::find(list, endpoint) != list.end())
      throw error(errc::invalid_argument, "add_receiver(" + endpoint + "): that receiver is served already");
    list.push_back(endpoint);
    options_.receivers = std::move(list);
  }

  /// streamer::remove_receiver (BYE waits up to 1 s for its reply, without the GIL).
  void remove_receiver(const std::string& endpoint) {
    if (closed_) throw error(errc::invalid_argument, "this refit.Streamer is closed");
    if (st_) {
      py::gil_scoped_release nogil;
      st_->remove_receiver(endpoint);
      return;
    }
    std::vector<std::string> list = receivers();
    const auto it = std::ranges::find(list, endpoint);
    if (it == list.end())
      throw error(errc::invalid_argument, "remove_receiver(" + endpoint + "): no such receiver is served");
    if (list.size() == 1)
      throw error(errc::invalid_argument,
                  "remove_receiver(" + endpoint + "): it is the last receiver; close() the streamer instead");
    list.erase(it);
    options_.receivers = std::move(list);
    options_.endpoint = options_.receivers.front();
  }

  /// The endpoints the next version goes to.
  std::vector<std::string> receivers() const {
    if (st_) return st_->receivers();
    return options_.receivers.empty() ? std::vector<std::string>{options_.endpoint} : options_.receivers;
  }

  /// The transport in use: the one given, or the one "auto" chose (None before the first refit).
  std::optional<std::string> transport() const {
    if (automatic_ && !st_ && !chosen_) return std::nullopt;
    return std::string(to_string(options_.transport));
  }

  refit_stats refit(std::uint64_t version, const py::object& tensors, const py::object& stream, bool subset) {
    if (closed_) throw error(errc::invalid_argument, "this refit.Streamer is closed");
    python_tensors source(stream, device_);
    // Containers (a state_dict, a list of pairs) are read while the streamer moves the bytes of
    // the tensors before: by the streamer's reader thread (below) from python_tensors::reader_from
    // pairs, else 64 pairs per visit under the GIL.
    // "items" is asked once, by an interned name (a list of pairs makes no AttributeError).
    static const auto* items = new py::str("items");  // never destroyed: see world()
    const bool mapping = has_attr(tensors, *items);
    const bool container = mapping || PyList_Check(tensors.ptr()) || PyTuple_Check(tensors.ptr());
    const py::object pairs = mapping ? tensors.attr(*items)() : tensors;
    // The reader thread takes a dict (an OrderedDict: what state_dict() returns), a list or a
    // tuple, exactly those types, whose iteration runs no Python of the caller's: a Mapping of
    // the caller's may gather each tensor as it is asked for, on the calling thread's device and
    // stream, so it is read on that thread.
    static const auto* ordered = new py::object(py::module_::import("collections").attr("OrderedDict"));
    PyObject* const t = tensors.ptr();
    const bool builtin = PyDict_CheckExact(t) || PyList_CheckExact(t) || PyTuple_CheckExact(t) ||
                         Py_TYPE(t) == reinterpret_cast<PyTypeObject*>(ordered->ptr());
    const Py_ssize_t count = builtin ? PyObject_Length(t) : 0;
    source.pull_from(py::iter(pairs), container ? 64 : 1);
    if (!st_) choose(source);
    streamer& s = *st_;
    if (count >= python_tensors::reader_from) {
      try {
        forget_foreign_reader();
        if (!reader_) reader_ = std::make_unique<reader_thread>();
        source.start_reader(count, *reader_);
      } catch (const std::system_error&) {
        // No thread to be had: the refit's thread reads the pairs.
      }
    }
    try {
      refit_stats stats;
      {
        py::gil_scoped_release nogil;
        // Joined here, without the GIL, whether the refit returns or throws.
        struct join_reader {
          python_tensors& source;
          ~join_reader() { source.stop_reader(); }
        } joined{source};
        stats = s.refit(version, source, subset ? refit_scope::subset : refit_scope::whole);
      }
      source.release();
      return stats;
    } catch (const error&) {
      source.raise_source_failure();
      throw;
    }
  }

 private:
  /// In a child forked since the reader was made: that reader is the parent's, and is left as it
  /// is (reader_thread); the child makes its own when it needs one.
  void forget_foreign_reader() noexcept {
    if (reader_ && !reader_->owned()) (void)reader_.release();
  }

  void make() {
    streamer_options o = options_;
    try {
      py::gil_scoped_release nogil;  // creates the buffers
      st_ = std::make_unique<streamer>(std::move(o));
    } catch (const error& e) {
      // The C++ message says what failed (cudaGetDevice: no driver); a Python user also needs to
      // hear which transport would work.
      if (options_.transport == transport_kind::cuda_ipc && e.code() == errc::cuda)
        throw error(e.code(), std::string(e.what()) +
                                  "; transport='cuda_ipc' needs a working CUDA device on this host: for CPU tensors "
                                  "(or on a machine without a GPU) use transport='host_shm', or transport='auto', "
                                  "which picks it");
      throw;
    }
  }

  /// transport="auto" at the first refit: looks at the first tensor, then makes the streamer.
  void choose(python_tensors& source) {
    options_.transport = choose_transport(source.first_device());
    chosen_ = true;
    const std::string why = options_.transport == transport_kind::cuda_ipc ? "the tensors are on a GPU of this host"
                                                                           : "the tensors are in host memory";
    py::module_::import("logging").attr("getLogger")("refit").attr("info")("refit.Streamer(transport='auto'): using " +
                                                                           std::string(to_string(options_.transport)) +
                                                                           " (" + why + "); pass transport= to choose");
    make();
  }

  std::unique_ptr<streamer> st_;
  std::unique_ptr<reader_thread> reader_;  ///< reads large containers; made by the first refit of one
  int device_ = 0;
  streamer_options options_;
  bool automatic_ = false;
  bool chosen_ = false;
  bool closed_ = false;
};

streamer_options streamer_options_from(std::string endpoint, const std::string& transport,
                                       std::optional<std::vector<std::string>> receivers, std::uint64_t buffer_bytes,
                                       std::size_t buffers, bool direct, double timeout,
                                       std::optional<std::string> token, int device, const py::object& curve,
                                       std::uint64_t alignment, bool keep_whole, const std::string& engine,
                                       const std::string& layout, bool delta, const std::string& delta_memory_name,
                                       std::uint64_t delta_max_bytes, std::size_t delta_threads,
                                       std::uint64_t delta_batch_bytes, std::size_t group_rank, std::size_t group_size,
                                       bool share_tensors, bool control_lane, bool nccl_twin, bool atomic) {
  streamer_options o;
  o.atomic = atomic;
  o.share_tensors = share_tensors;
  o.control_lane = control_lane;
  o.nccl_twin = nccl_twin;
  o.group_rank = group_rank;
  o.group_size = group_size;
  o.delta.enable = delta;
  if (delta_memory_name == "host")
    o.delta.memory = delta_memory::host;
  else if (delta_memory_name == "device")
    o.delta.memory = delta_memory::device;
  else
    throw py::value_error("delta_memory must be 'host' or 'device'; got '" + delta_memory_name + "'");
  o.delta.max_bytes = delta_max_bytes;
  o.delta.threads = delta_threads;
  o.delta.batch_bytes = delta_batch_bytes;
  o.layout = layout;
  o.endpoint = std::move(endpoint);
  if (transport != "auto") {
    const auto t = parse_transport(transport);
    if (!t)
      throw py::value_error("transport must be 'auto', 'host_shm', 'cuda_ipc' or 'nccl'; got '" + transport + "'");
    o.transport = *t;
  }
  if (receivers) o.receivers = std::move(*receivers);
  o.buffer_bytes = buffer_bytes;
  o.buffer_count = buffers;
  o.direct = direct;
  o.timeout = to_deadline(timeout, "timeout");
  o.token = token.value_or("");
  o.device = device;
  o.curve = to_curve(curve);
  o.alignment = alignment;
  o.keep_whole = keep_whole;
  const auto e = parse_copy_engine(engine);
  if (!e)
    throw py::value_error("engine must be one of automatic, kernel, memcpy_batch, memcpy_each; got '" + engine + "'");
  o.engine = *e;
  return o;
}

// ------------------------------------------------------------------------------- errors

/// Whether `s` is "path/file.ext:LINE" with a C++ or CUDA source's extension.
bool is_source_location(std::string_view s) {
  const auto colon = s.rfind(':');
  if (colon == std::string_view::npos || colon + 1 == s.size() || s.find(' ') != std::string_view::npos) return false;
  if (!std::all_of(s.begin() + static_cast<std::ptrdiff_t>(colon) + 1, s.end(),
                   [](char c) { return c >= '0' && c <= '9'; }))
    return false;
  const std::string_view file = s.substr(0, colon);
  return file.ends_with(".hpp") || file.ends_with(".cpp") || file.ends_with(".cu") || file.ends_with(".h") ||
         file.ends_with(".cuh");
}

/// Drops " (../lib/copy/cuda_check.hpp:40)": where in refit's sources an error was raised means
/// nothing to a Python user (C++ callers keep it: check_cuda adds it for them).
std::string without_source_locations(std::string m) {
  for (std::size_t open = m.find(" ("); open != std::string::npos; open = m.find(" (", open)) {
    const std::size_t close = m.find(')', open);
    if (close == std::string::npos) break;
    if (is_source_location(std::string_view(m).substr(open + 2, close - open - 2)))
      m.erase(open, close - open + 1);
    else
      open += 2;
  }
  return m;
}

void replace_all(std::string& m, std::string_view from, std::string_view to) {
  for (auto at = m.find(from); at != std::string::npos; at = m.find(from, at + to.size()))
    m.replace(at, from.size(), to);
}

/// A C++ error's message as a Python user reads it: the binding's names for what C++ calls
/// options and functions, and the hint a Python caller needs. Returns the code to raise with:
/// a receiver whose process ended is a dead peer, not a deadline (see the last case).
errc for_python(errc code, std::string& m) {
  m = without_source_locations(std::move(m));
  replace_all(m, "(or options.token)", "(or token= of refit.Receiver and refit.Streamer)");
  replace_all(m, "register parameters (add_parameter) or a callback (on_batch) first",
              "register parameters (rx.add_parameter / rx.add_parameters) or a callback (rx.on_tensor / rx.on_batch) "
              "before the trainer's first refit");
  replace_all(m, "applies through a callback (on_batch); use one sink or the other",
              "applies through a callback (on_tensor / on_batch); use one sink or the other");
  if (code == errc::invalid_argument && m.starts_with("add_parameter: '") && m.ends_with("' is already registered"))
    m += ": add_parameters() registers every tensor it is given, so a second call registers them again; to "
         "register a new table call rx.clear_parameters() first";
  if (m.find("is not built into this refit") != std::string::npos)
    m += ". In Python, transport='auto' (the default) picks a transport this build has; README.md, Install, says "
         "how to build the package with CUDA and NCCL";
  if (code == errc::incomplete && m.find(" registered tensors") != std::string::npos)
    m += ". If the trainer sends only some of the engine's tensors on purpose (LoRA adapters, the ones that "
         "changed), call st.refit(version, tensors, subset=True)";
  // The control lane saw the receiver's process end: retrying will not help, and code that
  // retries on RefitTimeout would retry a dead engine. (The C++ streamer reports errc::timeout.)
  if (code == errc::timeout && m.find("process ended before it answered") != std::string::npos) {
    m += " (the engine's process died: start a new one; this is Errc.peer, not a timeout)";
    return errc::peer;
  }
  return code;
}

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const error& e) {
    const package_types& t = package();
    if (!t.refit_error) {  // the module imported on its own, without the refit package
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return;
    }
    std::string message = e.what();
    const errc code = for_python(e.code(), message);
    const py::object& cls = code == errc::timeout ? t.refit_timeout : t.refit_error;
    const py::object exc = cls(message, static_cast<int>(code));
    PyErr_SetObject(cls.ptr(), exc.ptr());
  }
}

template <typename T>
std::string stats_repr(const char* name, const T& s) {
  return std::string(name) + "(version=" + std::to_string(s.version) + ", tensors=" + std::to_string(s.tensors) +
         ", bytes=" + std::to_string(s.bytes) + ", batches=" + std::to_string(s.batches) +
         ", seconds=" + std::to_string(s.seconds) + ")";
}

}  // namespace
}  // namespace refit::python

// Longer than 60 lines on purpose: a declarative table, one .def per Python name, with no control
// flow to hold in one's head; the logic it binds lives in the functions above.
PYBIND11_MODULE(_refit, m) {
  using namespace refit;
  using namespace refit::python;
  namespace py = pybind11;
  m.doc() = "refit's native core (use the refit package, not this module)";
  m.attr("__version__") = REFIT_PY_VERSION;

  py::class_<dropped_receiver>(m, "DroppedReceiver",
                               "A receiver a version dropped (on_receiver_failure='drop'): its endpoint, the error "
                               "code (an int of Errc) and the reason.")
      .def_readonly("endpoint", &dropped_receiver::endpoint)
      .def_property_readonly("code", [](const dropped_receiver& d) { return static_cast<int>(d.code); })
      .def_readonly("reason", &dropped_receiver::reason)
      .def("__repr__", [](const dropped_receiver& d) {
        return "DroppedReceiver(endpoint=" + std::string(py::repr(py::str(d.endpoint))) +
               ", code=" + std::string(to_string(d.code)) + ")";
      });
  py::class_<refit_stats>(m, "RefitStats", "Figures of one refit, as the streamer saw it.")
      .def_readonly("version", &refit_stats::version)
      .def_readonly("tensors", &refit_stats::tensors)
      .def_readonly("bytes", &refit_stats::bytes)
      .def_readonly("batches", &refit_stats::batches)
      .def_readonly("seconds", &refit_stats::seconds, "BEGIN to END's reply")
      .def_readonly("source_seconds", &refit_stats::source_seconds, "in the tensor source (a generator's gathers)")
      .def_readonly("pack_seconds", &refit_stats::pack_seconds)
      .def_readonly("wait_seconds", &refit_stats::wait_seconds)
      .def_readonly("direct", &refit_stats::direct,
                    "written straight into the receiver's weights (or its device stage)")
      .def_readonly("shared_bytes", &refit_stats::shared_bytes,
                    "bytes the receiver read where they are in the streamer's memory (share_tensors)")
      .def_readonly("parts_bytes", &refit_stats::parts_bytes,
                    "nccl in place to receivers of views (TP shards, fused tensors): the bytes sent, every "
                    "receiver's parts together; 0 otherwise")
      .def_readonly("control_lane", &refit_stats::control_lane,
                    "the requests went through each receiver's shared-memory control lane, not ZeroMQ")
      .def_readonly("subset", &refit_stats::subset, "sent as a subset (subset=True, or a delta)")
      .def_readonly("delta", &refit_stats::delta, "sent as patches against version `base`")
      .def_readonly("base", &refit_stats::base, "the delta's base version")
      .def_readonly("dropped", &refit_stats::dropped,
                    "the receivers this version dropped (on_receiver_failure='drop'), a list of DroppedReceiver")
      .def_readonly("whole_after_refusal", &refit_stats::whole_after_refusal,
                    "a receiver refused the delta (it did not hold the base): sent whole")
      .def_readonly("tensor_bytes", &refit_stats::tensor_bytes, "bytes of the tensors given (bytes: what moved)")
      .def_readonly("elements", &refit_stats::elements, "elements compared with the base (delta)")
      .def_readonly("changed", &refit_stats::changed, "elements that differed from the base (delta)")
      .def_readonly("base_bytes", &refit_stats::base_bytes, "memory of the streamer's base")
      .def_readonly("diff_seconds", &refit_stats::diff_seconds, "comparing with and updating the base")
      .def_readonly("commit_seconds", &refit_stats::commit_seconds,
                    "an engine-wide version (atomic=True): COMMIT's round trip, every receiver prepared to every "
                    "receiver committed")
      .def("__repr__", [](const refit_stats& s) { return stats_repr("RefitStats", s); });

  py::class_<receiver_stats>(m, "ReceiverStats", "Figures of the last refit a receiver committed.")
      .def_readonly("version", &receiver_stats::version)
      .def_readonly("tensors", &receiver_stats::tensors)
      .def_readonly("bytes", &receiver_stats::bytes)
      .def_readonly("batches", &receiver_stats::batches)
      .def_readonly("seconds", &receiver_stats::seconds)
      .def_readonly("apply_seconds", &receiver_stats::apply_seconds)
      .def_readonly("drain_seconds", &receiver_stats::drain_seconds)
      .def_readonly("pause_seconds", &receiver_stats::pause_seconds,
                    "staged: apply()'s copy of the stage into the weights (the engine's pause)")
      .def("__repr__", [](const receiver_stats& s) { return stats_repr("ReceiverStats", s); });

  py::class_<view>(m, "View", "One entry of a batch: a whole tensor or a byte range (chunk) of one.")
      .def_property_readonly("name", [](const view& v) { return v.meta.name; })
      .def_property_readonly(
          "offset", [](const view& v) { return v.offset; }, "first byte of the range in the tensor")
      .def_property_readonly("nbytes", [](const view& v) { return v.bytes; })
      .def_property_readonly(
          "total", [](const view& v) { return v.total; }, "bytes of the whole tensor")
      .def_property_readonly("whole", &view::whole)
      .def_property_readonly("last", &view::last)
      .def_property_readonly("shape", [](const view& v) { return py::tuple(py::cast(v.meta.shape)); })
      .def_property_readonly("dtype", [](const view& v) { return world().python_dtype(v.meta.type); })
      .def_property_readonly("tensor", &view::get_tensor,
                             "the bytes as a tensor (typed and shaped when whole, flat uint8 for a chunk)")
      .def("__repr__", [](const view& v) {
        return "View('" + v.meta.name + "', offset=" + std::to_string(v.offset) +
               ", nbytes=" + std::to_string(v.bytes) + ", total=" + std::to_string(v.total) + ")";
      });

  py::class_<py_receiver>(m, "Receiver")
      .def(py::init<std::optional<std::string>, int, double, std::optional<std::string>, py::object, std::string,
                    std::string, std::size_t, std::size_t, bool, bool, std::string, std::uint64_t>(),
           py::arg("endpoint") = py::none(), py::kw_only(), py::arg("device") = 0, py::arg("idle_timeout") = 60.0,
           py::arg("token") = py::none(), py::arg("curve") = py::none(), py::arg("engine") = "automatic",
           py::arg("layout") = "", py::arg("streamers") = 1, py::arg("delta_threads") = 0,
           py::arg("control_lane") = true, py::arg("allow_insecure_tcp") = false, py::arg("stage") = "none",
           py::arg("stage_bytes") = 0)
      .def_property_readonly("endpoint", &py_receiver::endpoint)
      .def_property_readonly("endpoints", &py_receiver::endpoints)
      .def_property_readonly("device", &py_receiver::device)
      .def("add_parameter", &py_receiver::add_parameter, py::arg("name"), py::arg("tensor"),
           py::arg("source_slice") = py::none(), py::kw_only(), py::arg("scale") = py::none(),
           py::arg("quant") = py::none(), py::arg("dtype") = py::none(), py::arg("scale_2") = py::none(),
           py::arg("scale_layout") = "row_major")
      .def("clear_parameters", &py_receiver::clear_parameters)
      .def("_on_batch", &py_receiver::on_batch, py::arg("fn"), py::arg("what") = "on_batch")
      .def("_on_begin", &py_receiver::on_begin, py::arg("fn"))
      .def("_on_commit", &py_receiver::on_commit, py::arg("fn"))
      .def("_on_abort", &py_receiver::on_abort, py::arg("fn"))
      .def("_on_prepared", &py_receiver::on_prepared, py::arg("fn"))
      .def("_apply_prepared", &py_receiver::apply_prepared, py::arg("stream") = std::uintptr_t{0})
      .def_property_readonly("prepared_version", &py_receiver::prepared_version)
      .def_property_readonly("stage", &py_receiver::stage)
      .def("serve_one", &py_receiver::serve_one, py::arg("timeout") = 0.1)
      .def("_serve", &py_receiver::serve, py::arg("stop"), py::arg("poll"))
      .def_property_readonly("committed_version", &py_receiver::committed_version)
      .def_property_readonly("dirty", &py_receiver::dirty)
      .def_property_readonly("poisoned", &py_receiver::poisoned)
      .def_property_readonly("last_stats", &py_receiver::last_stats)
      .def_property_readonly("last_error", &py_receiver::last_error)
      .def("close", &py_receiver::close);

  py::class_<py_streamer>(m, "Streamer")
      .def(py::init([](std::string endpoint, const std::string& transport,
                       std::optional<std::vector<std::string>> receivers, std::uint64_t buffer_bytes,
                       std::size_t buffers, bool direct, double timeout, std::optional<std::string> token, int device,
                       const py::object& curve, std::uint64_t alignment, bool keep_whole, const std::string& engine,
                       const std::string& layout, bool delta, const std::string& delta_memory_name,
                       std::uint64_t delta_max_bytes, std::size_t delta_threads, std::uint64_t delta_batch_bytes,
                       std::size_t group_rank, std::size_t group_size, bool share_tensors, bool control_lane,
                       bool nccl_twin, bool atomic, const std::string& on_receiver_failure, std::size_t min_receivers,
                       bool rejoin, std::optional<std::vector<std::vector<std::string>>> receiver_groups) {
             streamer_options o = streamer_options_from(
                 std::move(endpoint), transport, std::move(receivers), buffer_bytes, buffers, direct, timeout,
                 std::move(token), device, curve, alignment, keep_whole, engine, layout, delta, delta_memory_name,
                 delta_max_bytes, delta_threads, delta_batch_bytes, group_rank, group_size, share_tensors, control_lane,
                 nccl_twin, atomic);
             if (on_receiver_failure == "drop")
               o.on_receiver_failure = receiver_failure::drop;
             else if (on_receiver_failure != "fail")
               throw py::value_error("on_receiver_failure must be 'fail' or 'drop'; got '" + on_receiver_failure + "'");
             o.min_receivers = min_receivers;
             o.rejoin = rejoin;
             if (receiver_groups) o.receiver_groups = std::move(*receiver_groups);
             return std::make_unique<py_streamer>(std::move(o), transport == "auto");
           }),
           py::arg("endpoint"), py::kw_only(), py::arg("transport") = "auto", py::arg("receivers") = py::none(),
           py::arg("buffer_bytes") = std::uint64_t{256} << 20, py::arg("buffers") = 2, py::arg("direct") = true,
           py::arg("timeout") = 30.0, py::arg("token") = py::none(), py::arg("device") = 0,
           py::arg("curve") = py::none(), py::arg("alignment") = 256, py::arg("keep_whole") = true,
           py::arg("engine") = "automatic", py::arg("layout") = "", py::arg("delta") = false,
           py::arg("delta_memory") = "host", py::arg("delta_max_bytes") = std::uint64_t{64} << 30,
           py::arg("delta_threads") = 0, py::arg("delta_batch_bytes") = 0, py::arg("group_rank") = 0,
           py::arg("group_size") = 1, py::arg("share_tensors") = true, py::arg("control_lane") = true,
           py::arg("nccl_twin") = false, py::arg("atomic") = false, py::arg("on_receiver_failure") = "fail",
           py::arg("min_receivers") = 1, py::arg("rejoin") = false, py::arg("receiver_groups") = py::none())
      .def_property_readonly("transport", &py_streamer::transport,
                             "the transport in use: the one given, or the one transport='auto' chose at the first "
                             "refit (None before it)")
      .def("refit", &py_streamer::refit, py::arg("version"), py::arg("tensors"), py::kw_only(),
           py::arg("stream") = py::none(), py::arg("subset") = false)
      .def("announce", &py_streamer::announce, py::arg("hold") = 1.0)
      .def("add_receiver", &py_streamer::add_receiver, py::arg("endpoint"))
      .def("remove_receiver", &py_streamer::remove_receiver, py::arg("endpoint"))
      .def_property_readonly("receivers", &py_streamer::receivers)
      .def("close", &py_streamer::close);

  // Which NCCL the nccl transport loads (include/refit/nccl.hpp); refit/__init__.py prefers torch's.
  m.def("nccl_library", [] {
    const nccl_library_info i = refit::nccl_library();
    py::dict d;
    d["available"] = i.available;
    d["path"] = i.path;
    d["version"] = i.version;
    d["chosen_by"] = i.chosen_by;
    d["error"] = i.error;
    return d;
  });
  m.def("use_nccl_library", &refit::use_nccl_library, py::arg("path"));
  m.def("_prefer_nccl_library", &refit::prefer_nccl_library, py::arg("path"));
  m.def("_set_error_types", [](py::object refit_error, py::object refit_timeout) {
    package().refit_error = std::move(refit_error);
    package().refit_timeout = std::move(refit_timeout);
  });
  m.def("_set_shard_type", [](py::object shard) {
    if (!PyType_Check(shard.ptr())) throw py::type_error("_set_shard_type() takes a class");
    package().shard = std::move(shard);
  });
  // For the tests: a C++ message and code as refit.RefitError will carry them (translate()).
  m.def("_python_message", [](int code, std::string message) {
    const errc c = for_python(static_cast<errc>(code), message);
    return py::make_tuple(static_cast<int>(c), message);
  });
  py::register_exception_translator(&translate);
}
