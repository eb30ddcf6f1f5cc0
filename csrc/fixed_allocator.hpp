// kvdiag native allocators: the FIXED page allocator (same interface as stock, all six fixes).
//
// Contract of this file (pure C++; the bindings add the Python side):
//   Locks:   mu_ guards the page lists, the counts, the combined-map queue and the worker state;
//            it is held only for O(1) work per page (lists are PageRings) and NEVER across a map,
//            an unmap, mem_get_info, a device-lock probe or wait, a sleep, or a Python callback;
//            callers wake the worker after releasing it. ctl_mu_ serialises start/stop of the
//            worker. The backend's device VMM lock is taken inside map/unmap with mu_ released.
//            Lock order: ctl_mu_ -> mu_ (the device lock is never taken with mu_ held). mu_ is a
//            plain std::mutex: a contended native caller parks in the kernel instead of spinning
//            (with more threads than cores, spinners steal the cores and cache lines the holder
//            needs; see fixed_allocator.cpp). No condition variable is notified with mu_ held,
//            and none is notified when nobody waits on it.
//   GIL:     the bindings release the GIL around every call that can block (alloc_page slow path,
//            free with unmap, resize, trim, start/stop, trigger, wait_prealloc_idle,
//            get_avail_physical_pages). Fast paths run with the GIL held but only try_lock mu_
//            (a bounded spin, about a microsecond, never a wait).
//   Python:  the prealloc worker never calls should_use_worker_ipc (Python): the decision is an
//            atomic, set by set_use_worker_ipc or by set_should_use_worker_ipc_callback, which
//            calls its callable once on the caller's thread. The only Python the allocator ever
//            runs is a broadcast map/unmap callback the user installed for worker IPC, called
//            with no allocator lock held from the mapping thread (worker or caller); the bridge
//            takes the GIL itself, and no other thread waits for it beyond map_timeout_ms.
//   Waits:   alloc_page waits on pages_cv_ (pages in flight) and sync_cv_ (its page in a combined
//            map) in slices of wait_timeout_ms, for at most map_timeout_ms in total, then raises
//            AllocatorTimeout. Backend maps/unmaps are bounded by map_timeout_ms (device lock +
//            injected latency). The worker's waits are woken by triggers/stop and its back-off
//            sleeps are wait_for(backoff_ms). stop waits at most stop_timeout_ms for the worker,
//            then detaches it (it keeps the allocator alive through a shared_ptr and exits when
//            its map returns). A Python callback that never returns cannot be interrupted.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "backend.hpp"
#include "common.hpp"
#include "page_ring.hpp"

namespace kvdiag {
namespace fixed {

// How this file was compiled (CMake build type, flags, optimization); see KVDIAG_BUILD_INFO.
const char* build_info();

class PageAllocator : public std::enable_shared_from_this<PageAllocator> {
 public:
  // Prefer create(): the worker keeps a shared_ptr so a detached worker never dangles.
  static std::shared_ptr<PageAllocator> create(const AllocatorConfig& cfg);
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

  // Non-blocking fast paths for callers that hold the GIL: -1 / false means "take the slow path".
  page_id_t try_alloc_fast();
  bool try_free_fast(page_id_t page_id);

  int64_t get_num_free_pages() const { return num_free_.load(std::memory_order_relaxed); }
  int64_t get_num_inuse_pages() const;
  int64_t get_num_total_pages() const { return num_total_.load(std::memory_order_relaxed); }
  int64_t get_num_reserved_pages() const { return a_reserved_.load(std::memory_order_relaxed); }
  int64_t get_num_inflight_pages() const { return a_inflight_.load(std::memory_order_relaxed); }
  int64_t get_avail_physical_pages() const;
  int64_t get_num_mapped_pages() const { return backend_->mapped_pages(); }
  bool wait_prealloc_idle(double timeout_s) const;

  void set_broadcast_map_callback(MapCallback cb);
  void set_broadcast_unmap_callback(MapCallback cb);
  void set_should_use_worker_ipc_callback(const BoolCallback& cb);
  void set_use_worker_ipc(bool v) { use_worker_ipc_.store(v); }

  CounterSnapshot counters() const;
  const std::string& banner() const { return banner_; }
  const AllocatorConfig& config() const { return cfg_; }
  int64_t min_reserved_pages() const { return min_reserved_pages_; }
  int64_t max_reserved_pages() const { return max_reserved_pages_; }

