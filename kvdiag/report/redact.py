"""Redaction for the report stage: the one redactor lives in :mod:`kvdiag.redact` (re-exported here)."""

from __future__ import annotations

from kvdiag.redact import (
    REDACTED,
    Tally,
    is_secret_flag,
    is_secret_name,
    normalize_name,
    redact_obj,
    redact_shapes,
    redact_text,
)

__all__ = ["REDACTED", "Tally", "is_secret_flag", "is_secret_name", "normalize_name", "redact_obj",
           "redact_shapes", "redact_text"]
