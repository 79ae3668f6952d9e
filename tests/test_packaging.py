"""Packaging and hygiene: the wheel installs under one namespace and finds its data; lint is clean; the product
has no runtime checks that `python -O` would strip."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("basal_local", "backends")


def source_modules(root: Path) -> set[str]:
    """Every product module of the source tree, named as installed (pyproject's package-dir mapping)."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    names = set()
    for package, folder in mapping.items():
        for path in (root / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(root / folder).with_suffix("").parts
            names.add(".".join((package, *parts[:-1]) if parts[-1] == "__init__" else (package, *parts)))
    return names


def wheel_modules(names: list[str]) -> set[str]:
    return {n[:-3].replace("/", ".").removesuffix(".__init__") for n in names if n.endswith(".py")}


def test_wheel_installs_under_one_namespace(tmp_path):
    # build from a copy: a build inside the source tree leaves build/ and *.egg-info behind, and a stale
    # build/ folder can put deleted files into the wheel
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".test-cache", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"))
    # the PEP 517 build_wheel hook of the declared backend, as `pip wheel --no-build-isolation` calls it (pip's
    # own start-up and resolver cost more than the build)
    build = ("import importlib, sys, tomllib; "
             "backend = tomllib.load(open('pyproject.toml', 'rb'))['build-system']['build-backend']; "
             "print(importlib.import_module(backend).build_wheel(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-c", build, str(tmp_path)], cwd=source, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = next(tmp_path.glob("basal_local-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"basal_local"}
    assert "basal_local/backends/torch/llama.py" in names and "basal_local/assets/sample_requests.jsonl" in names
    assert "basal_local/tui/dashboard.tcss" in names and "basal_local/tui/screens/requests.py" in names
    # the MLX backend and the Metal kernel sources (package data) ship too
    assert "basal_local/backends/mlx/llama.py" in names and "basal_local/metal_shaders/__init__.py" in names
    assert {"basal_local/metal_shaders/tree_attention.metal", "basal_local/metal_shaders/rms_norm_residual.metal"} <= set(names)
    # every module of the source ships, so whatever a shipped module imports from the package is there (the
    # torch backend's imports included: importing it here would only add torch's own import time)
    missing = source_modules(source) - wheel_modules(names)
    assert not missing, f"modules missing from the wheel: {sorted(missing)}"
    target = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
    code = ("import basal_local.bench as b, basal_local.tui.app as t, basal_local.server.app; "
            "from importlib import resources; "
            "assert resources.files('basal_local.tui').joinpath(t.DashboardApp.CSS_PATH).is_file(); "
            "assert len(b.sample_requests()) == 48; "
            "assert resources.files('basal_local.assets').joinpath('corpus_pl.txt').is_file(); "
            "from basal_local import metal_shaders as ms; assert 'simd_max' in ms.source('tree_attention.metal'); "
            "import importlib.util as u; assert u.find_spec('backends') is None and u.find_spec('tui') is None; "
            "print(u.find_spec('basal_local.backends.torch').origin); print(basal_local.server.app.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target)},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    origins = out.stdout.split()
    assert len(origins) == 2 and all(o.startswith(str(target)) for o in origins), origins


def test_wheel_modules_name_what_setuptools_installs():
    """The helpers above name a module the way the import system does (else the comparison proves nothing)."""
    assert wheel_modules(["basal_local/__init__.py", "basal_local/backends/torch/llama.py", "x/y.tcss"]) == {
        "basal_local", "basal_local.backends.torch.llama"}
    found = source_modules(ROOT)
    assert {"basal_local", "basal_local.cli", "basal_local.backends", "basal_local.backends.torch.llama",
            "basal_local.tui.screens.requests", "basal_local.metal_shaders"} <= found
    assert not any(name.startswith(("backends", "tui")) for name in found)


def test_ruff_is_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_no_assert_statements_in_the_product():
    """`python -O` strips assert: a runtime check written as one silently disappears. Raise instead."""
    found = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            found += [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(tree)
                      if isinstance(node, ast.Assert)]
    assert not found, "assert statements in the product: " + ", ".join(found)
