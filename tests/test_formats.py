"""Shipped ports (MLX 8-bit and nvfp4, GGUF Q8_0 and Q4_K_M, ModelOpt FP8) load and answer like their weights.

Each port is written by `make-test-model --format` with the format's own library; the reference is the same
weights decoded here by that library (mx.dequantize, gguf.quants.dequantize, torch's float8) and run through the
f32 torch backend. The readers in basal_local/model/formats.py are therefore checked against no code of ours.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from basal_local.engine.packer import pack_prompts
from basal_local.model.directory import ModelLoadError, load_model_dir

from .conftest import load_backend, readout_logits
from .test_packer import random_specs

PRESET = {"bf16": "tiny64", "mlx-8bit": "tiny64", "mlx-fp4": "tiny64", "gguf-q8_0": "tiny64", "gguf-q4_k_m": "tiny256", "fp8": "tiny64"}
GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
GGUF_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
              "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def make_port(root: Path, fmt: str, seed: int = 5, preset: str | None = None) -> Path:
    from basal_local.model.testformats import convert_test_model
    from basal_local.model.testmodel import make_test_model

    out = make_test_model(root / fmt, preset=preset or PRESET[fmt], seed=seed, evidence_head=False)
    if fmt != "bf16":  # bf16: the generated source itself
        convert_test_model(out, fmt, seed=seed)
    return out


def _library_decoded(port: Path, fmt: str) -> dict[str, np.ndarray]:
    """The port's weights decoded by the format's own library, in Hugging Face names and row order."""
    cfg = json.loads((port / "config.json").read_text())
    if fmt.startswith("gguf"):
        import gguf

        out = {}
        for t in gguf.GGUFReader(str(port / "model.gguf")).tensors:
            value = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))
            if t.name in GGUF_TOP:
                out[GGUF_TOP[t.name]] = value
                continue
            _, layer, kind, suffix = t.name.split(".")
            name = f"model.layers.{layer}.{GGUF_LAYER[kind]}.{suffix}"
            heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}.get(kind)
            if heads:  # llama.cpp stores q/k rows interleaved per head pair; back to the half-split order
                rows = value.shape[0]
                value = value.reshape(heads, rows // heads // 2, 2, *value.shape[1:]).swapaxes(1, 2).reshape(
                    value.shape)
            out[name] = value
        return out
    if fmt.startswith("mlx"):
        import mlx.core as mx

        q = cfg["quantization"]
        raw = mx.load(str(port / "model.safetensors"))
        out = {}
        for name in [n for n in raw if not n.endswith((".scales", ".biases"))]:
            stem = name[: -len(".weight")]
            if stem + ".scales" in raw:
                scales, biases = raw[stem + ".scales"], raw.get(stem + ".biases")
                if biases is not None:  # affine: decode in f32 (a bf16 result would round the weights)
                    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
                w = mx.dequantize(raw[name], scales, biases,
                                  group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"))
            else:
                w = raw[name]
            out[name] = np.array(w.astype(mx.float32))
        return out
    import torch
    from safetensors.torch import load_file

    raw = load_file(str(port / "model.safetensors"))
    return {k: (v.float() * raw[k[:-7] + ".weight_scale"].float() if v.dtype == torch.float8_e4m3fn else v.float()
                ).numpy() for k, v in raw.items() if not k.endswith(("_scale",))}


def reference_dir(port: Path, fmt: str, root: Path) -> Path:
    """The port's directory with its weights decoded to f32 safetensors (a plain reference checkpoint)."""
    from safetensors.numpy import save_file

    ref = root / f"{fmt}-reference"
    ref.mkdir()
    for f in port.iterdir():
        if f.suffix in (".json", ".jinja") and f.name != "hf_quant_config.json":
            shutil.copy(f, ref / f.name)
    cfg = json.loads((ref / "config.json").read_text())
    cfg.pop("quantization", None)
    cfg.pop("quantization_config", None)
    (ref / "config.json").write_text(json.dumps(cfg))
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in _library_decoded(port, fmt).items()},
              str(ref / "model.safetensors"))
    return ref


