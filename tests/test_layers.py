"""The layers of docs/ARCHITECTURE.md "Layout and namespace", as imports: protocol knows no HTTP, api or engine; the
engine knows no HTTP and no wire dialect (its errors are protocol exceptions the api maps, docs/PROTOCOL.md §2.1);
backends know nothing of the server, the api or the commands; the settings know no room above them; the product
has no import circles; its modules stay under ~400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "basal_local"
FORBIDDEN = {
    "protocol": ("basal_local.api", "basal_local.server", "basal_local.engine", "basal_local.replicas", "torch",
                 "litestar", "uvicorn"),
    "engine": ("basal_local.api", "basal_local.server", "basal_local.replicas", "basal_local.commands", "litestar",
               "uvicorn"),
    "replicas": ("basal_local.api", "basal_local.server", "basal_local.commands", "litestar", "uvicorn"),
}
BACKEND_FORBIDDEN = ("basal_local.server", "basal_local.api", "basal_local.commands", "basal_local.cli")
# the settings modules sit below every room that reads them (the engine reads EngineSettings)
SETTINGS_MODULES = ("settings.py", "declare.py", "flags.py", "paths.py")
SETTINGS_FORBIDDEN = ("basal_local.server", "basal_local.api", "basal_local.commands", "basal_local.cli",
                      "basal_local.engine", "basal_local.replicas", "basal_local.bench", "litestar", "uvicorn", "torch")
MODULE_LINES = 400  # CONTRIBUTING.md "Style": modules under ~400 lines
LONG_MODULES: dict[str, str] = {}  # a module that must stay longer, and why


def _imports(path: Path, package: list[str], top_level_only: bool = False) -> list[str]:
    """Absolute names of every module `path` imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = []
    for node in nodes:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` blocks count as imports for the circle check
            nodes.extend(node.body)
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]  # `from . import x` may name a module
    return names


def _package_of(path: Path) -> list[str]:
    return ["basal_local", *path.relative_to(PACKAGE).parent.parts]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["basal_local", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports(layer):
    bad = [f"{path.relative_to(PACKAGE)} imports {name}" for path in sorted((PACKAGE / layer).glob("*.py"))
           for name in _imports(path, _package_of(path))
           if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[layer])]
    assert bad == []


def test_backends_import_nothing_of_server_api_or_commands():
    folder = ROOT / "backends"
    bad = []
    for path in sorted(folder.rglob("*.py")):
        package = ["basal_local", "backends", *path.relative_to(folder).parent.parts]
        bad += [f"{path.relative_to(ROOT)} imports {name}" for name in _imports(path, package)
                if any(name == f or name.startswith(f + ".") for f in BACKEND_FORBIDDEN)]
    assert bad == []


def test_settings_modules_import_no_room_above_them():
    bad = [f"{name} imports {imported}" for name in SETTINGS_MODULES
           for imported in _imports(PACKAGE / name, ["basal_local"])
           if any(imported == f or imported.startswith(f + ".") for f in SETTINGS_FORBIDDEN)]
    assert bad == []


def test_no_module_of_the_package_is_longer_than_about_400_lines():
    """Each module one concern (CONTRIBUTING.md "Style"); a module in LONG_MODULES says why it is longer, and is
    taken off that list once it is not."""
    lengths = {str(path.relative_to(PACKAGE)): len(path.read_text(encoding="utf-8").splitlines())
               for path in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in lengths.items() if n > MODULE_LINES and name not in LONG_MODULES} == {}
    assert {name: lengths.get(name, 0) for name in LONG_MODULES if lengths.get(name, 0) <= MODULE_LINES} == {}


def _code_words(path: Path) -> set[str]:
    """The names, attributes and string constants of a module's code (docstrings left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id.lower())
        elif isinstance(node, ast.Attribute):
            words.add(node.attr.lower())
        elif isinstance(node, ast.arg):
            words.add(node.arg.lower())
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.update(node.value.lower().replace("/", " ").split())
    return words


def test_the_engine_never_mentions_a_dialect():
    """The engine and the replicas return Outcomes; only api/ knows /v1/systemone and /v1/basal bodies."""
    bad = []
    for layer in ("engine", "replicas"):
        for path in sorted((PACKAGE / layer).glob("*.py")):
            words = _code_words(path)
            bad += [f"{path.relative_to(PACKAGE)} says {w}" for w in ("dialect", "systemone") if w in words]
    assert bad == []


def test_no_import_circles():
    """Module-level imports between the product's modules form no cycle (a function-local import for a heavy or
    optional dependency is not a circle)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for imported in _imports(path, package, top_level_only=True):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            # a package imports its own submodules (re-exports); the package itself is not the circle
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1 and not node.startswith(nxt + "."):
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert cycles == []


def test_the_resolver_sees_relative_imports():
    """The checks above can fail: engine/plan.py's own relative imports resolve to their absolute names."""
    path = PACKAGE / "engine" / "plan.py"
    names = _imports(path, _package_of(path))
    assert "basal_local.protocol.errors" in names and "basal_local.engine.packer" in names
