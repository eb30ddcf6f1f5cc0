"""Capture stage: read-only evidence from live processes, one backend per tool behind a Protocol.

Entry points: :func:`~kvdiag.capture.orchestrate.capture_processes` (parallel, bounded, never raises for
tool trouble) and :func:`~kvdiag.capture.discover.find_engine_processes` (which pid is the EngineCore).
"""
