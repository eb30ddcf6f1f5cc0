"""What the agent in a target and kvdiag's capture agree on: the private directory, the file names, the
armed record and the dump's text format. Standard library only (it is imported inside the target).

The directory is per user, 0700 and owned by that user: ``$KVDIAG_AGENT_DIR``, else
``/dev/shm/kvdiag-agent-UID`` (shared by the containers of one pod), else ``$TMPDIR/kvdiag-agent-UID``.
In it, per armed process ``PID.armed`` (written at arm time), and per request ``PID.NONCE.req``
(kvdiag's), ``PID.NONCE.tmp`` while the agent writes and ``PID.NONCE.dump`` once complete.

A process killed with SIGKILL leaves its ``PID.armed`` behind. Readers never trust one: it names the pid's
start time, checked against /proc. :func:`prune_stale` removes such leftovers, and only those: in the
private directory, regular files of ours, named as kvdiag names them, for a pid that is gone (an armed
record also when its pid now belongs to a later process).
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

ENABLE_ENV = "KVDIAG_AGENT"
DIR_ENV = "KVDIAG_AGENT_DIR"
FORMAT = "kvdiag-agent 1"
# The second way out of ``no_access``, beside granting ptrace: how a refused process becomes readable.
AGENT_FIX = (f"or start the engine with {ENABLE_ENV}=1 in its environment (kvdiag installed in its Python): kvdiag "
             "then reads it through its in-process agent, without ptrace")


def agent_dir(uid: int | None = None, environ: dict[str, str] | None = None) -> Path:
    """The agent directory of ``uid`` (default: ours) under ``environ`` (default: ours)."""
    env = os.environ if environ is None else environ
    explicit = env.get(DIR_ENV, "")
    if explicit:
        return Path(explicit)
    who = os.getuid() if uid is None else uid
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else Path(tempfile.gettempdir())
    return base / f"kvdiag-agent-{who}"


def private_dir_problem(path: Path, uid: int | None = None) -> str | None:
    """None when ``path`` is a real directory owned by ``uid`` (default: ours) that only its owner may
    enter; else why not."""
    who = os.getuid() if uid is None else uid
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != who:
        return f"{path} belongs to uid {st.st_uid}, not {who}"
    if st.st_mode & 0o077:
        return f"{path} is open to others (mode {stat.S_IMODE(st.st_mode):o}); it must be 0700"
    return None


def ensure_private_dir(path: Path) -> str | None:
    """Create ``path`` 0700 if missing; None when it is fit to use, else why not."""
    try:
        path.mkdir(mode=0o700, parents=False, exist_ok=True)
    except FileNotFoundError:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            return f"cannot create {path}: {exc.strerror}"
    except OSError as exc:
        return f"cannot create {path}: {exc.strerror}"
    return private_dir_problem(path)


def armed_name(pid: int) -> str:
    return f"{pid}.armed"


def request_name(pid: int, nonce: int, ext: str) -> str:
    """``PID.NONCE.req`` / ``.tmp`` / ``.dump``."""
    return f"{pid}.{nonce}.{ext}"


@dataclass(frozen=True)
class ArmedRecord:
    """What an armed process wrote about itself: which pid (and which start of it) answers which signal."""

    pid: int
    starttime: int        # /proc/PID/stat field 22: tells a reused pid from the process that armed
    trigger: int          # the real-time signal that asks for a dump (sent with sigqueue)
    thread: int           # the signal the trigger handler sends each thread (never sent by kvdiag)
    python: str

    def render(self) -> str:
        return (f"{FORMAT}\npid {self.pid}\nstarttime {self.starttime}\ntrigger {self.trigger}\n"
                f"thread {self.thread}\npython {self.python}\n")

    @staticmethod
    def parse(text: str) -> ArmedRecord | None:
        lines = text.splitlines()
        if not lines or lines[0] != FORMAT:
            return None
        fields = dict(ln.split(" ", 1) for ln in lines[1:] if " " in ln)
        try:
            return ArmedRecord(int(fields["pid"]), int(fields["starttime"]), int(fields["trigger"]),
                               int(fields["thread"]), fields.get("python", ""))
        except (KeyError, ValueError):
            return None


def starttime_of(stat_text: str) -> int | None:
    """Field 22 (starttime) of a /proc/PID/stat line."""
    try:
        return int(stat_text[stat_text.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


_ARMED_FILE = re.compile(r"^(\d+)\.armed$")
# What else kvdiag leaves keyed by a pid: requests and dumps (NONCE), an armed record being written, one set aside.
_PID_FILE = re.compile(r"^(\d+)\.(?:\d+\.(?:req|tmp|dump)|armed\.tmp|armed\.stale\.\d+)$")
_RECORD_MAX = 4096


def proc_starttime(pid: int) -> int | None:
    """The start time of ``pid`` (/proc/PID/stat field 22), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return starttime_of(fh.read())
    except OSError:
        return None


def _ours(st: os.stat_result, uid: int) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == uid


def _remove_stale_record(path: Path, pid: int, uid: int) -> bool:
    """Remove the armed record ``path`` when the process it names is no longer running; True when removed.

    Read through a descriptor that follows no link; removed by renaming it aside first and checking that the
    file set aside is the one read: a process that took the pid over and armed in between (its record
    replaces the file atomically) keeps its record."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        seen = os.fstat(fd)
        if not _ours(seen, uid) or seen.st_size > _RECORD_MAX:
            return False
        record = ArmedRecord.parse(os.read(fd, _RECORD_MAX).decode("ascii"))
    except (OSError, UnicodeDecodeError):
        return False
    finally:
        os.close(fd)
    if record is None or record.pid != pid or proc_starttime(pid) == record.starttime:
        return False
    aside = path.with_name(f"{path.name}.stale.{os.getpid()}")
    try:
        os.rename(path, aside)
    except OSError:
        return False
    try:
        now = os.lstat(aside)
        if (now.st_dev, now.st_ino) == (seen.st_dev, seen.st_ino):
            os.unlink(aside)
            return True
        try:
            os.link(aside, path)     # a newer record moved aside by mistake: back, never over a newer one
        except OSError:
            pass
        os.unlink(aside)
    except OSError:
        pass
    return False


def prune_stale(directory: Path, uid: int | None = None) -> list[str]:
    """Remove from the private agent ``directory`` what kvdiag left there for processes that are gone (a
    target killed with SIGKILL never removes its own armed record); the names removed. Anything not named
    the way kvdiag names its files, not a regular file, or not ``uid``'s is left alone, as is every file of
    a live pid (an armed record whose pid is live with another start time is stale: that pid was reused)."""
    who = os.getuid() if uid is None else uid
    if private_dir_problem(directory, who) is not None:
        return []
    removed: list[str] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        path = directory / name
        armed = _ARMED_FILE.match(name)
        if armed:
            if _remove_stale_record(path, int(armed.group(1)), who):
                removed.append(name)
            continue
        other = _PID_FILE.match(name)
        if other is None or proc_starttime(int(other.group(1))) is not None:
            continue
        try:
            if _ours(os.lstat(path), who):
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue
    return removed
