"""Parsers, merge and /proc helpers, on raw outputs saved from real captures (tests/fixtures/bundles)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from kvdiag.capture.base import BackendResult
from kvdiag.capture.discover import _log_role, classify_title, log_prefix_pids
from kvdiag.capture.merge import merge_threads
from kvdiag.capture.parsers import parse_gdb, parse_gdb_frame, parse_pyspy, parse_pystack
from kvdiag.model.evidence import ThreadEvidence, ToolRun
from kvdiag.model.kinds import GilState, ProcessRole
from kvdiag.osread.elfsym import elf_symbol
from kvdiag.osread.syscall import futex_wait_of, parse_syscall
from kvdiag.osread.tasks import parse_kernel_stack

BUNDLES = Path(__file__).resolve().parents[1] / "fixtures" / "bundles"


def raw(bundle: str, tool: str) -> tuple[int, str]:
    """(pid, text) of the process that has this tool's raw output and is the engine core if any."""
    data = json.loads((BUNDLES / bundle / "bundle.json").read_text())
    for proc in data["processes"]:
        for run in proc["tools"]:
            if run["tool"] == tool and run.get("raw_path") and proc["role"] != "api_server":
                return proc["pid"], (BUNDLES / bundle / run["raw_path"]).read_text()
    raise LookupError(f"{bundle} has no {tool} output")


def test_pystack_flags_and_innermost_first() -> None:
    pid, text = raw("gil_cycle", "pystack")
    threads, _ = parse_pystack(text)
    by_tid = {t.tid: t for t in threads}
    assert by_tid[pid].gil is GilState.HOLDS
    waiting = [t for t in threads if t.gil is GilState.WAITING]
    assert len(waiting) == 2
    main = by_tid[pid]
    # innermost first: the futex wait is frame 0, alloc_page is above it, _start is last
    assert "futex" in main.frames[0].name
    assert main.frames[-1].name == "_start"
    names = [f.name for f in main.frames]
    assert names.index("alloc_page") < names.index("<module>")
    module = next(f for f in main.frames if f.name == "<module>")
    assert module.kind == "python" and module.file and module.file.endswith("gil_cycle.py")
    assert module.source and "alloc_page" in module.source
    lib = next(f for f in main.frames if f.name == "alloc_page")
    assert lib.library and lib.library.endswith(".so") and lib.line


def test_pystack_stripped_interpreter_has_no_waiting_flag_for_native_worker() -> None:
    pid, text = raw("gil_cycle_stripped", "pystack")
    threads, _ = parse_pystack(text)
    worker = next(t for t in threads if t.tid != pid)
    assert worker.gil is GilState.UNKNOWN          # pystack cannot see take_gil by name
    names = [f.name for f in worker.frames]
    assert "take_gil" not in names and "???" in names
    assert names.index("PyGILState_Ensure") < names.index("map_pages")


def test_pystack_real_vllm_enginecore() -> None:
    _, text = raw("vllm_idle", "pystack")
    threads, _ = parse_pystack(text)
    assert sorted(t.tid for t in threads) == [6898, 7044, 7049, 7052, 7056]
    main = next(t for t in threads if t.tid == 6898)
    assert main.name == "VLLM::EngineCor" and main.gil is GilState.UNKNOWN
    assert main.frames[0].name == "__futex_abstimed_wait_common64"


def test_pyspy_names_and_frames() -> None:
    pid, text = raw("gil_cycle", "py-spy")
    threads, version = parse_pyspy(text)
    assert version and version.startswith("3.")
    names = {t.tid: t.name for t in threads}
    assert names[pid] == "MainThread" and "ticker" in names.values()
    ticker = next(t for t in threads if t.name == "ticker")
    assert ticker.frames[0].name == "ticker" and ticker.frames[0].kind == "python"


def test_pyspy_native_real_vllm() -> None:
    _, text = raw("vllm_busy", "py-spy")
    threads, version = parse_pyspy(text)
    assert version == "3.11.7"
    main = next(t for t in threads if t.tid == 6898)
    assert main.frames[0].name == "sched_yield" and main.frames[0].kind == "native"
    assert main.frames[0].library == "libc.so.6"
    assert any(f.kind == "python" and f.name == "EngineCore.step" for f in main.frames)
    monitor = next(t for t in threads if t.name == "MultiprocWorkerMonitor")
    sel = next(f for f in monitor.frames if f.name == "select_poll_poll_impl")
    assert sel.kind == "native" and sel.file == "selectmodule.c" and sel.line == 655


def test_gdb_threads_and_frames() -> None:
    pid, text = raw("gil_cycle", "gdb")
    threads = parse_gdb(text)
    assert {t.tid for t in threads} >= {pid}
    main = next(t for t in threads if t.tid == pid)
    assert main.name == "VLLM::EngineCor"
    alloc = next(f for f in main.frames if f.name == "alloc_page")
    assert alloc.file and alloc.file.endswith("gil_cycle.c")
    worker = next(t for t in threads if any(f.name == "map_pages" for f in t.frames))
    assert [f.name for f in worker.frames].index("take_gil") < [f.name for f in worker.frames].index("map_pages")


