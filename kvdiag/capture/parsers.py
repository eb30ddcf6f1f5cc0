"""Parsers for the text the stack tools print. Pure functions: text in, typed threads out.

Every parser returns frames innermost first (pystack prints outermost first
and is reversed here). Formats (see tests/fixtures for real samples):

- pystack: ``Traceback for thread TID (name) [Has the GIL] (most recent call last):``
  then ``(Python) File "f", line N, in func`` / ``(C) File "f", line N, in func (lib)``;
- py-spy dump: ``Thread TID (idle|active[+gil]): "name"`` then ``func (file:line)``;
- gdb ``thread apply all bt``: ``Thread N (Thread 0x.. (LWP TID) "name"):`` then
  ``#k  0xADDR in func (args) at file:line`` / ``... from lib``.
"""

from __future__ import annotations

import re

from kvdiag.model.evidence import Frame, ThreadEvidence
from kvdiag.model.kinds import GilState
from kvdiag.model.ranks import STEP_LOCALS

# ---------------------------------------------------------------- pystack

_PYSTACK_HEAD = re.compile(r"^Traceback for thread (\d+)(.*)\(most recent call last\):\s*$")
_PYSTACK_FRAME = re.compile(r"^\s*\((Python|C)\) File \"(.*)\", line (-?\d+), in (.*)$")
_PYSTACK_VERSION = re.compile(r"Python v?(\d+\.\d+(?:\.\d+)?)")


def _pystack_status(rest: str) -> tuple[str | None, GilState, list[str]]:
    """Split ``" (name) [Has the GIL] "`` into name, GIL state and the raw status words."""
    rest = rest.strip()
    status_words: list[str] = []
    m = re.search(r"\[([^\[\]]*)\]\s*$", rest)
    if m:
        status_words = [w.strip() for w in m.group(1).split(",") if w.strip()]
        rest = rest[:m.start()].strip()
    name = rest[1:-1] if rest.startswith("(") and rest.endswith(")") else (rest or None)
    joined = " ".join(status_words).lower()
    if "has the gil" in joined:
        gil = GilState.HOLDS
    elif "waiting for the gil" in joined:
        gil = GilState.WAITING
    else:
        # pystack flags a waiter only when a frame is literally take_gil; a stripped interpreter
        # hides it, so an empty status means "not holding", not "not waiting".
        gil = GilState.UNKNOWN
    return name, gil, status_words


_PYSTACK_LOCALS_HEAD = re.compile(r"^\s+(Arguments|Locals):\s*$")
_PYSTACK_LOCAL = re.compile(r"^(\s+)([A-Za-z_]\w*): (.*)$")
# pystack's summary of a threading.Lock / RLock object: the type and the address, nothing of its state.
_LOCK_VALUE = re.compile(r"^<(?:_thread\.)?(lock|RLock)(?: object)? at (0x[0-9a-fA-F]+)>$")


