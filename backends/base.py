"""The Backend protocol and the backend-neutral PackedBatch (docs/ARCHITECTURE.md "Torch backend").

Nothing but NumPy crosses this boundary: the packer produces a PackedBatch, a backend turns it into letter
logits. No framework is imported here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np


@dataclass
class PackedBatch:
    """One forward: several prefix-tree rows of prompts, flattened depth-first (parent blocks first).

    token_ids, positions, token_block: [T] (positions = the token's index in its own prompt)
    block_parent: [B] parent block or -1 for a row root; blocks are in DFS pre-order
    block_prefix: [B] index into `prefixes` of the cached K/V the block's row continues, or -1
    readout_index: [R] the token whose logits are read (the last token of a prompt; identical prompts share)
    letter_ids: [L] the union of letter token ids of the batch; forward returns logits [R, L]
    prefixes: names of cached prefixes (a template, or a template + state of the state cache) the backend
        holds K/V for; prefix_lengths: how many of each one's first tokens the rows continue (empty: all)
    fills: K/V this forward stores for later batches (the state cache, engine/prefix_cache.py)
    """

    token_ids: np.ndarray
    positions: np.ndarray
    token_block: np.ndarray
    block_parent: np.ndarray
    block_prefix: np.ndarray
    readout_index: np.ndarray
    letter_ids: np.ndarray
    prefixes: list[str] = field(default_factory=list)
    prefix_lengths: list[int] = field(default_factory=list)
    fills: list[Fill] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @classmethod
    def single(cls, token_ids, readout: str = "last") -> PackedBatch:
        """One prompt as a forward of its own, no cached prefix; read out at its last token or at every one."""
        ids = np.asarray(token_ids, dtype=np.int64).ravel()
        n = int(ids.shape[0])
        rows = np.arange(n, dtype=np.int64) if readout == "all" else np.array([n - 1], dtype=np.int64)
        return cls(token_ids=ids, positions=np.arange(n, dtype=np.int64), token_block=np.zeros(n, dtype=np.int32),
                   block_parent=np.array([-1], dtype=np.int32), block_prefix=np.array([-1], dtype=np.int32),
                   readout_index=rows, letter_ids=np.array([0], dtype=np.int64), prefixes=[])


@dataclass
class Fill:
    """Store a prefix's K/V in the backend's pool rows offset .. offset + parent_len + len(tokens) - 1: the first
    parent_len rows copied from the cached prefix `parent`, the rest the K/V this forward computes at its
    token indices `tokens` (in position order). Backends without a pool keep them under `name`."""

    name: str
    offset: int
    parent: str | None
    parent_len: int
    tokens: np.ndarray

    @property
    def length(self) -> int:
        return self.parent_len + int(self.tokens.shape[0])


@dataclass
class ModelInfo:
    layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    device: str
    parameters: int
    memory_bytes: int


class Backend(Protocol):
    name: str
    device: str

    def load(self, model_dir: Path, dtype: str) -> ModelInfo: ...

    def add_prefix(self, key: str, token_ids: list[int], offset: int | None = None) -> None:
        """Compute and keep the K/V of a prefix (a template) that rows may continue; `offset`: at these rows of
        the pool `open_cache` made (None: wherever the backend puts it, growing its store)."""

    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's cached K/V over every layer."""

    def open_cache(self, capacity: int) -> None:
        """Hold K/V for `capacity` tokens of cached prefixes (before warmup: CUDA graphs read the pool)."""

    def drop_prefix(self, key: str) -> None:
        """Forget a cached prefix (its rows may be reused)."""

    def forward(self, batch: PackedBatch) -> np.ndarray:
        """Letter logits, float32, [len(readout_index), len(letter_ids)]."""

    def forward_steps(self, batch: PackedBatch) -> Iterator[np.ndarray | None]:
        """The same forward, yielding None after each layer and the logits last."""

    def memory(self) -> dict[str, int]: ...

    def final_hidden(self, token_ids: np.ndarray) -> np.ndarray:
        """Hidden states after the final RMSNorm of one plain causal forward (no cached prefix),
        float32 [T, hidden]: what the evidence head (docs/PROTOCOL.md §6.8) reads."""

    # optional: `warmup(max_tokens)` prepares shapes (CUDA graphs) before the first request
    # optional: `launch(batch)` hands the forward to the device without waiting and returns a handle with
    # `done()`, `result()` (the logits, waiting) and `device_s()` (device seconds, or None); the engine then
    # overlaps host work with device work (engine/engine.py)


class Ready:
    """A forward that already ran: the `launch` handle of a backend (or a path) that computes at once."""

    __slots__ = ("logits",)

    def __init__(self, logits: np.ndarray) -> None:
        self.logits = logits

    def done(self) -> bool:
        return True

    def result(self) -> np.ndarray:
        return self.logits

    def device_s(self) -> float | None:
        return None


def ancestor_matrix(block_parent: np.ndarray) -> np.ndarray:
    """anc[b, a] is True iff block a is b or an ancestor of b (parents precede children)."""
    n = block_parent.shape[0]
    anc = np.eye(n, dtype=bool)
    for b in range(n):
        parent = block_parent[b]
        if parent >= 0:
            anc[b] |= anc[parent]
    return anc


def subtree_groups(batch: PackedBatch, prefix_lengths: list[int]):
    """Split a forward's queries into independent groups; None unless that at least halves the dense T x S work.

    Tokens of sibling subtrees never see each other, so a subtree can attend alone to its cached prefix, its
    ancestors' tokens and itself. Starting from the top-level subtrees, the largest subtree is split into its own
    block plus its children's subtrees while that lowers the padded work (groups x longest queries x longest
    keys). Pure NumPy: the torch and MLX twins share it. Returns (q_index [G, L], q_valid, k_index [G, S'], k_valid,
    token_slot [T]: where each token's output lands in the flattened [G * L] result).
    """
    n = batch.num_tokens
    parent = batch.block_parent
    n_blocks = len(parent)
    if n_blocks < 2:
        return None
    start = np.searchsorted(batch.token_block, np.arange(n_blocks))
    end = np.append(start[1:], n)
    subtree_end = end.copy()
    children: list[list[int]] = [[] for _ in range(n_blocks)]
    for blk in range(n_blocks - 1, -1, -1):
        if parent[blk] >= 0:
            subtree_end[parent[blk]] = max(subtree_end[parent[blk]], subtree_end[blk])
            children[parent[blk]].insert(0, blk)
    offsets = np.concatenate([[0], np.cumsum(prefix_lengths)]).astype(np.int64)
    total_prefix = int(offsets[-1])
    ancestor_keys: list[np.ndarray] = []
    for blk in range(n_blocks):
        if parent[blk] >= 0:
            p = parent[blk]
            ancestor_keys.append(np.concatenate([ancestor_keys[p], total_prefix + np.arange(start[p], end[p])]))
        else:
            j = int(batch.block_prefix[blk])
            ancestor_keys.append(np.arange(offsets[j], offsets[j + 1]) if j >= 0 else np.zeros(0, np.int64))

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
