"""Every name is imported from the module that defines it: no module imports a name only to pass it on (in
``__all__``, or unused in a package's ``__init__``), so there is one import path per name."""

from __future__ import annotations

import ast
from pathlib import Path

import kvdiag

ROOT = Path(kvdiag.__file__).resolve().parent


def _passed_on(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom)
                and node.module != "__future__" for a in node.names}
    exported: set[str] = set()
    used: set[str] = set()
    for n, node in enumerate(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)) or (n == 0 and isinstance(node, ast.Expr)):
            continue
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            exported |= {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)}
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                used.add(sub.id)
            elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):   # string annotations
                used.update(sub.value.replace("[", " ").replace("]", " ").replace("|", " ").split())
    init = path.name == "__init__.py"
    return sorted(name for name in imported if name in exported or (init and name not in used))


def test_no_module_imports_a_name_only_to_re_export_it() -> None:
    offenders = {str(p.relative_to(ROOT)): names for p in sorted(ROOT.rglob("*.py")) if (names := _passed_on(p))}
    assert not offenders, f"import these names from the module that defines them: {offenders}"
