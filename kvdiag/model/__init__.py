"""The typed model that flows between pipeline stages.

Capture produces a :class:`~kvdiag.model.bundle.Bundle`; analyzers read a bundle and return a
:class:`~kvdiag.model.verdict.Verdict`; reporters render a :class:`~kvdiag.model.report.Report` (bundle +
verdict). Every model here round-trips through JSON (``model_dump(mode="json")`` / ``model_validate``) so a
bundle attached to someone else's bug can be re-analyzed offline.

Conventions:
- frames are listed innermost first (index 0 is the frame executing now), like
  gdb and py-spy; pystack's outermost-first order is reversed on parse;
- times in the timeline are seconds since the run started (monotonic);
- paths inside a bundle are relative to the bundle folder.

One module per concern, each imported by its own name (``from kvdiag.model.bundle import Bundle``): kinds,
evidence, gpu, run, environment, doctor, judged, verdict, bundle, report, waits, health (what "healthy" means
in every report, derived from an engine's record and verdict).
"""
