"""schema/report.schema.json, generated from the models report.json is dumped from (:class:`Report`).

    python -m kvdiag.report.schema           # write schema/report.schema.json
    python -m kvdiag.report.schema --check   # exit 1 when the committed file differs from the models

The models are the one definition: pydantic's JSON schema of :class:`Report` in serialization mode,
with definitions named in snake case, no per-property titles, and open objects (later kvdiag versions
of the same ``schema_version`` may add fields; none is removed or changes meaning without a new one).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from kvdiag.model.kinds import SCHEMA_VERSION
from kvdiag.model.report import Report

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "schema" / "report.schema.json"

# Definition names report.json consumers already refer to; every other model is its name in snake case.
DEF_NAMES = {"EnginePhase": "phase", "EvidenceItem": "evidence", "BannerInfo": "banner", "ReportEngine": "engine",
             "SoakStats": "soak"}
# The fields every report.json of this schema_version carries (the ones written since its first release).
REQUIRED = ["schema_version", "kvdiag_version", "command", "created_at", "exit_code", "verdict", "verdicts_by_engine",
            "engines", "timeline", "findings"]


def _snake(name: str) -> str:
    return DEF_NAMES.get(name) or re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def _tidy(node: Any, names: dict[str, str]) -> Any:
    """Definitions renamed, property titles dropped, objects left open to added fields."""
    if isinstance(node, list):
        return [_tidy(x, names) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str):
            out[key] = "#/$defs/" + names[value.rsplit("/", 1)[-1]]
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _tidy({k: v for k, v in prop.items() if k != "title"}, names)
                        for name, prop in value.items()}
        elif key == "additionalProperties" and value is False:
            continue
        else:
            out[key] = _tidy(value, names)
    return out


def report_schema() -> dict[str, Any]:
    """The JSON schema of report.json, from :class:`Report`."""
    raw = Report.model_json_schema(mode="serialization")
    defs: dict[str, Any] = raw.pop("$defs", {})
    names = {name: _snake(name) for name in defs}
    body = _tidy(raw, names)
    body.pop("title", None)
    body.pop("description", None)
    body["properties"]["schema_version"] = {"const": SCHEMA_VERSION}
    body["required"] = [name for name in REQUIRED if name in body["properties"]]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://kvdiag.invalid/schema/report/{SCHEMA_VERSION}",
        "title": "kvdiag report.json",
        "description": (f"The machine-readable report kvdiag writes for every run (schema_version {SCHEMA_VERSION}), "
                        "generated from kvdiag.model.Report. Fields may be added in later versions of the same "
                        "schema_version; none listed here is removed or changes meaning without a new "
                        "schema_version."),
        **body,
        "$defs": {names[name]: _tidy(d, names) for name, d in sorted(defs.items(), key=lambda kv: names[kv[0]])},
    }


def schema_text() -> str:
    return json.dumps(report_schema(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = schema_text()
    if "--check" in args:
        current = SCHEMA_FILE.read_text(encoding="utf-8") if SCHEMA_FILE.is_file() else ""
        if current != text:
            print(f"{SCHEMA_FILE} differs from the models: run python -m kvdiag.report.schema", file=sys.stderr)
            return 1
        return 0
    SCHEMA_FILE.write_text(text, encoding="utf-8")
    print(f"wrote {SCHEMA_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