def test_gdb_real_vllm_all_threads() -> None:
    _, text = raw("vllm_idle", "gdb")
    threads = parse_gdb(text)
    assert len(threads) == 15
    zmq = next(t for t in threads if t.tid == 7054)
    assert zmq.name == "ZMQbg/IO/0" and zmq.frames[0].name == "epoll_wait"
    assert zmq.frames[1].name == "??" and zmq.frames[1].library and "libzmq" in zmq.frames[1].library


@pytest.mark.parametrize("line, name, file, lib", [
    ("0x00007f in std::condition_variable::wait(std::unique_lock<std::mutex>&) () from /lib/libstdc++.so.6",
     "std::condition_variable::wait(std::unique_lock<std::mutex>&)", None, "/lib/libstdc++.so.6"),
    ("0x01 in std::function<void (long, std::vector<long> const&)>::operator()(long, std::vector<long> const&)"
     " const (this=0x1, __args#0=1) at /usr/include/c++/12/bits/std_function.h:591",
     "std::function<void (long, std::vector<long> const&)>::operator()(long, std::vector<long> const&) const",
     "/usr/include/c++/12/bits/std_function.h", None),
    ("take_gil (tstate=tstate@entry=0x7f) at Python/ceval_gil.h:231", "take_gil", "Python/ceval_gil.h", None),
    ('0x7f in alloc_page (ready_fd=1, ready_msg=0x7f "READY (x)\\n") at gil_cycle.c:66', "alloc_page",
     "gil_cycle.c", None),
    ("0x00007f6a43d80af8 in ?? () from /tmp/libzmq.so.5", "??", None, "/tmp/libzmq.so.5"),
])
def test_gdb_frame_shapes(line: str, name: str, file: str | None, lib: str | None) -> None:
    f = parse_gdb_frame(line.split(" in ", 1)[1] if line.startswith("0x") else line)
    assert (f.name, f.file, f.library) == (name, file, lib)


def test_kernel_stack_and_syscall() -> None:
    assert parse_kernel_stack("[<0>] futex_wait_queue+0x60/0x90\n[<0>] do_futex+0x1/0x2\n") == [
        "futex_wait_queue", "do_futex"]
    nr, args = parse_syscall("202 0x7f20d4f4e6f4 0x89 0x0 0x7f 0x0 0xffffffff 0x7ffc 0x7f20")
    assert nr == 202 and args[0] == 0x7F20D4F4E6F4 and args[1] == 0x89
    assert futex_wait_of("202 0x1000 0x80 0x2 0x0 0x0 0x0 0x0 0x0") == (0x1000, 0)
    assert futex_wait_of("0 0x3 0x7ff 0x4 0x0 0x0 0x0 0x0 0x0") is None
    assert parse_syscall("running") == (None, [])
    assert parse_syscall("-1 0x7ffc 0x7f20") == (-1, [])


def test_merge_prefers_richest_stack_and_pystack_gil() -> None:
    pid, _ = raw("gil_cycle", "pystack")
    results: dict[str, BackendResult] = {}
    for tool, parse in (("pystack", lambda t: parse_pystack(t)[0]), ("py-spy", lambda t: parse_pyspy(t)[0]),
                        ("gdb", parse_gdb)):
        _, text = raw("gil_cycle", tool)
        results[tool] = BackendResult(tool=ToolRun(tool=tool, ok=True), threads=parse(text))
    results["proc"] = BackendResult(tool=ToolRun(tool="proc", ok=True),
                                    threads=[ThreadEvidence(tid=pid, gil=GilState.NONE)])
    merged = {t.tid: t for t in merge_threads(results)}
    main = merged[pid]
    assert set(main.frames_by_tool) == {"pystack", "py-spy", "gdb"}
    assert main.frames == main.frames_by_tool["pystack"]          # Python + native beats native only
    assert main.gil is GilState.HOLDS and main.gil_by_tool["proc"] is GilState.NONE
    assert main.name == "MainThread"                               # py-spy's Python thread name


def test_elf_symbol_matches_nm() -> None:
    libdir, name = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    nm = shutil.which("nm")
    if not (sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and name and nm):
        pytest.skip("needs a shared libpython and nm")
    path = Path(libdir) / name
    found = elf_symbol(path, "_PyRuntime")
    assert found is not None
    sym, _, _ = found
    out = subprocess.run([nm, "-D", "-S", str(path)], capture_output=True, text=True, timeout=60).stdout
    line = next(ln for ln in out.splitlines() if ln.endswith(" _PyRuntime"))
    value, size = (int(x, 16) for x in line.split()[:2])
    assert (sym.value, sym.size) == (value, size)
    assert elf_symbol(path, "no_such_symbol_kvdiag") is None


