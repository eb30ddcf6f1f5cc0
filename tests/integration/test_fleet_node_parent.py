"""A node's capture task says when its node went down under it: a Ray worker's parent is its node's raylet,
and a capture whose parent went away while it ran answers ``node_died`` (the driver then keeps what it sent
without judging it: the node's processes were being killed while they were read). Real processes: a parent
that starts the capturing child and exits (or stays) while the child captures a live target."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The middle process: starts the capturing child, then exits at once (parent_exits) or waits for it.
# The middle process: starts the capturing child and, once the child's capture has begun (its capture takes
# at least the /proc window, ~0.4 s), exits (parent_exits) or waits for it.
MIDDLE = r"""
import os, subprocess, sys, time
started = sys.argv[3] + ".started"
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
deadline = time.monotonic() + 30
while not os.path.exists(started) and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.1)
if sys.argv[-1] == "exit":
    sys.exit(0)
child.wait(60)
"""
CHILD = r"""
import json, os, sys
from kvdiag.runs.fleet.node import capture_on_node
open(sys.argv[2] + ".started", "w").close()
out = capture_on_node([int(sys.argv[1])], 10.0, ["proc", "py-spy"], "test")
with open(sys.argv[2] + ".tmp", "w") as fh:
    json.dump({"node_died": out["node_died"], "bytes": len(out["pack"])}, fh)
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
"""


def _run(tmp_path: Path, mode: str) -> dict[str, object]:
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    result = tmp_path / f"{mode}.json"
    try:
        middle = subprocess.Popen([sys.executable, "-c", MIDDLE, CHILD, str(target.pid), str(result), mode],
                                  cwd=ROOT, start_new_session=True)
        middle.wait(60)
        deadline = time.monotonic() + 60
        while not result.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert result.exists(), "the capturing child gave no answer"
        return json.loads(result.read_text())
    finally:
        target.kill()
        target.wait(10)


@pytest.mark.parametrize(("mode", "died"), [("exit", True), ("stay", False)])
def test_a_capture_whose_parent_went_away_says_its_node_died(tmp_path: Path, mode: str, died: bool) -> None:
    got = _run(tmp_path, mode)
    assert got["node_died"] is died, got
    assert int(got["bytes"]) > 0        # what it read is still sent
