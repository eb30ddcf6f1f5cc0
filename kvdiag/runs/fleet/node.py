"""What runs on each node of a fleet capture: kvdiag's own capture of the node's selected processes.

:func:`capture_on_node` is shipped to the node by reference (Ray pickles a module function by its
name), so the node's Python must import kvdiag: a node where it cannot is named in the report.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kvdiag.capture.bundle import capture_pids
from kvdiag.runs.fleet.pack import pack_dir


def capture_on_node(pids: Sequence[int], timeout_s: float, backends: Sequence[str], command: str) -> dict[str, object]:
    """Capture ``pids`` of this host exactly as ``kvdiag capture --pid`` does; the bundle folder, packed.

    Returns ``{"pack": bytes, "seconds": float, "skipped": [pid], "node_died": bool, "vanished": [pid]}``
    (``vanished``: targets gone by the end of the capture); the capturing process
    itself is never a target (a Ray worker may be both). ``node_died``: the process that started this one (a
    Ray worker's parent is its node's raylet) went away during the capture, so the node is going down and
    its processes were being killed while they were read; Ray's own table says so only seconds later.
    """
    began = time.monotonic()
    me = os.getpid()
    parent = os.getppid()
    wanted = [p for p in dict.fromkeys(int(p) for p in pids) if p != me]
    folder = Path(tempfile.mkdtemp(prefix="kvdiag-node-"))
    try:
        if wanted:
            # The selection is the fleet's: Ray's runtime (raylet, GCS, dashboard) holds the other end of
            # every worker's sockets, and a wait across nodes is read from Ray's task table, not from peers.
            capture_pids(wanted, folder, timeout_s=timeout_s, backends=list(backends), command=command,
                         follow=False)
        data = pack_dir(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"pack": data, "seconds": round(time.monotonic() - began, 3),
            "skipped": [p for p in pids if p == me], "node_died": os.getppid() != parent,
            "vanished": [p for p in wanted if not os.path.exists(f"/proc/{p}")]}
