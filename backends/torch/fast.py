"""The f16/bf16 GPU forward: Triton tree attention and fused kernels, one CUDA graph per (tokens, readouts).

Per layer: fused residual+RMSNorm, the q/k/v GEMM, RoPE in place (f32 math), tree attention reading f16 q/k/v
straight from the fused projection (no f32 copies, no concatenation of the cached prefix K/V: the kernel reads
the prefix from its own buffer by row), o GEMM, residual+RMSNorm, gate/up GEMM, SwiGLU, down GEMM. The last
layer runs attention, o_proj and the MLP at the readout rows only. Every kernel has a twin
(`basal_local.cuda_kernels.twins`), so the same code runs on the CPU in tests.

A forward's host-side inputs (token ids, positions, the attention tile tables) travel as ONE int32 buffer. A
CUDA graph is captured per (token bucket, readout bucket): the tile tables live in device memory, and the
attention kernel walks them with a persistent grid, so one graph serves any tree of that size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from basal_local.cuda_kernels import cublaslt, fp8, gemm, triton_available, triton_kernels, twins
from basal_local.cuda_kernels import plan as tplan

from ..base import PackedBatch, Ready

# graph sizes: steps of 16-32 tokens where single decisions fall (~200-500 tokens; the GEMMs' time moves in steps
# of 16 rows, tools/graph_sweep.py), coarser above, where batches are
TOKEN_BUCKETS = (64, 128, 192, 224, 256, 272, 288, 304, 320, 336, 352, 368, 384, 416, 448, 480, 512, 640, 768, 1024,
                 1536, 2048, 3072, 4096, 6144, 8192)
READOUT_BUCKETS = (4, 16, 64, 256)
MAX_GRAPHS = 96
GEMMS = ("verified", "chunked", "cublas", "triton", "fp8")
# rows per cuBLAS call where a weight's GEMMs use a fixed chunk: part of the numerics contract (a row's bits
# depend on it), never chosen by the batch; tools/gemm_chunks.py measured the trade-off (docs/CUDA_NOTES.md)
GEMM_CHUNK = 512
# the projections the fp8 route quantizes (BASAL_LOCAL_FP8_GEMMS, a comma list of these, narrows it: the others
# stay f16 cuBLAS at their own verified row counts)
FP8_GEMMS = ("qkv", "o", "gate_up", "down")
# the verified route uses cuBLAS as is where its results agree at some row count of at most this many rows
VERIFIED_FLOOR_MAX = 512
# the verified route's candidate row counts: the graph sizes, the readout sizes and every multiple of GEMM_STEP up to
# TIMED_MAX; those that agree are timed at load (up to TIMED_MAX) and a call runs at the smallest one that holds it
# or a larger one that is faster by more than 25 % (gemm.CallSizes; BASAL_LOCAL_GEMM_TIMED=0: always the smallest)
GEMM_STEP = 16
TIMED_MAX = 1024
# row counts where cuBLASLt's algorithms are tried beside torch's call (gemm.lt_choices): the graph sizes and
# readout sizes a forward calls at (the GEMM step between them would cost ~4x the load time for calls that pad
# to these anyway); tools/lt_probe.py measured them per shape (docs/PERFORMANCE.md, session 7)
LT_SIZES = tuple(sorted({s for s in TOKEN_BUCKETS if s <= TIMED_MAX} | set(READOUT_BUCKETS)))
# a pinned algorithm replaces torch's own (agreeing) call where it is faster by more than this, timed alone at load
# (BASAL_LOCAL_GEMM_LT_MARGIN; max preset gate/up at 304 rows: 109.7 vs 113.7 us, 3.5 %)
LT_MARGIN = 0.02


# a second tree-attention tiling (block_m, block_n, warps, stages) for graphs of up to ALT_MAX_TOKENS tokens and
# for eager forwards longer than the largest graph, where it is faster (docs/CUDA_NOTES.md: 19.2 vs 21.9 us a call
# in a single decision, 6.4 vs 7.6 ms in a 17k-token document; slower in a batch of 32; 3 stages: 20.1 vs 20.6 us
# single, 5.8 vs 6.3 ms for the document, session 6 call 3). Used only where it gives
# the default tiling's bits, checked at load on this device and dtype (as the GEMM row counts are), so a query's
# result still never depends on the size of the forward it is in. BASAL_LOCAL_ATTN_ALT=0 turns it off.
ALT_TILING = (128, 64, 8, 3)
ALT_MAX_TOKENS = 1024
# letter columns of a graph's logits (the most letters a batch can ask: protocol LETTERS has 10)
LETTER_CAP = 16
# the eager forward run once at warm-up (FastPath.warm_long): the size of a ~16.5k-token document's forward
LONG_WARMUP_TOKENS = 17371


class _Graph(NamedTuple):
    """One captured forward: its device input buffer (`static`, laid out as `layout`) and the pinned host
    buffer it is filled from, and the letter logits [r_cap, LETTER_CAP] it leaves in `logits`. `uploaded[0]`:
    the event after the last copy out of `staging` (None when none is pending), so a launch never refills
    the staging buffer under a copy that has not run yet."""

    graph: torch.cuda.CUDAGraph
    static: torch.Tensor
    layout: dict
    logits: torch.Tensor
    staging: torch.Tensor
    staging_np: np.ndarray
    uploaded: list


class Launched:
    """One graph replay in flight (`FastPath.launch`): its letter logits come back through their own pinned
    buffer; two CUDA events time it on the device."""

    __slots__ = ("host", "rows", "cols", "start", "end")

    def __init__(self, host: torch.Tensor, rows: int, cols: int, start, end) -> None:
        self.host, self.rows, self.cols, self.start, self.end = host, rows, cols, start, end

    def done(self) -> bool:
        return bool(self.end.query())

    def result(self) -> np.ndarray:
        self.end.synchronize()
        out = self.host.numpy()[:self.rows, :self.cols].copy()
        if not np.isfinite(out).all():
            raise FloatingPointError("non-finite letter logit")
        return out

    def device_s(self) -> float | None:
        """Device seconds from its input copy to its logits copy (after `result`)."""
        return self.start.elapsed_time(self.end) / 1000.0


def _tile_cap(size: int) -> int:
    """Tile records a graph of `size` tokens holds: one per 64 queries plus one per (partial) block."""
    return size // 64 + size // 4 + 8


class FastPath:
    def __init__(self, backend, use_triton: bool, gemm: str = "auto") -> None:
        self.b = backend
        self.use_triton = use_triton and triton_available()
        self.ops = triton_kernels() if self.use_triton else twins
        if gemm == "auto":
            gemm = os.environ.get("BASAL_LOCAL_GEMM", "verified")
        if gemm not in GEMMS:
            raise ValueError(f"unknown GEMM {gemm!r} ({', '.join(GEMMS)})")
        if gemm == "triton" and not self.use_triton:
            gemm = "verified"
        if backend.dtype == torch.float32:
            gemm = "cublas"  # the f32 path keeps plain cuBLAS (exact f32; no TF32)
        self.gemm = gemm
        chunk = int(os.environ.get("BASAL_LOCAL_GEMM_CHUNK", GEMM_CHUNK))
        # fixed-chunk route: every GEMM on blocks of exactly `chunk` rows, so graph sizes are whole chunks
        self.chunk = chunk if gemm == "chunked" else 1
        self.gemm_plan: dict[str, dict] = {}
        self._sizes: dict[tuple, gemm.CallSizes] = {}  # the verified route's row counts per GEMM key
        self.fp8_bytes = 0
        self._fp8: fp8.Fp8Weights | None = None
        if gemm == "triton":
            self.linear = self.ops.linear
        elif gemm == "chunked":
            self.linear = lambda x, w, b: twins.chunked_linear(x, w, b, chunk)
        elif gemm == "verified":
            self.linear = self._verified_linear(chunk)
        elif gemm == "fp8":
            self._fp8 = self._fp8_weights()
            self.linear = self._verified_linear(chunk, self._fp8.linear)
        else:
            self.linear = twins.linear
        self.block_m = self.ops.ATTN_BLOCK_M if self.use_triton else 64
        self.alt_tiling: tuple[int, int, int, int] | None = None
        if self.use_triton and backend.dtype != torch.float32 and os.environ.get("BASAL_LOCAL_ATTN_ALT", "1") != "0":
            self.alt_tiling = self._pick_alt_tiling()
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None
        self._capture_stream = None
        self.prefix_names: list[str] = []
        self.prefix_rows: dict[str, tuple[int, int]] = {}
        self.prefix_k: list[torch.Tensor] = []
        self.prefix_v: list[torch.Tensor] = []
        self.set_prefixes({})
        cfg = backend.config
        half = cfg.head_dim // 2
        angles = np.arange(cfg.max_position_embeddings, dtype=np.float64)[:, None] * backend.inv_freq[None, :half]
        self.cos = torch.from_numpy(np.cos(angles).astype(np.float32)).to(backend.device)
        self.sin = torch.from_numpy(np.sin(angles).astype(np.float32)).to(backend.device)

    def _pick_alt_tiling(self) -> tuple[int, int, int, int] | None:
        """ALT_TILING where it gives the default tiling's bits on this device, else None (recorded in gemm_plan)."""
        try:
            same = self._alt_tiling_agrees(ALT_TILING)
            why = "same bits" if same else "bits differ: not used"
        except Exception as exc:  # noqa: BLE001 - e.g. a GPU with less shared memory than the tiling needs
            same, why = False, f"does not run here ({type(exc).__name__}): not used"
        self.gemm_plan["attention_alt_tiling"] = "x".join(map(str, ALT_TILING)) + f" ({why})"
        return ALT_TILING if same else None

    def _alt(self, tokens: int) -> bool:
        """Whether a forward of `tokens` (its graph size, or its length when eager) runs the alternative tiling."""
        return self.alt_tiling is not None and (tokens <= ALT_MAX_TOKENS or tokens > TOKEN_BUCKETS[-1])

    def _block_m(self, tokens: int) -> int:
        return self.alt_tiling[0] if self._alt(tokens) else self.block_m

    def _alt_tiling_agrees(self, tiling: tuple[int, int, int, int]) -> bool:
        """Tree attention of one random tree (a cached prefix, a root, children and a grandchild) with the
        process's tiling and with `tiling`, every row and the readout rows: bit for bit the same?"""
        cfg, dev, dt = self.b.config, self.b.device, self.b.dtype
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        n_pre, sizes, parents = 40, (200, 70, 70, 50), (-1, 0, 0, 1)
        token_block = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
        starts, pos = {}, []
        for b, (n, par) in enumerate(zip(sizes, parents)):
            starts[b] = n_pre if par < 0 else starts[par] + sizes[par]
            pos.append(np.arange(starts[b], starts[b] + n))
        positions = np.concatenate(pos).astype(np.int64)
        t = len(positions)
        readout = np.cumsum(sizes) - 1
        g = torch.Generator(device=dev).manual_seed(1234)
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, generator=g).to(dt)
        pk, pv = (torch.randn(n_pre, hkv, d, device=dev, generator=g).to(dt) for _ in range(2))
        q = qkv[:, :hq * d].view(t, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        pos_d = torch.from_numpy(positions.astype(np.int32)).to(dev)
        outs: dict[tuple, torch.Tensor] = {}
        for rows in (None, readout):
            for name, til in (("default", None), ("alt", tiling)):
                bm = til[0] if til else self.block_m
                p = tplan.tile_plan(positions, token_block, np.array(parents, np.int32),
                                    np.array([0, -1, -1, -1], np.int32), [(0, n_pre)], bm, rows=rows)
                n_out = t if rows is None else len(rows)
                out = torch.zeros(n_out, hq * d, dtype=dt, device=dev)
                self.ops.tree_attention(q, k, v, pk, pv, pos_d, torch.from_numpy(p.tiles).to(dev),
                                        torch.from_numpy(p.q_rows).to(dev),
                                        torch.tensor([p.num_tiles], dtype=torch.int32, device=dev), out,
                                        compact=rows is not None, tiling=til)
                outs[(rows is None, name)] = out
        return all(torch.equal(outs[(full, "default")], outs[(full, "alt")]) for full in (True, False))

    def _fp8_weights(self) -> fp8.Fp8Weights:
        """float8 copies of every GEMM weight (per-channel power-of-two scales), the activation quantizer and
        the row-wise scaled GEMM of this device (`cuda_kernels.fp8`); the f16 weights stay as the keys."""
        if self.use_triton:
            quant = self.ops.quant_rows
            x = (torch.randn(8, 320, device=self.b.device) * 9).to(self.b.dtype)
            try:  # the kernel must give the twin's bits; if it cannot (another Triton), the twin runs instead
                (qa, sa), (qb, sb) = quant(x), fp8.quant_rows(x)
                same = torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)) and torch.equal(sa, sb)
            except Exception as exc:  # noqa: BLE001 - any compile or launch failure of the kernel
                same = False
                self.gemm_plan["fp8_quant_error"] = repr(exc)[:300]
            if not same:
                quant = fp8.quant_rows
            self.gemm_plan["fp8_quant"] = "triton" if same else "twin"
            store = fp8.Fp8Weights(quant, fp8.cuda_scaled_mm(self.b.device, self.b.dtype))
            self.gemm_plan["fp8_mm"] = store.mm.__name__
        else:
            store = fp8.Fp8Weights()
        names = [n.strip() for n in os.environ.get("BASAL_LOCAL_FP8_GEMMS", ",".join(FP8_GEMMS)).split(",") if n.strip()]
        unknown = sorted(set(names) - set(FP8_GEMMS))
        if unknown:
            raise ValueError(f"BASAL_LOCAL_FP8_GEMMS: unknown projection {unknown[0]!r} ({', '.join(FP8_GEMMS)})")
        self.gemm_plan["fp8_gemms"] = ",".join(n for n in FP8_GEMMS if n in names)
        for layer in self.b.layers:
            weights = {"qkv": layer.qkv_weight, "o": layer.o_proj_weight, "gate_up": layer.gate_up_weight,
                       "down": layer.down_proj_weight}
            for name in names:
                store.add(weights[name])
        self.fp8_bytes = store.nbytes()
        return store

    def _verified_linear(self, chunk: int, base: gemm.Linear = torch.nn.functional.linear):
        """`base` (cuBLAS f16, or the fp8 GEMM) at verified row counts per weight shape (cuda_kernels.gemm):
        checked once here, on this device; with f16/bf16 cuBLAS, cuBLASLt algorithms pinned per row count where
        they agree and are faster (`gemm.lt_choices`)."""
        layer = self.b.layers[0]
        candidates = sorted(set(TOKEN_BUCKETS) | set(READOUT_BUCKETS) | set(range(GEMM_STEP, TIMED_MAX + 1, GEMM_STEP)))
        if not self.use_triton and base is not torch.nn.functional.linear:
            # the fp8 twin on the CPU (tests): blocks of at most 512 rows keep the load-time check cheap
            candidates = [c for c in candidates if c <= VERIFIED_FLOOR_MAX]
        timed = os.environ.get("BASAL_LOCAL_GEMM_TIMED", "1") != "0"
        lt = self._lt() if base is torch.nn.functional.linear and timed and layer.qkv_weight.is_cuda else None
        sizes: dict[tuple[int, int, bool], gemm.CallSizes] = {}
        calls: dict[tuple, gemm.PinnedCall] = {}
        for w, bias in ((layer.qkv_weight, layer.qkv_bias), (layer.o_proj_weight, layer.o_proj_bias),
                        (layer.gate_up_weight, layer.gate_up_bias), (layer.down_proj_weight, layer.down_proj_bias)):
            key = self._gemm_key(w, bias)
            if key not in sizes:
                plan = gemm.plan_sizes(w, bias, candidates, VERIFIED_FLOOR_MAX, chunk, base)
                times, pins = {}, {}
                if w.is_cuda and plan["route"] == "verified" and timed:
                    times = gemm.time_sizes(w, bias, [m for m in plan["sizes"] if m <= TIMED_MAX], base)
                    if lt is not None:
                        margin = float(os.environ.get("BASAL_LOCAL_GEMM_LT_MARGIN", LT_MARGIN))
                        pins, lt_times = gemm.lt_choices(w, bias, candidates[-1], LT_SIZES, lt, times, margin=margin)
                        times.update(lt_times)
                sizes[key] = gemm.CallSizes(sorted(set(plan["sizes"]) | set(pins)), times)
                calls[key] = gemm.PinnedCall(base, lt, pins)
                report = {m: sizes[key].call(m) for m in TOKEN_BUCKETS + READOUT_BUCKETS
                          if m <= min(TIMED_MAX, sizes[key][-1])}
                self.gemm_plan[f"{w.shape[0]}x{w.shape[1]}" + ("-f16" if self._fp8 and not key[3] else "")] = {
                    "route": plan["route"], "sizes": plan["sizes"][0] if plan["route"] == "verified" else chunk,
                    "disagree": [m for m, ok in plan["agrees"].items() if not ok and m <= 1024],
                    "padded_calls": {m: c for m, c in report.items() if c != m},
                    **({"cublaslt_at": sorted(pins)} if pins else {})}

        def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            key = self._gemm_key(w, b)
            return gemm.sized_linear(x, w, b, sizes[key], calls[key])
        self._sizes = sizes
        return linear

    def _lt(self):
        """A cuBLASLt GEMM on this device (`cuda_kernels.cublaslt`), or None where it is off
        (BASAL_LOCAL_GEMM_LT=0) or cannot run here (recorded in gemm_plan)."""
        if os.environ.get("BASAL_LOCAL_GEMM_LT", "1") == "0":
            self.gemm_plan["cublaslt"] = "off (BASAL_LOCAL_GEMM_LT=0)"
            return None
        try:
            lt = cublaslt.LtGemm(self.b.device)
        except Exception as exc:  # noqa: BLE001 - no library, another version: the verified route as before
            self.gemm_plan["cublaslt"] = f"not used ({type(exc).__name__}: {str(exc)[:120]})"
            return None
        self.gemm_plan["cublaslt"] = "pinned algorithms where they agree and are faster"
        return lt

    def padded_rows(self, m: int, w: torch.Tensor, b: torch.Tensor | None) -> int:
        """The rows of the one library call a GEMM of m rows on `w` makes (m where it needs no padding or
        several calls): the kernel before it writes its output that tall, so the call reads it in place
        instead of copying it into a padded block (the max preset's down projection pads a 320-token graph to
        352 rows: 50 copies of 9 MB a forward)."""
        sizes = self._sizes.get(self._gemm_key(w, b)) if self._sizes else None
        if not sizes or m == 0:
            return m
        pieces = gemm.row_pieces(m, sizes)
        return pieces[0][2] if len(pieces) == 1 else m

    def _gemm_key(self, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int, bool, bool]:
        """What a GEMM's verified sizes depend on: the weight's shape, a bias, and fp8 or not."""
        return w.shape[0], w.shape[1], bias is not None, self._fp8 is not None and self._fp8.has(w)

    # ---- cached prefixes ---------------------------------------------------------------------------------
    def set_prefixes(self, prefix_kv: dict) -> None:
        """Lay the cached prefixes' K/V out as one [P, Hkv, D] buffer per layer (rows by prefix)."""
        self.prefix_names = list(prefix_kv)
        offset = 0
        for name in self.prefix_names:
            n = prefix_kv[name][0]
            self.prefix_rows[name] = (offset, n)
            offset += n
        layers = len(self.b.layers)
        cfg = self.b.config
        empty = torch.zeros(0, cfg.num_key_value_heads, cfg.head_dim, dtype=self.b.dtype, device=self.b.device)
        self.prefix_k = [torch.cat([prefix_kv[n][1][i][0] for n in self.prefix_names]) if self.prefix_names
                         else empty for i in range(layers)]
        self.prefix_v = [torch.cat([prefix_kv[n][1][i][1] for n in self.prefix_names]) if self.prefix_names
                         else empty for i in range(layers)]
        self.graphs.clear()  # captured graphs read the old buffers

    # ---- inputs --------------------------------------------------------------------------------------------
    def _layout(self, size: int, tile_cap: int, r_cap: int) -> tuple[dict, int]:
        rec = tplan.RECORD
        fields = {"ids": size, "pos": size, "nt": 1, "qrows": size, "tiles": tile_cap * rec, "nt_last": 1,
                  "qrows_last": r_cap, "tiles_last": r_cap * rec, "readout": r_cap, "letters": LETTER_CAP}
        layout, offset = {}, 0
        for name, length in fields.items():
            layout[name] = (offset, length)
            # every field 16-byte aligned whatever the sizes: Triton compiles one variant per pointer alignment,
            # so unaligned views (an eager forward of an odd token count) cost seconds of JIT on first use
            offset += -(-length // 4) * 4
        return layout, offset

    def _host_inputs(self, batch: PackedBatch, size: int, tile_cap: int, r_cap: int,
                     buf: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
        """The forward's int32 inputs laid out in one buffer (`buf`, zeroed here, or a new one)."""
        n = batch.num_tokens
        if n > size:
            raise RuntimeError(f"forward inputs need {n} slots, the upload buffer has {size}")
        rows = [self.prefix_rows[name] for name in batch.prefixes]
        block_m = self._block_m(size)
        full = tplan.tile_plan(batch.positions, batch.token_block, batch.block_parent, batch.block_prefix, rows,
                               block_m)
        last = tplan.tile_plan(batch.positions, batch.token_block, batch.block_parent, batch.block_prefix, rows,
                               block_m, rows=batch.readout_index)
        if full.num_tiles > tile_cap or last.num_tiles > r_cap:
            raise OverflowError("plan larger than the graph's tables")
        layout, total = self._layout(size, tile_cap, r_cap)
        if buf is None:
            buf = np.zeros(total, dtype=np.int32)
        else:
            buf[:] = 0

        def put(name: str, values) -> None:
            o = layout[name][0]
            flat = np.asarray(values).ravel()
            buf[o:o + flat.size] = flat

        letters = np.asarray(batch.letter_ids).ravel()[:LETTER_CAP]
        put("ids", batch.token_ids)
        put("pos", batch.positions)
        put("nt", [full.num_tiles])
        put("qrows", full.q_rows)
        put("tiles", full.tiles)
        put("nt_last", [last.num_tiles])
        put("qrows_last", last.q_rows)
        put("tiles_last", last.tiles)
        put("readout", batch.readout_index)
        # every slot a valid id: the graph's letter kernel reads all LETTER_CAP of them
        put("letters", np.concatenate([letters, np.full(LETTER_CAP - letters.size, letters[0] if letters.size else 0)]))
        return buf, layout

    @staticmethod
    def _views(dev_buf: torch.Tensor, layout: dict, plans: tuple[tplan.TilePlan, tplan.TilePlan] | None = None):
        v = {name: dev_buf[o:o + n] for name, (o, n) in layout.items()}
        v["tiles"] = v["tiles"].view(-1, tplan.RECORD)
        v["tiles_last"] = v["tiles_last"].view(-1, tplan.RECORD)
        return v

    def _upload(self, batch: PackedBatch, size: int, tile_cap: int, r_cap: int, into: _Graph | None = None):
        """The inputs on the device: a new tensor, or (a graph's) written through its pinned staging buffer."""
        if into is None:
            buf, layout = self._host_inputs(batch, size, tile_cap, r_cap)
            return torch.from_numpy(buf).to(self.b.device, non_blocking=False), layout
        # the staging buffer is free once the copy out of it ran (launches do not wait for their logits)
        pending = into.uploaded[0]
        if pending is not None:
            pending.synchronize()
            into.uploaded[0] = None
        self._host_inputs(batch, size, tile_cap, r_cap, into.staging_np)
        into.static.copy_(into.staging, non_blocking=True)
        return into.static, into.layout

    # ---- the layers ------------------------------------------------------------------------------------------
    def _attention(self, i: int, qkv: torch.Tensor, v: dict, last: bool) -> torch.Tensor:
        cfg = self.b.config
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        t = qkv.shape[0]
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
        val = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        tiles, q_rows, nt = (v["tiles_last"], v["qrows_last"], v["nt_last"]) if last else \
            (v["tiles"], v["qrows"], v["nt"])
        rows = q_rows.shape[0] if last else t
        if self.use_triton:
            # as tall as the o projection's library call (padded_rows): the rows past `rows` are never read back
            layer = self.b.layers[i]
            out = torch.empty(self.padded_rows(rows, layer.o_proj_weight, layer.o_proj_bias), hq * d,
                              dtype=qkv.dtype, device=qkv.device)
            return self.ops.tree_attention(q, k, val, self.prefix_k[i], self.prefix_v[i], v["pos"], tiles, q_rows,
                                           nt, out, compact=last, tiling=self.alt_tiling if self._alt(t) else None)
        n_tiles = int(nt[0])
        p = tplan.TilePlan(tiles[:n_tiles].cpu().numpy(), q_rows.cpu().numpy())
        out = twins.tree_attention(q, k, val, self.prefix_k[i], self.prefix_v[i], v["pos"], p, rows, compact=last)
        return out.view(rows, hq * d)

    def layers(self, v: dict, capture: list | None = None, sync: bool = False) -> Iterator[torch.Tensor | None]:
        """Run every layer; yields None after each but the last, then the final-normed readout rows."""
        b, cfg, ops = self.b, self.b.config, self.ops
        hq, hkv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        x = b.embed_tokens.index_select(0, v["ids"])
        delta = None
        n_layers = len(b.layers)
        for i, layer in enumerate(b.layers):
            last = i == n_layers - 1
            m = x.shape[0]
            h, x = ops.add_rms_norm(x, delta, layer.input_layernorm, eps,
                                    self.padded_rows(m, layer.qkv_weight, layer.qkv_bias))
            qkv = self.linear(h, layer.qkv_weight, layer.qkv_bias)[:m]
            ops.rope_(qkv, v["pos"], self.cos, self.sin, hq, hkv, d)
            if capture is not None:
                t = qkv.shape[0]
                capture.append((qkv[:, hq * d:(hq + hkv) * d].reshape(t, hkv, d).clone(),
                                qkv[:, (hq + hkv) * d:].reshape(t, hkv, d).clone()))
            attn = self._attention(i, qkv, v, last)
            if last:
                x = x.index_select(0, v["readout"])
            m = x.shape[0]
            o = self.linear(attn, layer.o_proj_weight, layer.o_proj_bias)[:m]
            h, x = ops.add_rms_norm(x, o, layer.post_attention_layernorm, eps,
                                    self.padded_rows(m, layer.gate_up_weight, layer.gate_up_bias))
            # one expression: the gate/up output is freed once SwiGLU has read it and SwiGLU's once down has (held
            # in locals to the next layer, a 17k-token document's forward peaked 1.1 GB higher: session 6 call 5)
            delta = self.linear(ops.silu_mul(self.linear(h, layer.gate_up_weight, layer.gate_up_bias)[:m],
                                             self.padded_rows(m, layer.down_proj_weight, layer.down_proj_bias)),
                                layer.down_proj_weight, layer.down_proj_bias)[:m]
            if not last:
                if sync and x.is_cuda:
                    torch.cuda.synchronize()  # the device is idle at a yield: a parked long lane hands it over
                yield None
        h, _ = ops.add_rms_norm(x, delta, b.norm, eps)
        yield h

    def _logits(self, h: torch.Tensor, batch: PackedBatch) -> np.ndarray:
        letters = torch.from_numpy(batch.letter_ids.astype(np.int64)).to(self.b.device)
        r = len(batch.readout_index)
        logits = self.ops.letter_logits(h[:r], self.b.lm_head, letters)
        out = logits.cpu().numpy()
        if not np.isfinite(out).all():
            raise FloatingPointError("non-finite letter logit")
        return out

    # ---- forwards ---------------------------------------------------------------------------------------------
    def forward_steps(self, batch: PackedBatch, capture: list | None = None) -> Iterator[np.ndarray | None]:
        n_tiles_hint = batch.num_tokens // self.block_m + len(batch.block_parent) + 1
        dev_buf, layout = self._upload(batch, batch.num_tokens, n_tiles_hint, max(1, len(batch.readout_index)))
        v = self._views(dev_buf, layout)
        for out in self.layers(v, capture, sync=True):
            if out is None:
                yield None
            else:
                yield self._logits(out, batch)

    def _graph_for(self, batch: PackedBatch) -> _Graph | None:
        """The captured graph a batch fits, with its inputs uploaded; None where it runs eagerly."""
        if self.b.cuda_graphs and batch.num_tokens <= TOKEN_BUCKETS[-1] and \
                len(batch.readout_index) <= READOUT_BUCKETS[-1] and len(batch.letter_ids) <= LETTER_CAP:
            size = self.bucket(batch.num_tokens)
            r_cap = next(r for r in READOUT_BUCKETS if r >= len(batch.readout_index))
            if (size, r_cap) in self.graphs or len(self.graphs) < MAX_GRAPHS:
                try:
                    entry = self._graph(size, r_cap)
                    self._upload(batch, size, _tile_cap(size), r_cap, into=entry)
                except OverflowError:
                    return None
                return entry
        return None

    def forward(self, batch: PackedBatch) -> np.ndarray:
        entry = self._graph_for(batch)
        if entry is not None:
            entry.graph.replay()
            return self._graph_logits(entry, batch)
        *_, logits = self.forward_steps(batch)
        return logits

    def launch(self, batch: PackedBatch) -> Launched | Ready:
        """`forward` without waiting for the device: the graph is replayed and its logits copied back
        asynchronously; the eager path (no graph fits) runs to the end here."""
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        entry = self._graph_for(batch)
        if entry is None:
            *_, logits = self.forward_steps(batch)
            return Ready(logits)
        uploaded = torch.cuda.Event()
        uploaded.record()
        entry.uploaded[0] = uploaded
        entry.graph.replay()
        host = torch.empty(entry.logits.shape, dtype=entry.logits.dtype, pin_memory=True)
        host.copy_(entry.logits, non_blocking=True)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return Launched(host, len(batch.readout_index), len(batch.letter_ids), start, end)

    def _graph_logits(self, entry: _Graph, batch: PackedBatch) -> np.ndarray:
        """The letter logits the graph computed: [r_cap, LETTER_CAP] back to the host, cut to the batch's."""
        out = entry.logits.cpu().numpy()[:len(batch.readout_index), :len(batch.letter_ids)]
        if not np.isfinite(out).all():
            raise FloatingPointError("non-finite letter logit")
        return out

    def bucket(self, tokens: int) -> int:
        """The graph size for a forward of `tokens`: the next bucket, rounded up to whole GEMM chunks."""
        size = next(s for s in TOKEN_BUCKETS if s >= tokens)
        return -(-size // self.chunk) * self.chunk

    def _graph(self, size: int, r_cap: int) -> _Graph:
        key = (size, r_cap)
        if key not in self.graphs:
            static, layout = self._upload(self._dummy(size, r_cap), size, _tile_cap(size), r_cap)
            v = self._views(static, layout)
            lm_head = self.b.lm_head
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the capture (Triton compiles, cuBLAS handles)
                for _ in range(2):
                    *_, h = self.layers(v)
                    self.ops.letter_logits(h, lm_head, v["letters"])
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            if self._capture_stream is None:  # torch's default capture stream lives on the first device used
                self._capture_stream = torch.cuda.Stream()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream):
                *_, h = self.layers(v)
                # the letter logits inside the graph too: no host round trip between the last layer and them
                logits = self.ops.letter_logits(h, lm_head, v["letters"])
            staging = torch.empty(static.shape, dtype=static.dtype, pin_memory=True)
            self.graphs[key] = _Graph(graph, static, layout, logits, staging, staging.numpy(), [None])
        return self.graphs[key]

    def _dummy(self, n: int, r_cap: int, children: int = 0) -> PackedBatch:
        """A valid forward of `n` tokens: one prefix-less block (plus `children` blocks of 64 tokens branching off
        it, each read out at its end), `r_cap` readouts."""
        root = n - 64 * children
        token_block = np.concatenate([np.zeros(root, np.int32), np.repeat(np.arange(1, children + 1, dtype=np.int32),
                                                                           64)])
        positions = np.concatenate([np.arange(root), np.tile(np.arange(root, root + 64), children)]).astype(np.int64)
        readout = (np.arange(n - r_cap, n, dtype=np.int64) if r_cap <= n else np.arange(n, dtype=np.int64)) \
            if not children else root + 64 * np.arange(children, dtype=np.int64) + 63
        return PackedBatch(token_ids=np.zeros(n, np.int64), positions=positions, token_block=token_block,
                           block_parent=np.array([-1] + [0] * children, np.int32),
                           block_prefix=np.full(children + 1, -1, np.int32), readout_index=readout,
                           letter_ids=np.zeros(1, np.int64), prefixes=[])

    def warmup(self, max_tokens: int) -> None:
        for size in sorted({self.bucket(s) for s in TOKEN_BUCKETS if s <= max(max_tokens, TOKEN_BUCKETS[0])}):
            for r_cap in READOUT_BUCKETS:
                if r_cap <= max(4, size // 32):
                    self._graph(size, r_cap)
        self.warm_long()

    def warm_long(self) -> None:
        """One eager forward longer than the largest graph (a long document with a few questions off it), so
        the first long request finds its kernels, library handles and memory ready (a 16.5k-token document
        took 3.3 s the first time and 1.0 s after on the H200, docs/PERFORMANCE.md)."""
        n = min(LONG_WARMUP_TOKENS, self.b.config.max_position_embeddings - 1)
        if n <= TOKEN_BUCKETS[-1]:
            return
        for _ in self.forward_steps(self._dummy(n, 4, children=4)):
            pass
