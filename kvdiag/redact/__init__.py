"""The one redactor: remove secrets from everything that enters an output folder.

:mod:`~kvdiag.redact.rules` decides what a secret is (text, objects, command lines, and the scan for
what is left); :mod:`~kvdiag.redact.files` writes, copies and scans files with those rules;
:mod:`~kvdiag.redact.bundle` redacts a bundle and keeps its redaction summary.
"""
