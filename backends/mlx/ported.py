"""Weights of a shipped port for the MLX backend: the MLX ports stay quantized (mlx-lm layout, the checkpoint's
mode, bits and group size), GGUF is dequantized at load to the compute dtype by the `gguf` package.

`port_weights` returns {Hugging Face name: mx.array | Quantized}; `fuse` joins q/k/v or gate/up row-wise, which
keeps quantized groups intact (groups run along the input dimension).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .quantize import Quantized

NATIVE_GGUF = {"Q8_0", "Q4_0", "F32", "F16"}  # the GGUF types mx.load reads as affine groups of 32


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
            bits = parts[0].shape[1] * 32 // shape[1]
            q = Quantized(*parts, bits, shape, 32, "affine")
            if is_projection(name):
                out[name] = q
            else:  # embeddings and head: gathered by row, kept in the compute dtype
                out[name] = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=bits).astype(dtype)
        else:
            value = raw.pop(key).astype(dtype)
            out[name] = value[rows] if rows is not None else value
    if raw:
        raise FormatError(f"{fmt.weights_file.name}: unknown tensor {next(iter(raw))!r}")
    return out


def port_weights(fmt, config, dtype: mx.Dtype) -> dict[str, mx.array | Quantized]:
    from basal_local.model.formats import FormatError, gguf_tensors, is_projection

    if fmt.family == "gguf":
        if set(fmt.tensor_types) <= NATIVE_GGUF:
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
