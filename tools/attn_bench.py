# ruff: noqa: B023  (each closure is timed at once, inside its loop iteration)
"""Tree-attention variants on one GPU, as the forward runs them: per-call time inside a CUDA graph of 60
back-to-back calls (a forward's layers), for a single decision, a batch of 32 decisions and (eager) a 17k-token
document, with the head shapes of the 4.5B (16/2) and max (32/8) presets; each variant checked against the
f32 twin, and the landed kernel (`ref`: the key-range lookup as a scalar loop inside the key loop, as it was
before the vectorized lookup) against the vectorized one at the same tiling, bit for bit.

Usage: attn_bench.py OUT.jsonl [TILING ...]  where TILING is block_m:block_n:warps:stages (default: a sweep).
Prints one JSON line per (variant, shape) and a table last.
"""

from __future__ import annotations

import json
import statistics
import sys

import numpy as np
import torch
import triton
import triton.language as tl

from basal_local.backends.base import PackedBatch
from basal_local.cuda_kernels import plan as tplan
from basal_local.cuda_kernels import triton_kernels, twins
from basal_local.engine.packer import PromptSpec, pack_prompts

K = triton_kernels()
# without a GPU (TRITON_INTERPRET=1, a dry run of this script on the CPU) every timing is 0
DEV = "cuda" if torch.cuda.is_available() else "cpu"
D = 128
SHAPES = {"4.5B": (16, 2), "max": (32, 8)}
DEFAULT_TILINGS = ["64:64:4:2", "128:64:8:2", "64:64:8:2", "64:128:8:2", "32:64:4:2", "64:64:4:3"]


