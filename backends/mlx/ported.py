"""Weights of a shipped port for the MLX backend: the MLX ports stay quantized (mlx-lm layout, the checkpoint's
mode, bits and group size), GGUF is dequantized at load to the compute dtype by the `gguf` package.

`port_weights` returns {Hugging Face name: mx.array | Quantized}; `fuse` joins q/k/v or gate/up row-wise, which
keeps quantized groups intact (groups run along the input dimension). `planned_bytes` is what a load will hold,
from the files' headers alone (the `--gpu-memory` check before loading).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .quantize import Quantized

NATIVE_GGUF = {"Q8_0", "Q4_0", "F32", "F16"}  # the GGUF types mx.load reads as affine groups of 32
GGUF_BITS = {"Q8_0": 8, "Q4_0": 4}
GGUF_GROUP = 32
PACKED = {"U32": 4, "U8": 1}  # the packed words and nvfp4 scale bytes of an MLX port, held as they are on disk


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _packed(numel: int, bits: int, group: int, size: int) -> int:
    """Bytes of an affine-quantized matrix: its packed words, a scale and a bias per group in the compute dtype."""
    return numel * bits // 8 + 2 * (numel // group) * size


def native_gguf(fmt) -> bool:
    return fmt.family == "gguf" and set(fmt.tensor_types) <= NATIVE_GGUF


def planned_bytes(fmt, config, size: int, quantize_bits: int | None = None, group: int = 64) -> int:
    """The bytes of the weights a load of `fmt` holds, before any is read, for a compute dtype of `size` bytes.

    An MLX port keeps its packed words and nvfp4 scale bytes as on disk and turns every other tensor (affine
    scales and biases, embeddings, norms, head) into the compute dtype; a Q8_0 / Q4_0 GGUF keeps its decoder
    projections packed in groups of 32 (a scale and a bias each in the compute dtype) and decodes the rest; any
    other GGUF is dequantized whole; bf16 weights under `--dtype q8|q4` (`quantize_bits`) are packed in groups
    of `group` where the input size allows (quantize.quantized_layers), the rest dense."""
    from basal_local.model.formats import is_projection, safetensors_header

    if fmt.family == "mlx":
        return sum(_numel(shape) * PACKED.get(dtype, size) for dtype, shape in
                   safetensors_header(fmt.weights_file).values())
    if native_gguf(fmt):
        import gguf  # the file's header was read by detect_format: it opens

        total = 0
        for t in gguf.GGUFReader(str(fmt.weights_file)).tensors:
            n = _numel(t.shape)
            bits = GGUF_BITS.get(t.tensor_type.name)
            total += _packed(n, bits, GGUF_GROUP, size) if bits and t.name.startswith("blk.") else n * size
        return total
    total = 0
    for name, shape in config.weight_shapes().items():
        n = _numel(shape)
        quantized = quantize_bits and is_projection(name) and name.endswith(".weight") and shape[1] % group == 0
        total += _packed(n, quantize_bits, group, size) if quantized else n * size
    return total


def _native_gguf(fmt, config, dtype: mx.Dtype) -> dict[str, mx.array | Quantized]:
    """Q8_0 / Q4_0 GGUF as MLX reads it (affine, group 32): projections stay quantized, q/k rows back in the
    Hugging Face order (a row permutation keeps the groups); embeddings and head are decoded to `dtype`."""
    import numpy as np

    from basal_local.model.formats import FormatError, gguf_name, is_projection, unpermute_rope

    try:
        raw = mx.load(str(fmt.weights_file))
    except Exception as exc:
        raise FormatError(f"{fmt.weights_file.name}: MLX cannot read it ({type(exc).__name__})") from None
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    out: dict[str, mx.array | Quantized] = {}
    for name, shape in config.weight_shapes().items():
        key = gguf_name(name)
        stem = key[: -len(".weight")] if key.endswith(".weight") else None
        rope = next((n for proj, n in heads.items() if f".{proj}." in name), None)
        rows = mx.array(unpermute_rope(np.arange(shape[0]), rope)) if rope else None
        if stem is not None and stem + ".scales" in raw:
            parts = [raw.pop(key), raw.pop(stem + ".scales").astype(dtype), raw.pop(stem + ".biases").astype(dtype)]
            if rows is not None:
                parts = [p[rows] for p in parts]
            bits = parts[0].shape[1] * 32 // shape[1]  # packed uint32 words per row
            q = Quantized(*parts, bits, shape, GGUF_GROUP, "affine")
            if is_projection(name):
                out[name] = q
            else:  # embeddings and head: gathered by row, kept in the compute dtype
                out[name] = mx.dequantize(q.weight, q.scales, q.biases, group_size=GGUF_GROUP, bits=bits).astype(dtype)
        else:
            value = raw.pop(key).astype(dtype)
            out[name] = value[rows] if rows is not None else value
    if raw:
        raise FormatError(f"{fmt.weights_file.name}: unknown tensor {next(iter(raw))!r}")
    return out


def port_weights(fmt, config, dtype: mx.Dtype) -> dict[str, mx.array | Quantized]:
    from basal_local.model.formats import FormatError, gguf_tensors, is_projection

    if fmt.family == "gguf":
        if native_gguf(fmt):
            return _native_gguf(fmt, config, dtype)
        return {name: mx.array(value).astype(dtype) for name, value in gguf_tensors(fmt, config)}
    if fmt.family != "mlx":
        raise FormatError(f"{Path(fmt.weights_file).name}: a {fmt.name} checkpoint runs on the torch backend "
                          "(--backend torch); the MLX backend reads bf16, the MLX ports and GGUF")
    raw = mx.load(str(fmt.weights_file))
    out: dict[str, mx.array | Quantized] = {}
    for name, shape in config.weight_shapes().items():
        if is_projection(name) and name.endswith(".weight"):
            stem = name[: -len(".weight")]
            scales = raw.pop(stem + ".scales")
            biases = raw.pop(stem + ".biases", None)
            if fmt.mode == "affine":  # affine scales/biases compute in the run dtype; nvfp4's are e4m3 bytes
                scales, biases = scales.astype(dtype), biases.astype(dtype)
            out[name] = Quantized(raw.pop(name), scales, biases, fmt.bits, shape, fmt.group_size, fmt.mode)
        else:
            out[name] = raw.pop(name)
    return out  # check_weights accounted for every tensor before; leftovers are caught by the caller


def fuse(parts: list) -> mx.array | Quantized:
    if not isinstance(parts[0], Quantized):
        return mx.concatenate(parts, axis=0)
    first = parts[0]
    cat = lambda arrays: mx.concatenate(arrays, axis=0)  # noqa: E731
    biases = cat([p.biases for p in parts]) if first.biases is not None else None
    return Quantized(cat([p.weight for p in parts]), cat([p.scales for p in parts]), biases, first.bits,
                     (sum(p.shape[0] for p in parts), first.shape[1]), first.group_size, first.mode)
