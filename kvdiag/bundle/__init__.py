"""The bundle: one folder per run, the single source of truth every later stage reads.

Layout (one for every command; :mod:`kvdiag.bundle.io` names each part)::

    OUT/                 report.json, report.html, report.md (renderings of bundle/bundle.json)
    OUT/bundle/          bundle.json, scenario.yaml, logs/<engine>.log, raw/<pid>/<tool>.txt
    OUT/<label>/         a nested run (``kvdiag ab``: stock/, fixed/), each with its own bundle/

:func:`~kvdiag.bundle.io.write_bundle` is the one writer of bundle.json (redacting: :mod:`kvdiag.redact`).
:func:`~kvdiag.bundle.io.load_run` is the one loader: the bundle plus the nested runs it names.
"""
