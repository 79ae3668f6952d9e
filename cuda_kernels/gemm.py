"""Batch-invariant GEMMs on the vendor library: call it only at row counts whose results are known to agree.

A GEMM library (cuBLAS) chooses its kernel, tiling and split-K from the problem shape, so a row's bits can
change with the number of rows multiplied beside it. Rows of a GEMM never interact, so if every library call
uses one of a few row counts M, and the library gives the same bits for a row at each of those counts, a row's
result cannot depend on the batch. The engine already runs forwards at fixed sizes (CUDA graph buckets), so:

- `row_pieces` covers m rows by calls of allowed sizes only: whole pieces of the largest size, then the rest
  padded up to an allowed size that holds it (`CallSizes.call`);
- `agreeing_sizes` finds, per weight, the allowed sizes by measurement on the device at load: the GEMM of one
  random [max, K] block at every candidate size (rows taken from the start and from the end), compared bit for
  bit with the largest size. Only the candidates that agree are used (a call of another size pads up to one of
  them). If the smallest is too large for small forwards, a fixed chunk (one size) is used instead, which is
  invariant by construction.
- `CallSizes` then picks, for a call of m rows, the smallest allowed size that holds m, or a larger one where
  that is faster by more than a quarter (`build_linear`: timed once at load on the device). Which allowed size
  runs never changes a row's bits, so the timing may pick differently on another day without changing an
  answer: cuBLAS's choice of kernel by M is uneven (max preset, gate/up: 268 us at 448 rows, 163 at 464), and
  padding such a call up to a size where it picks a better kernel is faster than running it as it comes.
- `lt_choices` adds row counts where the library's own call disagrees or is slow but one of the algorithms
  cuBLASLt lists for that very count agrees (`cublaslt`: max preset, down projection at 304 rows: split-K
  61 us and other bits; padded to 352 rows 67 us; a pinned algorithm without split-K at 304 rows 58 us, same
  bits); `PinnedCall` runs them.

Pure torch: the same functions run on the CPU in tests (docs/ARCHITECTURE.md, docs/PROTOCOL.md §10).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# a pinned cuBLASLt algorithm must beat torch's own call at its row count by this share (`lt_choices`)
LT_MARGIN = 0.02


class CallSizes:
    """The row counts a weight's GEMMs may be issued with (ascending, verified to give the same bits), and the
    seconds of one call at some of them (timed at load). `call(rows)`: the size a call of `rows` rows runs at:
    the smallest size that holds them, unless a larger timed one is faster by more than MARGIN. A GEMM timed
    alone differs from the same GEMM inside a whole forward by up to ~20 % (max preset, q/k/v at 320 rows: 35.8 us
    alone, 29.6 in the graph), so only gross outliers count (gate/up at 448 rows: 268 us, at 464: 163; the
    448-token graph 23.7 -> 20.1 ms; smaller margins padded calls that ran slower in the graph)."""

    MARGIN = 0.25

    def __init__(self, sizes: Sequence[int], times: dict[int, float] | None = None) -> None:
        self.sizes = sorted(sizes)
        self.times = dict(times or {})
        self._memo: dict[int, int] = {}

    def call(self, rows: int) -> int:
        if rows not in self._memo:
            fits = [s for s in self.sizes if s >= rows]
            best = fits[0]
            if best in self.times:
                faster = [s for s in fits if s in self.times and self.times[s] < (1 - self.MARGIN) * self.times[best]]
                if faster:
                    best = min(faster, key=lambda s: (self.times[s], s))
            self._memo[rows] = best
        return self._memo[rows]


def row_pieces(m: int, sizes: CallSizes) -> list[tuple[int, int, int]]:
    """(first row, rows, library M) of each call covering m rows; every M is one of `sizes`: whole calls of the
    largest size, then the rest at `sizes.call(rest)`."""
    top = sizes.sizes[-1]
    out = []
    start = 0
    while m - start > top:
        out.append((start, top, top))
        start += top
    rest = m - start
    if rest > 0:
        out.append((start, rest, sizes.call(rest)))
    return out


def sized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 sizes: CallSizes, linear: Linear = F.linear) -> torch.Tensor:
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
                   linear: Linear = F.linear, seed: int = 0,
                   dtype: torch.dtype | None = None) -> tuple[list[int], dict[int, bool]]:
    """The candidates on which the GEMM gives the largest candidate's bits (rows from the start and the end).

    Returns (sizes, agrees) where agrees[M] says whether M matched (for the record). cuBLAS agrees on most sizes
    and not on a few in between where it picks split-K (max preset, down: 400, 416, 464, 480 among 352-512), so
    every agreeing size is kept, not only the run of sizes that ends at the top. `dtype`: the activations'
    (the weight's unless given: a checkpoint's float8 weights take f16 activations)."""
    cands = sorted(set(candidates))
    top = cands[-1]
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    x = torch.randn(top, weight.shape[1], generator=gen, device=weight.device, dtype=torch.float32).to(
        dtype or weight.dtype)
    full = linear(x, weight, bias)
    agrees = {}
    for m in cands:
        head = torch.equal(linear(x[:m].contiguous(), weight, bias), full[:m])
        tail = torch.equal(linear(x[top - m:].contiguous(), weight, bias), full[top - m:])
        agrees[m] = bool(head and tail)
    return [m for m in cands if agrees[m]], agrees


class no_gc:
    """No garbage collection inside a graph capture: a collected CUDA graph (or tensor) of another owner freed
    mid-capture breaks the capture."""

    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc) -> None:
        if self.was:
            gc.enable()


def graph_seconds(calls: dict, device: torch.device, reps: int = 8) -> dict:
    """Seconds of one call of each of `calls` (key -> a function of no arguments) on a CUDA device: `reps` calls
    in one CUDA graph (as a forward runs them), the least of three replays. For choosing only: never changes a
    result."""
    times = {}
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for key, fn in calls.items():
            fn()  # library handles and workspace outside the capture
            graph = torch.cuda.CUDAGraph()
            with no_gc(), torch.cuda.graph(graph, stream=stream):
                for _ in range(reps):
                    fn()
            best = float("inf")
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                graph.replay()
                end.record(stream)
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1000.0 / reps)
            times[key] = best
            del graph
    torch.cuda.current_stream(device).wait_stream(stream)
    return times


def lt_choices(weight: torch.Tensor, bias: torch.Tensor | None, top: int, sizes: Sequence[int], lt,
               library_times: dict[int, float], timer=graph_seconds, seed: int = 0,
               margin: float = 0.05) -> tuple[dict[int, object], dict[int, float]]:
    """Row counts where a cuBLASLt algorithm of our choosing beats the library's own call (`cublaslt`).

    For each m of `sizes`: every algorithm the heuristic offers (split-K filtered out and not), run on the rows
    from the start and from the end of the `top`-row block `agreeing_sizes` checks, compared bit for bit with
    the library's `top`-row call; the agreeing ones are timed (`timer`) and the fastest is kept where the library's
    own call at m does not agree (no entry in `library_times`) or is slower by more than `margin`. Returns
    ({m: algorithm}, {m: seconds of one call}). Which of these runs never changes a bit: each gives the
    `top`-row call's bits, as every allowed size does."""
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    x = torch.randn(top, weight.shape[1], generator=gen, device=weight.device, dtype=torch.float32).to(weight.dtype)
    full = F.linear(x, weight, bias)
    pins: dict[int, object] = {}
    times: dict[int, float] = {}
    for m in sizes:
        if m > top:
            continue
        head, tail = x[:m].contiguous(), x[top - m:].contiguous()
        agreeing = []
        # each algorithm offered once: the list with split-K filtered out holds some the first 16 leave out
        for algo in dict.fromkeys([*lt.algos(weight, bias, m), *lt.algos(weight, bias, m, no_split=True)]):
            try:
                same = torch.equal(lt.matmul(head, weight, bias, algo), full[:m]) and \
                    torch.equal(lt.matmul(tail, weight, bias, algo), full[top - m:])
            except RuntimeError:  # an algorithm the library offers but cannot run here
                continue
            if same:
                agreeing.append(algo)
        if not agreeing:
            continue
        timed = timer({i: (lambda a=a, h=head: lt.matmul(h, weight, bias, a)) for i, a in enumerate(agreeing)},
                      weight.device)
        best = min(timed, key=timed.get)
        own = library_times.get(m)
        if own is None or timed[best] < (1 - margin) * own:
            pins[m], times[m] = agreeing[best], timed[best]
    return pins, times


