"""The agent's dump as kvdiag reads it (pure parts): the text format, GIL flags, the one stack per thread, the
path choice, and the no_access fix that names the agent."""

from __future__ import annotations

from kvdiag.agent.protocol import AGENT_FIX, ArmedRecord, starttime_of
from kvdiag.analyze.access import evidence_outcome, process_outcome
from kvdiag.capture.agent import AgentThread, _gil, _interleave, choose_path, dump_threads, parse_dump
from kvdiag.model.evidence import Frame, ProcessEvidence, TargetAccess, ThreadEvidence, ToolRun
from kvdiag.model.kinds import GilState, VerdictKind

DUMP = """kvdiag-agent 1
pid 100
tid 100
gen 3
python 3.11.7
threads 2
signalled 1
collect_ms 1
python-stacks
Thread 0x00007f0000000700 (most recent call first):
  File "/app/worker.py", line 12 in loop
  File "/usr/lib/python3.11/threading.py", line 975 in run

Current thread 0x00007f0000000100 (most recent call first):
  File "/app/main.py", line 5 in <module>

Thread 0x00007f0000000900 (most recent call first):
  File "/app/poller.py", line 7 in wait
end-python-stacks
thread 100 answered pthread 0x7f0000000100 gil 1 tstate 1 pc 0x1010 frames 0x9000 0x9001 0x1010 0x2020
thread 101 answered pthread 0x7f0000000700 gil 0 tstate 1 pc 0x1010 frames 0x9000 0x1010 0x2020
thread 102 asleep
tstate pthread 0x7f0000000100 native 100 current 1
tstate pthread 0x7f0000000900 native 102 current 0
maps
00001000-00003000 r-xp 00000000 08:01 1 /nonexistent/libx.so
end-maps
elapsed_ms 2
end
"""


def test_dump_text_parses_into_threads_stacks_and_maps() -> None:
    dump = parse_dump(DUMP)
    assert dump is not None and dump.complete and dump.pid == 100 and dump.python == "3.11.7"
    assert [t.tid for t in dump.threads] == [100, 101, 102]
    first = dump.threads[0]
    assert first.answered and first.holds_gil == 1 and first.pc == 0x1010 and first.addresses[2] == 0x1010
    assert not dump.threads[2].answered
    assert [f.name for f in dump.python_stacks[0x7F0000000700]] == ["loop", "run"]
    assert dump.python_stacks[0x7F0000000100][0].line == 5
    assert len(dump.maps) == 1 and dump.maps[0].path == "/nonexistent/libx.so"
    assert dump.tstates[0x7F0000000900] == (102, False)
    # the thread left asleep (not interrupted) still gets its Python stack, through the thread-state list
    asleep = {t.tid: t for t in dump_threads(dump, 100)}[102]
    assert [f.name for f in asleep.frames] == ["wait"] and asleep.gil is GilState.NONE
    assert parse_dump("not a dump") is None
    assert not parse_dump(DUMP.rsplit("end", 1)[0] + "partial").complete  # type: ignore[union-attr]


def test_gil_flags_come_from_the_runtime_and_the_stack() -> None:
    take = [Frame(name="pthread_cond_timedwait"), Frame(name="take_gil")]
    assert _gil(AgentThread(1, True, holds_gil=1, has_tstate=1), []) is GilState.HOLDS
    assert _gil(AgentThread(1, True, holds_gil=0, has_tstate=1), take) is GilState.WAITING
    assert _gil(AgentThread(1, True, holds_gil=0, has_tstate=0), []) is GilState.NONE
    # a thread state, not holding, no take_gil frame (a stripped interpreter): /proc's futex reading decides
    assert _gil(AgentThread(1, True, holds_gil=0, has_tstate=1), []) is GilState.UNKNOWN


def test_python_frames_go_where_the_eval_loop_is() -> None:
    native = [Frame(name="pthread_cond_wait"), Frame(name="alloc_page"), Frame(name="_PyEval_EvalFrameDefault"),
              Frame(name="Py_RunMain")]
    py = [Frame(name="f", kind="python"), Frame(name="<module>", kind="python")]
    assert [f.name for f in _interleave(native, py)] == ["pthread_cond_wait", "alloc_page", "f", "<module>",
                                                         "Py_RunMain"]
    assert [f.name for f in _interleave(native[:2], py)] == ["pthread_cond_wait", "alloc_page", "f", "<module>"]


def test_path_choice() -> None:
    refused = TargetAccess(ptrace_ok=False, refused=["open /proc/1/mem: Permission denied"])
    assert choose_path("auto", refused, armed_ok=True)[0] == "agent"
    assert choose_path("auto", refused, armed_ok=False)[0] == "ptrace"
    assert choose_path("agent", TargetAccess(), armed_ok=False)[0] == "agent"
    assert choose_path("auto", TargetAccess(zombie=True), armed_ok=True)[0] == "ptrace"


def test_armed_record_round_trips_and_starttime_is_field_22() -> None:
    rec = ArmedRecord(7, 12345, 62, 61, "3.11.7")
    assert ArmedRecord.parse(rec.render()) == rec
    assert ArmedRecord.parse("garbage") is None
    stat = "7 (a b) S 1 7 7 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 12345 1000 10"
    assert starttime_of(stat) == 12345


def test_a_refused_process_read_by_the_agent_is_judged_and_no_access_names_the_agent() -> None:
    access = TargetAccess(ptrace_ok=False, refused=["open /proc/5/mem: Permission denied"], fixes=["sudo ..."])
    read = ProcessEvidence(pid=5, access=access, threads=[ThreadEvidence(tid=5, frames=[Frame(name="f")])],
                           tools=[ToolRun(tool="agent", ok=True)])
    assert process_outcome(read, []) is None
    unread = read.model_copy(update={"tools": [ToolRun(tool="agent", ok=False, error="agent: not armed")]})
    assert process_outcome(unread, []) is VerdictKind.NO_ACCESS
    verdict = evidence_outcome("engine", [unread], [])
    assert verdict is not None and any(f.message == AGENT_FIX for f in verdict.findings)
    # asked for the agent (--via agent) where ptrace was allowed, and it did not answer: no evidence, not health
    forced = unread.model_copy(update={"access": TargetAccess()})
    assert process_outcome(forced, []) is VerdictKind.NO_EVIDENCE
