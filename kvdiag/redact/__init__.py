"""The one redactor: remove secrets from everything that enters an output folder.

:mod:`~kvdiag.redact.rules` decides what a secret is (text, objects, command lines, and the scan for
what is left); :mod:`~kvdiag.redact.files` writes, copies and scans files with those rules;
:mod:`~kvdiag.redact.bundle` redacts a bundle and keeps its redaction summary.
"""

from kvdiag.redact.bundle import BUNDLE_JSON, note_file, redact_bundle
from kvdiag.redact.files import Hit, copy_redacted, redact_file, redact_tree, replace_file, scan_tree, write_redacted
from kvdiag.redact.rules import (
    KINDS,
    OLD_MARKERS,
    REDACTED,
    URL_REDACTED,
    Tally,
    is_secret_flag,
    is_secret_name,
    normalize_name,
    redact_argv,
    redact_obj,
    redact_shapes,
    redact_text,
    scan_text,
)

__all__ = [
    "BUNDLE_JSON", "KINDS", "OLD_MARKERS", "REDACTED", "URL_REDACTED", "Hit", "Tally", "copy_redacted",
    "is_secret_flag", "is_secret_name", "normalize_name", "note_file", "redact_argv", "redact_bundle", "redact_file",
    "redact_obj", "redact_shapes", "redact_text", "redact_tree", "replace_file", "scan_text", "scan_tree",
    "write_redacted",
]