class PinnedCall:
    """One library call of a verified row count: the pinned cuBLASLt algorithm for that count (`lt_choices`),
    else `base` (torch's call)."""

    def __init__(self, base: Linear, lt=None, pins: dict[int, object] | None = None) -> None:
        self.base, self.lt, self.pins = base, lt, dict(pins or {})

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        algo = self.pins.get(x.shape[0])
        if algo is None:
            return self.base(x, weight, bias)
        return self.lt.matmul(x if x.is_contiguous() else x.contiguous(), weight, bias, algo)


class SizedGemm:
    """One weight shape's GEMM at its verified row counts: `sized_linear` through the pinned calls."""

    def __init__(self, sizes: CallSizes, call: PinnedCall) -> None:
        self.sizes, self.call = sizes, call

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return sized_linear(x, weight, bias, self.sizes, self.call)

    def padded_rows(self, m: int) -> int:
        """The rows of the one library call a GEMM of m rows makes (m where it needs several calls)."""
        pieces = row_pieces(m, self.sizes) if m else []
        return pieces[0][2] if len(pieces) == 1 else m


def open_lt(device, options, report: dict):
    """A cuBLASLt GEMM on this CUDA device, or None where options turn it off or it cannot run here."""
    if not options.cublaslt:
        report["cublaslt"] = "off (option)"
        return None
    from . import cublaslt

    try:
        lt = cublaslt.LtGemm(device)
    except Exception as exc:  # noqa: BLE001 - no library, another version: the verified route as before
        report["cublaslt"] = f"not used ({type(exc).__name__}: {str(exc)[:120]})"
        return None
    report["cublaslt"] = "pinned algorithms where they agree and are faster"
    return lt


