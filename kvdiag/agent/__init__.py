"""kvdiag's in-process agent: capture without ptrace.

``KVDIAG_AGENT=1`` in a Python process's environment (kvdiag importable there) arms it at interpreter
start through ``kvdiag_agent.pth``; unset, nothing of kvdiag runs in the process. Armed, the process
carries two signal handlers and a small native dumper (:mod:`kvdiag.agent.arm`); ``kvdiag capture``
asks it for a dump where ptrace is refused (:mod:`kvdiag.capture.agent`). What both sides agree on (the
private directory, the file names, the dump format) is :mod:`kvdiag.agent.protocol`.

This package imports nothing of kvdiag's pipeline: it runs inside the target.
"""
