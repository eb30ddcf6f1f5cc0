"""The /proc backend: state, wchan, kernel stack, syscall and CPU of every task, without stopping it.

Besides the plain readings it does two symbol-free, stop-free inferences by
reading the target's memory through /proc/PID/mem (root or same-user with
ptrace rights, the same permission the stack tools need):

- the GIL: ``_PyRuntime`` is an exported dynamic symbol even in stripped
  interpreters; the GIL struct lives inside it. A thread whose futex(2)
  address falls in that struct waits for the GIL; the struct's ``locked``
  flag and ``last_holder`` thread state name the holder (its
  ``native_thread_id`` is one of the process's TIDs);
- mutex owners: a thread in ``FUTEX_WAIT`` on a glibc mutex waits for the TID
  stored in the mutex's ``__owner`` field (PI mutexes store it in the word).
"""

from __future__ import annotations

import os
import re
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvdiag.capture import kwaits, xwaits
from kvdiag.capture.base import BackendResult
from kvdiag.capture.fds import FdResolver
from kvdiag.model.evidence import (
    FdInfo,
    KernelWait,
    ProcessEvidence,
    ProgressSample,
    ThreadEvidence,
    ThreadObservation,
    ToolRun,
)
from kvdiag.model.kinds import GilState, ThreadState
from kvdiag.model.run import Finding
from kvdiag.osread.elfsym import RuntimeSymbol, find_runtime_symbol
from kvdiag.osread.fds import epoll_targets, fd_stat, readlink
from kvdiag.osread.mem import TargetMemory
from kvdiag.osread.process import read_cmdline, read_comm, read_exe, read_io
from kvdiag.osread.stat import read_stat
from kvdiag.osread.status import Status, read_status
from kvdiag.osread.syscall import (
    FUTEX_PI_CMDS,
    FUTEX_TID_MASK,
    FUTEX_WAIT,
    HOST_MACHINE,
    HOST_POLL_TIMEOUT_ARG,
    HOST_SELECT_TIMEOUT,
    HOST_SYSCALLS,
    futex_wait_of,
    int_timeout,
    parse_syscall,
)
from kvdiag.osread.tasks import TaskReading, read_syscall, read_wchan, snapshot
from kvdiag.redact.files import write_redacted
from kvdiag.redact.rules import Tally, redact_argv

# Offset of the GIL struct inside _PyRuntime, per CPython version, read from debug builds with gdb
# (``p (char*)&_PyRuntime.ceval.gil - (char*)&_PyRuntime``); other versions are located by scanning.
_GIL_OFFSETS: dict[tuple[int, int], int] = {(3, 11): 360}
_DEFAULT_SWITCH_INTERVAL_US = 5000
# interval, last_holder, locked(+pad), switch_number, then cond, mutex, switch_cond, switch_mutex.
_PTHREAD_MUTEX_SIZE = 48 if HOST_MACHINE == "aarch64" else 40
_PTHREAD_COND_SIZE = 48
GIL_STRUCT_SIZE = 32 + 2 * (_PTHREAD_COND_SIZE + _PTHREAD_MUTEX_SIZE)
_MAX_RUNTIME_SCAN = 4 << 20

_STATE = {"R": ThreadState.RUNNING, "S": ThreadState.SLEEPING, "D": ThreadState.DISK_SLEEP,
          "T": ThreadState.STOPPED, "t": ThreadState.STOPPED, "Z": ThreadState.ZOMBIE,
          "X": ThreadState.ZOMBIE, "I": ThreadState.SLEEPING}


def thread_state(code: str) -> ThreadState:
    return _STATE.get(code[:1], ThreadState.UNKNOWN)


def log_files(pid: int) -> list[str]:
    """Regular files the process writes its stdout/stderr to (where a bare process logs)."""
    out: list[str] = []
    for fd in (1, 2):
        path = readlink(pid, fd)
        if path is None or not path.startswith("/") or path.startswith(("/dev/", "/proc/")) or path in out:
            continue
        st = fd_stat(pid, fd)
        if st is not None and stat.S_ISREG(st.st_mode):
            out.append(path)
    return out