def _logits(backend, md, prefixes) -> np.ndarray:
    pack = pack_prompts(random_specs(md, random.Random(7)), prefixes)
    return np.concatenate([np.ravel(x) for x in readout_logits(backend, pack)])


def _mlx_logits(port: Path, md, prefixes, dtype: str = "f32") -> tuple:
    from basal_local.backends.mlx import MLXBackend

    backend = MLXBackend("cpu")
    backend.load(port, dtype)
    for lang, ids in prefixes.items():
        backend.add_prefix(lang, ids)
    return backend, _logits(backend, md, prefixes)


@pytest.mark.parametrize("fmt,preset", [("mlx-8bit", None), ("mlx-fp4", None), ("gguf-q8_0", None),
                                        ("gguf-q8_0", "tiny"), ("gguf-q4_k_m", None), ("fp8", None), ("fp8", "tiny")])
def test_port_logits_equal_its_library_decoded_weights(fmt, preset, tmp_path):
    """`tiny` has q/k/v and MLP biases (rows of q/k biases are RoPE-permuted in GGUF too)."""
    port = make_port(tmp_path, fmt, preset=preset)
    md_ref, ref_backend, prefixes = load_backend(reference_dir(port, fmt, tmp_path))
    ref = _logits(ref_backend, md_ref, prefixes)
    md = load_model_dir(port)
    assert md.format.name == fmt
    if fmt.startswith(("gguf", "fp8")):  # torch dequantizes at load
        _, torch_backend, _ = load_backend(port)
        got = _logits(torch_backend, md, prefixes)
        assert np.abs(got - ref).max() <= 1e-4, (fmt, np.abs(got - ref).max())
    if fmt.startswith(("gguf", "mlx")):
        pytest.importorskip("mlx.core")
        backend, got = _mlx_logits(port, md, prefixes)
        if fmt in ("mlx-8bit", "mlx-fp4", "gguf-q8_0"):  # quantized_matmul on the packed weights, no dense copy
            from basal_local.backends.mlx.quantize import Quantized

            assert all(isinstance(getattr(layer, f"{n}_weight"), Quantized) and
                       getattr(layer, f"{n}_weight").mode == (md.format.mode or "affine")
                       for layer in backend.layers for n in ("qkv", "o_proj", "gate_up", "down_proj"))
        assert np.abs(got - ref).max() <= 2e-3, (fmt, np.abs(got - ref).max())


def test_torch_refuses_an_mlx_port_in_one_sentence(tmp_path):
    port = make_port(tmp_path, "mlx-8bit")
    with pytest.raises(ValueError, match=r"^model\.safetensors: an MLX port \(mlx-8bit\) runs on the MLX backend"):
        load_backend(port)


