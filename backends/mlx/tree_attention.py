"""Tree attention over a packed batch in MLX: the plain twin everywhere, the Metal kernel on Apple GPUs
(`ops.choose` picks one per backend).

Visibility (docs/ARCHITECTURE.md, `backends/host.py`): query t of block b sees the cached prefix keys of its
row, every key of an ancestor block, and the keys of its own block up to itself. `TwinAttention` evaluates that
rule as a boolean mask for `mx.fast.scaled_dot_product_attention`: per group of independent subtrees
(`host.subtree_groups`, padded into one batched call) where that at least halves the dense [T, S] work, else as
one dense [T, S] mask. (On `mlx[cpu]` the masked scores' `exp` is most of a forward's time, so scores that are
never visible are worth not making.) `MetalAttention` (`basal_local.metal_shaders`) reads the same rule as a
short list of key ranges per block, in prompt-position order (`host.block_chains`, as the CUDA tile plan does),
so it visits only visible keys.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import host
from ..base import PackedBatch


def block_key_ranges(batch: PackedBatch, prefix_lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per block, the key ranges a query of it may see, in prompt-position order.

    ranges [B, R, 3] int32: (first key, end key, prompt position of the first key) into the key array
    [prefix 0 keys, prefix 1 keys, ..., batch tokens]; n_ranges [B]. The own block is the last range
    (the kernel stops it at the query itself).
    """
    n_blocks = len(batch.block_parent)
    start, end = host.block_bounds(batch.token_block, n_blocks)
    offsets = np.concatenate([[0], np.cumsum(prefix_lengths)]).astype(np.int64)
    total_prefix = int(offsets[-1])
    chains: list[list[tuple[int, int, int]]] = []
    for blocks in host.block_chains(batch.block_parent):
        j = int(batch.block_prefix[blocks[0]])
        head = [(int(offsets[j]), int(offsets[j + 1]), 0)] if j >= 0 and prefix_lengths[j] > 0 else []
        chains.append(head + [(total_prefix + int(start[c]), total_prefix + int(end[c]),
                               int(batch.positions[min(start[c], batch.num_tokens - 1)])) for c in blocks])
    width = max(len(c) for c in chains)
    ranges = np.zeros((n_blocks, width, 3), dtype=np.int32)
    for b, chain in enumerate(chains):
        ranges[b, : len(chain)] = chain
    return ranges, np.array([len(c) for c in chains], dtype=np.int32)