def keep_lock_locals(text: str) -> str:
    """``pystack --locals`` output with every local dropped but the lock-typed ones (``name: <_thread.lock
    at 0x...>``): the values of other locals (tokens, prompts, user data) never reach the bundle."""
    out: list[str] = []
    header: str | None = None       # an Arguments:/Locals: header not written yet
    in_locals = False
    for line in text.splitlines():
        if _PYSTACK_LOCALS_HEAD.match(line):
            in_locals, header = True, line
            continue
        if in_locals:
            entry = _PYSTACK_LOCAL.match(line)
            if entry and not _PYSTACK_FRAME.match(line) and not _PYSTACK_HEAD.match(line):
                if _LOCK_VALUE.match(entry.group(3).strip()):
                    if header is not None:
                        out.append(header)
                        header = None
                    out.append(f"{entry.group(1)}{entry.group(2)}: {entry.group(3).strip()}")
                continue
            if not (_PYSTACK_FRAME.match(line) or _PYSTACK_HEAD.match(line) or not line.strip()):
                continue     # a continuation of a dropped value
            in_locals, header = False, None
        out.append(line)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def parse_pystack(text: str) -> tuple[list[ThreadEvidence], str | None]:
    """Threads from ``pystack remote --native`` output, frames innermost first."""
    threads: list[ThreadEvidence] = []
    version: str | None = None
    current: ThreadEvidence | None = None
    outer_first: list[Frame] = []
    last_python: Frame | None = None
    in_locals = False      # inside an Arguments:/Locals: block (pystack --locals)

    def flush() -> None:
        if current is not None:
            current.frames = list(reversed(outer_first))
            threads.append(current)

    for line in text.splitlines():
        head = _PYSTACK_HEAD.match(line)
        if head:
            flush()
            name, gil, _ = _pystack_status(head.group(2))
            current = ThreadEvidence(tid=int(head.group(1)), name=name, gil=gil)
            outer_first = []
            last_python = None
            in_locals = False
            continue
        if current is None:
            vm = _PYSTACK_VERSION.search(line)
            if vm and version is None:
                version = vm.group(1)
            continue
        fm = _PYSTACK_FRAME.match(line)
        if fm:
            kind, file, lineno, rest = fm.groups()
            if kind == "Python":
                frame = Frame(name=rest.strip(), kind="python", file=file, line=int(lineno))
                last_python = frame
            else:
                func, library = _split_trailing_library(rest.strip())
                frame = Frame(name=func, kind="native", file=None if file == "???" else file,
                              line=int(lineno) or None, library=library)
                last_python = None
            outer_first.append(frame)
            in_locals = False
            continue
        if _PYSTACK_LOCALS_HEAD.match(line):
            in_locals = True
            continue
        entry = _PYSTACK_LOCAL.match(line) if in_locals else None
        if entry is not None:
            lock = _LOCK_VALUE.match(entry.group(3).strip())
            if lock and last_python is not None:
                last_python.locks[entry.group(2)] = int(lock.group(2), 16)
            continue
        in_locals = False
        stripped = line.strip()
        if last_python is not None and stripped and line.startswith("        "):
            last_python.source = stripped[:300]
    flush()
    return threads, version


def _split_trailing_library(rest: str) -> tuple[str, str | None]:
    """``func (inlined) (/lib/x.so)`` → (``func``, ``/lib/x.so``)."""
    library: str | None = None
    if rest.endswith(")"):
        idx = rest.rfind(" (")
        if idx > 0:
            candidate = rest[idx + 2:-1]
            if "/" in candidate or ".so" in candidate or candidate.startswith("python"):
                library = candidate
                rest = rest[:idx]
    if rest.endswith(" (inlined)"):
        rest = rest[: -len(" (inlined)")]
    return rest.strip(), library


# ---------------------------------------------------------------- py-spy

_PYSPY_HEAD = re.compile(r"^Thread (0x[0-9A-Fa-f]+|\d+) \(([^)]*)\)(?::\s*\"(.*)\")?\s*$")
_PYSPY_FRAME = re.compile(r"^\s+(.*?) \(([^()]*)\)\s*$")
_PYSPY_VERSION = re.compile(r"^Python v(\d+\.\d+(?:\.\d+)?)")
_PY_LOCATION = re.compile(r"(\.pyw?|\.pyx):(\d+)$|^<[^>]*>:(\d+)$")


# Of ``py-spy dump --locals`` only the integer step counters (kvdiag.model.STEP_LOCALS) are kept.
_PYSPY_STEP = re.compile(r"^\s{8,}(" + "|".join(STEP_LOCALS) + r"): (-?\d{1,18})\s*$")
_PYSPY_FRAME_LINE = re.compile(r"^ {4}\S")


