"""A node's bundle folder as bytes and back (gzip'd tar): what a node sends the driver."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from kvdiag.errors import BundleError


def pack_dir(folder: Path) -> bytes:
    """Every regular file under ``folder`` (symlinks and special files are left out)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and not path.is_symlink():
                tar.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    return buf.getvalue()


def unpack_dir(data: bytes, folder: Path) -> None:
    """Unpack what :func:`pack_dir` made into ``folder``; refuses members that would land outside it."""
    folder.mkdir(parents=True, exist_ok=True)
    root = folder.resolve()
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar.getmembers():
                dest = (folder / member.name).resolve()
                if not member.isfile() or not dest.is_relative_to(root):
                    raise BundleError(f"a node's bundle holds an unexpected entry: {member.name!r}")
                dest.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(member)
                if src is None:
                    continue
                dest.write_bytes(src.read())
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise BundleError(f"a node's bundle could not be unpacked: {exc}") from None
