"""Plain-torch twins of the Triton kernels: the same function, written for clarity (and CPU tests).

Each twin takes the same arguments as its kernel launcher in `kernels.py` and computes in f32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import quant_rows, quant_static  # noqa: F401  (the twins of kernels.quant_rows, kernels.quant_static)
from .plan import TilePlan


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: torch.Tensor,
                   prefix_v: torch.Tensor, positions: torch.Tensor, plan: TilePlan, out_rows: int,
                   compact: bool = False) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D], prefix_k/v [P, Hkv, D] -> [out_rows, Hq, D] in q's dtype.

    With `compact`, output row i is the i-th query of the plan (q_rows order), else the token q_rows[i]."""
    n_heads, n_kv, d = q.shape[1], k.shape[1], q.shape[2]
    out = torch.zeros(out_rows, n_heads, d, dtype=q.dtype, device=q.device)
    # once, not per tile: the table as plain ints, the queries and their positions in the plan's order, K and V
    # side by side ([T, 2 Hkv, D]: one gather and one head repeat a tile for both); a tile writes its slice of
    # `result`. On the CPU this twin is the forward's attention, and per-tile steps cost more than a small tile
    tiles = [rec[:6] + [rec[2]] + rec[8:8 + 3 * rec[5]] for rec in plan.tiles.tolist()]
    if not tiles:
        return out
    # the queries the tiles hold (a graph's table is longer: the rest is padding)
    n_queries = max(rec[0] + rec[1] for rec in tiles)
    q_rows = torch.as_tensor(plan.q_rows[:n_queries], dtype=torch.long, device=q.device)
    query_pos = positions.long()[q_rows]
    queries = q[q_rows].float().transpose(0, 1)  # [Hq, Q, D] in the plan's order
    result = torch.empty(n_queries, n_heads, d, dtype=q.dtype, device=q.device)  # the same order
    key_pos = torch.arange(max(rec[6] for rec in tiles), device=q.device)
    kv = torch.cat([k, v], 1)
    prefix_kv: dict[tuple[int, int], torch.Tensor] = {}
    for q_off, n_q, _, n_pre, pre_off, n_r, n_keys, *ranges in tiles:
        pieces = []
        if n_pre:
            if (pre_off, n_pre) not in prefix_kv:
                prefix_kv[pre_off, n_pre] = torch.cat([prefix_k[pre_off:pre_off + n_pre],
                                                       prefix_v[pre_off:pre_off + n_pre]], 1)
            pieces.append(prefix_kv[pre_off, n_pre])
        for r in range(n_r):
            _, ts, ln = ranges[3 * r: 3 * r + 3]
            pieces.append(kv[ts:ts + ln])
        keys = (pieces[0] if len(pieces) == 1 else torch.cat(pieces))[:n_keys]
        assert keys.shape[0] == n_keys, "key ranges do not cover the tile's positions"
        # [2 Hq, S, D]: each K/V head repeated for its query heads, K's heads first
        both = keys.float().transpose(0, 1).repeat_interleave(n_heads // n_kv, 0)
        mask = key_pos[None, :n_keys] <= query_pos[q_off:q_off + n_q, None]
        o = F.scaled_dot_product_attention(queries[None, :, q_off:q_off + n_q], both[None, :n_heads],
                                           both[None, n_heads:], attn_mask=mask)[0]
        result[q_off:q_off + n_q] = o.transpose(0, 1)
    if compact:
        out[:n_queries] = result
    else:
        out[q_rows] = result
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + delta), x + delta), the sum rounded to x's dtype as the residual stream is;
    `out_rows` > x's rows: the normed output that tall, its first rows the result (for a padded GEMM)."""
    if delta is not None:
        x = x + delta
    xf = x.float()
    h = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return _taller(h, out_rows), x


def _taller(y: torch.Tensor, out_rows: int | None) -> torch.Tensor:
    """y, or a block of `out_rows` rows whose first rows are y (the rest unwritten)."""
    if out_rows is None or out_rows <= y.shape[0]:
        return y
    out = y.new_empty(out_rows, y.shape[1])
    out[:y.shape[0]] = y
    return out


def rope_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
          n_kv: int, head_dim: int, fill: torch.Tensor | None = None, pool_k: torch.Tensor | None = None,
          pool_v: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate-half RoPE in place on the q and k heads of a fused qkv [T, (Hq + 2 Hkv) * D] (f32 math).

    cos/sin: [max_position, D/2] f32 tables (computed in f64 on the host). `fill` (int32 per token: pool row + 1,
    0 for none): those tokens' K (rotated) and V also go to their rows of pool_k / pool_v [rows, Hkv, D]."""
    t = qkv.shape[0]
    heads = qkv.view(t, -1, head_dim)[:, : n_heads + n_kv]
    half = head_dim // 2
    c = cos[positions.long()][:, None, :]
    s = sin[positions.long()][:, None, :]
    x1, x2 = heads[..., :half].float(), heads[..., half:].float()
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    heads.copy_(rotated.to(qkv.dtype))
    if fill is not None and pool_k is not None:
        tokens = torch.nonzero(fill[:t]).flatten()
        if tokens.numel():
            rows = fill[tokens].long() - 1
            kv = qkv.view(t, -1, head_dim)
            pool_k[rows] = kv[tokens, n_heads:n_heads + n_kv]
            pool_v[rows] = kv[tokens, n_heads + n_kv:n_heads + 2 * n_kv]
    return qkv


def silu_mul(gate_up: torch.Tensor, out_rows: int | None = None) -> torch.Tensor:
    """silu(gate) * up of a fused [T, 2I] gate/up, in f32, rounded once; `out_rows` > T: an output of that
    many rows whose first T are the result (the rest unwritten, for a padded GEMM after it)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return _taller((F.silu(gate) * up).to(gate_up.dtype), out_rows)


def letter_logits(h: torch.Tensor, lm_head: torch.Tensor, letters: torch.Tensor) -> torch.Tensor:
    """f32 dot products of the readout rows with the letters' lm_head rows: [R, L]."""
    return h.float() @ lm_head[letters].float().T
