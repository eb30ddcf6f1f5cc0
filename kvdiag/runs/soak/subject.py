"""The server a soak loads, launched or already running, and the few HTTP questions asked of it
(does it answer, which model it serves, is it healthy) outside the load itself."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from kvdiag.osread.ptable import process_tree
from kvdiag.runs.engines import EngineWatch


@dataclass
class Subject:
    """The engine under load, launched or external."""

    name: str
    url: str
    allocator: str
    watch: EngineWatch | None = None          # launched engines only
    root_pid: int | None = None               # API server (process to capture from)
    log_pids: dict[str, int] = field(default_factory=dict)
    request_model: str | None = None


async def healthy(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(f"{url}/health")).status_code == 200
    except (httpx.HTTPError, OSError):
        return False


def server_answers(url: str) -> bool:
    with httpx.Client(trust_env=False, timeout=httpx.Timeout(5.0)) as c:
        for path in ("/health", "/v1/models"):
            try:
                if c.get(f"{url}{path}").status_code == 200:
                    return True
            except (httpx.HTTPError, OSError):
                continue
    return False


def served_model(url: str) -> str | None:
    """The first model id the server lists (what requests must name); None if it lists none."""
    try:
        with httpx.Client(trust_env=False, timeout=httpx.Timeout(5.0)) as c:
            data = c.get(f"{url}/v1/models").json()
        first = data["data"][0]["id"]
        return str(first) if first else None
    except (httpx.HTTPError, OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def server_pids(s: Subject) -> list[int]:
    """The server's processes whose CPU time the saturation judgement reads (API server and children)."""
    if s.root_pid is None:
        return []

    return process_tree(s.root_pid) or [s.root_pid]


__all__ = ["Subject", "healthy", "served_model", "server_answers", "server_pids"]
