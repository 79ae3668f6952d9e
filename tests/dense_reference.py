"""A dense-mask reference of the packed tree forward, for the tests (never imported by the product).

Written from the visibility rule (docs/ARCHITECTURE.md): a query of block b sees the cached prefix of its row, every key of
an ancestor block, and its own block up to itself. The mask is built as a [T, S] boolean matrix from that rule
(not from the tile plan), and every layer is plain f32 torch over the backend's loaded weights, so it checks the
tile plan and the fused forward from outside.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def ancestors(block_parent: np.ndarray) -> np.ndarray:
    """anc[b, a]: block a is b or one of b's ancestors."""
    n = len(block_parent)
    anc = np.eye(n, dtype=bool)
    for b in range(n):
        if block_parent[b] >= 0:
            anc[b] |= anc[block_parent[b]]
    return anc


def dense_mask(batch, prefix_lengths: list[int]) -> torch.Tensor:
    """[T, P + T] visibility of the keys (the cached prefixes in order, then the forward's tokens)."""
    n, p = batch.num_tokens, sum(prefix_lengths)
    anc = ancestors(batch.block_parent)
    blk = batch.token_block
    order = np.arange(n)
    own = anc[blk][:, blk] & (order[None, :] <= order[:, None])
    pre = np.zeros((n, p), dtype=bool)
    offsets = np.concatenate([[0], np.cumsum(prefix_lengths)]).astype(int)
    for j in range(len(prefix_lengths)):
        pre[:, offsets[j]:offsets[j + 1]] = (batch.block_prefix[blk] == j)[:, None]
    return torch.from_numpy(np.concatenate([pre, own], axis=1))


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D], keys/values [S, Hkv, D], mask [T, S] -> [T, Hq, D] in f32."""
    rep = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(rep, 1).transpose(0, 1)
    v = values.float().repeat_interleave(rep, 1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k[None], v[None], attn_mask=mask)[0]
    return out.transpose(0, 1)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, positions: np.ndarray, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = theta ** (-np.arange(d // 2, dtype=np.float64) * 2.0 / d)
    ang = positions.astype(np.float64)[:, None] * inv[None, :]
    cos = torch.from_numpy(np.cos(np.concatenate([ang, ang], 1)).astype(np.float32))[:, None, :]
    sin = torch.from_numpy(np.sin(np.concatenate([ang, ang], 1)).astype(np.float32))[:, None, :]
    xf = x.float()
    return xf * cos + torch.cat([-xf[..., d // 2:], xf[..., :d // 2]], -1) * sin


def cached_kv(backend, key: str, length: int | None = None) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(tokens, per layer (K, V)) of a cached prefix's first `length` tokens, read from the torch backend's pool."""
    fwd = backend.fwd
    offset, n = fwd.prefix_rows[key]
    n = n if length is None else length
    return n, [(k[offset:offset + n], v[offset:offset + n]) for k, v in zip(fwd.prefix_k, fwd.prefix_v)]


@torch.inference_mode()
def forward(backend, batch) -> np.ndarray:
    """The letter logits [R, L] of a packed batch, over a CPU torch backend's weights and cached prefixes."""
    cfg = backend.config
    hq, hkv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    lengths = batch.prefix_lengths or [None] * len(batch.prefixes)
    prefixes = [cached_kv(backend, name, n) for name, n in zip(batch.prefixes, lengths)]
    mask = dense_mask(batch, [p[0] for p in prefixes])
    x = backend.embed_tokens[torch.from_numpy(batch.token_ids.astype(np.int64))]
    for i, layer in enumerate(backend.layers):
        h = _rms(x, layer.input_layernorm, eps)
        qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias)
        q = _rope(qkv[:, :hq * d].view(-1, hq, d), batch.positions, cfg.rope_theta)
        k = _rope(qkv[:, hq * d:(hq + hkv) * d].view(-1, hkv, d), batch.positions, cfg.rope_theta)
        v = qkv[:, (hq + hkv) * d:].view(-1, hkv, d).float()
        keys = torch.cat([p[1][i][0].float() for p in prefixes] + [k])
        values = torch.cat([p[1][i][1].float() for p in prefixes] + [v])
        attn = attention(q, keys, values, mask).reshape(-1, hq * d).to(x.dtype)
        x = x + F.linear(attn, layer.o_proj_weight, layer.o_proj_bias)
        h = _rms(x, layer.post_attention_layernorm, eps)
        gate, up = F.linear(h, layer.gate_up_weight, layer.gate_up_bias).float().chunk(2, -1)
        x = x + F.linear((F.silu(gate) * up).to(x.dtype), layer.down_proj_weight, layer.down_proj_bias)
    rows = torch.from_numpy(batch.readout_index.astype(np.int64))
    h = _rms(x[rows], backend.norm, eps).float()
    return (h @ backend.lm_head[torch.from_numpy(batch.letter_ids.astype(np.int64))].float().T).numpy()
