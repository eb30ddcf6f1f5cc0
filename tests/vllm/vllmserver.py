"""A real `vllm serve` started by hand (not by kvdiag), as a user runs one beside `kvdiag watch`.

kvdiag's plugin is put on its PYTHONPATH the way kvdiag/launch/vllm.py stages it, with kvdiag's fixed page
allocator behind the EngineCore's KV blocks; ``stall_after_s`` sets KVDIAG_VLLM_STALL_AFTER_S (the plugin
then builds a stock engine-2 pool on the EngineCore main thread that many seconds into serving: a real GIL
cycle). Its own process group, its vLLM temp files in a private folder, torn down by :meth:`stop`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from kvdiag.allocator import remove_device_files
from kvdiag.launch.owned import OwnedFiles, sweep_shm, vllm_dist_idents
from kvdiag.launch.vllm import default_model, find_vllm, native_library, stage_plugin
from kvdiag.osread.children import children
from kvdiag.ports import free_port


class VllmServer:
    def __init__(self, log_path: Path, stall_after_s: float | None = None, port: int | None = None,
                 model: str | None = None, max_num_seqs: int | None = None, step_delay_ms: float | None = None) -> None:
        self.port = port or free_port("127.0.0.1")
        self.log_path = log_path
        self.model = model or default_model()
        self.stall_after_s = stall_after_s
        self.max_num_seqs = max_num_seqs
        self.step_delay_ms = step_delay_ms
        self.device = f"kvdiag-watch-{uuid.uuid4().hex[:8]}"
        self.private = Path(tempfile.mkdtemp(prefix="kvdiag-watch-vllm-"))
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def env(self) -> dict[str, str]:
        site = stage_plugin(self.private)
        old = os.environ.get("PYTHONPATH")
        env = {**os.environ,
               "PYTHONPATH": f"{site}{os.pathsep}{old}" if old else str(site),
               "KVDIAG_VLLM_ALLOCATOR": "fixed", "KVDIAG_VLLM_ENGINE": "watched",
               "KVDIAG_VLLM_LAYERS": "28", "KVDIAG_VLLM_KV_PER_LAYER_MB": "64", "KVDIAG_VLLM_DEVICE": self.device,
               "KVCACHED_PAGE_SIZE_MB": "2", "KVCACHED_MIN_RESERVED_PAGES": "5", "KVCACHED_MAX_RESERVED_PAGES": "10",
               "KVCACHED_PAGE_PREALLOC_ENABLED": "true", "KVCACHED_IPC_NAME": f"W{self.device[-8:]}",
               "TMPDIR": str(self.private), "VLLM_RPC_BASE_PATH": str(self.private),
               "VLLM_CACHE_ROOT": str(self.private / "cache"), "PYTHONUNBUFFERED": "1"}
        native = native_library()
        if native:
            env["KVDIAG_NATIVE_PATH"] = native
        if self.stall_after_s is not None:
            env["KVDIAG_VLLM_STALL_AFTER_S"] = f"{self.stall_after_s:g}"
        if self.step_delay_ms is not None:
            env["KVDIAG_VLLM_STEP_DELAY_MS"] = f"{self.step_delay_ms:g}"
        return env

    def start(self) -> VllmServer:
        argv = [find_vllm(None), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                "--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "4M"]
        if self.max_num_seqs is not None:
            argv += ["--max-num-seqs", str(self.max_num_seqs)]
        self.started = time.time()
        with open(self.log_path, "ab", buffering=0) as log:
            self.popen = subprocess.Popen(argv, env=self.env(), stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        return self

    def wait_ready(self, timeout_s: float = 180.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen is not None and self.popen.poll() is not None:
                return False
            try:
                if httpx.get(f"{self.url}/health", timeout=1, trust_env=False).status_code == 200:
                    return True
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(0.5)
        return False

    def engine_core_pid(self) -> int | None:
        for child in children(self.pid) or []:
            try:
                with open(f"/proc/{child}/comm") as fh:
                    if fh.read().strip() == "VLLM::EngineCor":
                        return child
            except OSError:
                continue
        return None

    def tree(self) -> list[int]:
        """The API server, its children and theirs (EngineCore, Worker, resource tracker)."""
        out, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children(pid) or [])
        return out

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        owned = OwnedFiles()
        if self.popen is not None:
            owned.observe(self.tree())   # what the server's processes hold is what this fixture may remove
            pgid = self.popen.pid
            for sig, wait_s in ((signal.SIGCONT, 0.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline:
                    self.popen.poll()
                    try:
                        os.killpg(pgid, 0)
                    except ProcessLookupError:
                        break
                    time.sleep(0.1)
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        remove_device_files(self.device)
        # What the killed tree left in /dev/shm (its queues, semaphores, TP segments), by kvdiag's own rule:
        # only files the tree was seen holding, once nobody holds them.
        sweep_shm(getattr(self, "started", time.time()), owned.seen, idents=vllm_dist_idents([self.private]))
        shutil.rmtree(self.private, ignore_errors=True)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
