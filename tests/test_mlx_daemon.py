"""The daemon with `--backend mlx` on the CPU against `--backend torch`; backend selection; a torch-less install.

Split from tests/test_mlx.py so that the MLX files run on different test workers (`--dist loadfile`).
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'mlx[cpu]' on Linux)")

from .conftest import Daemon, http  # noqa: E402

# ---- the daemon with --backend mlx ------------------------------------------------------------------------
BODY = {"model": "basal-test-tiny", "state": {"zgłoszenie": "Paczka dotarła uszkodzona", "kwota": 129.99},
        "questions": {"kind": {"type": "choice", "criteria": {"damage": "Uszkodzenie", "late": "Opóźnienie"}},
                      "urgent": {"type": "noul", "instructions": "Is it urgent?"},
                      "level": {"type": "score", "instructions": "Priorytet?", "criteria": ["niski", "wysoki", "x"]}}}


def _numbers(answer: dict) -> list[float]:
    """Every probability-like number of an answer, in a fixed order."""
    out = []
    for ans in answer["answers"].values():
        for key in sorted(ans):
            value = ans[key]
            if isinstance(value, float):
                out.append(value)
            elif isinstance(value, dict):
                out.extend(v for _, v in sorted(value.items()) if isinstance(v, float))
    return out


def _compare(mlx_url: str, torch_url: str) -> None:
    for dialect in ("systemone", "basal"):
        s1, _, ours = http("POST", f"{mlx_url}/v1/{dialect}", BODY)
        s2, _, ref = http("POST", f"{torch_url}/v1/{dialect}", BODY)
        assert s1 == s2 == 200, (ours, ref)
        a, b = _numbers(ours), _numbers(ref)
        assert len(a) == len(b) and len(a) >= 3
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-4, dialect


@pytest.fixture(scope="module")
def torch_daemon(tiny_model):
    """Started, not awaited: each test starts its MLX daemon first and then waits for both, so the two load
    side by side (a busy shared 2-core machine starts two daemons slowly: generous waits)."""
    d = Daemon(["--model", str(tiny_model), "--backend", "torch", "--device", "cpu"])
    try:
        yield d
    finally:
        d.stop()  # also when it never became ready: no orphan daemon


def test_daemon_mlx_cpu_equals_torch_cpu_on_both_endpoints(torch_daemon, tiny_model):
    daemon = torch_daemon
    d = Daemon(["--model", str(tiny_model), "--backend", "mlx", "--device", "cpu"])
    try:
        d.wait_ready(timeout=300)
        daemon.wait_ready(timeout=300)
        status, _, health = http("GET", d.url + "/health")
        assert status == 200 and health["backend"] == "mlx" and health["device"] == "cpu"
        assert health["dtype"] == "f32"
        _compare(d.url, daemon.url)
    finally:
        d.stop()


def test_long_lane_with_mlx(torch_daemon, tiny_model):
    d = Daemon(["--model", str(tiny_model), "--backend", "mlx", "--device", "cpu", "--long-tokens", "40"])
    try:
        d.wait_ready(timeout=300)
        torch_daemon.wait_ready(timeout=300)
        _compare(d.url, torch_daemon.url)  # the request is above 40 tokens: the long lane answers it
        _, _, stats = http("GET", d.url + "/api/stats")
        assert {b["lane"] for b in stats["batches"]} == {"long"}
    finally:
        d.stop()


def test_mlx_missing_is_one_clear_line(tiny_model, monkeypatch):
    import basal_local.backends.select as select

    monkeypatch.setattr(select, "mlx_importable", lambda: False)
    with pytest.raises(ValueError) as err:
        select.make_backend("mlx", "cpu")
    assert "pip install" in str(err.value) and "\n" not in str(err.value)


def test_auto_selection_rules(monkeypatch):
    import basal_local.backends.select as select

    monkeypatch.setattr(select, "mlx_available", lambda: True)
    assert select.resolve_backend("auto", "auto") == "mlx"  # an Apple Silicon Mac with Metal
    assert select.resolve_backend("auto", "cuda") == "torch"
    monkeypatch.setattr(select, "mlx_available", lambda: False)
    assert select.resolve_backend("auto", "auto") == "torch"  # torch is installed here
    assert select.resolve_backend("mlx", "cpu") == "mlx"
    with pytest.raises(ValueError, match="unknown backend"):
        select.resolve_backend("tpu", "auto")
    backend = select.make_backend("mlx", "cpu")
    assert backend.name == "mlx" and backend.device == "cpu" and backend.attention == "sdpa"
    if not mx.metal.is_available():
        with pytest.raises(ValueError, match="Metal"):
            select.make_backend("mlx", "mps")


def test_without_torch_make_test_model_and_auto_backend_run_on_mlx(tmp_path):
    """A torch-less install (Apple Silicon): make-test-model writes weights with NumPy, auto picks MLX."""
    import subprocess
    import sys

    block = "import sys; sys.modules['torch'] = None; "
    out = subprocess.run([sys.executable, "-c", block + "from basal_local.cli import main; sys.exit(main(sys.argv[1:]))",
                          "make-test-model", str(tmp_path / "m"), "--preset", "tiny"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    code = block + (
        "import numpy as np; from basal_local.backends.select import make_backend; "
        "from basal_local.backends.base import PackedBatch; "
        "b = make_backend('auto', 'cpu'); b.load(sys.argv[1], 'auto'); "
        "x = b.forward(PackedBatch.single([1, 3, 50, 60, 70])); "
        "print(b.name, b.device, x.shape, bool(np.isfinite(x).all()))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["mlx", "cpu", "(1,", "1)", "True"]
