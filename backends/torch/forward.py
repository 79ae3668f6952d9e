"""The torch backend's one forward: a fused Llama layer loop over a packed prefix tree, its ops chosen once.

Per layer: residual+RMSNorm, the q/k/v GEMM, RoPE in place (f32 math), tree attention reading q/k/v straight
from the fused projection (the cached prefix K/V from its own buffer by row), o GEMM, residual+RMSNorm,
gate/up GEMM, SwiGLU, down GEMM. The last layer runs attention, o_proj and the MLP at the readout rows only.
The ops are the Triton kernels on CUDA (`cuda_kernels.kernels`) or their plain-torch twins
(`cuda_kernels.twins`: the CPU f32 reference); the GEMM route is `cuda_kernels.gemm.build_linear`'s.

A forward's host-side inputs (token ids, positions, the attention tile tables) travel as ONE int32 buffer, so
`graphs.Graphs` can capture this same forward with its inputs in device memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from basal_local.cuda_kernels import fp8, gemm, triton_available, triton_kernels, twins
from basal_local.cuda_kernels import plan as tplan

from .. import host
from ..base import PackedBatch
from .options import FP8_GEMMS, TorchOptions

# the sizes a forward's GEMMs are called at (graph sizes and readout sizes, graphs.py): the verified route
# checks these and every multiple of GEMM_STEP up to TIMED_MAX rows at load
TOKEN_BUCKETS = (64, 128, 192, 224, 256, 272, 288, 304, 320, 336, 352, 368, 384, 416, 448, 480, 512, 640, 768, 1024,
                 1536, 2048, 3072, 4096, 6144, 8192)
READOUT_BUCKETS = (4, 16, 64, 256)
GEMM_STEP = 16
TIMED_MAX = 1024
# the verified route uses cuBLAS as is where its results agree at some row count of at most this many rows
VERIFIED_FLOOR_MAX = 512
# where cuBLASLt algorithms are tried: the sizes a forward really calls at (the GEMM step between them would
# cost ~4x the load time for calls that pad to these anyway)
LT_SIZES = tuple(sorted({s for s in TOKEN_BUCKETS if s <= TIMED_MAX} | set(READOUT_BUCKETS)))
# a second attention tiling for forwards of up to ALT_MAX_TOKENS tokens and eager ones past the largest graph,
# where it is faster (docs/CUDA_NOTES.md); used only where it gives the default tiling's bits on this device
ALT_TILING = (128, 64, 8, 3)
ALT_MAX_TOKENS = 1024
# letter columns of the logits (the most letters a batch can ask: protocol LETTERS has 10)
LETTER_CAP = 16
# the attention's split slots per SM: a split tile takes a slot per chunk (a state-cache hit of 5 questions about an
# 18k-token document: 45 tiles of ~5 chunks on an H200's 264), a tiling of more rows never splits
SPLIT_SLOTS_PER_SM = 2


def last_cap(r_cap: int) -> int:
    """Records the last layer's table holds for `r_cap` readouts: a readout tile each, split into chunk records
    where a few read a long cached document (plan.split_tiles; 4 x: up to ~16k keys each)."""
    return 4 * r_cap


class Forward:
    def __init__(self, backend, options: TorchOptions, kernels: bool) -> None:
        # no reference cycle with the backend: a dropped backend (and its CUDA graphs) is freed where it is
        # dropped, never by the garbage collector in the middle of another backend's graph capture
        self.b = weakref.proxy(backend)
        self.options = options
        self.use_triton = kernels and backend.device.startswith("cuda") and triton_available()
        self.ops = triton_kernels() if self.use_triton else twins
        self.report: dict = {}
        self.fp8_bytes = 0
        self._fp8: fp8.Fp8Weights | None = None
        self._gemms: dict[tuple, gemm.SizedGemm] = {}
        # dtype fp8: the fp8 GEMMs at verified row counts; f32 keeps plain cuBLAS (exact f32; no TF32)
        self.gemm = "fp8" if backend.dtype_name == "fp8" else "cublas" if backend.dtype == torch.float32 \
            else options.gemm
        if self.gemm == "chunked":  # every library call of exactly gemm_chunk rows: invariant by construction
            chunk = gemm.CallSizes([options.gemm_chunk])
            self.linear = lambda x, w, b: gemm.sized_linear(x, w, b, chunk)
        elif self.gemm == "cublas":
            self.linear = F.linear
        else:
            self.linear = self._verified()
        self.tiling = tuple(options.attention_tiling) if self.use_triton else (64, 64, 4, 2)
        alt = self.use_triton and options.attention_alt_tiling and backend.dtype != torch.float32
        self.scratch = self._scratch((self.tiling, ALT_TILING) if alt else (self.tiling,)) if self.use_triton else None
        self.alt_tiling = self._pick_alt_tiling() if alt else None
        self.prefix_rows: dict[str, tuple[int, int]] = {}  # cached prefix -> (pool row, length)
        self.prefix_k: list[torch.Tensor] = []
        self.prefix_v: list[torch.Tensor] = []
        self.capacity = 0
        self.open_pool(0)
        cos, sin = host.rope_tables(backend.config)
        self.cos, self.sin = torch.from_numpy(cos).to(backend.device), torch.from_numpy(sin).to(backend.device)

    # ---- the GEMMs -------------------------------------------------------------------------------------------
    def _verified(self):
        """cuBLAS (or the fp8 GEMM) at verified row counts per weight shape (`gemm.build_linear`)."""
        base = F.linear
        if self.gemm == "fp8":
            names = [n for n in FP8_GEMMS if n in self.options.fp8_gemms]
            if getattr(self.b, "fp8_checkpoint", None) is not None:
                # a ModelOpt FP8 checkpoint: its e4m3 weights as loaded, its static scales (llama.py's load)
                kernel = self.ops.quant_static if self.use_triton else None
                self._fp8 = fp8.build_checkpoint_store(self.b.layers, self.b.fp8_checkpoint, names, self.b.device,
                                                       self.b.dtype, kernel, self.report)
                self.report["fp8_requantized_parts"] = self.b.fp8_requantized
            else:
                self._fp8 = fp8.build_store(self.b.layers, names, self.b.device, self.b.dtype,
                                            self.ops.quant_rows if self.use_triton else None, self.report)
            self.fp8_bytes = self._fp8.nbytes()
            base = self._fp8.linear
        candidates = sorted(set(TOKEN_BUCKETS) | set(READOUT_BUCKETS) | set(range(GEMM_STEP, TIMED_MAX + 1, GEMM_STEP)))
        if not self.use_triton and base is not F.linear:
            candidates = [c for c in candidates if c <= VERIFIED_FLOOR_MAX]  # the fp8 twin: a cheap check
        layer = self.b.layers[0]
        lt = gemm.open_lt(self.b.device, self.options, self.report) \
            if base is F.linear and layer.qkv_weight.is_cuda else None
        for w, bias in ((layer.qkv_weight, layer.qkv_bias), (layer.o_proj_weight, layer.o_proj_bias),
                        (layer.gate_up_weight, layer.gate_up_bias), (layer.down_proj_weight, layer.down_proj_bias)):
            key = self._gemm_key(w, bias)
            if key not in self._gemms:
                self._gemms[key], plan = gemm.build_linear(
                    w, bias, self.options, candidates, base, lt, LT_SIZES, VERIFIED_FLOOR_MAX, TIMED_MAX,
                    TOKEN_BUCKETS + READOUT_BUCKETS, dtype=self.b.dtype)
                self.report[f"{w.shape[0]}x{w.shape[1]}" + ("-f16" if self._fp8 and not key[3] else "")] = plan
        gemms, store = self._gemms, self._fp8  # not self: the closure would make a cycle through self.linear
        return lambda x, w, b: gemms[(w.shape[0], w.shape[1], b is not None, store is not None and store.has(w))](
            x, w, b)

    def padded_rows(self, m: int, w: torch.Tensor, b: torch.Tensor | None) -> int:
        """The rows of the one library call a GEMM of m rows on `w` makes: the op before it writes its output
        that tall, so the call reads it in place instead of copying it into a padded block."""
        sized = self._gemms.get(self._gemm_key(w, b)) if self._gemms else None
        return sized.padded_rows(m) if sized is not None else m

    def _gemm_key(self, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int, bool, bool]:
        """What a GEMM's verified sizes depend on: the weight's shape, a bias, and fp8 or not."""
        return w.shape[0], w.shape[1], bias is not None, self._fp8 is not None and self._fp8.has(w)

    # ---- the attention tiling ------------------------------------------------------------------------------
    def _pick_alt_tiling(self, tiling: tuple[int, int, int, int] = ALT_TILING,
                         key: str = "attention_alt_tiling") -> tuple[int, int, int, int] | None:
        try:
            same = self._alt_tiling_agrees(tiling)
            why = "same bits" if same else "bits differ: not used"
        except Exception as exc:  # noqa: BLE001 - e.g. a GPU with less shared memory than the tiling needs
            same, why = False, f"does not run here ({type(exc).__name__}): not used"
        self.report[key] = "x".join(map(str, tiling)) + f" ({why})"
        return tiling if same else None

    def _scratch(self, tilings: tuple[tuple[int, int, int, int], ...]):
        """The attention's scratch (kernels.Scratch) for these tilings: a tile of more than one chunk of keys
        merges its chunks there, and a split tile's chunks leave their partials there (cuda_kernels/plan.py)."""
        cfg = self.b.config
        self.sms = sms = self.ops.num_sms(torch.device(self.b.device).index or 0)
        nprog, split_slots, n_kv = 4 * sms, SPLIT_SLOTS_PER_SM * sms, cfg.num_key_value_heads
        # only tilings of at most SPLIT_ROWS rows split (a wider one runs forwards of many tiles)
        need = max(self.ops.Scratch.needs(t[0], nprog, split_slots if t[0] <= tplan.SPLIT_ROWS else 0, n_kv)
                   for t in tilings)
        scratch = self.ops.Scratch(self.b.device, n_kv, cfg.head_dim, need, split_slots, nprog)
        self.report["attention_scratch_mb"] = round(scratch.nbytes() / 1e6, 1)
        return scratch

    def split(self, plan: tplan.TilePlan, cap: int, block_m: int) -> tplan.TilePlan:
        """`plan` with its long tiles split into chunk records where they would leave the device idle (at most
        `cap` records and the scratch's slots for `block_m`-row tiles; the same bits either way). The twins take
        plans as they are."""
        if self.scratch is None or block_m > tplan.SPLIT_ROWS:
            return plan
        sc, n_kv = self.scratch, self.b.config.num_key_value_heads
        slots = min(sc.split_slots, (sc.rows // block_m - 2 * sc.nprog) // n_kv)
        return tplan.split_tiles(plan, n_kv, self.sms, cap, slots)[0]

    def alt(self, tokens: int) -> bool:
        """Whether a forward of `tokens` (its graph size, or its length when eager) runs the alternative tiling."""
        return self.alt_tiling is not None and (tokens <= ALT_MAX_TOKENS or tokens > TOKEN_BUCKETS[-1])

    def tiling_for(self, tokens: int) -> tuple[int, int, int, int]:
        """The attention tiling of a forward of `tokens`: the alternative one where `alt`, else the default
        (both the default's bits)."""
        return self.alt_tiling if self.alt_tiling is not None and self.alt(tokens) else self.tiling

    def block_m(self, tokens: int) -> int:
        """Queries per tile of the plan: the kernel's rows are (query, head) pairs of one K/V head's query heads
        (kernels.queries_per_tile); the twins take tiles of the tiling's rows in queries."""
        rows = self.tiling_for(tokens)[0]
        if not self.use_triton:
            return rows
        cfg = self.b.config
        return max(1, rows // (cfg.num_attention_heads // cfg.num_key_value_heads))

    def _alt_tiling_agrees(self, tiling: tuple[int, int, int, int]) -> bool:
        """Tree attention of one random tree (a cached prefix, a root, children and a grandchild) with the
        default tiling and with `tiling`, every row and the readout rows: bit for bit the same?"""
        cfg, dev, dt = self.b.config, self.b.device, self.b.dtype
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        n_pre, sizes = 40, (200, 70, 70, 50)
        positions, token_block, parents = host.tree_tokens(n_pre, sizes, (-1, 0, 0, 1))
        t = len(positions)
        readout = np.cumsum(sizes) - 1
        g = torch.Generator(device=dev).manual_seed(1234)
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, generator=g).to(dt)
        pk, pv = (torch.randn(n_pre, hkv, d, device=dev, generator=g).to(dt) for _ in range(2))
        q, k, v = self._split(qkv)
        pos_d = torch.from_numpy(positions.astype(np.int32)).to(dev)
        outs: dict[tuple, torch.Tensor] = {}
        for rows in (None, readout):
            for name, til in (("default", self.tiling), ("alt", tiling)):
                p = tplan.tile_plan(positions, token_block, parents, np.array([0, -1, -1, -1], np.int32), [(0, n_pre)],
                                    max(1, til[0] // (hq // hkv)), rows=rows)
                out = torch.zeros(t if rows is None else len(rows), hq * d, dtype=dt, device=dev)
                self.ops.tree_attention(q, k, v, pk, pv, pos_d, torch.from_numpy(p.tiles).to(dev),
                                        torch.from_numpy(p.q_rows).to(dev),
                                        torch.tensor([p.num_tiles], dtype=torch.int32, device=dev), out,
                                        compact=rows is not None, tiling=til, scratch=self.scratch)
                outs[(rows is None, name)] = out
        return all(torch.equal(outs[(full, "default")], outs[(full, "alt")]) for full in (True, False))

    # ---- cached prefixes: one pool of K/V rows per layer -------------------------------------------------
    def open_pool(self, capacity: int) -> None:
        """A [capacity, Hkv, D] K and V buffer per layer (the templates and the state cache, by row); the rows
        already held are kept. CUDA graphs read these buffers, so a new pool means new graphs."""
        cfg, dev, dt = self.b.config, self.b.device, self.b.dtype
        old = self.prefix_k, self.prefix_v
        self.prefix_k, self.prefix_v = (
            [torch.empty(capacity, cfg.num_key_value_heads, cfg.head_dim, dtype=dt, device=dev)
             for _ in self.b.layers] for _ in (0, 1))
        keep = min(capacity, old[0][0].shape[0]) if old[0] else 0
        for i in range(len(old[0])):
            if keep:
                self.prefix_k[i][:keep].copy_(old[0][i][:keep])
                self.prefix_v[i][:keep].copy_(old[1][i][:keep])
        self.capacity = capacity

    def kv_bytes_per_token(self) -> int:
        cfg = self.b.config
        return 2 * len(self.b.layers) * cfg.num_key_value_heads * cfg.head_dim * self.b.dtype.itemsize

    def fill_plan(self, batch: PackedBatch) -> tuple[np.ndarray | None, list[tuple[np.ndarray, np.ndarray]]]:
        """Where the forward stores the K/V its fills keep: per token its pool row + 1 (0: none; RoPE stores it
        there), and the rows of a token two fills keep, copied pool to pool after the forward (source, dest).
        Copies each fill's parent rows now (pool to pool, rows no batch in flight reads) and records the rows."""
        if not batch.fills:
            return None, []
        dst = np.zeros(batch.num_tokens, dtype=np.int32)
        after = []
        for f in batch.fills:
            if f.offset + f.length > self.capacity:
                raise ValueError(f"cached prefix {f.name!r} ends at row {f.offset + f.length}, past the pool's "
                                 f"{self.capacity}")
            if f.parent_len:
                src, _ = self.prefix_rows[f.parent]
                for pool in (*self.prefix_k, *self.prefix_v):
                    pool[f.offset:f.offset + f.parent_len].copy_(pool[src:src + f.parent_len])
            tokens = np.asarray(f.tokens, dtype=np.int64)
            rows = np.arange(f.offset + f.parent_len, f.offset + f.length, dtype=np.int32) + 1
            free = dst[tokens] == 0
            dst[tokens[free]] = rows[free]
            if not free.all():  # a token an earlier fill of this batch keeps already
                after.append((dst[tokens[~free]] - 1, rows[~free] - 1))
            self.prefix_rows[f.name] = (f.offset, f.length)
        return dst, after

    def copy_after(self, after: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """The pool-to-pool copies of `fill_plan`, once the forward has stored the sources."""
        cuda = self.b.device.startswith("cuda")
        for src, dest in after:
            # from pinned memory without waiting: a copy from pageable memory would hold the host until the
            # forward before it ended, and the lane could not launch the next batch meanwhile (the caching host
            # allocator keeps the pinned block until the copy ran)
            s, d = (torch.from_numpy(a.astype(np.int64)) for a in (src, dest))
            if cuda:
                s, d = (t.pin_memory().to(self.b.device, non_blocking=True) for t in (s, d))
            elif self.b.device != "cpu":  # (MPS: where the pools are)
                s, d = s.to(self.b.device), d.to(self.b.device)
            for pool in (*self.prefix_k, *self.prefix_v):
                pool.index_copy_(0, d, pool.index_select(0, s))

    # ---- inputs ------------------------------------------------------------------------------------------
    @staticmethod
    def layout(size: int, tile_cap: int, r_cap: int) -> tuple[dict, int]:
        rec = tplan.RECORD
        fields = {"ids": size, "pos": size, "fill": size, "nt": 1, "qrows": size, "tiles": tile_cap * rec, "nt_last": 1,
                  "qrows_last": r_cap, "tiles_last": last_cap(r_cap) * rec, "readout": r_cap, "letters": LETTER_CAP}
        layout, offset = {}, 0
        for name, length in fields.items():
            layout[name] = (offset, length)
            # every field 16-byte aligned whatever the sizes: Triton compiles one variant per pointer alignment,
            # so unaligned views (an eager forward of an odd token count) cost seconds of JIT on first use
            offset += -(-length // 4) * 4
        return layout, offset

    def host_inputs(self, batch: PackedBatch, size: int, tile_cap: int, r_cap: int,
                    buf: np.ndarray | None = None, fill: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
        """The forward's int32 inputs laid out in one buffer (`buf`, zeroed here, or a new one); `fill` is
        `fill_plan`'s pool row + 1 per token."""
        if batch.num_tokens > size:
            raise RuntimeError(f"forward inputs need {batch.num_tokens} slots, the upload buffer has {size}")
        rows = [self.prefix_rows[name] for name in batch.prefixes]
        if batch.prefix_lengths:  # the rows continue these many tokens of each cached prefix
            rows = [(offset, used) for (offset, _), used in zip(rows, batch.prefix_lengths)]
        args = (batch.positions, batch.token_block, batch.block_parent, batch.block_prefix, rows, self.block_m(size))
        full, last = tplan.tile_plans(*args, rows=batch.readout_index)
        if full.num_tiles > tile_cap or last.num_tiles > r_cap:
            raise OverflowError("plan larger than the graph's tables")
        full = self.split(full, tile_cap, self.tiling_for(size)[0])
        last = self.split(last, last_cap(r_cap), self.tiling_for(size)[0])
        layout, total = self.layout(size, tile_cap, r_cap)
        if buf is None:
            buf = np.zeros(total, dtype=np.int32)
        else:
            buf[:] = 0
        letters = np.asarray(batch.letter_ids).ravel()[:LETTER_CAP]
        # every letter slot a valid id: the graph's letter kernel reads all LETTER_CAP of them
        letters = np.concatenate([letters, np.full(LETTER_CAP - letters.size, letters[0] if letters.size else 0)])
        for name, values in (("ids", batch.token_ids), ("pos", batch.positions), ("fill", () if fill is None else fill),
                             ("nt", [full.num_tiles]),
                             ("qrows", full.q_rows), ("tiles", full.tiles), ("nt_last", [last.num_tiles]),
                             ("qrows_last", last.q_rows), ("tiles_last", last.tiles),
                             ("readout", batch.readout_index), ("letters", letters)):
            flat = np.asarray(values).ravel()
            buf[layout[name][0]:layout[name][0] + flat.size] = flat
        return buf, layout

    @staticmethod
    def views(dev_buf: torch.Tensor, layout: dict) -> dict:
        v = {name: dev_buf[o:o + n] for name, (o, n) in layout.items()}
        v["tiles"] = v["tiles"].view(-1, tplan.RECORD)
        v["tiles_last"] = v["tiles_last"].view(-1, tplan.RECORD)
        return v

    # ---- the layers ------------------------------------------------------------------------------------------
    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.b.config
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        t = qkv.shape[0]
        return (qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d),
                qkv[:, (hq + hkv) * d:].view(t, hkv, d))

    def _attention(self, i: int, qkv: torch.Tensor, v: dict, last: bool) -> torch.Tensor:
        q, k, val = self._split(qkv)
        t, width = qkv.shape[0], q.shape[1] * q.shape[2]
        tiles, q_rows, nt = (v["tiles_last"], v["qrows_last"], v["nt_last"]) if last else \
            (v["tiles"], v["qrows"], v["nt"])
        rows = q_rows.shape[0] if last else t
        if self.use_triton:
            tiling = self.tiling_for(t)
            # as tall as the o projection's library call (padded_rows): the rows past `rows` are never read back
            layer = self.b.layers[i]
            out = torch.empty(self.padded_rows(rows, layer.o_proj_weight, layer.o_proj_bias), width,
                              dtype=qkv.dtype, device=qkv.device)
            return self.ops.tree_attention(q, k, val, self.prefix_k[i], self.prefix_v[i], v["pos"], tiles, q_rows,
                                           nt, out, compact=last, tiling=tiling, scratch=self.scratch)
        p = tplan.TilePlan(tiles[:int(nt[0])].cpu().numpy(), q_rows.cpu().numpy())
        out = twins.tree_attention(q, k, val, self.prefix_k[i], self.prefix_v[i], v["pos"], p, rows, compact=last)
        return out.view(rows, width)

    def layers(self, v: dict, capture: list | None = None, sync: bool = False) -> Iterator[torch.Tensor | None]:
        """Run every layer; yields None after each but the last, then the final-normed readout rows."""
        b, ops, eps = self.b, self.ops, self.b.config.rms_norm_eps
        cfg = b.config
        x = b.embed_tokens.index_select(0, v["ids"])
        delta = None
        for i, layer in enumerate(b.layers):
            last = i == len(b.layers) - 1
            m = x.shape[0]
            h, x = ops.add_rms_norm(x, delta, layer.input_layernorm, eps,
                                    self.padded_rows(m, layer.qkv_weight, layer.qkv_bias))
            qkv = self.linear(h, layer.qkv_weight, layer.qkv_bias)[:m]
            ops.rope_(qkv, v["pos"], self.cos, self.sin, cfg.num_attention_heads, cfg.num_key_value_heads,
                      cfg.head_dim, v["fill"], self.prefix_k[i], self.prefix_v[i])  # fills the state cache too
            if capture is not None:
                _, k, val = self._split(qkv)
                capture.append((k.clone(), val.clone()))
            attn = self._attention(i, qkv, v, last)
            if last:
                x = x.index_select(0, v["readout"])
            m = x.shape[0]
            o = self.linear(attn, layer.o_proj_weight, layer.o_proj_bias)[:m]
            h, x = ops.add_rms_norm(x, o, layer.post_attention_layernorm, eps,
                                    self.padded_rows(m, layer.gate_up_weight, layer.gate_up_bias))
            # one expression: the gate/up output is freed once SwiGLU has read it and SwiGLU's once down has
            # (held in locals to the next layer, a 17k-token document's forward peaked 1.1 GB higher)
            delta = self.linear(ops.silu_mul(self.linear(h, layer.gate_up_weight, layer.gate_up_bias)[:m],
                                             self.padded_rows(m, layer.down_proj_weight, layer.down_proj_bias)),
                                layer.down_proj_weight, layer.down_proj_bias)[:m]
            if not last:
                if sync and x.is_cuda:
                    torch.cuda.synchronize()  # the device is idle at a yield: a parked long lane hands it over
                yield None
        h, _ = ops.add_rms_norm(x, delta, b.norm, eps)
        yield h

    def letter_logits(self, h: torch.Tensor, letters: torch.Tensor) -> torch.Tensor:
        return self.ops.letter_logits(h, self.b.lm_head, letters)

    # ---- the eager forward ---------------------------------------------------------------------------------
    def upload(self, batch: PackedBatch, fill: np.ndarray | None = None) -> dict:
        n_tiles = batch.num_tokens // self.block_m(batch.num_tokens) + len(batch.block_parent) + 1
        buf, layout = self.host_inputs(batch, batch.num_tokens, n_tiles, max(1, len(batch.readout_index)), fill=fill)
        return self.views(torch.from_numpy(buf).to(self.b.device), layout)

    def steps(self, batch: PackedBatch, capture: list | None = None) -> Iterator[np.ndarray | None]:
        fill, after = self.fill_plan(batch)
        v = self.upload(batch, fill)
        for h in self.layers(v, capture, sync=True):
            if h is None:
                yield None
            else:
                self.copy_after(after)
                letters = torch.from_numpy(batch.letter_ids.astype(np.int64)).to(self.b.device)
                yield finite(self.letter_logits(h[:len(batch.readout_index)], letters).cpu().numpy())

    def hidden(self, batch: PackedBatch) -> torch.Tensor:
        """The final-normed hidden states of the batch's readout rows."""
        *_, h = self.layers(self.upload(batch))
        return h[:len(batch.readout_index)]


def finite(logits: np.ndarray) -> np.ndarray:
    if not np.isfinite(logits).all():
        raise FloatingPointError("non-finite letter logit")
    return logits
