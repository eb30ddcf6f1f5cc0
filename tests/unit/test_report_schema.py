"""schema/report.schema.json is generated from the models: the committed file is what they generate."""

from __future__ import annotations

import jsonschema

from kvdiag.model.report import Report
from kvdiag.report.schema import SCHEMA_FILE, main, report_schema, schema_text


def test_committed_schema_is_the_generated_one() -> None:
    assert SCHEMA_FILE.read_text(encoding="utf-8") == schema_text(), \
        "schema/report.schema.json is stale: run python -m kvdiag.report.schema"
    assert main(["--check"]) == 0


def test_generated_schema_is_valid_and_covers_every_report_field() -> None:
    schema = report_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert set(schema["properties"]) == set(Report.model_fields)
    assert set(schema["required"]) <= set(Report.model_fields)
    assert schema["properties"]["schema_version"] == {"const": "1"}
    # An older report (no key frames, no frame references) still validates: added fields are optional.
    old = {"schema_version": "1", "kvdiag_version": "0.1", "command": "repro", "created_at": "", "exit_code": 10,
           "verdict": {"kind": "gil_cycle", "summary": "s", "confidence": "high",
                       "evidence": [{"pid": 1, "tid": 1, "role": "r", "frames": ["f"]}]},
           "verdicts_by_engine": {}, "engines": [], "timeline": [], "findings": [], "some_later_field": 1}
    jsonschema.Draft202012Validator(schema).validate(old)
