"""Tokenizer calls of the planning path, timed three ways on this host (issue 9: planning is ~0.55 ms of a single
decision): `Tokenizer.encode` per text (what `BasalTokenizer._run` does for short work), `encode_batch_fast` with one
text per call, and `encode_batch_fast` with the call's texts together (the tokenizer's thread pool). The texts are
the ones the sample set's single decisions tokenize (captured from `ModelEngine.plan`); every way must give the same
ids. Interleaved repetitions; prints min / p25 / median microseconds per request. Usage: tok_bench.py MODEL_DIR
"""

from __future__ import annotations

import sys
import time

from basal_local.api.systemone import validate_systemone
from basal_local.backends.torch import TorchBackend
from basal_local.bench import single_question_requests
from basal_local.engine.engine import EngineSettings, ModelEngine
from basal_local.engine.gate import DeviceGate
from basal_local.model.directory import load_model_dir
from basal_local.telemetry import Telemetry


def main(model_dir: str, reps: int = 15) -> None:
    md = load_model_dir(model_dir)
    backend = TorchBackend("cpu")
    backend.load(md.path, "auto")
    engine = ModelEngine(md, backend, DeviceGate(), Telemetry(), EngineSettings(long_tokens=0))
    tok = md.tokenizer
    calls: list[list[str]] = []
    run = tok._run

    def capture(texts):
        calls.append(list(texts))
        return run(texts)
    tok._run = capture
    for r in single_question_requests(md.name):
        engine.plan(validate_systemone(r, md.name))
    tok._run = run
    raw = tok._tok

    ways = {
        "encode": lambda c: [raw.encode(t, add_special_tokens=False).ids for t in c],
        "fast_per_text": lambda c: [raw.encode_batch_fast([t], add_special_tokens=False)[0].ids for t in c],
        "fast_batch": lambda c: [e.ids for e in raw.encode_batch_fast(c, add_special_tokens=False)],
    }
    want = [ways["encode"](c) for c in calls]
    for name, fn in ways.items():
        assert [fn(c) for c in calls] == want, f"{name} gives other ids"
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(reps):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            for c in calls:
                fn(c)
            times[name].append((time.perf_counter() - t0) / len(calls) * 1e6)
    print(f"{len(calls)} requests, {sum(map(len, calls))} texts")
    for name, v in times.items():
        v.sort()
        print(f"{name:14s} min {v[0]:7.1f}  p25 {v[len(v) // 4]:7.1f}  median {v[len(v) // 2]:7.1f} us/request")


if __name__ == "__main__":
    main(sys.argv[1])