@triton.jit
def _ref_kernel(Q, K, V, PK, PV, OUT, POS, TILES, QROWS, NT,
                stride_qt, stride_kt, stride_vt, stride_pt, stride_ot, qk_scale,
                N_HEADS: tl.constexpr, REP: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NPROG: tl.constexpr, REC: tl.constexpr):
    """The kernel as landed before (scalar range loop per key tile); f16/bf16 only, non-compact output."""
    pid = tl.program_id(0)
    n_work = tl.load(NT) * N_HEADS
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for w in range(pid, n_work, NPROG):
        tile = w // N_HEADS
        head = w % N_HEADS
        kvh = head // REP
        rec = TILES + tile * REC
        q_off = tl.load(rec)
        n_q = tl.load(rec + 1)
        n_keys = tl.load(rec + 2)
        n_pre = tl.load(rec + 3)
        pre_off = tl.load(rec + 4)
        n_r = tl.load(rec + 5)
        m_valid = offs_m < n_q
        rows = tl.load(QROWS + q_off + offs_m, mask=m_valid, other=0)
        q_pos = tl.load(POS + rows, mask=m_valid, other=0)
        q = tl.load(Q + rows[:, None] * stride_qt + head * HEAD_DIM + offs_d[None, :], mask=m_valid[:, None],
                    other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start in range(0, n_keys, BLOCK_N):
            p = start + offs_n
            addr = tl.zeros([BLOCK_N], tl.int32)
            for r in range(0, n_r):
                ps = tl.load(rec + 8 + 3 * r)
                ts = tl.load(rec + 9 + 3 * r)
                ln = tl.load(rec + 10 + 3 * r)
                addr = tl.where((p >= ps) & (p < ps + ln), ts + p - ps, addr)
            is_pre = p < n_pre
            is_fwd = (p >= n_pre) & (p < n_keys)
            kf = tl.load(K + addr[:, None] * stride_kt + kvh * HEAD_DIM + offs_d[None, :], mask=is_fwd[:, None],
                         other=0.0)
            kp = tl.load(PK + (pre_off + p)[:, None] * stride_pt + kvh * HEAD_DIM + offs_d[None, :],
                         mask=is_pre[:, None], other=0.0)
            k = tl.where(is_pre[:, None], kp, kf)
            s = tl.dot(q, tl.trans(k))
            visible = p[None, :] <= q_pos[:, None]
            s = tl.where(visible, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            pr = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            vf = tl.load(V + addr[:, None] * stride_vt + kvh * HEAD_DIM + offs_d[None, :], mask=is_fwd[:, None],
                         other=0.0)
            vp = tl.load(PV + (pre_off + p)[:, None] * stride_pt + kvh * HEAD_DIM + offs_d[None, :],
                         mask=is_pre[:, None], other=0.0)
            v = tl.where(is_pre[:, None], vp, vf)
            acc = acc * alpha[:, None]
            acc = tl.dot(pr.to(v.dtype), v, acc)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(OUT + rows[:, None] * stride_ot + head * HEAD_DIM + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=m_valid[:, None])


def ref_attention(q, k, v, pk, pv, pos, tiles, q_rows, nt, out, tiling):
    bm, bn, warps, stages = tiling[:4]
    nprog = 4 * K.num_sms(0) if DEV == "cuda" else 8
    _ref_kernel[(nprog,)](q, k, v, pk, pv, out, pos, tiles, q_rows, nt, q.stride(0), k.stride(0), v.stride(0),
                          pk.stride(0), out.stride(0), D ** -0.5 * 1.4426950408889634, N_HEADS=q.shape[1],
                          REP=q.shape[1] // k.shape[1], HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, NPROG=nprog,
                          REC=tplan.RECORD, num_warps=warps, num_stages=stages)
    return out


def synthetic(n_states: int, rng: np.random.Generator, prefix: list[int]) -> PackedBatch:
    """Decisions shaped like the sample set's: a cached template prefix, a state, one question in both orders."""
    specs = []
    for _ in range(n_states):
        state = list(rng.integers(100, 2000, int(rng.integers(120, 260))))
        q = list(rng.integers(100, 2000, int(rng.integers(15, 40))))
        opts = list(rng.integers(100, 2000, int(rng.integers(20, 40))))
        for order in (opts, opts[::-1]):
            specs.append(PromptSpec(prefix + state + q + order + [5, 6], "en", [7, 8]))
    return pack_prompts(specs, {"en": prefix}, max_forward_tokens=10**6).batches[0]


def long_doc(n: int, prefix: int) -> PackedBatch:
    """A document of ~n tokens (after a cached prefix) with 5 questions of 64 tokens branching off it."""
    children = 5
    root = n - 64 * children
    token_block = np.concatenate([np.zeros(root, np.int32), np.repeat(np.arange(1, children + 1, dtype=np.int32), 64)])
    positions = np.concatenate([np.arange(prefix, prefix + root),
                                np.tile(np.arange(prefix + root, prefix + root + 64), children)]).astype(np.int64)
    return PackedBatch(token_ids=np.zeros(n, np.int64), positions=positions, token_block=token_block,
                       block_parent=np.array([-1] + [0] * children, np.int32),
                       block_prefix=np.array([0] + [-1] * children, np.int32),
                       readout_index=root + 64 * np.arange(children, dtype=np.int64) + 63,
                       letter_ids=np.zeros(1, np.int64), prefixes=["en"])


def graph_ms(fn, calls: int = 60, replays: int = 30) -> float:
    """Per-call milliseconds of `fn` captured `calls` times back to back in one CUDA graph."""
    if DEV != "cuda":
        return 0.0
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def eager_ms(fn, reps: int = 10) -> float:
    if DEV != "cuda":
        return 0.0
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(out_path: str, *tilings: str) -> None:
    tilings = tilings or tuple(DEFAULT_TILINGS)
    rng = np.random.default_rng(0)
    n_pre = 96
    prefix = list(rng.integers(100, 2000, n_pre))
    cases = {"single": synthetic(1, np.random.default_rng(1), prefix),
             "batch32": synthetic(32, np.random.default_rng(2), prefix),
             "long17k": long_doc(17280, n_pre)}
    shapes = SHAPES
    if DEV != "cuda":  # a dry run: small shapes only
        cases, shapes = {"single": cases["single"]}, {"4.5B": (2, 1)}
    rows, table = [], []
    f = open(out_path, "w")
    for preset, (hq, hkv) in shapes.items():
        for case, batch in cases.items():
            if case == "long17k" and preset == "max":
                continue
            t = batch.num_tokens
            g = torch.Generator(device=DEV).manual_seed(0)
            qkv = torch.randn(t, (hq + 2 * hkv) * D, device=DEV, generator=g).half()
            q = qkv[:, :hq * D].view(t, hq, D)
            k = qkv[:, hq * D:(hq + hkv) * D].view(t, hkv, D)
            v = qkv[:, (hq + hkv) * D:].view(t, hkv, D)
            pk = torch.randn(n_pre, hkv, D, device=DEV, generator=g).half()
            pv = torch.randn(n_pre, hkv, D, device=DEV, generator=g).half()
            pos = torch.from_numpy(batch.positions.astype(np.int32)).to(DEV)
            want = first = None
            for spec in tilings:
                tiling = tuple(int(x) for x in spec.split(":"))
                bm = tiling[0]
                p = tplan.tile_plan(batch.positions, batch.token_block, batch.block_parent, batch.block_prefix,
                                    [(0, n_pre)], bm)
                tiles = torch.from_numpy(p.tiles).to(DEV)
                q_rows = torch.from_numpy(p.q_rows).to(DEV)
                # (the CPU interpreter takes a loop bound from a 0-d tensor only)
                nt = torch.tensor([p.num_tiles] if DEV == "cuda" else p.num_tiles, dtype=torch.int32, device=DEV)
                out = torch.full((t, hq * D), float("nan"), dtype=torch.float16, device=DEV)
                ref_out = torch.full((t, hq * D), float("nan"), dtype=torch.float16, device=DEV)
                rec = {"preset": preset, "case": case, "tokens": t, "tiles": p.num_tiles, "tiling": spec}
                try:
                    def new():
                        return K.tree_attention(q, k, v, pk, pv, pos, tiles, q_rows, nt, out, compact=False,
                                                nprog=None if DEV == "cuda" else 8, tiling=tiling)

                    def ref():
                        return ref_attention(q, k, v, pk, pv, pos, tiles, q_rows, nt, ref_out, tiling)
                    new()
                    ref()
                    if DEV == "cuda":
                        torch.cuda.synchronize()
                    rec["bitwise_equal_to_ref"] = bool(torch.equal(out, ref_out))
                    # does the tiling itself change the bits (block_m or warps at one block_n)?
                    if first is None:
                        first = (spec, out.clone())
                    rec["bitwise_equal_to_" + first[0]] = bool(torch.equal(out, first[1]))
                    rec["unwritten"] = int(torch.isnan(out).sum().item())
                    if want is None and case != "long17k":
                        want = twins.tree_attention(q.float(), k.float(), v.float(), pk.float(), pv.float(),
                                                    pos.long(), p, t).view(t, hq * D)
                    if want is not None:
                        rec["rel_err_vs_twin"] = float(((out.float() - want).norm() / want.norm()).item())
                    if case == "long17k":
                        rec["ms"], rec["ref_ms"] = eager_ms(new), eager_ms(ref)
                    else:
                        rec["ms"], rec["ref_ms"] = graph_ms(new), graph_ms(ref)
                except Exception as exc:  # noqa: BLE001 - a tiling that does not compile is a result too
                    if DEV != "cuda":
                        raise
                    rec["error"] = repr(exc)[:300]
                print(json.dumps(rec), flush=True)
                f.write(json.dumps(rec) + "\n")
                rows.append(rec)
                if "ms" in rec:
                    table.append(f"{preset:5s} {case:8s} T={t:6d} {spec:11s} {rec['ms'] * 1000:9.1f} us "
                                 f"(ref {rec['ref_ms'] * 1000:9.1f})  bitwise={rec['bitwise_equal_to_ref']} "
                                 f"same-as-first={rec['bitwise_equal_to_' + first[0]]} "
                                 f"err={rec.get('rel_err_vs_twin', float('nan')):.1e}")
                else:
                    table.append(f"{preset:5s} {case:8s} {spec:11s} ERROR {rec['error'][:120]}")
    f.close()
    print("\n".join(table))


if __name__ == "__main__":
    main(*sys.argv[1:])
