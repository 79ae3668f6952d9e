"""Metal kernels for the MLX backend, through `mx.fast.metal_kernel` (Apple GPUs only).

The `.metal` files beside this module are kernel bodies (MLX generates the signatures from the input and
output names). Each kernel has a plain-MLX twin that the CPU and CI run: tree attention's is
`backends/mlx/tree_attention.py:sdpa_twin`, the fused RMSNorm + residual's is `rms_norm_residual_twin`.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import numpy as np

TREE_ATTENTION_INPUTS = ["q", "keys", "values", "q_block", "q_key", "q_pos", "ranges", "n_ranges"]
RMS_NORM_RESIDUAL_INPUTS = ["x", "residual", "weight", "eps"]


def source(name: str) -> str:
    """The text of a bundled `.metal` kernel body."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def metal_available() -> bool:
    try:
        import mlx.core as mx

        return bool(mx.metal.is_available())
    except Exception:
        return False


@cache
def _kernel(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...]):
    import mlx.core as mx

    return mx.fast.metal_kernel(name=name.removesuffix(".metal"), input_names=list(inputs),
                                output_names=list(outputs), source=source(name))


def tree_attention_kernel():
    return _kernel("tree_attention.metal", tuple(TREE_ATTENTION_INPUTS), ("out",))


def tree_attention_metal(q, keys, values, q_block: np.ndarray, q_key: np.ndarray, q_pos: np.ndarray,
                         ranges: np.ndarray, n_ranges: np.ndarray):
    """Tree attention on the GPU: q [TQ, Hq, D], keys/values [S, Hkv, D] (cast to f32) -> [TQ, Hq, D] f32.

    q_block/q_key/q_pos: each query's block, own key index and prompt position; ranges/n_ranges: from
    `backends.mlx.tree_attention.block_key_ranges`."""
    import mlx.core as mx

    tq, hq, d = q.shape
    hkv = keys.shape[1]
    arrays = [q.astype(mx.float32), keys.astype(mx.float32), values.astype(mx.float32),
              mx.array(q_block.astype(np.int32)), mx.array(np.asarray(q_key, dtype=np.int32)),
              mx.array(q_pos.astype(np.int32)), mx.array(ranges.astype(np.int32)),
              mx.array(n_ranges.astype(np.int32))]
    (out,) = tree_attention_kernel()(
        inputs=arrays, template=[("D", d), ("HQ", hq), ("HKV", hkv), ("R", int(ranges.shape[1])),
                                 ("DPL", (d + 31) // 32)],
        grid=(32, hq, tq), threadgroup=(32, 1, 1), output_shapes=[(tq, hq, d)], output_dtypes=[mx.float32])
    return out


def rms_norm_residual_kernel():
    return _kernel("rms_norm_residual.metal", tuple(RMS_NORM_RESIDUAL_INPUTS), ("out", "summed"))


def rms_norm_residual_metal(x, residual, weight, eps: float):
    """(rms_norm(x + residual) * weight, x + residual) in one pass per row; x/residual [T, H]."""
    import mlx.core as mx

    t, hidden = x.shape
    threads = 256 if hidden >= 256 else 32
    out, summed = rms_norm_residual_kernel()(
        inputs=[x, residual.astype(x.dtype), weight.astype(x.dtype), mx.array([eps], dtype=mx.float32)],
        template=[("T", x.dtype), ("H", hidden), ("THREADS", threads)], grid=(threads, t, 1),
        threadgroup=(threads, 1, 1), output_shapes=[(t, hidden), (t, hidden)], output_dtypes=[x.dtype, x.dtype])
    return out, summed


def rms_norm_residual_twin(x, residual, weight, eps: float):
    """The plain-MLX twin of the fused kernel."""
    import mlx.core as mx

    summed = x + residual.astype(x.dtype)
    return mx.fast.rms_norm(summed, weight.astype(x.dtype), eps), summed
