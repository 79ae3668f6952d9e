"""The layers of docs/ARCHITECTURE.md "Layout and namespace", as imports: protocol knows no HTTP, api or engine; the engine knows no HTTP
and no wire dialect (its errors are protocol exceptions the api maps, docs/PROTOCOL.md §2.1)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "basal_local"
FORBIDDEN = {
    "protocol": ("basal_local.api", "basal_local.server", "basal_local.engine", "torch", "litestar", "uvicorn"),
    "engine": ("basal_local.api", "basal_local.server", "litestar", "uvicorn"),
}


def _imports(path: Path) -> list[str]:
    """Absolute names of every module `path` imports (relative imports resolved against its package)."""
    package = ["basal_local", *path.relative_to(PACKAGE).parent.parts]
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            names.append(".".join([*base, *(node.module or "").split(".")]).strip("."))
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports(layer):
    bad = [f"{path.relative_to(PACKAGE)} imports {name}" for path in sorted((PACKAGE / layer).glob("*.py"))
           for name in _imports(path) if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[layer])]
    assert bad == []


def test_the_resolver_sees_relative_imports():
    """The check above can fail: engine/plan.py's own relative imports resolve to their absolute names."""
    names = _imports(PACKAGE / "engine" / "plan.py")
    assert "basal_local.protocol.errors" in names and "basal_local.engine.packer" in names
