"""Raw outputs, logs and bundle.json named in report.html are links that open those files."""

from __future__ import annotations

import io
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from urllib.parse import unquote

import pytest

from kvdiag.cli.main import main
from kvdiag.report.html import bundle_href

BUNDLES = Path(__file__).resolve().parents[1] / "fixtures" / "bundles"


@pytest.mark.parametrize(("rel", "base", "href"), [
    ("raw/vlm/123/py-spy.txt", "bundle", "bundle/raw/vlm/123/py-spy.txt"),
    ("logs/a b#1.log", "bundle", "bundle/logs/a%20b%231.log"),
    ("bundle.json", "../runs/x y/bundle", "../runs/x%20y/bundle/bundle.json"),
    ("bundle.json", "", "bundle.json"),
    ("../../etc/passwd", "bundle", None),
    ("/etc/passwd", "bundle", None),
    ("javascript:alert(1)", "bundle", None),
    ("raw/x.txt", None, None),
    (None, "bundle", None),
])
def test_bundle_href(rel: str | None, base: str | None, href: str | None) -> None:
    assert bundle_href(rel, base) == href


def _hrefs(page: str) -> list[str]:
    return [h for h in re.findall(r'<a href="([^"]+)"', page) if not h.startswith("#")]


def _render(*argv: str) -> None:
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        assert main(list(argv)) == 0, out.getvalue()


@pytest.mark.parametrize("how", ["out", "html"])
def test_every_raw_output_path_is_a_working_link(tmp_path: Path, how: str) -> None:
    bundle = BUNDLES / "gil_cycle"
    if how == "out":
        _render("report", str(bundle), "--out", str(tmp_path / "run"))
        page_path = tmp_path / "run" / "report.html"
    else:
        _render("report", str(bundle), "--html", str(tmp_path / "elsewhere" / "r.html"))
        page_path = tmp_path / "elsewhere" / "r.html"
    page = page_path.read_text()
    hrefs = _hrefs(page)
    raw_files = sorted(str(p.relative_to(bundle)) for p in (bundle / "raw").rglob("*") if p.is_file())
    assert raw_files
    for rel in raw_files:
        assert any(unquote(h).endswith("/" + rel) for h in hrefs), (rel, hrefs)
    assert any(unquote(h).endswith("/bundle.json") for h in hrefs)
    for h in hrefs:
        target = (page_path.parent / unquote(h)).resolve()
        assert target.is_file(), h
        assert bundle.resolve() in target.parents
