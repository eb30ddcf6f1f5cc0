"""vLLM's log-line format, so one set of watchers reads the simulated and the real engine.

vLLM prints ``(<process> pid=<pid>) <LEVEL> <MM-DD HH:MM:SS> [<file>:<line>] <msg>`` on stdout,
prefixing every line of a multi-line message (tracebacks included).
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "kvdiag.sim"


class VllmFormatter(logging.Formatter):
    """Formats records like vLLM's default handler, one prefix per physical line."""

    def __init__(self, process_name: str) -> None:
        super().__init__(datefmt="%m-%d %H:%M:%S")
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        prefix = (f"({self.process_name} pid={os.getpid()}) {record.levelname} "
                  f"{self.formatTime(record, self.datefmt)} [{record.filename}:{record.lineno}] ")
        text = record.getMessage()
        if record.exc_info:
            text = f"{text}\n{self.formatException(record.exc_info)}"
        return "\n".join(prefix + line for line in text.split("\n"))


def unbuffer_stdio() -> None:
    """Line-buffer stdout/stderr: watchers tail the log while the engine may hang at any moment."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=True)


def setup(process_name: str) -> logging.Logger:
    """Configure the sim's logger for this process and return it."""
    unbuffer_stdio()
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(VllmFormatter(process_name))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
