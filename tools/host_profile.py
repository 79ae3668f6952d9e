"""Where the wall time of one single decision goes on the host (issue 9: ~1.5-2 ms above the kernel time).

Runs the sample set's single decisions through the engine path of `bench` (plan -> pack -> forward) and splits
each into: planning, packing, the graph's input building + upload, and the graph replay with the wait for the GPU (the
letter logits are part of the graph) and the logits back; then cProfile's top functions over the same loop. Usage: host_profile.py MODEL_DIR OUT.txt
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from basal_local.api.systemone import validate_systemone
from basal_local.backends.torch import TorchBackend
from basal_local.bench import single_question_requests
from basal_local.engine.engine import EngineSettings, ModelEngine
from basal_local.engine.gate import DeviceGate
from basal_local.engine.packer import pack_prompts
from basal_local.model.directory import load_model_dir
from basal_local.telemetry import Telemetry


def main() -> None:
    md = load_model_dir(sys.argv[1])
    backend = TorchBackend("cuda")
    backend.load(md.path, "auto")
    engine = ModelEngine(md, backend, DeviceGate(), Telemetry(), EngineSettings(long_tokens=0))
    graphs = backend.graphs
    requests = [validate_systemone(r, md.name) for r in single_question_requests(md.name)]
    parts: dict[str, list[float]] = {k: [] for k in ("plan", "pack", "upload", "replay_and_wait", "total")}
    graph_for, forward = graphs._graph_for, graphs.forward

    def timed_upload(*a, **k):
        t = time.perf_counter()
        out = graph_for(*a, **k)
        parts["upload"].append(time.perf_counter() - t)
        return out

    def timed_forward(*a, **k):
        t = time.perf_counter()
        out = forward(*a, **k)
        parts["replay_and_wait"].append(time.perf_counter() - t - parts["upload"][-1])
        return out

    graphs._graph_for, graphs.forward = timed_upload, timed_forward

    def decide(r):
        t0 = time.perf_counter()
        plan = engine.plan(r)
        t1 = time.perf_counter()
        pack = pack_prompts(plan.prompt_specs(), engine.prefixes)
        t2 = time.perf_counter()
        for b in pack.batches:
            backend.forward(b)
        torch.cuda.synchronize()
        parts["plan"].append(t1 - t0)
        parts["pack"].append(t2 - t1)
        parts["total"].append(time.perf_counter() - t0)

    for r in requests[:10]:
        decide(r)
    for v in parts.values():
        v.clear()
    for _ in range(2):
        for r in requests:
            decide(r)
    lines = [f"{k:>16}: median {statistics.median(v) * 1e3:.3f} ms" for k, v in parts.items()]
    prof = cProfile.Profile()
    prof.enable()
    for r in requests:
        decide(r)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    text = "\n".join(lines) + "\n\n" + buf.getvalue()
    print("\n".join(lines))
    with open(sys.argv[2], "w", encoding="utf-8") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
