"""The weight formats of a model directory: bf16/f16 safetensors, the MLX ports (affine 8-bit, nvfp4), GGUF and
NVIDIA ModelOpt FP8. `detect_format` names the layout, `check_weights` accounts for every tensor without reading
the data, and the readers yield tensors per Hugging Face name so a backend changes only at its load step.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .config import ConfigError, LlamaConfig
from .weightfile import SAFETENSORS_ITEMSIZE, ModelLoadError, check_weight_names, read_safetensors_header

PORT_FORMATS = ("mlx-8bit", "mlx-fp4", "gguf-q8_0", "gguf-q4_k_m", "fp8")
GGUF_FILE = "model.gguf"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HF_TO_GGUF_SUFFIX = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                     "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                     "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                     "mlp.down_proj": "ffn_down"}
GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
# which port calibration files a format reads, first found wins; CALIBRATION.json otherwise (inherited)
CALIBRATION_FILES = {"mlx": ("CALIBRATION.mlx.json",), "gguf": ("CALIBRATION.gguf.json", "CALIBRATION.llamacpp.json"),
                     "fp8": ("CALIBRATION.fp8.json", "CALIBRATION.vllm.json")}
MLX_MODES = {"affine": ({2, 3, 4, 5, 6, 8}, {32, 64, 128}), "nvfp4": ({4}, {16}), "mxfp4": ({4}, {32})}


class FormatError(ValueError):
    """One sentence naming the file and the tensor or field."""


@dataclass(frozen=True)
class WeightFormat:
    name: str                  # bf16, mlx-8bit, mlx-fp4, gguf-q8_0, gguf-q4_k_m, gguf, fp8
    family: str                # safetensors, mlx, gguf, fp8
    weights_file: Path
    bits: int = 16
    group_size: int | None = None
    mode: str | None = None    # MLX quantization mode (affine, nvfp4)
    dense: tuple[str, ...] = ()  # what stays bf16 (or Q8_0 in GGUF)
    tensor_types: dict[str, int] = field(default_factory=dict)  # GGUF: type name -> tensor count

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "bits": self.bits, "file": self.weights_file.name}
        if self.group_size:
            out["group_size"] = self.group_size
        if self.mode:
            out["mode"] = self.mode
        if self.dense:
            out["dense_layers"] = list(self.dense)
        if self.tensor_types:
            out["tensor_types"] = dict(self.tensor_types)
        return out


def is_projection(name: str) -> bool:
    return any(f".{p}." in name for p in PROJECTIONS) and name.startswith("model.layers.")


def gguf_name(hf: str) -> str:
    if hf in GGUF_TOP:
        return GGUF_TOP[hf]
    _, _, rest = hf.partition("model.layers.")
    layer, _, tail = rest.partition(".")
    stem, _, kind = tail.rpartition(".")
    return f"blk.{layer}.{HF_TO_GGUF_SUFFIX[stem]}.{kind}"


def permute_rope(value, heads: int):
    """Hugging Face q/k rows (half-split RoPE) to GGUF's interleaved order, as llama.cpp's converter stores them."""
    rest = value.shape[1:]
    return value.reshape(heads, 2, value.shape[0] // heads // 2, *rest).swapaxes(1, 2).reshape(value.shape)


def unpermute_rope(value, heads: int):
    rest = value.shape[1:]
    return value.reshape(heads, value.shape[0] // heads // 2, 2, *rest).swapaxes(1, 2).reshape(value.shape)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FormatError(f"{path.name}: cannot be read as JSON ({type(exc).__name__})") from None


GGUF_CONFIG = {"num_hidden_layers": "block_count", "max_position_embeddings": "context_length",
               "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
               "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
               "head_dim": "attention.key_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
               "vocab_size": "vocab_size"}


def read_config(path: Path) -> dict:
    """A model directory's config.json, or, for a GGUF directory without one, the same fields from the GGUF
    file's metadata (`gguf_config`)."""
    if (path / "config.json").exists() or not list(path.glob("*.gguf")):
        return _json(path / "config.json")
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) > 1:
        raise FormatError(f"{path}: holds {len(ggufs)} GGUF files and no config.json; keep the one to serve")
    return gguf_config(ggufs[0])


