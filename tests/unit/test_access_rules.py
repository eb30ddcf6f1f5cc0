"""No evidence is not health: the pure outcome rules, exit codes, and the preflight's explanations."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from kvdiag.analyze.access import evidence_outcome, process_outcome
from kvdiag.analyze.diagnosis import exit_code_for
from kvdiag.analyze.overall import analyze
from kvdiag.capture.access import _explain, check_target, host_ptrace_facts, is_kernel_thread
from kvdiag.model.bundle import Bundle
from kvdiag.model.environment import PtraceAccess
from kvdiag.model.evidence import ProcessEvidence, TargetAccess, ThreadEvidence, ToolRun
from kvdiag.model.kinds import NO_EVIDENCE_KINDS, EnginePhase, ThreadState, VerdictKind
from kvdiag.model.run import EngineRecord, Finding
from kvdiag.model.verdict import Verdict

REFUSED = TargetAccess(uid=0, our_uid=1000, ptrace_ok=False,
                       refused=["open /proc/42/mem (...): Permission denied",
                                "pid 42 belongs to uid 0 and kvdiag runs as uid 1000 without CAP_SYS_PTRACE"],
                       fixes=['run kvdiag as root, keeping your PATH: sudo env "PATH=$PATH" kvdiag capture --pid 42'])


def _proc(pid: int = 42, access: TargetAccess | None = None, **kw: object) -> ProcessEvidence:
    threads = [ThreadEvidence(tid=pid, state=ThreadState.SLEEPING, wchan="futex_wait_queue", cpu_ticks_delta=0),
               ThreadEvidence(tid=pid + 1, state=ThreadState.SLEEPING, wchan="futex_wait_queue", cpu_ticks_delta=0)]
    return ProcessEvidence(pid=pid, comm="python3", state=ThreadState.SLEEPING, cpu_percent=0.0, threads=threads,
                           access=access, **kw)  # type: ignore[arg-type]


def test_refused_target_is_no_access_exit_3_with_the_fix_and_partial_evidence() -> None:
    v = analyze(Bundle(processes=[_proc(access=REFUSED)]))
    assert v.kind is VerdictKind.NO_ACCESS and exit_code_for(v) == 3
    assert "belongs to uid 0" in v.summary and "sudo env" in v.summary and "healthy" not in v.summary
    kinds = [f.kind for f in v.findings]
    assert kinds.count("access_refused") == 2 and "access_fix" in kinds
    partial = next(f.message for f in v.findings if f.kind == "partial_evidence")
    assert "/proc only, not judged" in partial and "2 threads (2 sleeping)" in partial
    assert "futex_wait_queue x2" in partial


def test_tools_all_refused_is_no_access_even_without_preflight_facts() -> None:
    """A bundle from before the preflight (or a refusal the preflight could not foresee)."""
    tools = [ToolRun(tool="py-spy", ok=False, error="py-spy exited 1: Error: Permission Denied (os error 13)"),
             ToolRun(tool="pystack", ok=False, error="pystack exited 1: Operation not permitted"),
             ToolRun(tool="gdb", ok=False, error="gdb exited 0: ptrace: Operation not permitted.")]
    v = analyze(Bundle(processes=[_proc(tools=tools)]))
    assert v.kind is VerdictKind.NO_ACCESS and exit_code_for(v) == 3
    # one tool that read the process is evidence: judged normally
    tools[1] = ToolRun(tool="pystack", ok=True)
    assert process_outcome(_proc(tools=tools), []) is None


def test_a_live_process_with_no_thread_read_is_no_evidence_not_healthy() -> None:
    """Every tool missing or failing (here: a target another debugger holds, captured without /proc)."""
    tools = [ToolRun(tool="py-spy", ok=False, error="py-spy exited 1: Error: Failed to get stack traces"),
             ToolRun(tool="gdb", ok=False, error="gdb not installed (not on PATH)")]
    proc = ProcessEvidence(pid=42, access=TargetAccess(python=True), tools=tools)
    v = analyze(Bundle(processes=[proc]))
    assert v.kind is VerdictKind.NO_EVIDENCE and exit_code_for(v) == 3
    assert "gdb not installed" in v.summary and "healthy" not in v.summary
    assert any(f.kind == "no_evidence" for f in v.findings)


def test_yama_scope_1_keeps_the_tools_out_but_not_kvdiag() -> None:
    """Ubuntu's default: kvdiag reads the engines it started, its tools may not attach. A hang the /proc
    evidence shows stands; health is never claimed; the fix is the sysctl or sudo."""
    a = TargetAccess(python=True, tracers_ok=False, refused=["kernel.yama.ptrace_scope=1 (...): py-spy, pystack "
                                                             "and gdb run as kvdiag's children"],
                     fixes=["sudo env ...", "or ... sudo sysctl kernel.yama.ptrace_scope=0"])
    quiet = ProcessEvidence(pid=42, access=a, state=ThreadState.RUNNING,
                            threads=[ThreadEvidence(tid=42, state=ThreadState.RUNNING, cpu_ticks_delta=20)])
    v = analyze(Bundle(processes=[quiet]))
    assert v.kind is VerdictKind.NO_ACCESS and "ptrace_scope=1" in v.summary
    assert any("sysctl kernel.yama.ptrace_scope=0" in f.message for f in v.findings if f.kind == "access_fix")
    from kvdiag.analyze.access import judgeable
    assert judgeable([quiet], []) == [quiet]   # its /proc evidence is still judged for a hang
    refused = _proc(access=REFUSED)
    assert judgeable([refused], []) == []        # memory unreadable: /proc alone never judged


def test_a_stalled_engine_that_could_not_be_read_is_no_access_not_unknown() -> None:
    e = EngineRecord(name="eng", phase=EnginePhase.STALLED)
    b = Bundle(engines=[e], processes=[_proc(access=REFUSED, engine="eng")], stall_detected=True)
    v = analyze(b)
    assert v.kind is VerdictKind.NO_ACCESS and "stalled" in v.summary and exit_code_for(v) == 3


def test_one_unreadable_process_forbids_health_for_its_group() -> None:
    readable = _proc(pid=50, access=TargetAccess(python=True))
    readable.threads = [ThreadEvidence(tid=50, state=ThreadState.RUNNING, cpu_ticks_delta=20)]
    v = evidence_outcome("g", [readable, _proc(pid=60, access=REFUSED)], [])
    assert v is not None and v.kind is VerdictKind.NO_ACCESS
    assert analyze(Bundle(processes=[readable, _proc(pid=60, access=REFUSED)])).kind is VerdictKind.NO_ACCESS


def test_a_non_python_process_next_to_a_judged_one_does_not_hide_the_judgement() -> None:
    shell = _proc(pid=10, access=TargetAccess(python=False))
    busy = ProcessEvidence(pid=11, access=TargetAccess(python=True),
                           threads=[ThreadEvidence(tid=11, state=ThreadState.RUNNING, cpu_ticks_delta=25)])
    assert evidence_outcome("g", [shell, busy], []) is None
    assert analyze(Bundle(processes=[shell, busy])).kind is VerdictKind.HEALTHY


@pytest.mark.parametrize(("proc", "findings", "kind"), [
    (_proc(access=TargetAccess(zombie=True, exit_status="exit code 7", ptrace_ok=False)), [], VerdictKind.ZOMBIE),
    (_proc(access=TargetAccess(python=True)), [], None),
    (ProcessEvidence(pid=42, state=ThreadState.ZOMBIE), [], VerdictKind.ZOMBIE),
    (ProcessEvidence(pid=42, alive=False), [], VerdictKind.EXITED),
    (_proc(access=TargetAccess(python=True)), [Finding(kind="target_exited", pid=42, message="x")],
     VerdictKind.EXITED),
    (_proc(access=TargetAccess(python=False)), [], VerdictKind.NOT_PYTHON),
    (_proc(access=TargetAccess(kernel_thread=True, ptrace_ok=False)), [], VerdictKind.KERNEL_THREAD),
])
def test_each_outcome_and_its_exit_code(proc: ProcessEvidence, findings: list[Finding],
                                        kind: VerdictKind | None) -> None:
    assert process_outcome(proc, findings) is kind
    if kind is None:
        return
    v = evidence_outcome("g", [proc], findings)
    assert v is not None and v.kind is kind
    assert exit_code_for(v) == (3 if kind is VerdictKind.NO_ACCESS else 5)
    assert "healthy" not in v.summary


def test_exit_codes_of_all_no_evidence_kinds() -> None:
    for kind in NO_EVIDENCE_KINDS:
        assert not kind.is_hang
        expect = 3 if kind in (VerdictKind.NO_ACCESS, VerdictKind.NO_EVIDENCE) else 5
        assert exit_code_for(Verdict(kind=kind, summary="")) == expect


def _facts(**kw: object) -> PtraceAccess:
    return PtraceAccess(**{"yama_ptrace_scope": None, "cap_sys_ptrace": False, "seccomp": 0, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(("facts", "euid", "uid", "refused", "fix"), [
    (_facts(), 1000, 0, "belongs to uid 0 and kvdiag runs as uid 1000 without CAP_SYS_PTRACE", "sudo env"),
    (_facts(), 1000, 1001, "belongs to uid 1001", "sudo -u '#1001'"),
    (_facts(container="docker"), 0, 1001, "without CAP_SYS_PTRACE", "--cap-add=SYS_PTRACE"),
    (_facts(yama_ptrace_scope=1), 1000, 1000, "ptrace_scope=1", "sudo sysctl kernel.yama.ptrace_scope=0"),
    (_facts(yama_ptrace_scope=2), 1000, 1000, "ptrace_scope=2", "sudo env"),
    (_facts(yama_ptrace_scope=3), 1000, 1000, "ptrace_scope=3", "until it reboots"),
])
def test_the_refusal_names_why_and_the_fix_that_fits(facts: PtraceAccess, euid: int, uid: int, refused: str,
                                                    fix: str) -> None:
    access = TargetAccess(ptrace_ok=False)
    _explain(424242, PermissionError(errno.EACCES, "Permission denied"), uid, facts, euid, access)
    assert any(refused in r for r in access.refused), access.refused
    assert any(fix in f for f in access.fixes), access.fixes


def test_preflight_on_real_processes() -> None:
    facts = host_ptrace_facts()
    assert facts.uid == os.getuid() and isinstance(facts.cap_sys_ptrace, bool)
    child = subprocess.Popen([sys.executable, "-c", "import time; print('ok', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ok"
        a = check_target(child.pid)
        assert a.ptrace_ok and a.python is True and not a.zombie and not a.kernel_thread and a.uid == os.getuid()
    finally:
        child.kill()
        child.wait(timeout=10)
    gone = check_target(child.pid)
    assert not gone.ptrace_ok and "does not exist" in gone.refused[0]
    if is_kernel_thread(2):
        k = check_target(2)
        assert k.kernel_thread and not k.ptrace_ok and k.python is False


def test_a_timed_wait_resumed_after_a_stop_is_read_as_a_sleep() -> None:
    """After SIGSTOP/SIGCONT or a debugger's attach, a thread asleep in nanosleep (or a timed futex or poll) is
    parked in restart_syscall and its wchan reads do_syscall_64: /proc alone still says it waits by itself."""
    from kvdiag.analyze.classify import WaitKind, classify_thread

    for machine, nr in (("x86_64", 219), ("aarch64", 128)):
        th = ThreadEvidence(tid=7, state=ThreadState.SLEEPING, wchan="do_syscall_64", syscall=f"{nr} 0x0 0x0 0x0",
                            syscall_nr=nr, cpu_ticks_delta=0)
        proc = ProcessEvidence(pid=7, threads=[th])
        view = classify_thread(th, proc, machine)
        assert view.kind is WaitKind.SLEEP, (machine, view.kind)
        assert "restart_syscall" in (view.wait_frame or "")
