"""What one engine's log line says: start-up phase, the pids its prefixes name, banners, error and OOM lines."""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from kvdiag.errors import UsageError
from kvdiag.kvcached.banner import BANNER_MARKER, parse_banner
from kvdiag.model.kinds import EnginePhase
from kvdiag.model.run import BannerInfo

# Characters of one log line kept where a line is quoted (events, reports); a banner is about 300.
MAX_LINE = 2000

# vLLM prefixes: "(EngineCore pid=6898) ...", "(EngineCore_DP0 pid=..)", "(APIServer pid=6790) ...".
_PID_PREFIX = re.compile(r"\((?P<who>[A-Za-z]+(?:_[A-Za-z]*\d+)?)(?:-\d+)? pid=(?P<pid>\d+)\)")
_UVICORN_PID = re.compile(r"Started server process \[(?P<pid>\d+)\]")

# (phase, pattern) in startup order; a later phase never moves the tracker back.
_PHASE_PATTERNS: list[tuple[EnginePhase, re.Pattern[str]]] = [
    # vLLM's wording, and a loader's generic progress ("loading shard 17/40", "Loading checkpoint shards").
    (EnginePhase.LOADING, re.compile(r"Starting to load model|Loading weights|Loading safetensors|load model|"
                                     r"[Ll]oading (?:\w+ )?(?:shards?|checkpoints?|weights)\b")),
    (EnginePhase.PROFILING, re.compile(r"[Pp]rofil|determine_available_memory|Memory profiling")),
    (EnginePhase.KV_INIT,
     re.compile(r"KV cache size|Available KV cache memory|init engine \(profile, create kv cache")),
    (EnginePhase.BANNER, re.compile(re.escape(BANNER_MARKER))),
    (EnginePhase.SERVING, re.compile(r"Application startup complete")),
]
_ORDER = [EnginePhase.NOT_STARTED, EnginePhase.LAUNCHING, EnginePhase.LOADING, EnginePhase.PROFILING,
          EnginePhase.KV_INIT, EnginePhase.BANNER, EnginePhase.SERVING]

# Words of an allocation failure (host or device), and of a process dying.
_OOM_WORDS = (r"out of memory|CUDA_ERROR_OUT_OF_MEMORY|OutOfMemoryError|Cannot allocate memory|oom[-_ ]kill|"
              r"std::bad_alloc")
_CRASH_WORDS = (r"Traceback \(most recent call last\)|EngineDeadError|Fatal Python error|Segmentation fault|"
                r"core dumped|terminate called")
# A log line that reports an allocation failure, or an error worth keeping as the engine's error line.
OOM_LINE = re.compile(_OOM_WORDS, re.IGNORECASE)
TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
# The last line of a traceback: the exception's type and message ("ValueError: ...", "KeyboardInterrupt").
EXCEPTION_END = re.compile(r"(?:^|\s)(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt)(?:: |$)")
ERROR_LINE = re.compile(_CRASH_WORDS + r"|Engine core initialization failed|std::abort|RuntimeError: |AssertionError")
# What names the cause once the process died: a live engine may print "OOM" in advice ("to avoid OOM"), so
# these broader words count only at exit.
OOM_AT_EXIT = re.compile(_OOM_WORDS + r"|\bOOM\b|Killed process \d+|MemoryError", re.IGNORECASE)
CRASH_AT_EXIT = re.compile(_CRASH_WORDS + r"|Aborted|SIGSEGV|SIGABRT|failed in CUDA driver", re.IGNORECASE)


@dataclass
class LogState:
    """What one engine's log has told us so far."""

    phase: EnginePhase = EnginePhase.LAUNCHING
    lines_seen: int = 0
    banners: list[BannerInfo] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    errors: list[str] = field(default_factory=list)
    in_traceback: bool = False       # a traceback began and its exception line has not come yet
    oom: bool = False
    events: list[tuple[EnginePhase, int]] = field(default_factory=list)  # phase reached at line no

    @property
    def last_line(self) -> str | None:
        return self.tail[-1] if self.tail else None


def feed_line(state: LogState, line: str, source: str | None = None) -> list[str]:
    """Update ``state`` with one log line; returns human-readable events it caused."""
    state.lines_seen += 1
    state.tail.append(line)
    events: list[str] = []
    for m in _PID_PREFIX.finditer(line[:80]):
        who = m.group("who").lower()
        role = ("engine_core" if who.startswith("enginecore") else "api_server" if who.startswith("apiserver")
                else "worker" if "worker" in who else None)
        if role and role not in state.pids:
            state.pids[role] = int(m.group("pid"))
            events.append(f"{role} pid {m.group('pid')}")
    um = _UVICORN_PID.search(line)
    if um and "api_server" not in state.pids:
        state.pids["api_server"] = int(um.group("pid"))
    banner = parse_banner(line, state.lines_seen, source)
    if banner is not None:
        state.banners.append(banner)
        # The fields the prealloc deadlock turns on, whole (the raw banner is in the log and the bundle).
        events.append(f"banner group_id={banner.group_id} num_layers={banner.num_layers} "
                      f"mem_size_per_layer={banner.mem_size_per_layer_mb:g}MB page_size={banner.page_size_mb:g}MB "
                      f"enable_prealloc={int(banner.enable_prealloc)} "
                      f"min_reserved_pages={banner.min_reserved_pages} max_reserved_pages={banner.max_reserved_pages}")
    for phase, pattern in _PHASE_PATTERNS:
        if pattern.search(line) and _ORDER.index(phase) > _ORDER.index(state.phase):
            state.phase = phase
            state.events.append((phase, state.lines_seen))
            events.append(f"phase {phase.value}")
    if OOM_LINE.search(line):
        state.oom = True
        state.errors.append(line.strip()[:500])
    elif ERROR_LINE.search(line):
        state.errors.append(line.strip()[:500])
        state.in_traceback = state.in_traceback or bool(TRACEBACK.search(line))
    elif state.in_traceback and EXCEPTION_END.search(line):
        state.errors.append(line.strip()[:500])    # the exception a traceback ends with: its cause
        state.in_traceback = False
    return events


def root_error(errors: list[str]) -> str | None:
    """The error line that names the cause: the first exception (for a vLLM engine, the EngineCore's),
    never a traceback's header nor a later line that only points back at it ("See root cause above")."""
    real = [ln for ln in errors if not TRACEBACK.search(ln) and "root cause" not in ln.lower()]
    core = [ln for ln in real if "EngineCore" in ln]
    pick = core or real or errors
    return pick[0] if pick else None


def read_log_lines(path: Path) -> list[str]:
    """The lines of a log the user named; a UsageError saying why when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        raise UsageError(f"{path}: file not found") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror}") from None