def _write_header(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize("damage,message", [
    ("truncate-gguf", r"^model\.gguf: not a GGUF file or truncated"),
    ("group-size", r'^config\.json: field "quantization\.group_size" must be one of \[32, 64, 128\]'),
    ("group-mismatch", r"^model\.safetensors: tensor 'model\.layers\.0\.self_attn\.q_proj\.scales' has shape"),
    ("missing-scales", r"^model\.safetensors: missing tensor 'model\.layers\.0\.self_attn\.q_proj\.scales'"),
    ("truncate-st", r"^model\.safetensors: truncated or corrupt"),
    ("fp8-missing-scale", r"^model\.safetensors: missing tensor 'model\.layers\.0\.mlp\.up_proj\.weight_scale'"),
    ("nvfp4-modelopt", r"^hf_quant_config\.json: quant_algo 'NVFP4' is not supported"),
])
def test_damaged_ports_are_refused_naming_file_and_tensor(damage, message, tmp_path):
    fmt = {"truncate-gguf": "gguf-q8_0", "fp8-missing-scale": "fp8", "nvfp4-modelopt": "fp8"}.get(damage, "mlx-8bit")
    port = make_port(tmp_path, fmt)
    cfg = json.loads((port / "config.json").read_text())
    if damage == "truncate-gguf":
        data = (port / "model.gguf").read_bytes()
        (port / "model.gguf").write_bytes(data[: len(data) // 2])
    elif damage in ("group-size", "group-mismatch"):
        cfg["quantization"]["group_size"] = 48 if damage == "group-size" else 32
        (port / "config.json").write_text(json.dumps(cfg))
    elif damage == "nvfp4-modelopt":
        q = json.loads((port / "hf_quant_config.json").read_text())
        q["quantization"]["quant_algo"] = "NVFP4"
        (port / "hf_quant_config.json").write_text(json.dumps(q))
    else:
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(port / "model.safetensors"), "pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        drop = {"missing-scales": "model.layers.0.self_attn.q_proj.scales",
                "fp8-missing-scale": "model.layers.0.mlp.up_proj.weight_scale"}.get(damage)
        tensors.pop(drop, None)
        save_file(tensors, str(port / "model.safetensors"))
        if damage == "truncate-st":
            data = (port / "model.safetensors").read_bytes()
            (port / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model_dir(port)
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)


def test_calibration_per_port(tmp_path):
    port = make_port(tmp_path, "mlx-fp4")
    md = load_model_dir(port)
    assert (md.calibration.file, md.calibration.inherited) == ("CALIBRATION.json", True)
    own = {"temperature_per_prim": {"choice": 2.5}, "thresholds": {"0.05": {"confidence": 0.8}}}
    (port / "CALIBRATION.mlx.json").write_text(json.dumps(own))
    md = load_model_dir(port)
    assert (md.calibration.file, md.calibration.inherited) == ("CALIBRATION.mlx.json", False)
    assert md.calibration.temperatures == {"choice": 2.5} and md.calibration.thresholds == {"0.05": 0.8}
    (port / "CALIBRATION.gguf.json").write_text(json.dumps(own))  # another engine's file is not read by MLX
    gguf_port = make_port(tmp_path, "gguf-q8_0")
    assert load_model_dir(gguf_port).calibration.file == "CALIBRATION.json"
    (gguf_port / "CALIBRATION.llamacpp.json").write_text(json.dumps(own))
    assert load_model_dir(gguf_port).calibration.file == "CALIBRATION.llamacpp.json"


def test_bf16_directory_reads_only_calibration_json(tiny_model):
    md = load_model_dir(tiny_model)
    assert md.format.name == "bf16" and md.calibration.file == "CALIBRATION.json" and not md.calibration.inherited


def test_pull_tags_name_the_port_repository_and_one_gguf_file(monkeypatch, tmp_path):
    import huggingface_hub

    from basal_local.model import registry

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, revision=None, **kw: calls.append((repo, revision, kw)) or str(tmp_path))
    for ref in ("4.5B", "4.5B:mlx-8bit", "4.5B:mlx-fp4", "4.5B:gguf-q8_0", "mini:fp8@abc"):
        registry.pull(ref)
    assert [(c[0], c[1]) for c in calls] == [
        ("Remek/basal-1.5-4.5B", None), ("Remek/basal-1.5-4.5B-MLX-8bit", None), ("Remek/basal-1.5-4.5B-MLX-fp4", None),
        ("Remek/basal-1.5-4.5B-GGUF", None), ("Remek/basal-1.5-mini-FP8", "abc")]
    patterns = calls[3][2]["allow_patterns"]
    assert "*Q8_0.gguf" in patterns and not any("Q4_K" in p for p in patterns)
    assert all("allow_patterns" not in c[2] for i, c in enumerate(calls) if i != 3)
    with pytest.raises(registry.ModelNotFound, match="unknown model tag '4.5B:q3'"):
        registry.split_ref("4.5B:q3")


def test_show_names_format_bits_dense_layers_and_calibration(tmp_path):
    from basal_local.commands.models import describe

    port = make_port(tmp_path, "mlx-fp4")
    info = describe(port)["port"]
    assert info["format"] == "mlx-fp4" and info["bits"] == 4 and info["quantization"] == {"group_size": 16,
                                                                                          "mode": "nvfp4"}
    assert "lm_head" in info["dense_layers"] and "model.embed_tokens" in info["dense_layers"]
    assert (info["calibration_file"], info["calibration_inherited"]) == ("CALIBRATION.json", True)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mlx-8bit", "mlx-fp4", "gguf-q8_0", "gguf-q4_k_m", "fp8"])
def test_port_agreement_with_its_bf16_source_on_the_sample_set(fmt, tmp_path):
    """docs/PERFORMANCE.md's table: same decision share, max and median |Δp_cal| vs the bf16 source (-s prints)."""
    from basal_local.backends.torch import TorchBackend
    from basal_local.model.testmodel import make_test_model

    from .test_mlx_weights import _decisions

    source = make_test_model(tmp_path / "bf16", preset=PRESET[fmt], seed=5, evidence_head=False)
    port = make_port(tmp_path, fmt)

    def run(path: Path):
        if fmt.startswith("mlx"):
            from basal_local.backends.mlx import MLXBackend

            backend = MLXBackend("cpu")
        else:
            backend = TorchBackend("cpu")
        backend.load(path, "f32")
        md = load_model_dir(path)
        for lang in ("pl", "en"):
            backend.add_prefix(lang, md.tokenizer.template_prefix(lang))
        return _decisions(backend, md)

    ref, got = run(source), run(port)
    same = np.mean([a[0] == b[0] for a, b in zip(got, ref)])
    deltas = np.array([abs(a[1][k] - b[1][k]) for a, b in zip(got, ref) for k in b[1]])
    print(f"\n{fmt} vs bf16 on {len(ref)} sample questions ({PRESET[fmt]}): same decision {same:.1%}, "
          f"max |dp_cal| {deltas.max():.4f}, median {np.median(deltas):.5f}")
    assert same >= 0.5 and 0 < np.median(deltas) < 0.2  # random weights: loose bounds, the figures are the point


@pytest.mark.parametrize("fmt,backend", [("gguf-q4_k_m", "torch"), ("fp8", "torch"), ("mlx-fp4", "mlx")])
def test_port_answers_through_the_engine(fmt, backend, tmp_path):
    """A port answers real sample questions end to end (plan, pack, forward, calibrate) with its port calibration."""
    from basal_local.api.systemone import validate_systemone
    from basal_local.bench import single_question_requests
    from basal_local.engine.engine import EngineSettings, ModelEngine
    from basal_local.engine.gate import DeviceGate
    from basal_local.telemetry import Telemetry

    port = make_port(tmp_path, fmt)
    (port / ("CALIBRATION.mlx.json" if backend == "mlx" else "CALIBRATION.fp8.json")).write_text(
        json.dumps({"temperature_per_prim": {"choice": 3.0}}))
    md = load_model_dir(port)
    if backend == "mlx":
        pytest.importorskip("mlx.core")
        from basal_local.backends.mlx import MLXBackend

        be = MLXBackend("cpu")
    else:
        from basal_local.backends.torch import TorchBackend

        be = TorchBackend("cpu")
    be.load(port, "f32")
    for lang in ("pl", "en"):
        be.add_prefix(lang, md.tokenizer.template_prefix(lang))
    engine = ModelEngine(md, be, DeviceGate(), Telemetry(), EngineSettings(long_tokens=0, max_batch_tokens=512))
    engine.start()
    try:
        bodies = single_question_requests(md.name)[:3]
        answers = [engine.submit(engine.plan(validate_systemone(b, md.name))).result(timeout=120)
                   for b in bodies]
    finally:
        engine.stop()
    assert len(answers) == 3 and all(a.answers for a in answers)  # each an Outcome with its questions
    assert md.calibration.file == ("CALIBRATION.mlx.json" if backend == "mlx" else
                                   ("CALIBRATION.fp8.json" if fmt == "fp8" else "CALIBRATION.json"))


@pytest.mark.parametrize("fmt,dtype", [("bf16", "f32"), ("bf16", "fp8"), ("fp8", "fp8"), ("fp8", "f32"),
                                       ("gguf-q8_0", "f32")])
def test_gpu_memory_check_counts_the_weights_as_this_load_holds_them(fmt, dtype, tmp_path):
    """--gpu-memory refuses before loading by the bytes the load will hold (backends/memory.weights_bytes): the
    run dtype for bf16 and dequantized ports, one byte per e4m3 projection weight for an FP8 checkpoint on its
    fp8 route, the float8 copy beside the f16 weight for dtype fp8; equal to what the loaded backend reports,
    less the scales."""
    from basal_local.backends.torch import TorchBackend
    from basal_local.model.formats import is_projection

    path = make_port(tmp_path, fmt)
    backend = TorchBackend("cpu")
    backend.load(path, dtype)
    planned = backend.planned_weight_bytes(backend.config, is_projection)
    scales = 0
    if backend.fwd._fp8 is not None:
        scales = sum(s.numel() * 4 for _, _, s, _ in backend.fwd._fp8._by_id.values())
    assert planned == backend.memory()["weights_bytes"] - scales
    if fmt == "fp8" and dtype == "fp8":
        assert backend._dtype_label() == "the checkpoint's fp8"
    elif fmt.startswith("gguf"):
        assert backend._dtype_label() == "f32 (a gguf-q8_0 checkpoint dequantized at load)"


@pytest.mark.parametrize("fmt,dtype", [("bf16", "f32"), ("bf16", "f16"), ("bf16", "q8"), ("bf16", "q4"),
                                       ("mlx-8bit", "f32"), ("mlx-8bit", "f16"), ("mlx-fp4", "f32"),
                                       ("gguf-q8_0", "f32"), ("gguf-q4_k_m", "f32")])
def test_mlx_gpu_memory_check_counts_the_weights_as_this_load_holds_them(fmt, dtype, tmp_path):
    """The MLX backend plans a load's bytes from the files' headers (packed words and scale bytes as the port
    holds them, every other tensor in the compute dtype) and the plan equals the bytes of the arrays the loaded
    backend holds; a quantized port plans well under its dequantized size."""
    pytest.importorskip("mlx.core")
    from basal_local.backends.mlx import MLXBackend
    from basal_local.model.formats import is_projection

    path = make_port(tmp_path, fmt)
    backend = MLXBackend("cpu")
    backend.load(path, dtype)
    planned = backend.planned_weight_bytes(backend.config)
    assert planned == backend.memory()["weights_bytes"]
    shapes = backend.config.weight_shapes()
    dense = sum(int(np.prod(s)) for s in shapes.values()) * backend.dtype.size
    projections = sum(int(np.prod(s)) for n, s in shapes.items() if is_projection(n) and n.endswith(".weight")
                      ) * backend.dtype.size
    if fmt.startswith("mlx") or fmt == "gguf-q8_0" or dtype in ("q8", "q4"):
        # 8 bits or fewer a weight against 16 or 32, a few scale bytes per group: at least 40 % saved
        assert dense - planned > 0.4 * projections, (planned, dense, projections)
    else:
        assert planned == dense


@pytest.mark.parametrize("fmt,label", [("mlx-8bit", "the checkpoint's 8-bit affine (group 64)"),
                                       ("mlx-fp4", "the checkpoint's 4-bit nvfp4 (group 16)"),
                                       ("gguf-q8_0", "the checkpoint's Q8_0"),
                                       ("gguf-q4_k_m", "f32 (a gguf-q4_k_m checkpoint dequantized at load)")])
def test_mlx_gpu_memory_refuses_a_port_over_the_limit_in_one_sentence(fmt, label, tmp_path, monkeypatch):
    """--gpu-memory on Metal (the device's memory faked: no Mac here): a port whose weights as loaded exceed the
    limit is refused before anything loads, in the torch backend's sentence; one that fits only by its packed
    size (its dequantized weights would not) loads, answers and reports the limit it set."""
    pytest.importorskip("mlx.core")
    import basal_local.backends.mlx.llama as mlx_llama
    from basal_local.backends.base import PackedBatch
    from basal_local.backends.mlx import MLXBackend

    port = make_port(tmp_path, fmt)
    limits = []
    monkeypatch.setattr(mlx_llama.mx, "device_info", lambda: {"memory_size": 16 * 10 ** 9})
    monkeypatch.setattr(mlx_llama.mx, "set_memory_limit", limits.append)
    probe = MLXBackend("cpu")
    probe.load(port, "f32")
    held = probe.memory()["weights_bytes"]
    dense = sum(int(np.prod(s)) for s in probe.config.weight_shapes().values()) * 4

    def on_metal(limit: int):
        value = f"{limit / 1e6:.6f}MB"
        backend = MLXBackend("cpu", memory_limit=value)
        backend.device = "metal"  # the check and the limit as on a Mac; the arrays stay on the CPU
        return backend, value

    too_small, value = on_metal(held - 1000)
    with pytest.raises(ValueError) as err:
        too_small.load(port, "f32")
    assert str(err.value).startswith(f"the model's weights need {held / 1e9:.1f} GB in {label} on the Metal GPU, "
                                     f"more than --gpu-memory {value} allows")
    assert not hasattr(too_small, "layers") and limits == []  # refused before any weight was read
    if fmt == "gguf-q4_k_m":
        return  # dequantized at load: nothing smaller to fit
    assert held < dense
    fits, value = on_metal((held + dense) // 2)  # the port fits; its weights dequantized to f32 would not
    fits.load(port, "f32")
    assert fits.memory()["device_limit_bytes"] == limits[-1] == int(float(value[:-2]) * 1e6)
    logits = fits.forward(PackedBatch.single([1, 2, 3]))
    assert logits.shape == (1, 1) and np.isfinite(logits).all()


def test_k_quant_blocks_decode_by_the_gguf_package_close_to_their_source():
    """make-test-model's Q4_K / Q6_K quantizer (the gguf package has none) read back by the package's own
    dequantizer: round to nearest at 4 / 6 bits gives an rms error of ~step / sqrt(12), i.e. ~8 % / ~2 % of a
    Gaussian row's rms; a byte in the wrong place would give ~140 %. Zero blocks decode to zeros."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    from basal_local.model.testformats import k_quant_blocks

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 512)) * np.array([1e-3, 0.05, 1, 3, 0.02, 0.5])[:, None]).astype(np.float32)
    x[2, :256] = np.abs(x[2, :256])  # a block without negatives (Q4_K's minimum is then 0)
    x[3, 256:] = 0.0
    for qtype, bound, size in ((Q.Q4_K, 0.1, 144), (Q.Q6_K, 0.03, 210)):
        blocks = k_quant_blocks(x, qtype)
        assert blocks.dtype == np.uint8 and blocks.shape == (6, 2 * size)
        dec = gguf.quants.dequantize(blocks, qtype).reshape(x.shape)
        for row in range(6):
            rel = np.linalg.norm(dec[row] - x[row]) / np.linalg.norm(x[row])
            assert rel <= bound, (qtype.name, row, rel)
        assert not dec[3, 256:].any()


def test_gguf_directory_without_config_json_reads_the_metadata(tmp_path):
    """A GGUF port shipped without config.json (llama.cpp's layout) loads from the file's metadata: the same
    LlamaConfig as the config.json it was written from, and the same letter logits."""
    from basal_local.model.formats import FormatError, gguf_config

    port = make_port(tmp_path, "gguf-q8_0", preset="tiny")  # tiny: q/k/v and MLP biases
    with_config = load_model_dir(port)
    _, backend, prefixes = load_backend(port)
    want = _logits(backend, with_config, prefixes)
    (port / "config.json").unlink()
    md = load_model_dir(port)
    assert md.config == with_config.config and md.format.name == "gguf-q8_0"
    assert gguf_config(port / "model.gguf")["rms_norm_eps"] == with_config.config.rms_norm_eps
    _, backend, prefixes = load_backend(port)
    assert np.array_equal(_logits(backend, md, prefixes), want)
    # a GGUF of another architecture, without config.json: refused naming the file and the field
    import gguf

    other = tmp_path / "qwen"
    other.mkdir()
    for f in port.iterdir():
        if f.suffix != ".gguf":
            shutil.copy(f, other / f.name)
    writer = gguf.GGUFWriter(str(other / "model.gguf"), "qwen2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(FormatError, match=r"^model\.gguf: general\.architecture is 'qwen2'; basal-local reads llama"):
        gguf_config(other / "model.gguf")
    with pytest.raises(ModelLoadError, match=r"general\.architecture is 'qwen2'"):
        load_model_dir(other)


def test_pull_on_a_mac_names_the_port_that_fits(monkeypatch):
    """`pull 4.5B` on an Apple Silicon Mac: with 16 GB the bf16 weights (9.5 GB) are refused before any
    download, naming 4.5B:mlx-8bit (the largest port within half the memory) and the way to get bf16 anyway;
    with 32 GB bf16 fits and the hint only mentions the ports; a tag is never second-guessed."""
    import argparse
    import os
    import platform
    import sys

    from basal_local.commands import UserError
    from basal_local.commands import models as commands
    from basal_local.model.registry import mac_port_advice

    text, fits = mac_port_advice("4.5B", 16 * 10 ** 9)
    assert not fits and text == ("this Mac has 16 GB of memory: 4.5B in bf16 (9.5 GB) leaves too little; pull "
                                 "4.5B:mlx-8bit (5.2 GB), the largest port that fits (4.5B:bf16 9.5 GB, "
                                 "4.5B:mlx-8bit 5.2 GB, 4.5B:mlx-fp4 2.9 GB)")
    assert mac_port_advice("4.5B", 8 * 10 ** 9)[0].startswith("this Mac has 8 GB of memory: 4.5B in bf16 (9.5 GB) "
                                                                "leaves too little; pull 4.5B:mlx-fp4 (2.9 GB)")
    assert mac_port_advice("4.5B@abc", 32 * 10 ** 9)[1] is True
    assert "try a smaller model" in mac_port_advice("max", 16 * 10 ** 9)[0]
    assert mac_port_advice("4.5B:bf16", 8 * 10 ** 9) is None and mac_port_advice("4.5B:mlx-8bit", 8 * 10 ** 9) is None
    assert mac_port_advice("Remek/other", 8 * 10 ** 9) is None

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    monkeypatch.setattr(os, "sysconf", lambda key: {"SC_PAGE_SIZE": 16384, "SC_PHYS_PAGES": 16 * 10 ** 9 // 16384}[key])
    monkeypatch.setattr("basal_local.model.registry.pull", lambda ref: pytest.fail("downloaded"))
    with pytest.raises(UserError) as err:
        commands.pull(argparse.Namespace(ref="4.5B"))
    assert "pull 4.5B:mlx-8bit (5.2 GB)" in err.value.cause
    assert err.value.fix == "`basal-local pull 4.5B:bf16` downloads the bf16 weights anyway"
