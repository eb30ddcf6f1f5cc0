"""The PageAllocator banner is quoted whole (enable_prealloc, min/max_reserved_pages included) in the live
progress line, the timeline and report.md, and a stall's onset is never placed before the banner that
was the engine's last progress.

Engine "one" answers /health (so every poll of engine "two" comes after a real HTTP round trip, the
gap that used to put the onset before the banner); engine "two" prints the banner of issue #371 and
then hangs without using CPU, like the stock allocator's engine 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from kvcli import HEALTH_SERVER, run_kvdiag

from kvdiag.ports import free_port

pytestmark = pytest.mark.timeout(200)

BANNER = ("Init C++ PageAllocator: num_layers=28, mem_size_per_layer=11MB, total_mem_size=616MB, page_size=2MB, "
          "world_size=1, pp_rank=0, async_sched=1, contiguous_layout=1, enable_prealloc=1, num_kv_buffers=2, "
          "group_id=0, min_reserved_pages=5, max_reserved_pages=5")
TAIL = "enable_prealloc=1, num_kv_buffers=2, group_id=0, min_reserved_pages=5, max_reserved_pages=5"

HANGS_AFTER_BANNER = """
import sys, time
print("loading weights", flush=True)
print(sys.argv[1], flush=True)
time.sleep(150)
"""


def test_banner_is_quoted_whole_and_the_stall_onset_follows_it(tmp_path: Path) -> None:
    (tmp_path / "health.py").write_text(HEALTH_SERVER)
    (tmp_path / "hang.py").write_text(HANGS_AFTER_BANNER)
    port = free_port()
    scenario = tmp_path / "s.yaml"
    scenario.write_text(f"""
name: banner-last
windows: {{stall_s: 2, startup_timeout_s: 90, timeout_s: 120, poll_s: 0.1, kill_grace_s: 0.5}}
capture: {{when: never}}
engines:
  - name: one
    kind: command
    port: {port}
    command: ["{sys.executable}", "{tmp_path / 'health.py'}", "{port}"]
  - name: two
    kind: command
    start_after: one
    ready: "log:NEVER READY"
    command: ["{sys.executable}", "{tmp_path / 'hang.py'}", "{BANNER}"]
""")
    out = tmp_path / "out"
    proc = run_kvdiag("repro", "two-engine", "--scenario", str(scenario), "--out", str(out), timeout=180)
    assert proc.returncode == 10, proc.stderr
    # The live line.
    live = [line for line in proc.stderr.splitlines() if "two: stall detected" in line]
    assert live and TAIL in live[0], proc.stderr
    # The timeline (report.json) and its order.
    report = json.loads((out / "report.json").read_text())
    events = [(e["t"], e["engine"], e["event"], e.get("detail") or "") for e in report["timeline"]]
    detected = next(e for e in events if e[1] == "two" and e[2] == "stall detected")
    assert TAIL in detected[3]
    banner_i = next(i for i, e in enumerate(events) if e[1] == "two" and e[2].startswith("banner"))
    onset_i = next(i for i, e in enumerate(events) if e[1] == "two" and e[2].startswith("stall onset"))
    banner_event = events[banner_i][2]
    assert "enable_prealloc=1" in banner_event and "min_reserved_pages=5 max_reserved_pages=5" in banner_event
    assert onset_i > banner_i and events[onset_i][0] >= events[banner_i][0], events
    # report.md: the engines table and the timeline quote it whole.
    md = (out / "report.md").read_text()
    timeline_md = md.split("<summary>Timeline</summary>", 1)[1]
    assert TAIL in timeline_md
    assert timeline_md.index("banner group_id=0") < timeline_md.index("stall onset")
    engines_md = md.split("#### Engines", 1)[1]
    engine_row = next(line for line in engines_md.splitlines() if line.startswith("| two |"))
    assert TAIL in engine_row
    # The HTML's timeline table too.
    assert TAIL in (out / "report.html").read_text()