def _sizes(pid: int, paths: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for fd in (1, 2):
        path = readlink(pid, fd)
        if path in paths and path not in out and (st := fd_stat(pid, fd)) is not None:
            out[path] = st.st_size
    return out


def _version_of(path: str) -> tuple[int, int] | None:
    m = re.search(r"python(\d)\.(\d+)", os.path.basename(path))
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass
class GilInfo:
    runtime: RuntimeSymbol
    start: int
    end: int
    precise: bool                # the GIL struct itself, not all of _PyRuntime
    locked: bool | None = None
    holder_tid: int | None = None
    how: str = ""


def _plausible_gil(head: bytes) -> bool:
    interval, last_holder, locked = struct.unpack_from("<QQi", head, 0)
    if not 0 < interval < 10**9 or locked not in (0, 1):
        return False
    return bool(last_holder == 0 or (last_holder > 0x10000 and last_holder % 8 == 0))


def locate_gil(pid: int, mem: TargetMemory, tids: list[int]) -> GilInfo | None:
    """Find the GIL struct of ``pid`` and, when it is held, the holder's TID."""
    rt = find_runtime_symbol(pid)
    if rt is None:
        return None
    info = GilInfo(runtime=rt, start=rt.address, end=rt.address + max(rt.size, 1), precise=False,
                   how="_PyRuntime extent (GIL offset unknown for this interpreter)")
    version = _version_of(rt.object_path) or _version_of(os.path.realpath(read_exe(pid) or ""))
    start: int | None = None
    if version in _GIL_OFFSETS:
        cand = rt.address + _GIL_OFFSETS[version]
        head = mem.read(cand, 24)
        if head is not None and _plausible_gil(head):
            start = cand
            info.how = f"_PyRuntime+{_GIL_OFFSETS[version]} (CPython {version[0]}.{version[1]})"
    if start is None and rt.size:
        blob = mem.read(rt.address, min(rt.size, _MAX_RUNTIME_SCAN))
        if blob is not None:
            hits = [off for off in range(0, len(blob) - 24, 8)
                    if struct.unpack_from("<Q", blob, off)[0] == _DEFAULT_SWITCH_INTERVAL_US
                    and _plausible_gil(blob[off:off + 24])]
            if len(hits) == 1:
                start = rt.address + hits[0]
                info.how = f"_PyRuntime+{hits[0]} (found by its switch interval)"
    if start is None:
        return info
    info.start, info.end, info.precise = start, start + GIL_STRUCT_SIZE, True
    info.locked, info.holder_tid = read_gil_holder(mem, info, tids)
    return info


def read_gil_holder(mem: TargetMemory, info: GilInfo, tids: list[int]) -> tuple[bool | None, int | None]:
    """(locked, holder TID) of a located GIL struct, read now (cheap: used again after the sample window)."""
    if not info.precise:
        return None, None
    head = mem.read(info.start, 24)
    if head is None:
        return None, None
    _, last_holder, locked = struct.unpack_from("<QQi", head, 0)
    holder: int | None = None
    if locked == 1 and last_holder:
        tstate = mem.read(last_holder, 1024)
        if tstate is not None:
            wanted = set(tids)
            found = {v for off in range(0, len(tstate) - 7, 8)
                     if (v := struct.unpack_from("<Q", tstate, off)[0]) in wanted}
            if len(found) == 1:
                holder = found.pop()
    return locked == 1, holder


def futex_owner(mem: TargetMemory, addr: int, cmd: int, tids: set[int], waiter: int) -> int | None:
    """Owner TID of the lock a FUTEX_WAIT / LOCK_PI waiter sleeps on, if it is a mutex we can read."""
    if cmd in FUTEX_PI_CMDS:
        word = mem.read(addr, 4)
        if word is None:
            return None
        owner = struct.unpack("<I", word)[0] & FUTEX_TID_MASK
    elif cmd == FUTEX_WAIT:
        data = mem.read(addr, 12)
        if data is None:
            return None
        lock, _count, owner = struct.unpack("<IIi", data)
        if lock == 0:
            return None
    else:
        return None
    return owner if owner in tids and owner != waiter else None


@dataclass
class ProcWindow:
    """A progress window opened by :meth:`ProcBackend.begin`: the first sample and what was read inside it."""

    pid: int
    start: float
    window_start: float
    window_end: float
    status: Status
    logs: list[str]
    io_before: dict[str, int]
    sizes_before: dict[str, int]
    first: dict[int, TaskReading]
    mem: TargetMemory
    mem_ok: bool = False
    gil: GilInfo | None = None
    proc: ProcessEvidence | None = None
    tally: Tally = field(default_factory=Tally)
    resolver: FdResolver | None = None
    deadline: float | None = None   # the fd resolver's bound
    # tid -> (raw syscall line, (fds, wait timeout)), resolved inside the window from the first sample
    fd_waits: dict[int, tuple[str, tuple[list[FdInfo], int | None]]] = field(default_factory=dict)
    shared: xwaits.SharedWindow | None = None   # shared mappings' first reading (kvdiag.capture.xwaits)
    task_io: dict[int, dict[str, int]] = field(default_factory=dict)   # each thread's I/O counters, first sample
    kernel_waits: dict[int, tuple[str, KernelWait]] = field(default_factory=dict)   # tid -> (syscall line, wait)


class ProcBackend:
    """Reads /proc (and, read-only, /proc/PID/mem). Never stops the target."""

    name = "proc"
    stops_target = False

    def __init__(self, cpu_interval_s: float = 0.4) -> None:
        self.cpu_interval_s = cpu_interval_s

    def available(self) -> str | None:
        return None if os.path.isdir("/proc/self/task") else "/proc is not mounted"

    def capture(self, pid: int, timeout_s: float, raw_dir: Path) -> BackendResult:
        opened = self.begin(pid, timeout_s)
        if isinstance(opened, BackendResult):
            return opened
        time.sleep(max(0.0, opened.window_end - time.monotonic()))
        return self.finish(opened, raw_dir)

    def begin(self, pid: int, timeout_s: float) -> ProcWindow | BackendResult:
        """Open the progress window: the first reading of everything that can move, then (inside the
        window, while the target runs untouched) the readings that need no second sample: the process's
        identity, the GIL's place, the fds blocked threads wait on. A BackendResult: nothing to read.

        The caller waits until ``window_end`` (other processes' windows and non-pausing tools may run
        meanwhile; nothing may pause the target) and then calls :meth:`finish`.
        """
        start = time.monotonic()
        argv = [f"/proc/{pid}"]
        status = read_status(pid)
        if status is None:
            run = ToolRun(tool=self.name, ok=False, duration_s=0.0, command=argv,
                          error=f"process {pid} does not exist")
            return BackendResult(tool=run, process=ProcessEvidence(pid=pid, alive=False))
        # Progress window: everything that can move is read at both ends, before any tool pauses the target.
        logs = log_files(pid)
        io_before, sizes_before = read_io(pid), _sizes(pid, logs)
        first = snapshot(pid, full=True)
        task_io = {tid: read_io(pid, tid) for tid in first}
        window_start = time.monotonic()
        interval = max(0.0, min(self.cpu_interval_s, timeout_s / 4))
        w = ProcWindow(pid=pid, start=start, window_start=window_start, window_end=window_start + interval,
                       status=status, logs=logs, io_before=io_before, sizes_before=sizes_before, first=first,
                       mem=TargetMemory(pid), task_io=task_io)
        w.mem_ok = w.mem.ok
        # Inside the window: what needs no second sample.
        w.gil = locate_gil(pid, w.mem, list(first)) if w.mem.ok else None
        w.proc = self._process(pid, status, w.tally)
        w.deadline = start + max(timeout_s, 1.0)
        w.resolver = FdResolver(pid, w.deadline)
        syscalls = {tid: sample.syscall for tid, sample in first.items() if sample.syscall}
        waits = _fd_waits(pid, syscalls, w.mem, w.resolver)
        w.fd_waits = {tid: (syscalls[tid], found) for tid, found in waits.items()}
        w.kernel_waits = {tid: (syscalls[tid], kw) for tid, kw in
                          kwaits.kernel_waits(pid, syscalls, w.mem, w.deadline).items()}
        w.shared = xwaits.begin(pid)
        return w

    def finish(self, w: ProcWindow, raw_dir: Path) -> BackendResult:
        """Close the window (second sample) and build the evidence."""
        pid, first, mem, gil = w.pid, w.first, w.mem, w.gil
        tids = list(first)
        try:
            second = snapshot(pid, full=False)
            second_sys = {tid: read_syscall(pid, tid) for tid in first}
            io_second = {tid: read_io(pid, tid) for tid in first}
            io_after, sizes_after = read_io(pid), _sizes(pid, w.logs)
            window = time.monotonic() - w.window_start
            holder_after: int | None = None
            if gil is not None and mem.ok:
                _, holder_after = read_gil_holder(mem, gil, tids)
            elapsed = max(time.monotonic() - w.start, 1e-6)
            proc, tally, status = w.proc, w.tally, w.status
            assert proc is not None
            proc.tracer_pid = status.tracer_pid or None
            proc.log_files = w.logs
            findings: list[Finding] = []
            threads = self._threads(pid, first, second, second_sys, mem, gil)
            # Inside the window each thread's fds were resolved from the first sample; a thread whose syscall
            # line differs now (it was running then) is resolved here, all of them at once.
            resolver = w.resolver or FdResolver(pid, w.deadline)
            late = {th.tid: th.syscall for th in threads
                    if th.syscall and (th.tid not in w.fd_waits or w.fd_waits[th.tid][0] != th.syscall)}
            waits = {tid: found for tid, (_, found) in w.fd_waits.items()}
            waits.update(_fd_waits(pid, late, mem, resolver))
            for th in threads:
                if th.syscall and th.tid in waits:
                    th.blocked_fds, th.wait_timeout_ms = waits[th.tid]
                kw = w.kernel_waits.get(th.tid)
                if kw is not None and kw[0] == th.syscall:
                    th.kernel_wait = kw[1]
                if th.syscall:
                    th.wait_signals, timeout = _sigwait(th.syscall, mem)
                    if th.wait_signals is not None:
                        th.wait_timeout_ms = timeout
                th.observed = _observation(first[th.tid], second.get(th.tid), first[th.tid].syscall,
                                           second_sys.get(th.tid), w.task_io.get(th.tid), io_second.get(th.tid))
            shared = w.shared or xwaits.begin(pid)
        finally:
            mem.close()
        if not w.mem_ok:
            findings.append(Finding(kind="tool_failed", pid=pid,
                                    message=f"/proc/{pid}/mem unreadable: no GIL or mutex-owner inference"))
        findings += _state_findings(pid, proc, threads)
        if gil is not None:
            proc.gil_futex_range = (gil.start, gil.end)
            proc.python_version = proc.python_version or _fmt_version(gil.runtime.object_path)
        total = sum(t.cpu_ticks_delta or 0 for t in threads)
        clk = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        proc.cpu_percent = round(100.0 * total / clk / elapsed, 1)
        proc.threads = threads
        proc.progress = ProgressSample(
            window_s=round(window, 3), cpu_ticks=total,
            io_delta={k: io_after[k] - w.io_before[k] for k in ("rchar", "wchar", "syscr", "syscw")
                      if k in io_after and k in w.io_before},
            log_growth={p: sizes_after[p] - w.sizes_before[p] for p in sizes_after if p in w.sizes_before},
            gil_holders=[gil.holder_tid, holder_after] if gil is not None and gil.precise else [],
            writes_total=io_after.get("syscw"))
        xwaits.finish(shared, proc, threads, resolver, w.deadline)
        raw = self._write_raw(raw_dir, proc, gil, tally)
        run = ToolRun(tool=self.name, ok=True, duration_s=round(time.monotonic() - w.start, 3),
                      raw_path=str(raw) if raw else None, command=[f"/proc/{pid}"], redactions=tally.as_dict())
        return BackendResult(tool=run, threads=threads, process=proc, findings=findings,
                             python_version=proc.python_version)

    @staticmethod
    def _process(pid: int, status: Status, tally: Tally | None = None) -> ProcessEvidence:
        proc = ProcessEvidence(pid=pid)
        proc.comm = read_comm(pid) or None
        # Redacted as read: a key on the command line never reaches the bundle, proc.txt or a report.
        proc.cmdline = redact_argv((read_cmdline(pid) or [])[:64], tally)
        proc.state = thread_state(status.state)
        proc.wchan = read_wchan(pid)
        proc.exe = read_exe(pid)
        proc.ppid = status.ppid
        mask = status.sig_caught
        proc.signals_caught = [n for n in range(1, 65) if mask >> (n - 1) & 1] if mask is not None else None
        st = read_stat(pid)
        if st is not None:
            proc.pgid = st.pgid
        return proc

    @staticmethod
    def _threads(pid: int, first: dict[int, TaskReading], second: dict[int, TaskReading],
                 second_sys: dict[int, str | None], mem: TargetMemory, gil: GilInfo | None) -> list[ThreadEvidence]:
        tidset = set(first)
        out: list[ThreadEvidence] = []
        for tid, s in sorted(first.items()):
            raw_sys = s.syscall
            nr, _ = parse_syscall(raw_sys)
            if nr is None or nr < 0:
                alt = (second_sys.get(tid) or "").strip() or None
                alt_nr, _ = parse_syscall(alt)
                if alt_nr is not None and alt_nr >= 0:
                    raw_sys, nr = alt, alt_nr
            th = ThreadEvidence(tid=tid, name=s.comm, state=thread_state(s.state), wchan=s.wchan,
                                kernel_stack=list(s.kernel_stack), syscall=raw_sys, syscall_nr=nr)
            later = second.get(tid)
            if later is not None:
                th.utime_ticks, th.stime_ticks = later.utime, later.stime
                if s.ticks is not None and later.ticks is not None:
                    th.cpu_ticks_delta = max(0, later.ticks - s.ticks)
                if s.ctx_switches is not None and later.ctx_switches is not None:
                    th.ctx_switches_delta = max(0, later.ctx_switches - s.ctx_switches)
            fw = futex_wait_of(raw_sys)
            if fw is not None:
                th.futex_addr = fw[0]
                if mem.ok:
                    th.futex_owner_tid = futex_owner(mem, fw[0], fw[1], tidset, tid)
            if gil is not None:
                th.in_gil_struct = th.futex_addr is not None and gil.start <= th.futex_addr < gil.end
                if gil.holder_tid == tid:
                    th.gil = GilState.HOLDS
                elif th.in_gil_struct:
                    th.gil = GilState.WAITING
                elif gil.precise and gil.locked is not None:
                    th.gil = GilState.NONE
            out.append(th)
        return out

    @staticmethod
    def _write_raw(raw_dir: Path, proc: ProcessEvidence, gil: GilInfo | None,
                   tally: Tally | None = None) -> Path | None:
        lines = [f"# /proc/{proc.pid}: comm={proc.comm!r} state={proc.state.value} wchan={proc.wchan} "
                 f"ppid={proc.ppid} pgid={proc.pgid} cpu%={proc.cpu_percent}",
                 f"# cmdline: {' '.join(proc.cmdline)}", f"# exe: {proc.exe}"]
        if gil is not None:
            lines.append(f"# _PyRuntime {gil.runtime.address:#x}+{gil.runtime.size} in {gil.runtime.object_path}")
            lines.append(f"# GIL range {gil.start:#x}-{gil.end:#x} via {gil.how}; locked={gil.locked} "
                         f"holder_tid={gil.holder_tid}")
        else:
            lines.append("# _PyRuntime not found (not a CPython process, or maps unreadable)")
        lines.append("tid\tcomm\tstate\twchan\tcpu_delta\tsyscall\tfutex_owner\tgil\tkernel_stack")
        for t in proc.threads:
            lines.append("\t".join([str(t.tid), t.name or "", t.state.value, t.wchan or "",
                                    str(t.cpu_ticks_delta), t.syscall or "", str(t.futex_owner_tid or ""),
                                    t.gil.value, " <- ".join(t.kernel_stack)]))
        path = raw_dir / "proc.txt"
        try:
            write_redacted(path, "\n".join(lines) + "\n", tally)
        except OSError:
            return None
        return path


_MAX_POLL_FDS = 64
_IO_KEYS = ("rchar", "wchar", "syscr", "syscw")
_WAIT_FIELDS = 5     # a /proc/.../syscall line: the number, then six arguments, the stack and instruction pointers


def _observation(a: TaskReading, b: TaskReading | None, sys_a: str | None, sys_b: str | None,
                 io_a: dict[str, int] | None, io_b: dict[str, int] | None) -> ThreadObservation | None:
    """What the thread did between its two samples; None when it was gone at the second."""
    if b is None:
        return None

    def delta(x: int | None, y: int | None) -> int | None:
        return max(0, y - x) if x is not None and y is not None else None

    same = None
    if sys_a and sys_b and sys_a.strip() != "running" and sys_b.strip() != "running":
        # The number and the first four arguments name a wait (the fd, the futex word and op, the timespec); the
        # last two are often unused by the call and hold whatever the registers held, so a timer loop that sleeps
        # again in the same call would read as "somewhere else" from them.
        same = sys_a.split()[:_WAIT_FIELDS] == sys_b.split()[:_WAIT_FIELDS]
    elif (sys_a or "").strip() == "running" or (sys_b or "").strip() == "running":
        same = False
    io = {k: io_b[k] - io_a[k] for k in _IO_KEYS if io_a and io_b and k in io_a and k in io_b}
    return ThreadObservation(cpu_ticks=delta(a.ticks, b.ticks), voluntary_switches=delta(a.voluntary, b.voluntary),
                             nonvoluntary_switches=delta(a.nonvoluntary, b.nonvoluntary), same_syscall=same,
                             io_delta=io)


def _fd_waits(pid: int, syscalls: dict[int, str], mem: TargetMemory,
              resolver: FdResolver) -> dict[int, tuple[list[FdInfo], int | None]]:
    """For threads blocked in read/recv/epoll/poll (tid -> raw syscall line): which fds, their peers and
    the wait's timeout; threads whose syscall waits on no fd are left out.

    All threads' fds are resolved together: one host-wide socket table and one /proc/*/fd scan."""
    timeouts: dict[int, int | None] = {}
    wanted: dict[int, list[int]] = {}
    mqueues: set[int] = set()   # fds an mq_timedreceive waits on: POSIX message queues
    for tid, syscall in syscalls.items():
        nr, args = parse_syscall(syscall)
        if nr is None or nr < 0 or not args:
            continue
        fds: list[int] = []
        timeout: int | None = None
        if nr in HOST_SYSCALLS.get("read", ()):
            fds = [args[0]]
        elif nr in HOST_SYSCALLS.get("mq_receive", ()) and len(args) >= 5:
            fds = [args[0]]
            mqueues.add(args[0])
            timeout = -1 if args[4] == 0 else None   # an absolute timespec: unread
        elif nr in HOST_SYSCALLS.get("epoll", ()) and len(args) >= 4:
            fds = epoll_targets(pid, args[0])
            timeout = int_timeout(args[3])
        elif nr in HOST_POLL_TIMEOUT_ARG and len(args) >= 3:
            nfds = min(args[1], _MAX_POLL_FDS)
            raw = mem.read(args[0], 8 * nfds) if mem.ok and nfds else None
            if raw is not None:
                fds = [struct.unpack_from("<i", raw, 8 * i)[0] for i in range(nfds)]
                fds = [fd for fd in fds if fd >= 0]
            idx = HOST_POLL_TIMEOUT_ARG[nr]
            if idx >= 0:
                timeout = int_timeout(args[idx])
            else:
                timeout = -1 if args[2] == 0 else None   # ppoll: a NULL timespec waits forever
        elif nr in HOST_SELECT_TIMEOUT and len(args) >= 5:
            fds, timeout = _select_wait(nr, args, mem)
        elif nr in HOST_SYSCALLS.get("sleep", ()) and args:
            timeout = _sleep_left_ms(nr, args, mem)
        else:
            continue
        timeouts[tid] = timeout
        if fds:
            wanted[tid] = fds[:_MAX_POLL_FDS]
    infos: dict[int, FdInfo] = {}
    if wanted:
        infos = {i.fd: i for i in resolver.describe(sorted({fd for fds in wanted.values() for fd in fds}))}
        for fd in mqueues & set(infos):
            resolver.as_mqueue(infos[fd])
    return {tid: ([infos[fd].model_copy() for fd in wanted.get(tid, []) if fd in infos], timeout)
            for tid, timeout in timeouts.items()}


def _sigwait(raw: str, mem: TargetMemory) -> tuple[list[int] | None, int | None]:
    """The signals an rt_sigtimedwait waits for (its set, read from memory) and its timeout in ms (-1: a NULL
    timeout, forever); (None, None) for any other syscall or an unreadable set."""
    nr, args = parse_syscall(raw)
    if nr is None or nr not in HOST_SYSCALLS.get("sigwait", ()) or len(args) < 3 or not mem.ok:
        return None, None
    raw_set = mem.read(args[0], 8)
    if raw_set is None:
        return None, None
    bits = int.from_bytes(raw_set, "little")
    signals = [n + 1 for n in range(64) if bits >> n & 1]
    if args[2] == 0:
        return signals, -1
    ts = mem.read(args[2], 16)
    if ts is None:
        return signals, None
    sec, nsec = struct.unpack("<qq", ts)
    return signals, max(0, sec * 1000 + nsec // 1_000_000)


def _select_wait(nr: int, args: list[int], mem: TargetMemory) -> tuple[list[int], int | None]:
    """The fds a select/pselect6 waits to read (its read set, a bitmap in the target's memory) and its
    timeout in ms (-1: a NULL timeout, forever; None: unread)."""
    nfds = min(args[0], _MAX_POLL_FDS * 16)
    fds: list[int] = []
    if args[1] and nfds > 0 and mem.ok:
        raw = mem.read(args[1], 8 * ((nfds + 63) // 64))
        if raw is not None:
            bits = int.from_bytes(raw, "little")
            fds = [fd for fd in range(nfds) if bits >> fd & 1]
    if args[4] == 0:
        return fds, -1
    raw = mem.read(args[4], 16) if mem.ok else None
    if raw is None:
        return fds, None
    sec, frac = struct.unpack("<qq", raw)
    return fds, max(0, sec * 1000 + (frac // 1000 if HOST_SELECT_TIMEOUT[nr] == "timeval" else frac // 1_000_000))


_TIMER_ABSTIME = 1
_CLOCKS = {0: time.CLOCK_REALTIME, 1: time.CLOCK_MONOTONIC, 7: getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)}


def _sleep_left_ms(nr: int, args: list[int], mem: TargetMemory) -> int | None:
    """How long a thread in nanosleep/clock_nanosleep has left to sleep (its requested timespec read from its
    memory; a relative request counts from the call, so it is an upper bound). None: not readable."""
    clock = nr == max(HOST_SYSCALLS["sleep"])       # clock_nanosleep(clockid, flags, req, rem), not nanosleep(req, rem)
    req = args[2] if clock and len(args) > 2 else args[0]
    raw = mem.read(req, 16) if mem.ok and req else None
    if raw is None or len(raw) < 16:
        return None
    sec, nsec = struct.unpack("<qq", raw)
    ms = int(sec) * 1000 + int(nsec) // 1_000_000
    if clock and args[1] & _TIMER_ABSTIME:
        clk = _CLOCKS.get(args[0])
        if clk is None:
            return None
        ms -= int(time.clock_gettime(clk) * 1000)
    return max(ms, 0)


def _state_findings(pid: int, proc: ProcessEvidence, threads: list[ThreadEvidence]) -> list[Finding]:
    """Say up front what a stopped or uninterruptible target will keep from us."""
    out: list[Finding] = []
    if proc.state is ThreadState.STOPPED:
        out.append(Finding(kind="target_stopped", pid=pid, message=(
            f"pid {pid} is stopped (SIGSTOP or job control): stacks can be read, but CPU use cannot show "
            "which threads would run; left stopped as found")))
    dstate = [t for t in threads if t.state is ThreadState.DISK_SLEEP]
    if dstate:
        where = ", ".join(f"{t.tid} ({t.wchan or '?'})" for t in dstate[:5])
        out.append(Finding(kind="target_uninterruptible", pid=pid, message=(
            f"pid {pid} has {len(dstate)} thread(s) in uninterruptible sleep: {where}; ptrace-based tools "
            "(pystack, gdb) cannot stop them and may time out")))
    return out


def _fmt_version(path: str) -> str | None:
    v = _version_of(path)
    return f"{v[0]}.{v[1]}" if v else None
