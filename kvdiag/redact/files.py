"""Redacted files: how every raw output and log enters an output folder, and ``kvdiag redact DIR``'s
scan of one for what is left."""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from kvdiag.redact.rules import Tally, redact_text, scan_text


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# Read once, at import (single-threaded): os.umask can only be read by setting it.
_UMASK = _read_umask()


def replace_file(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically, so no reader sees a half-written file.

    The temporary file is created owner-only (an unredacted or partial file is never readable
    by others) and given the mode the user's umask gives any new file before it replaces
    ``path``: output folders are handed to colleagues, and secrets are redacted before this.
    Raises OSError like ``write_text``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            os.fchmod(fh.fileno(), 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_redacted(path: Path, text: str, tally: Tally | None = None) -> Path:
    """Write ``text`` to ``path`` redacted (the way every raw output enters an output folder),
    atomically (:func:`replace_file`)."""
    return replace_file(path, redact_text(text, tally))


def copy_redacted(src: Path, dst: Path, tally: Tally | None = None) -> Path:
    """Copy a text file (an engine log) into the output folder, redacted."""
    return write_redacted(dst, src.read_text(encoding="utf-8", errors="replace"), tally)


def redact_file(path: Path, tally: Tally | None = None) -> bool:
    """Rewrite one text file in place with secrets redacted; True when it changed."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return False
    safe = redact_text(text, tally)
    if safe == text:
        return False
    write_redacted(path, safe)
    return True


def redact_tree(folder: Path, tally: Tally | None = None) -> int:
    """Rewrite every text file under ``folder`` with secrets redacted; returns how many changed."""
    changed = 0
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            changed += redact_file(path, tally)
    return changed


# ---------------------------------------------------------------- scanning (kvdiag redact DIR)


@dataclass(frozen=True)
class Hit:
    """A credential-shaped value left in a file: where and which kind, never the value."""

    path: str
    line: int
    kind: str


_NON_TEXT = re.compile(r"[^\x20-\x7e\t\n]")


def scan_tree(folder: Path) -> list[Hit]:
    """Every secret left in any file under ``folder`` (binary files are read as latin-1)."""
    hits: list[Hit] = []
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or path.is_symlink():
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            # Binary: keep the printable runs (as strings(1) would), line breaks where they were.
            text = _NON_TEXT.sub(" ", data.decode("latin-1"))
        rel = os.path.relpath(path, folder)
        hits.extend(Hit(rel, no, kind) for no, kind in scan_text(text))
    return hits
