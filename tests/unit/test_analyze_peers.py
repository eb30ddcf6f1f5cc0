"""Never a false deadlock across processes: a blocked read is judged with its peer.

Bundles (real captures, tests/fixtures/bundles):
- sim_idle_always: `kvdiag repro two-engine --allocator fixed` with `capture: {when: always}`, both
  simulated engines idle and healthy (API server + EngineCore each, fd peers from /proc);
- vllm_two_engine_stock: the real vLLM CPU two-engine stock run (tests/vllm), engine 2's EngineCore
  hung in a GIL cycle while its API server and Worker wait on it;
- vllm_idle: a real idle vLLM tree (API server, EngineCore, Worker; the shared vLLM captures), captured
  before the fd peers existed: the peers are added here as capture/fds.py reports them.
"""

from __future__ import annotations

from pathlib import Path

from kvdiag.analyze.diagnosis import exit_code_for
from kvdiag.analyze.overall import analyze, analyze_by_engine
from kvdiag.analyze.process import analyze_process
from kvdiag.bundle.io import load_bundle
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import FdInfo, ProcessEvidence
from kvdiag.model.kinds import EnginePhase, ProcessRole, ThreadState, VerdictKind
from kvdiag.model.run import EngineRecord

BUNDLES = Path(__file__).resolve().parents[1] / "fixtures" / "bundles"


def load(name: str) -> Bundle:
    return load_bundle(BUNDLES / name)[0]


def _proc(bundle: Bundle, role: ProcessRole, engine: str | None = None) -> ProcessEvidence:
    return next(p for p in bundle.processes if p.role is role and (engine is None or p.engine == engine))


def _without_io_threads(proc: ProcessEvidence) -> None:
    """Drop ZMQ's I/O threads: they wait on the outside world and so could still act, which keeps any
    rule from firing. Without them each process is judged on its own waits alone: the harshest case,
    the one that produced the false deadlocks."""
    proc.threads = [t for t in proc.threads if not (t.name or "").startswith("ZMQbg/")]


def _park(proc: ProcessEvidence, tid: int, fds: list[FdInfo]) -> None:
    """Make thread ``tid`` an untimed wait on ``fds`` that neither ran nor woke during the window."""
    th = next(t for t in proc.threads if t.tid == tid)
    th.wait_timeout_ms = -1
    th.ctx_switches_delta = 0
    th.cpu_ticks_delta = 0
    th.blocked_fds = fds


def _conn(kind: str, peer: ProcessEvidence, accepted: bool = False) -> FdInfo:
    return FdInfo(fd=7, kind=kind, proto="unix" if kind == "socket" else None, inode=4242,
                  peer_pids=[peer.pid], peer_comm=peer.comm, accepted=accepted)


# ---------------------------------------------------------------- idle simulated engines


def test_idle_sim_engines_captured_always_are_healthy() -> None:
    bundle = load("sim_idle_always")
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.HEALTHY, verdict.summary
    assert exit_code_for(verdict) == 0
    assert {v.kind for v in analyze_by_engine(bundle).values()} == {VerdictKind.HEALTHY}


def test_idle_sim_engine_is_healthy_when_the_fd_peers_could_not_be_resolved() -> None:
    """The reported false deadlock: without peers (sock_diag failed or timed out on a busy host) the
    EngineCore's input thread, blocked reading its API server's socket, was called a blocked IPC read
    although its main thread kept waking. A background reader is not a hang while another thread acts."""
    bundle = load("sim_idle_always")
    for p in bundle.processes:
        for t in p.threads:
            for f in t.blocked_fds:
                f.peer_pids, f.peer_comm = [], None
    core = _proc(bundle, ProcessRole.ENGINE_CORE)
    reader = next(t for t in core.threads if t.name == "process_input_sockets")
    main = next(t for t in core.threads if t.tid == core.pid)
    assert reader.blocked_fds and (main.ctx_switches_delta or 0) > 0   # the shape that was misjudged
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.HEALTHY, verdict.summary


def test_a_main_thread_blocked_reading_is_still_a_blocked_read() -> None:
    """The change is about background readers: a process whose main thread is stuck in the read, and
    nothing else of it moves, stays a blocked IPC read (the corpus' ipc_read shapes)."""
    verdict = analyze(load("ipc_read"))
    assert verdict.kind is VerdictKind.BLOCKED_IPC_READ, verdict.summary


