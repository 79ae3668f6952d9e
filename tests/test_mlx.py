"""The MLX backend on the CPU (`mlx[cpu]`) against the torch f32 reference; Metal kernels against their twins.

Everything here but the Metal tests runs on Linux; those skip with a reason where Metal is absent.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'mlx[cpu]' on Linux)")

from basal_local.engine.packer import pack_prompts  # noqa: E402

from .conftest import Daemon, http, load_backend, readout_logits  # noqa: E402
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
    if not METAL:
        with pytest.raises(ValueError, match="Metal"):
            select.make_backend("mlx", "mps")


# ---- quantized weights --------------------------------------------------------------------------------------
def _decisions(backend, md, every: int = 1):
    """(decision, calibrated probabilities) for every `every`-th question of the sample set, via the real engine
    path."""
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
            (ans,) = job.future.result(timeout=300).body["answers"].values()
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
        "from basal_local.backends.mlx.llama import _single_prompt; "
        "b = make_backend('auto', 'cpu'); b.load(sys.argv[1], 'auto'); "
        "x = b.forward(_single_prompt([1, 3, 50, 60, 70])); "
        "print(b.name, b.device, x.shape, bool(np.isfinite(x).all()))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["mlx", "cpu", "(1,", "1)", "True"]


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
    from basal_local.backends.mlx.tree_attention import TreeAttention, block_key_ranges, random_tree_batch

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
        twin = np.array(TreeAttention(batch, prefix_lengths, "sdpa")(mx.array(q), mx.array(k), mx.array(v)))
        assert np.abs(emulated - twin).max() <= 1e-5


@needs_metal
@pytest.mark.parametrize("heads,kv,dim", [(4, 2, 16), (16, 2, 128), (4, 1, 32)])
def test_metal_tree_attention_matches_twin(heads, kv, dim):
    from basal_local.backends.mlx.tree_attention import TreeAttention, random_tree_batch

    rng = np.random.default_rng(heads * dim)
    for prefix_lengths in ([37, 21], []):
        batch = random_tree_batch(rng, prefix_lengths, n_roots=4, children=3)
        s = sum(prefix_lengths) + batch.num_tokens
        q = mx.array(rng.standard_normal((batch.num_tokens, heads, dim)).astype(np.float32))
        k = mx.array(rng.standard_normal((s, kv, dim)).astype(np.float32))
        v = mx.array(rng.standard_normal((s, kv, dim)).astype(np.float32))
        with mx.stream(mx.gpu):
            kernel = np.array(TreeAttention(batch, prefix_lengths, "metal")(q, k, v))
            twin = np.array(TreeAttention(batch, prefix_lengths, "sdpa")(q, k, v))
            rows = np.array([0, batch.num_tokens // 2, batch.num_tokens - 1])
            kernel_rows = np.array(TreeAttention(batch, prefix_lengths, "metal")(q, k, v, rows=rows))
        diff = np.abs(kernel - twin)
        print(f"\nkernel vs twin H={heads} Hkv={kv} D={dim}: max {diff.max():.3g}, mean {diff.mean():.3g}")
        assert diff.max() <= 1e-4 and np.array_equal(kernel_rows, kernel[rows])


@needs_metal
def test_metal_tree_attention_is_bitwise_invariant_alone_vs_packed():
    """Each prompt's attention rows are bit-identical alone and packed with others (position-aligned tiles)."""
    from basal_local.backends.base import PackedBatch, ancestor_matrix
    from basal_local.backends.mlx.tree_attention import TreeAttention, random_tree_batch

    rng = np.random.default_rng(0)
    heads, kv, dim, lengths = 8, 2, 64, [45]
    batch = random_tree_batch(rng, lengths, n_roots=3, children=3)
    keys = rng.standard_normal((lengths[0] + batch.num_tokens, kv, dim)).astype(np.float32)
    values = rng.standard_normal(keys.shape).astype(np.float32)
    q = rng.standard_normal((batch.num_tokens, heads, dim)).astype(np.float32)
    anc = ancestor_matrix(batch.block_parent)
    with mx.stream(mx.gpu):
        packed = np.array(TreeAttention(batch, lengths, "metal")(mx.array(q), mx.array(keys), mx.array(values)))
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
            out = np.array(TreeAttention(alone, lengths, "metal")(mx.array(q[idx]), mx.array(keys[sel]),
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
    assert gpu.attention == "metal"  # the kernel passed its own check
    pack = pack_prompts(random_specs(md, random.Random(2)), prefixes)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(readout_logits(gpu, pack), readout_logits(cpu, pack)))
    assert worst <= 1e-4
