"""Save and load a capture bundle folder (bundle/bundle.json plus raw files)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pydantic import ValidationError

from kvdiag.errors import BundleError
from kvdiag.model import SCHEMA_VERSION, Bundle
from kvdiag.redact import redact_bundle

BUNDLE_FILE = "bundle.json"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so readers never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_bundle(bundle: Bundle, bundle_dir: Path) -> Path:
    """Write bundle_dir/bundle.json, redacted (the one place the bundle enters the folder).

    The caller's ``bundle.redaction`` is updated to the summary written, so the
    reports built from it show the same counts.
    """
    path = bundle_dir / BUNDLE_FILE
    safe = redact_bundle(bundle)
    bundle.redaction = safe.redaction.model_copy(deep=True)
    atomic_write_text(path, safe.model_dump_json(indent=2))
    return path


def resolve_bundle_dir(path: Path) -> Path:
    """Accept the bundle folder, its bundle.json, or a run folder holding bundle/."""
    if path.is_file():
        return path.parent
    if (path / BUNDLE_FILE).is_file():
        return path
    if (path / "bundle" / BUNDLE_FILE).is_file():
        return path / "bundle"
    raise BundleError(f"{path}: no {BUNDLE_FILE} found", hint="pass a run folder, its bundle/ or bundle.json")


def load_bundle(path: Path) -> tuple[Bundle, Path]:
    bundle_dir = resolve_bundle_dir(path)
    file = bundle_dir / BUNDLE_FILE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise BundleError(f"{file}: cannot read bundle: {exc}") from exc
    version = str(data.get("schema_version", "")) if isinstance(data, dict) else ""
    if version != SCHEMA_VERSION:
        raise BundleError(f"{file}: bundle schema_version {version!r} is not supported (expected {SCHEMA_VERSION})")
    try:
        return Bundle.model_validate(data), bundle_dir
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise BundleError(f"{file}: invalid bundle at {loc}: {first['msg']}") from exc
