"""The fp8 GEMM route (cuda_kernels/fp8.py) on the CPU: row quantization, the dequantized twin, the fast forward.

The golden scales come from math (2 ** ceil(log2(amax / 448)) in float64), not from the bit arithmetic under
test; the CUDA side (Triton quantizer vs this twin bit for bit, torch._scaled_mm vs the twin, invariance on the
GPU) is in tests/test_cuda.py.
"""

from __future__ import annotations

import json
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



def _against(ref, quant, pack):
    """Both backends' readout logits of a pack, the largest difference and the reference's largest logit."""
    a, b = readout_logits(ref, pack), readout_logits(quant, pack)
    return a, b, max(float(np.abs(x - y).max()) for x, y in zip(a, b)), max(float(np.abs(x).max()) for x in a)

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
    a, b, worst, scale = _against(ref, quant, pack_prompts(specs, prefixes))
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


# ---- ModelOpt FP8 checkpoints: their own e4m3 weights and static scales -------------------------------------
def _e4m3_values() -> np.ndarray:
    """Every finite e4m3 value, from the format's definition (1 sign, 4 exponent bits of bias 7, 3 mantissa
    bits; exponent 0 subnormal; S.1111.111 is NaN), ascending, in float64: the golden rounding table."""
    vals = set()
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            vals.update((v, -v))
    return np.array(sorted(vals))


def _round_e4m3(x: np.ndarray) -> np.ndarray:
    """Round to the nearest e4m3 value, ties to the even mantissa, saturating at ±448 (independent of torch)."""
    nonneg = _e4m3_values()
    nonneg = nonneg[nonneg >= 0]  # 0, 2^-9, ...: consecutive values one mantissa step apart
    mag = np.minimum(np.abs(np.asarray(x, dtype=np.float64)), 448.0)
    hi = np.clip(np.searchsorted(nonneg, mag), 1, len(nonneg) - 1)
    lo_v, hi_v = nonneg[hi - 1], nonneg[hi]
    up = np.where((hi_v - mag) == (mag - lo_v), hi % 2 == 0, (hi_v - mag) < (mag - lo_v))  # even index: even mantissa
    return np.copysign(np.where(up, hi_v, lo_v), x)


def test_quant_static_is_round_to_nearest_even_saturated():
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(7, 200, generator=gen) * torch.logspace(-3, 2, 7)[:, None]).to(torch.float16)
    x[0, :6] = torch.tensor([1e4, -1e4, 0.0, 448.0, 464.0, -465.0])
    x[1, :4] = torch.tensor([0.0087890625, 0.01171875, 2.0 ** -10, 3 * 2.0 ** -11])  # ties at mantissa steps
    for scale in (0.02, 1.0, 0.3):
        inv = fp8.inverse_scale(scale)
        assert inv == float(np.float32(1.0) / np.float32(scale))
        q = fp8.quant_static(x, inv)
        want = _round_e4m3(x.float().numpy() * np.float32(inv))  # the f32 product, then e4m3
        assert q.dtype == fp8.FP8 and np.array_equal(q.double().numpy(), want), scale
    # a row's bits are its own
    assert torch.equal(fp8.quant_static(x[3:4], 0.5).view(torch.uint8), fp8.quant_static(x, 0.5)[3:4].view(torch.uint8))


def test_fuse_parts_requantizes_to_the_largest_scale():
    gen = torch.Generator().manual_seed(3)
    parts = [(torch.randn(n, 32, generator=gen) * 100).to(fp8.FP8) for n in (8, 4, 4)]
    same, s, s_in, changed = fp8.fuse_parts(parts, [0.5, 0.5, 0.5], [0.1, 0.1, 0.1])
    assert changed == 0 and s.dim() == 0 and float(s) == 0.5 and s_in == pytest.approx(0.1)
    assert all(a is b for a, b in zip(same, parts))  # equal scales: the bits on disk, untouched
    out, s, s_in, changed = fp8.fuse_parts(parts, [0.5, 0.25, 0.125], [0.1, 0.3, 0.2])
    assert changed == 2 and float(s) == 0.5 and s_in == pytest.approx(0.3)  # one input: the widest scale
    assert out[0] is parts[0]
    for q, new, scale in zip(parts[1:], out[1:], (0.25, 0.125)):
        want = _round_e4m3(q.double().numpy() * scale / 0.5)
        assert np.array_equal(new.double().numpy(), want)


