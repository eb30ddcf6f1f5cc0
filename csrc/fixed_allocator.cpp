// kvdiag native allocators: the FIXED page allocator.
//
// Contract of this file (pure C++; bindings in bindings.cpp):
//   Locks:   mu_ (page lists, counts, combined-map queue, worker state) is a plain, parking mutex
//            (std::mutex: a contended locker sleeps in the kernel, it never spins), held only for
//            O(1) work per page (free_pages: O(n) for n pages). It is released before every
//            map/unmap/mem_get_info/device probe/sleep/Python callback, and no condition variable
//            is notified with it held: callers note under mu_ whether anyone waits (waiters_,
//            sync_waiters_, worker_waiting_) and notify after unlocking, and only then.
//            ctl_mu_ serialises start/stop (order ctl_mu_ -> mu_; the device lock is never taken
//            with mu_ held).
//   GIL:     the bindings release it around every call that may block; the fast paths
//            (try_alloc_fast/try_free_fast, called with the GIL held) only try_lock mu_ (a bounded
//            spin of kSpinTries) and never wait, so a GIL holder never sleeps on mu_.
//   Python:  the worker never calls should_use_worker_ipc (an atomic holds the answer). Broadcast
//            map/unmap callbacks, when installed for worker IPC, are invoked with no lock held
//            (the std::function is copied out under mu_ and called after unlocking).
//   Waits:   alloc_page: pages_cv_/sync_cv_ wait_until in wait_timeout_ms slices, total <=
//            map_timeout_ms, then AllocatorTimeout. Maps/unmaps: deadline = now + map_timeout_ms.
//            Worker: worker_cv_ wait (trigger/stop) and wait_for(backoff_ms). stop:
//            exit_cv_.wait_for(stop_timeout_ms), then detach. wait_prealloc_idle: polled until
//            its deadline.
//
// The six fixes, by where they live:
//   1 bounded wait, then synchronous map on the caller ........ alloc_page, map_for_caller
//   2 in-flight pages visible; the worker never takes more than half the free list at once, so
//     callers can still map synchronously while it works ....... prealloc_worker, publish_inflight_locked
//   3 stalled/failed map -> log + AllocatorTimeout/RuntimeError . map_pages, alloc_page
//   4 saturating headroom ...................................... get_avail_physical_pages
//   5 back off while another process holds the device VMM lock  prealloc_worker
//   6 GIL released around waits and maps; no callback under a lock  bindings.cpp, map_pages
//
// Why releasing the GIL costs no throughput (issue 19): with the GIL released, several callers
// can need a synchronous map at the same time, and each would queue for the device lock to map
// one page. Instead they COMBINE (map_for_caller): the first becomes the leader and maps every
// page queued so far in one backend call; the others wait for that call's outcome. A map then
// costs one device-lock round per batch of callers instead of one per caller, which is what the
// stock allocator gets by accident from serialising every caller on the GIL. The fast paths do
// O(1) work under mu_ with no allocation and no clock read and never wake a worker that is
// already awake.
//
// Why mu_ parks instead of spinning: native callers can outnumber the cores (the engine's
// threads, a stress run's 8 threads on 2 cores). A spinning waiter (an adaptive mutex, a
// try_lock loop) keeps every core contending for mu_'s cache lines, so each op pays cross-core
// transfers of the lock word, the reserve ring and in_use_, and it burns the time slice that a
// preempted holder needs to finish. A parked waiter leaves its core to a thread that can make
// progress; the running threads then take mu_ uncontended, on lines their core already holds.
// The stock allocator parks too (plain mutex); spinning made this one host-dependent: it lost 2x
// on a quiet 2-core host, where both cores were free to spin, and won on a busy one. Parking has a
// price too: with critical sections this short a woken waiter often finds mu_ free again, so a
// contended unlock costs a futex wake that a spin would have saved: what the stock allocator pays
// for the same kind of lock, while this allocator does less holding it.
#include "fixed_allocator.hpp"

#include <algorithm>
#include <iostream>

