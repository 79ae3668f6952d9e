"""Tree attention alone on a GPU, per layer: this tree's kernel against another version of `kernels.py`.

    git show REF:cuda_kernels/kernels.py | sed 's/^from .plan import/from basal_local.cuda_kernels.plan import/' > /tmp/k.py
    python tools/attn_bench.py [/tmp/k.py] [--json OUT]

Shapes (4.5B heads: 16 query heads, 2 K/V heads, head_dim 128, f16): `hit`, 5 questions of 119 tokens after a
17,934-row cached document (a state-cache hit); `fresh`, a 17,800-token document and 5 questions computed at once;
`short32`, 32 prompts of 200 tokens after a 60-token template. Per shape and tiling (the default and the
alternative of backends/torch/forward.py): median ms of 30 launches (CUDA events) and, with a reference kernel
file, its median and whether the outputs are bitwise equal. The first figures (docs/CUDA_NOTES.md): hit 0.50-0.54
ms, fresh 6.3-6.4 ms (alternative tiling), short32 0.13 ms.
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import numpy as np
import torch

from basal_local.backends.torch.forward import ALT_TILING
from basal_local.backends.torch.options import DEFAULT_TILING
from basal_local.cuda_kernels import plan as tplan
from basal_local.cuda_kernels import triton_kernels

HQ, HKV, D, DTYPE = 16, 2, 128, torch.float16


def tree(n_pre: int, sizes: tuple[int, ...], parents: tuple[int, ...], seed: int = 0) -> tuple:
    """Blocks after a cached prefix of n_pre rows (every block reads it), children after their parent."""
    token_block = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    starts, pos = {}, []
    for b, (n, par) in enumerate(zip(sizes, parents)):
        starts[b] = n_pre if par < 0 else starts[par] + sizes[par]
        pos.append(np.arange(starts[b], starts[b] + n))
    positions = np.concatenate(pos).astype(np.int64)
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = len(positions)
    q = torch.randn(t, HQ, D, device="cuda", generator=g).to(DTYPE)
    k, v = (torch.randn(t, HKV, D, device="cuda", generator=g).to(DTYPE) for _ in range(2))
    pk, pv = (torch.randn(max(n_pre, 1), HKV, D, device="cuda", generator=g).to(DTYPE) for _ in range(2))
    return positions, token_block, np.array(parents, np.int32), q, k, v, pk, pv, n_pre


def attend(kernels, shape: tuple, tiling: tuple, reps: int = 30) -> tuple[torch.Tensor, float]:
    positions, token_block, parents, q, k, v, pk, pv, n_pre = shape
    p = tplan.tile_plan(positions, token_block, parents, np.zeros(len(parents), np.int32), [(0, n_pre)],
                        max(1, tiling[0] // (HQ // HKV)))
    out = torch.zeros(len(positions), HQ * D, dtype=DTYPE, device="cuda")
    args = (q, k, v, pk, pv, torch.from_numpy(positions.astype(np.int32)).cuda(), torch.from_numpy(p.tiles).cuda(),
            torch.from_numpy(p.q_rows).cuda(), torch.tensor([p.num_tiles], dtype=torch.int32, device="cuda"), out)
    kernels.tree_attention(*args, compact=False, tiling=tiling)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        kernels.tree_attention(*args, compact=False, tiling=tiling)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return out.clone(), float(np.median(times))


def tilings(text: str) -> list[tuple[int, ...]]:
    """--tilings: BLOCK_MxBLOCK_NxWARPSxSTAGES, comma-separated."""
    out = []
    for t in text.split(","):
        parts = t.strip().split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"{t!r} is not BLOCK_MxBLOCK_NxWARPSxSTAGES (e.g. 128x64x8x3)")
        out.append(tuple(int(p) for p in parts))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reference", nargs="?", help="another kernels.py (its plan import made absolute)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--tilings", type=tilings, help="BLOCK_MxBLOCK_NxWARPSxSTAGES,... instead of the default and the alternative "
                    "tiling; each output is compared with the first listed tiling of the same BLOCK_N")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (and Triton): run it on the device machine")
    new = triton_kernels()
    ref = None
    if a.reference:
        spec = importlib.util.spec_from_file_location("reference_kernels", a.reference)
        ref = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ref)
    shapes = {"hit": tree(17934, (119,) * 5, (-1,) * 5),
              "fresh": tree(100, (17800,) + (119,) * 5, (-1,) + (0,) * 5),
              "short32": tree(60, (200,) * 32, (-1,) * 32)}
    chosen = a.tilings or [DEFAULT_TILING, ALT_TILING]
    res: dict[str, dict] = {}
    for name, shape in shapes.items():
        first: dict[int, torch.Tensor] = {}
        for tiling in chosen:
            key = f"{name} {'x'.join(map(str, tiling))}"
            try:
                out, ms = attend(new, shape, tiling)
            except Exception as exc:  # noqa: BLE001 - a tiling this GPU cannot run (shared memory)
                res[key] = {"error": type(exc).__name__}
                print(key, res[key], flush=True)
                continue
            res[key] = {"ms": round(ms, 4)}
            if tiling[1] in first:
                res[key]["same_bits_as_first"] = bool(torch.equal(out, first[tiling[1]]))
            first.setdefault(tiling[1], out)
            if ref is not None:
                base, ref_ms = attend(ref, shape, tiling)
                res[key].update(reference_ms=round(ref_ms, 4), bitwise=bool(torch.equal(out, base)))
            print(key, res[key], flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
