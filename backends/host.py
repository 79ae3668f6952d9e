"""The host side that every backend shares (NumPy only): the visibility rule, RoPE tables, the weight-fusion
plan, the dtype rule (`PackedBatch.single` is the one-prompt forward).

Visibility: a query of block b sees the cached prefix of its row, then each ancestor block root
first, then its own block up to itself, which are exactly the positions 0..pos(query) of its own prompt.
`block_chains` gives those blocks in that order; the CUDA tile plan (`cuda_kernels/plan.py`) and the MLX
attention (`backends/mlx/tree_attention.py`) turn them into their key ranges.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# the checkpoint's tensors that loading fuses into one GEMM weight (Hugging Face names below model.layers.N.)
FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down_proj": ("mlp.down_proj",)}
NORMS = ("input_layernorm", "post_attention_layernorm")
LAYER_SLOTS = NORMS + tuple(f"{name}_{kind}" for name in FUSED for kind in ("weight", "bias"))


def block_bounds(token_block: np.ndarray, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Each block's first token and the token after its last (blocks are contiguous, in order)."""
    start = np.searchsorted(token_block, np.arange(n_blocks)).astype(np.int64)
    end = np.append(start[1:], token_block.shape[0]).astype(np.int64)
    return start, end


def block_chains(block_parent) -> list[list[int]]:
    """Per block, the blocks its queries see: its ancestors root first, then itself (parents precede children;
    plain lists: a forward has a handful of blocks and NumPy's per-call cost would dominate)."""
    chains: list[list[int]] = []
    for b, p in enumerate(np.asarray(block_parent).tolist()):
        chains.append((chains[p] if p >= 0 else []) + [b])
    return chains


def inv_freq(cfg) -> np.ndarray:
    """RoPE's inverse frequencies [head_dim / 2] in float64."""
    half = cfg.head_dim // 2
    return cfg.rope_theta ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.head_dim)


def rope_angles(positions: np.ndarray, freqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [T, head_dim / 2] as float32, computed in float64 (a table for every position 0..T-1 when
    `positions` is an arange)."""
    angles = np.asarray(positions, dtype=np.float64)[:, None] * freqs[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_tables(cfg) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_position_embeddings, head_dim / 2] f32: the forward gathers a token's row by position."""
    return rope_angles(np.arange(cfg.max_position_embeddings), inv_freq(cfg))


def load_layer(take: Callable[[str], object], cat: Callable[[list], object], cfg, i: int) -> dict:
    """Layer i's tensors by slot (LAYER_SLOTS): the norms, and the fused GEMM weights and biases (q/k/v and
    gate/up concatenated along the output dimension by `cat`); `take(name)` pops one checkpoint tensor."""
    p = f"model.layers.{i}."
    out = {n: take(p + n + ".weight") for n in NORMS}
    biased = {"qkv": cfg.attention_bias, "o_proj": cfg.attention_bias, "gate_up": cfg.mlp_bias,
              "down_proj": cfg.mlp_bias}
    for name, parts in FUSED.items():
        for kind in ("weight", "bias"):
            if kind == "bias" and not biased[name]:
                out[f"{name}_bias"] = None
                continue
            tensors = [take(f"{p}{part}.{kind}") for part in parts]
            out[f"{name}_{kind}"] = tensors[0] if len(tensors) == 1 else cat(tensors)
    return out


def resolve_dtype(dtype: str, device_is_cpu: bool, known: tuple[str, ...], backend: str) -> str:
    """`auto` is f32 on the CPU (the reference) and f16 on a GPU; anything not in `known` is refused."""
    if dtype == "auto":
        return "f32" if device_is_cpu else "f16"
    if dtype not in known:
        raise ValueError(f"unknown dtype {dtype!r} for the {backend} backend ({', '.join(known)})")
    return dtype
