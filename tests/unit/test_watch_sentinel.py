"""The watch sentinel's judgement over looks (time injected: nothing sleeps), its loop, events, exporter and
retention."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvdiag.runs.watch.events import EventSink, WatchEvent
from kvdiag.runs.watch.exporter import WatchExporter
from kvdiag.runs.watch.retention import capture_dir, prune, watch_captures
from kvdiag.runs.watch.sentinel import CaptureRequest, CaptureResult, EngineTracker, Sentinel
from kvdiag.watch.metrics import ServerMetrics, parse_server_metrics
from kvdiag.watch.reading import CoreSample, Look

VLLM = Path(__file__).resolve().parents[2].parent / "shared" / "vllm"


def look(t: float, running: float = 0, tokens: float = 0, *, waiting: float = 0, start: float | None = 100.0,
         server: int | None = 10, core: int | None = 11, state: str = "S", health: int | None = 200,
         up: bool = True) -> Look:
    m = ServerMetrics(running=running, waiting=waiting, generation_tokens=tokens, start_time=start) if up else None
    c = CoreSample(pid=core, state=state, wchan="futex_do_wait", cpu_ticks=int(t * 10)) if core else None
    return Look(t=t, wall=1000.0 + t, metrics=m, error=None if up else "ConnectError", health=health,
                server_pid=server, core=c)


def events(tr: EngineTracker, looks: list[Look]) -> list[tuple[float, str, dict[str, object]]]:
    return [(lk.t, e.event, e.fields) for lk in looks for e in tr.observe(lk)]


def test_busy_without_progress_for_the_window_is_a_stall_whatever_health_says() -> None:
    tr = EngineTracker("e", "http://x", window_s=5.0)
    looks = [look(t, running=2, tokens=10 * t) for t in range(0, 4)]           # progressing
    looks += [look(t, running=2, tokens=30) for t in range(4, 12)]              # frozen at t=3
    got = events(tr, looks)
    stalls = [(t, f) for t, ev, f in got if ev == "stall"]
    assert len(stalls) == 1
    t, f = stalls[0]
    assert t == 8.0                     # last progress at 3, window 5
    assert f["health"] == 200 and f["quiet_s"] == 5.0 and f["capture"] is True
    assert f["onset_unix"] == 1003.0
    assert tr.stall_onset == 3.0


def test_waiting_requests_count_as_in_flight() -> None:
    tr = EngineTracker("e", "http://x", window_s=3.0)
    got = events(tr, [look(t, running=0, waiting=4, tokens=0) for t in range(0, 6)])
    assert [ev for _, ev, _ in got] == ["stall"]


def test_no_requests_is_idle_never_a_stall() -> None:
    tr = EngineTracker("e", "http://x", window_s=2.0)
    got = events(tr, [look(t, running=0, tokens=5) for t in range(0, 600)])
    assert got == []


def test_slow_but_progressing_is_not_a_stall() -> None:
    tr = EngineTracker("e", "http://x", window_s=5.0)
    got = events(tr, [look(t, running=3, tokens=t // 4) for t in range(0, 120)])   # a token every 4 s
    assert got == []


def test_progress_after_a_stall_is_recovered() -> None:
    tr = EngineTracker("e", "http://x", window_s=2.0)
    looks = [look(t, running=1, tokens=5) for t in range(0, 5)] + [look(5, running=1, tokens=6)]
    got = events(tr, looks)
    assert [ev for _, ev, _ in got] == ["stall", "recovered"]
    assert got[1][2]["what"] == "stall" and got[1][2]["after_s"] == 5.0


def test_a_restart_is_one_event_and_the_stall_clock_starts_over() -> None:
    tr = EngineTracker("e", "http://x", window_s=3.0)
    looks = [look(t, running=1, tokens=10 * t) for t in range(0, 3)]
    looks += [look(t, up=False, health=None) for t in range(3, 6)]                 # down
    looks += [look(t, running=1, tokens=10 * (t - 6), start=200.0, server=20, core=21) for t in range(6, 12)]
    got = events(tr, looks)
    assert [ev for _, ev, _ in got] == ["error", "restart"]
    err, restart = got[0][2], got[1][2]
    assert err["kind"] == "unreachable"
    reasons = " ".join(restart["reasons"])      # type: ignore[arg-type]
    assert "process_start_time_seconds" in reasons and "API server pid 10 -> 20" in reasons
    assert "EngineCore pid 11 -> 21" in reasons
    assert restart["down_s"] == 3.0
    assert tr.restarts == 1 and tr.scrape_errors == 3


def test_counters_going_back_is_a_restart_even_without_pids_or_start_time() -> None:
    tr = EngineTracker("e", "http://x", window_s=3.0)
    looks = [look(t, running=1, tokens=100 + t, start=None, server=None, core=None) for t in range(0, 3)]
    looks += [look(3, running=0, tokens=0, start=None, server=None, core=None)]
    assert [ev for _, ev, _ in events(tr, looks)] == ["restart"]


def test_a_server_back_with_the_same_process_is_recovered_not_restarted() -> None:
    tr = EngineTracker("e", "http://x", window_s=3.0)
    looks = [look(0, tokens=5), look(1, up=False), look(2, up=False, health=200), look(3, tokens=5)]
    got = events(tr, looks)
    assert [ev for _, ev, _ in got] == ["error", "recovered"]
    assert got[1][2]["what"] == "unreachable"


def test_the_first_look_after_a_blind_gap_never_fires() -> None:
    # The loop was busy (a capture of another engine): tokens may have come meanwhile.
    tr = EngineTracker("e", "http://x", window_s=3.0, period_s=1.0)
    got = events(tr, [look(0, running=1, tokens=1), look(1, running=1, tokens=1), look(20, running=1, tokens=1)])
    assert got == []
    assert [ev for _, ev, _ in events(tr, [look(21, running=1, tokens=1)])] == ["stall"]


def test_no_local_engine_core_is_reported_not_captured() -> None:
    tr = EngineTracker("e", "http://x", window_s=2.0)
    got = events(tr, [look(t, running=1, tokens=1, core=None) for t in range(0, 4)])
    (_, _, f), = got
    assert f["capture"] is False and "no local EngineCore" in str(f["why_not"])


def test_cooldown_after_a_capture() -> None:
    tr = EngineTracker("e", "http://x", window_s=2.0, cooldown_s=100.0)
    events(tr, [look(t, running=1, tokens=1) for t in range(0, 3)])
    tr.note_capture(2.0)
    got = events(tr, [look(3, running=1, tokens=2)] + [look(t, running=1, tokens=2) for t in range(4, 7)])
    stall = [f for _, ev, f in got if ev == "stall"]
    assert stall and stall[0]["capture"] is False and "cooldown" in str(stall[0]["why_not"])


def test_engine_core_cpu_and_state_are_in_the_stall_event() -> None:
    tr = EngineTracker("e", "http://x", window_s=2.0)
    got = events(tr, [look(t, running=1, tokens=1, state="T") for t in range(0, 4)])
    core = got[0][2]["engine_core"]
    assert isinstance(core, dict) and core["state"] == "T" and core["pid"] == 11 and core["cpu_pct"] is not None


class FakeTime:
    """A clock the loop's wait advances."""

    def __init__(self) -> None:
        self.now = 0.0
        self.stop_at: float | None = None

    def clock(self) -> float:
        return self.now

    def wait(self, s: float) -> bool:
        self.now += max(s, 0.001)
        return self.stop_at is not None and self.now >= self.stop_at


