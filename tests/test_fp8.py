"""The fp8 GEMM route (cuda_kernels/fp8.py) on the CPU: row quantization, the dequantized twin, the fast forward.

The golden scales come from math (2 ** ceil(log2(amax / 448)) in float64), not from the bit arithmetic under
test; the CUDA side (Triton quantizer vs this twin bit for bit, torch._scaled_mm vs the twin, invariance on the
GPU) is in tests/test_cuda.py.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from basal_local.cuda_kernels import fp8
from basal_local.engine.packer import pack_prompts

from .conftest import load_backend, readout_logits
from .test_packer import random_specs


def _golden_scale(row: torch.Tensor) -> float:
    amax = float(row.double().abs().max())
    if amax == 0.0:
        return 1.0
    e = math.ceil(math.log2(amax / 448.0))
    while amax / 2.0 ** e > 448.0:  # guard against log2 rounding at exact powers
        e += 1
    while amax / 2.0 ** (e - 1) <= 448.0:
        e -= 1
    return 2.0 ** e


def test_quant_rows_power_of_two_scales_and_row_independence():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 96, generator=gen) * torch.logspace(-4, 3, 9)[:, None]).to(torch.float16)
    x[3] = 0.0
    x[5, 7] = 448.0  # amax exactly on the fp8 maximum: scale 1
    x[6, 0] = 1.75 * 2 ** 3  # m == 1.75 stays at 2**(E-8); 1.75 + ulp moves up
    q, s = fp8.quant_rows(x)
    assert q.dtype == fp8.FP8 and s.shape == (9, 1) and s.dtype == torch.float32
    for i in range(9):
        assert float(s[i, 0]) == _golden_scale(x[i].float()), i
    qf = q.float()
    assert float(qf.abs().max()) <= 448.0
    assert torch.all(qf[3] == 0) and float(s[3, 0]) == 1.0
    # each nonzero row uses the top octave of fp8's range, and the round trip is within e4m3's half ulp (2**-4)
    # relative to the element, or under the smallest subnormal step for tiny elements
    for i in (0, 1, 2, 4, 5, 6, 7, 8):
        assert float(qf[i].abs().max()) > 224.0
        err = (qf[i] * s[i] - x[i].float()).abs()
        bound = torch.maximum(x[i].float().abs() * 2 ** -4, s[i] * 2.0 ** -10)
        assert bool((err <= bound).all()), i
    # a row's bits do not depend on the rows beside it
    q1, s1 = fp8.quant_rows(x[4:5])
    assert torch.equal(q1.view(torch.uint8), q[4:5].view(torch.uint8)) and torch.equal(s1, s[4:5])


def test_fp8_linear_twin_close_to_f32_and_row_invariant():
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(48, 64, generator=gen) * 0.05).to(torch.float16)
    bias = torch.randn(48, generator=gen).to(torch.float16)
    x = torch.randn(20, 64, generator=gen).to(torch.float16)
    store = fp8.Fp8Weights()
    store.add(w)
    assert store.nbytes() == 48 * 64 + 48 * 4
    y = store.linear(x, w, bias)
    ref = x.float() @ w.float().T + bias.float()
    assert y.dtype == torch.float16
    rel = float((y.float() - ref).norm() / ref.norm())
    assert 1e-4 < rel <= 0.05, rel  # really quantized, and still close
    assert torch.equal(store.linear(x[7:9], w, bias), y[7:9])


def test_fp8_fast_forward_on_twins_close_to_reference(tiny_model):
    """dtype fp8 on the tree path (here the twins on the CPU) gives letter logits near the f32 reference and
    the same bits for a prompt alone and in a batch."""
    md, ref, prefixes = load_backend(tiny_model)
    _, quant, _ = load_backend(tiny_model, dtype="fp8")
    assert quant.fwd.gemm == "fp8" and quant.dtype == torch.float16 and quant.fwd.fp8_bytes > 0
    specs = random_specs(md, random.Random(3))
    pack = pack_prompts(specs, prefixes)
    a, b = readout_logits(ref, pack), readout_logits(quant, pack)
    worst = max(float(np.abs(x - y).max()) for x, y in zip(a, b))
    scale = max(float(np.abs(x).max()) for x in a)
    # fp8's 2**-4 relative rounding through every layer of a random model: ~5-8 % of the largest logit here
    # (f16 on the same path: ~0.07 %); the decisions stay
    assert worst <= 0.1 * max(1.0, scale), (worst, scale)
    assert all(np.argmax(x) == np.argmax(y) for x, y in zip(a, b))
    alone = readout_logits(quant, pack_prompts(specs[-1:], prefixes))[0]
    if quant.device.startswith("cuda"):
        assert np.array_equal(alone, b[-1])  # the numerics contract: bitwise on CUDA
    else:
        # on the CPU the contract is 1e-6: torch's CPU GEMMs may pick other kernels for other row counts (AVX-512)
        assert float(np.abs(alone - b[-1]).max()) <= 1e-6 * max(1.0, scale)


def test_fp8_refused_where_it_cannot_run(tiny_model):
    from basal_local.backends.select import check_dtype

    with pytest.raises(ValueError, match="NVIDIA"):
        check_dtype("torch", "cpu", "fp8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="NVIDIA"):
            check_dtype("auto", "auto", "fp8")


def test_fp8_gemms_subset_keeps_the_rest_f16(tiny_model, monkeypatch):
    """The fp8_gemms option narrows the route: only those projections get float8 copies; the others run f16 at
    their own verified sizes, and the forward keeps its decisions."""
    from basal_local.backends.torch.options import TorchOptions

    md, ref, prefixes = load_backend(tiny_model)
    _, quant, _ = load_backend(tiny_model, dtype="fp8", options=TorchOptions.from_settings(fp8_gemms="gate_up,down"))
    cfg = md.config
    per_layer = 3 * cfg.intermediate_size * cfg.hidden_size + 2 * cfg.intermediate_size * 4 + cfg.hidden_size * 4
    assert quant.fwd.fp8_bytes == cfg.num_hidden_layers * per_layer
    assert quant.fwd.report["fp8_gemms"] == "gate_up,down"
    assert any(k.endswith("-f16") for k in quant.fwd.report)
    specs = random_specs(md, random.Random(4))
    pack = pack_prompts(specs, prefixes)
    a, b = readout_logits(ref, pack), readout_logits(quant, pack)
    assert all(np.argmax(x) == np.argmax(y) for x, y in zip(a, b))
    # bitwise row invariance is the GPU's contract (test_cuda.py); the CPU's f16 GEMMs only come close
    alone = readout_logits(quant, pack_prompts(specs[:1], prefixes))[0]
    assert float(np.abs(alone - b[0]).max()) <= 1e-5
    with pytest.raises(ValueError, match="unknown projection 'gate'"):
        TorchOptions.from_settings(fp8_gemms="gate,down")


def test_cli_bench_fp8_on_cpu_is_a_user_error(tiny_model, capsys):
    from basal_local.cli import main

    assert main(["bench", "--model", str(tiny_model), "--device", "cpu", "--dtype", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "fp8 runs on NVIDIA GPUs only" in err and "Traceback" not in err
