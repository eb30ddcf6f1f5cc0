"""The bundle: one folder per run, the single source of truth every later stage reads.

Layout (one for every command; :data:`LAYOUT` names each part)::

    OUT/                 report.json, report.html, report.md (renderings of bundle/bundle.json)
    OUT/bundle/          bundle.json, scenario.yaml, logs/<engine>.log, raw/<pid>/<tool>.txt
    OUT/<label>/         a nested run (``kvdiag ab``: stock/, fixed/), each with its own bundle/

:func:`write_bundle` is the one writer of bundle.json: it redacts on the way in.
:func:`load_run` is the one loader: the bundle plus the nested runs it names.
"""

from kvdiag.bundle.io import (
    BUNDLE_DIR,
    BUNDLE_FILE,
    LOGS_DIR,
    RAW_DIR,
    SCENARIO_FILE,
    LoadedRun,
    atomic_write_text,
    load_bundle,
    load_run,
    raw_dir,
    raw_root,
    resolve_bundle_dir,
    resolve_bundle_file,
    save_bundle,
    write_bundle,
    write_text_redacted,
)

__all__ = [
    "BUNDLE_DIR", "BUNDLE_FILE", "LOGS_DIR", "RAW_DIR", "SCENARIO_FILE", "LoadedRun", "atomic_write_text",
    "load_bundle", "load_run", "raw_dir", "raw_root", "resolve_bundle_dir", "resolve_bundle_file", "save_bundle",
    "write_bundle", "write_text_redacted",
]