def _sentinel(ft: FakeTime, tokens_until: float, once: bool, captures: list[CaptureRequest],
              out: io.StringIO) -> Sentinel:
    tr = EngineTracker("e", "http://x", window_s=3.0)

    def looker() -> Look:
        t = ft.now
        return look(t, running=2, tokens=min(t, tokens_until) * 10)

    def capture(req: CaptureRequest, announce: Callable[[CaptureResult], None]) -> CaptureResult:
        captures.append(req)
        ft.now += 1.5          # a capture takes time
        return CaptureResult("gil_cycle", "a cycle", "high", 10, "/tmp/x", 1.5)

    return Sentinel([tr], {"e": looker}, capture, EventSink(out), ft.clock, ft.wait, period_s=1.0, once=once,
                    wall=lambda: 1000.0 + ft.now)


def test_loop_once_captures_the_stall_and_stops() -> None:
    ft, caps, out = FakeTime(), [], io.StringIO()
    outcome = _sentinel(ft, 5.0, True, caps, out).run()
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["event"] for x in lines] == ["start", "stall", "verdict", "report", "stop"]
    assert outcome.once_hit and outcome.named == 1 and len(caps) == 1
    assert caps[0].onset_t == 5.0 and caps[0].detected_t == 8.0 and caps[0].core_pid == 11
    verdict = lines[2]
    assert verdict["kind"] == "gil_cycle" and verdict["onset_to_verdict_s"] == 4.5   # window 3 + capture 1.5


