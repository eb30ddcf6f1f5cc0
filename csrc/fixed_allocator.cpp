// kvdiag native allocators: the FIXED page allocator.
//
// Contract of this file (pure C++; bindings in bindings.cpp):
//   Locks:   mu_ (lists, counters, worker state) is only held for O(pages) list work; it is released
//            before every map/unmap/mem_get_info/device probe/sleep/Python callback. ctl_mu_
//            serialises start/stop (order ctl_mu_ -> mu_).
//   GIL:     the bindings release it around every call that may block; the fast paths
//            (try_alloc_fast/try_free_fast) only try_lock mu_ and never wait.
//   Python:  broadcast map/unmap callbacks, invoked with no lock held (the std::function is copied
//            out under mu_ and called after unlocking).
//   Waits:   alloc_page: pages_cv_.wait_until in wait_timeout_ms slices, total <= map_timeout_ms,
//            then AllocatorTimeout. Maps/unmaps: deadline = now + map_timeout_ms. Worker:
//            worker_cv_ wait (trigger/stop) and wait_for(backoff_ms). stop: exit_cv_.wait_for
//            (stop_timeout_ms), then detach. wait_prealloc_idle: polled until its deadline.
//
// The six fixes, by where they live:
//   1 bounded wait, then synchronous map on the caller ........ alloc_page
//   2 in-flight pages visible; the worker never takes more than half the free list at once, so
//     callers can still map synchronously while it works ....... prealloc_worker, publish_locked
//   3 stalled/failed map -> log + AllocatorTimeout/RuntimeError . map_pages, alloc_page
//   4 saturating headroom ...................................... get_avail_physical_pages
//   5 back off while another process holds the device VMM lock  prealloc_worker
//   6 GIL released around waits and maps; no callback under a lock  bindings.cpp, map_pages
#include "fixed_allocator.hpp"

#include <algorithm>
#include <iostream>

namespace kvdiag {
namespace fixed {

namespace {

[[noreturn]] void throw_map_error(const MapOutcome& r, const char* what, int64_t timeout_ms) {
  if (r.status == MapStatus::Timeout)
    throw AllocatorTimeout(std::string(what) + ": mapping did not finish within map_timeout_ms=" +
                           std::to_string(timeout_ms) + " (" + r.message + ")");
  throw std::runtime_error(std::string(what) + ": Failed to map pages to KV tensors (" +
                           map_status_name(r.status) + "): " + r.message);
}

}  // namespace

std::shared_ptr<PageAllocator> PageAllocator::create(const AllocatorConfig& cfg) {
  return std::make_shared<PageAllocator>(cfg);
}

PageAllocator::PageAllocator(const AllocatorConfig& cfg) : cfg_(cfg) {
  max_pages_ = validate_config(cfg_);
  num_free_pages_ = num_total_pages_ = max_pages_;
  min_reserved_pages_ = std::min(max_pages_, cfg_.min_reserved_pages);
  max_reserved_pages_ = std::min(max_pages_, cfg_.max_reserved_pages);
  enable_page_prealloc_ = cfg_.enable_prealloc;
  backend_ = make_backend(cfg_, max_pages_);
  for (page_id_t i = 0; i < max_pages_; ++i) free_page_list_.push_back(i);
  in_use_.assign(static_cast<size_t>(max_pages_), 0);
  {
    std::lock_guard<std::mutex> lk(mu_);
    publish_locked();
  }
  banner_ = format_banner(cfg_, min_reserved_pages_, max_reserved_pages_);
  if (cfg_.print_banner) std::cout << banner_ << std::endl;
}

PageAllocator::~PageAllocator() { stop_prealloc_thread(); }

void PageAllocator::publish_locked() {
  a_num_free_.store(num_free_pages_, std::memory_order_relaxed);
  a_num_total_.store(num_total_pages_, std::memory_order_relaxed);
  a_reserved_.store(static_cast<int64_t>(reserved_page_list_.size()), std::memory_order_relaxed);
  a_inflight_.store(inflight_locked(), std::memory_order_relaxed);
}

int64_t PageAllocator::inflight_locked() const {
  return num_free_pages_ - static_cast<int64_t>(free_page_list_.size()) -
         static_cast<int64_t>(reserved_page_list_.size());
}

int64_t PageAllocator::get_num_inuse_pages() const {
  return a_num_total_.load(std::memory_order_relaxed) - a_num_free_.load(std::memory_order_relaxed);
}

void PageAllocator::wake_worker_locked() {
  if (!enable_page_prealloc_ || !running_) return;
  signaled_ = true;
  if (worker_waiting_) worker_cv_.notify_one();
}

void PageAllocator::notify_waiters(bool had_waiters) {
  if (had_waiters) pages_cv_.notify_all();
}

void PageAllocator::start_prealloc_thread() {
  if (!enable_page_prealloc_) return;
  std::lock_guard<std::mutex> ctl(ctl_mu_);
  if (worker_.joinable()) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    running_ = true;
    worker_exited_ = false;
    signaled_ = true;  // the initial trigger, like kvcached's start_prealloc_thread
  }
  std::shared_ptr<PageAllocator> self = weak_from_this().lock();
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lk(mu_);
    gen = ++worker_gen_;
  }
  worker_ = std::thread([this, self, gen] { prealloc_worker(gen); });
}

