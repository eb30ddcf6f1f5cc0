"""Analyze stage: pure rules over a bundle → Verdict / Diagnosis. No I/O, no clock.

- :func:`~kvdiag.analyze.diagnosis.diagnose`: the run's whole conclusion (verdicts, exit code, soak judgement, A/B
  comparison), stored in the bundle by the run and recomputed by ``kvdiag analyze``;
- :func:`~kvdiag.analyze.overall.analyze_by_engine`: one verdict per engine (processes captured
  without an engine record form one group named ``pid-<first pid>``);
- :func:`~kvdiag.analyze.overall.analyze`: the overall verdict, the worst engine's, naming the others.
"""
