"""Where a graphed forward's time goes per token bucket (issue 9): GEMM time per row count, graph replay per bucket.

python tools/graph_sweep.py OUT.json [MODEL_DIR ...]   (needs a CUDA GPU)

1. For each preset's projection shapes (tools/gemm_chunks.py PRESETS), cuBLAS f16 time (one CUDA graph of 20 calls)
   at row counts 192..512 in steps of 16, the kernel cuBLAS picks (torch.profiler), and whether the rows give the
   bits of the same rows in a 512-row call (what the verified route checks at load); then per preset the GEMM
   time of a whole forward per row count (the four projections x layers).
2. For each model directory: the backend as `serve` loads it; each captured graph of a single decision's sizes
   replayed alone (CUDA events, median of 30 back to back), and for the graph a median single decision uses: the
   same after 30 ms of idle device each (`spaced_ms`: the clock under sustained load) and a profile of one
   replay: the kernels' summed time vs the span from the first kernel's start to the last one's end (the
   difference is the time between kernels).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from gemm_chunks import PRESETS, graphed_ms

LAYERS = {"4.5B": 60, "max": 50}
ROWS = list(range(192, 513, 16))


def kernel_names(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def gemm_sweep(result: dict) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for preset, shapes in PRESETS.items():
        per_rows: dict[int, float] = defaultdict(float)
        for n, k in shapes:
            w = (torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5).half()
            x = torch.randn(512, k, device="cuda", generator=gen).half()
            full = F.linear(x, w)
            for m in ROWS:
                xm = x[:m].contiguous()
                ms = graphed_ms(lambda xm=xm, w=w: F.linear(xm, w))
                row = {"preset": preset, "n": n, "k": k, "m": m, "us": round(ms * 1000, 2),
                       "tflops": round(2 * m * n * k / ms / 1e9, 1), "same_bits_as_512": bool(torch.equal(F.linear(xm, w), full[:m])),
                       "kernels": kernel_names(lambda xm=xm, w=w: F.linear(xm, w))}
                per_rows[m] += ms * LAYERS[preset]
                result["gemm"].append(row)
                print(json.dumps(row), flush=True)
        result["forward_gemm_ms"][preset] = {m: round(v, 3) for m, v in per_rows.items()}
        print(preset, "forward GEMM ms per rows:", result["forward_gemm_ms"][preset], flush=True)


def replay_ms(graph, times: int, idle_s: float = 0.0) -> float:
    """Median milliseconds of one replay (CUDA events), `idle_s` of idle device before each."""
    out = []
    for _ in range(times):
        time.sleep(idle_s)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return round(statistics.median(out), 3)


def graph_sweep(result: dict, model_dir: str) -> None:
    from basal_local.api.systemone import validate_systemone
    from basal_local.backends.torch import TorchBackend
    from basal_local.bench import single_question_requests
    from basal_local.engine.engine import EngineSettings, ModelEngine
    from basal_local.engine.gate import DeviceGate
    from basal_local.engine.packer import pack_prompts
    from basal_local.model.directory import load_model_dir
    from basal_local.telemetry import Telemetry

    md = load_model_dir(model_dir)
    backend = TorchBackend("cuda")
    backend.load(md.path, "auto")
    engine = ModelEngine(md, backend, DeviceGate(), Telemetry(), EngineSettings(long_tokens=0))
    fast = backend.graphs
    requests = [validate_systemone(r, md.name) for r in single_question_requests(md.name)]
    sizes = []
    for r in requests:
        pack = pack_prompts(engine.plan(r).prompt_specs(), engine.prefixes)
        for b in pack.batches:
            backend.forward(b)
            sizes.append((b.num_tokens, fast.bucket(b.num_tokens)))
    torch.cuda.synchronize()
    out = {"model": md.name, "forward_tokens": sorted(n for n, _ in sizes), "graphs": {}}
    median_bucket = sorted(s for _, s in sizes)[len(sizes) // 2]
    for key, entry in sorted(fast.graphs.items()):
        if key[0] > 1024:
            continue
        out["graphs"][f"{key[0]}x{key[1]}"] = replay_ms(entry.graph, 30)
    entry = fast.graphs[(median_bucket, 4)]
    # the same graph replayed after 30 ms of idle device each time (vs back to back above): a difference is
    # the clock the device holds under sustained load (power), not our code
    out["spaced_ms"] = replay_ms(entry.graph, 20, idle_s=0.03)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        entry.graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    starts = [e.time_range.start for e in kernels]
    ends = [e.time_range.end for e in kernels]
    fam: dict[str, float] = defaultdict(float)
    for e in kernels:
        fam[e.name[:60]] += e.time_range.elapsed_us()
    out["profile_bucket"] = median_bucket
    out["profile"] = {"kernels": len(kernels), "kernel_sum_us": round(sum(e.time_range.elapsed_us() for e in kernels), 1),
                      "span_us": round(max(ends) - min(starts), 1) if kernels else 0,
                      "top": sorted(((round(v, 1), k) for k, v in fam.items()), reverse=True)[:14]}
    result["models"].append(out)
    print(json.dumps(out), flush=True)


def main() -> None:
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "gemm": [], "forward_gemm_ms": {},
              "models": []}
    if "--no-gemm" not in sys.argv:
        gemm_sweep(result)
    for model_dir in [a for a in sys.argv[2:] if not a.startswith("--")]:
        graph_sweep(result, model_dir)
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