void PageAllocator::stop_prealloc_thread() {
  std::lock_guard<std::mutex> ctl(ctl_mu_);
  if (!worker_.joinable()) return;
  std::unique_lock<std::mutex> lk(mu_);
  running_ = false;
  worker_cv_.notify_all();
  const bool exited = exit_cv_.wait_for(lk, std::chrono::milliseconds(cfg_.stop_timeout_ms),
                                        [&] { return worker_exited_; });
  lk.unlock();
  if (exited || weak_from_this().expired()) {
    // Without a shared_ptr owner a detached worker could outlive us, so join even if slow.
    worker_.join();
    return;
  }
  KVD_ERROR("prealloc worker did not stop within stop_timeout_ms=%lld (a map is stalled); detaching it",
            static_cast<long long>(cfg_.stop_timeout_ms));
  worker_.detach();
}

void PageAllocator::trigger_preallocation() {
  std::lock_guard<std::mutex> lk(mu_);
  wake_worker_locked();
}

page_id_t PageAllocator::take_reserved_locked() {
  page_id_t page_id = reserved_page_list_.front();
  reserved_page_list_.pop_front();
  num_free_pages_--;
  in_use_[page_id] = 1;
  if (static_cast<int64_t>(reserved_page_list_.size()) < min_reserved_pages_) wake_worker_locked();
  publish_locked();
  return page_id;
}

page_id_t PageAllocator::try_alloc_fast() {
  std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock() || reserved_page_list_.empty()) return -1;
  return take_reserved_locked();
}

__attribute__((noinline)) page_id_t PageAllocator::alloc_page() {
  const auto deadline = map_deadline();
  std::unique_lock<std::mutex> lk(mu_);
  page_id_t page_id = -1;
  bool counted_wait = false;
  for (;;) {
    if (!reserved_page_list_.empty()) return take_reserved_locked();
    if (!free_page_list_.empty()) {
      page_id = free_page_list_.front();
      free_page_list_.pop_front();
      num_free_pages_--;
      in_use_[page_id] = 1;
      publish_locked();
      break;
    }
    if (num_free_pages_ <= 0) throw std::runtime_error("No free pages left");
    // Fix 2: pages exist but are in flight (the worker is mapping them, or a free is unmapping
    // them). That is "wait a little", never "wait forever".
    const auto now = Clock::now();
    if (now >= deadline) {
      counters_.alloc_timeouts++;
      const int64_t inflight = inflight_locked();
      throw AllocatorTimeout("alloc_page: no page became available within map_timeout_ms=" +
                             std::to_string(cfg_.map_timeout_ms) + "; " + std::to_string(inflight) +
                             " page(s) are in flight (a map or unmap is stalled)");
    }
    if (!counted_wait) {
      counters_.waits++;
      counted_wait = true;
    }
    waiters_++;
    // Fix 1: a bounded slice; the loop re-checks the lists (sync fallback) after each one.
    auto status = pages_cv_.wait_until(lk, std::min(deadline, now + std::chrono::milliseconds(cfg_.wait_timeout_ms)));
    waiters_--;
    if (status == std::cv_status::timeout) counters_.wait_timeouts++;
  }
  lk.unlock();
  if (enable_page_prealloc_) counters_.sync_fallbacks++;
  MapOutcome r = map_pages({page_id}, map_deadline());
  if (!r.ok()) {
    lk.lock();
    in_use_[page_id] = 0;
    free_page_list_.push_front(page_id);
    num_free_pages_++;
    publish_locked();
    const bool had_waiters = waiters_ > 0;
    lk.unlock();
    notify_waiters(had_waiters);
    throw_map_error(r, "alloc_page", cfg_.map_timeout_ms);
  }
  trigger_preallocation();
  return page_id;
}

