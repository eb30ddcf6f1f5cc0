"""/proc/PID/status (and a task's) as a typed record of the fields kvdiag reads."""

from __future__ import annotations

from dataclasses import dataclass

from kvdiag.osread.files import PROC, read_text


@dataclass(frozen=True)
class Status:
    """Fields of a status file; None where the line is missing or malformed."""

    state: str                          # the State letter ("S" of "S (sleeping)"); "?" when missing
    ppid: int | None = None
    uid: int | None = None              # the real uid (first of the Uid line)
    tracer_pid: int | None = None       # 0 when nothing traces it
    sig_caught: int | None = None       # SigCgt bit mask (signal n is bit n-1)
    cap_eff: int | None = None          # CapEff bit mask
    seccomp: int | None = None          # 0 off, 1 strict, 2 filter
    ctx_switches: int | None = None     # voluntary + nonvoluntary context switches
    voluntary: int | None = None        # the thread gave up the CPU (it blocked or slept)
    nonvoluntary: int | None = None     # the kernel took the CPU from it (it was running)


def _int(text: str | None, base: int = 10) -> int | None:
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def parse_status(text: str) -> Status:
    """Every ``Key:\\tvalue`` line of a status file, the fields kvdiag uses typed."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, val = line.partition(":")
        if sep:
            fields[key.strip()] = val.strip()
    uid = fields.get("Uid", "").split()
    switches = [v for k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")
                if (v := _int(fields.get(k))) is not None]
    digits = {k: fields[k] for k in ("PPid", "TracerPid", "Seccomp") if fields.get(k, "").isdigit()}
    return Status(state=fields.get("State", "?")[:1] or "?",
                  ppid=_int(digits.get("PPid")), uid=_int(uid[0]) if uid else None,
                  tracer_pid=_int(digits.get("TracerPid")), sig_caught=_int(fields.get("SigCgt"), 16),
                  cap_eff=_int(fields.get("CapEff"), 16), seccomp=_int(digits.get("Seccomp")),
                  ctx_switches=sum(switches) if switches else None,
                  voluntary=_int(fields.get("voluntary_ctxt_switches")),
                  nonvoluntary=_int(fields.get("nonvoluntary_ctxt_switches")))


def read_status(pid: int | str, tid: int | None = None, proc_root: str = PROC) -> Status | None:
    """/proc/<pid>[/task/<tid>]/status (``pid`` may be "self"); None when gone, refused or empty."""
    path = f"{proc_root}/{pid}/task/{tid}/status" if tid is not None else f"{proc_root}/{pid}/status"
    text = read_text(path)
    return parse_status(text) if text else None
