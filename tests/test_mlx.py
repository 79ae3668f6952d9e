"""The MLX backend on the CPU (`mlx[cpu]`) against the torch f32 reference; Metal kernels against their twins.

Everything here but the Metal tests runs on Linux; those skip with a reason where Metal is absent. The daemon
with `--backend mlx` is in tests/test_mlx_daemon.py, quantized and torch-less weights in tests/test_mlx_weights.py
(separate files run on separate test workers).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'mlx[cpu]' on Linux)")

from basal_local.engine.packer import pack_prompts  # noqa: E402

from .conftest import load_backend, readout_logits  # noqa: E402
from .test_packer import random_specs  # noqa: E402

METAL = bool(mx.metal.is_available())
needs_metal = pytest.mark.skipif(not METAL, reason="Metal is not available (the kernels run on Apple GPUs only)")


def load_mlx(model_dir, dtype: str = "f32", device: str = "cpu", attention: str = "auto"):
    from basal_local.backends.mlx import MLXBackend
    from basal_local.model import load_model_dir

    md = load_model_dir(model_dir)
    backend = MLXBackend(device, attention)
    backend.load(model_dir, dtype)
    for lang in ("pl", "en"):
        backend.add_prefix(lang, md.tokenizer.template_prefix(lang))
    return backend


@pytest.fixture(scope="module")
def tiny_pair(tiny_model):
    md, torch_backend, prefixes = load_backend(tiny_model)
    return md, torch_backend, load_mlx(tiny_model), prefixes


@pytest.mark.parametrize("fixture", ["tiny_model", "small_model"])
def test_letter_logits_match_torch_f32(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    md, torch_backend, prefixes = load_backend(model_dir)
    backend = load_mlx(model_dir)
    assert backend.name == "mlx" and backend.device == "cpu"
    worst = 0.0
    for seed in range(3):
        pack = pack_prompts(random_specs(md, random.Random(seed)), prefixes, max_forward_tokens=400)
        ours, ref = readout_logits(backend, pack), readout_logits(torch_backend, pack)
        assert all(a.dtype == np.float32 for a in ours)
        worst = max(worst, max(float(np.abs(a - b).max()) for a, b in zip(ours, ref)))
    assert worst <= 1e-4, worst


@pytest.mark.parametrize("seed", range(3))
def test_tree_packing_equals_separate_forwards(tiny_pair, seed):
    md, _, backend, prefixes = tiny_pair
    specs = random_specs(md, random.Random(seed))
    separate = [readout_logits(backend, pack_prompts([s]))[0] for s in specs]
    for use_prefix, forward_limit in ((True, 8192), (False, 8192), (True, 300)):
        pack = pack_prompts(specs, prefixes if use_prefix else None, max_forward_tokens=forward_limit)
        worst = max(float(np.abs(a - b).max()) for a, b in zip(readout_logits(backend, pack), separate))
        assert worst <= 1e-5, (use_prefix, forward_limit, worst)


def test_subtree_groups_equal_the_dense_mask(tiny_model):
    """Independent subtrees attending alone (the twin's default) give the dense-mask result, on random q/k/v of
    real packed batches, with and without cached prefixes."""
    from basal_local.backends.mlx.tree_attention import TwinAttention
    from basal_local.model import load_model_dir

    md = load_model_dir(tiny_model)
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    specs = [s for seed in range(4) for s in random_specs(md, random.Random(seed))]
    rng = np.random.default_rng(0)
    for use_prefix in (True, False):
        batch = pack_prompts(specs, prefixes if use_prefix else None).batches[0]
        lengths = [len(prefixes[name]) for name in batch.prefixes]
        split, dense = TwinAttention(batch, lengths), TwinAttention(batch, lengths, segment=False)
        assert split.grouped and not dense.grouped
        n, s = batch.num_tokens, sum(lengths) + batch.num_tokens
        q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32))
                   for shape in ((n, 4, 16), (s, 2, 16), (s, 2, 16)))
        assert float(mx.abs(split(q, k, v) - dense(q, k, v)).max()) <= 1e-5


def test_forward_steps_equals_forward(tiny_pair):
    md, _, backend, prefixes = tiny_pair
    pack = pack_prompts(random_specs(md, random.Random(7)), prefixes)
    for batch in pack.batches:
        steps = list(backend.forward_steps(batch))
        assert steps[:-1] == [None] * (len(backend.layers) - 1)
        assert np.array_equal(steps[-1], backend.forward(batch))


def test_final_hidden_matches_transformers(tiny_model, tiny_pair):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from .hf_reference import HFModel

    md, _, backend, _ = tiny_pair
    ids = np.array(md.tokenizer.encode("Paczka dotarła uszkodzona, proszę o zwrot."), dtype=np.int64)
    ref = HFModel(tiny_model).hidden(ids.tolist())
    got = backend.final_hidden(ids)
    assert got.dtype == np.float32 and got.shape == (len(ids), md.config.hidden_size)
    assert float(np.abs(got - ref).max()) <= 1e-4


def test_strict_load_names_the_tensor(tiny_model, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    from basal_local.backends.mlx import MLXBackend

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model, model_dir)
    mx_weights = mx.load(str(tiny_model / "model.safetensors"))
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx_weights.items()}
    weights["model.extra.weight"] = np.zeros(3, dtype=np.float32)
    save_file(weights, str(model_dir / "model.safetensors"))
    assert "model.extra.weight" in load_file(str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="unknown tensor 'model.extra.weight'"):
        MLXBackend("cpu").load(model_dir, "f32")


def test_ops_are_chosen_once_kernels_on_metal_twins_elsewhere(tiny_pair, caplog):
    """The CPU runs the twins; asking for the Metal kernel there is refused in one sentence; a kernel that fails
    its warm-up check against the twin (here: no Metal device to run it on) gives way to the twin with a warning;
    the projections are Dense or Quantized matmuls chosen at load."""
    import logging

    from basal_local.backends.mlx import ops
    from basal_local.backends.mlx.quantize import Quantized

    _, _, backend, _ = tiny_pair
    assert backend.ops.describe() == {"attention": "sdpa", "norm": "twin"} and backend.attention == "sdpa"
    assert backend.ops.tree_attention is ops.TwinAttention and backend.ops.add_rms_norm is ops.add_rms_norm
    assert backend.describe()["linear"] == "dense"
    assert all(isinstance(getattr(layer, f"{name}_weight"), ops.Dense | Quantized)
               for layer in backend.layers for name in ("qkv", "o_proj", "gate_up", "down_proj"))
    with pytest.raises(ValueError, match=r"^the Metal tree-attention kernel needs --device mps$"):
        ops.choose("cpu", "metal")
    with pytest.raises(ValueError, match=r"^unknown attention 'flex' for the MLX backend \(sdpa or metal\)$"):
        ops.choose("cpu", "flex")
    assert ops.choose("metal", "auto").describe() == {"attention": "metal", "norm": "metal"}
    if not METAL:
        with caplog.at_level(logging.WARNING):
            fallback = ops.checked(ops.Ops("metal", "metal"), 4, 2, 16, 64, mx.float32)
        assert fallback.describe() == {"attention": "sdpa", "norm": "twin"}
        assert "tree-attention kernel not used" in caplog.text and "RMSNorm kernel not used" in caplog.text


def test_add_rms_norm_twin_is_the_residual_sum_then_rms_norm():
    """The twin's contract, against NumPy in float64: (w * (x + d) / rms(x + d), x + d)."""
    from basal_local.backends.mlx.ops import add_rms_norm

    rng = np.random.default_rng(3)
    x, d = rng.standard_normal((5, 64)).astype(np.float32), rng.standard_normal((5, 64)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    out, summed = add_rms_norm(mx.array(x), mx.array(d), mx.array(w), 1e-6)
    s = x.astype(np.float64) + d
    ref = w * s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-6)
    assert np.array_equal(np.array(summed), x + d) and np.abs(np.array(out) - ref).max() <= 1e-5
    alone, _ = add_rms_norm(mx.array(x), None, mx.array(w), 1e-6)
    assert np.abs(np.array(alone) - w * x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
                  ).max() <= 1e-5


# ---- Metal kernels (Apple GPUs) -------------------------------------------------------------------------------
def test_metal_sources_ship_and_build_kernel_objects():
    """Runs everywhere: the .metal bodies load from the package and name every input the Python side passes."""
    from basal_local import metal_shaders as ms

    for name, inputs, outputs in (("tree_attention.metal", ms.TREE_ATTENTION_INPUTS, ["out"]),
                                  ("rms_norm_residual.metal", ms.RMS_NORM_RESIDUAL_INPUTS, ["out", "summed"])):
        text = ms.source(name)
        assert text.count("{") == text.count("}") and text.count("(") == text.count(")")
        for ident in inputs + outputs:
            assert f"{ident}[" in text or f"{ident} +" in text, (name, ident)
    assert ms.tree_attention_kernel() is not None and ms.rms_norm_residual_kernel() is not None


def _emulate_tree_attention_kernel(q, keys, values, q_block, q_key, q_pos, ranges, n_ranges):
    """tree_attention.metal step by step in NumPy, the 32 lanes of a SIMD group as a vector (f32)."""
    tq, hq, d = q.shape
    hkv = keys.shape[1]
    lanes = np.arange(32)
    out = np.zeros((tq, hq, d), dtype=np.float32)
    for t in range(tq):
        blk = q_block[t]
        for h in range(hq):
            hk = h // (hq // hkv)
            m, total, acc = np.float32(-np.inf), np.float32(0), np.zeros(d, dtype=np.float32)
            for p0 in range(0, q_pos[t] + 1, 32):
                p = p0 + lanes
                key = np.full(32, -1)
                for r in range(n_ranges[blk]):
                    k0, k1, ps = ranges[blk, r]
                    inside = (p >= ps) & (p < ps + (k1 - k0))
                    key = np.where(inside, k0 + (p - ps), key)
                key = np.where((p > q_pos[t]) | (key > q_key[t]), -1, key)
                s = np.where(key >= 0, (keys[np.maximum(key, 0), hk] @ q[t, h]) / np.float32(np.sqrt(d)), -np.inf)
                if s.max() == -np.inf:
                    continue
                m_new = max(m, s.max())
                corr = np.exp(m - m_new)
                e = np.where(key >= 0, np.exp(s - m_new), 0).astype(np.float32)
                total = total * corr + e.sum()
                acc = acc * corr + (e[key >= 0, None] * values[key[key >= 0], hk]).sum(0)
                m = m_new
            out[t, h] = acc / total
    return out


def test_tree_attention_kernel_algorithm_matches_twin_on_cpu():
    """Runs everywhere: the kernel's key ranges and tiled online softmax (emulated) equal the dense-mask twin."""
    from basal_local.backends.mlx.tree_attention import TwinAttention, block_key_ranges, random_tree_batch

    rng = np.random.default_rng(1)
    for prefix_lengths in ([37, 21], []):
        batch = random_tree_batch(rng, prefix_lengths, n_roots=3, children=2)
        s = sum(prefix_lengths) + batch.num_tokens
        q = rng.standard_normal((batch.num_tokens, 4, 16)).astype(np.float32)
        k = rng.standard_normal((s, 2, 16)).astype(np.float32)
        v = rng.standard_normal((s, 2, 16)).astype(np.float32)
        ranges, n_ranges = block_key_ranges(batch, prefix_lengths)
        emulated = _emulate_tree_attention_kernel(q, k, v, batch.token_block, sum(prefix_lengths)
                                                  + np.arange(batch.num_tokens), batch.positions, ranges, n_ranges)
        twin = np.array(TwinAttention(batch, prefix_lengths)(mx.array(q), mx.array(k), mx.array(v)))
        assert np.abs(emulated - twin).max() <= 1e-5


@needs_metal
@pytest.mark.parametrize("heads,kv,dim", [(4, 2, 16), (16, 2, 128), (4, 1, 32)])
def test_metal_tree_attention_matches_twin(heads, kv, dim):
    from basal_local.backends.mlx.tree_attention import MetalAttention, TwinAttention, random_tree_batch

    rng = np.random.default_rng(heads * dim)
    for prefix_lengths in ([37, 21], []):
        batch = random_tree_batch(rng, prefix_lengths, n_roots=4, children=3)
        s = sum(prefix_lengths) + batch.num_tokens
        q = mx.array(rng.standard_normal((batch.num_tokens, heads, dim)).astype(np.float32))
        k = mx.array(rng.standard_normal((s, kv, dim)).astype(np.float32))
        v = mx.array(rng.standard_normal((s, kv, dim)).astype(np.float32))
        with mx.stream(mx.gpu):
            kernel = np.array(MetalAttention(batch, prefix_lengths)(q, k, v))
            twin = np.array(TwinAttention(batch, prefix_lengths)(q, k, v))
            rows = np.array([0, batch.num_tokens // 2, batch.num_tokens - 1])
            kernel_rows = np.array(MetalAttention(batch, prefix_lengths)(q, k, v, rows=rows))
        diff = np.abs(kernel - twin)
        print(f"\nkernel vs twin H={heads} Hkv={kv} D={dim}: max {diff.max():.3g}, mean {diff.mean():.3g}")
        assert diff.max() <= 1e-4 and np.array_equal(kernel_rows, kernel[rows])


@needs_metal
def test_metal_tree_attention_is_bitwise_invariant_alone_vs_packed():
    """Each prompt's attention rows are bit-identical alone and packed with others (position-aligned tiles)."""
    from basal_local.backends.base import PackedBatch
    from basal_local.backends.host import ancestor_matrix
    from basal_local.backends.mlx.tree_attention import MetalAttention, random_tree_batch

    rng = np.random.default_rng(0)
    heads, kv, dim, lengths = 8, 2, 64, [45]
    batch = random_tree_batch(rng, lengths, n_roots=3, children=3)
    keys = rng.standard_normal((lengths[0] + batch.num_tokens, kv, dim)).astype(np.float32)
    values = rng.standard_normal(keys.shape).astype(np.float32)
    q = rng.standard_normal((batch.num_tokens, heads, dim)).astype(np.float32)
    anc = ancestor_matrix(batch.block_parent)
    with mx.stream(mx.gpu):
        packed = np.array(MetalAttention(batch, lengths)(mx.array(q), mx.array(keys), mx.array(values)))
        checked = 0
        for leaf in range(len(batch.block_parent)):
            if leaf in batch.block_parent:
                continue
            idx = np.nonzero(anc[leaf][batch.token_block])[0]  # the prompt of this leaf: its ancestor chain
            root = int(np.nonzero(anc[leaf])[0][0])
            alone = PackedBatch(token_ids=np.zeros(len(idx), dtype=np.int64), positions=batch.positions[idx],
                                token_block=np.zeros(len(idx), dtype=np.int32), block_parent=np.array([-1]),
                                block_prefix=np.array([batch.block_prefix[root]]),
                                readout_index=np.array([len(idx) - 1]), letter_ids=np.array([0]),
                                prefixes=batch.prefixes)
            sel = np.concatenate([np.arange(lengths[0]), lengths[0] + idx])
            out = np.array(MetalAttention(alone, lengths)(mx.array(q[idx]), mx.array(keys[sel]),
                                                                   mx.array(values[sel])))
            assert np.array_equal(out, packed[idx]), leaf
            checked += 1
    assert checked >= 6


@needs_metal
def test_metal_rms_norm_residual_matches_twin():
    from basal_local import metal_shaders as ms

    rng = np.random.default_rng(0)
    for dtype, tol in ((mx.float32, 1e-5), (mx.float16, 2e-2)):
        x = mx.array(rng.standard_normal((37, 320)).astype(np.float32)).astype(dtype)
        res = mx.array(rng.standard_normal((37, 320)).astype(np.float32)).astype(dtype)
        w = mx.array((1 + 0.1 * rng.standard_normal(320)).astype(np.float32)).astype(dtype)
        with mx.stream(mx.gpu):
            out, summed = ms.rms_norm_residual_metal(x, res, w, 1e-6)
            ref_out, ref_summed = ms.rms_norm_residual_twin(x, res, w, 1e-6)
            diff = np.abs(np.array(out.astype(mx.float32)) - np.array(ref_out.astype(mx.float32)))
            print(f"\nrms_norm_residual {dtype}: max {diff.max():.3g}, mean {diff.mean():.3g}")
            assert np.array_equal(np.array(summed), np.array(ref_summed)) and diff.max() <= tol
            alone, _ = ms.rms_norm_residual_metal(x[5:6], res[5:6], w, 1e-6)
            assert np.array_equal(np.array(alone), np.array(out[5:6]))


@needs_metal
def test_metal_forward_matches_cpu_f32(tiny_model, tiny_pair):
    md, _, cpu, prefixes = tiny_pair
    gpu = load_mlx(tiny_model, "f32", "mps")
    gpu.warmup()
    assert gpu.ops.describe() == {"attention": "metal", "norm": "metal"}  # the kernels passed their checks
    pack = pack_prompts(random_specs(md, random.Random(2)), prefixes)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(readout_logits(gpu, pack), readout_logits(cpu, pack)))
    assert worst <= 1e-4
