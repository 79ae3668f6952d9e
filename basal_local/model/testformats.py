"""`make-test-model --format`: rewrite a generated bf16 model in the layout of a port Basal ships.

Each layout is written with the format's own library, so our readers are tested against files no code of
ours encoded: mlx's `mx.quantize` and safetensors writer (mlx-lm layout), the `gguf` package's writer and
quantizers (Q4_K / Q6_K by `k_quant_blocks`, since the package has no K-quant quantizer: its dequantizer
is the reference that checks them), and torch's float8 e4m3 for
the NVIDIA ModelOpt FP8 layout. Embeddings and output head stay bf16 (Q8_0 in GGUF), as upstream ships them.

FP8 is calibrated as ModelOpt's FP8_DEFAULT_CFG is: per-tensor weight scales amax / 448, and static input
scales amax / 448 of each projection's input over calibration prompts (the bundled sample requests run through
the bf16 model on `device`, f32 on the CPU, f16 on CUDA).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import numpy as np

from .directory import load_model_dir
from .formats import GGUF_FILE, HF_TO_GGUF_SUFFIX, PORT_FORMATS, gguf_name, is_projection, permute_rope

MLX_MODES = {"mlx-8bit": ("affine", 8, 64), "mlx-fp4": ("nvfp4", 4, 16)}


def _read_bf16(path: Path) -> dict[str, np.ndarray]:
    """model.safetensors as f32 NumPy (bf16 widened exactly)."""
    from safetensors.torch import load_file  # imports torch (seconds): only to read bf16, which numpy lacks

    return {k: v.float().numpy() for k, v in load_file(str(path)).items()}


def check_format(config: dict, fmt: str) -> None:
    """ValueError before anything is written when a preset's shapes cannot take `fmt` as a shipped port has it:
    MLX quantizes every projection in groups along its input; Q4_K_M's K-quants need rows of 256 (on a preset
    with none, every matrix would fall back to Q8_0: an 8-bit file named 4-bit)."""
    inputs = {config["hidden_size"], config["num_attention_heads"] * config["head_dim"], config["intermediate_size"]}
    if fmt in MLX_MODES:
        group = MLX_MODES[fmt][2]
        if any(n % group for n in inputs):
            raise ValueError(f"--format {fmt} quantizes in groups of {group}: this preset's projections take "
                             f"{', '.join(str(n) for n in sorted(inputs))} inputs; use --preset tiny64 or a real "
                             "preset")
    if fmt == "gguf-q4_k_m" and any(n % 256 for n in inputs):
        raise ValueError(f"--format {fmt} needs projections with rows of 256 (its K-quants): this preset's take "
                         f"{', '.join(str(n) for n in sorted(inputs))}; use --preset tiny256 or a real preset")


def convert_test_model(directory: Path, fmt: str, seed: int = 0, device: str = "cpu") -> None:
    if fmt not in PORT_FORMATS:
        raise ValueError(f"unknown format {fmt!r} (choose from bf16, {', '.join(PORT_FORMATS)})")
    src = directory / "model.safetensors"
    config = json.loads((directory / "config.json").read_text())
    if fmt == "fp8":  # tensor by tensor on `device`: a max preset's f32 copy would not fit beside the rest
        _write_modelopt_fp8(directory, config, calibrate_inputs(directory, device), device)
        (directory / "config.json").write_text(json.dumps(config, indent=1))
        return
    weights = _read_bf16(src)
    if fmt in MLX_MODES:
        _write_mlx(directory, weights, config, *MLX_MODES[fmt])
    else:
        _write_gguf(directory, weights, config, fmt)
        src.unlink()
    (directory / "config.json").write_text(json.dumps(config, indent=1))


def _write_mlx(directory: Path, weights: dict, config: dict, mode: str, bits: int, group: int) -> None:
    import mlx.core as mx  # optional: only on a Mac, for the MLX layouts

    out = {}
    for name, value in weights.items():
        arr = mx.array(value)
        if is_projection(name) and name.endswith(".weight"):
            if value.shape[1] % group:
                raise ValueError(f"{name}: input size {value.shape[1]} is not a multiple of the group size "
                                 f"{group}; use --preset tiny64 or a real preset")
            parts = mx.quantize(arr, group_size=group, bits=bits, mode=mode)
            stem = name[: -len(".weight")]
            out[name] = parts[0]
            out[stem + ".scales"] = parts[1]
            if len(parts) > 2 and parts[2] is not None:
                out[stem + ".biases"] = parts[2].astype(mx.bfloat16)
            if mode == "affine":
                out[stem + ".scales"] = parts[1].astype(mx.bfloat16)
        else:
            out[name] = arr.astype(mx.bfloat16)
    mx.save_safetensors(str(directory / "model.safetensors"), out, metadata={"format": "mlx"})
    quant = {"group_size": group, "bits": bits} | ({"mode": mode} if mode != "affine" else {})
    config["quantization"] = quant
    config["quantization_config"] = dict(quant)


def _write_gguf(directory: Path, weights: dict, config: dict, fmt: str) -> None:
    import gguf  # ~0.4 s to import: only for the GGUF layouts
    from gguf import GGMLQuantizationType as Q  # ~0.4 s to import: only for the GGUF layouts

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(directory / GGUF_FILE), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(7 if fmt == "gguf-q8_0" else 15)  # llama.cpp's MOSTLY_Q8_0 / MOSTLY_Q4_K_M
    for name, value in weights.items():
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            value = permute_rope(value, heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            value = permute_rope(value, kv_heads)
        qtype = _gguf_type(name, value, fmt)
        if qtype == Q.F32:
            writer.add_tensor(gguf_name(name), value.astype(np.float32))
        elif qtype in (Q.Q4_K, Q.Q6_K):
            writer.add_tensor(gguf_name(name), k_quant_blocks(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(value.astype(np.float32), qtype),
                              raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_type(name: str, value: np.ndarray, fmt: str):
    from gguf import GGMLQuantizationType as Q  # ~0.4 s to import: only for the GGUF layouts

    if value.ndim == 1:
        return Q.F32
    if fmt == "gguf-q8_0" or not is_projection(name) or value.shape[1] % 256:
        return Q.Q8_0  # Q4_K_M keeps embeddings and head at Q8_0; K-quants need rows of 256
    return Q.Q6_K if name.endswith(("v_proj.weight", "down_proj.weight")) else Q.Q4_K


def k_quant_blocks(value: np.ndarray, qtype) -> np.ndarray:
    """A [rows, cols] f32 matrix as Q4_K or Q6_K blocks (the `gguf` package dequantizes them but has no
    quantizer): per 256-value super-block, sub-block scales (and Q4_K's minimums) from each sub-block's range,
    quantized to 6 / 8 bits against an f16 super-block scale, then the values rounded to their 4 / 6-bit levels.
    Round to nearest, no search for better scales (llama.cpp's quantizer searches; this is coarser, never finer).
    Packed in ggml's byte layout, which `gguf.quants.dequantize` reads (tests/test_formats.py checks it)."""
    from gguf import GGMLQuantizationType as Q  # ~0.4 s to import: only for the GGUF layouts

    rows, cols = value.shape
    x = value.astype(np.float32).reshape(-1, 256)  # super-blocks, row-major: each row's blocks in order
    n = x.shape[0]
    if qtype == Q.Q4_K:
        sub = x.reshape(n, 8, 32)
        lo = np.minimum(sub.min(axis=2), 0.0)
        hi = np.maximum(sub.max(axis=2), lo)
        scale, mins = (hi - lo) / 15.0, -lo
        d = (scale.max(axis=1) / 63.0).astype(np.float16)
        dmin = (mins.max(axis=1) / 63.0).astype(np.float16)
        df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
        sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
        m = np.clip(np.rint(np.divide(mins, dminf, out=np.zeros_like(mins), where=dminf > 0)), 0, 63).astype(np.uint8)
        step, offset = (df * sc)[:, :, None], (dminf * m)[:, :, None]
        q = np.clip(np.rint(np.divide(sub + offset, step, out=np.zeros_like(sub), where=step > 0)), 0, 15)
        q = q.astype(np.uint8).reshape(n, 4, 2, 32)
        qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
        scales = np.concatenate([(sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
                                 (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6),
                                 (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=1).astype(np.uint8)
        blocks = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, qs], axis=1)
    elif qtype == Q.Q6_K:
        sub = x.reshape(n, 16, 16)
        scale = np.abs(sub).max(axis=2) / 31.0
        d = (scale.max(axis=1) / 127.0).astype(np.float16)
        df = d.astype(np.float32)[:, None]
        sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127).astype(np.int8)
        step = (df * sc.astype(np.float32))[:, :, None]
        q = np.clip(np.rint(np.divide(sub, step, out=np.zeros_like(sub), where=step > 0)), -32, 31) + 32
        q = q.astype(np.uint8).reshape(n, 256)
        low = (q & 0x0F).reshape(n, 2, 2, 64)
        high = (q >> 4).reshape(n, 2, 4, 32)
        ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
        qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
        blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)
    else:
        raise ValueError(f"no K-quant quantizer for {qtype!r}")
    return np.ascontiguousarray(blocks.astype(np.uint8).reshape(rows, -1))


CALIBRATION_PROMPTS = 16


def calibrate_inputs(directory: Path, device: str = "cpu", prompts: int = CALIBRATION_PROMPTS) -> dict[str, float]:
    """{projection stem: input amax} over the first `prompts` sample requests (template prefix + state) run
    through the bf16 model in `directory` (plain GEMMs, no padding rows, so the amax is of real rows only)."""
    # torch and the torch backend (seconds to import): only to calibrate the FP8 layout's scales
    import torch

    from ..backends.torch import TorchBackend
    from ..backends.torch.options import TorchOptions

    md = load_model_dir(directory)
    backend = TorchBackend(device, options=TorchOptions(gemm="cublas", cuda_graphs=False))
    backend.load(directory, "auto")
    parts = {"qkv_weight": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "o_proj_weight": ("self_attn.o_proj",), "gate_up_weight": ("mlp.gate_proj", "mlp.up_proj"),
             "down_proj_weight": ("mlp.down_proj",)}
    stems = {id(getattr(layer, slot)): [f"model.layers.{i}.{p}" for p in names]
             for i, layer in enumerate(backend.layers) for slot, names in parts.items()}
    amax: dict[str, float] = {}
    plain = backend.fwd.linear

    def recording(x, w, b):
        for stem in stems.get(id(w), ()):
            amax[stem] = max(amax.get(stem, 0.0), float(x.float().abs().max()))
        return plain(x, w, b)

    backend.fwd.linear = recording
    lines = resources.files("basal_local.assets").joinpath("sample_requests.jsonl").read_text(encoding="utf-8")
    for line in [ln for ln in lines.splitlines() if ln.strip()][:prompts]:
        req = json.loads(line)
        lang = "pl" if str(req.get("id", "")).startswith("pl") else "en"
        ids = md.tokenizer.template_prefix(lang) + md.tokenizer.encode(str(req.get("state", "")))
        backend.final_hidden(np.asarray(ids[: md.config.max_position_embeddings], dtype=np.int64))
    del backend
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return amax


def _write_modelopt_fp8(directory: Path, config: dict, input_amax: dict[str, float], device: str = "cpu") -> None:
    import torch  # seconds to import: only for the FP8 layout
    from safetensors import safe_open
    from safetensors.torch import save_file

    finfo = torch.finfo(torch.float8_e4m3fn)
    out = {}
    with safe_open(str(directory / "model.safetensors"), framework="pt") as fh:
        for name in fh.keys():
            t = fh.get_tensor(name).to(device).float()  # bf16 widened exactly; the same bits on any device
            if is_projection(name) and name.endswith(".weight"):
                scale = t.abs().max().clamp(min=1e-12) / finfo.max  # per-tensor, as FP8_DEFAULT_CFG
                out[name] = (t / scale).clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn).cpu()
                stem = name[: -len(".weight")]
                out[stem + ".weight_scale"] = scale.reshape(()).float().cpu()
                # the static activation scale ModelOpt calibrates: the input's amax over the calibration prompts
                amax = input_amax.get(stem, 0.0)
                out[stem + ".input_scale"] = torch.tensor(amax / finfo.max if amax > 0 else 1.0, dtype=torch.float32)
            else:
                out[name] = t.to(torch.bfloat16).cpu()
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
    (directory / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quant}, indent=1))
    config["quantization_config"] = {"quant_method": "modelopt", **quant}


__all__ = ["convert_test_model", "HF_TO_GGUF_SUFFIX"]
