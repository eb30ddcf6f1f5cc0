"""May this user attach a tracer (py-spy, pystack, gdb) to an engine? The facts and the fix.

Read from /proc only; nothing is attached. The rules (Linux Yama LSM,
Documentation/admin-guide/LSM/Yama.rst):

- scope 0: any process of the same user (or with CAP_SYS_PTRACE);
- scope 1: only descendants of the tracer, unless CAP_SYS_PTRACE. kvdiag's
  tools are siblings of the engines, not their ancestors, so even engines
  kvdiag started are refused;
- scope 2: only with CAP_SYS_PTRACE;
- scope 3: never (until reboot).

Containers drop CAP_SYS_PTRACE by default (docker, kubernetes), and old
docker seccomp profiles block ptrace(2) altogether.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvdiag.model import PtraceAccess

CAP_SYS_PTRACE = 19


def _status_field(name: str, status: str) -> str | None:
    for line in status.splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return None


def detect_container() -> str | None:
    """The container runtime this process runs under, or None on a plain host."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "kubernetes"
    if Path("/run/.containerenv").exists():
        return "podman"
    if Path("/.dockerenv").exists():
        return "docker"
    try:
        cg = Path("/proc/1/cgroup").read_text(encoding="utf-8")
    except OSError:
        cg = ""
    for needle, name in (("kubepods", "kubernetes"), ("docker", "docker"), ("lxc", "lxc"),
                         ("containerd", "containerd")):
        if needle in cg:
            return name
    try:
        env1 = Path("/proc/1/environ").read_bytes()
        if b"container=" in env1:
            return env1.split(b"container=", 1)[1].split(b"\0", 1)[0].decode(errors="replace") or "container"
    except OSError:
        pass
    return None


def _fix_for_cap(container: str | None) -> str:
    if container == "kubernetes":
        return "add SYS_PTRACE to the pod's securityContext.capabilities.add"
    if container in ("docker", "podman", "containerd"):
        return f"run the container with --cap-add=SYS_PTRACE ({container})"
    return "run kvdiag as root, or give it CAP_SYS_PTRACE (sudo setcap cap_sys_ptrace+ep on the tools)"


def probe_ptrace(proc_root: Path = Path("/proc")) -> PtraceAccess:
    """Read Yama's scope, this process's capabilities, uid, seccomp mode and container; judge attach."""
    acc = PtraceAccess(uid=os.getuid(), container=detect_container())
    try:
        acc.yama_ptrace_scope = int((proc_root / "sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        acc.yama_ptrace_scope = None
    try:
        status = (proc_root / "self/status").read_text(encoding="utf-8")
    except OSError:
        status = ""
    cap = _status_field("CapEff", status)
    if cap:
        try:
            acc.cap_sys_ptrace = bool(int(cap, 16) >> CAP_SYS_PTRACE & 1)
        except ValueError:
            acc.cap_sys_ptrace = None
    sec = _status_field("Seccomp", status)
    if sec and sec.isdigit():
        acc.seccomp = int(sec)
    judge(acc)
    return acc


def judge(acc: PtraceAccess) -> PtraceAccess:
    """Fill attach_children / attach_any_same_uid, problem and fix from the facts (pure)."""
    scope = acc.yama_ptrace_scope
    cap = bool(acc.cap_sys_ptrace)
    if scope == 3:
        acc.attach_children = acc.attach_any_same_uid = False
        acc.problem = "kernel.yama.ptrace_scope=3: no process may attach a tracer until reboot"
        acc.fix = ("reboot with kernel.yama.ptrace_scope<=1 (set it in /etc/sysctl.d/); until then use "
                   "`kvdiag capture --tools proc,py-spy-nonblocking`, which only reads /proc")
    elif scope == 2 and not cap:
        acc.attach_children = acc.attach_any_same_uid = False
        acc.problem = "kernel.yama.ptrace_scope=2 and no CAP_SYS_PTRACE: only an admin may attach"
        acc.fix = _fix_for_cap(acc.container) + ", or `sudo sysctl kernel.yama.ptrace_scope=0`"
    elif scope == 1 and not cap:
        # The tools kvdiag starts are siblings of the engines, never their ancestors.
        acc.attach_children = acc.attach_any_same_uid = False
        acc.problem = ("kernel.yama.ptrace_scope=1 and no CAP_SYS_PTRACE: py-spy/pystack/gdb may only attach to "
                       "their own descendants, so attaching to an engine is refused")
        acc.fix = "`sudo sysctl kernel.yama.ptrace_scope=0` (until reboot), or " + _fix_for_cap(acc.container)
    else:
        acc.attach_children = acc.attach_any_same_uid = True
        if acc.seccomp == 2 and acc.container in ("docker", "podman") and not cap:
            acc.problem = (f"inside {acc.container} with a seccomp filter and no CAP_SYS_PTRACE: the default "
                           "profile may block ptrace(2) on older engines/kernels")
            acc.fix = _fix_for_cap(acc.container)
    return acc