def gguf_config(file: Path) -> dict:
    """config.json's fields (the Hugging Face Llama layout) from a llama GGUF file's metadata; biases and tied
    embeddings from the tensors it holds. f32 metadata values as their shortest decimal (1e-06, not 9.99e-07)."""
    reader = _gguf_reader(file)

    def field(key: str):
        f = reader.fields.get(key)
        if f is None or not f.types:
            return None
        if f.types[0].name == "STRING":
            return bytes(f.parts[-1]).decode("utf-8", "replace")
        value = f.parts[-1][0]
        return float(str(np.float32(value))) if f.types[0].name == "FLOAT32" else value.item()

    arch = field("general.architecture")
    if arch != "llama":
        raise FormatError(f"{file.name}: general.architecture is {arch!r}; basal-local reads llama GGUF files "
                          "(or put the model's config.json beside it)")
    names = {t.name for t in reader.tensors}
    raw: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                           "attention_bias": "blk.0.attn_q.bias" in names, "mlp_bias": "blk.0.ffn_gate.bias" in names,
                           "tie_word_embeddings": "output.weight" not in names}
    for hf, key in GGUF_CONFIG.items():
        raw[hf] = field(f"llama.{key}")
    if raw["vocab_size"] is None:
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        raw["vocab_size"] = int(embd.shape[-1]) if embd is not None else None
    if raw["head_dim"] is None and raw["hidden_size"] and raw["num_attention_heads"]:
        raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": field("llama.rope.freq_base") or 10000.0}
    if field("llama.rope.scaling.type") not in (None, "none"):
        raw["rope_scaling"] = {"type": field("llama.rope.scaling.type")}
    try:
        LlamaConfig.from_dict(raw)
    except ConfigError as exc:
        message = str(exc).replace("config.json: field", f"{file.name} (no config.json): the metadata's")
        raise FormatError(message) from None
    return raw


def detect_format(path: Path, raw_config: dict) -> WeightFormat:
    """The layout of a model directory, from config.json and the files beside it (no tensor data read)."""
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    has_st = (path / "model.safetensors").exists()
    if ggufs and not has_st:
        if len(ggufs) > 1:
            raise FormatError(f"{path}: holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); keep the one to serve")
        return _gguf_format(path / ggufs[0])
    if not has_st:
        raise FormatError(f"model.safetensors: missing from {path} (and no .gguf file)")
    dense = ("model.embed_tokens", "lm_head", "norms", "biases")
    quant = raw_config.get("quantization")
    if quant is not None:
        if not isinstance(quant, dict):
            raise FormatError('config.json: field "quantization" must be an object (the mlx-lm layout)')
        mode = quant.get("mode", "affine")
        bits, group = quant.get("bits"), quant.get("group_size")
        if mode not in MLX_MODES:
            raise FormatError(f'config.json: field "quantization.mode" {mode!r} is not an MLX mode '
                              f"({', '.join(MLX_MODES)})")
        allowed_bits, allowed_groups = MLX_MODES[mode]
        if bits not in allowed_bits:
            raise FormatError(f'config.json: field "quantization.bits" must be one of {sorted(allowed_bits)} '
                              f"for mode {mode} (got {bits!r})")
        if group not in allowed_groups:
            raise FormatError(f'config.json: field "quantization.group_size" must be one of '
                              f"{sorted(allowed_groups)} for mode {mode} (got {group!r})")
        name = {("affine", 8): "mlx-8bit", ("nvfp4", 4): "mlx-fp4"}.get((mode, bits), f"mlx-{mode}-{bits}bit")
        return WeightFormat(name, "mlx", path / "model.safetensors", bits, group, mode, dense)
    qc = raw_config.get("quantization_config")
    hf_quant = path / "hf_quant_config.json"
    if hf_quant.exists() or (isinstance(qc, dict) and qc.get("quant_method") == "modelopt"):
        algo = (_json(hf_quant).get("quantization") or {}).get("quant_algo") if hf_quant.exists() else qc.get("quant_algo")
        if algo != "FP8":
            raise FormatError(f"hf_quant_config.json: quant_algo {algo!r} is not supported (only ModelOpt FP8)")
        return WeightFormat("fp8", "fp8", path / "model.safetensors", 8, None, None, dense)
    if qc is not None:
        raise FormatError(f'config.json: field "quantization_config" names a format basal-local cannot read '
                          f"({qc.get('quant_method') if isinstance(qc, dict) else qc!r})")
    return WeightFormat("bf16", "safetensors", path / "model.safetensors")


def _gguf_reader(file: Path):
    import gguf  # ~0.4 s to import: only for GGUF files

    try:
        return gguf.GGUFReader(str(file))
    except Exception as exc:  # a corrupt or cut file fails inside numpy's memmap or the header parser
        raise FormatError(f"{file.name}: not a GGUF file or truncated ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else 'unreadable'})") from None


