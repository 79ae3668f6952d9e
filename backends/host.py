"""The host side that every backend shares (NumPy only): the visibility rule, RoPE tables, the weight-fusion
plan and the strict load, the dtype rule (`PackedBatch.single` is the one-prompt forward).

Visibility: a query of block b sees the cached prefix of its row, then each ancestor block root
first, then its own block up to itself, which are exactly the positions 0..pos(query) of its own prompt.
`block_chains` gives those blocks in that order; the CUDA tile plan (`cuda_kernels/plan.py`) and the MLX
attention (`backends/mlx/tree_attention.py`: the kernel's key ranges, the twin's mask and subtree groups)
turn them into what they read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

# the checkpoint's tensors that loading fuses into one GEMM weight (Hugging Face names below model.layers.N.)
FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down_proj": ("mlp.down_proj",)}
NORMS = ("input_layernorm", "post_attention_layernorm")
LAYER_SLOTS = NORMS + tuple(f"{name}_{kind}" for name in FUSED for kind in ("weight", "bias"))


def tree_tokens(n_pre: int, sizes: Sequence[int], parents: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, block of each token, parent of each block) of blocks of these sizes after a cached prefix of
    n_pre rows, each block's positions continuing its parent's (parents precede children): a tree to test or
    time the tree attention on."""
    token_block = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    starts: list[int] = []
    for n_par in parents:
        starts.append(n_pre if n_par < 0 else starts[n_par] + sizes[n_par])
    positions = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, sizes)]).astype(np.int64)
    return positions, token_block, np.array(parents, np.int32)


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


def ancestor_matrix(block_parent: np.ndarray) -> np.ndarray:
    """anc[b, a] is True iff block a is b or an ancestor of b (parents precede children)."""
    n = len(block_parent)
    anc = np.zeros((n, n), dtype=bool)
    for b, chain in enumerate(block_chains(block_parent)):
        anc[b, chain] = True
    return anc


def subtree_groups(batch, prefix_lengths: list[int]):
    """Split a forward's queries into independent groups; None unless that at least halves the dense T x S work.

    Tokens of sibling subtrees never see each other, so a subtree can attend alone to its cached prefix, its
    ancestors' tokens and itself. Starting from the top-level subtrees, the largest subtree is split into its own
    block plus its children's subtrees while that lowers the padded work (groups x longest queries x longest
    keys). Returns (q_index [G, L], q_valid, k_index [G, S'], k_valid, token_slot [T]: where each token's output
    lands in the flattened [G * L] result); keys index [prefix 0 keys, prefix 1 keys, ..., batch tokens].
    """
    n = batch.num_tokens
    parent = batch.block_parent
    n_blocks = len(parent)
    if n_blocks < 2:
        return None
    start, end = block_bounds(batch.token_block, n_blocks)
    subtree_end = end.copy()
    children: list[list[int]] = [[] for _ in range(n_blocks)]
    for blk in range(n_blocks - 1, -1, -1):
        if parent[blk] >= 0:
            subtree_end[parent[blk]] = max(subtree_end[parent[blk]], subtree_end[blk])
            children[parent[blk]].insert(0, blk)
    offsets = np.concatenate([[0], np.cumsum(prefix_lengths)]).astype(np.int64)
    total_prefix = int(offsets[-1])
    ancestor_keys: list[np.ndarray] = []  # per block: the keys its queries see before their own block
    for chain in block_chains(parent):
        j = int(batch.block_prefix[chain[0]])
        head = [np.arange(offsets[j], offsets[j + 1])] if j >= 0 else []
        ancestor_keys.append(np.concatenate(head + [total_prefix + np.arange(start[c], end[c]) for c in chain[:-1]]
                                            + [np.zeros(0, np.int64)]))

    def group(blk: int, whole: bool) -> tuple[int, int, int, int, bool]:
        q_end = subtree_end[blk] if whole else end[blk]
        return (q_end - start[blk], len(ancestor_keys[blk]) + q_end - start[blk], blk, q_end, whole)

    def cost(groups) -> int:
        return len(groups) * max(g[0] for g in groups) * max(g[1] for g in groups)

    groups = [group(blk, True) for blk in range(n_blocks) if parent[blk] < 0]
    best, best_cost = list(groups), cost(groups)
    while len(groups) < 512:
        splittable = [g for g in groups if g[4] and children[g[2]]]
        if not splittable:
            break
        largest = max(splittable, key=lambda g: g[0])
        groups.remove(largest)
        groups.append(group(largest[2], False))
        groups.extend(group(c, True) for c in children[largest[2]])
        if cost(groups) < best_cost:
            best, best_cost = list(groups), cost(groups)
    if len(best) < 2 or best_cost > 0.5 * n * (total_prefix + n):
        return None
    l_max = max(g[0] for g in best)
    s_max = max(g[1] for g in best)
    q_index = np.zeros((len(best), l_max), dtype=np.int64)
    q_valid = np.zeros((len(best), l_max), dtype=bool)
    k_index = np.zeros((len(best), s_max), dtype=np.int64)
    k_valid = np.zeros((len(best), s_max), dtype=bool)
    token_slot = np.zeros(n, dtype=np.int64)
    for i, (length, keys, blk, q_end, _) in enumerate(best):
        queries = np.arange(start[blk], q_end)
        q_index[i, :length], q_valid[i, :length] = queries, True
        k_index[i, :keys] = np.concatenate([ancestor_keys[blk], total_prefix + queries])
        k_valid[i, :keys] = True
        token_slot[queries] = i * l_max + np.arange(length)
    return q_index, q_valid, k_index, k_valid, token_slot


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


