"""Tree attention alone on a GPU, per layer: this tree's kernel against another version of `kernels.py`, and the
checks of its chunked keys (cuda_kernels/plan.py).

    git show REF:cuda_kernels/kernels.py | sed 's/^from .plan import/from basal_local.cuda_kernels.plan import/' > /tmp/k.py
    python tools/attn_bench.py [/tmp/k.py] [--json OUT] [--tilings 128x64x8x3,...]

Shapes (4.5B heads: 16 query heads, 2 K/V heads, head_dim 128, f16): `hit`, the 16 blocks of 5 questions in two
option orders (593 tokens) after a 17,934-row cached document (a state-cache hit; its tiles split into chunk
work items as a forward splits them); `last`, the hit's last layer (its readout rows only); `fresh`, the same
document (17,876 tokens after a 58-token template) and questions computed at once; `short32`, 32 prompts of 200
tokens after a 60-token template. Per shape and tiling (the forward's default and alternative): median ms of 30 launches (CUDA events) and, with a
reference kernel file, its median and whether the outputs are bitwise equal. Checks, with the same random K/V:
the hit's rows split and not, and the hit against the fresh computation's question rows (bitwise: a state-cache
hit changes no bit), and the tilings against each other.

Without a GPU, `DEV=cpu TRITON_INTERPRET=1` runs every step on small shapes in Triton's interpreter (Triton 3.9
or later; minutes): a check of the kernels' logic (the same values merged in the same order), not of the GPU's
bits or times.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import numpy as np
import torch

from basal_local.backends.host import tree_tokens
from basal_local.backends.torch.forward import ALT_TILING
from basal_local.backends.torch.options import DEFAULT_TILING
from basal_local.cuda_kernels import plan as tplan
from basal_local.cuda_kernels import triton_kernels

DEV = os.environ.get("DEV", "cuda")
SMALL = DEV != "cuda"  # the interpreter's smoke test: small heads, a short document, chunks of 128 keys
HQ, HKV, D, DT = (4, 2, 32, torch.float16) if SMALL else (16, 2, 128, torch.float16)
CHUNK = 128 if SMALL else tplan.CHUNK_KEYS
HIT_SIZES = (24, 29, 29, 18, 77, 77, 1, 21, 50, 50, 17, 58, 58, 26, 29, 29)  # a 5-question hit's blocks
HIT_PARENTS = (-1, 0, 0, -1, 3, 3, -1, 6, 7, 7, 6, 10, 10, -1, 13, 13)


class Shapes:
    """The four shapes on one set of random K/V: the hit's pool holds the fresh forward's document rows."""

    def __init__(self) -> None:
        g = torch.Generator(device=DEV).manual_seed(0)
        rnd = lambda *shape: torch.randn(*shape, device=DEV, generator=g).to(DT)  # noqa: E731
        template, self.doc = (58, 300) if SMALL else (58, 17876)
        parents = (-1,) + tuple(p + 1 if p >= 0 else 0 for p in HIT_PARENTS)
        fresh = tree_tokens(template, (self.doc,) + HIT_SIZES, parents)
        n = len(fresh[0])
        q, k, v = rnd(n, HQ, D), rnd(n, HKV, D), rnd(n, HKV, D)
        pk, pv = rnd(template, HKV, D), rnd(template, HKV, D)
        hit = tree_tokens(template + self.doc, HIT_SIZES, HIT_PARENTS)
        d = self.doc
        hit_qkv = (q[d:].contiguous(), k[d:].contiguous(), v[d:].contiguous())
        hit_pool = (torch.cat([pk, k[:d]]), torch.cat([pv, v[:d]]))
        leaves = [b for b in range(len(HIT_SIZES)) if b not in HIT_PARENTS]
        self.readouts = np.cumsum(HIT_SIZES)[leaves] - 1
        n_short = 2 if SMALL else 32
        short = tree_tokens(60, (200,) * n_short, (-1,) * n_short)
        s = len(short[0])
        self.all = {"hit": (hit, hit_qkv, hit_pool, template + d, None),
                    "last": (hit, hit_qkv, hit_pool, template + d, self.readouts),
                    "fresh": (fresh, (q, k, v), (pk, pv), template, None),
                    "short32": (short, (rnd(s, HQ, D), rnd(s, HKV, D), rnd(s, HKV, D)), (rnd(60, HKV, D),
                                                                                         rnd(60, HKV, D)), 60, None)}


def attend(kernels, shape: tuple, tiling: tuple, programs: int, scratch=None, split: bool = True,
           reps: int = 30, nprog: int | None = None) -> tuple[torch.Tensor, float]:
    """Output and median ms of `reps` launches; `split`: the tiles split as a forward on `programs` SMs splits
    them (only kernels with chunked keys, which take a `scratch`; a kernel before them takes `nprog` programs)."""
    (positions, token_block, parents), qkv, pool, n_pre, rows = shape
    p = tplan.tile_plan(positions, token_block, parents, np.zeros(len(parents), np.int32), [(0, n_pre)],
                        max(1, tiling[0] // (HQ // HKV)), rows=rows)
    if scratch is not None and split:
        p, _ = tplan.split_tiles(p, HKV, programs, 10**6, scratch.split_slots, CHUNK)
    out = torch.full((len(positions) if rows is None else len(rows), HQ * D), float("nan"), dtype=DT, device=DEV)
    t = lambda a: torch.from_numpy(a).to(DEV)  # noqa: E731
    args = (*qkv, *pool, t(positions.astype(np.int32)), t(p.tiles), t(p.q_rows),
            torch.tensor([p.num_tiles], dtype=torch.int32, device=DEV), out)
    kw = {"compact": rows is not None, "tiling": tiling}
    if scratch is not None:
        kw.update(scratch=scratch, chunk=CHUNK)
    else:
        kw.update(nprog=nprog)
    kernels.tree_attention(*args, **kw)
    first = out.clone()
    times = []
    for _ in range(reps if DEV == "cuda" else 1):
        if DEV == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            kernels.tree_attention(*args, **kw)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            kernels.tree_attention(*args, **kw)
            times.append(0.0)
    if not torch.equal(first, out) or torch.isnan(out).any():
        raise AssertionError("an output moved between launches or was not written")
    if scratch is not None and int(scratch.counts.abs().sum()):
        raise AssertionError("a split tile's arrival count was not reset")
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
    ap.add_argument("--tilings", type=tilings, help="BLOCK_MxBLOCK_NxWARPSxSTAGES,... instead of the forward's two "
                    "(the default and the alternative)")
    a = ap.parse_args()
    if DEV == "cuda" and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (and Triton): run it on the device machine, or DEV=cpu TRITON_INTERPRET=1")
    new = triton_kernels()
    ref = None
    if a.reference:
        spec = importlib.util.spec_from_file_location("reference_kernels", a.reference)
        ref = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ref)
    sms = new.num_sms(0) if DEV == "cuda" else 8
    programs = sms if DEV == "cuda" else 10**6  # split as a forward on this GPU would; the smoke test: every tile
    small = {DEFAULT_TILING: (8, 64, 4, 2), ALT_TILING: (16, 64, 4, 2)}
    size = (lambda t: small.get(t, t)) if SMALL else (lambda t: t)
    chosen = [size(t) for t in a.tilings] if a.tilings else None
    rows = max(size(t)[0] for t in (a.tilings or [ALT_TILING]))
    scratch = new.Scratch(DEV, HKV, D, new.Scratch.needs(rows, 4 * sms, 4 * sms, HKV), 4 * sms, 4 * sms)
    shapes = Shapes()
    res: dict[str, dict] = {}
    outs: dict[tuple, torch.Tensor] = {}

    def note(key: str, value: dict) -> None:
        res[key] = value
        print(key, value, flush=True)

    for name, shape in shapes.all.items():
        for tiling in chosen or [size(DEFAULT_TILING), size(ALT_TILING)]:
            tk = "x".join(map(str, tiling))
            try:
                out, ms = attend(new, shape, tiling, programs, scratch)
            except Exception as exc:  # noqa: BLE001 - a tiling this GPU cannot run (shared memory)
                note(f"{name} {tk}", {"error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                continue
            row = {"ms": round(ms, 4)}
            outs[(name, tk, True)] = out
            if name in ("hit", "last"):
                whole, whole_ms = attend(new, shape, tiling, programs, scratch, split=False)
                outs[(name, tk, False)] = whole
                row.update(unsplit_ms=round(whole_ms, 4), split_bitwise_unsplit=bool(torch.equal(out, whole)))
            if ref is not None:
                base, ref_ms = attend(ref, shape, tiling, programs, getattr(ref, "Scratch", None) and scratch,
                                      nprog=4 * sms)
                row.update(reference_ms=round(ref_ms, 4), speedup=round(ref_ms / ms, 3) if ms else None,
                           bitwise_reference=bool(torch.equal(out, base)))
            note(f"{name} {tk}", row)
    checks = {}
    fresh = [v for (n, _, _), v in outs.items() if n == "fresh"]
    for (name, tk, split), out in outs.items():
        if name == "hit" and fresh:
            checks[f"hit {tk} {'split' if split else 'whole'} == fresh rows"] = bool(torch.equal(
                out, fresh[0][shapes.doc:]))
        if name == "last" and fresh:
            checks[f"last {tk} {'split' if split else 'whole'} == fresh readout rows"] = bool(torch.equal(
                out, fresh[0][shapes.doc + shapes.readouts]))
    for name in shapes.all:
        mine = [v for (n, _, s), v in outs.items() if n == name and s]
        if len(mine) > 1:
            checks[f"{name}: every tiling the same bits"] = all(torch.equal(mine[0], m) for m in mine[1:])
    for key, value in checks.items():
        print("check", key, value, flush=True)
    res["checks"] = checks
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if not all(checks.values()):
        raise SystemExit("a check failed")


if __name__ == "__main__":
    main()
