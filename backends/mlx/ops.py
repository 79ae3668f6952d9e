"""The MLX forward's ops, chosen once: the Metal kernels on an Apple GPU (`basal_local.metal_shaders`), their
plain-MLX twins elsewhere (the CPU with `mlx[cpu]`), and the twin wherever a kernel fails its check against it
at warm-up.

`Ops` holds the choice (tree attention, residual add + RMSNorm); the weights hold theirs from load: each
projection is a `Dense` matrix or a `quantize.Quantized` one, and the forward calls `matmul` on either.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from .tree_attention import MetalAttention, TwinAttention, random_tree_batch

log = logging.getLogger(__name__)


class Dense:
    """A weight matrix [out, in] in the compute dtype, with `quantize.Quantized`'s interface."""

    __slots__ = ("weight",)

    def __init__(self, weight: mx.array) -> None:
        self.weight = weight

    def matmul(self, x: mx.array) -> mx.array:
        """x @ W.T for x [T, in]."""
        return x @ self.weight.T

    def arrays(self) -> list[mx.array]:
        return [self.weight]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    @property
    def size(self) -> int:
        return self.weight.size


def add_rms_norm(x: mx.array, delta: mx.array | None, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """(weight * rms_norm(x + delta), x + delta), the sum in x's dtype as the residual stream is: the twin."""
    summed = x if delta is None else x + delta
    return mx.fast.rms_norm(summed, weight, eps), summed


def add_rms_norm_metal(x: mx.array, delta: mx.array | None, weight: mx.array,
                       eps: float) -> tuple[mx.array, mx.array]:
    """`add_rms_norm` as one Metal kernel per row (`rms_norm_residual.metal`)."""
    if delta is None:
        return mx.fast.rms_norm(x, weight, eps), x
    from basal_local.metal_shaders import rms_norm_residual_metal

    return rms_norm_residual_metal(x, delta, weight, eps)


class Ops:
    """The ops of one backend: `attention` "metal" (the kernel) or "sdpa" (the twin), `norm` "metal" or "twin"."""

    def __init__(self, attention: str, norm: str) -> None:
        self.attention, self.norm = attention, norm
        self.tree_attention = MetalAttention if attention == "metal" else TwinAttention
        self.add_rms_norm = add_rms_norm_metal if norm == "metal" else add_rms_norm

    def describe(self) -> dict[str, str]:
        return {"attention": self.attention, "norm": self.norm}


def choose(device: str, attention: str) -> Ops:
    """The kernels on Metal ("auto"), the twins on the CPU; `attention` "metal" or "sdpa" forces one."""
    if attention == "auto":
        # the kernels are packing-invariant by construction; warm-up checks them against the twins first
        attention = "metal" if device == "metal" else "sdpa"
    if attention not in ("sdpa", "metal"):
        raise ValueError(f"unknown attention {attention!r} for the MLX backend (sdpa or metal)")
    if attention == "metal" and device != "metal":
        raise ValueError("the Metal tree-attention kernel needs --device mps")
    return Ops(attention, "metal" if device == "metal" else "twin")


def checked(ops: Ops, n_heads: int, n_kv: int, head_dim: int, hidden: int, dtype: mx.Dtype) -> Ops:
    """`ops` with each Metal kernel that does not match its twin replaced by the twin (a warning says why)."""
    attention, norm = ops.attention, ops.norm
    if attention == "metal":
        ok, why = attention_matches_twin(n_heads, n_kv, head_dim)
        if not ok:
            log.warning("Metal tree-attention kernel not used (%s); using the dense-mask twin", why)
            attention = "sdpa"
    if norm == "metal":
        ok, why = norm_matches_twin(hidden, dtype)
        if not ok:
            log.warning("Metal residual + RMSNorm kernel not used (%s); using mx.fast.rms_norm", why)
            norm = "twin"
    return ops if (attention, norm) == (ops.attention, ops.norm) else Ops(attention, norm)


def _failed(exc: Exception) -> str:
    """A kernel's compile or launch failure in one line (it must not fail requests: the twin is exact)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def attention_matches_twin(n_heads: int, n_kv: int, head_dim: int, tolerance: float = 1e-4) -> tuple[bool, str]:
    """Run the Metal tree-attention kernel and the twin on one random tree; (agree, why not)."""
    rng = np.random.default_rng(0)
    prefix_lengths = [37, 21]
    batch = random_tree_batch(rng, prefix_lengths)
    s = sum(prefix_lengths) + batch.num_tokens
    q = mx.array(rng.standard_normal((batch.num_tokens, n_heads, head_dim)).astype(np.float32))
    k = mx.array(rng.standard_normal((s, n_kv, head_dim)).astype(np.float32))
    v = mx.array(rng.standard_normal((s, n_kv, head_dim)).astype(np.float32))
    try:
        with mx.stream(mx.gpu):
            kernel = np.array(MetalAttention(batch, prefix_lengths)(q, k, v))
            twin = np.array(TwinAttention(batch, prefix_lengths)(q, k, v))
    except Exception as exc:
        return False, _failed(exc)
    diff = float(np.abs(kernel - twin).max())
    return diff <= tolerance, f"max |kernel - twin| = {diff:.3g}"


def norm_matches_twin(hidden: int, dtype: mx.Dtype) -> tuple[bool, str]:
    """Run the Metal residual + RMSNorm kernel and the twin on random rows of the model's width and dtype: the
    sums equal, the normed rows within the dtype's rounding, a row alone equal to it amid others."""
    rng = np.random.default_rng(0)
    x, delta = (mx.array(rng.standard_normal((37, hidden)).astype(np.float32)).astype(dtype) for _ in range(2))
    weight = mx.array((1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)).astype(dtype)
    tolerance = 1e-5 if dtype == mx.float32 else 2e-2
    try:
        with mx.stream(mx.gpu):
            out, summed = (np.array(a.astype(mx.float32)) for a in add_rms_norm_metal(x, delta, weight, 1e-6))
            ref, ref_summed = (np.array(a.astype(mx.float32)) for a in add_rms_norm(x, delta, weight, 1e-6))
            alone = np.array(add_rms_norm_metal(x[5:6], delta[5:6], weight, 1e-6)[0].astype(mx.float32))
    except Exception as exc:
        return False, _failed(exc)
    diff = float(np.abs(out - ref).max())
    ok = diff <= tolerance and np.array_equal(summed, ref_summed) and np.array_equal(alone, out[5:6])
    return ok, f"max |kernel - twin| = {diff:.3g}"
