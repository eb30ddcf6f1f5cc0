"""Why a node of a fleet capture gave no usable evidence, in words that name the fix. Pure.

Two sources: the error a node's capture task raised (the node went away; kvdiag cannot be imported by
the Python Ray runs there), and the node's own bundle (every process there refused the stack tools).
"""

from __future__ import annotations

import re

from kvdiag.agent.protocol import AGENT_FIX
from kvdiag.analyze.access import attach_refused
from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import ProcessEvidence
from kvdiag.model.fleet import NodeOutcome

# Errors that mean the node (or the worker on it) went away while its capture ran.
DIED_ERRORS = ("NodeDiedError", "WorkerCrashedError", "ObjectLostError", "OwnerDiedError",
               "ObjectFetchTimedOutError", "ObjectReconstructionFailedError", "RayActorError", "ActorDiedError",
               "LocalRayletDiedError")
_NO_MODULE = re.compile(r"No module named '([\w.]+)'")
# Ray's "failed to import on the worker" error lists the worker's sys.path: its site-packages say which
# Python (which venv, which image) the node runs.
_SITE_PACKAGES = re.compile(r"'([^']*?(?:site|dist)-packages)'")
# The reason of a task failure no known error explains (a node dying under it is one explanation).
GENERIC_FAILURE = "the capture task failed there"
_MERGE_HINT = "or run `kvdiag capture --pid` on that host and `kvdiag merge` the folders"


def task_failure(error_name: str, text: str) -> tuple[NodeOutcome, str]:
    """(outcome, reason) for a node whose capture task raised an error of type ``error_name`` with ``text``."""
    if any(d in error_name for d in DIED_ERRORS):
        return "died", f"the node (or its worker) went away during capture ({error_name})"
    missing = _NO_MODULE.search(text)
    if missing is not None:
        module = missing.group(1)
        at = text.find("sys.path")
        site = _SITE_PACKAGES.search(text, at) if at >= 0 else None
        python = f" (its packages: {site.group(1)})" if site else ""
        if module == "kvdiag":
            return "refused", (f"kvdiag is not importable by the Python Ray runs on that node{python}: "
                               f"No module named 'kvdiag'. Install kvdiag there ({_MERGE_HINT})")
        if module.startswith("kvdiag."):
            return "refused", (f"the kvdiag installed on that node has no {module}{python}: another version; "
                               f"install this one there ({_MERGE_HINT})")
        return "refused", (f"kvdiag cannot be imported on that node: No module named '{module}'{python}; "
                           f"install kvdiag with its dependencies there ({_MERGE_HINT})")
    last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), error_name)
    return "refused", f"{GENERIC_FAILURE}: {last[:300]}"


def _others(procs: list[ProcessEvidence]) -> str:
    n = len(procs) - 1
    return f" and {n} more process{'es' if n > 1 else ''}" if n else ""


def access_refusal(bundle: Bundle) -> str | None:
    """Why no process of a node's bundle could be read as a verdict needs, None when one could.

    Either the preflight refused every process (the fix is the preflight's), or the kernel refused every
    ptrace attach the preflight allowed: a seccomp filter (a container without SYS_PTRACE) refuses
    ptrace while /proc/PID/mem still opens, so py-spy may read Python stacks with no native frames.
    """
    procs = [p for p in bundle.processes if p.access is not None]
    if not procs:
        return None
    if not any(p.access is not None and p.access.ptrace_ok and p.access.tracers_ok for p in procs):
        first = procs[0].access
        assert first is not None
        refused = first.refused[-1] if first.refused else "ptrace refused"
        fix = f" (fix: {first.fixes[0]})" if first.fixes else ""
        return f"no access: {refused}{fix}"
    errors = {p.pid: attach_refused(p) for p in procs}
    if not all(errors.values()):
        return None
    tools = sorted({e.split(":", 1)[0] for errs in errors.values() for e in errs})
    if any(p.access is not None and p.access.seccomp == 2 for p in procs):
        cause = "kvdiag there runs under a seccomp filter, which refuses ptrace as in a container without SYS_PTRACE"
        fix = ("run the node's container with --cap-add=SYS_PTRACE (Kubernetes: securityContext.capabilities.add: "
               f"[SYS_PTRACE]); if still refused, --security-opt seccomp=unconfined; {AGENT_FIX}")
    else:
        cause = "/proc/PID/mem opened, so an LSM such as AppArmor or SELinux denies the attach"
        fix = "allow ptrace for kvdiag's tools in that policy, or run kvdiag there as root"
    pyspy = all(any(t.tool == "py-spy" and t.ok for t in p.tools) for p in procs)
    read = ("only Python stacks were read (py-spy, through /proc/PID/mem): no native frames, no GIL state"
            if pyspy else "no stack was read")
    return (f"ptrace refused: the kernel refused {' and '.join(tools)} attaching to pid {procs[0].pid}{_others(procs)} "
            f"({cause}); {read} (fix: {fix})")


__all__ = ["DIED_ERRORS", "access_refusal", "task_failure"]