def test_checkpoint_linear_is_the_dequantized_product():
    """The twin GEMM of a checkpoint weight: round(x / s_in) · (q · s_w), summed exactly, one rounding to f16."""
    gen = torch.Generator().manual_seed(4)
    parts = [(torch.randn(n, 64, generator=gen) * 60).to(fp8.FP8) for n in (24, 8)]
    ws, ins = [0.004, 0.002], [0.02, 0.02]
    qs, sw, s_in, _ = fp8.fuse_parts(parts, ws, ins)
    wq = torch.cat(qs)
    store = fp8.Fp8Weights()
    store.add_checkpoint(wq, sw, s_in, fp8.quant_static)
    assert store.has(wq) and store.nbytes() == sw.numel() * 4  # no copy of the weight
    x = (torch.randn(10, 64, generator=gen) * 2).to(torch.float16)
    x[2, 5] = 100.0  # beyond the calibrated range: saturates at 448 * s_in
    y = store.linear(x, wq, None)
    xq = _round_e4m3(x.float().numpy() * np.float32(fp8.inverse_scale(s_in)))
    ref = (xq @ (wq.double().numpy() * max(ws)).T) * np.float64(np.float32(s_in))
    assert y.dtype == torch.float16
    assert np.allclose(y.double().numpy(), ref, rtol=2 ** -10, atol=1e-6)
    assert torch.equal(store.linear(x[4:6], wq, None), y[4:6])


@pytest.fixture(scope="module")
def fp8_port(tmp_path_factory):
    from .test_formats import make_port, reference_dir

    root = tmp_path_factory.mktemp("fp8port")
    port = make_port(root, "fp8")
    return port, reference_dir(port, "fp8", root)


def test_checkpoint_route_close_to_its_dequantized_reference(fp8_port):
    """An FP8 checkpoint on the fp8 route (the twins here; CUDA runs the same arithmetic) keeps the e4m3 weights
    as loaded, and its letter logits stay near the checkpoint's weights dequantized through the f32 reference."""
    port, ref_dir = fp8_port
    md, ref, prefixes = load_backend(ref_dir)
    _, quant, _ = load_backend(port, dtype="fp8")
    assert quant.fwd.gemm == "fp8" and quant.fwd.report["fp8_scales"] == "checkpoint (tensor)"
    layer = quant.layers[0]
    assert all(getattr(layer, f"{n}_weight").dtype == fp8.FP8 for n in ("qkv", "o_proj", "gate_up", "down_proj"))
    slots = ("qkv_weight", "o_proj_weight", "gate_up_weight", "down_proj_weight")
    proj = sum(getattr(L, n).numel() for L in ref.layers for n in slots)
    rest = sum(t.numel() for t in ref._tensors()) - proj
    # one byte per projection weight (no f16 copy), two per other tensor, and the scales
    assert quant.memory()["weights_bytes"] == proj + 2 * rest + quant.fwd.fp8_bytes
    assert quant.fwd.fp8_bytes == sum(s.numel() * 4 for by in quant.fp8_checkpoint for s, _ in by.values())
    assert quant.fp8_requantized > 0  # q/k/v and gate/up scales differ in a random model
    specs = random_specs(md, random.Random(3))
    a, b, worst, scale = _against(ref, quant, pack_prompts(specs, prefixes))
    # e4m3 activations at calibrated static scales (2**-4 relative rounding per layer input, a few values
    # saturating): measured 5.1 % of the largest logit here; f16 alone 0.08 %
    assert worst <= 0.1 * max(1.0, scale), (worst, scale)
    assert np.mean([np.argmax(x) == np.argmax(y) for x, y in zip(a, b)]) >= 0.9
    alone = readout_logits(quant, pack_prompts(specs[-1:], prefixes))[0]
    if quant.device.startswith("cuda"):
        assert np.array_equal(alone, b[-1])
    else:
        assert float(np.abs(alone - b[-1]).max()) <= 1e-6 * max(1.0, scale)


def test_checkpoint_subset_dequantizes_the_rest(fp8_port):
    from basal_local.backends.torch.options import TorchOptions

    port, _ = fp8_port
    _, quant, _ = load_backend(port, dtype="fp8", options=TorchOptions.from_settings(fp8_gemms="gate_up,down"))
    layer = quant.layers[0]
    assert layer.qkv_weight.dtype == torch.float16 and layer.o_proj_weight.dtype == torch.float16
    assert layer.gate_up_weight.dtype == fp8.FP8 and layer.down_proj_weight.dtype == fp8.FP8


def test_checkpoint_refused_on_a_gpu_without_fp8(fp8_port, monkeypatch):
    from basal_local.backends.torch import TorchBackend
    from basal_local.model.formats import detect_format

    port, _ = fp8_port
    backend = TorchBackend("cpu")
    backend.device = "cuda:0"
    backend.format = detect_format(port, json.loads((port / "config.json").read_text()))
    monkeypatch.setattr(fp8, "fp8_supported", lambda device: (False, "NVIDIA A100-SXM4-80GB, compute capability 8.0"))
    with pytest.raises(ValueError) as err:
        backend._check_fp8_gpu()
    assert str(err.value) == ("fp8 needs a GPU with fp8 tensor cores (compute capability 8.9 or later); cuda:0 is "
                              "NVIDIA A100-SXM4-80GB, compute capability 8.0 (--dtype f16 loads this FP8 checkpoint "
                              "dequantized)")


