"""CUDA graphs around the one forward (forward.py): buckets, capture, replay, warm-up.

A graph is captured per (token bucket, readout bucket) from the same `Forward.layers` an eager forward runs:
the tile tables live in device memory and the attention kernel walks them with a persistent grid, so one graph
serves any tree of that size. The letter logits are computed inside the graph (no host round trip after the
last layer) and come back through a pinned buffer.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from basal_local.cuda_kernels.gemm import no_gc

from ..base import PackedBatch, Ready
from .forward import LETTER_CAP, READOUT_BUCKETS, TOKEN_BUCKETS, Forward, finite

MAX_GRAPHS = 96
# a batch reads out at most one row per this many of its tokens: a prompt's own tokens past what it shares (its
# question asked again about a cached document) are 29 or more in the sample set with the test tokenizer, ~19 with
# Basal's (~0.65x the tokens); a served stream of the samples with the state cache made 1,444-token batches of 18
# readouts, which need the 64-readout graph of 1,536 tokens
MIN_TOKENS_PER_READOUT = 16
# the eager forward run once at warm-up (`warm_long`): the size of a ~16.5k-token document's forward
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
    """One graph replay in flight (`Graphs.launch`): its letter logits come back through their own pinned
    buffer; two CUDA events time it on the device."""

    __slots__ = ("host", "rows", "cols", "start", "end", "kind")

    def __init__(self, host: torch.Tensor, rows: int, cols: int, start, end, kind: str = "graph") -> None:
        self.host, self.rows, self.cols, self.start, self.end, self.kind = host, rows, cols, start, end, kind

    def done(self) -> bool:
        return bool(self.end.query())

    def result(self) -> np.ndarray:
        self.end.synchronize()
        return finite(self.host.numpy()[:self.rows, :self.cols].copy())

    def device_s(self) -> float | None:
        """Device seconds from its input copy to its logits copy (after `result`)."""
        return self.start.elapsed_time(self.end) / 1000.0


def tile_cap(size: int) -> int:
    """Tile records a graph of `size` tokens holds: one per 8 queries (a tile of 64 rows over 8 query heads of a
    K/V head) plus one per (partial) block."""
    return size // 8 + size // 4 + 8


def pool_bytes(segments: list[dict], pool: tuple | None) -> int:
    """Device memory of one CUDA-graph memory pool: the caching allocator's segments that belong to it
    (`torch.cuda.memory_snapshot()`). What the allocator reserved around each capture read ~50x too little
    for the 4.5B preset on an H200 (27 MB against 1.35 GB of the pool's segments)."""
    if pool is None:
        return 0
    return sum(int(seg["total_size"]) for seg in segments if tuple(seg.get("segment_pool_id", ())) == tuple(pool))


class Graphs:
    def __init__(self, fwd: Forward) -> None:
        self.fwd = fwd
        self.pool_bytes = 0  # the graphs' private memory pool, measured after each capture
        # the chunked route runs every GEMM on whole chunks of rows, so graph sizes are whole chunks
        self.chunk = fwd.options.gemm_chunk if fwd.gemm == "chunked" else 1
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None
        self._capture_stream = None

    def clear(self) -> None:
        self.graphs.clear()  # captured graphs read the old prefix buffers
        self._pool = None  # their memory pool went with them: the next capture starts a new one
        self.pool_bytes = 0

    def memory_bytes(self) -> int:
        """Device memory the captured graphs hold: their pool and their input buffers (`memory()`'s
        `graphs_bytes`, the dashboard's share of the GPU for graphs)."""
        return self.pool_bytes + sum(g.static.numel() * g.static.element_size() for g in list(self.graphs.values()))

    def bucket(self, tokens: int) -> int:
        return graph_size(tokens, self.chunk)

    def _graph_for(self, batch: PackedBatch) -> tuple[_Graph, list] | None:
        """The captured graph a batch fits, with its inputs uploaded (and the pool copies to make after it,
        `Forward.fill_plan`); None where it runs eagerly."""
        if batch.num_tokens > TOKEN_BUCKETS[-1] or len(batch.readout_index) > READOUT_BUCKETS[-1] or \
                len(batch.letter_ids) > LETTER_CAP:
            return None
        size = self.bucket(batch.num_tokens)
        r_cap = next(r for r in READOUT_BUCKETS if r >= len(batch.readout_index))
        if (size, r_cap) not in self.graphs and len(self.graphs) >= MAX_GRAPHS:
            return None
        try:
            entry = self._graph(size, r_cap)
            # the staging buffer is free once the copy out of it ran (launches do not wait for their logits)
            if entry.uploaded[0] is not None:
                entry.uploaded[0].synchronize()
                entry.uploaded[0] = None
            # (a plan too large for the graph runs eagerly, whose fill_plan copies the same parent rows again)
            fill, after = self.fwd.fill_plan(batch)
            self.fwd.host_inputs(batch, size, tile_cap(size), r_cap, entry.staging_np, fill=fill)
        except OverflowError:
            return None
        entry.static.copy_(entry.staging, non_blocking=True)
        return entry, after

    def forward(self, batch: PackedBatch) -> np.ndarray:
        found = self._graph_for(batch)
        if found is None:
            *_, logits = self.fwd.steps(batch)
            return logits
        entry, after = found
        entry.graph.replay()
        self.fwd.copy_after(after)
        return finite(entry.logits.cpu().numpy()[:len(batch.readout_index), :len(batch.letter_ids)])

    def launch(self, batch: PackedBatch) -> Launched | Ready:
        """`forward` without waiting for the device: the graph is replayed and its logits copied back
        asynchronously; the eager path (no graph fits) runs to the end here."""
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        graphs = len(self.graphs)
        found = self._graph_for(batch)
        if found is None:
            *_, logits = self.fwd.steps(batch)
            return Ready(logits)
        entry, after = found
        uploaded = torch.cuda.Event()
        uploaded.record()
        entry.uploaded[0] = uploaded
        entry.graph.replay()
        self.fwd.copy_after(after)
        host = torch.empty(entry.logits.shape, dtype=entry.logits.dtype, pin_memory=True)
        host.copy_(entry.logits, non_blocking=True)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        # a (tokens, readouts) size not captured at warm-up is captured on its first use (an eager warm-up run
        # and the capture): the record says so, as the cause of that batch's time
        kind = "graph captured now" if len(self.graphs) > graphs else "graph"
        return Launched(host, len(batch.readout_index), len(batch.letter_ids), start, end, kind)

    def _run(self, v: dict) -> torch.Tensor:
        *_, h = self.fwd.layers(v)
        return self.fwd.letter_logits(h, v["letters"])

    def _graph(self, size: int, r_cap: int) -> _Graph:
        key = (size, r_cap)
        if key not in self.graphs:
            buf, layout = self.fwd.host_inputs(dummy(size, r_cap), size, tile_cap(size), r_cap)
            static = torch.from_numpy(buf).to(self.fwd.b.device)
            v = self.fwd.views(static, layout)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # one run outside the capture: Triton compiles, cuBLAS makes its handles
                self._run(v)
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            if self._capture_stream is None:  # torch's default capture stream lives on the first device used
                self._capture_stream = torch.cuda.Stream()
            graph = torch.cuda.CUDAGraph()
            try:
                with no_gc(), torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream):
                    logits = self._run(v)
            finally:  # a failed capture's segments stay in the pool until the graphs go
                self.pool_bytes = pool_bytes(torch.cuda.memory_snapshot(), self._pool)
            staging = torch.empty(static.shape, dtype=static.dtype, pin_memory=True)
            self.graphs[key] = _Graph(graph, static, layout, logits, staging, staging.numpy(), [None])
        return self.graphs[key]

    def warmup(self, max_tokens: int) -> None:
        for size, r_cap in warm_sizes(max_tokens, self.chunk):
            self._graph(size, r_cap)
        self.warm_long()

    def warm_long(self) -> None:
        """One eager forward longer than the largest graph (a long document with a few questions off it), so
        the first long request finds its kernels, library handles and memory ready (a 16.5k-token document
        took 3.3 s the first time and 1.0 s after on the H200, docs/PERFORMANCE.md)."""
        n = min(LONG_WARMUP_TOKENS, self.fwd.b.config.max_position_embeddings - 1)
        if n > TOKEN_BUCKETS[-1]:
            for _ in self.fwd.steps(dummy(n, 4, children=4)):
                pass


