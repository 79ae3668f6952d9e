"""Tree attention over a packed batch: a fused FlexAttention kernel on CUDA, its plain SDPA twin everywhere.

Visibility (docs/ARCHITECTURE.md): query t of block b sees the cached prefix keys of its row, every key of an ancestor
block, and the keys of its own block up to itself. Both implementations evaluate the same rule from the same
small tensors: an extended ancestor matrix over blocks plus one virtual block per cached prefix, the block of
every query and key, and each key's order (-1 for prefix keys, so they are visible to every query).
The twin builds the dense [T, S] boolean mask; the kernel builds a block mask and skips fully masked tiles,
so its work follows the tree instead of T x S.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from ..base import PackedBatch, ancestor_matrix, subtree_groups

log = logging.getLogger(__name__)
_compiled_flex = None
_flex_broken = False  # set once the compiled kernel failed on this machine: the twin takes over, counted
_flex_fallbacks = 0  # attention calls of a flex backend that the twin answered instead of the kernel


def flex_fallbacks() -> int:
    """Attention calls (layers) that fell back from the compiled FlexAttention kernel to the twin in this process.

    A kernel-vs-twin comparison is only a comparison when this stayed 0 (the tests assert it)."""
    return _flex_fallbacks


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _flex(compiled: bool):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention  # eager reference path (CPU tests)
    if _compiled_flex is None:
        # one compiled kernel for every token count (dynamic shapes), not one per shape
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


def sdpa_twin(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Dense-mask attention: q [..., Hq, T, D], keys/values [..., Hkv, S, D], mask broadcastable to [..., T, S]."""
    n_heads, n_kv = q.shape[-3], keys.shape[-3]
    if n_heads != n_kv:
        # GQA: explicit expansion keeps SDPA on its fused memory-efficient kernel, which takes any mask
        keys = keys.repeat_interleave(n_heads // n_kv, dim=-3)
        values = values.repeat_interleave(n_heads // n_kv, dim=-3)
    if q.dim() == 3:
        return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask)[0]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class StaticMaskAttention:
    """Attention with a mask held in a fixed buffer (inside a captured CUDA graph)."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def __call__(self, q, keys, values, rows=None) -> torch.Tensor:
        return sdpa_twin(q, keys, values, self.mask)


class TreeAttention:
    """Built once per forward; called once per layer with f32 q [Hq, T, D], keys/values [Hkv, S, D].

    The twin splits a forward into its independent subtrees when that at least halves the work."""

    def __init__(self, batch: PackedBatch, prefix_lengths: list[int], device: str, impl: str = "sdpa",
                 segment: bool = True) -> None:
        n_blocks = len(batch.block_parent)
        ext = np.zeros((n_blocks, n_blocks + len(prefix_lengths)), dtype=bool)
        ext[:, :n_blocks] = ancestor_matrix(batch.block_parent)
        for j in range(len(prefix_lengths)):
            ext[:, n_blocks + j] = batch.block_prefix == j
        prefix_blocks = [np.full(n, n_blocks + j, dtype=np.int64) for j, n in enumerate(prefix_lengths)]
        total_prefix = sum(prefix_lengths)
        n = batch.num_tokens
        self.impl = impl
        self.device = device
        self.num_queries = n
        self.num_keys = total_prefix + n
        self.ext = torch.from_numpy(ext).to(device)
        self.q_block = torch.from_numpy(batch.token_block.astype(np.int64)).to(device)
        self.k_block = torch.from_numpy(np.concatenate(prefix_blocks + [batch.token_block.astype(np.int64)])).to(device)
        self.k_order = torch.cat([torch.full((total_prefix,), -1, dtype=torch.int64),
                                  torch.arange(n, dtype=torch.int64)]).to(device)
        self._dense: torch.Tensor | None = None
        self._block_mask = None
        self._segments = self._segment(batch, prefix_lengths) if impl == "sdpa" and segment else None
        if impl == "flex":
            from torch.nn.attention.flex_attention import create_block_mask

            ext_t, q_block, k_block, k_order = self.ext, self.q_block, self.k_block, self.k_order

            def visible(b, h, q_idx, kv_idx):
                return ext_t[q_block[q_idx], k_block[kv_idx]] & (k_order[kv_idx] <= q_idx)

            self._block_mask = create_block_mask(visible, None, None, n, self.num_keys, device=device)

    def _segment(self, batch: PackedBatch, prefix_lengths: list[int]):
        """The queries in independent subtree groups (`base.subtree_groups`; STYLE: the plain twin, made
        affordable) with each group's mask on the device; None unless that at least halves the dense T x S work."""
        groups = subtree_groups(batch, prefix_lengths)
        if groups is None:
            return None
        q_index, q_valid, k_index, k_valid, token_slot = groups
        dev = self.device
        qi, ki = torch.from_numpy(q_index).to(dev), torch.from_numpy(k_index).to(dev)
        qv, kv = torch.from_numpy(q_valid).to(dev), torch.from_numpy(k_valid).to(dev)
        mask = self.ext[self.q_block[qi][:, :, None], self.k_block[ki][:, None, :]]
        mask &= self.k_order[ki][:, None, :] <= qi[:, :, None]
        mask &= kv[:, None, :]
        mask[:, :, 0] |= ~qv  # padding rows see one key (no NaN); their output is dropped
        return qi, ki, mask[:, None], torch.from_numpy(token_slot).to(dev)

    @property
    def grouped(self) -> bool:
        """Whether the queries attend in independent subtree groups (instead of one dense mask)."""
        return self._segments is not None

    def dense_mask(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The [T, S] (or [len(rows), S]) boolean mask of the twin."""
        if rows is None:
            if self._dense is None:
                q = torch.arange(self.num_queries, device=self.device)
                self._dense = self.ext[self.q_block][:, self.k_block] & (self.k_order[None, :] <= q[:, None])
            return self._dense
        return self.ext[self.q_block[rows]][:, self.k_block] & (self.k_order[None, :] <= rows[:, None])

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        n_heads, n_kv = q.shape[0], keys.shape[0]
        global _flex_broken, _flex_fallbacks
        if self.impl == "flex" and rows is None:
            if not _flex_broken:
                try:
                    # the prefill kernel always: the decoding variant has no f32 configuration
                    out = _flex(q.is_cuda)(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                           block_mask=self._block_mask, enable_gqa=n_heads != n_kv,
                                           kernel_options={"FORCE_USE_FLEX_ATTENTION": True})
                    return out[0]
                except Exception as exc:
                    if not q.is_cuda:
                        raise  # the eager path compiles nothing: its failure is a bug, never hidden
                    # a compiler failure must not fail requests; the twin is exact, and counted
                    _flex_broken = True
                    log.warning("FlexAttention kernel failed to compile (%s: %s); every later attention call "
                                "uses dense-mask SDPA (counted in flex_fallbacks())",
                                type(exc).__name__, str(exc).splitlines()[0][:200])
            _flex_fallbacks += 1
        if rows is None and self._segments is not None:
            q_index, k_index, mask, token_slot = self._segments
            out = sdpa_twin(q[:, q_index].transpose(0, 1), keys[:, k_index].transpose(0, 1),
                            values[:, k_index].transpose(0, 1), mask)  # [n_seg, Hq, L, D]
            return out.transpose(0, 1).reshape(n_heads, -1, q.shape[-1])[:, token_slot]
        if rows is not None:
            q = q[:, rows]
        return sdpa_twin(q, keys, values, self.dense_mask(rows))