def _gguf_format(file: Path) -> WeightFormat:
    reader = _gguf_reader(file)
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    matrix_types = Counter(t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) > 1)
    file_type = reader.fields.get("general.file_type")
    file_type = int(file_type.parts[-1][0]) if file_type is not None else None
    if file_type == 15 and set(matrix_types) <= {"Q4_K", "Q6_K", "Q8_0"}:  # llama.cpp's MOSTLY_Q4_K_M
        name, bits = "gguf-q4_k_m", 4
    elif set(matrix_types) <= {"Q8_0"}:
        name, bits = "gguf-q8_0", 8
    elif set(matrix_types) <= {"Q4_K", "Q6_K", "Q8_0"}:
        name, bits = "gguf-q4_k_m", 4
    else:
        name, bits = "gguf", 0
    dense = tuple(sorted({f"{t.name} ({t.tensor_type.name})" for t in reader.tensors
                          if t.name in ("token_embd.weight", "output.weight")}))
    return WeightFormat(name, "gguf", file, bits, None, None, dense, dict(counts))


def check_weights(fmt: WeightFormat, config) -> None:
    """Every tensor accounted for, with the dtype and shape its format implies; FormatError otherwise."""
    if fmt.family == "gguf":
        for _ in gguf_tensors(fmt, config, dequantize=False):
            pass
        return
    if fmt.family == "safetensors":  # the reference layout keeps directory.py's own check and messages
        try:
            return check_weight_names(config, read_safetensors_header(fmt.weights_file))
        except ModelLoadError as exc:
            raise FormatError(str(exc)) from None
    header = safetensors_header(fmt.weights_file)
    fname = fmt.weights_file.name
    expected = config.weight_shapes()
    seen = set()
    for name, shape in expected.items():
        stem = name[: -len(".weight")]
        quantized = fmt.family in ("mlx", "fp8") and is_projection(name) and name.endswith(".weight")
        if name not in header:
            raise FormatError(f"{fname}: missing tensor {name!r}")
        dtype, got = header[name]
        seen.add(name)
        if not quantized:
            if got != shape:
                raise FormatError(f"{fname}: tensor {name!r} has shape {got}, config.json implies {shape}")
            continue
        if fmt.family == "fp8":
            want = {name: ("F8_E4M3", shape), stem + ".weight_scale": ("F32", None), stem + ".input_scale": ("F32", None)}
        else:
            out_dim, in_dim = shape
            if in_dim % fmt.group_size:
                raise FormatError(f"{fname}: tensor {name!r} has {in_dim} inputs, not a multiple of the group size "
                                  f"{fmt.group_size} in config.json")
            groups = (out_dim, in_dim // fmt.group_size)
            want = {name: ("U32", (out_dim, in_dim * fmt.bits // 32)),
                    stem + ".scales": (("U8",) if fmt.mode != "affine" else ("BF16", "F16", "F32"), groups)}
            if fmt.mode == "affine":
                want[stem + ".biases"] = (("BF16", "F16", "F32"), groups)
        for key, (dtypes, want_shape) in want.items():
            if key not in header:
                raise FormatError(f"{fname}: missing tensor {key!r} (a {fmt.name} checkpoint needs it)")
            dtype, got = header[key]
            seen.add(key)
            if dtype not in (dtypes if isinstance(dtypes, tuple) else (dtypes,)):
                raise FormatError(f"{fname}: tensor {key!r} is {dtype}, a {fmt.name} checkpoint has {dtypes}")
            if want_shape is None and got not in ((), (1,)):
                raise FormatError(f"{fname}: tensor {key!r} has shape {got}, a per-tensor scale is a scalar")
            if want_shape is not None and got != want_shape:
                raise FormatError(f"{fname}: tensor {key!r} has shape {got}, expected {want_shape} for "
                                  f"{fmt.name} (bits {fmt.bits}, group size {fmt.group_size})")
    unknown = sorted(set(header) - seen)
    if unknown:
        raise FormatError(f"{fname}: unknown tensor {unknown[0]!r} ({len(unknown)} unknown in all)")


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)}; the truncation and corruption checks are weightfile.read_safetensors_header's."""
    try:  # the ports add packed words, scale bytes and float8 to the dtypes a safetensors file may hold
        read_safetensors_header(path, {**SAFETENSORS_ITEMSIZE, "U32": 4, "U8": 1, "F8_E4M3": 1})
    except ModelLoadError as exc:
        raise FormatError(str(exc)) from None
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        raw = json.loads(fh.read(size))
    return {k: (str(v["dtype"]), tuple(int(n) for n in v["shape"])) for k, v in raw.items() if k != "__metadata__"}


def gguf_tensors(fmt: WeightFormat, config, dequantize: bool = True) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, f32 NumPy array) per tensor, dequantized by the `gguf` package, q/k rows un-permuted."""
    from gguf.quants import dequantize as gguf_dequantize  # ~0.4 s to import: only for GGUF files

    reader = _gguf_reader(fmt.weights_file)
    fname = fmt.weights_file.name
    by_name = {t.name: t for t in reader.tensors}
    expected = config.weight_shapes()
    for hf, shape in expected.items():
        name = gguf_name(hf)
        t = by_name.pop(name, None)
        if t is None:
            raise FormatError(f"{fname}: missing tensor {name!r} ({hf})")
        got = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
        if got != shape:
            raise FormatError(f"{fname}: tensor {name!r} has shape {got}, config.json implies {shape}")
        if not dequantize:
            continue
        try:
            value = np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        except Exception as exc:
            raise FormatError(f"{fname}: tensor {name!r} ({t.tensor_type.name}) cannot be decoded "
                              f"({type(exc).__name__})") from None
        if hf.endswith(("q_proj.weight", "q_proj.bias")):
            value = unpermute_rope(value, config.num_attention_heads)
        elif hf.endswith(("k_proj.weight", "k_proj.bias")):
            value = unpermute_rope(value, config.num_key_value_heads)
        yield hf, value
    if by_name:
        raise FormatError(f"{fname}: unknown tensor {next(iter(by_name))!r} ({len(by_name)} unknown in all)")


def torch_tensors(fmt: WeightFormat, config, keep_fp8: bool = False) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, torch tensor) per weight, dequantized at load for the torch backend (bf16 passes as is).

    keep_fp8: a ModelOpt FP8 checkpoint's e4m3 weights as they are, each followed by its `weight_scale` and
    `input_scale` (f32 scalars, checked finite and positive) for the fp8 GEMMs (cuda_kernels/fp8.py)."""
    # torch (seconds to import, and an MLX install has none) and safetensors' torch loader: only for the torch
    # backend's load
    import torch
    from safetensors import safe_open

    if fmt.family == "mlx":
        raise FormatError(f"{fmt.weights_file.name}: an MLX port ({fmt.name}) runs on the MLX backend "
                          "(--backend mlx); the torch backend reads bf16, GGUF and FP8 checkpoints")
    if fmt.family == "gguf":
        for name, value in gguf_tensors(fmt, config):
            yield name, torch.from_numpy(np.array(value, copy=not value.flags.writeable))
        return
    with safe_open(str(fmt.weights_file), framework="pt") as fh:
        keys = set(fh.keys())
        for key in sorted(keys):
            if key.endswith((".weight_scale", ".input_scale")):
                continue
            t = fh.get_tensor(key)
            if fmt.family == "fp8" and t.dtype == torch.float8_e4m3fn:
                stem = key[: -len(".weight")]
                if keep_fp8:
                    yield key, t
                    for kind in (".weight_scale", ".input_scale"):
                        yield stem + kind, _fp8_scale(fh, fmt, stem + kind)
                    continue
                t = t.float() * _fp8_scale(fh, fmt, stem + ".weight_scale")
            yield key, t