def build_linear(weight: torch.Tensor, bias: torch.Tensor | None, options, candidates: Sequence[int],
                 base: Linear = F.linear, lt=None, lt_sizes: Sequence[int] = (), floor_max: int = 512,
                 timed_max: int = 1024, report_sizes: Sequence[int] = (),
                 dtype: torch.dtype | None = None) -> tuple[SizedGemm, dict]:
    """The GEMM of one weight shape issued only at row counts that give the same bits on this device, checked
    here (`agreeing_sizes`): those if the smallest is at most `floor_max` rows, else the fixed chunk of
    `options.gemm_chunk` rows (the same shape every call: invariant by construction). On CUDA the verified sizes
    up to `timed_max` are timed (`graph_seconds`) and, with `lt`, cuBLASLt algorithms pinned where they agree and
    are faster by LT_MARGIN (`lt_choices`). Deterministic for a given device and library but for the timing,
    which never changes a bit. Returns it and what was chosen (for the load report). `dtype`: the activations'
    (the weight's unless given)."""
    verified, agrees = agreeing_sizes(weight, bias, candidates, base, dtype=dtype)
    route = "verified" if verified and verified[0] <= floor_max else "chunk"
    allowed = verified if route == "verified" else [options.gemm_chunk]
    times, pins = {}, {}
    if weight.is_cuda and route == "verified":
        x = torch.randn(timed_max, weight.shape[1], device=weight.device).to(dtype or weight.dtype)
        times = graph_seconds({m: (lambda xm=x[:m]: base(xm, weight, bias)) for m in allowed if m <= timed_max},
                              weight.device)
        if lt is not None:
            pins, lt_times = lt_choices(weight, bias, candidates[-1], lt_sizes, lt, times, margin=LT_MARGIN)
            times.update(lt_times)
    sizes = CallSizes(sorted(set(allowed) | set(pins)), times)
    calls = {m: sizes.call(m) for m in report_sizes if m <= min(timed_max, sizes.sizes[-1])}
    report = {"route": route, "sizes": allowed[0], "disagree": [m for m, ok in agrees.items() if not ok and m <= 1024],
              "padded_calls": {m: c for m, c in calls.items() if c != m},
              **({"cublaslt_at": sorted(pins)} if pins else {})}
    return SizedGemm(sizes, PinnedCall(base, lt if pins else None, pins)), report
