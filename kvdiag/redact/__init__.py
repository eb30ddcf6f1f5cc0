"""The one redactor: remove secrets from everything that enters an output folder.

:mod:`~kvdiag.redact.rules` decides what a secret is (text, objects, command lines, and the scan for
what is left); :mod:`~kvdiag.redact.files` writes, copies and scans files with those rules;
:mod:`~kvdiag.redact.bundle` redacts a bundle and keeps its redaction summary.

Where it runs: data is redacted where it enters, and nothing downstream redacts again. A tool's raw output and
/proc's command lines are redacted as they are read (capture); a text file as it is written into the bundle
(:func:`~kvdiag.bundle.io.write_text_redacted`); the bundle when a run's tail takes it
(:func:`~kvdiag.runs.output.finish`, so analysis sees only what the bundle keeps), when it is written
(:func:`~kvdiag.bundle.io.write_bundle`) and when it is loaded (a bundle from an older kvdiag may hold secrets);
the report's inputs once, in :func:`~kvdiag.report.run_view` (a caller may hand it anything). Renderers and
analyzers use what they are given.
"""