def _fp8_scale(fh, fmt: WeightFormat, key: str):
    """A ModelOpt per-tensor scale as an f32 scalar tensor; FormatError unless finite and positive."""
    t = fh.get_tensor(key).float().reshape(())
    value = float(t)
    if not (value > 0 and value < float("inf")):
        raise FormatError(f"{fmt.weights_file.name}: tensor {key!r} is {value!r}, a scale must be finite and positive")
    return t


def calibration_file(path: Path, fmt: WeightFormat | None) -> tuple[Path | None, bool]:
    """(the calibration file a port uses, inherited): its own CALIBRATION.<engine>.json, else CALIBRATION.json."""
    family = fmt.family if fmt is not None else "safetensors"
    for name in CALIBRATION_FILES.get(family, ()):
        if (path / name).exists():
            return path / name, False
    base = path / "CALIBRATION.json"
    return (base if base.exists() else None), family in CALIBRATION_FILES


def port_summary(md) -> dict[str, Any]:
    """What `show`, `/v1/models` and the stats name: the format, its bits, what stays bf16, the calibration file."""
    fmt = md.format.describe() if md.format is not None else {"name": "bf16", "bits": 16}
    cal = md.calibration
    return {"format": fmt["name"], "bits": fmt["bits"], "dense_layers": fmt.get("dense_layers", []),
            "quantization": {k: fmt[k] for k in ("group_size", "mode", "tensor_types") if k in fmt},
            "calibration_file": cal.file, "calibration_inherited": cal.inherited}
