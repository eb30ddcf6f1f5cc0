// kvdiag native allocators: multi-threaded stress driver over the allocator core (no Python).
//
// Contract of this file (pure C++, no Python):
//   Locks:   the allocators' own; ownership of pages is tracked in an array of atomics (a page
//            handed out twice is counted in double_allocs). first_error is guarded by err_mu.
//            Op tallies are per thread, summed into the shared totals when the thread ends;
//            the ownership flags and each thread's held-page buffer sit on cache lines of their
//            own (LineArray/LineAllocator), so the driver adds no false sharing to what it measures.
//   GIL:     never touched.
//   Waits:   per-op latency is measured; > stall_ms is a stall. Joins at the end are bounded by the
//            op budget because every allocator call used here is bounded (fixed) or cannot wait
//            on Python (stock without callbacks).
#include "stress.hpp"

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "fixed_allocator.hpp"
#include "page_ring.hpp"
#include "stock_allocator.hpp"

namespace kvdiag {

namespace {

// Uniform view over both allocators for the driver.
struct AnyAllocator {
  std::shared_ptr<fixed::PageAllocator> fixed_;
  std::unique_ptr<stock::PageAllocator> stock_;

  page_id_t alloc() { return fixed_ ? fixed_->alloc_page() : stock_->alloc_page(); }
  void free_one(page_id_t id) { fixed_ ? fixed_->free_page(id) : stock_->free_page(id); }
  void free_many(const std::vector<page_id_t>& ids) { fixed_ ? fixed_->free_pages(ids) : stock_->free_pages(ids); }
  void trigger() { fixed_ ? fixed_->trigger_preallocation() : stock_->trigger_preallocation(); }
  bool resize(int64_t bytes) { return fixed_ ? fixed_->resize(bytes) : stock_->resize(bytes); }
  void trim() { fixed_ ? fixed_->trim() : stock_->trim(); }
  void start() { fixed_ ? fixed_->start_prealloc_thread() : stock_->start_prealloc_thread(); }
  void stop() { fixed_ ? fixed_->stop_prealloc_thread() : stock_->stop_prealloc_thread(); }
  int64_t num_free() const { return fixed_ ? fixed_->get_num_free_pages() : stock_->get_num_free_pages(); }
  int64_t num_total() const { return fixed_ ? fixed_->get_num_total_pages() : stock_->get_num_total_pages(); }
  int64_t inflight() const { return fixed_ ? fixed_->get_num_inflight_pages() : stock_->get_num_inflight_pages(); }
  CounterSnapshot counters() const { return fixed_ ? fixed_->counters() : stock_->counters(); }
};

struct Shared {
  LineArray<std::atomic<uint8_t>> owned;  // on its own cache lines, like the allocators' arrays
  std::atomic<int64_t> ops{0}, max_op_ns{0}, stalls{0}, allocs{0}, frees{0}, oop{0}, timeouts{0}, errors{0},
      double_allocs{0}, resizes_ok{0};
  std::mutex err_mu;
  std::string first_error;
  explicit Shared(size_t n) : owned(n, uint8_t{0}) {}
  void error(const std::string& what) {
    errors++;
    std::lock_guard<std::mutex> g(err_mu);
    if (first_error.empty()) first_error = what;
  }
};

void run_thread(AnyAllocator& a, Shared& sh, const StressOptions& o, int64_t my_ops, uint64_t seed, int64_t pool) {
  std::mt19937_64 rng(seed);
  // Written on every op: on cache lines of its own, not next to another thread's (same arena).
  std::vector<page_id_t, LineAllocator<page_id_t>> held;
  held.reserve(static_cast<size_t>(o.hold_max) + 1);
  const int64_t stall_ns = o.stall_ms * 1000000;
  const bool pairs = o.mode == "alloc_free";
  int64_t local_max = 0;
  // Per-thread tallies, added to the shared totals once at the end: shared atomic counters
  // would bounce one cache line between cores on every op and dominate what is measured.
  int64_t allocs = 0, frees = 0, oop = 0, stalls = 0;
  auto take = [&](page_id_t id) {
    if (sh.owned[static_cast<size_t>(id)].exchange(1) != 0) sh.double_allocs++;
    held.push_back(id);
    allocs++;
  };
  auto give = [&](page_id_t id) {
    sh.owned[static_cast<size_t>(id)].store(0);
    frees++;
  };
  for (int64_t i = 0; i < my_ops; ++i) {
    const auto t0 = Clock::now();
    try {
      if (pairs) {
        page_id_t id = a.alloc();
        take(id);
        held.pop_back();
        give(id);
        a.free_one(id);
      } else {
        const unsigned r = static_cast<unsigned>(rng() % 1000);
        if (held.empty() || (r < 450 && static_cast<int64_t>(held.size()) < o.hold_max)) {
          take(a.alloc());
        } else if (r < 880) {
          size_t k = static_cast<size_t>(rng() % held.size());
          page_id_t id = held[k];
          held[k] = held.back();
          held.pop_back();
          give(id);
          a.free_one(id);
        } else if (r < 940) {
          std::vector<page_id_t> batch(held.begin(), held.end());
          held.clear();
          for (page_id_t id : batch) give(id);
          a.free_many(batch);
        } else if (r < 975) {
          a.trigger();
        } else if (r < 997) {
          // Shrink a little or grow back to the full pool.
          int64_t total = a.num_total();
          int64_t target = (rng() & 1) ? pool : std::max<int64_t>(1, total - 1 - static_cast<int64_t>(rng() % 3));
          if (a.resize(target * o.cfg.page_size)) sh.resizes_ok++;
        } else {
          a.trim();
        }
      }
    } catch (const AllocatorTimeout& e) {
      sh.timeouts++;
      sh.error(std::string("AllocatorTimeout: ") + e.what());
    } catch (const std::runtime_error& e) {
      if (std::string(e.what()).rfind("No free pages left", 0) == 0)
        oop++;
      else
        sh.error(e.what());
    } catch (const std::exception& e) {
      sh.error(e.what());
    }
    const int64_t ns = ns_between(t0, Clock::now());
    local_max = std::max(local_max, ns);
    if (ns > stall_ns) stalls++;
  }
  if (!held.empty()) {
    for (page_id_t id : held) give(id);
    try {
      a.free_many(std::vector<page_id_t>(held.begin(), held.end()));
    } catch (const std::exception& e) {
      sh.error(e.what());
    }
  }
  sh.ops += my_ops;
  sh.allocs += allocs;
  sh.frees += frees;
  sh.oop += oop;
  sh.stalls += stalls;
  int64_t prev = sh.max_op_ns.load();
  while (local_max > prev && !sh.max_op_ns.compare_exchange_weak(prev, local_max)) {
  }
}

}  // namespace

StressResult run_stress(const StressOptions& o) {
  if (o.threads < 1 || o.threads > 256) throw InvalidArgument("threads", "must be in [1, 256]");
  if (o.ops < 0) throw InvalidArgument("ops", "must be >= 0");
  if (o.kind != "fixed" && o.kind != "stock") throw InvalidArgument("kind", "must be 'fixed' or 'stock'");
  if (o.mode != "random" && o.mode != "alloc_free") throw InvalidArgument("mode", "must be 'random' or 'alloc_free'");
  AnyAllocator a;
  AllocatorConfig cfg = o.cfg;
  cfg.print_banner = false;
  if (o.kind == "fixed")
    a.fixed_ = fixed::PageAllocator::create(cfg);
  else
    a.stock_ = std::make_unique<stock::PageAllocator>(cfg);
  const int64_t pool = cfg.mem_size_per_layer / cfg.page_size;
  Shared sh(static_cast<size_t>(pool));
  if (o.start_prealloc) a.start();
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < o.threads; ++t) {
    int64_t share = o.ops / o.threads + (t < o.ops % o.threads ? 1 : 0);
    ts.emplace_back(run_thread, std::ref(a), std::ref(sh), std::cref(o), share, o.seed * 7919 + static_cast<uint64_t>(t), pool);
  }
  for (auto& t : ts) t.join();
  StressResult r;
  r.elapsed_ns = ns_between(t0, Clock::now());
  a.stop();
  // Restore the full pool so the final counts are comparable.
  a.resize(pool * cfg.page_size);
  r.ops = sh.ops;
  r.max_op_ns = sh.max_op_ns;
  r.stalls = sh.stalls;
  r.allocs = sh.allocs;
  r.frees = sh.frees;
  r.out_of_pages = sh.oop;
  r.timeouts = sh.timeouts;
  r.errors = sh.errors;
  r.double_allocs = sh.double_allocs;
  r.resizes_ok = sh.resizes_ok;
  r.final_free = a.num_free();
  r.final_total = a.num_total();
  r.final_inflight = a.inflight();
  r.first_error = sh.first_error;
  r.counters = a.counters();
  return r;
}

}  // namespace kvdiag