void PageAllocator::check_allocated_locked(page_id_t page_id) const {
  if (page_id < 0 || page_id >= max_pages_)
    throw InvalidArgument("page_id", "out of range: " + std::to_string(page_id));
  if (!in_use_[page_id]) throw InvalidArgument("page_id", "page " + std::to_string(page_id) + " is not allocated");
}

bool PageAllocator::try_free_fast(page_id_t page_id) {
  std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock()) return false;
  check_allocated_locked(page_id);
  if (static_cast<int64_t>(reserved_page_list_.size()) >= max_reserved_pages_) return false;
  in_use_[page_id] = 0;
  num_free_pages_++;
  reserved_page_list_.push_back(page_id);
  publish_locked();
  const bool had_waiters = waiters_ > 0;
  lk.unlock();
  notify_waiters(had_waiters);
  return true;
}

void PageAllocator::free_page(page_id_t page_id) { free_pages({page_id}); }

void PageAllocator::free_pages(const std::vector<page_id_t>& page_ids) {
  std::vector<page_id_t> to_unmap;
  bool had_waiters;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 0; i < page_ids.size(); ++i) {
      check_allocated_locked(page_ids[i]);
      for (size_t j = 0; j < i; ++j)
        if (page_ids[j] == page_ids[i]) throw InvalidArgument("page_ids", "duplicate page " + std::to_string(page_ids[i]));
    }
    num_free_pages_ += static_cast<int64_t>(page_ids.size());
    for (page_id_t id : page_ids) {
      in_use_[id] = 0;
      if (static_cast<int64_t>(reserved_page_list_.size()) < max_reserved_pages_)
        reserved_page_list_.push_back(id);
      else
        to_unmap.push_back(id);
    }
    publish_locked();
    had_waiters = waiters_ > 0;
  }
  notify_waiters(had_waiters);
  if (!to_unmap.empty()) unmap_and_return(std::move(to_unmap), false);
}

void PageAllocator::unmap_and_return(std::vector<page_id_t> pages, bool to_reclaimed) {
  MapOutcome r = unmap_pages(pages, map_deadline());
  bool had_waiters;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (to_reclaimed) {
      // Out of the pool either way; a page that failed to unmap stays mapped and is skipped when
      // it is mapped again after a grow.
      reclaimed_page_list_.insert(reclaimed_page_list_.end(), pages.begin(), pages.end());
    } else if (r.ok()) {
      free_page_list_.insert(free_page_list_.end(), pages.begin(), pages.end());
    } else {
      // Still mapped: keep them usable as reserve rather than losing them.
      reserved_page_list_.insert(reserved_page_list_.end(), pages.begin(), pages.end());
    }
    publish_locked();
    had_waiters = waiters_ > 0;
  }
  notify_waiters(had_waiters);
}

bool PageAllocator::resize(int64_t new_mem_size) {
  if (new_mem_size < 0) throw InvalidArgument("new_mem_size", "must be >= 0");
  const int64_t new_num_pages = new_mem_size / cfg_.page_size;
  std::vector<page_id_t> to_unmap;
  bool had_waiters;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (new_num_pages > max_pages_) return false;
    const int64_t inuse = num_total_pages_ - num_free_pages_;
    if (new_num_pages < inuse) return false;
    if (new_num_pages == num_total_pages_) return true;
    if (new_num_pages > num_total_pages_) {
      const int64_t grow = new_num_pages - num_total_pages_;
      // Pages still being unmapped by a concurrent shrink are not back yet.
      if (static_cast<int64_t>(reclaimed_page_list_.size()) < grow) return false;
      for (int64_t i = 0; i < grow; ++i) {
        free_page_list_.push_back(reclaimed_page_list_.back());
        reclaimed_page_list_.pop_back();
      }
      num_free_pages_ += grow;
      num_total_pages_ = new_num_pages;
      publish_locked();
      had_waiters = waiters_ > 0;
    } else {
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
      publish_locked();
      had_waiters = false;
    }
  }
  notify_waiters(had_waiters);
  if (!to_unmap.empty()) unmap_and_return(std::move(to_unmap), true);
  return true;
}

void PageAllocator::trim() {
  std::vector<page_id_t> to_unmap;
  {
    std::lock_guard<std::mutex> lk(mu_);
    to_unmap.assign(reserved_page_list_.begin(), reserved_page_list_.end());
    reserved_page_list_.clear();
    publish_locked();
  }
  if (!to_unmap.empty()) unmap_and_return(std::move(to_unmap), false);
}

