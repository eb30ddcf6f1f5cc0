// kvdiag native allocators: a Python-free check of the CUDA backend on a real GPU.
//
// Contract of this file (pure C++, no Python):
//   Locks:   only the allocators' and the backend's own (see their headers).
//   GIL:     there is no interpreter in this program.
//   Waits:   the fixed allocator bounds every wait (map_timeout_ms); wait_prealloc_idle is bounded.
// Usage: kvdiag_cuda_check [tag] [hold_s]
// Maps pages through both allocators with backend="cuda", checks that cuMemGetInfo's free bytes
// drop and come back by the expected amounts, optionally holds the mapping for hold_s seconds (to
// run two processes side by side on one GPU), and exits 1 on any mismatch or error.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "fixed_allocator.hpp"
#include "stock_allocator.hpp"

using namespace kvdiag;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) failures++;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string tag = argc > 1 ? argv[1] : "a";
  const int hold_s = argc > 2 ? std::atoi(argv[2]) : 0;
  const int64_t MB = 1024 * 1024;
  AllocatorConfig cfg;
  cfg.backend = "cuda";
  cfg.device_name = "kvdiag-gpucheck";
  cfg.num_layers = 4;
  cfg.page_size = 2 * MB;
  cfg.mem_size_per_layer = 16 * cfg.page_size;
  cfg.enable_prealloc = false;
  cfg.min_reserved_pages = 0;
  cfg.max_reserved_pages = 0;
  const int64_t per_page = cfg.page_size * cfg.num_layers * cfg.num_kv_buffers;  // 16 MB

  try {
    auto fixed = fixed::PageAllocator::create(cfg);
    // get_avail_physical_pages() is cuMemGetInfo's free bytes (minus headroom) in 16 MB pages.
    const int64_t avail0 = fixed->get_avail_physical_pages();
    std::printf("[%s] pid=%d avail_physical_pages=%ld (16 MB each)\n", tag.c_str(), getpid(), static_cast<long>(avail0));
    std::vector<page_id_t> pages;
    for (int i = 0; i < 8; ++i) pages.push_back(fixed->alloc_page());
    expect(fixed->get_num_mapped_pages() == 8, "fixed: 8 pages mapped through cuMemCreate/cuMemMap");
    const int64_t avail1 = fixed->get_avail_physical_pages();
    std::printf("[%s] after 8 pages (128 MB): avail_physical_pages=%ld (delta %ld)\n", tag.c_str(), static_cast<long>(avail1),
                static_cast<long>(avail0 - avail1));
    expect(avail0 - avail1 >= 7 && avail0 - avail1 <= 9, "fixed: cuMemGetInfo free bytes dropped by ~8 pages");
    if (hold_s > 0) std::this_thread::sleep_for(std::chrono::seconds(hold_s));
    fixed->free_pages(pages);
    fixed->trim();
    expect(fixed->get_num_mapped_pages() == 0, "fixed: all pages unmapped and released");
    const int64_t avail2 = fixed->get_avail_physical_pages();
    expect(avail2 - avail1 >= 7, "fixed: free bytes came back");

    AllocatorConfig pc = cfg;
    pc.enable_prealloc = true;
    pc.min_reserved_pages = 5;
    pc.max_reserved_pages = 5;
    stock::PageAllocator stock(pc);
    stock.start_prealloc_thread();
    expect(stock.wait_prealloc_idle(30.0), "stock: prealloc worker went idle");
    expect(stock.get_num_reserved_pages() == 5 && stock.get_num_mapped_pages() == 5, "stock: worker reserved 5 pages on the GPU");
    page_id_t p = stock.alloc_page();
    expect(p == 0, "stock: fast path served page 0");
    stock.free_page(p);
    stock.stop_prealloc_thread();
    std::printf("[%s] per-page bytes %ld; counters: fixed map_calls=%ld map_ns_max=%ld\n", tag.c_str(), static_cast<long>(per_page),
                static_cast<long>(fixed->counters().map_calls), static_cast<long>(fixed->counters().map_ns_max));
  } catch (const std::exception& e) {
    std::printf("FAIL exception: %s\n", e.what());
    return 1;
  }
  std::printf("[%s] %s\n", tag.c_str(), failures ? "FAILED" : "PASSED");
  return failures ? 1 : 0;
}
