"""The one way a run is stopped from outside: Ctrl-C, SIGTERM and SIGHUP.

Every command takes them alike: the run stops at once (a signal raises where the main thread
is), the engines are torn down, a partial report is written and kvdiag exits 130. SIGTERM and
SIGHUP raise :class:`~kvdiag.errors.Terminated`, a KeyboardInterrupt, so no ``except
Exception`` on the way up swallows them. A stage whose loop must end cleanly instead of being
raised into (an asyncio load, the watch's sentinel) asks for a callback with :func:`on_stop`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING

from kvdiag.errors import Interrupted, Terminated

if TYPE_CHECKING:   # a type only: every command installs these handlers, few run an event loop
    import asyncio

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)     # beside SIGINT, which Python raises as KeyboardInterrupt
ALL_SIGNALS = (signal.SIGINT, *STOP_SIGNALS)


def reason(signum: int) -> str:
    """What stopped the run, as the bundle and the partial report say it."""
    return "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"received {signal.Signals(signum).name}"


def as_interrupted(exc: BaseException) -> Interrupted:
    """The run's :class:`Interrupted` for whatever stopped it (Ctrl-C, a signal, an Interrupted)."""
    if isinstance(exc, Interrupted):
        return exc
    return Interrupted(str(exc) or reason(signal.SIGINT))


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(reason(signum))


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def install() -> None:
    """For the process (the CLI's entry): SIGTERM/SIGHUP raise like Ctrl-C does. Started as a background
    job of a script, Python inherits SIGINT ignored and installs no KeyboardInterrupt handler; `kill -INT`
    must still end the run cleanly."""
    if not _main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_terminated)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def ignore_from_now() -> None:
    """The run is over and its outputs are written: a late Ctrl-C or SIGTERM must not turn the exit status
    into a death by signal during interpreter shutdown. One that lands before the handlers are swapped
    raises here and is retried; once SIG_IGN is in place a still-pending one is dropped."""
    while True:
        try:
            for sig in ALL_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            return
        except KeyboardInterrupt:
            continue


@contextmanager
def raising() -> Iterator[None]:
    """SIGTERM/SIGHUP raise for the duration (a run used as a library, without :func:`install`);
    off the main thread nothing changes (the reaper still tears down)."""
    if not _main_thread():
        yield
        return
    with _handling(STOP_SIGNALS, _raise_terminated):
        yield


@contextmanager
def _handling(signals: tuple[signal.Signals, ...], handler: signal.Handlers | Callable[[int, FrameType | None], None],
              ) -> Iterator[None]:
    """``handler`` for ``signals`` for the duration, then what was there before; off the main thread
    (where handlers cannot be set) nothing changes."""
    saved: dict[signal.Signals, object] = {}
    for sig in signals:
        try:
            saved[sig] = signal.signal(sig, handler)
        except ValueError:   # not the main thread
            pass
    try:
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)  # type: ignore[arg-type]


@contextmanager
def held(signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Ignore ``signals`` for the duration: teardown must not be cut short by a second Ctrl-C."""
    with _handling(signals, signal.SIG_IGN):
        yield


@contextmanager
def on_stop(callback: Callable[[str], None], signals: tuple[signal.Signals, ...] = ALL_SIGNALS,
            loop: asyncio.AbstractEventLoop | None = None) -> Iterator[None]:
    """``callback(reason)`` instead of an exception while inside: on ``loop`` (its own signal handlers,
    so the callback runs between its tasks) or, without one, from the main thread's handler. Off the
    main thread nothing changes."""
    if not _main_thread():
        yield
        return
    if loop is not None:
        # Removing a loop's handler leaves its no-op or SIG_DFL behind: what was there before goes back.
        saved_py = {sig: signal.getsignal(sig) for sig in signals}
        added: list[signal.Signals] = []
        for sig in signals:
            try:
                loop.add_signal_handler(sig, callback, reason(sig))
                added.append(sig)
            except (ValueError, RuntimeError, NotImplementedError):
                pass
        try:
            yield
        finally:
            for sig in added:
                try:
                    loop.remove_signal_handler(sig)
                except (ValueError, RuntimeError, NotImplementedError):
                    pass
            for sig, old in saved_py.items():
                if old is not None:
                    signal.signal(sig, old)
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        callback(reason(signum))

    with _handling(signals, handler):
        yield


__all__ = ["ALL_SIGNALS", "STOP_SIGNALS", "as_interrupted", "held", "ignore_from_now", "install", "on_stop", "raising",
           "reason"]