# ---------------------------------------------------------------- real vLLM: a hung EngineCore


def _stock() -> tuple[Bundle, ProcessEvidence, ProcessEvidence]:
    bundle = load("vllm_two_engine_stock")
    return bundle, _proc(bundle, ProcessRole.API_SERVER, "vlm"), _proc(bundle, ProcessRole.ENGINE_CORE, "vlm")


def _park_api_loop_on_core(api: ProcessEvidence, core: ProcessEvidence) -> None:
    """The shape reported from the real run: the API server's loop parked in poll with no timeout on
    the EngineCore's pipe only (a blocked IPC read on its own)."""
    _without_io_threads(api)
    _park(api, api.pid, [_conn("pipe", core)])
    for t in api.threads:
        if t.tid != api.pid:
            t.ctx_switches_delta, t.cpu_ticks_delta = 0, 0


def test_real_vllm_stock_engine_two_is_the_engine_core_gil_cycle() -> None:
    bundle, _, core = _stock()
    verdict = analyze_by_engine(bundle)["vlm"]
    assert verdict.kind is VerdictKind.GIL_CYCLE and f"pid {core.pid}" in verdict.summary, verdict.summary
    assert analyze_by_engine(bundle)["coder"].kind is VerdictKind.HEALTHY


def test_api_server_loop_parked_on_a_hung_engine_core_defers_to_it() -> None:
    bundle, api, core = _stock()
    _park_api_loop_on_core(api, core)
    alone = analyze_process(api, bundle.host.machine, "vlm")
    assert alone is not None and alone.kind is VerdictKind.BLOCKED_IPC_READ   # on its own, it is one
    verdict = analyze_by_engine(bundle)["vlm"]
    assert verdict.kind is VerdictKind.GIL_CYCLE and f"pid {core.pid}" in verdict.summary, verdict.summary
    notes = [f.message for f in verdict.findings if f.kind == "waits_on_hung_peer"]
    assert any(f"pid {api.pid} waits on pid {core.pid}" in m and "gil_cycle" in m for m in notes), notes


def test_deferral_does_not_depend_on_severity_order() -> None:
    """The API server's read defers even when the EngineCore's own verdict ranks below a blocked read
    (a stopped EngineCore): the engine's verdict is the EngineCore's, never the API server's read."""
    bundle, api, core = _stock()
    _park_api_loop_on_core(api, core)
    core.state = ThreadState.STOPPED
    for t in core.threads:
        t.state = ThreadState.STOPPED
    verdict = analyze_by_engine(bundle)["vlm"]
    assert verdict.kind is VerdictKind.STOPPED and f"pid {core.pid}" in verdict.summary, verdict.summary


def test_hung_engine_core_captured_without_an_engine_is_adopted_by_the_waiting_engine() -> None:
    bundle, api, core = _stock()
    _park_api_loop_on_core(api, core)
    core.engine = None
    verdict = analyze_by_engine(bundle)["vlm"]
    assert verdict.kind is VerdictKind.GIL_CYCLE and f"pid {core.pid}" in verdict.summary, verdict.summary


def test_a_read_cycle_between_two_captured_processes_stays_a_deadlock() -> None:
    """Each waits for the other to write: not a consequence of anything else, a real cross-process hang."""
    bundle = load("ipc_read")
    client = bundle.processes[0]
    server = client.model_copy(deep=True)
    server.pid = client.pid + 1000
    server.threads[0].tid = server.pid
    for t in server.threads:
        t.blocked_fds = []
    reader = next(t for t in client.threads if t.tid == client.pid)
    reader.blocked_fds = [_conn("socket", server)]
    next(t for t in server.threads if t.tid == server.pid).blocked_fds = [_conn("socket", client)]
    bundle.processes.append(server)
    verdict = analyze(bundle)
    assert verdict.kind is VerdictKind.BLOCKED_IPC_READ, verdict.summary


# ---------------------------------------------------------------- real vLLM: an idle tree


