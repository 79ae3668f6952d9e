"""The Backend protocol and the backend-neutral PackedBatch (DESIGN.md "The Backend protocol").

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
    block_prefix: [B] index into `prefixes` of the cached template K/V the block's row continues, or -1
    readout_index: [R] the token whose logits are read (the last token of a prompt; identical prompts share)
    letter_ids: [L] the union of letter token ids of the batch; forward returns logits [R, L]
    prefixes: names of cached prefixes (the template per language) the backend holds K/V for
    """

    token_ids: np.ndarray
    positions: np.ndarray
    token_block: np.ndarray
    block_parent: np.ndarray
    block_prefix: np.ndarray
    readout_index: np.ndarray
    letter_ids: np.ndarray
    prefixes: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


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

    def add_prefix(self, key: str, token_ids: list[int]) -> None:
        """Compute and keep the K/V of a prefix (the template) that rows may continue."""

    def forward(self, batch: PackedBatch) -> np.ndarray:
        """Letter logits, float32, [len(readout_index), len(letter_ids)]."""

    def forward_steps(self, batch: PackedBatch) -> Iterator[np.ndarray | None]:
        """The same forward, yielding None after each layer and the logits last."""

    def memory(self) -> dict[str, int]: ...

    def final_hidden(self, token_ids: np.ndarray) -> np.ndarray:
        """Hidden states after the final RMSNorm of one plain causal forward (no cached prefix),
        float32 [T, hidden]: what the evidence head (PROTOCOL.md §6.8) reads."""

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
