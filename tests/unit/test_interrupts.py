"""The one stop path: real signals sent to this process, the handlers put back afterwards."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kvdiag import interrupts
from kvdiag.errors import Interrupted, Terminated


def test_sigterm_raises_inside_raising_and_handlers_are_restored() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated, match="received SIGTERM"), interrupts.raising():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)   # let the handler run here, not later
    assert signal.getsignal(signal.SIGTERM) is before


def test_on_stop_calls_back_instead_of_raising() -> None:
    said: list[str] = []
    before = signal.getsignal(signal.SIGHUP)
    with interrupts.on_stop(said.append, signals=interrupts.STOP_SIGNALS):
        os.kill(os.getpid(), signal.SIGHUP)
        signal.sigtimedwait([], 0)
    assert said == ["received SIGHUP"] and signal.getsignal(signal.SIGHUP) is before


def test_on_stop_on_an_event_loop_ends_the_loop_cleanly() -> None:
    before = signal.getsignal(signal.SIGTERM)

    async def main() -> list[str]:
        said: list[str] = []
        woke = asyncio.Event()

        def stop(reason: str) -> None:
            said.append(reason)
            woke.set()

        with interrupts.on_stop(stop, loop=asyncio.get_running_loop()):
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(woke.wait(), timeout=5)
        return said

    assert asyncio.run(main()) == ["received SIGTERM"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_every_stop_becomes_one_interrupted() -> None:
    own = Interrupted("received SIGHUP")
    assert interrupts.as_interrupted(own) is own
    assert interrupts.as_interrupted(KeyboardInterrupt()).message == "interrupted (Ctrl-C)"
    assert interrupts.as_interrupted(Terminated("received SIGTERM")).message == "received SIGTERM"