__attribute__((noinline)) void PageAllocator::prealloc_worker(uint64_t gen) {
  std::unique_lock<std::mutex> lk(mu_);
  const auto backoff = std::chrono::milliseconds(cfg_.backoff_ms);
  // `gen` retires a worker that was detached by a timed-out stop if a new one has been started.
  auto live = [&] { return running_ && gen == worker_gen_; };
  while (live()) {
    if (!signaled_) {
      worker_busy_ = false;
      worker_waiting_ = true;
      worker_cv_.wait(lk, [&] { return !live() || signaled_; });
      worker_waiting_ = false;
      if (!live()) break;
    }
    signaled_ = false;
    worker_busy_ = true;
    if (std::min<int64_t>(min_reserved_pages_ - static_cast<int64_t>(reserved_page_list_.size()),
                          static_cast<int64_t>(free_page_list_.size())) <= 0)
      continue;
    // Fix 4 (and no driver call under mu_): the headroom check runs unlocked and saturates.
    lk.unlock();
    const int64_t avail = get_avail_physical_pages();
    lk.lock();
    if (!live()) break;
    const int64_t current_reserved = static_cast<int64_t>(reserved_page_list_.size());
    int64_t to_reserve = std::max<int64_t>(0, min_reserved_pages_ - current_reserved);
    to_reserve = std::min<int64_t>(to_reserve, static_cast<int64_t>(free_page_list_.size()));
    to_reserve = std::min<int64_t>(to_reserve, avail);
    KVD_INFO("prealloc worker: min_reserved_pages: %ld, current_reserved: %ld, to_reserve: %ld, "
             "len(free_page_list): %zu, avail_physical_pages: %ld",
             static_cast<long>(min_reserved_pages_), static_cast<long>(current_reserved),
             static_cast<long>(to_reserve), free_page_list_.size(), static_cast<long>(avail));
    if (to_reserve <= 0) {
      if (avail <= 0) KVD_WARN("prealloc worker: no physical headroom on the device; not reserving");
      continue;
    }
    int64_t done = 0;
    while (live() && done < to_reserve && !free_page_list_.empty()) {
      // Fix 5: while another process is mid-VMM on this device, leave the pages on the free list
      // (callers can still map them synchronously) and retry later.
      lk.unlock();
      const bool busy = backend_->vmm_busy_elsewhere();
      lk.lock();
      if (busy) {
        counters_.backoffs++;
        worker_cv_.wait_for(lk, backoff, [&] { return !live(); });
        continue;
      }
      // mu_ was released for the probe: callers may have emptied the free list meanwhile.
      if (free_page_list_.empty()) break;
      // Fix 2: at most half the free list per map call, so the free list rarely empties under
      // a caller; every page in flight is counted in get_num_inflight_pages().
      const int64_t half = std::max<int64_t>(1, (static_cast<int64_t>(free_page_list_.size()) + 1) / 2);
      const int64_t chunk = std::min<int64_t>(to_reserve - done, half);
      std::vector<page_id_t> batch;
      batch.reserve(static_cast<size_t>(chunk));
      for (int64_t i = 0; i < chunk; ++i) {
        batch.push_back(free_page_list_.front());
        free_page_list_.pop_front();
      }
      publish_locked();
      lk.unlock();
      MapOutcome r = map_pages(batch, map_deadline());
      lk.lock();
      if (r.ok()) {
        reserved_page_list_.insert(reserved_page_list_.end(), batch.begin(), batch.end());
        done += chunk;
      } else {
        free_page_list_.insert(free_page_list_.begin(), batch.begin(), batch.end());
        KVD_ERROR("Failed to preallocate %zu pages: %s (%s)", batch.size(), r.message.c_str(),
                  map_status_name(r.status));
      }
      publish_locked();
      if (waiters_ > 0) pages_cv_.notify_all();
      if (!r.ok()) {
        // Back off; the next trigger retries. Callers are not blocked meanwhile.
        worker_cv_.wait_for(lk, backoff, [&] { return !live(); });
        break;
      }
    }
    KVD_INFO("Preallocated %ld pages, reserved=%zu", static_cast<long>(done), reserved_page_list_.size());
  }
  if (gen == worker_gen_) {
    worker_busy_ = false;
    worker_exited_ = true;
    exit_cv_.notify_all();
  }
}

