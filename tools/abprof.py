"""Where a single decision's time goes, for this tree or an older one (whichever basal_local PYTHONPATH puts first):
plan, pack and forward on the host's clock, the forward's device time on CUDA events, and the kernels of a
forward under torch.profiler. gpu.sh's `abprof` stage runs it for dist/gpu/old and new and prints them side by
side (`python tools/abprof.py compare OLD.json NEW.json`).

    python tools/abprof.py run MODEL_DIR OUT.json [REPEAT]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import defaultdict

from gpu import kernel_times  # (this folder's: the kernels of a profile, as `gpu.py profile` reads them)

DEVICE = os.environ.get("DEV", "cuda")  # cpu: a rehearsal here (no device clock, no kernels)


def _engine(model_dir: str):
    """(engine, backend, requests) through whichever bench this tree has: both warm up the same way."""
    try:  # this main's bench
        from basal_local.commands.benchengine import Bench
    except ImportError:  # an older main's (c466bdb: basal_local/bench.py)
        from basal_local import bench as old
        from basal_local.api.systemone import validate_systemone
        from basal_local.backends.select import make_backend
        from basal_local.model.directory import load_model_dir

        model = load_model_dir(model_dir)
        backend = make_backend("torch", DEVICE, "auto")
        old._load(backend, model, "f16" if DEVICE == "cuda" else "f32")
        engine = old._engine(model, backend)
        return engine, backend, [validate_systemone(r, model.name) for r in old.single_question_requests(model.name)]
    b = Bench(model_dir, "torch", DEVICE, "f16" if DEVICE == "cuda" else "f32")
    return b.engine, b.backend, b.requests()


def run(model_dir: str, out: str, repeat: str = "3") -> None:
    import torch

    from basal_local.engine.packer import pack_prompts

    engine, backend, requests = _engine(model_dir)
    result: dict = {"module": __import__("basal_local").__file__}
    cuda = DEVICE == "cuda"

    def one(group, phases: dict | None = None) -> None:
        """Plan, pack and forward one group; its times into `phases` where given."""
        t0 = time.perf_counter()
        plans = [engine.plan(r) for r in group]
        t1 = time.perf_counter()
        batches = pack_prompts([s for p in plans for s in p.prompt_specs()], engine.prefixes).batches
        t2 = time.perf_counter()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        for b in batches:
            backend.forward(b)
        t3 = time.perf_counter()  # the forwards' host side (they return before the device ends, or not)
        if cuda:
            end.record()
            torch.cuda.synchronize()
        t4 = time.perf_counter()
        if phases is not None:
            for k, v in (("plan", t1 - t0), ("pack", t2 - t1), ("forward_returns", t3 - t2),
                         ("forward_synced", t4 - t2), ("total", t4 - t0)):
                phases[k].append(v * 1000.0)
            phases["device_events"].append(start.elapsed_time(end) if cuda else 0.0)

    for label, size in (("single decision", 1), ("32 decisions", 32)):
        groups = [requests[i:i + size] for i in range(0, len(requests) - size + 1, size)]
        phases: dict = defaultdict(list)
        for g in groups[:5]:
            one(g)
        for _ in range(int(repeat)):
            for g in groups:
                one(g, phases)
        n_prof = min(len(groups), 20)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            for g in groups[:n_prof]:
                one(g)
        kernels = sorted(((round(t, 4), round(n, 2), name[:100]) for t, n, name in kernel_times(prof, n_prof)),
                         reverse=True)
        result[label] = {"n": len(phases["total"]),
                         "median_ms": {k: round(statistics.median(v), 4) for k, v in phases.items()},
                         "mean_ms": {k: round(statistics.fmean(v), 4) for k, v in phases.items()},
                         "kernel_ms_per_forward": round(sum(k[0] for k in kernels), 4),
                         "kernels_per_forward": round(sum(k[1] for k in kernels), 2),
                         "kernels": kernels[:25]}
    json.dump(result, open(out, "w"), indent=1)
    print(json.dumps({k: v if not isinstance(v, dict) else {x: v[x] for x in v if x != "kernels"}
                      for k, v in result.items()}, indent=1))


def compare(old_path: str, new_path: str) -> None:
    old, new = json.load(open(old_path)), json.load(open(new_path))
    for label in ("single decision", "32 decisions"):
        o, n = old[label], new[label]
        print(f"{label}: median ms, old -> new (new/old)")
        for k in o["median_ms"]:
            a, b = o["median_ms"][k], n["median_ms"][k]
            print(f"  {k:16s} {a:9.3f} -> {b:9.3f}  ({b / a if a else 0:.3f}x)   mean {o['mean_ms'][k]:.3f} -> "
                  f"{n['mean_ms'][k]:.3f}")
        print(f"  kernel time per forward {o['kernel_ms_per_forward']:.3f} -> {n['kernel_ms_per_forward']:.3f} ms, "
              f"kernels {o['kernels_per_forward']} -> {n['kernels_per_forward']}")
        for side, d in (("old", o), ("new", n)):
            print(f"  {side} kernels (ms per forward, launches per forward, name):")
            for t, c, name in d["kernels"][:14]:
                print(f"    {t:8.4f} {c:7.2f}  {name}")


if __name__ == "__main__":
    command, *args = sys.argv[1:] or ["-h"]
    if command == "run":
        run(*args)
    elif command == "compare":
        compare(*args)
    else:
        sys.exit(__doc__)
