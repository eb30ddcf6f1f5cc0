"""A capture in two stages: the engine core first, the rest of the tree only when it is needed.

A vLLM tree is an API server, its EngineCore, workers and a resource tracker. The EngineCore is where
an engine's hangs live; the pausing tools (pystack with native frames, gdb) on every other process
cost more than the EngineCore's own capture (the API server maps torch: its native stack alone takes
longer than the EngineCore's). So:

1. the focus processes (the EngineCore) get every tool, while the others get what never pauses them
   (/proc, py-spy without --native), at the same time;
2. ``decides(evidence, findings)`` (the caller's judge: capture does not analyze) says whether that
   evidence already names a hang in a focus process; if so the others' pausing tools are recorded as
   skipped, with the reason;
3. otherwise (no hang in the focus: the answer may lie elsewhere) the other processes get the tools
   the first stage left out (the pausing ones), and what those see is added to their first-stage
   evidence: their /proc progress window already ran in the first stage, beside the focus's, and is
   not opened a second time (on an idle vLLM tree that second window was a fifth of the capture).
   A multiprocessing helper (the resource tracker) is left out of this stage: its threads read as idle
   by design whatever their stacks say, and /proc and py-spy read it in the first stage.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvdiag.capture.base import CaptureBackend
from kvdiag.capture.discover import multiprocessing_helper
from kvdiag.capture.merge import add_tools
from kvdiag.capture.orchestrate import CAPTURE_SLACK_S, capture_processes, make_backends
from kvdiag.capture.tools import PyspyBackend, PystackBackend, pyspy_nonblocking
from kvdiag.model.evidence import ProcessEvidence, ToolRun
from kvdiag.model.run import Finding

Decider = Callable[[list[ProcessEvidence], list[Finding]], "str | None"]


def _quiet(backends: list[CaptureBackend]) -> list[CaptureBackend]:
    """The tools that never pause a target: /proc, and py-spy reading Python frames only."""
    out: list[CaptureBackend] = []
    for b in backends:
        if isinstance(b, PyspyBackend):
            out.append(pyspy_nonblocking(b.binary) if b.native else b)
        elif not b.stops_target:
            out.append(b)
    return out


def _pausing(backends: list[CaptureBackend], quiet: list[CaptureBackend]) -> list[CaptureBackend]:
    """The tools the first stage did not run on the other processes: the pausing ones. py-spy ran there
    already without pausing; it runs again (with --native) only where no pystack reads native frames."""
    native_pystack = any(isinstance(b, PystackBackend) and b.native and b.available() is None for b in backends)
    quiet_names = {b.name for b in quiet}
    return [b for b in backends if b.name not in quiet_names
            or (isinstance(b, PyspyBackend) and b.native and not native_pystack)]


def _skip_pausing(ev: ProcessEvidence, chosen: list[CaptureBackend], quiet: list[CaptureBackend], why: str) -> None:
    """Record the pausing tools that stay off ``ev``'s process as skipped, with why."""
    quiet_names = {b.name for b in quiet}
    done = {t.tool for t in ev.tools}
    for b in chosen:
        if b.name not in quiet_names and b.name not in done:
            ev.tools.append(ToolRun(tool=b.name, ok=False, skipped=True,
                                    error=f"{b.name} skipped: {why}; /proc and py-spy (without pausing it) read "
                                          "this process"))


def capture_staged(pids: Sequence[int], focus: Sequence[int], raw_dir: Path, *, timeout_s: float,
                   backends: Sequence[str | CaptureBackend] | None, bundle_dir: Path | None,
                   decides: Decider, on_open: Callable[[], None] | None = None,
                   ) -> tuple[list[ProcessEvidence], list[Finding]]:
    """Capture ``pids`` with the ``focus`` processes first (see the module); the evidence of every pid,
    focus processes first, and the findings. ``on_open``: once the focus processes' windows have opened
    (see :func:`~kvdiag.capture.orchestrate.capture_processes`)."""
    chosen = make_backends(backends)
    core = [p for p in pids if p in set(focus)]
    rest = [p for p in pids if p not in set(focus)]
    quiet = _quiet(make_backends(backends))   # instances of their own: both stages run at once
    if not core or not rest:
        return capture_processes(pids, raw_dir, timeout_s=timeout_s, backends=chosen, bundle_dir=bundle_dir,
                                 on_open=on_open)
    start = time.monotonic()
    box: list[tuple[list[ProcessEvidence], list[Finding]]] = []
    side = threading.Thread(target=lambda: box.append(capture_processes(
        rest, raw_dir, timeout_s=timeout_s, backends=quiet, bundle_dir=bundle_dir)),
        name="kvdiag-capture-rest", daemon=True)
    side.start()
    try:
        ev_core, f_core = capture_processes(core, raw_dir, timeout_s=timeout_s, backends=chosen,
                                            bundle_dir=bundle_dir, on_open=on_open)
    finally:
        side.join(timeout_s + CAPTURE_SLACK_S)
    ev_rest, f_rest = box[0] if box else ([], [])
    try:
        # No first-stage evidence of the rest (its capture failed): nothing decides, capture it in full.
        why = decides(ev_core + ev_rest, f_core + f_rest) if box else None
    except Exception:  # noqa: BLE001 - a judge that fails decides nothing: the rest gets every tool
        why = None
    if why is not None:
        for ev in ev_rest:
            _skip_pausing(ev, chosen, quiet, why)
        return ev_core + ev_rest, f_core + f_rest
    helpers = {e.pid for e in ev_rest if e.alive and multiprocessing_helper(e.pid)}
    for ev in ev_rest:
        if ev.pid in helpers:
            _skip_pausing(ev, chosen, quiet, f"pid {ev.pid} is a multiprocessing helper, idle by design whatever "
                                              "its stack")
    later = _pausing(make_backends(backends), quiet)
    offset = time.monotonic() - start
    more_pids = [p for p in rest if p not in helpers]
    ev_more, f_more = (capture_processes(more_pids, raw_dir, timeout_s=timeout_s, backends=later,
                                         bundle_dir=bundle_dir) if more_pids else ([], []))
    more = {e.pid: e for e in ev_more}
    for e in ev_more:   # the tools' start, from the capture's start like the first stage's
        for run in e.tools:
            if run.started_s is not None:
                run.started_s = round(run.started_s + offset, 3)
    merged = [add_tools(e, more[e.pid]) if e.pid in more else e for e in ev_rest]
    merged += [e for e in ev_more if e.pid not in {m.pid for m in ev_rest}]
    missing = {f.message for f in f_core + f_rest if f.kind == "tool_missing"}
    f_more = [f for f in f_more if f.kind != "tool_missing" or f.message not in missing]
    return ev_core + merged, f_core + f_rest + f_more
