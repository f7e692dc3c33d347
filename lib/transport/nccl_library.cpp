// refit — loading NCCL at run time (include/refit/nccl.hpp). refit calls NCCL only through the
// functions of lib/transport/nccl_api.cpp, which look each symbol up here; nothing links
// libnccl, so a process holds exactly one NCCL: the one it named, the one it already loaded
// (torch's), the one the Python package prefers, or the loader's default, in that order.
#include "transport/nccl_library.hpp"

#include <dlfcn.h>
#include <fmt/format.h>
#include <link.h>

#include <array>
#include <climits>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string_view>

#include "config/config.hpp"
#include "model/log.hpp"
#include "refit/error.hpp"

namespace refit::transport {
namespace {

// Every NCCL function refit calls (nccl_api.cpp): a library lacking one is not used.
constexpr std::array required = {
    "ncclGetVersion",     "ncclGetUniqueId",  "ncclCommInitRankConfig", "ncclCommGetAsyncError", "ncclCommAbort",
    "ncclGetErrorString", "ncclGetLastError", "ncclGroupStart",         "ncclGroupEnd",          "ncclBroadcast",
    "ncclSend",           "ncclRecv",         "ncclAllReduce",
};

struct state {
  std::mutex mutex;
  bool tried = false;
  void* handle = nullptr;
  nccl_library_info info;
  std::string named;      ///< use_nccl_library()
  std::string preferred;  ///< prefer_nccl_library()
};

state& the_state() {
  static state s;
  return s;
}

/// The path of a libnccl.so* this process has loaded already, or empty.
std::string loaded_in_process() {
  std::string found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* out) -> int {
        const std::string_view name = info->dlpi_name != nullptr ? info->dlpi_name : "";
        const std::size_t slash = name.rfind('/');
        const std::string_view base = slash == std::string_view::npos ? name : name.substr(slash + 1);
        if (!base.starts_with("libnccl.so")) return 0;
        *static_cast<std::string*>(out) = std::string(name);
        return 1;
      },
      &found);
  return found;
}

/// The real path of the object that holds `symbol` (what dlopen resolved `asked` to).
std::string resolved_path(void* symbol, const std::string& asked) {
  Dl_info info{};
  if (symbol == nullptr || dladdr(symbol, &info) == 0 || info.dli_fname == nullptr) return asked;
  std::array<char, PATH_MAX> real{};
  return realpath(info.dli_fname, real.data()) != nullptr ? std::string(real.data()) : std::string(info.dli_fname);
}

/// Opens `path` and checks it: the library's state on success, an explanation otherwise.
bool open_library(state& s, const std::string& path, const std::string& chosen_by, int flags, std::string& why) {
  dlerror();
  void* h = dlopen(path.c_str(), flags);
  if (h == nullptr) {
    const char* e = dlerror();
    why = fmt::format("cannot load {} ({}): {}", path, chosen_by, e != nullptr ? e : "unknown dlopen error");
    return false;
  }
  for (const char* name : required) {
    if (dlsym(h, name) == nullptr) {
      why = fmt::format("{} ({}) has no {}: it is not NCCL 2.19 or newer", path, chosen_by, name);
      dlclose(h);
      return false;
    }
  }
  int version = 0;
  using get_version = int (*)(int*);  // ncclResult_t is an int-sized enum
  if (reinterpret_cast<get_version>(dlsym(h, "ncclGetVersion"))(&version) != 0 || version <= 0) {
    why = fmt::format("{} ({}): ncclGetVersion failed", path, chosen_by);
    dlclose(h);
    return false;
  }
  s.handle = h;
  s.info.available = true;
  s.info.path = resolved_path(dlsym(h, "ncclGetVersion"), path);
  s.info.version = version;
  s.info.chosen_by = chosen_by;
  s.info.error.clear();
  return true;
}

