"""A crash summary names the first exception of the failing process, not vLLM's pointer back at it."""

from __future__ import annotations

from kvdiag.analyze.enginelog import telling_line
from kvdiag.logs.lines import CRASH_AT_EXIT, LogState, feed_line, root_error

# What a vLLM engine whose EngineCore failed at start-up prints (shape of vLLM 0.1x-0.3x logs).
VLLM_CRASH = """\
(APIServer pid=6790) INFO 12-05 10:00:00 [api_server.py:1] vLLM API server version 0.32.0
(EngineCore_DP0 pid=6898) ERROR 12-05 10:00:05 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid=6898) ERROR 12-05 10:00:05 [core.py:708] Traceback (most recent call last):
(EngineCore_DP0 pid=6898) ERROR 12-05 10:00:05 [core.py:708]   File "/venv/vllm/v1/engine/core.py", line 699, in run
(EngineCore_DP0 pid=6898) ERROR 12-05 10:00:05 [core.py:708]     raise ValueError("No memory for the cache")
(EngineCore_DP0 pid=6898) ERROR 12-05 10:00:05 [core.py:708] ValueError: No available memory for the cache blocks.
(APIServer pid=6790) Traceback (most recent call last):
(APIServer pid=6790)   File "/venv/bin/vllm", line 10, in <module>
(APIServer pid=6790) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_engines_error_is_the_engine_cores_exception() -> None:
    state = LogState()
    for line in VLLM_CRASH.splitlines():
        feed_line(state, line)
    error = root_error(state.errors)
    assert error is not None and "ValueError: No available memory for the cache blocks." in error, state.errors


def test_the_crash_summary_line_is_the_root_exception() -> None:
    line = telling_line(VLLM_CRASH, CRASH_AT_EXIT)
    assert "ValueError: No available memory" in line and "root cause" not in line, line


def test_a_plain_traceback_ends_with_its_exception() -> None:
    state = LogState()
    for line in ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
                 "mypkg.errors.LoaderError: shard 3 is corrupt"]:
        feed_line(state, line)
    assert root_error(state.errors) == "mypkg.errors.LoaderError: shard 3 is corrupt"
