"""The kvcached build fingerprint tells a pre-fix tree from a post-fix one by its files."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from kvdiag.kvcached.build import (
    GIL_DEFECT,
    IPC_DEFECT,
    UNDERFLOW_DEFECT,
    fingerprint_tree,
    installed_kvcached,
)
from kvdiag.model.environment import DefectStatus, KvcachedBuild

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def statuses(build: KvcachedBuild) -> dict[str, DefectStatus]:
    return {c.defect: c.status for c in build.checks}


def test_prefix_fixture_is_pre_fix_on_every_count() -> None:
    build = fingerprint_tree(FIXTURES / "kvcached_prefix", version="0.1.5")
    assert build.verdict == "pre_fix" and build.allocator == "cpp"
    assert statuses(build) == {GIL_DEFECT: DefectStatus.PRESENT, IPC_DEFECT: DefectStatus.PRESENT,
                               UNDERFLOW_DEFECT: DefectStatus.PRESENT}
    gil = build.checks[0]
    assert "#371" in gil.upstream and "#422" in gil.upstream
    assert any("without gil_scoped_release" in e for e in gil.evidence)
    assert any("set_should_use_worker_ipc_callback" in e for e in gil.evidence)
    assert "#377" in build.checks[2].upstream


def test_postfix_fixture_is_fixed() -> None:
    build = fingerprint_tree(FIXTURES / "kvcached_postfix")
    assert build.verdict == "fixed"
    assert set(statuses(build).values()) == {DefectStatus.FIXED}


def _compile_extension(tmp: Path, names: list[str], so_name: str) -> Path:
    """A real shared object whose strings are the method names a pybind11 module registers."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp / "ext.c"
    body = "".join(f'const char *name_{i} = "{n}";\n' for i, n in enumerate(names))
    src.write_text(body)
    out = tmp / so_name
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True, capture_output=True)
    return out


@pytest.mark.parametrize(("names", "expect"), [
    (["PageAllocator", "alloc_page", "set_should_use_worker_ipc_callback"], DefectStatus.PRESENT),
    (["PageAllocator", "alloc_page", "set_use_worker_ipc"], DefectStatus.FIXED),
])
def test_binary_only_install_is_judged_from_the_extension(tmp_path: Path, names: list[str],
                                                           expect: DefectStatus) -> None:
    pkg = tmp_path / "site-packages" / "kvcached"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    _compile_extension(tmp_path, names, "vmm_ops.cpython-311-x86_64-linux-gnu.so")
    shutil.move(str(tmp_path / "vmm_ops.cpython-311-x86_64-linux-gnu.so"), pkg)
    build = fingerprint_tree(pkg)
    assert build.allocator == "cpp" and "binary" in build.sources and "source" not in build.sources
    assert statuses(build)[GIL_DEFECT] is expect
    assert statuses(build)[UNDERFLOW_DEFECT] is DefectStatus.UNKNOWN   # the binary cannot show it


def test_stale_build_of_a_fixed_source_is_called_out(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(FIXTURES / "kvcached_postfix", tree)
    _compile_extension(tmp_path, ["alloc_page", "set_should_use_worker_ipc_callback"], "vmm_ops.so")
    shutil.move(str(tmp_path / "vmm_ops.so"), tree / "kvcached")
    build = fingerprint_tree(tree)
    assert build.verdict == "pre_fix"   # what runs is the old binary
    assert any("disagree" in e for e in build.checks[0].evidence)


def test_python_allocator_era_is_not_affected(tmp_path: Path) -> None:
    pkg = tmp_path / "kvcached"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "page_allocator.py").write_text("class PageAllocator:\n    pass\n")
    build = fingerprint_tree(pkg)
    assert build.allocator == "python" and build.verdict == "not_affected"


def test_not_installed_here() -> None:
    try:
        import importlib.util

        present = importlib.util.find_spec("kvcached") is not None
    except (ImportError, ValueError):
        present = False
    build = installed_kvcached()
    assert build.installed is present
    if not present:
        assert build.verdict == "absent" and "not installed" in build.summary


SDIST_URL = ("https://files.pythonhosted.org/packages/fd/fc/9151b1487702469b66725d7f239d3efcb3b1753f9f67ac6a96297bd2e"
             "839/kvcached-0.1.6.tar.gz")
SDIST_SHA256 = "4a1a428244b5e3667841e28f03a4a20be7066a21a856b2deaef727e18f845068"


def _sdist() -> Path | None:
    """KVDIAG_KVCACHED_SDIST, else a verified copy in ~/.cache/kvdiag, fetched once from PyPI when reachable."""
    given = os.environ.get("KVDIAG_KVCACHED_SDIST")
    if given:
        return Path(given)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvdiag" / "kvcached-0.1.6.tar.gz"
    if not cache.exists():
        import hashlib
        import urllib.request

        try:
            with urllib.request.urlopen(SDIST_URL, timeout=20) as resp:
                data = resp.read()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != SDIST_SHA256:
            return None
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".part")
        tmp.write_bytes(data)
        tmp.replace(cache)
    return cache


def test_kvcached_0_1_6_sdist_is_post_fix(tmp_path: Path) -> None:
    """kvcached 0.1.6's source distribution (the first release with the C++ allocator) is post-fix.

    Uses KVDIAG_KVCACHED_SDIST=/path/to/kvcached-0.1.6.tar.gz (or its unpacked folder) when set, else
    fetches the sdist once (sha256-checked). `pip download kvcached==0.1.6 --no-deps --no-binary :all:`
    stops at its metadata step without torch, so the file is taken as pip would fetch it.
    """
    path = _sdist()
    if path is None:
        pytest.skip("kvcached 0.1.6 sdist not reachable (set KVDIAG_KVCACHED_SDIST)")
    if path.is_file():
        with tarfile.open(path) as tar:
            try:
                tar.extractall(tmp_path, filter="data")
            except TypeError:  # Python without extraction filters: the sdist's sha256 was checked
                tar.extractall(tmp_path)  # noqa: S202
        path = next(tmp_path.glob("kvcached-*"))
    build = fingerprint_tree(path, version="0.1.6")
    assert build.verdict == "fixed"
    assert set(statuses(build).values()) == {DefectStatus.FIXED}
    prefix = fingerprint_tree(FIXTURES / "kvcached_prefix")
    assert prefix.verdict == "pre_fix"
