"""The bundle's redaction: a redacted copy of it and the summary of what was removed from each file."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from kvdiag.model.bundle import Bundle
from kvdiag.model.evidence import RedactionSummary
from kvdiag.redact.rules import Tally, redact_obj

BUNDLE_JSON = "bundle.json"


def note_file(summary: RedactionSummary, rel_path: str, counts: Mapping[str, int]) -> None:
    """Record what was removed from one file written into the bundle folder (replaces its entry)."""
    clean = {k: n for k, n in counts.items() if n}
    if clean:
        summary.files[rel_path] = dict(sorted(clean.items()))
    else:
        summary.files.pop(rel_path, None)
    _recount(summary)


def _recount(summary: RedactionSummary) -> None:
    by_kind: Counter[str] = Counter()
    for counts in summary.files.values():
        by_kind.update(counts)
    summary.by_kind = dict(sorted(by_kind.items()))
    summary.total = sum(by_kind.values())


def redact_bundle(bundle: Bundle) -> Bundle:
    """A redacted copy of ``bundle`` with its redaction summary brought up to date.

    The summary gathers what capture removed from each raw output (``ToolRun.redactions``),
    what earlier writes recorded (logs, scenario copy) and what this pass removes from the
    bundle's own fields (entry ``bundle.json``). Saving the same bundle twice gives the same summary.
    """
    tally = Tally()
    summary = bundle.redaction.model_copy(deep=True)
    data = bundle.model_dump(mode="python", exclude={"redaction"})
    safe = Bundle.model_validate(redact_obj(data, tally))
    for proc in safe.processes:
        for tool in proc.tools:
            if tool.redactions:
                summary.files[tool.raw_path or f"{tool.tool} of pid {proc.pid}"] = dict(sorted(tool.redactions.items()))
    found = tally.as_dict()
    if found or BUNDLE_JSON not in summary.files:
        note_file(summary, BUNDLE_JSON, found)
    _recount(summary)
    safe.redaction = summary
    return safe
