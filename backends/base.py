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

    @classmethod
    def prefix(cls, key: str, token_ids, offset: int = 0) -> PackedBatch:
        """One prompt whose K/V the forward keeps under `key` at pool row `offset` (a backend's `add_prefix`)."""
        batch = cls.single(token_ids)
        batch.fills = [Fill(key, offset, None, 0, np.arange(batch.num_tokens, dtype=np.int64))]
        return batch


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
    # `done()`, `result()` (the logits, waiting), `device_s()` (device seconds, or None) and `kind` (how it ran:
    # "eager", "graph", "graph captured now"; the batch's record shows it); the engine then overlaps host work
    # with device work (engine/engine.py)


class Ready:
    """A forward that already ran: the `launch` handle of a backend (or a path) that computes at once."""

    __slots__ = ("logits",)
    kind = "eager"

    def __init__(self, logits: np.ndarray) -> None:
        self.logits = logits

    def done(self) -> bool:
        return True

    def result(self) -> np.ndarray:
        return self.logits

    def device_s(self) -> float | None:
        return None