class Layer:
    """One decoder layer's tensors by slot (LAYER_SLOTS; a bias slot is None where the model has none)."""

    __slots__ = LAYER_SLOTS

    def __init__(self, tensors: dict) -> None:
        for slot, tensor in tensors.items():
            setattr(self, slot, tensor)

    def tensors(self) -> list:
        return [t for t in (getattr(self, slot) for slot in LAYER_SLOTS) if t is not None]


class Checkpoint:
    """A checkpoint's tensors {Hugging Face name: tensor}, taken one by one (each through `convert`), strictly:
    a missing tensor, or one left over once the model is taken, is a ValueError naming it."""

    def __init__(self, tensors: dict, convert: Callable = lambda t: t, file: str = "model.safetensors") -> None:
        self.tensors, self.convert, self.file = tensors, convert, file

    def take(self, key: str):
        if key not in self.tensors:
            raise ValueError(f"{self.file}: missing tensor {key!r}")
        return self.convert(self.tensors.pop(key))

    def top(self) -> tuple:
        """(embed_tokens, norm, lm_head)."""
        return self.take("model.embed_tokens.weight"), self.take("model.norm.weight"), self.take("lm_head.weight")

    def layer(self, cfg, i: int, cat: Callable[[list], object]) -> dict:
        """Layer i's tensors by slot (LAYER_SLOTS): the norms, and the fused GEMM weights and biases (q/k/v and
        gate/up concatenated along the output dimension by `cat`)."""
        p = f"model.layers.{i}."
        out = {n: self.take(p + n + ".weight") for n in NORMS}
        biased = {"qkv": cfg.attention_bias, "o_proj": cfg.attention_bias, "gate_up": cfg.mlp_bias,
                  "down_proj": cfg.mlp_bias}
        for name, parts in FUSED.items():
            for kind in ("weight", "bias"):
                if kind == "bias" and not biased[name]:
                    out[f"{name}_bias"] = None
                    continue
                tensors = [self.take(f"{p}{part}.{kind}") for part in parts]
                out[f"{name}_{kind}"] = tensors[0] if len(tensors) == 1 else cat(tensors)
        return out

    def done(self) -> None:
        if self.tensors:
            raise ValueError(f"{self.file}: unknown tensor {next(iter(self.tensors))!r}")


def read_model(model_dir: Path):
    """(LlamaConfig, WeightFormat) of a model directory: config.json or a GGUF file's metadata, and the layout of
    its weights (model/formats.py), before any tensor is read."""
    from basal_local.model.config import LlamaConfig
    from basal_local.model.formats import detect_format, read_config

    raw_config = read_config(Path(model_dir))
    return LlamaConfig.from_dict(raw_config), detect_format(Path(model_dir), raw_config)


def resolve_dtype(dtype: str, device_is_cpu: bool, known: tuple[str, ...], backend: str) -> str:
    """`auto` is f32 on the CPU (the reference) and f16 on a GPU; anything not in `known` is refused."""
    if dtype == "auto":
        return "f32" if device_is_cpu else "f16"
    if dtype not in known:
        raise ValueError(f"unknown dtype {dtype!r} for the {backend} backend ({', '.join(known)})")
    return dtype
