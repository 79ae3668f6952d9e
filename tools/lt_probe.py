"""Which cuBLASLt algorithms give the large-M call's bits at small row counts, and how fast (issue 9, max single).

python tools/lt_probe.py OUT.jsonl [ROWS ...]   (needs a CUDA GPU; run from tools/ or with tools on sys.path)

For each projection shape of the 4.5B and max presets (tools/gemm_chunks.py PRESETS) and each row count (default
4, 16, 64, 192..512 step 16): torch's F.linear time (one CUDA graph of 20 calls) and whether its rows equal the
same rows of a 1,024-row F.linear call; then every algorithm cuBLASLt's heuristic offers for that shape (up to 32,
and again with split-K reductions filtered out), each timed the same way and compared bit for bit with that
reference; those that agree are timed. One JSON line per (shape, rows): torch's time and bits, and the fastest
algorithm that agrees.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from gemm_chunks import PRESETS, graphed_ms

from basal_local.cuda_kernels import cublaslt

DEFAULT_ROWS = [4, 16, 64] + list(range(192, 513, 16))


def main() -> None:
    out_path = sys.argv[1]
    rows = [int(r) for r in sys.argv[2:]] or DEFAULT_ROWS
    lt = cublaslt.LtGemm("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    top = 1024
    with open(out_path, "w") as out:
        for preset, shapes in PRESETS.items():
            for n, k in shapes:
                w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).half()
                x = torch.randn(top, k, device="cuda", generator=gen).half()
                full = F.linear(x, w)
                for m in rows:
                    xm = x[:m].contiguous()
                    torch_ms = graphed_ms(lambda xm=xm, w=w: F.linear(xm, w))
                    torch_same = bool(torch.equal(F.linear(xm, w), full[:m]))
                    seen, tried = set(), []
                    for no_split in (False, True):
                        try:
                            algos = lt.algos(w, None, m, 32, no_split=no_split)
                        except RuntimeError as exc:
                            tried.append({"no_split": no_split, "error": str(exc)})
                            continue
                        for a in algos:
                            if a.raw in seen:
                                continue
                            seen.add(a.raw)
                            try:
                                y = lt.matmul(xm, w, None, a)
                                torch.cuda.synchronize()
                                same = bool(torch.equal(y, full[:m]))
                                ms = graphed_ms(lambda xm=xm, w=w, a=a: lt.matmul(xm, w, None, a)) if same else None
                            except RuntimeError as exc:
                                tried.append({"rank": a.rank, "no_split": no_split, "error": str(exc)[:120]})
                                continue
                            tried.append({"rank": a.rank, "no_split": no_split, "ws": a.workspace,
                                          "us": round(ms * 1000, 2) if ms else None, "same": same})
                    ok = [t for t in tried if t.get("same")]
                    best = min(ok, key=lambda t: t["us"]) if ok else None
                    row = {"preset": preset, "n": n, "k": k, "m": m, "torch_us": round(torch_ms * 1000, 2),
                           "torch_same": torch_same, "algos": len(tried), "agreeing": len(ok),
                           "best_agreeing": best}
                    print(json.dumps(row), flush=True)
                    out.write(json.dumps({**row, "tried": tried}) + "\n")


if __name__ == "__main__":
    main()
