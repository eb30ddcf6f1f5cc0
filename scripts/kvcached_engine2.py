"""Drive upstream kvcached (0.1.6 sdist, C++ PageAllocator with the #422 fix) through the seed's
engine-2 start-up on a real GPU: KV tensors for 28 layers x 11 MB, a prealloc-enabled
PageAllocator (5 pages == min_reserved_pages), then the null-block alloc_page on the main thread,
the way vLLM's EngineCore does at TP=1. Prints the banner (from C++) and "STARTED <seconds>".
Used by scripts/gpu_proof.sh and scripts/gpu_issue31.sh (KVDIAG_E2_IPC_CALLBACK=1 registers the
should_use_worker_ipc callback as KVCacheManager does); needs torch with CUDA and kvcached installed.
"""

from __future__ import annotations

import os
import signal
import time

signal.alarm(50)  # a regression must not wedge the GPU proof run
os.environ.setdefault("KVCACHED_PAGE_PREALLOC_ENABLED", "true")
os.environ.setdefault("KVCACHED_IPC_NAME", "KVDIAG_ENG2")

import faulthandler  # noqa: E402
import sys  # noqa: E402

import kvcached.vmm_ops as ops  # noqa: E402
import torch  # noqa: E402

faulthandler.enable()
MB = 1024 * 1024
# The seed's 11 MB per layer is rounded by kvcached to whole 2 MB pages; 10 MB keeps the same
# 5-page pool (== min_reserved_pages) without the alignment step. argv[1] may override (MB).
LAYERS, PER_LAYER, PAGE = 28, int(sys.argv[1] if len(sys.argv) > 1 else 10) * MB, 2 * MB
ASYNC = (sys.argv[2] if len(sys.argv) > 2 else "0") == "1"

t0 = time.monotonic()
torch.cuda.init()
ops.init_kvcached("cuda:0", PAGE, True)
# create_kv_tensors takes the bytes of one layer's K and V together (the PageAllocator's
# mem_size_per_layer is one of them): a compound page spans every layer's K and V.
ops.create_kv_tensors(PER_LAYER * 2, 2, "cuda:0", LAYERS, 2, 0, False)
alloc = ops.PageAllocator(num_layers=LAYERS, mem_size_per_layer=PER_LAYER, page_size=PAGE, world_size=1,
                          pp_rank=0, async_sched=ASYNC, contiguous_layout=True, enable_page_prealloc=True,
                          num_kv_buffers=2, group_id=0, ipc_name="KVDIAG_ENG2")
# The Python work of the callback and the engine's own work between starting the prealloc thread and its
# first alloc_page (vLLM builds its block pool there). With the pre-fix build the first alloc_page comes while
# the worker, holding every free page, runs the callback: alloc_page then waits for it holding the GIL, and
# the callback cannot get the GIL back to return.
CALLBACK_WORK_S = float(os.environ.get("KVDIAG_E2_CALLBACK_WORK_MS", "20")) / 1000
GAP_S = float(os.environ.get("KVDIAG_E2_GAP_MS", "10")) / 1000


def should_use_worker_ipc() -> bool:
    end = time.monotonic() + CALLBACK_WORK_S
    while time.monotonic() < end:   # Python work: holds the GIL, gives it up only at switch intervals
        pass
    return False


if os.environ.get("KVDIAG_E2_IPC_CALLBACK") == "1":
    # What kvcached's KVCacheManager registers: a Python callable the prealloc worker calls from map_pages,
    # which takes the GIL there (the pre-fix alloc_page keeps it while it waits: kvcached #371).
    # The fixed build (0.1.6) takes a plain bool instead, so its prealloc worker never calls into Python.
    if hasattr(alloc, "set_should_use_worker_ipc_callback"):
        alloc.set_should_use_worker_ipc_callback(should_use_worker_ipc)
    else:
        alloc.set_use_worker_ipc(False)
alloc.start_prealloc_thread()
time.sleep(GAP_S)
page = alloc.alloc_page()  # the null block; with the pre-fix allocator this is where it hung
print(f"STARTED {time.monotonic() - t0:.3f} page={page.page_id} free={alloc.get_num_free_pages()}", flush=True)
alloc.stop_prealloc_thread()
ops.shutdown_kvcached()
