"""How kvdiag starts a Python module in a child process without the user's folder on sys.path.

``python -m pkg`` puts the current folder first on ``sys.path``. Run from a source checkout
after a regular (non-editable) install, that shadows the installed kvdiag with the checkout's
``kvdiag/`` (which has no built ``_native``): engines crashed with
``No module named 'kvdiag._native'``. ``-P`` (Python 3.11+) leaves the folder out; older
interpreters get the same through a tiny bootstrap that drops it before running the module.
"""

from __future__ import annotations

import sys

_BOOTSTRAP = ("import os, runpy, sys; cwd = os.getcwd(); "
              "sys.path[:] = [p for p in sys.path if p not in ('', '.', cwd)]; "
              "runpy.run_module(sys.argv[1], run_name='__main__', alter_sys=True)")


def module_argv(module: str, python: str | None = None) -> list[str]:
    """argv prefix that runs ``python -m module`` with the current folder kept off ``sys.path``."""
    exe = python or sys.executable
    if python in (None, sys.executable) and sys.version_info >= (3, 11):
        return [exe, "-P", "-m", module]
    # Unknown or older interpreter: -P may not exist there; the bootstrap works everywhere.
    return [exe, "-c", _BOOTSTRAP, module]
