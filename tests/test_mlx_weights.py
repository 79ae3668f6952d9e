"""MLX quantized weights (q8/q4) against f32 on the sample set, and model weights written without torch.

Split from tests/test_mlx.py so that the MLX files run on different test workers (`--dist loadfile`).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'mlx[cpu]' on Linux)")

from basal_local.engine.packer import pack_prompts  # noqa: E402

from .conftest import load_backend, readout_logits  # noqa: E402
from .test_mlx import load_mlx  # noqa: E402
from .test_packer import random_specs  # noqa: E402


# ---- quantized weights --------------------------------------------------------------------------------------
def _decisions(backend, md, every: int = 1):
    """(decision, calibrated probabilities) for every `every`-th question of the sample set, via the real engine
    path."""
    from basal_local.api.answers import response_body
    from basal_local.api.systemone import validate_systemone
    from basal_local.bench import single_question_requests
    from basal_local.engine.engine import EngineSettings, ModelEngine
    from basal_local.engine.gate import DeviceGate
    from basal_local.telemetry import Telemetry

    # batches of at most 512 tokens: the twin's dense [T, S] attention costs T x S, and MLX on a CPU runs it
    # slowly (reference BLAS in the Linux wheel); f32 and quantized see the same batches, which is the point
    engine = ModelEngine(md, backend, DeviceGate(), Telemetry(), EngineSettings(long_tokens=0, max_batch_tokens=512))
    engine.start()
    try:
        jobs = [engine.submit(engine.plan(validate_systemone(body, md.name)))
                for body in single_question_requests(md.name)[::every]]
        out = []
        for job in jobs:
            (ans,) = response_body(job.result(timeout=300), "systemone", 0.0)["answers"].values()
            probs = ({"true": ans["noul"], "false": 1.0 - ans["noul"]} if ans["type"] == "noul"
                     else ans["probabilities"])
            out.append((max(probs, key=probs.get), probs))
        return out
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def model64(tmp_path_factory):
    from basal_local.model.testmodel import make_test_model

    return make_test_model(tmp_path_factory.mktemp("tiny64"), preset="tiny64", seed=3)


@pytest.mark.parametrize("dtype,share,max_dp,every", [
    ("q8", 0.98, 0.02, 4),  # every 4th sample question (17): the same checks in a quarter of the time
    pytest.param("q8", 0.98, 0.02, 1, marks=pytest.mark.slow),  # the whole sample set: the figure
    pytest.param("q4", 0.85, 0.2, 1, marks=pytest.mark.slow)])
def test_quantized_agreement_with_f32_on_the_sample_set(model64, tmp_path, monkeypatch, dtype, share, max_dp, every):
    """Figures of the issue: same decision share, max and median |Δp_cal| vs f32 (printed with -s)."""
    from basal_local.backends.mlx.quantize import Quantized, cache_dir
    from basal_local.model import load_model_dir

    monkeypatch.setenv("BASAL_LOCAL_HOME", str(tmp_path / "home"))
    md = load_model_dir(model64)
    before = sorted(p.name for p in model64.iterdir())
    ref = _decisions(load_mlx(model64, "f32"), md, every)
    quantized = load_mlx(model64, dtype)
    assert all(isinstance(getattr(layer, f"{name}_weight"), Quantized) for layer in quantized.layers
               for name in ("qkv", "o_proj", "gate_up", "down_proj"))
    got = _decisions(quantized, md, every)
    same = np.mean([a[0] == b[0] for a, b in zip(got, ref)])
    deltas = np.array([abs(a[1][k] - b[1][k]) for a, b in zip(got, ref) for k in b[1]])
    print(f"\n{dtype} vs f32 on {len(ref)} sample questions (tiny64 model): same decision {same:.1%}, "
          f"max |dp_cal| {deltas.max():.4f}, median {np.median(deltas):.5f}")
    assert same >= share and deltas.max() <= max_dp and 0 < np.median(deltas) < max_dp
    # converted once into the user cache, never into the model directory
    cached = list(cache_dir().glob(f"*-{dtype}-g64.safetensors"))
    assert len(cached) == 1 and sorted(p.name for p in model64.iterdir()) == before
    stamp = cached[0].stat().st_mtime_ns
    again = load_mlx(model64, dtype)
    assert cached[0].stat().st_mtime_ns == stamp
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    batch = pack_prompts(random_specs(md, random.Random(3)), prefixes).batches[0]
    assert np.array_equal(again.forward(batch), quantized.forward(batch))


def test_tiny_model_quantizes_what_divides_by_64(tiny_model, tmp_path, monkeypatch):
    """tiny's down_proj has 160 inputs (not a multiple of 64): it stays dense, the rest is q8."""
    from basal_local.backends.mlx.quantize import Quantized

    monkeypatch.setenv("BASAL_LOCAL_HOME", str(tmp_path / "home"))
    backend = load_mlx(tiny_model, "q8")
    layer = backend.layers[0]
    assert isinstance(layer.qkv_weight, Quantized) and isinstance(layer.gate_up_weight, Quantized)
    assert not isinstance(layer.down_proj_weight, Quantized)
    assert backend.memory()["weights_bytes"] > 0


# ---- weights without torch ----------------------------------------------------------------------------------
def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    from basal_local.model.testmodel import bf16_bits

    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 10000),
                             np.array([0.0, -0.0, 1.0, 3.0e38, -3.4e38, np.inf, -np.inf, 1.00390625, 1.01171875],
                                      dtype=np.float32)])
    ref = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bf16_bits(values), ref)


def test_numpy_weights_make_a_loadable_deterministic_model(tmp_path):
    from safetensors import safe_open

    from basal_local.model import load_model_dir
    from basal_local.model.testmodel import make_test_model

    a = make_test_model(tmp_path / "a", preset="tiny", seed=5, weights="numpy")
    b = make_test_model(tmp_path / "b", preset="tiny", seed=5, weights="numpy")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    md = load_model_dir(a, check_weights=True)
    with safe_open(str(a / "model.safetensors"), framework="numpy") as fh:
        assert set(fh.keys()) == set(md.config.weight_shapes())
    backend = load_mlx(a)
    pack = pack_prompts(random_specs(md, random.Random(1)), None)
    logits = readout_logits(backend, pack)
    assert all(np.isfinite(x).all() for x in logits)
    if pytest.importorskip("torch"):
        _, torch_backend, _ = load_backend(a)
        assert max(float(np.abs(x - y).max()) for x, y in zip(logits, readout_logits(torch_backend, pack))) <= 1e-4
