# ruff: noqa: B023  (each lambda is timed at once, inside its loop iteration)
"""M-chunked cuBLAS (issue 9): time and bitwise batch invariance of `twins.chunked_linear` per weight shape.

For each projection shape of a preset and each chunk size: kernel time (one CUDA graph replayed) at a single
decision's rows (~320) and at a batch of 32 (~8,192), beside plain cuBLAS at the same M; and whether rows
multiplied alone give the same bits as the same rows amid 8,192 others (plain cuBLAS too, for contrast).
Writes JSON to argv[1]; prints a table. Needs a CUDA GPU.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from basal_local.cuda_kernels import twins

PRESETS = {  # (N, K) of q/k/v, o, gate/up, down
    "4.5B": [(2560, 2048), (2048, 2048), (22016, 2048), (2048, 11008)],
    "max": [(6144, 4096), (4096, 4096), (2 * 14336, 4096), (4096, 14336)],
}
CHUNKS = (128, 256, 384, 512)
SINGLE, BATCH = 320, 8192


def graphed_ms(fn, reps: int = 20) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    out_path = sys.argv[1]
    presets = sys.argv[2:] or ["4.5B"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": []}
    for preset in presets:
        for n, k in PRESETS[preset]:
            w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).half()
            x = torch.randn(BATCH, k, device="cuda", generator=gen).half()
            row = {"preset": preset, "n": n, "k": k}
            full = F.linear(x, w)
            row["cublas_ms"] = {"single": round(graphed_ms(lambda: F.linear(x[:SINGLE], w)), 4),
                                "batch": round(graphed_ms(lambda: F.linear(x, w)), 4)}
            # plain cuBLAS: rows alone (at the start, and from the middle) vs the same rows amid 8,192
            row["cublas_bitwise"] = bool(torch.equal(F.linear(x[:SINGLE], w), full[:SINGLE])
                                         and torch.equal(F.linear(x[4001:4001 + SINGLE], w), full[4001:4001 + SINGLE]))
            for c in CHUNKS:
                fullc = twins.chunked_linear(x, w, None, c)
                same = all(torch.equal(twins.chunked_linear(x[s:s + m], w, None, c), fullc[s:s + m])
                           for s, m in ((0, SINGLE), (4001, SINGLE), (77, 1), (5000, 37)))
                err = ((fullc.float() - full.float()).norm() / full.float().norm()).item()
                row[f"chunk{c}"] = {"single": round(graphed_ms(lambda: twins.chunked_linear(x[:SINGLE], w, None, c)), 4),
                                    "batch": round(graphed_ms(lambda: twins.chunked_linear(x, w, None, c)), 4),
                                    "bitwise": bool(same), "rel_err_vs_cublas": err}
            result["shapes"].append(row)
            print(json.dumps(row), flush=True)
    # per-layer sums (one of each projection) and the whole-model GEMM time per preset
    layers = {"4.5B": 60, "max": 50}
    summary = {}
    for preset in presets:
        rows = [r for r in result["shapes"] if r["preset"] == preset]
        s = {"cublas": [sum(r["cublas_ms"][m] for r in rows) * layers[preset] for m in ("single", "batch")]}
        for c in CHUNKS:
            s[f"chunk{c}"] = [sum(r[f"chunk{c}"][m] for r in rows) * layers[preset] for m in ("single", "batch")]
        summary[preset] = {k: [round(v, 2) for v in vals] for k, vals in s.items()}
        print(preset, "model GEMM ms (single 320 rows, batch 8192 rows):", json.dumps(summary[preset]))
    result["model_gemm_ms"] = summary
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