class TwinAttention:
    """The twin, built once per forward; called per layer with f32 q [T, Hq, D], keys/values [S, Hkv, D] ->
    [T', Hq, D] (T' = len(rows) where given). segment=False keeps one dense mask (the reference its subtree
    groups are tested against)."""

    def __init__(self, batch: PackedBatch, prefix_lengths: list[int], segment: bool = True) -> None:
        n_blocks = len(batch.block_parent)
        ext = np.zeros((n_blocks, n_blocks + len(prefix_lengths)), dtype=bool)
        ext[:, :n_blocks] = host.ancestor_matrix(batch.block_parent)
        for j in range(len(prefix_lengths)):
            ext[:, n_blocks + j] = batch.block_prefix == j
        prefix_blocks = [np.full(n, n_blocks + j, dtype=np.int32) for j, n in enumerate(prefix_lengths)]
        total_prefix = sum(prefix_lengths)
        n = batch.num_tokens
        self.num_queries = n
        self.ext = mx.array(ext)
        self.q_block = batch.token_block.astype(np.int32)
        k_block = np.concatenate(prefix_blocks + [self.q_block])
        k_order = np.concatenate([np.full(total_prefix, -1, dtype=np.int32), np.arange(n, dtype=np.int32)])
        self.k_block, self.k_order = mx.array(k_block), mx.array(k_order)
        self._dense: mx.array | None = None
        self._segments = None
        groups = host.subtree_groups(batch, prefix_lengths) if segment else None
        if groups is not None:
            q_index, q_valid, k_index, k_valid, token_slot = groups
            mask = ext[self.q_block[q_index][:, :, None], k_block[k_index][:, None, :]]
            mask &= k_order[k_index][:, None, :] <= q_index[:, :, None]
            mask &= k_valid[:, None, :]
            mask[:, :, 0] |= ~q_valid  # padding rows see one key (no NaN); their output is dropped
            self._segments = (mx.array(q_index.reshape(-1).astype(np.int32)), mx.array(k_index.astype(np.int32)),
                              mx.array(mask[:, None]), mx.array(token_slot.astype(np.int32)))

    @property
    def grouped(self) -> bool:
        """Whether the queries attend in independent subtree groups (instead of one dense mask)."""
        return self._segments is not None

    def dense_mask(self, rows: np.ndarray | None = None) -> mx.array:
        """The [T, S] (or [len(rows), S]) boolean mask of the twin."""
        if rows is None and self._dense is not None:
            return self._dense
        queries = np.arange(self.num_queries, dtype=np.int32) if rows is None else rows.astype(np.int32)
        q_block = mx.array(self.q_block[queries])
        mask = self.ext[q_block][:, self.k_block] & (self.k_order[None, :] <= mx.array(queries)[:, None])
        if rows is None:
            self._dense = mask
        return mask

    def __call__(self, q: mx.array, keys: mx.array, values: mx.array, rows: np.ndarray | None = None) -> mx.array:
        if rows is not None:
            return sdpa_twin(q[mx.array(rows.astype(np.int32))], keys, values, self.dense_mask(rows))
        if self._segments is None:
            return sdpa_twin(q, keys, values, self.dense_mask())
        q_flat, k_index, mask, token_slot = self._segments
        n_groups, s_max = k_index.shape
        scale = 1.0 / float(np.sqrt(q.shape[-1]))
        qs = q[q_flat].reshape(n_groups, -1, *q.shape[1:]).transpose(0, 2, 1, 3)  # [G, Hq, L, D]
        ks, vs = (t[k_index.reshape(-1)].reshape(n_groups, s_max, *t.shape[1:]).transpose(0, 2, 1, 3)
                  for t in (keys, values))  # [G, Hkv, S', D]
        out = mx.fast.scaled_dot_product_attention(qs, ks, vs, scale=scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(-1, *q.shape[1:])[token_slot]


class MetalAttention:
    """The Metal kernel (Apple GPU only), built once per forward and called as the twin is: it reads the rule
    as each block's key ranges (`block_key_ranges`) and visits only visible keys."""

    def __init__(self, batch: PackedBatch, prefix_lengths: list[int]) -> None:
        self.num_queries = batch.num_tokens
        self.total_prefix = sum(prefix_lengths)
        self.q_block = batch.token_block.astype(np.int32)
        self.positions = batch.positions.astype(np.int32)
        self.ranges, self.n_ranges = block_key_ranges(batch, prefix_lengths)

    def __call__(self, q: mx.array, keys: mx.array, values: mx.array, rows: np.ndarray | None = None) -> mx.array:
        from basal_local.metal_shaders import tree_attention_metal

        queries = np.arange(self.num_queries, dtype=np.int32) if rows is None else rows.astype(np.int32)
        if rows is not None:
            q = q[mx.array(queries)]
        return tree_attention_metal(q, keys, values, self.q_block[queries], self.total_prefix + queries,
                                    self.positions[queries], self.ranges, self.n_ranges)


def sdpa_twin(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array) -> mx.array:
    """Dense-mask attention: q [T, Hq, D], keys/values [S, Hkv, D] (GQA native), mask [T, S] -> [T, Hq, D]."""
    scale = 1.0 / float(np.sqrt(q.shape[-1]))
    out = mx.fast.scaled_dot_product_attention(q.transpose(1, 0, 2)[None], keys.transpose(1, 0, 2)[None],
                                               values.transpose(1, 0, 2)[None], scale=scale, mask=mask[None, None])
    return out[0].transpose(1, 0, 2)


def random_tree_batch(rng: np.random.Generator, prefix_lengths: list[int], n_roots: int = 3,
                      children: int = 2) -> PackedBatch:
    """A small packed batch of random blocks (roots continuing the given prefixes, one level of children)."""
    parents, prefix_of, lengths = [], [], []
    for r in range(n_roots):
        root = len(parents)
        parents.append(-1)
        prefix = r % len(prefix_lengths) if prefix_lengths else -1
        prefix_of.append(prefix)
        lengths.append(int(rng.integers(3, 40)))
        for _ in range(children):
            parents.append(root)
            prefix_of.append(prefix)  # every block of a row continues the row's prefix
            lengths.append(int(rng.integers(1, 40)))
    token_block = np.concatenate([np.full(n, b, dtype=np.int32) for b, n in enumerate(lengths)])
    positions = []
    for b, n in enumerate(lengths):
        if parents[b] >= 0:
            first = int(positions[parents[b]][-1]) + 1
        else:
            first = prefix_lengths[prefix_of[b]] if prefix_of[b] >= 0 else 0
        positions.append(np.arange(first, first + n, dtype=np.int64))
    n_tokens = len(token_block)
    return PackedBatch(token_ids=np.zeros(n_tokens, dtype=np.int64), positions=np.concatenate(positions),
                       token_block=token_block, block_parent=np.array(parents, dtype=np.int32),
                       block_prefix=np.array(prefix_of, dtype=np.int32),
                       readout_index=np.array([n_tokens - 1], dtype=np.int64), letter_ids=np.array([0]),
                       prefixes=[f"p{j}" for j in range(len(prefix_lengths))])