def keep_step_locals(text: str) -> str:
    """``py-spy dump --locals`` output with every local dropped but the integer step counters
    (:data:`kvdiag.model.STEP_LOCALS`): the values of other locals (tokens, prompts, user data) never reach the bundle.
    Kept: the headers before the first thread, thread headers, frame lines (four spaces in) and those counters;
    every other line (an Arguments:/Locals: header, a value, a value's continuation) goes."""
    out: list[str] = []
    seen_thread = False
    for line in text.splitlines():
        if _PYSPY_HEAD.match(line):
            seen_thread = True
            out.append(line)
        elif not seen_thread or _PYSPY_STEP.match(line):
            out.append(line)
        elif _PYSPY_FRAME_LINE.match(line) and _PYSPY_FRAME.match(line):
            out.append(line)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def parse_pyspy(text: str) -> tuple[list[ThreadEvidence], str | None]:
    """Threads from ``py-spy dump`` output (with or without ``--native``; with ``--locals`` once
    :func:`keep_step_locals` kept only the step counters, which go to their frame's ``counters``).

    The status word goes into ``name`` only when py-spy gave no thread name; ``active+gil``
    marks the GIL holder. Hexadecimal thread ids (old py-spy) cannot be mapped to a TID and
    are skipped.
    """
    threads: list[ThreadEvidence] = []
    version: str | None = None
    current: ThreadEvidence | None = None
    for line in text.splitlines():
        vm = _PYSPY_VERSION.match(line)
        if vm:
            version = vm.group(1)
            continue
        head = _PYSPY_HEAD.match(line)
        if head:
            ident, status, name = head.groups()
            current = None
            if ident.startswith("0x"):
                continue
            gil = GilState.HOLDS if "gil" in status.split("+") else GilState.UNKNOWN
            current = ThreadEvidence(tid=int(ident), name=name, gil=gil)
            threads.append(current)
            continue
        if current is None or not line.startswith(" "):
            continue
        step = _PYSPY_STEP.match(line)
        if step is not None:
            if current.frames and current.frames[-1].kind == "python":
                current.frames[-1].counters[step.group(1)] = int(step.group(2))
            continue
        fm = _PYSPY_FRAME.match(line)
        if fm:
            func, loc = fm.group(1).strip(), fm.group(2).strip()
            lm = _PY_LOCATION.search(loc)
            if lm:
                file, _, lineno = loc.rpartition(":")
                current.frames.append(Frame(name=func, kind="python", file=file, line=int(lineno)))
            elif ":" in loc and loc.rpartition(":")[2].isdigit():
                file, _, lineno = loc.rpartition(":")
                current.frames.append(Frame(name=func, kind="native", file=file, line=int(lineno)))
            else:
                current.frames.append(Frame(name=func, kind="native", library=loc or None))
        elif line.strip():
            current.frames.append(Frame(name=line.strip(), kind="native"))
    return threads, version


def pyspy_status(text: str) -> dict[int, str]:
    """TID → py-spy's own status word (idle / active / active+gil)."""
    out: dict[int, str] = {}
    for line in text.splitlines():
        head = _PYSPY_HEAD.match(line)
        if head and not head.group(1).startswith("0x"):
            out[int(head.group(1))] = head.group(2)
    return out


# ---------------------------------------------------------------- gdb

_GDB_THREAD = re.compile(
    r"^Thread \d+ \((?:Thread 0x[0-9a-fA-F]+ \()?(?:LWP|process) (\d+)\)?(?: \"(.*)\")?\)?:\s*$")
_GDB_FRAME = re.compile(r"^#(\d+)\s+(?:0x[0-9a-fA-F]+ in )?(.*)$")
_GDB_AT = re.compile(r"\s+at\s+(\S.*?):(\d+)\s*$")
_GDB_FROM = re.compile(r"\s+from\s+(\S+)\s*$")


def _gdb_function_name(head: str) -> str:
    """Name part of ``func (args...)``: up to the first `` (`` outside template brackets."""
    depth = 0
    for i, ch in enumerate(head):
        if ch == "<":
            depth += 1
        elif ch == ">" and depth > 0:
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0 and head[i - 1] == " ":
            return head[: i - 1].strip()
    return head.strip()


def parse_gdb_frame(rest: str) -> Frame:
    file: str | None = None
    line: int | None = None
    library: str | None = None
    at = _GDB_AT.search(rest)
    if at:
        file, line = at.group(1), int(at.group(2))
        rest = rest[: at.start()]
    else:
        frm = _GDB_FROM.search(rest)
        if frm:
            library = frm.group(1)
            rest = rest[: frm.start()]
    name = _gdb_function_name(rest)
    return Frame(name=name or "??", kind="native", file=file, line=line, library=library)


def parse_gdb(text: str) -> list[ThreadEvidence]:
    """Threads from ``gdb -batch -ex 'thread apply all bt'`` output."""
    threads: list[ThreadEvidence] = []
    current: ThreadEvidence | None = None
    for line in text.splitlines():
        th = _GDB_THREAD.match(line)
        if th:
            current = ThreadEvidence(tid=int(th.group(1)), name=th.group(2))
            threads.append(current)
            continue
        if current is None:
            continue
        fm = _GDB_FRAME.match(line)
        if fm:
            current.frames.append(parse_gdb_frame(fm.group(2)))
    return threads
