"""Write and read a bundle folder: bundle/bundle.json plus the raw files beside it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from kvdiag.errors import BundleError
from kvdiag.model.bundle import Bundle
from kvdiag.model.kinds import SCHEMA_VERSION
from kvdiag.redact.bundle import redact_bundle
from kvdiag.redact.files import replace_file
from kvdiag.redact.rules import redact_text

BUNDLE_DIR = "bundle"            # inside a run's output folder
BUNDLE_FILE = "bundle.json"
SCENARIO_FILE = "scenario.yaml"
LOGS_DIR = "logs"                # logs/<engine>.log, redacted copies
RAW_DIR = "raw"                  # raw/<pid>/<tool>.txt raw tool outputs, redacted (see raw_dir)
_MAX_NESTING = 2                 # an ab run nests plain runs, nothing deeper


def raw_root(bundle_dir: Path) -> Path:
    """Where a bundle's raw tool outputs go: ``bundle_dir/raw``."""
    return bundle_dir / RAW_DIR


def raw_dir(root: Path, pid: int) -> Path:
    """The one raw layout, for every command (capture, repro, ab, soak): ``raw/<pid>/<tool>.txt``.

    ``root`` is :func:`raw_root` of the bundle folder. A pid is unique within one run, and each
    process's engine is recorded in bundle.json (``processes[].engine``), so the path does not
    repeat it. A bundle laid out otherwise (``raw/<engine>/<pid>/``) stays readable because every
    tool run stores its file's bundle-relative ``raw_path``, which the loader and renderers follow
    (never a path rebuilt from this layout).
    """
    return root / str(pid)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so readers never see a half-written file."""
    replace_file(path, text)


def write_text_redacted(path: Path, text: str) -> None:
    """A text file entering the bundle (scenario, logs, raw tool output), secrets redacted."""
    atomic_write_text(path, redact_text(text))


def write_bundle(bundle: Bundle, bundle_dir: Path) -> Bundle:
    """Redact ``bundle`` (kvdiag.redact, the one redactor) and write it as ``bundle_dir/bundle.json``.

    Returns the redacted copy that was written (with its redaction summary)."""
    safe = redact_bundle(bundle)
    atomic_write_text(bundle_dir / BUNDLE_FILE, safe.model_dump_json(indent=2))
    return safe


def save_bundle(bundle: Bundle, bundle_dir: Path) -> Path:
    """Write bundle_dir/bundle.json, redacted; the caller's ``bundle.redaction`` gets the summary written."""
    safe = write_bundle(bundle, bundle_dir)
    bundle.redaction = safe.redaction.model_copy(deep=True)
    return bundle_dir / BUNDLE_FILE


def resolve_bundle_file(path: Path) -> Path:
    """The bundle's JSON file: ``path`` itself when it is a file (a bundle.json under any name, e.g.
    renamed after a download), else the bundle.json of a bundle folder or of a run folder holding bundle/."""
    if path.is_file():
        return path
    if (path / BUNDLE_FILE).is_file():
        return path / BUNDLE_FILE
    if (path / BUNDLE_DIR / BUNDLE_FILE).is_file():
        return path / BUNDLE_DIR / BUNDLE_FILE
    if not path.exists():
        raise BundleError(f"{path}: no such file or folder", hint="pass a run folder, its bundle/ or a bundle "
                                                                  "JSON file")
    raise BundleError(f"{path}: no {BUNDLE_FILE} found", hint="pass a run folder, its bundle/ or a bundle JSON file")


def resolve_bundle_dir(path: Path) -> Path:
    """Accept the bundle folder, its bundle JSON file, or a run folder holding bundle/."""
    return resolve_bundle_file(path).parent


def load_bundle(path: Path) -> tuple[Bundle, Path]:
    """The bundle at ``path`` (run folder, bundle folder or a bundle JSON file) and its folder."""
    file = resolve_bundle_file(path)
    bundle_dir = file.parent
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise BundleError(f"{file}: cannot read bundle: {exc}") from exc
    version = str(data.get("schema_version", "")) if isinstance(data, dict) else ""
    if version != SCHEMA_VERSION:
        raise BundleError(f"{file}: bundle schema_version {version!r} is not supported (expected {SCHEMA_VERSION})")
    try:
        return redact_bundle(Bundle.model_validate(data)), bundle_dir
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise BundleError(f"{file}: invalid bundle at {loc}: {first['msg']}") from exc


@dataclass
class LoadedRun:
    """A bundle read from disk, with the nested runs it names (``kvdiag ab``)."""

    bundle: Bundle
    bundle_dir: Path
    runs: dict[str, LoadedRun] = field(default_factory=dict)

    @property
    def run_bundles(self) -> dict[str, Bundle]:
        return {label: run.bundle for label, run in self.runs.items()}

    @property
    def out_dir(self) -> Path:
        """The run's output folder (where report.* go): the folder holding bundle/."""
        return self.bundle_dir.parent if self.bundle_dir.name == BUNDLE_DIR else self.bundle_dir


def load_run(path: Path, _depth: int = 0) -> LoadedRun:
    """The bundle at ``path`` and, recursively, the nested runs its ``runs`` name."""
    bundle, bundle_dir = load_bundle(path)
    run = LoadedRun(bundle, bundle_dir)
    for label, rel in bundle.runs.items():
        if _depth >= _MAX_NESTING or Path(rel).is_absolute():
            raise BundleError(f"{bundle_dir / BUNDLE_FILE}: nested run {label!r} at {rel!r} is not allowed")
        run.runs[label] = load_run(bundle_dir / rel, _depth + 1)
    return run
