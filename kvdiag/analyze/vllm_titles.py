"""vLLM's names for its processes, read from their titles: ``VLLM::EngineCore``, ``VLLM::Worker_TP1`` (the
kernel cuts comm to 15 characters, ``VLLM::Worker_TP``: the command line keeps the rank)."""

from __future__ import annotations

import re

from kvdiag.model.evidence import ProcessEvidence

_RANK = re.compile(r"_TP(\d+)")


def _title(p: ProcessEvidence) -> str:
    return ((p.cmdline[0] if p.cmdline else "") or (p.comm or "")).strip("\0 ")


def process_title(p: ProcessEvidence) -> str | None:
    """vLLM's own name of a process (``Worker_TP1``, ``EngineCore``); None for a process vLLM did not title."""
    title = _title(p)
    return title[6:] or None if title.startswith("VLLM::") else None


def worker_rank(p: ProcessEvidence) -> int | None:
    """The tensor-parallel rank in a worker's title (``VLLM::Worker_TP1`` -> 1); None when it names none."""
    m = _RANK.search(_title(p))
    return int(m.group(1)) if m else None


__all__ = ["process_title", "worker_rank"]
