// kvdiag native allocators: the STOCK page allocator (kvcached fea40de model, defect kept).
//
// Contract of this file (pure C++; bindings in bindings.cpp):
//   Locks:   lock_ (one mutex) + cond_ (one condvar) guard the lists and counters. lock_ is released
//            around every map/unmap; the worker calls get_avail_physical_pages() (mem_get_info)
//            WITH lock_ held, like kvcached. Callback setters assign under lock_.
//   GIL:     no method releases it (the binding keeps it, like fea40de).
//   Python:  map_pages/unmap_pages call should_use_worker_ipc() (the Python callback when set) and
//            the broadcast callbacks; on the prealloc worker these need the GIL.
//   Waits:   alloc_page(): cond_.wait(lock) with NO timeout while both lists are empty and
//            num_free_pages_ > 0 — the #371 defect. prealloc_worker(): cond_.wait until triggered or
//            stopped. stop_prealloc_thread(): unbounded join. Maps: unbounded device-lock wait.
//            wait_prealloc_idle() (kvdiag addition) polls with a deadline.
#include "stock_allocator.hpp"

#include <algorithm>
#include <iostream>

namespace kvdiag {
namespace stock {

PageAllocator::PageAllocator(const AllocatorConfig& cfg) : cfg_(cfg) {
  max_pages_ = validate_config(cfg_);
  num_free_pages_ = num_total_pages_ = max_pages_;
  min_reserved_pages_ = std::min(max_pages_, cfg_.min_reserved_pages);
  max_reserved_pages_ = std::min(max_pages_, cfg_.max_reserved_pages);
  enable_page_prealloc_ = cfg_.enable_prealloc;
  gpu_utilization_ = cfg_.gpu_utilization;
  backend_ = make_backend(cfg_, max_pages_);
  for (page_id_t i = 0; i < max_pages_; ++i) free_page_list_.push_back(i);
  in_use_.assign(static_cast<size_t>(max_pages_), 0);
  banner_ = format_banner(cfg_, min_reserved_pages_, max_reserved_pages_);
  // kvcached prints with std::cout and std::endl: stdout, whatever the log level.
  if (cfg_.print_banner) std::cout << banner_ << std::endl;
}

PageAllocator::~PageAllocator() { stop_prealloc_thread(); }

void PageAllocator::start_prealloc_thread() {
  if (!enable_page_prealloc_) return;
  if (prealloc_thread_) return;
  prealloc_running_ = true;
  prealloc_thread_ = std::make_unique<std::thread>(&PageAllocator::prealloc_worker, this);
  trigger_preallocation();
}

void PageAllocator::stop_prealloc_thread() {
  if (!enable_page_prealloc_ || !prealloc_thread_) return;
  {
    std::lock_guard<std::mutex> lock(lock_);
    prealloc_running_ = false;
    cond_.notify_all();
  }
  // Unbounded join, with the GIL still held when called from Python (kvcached fea40de).
  if (prealloc_thread_->joinable()) prealloc_thread_->join();
  prealloc_thread_.reset();
}

__attribute__((noinline)) void PageAllocator::trigger_preallocation() {
  std::lock_guard<std::mutex> lock(lock_);
  prealloc_needed_ = true;
  cond_.notify_all();
}

__attribute__((noinline)) page_id_t PageAllocator::alloc_page() {
  std::unique_lock<std::mutex> lock(lock_);
  page_id_t page_id = -1;
  while (page_id == -1) {
    if (!reserved_page_list_.empty()) {
      // Fast path: a pre-mapped page.
      page_id = reserved_page_list_.front();
      reserved_page_list_.pop_front();
      num_free_pages_--;
      in_use_[page_id] = 1;
      if (static_cast<int64_t>(reserved_page_list_.size()) < min_reserved_pages_) {
        prealloc_needed_ = true;
        cond_.notify_all();
      }
      return page_id;
    }
    if (!free_page_list_.empty()) {
      // Slow path: map on this thread below.
      page_id = free_page_list_.front();
      free_page_list_.pop_front();
      num_free_pages_--;
      in_use_[page_id] = 1;
      break;
    }
    if (num_free_pages_ <= 0) throw std::runtime_error("No free pages left");
    if (!enable_page_prealloc_)
      throw std::runtime_error("Inconsistent page allocator state: no free pages in the lists but num_free_pages_ > 0");
    counters_.waits++;
    // THE DEFECT (#371): no timeout. Only the prealloc worker can wake this, and it may need the
    // GIL this thread is holding.
    cond_.wait(lock);
  }
  lock.unlock();
  if (enable_page_prealloc_) counters_.sync_fallbacks++;
  try {
    map_pages({page_id});
  } catch (...) {
    lock.lock();
    in_use_[page_id] = 0;
    free_page_list_.push_front(page_id);
    num_free_pages_++;
    cond_.notify_all();
    throw;
  }
  if (enable_page_prealloc_) trigger_preallocation();
  return page_id;
}

void PageAllocator::check_allocated_locked(page_id_t page_id) const {
  if (page_id < 0 || page_id >= max_pages_)
    throw InvalidArgument("page_id", "out of range: " + std::to_string(page_id));
  if (!in_use_[page_id]) throw InvalidArgument("page_id", "page " + std::to_string(page_id) + " is not allocated");
}

void PageAllocator::free_page(page_id_t page_id) { free_pages({page_id}); }

void PageAllocator::free_pages(const std::vector<page_id_t>& page_ids) {
  std::vector<page_id_t> to_unmap;
  {
    std::lock_guard<std::mutex> lock(lock_);
    for (size_t i = 0; i < page_ids.size(); ++i) {
      check_allocated_locked(page_ids[i]);
      for (size_t j = 0; j < i; ++j)
        if (page_ids[j] == page_ids[i]) throw InvalidArgument("page_ids", "duplicate page " + std::to_string(page_ids[i]));
    }
    num_free_pages_ += static_cast<int64_t>(page_ids.size());
    for (page_id_t id : page_ids) {
      in_use_[id] = 0;
      // Freed pages are still mapped: keep them as reserve up to max_reserved_pages.
      if (static_cast<int64_t>(reserved_page_list_.size()) < max_reserved_pages_)
        reserved_page_list_.push_back(id);
      else
        to_unmap.push_back(id);
    }
    if (to_unmap.empty()) {
      cond_.notify_all();
      return;
    }
  }
  try {
    unmap_pages(to_unmap);
  } catch (const std::exception& e) {
    KVD_ERROR("Failed to unmap %zu pages: %s", to_unmap.size(), e.what());
    std::lock_guard<std::mutex> lock(lock_);
    // Still mapped: keep them usable as reserve.
    reserved_page_list_.insert(reserved_page_list_.end(), to_unmap.begin(), to_unmap.end());
    cond_.notify_all();
    return;
  }
  std::lock_guard<std::mutex> lock(lock_);
  free_page_list_.insert(free_page_list_.end(), to_unmap.begin(), to_unmap.end());
  cond_.notify_all();
}

bool PageAllocator::resize(int64_t new_mem_size) {
  if (new_mem_size < 0) throw InvalidArgument("new_mem_size", "must be >= 0");
  const int64_t new_num_pages = new_mem_size / cfg_.page_size;
  std::vector<page_id_t> to_unmap;
  {
    std::lock_guard<std::mutex> lock(lock_);
    if (new_num_pages > max_pages_) return false;
    const int64_t inuse = num_total_pages_ - num_free_pages_;
    if (new_num_pages < inuse) return false;
    if (new_num_pages == num_total_pages_) return true;
    if (new_num_pages > num_total_pages_) {
      int64_t grow = new_num_pages - num_total_pages_;
      // Pages still being unmapped by a concurrent shrink are not back yet.
      if (static_cast<int64_t>(reclaimed_page_list_.size()) < grow) return false;
      for (int64_t i = 0; i < grow; ++i) {
        free_page_list_.push_back(reclaimed_page_list_.back());
        reclaimed_page_list_.pop_back();
      }
      num_free_pages_ += grow;
      num_total_pages_ = new_num_pages;
      cond_.notify_all();
      return true;
    }
    int64_t shrink = num_total_pages_ - new_num_pages;
    if (static_cast<int64_t>(free_page_list_.size() + reserved_page_list_.size()) < shrink) return false;
    while (shrink > 0 && !free_page_list_.empty()) {
      reclaimed_page_list_.push_back(free_page_list_.back());
      free_page_list_.pop_back();
      --shrink;
    }
    while (shrink > 0) {
      to_unmap.push_back(reserved_page_list_.back());
      reserved_page_list_.pop_back();
      --shrink;
    }
    num_free_pages_ -= num_total_pages_ - new_num_pages;
    num_total_pages_ = new_num_pages;
  }
  if (!to_unmap.empty()) {
    try {
      unmap_pages(to_unmap);
    } catch (const std::exception& e) {
      KVD_ERROR("Failed to unmap %zu pages during resize: %s", to_unmap.size(), e.what());
    }
    std::lock_guard<std::mutex> lock(lock_);
    reclaimed_page_list_.insert(reclaimed_page_list_.end(), to_unmap.begin(), to_unmap.end());
  }
  return true;
}

void PageAllocator::trim() {
  std::vector<page_id_t> to_unmap;
  {
    std::lock_guard<std::mutex> lock(lock_);
    to_unmap.assign(reserved_page_list_.begin(), reserved_page_list_.end());
    reserved_page_list_.clear();
  }
  if (to_unmap.empty()) return;
  try {
    unmap_pages(to_unmap);
  } catch (const std::exception& e) {
    KVD_ERROR("Failed to unmap %zu pages during trim: %s", to_unmap.size(), e.what());
    std::lock_guard<std::mutex> lock(lock_);
    reserved_page_list_.insert(reserved_page_list_.end(), to_unmap.begin(), to_unmap.end());
    return;
  }
  std::lock_guard<std::mutex> lock(lock_);
  free_page_list_.insert(free_page_list_.end(), to_unmap.begin(), to_unmap.end());
  cond_.notify_all();
}

__attribute__((noinline)) void PageAllocator::prealloc_worker() {
  while (prealloc_running_) {
    std::unique_lock<std::mutex> lock(lock_);
    worker_busy_ = false;
    while (!prealloc_needed_ && prealloc_running_) cond_.wait(lock);
    if (!prealloc_running_) break;
    worker_busy_ = true;
    prealloc_needed_ = false;
    counters_.worker_wakeups.fetch_add(1, std::memory_order_relaxed);
    KVD_INFO("prealloc worker triggered...");
    const int64_t current_reserved = static_cast<int64_t>(reserved_page_list_.size());
    int64_t to_reserve = std::max<int64_t>(0, min_reserved_pages_ - current_reserved);
    to_reserve = std::min<int64_t>(to_reserve, static_cast<int64_t>(free_page_list_.size()));
    // mem_get_info with lock_ held, like kvcached; the #377 underflow lives in here.
    to_reserve = std::min<int64_t>(to_reserve, avail_physical_pages_unlocked());
    KVD_INFO("max_reserved_pages: %ld, min_reserved_pages: %ld, current_reserved: %ld, to_reserve: %ld, "
             "len(free_page_list): %zu",
             static_cast<long>(max_reserved_pages_), static_cast<long>(min_reserved_pages_),
             static_cast<long>(current_reserved), static_cast<long>(to_reserve), free_page_list_.size());
    if (to_reserve <= 0) continue;
    std::vector<page_id_t> pages_to_reserve;
    pages_to_reserve.reserve(static_cast<size_t>(to_reserve));
    for (int64_t i = 0; i < to_reserve && !free_page_list_.empty(); ++i) {
      pages_to_reserve.push_back(free_page_list_.front());
      free_page_list_.pop_front();
    }
    // The pages are now in neither list ("in flight") until map_pages returns.
    lock.unlock();
    try {
      map_pages(pages_to_reserve);
      lock.lock();
      reserved_page_list_.insert(reserved_page_list_.end(), pages_to_reserve.begin(), pages_to_reserve.end());
      KVD_INFO("Preallocated %zu pages, reserved=%zu", pages_to_reserve.size(), reserved_page_list_.size());
      cond_.notify_all();
    } catch (const std::exception& e) {
      if (!lock.owns_lock()) lock.lock();
      free_page_list_.insert(free_page_list_.begin(), pages_to_reserve.begin(), pages_to_reserve.end());
      KVD_ERROR("Failed to preallocate %zu pages: %s", pages_to_reserve.size(), e.what());
      cond_.notify_all();
    }
  }
  worker_busy_ = false;
}

__attribute__((noinline)) bool PageAllocator::should_use_worker_ipc() {
  // fea40de: the Python callback, called directly from whatever thread maps — no lock, no cache.
  if (should_use_worker_ipc_callback_) return should_use_worker_ipc_callback_();
  return use_worker_ipc_flag_.load();
}

__attribute__((noinline)) void PageAllocator::map_pages(const std::vector<page_id_t>& page_ids) {
  std::vector<offset_t> offsets = page_offsets(cfg_, page_ids);
  auto t0 = Clock::now();
  if ((cfg_.world_size > 1 || should_use_worker_ipc()) && broadcast_map_callback_) {
    broadcast_map_callback_(cfg_.world_size, offsets);  // cross-process RPC in kvcached; can block
    counters_.record_map(ns_between(t0, Clock::now()), page_ids.size());
    return;
  }
  MapOutcome r = backend_->map(page_ids, std::nullopt);  // unbounded, like the driver
  counters_.record_map(ns_between(t0, Clock::now()), page_ids.size());
  if (!r.ok()) {
    counters_.map_failures++;
    throw std::runtime_error("Failed to map pages to KV tensors: " + r.message);
  }
  KVD_INFO("Mapped %zu pages to KV tensors", page_ids.size());
}

__attribute__((noinline)) void PageAllocator::unmap_pages(const std::vector<page_id_t>& page_ids) {
  std::vector<offset_t> offsets = page_offsets(cfg_, page_ids);
  counters_.unmap_calls++;
  if ((cfg_.world_size > 1 || should_use_worker_ipc()) && broadcast_unmap_callback_) {
    broadcast_unmap_callback_(cfg_.world_size, offsets);
    return;
  }
  MapOutcome r = backend_->unmap(page_ids, std::nullopt);
  if (!r.ok()) {
    counters_.map_failures++;
    throw std::runtime_error("Failed to unmap pages from KV tensors: " + r.message);
  }
}

int64_t PageAllocator::avail_physical_pages_unlocked() const {
  size_t avail_phy_mem_size = 0, total_phy_mem_size = 0;
  backend_->mem_get_info(&avail_phy_mem_size, &total_phy_mem_size);
  size_t headroom = static_cast<size_t>(static_cast<double>(total_phy_mem_size) * (1.0 - gpu_utilization_));
  // Bug #377, kept on purpose: size_t subtraction wraps when avail < headroom; max(..., 0) keeps it.
  avail_phy_mem_size = std::max(avail_phy_mem_size - headroom, static_cast<size_t>(0));
  size_t per_page = static_cast<size_t>(cfg_.page_size) * static_cast<size_t>(cfg_.num_layers) *
                    static_cast<size_t>(cfg_.num_kv_buffers);
  return static_cast<int64_t>(avail_phy_mem_size / per_page);
}

int64_t PageAllocator::get_avail_physical_pages() const { return avail_physical_pages_unlocked(); }

// Getters: no lock for the counters (like fea40de); the list sizes take lock_.
int64_t PageAllocator::get_num_free_pages() const { return num_free_pages_; }
int64_t PageAllocator::get_num_inuse_pages() const { return num_total_pages_ - num_free_pages_; }
int64_t PageAllocator::get_num_total_pages() const { return num_total_pages_; }

int64_t PageAllocator::get_num_reserved_pages() const {
  std::lock_guard<std::mutex> lock(lock_);
  return static_cast<int64_t>(reserved_page_list_.size());
}

int64_t PageAllocator::inflight_locked() const {
  return num_free_pages_ - static_cast<int64_t>(free_page_list_.size()) -
         static_cast<int64_t>(reserved_page_list_.size());
}

int64_t PageAllocator::get_num_inflight_pages() const {
  std::lock_guard<std::mutex> lock(lock_);
  return inflight_locked();
}

bool PageAllocator::wait_prealloc_idle(double timeout_s) const {
  auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(lock_);
      bool idle = !prealloc_thread_ || !prealloc_running_ || (!prealloc_needed_ && !worker_busy_);
      if (idle) return true;
    }
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void PageAllocator::set_broadcast_map_callback(MapCallback cb) {
  std::lock_guard<std::mutex> lock(lock_);
  broadcast_map_callback_ = std::move(cb);
}

void PageAllocator::set_broadcast_unmap_callback(MapCallback cb) {
  std::lock_guard<std::mutex> lock(lock_);
  broadcast_unmap_callback_ = std::move(cb);
}

void PageAllocator::set_should_use_worker_ipc_callback(BoolCallback cb) {
  std::lock_guard<std::mutex> lock(lock_);
  should_use_worker_ipc_callback_ = std::move(cb);
}

void PageAllocator::set_use_worker_ipc(bool v) { use_worker_ipc_flag_ = v; }

const char* build_info() { return KVDIAG_BUILD_INFO; }

CounterSnapshot PageAllocator::counters() const {
  std::lock_guard<std::mutex> lock(lock_);
  return counters_.snapshot(inflight_locked());
}

}  // namespace stock
}  // namespace kvdiag
