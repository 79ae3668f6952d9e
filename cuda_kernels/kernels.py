"""Triton kernels (imported only where Triton and a GPU exist); each has a twin in `twins.py`.

Every kernel's reduction order is fixed by compile-time constants and never by the number of rows, so a
row's result is the same bits alone or in any batch (docs/PROTOCOL.md §10):
- tree attention: keys in tiles of BLOCK_N *positions* (plan.py), online softmax in f32, f16/bf16 operands,
  chunks of CHUNK_KEYS positions merged in chunk order (plan.py);
- norms, RoPE, SwiGLU, letter logits: one program per row (or element block), fixed-width reductions.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .plan import CHUNK_KEYS, MAX_RANGES, OPEN, RECORD, SPLIT_ROWS

# key-range slots a tile record holds, as a power of two (the kernel compares a key tile with all of them)
RANGE_SLOTS = triton.next_power_of_2(MAX_RANGES)
# tilings of more rows never split (plan.SPLIT_ROWS): their kernels leave that code out
SPLIT_ROWS_C = tl.constexpr(SPLIT_ROWS)


@functools.cache
def num_sms(device_index: int = 0) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# ---- tree attention ----------------------------------------------------------------------------------------
@triton.jit
def _kv_tile(K, V, PK, PV, start, offs_n, offs_d, r_pos, r_shift, r_end, n_pre, n_keys, pre_off, kvh,
             stride_kt, stride_vt, stride_pt, HEAD_DIM: tl.constexpr):
    """The K and V rows of key positions start .. start + BLOCK_N - 1 (zeros past n_keys: no memory traffic)."""
    p = start + offs_n
    # token index of each forward key: its range's first token + offset in the range (ranges are disjoint; an
    # unused slot is empty and never matches)
    hit = (p[:, None] >= r_pos[None, :]) & (p[:, None] < r_end[None, :])
    addr = tl.sum(tl.where(hit, p[:, None] + r_shift[None, :], 0), 1)
    is_pre = p < n_pre
    is_fwd = (p >= n_pre) & (p < n_keys)
    kf = tl.load(K + addr[:, None] * stride_kt + kvh * HEAD_DIM + offs_d[None, :], mask=is_fwd[:, None], other=0.0)
    kp = tl.load(PK + (pre_off + p)[:, None] * stride_pt + kvh * HEAD_DIM + offs_d[None, :], mask=is_pre[:, None],
                 other=0.0)
    vf = tl.load(V + addr[:, None] * stride_vt + kvh * HEAD_DIM + offs_d[None, :], mask=is_fwd[:, None], other=0.0)
    vp = tl.load(PV + (pre_off + p)[:, None] * stride_pt + kvh * HEAD_DIM + offs_d[None, :], mask=is_pre[:, None],
                 other=0.0)
    return tl.where(is_pre[:, None], kp, kf), tl.where(is_pre[:, None], vp, vf)


@triton.jit
def _attend(q, k, v, p, q_pos, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr, MASK: tl.constexpr):
    """One key tile of the online softmax: (m, l, acc) updated in f32. `MASK`: some key of the tile may lie past
    a query (else the tile is wholly visible and the select is left out). The scale and the row max enter as one
    explicit fma, so a tile gives the same bits with the select and without it (a document read from the pool or
    from its open range without masks, the same keys elsewhere with them)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASK:
        s = tl.where(p[None, :] <= q_pos[:, None], s, float("-inf"))
    # max(s) * scale is max(s * scale) bit for bit: rounding a product by a positive constant keeps the order
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    pr = tl.math.exp2(tl.fma(s, qk_scale, -m_new[:, None]))
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(pr, 1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(pr, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(pr.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def _lesser(a, b):
    """min(a, b) of two scalars, written so that the compiler keeps the key loops' bounds in 32 bits (a min() as a
    loop bound widened them, and the forward's key loop grew by a sixth)."""
    return a - tl.maximum(a - b, 0)


@triton.jit
def _chunk(q, q_pos, K, V, PK, PV, lo, hi, n_full, n_pre, n_keys, pre_off, kvh, r_pos, r_shift, r_end, o_lo, o_hi,
           o_shift, offs_n, offs_d, stride_kt, stride_vt, stride_pt, qk_scale, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr):
    """The online softmax of the key positions lo .. hi - 1 from a fresh (m, l, acc), in key tiles of increasing
    position. Whole tiles that every query sees and that lie in one contiguous run of rows load it without the
    range lookup and the select: the cached prefix's (below n_full, from the pool) and the open range's (o_lo ..
    o_hi, key p at token p + o_shift); a question about a long cached document spends nearly all its keys in the
    first, a long document computed in the forward in the second. The rest through the ranges, masked."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    rows_pre = (pre_off + offs_n)[:, None] * stride_pt + kvh * HEAD_DIM + offs_d[None, :]
    for start in range(lo, _lesser(hi, n_full), BLOCK_N):
        k = tl.load(PK + rows_pre + start * stride_pt)
        v = tl.load(PV + rows_pre + start * stride_pt)
        m_i, l_i, acc = _attend(q, k, v, start + offs_n, q_pos, m_i, l_i, acc, qk_scale, IEEE, False)
    g0 = tl.maximum(lo, n_full)
    a = _lesser(tl.maximum(o_lo, g0), hi)  # the open range's whole tiles within g0 .. hi: a .. b
    b = _lesser(tl.maximum(o_hi, a), hi)
    for start in range(g0, a, BLOCK_N):
        k, v = _kv_tile(K, V, PK, PV, start, offs_n, offs_d, r_pos, r_shift, r_end, n_pre, n_keys, pre_off, kvh,
                        stride_kt, stride_vt, stride_pt, HEAD_DIM)
        m_i, l_i, acc = _attend(q, k, v, start + offs_n, q_pos, m_i, l_i, acc, qk_scale, IEEE, True)
    rows_o = (o_shift + offs_n)[:, None] * stride_kt + kvh * HEAD_DIM + offs_d[None, :]  # K's and V's (one stride)
    for start in range(a, b, BLOCK_N):
        k = tl.load(K + rows_o + start * stride_kt)
        v = tl.load(V + rows_o + start * stride_kt)
        m_i, l_i, acc = _attend(q, k, v, start + offs_n, q_pos, m_i, l_i, acc, qk_scale, IEEE, False)
    for start in range(b, hi, BLOCK_N):
        k, v = _kv_tile(K, V, PK, PV, start, offs_n, offs_d, r_pos, r_shift, r_end, n_pre, n_keys, pre_off, kvh,
                        stride_kt, stride_vt, stride_pt, HEAD_DIM)
        m_i, l_i, acc = _attend(q, k, v, start + offs_n, q_pos, m_i, l_i, acc, qk_scale, IEEE, True)
    return m_i, l_i, acc


# The scratch slots: slot s holds BLOCK_M rows: acc at SLOTS[(s * BLOCK_M + row) * HEAD_DIM + d], then (past every
# slot's acc, `ml` = n_slots * BLOCK_M * HEAD_DIM) m at SLOTS[ml + 2 * (s * BLOCK_M + row)] and l just after it. A
# row index that depends on the slot keeps the compiler from computing every address once ahead of the key loops
# (the whole tile's pointers held across them spilled registers in the hottest loop).
@triton.jit
def _save(SLOTS, ml, slot, acc, m, l_sum, offs_m, offs_d, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A chunk's (acc, m, l) into scratch slot `slot`."""
    row = slot * BLOCK_M + offs_m
    tl.store(SLOTS + row[:, None] * HEAD_DIM + offs_d[None, :], acc)
    tl.store(SLOTS + ml + 2 * row, m)
    tl.store(SLOTS + ml + 2 * row + 1, l_sum)


@triton.jit
def _merge(SLOTS, ml, state, part, offs_m, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, SLICE: tl.constexpr):
    """The chunks so far (slot `state`) and the next chunk (slot `part`) -> all of them, in `state`. A row that
    sees no key of the next chunk (m = -inf; its l and acc are not numbers) keeps what it had, bit for bit.
    Column slice by slice, from memory: no second accumulator in registers. Loads are ".cg" (from L2, never a
    stale L1 line: another SM wrote a split tile's partials)."""
    row_s = state * BLOCK_M + offs_m
    row_p = part * BLOCK_M + offs_m
    big_m = tl.load(SLOTS + ml + 2 * row_s, cache_modifier=".cg")
    big_l = tl.load(SLOTS + ml + 2 * row_s + 1, cache_modifier=".cg")
    m = tl.load(SLOTS + ml + 2 * row_p, cache_modifier=".cg")
    l_p = tl.load(SLOTS + ml + 2 * row_p + 1, cache_modifier=".cg")
    keep = m > float("-inf")
    new_m = tl.maximum(big_m, m)
    a = tl.math.exp2(big_m - new_m)
    b = tl.math.exp2(m - new_m)
    offs_s = tl.arange(0, SLICE)
    for d0 in tl.static_range(0, HEAD_DIM, SLICE):
        o_at = SLOTS + row_s[:, None] * HEAD_DIM + d0 + offs_s[None, :]
        o = tl.load(o_at, cache_modifier=".cg")
        acc = tl.load(SLOTS + row_p[:, None] * HEAD_DIM + d0 + offs_s[None, :], cache_modifier=".cg")
        tl.store(o_at, tl.where(keep[:, None], tl.fma(acc, b[:, None], o * a[:, None]), o))
    tl.store(SLOTS + ml + 2 * row_s, tl.where(keep, new_m, big_m))
    tl.store(SLOTS + ml + 2 * row_s + 1, tl.where(keep, tl.fma(l_p, b, big_l * a), big_l))


@triton.jit
def _emit(OUT, SLOTS, ml, state, dest, head, m_valid, offs_m, stride_ot, HEAD_DIM: tl.constexpr,
          BLOCK_M: tl.constexpr, SLICE: tl.constexpr):
    """The output rows of merged chunks (slot `state`): acc / l, as a tile of one chunk writes its own."""
    row = state * BLOCK_M + offs_m
    l_sum = tl.load(SLOTS + ml + 2 * row + 1, cache_modifier=".cg")
    offs_s = tl.arange(0, SLICE)
    for d0 in tl.static_range(0, HEAD_DIM, SLICE):
        o = tl.load(SLOTS + row[:, None] * HEAD_DIM + d0 + offs_s[None, :], cache_modifier=".cg")
        tl.store(OUT + dest[:, None] * stride_ot + head[:, None] * HEAD_DIM + d0 + offs_s[None, :],
                 (o / l_sum[:, None]).to(OUT.dtype.element_ty), mask=m_valid[:, None])


@triton.jit
def _tree_attn_kernel(Q, K, V, PK, PV, OUT, POS, TILES, QROWS, NT, SLOTS, COUNTS,
                      stride_qt, stride_kt, stride_vt, stride_pt, stride_ot, qk_scale, n_slots,
                      N_HEADS: tl.constexpr, REP: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NPROG: tl.constexpr,
                      COMPACT: tl.constexpr, IEEE: tl.constexpr, REC: tl.constexpr, RANGES: tl.constexpr,
                      CHUNK: tl.constexpr, SLICE: tl.constexpr, OPEN: tl.constexpr):
    pid = tl.program_id(0)
    # one work item per (record, K/V head): its rows are (query, head) pairs of the REP query heads that read that
    # K/V head, so each key tile is loaded once for all of them (GQA); a row's arithmetic is the same either way
    n_kv = N_HEADS // REP
    QPT = BLOCK_M // REP  # queries per tile (plan.py tiles hold at most this many)
    ml = n_slots * BLOCK_M * HEAD_DIM  # where the slots' m and l start
    n_work = tl.load(NT) * n_kv
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_r = tl.arange(0, RANGES)
    in_rec = 10 + 3 * offs_r < OPEN  # range slots that lie inside a record's ranges
    query = offs_m // REP
    mine = 2 * pid  # this program's two slots: the chunks so far of a tile it walks alone, the next chunk
    split_base = 2 * NPROG  # then a slot per (chunk, K/V head) of the split tiles
    # the work loop: one key chunk per pass (a tile of several chunks walked here takes a pass per chunk, its
    # state between them in this program's slots), so the key loops sit directly in it
    w = pid
    c = pid * 0 - 1  # the chunk of this pass; -1: the first of the next work item
    while w < n_work:
        tile = w // n_kv
        kvh = w % n_kv
        head = kvh * REP + offs_m % REP
        rec = TILES + tile * REC
        q_off = tl.load(rec)
        n_q = tl.load(rec + 1)
        n_keys = tl.load(rec + 2)
        n_pre = tl.load(rec + 3)
        pre_off = tl.load(rec + 4)
        n_r = tl.load(rec + 5)
        chunk = tl.load(rec + 6) - 1  # -1: the whole tile, every chunk of it here
        slot0 = tl.load(rec + 7)
        # the tile's key ranges as vectors, loaded beside the fields above (not after n_r: one memory round trip
        # less before the first key tile); a key's token index is then found without a loop over the ranges
        r_pos = tl.load(rec + 8 + 3 * offs_r, mask=in_rec, other=0)
        r_shift = tl.load(rec + 9 + 3 * offs_r, mask=in_rec, other=0) - r_pos
        r_end = tl.where(offs_r < n_r, r_pos + tl.load(rec + 10 + 3 * offs_r, mask=in_rec, other=0), 0)
        o_pos = tl.load(rec + OPEN)
        o_lo = (o_pos + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # the open range's whole key tiles: o_lo .. o_hi
        o_hi = tl.load(rec + OPEN + 1) // BLOCK_N * BLOCK_N
        o_shift = tl.load(rec + OPEN + 2)
        m_valid = (query < n_q) & (offs_m < QPT * REP)
        rows = tl.load(QROWS + q_off + query, mask=m_valid, other=0)
        q_pos = tl.load(POS + rows, mask=m_valid, other=0)
        q = tl.load(Q + rows[:, None] * stride_qt + head[:, None] * HEAD_DIM + offs_d[None, :], mask=m_valid[:, None],
                    other=0.0)
        if COMPACT:
            dest = q_off + query
        else:
            dest = rows
        n_full = tl.minimum(n_pre, n_keys) // BLOCK_N * BLOCK_N
        n_chunks = (n_keys + CHUNK - 1) // CHUNK
        split = (chunk >= 0) & (BLOCK_M <= SPLIT_ROWS_C)  # (no split tile has more rows)
        c = tl.where(c < 0, tl.maximum(chunk, 0), c)
        lo = c * CHUNK
        hi = _lesser(n_keys, lo + CHUNK)
        m_i, l_i, acc = _chunk(q, q_pos, K, V, PK, PV, lo, hi, n_full, n_pre, n_keys, pre_off, kvh, r_pos, r_shift,
                               r_end, o_lo, o_hi, o_shift, offs_n, offs_d, stride_kt, stride_vt, stride_pt, qk_scale,
                               BLOCK_M, BLOCK_N, HEAD_DIM, IEEE)
        if BLOCK_M <= SPLIT_ROWS_C and split:
            # one chunk of a split tile: its partial to the tile's slot for it; the last chunk of the tile to end
            # merges them all in chunk order, the same steps as a tile walked here on the same values (the order
            # the chunks ran in never shows)
            _save(SLOTS, ml, split_base + (slot0 + c) * n_kv + kvh, acc, m_i, l_i, offs_m, offs_d, BLOCK_M, HEAD_DIM)
            tl.debug_barrier()  # every thread's partial stored before the count says so
            count = COUNTS + slot0 * n_kv + kvh
            if tl.atomic_add(count, 1, sem="acq_rel") == n_chunks - 1:
                tl.store(count, 0)  # ready for the next launch (the next layer, the next replay)
                first = split_base + slot0 * n_kv + kvh
                for j in range(1, n_chunks):
                    _merge(SLOTS, ml, first, first + j * n_kv, offs_m, HEAD_DIM, BLOCK_M, SLICE)
                    tl.debug_barrier()
                _emit(OUT, SLOTS, ml, first, dest, head, m_valid, offs_m, stride_ot, HEAD_DIM, BLOCK_M, SLICE)
        elif n_chunks > 1:
            # a tile of several chunks walked here: each merged into this program's first slot
            _save(SLOTS, ml, mine + tl.minimum(c, 1), acc, m_i, l_i, offs_m, offs_d, BLOCK_M, HEAD_DIM)
            tl.debug_barrier()  # each thread reads what others stored
            if c > 0:
                _merge(SLOTS, ml, mine, mine + 1, offs_m, HEAD_DIM, BLOCK_M, SLICE)
                tl.debug_barrier()
            if c == n_chunks - 1:
                _emit(OUT, SLOTS, ml, mine, dest, head, m_valid, offs_m, stride_ot, HEAD_DIM, BLOCK_M, SLICE)
                tl.debug_barrier()  # read before the next work item's chunks overwrite the slot
        else:
            tl.store(OUT + dest[:, None] * stride_ot + head[:, None] * HEAD_DIM + offs_d[None, :],
                     (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=m_valid[:, None])
        last = split | (c >= n_chunks - 1)
        w = tl.where(last, w + NPROG, w)
        c = tl.where(last, -1, c + 1)


def queries_per_tile(block_m: int, n_heads: int, n_kv: int) -> int:
    """The most queries a tile of the plan may hold for a tiling of `block_m` rows: the kernel's rows are the
    (query, head) pairs of one K/V head's query heads."""
    return max(1, block_m // (n_heads // n_kv))


class Scratch:
    """The tree attention's f32 scratch on one device: per launch, two slots of a tile's rows per program (the
    chunks of a tile it walks alone), then `split_slots` x K/V heads slots (the chunks of split tiles,
    plan.split_tiles); the split tiles' arrival counts (zero between launches: the last chunk of a tile resets
    its count). `rows`: rows of (head_dim + 2) f32 in all, enough for the largest tiling `needs`."""

    def __init__(self, device: torch.device | str, n_kv: int, head_dim: int, rows: int, split_slots: int,
                 nprog: int) -> None:
        self.nprog, self.split_slots, self.n_kv, self.rows = nprog, split_slots, n_kv, rows
        self.slots = torch.empty(rows * (head_dim + 2), dtype=torch.float32, device=device)
        self.counts = torch.zeros(max(1, split_slots * n_kv), dtype=torch.int32, device=device)

    @staticmethod
    def needs(block_m: int, nprog: int, split_slots: int, n_kv: int) -> int:
        """Rows a launch of `block_m`-row tiles needs."""
        return (2 * nprog + split_slots * n_kv) * block_m

    def nbytes(self) -> int:
        return self.slots.numel() * 4 + self.counts.numel() * 4


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: torch.Tensor,
                   prefix_v: torch.Tensor, positions: torch.Tensor, tiles: torch.Tensor, q_rows: torch.Tensor,
                   n_tiles: torch.Tensor, out: torch.Tensor, compact: bool,
                   tiling: tuple[int, int, int, int], scratch: Scratch | None = None,
                   chunk: int = CHUNK_KEYS) -> torch.Tensor:
    """q [T, Hq, D] and k/v [T, Hkv, D] (row-strided views of the fused qkv), prefix_k/v [P, Hkv, D].

    tiles [>= n, RECORD] int32, q_rows int32, n_tiles [1] int32 (device: the count may change between replays
    of a CUDA graph); out [T or n_queries, Hq * D]. A persistent grid of the scratch's programs walks the work.
    `tiling`: (block_m, block_n, warps, stages), the tiles planned with `queries_per_tile(block_m, ...)` queries
    at most (the forward's options). `scratch` (its slots for tiles of more than one chunk of keys): one of
    this device's, or a new one sized for this call without split tiles."""
    block_m, block_n, warps, stages = tiling
    n_heads, n_kv, d = q.shape[1], k.shape[1], q.shape[2]
    assert q.stride(2) == 1 and k.stride(1) == d and v.stride(1) == d and q.stride(1) == d
    assert k.stride(0) == v.stride(0)  # (views of one fused projection: the open range's rows share offsets)
    assert prefix_k.stride(0) == prefix_v.stride(0) and out.stride(1) == 1
    assert chunk % block_n == 0
    if prefix_k.shape[0] == 0:  # no cached prefix: any valid pointer (never read)
        prefix_k, prefix_v = k, v
    if scratch is None:
        nprog = 4 * num_sms(q.device.index or 0)
        scratch = Scratch(q.device, n_kv, d, Scratch.needs(block_m, nprog, 0, n_kv), 0, nprog)
    assert Scratch.needs(block_m, scratch.nprog, 0, n_kv) <= scratch.rows  # (split_tiles fits its records' slots)
    ieee = q.dtype == torch.float32
    _tree_attn_kernel[(scratch.nprog,)](
        q, k, v, prefix_k, prefix_v, out, positions, tiles, q_rows, n_tiles, scratch.slots, scratch.counts,
        q.stride(0), k.stride(0), v.stride(0), prefix_k.stride(0), out.stride(0), d ** -0.5 * 1.4426950408889634,
        scratch.rows // block_m,
        N_HEADS=n_heads, REP=n_heads // n_kv, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
        NPROG=scratch.nprog, COMPACT=compact, IEEE=ieee, REC=RECORD, RANGES=RANGE_SLOTS, CHUNK=chunk, OPEN=OPEN,
        SLICE=min(32, d),  # columns per step of a merge
        num_warps=warps, num_stages=1 if ieee else stages)
    return out


# ---- residual + RMSNorm, RoPE, SwiGLU, letter logits -------------------------------------------------------
@triton.jit
def _add_rms_norm_kernel(X, DELTA, W, H, XOUT, stride_x, stride_d, stride_h, N, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        x = x + tl.load(DELTA + row * stride_d + cols, mask=mask, other=0.0)
        tl.store(XOUT + row * stride_x + cols, x, mask=mask)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    y = (xf * r).to(x.dtype)
    w = tl.load(W + cols, mask=mask, other=0.0)
    tl.store(H + row * stride_h + cols, w * y, mask=mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + delta), x + delta); `out_rows` (>= x's rows) sizes the normed output for a padded
    GEMM after it (the rows past x's are left unwritten)."""
    rows, n = x.shape
    h = torch.empty(max(rows, out_rows or 0), n, dtype=x.dtype, device=x.device)
    xout = torch.empty_like(x) if delta is not None else x
    _add_rms_norm_kernel[(rows,)](x, delta if delta is not None else x, weight, h, xout, x.stride(0),
                                  delta.stride(0) if delta is not None else 0, h.stride(0), n, eps,
                                  HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(n), num_warps=8)
    return h, xout


@triton.jit
def _rope_kernel(QKV, POS, COS, SIN, FILL, PK, PV, stride_t, stride_p, N_Q: tl.constexpr, N_KV: tl.constexpr,
                 HP: tl.constexpr, HKVP: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(POS + t)
    h = tl.arange(0, HP)
    j = tl.arange(0, HALF)
    mask = (h < N_Q + N_KV)[:, None]
    base = QKV + t * stride_t + h[:, None] * (2 * HALF) + j[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    c = tl.load(COS + pos * HALF + j)[None, :]
    s = tl.load(SIN + pos * HALF + j)[None, :]
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    y1 = (a1 * c - a2 * s).to(x1.dtype)
    y2 = (a2 * c + a1 * s).to(x1.dtype)
    tl.store(base, y1, mask=mask)
    tl.store(base + HALF, y2, mask=mask)
    # the state cache: a token with a pool row (FILL = row + 1) also stores its K (the values just written) and
    # its V there, so a forward that fills the cache is the same forward (and the same CUDA graph)
    row = tl.load(FILL + t) - 1
    if row >= 0:
        kmask = ((h >= N_Q) & (h < N_Q + N_KV))[:, None]
        dest = PK + row * stride_p + (h[:, None] - N_Q) * (2 * HALF) + j[None, :]
        tl.store(dest, y1, mask=kmask)
        tl.store(dest + HALF, y2, mask=kmask)
        hv = tl.arange(0, HKVP)
        d = tl.arange(0, 2 * HALF)
        vmask = (hv < N_KV)[:, None]
        val = tl.load(QKV + t * stride_t + (N_Q + N_KV + hv[:, None]) * (2 * HALF) + d[None, :], mask=vmask)
        tl.store(PV + row * stride_p + hv[:, None] * (2 * HALF) + d[None, :], val, mask=vmask)


def rope_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
          n_kv: int, head_dim: int, fill: torch.Tensor | None = None, pool_k: torch.Tensor | None = None,
          pool_v: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE in place on the q and k heads; with `fill` (int32 per token: pool row + 1, 0 for none), the tokens'
    K and V also go to those rows of pool_k / pool_v [rows, Hkv, D]."""
    if fill is None or pool_k is None or pool_k.shape[0] == 0:  # nothing to store: any valid pointers
        fill = torch.zeros(qkv.shape[0], dtype=torch.int32, device=qkv.device) if fill is None else fill
        pool_k = pool_v = qkv
    else:
        assert pool_k.stride(0) == pool_v.stride(0) == n_kv * head_dim and pool_k.stride(1) == head_dim
    _rope_kernel[(qkv.shape[0],)](qkv, positions, cos, sin, fill, pool_k, pool_v, qkv.stride(0), pool_k.stride(0),
                                  N_Q=n_heads, N_KV=n_kv, HP=triton.next_power_of_2(n_heads + n_kv),
                                  HKVP=triton.next_power_of_2(n_kv), HALF=head_dim // 2, num_warps=4)
    return qkv


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_g, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(GU + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_g + N + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(OUT + row * stride_o + cols, y.to(OUT.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, out_rows: int | None = None) -> torch.Tensor:
    """silu(gate) * up; `out_rows` (>= the rows of gate_up) sizes the output for a padded GEMM after it (the
    rows past gate_up's are left unwritten)."""
    rows, n2 = gate_up.shape
    n = n2 // 2
    out = torch.empty(max(rows, out_rows or 0), n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                                   BLOCK=block, num_warps=4)
    return out


@triton.jit
def _letter_kernel(H, W, LETTERS, OUT, stride_h, stride_w, N, n_letters, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    j = tl.program_id(1)
    letter = tl.load(LETTERS + j).to(tl.int64)  # int32 or int64 ids; the row offset can pass 2**31
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        h = tl.load(H + r * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + letter * stride_w + cols, mask=mask, other=0.0).to(tl.float32)
        acc += h * w
    tl.store(OUT + r * n_letters + j, tl.sum(acc, 0))


def letter_logits(h: torch.Tensor, lm_head: torch.Tensor, letters: torch.Tensor) -> torch.Tensor:
    rows, n = h.shape
    out = torch.empty(rows, letters.shape[0], dtype=torch.float32, device=h.device)
    if rows and letters.shape[0]:
        _letter_kernel[(rows, letters.shape[0])](h, lm_head, letters, out, h.stride(0), lm_head.stride(0), n,
                                                 letters.shape[0], BLOCK=512, num_warps=4)
    return out


# ---- fp8 row quantization (twin: fp8.quant_rows) ------------------------------------------------------------
@triton.jit
def _quant_rows_kernel(X, Q, S, stride_x, stride_q, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    amax = tl.zeros([BLOCK], tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    a = tl.max(amax, 0)
    # the power-of-two scale of fp8.pow2_scale_bits, from the exponent and mantissa bits of the row's amax
    bits = a.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    se = tl.where((bits & 0x7FFFFF) > 0x600000, e - 7, e - 8)
    se = tl.where(a > 0, se, 127)
    se = tl.minimum(tl.maximum(se, 1), 253)
    scale = (se << 23).to(tl.float32, bitcast=True)
    inv = ((254 - se) << 23).to(tl.float32, bitcast=True)
    tl.store(S + row, scale)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(Q + row * stride_q + cols, (x * inv).to(tl.float8e4nv), mask=cols < N)


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, n = x.shape
    q = torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quant_rows_kernel[(rows,)](x, q, s, x.stride(0), q.stride(0), n, BLOCK=min(2048, triton.next_power_of_2(n)),
                                    num_warps=4)
    return q, s


# ---- fp8 static quantization (twin: fp8.quant_static) ---------------------------------------------------------
@triton.jit
def _quant_static_kernel(X, Q, stride_x, stride_q, N, inv, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32) * inv
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    tl.store(Q + row * stride_q + cols, x.to(tl.float8e4nv), mask=cols < N)


def quant_static(x: torch.Tensor, inv: float) -> torch.Tensor:
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, n = x.shape
    q = torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _quant_static_kernel[(rows, triton.cdiv(n, block))](x, q, x.stride(0), q.stride(0), n, inv, BLOCK=block,
                                                           num_warps=4)
    return q
