// kvdiag native allocators: the "host" mapping backend (real memory standing in for device memory).
//
// Contract of this file (pure C++, no Python):
//   Locks:   vmm_lock_ (DeviceVmmLock: process mutex + flock, shared with co-located processes)
//            is held for the whole of each map/unmap, injected latency included, to model the
//            driver's device-wide VMM serialization. st_mu_ guards the mapped-page bitmap and is
//            never held across a wait or a syscall that can block.
//   GIL:     never touched; nothing here calls into Python.
//   Waits:   without a deadline the device-lock wait is unbounded (stock model); with one, the
//            lock wait and the injected latency are bounded by it (MapStatus::Timeout).
// Memory:    the pool's virtual range is reserved with mmap(PROT_NONE, MAP_NORESERVE). Mapping a
//            page = mprotect(READ|WRITE) + touching one OS page per physical page (or every OS
//            page with host_full_commit / KVDIAG_HOST_FULL_COMMIT=1), so RSS stays small.
//            Unmapping = madvise(DONTNEED) + mprotect(PROT_NONE).
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "backend.hpp"
#include "device.hpp"

namespace kvdiag {

const char* map_status_name(MapStatus s) {
  switch (s) {
    case MapStatus::Ok: return "ok";
    case MapStatus::Timeout: return "timeout";
    case MapStatus::OutOfMemory: return "out of memory";
    case MapStatus::Error: return "error";
  }
  return "?";
}

std::vector<offset_t> page_offsets(const AllocatorConfig& cfg, const std::vector<page_id_t>& ids) {
  std::vector<offset_t> out;
  out.reserve(ids.size());
  for (page_id_t id : ids) {
    out.push_back(cfg.contiguous_layout ? id * cfg.page_size * cfg.num_layers * cfg.num_kv_buffers
                                        : id * cfg.page_size);
  }
  return out;
}

namespace {

class HostBackend final : public MappingBackend {
 public:
  HostBackend(const AllocatorConfig& cfg, int64_t num_pages)
      : cfg_(cfg),
        num_pages_(num_pages),
        segments_(cfg.num_layers * cfg.num_kv_buffers),
        page_bytes_(cfg.page_size * segments_),
        mapped_(static_cast<size_t>(num_pages), 0),
        account_(DeviceAccount::open(cfg.device_name)),
        vmm_lock_(cfg.device_name) {
    const char* env = std::getenv("KVDIAG_HOST_FULL_COMMIT");
    full_commit_ = cfg.host_full_commit || (env && env[0] == '1');
    os_page_ = sysconf(_SC_PAGESIZE);
    va_size_ = static_cast<size_t>(num_pages_) * static_cast<size_t>(page_bytes_);
    void* p = mmap(nullptr, va_size_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw std::runtime_error(std::string("host backend: cannot reserve virtual range: ") + std::strerror(errno));
    base_ = static_cast<char*>(p);
  }

  ~HostBackend() override {
    int64_t still = 0;
    {
      std::lock_guard<std::mutex> g(st_mu_);
      for (uint8_t m : mapped_) still += m;
    }
    if (still) account_->add_kv_bytes(-still * page_bytes_);
    munmap(base_, va_size_);
  }

  const char* name() const override { return "host"; }

  MapOutcome map(const std::vector<page_id_t>& ids, std::optional<Clock::time_point> deadline) override {
    std::vector<page_id_t> todo;
    {
      std::lock_guard<std::mutex> g(st_mu_);
      for (page_id_t id : ids) {
        if (id < 0 || id >= num_pages_) return {MapStatus::Error, "page id " + std::to_string(id) + " out of range"};
        if (mapped_[id]) {
          KVD_WARN("Page %ld is already mapped.", static_cast<long>(id));
          continue;
        }
        todo.push_back(id);
      }
    }
    if (!acquire(deadline)) return {MapStatus::Timeout, "device VMM lock busy (held by another process?)"};
    struct Unlock {
      DeviceVmmLock& l;
      ~Unlock() { l.unlock(); }
    } unlock_on_exit{vmm_lock_};
    if (!inject_latency(deadline)) return {MapStatus::Timeout, "map did not finish before its deadline"};
    const int64_t need = static_cast<int64_t>(todo.size()) * page_bytes_;
    if (account_->used_bytes_all() + need > cfg_.device_size)
      return {MapStatus::OutOfMemory, "device " + cfg_.device_name + " has no room for " + std::to_string(need) + " bytes"};
    for (size_t i = 0; i < todo.size(); ++i) {
      if (!protect(todo[i], PROT_READ | PROT_WRITE)) {
        std::string err = std::strerror(errno);
        for (size_t j = 0; j <= i; ++j) protect(todo[j], PROT_NONE);
        return {MapStatus::Error, "mprotect failed: " + err};
      }
      touch(todo[i]);
    }
    account_->add_kv_bytes(need);
    std::lock_guard<std::mutex> g(st_mu_);
    for (page_id_t id : todo) mapped_[id] = 1;
    return {};
  }

  MapOutcome unmap(const std::vector<page_id_t>& ids, std::optional<Clock::time_point> deadline) override {
    std::vector<page_id_t> todo;
    {
      std::lock_guard<std::mutex> g(st_mu_);
      for (page_id_t id : ids) {
        if (id < 0 || id >= num_pages_) return {MapStatus::Error, "page id " + std::to_string(id) + " out of range"};
        if (!mapped_[id]) {
          KVD_WARN("Page %ld is not mapped.", static_cast<long>(id));
          continue;
        }
        todo.push_back(id);
      }
    }
    if (!acquire(deadline)) return {MapStatus::Timeout, "device VMM lock busy (held by another process?)"};
    for (page_id_t id : todo) {
      for_each_segment(id, [&](char* p, size_t n) { madvise(p, n, MADV_DONTNEED); });
      protect(id, PROT_NONE);
    }
    account_->add_kv_bytes(-static_cast<int64_t>(todo.size()) * page_bytes_);
    {
      std::lock_guard<std::mutex> g(st_mu_);
      for (page_id_t id : todo) mapped_[id] = 0;
    }
    vmm_lock_.unlock();
    return {};
  }

  void mem_get_info(size_t* free_bytes, size_t* total_bytes) override {
    const int64_t used = account_->used_bytes_all();
    *total_bytes = static_cast<size_t>(cfg_.device_size);
    *free_bytes = used >= cfg_.device_size ? 0 : static_cast<size_t>(cfg_.device_size - used);
  }

  bool vmm_busy_elsewhere() override { return vmm_lock_.busy_elsewhere(); }

  int64_t mapped_pages() const override {
    std::lock_guard<std::mutex> g(st_mu_);
    int64_t n = 0;
    for (uint8_t m : mapped_) n += m;
    return n;
  }

 private:
  bool acquire(const std::optional<Clock::time_point>& deadline) {
    if (!deadline) {
      vmm_lock_.lock();
      return true;
    }
    return vmm_lock_.lock_until(*deadline);
  }

  // Sleeps for the configured driver latency; false if that would cross the deadline.
  bool inject_latency(const std::optional<Clock::time_point>& deadline) {
    if (cfg_.map_latency_us <= 0) return true;
    auto want = std::chrono::microseconds(cfg_.map_latency_us);
    if (deadline && Clock::now() + want > *deadline) {
      std::this_thread::sleep_until(*deadline);
      return false;
    }
    std::this_thread::sleep_for(want);
    return true;
  }

  template <typename F>
  void for_each_segment(page_id_t id, F&& f) {
    if (cfg_.contiguous_layout) {
      f(base_ + id * page_bytes_, static_cast<size_t>(page_bytes_));
      return;
    }
    const int64_t stride = num_pages_ * cfg_.page_size;  // one K or V tensor of one layer
    for (int64_t s = 0; s < segments_; ++s) f(base_ + s * stride + id * cfg_.page_size, static_cast<size_t>(cfg_.page_size));
  }

  bool protect(page_id_t id, int prot) {
    bool ok = true;
    for_each_segment(id, [&](char* p, size_t n) { ok = ok && mprotect(p, n, prot) == 0; });
    return ok;
  }

  void touch(page_id_t id) {
    for_each_segment(id, [&](char* p, size_t n) {
      if (full_commit_) {
        std::memset(p, 0, n);
        return;
      }
      // One OS page per physical page: real backing, small RSS.
      for (size_t off = 0; off < n; off += static_cast<size_t>(cfg_.page_size))
        *reinterpret_cast<volatile char*>(p + off) = 1;
    });
  }

  AllocatorConfig cfg_;
  int64_t num_pages_;
  int64_t segments_;
  int64_t page_bytes_;  // bytes behind one page id (all layers and buffers)
  bool full_commit_ = false;
  long os_page_ = 4096;
  size_t va_size_ = 0;
  char* base_ = nullptr;
  mutable std::mutex st_mu_;
  std::vector<uint8_t> mapped_;
  std::shared_ptr<DeviceAccount> account_;
  DeviceVmmLock vmm_lock_;
};

}  // namespace

std::unique_ptr<MappingBackend> make_host_backend(const AllocatorConfig& cfg, int64_t num_pages) {
  return std::make_unique<HostBackend>(cfg, num_pages);
}

std::unique_ptr<MappingBackend> make_backend(const AllocatorConfig& cfg, int64_t num_pages) {
  if (cfg.backend == "host") return make_host_backend(cfg, num_pages);
  if (cfg.backend == "cuda") return make_cuda_backend(cfg, num_pages);
  throw InvalidArgument("backend", "must be 'host' or 'cuda', got '" + cfg.backend + "'");
}

}  // namespace kvdiag