def test_checkpoint_on_the_cpu_runs_dequantized_under_auto(fp8_port):
    port, _ = fp8_port
    _, backend, _ = load_backend(port)  # auto on the CPU: the f32 reference on the dequantized weights
    assert backend.dtype_name == "f32" and backend.fp8_checkpoint is None
    assert backend.layers[0].qkv_weight.dtype == torch.float32


def test_bad_scales_are_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    from basal_local.backends.torch import TorchBackend

    from .test_formats import make_port

    port = make_port(tmp_path, "fp8")
    w = load_file(str(port / "model.safetensors"))
    w["model.layers.1.mlp.down_proj.input_scale"] = torch.tensor(float("nan"))
    save_file(w, str(port / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"^model\.safetensors: tensor 'model\.layers\.1\.mlp\.down_proj\."
                                         r"input_scale' is nan, a scale must be finite and positive$"):
        TorchBackend("cpu").load(port, "fp8")


def test_make_test_model_calibrates_the_input_scales(fp8_port):
    """input_scale = amax / 448 of each projection's input on the calibration prompts (ModelOpt's static
    scales): q/k/v share theirs, gate/up theirs, and no calibrated input saturates."""
    from safetensors.torch import load_file

    port, _ = fp8_port
    w = load_file(str(port / "model.safetensors"))
    s = {k[: -len(".input_scale")]: float(v) for k, v in w.items() if k.endswith(".input_scale")}
    for i in range(2):
        p = f"model.layers.{i}."
        assert s[p + "self_attn.q_proj"] == s[p + "self_attn.k_proj"] == s[p + "self_attn.v_proj"]
        assert s[p + "mlp.gate_proj"] == s[p + "mlp.up_proj"]
        assert all(0 < s[p + n] < 1 for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj",
                                               "mlp.down_proj"))
    assert len(set(s.values())) > 4  # really measured per projection, not one constant


# ---- the same on a GPU (skipped without CUDA; the tests stage of tools/gpu.sh runs them) ---------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_cuda_static_quantizer_matches_its_twin():
    from basal_local.cuda_kernels import triton_kernels

    kernels = triton_kernels()
    g = torch.Generator(device="cuda").manual_seed(5)
    for m, k in ((1, 64), (317, 2048), (70, 14336), (5, 160), (4096, 4096)):
        x = (torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.float16)
        x[0, :4] = torch.tensor([448.0, -1e-7, 6e4, -6e4])
        for scale in (0.02, 0.0071, 1.0):
            inv = fp8.inverse_scale(scale)
            assert torch.equal(kernels.quant_static(x, inv).view(torch.uint8),
                               fp8.quant_static(x, inv).view(torch.uint8)), (m, k, scale)


@pytest.fixture(scope="module")
def small_fp8_port(tmp_path_factory):
    from .test_formats import make_port, reference_dir

    root = tmp_path_factory.mktemp("fp8small")
    port = make_port(root, "fp8", preset="small")
    return port, reference_dir(port, "fp8", root)


@cuda
def test_cuda_checkpoint_route_bitwise_invariant_and_close(small_fp8_port):
    """auto on CUDA runs an FP8 checkpoint on its own e4m3 GEMMs (the Triton static quantizer, _scaled_mm at the
    verified row counts): a prompt alone, amid others and eager gives the same bits, and the letter logits stay
    within the twin's envelope of the dequantized f32 reference."""
    from basal_local.engine.packer import PromptSpec

    port, ref_dir = small_fp8_port
    md, backend, prefixes = load_backend(port, device="cuda", dtype="auto")
    assert backend.dtype_name == "fp8" and backend.fwd.gemm == "fp8" and backend.graphs is not None
    report = backend.fwd.report
    assert report["fp8_quant"] == "triton static", report.get("fp8_quant_error")
    assert report["fp8_mm"] == "scaled_mm_cuda"
    assert backend.layers[0].qkv_weight.dtype == fp8.FP8
    rng = random.Random(11)
    specs = [s for seed in range(6) for s in random_specs(md, random.Random(seed))]
    for trial in range(6):
        target = rng.choice(specs)
        alone = readout_logits(backend, pack_prompts([target], prefixes))[0]
        mixed = readout_logits(backend, pack_prompts(rng.sample(specs, rng.randint(3, 40)) + [target], prefixes))[-1]
        eager = readout_logits(backend, pack_prompts([PromptSpec(target.token_ids, target.lang, target.letter_ids)],
                                                     prefixes))[0]
        assert np.array_equal(alone, mixed) and np.array_equal(alone, eager), (trial, float(np.abs(alone - mixed).max()))
    _, ref, _ = load_backend(ref_dir, device="cpu", dtype="f32")
    a, b, worst, scale = _against(ref, backend, pack_prompts(specs[:12], prefixes))
    assert worst <= 0.1 * max(1.0, scale), (worst, scale)