__attribute__((noinline)) MapOutcome PageAllocator::map_pages(const std::vector<page_id_t>& page_ids,
                                                              Clock::time_point deadline) {
  std::shared_ptr<const MapCallback> cb;
  if (cfg_.world_size > 1 || use_worker_ipc_.load()) {
    std::lock_guard<std::mutex> lk(mu_);
    cb = map_cb_;
  }
  const auto t0 = Clock::now();
  MapOutcome r;
  if (cb) {
    // Fix 6: no allocator lock is held here; the bridge takes the GIL by itself.
    try {
      (*cb)(cfg_.world_size, page_offsets(cfg_, page_ids));
    } catch (const std::exception& e) {
      r = {MapStatus::Error, std::string("broadcast map callback failed: ") + e.what()};
    }
    if (r.ok() && Clock::now() > deadline)
      KVD_WARN("broadcast map callback took longer than map_timeout_ms=%lld", static_cast<long long>(cfg_.map_timeout_ms));
  } else {
    r = backend_->map(page_ids, deadline);
  }
  counters_.record_map(ns_between(t0, Clock::now()));
  if (!r.ok()) {
    counters_.map_failures++;
    KVD_ERROR("map of %zu page(s) failed (%s): %s", page_ids.size(), map_status_name(r.status), r.message.c_str());
  }
  return r;
}

MapOutcome PageAllocator::unmap_pages(const std::vector<page_id_t>& page_ids, Clock::time_point deadline) {
  std::shared_ptr<const MapCallback> cb;
  if (cfg_.world_size > 1 || use_worker_ipc_.load()) {
    std::lock_guard<std::mutex> lk(mu_);
    cb = unmap_cb_;
  }
  counters_.unmap_calls++;
  MapOutcome r;
  if (cb) {
    try {
      (*cb)(cfg_.world_size, page_offsets(cfg_, page_ids));
    } catch (const std::exception& e) {
      r = {MapStatus::Error, std::string("broadcast unmap callback failed: ") + e.what()};
    }
  } else {
    r = backend_->unmap(page_ids, deadline);
  }
  if (!r.ok()) {
    counters_.map_failures++;
    KVD_ERROR("unmap of %zu page(s) failed (%s): %s", page_ids.size(), map_status_name(r.status), r.message.c_str());
  }
  return r;
}

int64_t PageAllocator::get_avail_physical_pages() const {
  size_t avail = 0, total = 0;
  backend_->mem_get_info(&avail, &total);
  const size_t headroom = static_cast<size_t>(static_cast<double>(total) * (1.0 - cfg_.gpu_utilization));
  // Fix 4 (#377): saturate instead of wrapping.
  const size_t usable = avail > headroom ? avail - headroom : 0;
  const size_t per_page = static_cast<size_t>(cfg_.page_size) * static_cast<size_t>(cfg_.num_layers) *
                          static_cast<size_t>(cfg_.num_kv_buffers);
  return static_cast<int64_t>(usable / per_page);
}

bool PageAllocator::wait_prealloc_idle(double timeout_s) const {
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  for (;;) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!running_ || (!signaled_ && !worker_busy_)) return true;
    }
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void PageAllocator::set_broadcast_map_callback(MapCallback cb) {
  std::shared_ptr<const MapCallback> next = cb ? std::make_shared<const MapCallback>(std::move(cb)) : nullptr;
  std::shared_ptr<const MapCallback> old;
  {
    std::lock_guard<std::mutex> lk(mu_);
    old = std::move(map_cb_);
    map_cb_ = std::move(next);
  }
  // `old` dies here, after unlocking: destroying a Python bridge takes the GIL.
}

void PageAllocator::set_broadcast_unmap_callback(MapCallback cb) {
  std::shared_ptr<const MapCallback> next = cb ? std::make_shared<const MapCallback>(std::move(cb)) : nullptr;
  std::shared_ptr<const MapCallback> old;
  {
    std::lock_guard<std::mutex> lk(mu_);
    old = std::move(unmap_cb_);
    unmap_cb_ = std::move(next);
  }
}

void PageAllocator::set_should_use_worker_ipc_callback(const BoolCallback& cb) {
  // Called once, here, on the caller's thread; the worker only ever reads the atomic.
  use_worker_ipc_.store(cb ? cb() : false);
}

CounterSnapshot PageAllocator::counters() const {
  std::lock_guard<std::mutex> lk(mu_);
  return counters_.snapshot(inflight_locked());
}

}  // namespace fixed
}  // namespace kvdiag
