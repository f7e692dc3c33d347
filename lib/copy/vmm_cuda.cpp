// refit — VMM memory shared as file descriptors. See vmm.hpp.
#include "copy/vmm.hpp"

#include <cuda.h>  // types and enums only: the functions come through driver_entry
#include <fmt/format.h>

#include <utility>

#include "copy/cuda_check.hpp"
#include "copy/driver.hpp"
#include "refit/error.hpp"

namespace refit::copy::vmm {
namespace {

/// The driver functions this file calls, looked up once (any of them null: no VMM here).
struct driver {
  decltype(&::cuPointerGetAttribute) get_attribute = driver_entry<decltype(get_attribute)>("cuPointerGetAttribute");
  decltype(&::cuMemRetainAllocationHandle) retain = driver_entry<decltype(retain)>("cuMemRetainAllocationHandle");
  decltype(&::cuMemExportToShareableHandle) export_handle =
      driver_entry<decltype(export_handle)>("cuMemExportToShareableHandle");
  decltype(&::cuMemImportFromShareableHandle) import_handle =
      driver_entry<decltype(import_handle)>("cuMemImportFromShareableHandle");
  decltype(&::cuMemRelease) release = driver_entry<decltype(release)>("cuMemRelease");
  decltype(&::cuMemCreate) create = driver_entry<decltype(create)>("cuMemCreate");
  decltype(&::cuMemAddressReserve) reserve = driver_entry<decltype(reserve)>("cuMemAddressReserve");
  decltype(&::cuMemAddressFree) address_free = driver_entry<decltype(address_free)>("cuMemAddressFree");
  decltype(&::cuMemMap) map = driver_entry<decltype(map)>("cuMemMap");
  decltype(&::cuMemUnmap) unmap = driver_entry<decltype(unmap)>("cuMemUnmap");
  decltype(&::cuMemSetAccess) set_access = driver_entry<decltype(set_access)>("cuMemSetAccess");
  decltype(&::cuMemGetAllocationGranularity) get_granularity =
      driver_entry<decltype(get_granularity)>("cuMemGetAllocationGranularity");

