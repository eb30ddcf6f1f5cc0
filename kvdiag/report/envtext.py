"""The environment record as plain lines (Markdown, terminal and `kvdiag doctor` share them)."""

from __future__ import annotations

from kvdiag.model.environment import EnvironmentRecord, KvcachedBuild


def _mb(value: int | None) -> str:
    return "?" if value is None else f"{value / 1024:.1f} GiB"


def gpu_lines(env: EnvironmentRecord) -> list[str]:
    if not env.gpus:
        return [env.gpu_note or "no GPU"]
    return [f"GPU {g.index}: {g.name}, {_mb(g.total_mb)} total, {_mb(g.free_mb)} free" for g in env.gpus]


def _three(pk: dict[str, str | None], kvcached_verdict: str | None = None) -> str:
    kv = f" ({kvcached_verdict})" if kvcached_verdict else ""
    return (f"vLLM {pk.get('vllm') or '—'}, kvcached {pk.get('kvcached') or '—'}{kv}, "
            f"torch {pk.get('torch') or '—'}")


def package_summary(env: EnvironmentRecord) -> str:
    """vLLM/kvcached/torch versions saying whose they are: each engine interpreter's, else kvdiag's."""
    if not env.engine_packages:
        return f"{_three(env.packages, env.kvcached.verdict)} (kvdiag's Python)"
    return "; ".join(f"{_three(ip.packages, _verdict(ip.kvcached))} ({ip.who}: Python {ip.python_version or '?'} "
                     f"{ip.python})" for ip in env.engine_packages)


def _verdict(build: KvcachedBuild | None) -> str | None:
    return build.verdict if build is not None and build.installed else None


def kvcached_lines(build: KvcachedBuild, whose: str) -> list[str]:
    """The kvcached build one interpreter imports: verdict, summary, one line per known defect."""
    if not build.installed:
        return [f"kvcached ({whose}): {build.summary or 'not installed'}"]
    ver = f" {build.version}" if build.version else ""
    git = f" (git {build.git_commit[:12]})" if build.git_commit else ""
    at = f" at {build.location}" if build.location else ""
    return [f"kvcached{ver}{git} ({whose}){at}: {build.verdict}: {build.summary}",
            *(f"  {c.defect}: {c.status.value} ({c.upstream})" for c in build.checks)]


def environment_lines(env: EnvironmentRecord) -> list[str]:
    """One fact per line of the (redacted) record."""
    pkgs = ", ".join(f"{k} {v}" if v else f"{k} —" for k, v in env.packages.items())
    whose = f"kvdiag's Python {env.packages_python}".rstrip() if env.engine_packages else "kvdiag's Python"
    lines = [f"OS: {env.os}, kernel {env.kernel} ({env.machine})", f"Python: {env.python} (kvdiag's)"]
    for ip in env.engine_packages:
        ipk = ", ".join(f"{k} {v}" if v else f"{k} —" for k, v in ip.packages.items())
        how = f"; {ip.source}: {ip.note}" if ip.note else ""
        lines.append(f"packages of {ip.who} (Python {ip.python_version or '?'} {ip.python}{how}): {ipk}")
    lines += [f"packages ({whose}): {pkgs}",
             f"CUDA: driver {env.cuda_driver or '—'}, runtime {env.cuda_runtime or '—'}"]
    lines += gpu_lines(env)
    limits = []
    if env.cpu_limit is not None:
        limits.append(f"cgroup CPU quota {env.cpu_limit:g}")
    if env.memory_limit_mb is not None:
        limits.append(f"cgroup memory limit {_mb(env.memory_limit_mb)}")
    lines.append(f"CPUs: {env.cpus if env.cpus is not None else '?'}, memory {_mb(env.memory_total_mb)}"
                 + (f" ({', '.join(limits)})" if limits else ""))
    p = env.ptrace
    scope = "absent" if p.yama_ptrace_scope is None else str(p.yama_ptrace_scope)
    lines.append(f"ptrace: yama ptrace_scope {scope}, CAP_SYS_PTRACE {'yes' if p.cap_sys_ptrace else 'no'}, "
                 f"container {p.container or 'none'}: "
                 + (f"capture refused: {p.problem}; fix: {p.fix}" if p.problem else "attach allowed"))
    for ip in env.engine_packages:
        if ip.kvcached is not None:
            lines += kvcached_lines(ip.kvcached, f"{ip.who}: {ip.python}")
    lines += kvcached_lines(env.kvcached, "kvdiag's Python")
    rt = env.kvcached_runtime
    if rt is not None:
        for s in rt.segments:
            lines.append(f"shm segment /dev/shm/{s.name}: used {s.used_bytes}/{s.total_bytes} B, prealloc "
                         f"{s.prealloc_bytes} B, pids {', '.join(map(str, s.pids)) or 'none'}")
        for sock in rt.sockets:
            lines.append(f"IPC socket {sock.path}: listener {', '.join(map(str, sock.listener_pids)) or 'none'}, "
                         f"peers {', '.join(map(str, sock.peer_pids)) or 'none'}" + (" (stale)" if sock.stale else ""))
    if env.env:
        lines.append(f"variables ({env.env_source or 'kvdiag'}):")
    for key, value in env.env.items():
        lines.append(f"  {key}={value}")
    for err in env.errors:
        lines.append(f"not collected: {err}")
    lines += node_lines(env)
    return lines


def node_lines(env: EnvironmentRecord) -> list[str]:
    """The node table of a bundle merged from several hosts (the record above is its first node's)."""
    if not env.nodes:
        return []
    lines = [f"nodes ({len(env.nodes)}; the lines above describe the first captured one):"]
    for n in env.nodes:
        facts = [
            n.outcome + (f": {n.reason}" if n.reason and n.outcome != "captured" else ""),
            "head" if n.head else "",
            f"pids {', '.join(map(str, n.pids))}" if n.pids else "",
            f"capture {n.capture_s:.1f}s" if n.capture_s is not None else "",
            f"{n.bytes_moved / 1024:.0f} KiB sent" if n.bytes_moved is not None else "",
            f"kernel {n.kernel} ({n.machine or '?'}), {n.cpus if n.cpus is not None else '?'} CPUs" if n.kernel else "",
        ]
        lines.append(f"  {n.node}: " + "; ".join(fact for fact in facts if fact))
    return lines
