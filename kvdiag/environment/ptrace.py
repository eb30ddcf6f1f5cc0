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

from kvdiag.model.environment import PtraceAccess
from kvdiag.osread.files import read_text
from kvdiag.osread.host import yama_ptrace_scope
from kvdiag.osread.process import read_environ
from kvdiag.osread.status import read_status

CAP_SYS_PTRACE = 19


def detect_container() -> str | None:
    """The container runtime this process runs under, or None on a plain host."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "kubernetes"
    if Path("/run/.containerenv").exists():
        return "podman"
    if Path("/.dockerenv").exists():
        return "docker"
    cg = read_text("/proc/1/cgroup") or ""
    for needle, name in (("kubepods", "kubernetes"), ("docker", "docker"), ("lxc", "lxc"),
                         ("containerd", "containerd")):
        if needle in cg:
            return name
    env1 = read_environ(1) or {}
    if "container" in env1:
        return env1["container"] or "container"
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
    acc.yama_ptrace_scope = yama_ptrace_scope(proc_root)
    status = read_status("self", proc_root=str(proc_root))
    if status is not None and status.cap_eff is not None:
        acc.cap_sys_ptrace = bool(status.cap_eff >> CAP_SYS_PTRACE & 1)
    if status is not None and status.seccomp is not None:
        acc.seccomp = status.seccomp
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
