"""Fingerprint a kvcached build from its files, not its version number.

No release shipped the allocator behind kvcached #371 (it lived on git main
between PR #319 and PR #422), and git builds keep the last tag's version, so
``kvcached 0.1.5`` says nothing about it. What does tell:

- the bindings: at the buggy commits ``PageAllocator.alloc_page`` is bound
  without releasing the GIL, and the prealloc thread asks Python
  ``should_use_worker_ipc`` through ``set_should_use_worker_ipc_callback``.
  PR #422 added ``call_guard<gil_scoped_release>`` and replaced the callback
  by ``set_use_worker_ipc(bool)``. Read from csrc/torch_bindings.cpp when the
  source is there; else from the extension module's strings (the method names
  pybind11 registers) and from the Python side that calls them;
- the worker IPC read: ``kvcached/tp_ipc_util.py`` awaits ``readexactly`` with
  no timeout before #422, and wraps it in ``asyncio.wait_for`` with
  ``KVCACHED_IPC_TIMEOUT`` after;
- the headroom underflow (#377): ``get_avail_physical_pages`` subtracts the
  headroom from the free memory in unsigned arithmetic; f8b07c8 brought
  ``saturating_subtract``. Only the C++ source shows it.

Nothing here imports kvcached (importing it can initialise CUDA).
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Literal

from kvdiag.kvcached.defects import BY_KEY, GIL_HOLDING_ALLOC_PAGE, HEADROOM_UNDERFLOW, UNBOUNDED_IPC_READ
from kvdiag.model.environment import DefectCheck, DefectStatus, KvcachedBuild
from kvdiag.osread.files import read_text as _read

GIL_DEFECT = GIL_HOLDING_ALLOC_PAGE.key
IPC_DEFECT = UNBOUNDED_IPC_READ.key
UNDERFLOW_DEFECT = HEADROOM_UNDERFLOW.key

_BUILD_VERDICT: dict[DefectStatus, Literal["pre_fix", "fixed", "not_affected", "unknown"]] = {
    DefectStatus.PRESENT: "pre_fix", DefectStatus.FIXED: "fixed", DefectStatus.NOT_APPLICABLE: "not_affected",
    DefectStatus.UNKNOWN: "unknown"}
OLD_CALLBACK = "set_should_use_worker_ipc_callback"
NEW_SETTER = "set_use_worker_ipc"
_MAX_BINARY_BYTES = 256 * 1024 * 1024


def _check(defect: str, status: DefectStatus, evidence: list[str]) -> DefectCheck:
    known = BY_KEY[defect]
    return DefectCheck(defect=defect, title=known.title, status=status, upstream=known.upstream, evidence=evidence)


def _def_statement(text: str, method: str) -> str | None:
    """The ``.def("method", ...)`` call in a pybind11 binding file, up to its closing parenthesis."""
    m = re.search(r'\.def\(\s*"' + re.escape(method) + r'"', text)
    if m is None:
        return None
    depth = 0
    for i in range(m.start() + 4, len(text)):
        c = text[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return text[m.start():i + 1]
    return text[m.start():]


def _function_body(text: str, name: str) -> str | None:
    """The body of the free function ``name`` defined in ``text`` (first definition, brace-matched)."""
    m = re.search(r"\b" + re.escape(name) + r"\s*\([^;{]*\)\s*(?:const\s*)?\{", text)
    if m is None:
        return None
    depth = 0
    for i in range(m.end() - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[m.end():i]
    return None


def _gil_from_bindings(text: str, where: str) -> tuple[DefectStatus, list[str]] | None:
    stmt = _def_statement(text, "alloc_page")
    if stmt is None:
        return None
    releases = "gil_scoped_release" in stmt
    how = "call_guard<gil_scoped_release> on the binding"
    if not releases:
        target = re.search(r"&\s*([\w:]+)", stmt)
        body = _function_body(text, target.group(1).split("::")[-1]) if target else None
        if body is not None and "gil_scoped_release" in body:
            releases, how = True, "gil_scoped_release inside the bound function"
    ev = []
    if releases:
        ev.append(f"{where}: alloc_page releases the GIL ({how})")
    else:
        ev.append(f"{where}: alloc_page is bound without gil_scoped_release (waits with the GIL held)")
    if _def_statement(text, OLD_CALLBACK) is not None:
        ev.append(f"{where}: binds {OLD_CALLBACK} (the prealloc thread calls Python)")
    if _def_statement(text, NEW_SETTER) is not None:
        ev.append(f"{where}: binds {NEW_SETTER} (a cached flag, no Python call from the prealloc thread)")
    if not releases or _def_statement(text, OLD_CALLBACK) is not None:
        return DefectStatus.PRESENT, ev
    return DefectStatus.FIXED, ev


def _binary_strings(path: Path) -> set[str]:
    """Which of the marker names occur as NUL-terminated strings in an extension module."""
    try:
        if path.stat().st_size > _MAX_BINARY_BYTES:
            return set()
        data = path.read_bytes()
    except OSError:
        return set()
    found = set()
    for name in (OLD_CALLBACK, NEW_SETTER, "alloc_page", "PageAllocator", "prealloc_worker"):
        if re.search(rb"(?<![A-Za-z0-9_])" + name.encode() + rb"\x00", data):
            found.add(name)
    return found


def _extension_modules(pkg: Path) -> list[Path]:
    out: list[Path] = []
    for pattern in ("vmm_ops*.so", "_C*.so", "*.so"):
        for p in sorted(pkg.glob(pattern)):
            if p not in out:
                out.append(p)
    return out


def fingerprint_tree(root: Path, *, version: str | None = None, git_commit: str | None = None,
                     installed: bool = True) -> KvcachedBuild:
    """Judge a kvcached tree: ``root`` is the package folder, or a source tree holding ``kvcached/``."""
    root = Path(root)
    pkg = root / "kvcached" if (root / "kvcached" / "__init__.py").exists() else root
    src = next((c for c in (pkg.parent / "csrc", root / "csrc") if c.is_dir()), None)
    build = KvcachedBuild(installed=installed, version=version, location=str(pkg), git_commit=git_commit)
    bindings = _read(src / "torch_bindings.cpp") if src else None
    allocator_cpp = _read(src / "page_allocator.cpp") if src else None
    sos = _extension_modules(pkg)
    so_marks: dict[Path, set[str]] = {p: _binary_strings(p) for p in sos}
    kvm = _read(pkg / "kv_cache_manager.py")
    ipc = _read(pkg / "tp_ipc_util.py")

    has_cpp = bool(allocator_cpp) or any("PageAllocator" in m or "alloc_page" in m for m in so_marks.values())
    if has_cpp or (bindings and "PageAllocator" in bindings):
        build.allocator = "cpp"
    elif (pkg / "page_allocator.py").exists():
        build.allocator = "python"
    if bindings is not None:
        build.sources.append("source")
    if sos:
        build.sources.append("binary")
    if kvm is not None or ipc is not None:
        build.sources.append("python")

    # 1. The GIL cycle of #371: the binary is what runs, then the source, then the Python caller.
    gil: tuple[DefectStatus, list[str]] | None = None
    for so, marks in so_marks.items():
        if OLD_CALLBACK in marks:
            gil = (DefectStatus.PRESENT, [f"{so.name}: registers {OLD_CALLBACK} (pre-#422 binding set: "
                                          "alloc_page holds the GIL, the prealloc thread calls Python)"])
        elif NEW_SETTER in marks:
            gil = (DefectStatus.FIXED, [f"{so.name}: registers {NEW_SETTER} (the #422 binding set)"])
        if gil:
            break
    from_source = _gil_from_bindings(bindings, "csrc/torch_bindings.cpp") if bindings else None
    if from_source is not None:
        if gil is None:
            gil = from_source
        else:
            gil[1].extend(from_source[1])
            if from_source[0] is not gil[0]:
                gil[1].append("the built extension and the source tree disagree: rebuild kvcached "
                              "(pip install -e . --no-build-isolation)")
    if kvm is not None:
        if OLD_CALLBACK in kvm:
            ev = f"kvcached/kv_cache_manager.py: calls {OLD_CALLBACK}"
            gil = gil or (DefectStatus.PRESENT, [])
            gil[1].append(ev)
        elif NEW_SETTER in kvm:
            gil = gil or (DefectStatus.FIXED, [])
            gil[1].append(f"kvcached/kv_cache_manager.py: calls {NEW_SETTER}")
    if gil is None:
        if build.allocator == "python":
            gil = (DefectStatus.NOT_APPLICABLE, ["kvcached/page_allocator.py: the Python allocator (before PR #319)"])
        else:
            gil = (DefectStatus.UNKNOWN, ["no bindings source, extension module or kv_cache_manager.py found"])
    build.checks.append(_check(GIL_DEFECT, *gil))

    # 2. The worker IPC read.
    if ipc is None:
        build.checks.append(_check(IPC_DEFECT, DefectStatus.UNKNOWN, ["kvcached/tp_ipc_util.py not found"]))
    elif "wait_for" in ipc or "KVCACHED_IPC_TIMEOUT" in ipc:
        build.checks.append(_check(IPC_DEFECT, DefectStatus.FIXED,
                                   ["kvcached/tp_ipc_util.py: the reply read is bounded (asyncio.wait_for, "
                                    "KVCACHED_IPC_TIMEOUT)"]))
    elif "readexactly" in ipc:
        build.checks.append(_check(IPC_DEFECT, DefectStatus.PRESENT,
                                   ["kvcached/tp_ipc_util.py: readexactly() with no timeout: a live but stuck "
                                    "worker hangs the caller forever"]))
    else:
        build.checks.append(_check(IPC_DEFECT, DefectStatus.UNKNOWN,
                                   ["kvcached/tp_ipc_util.py: no reply read recognised"]))

    # 3. The headroom underflow (#377): only the C++ source shows it.
    if allocator_cpp is not None:
        body = _function_body(allocator_cpp, "get_avail_physical_pages") or ""
        if "saturating_subtract" in body:
            st, ev = DefectStatus.FIXED, "csrc/page_allocator.cpp: get_avail_physical_pages uses saturating_subtract"
        elif re.search(r"max\(\s*\w+\s*-\s*\w+\s*,\s*\(size_t\)\s*0\s*\)", body):
            st, ev = DefectStatus.PRESENT, ("csrc/page_allocator.cpp: get_avail_physical_pages takes "
                                            "max(free - headroom, (size_t)0) in unsigned arithmetic")
        elif body:
            st, ev = DefectStatus.UNKNOWN, "csrc/page_allocator.cpp: get_avail_physical_pages not recognised"
        else:
            st, ev = DefectStatus.UNKNOWN, "csrc/page_allocator.cpp: get_avail_physical_pages not found"
        build.checks.append(_check(UNDERFLOW_DEFECT, st, [ev]))
    elif build.allocator == "python":
        build.checks.append(_check(UNDERFLOW_DEFECT, DefectStatus.NOT_APPLICABLE,
                                   ["the Python allocator (before PR #319) has no C++ headroom computation"]))
    else:
        build.checks.append(_check(UNDERFLOW_DEFECT, DefectStatus.UNKNOWN,
                                   ["C++ source not installed; the binary does not show it"]))

    status = build.checks[0].status
    build.verdict = _BUILD_VERDICT[status]
    build.summary = {
        "pre_fix": "pre-fix build: the prealloc GIL cycle of kvcached #371 can happen (fixed by PR #422, first "
                   "in 0.1.6); set KVCACHED_PAGE_PREALLOC_ENABLED=false or install kvcached >= 0.1.6",
        "fixed": "has the #422 fix (GIL released in alloc_page, no Python call from the prealloc thread)",
        "not_affected": "Python page allocator (before the C++ allocator of PR #319): not affected by #371",
        "unknown": "could not tell whether this build has the #422 fix",
    }[build.verdict]
    return build


def _direct_url_commit(dist: metadata.Distribution) -> str | None:
    try:
        raw = dist.read_text("direct_url.json")
    except Exception:
        return None
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    vcs = data.get("vcs_info") if isinstance(data, dict) else None
    commit = vcs.get("commit_id") if isinstance(vcs, dict) else None
    return str(commit) if commit else None


def build_at(locations: Sequence[str], version: str | None, commit: str | None, *,
             installed: bool = True) -> KvcachedBuild:
    """The fingerprint of the kvcached package found at ``locations`` (an import spec's folders).

    ``installed`` says whether package metadata was found; no folder and no metadata is "absent".
    Fingerprints are cached per folder: every engine sharing an interpreter reads its files once.
    """
    if not locations:
        if not installed:
            return KvcachedBuild(installed=False, verdict="absent", summary="kvcached is not installed")
        return KvcachedBuild(installed=True, version=version, git_commit=commit, verdict="unknown",
                             summary="kvcached metadata found but not its package folder")
    key = (str(Path(locations[0]).resolve()), version, commit)
    if key not in _fingerprints:
        _fingerprints[key] = fingerprint_tree(Path(locations[0]), version=version, git_commit=commit)
    return _fingerprints[key].model_copy(deep=True)


_fingerprints: dict[tuple[str, str | None, str | None], KvcachedBuild] = {}


def site_kvcached(site_dirs: Iterable[Path]) -> list[str]:
    """The kvcached package folder an interpreter with these site folders would import (first on the path)."""
    for d in site_dirs:
        if (d / "kvcached" / "__init__.py").is_file():
            return [str(d / "kvcached")]
    return []


def installed_kvcached() -> KvcachedBuild:
    """Fingerprint the kvcached this interpreter (kvdiag's own) would import (without importing it)."""
    version: str | None = None
    commit: str | None = None
    try:
        dist = metadata.distribution("kvcached")
        version = dist.version
        commit = _direct_url_commit(dist)
    except metadata.PackageNotFoundError:
        dist = None
    try:
        spec = importlib.util.find_spec("kvcached")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return build_at(locations, version, commit, installed=dist is not None)