@pytest.mark.parametrize("cmdline, comm, role", [
    ("VLLM::EngineCore", "VLLM::EngineCor", ProcessRole.ENGINE_CORE),
    ("VLLM::EngineCore_DP0", "VLLM::EngineCor", ProcessRole.ENGINE_CORE),
    ("VLLM::Worker_TP1", "VLLM::Worker_TP", ProcessRole.WORKER),
    ("/v/bin/python3 /v/bin/vllm serve /m --port 8000", "vllm", ProcessRole.API_SERVER),
    ("/v/bin/python3 -B -c from multiprocessing.resource_tracker import main;main(32)", "python3",
     ProcessRole.OTHER),
    # an API server whose arguments mention EngineCore is still not an engine core
    ("python serve.py --title VLLM::EngineCore", "python", ProcessRole.OTHER),
])
def test_classify_title(cmdline: str, comm: str, role: ProcessRole) -> None:
    assert classify_title(cmdline, comm) is role


def test_log_prefix_pids() -> None:
    lines = ["(APIServer pid=6790) INFO 12-03 06:15:30 [api_utils.py:286] non-default args: {}",
             "(EngineCore pid=6898) INFO 12-03 06:15:40 [core.py:133] Initializing a V1 LLM engine",
             "(VllmWorker-0 pid=6946) WARNING 12-03 06:15:45 [vllm.py:725] ...",
             "(EngineCore_DP1 pid=7001) INFO ...", "(EngineCore pid=1) a later line does not win"]
    pids = log_prefix_pids(lines)
    assert pids == {"api_server": 6790, "engine_core": 6898, "worker": 6946, "EngineCore_DP1": 7001}
    assert _log_role("EngineCore_DP1") is ProcessRole.ENGINE_CORE


def test_pystack_locals_keep_only_lock_objects() -> None:
    """Real `pystack remote --locals --native-all` output of two threads taking two locks in opposite
    orders (tests/fixtures/raw/pystack_locals.txt; one frame has a `password` argument): only the
    lock-typed locals survive, name and address, and the frames' source lines are still read."""
    from kvdiag.capture.parsers import keep_lock_locals

    text = (Path(__file__).resolve().parents[1] / "fixtures" / "raw" / "pystack_locals.txt").read_text()
    assert "hunter2" in text and "<Thread at" in text
    kept = keep_lock_locals(text)
    assert "hunter2" not in kept and "password" not in kept and "<Thread at" not in kept and "self:" not in kept
    threads, _ = parse_pystack(kept)
    workers = [t for t in threads if any(f.name == "t1" for f in t.frames)]
    assert len(workers) == 2
    frames = [next(f for f in t.frames if f.name == "t1") for t in workers]
    assert all(f.source == "with second:" and set(f.locks) == {"first", "second"} for f in frames)
    a, b = frames
    assert a.locks["first"] == b.locks["second"] and a.locks["second"] == b.locks["first"]
    assert all(not f.locks for t in threads for f in t.frames if f.name != "t1")


def test_pyspy_locals_keep_only_integer_step_counters() -> None:
    """Real `py-spy dump --nonblocking --locals` output of a gloo rank parked in broadcast
    (tests/fixtures/raw/pyspy_locals_rank.txt): only the integer step counters survive, on their frames;
    every other local (tensors, modules, kwargs, a rank argument) and the Arguments/Locals headers go."""
    from kvdiag.capture.parsers import keep_step_locals

    text = (Path(__file__).resolve().parents[1] / "fixtures" / "raw" / "pyspy_locals_rank.txt").read_text()
    assert "<Tensor at" in text and "kwargs:" in text and "rank: 1" in text
    kept = keep_step_locals(text)
    for gone in ("<Tensor at", "kwargs", "rank:", "src:", "Arguments:", "Locals:", "odd:", "<module at"):
        assert gone not in kept, gone
    threads, version = parse_pyspy(kept)
    assert version == "3.11.7" and len(threads) == 1
    frames = threads[0].frames
    assert [f.name for f in frames][:3] == ["broadcast", "_exception_logger.<locals>.wrapper", "mismatched_broadcast"]
    assert all(f.kind == "python" for f in frames)
    counted = {f.name: f.counters for f in frames if f.counters}
    assert counted == {"mismatched_broadcast": {"step": 1}, "_rank_main": {"step": 1}}
    # The same parser reads py-spy without --locals as before: no counters.
    plain, _ = parse_pyspy("\n".join(ln for ln in kept.splitlines() if ": " not in ln or "Thread" in ln))
    assert plain[0].frames == [f.model_copy(update={"counters": {}}) for f in frames]
