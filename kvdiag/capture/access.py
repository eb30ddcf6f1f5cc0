"""Preflight before attaching: may kvdiag read this process, and is it something to diagnose at all?

Quick and read-only: nothing here attaches to, signals or pauses the target.
The decisive test is opening ``/proc/PID/mem`` for reading: the kernel runs the
same check as for a ptrace attach (owner uid against ours, CAP_SYS_PTRACE, the
Yama LSM's ``ptrace_scope``), so a refusal here means py-spy, pystack and gdb
would be refused too. One refusal it cannot see: under Yama's scope 1 kvdiag
may read an engine it started (its ancestor) while the tools, kvdiag's
children, may not attach; the scope says so (``tracers_ok``). The facts around
it (who owns the target, the scope, our capabilities, a container, seccomp)
explain *why* and pick the fix.

Public API (small, for ``kvdiag doctor`` and the capture orchestrator):

- :func:`host_ptrace_facts` — the host-wide facts (scope, capability, container, seccomp), which are
  the environment record's (:mod:`kvdiag.environment.ptrace`);
- :func:`check_target` — everything about one pid, as a :class:`~kvdiag.model.evidence.TargetAccess`.
"""

from __future__ import annotations

import errno
import os
import re
import signal

from kvdiag.environment.ptrace import probe_ptrace
from kvdiag.model.environment import PtraceAccess
from kvdiag.model.evidence import TargetAccess
from kvdiag.osread.elfsym import find_runtime_symbol
from kvdiag.osread.maps import read_maps
from kvdiag.osread.mem import mem_open_error
from kvdiag.osread.process import read_comm, read_exe
from kvdiag.osread.ptable import ancestors
from kvdiag.osread.stat import read_stat
from kvdiag.osread.status import read_status

KTHREADD_COMM = "kthreadd"
_PYTHON_EXE = re.compile(r"^python[\d.]*[dmu]*$|^pypy[\d.]*$")

_SCOPE_MEANING = {
    0: "classic: any process of the same user may be traced",
    1: "restricted: only descendants may be traced (Ubuntu's default)",
    2: "admin-only: only processes with CAP_SYS_PTRACE may trace",
    3: "no attach: ptrace is disabled until reboot",
}


def host_ptrace_facts() -> PtraceAccess:
    """The host-wide ptrace facts (Yama scope, CAP_SYS_PTRACE, container, seccomp): the environment
    record's own probe (:func:`kvdiag.environment.ptrace.probe_ptrace`), so doctor, the report's
    environment and the capture preflight state the same facts."""
    return probe_ptrace()


def is_kernel_thread(pid: int) -> bool:
    """A kernel thread: the PF_KTHREAD task flag (kthreadd and everything it starts)."""
    st = read_stat(pid)
    return st is not None and st.kernel_thread


def _describe_wait_status(status: int) -> str:
    if status & 0x7F == 0:
        return f"exit code {(status >> 8) & 0xFF}"
    sig = status & 0x7F
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    return f"killed by {name}" + (" (core dumped)" if status & 0x80 else "")


def runs_python(pid: int) -> bool | None:
    """True when a Python interpreter is in ``pid`` (libpython mapped, a python executable, or the
    interpreter's ``_PyRuntime`` symbol); None when its memory map cannot be read."""
    exe = os.path.basename(read_exe(pid) or "")
    if _PYTHON_EXE.match(exe.replace(" (deleted)", "")):
        return True
    maps = read_maps(pid)
    if maps is None:
        return None
    if any("libpython" in m.path for m in maps):
        return True
    try:
        return find_runtime_symbol(pid) is not None
    except (OSError, ValueError):
        return None


def _sudo_line(pid: int) -> str:
    return (f"run kvdiag as root, keeping your PATH so sudo finds kvdiag and its tools: "
            f"sudo env \"PATH=$PATH\" kvdiag capture --pid {pid}")