namespace kvdiag {
namespace fixed {

const char* build_info() { return KVDIAG_BUILD_INFO; }

namespace {

[[noreturn]] void throw_map_error(const MapOutcome& r, const char* what, int64_t timeout_ms) {
  if (r.status == MapStatus::Timeout)
    throw AllocatorTimeout(std::string(what) + ": mapping did not finish within map_timeout_ms=" +
                           std::to_string(timeout_ms) + " (" + r.message + ")");
  throw std::runtime_error(std::string(what) + ": Failed to map pages to KV tensors (" +
                           map_status_name(r.status) + "): " + r.message);
}

}  // namespace

// One caller's page in a combined synchronous map. Shared between the caller and the leader
// that maps it, so a caller that gives up (deadline) never leaves the leader a dangling pointer.
struct PageAllocator::SyncMap {
  enum class State { Queued, Mapping, Done };
  page_id_t page;
  Clock::time_point deadline;
  State state = State::Queued;
  bool abandoned = false;  // the caller timed out while the leader was mapping this page
  MapOutcome outcome;
};

std::shared_ptr<PageAllocator> PageAllocator::create(const AllocatorConfig& cfg) {
  return std::make_shared<PageAllocator>(cfg);
}

PageAllocator::PageAllocator(const AllocatorConfig& cfg)
    : cfg_(cfg),
      max_pages_(validate_config(cfg_)),
      reserved_(static_cast<size_t>(max_pages_)),
      free_(static_cast<size_t>(max_pages_)),
      reclaimed_(static_cast<size_t>(max_pages_)) {
  min_reserved_pages_ = std::min(max_pages_, cfg_.min_reserved_pages);
  max_reserved_pages_ = std::min(max_pages_, cfg_.max_reserved_pages);
  enable_page_prealloc_ = cfg_.enable_prealloc;
  backend_ = make_backend(cfg_, max_pages_);
  for (page_id_t i = 0; i < max_pages_; ++i) free_.push_back(i);
  in_use_.assign(static_cast<size_t>(max_pages_), uint8_t{0});
  {
    std::lock_guard<std::mutex> lk(mu_);
    num_free_.store(max_pages_, std::memory_order_relaxed);
    num_total_.store(max_pages_, std::memory_order_relaxed);
    publish_reserved_locked();
    publish_inflight_locked();
  }
  banner_ = format_banner(cfg_, min_reserved_pages_, max_reserved_pages_);
  if (cfg_.print_banner) std::cout << banner_ << std::endl;
}

PageAllocator::~PageAllocator() { stop_prealloc_thread(); }

void PageAllocator::publish_inflight_locked() {
  // Pages counted free but in neither list: a worker batch being mapped, pages being unmapped,
  // pages of a caller that gave up on a combined map.
  a_inflight_.store(num_free_.load(std::memory_order_relaxed) - static_cast<int64_t>(free_.size()) -
                        static_cast<int64_t>(reserved_.size()),
                    std::memory_order_relaxed);
}

int64_t PageAllocator::get_num_inuse_pages() const {
  return num_total_.load(std::memory_order_relaxed) - num_free_.load(std::memory_order_relaxed);
}

// Marks the worker signalled; true if it sleeps and must be notified (after unlocking mu_).
// A worker that is awake re-checks signaled_ before it sleeps, so it is notified once per sleep.
bool PageAllocator::wake_worker_locked() {
  if (!enable_page_prealloc_ || !running_) return false;
  const bool notify = worker_waiting_ && !signaled_;
  signaled_ = true;
  return notify;
}

void PageAllocator::start_prealloc_thread() {
  if (!enable_page_prealloc_) return;
  std::lock_guard<std::mutex> ctl(ctl_mu_);
  if (worker_.joinable()) return;
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lk(mu_);
    running_ = true;
    worker_exited_ = false;
    signaled_ = true;  // the initial trigger, like kvcached's start_prealloc_thread
    gen = ++worker_gen_;
  }
  std::shared_ptr<PageAllocator> self = weak_from_this().lock();
  worker_ = std::thread([this, self, gen] { prealloc_worker(gen); });
}

void PageAllocator::stop_prealloc_thread() {
  std::lock_guard<std::mutex> ctl(ctl_mu_);
  if (!worker_.joinable()) return;
  Lock lk(mu_);
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
  bool notify;
  {
    std::lock_guard<std::mutex> lk(mu_);
    notify = wake_worker_locked();
  }
  notify_worker(notify);
}

page_id_t PageAllocator::take_reserved_locked(bool* notify_worker) {
  const page_id_t page_id = reserved_.pop_front();
  num_free_.store(num_free_.load(std::memory_order_relaxed) - 1, std::memory_order_relaxed);
  in_use_[static_cast<size_t>(page_id)] = 1;
  publish_reserved_locked();
  *notify_worker = static_cast<int64_t>(reserved_.size()) < min_reserved_pages_ && wake_worker_locked();
  return page_id;
}

bool PageAllocator::spin_try_lock(Lock& lk) {
  for (int i = 0;; ++i) {
    if (mu_.try_lock()) {
      lk = Lock(mu_, std::adopt_lock);
      return true;
    }
    if (i == kSpinTries) return false;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
}

page_id_t PageAllocator::try_alloc_fast() {
  bool notify = false;
  page_id_t page_id;
  {
    Lock lk;
    if (!spin_try_lock(lk) || reserved_.empty()) return -1;
    page_id = take_reserved_locked(&notify);
  }
  notify_worker(notify);
  return page_id;
}

__attribute__((noinline)) page_id_t PageAllocator::alloc_page() {
  Lock lk(mu_);
  if (!reserved_.empty()) {
    bool notify = false;
    const page_id_t page_id = take_reserved_locked(&notify);
    lk.unlock();
    notify_worker(notify);
    return page_id;
  }
  return alloc_slow(lk);
}

// The reserve is empty: map a free page on this thread (combined with concurrent callers), or
// wait a bounded time for pages in flight.
page_id_t PageAllocator::alloc_slow(Lock& lk) {
  Clock::time_point deadline{};  // set on the first wait: the fast paths never read the clock
  bool waited = false;
  for (;;) {
    if (!reserved_.empty()) {
      bool notify = false;
      const page_id_t page_id = take_reserved_locked(&notify);
      lk.unlock();
      notify_worker(notify);
      return page_id;
    }
    if (!free_.empty()) break;
    if (num_free_.load(std::memory_order_relaxed) <= 0) throw std::runtime_error("No free pages left");
    // Fix 2: pages exist but are in flight (the worker is mapping them, or a free is unmapping
    // them). That is "wait a little", never "wait forever".
    const auto now = Clock::now();
    if (!waited) {
      waited = true;
      deadline = now + std::chrono::milliseconds(cfg_.map_timeout_ms);
      counters_.waits++;
    } else if (now >= deadline) {
      counters_.alloc_timeouts++;
      throw AllocatorTimeout("alloc_page: no page became available within map_timeout_ms=" +
                             std::to_string(cfg_.map_timeout_ms) + "; " +
                             std::to_string(a_inflight_.load(std::memory_order_relaxed)) +
                             " page(s) are in flight (a map or unmap is stalled)");
    }
    waiters_++;
    // Fix 1: a bounded slice; the loop re-checks the lists (sync fallback) after each one.
    const auto status =
        pages_cv_.wait_until(lk, std::min(deadline, now + std::chrono::milliseconds(cfg_.wait_timeout_ms)));
    waiters_--;
    if (status == std::cv_status::timeout) counters_.wait_timeouts++;
  }
  const page_id_t page_id = free_.pop_front();
  num_free_.store(num_free_.load(std::memory_order_relaxed) - 1, std::memory_order_relaxed);
  in_use_[static_cast<size_t>(page_id)] = 1;
  if (enable_page_prealloc_) counters_.sync_fallbacks++;
  const MapOutcome r = map_for_caller(lk, page_id);
  if (!r.ok()) {
    lk.unlock();
    throw_map_error(r, "alloc_page", cfg_.map_timeout_ms);
  }
  // Like kvcached: after a synchronous map, ask the worker to top the reserve up.
  const bool notify = wake_worker_locked();
  lk.unlock();
  notify_worker(notify);
  return page_id;
}

// Undoes an alloc of `page_id` whose map failed: back to the front of the free list.
void PageAllocator::return_page_locked(page_id_t page_id) {
  in_use_[static_cast<size_t>(page_id)] = 0;
  free_.push_front(page_id);
  num_free_.store(num_free_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  publish_inflight_locked();
  if (waiters_ > 0) pages_cv_.notify_all();
}

// Maps `page_id` (taken off the free list, counted in use) for the calling thread; mu_ is held on
// entry and on return. Concurrent callers combine: whoever finds no map running leads and maps
// every queued page in one backend call; the others wait for its outcome, each for at most its
// own map_timeout_ms. On failure the page is back on the free list (or, if the caller gave up
// while its page was being mapped, the leader puts it back when the map returns).
MapOutcome PageAllocator::map_for_caller(Lock& lk, page_id_t page_id) {
  auto me = std::make_shared<SyncMap>();
  me->page = page_id;
  me->deadline = map_deadline();
  sync_queue_.push_back(me);
  for (;;) {
    if (me->state == SyncMap::State::Done) {
      if (!me->outcome.ok()) return_page_locked(page_id);
      return me->outcome;
    }
    if (me->state == SyncMap::State::Queued && !sync_leader_) {
      lead_combined_map(lk);
      continue;
    }
    const auto now = Clock::now();
    if (now >= me->deadline) {
      if (me->state == SyncMap::State::Queued) {
        sync_queue_.erase(std::find(sync_queue_.begin(), sync_queue_.end(), me));
        return_page_locked(page_id);
      } else {
        // The leader is mapping our page and its map outlived our deadline (a stalled callback):
        // the page is free again but in flight until the leader's map returns.
        me->abandoned = true;
        in_use_[static_cast<size_t>(page_id)] = 0;
        num_free_.store(num_free_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
        publish_inflight_locked();
      }
      counters_.alloc_timeouts++;
      return {MapStatus::Timeout, "the combined map carrying this page did not finish in time"};
    }
    sync_waiters_++;
    sync_cv_.wait_until(lk, std::min(me->deadline, now + std::chrono::milliseconds(cfg_.wait_timeout_ms)));
    sync_waiters_--;
  }
}

// Maps every queued caller page in one backend call (mu_ held on entry and on return).
void PageAllocator::lead_combined_map(Lock& lk) {
  sync_leader_ = true;
  std::vector<std::shared_ptr<SyncMap>> batch;
  batch.swap(sync_queue_);
  std::vector<page_id_t> pages;
  pages.reserve(batch.size());
  Clock::time_point deadline = batch.front()->deadline;
  for (auto& m : batch) {
    m->state = SyncMap::State::Mapping;
    pages.push_back(m->page);
    deadline = std::min(deadline, m->deadline);
  }
  if (batch.size() > 1) counters_.combined_maps++;
  lk.unlock();
  std::vector<MapOutcome> outcome(batch.size(), map_pages(pages, deadline));
  if (batch.size() > 1 && !outcome[0].ok() && outcome[0].status != MapStatus::Timeout) {
    // A combined map failed as a whole (e.g. the device has room for some of the pages only):
    // give each caller the outcome its own page would have had.
    for (size_t i = 0; i < batch.size(); ++i) outcome[i] = map_pages({pages[i]}, batch[i]->deadline);
  }
  lk.lock();
  bool returned = false;
  for (size_t i = 0; i < batch.size(); ++i) {
    SyncMap& m = *batch[i];
    m.outcome = outcome[i];
    m.state = SyncMap::State::Done;
    if (m.abandoned) {
      // Its caller has gone: a mapped page joins the reserve, an unmapped one the free list.
      if (m.outcome.ok())
        reserved_.push_back(m.page);
      else
        free_.push_front(m.page);
      returned = true;
    }
  }
  sync_leader_ = false;
  if (returned) {
    publish_reserved_locked();
    publish_inflight_locked();
    if (waiters_ > 0) pages_cv_.notify_all();
  }
  // Wakes the callers of this batch and, if pages were queued meanwhile, their next leader.
  if (sync_waiters_ > 0) sync_cv_.notify_all();
}

void PageAllocator::check_allocated_locked(page_id_t page_id) const {
  if (page_id < 0 || page_id >= max_pages_)
    throw InvalidArgument("page_id", "out of range: " + std::to_string(page_id));
  if (!in_use_[static_cast<size_t>(page_id)])
    throw InvalidArgument("page_id", "page " + std::to_string(page_id) + " is not allocated");
}

bool PageAllocator::try_free_fast(page_id_t page_id) {
  bool had_waiters;
  {
    Lock lk;
    if (!spin_try_lock(lk)) return false;
    check_allocated_locked(page_id);
    if (static_cast<int64_t>(reserved_.size()) >= max_reserved_pages_) return false;
    in_use_[static_cast<size_t>(page_id)] = 0;
    num_free_.store(num_free_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    reserved_.push_back(page_id);
    publish_reserved_locked();
    had_waiters = waiters_ > 0;
  }
  if (had_waiters) pages_cv_.notify_all();
  return true;
}

void PageAllocator::free_page(page_id_t page_id) {
  bool had_waiters;
  {
    Lock lk(mu_);
    check_allocated_locked(page_id);
    in_use_[static_cast<size_t>(page_id)] = 0;
    num_free_.store(num_free_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    if (static_cast<int64_t>(reserved_.size()) >= max_reserved_pages_) {
      // Over the reserve: unmap it (outside mu_), then it joins the free list.
      publish_inflight_locked();
      lk.unlock();
      unmap_and_return({page_id}, false);
      return;
    }
    reserved_.push_back(page_id);
    publish_reserved_locked();
    had_waiters = waiters_ > 0;
  }
  if (had_waiters) pages_cv_.notify_all();
}

void PageAllocator::free_pages(const std::vector<page_id_t>& page_ids) {
  std::vector<page_id_t> to_unmap;
  bool had_waiters;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // O(n) validation: mark each page as seen (2) while checking, restore the marks on error.
    for (size_t i = 0; i < page_ids.size(); ++i) {
      const page_id_t id = page_ids[i];
      const bool bad_range = id < 0 || id >= max_pages_;
      if (bad_range || in_use_[static_cast<size_t>(id)] != 1) {
        for (size_t j = 0; j < i; ++j) in_use_[static_cast<size_t>(page_ids[j])] = 1;
        if (!bad_range && in_use_[static_cast<size_t>(id)] == 1)
          throw InvalidArgument("page_ids", "duplicate page " + std::to_string(id));
        check_allocated_locked(id);  // throws: out of range or not allocated
      }
      in_use_[static_cast<size_t>(id)] = 2;
    }
    num_free_.store(num_free_.load(std::memory_order_relaxed) + static_cast<int64_t>(page_ids.size()),
                    std::memory_order_relaxed);
    for (page_id_t id : page_ids) {
      in_use_[static_cast<size_t>(id)] = 0;
      if (static_cast<int64_t>(reserved_.size()) < max_reserved_pages_)
        reserved_.push_back(id);
      else
        to_unmap.push_back(id);
    }
    publish_reserved_locked();
    publish_inflight_locked();
    had_waiters = waiters_ > 0;
  }
  if (had_waiters) pages_cv_.notify_all();
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
      for (page_id_t id : pages) reclaimed_.push_back(id);
    } else if (r.ok()) {
      for (page_id_t id : pages) free_.push_back(id);
    } else {
      // Still mapped: keep them usable as reserve rather than losing them.
      for (page_id_t id : pages) reserved_.push_back(id);
    }
    publish_reserved_locked();
    publish_inflight_locked();
    had_waiters = waiters_ > 0;
  }
  if (had_waiters) pages_cv_.notify_all();
}

bool PageAllocator::resize(int64_t new_mem_size) {
  if (new_mem_size < 0) throw InvalidArgument("new_mem_size", "must be >= 0");
  const int64_t new_num_pages = new_mem_size / cfg_.page_size;
  std::vector<page_id_t> to_unmap;
  bool had_waiters = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    const int64_t total = num_total_.load(std::memory_order_relaxed);
    const int64_t free_count = num_free_.load(std::memory_order_relaxed);
    if (new_num_pages > max_pages_) return false;
    if (new_num_pages < total - free_count) return false;
    if (new_num_pages == total) return true;
    if (new_num_pages > total) {
      const int64_t grow = new_num_pages - total;
      // Pages still being unmapped by a concurrent shrink are not back yet.
      if (static_cast<int64_t>(reclaimed_.size()) < grow) return false;
      for (int64_t i = 0; i < grow; ++i) free_.push_back(reclaimed_.pop_back());
      num_free_.store(free_count + grow, std::memory_order_relaxed);
      num_total_.store(new_num_pages, std::memory_order_relaxed);
      had_waiters = waiters_ > 0;
    } else {
      int64_t shrink = total - new_num_pages;
      if (static_cast<int64_t>(free_.size() + reserved_.size()) < shrink) return false;
      while (shrink > 0 && !free_.empty()) {
        reclaimed_.push_back(free_.pop_back());
        --shrink;
      }
      while (shrink > 0) {
        to_unmap.push_back(reserved_.pop_back());
        --shrink;
      }
      num_free_.store(free_count - (total - new_num_pages), std::memory_order_relaxed);
      num_total_.store(new_num_pages, std::memory_order_relaxed);
    }
    publish_reserved_locked();
    publish_inflight_locked();
  }
  if (had_waiters) pages_cv_.notify_all();
  if (!to_unmap.empty()) unmap_and_return(std::move(to_unmap), true);
  return true;
}

void PageAllocator::trim() {
  std::vector<page_id_t> to_unmap;
  {
    std::lock_guard<std::mutex> lk(mu_);
    to_unmap.reserve(reserved_.size());
    while (!reserved_.empty()) to_unmap.push_back(reserved_.pop_front());
    publish_reserved_locked();
    publish_inflight_locked();
  }
  if (!to_unmap.empty()) unmap_and_return(std::move(to_unmap), false);
}

__attribute__((noinline)) void PageAllocator::prealloc_worker(uint64_t gen) {
  Lock lk(mu_);
  const auto backoff = std::chrono::milliseconds(cfg_.backoff_ms);
  // `gen` retires a worker that was detached by a timed-out stop if a new one has been started.
  auto live = [&] { return running_ && gen == worker_gen_; };
  auto wanted = [&] {
    return std::min<int64_t>(min_reserved_pages_ - static_cast<int64_t>(reserved_.size()),
                             static_cast<int64_t>(free_.size()));
  };
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
    counters_.worker_wakeups.fetch_add(1, std::memory_order_relaxed);
    if (wanted() <= 0) continue;  // a transient dip that frees refilled before the worker ran
    // Fix 4 (and no driver call under mu_): the headroom check runs unlocked and saturates.
    lk.unlock();
    const int64_t avail = get_avail_physical_pages();
    lk.lock();
    if (!live()) break;
    const int64_t current_reserved = static_cast<int64_t>(reserved_.size());
    const int64_t to_reserve = std::min<int64_t>(wanted(), avail);
    KVD_INFO("prealloc worker: min_reserved_pages: %ld, current_reserved: %ld, to_reserve: %ld, "
             "len(free_page_list): %zu, avail_physical_pages: %ld",
             static_cast<long>(min_reserved_pages_), static_cast<long>(current_reserved),
             static_cast<long>(to_reserve), free_.size(), static_cast<long>(avail));
    if (to_reserve <= 0) {
      if (avail <= 0) KVD_WARN("prealloc worker: no physical headroom on the device; not reserving");
      continue;
    }
    int64_t done = 0;
    while (live() && done < to_reserve && !free_.empty()) {
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
      if (free_.empty()) break;
      // Fix 2: at most half the free list per map call, so the free list rarely empties under
      // a caller; every page in flight is counted in get_num_inflight_pages().
      const int64_t half = std::max<int64_t>(1, (static_cast<int64_t>(free_.size()) + 1) / 2);
      const int64_t chunk = std::min<int64_t>(to_reserve - done, half);
      std::vector<page_id_t> batch;
      batch.reserve(static_cast<size_t>(chunk));
      for (int64_t i = 0; i < chunk; ++i) batch.push_back(free_.pop_front());
      publish_inflight_locked();
      lk.unlock();
      MapOutcome r = map_pages(batch, map_deadline());
      lk.lock();
      if (r.ok()) {
        for (page_id_t id : batch) reserved_.push_back(id);
        done += chunk;
      } else {
        for (auto it = batch.rbegin(); it != batch.rend(); ++it) free_.push_front(*it);
        KVD_ERROR("Failed to preallocate %zu pages: %s (%s)", batch.size(), r.message.c_str(),
                  map_status_name(r.status));
      }
      publish_reserved_locked();
      publish_inflight_locked();
      if (waiters_ > 0) pages_cv_.notify_all();
      if (!r.ok()) {
        // Back off; the next trigger retries. Callers are not blocked meanwhile.
        worker_cv_.wait_for(lk, backoff, [&] { return !live(); });
        break;
      }
    }
    KVD_INFO("Preallocated %ld pages, reserved=%zu", static_cast<long>(done), reserved_.size());
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
  counters_.record_map(ns_between(t0, Clock::now()), page_ids.size());
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
  return counters_.snapshot(a_inflight_.load(std::memory_order_relaxed));
}

}  // namespace fixed
}  // namespace kvdiag
