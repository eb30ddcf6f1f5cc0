"""The canary's policy (when a probe is due), the tracker's verdict on a probe, /ready, and the API server's
requests in progress (time injected; the probe's HTTP through httpx's mock transport: nothing sleeps)."""

from __future__ import annotations

import json

import httpx

from kvdiag.runs.watch.canary import Canary, CanaryPolicy, ProbeOutcome, ProbeSender
from kvdiag.runs.watch.exporter import WatchExporter
from kvdiag.runs.watch.sentinel import EngineTracker
from kvdiag.watch.metrics import ServerMetrics, parse_server_metrics
from kvdiag.watch.reading import CoreSample, Look


def look(t: float, running: float = 0, tokens: float = 0, api: float | None = None) -> Look:
    m = ServerMetrics(running=running, waiting=0, generation_tokens=tokens, start_time=100.0, api_in_progress=api)
    return Look(t=t, wall=1000.0 + t, metrics=m, health=200, server_pid=10,
                core=CoreSample(pid=11, state="T", wchan="do_signal_stop", cpu_ticks=0))


def test_a_probe_is_due_only_after_a_quiet_period_and_never_two_at_once() -> None:
    p = CanaryPolicy(period_s=5.0)
    p.note_look(look(0, tokens=1))
    assert not p.due(4.9, True) and p.due(5.0, True) and not p.due(5.0, False)
    p.note_look(look(6, running=1, tokens=1))          # work: the quiet clock starts over
    assert not p.due(10.0, True) and p.due(11.0, True)
    p.sent(11.0)
    assert not p.due(30.0, True)                       # one in flight at most
    p.ended(12.0)
    assert not p.due(16.0, True) and p.due(17.0, True)


def test_an_unanswered_probe_is_a_stall_until_progress_or_an_answer() -> None:
    tr = EngineTracker("e", "http://x", window_s=5.0)
    for t in range(0, 10):
        assert tr.observe(look(t, tokens=3)) == []     # idle: never a stall by itself
    assert tr.ready == (True, "progressing or idle")
    evs = tr.probe_unanswered(look(10, tokens=3), {"id": "kvdiag-probe-1"}, sent_t=4.0)
    assert [e.event for e in evs] == ["stall"]
    f = evs[0].fields
    assert f["probe"] == {"id": "kvdiag-probe-1"} and f["capture"] is True and f["quiet_s"] == 6.0
    assert tr.stall_onset == 4.0 and not tr.ready[0] and "probe" in tr.ready[1]
    assert tr.observe(look(11, tokens=3)) == [] and not tr.ready[0]       # still idle: still stalled
    assert tr.probe_unanswered(look(12, tokens=3), {"id": "kvdiag-probe-2"}, sent_t=11.0) == []
    assert [e.event for e in tr.observe(look(13, tokens=4))] == ["recovered"]   # progress ends it
    assert tr.ready[0]
    tr.probe_unanswered(look(20, tokens=4), {"id": "kvdiag-probe-3"}, sent_t=14.0)
    assert [e.event for e in tr.probe_answered(look(26, tokens=4))] == ["recovered"]
    assert tr.ready[0] and tr.stalls == 2


def test_work_only_the_api_server_sees_is_in_flight() -> None:
    text = ('vllm:num_requests_running{engine="0"} 0.0\nvllm:num_requests_waiting{engine="0"} 0.0\n'
            'http_requests_inprogress{handler="/v1/completions",method="POST"} 3.0\n'
            'http_requests_inprogress{handler="/metrics",method="GET"} 1.0\n')
    m = parse_server_metrics(text)
    assert m.api_in_progress == 3.0 and m.in_flight == 3
    assert parse_server_metrics('vllm:num_requests_running 2.0\n').api_in_progress is None


def test_the_probe_is_one_marked_token_and_its_timeout_is_a_stall() -> None:
    seen: list[httpx.Request] = []

    def answer(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200, json={"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}})

    out = ProbeSender("http://x", 5.0, transport=httpx.MockTransport(answer))(7)
    assert out.answered and not out.timed_out
    body = json.loads(seen[-1].read())
    assert body["max_tokens"] == 1 and body["user"] == "kvdiag-probe-7" and body["model"] == "m"
    assert seen[-1].headers["x-request-id"] == "kvdiag-probe-7"

    def frozen(req: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=req)

    out = ProbeSender("http://x", 5.0, model="m", transport=httpx.MockTransport(frozen))(8)
    assert out.timed_out and not out.answered


def test_ready_answers_503_per_engine_and_overall_after_an_unanswered_probe() -> None:
    a, b = EngineTracker("a:1", "http://a:1", window_s=5.0), EngineTracker("b:2", "http://b:2", window_s=5.0)
    ex = WatchExporter([a, b])
    assert ex.readiness()[0] == 503                    # not looked at yet
    a.observe(look(0))
    b.observe(look(0))
    assert ex.readiness() == (200, {"ready": True, "engines": {"a:1": {"ready": True, "why": "progressing or idle"},
                                                                "b:2": {"ready": True, "why": "progressing or idle"}}})
    done = ProbeOutcome(1, 0.0, 1000.0, answered=False, latency_s=5.0, timed_out=True, error="no answer")
    c = Canary("b:2", send=lambda n: done)
    c._done.append(done)
    evs = c.after_look(b, look(6))
    assert [e.event for e in evs] == ["probe_failed", "stall"]
    for e in evs:
        ex.on_event(e)
    assert ex.readiness()[0] == 503 and ex.readiness("a:1")[0] == 200 and ex.readiness("b:2")[0] == 503
    assert ex.readiness("c:3")[0] == 404
    assert 'kvdiag_watch_probes_total{engine="b:2",outcome="failed"} 1.0' in ex.text()
    assert 'kvdiag_watch_ready{engine="b:2"} 0.0' in ex.text()
