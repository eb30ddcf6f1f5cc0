"""Analyze stage: pure rules over a bundle → Verdict / Diagnosis. No I/O, no clock.

- :func:`diagnose`: the run's whole conclusion (verdicts, exit code, soak judgement, A/B
  comparison), stored in the bundle by the run and recomputed by ``kvdiag analyze``;
- :func:`analyze_by_engine`: one verdict per engine (processes captured
  without an engine record form one group named ``pid-<first pid>``);
- :func:`analyze`: the overall verdict, the worst engine's, naming the others.
"""

from __future__ import annotations

from kvdiag.analyze.classify import ThreadView, WaitKind, classify_process, classify_thread
from kvdiag.analyze.diagnosis import diagnose, exit_code_for
from kvdiag.analyze.overall import analyze, analyze_by_engine
from kvdiag.analyze.process import analyze_process
from kvdiag.analyze.rulekit import SEVERITY, severity
from kvdiag.analyze.signature import hang_signature, sign
from kvdiag.analyze.waitgraph import WaitGraph
from kvdiag.analyze.xproc import judge_across, merge_across

__all__ = [
    "SEVERITY", "ThreadView", "WaitGraph", "WaitKind", "analyze", "analyze_by_engine", "analyze_process",
    "classify_process", "classify_thread", "diagnose", "exit_code_for", "hang_signature", "judge_across",
    "merge_across", "severity", "sign",
]
