// kvdiag native allocators: the STOCK page allocator, a faithful model of kvcached's
// csrc/page_allocator.cpp at fea40de, defect included ON PURPOSE.
//
// Contract of this file (pure C++; the bindings add the Python side):
//   Locks:   ONE std::mutex lock_ and ONE std::condition_variable cond_ for everything, like
//            kvcached. The backend's device VMM lock is taken inside map/unmap with lock_ released.
//   GIL:     the Python binding releases the GIL for NONE of the kvcached methods (alloc_page
//            included), exactly like kvcached's pybind11 bindings at fea40de.
//   Python:  map_pages()/unmap_pages() call should_use_worker_ipc_callback_ and the broadcast
//            callbacks, from whichever thread maps — including the prealloc worker. The bindings'
//            bridges take the GIL (gil_scoped_acquire) for each call.
//   Waits:   alloc_page() waits on cond_ with NO timeout when both lists are empty and
//            num_free_pages_ > 0 (the #371 defect). stop_prealloc_thread() joins without bound.
//            The worker's cond_ wait is woken by triggers and stop. Map waits on the device lock
//            without bound. So the documented cycle (alloc_page holding the GIL while the worker
//            needs the GIL inside map_pages) hangs forever, by design.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "backend.hpp"
#include "common.hpp"

namespace kvdiag {
namespace stock {

// How this file was compiled (CMake build type, flags, optimization); see KVDIAG_BUILD_INFO.
const char* build_info();

class PageAllocator {
 public:
  explicit PageAllocator(const AllocatorConfig& cfg);
  ~PageAllocator();
  PageAllocator(const PageAllocator&) = delete;
  PageAllocator& operator=(const PageAllocator&) = delete;

  void start_prealloc_thread();
  void stop_prealloc_thread();
  page_id_t alloc_page();
  void free_page(page_id_t page_id);
  void free_pages(const std::vector<page_id_t>& page_ids);
  bool resize(int64_t new_mem_size);
  void trim();
  void trigger_preallocation();

  int64_t get_num_free_pages() const;
  int64_t get_num_inuse_pages() const;
  int64_t get_num_total_pages() const;
  int64_t get_num_reserved_pages() const;
  int64_t get_num_inflight_pages() const;
  int64_t get_avail_physical_pages() const;
  int64_t get_num_mapped_pages() const { return backend_->mapped_pages(); }
  // kvdiag addition for deterministic tests: polls until the worker is idle (bounded).
  bool wait_prealloc_idle(double timeout_s) const;

  void set_broadcast_map_callback(MapCallback cb);
  void set_broadcast_unmap_callback(MapCallback cb);
  void set_should_use_worker_ipc_callback(BoolCallback cb);
  void set_use_worker_ipc(bool v);

  CounterSnapshot counters() const;
  const std::string& banner() const { return banner_; }
  const AllocatorConfig& config() const { return cfg_; }
  int64_t min_reserved_pages() const { return min_reserved_pages_; }
  int64_t max_reserved_pages() const { return max_reserved_pages_; }

 private:
  void prealloc_worker();
  void map_pages(const std::vector<page_id_t>& page_ids);
  void unmap_pages(const std::vector<page_id_t>& page_ids);
  bool should_use_worker_ipc();
  int64_t avail_physical_pages_unlocked() const;
  void check_allocated_locked(page_id_t page_id) const;
  int64_t inflight_locked() const;

  AllocatorConfig cfg_;
  std::string banner_;
  int64_t max_pages_;  // virtual capacity (pages per layer at construction)
  int64_t min_reserved_pages_;
  int64_t max_reserved_pages_;
  bool enable_page_prealloc_;
  double gpu_utilization_;
  std::unique_ptr<MappingBackend> backend_;

  // Counters: plain int64 like fea40de; always written under lock_.
  int64_t num_free_pages_;
  int64_t num_total_pages_;
  std::deque<page_id_t> free_page_list_;
  std::deque<page_id_t> reserved_page_list_;
  std::deque<page_id_t> reclaimed_page_list_;
  std::vector<uint8_t> in_use_;

  mutable std::mutex lock_;
  std::condition_variable cond_;
  std::atomic<bool> prealloc_running_{false};
  std::atomic<bool> prealloc_needed_{false};
  std::atomic<bool> worker_busy_{false};
  std::unique_ptr<std::thread> prealloc_thread_;

  MapCallback broadcast_map_callback_;
  MapCallback broadcast_unmap_callback_;
  BoolCallback should_use_worker_ipc_callback_;
  std::atomic<bool> use_worker_ipc_flag_{false};

  Counters counters_;
};

}  // namespace stock
}  // namespace kvdiag