  [[nodiscard]] bool complete() const noexcept {
    return get_attribute && retain && export_handle && import_handle && release && create && reserve && address_free &&
           map && unmap && set_access && get_granularity;
  }
};

const driver& api() {
  static const driver d;
  return d;
}

/// The driver, or refit::error(errc::transport) saying it lacks the VMM API.
const driver& need_api() {
  const driver& d = api();
  if (!d.complete())
    throw error(errc::transport,
                "the CUDA driver lacks the virtual memory API (cuMemMap and friends): cannot map "
                "the peer's VMM memory");
  return d;
}

CUmemAllocationProp device_prop(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

/// Read and write access for `device` (cuMemSetAccess).
CUmemAccessDesc read_write(int device) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return access;
}

/// Reads a pointer attribute of `p` into an integer; false when the driver cannot say.
template <typename T>
bool attribute(const driver& d, CUpointer_attribute what, const void* p, T& out) noexcept {
  unsigned long long v = 0;  // wide enough for each attribute asked here
  if (d.get_attribute(&v, what, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) return false;
  out = static_cast<T>(v);
  return true;
}

std::string driver_error(CUresult r) { return fmt::format("CUresult {}", static_cast<int>(r)); }

}  // namespace

std::optional<std::vector<chunk>> chunks_of(const void* p, std::uint64_t bytes, int device) noexcept {
  try {
    const driver& d = api();
    if (!d.complete() || bytes == 0) return std::nullopt;
    on_device guard(device);
    std::vector<chunk> out;
    const auto first = reinterpret_cast<std::uintptr_t>(p);
    const std::uintptr_t end = first + bytes;
    for (std::uintptr_t at = first; at < end;) {
      const auto* q = reinterpret_cast<const void*>(at);
      std::uint64_t types = 0;
      chunk c;
      if (!attribute(d, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, q, types) ||
          (types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0 ||
          !attribute(d, CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, q, c.base) ||
          !attribute(d, CU_POINTER_ATTRIBUTE_MAPPING_SIZE, q, c.bytes) ||
          !attribute(d, CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID, q, c.id))
        return std::nullopt;
      if (c.bytes == 0 || c.base > at || at - c.base >= c.bytes) return std::nullopt;  // not what VMM says
      out.push_back(c);
      at = c.base + c.bytes;
    }
    return out;
  } catch (...) {
    return std::nullopt;
  }
}

int export_fd(std::uintptr_t base, int device) noexcept {
  try {
    const driver& d = api();
    if (!d.complete()) return -1;
    on_device guard(device);
    CUmemGenericAllocationHandle h{};
    if (d.retain(&h, reinterpret_cast<void*>(base)) != CUDA_SUCCESS) return -1;
    int fd = -1;
    const CUresult r = d.export_handle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    (void)d.release(h);  // the retain's reference: the mapping keeps its own
    return r == CUDA_SUCCESS ? fd : -1;
  } catch (...) {
    return -1;
  }
}

mapping::mapping(std::span<const int> fds, std::span<const std::uint64_t> bytes, int device) : device_(device) {
  const driver& d = need_api();
  if (fds.size() != bytes.size() || fds.empty())
    throw error(errc::internal, "vmm::mapping: one size per descriptor, at least one");
  std::uint64_t total = 0;
  for (const std::uint64_t b : bytes) {
    if (b == 0 || __builtin_add_overflow(total, b, &total))
      throw error(errc::transport, "a VMM chunk of the peer has no size, or the chunks overflow the address space");
  }
  on_device guard(device);
  CUdeviceptr base = 0;
  if (const CUresult r = d.reserve(&base, total, 0, 0, 0); r != CUDA_SUCCESS)
    throw error(errc::transport,
                fmt::format("cuMemAddressReserve of {} bytes for the peer's VMM memory: {}", total, driver_error(r)));
  base_ = base;
  bytes_ = total;
  for (std::size_t i = 0; i < fds.size(); ++i) {
    CUmemGenericAllocationHandle h{};
    CUresult r = d.import_handle(&h, reinterpret_cast<void*>(static_cast<std::intptr_t>(fds[i])),
                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r == CUDA_SUCCESS) {
      r = d.map(base_ + mapped_, bytes[i], 0, h, 0);
      (void)d.release(h);  // the mapping holds the allocation from here on
    }
    if (r != CUDA_SUCCESS) {
      release();
      throw error(errc::transport, fmt::format("cannot import or map chunk {} of {} ({} bytes) of the peer's VMM "
                                               "memory: {} (a size the chunk does not have, or another device?)",
                                               i, fds.size(), bytes[i], driver_error(r)));
    }
    mapped_ += bytes[i];
  }
  const CUmemAccessDesc access = read_write(device);
  if (const CUresult r = d.set_access(base_, total, &access, 1); r != CUDA_SUCCESS) {
    release();
    throw error(errc::transport,
                fmt::format("cuMemSetAccess on the peer's VMM memory for device {}: {}", device, driver_error(r)));
  }
}

mapping::~mapping() { release(); }

mapping::mapping(mapping&& other) noexcept
    : base_(std::exchange(other.base_, 0)),
      bytes_(std::exchange(other.bytes_, 0)),
      mapped_(std::exchange(other.mapped_, 0)),
      device_(other.device_) {}

mapping& mapping::operator=(mapping&& other) noexcept {
  if (this != &other) {
    release();
    base_ = std::exchange(other.base_, 0);
    bytes_ = std::exchange(other.bytes_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
    device_ = other.device_;
  }
  return *this;
}

void mapping::release() noexcept {
  if (base_ == 0) return;
  const driver& d = api();
  if (mapped_ != 0) (void)d.unmap(base_, mapped_);
  (void)d.address_free(base_, bytes_);
  base_ = 0;
  bytes_ = 0;
  mapped_ = 0;
}

std::uint64_t granularity(int device) {
  const driver& d = api();
  if (!d.complete()) throw error(errc::cuda, "the CUDA driver lacks the virtual memory API");
  const CUmemAllocationProp prop = device_prop(device);
  std::size_t g = 0;
  if (const CUresult r = d.get_granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM); r != CUDA_SUCCESS)
    throw error(errc::cuda, fmt::format("cuMemGetAllocationGranularity on device {}: {}", device, driver_error(r)));
  return g;
}

local_chunks::local_chunks(std::size_t count, std::uint64_t chunk_bytes, int device)
    : chunk_(chunk_bytes), device_(device) {
  const driver& d = api();
  if (!d.complete()) throw error(errc::cuda, "the CUDA driver lacks the virtual memory API");
  on_device guard(device);
  bytes_ = count * chunk_bytes;
  CUdeviceptr base = 0;
  if (const CUresult r = d.reserve(&base, bytes_, 0, 0, 0); r != CUDA_SUCCESS)
    throw error(errc::cuda, fmt::format("cuMemAddressReserve: {}", driver_error(r)));
  base_ = base;
  handles_.assign(count, 0);
  for (std::size_t k = 0; k < count; ++k) replace(k);
}

void local_chunks::replace(std::size_t k) {
  const driver& d = api();
  on_device guard(device_);
  const CUdeviceptr at = base_ + k * chunk_;
  if (handles_.at(k) != 0) {
    (void)d.unmap(at, chunk_);
    (void)d.release(handles_[k]);
    handles_[k] = 0;
  }
  const CUmemAllocationProp prop = device_prop(device_);
  CUmemGenericAllocationHandle h{};
  if (const CUresult r = d.create(&h, chunk_, &prop, 0); r != CUDA_SUCCESS)
    throw error(errc::cuda, fmt::format("cuMemCreate of {} bytes: {}", chunk_, driver_error(r)));
  handles_[k] = h;
  if (const CUresult r = d.map(at, chunk_, 0, h, 0); r != CUDA_SUCCESS)
    throw error(errc::cuda, fmt::format("cuMemMap: {}", driver_error(r)));
  const CUmemAccessDesc access = read_write(device_);
  if (const CUresult r = d.set_access(at, chunk_, &access, 1); r != CUDA_SUCCESS)
    throw error(errc::cuda, fmt::format("cuMemSetAccess: {}", driver_error(r)));
}

local_chunks::~local_chunks() {
  const driver& d = api();
  for (std::size_t k = 0; k < handles_.size(); ++k) {
    if (handles_[k] == 0) continue;
    (void)d.unmap(base_ + k * chunk_, chunk_);
    (void)d.release(handles_[k]);
  }
  if (base_ != 0) (void)d.address_free(base_, bytes_);
}

}  // namespace refit::copy::vmm
