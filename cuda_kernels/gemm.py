"""Batch-invariant GEMMs on the vendor library: call it only at row counts whose results are known to agree.

A GEMM library (cuBLAS) chooses its kernel, tiling and split-K from the problem shape, so a row's bits can
change with the number of rows multiplied beside it. Rows of a GEMM never interact, so if every library call
uses one of a few row counts M, and the library gives the same bits for a row at each of those counts, a row's
result cannot depend on the batch. The engine already runs forwards at fixed sizes (CUDA graph buckets), so:

- `row_pieces` covers m rows by calls of allowed sizes only: whole pieces of the largest size, then the rest
  padded up to the smallest allowed size that holds it;
- `verified_sizes` finds, per weight, the allowed sizes by measurement on the device at load: the GEMM of one
  random [max, K] block at every candidate size (rows taken from the start and from the end), compared bit for
  bit with the largest size. Sizes below the smallest M from which every larger candidate agrees are not used
  (smaller calls pad up to it). If that M is too large for small forwards, a fixed chunk (one size) is used
  instead, which is invariant by construction.

Pure torch: the same functions run on the CPU in tests (ENGINE.md §2, DESIGN.md "Numerics and reproducibility").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def row_pieces(m: int, sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first row, rows, library M) of each call covering m rows; every M is one of `sizes` (ascending)."""
    top = sizes[-1]
    out = []
    start = 0
    while m - start > top:
        out.append((start, top, top))
        start += top
    rest = m - start
    if rest > 0:
        out.append((start, rest, next(s for s in sizes if s >= rest)))
    return out


def sized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes: Sequence[int],
                 linear: Linear = F.linear) -> torch.Tensor:
    """x [m, K] @ weight[N, K].T (+ bias), issued to `linear` only with row counts from `sizes`.

    Whole pieces read x in place; only the last piece is copied into a padded block. Several pieces (a
    long eager forward) are written into one output, so the peak is one output plus one padded block."""
    m, k = x.shape
    pieces = row_pieces(m, sizes)
    if not pieces:
        return x.new_empty(0, weight.shape[0])
    if x.stride(1) != 1 or x.stride(0) != k:
        x = x.contiguous()

    def rows_for(start: int, rows: int, call_m: int) -> torch.Tensor:
        if rows == call_m:
            return x[start:start + rows]
        # the padding rows are left unwritten: a GEMM's output row depends on its own input row only, and the
        # padding rows' outputs are dropped (a fill of the block cost ~4 us per call: 0.2 ms a forward on max)
        block = x.new_empty(call_m, k)
        block[:rows] = x[start:start + rows]
        return block

    if len(pieces) == 1:
        start, rows, call_m = pieces[0]
        return linear(rows_for(start, rows, call_m), weight, bias)[:rows]
    out = x.new_empty(m, weight.shape[0])
    for start, rows, call_m in pieces:
        out[start:start + rows] = linear(rows_for(start, rows, call_m), weight, bias)[:rows]
    return out


def agreeing_sizes(weight: torch.Tensor, bias: torch.Tensor | None, candidates: Sequence[int],
                   linear: Linear = F.linear, seed: int = 0) -> tuple[list[int], dict[int, bool]]:
    """The candidates from the smallest M on which every larger candidate gives the largest's bits.

    Returns (sizes, agrees) where agrees[M] says whether M alone matched (for the record)."""
    cands = sorted(set(candidates))
    top = cands[-1]
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    x = torch.randn(top, weight.shape[1], generator=gen, device=weight.device, dtype=torch.float32).to(weight.dtype)
    full = linear(x, weight, bias)
    agrees = {}
    for m in cands:
        head = torch.equal(linear(x[:m].contiguous(), weight, bias), full[:m])
        tail = torch.equal(linear(x[top - m:].contiguous(), weight, bias), full[top - m:])
        agrees[m] = bool(head and tail)
    sizes: list[int] = []
    for m in reversed(cands):  # the longest run of agreeing sizes that ends at the top
        if not agrees[m]:
            break
        sizes.insert(0, m)
    return sizes, agrees


def plan_sizes(weight: torch.Tensor, bias: torch.Tensor | None, candidates: Sequence[int], max_floor: int,
               chunk: int, linear: Linear = F.linear) -> dict:
    """The row counts this weight's GEMMs may use: the verified candidates if they start at or below
    `max_floor`, else the fixed chunk [chunk]. Deterministic for a given device and library (no timing)."""
    sizes, agrees = agreeing_sizes(weight, bias, candidates, linear)
    if sizes and sizes[0] <= max_floor:
        return {"sizes": sizes, "route": "verified", "agrees": agrees}
    return {"sizes": [chunk], "route": "chunk", "agrees": agrees}
