// kvdiag native allocators: the "cuda" mapping backend (real CUDA virtual memory management).
//
// Contract of this file (pure C++, no Python):
//   Locks:   vmm_lock_ (DeviceVmmLock, flock shared by co-located kvdiag processes) is held for
//            each map/unmap so kvdiag's own processes serialise like the driver does and the fixed
//            allocator can see "another process is mid-VMM". st_mu_ guards the handle table and is
//            never held across a driver call.
//   GIL:     never touched; nothing here calls into Python.
//   Waits:   the device-lock wait is unbounded without a deadline (stock) and bounded with one.
//            The driver calls themselves (cuMemCreate/cuMemMap/...) cannot be bounded.
// Loading:   libcuda.so.1 is opened with dlopen at construction, so the package builds and imports
//            on machines without a GPU; asking for this backend there raises BackendUnavailable.
#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <vector>

#include "backend.hpp"
#include "device.hpp"

namespace kvdiag {

namespace {

// The few driver API types used here, with the driver's ABI (cuda.h, CUDA 11+).
using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUdeviceptr = unsigned long long;
using CUmemGenericAllocationHandle = unsigned long long;
constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;

struct CUmemLocation {
  int type;  // CU_MEM_LOCATION_TYPE_DEVICE = 1
  int id;
};
struct CUmemAllocationProp {
  int type;                  // CU_MEM_ALLOCATION_TYPE_PINNED = 1
  int requestedHandleTypes;  // CU_MEM_HANDLE_TYPE_NONE = 0
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;  // CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
};

struct Driver {
  void* lib = nullptr;
  CUresult (*cuInit)(unsigned int) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;
  CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*, int) = nullptr;
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long) = nullptr;
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long) = nullptr;
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) = nullptr;
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*cuMemGetInfo)(size_t*, size_t*) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;

  template <typename T>
  void sym(T& fn, const char* name, const char* alt = nullptr) {
    void* p = dlsym(lib, name);
    if (!p && alt) p = dlsym(lib, alt);
    if (!p) throw BackendUnavailable(std::string("backend='cuda': libcuda.so.1 lacks ") + name);
    fn = reinterpret_cast<T>(p);
  }

  // Loaded once per process; kept for the process lifetime (the driver cannot be unloaded safely).
  static Driver& get() {
    static Driver* d = [] {
      auto* drv = new Driver();
      drv->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
      if (!drv->lib) {
        const char* err = dlerror();
        std::string msg = std::string("backend='cuda' needs the NVIDIA driver (libcuda.so.1), which could not be loaded: ") +
                          (err ? err : "unknown error") + "; use backend='host' on machines without a GPU";
        delete drv;
        throw BackendUnavailable(msg);
      }
      drv->sym(drv->cuInit, "cuInit");
      drv->sym(drv->cuDeviceGet, "cuDeviceGet");
      drv->sym(drv->cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
      drv->sym(drv->cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease");
      drv->sym(drv->cuCtxSetCurrent, "cuCtxSetCurrent");
      drv->sym(drv->cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity");
      drv->sym(drv->cuMemAddressReserve, "cuMemAddressReserve");
      drv->sym(drv->cuMemAddressFree, "cuMemAddressFree");
      drv->sym(drv->cuMemCreate, "cuMemCreate");
      drv->sym(drv->cuMemRelease, "cuMemRelease");
      drv->sym(drv->cuMemMap, "cuMemMap");
      drv->sym(drv->cuMemUnmap, "cuMemUnmap");
      drv->sym(drv->cuMemSetAccess, "cuMemSetAccess");
      drv->sym(drv->cuMemGetInfo, "cuMemGetInfo_v2", "cuMemGetInfo");
      drv->sym(drv->cuGetErrorString, "cuGetErrorString");
      return drv;
    }();
    return *d;
  }
};

std::string cu_error(Driver& d, const char* call, CUresult rc) {
  const char* s = nullptr;
  if (d.cuGetErrorString) d.cuGetErrorString(rc, &s);
  return std::string(call) + " failed in CUDA driver (" + std::to_string(rc) + "): " + (s ? s : "unknown");
}

class CudaBackend final : public MappingBackend {
 public:
  CudaBackend(const AllocatorConfig& cfg, int64_t num_pages)
      : cfg_(cfg),
        drv_(Driver::get()),
        num_pages_(num_pages),
        segments_(cfg.num_layers * cfg.num_kv_buffers),
        handles_(static_cast<size_t>(num_pages * cfg.num_layers * cfg.num_kv_buffers), 0),
        mapped_(static_cast<size_t>(num_pages), 0),
        vmm_lock_(cfg.device_name) {
    check(drv_.cuInit(0), "cuInit");
    check(drv_.cuDeviceGet(&dev_, static_cast<int>(cfg.cuda_device)), "cuDeviceGet");
    check(drv_.cuDevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
    ctx_retained_ = true;
    bind();
    std::memset(&prop_, 0, sizeof prop_);
    prop_.type = 1;
    prop_.location.type = 1;
    prop_.location.id = dev_;
    size_t gran = 0;
    check(drv_.cuMemGetAllocationGranularity(&gran, &prop_, 0), "cuMemGetAllocationGranularity");
    if (gran == 0 || cfg.page_size % static_cast<int64_t>(gran) != 0) {
      release();
      throw InvalidArgument("page_size", "must be a multiple of the CUDA allocation granularity (" +
                                             std::to_string(gran) + " bytes)");
    }
    va_size_ = static_cast<size_t>(num_pages_ * cfg.page_size * segments_);
    check(drv_.cuMemAddressReserve(&base_, va_size_, gran, 0, 0), "cuMemAddressReserve");
  }

  ~CudaBackend() override {
    std::vector<page_id_t> all;
    for (page_id_t i = 0; i < num_pages_; ++i)
      if (mapped_[i]) all.push_back(i);
    if (!all.empty()) unmap(all, std::nullopt);
    release();
  }

  const char* name() const override { return "cuda"; }

  MapOutcome map(const std::vector<page_id_t>& ids, std::optional<Clock::time_point> deadline) override {
    if (!acquire(deadline)) return {MapStatus::Timeout, "device VMM lock busy (held by another process?)"};
    bind();
    CUmemAccessDesc access{};
    access.location.type = 1;
    access.location.id = dev_;
    access.flags = 3;
    std::vector<page_id_t> done;
    MapOutcome out;
    for (page_id_t id : ids) {
      if (id < 0 || id >= num_pages_) {
        out = {MapStatus::Error, "page id " + std::to_string(id) + " out of range"};
        break;
      }
      if (is_mapped(id)) {
        KVD_WARN("Page %ld is already mapped.", static_cast<long>(id));
        continue;
      }
      bool ok = true;
      for (int64_t s = 0; s < segments_ && ok; ++s) {
        CUmemGenericAllocationHandle h = 0;
        CUresult rc = drv_.cuMemCreate(&h, static_cast<size_t>(cfg_.page_size), &prop_, 0);
        if (rc != CUDA_SUCCESS) {
          out = {rc == CUDA_ERROR_OUT_OF_MEMORY ? MapStatus::OutOfMemory : MapStatus::Error, cu_error(drv_, "cuMemCreate", rc)};
          ok = false;
          break;
        }
        CUdeviceptr va = segment_va(id, s);
        rc = drv_.cuMemMap(va, static_cast<size_t>(cfg_.page_size), 0, h, 0);
        if (rc == CUDA_SUCCESS) rc = drv_.cuMemSetAccess(va, static_cast<size_t>(cfg_.page_size), &access, 1);
        if (rc != CUDA_SUCCESS) {
          drv_.cuMemUnmap(va, static_cast<size_t>(cfg_.page_size));
          drv_.cuMemRelease(h);
          out = {MapStatus::Error, cu_error(drv_, "cuMemMap/cuMemSetAccess", rc)};
          ok = false;
          break;
        }
        set_handle(id, s, h);
      }
      if (!ok) {
        release_segments(id);
        break;
      }
      set_mapped(id, true);
      done.push_back(id);
    }
    if (!out.ok()) {
      // All or nothing, like kvcached after #412: roll back what this call mapped.
      for (page_id_t id : done) {
        release_segments(id);
        set_mapped(id, false);
      }
    }
    vmm_lock_.unlock();
    return out;
  }

  MapOutcome unmap(const std::vector<page_id_t>& ids, std::optional<Clock::time_point> deadline) override {
    if (!acquire(deadline)) return {MapStatus::Timeout, "device VMM lock busy (held by another process?)"};
    bind();
    for (page_id_t id : ids) {
      if (id < 0 || id >= num_pages_ || !is_mapped(id)) {
        KVD_WARN("Page %ld is not mapped.", static_cast<long>(id));
        continue;
      }
      release_segments(id);
      set_mapped(id, false);
    }
    vmm_lock_.unlock();
    return {};
  }

  void mem_get_info(size_t* free_bytes, size_t* total_bytes) override {
    bind();
    CUresult rc = drv_.cuMemGetInfo(free_bytes, total_bytes);
    if (rc != CUDA_SUCCESS) throw std::runtime_error(cu_error(drv_, "cuMemGetInfo", rc));
  }

  bool vmm_busy_elsewhere() override { return vmm_lock_.busy_elsewhere(); }

  int64_t mapped_pages() const override {
    std::lock_guard<std::mutex> g(st_mu_);
    int64_t n = 0;
    for (uint8_t m : mapped_) n += m;
    return n;
  }

 private:
  void check(CUresult rc, const char* call) {
    if (rc != CUDA_SUCCESS) {
      std::string msg = cu_error(drv_, call, rc);
      release();
      throw BackendUnavailable("backend='cuda': " + msg);
    }
  }
  void bind() { drv_.cuCtxSetCurrent(ctx_); }
  void release() {
    if (base_) {
      drv_.cuMemAddressFree(base_, va_size_);
      base_ = 0;
    }
    if (ctx_retained_) {
      drv_.cuDevicePrimaryCtxRelease(dev_);
      ctx_retained_ = false;
    }
  }
  bool acquire(const std::optional<Clock::time_point>& deadline) {
    if (!deadline) {
      vmm_lock_.lock();
      return true;
    }
    return vmm_lock_.lock_until(*deadline);
  }
  CUdeviceptr segment_va(page_id_t id, int64_t s) const {
    if (cfg_.contiguous_layout) return base_ + static_cast<CUdeviceptr>((id * segments_ + s) * cfg_.page_size);
    return base_ + static_cast<CUdeviceptr>(s * num_pages_ * cfg_.page_size + id * cfg_.page_size);
  }
  bool is_mapped(page_id_t id) const {
    std::lock_guard<std::mutex> g(st_mu_);
    return mapped_[id] != 0;
  }
  void set_mapped(page_id_t id, bool v) {
    std::lock_guard<std::mutex> g(st_mu_);
    mapped_[id] = v ? 1 : 0;
  }
  void set_handle(page_id_t id, int64_t s, CUmemGenericAllocationHandle h) {
    std::lock_guard<std::mutex> g(st_mu_);
    handles_[static_cast<size_t>(id * segments_ + s)] = h;
  }
  void release_segments(page_id_t id) {
    for (int64_t s = 0; s < segments_; ++s) {
      CUmemGenericAllocationHandle h;
      {
        std::lock_guard<std::mutex> g(st_mu_);
        h = handles_[static_cast<size_t>(id * segments_ + s)];
        handles_[static_cast<size_t>(id * segments_ + s)] = 0;
      }
      if (h) {
        drv_.cuMemUnmap(segment_va(id, s), static_cast<size_t>(cfg_.page_size));
        drv_.cuMemRelease(h);
      }
    }
  }

  AllocatorConfig cfg_;
  Driver& drv_;
  int64_t num_pages_;
  int64_t segments_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  bool ctx_retained_ = false;
  CUmemAllocationProp prop_{};
  CUdeviceptr base_ = 0;
  size_t va_size_ = 0;
  mutable std::mutex st_mu_;
  std::vector<CUmemGenericAllocationHandle> handles_;
  std::vector<uint8_t> mapped_;
  DeviceVmmLock vmm_lock_;
};

}  // namespace

std::unique_ptr<MappingBackend> make_cuda_backend(const AllocatorConfig& cfg, int64_t num_pages) {
  return std::make_unique<CudaBackend>(cfg, num_pages);
}

}  // namespace kvdiag