/// The choice of include/refit/nccl.hpp, made once. Caller holds the mutex.
void load(state& s) {
  if (s.tried) return;
  s.tried = true;
  if (REFIT_HAVE_NCCL == 0) {
    s.info.error = "this librefit was built without NCCL (rebuild with -Dnccl=enabled where nccl.h is installed)";
    return;
  }
  std::string why;
  const char* env = std::getenv("REFIT_NCCL_LIBRARY");
  if (!s.named.empty()) {
    if (!open_library(s, s.named, "use_nccl_library", RTLD_NOW | RTLD_LOCAL, why)) s.info.error = why;
    return;  // named: nothing else is tried
  }
  if (env != nullptr && *env != '\0') {
    if (!open_library(s, env, "REFIT_NCCL_LIBRARY", RTLD_NOW | RTLD_LOCAL, why)) s.info.error = why;
    return;
  }
  if (const std::string loaded = loaded_in_process(); !loaded.empty()) {
    if (open_library(s, loaded, "loaded in this process", RTLD_NOW | RTLD_NOLOAD, why)) return;
  }
  std::string tried;
  const auto attempt = [&](const std::string& path, const char* chosen_by) {
    if (path.empty()) return false;
    if (open_library(s, path, chosen_by, RTLD_NOW | RTLD_LOCAL, why)) return true;
    tried += (tried.empty() ? "" : "; ") + why;
    return false;
  };
  if (attempt(s.preferred, "preferred (the NCCL torch's wheel brings)")) return;
  if (attempt("libnccl.so.2", "the dynamic loader's search path")) return;
  if (attempt(REFIT_NCCL_BUILD_LIBRARY, "the one refit was built against")) return;
  s.info.error = fmt::format(
      "no NCCL could be loaded ({}); install NCCL (libnccl2, or pip's nvidia-nccl-cu12/13 as torch brings), "
      "put its directory on LD_LIBRARY_PATH or name the file in REFIT_NCCL_LIBRARY",
      tried);
}

}  // namespace

void* nccl_symbol(const char* name) noexcept {
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  load(s);
  return s.handle != nullptr ? dlsym(s.handle, name) : nullptr;
}

const nccl_library_info& require_nccl() {
  state& s = the_state();
  std::lock_guard lock(s.mutex);
  load(s);
  if (!s.info.available) throw error(errc::nccl, fmt::format("nccl is unavailable: {}", s.info.error));
  return s.info;
}

std::string nccl_version_text(int version) {
  return fmt::format("{}.{}.{}", version / 10000, version / 100 % 100, version % 100);
}

std::string nccl_mismatch(int mine, const std::string& my_path, int theirs, const std::string& their_path,
                          const std::string& theirs_are) {
  return fmt::format(
      "NCCL versions differ: this process uses NCCL {} ({}), {} NCCL {} ({}); NCCL refuses peers of other "
      "versions. Load the same NCCL on both sides: name it in REFIT_NCCL_LIBRARY (refit-bench: "
      "--nccl-library), or, in Python, import torch in both (refit then uses torch's)",
      nccl_version_text(mine), my_path, theirs_are, nccl_version_text(theirs), their_path);
}

}  // namespace refit::transport

namespace refit {

nccl_library_info nccl_library() {
  transport::state& s = transport::the_state();
  std::lock_guard lock(s.mutex);
  transport::load(s);
  return s.info;
}

void use_nccl_library(const std::string& path) {
  if (path.empty()) throw error(errc::invalid_argument, "use_nccl_library: the path is empty");
  transport::state& s = transport::the_state();
  std::lock_guard lock(s.mutex);
  if (s.tried) {
    if (s.info.available && (s.named == path || s.info.path == path)) return;
    if (s.info.available)
      throw error(errc::invalid_argument,
                  fmt::format("use_nccl_library({}): {} is in use already ({}); name the library before the first "
                              "nccl session, or set REFIT_NCCL_LIBRARY before the process starts",
                              path, describe(s.info), s.info.chosen_by));
    s.tried = false;  // nothing was loaded: try again with this one
  }
  s.named = path;
  transport::load(s);
  if (!s.info.available) {
    const std::string why = s.info.error;
    s.named.clear();
    s.tried = false;
    s.info = {};
    throw error(errc::invalid_argument, fmt::format("use_nccl_library: {}", why));
  }
}

void prefer_nccl_library(const std::string& path) noexcept {
  transport::state& s = transport::the_state();
  std::lock_guard lock(s.mutex);
  if (!s.tried) s.preferred = path;
}

std::string describe(const nccl_library_info& info) {
  if (!info.available) return fmt::format("no NCCL: {}", info.error);
  return fmt::format("NCCL {} ({}, {})", transport::nccl_version_text(info.version), info.path, info.chosen_by);
}

}  // namespace refit
