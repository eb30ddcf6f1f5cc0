"""Launch stage: engine processes in their own process groups, torn down on every exit path."""

from kvdiag.launch.process import EngineProcess, ProcessSet, free_port, port_in_use

__all__ = ["EngineProcess", "ProcessSet", "free_port", "port_in_use"]