def _idle_vllm_engine() -> tuple[Bundle, ProcessEvidence, ProcessEvidence, ProcessEvidence]:
    bundle = load("vllm_idle")
    api = _proc(bundle, ProcessRole.API_SERVER)
    core = _proc(bundle, ProcessRole.ENGINE_CORE)
    worker = _proc(bundle, ProcessRole.WORKER)
    for p in (api, core, worker):
        _without_io_threads(p)
        p.engine = "e"
        for t in p.threads:     # a sample window in which nothing ran or woke: the harshest idle
            t.ctx_switches_delta, t.cpu_ticks_delta = 0, 0
    core.ppid, worker.ppid = api.pid, core.pid
    # as during start-up, before the API server starts its engine monitor (a sentinel poll, which
    # could still act): nothing of the API server moves but its loop
    api.threads = [t for t in api.threads if t.name != "MPClientEngineMonitor"]
    bundle.engines = [EngineRecord(name="e", phase=EnginePhase.SERVING, healthy=True)]
    return bundle, api, core, worker


def test_idle_vllm_tree_with_fd_peers_is_healthy() -> None:
    """pystack_enginecore.txt / pyspy_idle_worker_api.txt shapes, with the peers capture reports: the API
    server's loop waits on its EngineCore, the EngineCore's input thread and worker monitor poll with no
    timeout on the API server and the Worker, the Worker's loop and death-pipe monitor wait on the
    EngineCore. Every process waits for another part of its own engine, none is hung: healthy."""
    bundle, api, core, worker = _idle_vllm_engine()
    _park(api, api.pid, [_conn("pipe", core)])
    _park(core, next(t.tid for t in core.threads if "process_input_sockets" in (t.name or "")),
          [_conn("socket", api)])
    _park(core, next(t.tid for t in core.threads if t.name == "MultiprocWorkerMonitor"), [_conn("pipe", worker)])
    _park(worker, worker.pid, [_conn("socket", core)])
    _park(worker, next(t.tid for t in worker.threads if t.name == "DeathPipeMonitor"), [_conn("pipe", core)])
    alone = analyze_process(api, bundle.host.machine, "e")
    assert alone is not None and alone.kind is VerdictKind.BLOCKED_IPC_READ   # the shape that misled
    verdict = analyze_by_engine(bundle)["e"]
    assert verdict.kind is VerdictKind.HEALTHY, verdict.summary
    assert any(f.kind == "waits_on_own_engine" and f"pid {api.pid}" in f.message for f in verdict.findings)


def test_vllm_engine_liveness_monitor_is_idle_by_design() -> None:
    """The API server's MPClientEngineMonitor waits, with no timeout, on the EngineCore's process
    sentinel (a pipe) for it to die: that wait is the engine's health, not a read."""
    from kvdiag.analyze.classify import classify_process

    bundle, api, core, _ = _idle_vllm_engine()
    monitor = api.threads[-1].model_copy(deep=True)
    monitor.tid, monitor.name = api.pid + 500, "MPClientEngineMonitor"
    api.threads.append(monitor)
    _park(api, monitor.tid, [_conn("pipe", core)])
    view = next(t for t in classify_process(api, None) if t.tid == monitor.tid)
    assert view.idle_by_design


def test_a_read_only_the_stacks_saw_is_never_a_deadlock() -> None:
    """healthy_blocking_server (a ping-pong client and its server), captured while kvdiag's own tools paused
    the server: /proc saw the client asleep between pings, py-spy and gdb later found it in recv() waiting
    for the pong. Without pystack (whose stack shows the sleep) the stacks show a read /proc did not see:
    the thread moved between the two readings, so it is no deadlock. Without /proc too, nothing says
    which end it is: inconclusive, naming the missing evidence."""
    from kvdiag.capture.merge import bundle_without_tool

    bundle = load("healthy_blocking_server_paused_peer")
    assert analyze(bundle).kind is VerdictKind.HEALTHY
    verdict = analyze(bundle_without_tool(bundle, "pystack"))
    assert verdict.kind is VerdictKind.HEALTHY, verdict.summary
    verdict = analyze(bundle_without_tool(bundle_without_tool(bundle, "pystack"), "proc"))
    assert verdict.kind is VerdictKind.INCONCLUSIVE, verdict.summary
    assert "/proc was not read" in verdict.summary and exit_code_for(verdict) == 6