def test_loop_keeps_watching_after_a_stall_and_stops_on_request() -> None:
    ft, caps, out = FakeTime(), [], io.StringIO()
    ft.stop_at = 60.0
    outcome = _sentinel(ft, 5.0, False, caps, out).run()
    evs = [json.loads(x)["event"] for x in out.getvalue().splitlines()]
    assert evs == ["start", "stall", "verdict", "report", "stop"]     # one stall, captured once
    assert not outcome.once_hit and outcome.stalls == 1 and ft.now >= 60.0


def test_a_failing_look_or_capture_never_ends_the_watch() -> None:
    ft, out = FakeTime(), io.StringIO()
    ft.stop_at = 20.0
    tr = EngineTracker("e", "http://x", window_s=3.0)

    def looker() -> Look:
        if ft.now < 5:
            raise RuntimeError("parser bug")
        return look(ft.now, running=1, tokens=1)

    def capture(req: CaptureRequest, announce: Callable[[CaptureResult], None]) -> CaptureResult:
        raise OSError("disk full")

    Sentinel([tr], {"e": looker}, capture, EventSink(out), ft.clock, ft.wait, wall=lambda: ft.now).run()
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["event"] for x in lines] == ["start", "error", "recovered", "stall", "error", "stop"]
    assert "parser bug" in lines[1]["error"] and lines[4]["kind"] == "capture"


def test_parse_real_vllm_metrics() -> None:
    path = VLLM / "metrics_after_load.txt"
    if not path.exists():
        pytest.skip("shared vLLM captures not present")
    m = parse_server_metrics(path.read_text())
    assert m.generation_tokens and m.prompt_tokens and m.finished and m.iterations
    assert m.start_time and m.start_time > 1.7e9
    assert m.in_flight is not None and m.progress == m.generation_tokens + m.prompt_tokens + m.finished


def test_exporter_counts_stalls_by_kind_and_the_last_verdict() -> None:
    tr = EngineTracker("e", "http://x", window_s=2.0)
    for lk in [look(0, running=1, tokens=1), look(1, up=False), look(2, up=False)]:
        tr.observe(lk)
    ex = WatchExporter([tr])
    ex.on_event(WatchEvent("verdict", "e", 5.0, {"kind": "gil_cycle"}))
    ex.on_event(WatchEvent("verdict", "e", 6.0, {"kind": "stopped"}))
    ex.on_event(WatchEvent("stall", "e", 7.0, {"capture": False}))
    text = ex.text()
    assert 'kvdiag_watch_stalls_total{engine="e",kind="gil_cycle"} 1.0' in text
    assert 'kvdiag_watch_stalls_total{engine="e",kind="uncaptured"} 1.0' in text
    assert 'kvdiag_watch_last_verdict{engine="e",kind="stopped"} 1.0' in text
    assert 'kvdiag_watch_last_verdict{engine="e",kind="gil_cycle"} 0.0' in text
    assert 'kvdiag_watch_scrape_errors_total{engine="e"} 2.0' in text
    assert 'kvdiag_watch_engine_up{engine="e"} 0.0' in text


def test_retention_keeps_the_newest_and_only_touches_its_own_folders(tmp_path: Path) -> None:
    made = []
    for i in range(5):
        d = capture_dir(tmp_path, "127.0.0.1:8000")
        (d / "bundle").mkdir(parents=True)
        import os

        os.utime(d, (1000 + i, 1000 + i))
        made.append(d)
    (tmp_path / "stall-mine").mkdir()          # no bundle/: not a capture folder
    (tmp_path / "notes").mkdir()
    gone = prune(tmp_path, 2)
    assert gone == made[:3]
    assert watch_captures(tmp_path) == made[3:]
    assert (tmp_path / "stall-mine").is_dir() and (tmp_path / "notes").is_dir()


def test_a_server_whose_looks_are_always_slow_is_still_judged() -> None:
    # /metrics of a busy API server can take seconds every time: every gap is long, none is a blind spell.
    tr = EngineTracker("e", "http://x", window_s=6.0, period_s=0.5)
    looks = [look(t * 2.5, running=2, tokens=min(t, 4)) for t in range(0, 12)]
    assert [ev for _, ev, _ in events(tr, looks)] == ["stall"]
