"""Packaging and hygiene: the wheel installs under one namespace and finds its data; lint is clean."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_installs_under_one_namespace(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("basal_local-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"basal_local"}
    assert "basal_local/backends/torch/llama.py" in names and "basal_local/assets/sample_requests.jsonl" in names
    # the MLX backend and the Metal kernel sources (package data) ship too
    assert "basal_local/backends/mlx/llama.py" in names and "basal_local/metal_shaders/__init__.py" in names
    assert {"basal_local/metal_shaders/tree_attention.metal", "basal_local/metal_shaders/rms_norm_residual.metal"} <= set(names)
    target = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
    code = ("import basal_local.backends.torch, basal_local.bench as b; "
            "from importlib import resources; "
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


def test_tiny_test_model_loads_fast(tiny_model):
    import time

    from basal_local.backends.torch import TorchBackend
    from basal_local.model import load_model_dir

    t = time.perf_counter()
    md = load_model_dir(tiny_model)
    TorchBackend("cpu").load(md.path, "f32")
    assert time.perf_counter() - t < 2.0