def _explain(pid: int, err: OSError, uid: int | None, facts: PtraceAccess, euid: int,
             access: TargetAccess) -> None:
    """Fill ``access.refused`` and ``access.fixes`` for a refused /proc/PID/mem open."""
    why = os.strerror(err.errno) if err.errno else str(err)
    access.refused.append(f"open /proc/{pid}/mem (the ptrace-attach check py-spy, pystack and gdb need): {why}")
    same_user = uid is not None and uid == euid
    scope = facts.yama_ptrace_scope
    if scope == 3:
        access.refused.append(f"kernel.yama.ptrace_scope=3 ({_SCOPE_MEANING[3]})")
        access.fixes.append("ptrace is disabled on this host until it reboots (ptrace_scope 3 cannot be lowered); "
                            "reboot with kernel.yama.ptrace_scope<=1 in /etc/sysctl.d, then capture again")
        return
    if not same_user and not facts.cap_sys_ptrace:
        access.refused.append(f"pid {pid} belongs to uid {uid if uid is not None else '?'} and kvdiag runs as uid "
                              f"{euid} without CAP_SYS_PTRACE")
        if facts.container and euid == 0:
            # root without the capability: the container was started without it
            access.fixes.append(f"kvdiag runs as root in a {facts.container} container without CAP_SYS_PTRACE: start "
                                "it with --cap-add=SYS_PTRACE (Kubernetes: securityContext.capabilities.add: "
                                "[SYS_PTRACE])")
        else:
            access.fixes.append(_sudo_line(pid))
        if uid is not None and uid != 0:
            access.fixes.append(f"or run kvdiag as the target's own user (uid {uid}): "
                                f"sudo -u '#{uid}' env \"PATH=$PATH\" kvdiag capture --pid {pid}")
        return
    if scope == 2 and not facts.cap_sys_ptrace:
        access.refused.append(f"kernel.yama.ptrace_scope=2 ({_SCOPE_MEANING[2]}) and kvdiag lacks CAP_SYS_PTRACE")
        access.fixes.append(_sudo_line(pid))
        return
    if scope == 1 and not facts.cap_sys_ptrace and os.getpid() not in ancestors(pid):
        access.refused.append(f"kernel.yama.ptrace_scope=1 ({_SCOPE_MEANING[1]}); pid {pid} is not a child of kvdiag")
        access.fixes.append(_sudo_line(pid))
        access.fixes.append("or allow tracing your own processes until reboot: sudo sysctl kernel.yama.ptrace_scope=0")
        return
    if facts.container and not facts.cap_sys_ptrace:
        access.refused.append(f"kvdiag runs in a {facts.container} container without CAP_SYS_PTRACE")
        access.fixes.append("start the container with --cap-add=SYS_PTRACE (Kubernetes: securityContext."
                            "capabilities.add: [SYS_PTRACE])")
        if facts.seccomp == 2:
            access.fixes.append("if it is still refused, the container's seccomp profile blocks ptrace: "
                                "--security-opt seccomp=unconfined")
        return
    if err.errno in (errno.EACCES, errno.EPERM):
        # Same user, scope allows it: the target made itself undumpable (setuid, PR_SET_DUMPABLE 0)
        # or an LSM (AppArmor, SELinux) denies it.
        access.refused.append(f"pid {pid} is not traceable by its owner (it may have dropped dumpability, or an "
                              "LSM such as AppArmor/SELinux denies ptrace)")
        access.fixes.append(_sudo_line(pid))


def check_target(pid: int) -> TargetAccess:
    """Everything the preflight learns about ``pid`` without attaching (see the module docstring)."""
    facts = host_ptrace_facts()
    euid = os.geteuid()
    access = TargetAccess(our_uid=euid, ptrace_scope=facts.yama_ptrace_scope,
                          cap_sys_ptrace=bool(facts.cap_sys_ptrace), container=facts.container, seccomp=facts.seccomp)
    status = read_status(pid)
    access.uid = status.uid if status is not None else None
    st = read_stat(pid)
    if st is None:
        access.ptrace_ok = False
        access.refused.append(f"pid {pid} does not exist (any more)")
        return access
    access.state = st.state
    access.tracer_pid = status.tracer_pid if status is not None else None
    if st.kernel_thread or (pid == 2 and read_comm(2) == KTHREADD_COMM):
        access.kernel_thread = True
        access.ptrace_ok = False
        access.python = False
        access.refused.append(f"pid {pid} is a kernel thread: it runs kernel code only (no Python, no stack "
                              "tool can attach); capture refused")
        access.fixes.append("pass the pid of the engine process (the EngineCore, or its API server with "
                            "--engine-core-of)")
        return access
    if st.state in ("Z", "X"):
        access.zombie = True
        access.ptrace_ok = False
        access.python = None
        if facts.cap_sys_ptrace or access.uid == euid:   # else the kernel shows 0, not the status
            access.exit_status = _describe_wait_status(st.exit_code) if st.exit_code is not None else None
        return access
    err = mem_open_error(pid)
    if err is not None:
        if err.errno == errno.ENOENT or not os.path.isdir(f"/proc/{pid}"):
            access.ptrace_ok = False
            access.refused.append(f"pid {pid} exited while being checked")
            return access
        access.ptrace_ok = False
        _explain(pid, err, access.uid, facts, euid, access)
        return access
    if facts.yama_ptrace_scope == 1 and not facts.cap_sys_ptrace:
        # kvdiag may read a process it started (its ancestor), but the stack tools are kvdiag's children:
        # siblings of the target, never its ancestors, so Yama refuses their attach.
        access.tracers_ok = False
        access.refused.append(f"kernel.yama.ptrace_scope=1 ({_SCOPE_MEANING[1]}): py-spy, pystack and gdb run as "
                              f"kvdiag's children, never ancestors of pid {pid}, so they may not attach")
        access.fixes.append(_sudo_line(pid))
        access.fixes.append("or allow tracing your own processes until reboot: sudo sysctl kernel.yama.ptrace_scope=0")
    access.python = runs_python(pid)
    return access


__all__ = ["check_target", "host_ptrace_facts", "is_kernel_thread", "runs_python"]
