"""The rules, split by concern; this module names the ones the rest of kvdiag uses.

- :mod:`~kvdiag.analyze.process`: one process's verdict (the process rules in order);
- :mod:`~kvdiag.analyze.gil_rules`, :mod:`~kvdiag.analyze.lock_rules`, :mod:`~kvdiag.analyze.io_rules`:
  the process rules, and :mod:`~kvdiag.analyze.rulekit` what they share;
- :mod:`~kvdiag.analyze.peers`: the cross-process peer judge;
- :mod:`~kvdiag.analyze.engine_rules`: an engine's verdict;
- :mod:`~kvdiag.analyze.confidence`: how sure a healthy verdict is.
"""

from __future__ import annotations

from kvdiag.analyze.confidence import healthy_confidence
from kvdiag.analyze.engine_rules import banner_findings, decode_stalled, decode_stalled_from_log, engine_verdict
from kvdiag.analyze.gil_rules import gil_held_blocked, gil_held_warning
from kvdiag.analyze.peers import read_peers
from kvdiag.analyze.process import PROCESS_RULES, analyze_process, process_findings
from kvdiag.analyze.rulekit import SEVERITY, STACKS_ONLY, peer_phrase, proc_missing, severity, wake_signals

__all__ = [
    "PROCESS_RULES", "SEVERITY", "STACKS_ONLY", "analyze_process", "banner_findings", "decode_stalled",
    "decode_stalled_from_log", "engine_verdict", "gil_held_blocked", "gil_held_warning", "healthy_confidence",
    "peer_phrase", "proc_missing", "process_findings", "read_peers", "severity", "wake_signals",
]
