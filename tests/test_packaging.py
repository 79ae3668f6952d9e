"""Packaging and hygiene: the wheel installs under one namespace and finds its data; lint is clean; the product
has no runtime checks that `python -O` would strip."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("basal_local", "backends")


def test_wheel_installs_under_one_namespace(tmp_path):
    # build from a copy: a build inside the source tree leaves build/ and *.egg-info behind, and a stale
    # build/ folder can put deleted files into the wheel
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".test-cache", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("basal_local-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"basal_local"}
    assert "basal_local/backends/torch/llama.py" in names and "basal_local/assets/sample_requests.jsonl" in names
    assert "basal_local/tui/dashboard.tcss" in names and "basal_local/tui/screens/requests.py" in names
    # the MLX backend and the Metal kernel sources (package data) ship too
    assert "basal_local/backends/mlx/llama.py" in names and "basal_local/metal_shaders/__init__.py" in names
    assert {"basal_local/metal_shaders/tree_attention.metal", "basal_local/metal_shaders/rms_norm_residual.metal"} <= set(names)
    target = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
    code = ("import basal_local.backends.torch, basal_local.bench as b, basal_local.tui.app as t; "
            "from importlib import resources; "
            "assert resources.files('basal_local.tui').joinpath(t.DashboardApp.CSS_PATH).is_file(); "
            "assert len(b.sample_requests()) == 48; "
            "assert resources.files('basal_local.assets').joinpath('corpus_pl.txt').is_file(); "
            "from basal_local import metal_shaders as ms; assert 'simd_max' in ms.source('tree_attention.metal'); "
            "import importlib.util as u; assert u.find_spec('backends') is None and u.find_spec('tui') is None; "
            "print(basal_local.backends.torch.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target)},
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(target))


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
