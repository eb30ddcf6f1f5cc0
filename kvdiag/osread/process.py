"""Per-process /proc files that need no parsing beyond splitting: comm, cmdline, exe, cwd, environ, io."""

from __future__ import annotations

from kvdiag.osread.files import PROC, read_bytes, read_link, read_text


def read_comm(pid: int, tid: int | None = None) -> str | None:
    """The task's comm (15 characters at most), stripped; None when unreadable."""
    text = read_text(f"{PROC}/{pid}/task/{tid}/comm" if tid is not None else f"{PROC}/{pid}/comm")
    return text.strip() if text is not None else None


def read_cmdline(pid: int) -> list[str] | None:
    """argv as the process shows it now (a retitled process shows its title); None when unreadable."""
    raw = read_bytes(f"{PROC}/{pid}/cmdline")
    if raw is None:
        return None
    return [a.decode("utf-8", "replace") for a in raw.split(b"\x00") if a]


def read_exe(pid: int) -> str | None:
    """The executable's path (may end in " (deleted)"); None when refused or gone."""
    return read_link(f"{PROC}/{pid}/exe")


def read_cwd(pid: int) -> str | None:
    return read_link(f"{PROC}/{pid}/cwd")


def read_environ(pid: int) -> dict[str, str] | None:
    """The environment ``pid`` was started with, or None when it cannot be read."""
    raw = read_bytes(f"{PROC}/{pid}/environ")
    if raw is None:
        return None
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def read_io(pid: int, tid: int | None = None) -> dict[str, int]:
    """/proc/PID/io (or one thread's /proc/PID/task/TID/io) counters (rchar, wchar, syscr, syscw, ...); {} when
    unreadable."""
    out: dict[str, int] = {}
    path = f"{PROC}/{pid}/io" if tid is None else f"{PROC}/{pid}/task/{tid}/io"
    for line in (read_text(path) or "").splitlines():
        key, _, val = line.partition(":")
        if val.strip().isdigit():
            out[key.strip()] = int(val)
    return out
