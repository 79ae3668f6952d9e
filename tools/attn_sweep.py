"""Single-decision latency of the engine path (plan -> pack -> graph forward) under one attention tiling.

The tiling is the backend option `attention_tiling` (block_m,block_n,warps,stages; default 64,64,4,2); prints one
JSON line. Graphs are captured only up to 1,024 tokens (every single decision fits), so a run takes seconds.
Usage: attn_sweep.py MODEL_DIR [BLOCK_M,BLOCK_N,WARPS,STAGES]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from basal_local.api.systemone import validate_systemone
from basal_local.backends.torch import TorchBackend
from basal_local.backends.torch.options import DEFAULT_TILING, TorchOptions
from basal_local.bench import single_question_requests
from basal_local.engine.engine import EngineSettings, ModelEngine
from basal_local.engine.gate import DeviceGate
from basal_local.engine.packer import pack_prompts
from basal_local.model.directory import load_model_dir
from basal_local.telemetry import Telemetry


def main() -> None:
    md = load_model_dir(sys.argv[1])
    tiling = tuple(int(x) for x in sys.argv[2].split(",")) if len(sys.argv) > 2 else DEFAULT_TILING
    backend = TorchBackend("cuda", options=TorchOptions(attention_tiling=tiling, attention_alt_tiling=False))
    backend.load(md.path, "auto")
    engine = ModelEngine(md, backend, DeviceGate(), Telemetry(), EngineSettings(long_tokens=0, max_forward_tokens=1024))
    requests = [validate_systemone(r, md.name) for r in single_question_requests(md.name)]

    def decide(r) -> float:
        t = time.perf_counter()
        pack = pack_prompts(engine.plan(r).prompt_specs(), engine.prefixes)
        for b in pack.batches:
            backend.forward(b)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    for r in requests[:10]:
        decide(r)
    times = [decide(r) for _ in range(3) for r in requests]
    print(json.dumps({"block_m": tiling[0], "block_n": tiling[1], "warps": tiling[2], "stages": tiling[3],
                      "single_ms_median": round(statistics.median(times), 3),
                      "single_ms_p10": round(sorted(times)[len(times) // 10], 3)}))


if __name__ == "__main__":
    main()
