"""The simulated engine: a vLLM-shaped server (API server + EngineCore) on kvdiag's page allocators.

Run it with ``python -m kvdiag.sim serve ...`` or ``kvdiag sim serve ...``; build its command line
from Python with :func:`command`. Kept import-light: the EngineCore spawn child imports this
package, and it must not pay for uvicorn.
"""

from __future__ import annotations

from kvdiag.sim.cmdline import command

__all__ = ["command"]