 private:
  struct SyncMap;  // one caller's page waiting in a combined synchronous map
  using Lock = std::unique_lock<std::mutex>;

  // The GIL-holding fast paths retry try_lock for a bounded spin (kSpinTries pauses, about a
  // microsecond: mu_ is held for O(1) work) before they give up and take the GIL-releasing slow
  // path, which costs far more. Native callers just lock() and park when mu_ is taken: with
  // threads on several cores a spin steals mu_'s cache line from the holder and slows every
  // handoff, and with more threads than cores it burns the slice a preempted holder needs.
  static constexpr int kSpinTries = 32;
  bool spin_try_lock(Lock& lk);

  void prealloc_worker(uint64_t gen);
  MapOutcome map_pages(const std::vector<page_id_t>& page_ids, Clock::time_point deadline);
  MapOutcome unmap_pages(const std::vector<page_id_t>& page_ids, Clock::time_point deadline);
  page_id_t take_reserved_locked(bool* notify_worker);
  page_id_t alloc_slow(Lock& lk);
  MapOutcome map_for_caller(Lock& lk, page_id_t page_id);
  void lead_combined_map(Lock& lk);
  void return_page_locked(page_id_t page_id);
  bool wake_worker_locked();
  void notify_worker(bool needed) {
    if (needed) worker_cv_.notify_one();
  }
  void publish_reserved_locked() {
    a_reserved_.store(static_cast<int64_t>(reserved_.size()), std::memory_order_relaxed);
  }
  void publish_inflight_locked();
  void check_allocated_locked(page_id_t page_id) const;
  void unmap_and_return(std::vector<page_id_t> pages, bool to_reclaimed);
  Clock::time_point map_deadline() const { return Clock::now() + std::chrono::milliseconds(cfg_.map_timeout_ms); }

  AllocatorConfig cfg_;
  std::string banner_;
  int64_t max_pages_;
  int64_t min_reserved_pages_;
  int64_t max_reserved_pages_;
  bool enable_page_prealloc_;
  std::unique_ptr<MappingBackend> backend_;

  // Hot state first, on its own cache lines: the fast paths touch mu_, the reserve, the counts
  // and in_use_ and nothing else. The rings' buffers and in_use_ are LineArrays: on the heap but
  // on whole cache lines of their own, so no other thread's heap data shares a line with them.
  alignas(64) mutable std::mutex mu_;
  // Guarded by mu_. The counts are atomics only so that getters can read them without mu_;
  // they are written with mu_ held.
  std::atomic<int64_t> num_free_{0};   // pages not in use: free list + reserve + in flight
  std::atomic<int64_t> a_reserved_{0};  // reserved_.size(), published for get_num_reserved_pages
  PageRing reserved_;                   // mapped pages ready for the fast path
  LineArray<uint8_t> in_use_;  // per page: 1 allocated (2 while free_pages validates)
  int64_t waiters_ = 0;                 // alloc_page callers waiting on pages_cv_
  bool running_ = false;
  bool signaled_ = false;
  bool worker_waiting_ = false;
  bool worker_busy_ = false;
  bool worker_exited_ = true;
  bool sync_leader_ = false;            // a caller is running a combined map
  // Guarded by mu_, off the fast paths.
  alignas(64) std::atomic<int64_t> num_total_{0};
  std::atomic<int64_t> a_inflight_{0};  // published for get_num_inflight_pages
  PageRing free_;       // unmapped pages
  PageRing reclaimed_;  // pages removed by a shrink
  std::vector<std::shared_ptr<SyncMap>> sync_queue_;  // callers' pages waiting for a combined map
  int64_t sync_waiters_ = 0;                          // callers waiting on sync_cv_
  uint64_t worker_gen_ = 0;
  std::shared_ptr<const MapCallback> map_cb_;
  std::shared_ptr<const MapCallback> unmap_cb_;

  std::condition_variable pages_cv_;   // alloc_page waiters: pages published or returned
  std::condition_variable sync_cv_;    // callers whose page is in a combined map
  std::condition_variable worker_cv_;  // the worker: trigger or stop
  std::condition_variable exit_cv_;    // stop: the worker has exited
  std::mutex ctl_mu_;                  // start/stop
  std::thread worker_;                 // guarded by ctl_mu_
  std::atomic<bool> use_worker_ipc_{false};
  Counters counters_;
};

}  // namespace fixed
}  // namespace kvdiag