def graph_size(tokens: int, chunk: int = 1) -> int:
    """The graph size for a forward of `tokens`: the next bucket (the largest past it), rounded up to whole GEMM
    chunks."""
    size = next((s for s in TOKEN_BUCKETS if s >= tokens), TOKEN_BUCKETS[-1])
    return -(-size // chunk) * chunk


def warm_sizes(max_tokens: int, chunk: int = 1) -> list[tuple[int, int]]:
    """The (tokens, readouts) graphs warm-up captures: per token bucket up to `max_tokens`, every readout bucket up
    to the one that holds a readout per MIN_TOKENS_PER_READOUT tokens. A size missing here is captured when a
    batch first needs it, and that capture (an eager run and the capture, ~0.2 s for the 4.5B preset) holds the lane."""
    # every bucket a forward of at most `max_tokens` can take: those below it and the one that holds it
    sizes = sorted({graph_size(s, chunk) for s in TOKEN_BUCKETS if s <= graph_size(max_tokens)})
    out = []
    for size in sizes:
        most = max(1, size // MIN_TOKENS_PER_READOUT)
        for r_cap in READOUT_BUCKETS:
            out.append((size, r_cap))
            if r_cap >= most:
                break
    return out


def dummy(n: int, r_cap: int, children: int = 0) -> PackedBatch:
    """A valid forward of `n` tokens: one prefix-less block (plus `children` blocks of 64 tokens branching off
    it, each read out at its end), `r_cap` readouts."""
    root = n - 64 * children
    token_block = np.concatenate([np.zeros(root, np.int32), np.repeat(np.arange(1, children + 1, dtype=np.int32), 64)])
    positions = np.concatenate([np.arange(root), np.tile(np.arange(root, root + 64), children)]).astype(np.int64)
    readout = (np.arange(n - r_cap, n, dtype=np.int64) if r_cap <= n else np.arange(n, dtype=np.int64)) \
        if not children else root + 64 * np.arange(children, dtype=np.int64) + 63
    return PackedBatch(token_ids=np.zeros(n, np.int64), positions=positions, token_block=token_block,
                       block_parent=np.array([-1] + [0] * children, np.int32),
                       block_prefix=np.full(children + 1, -1, np.int32), readout_index=readout,
                       letter_ids=np.zeros(1, np.int64), prefixes=[])
