"""fp8 vs f16 GEMMs on one GPU (issue 9): microbench per weight shape, sample-set agreement, invariance, speed.

    python tools/fp8_check.py MODEL_DIR OUT.json [--skip-micro] [--cpu] [--subsets=qkv,o,gate_up,down;gate_up,down]

1. Per weight shape of the model: f16 cuBLAS vs fp8 (Triton row quantizer + torch._scaled_mm, row-wise scales)
   at 320 and 8,192 rows (CUDA events, median of 20), and use_fast_accum for the record.
2. One backend loaded in f16 (the verified route): the sample set's letter logits and a single decision's
   forward time; then the same weights through the fp8 route (FastPath rebuilt, prefixes recomputed): the same,
   plus per-prompt decisions vs f16, max |dlogit|, max |dp_cal| (calibrate(softmax, 1.3)), and 8 trials of a
   prompt alone vs amid 31 others, bit for bit.
Prints one JSON line per step and writes them all to OUT.json.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

import numpy as np
import torch

from basal_local.api.systemone import validate_systemone
from basal_local.backends.torch import TorchBackend
from basal_local.backends.torch.forward import Forward
from basal_local.backends.torch.graphs import Graphs
from basal_local.backends.torch.options import FP8_GEMMS, TorchOptions
from basal_local.bench import sample_requests
from basal_local.cuda_kernels import fp8, triton_kernels
from basal_local.engine.packer import PromptSpec, pack_prompts
from basal_local.model import load_model_dir
from basal_local.protocol.decision import calibrate, softmax
from basal_local.protocol.render import render_question

RESULTS: list[dict] = []


def emit(**row) -> None:
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def micro(cfg) -> None:
    kernels = triton_kernels()
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    mm = fp8.cuda_scaled_mm("cuda", torch.float16)
    emit(step="scaled_mm", f16_out_direct=mm is fp8.scaled_mm_cuda)
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in (("qkv", qkv, h), ("o", h, cfg.num_attention_heads * cfg.head_dim), ("gate_up", 2 * i, h),
                       ("down", h, i)):
        for m in (320, 8192):
            micro_shape(kernels, mm, g, name, m, n, k)
        torch.cuda.empty_cache()


def micro_shape(kernels, mm, g, name: str, m: int, n: int, k: int) -> None:
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.float16)
    wq, sw = fp8.quantize_weight(w)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.float16)
    xq, sx = kernels.quant_rows(x)
    f16 = timed(lambda: torch.nn.functional.linear(x, w))
    q = timed(lambda: kernels.quant_rows(x))
    f8 = timed(lambda: mm(xq, wq, sx, sw, torch.float16))
    fast = timed(lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16,
                                          use_fast_accum=True))
    tflop = 2 * m * n * k / 1e12
    emit(step="micro", shape=name, m=m, n=n, k=k, f16_ms=round(f16, 4), quant_ms=round(q, 4), fp8_ms=round(f8, 4),
         fp8_fast_accum_ms=round(fast, 4), f16_tflops=round(tflop / f16 * 1e3), fp8_tflops=round(tflop / f8 * 1e3),
         speedup_with_quant=round(f16 / (f8 + q), 2))


def prompt_specs(md) -> tuple[list[PromptSpec], list[tuple[int, int]]]:
    specs, decisions = [], []
    for item in sample_requests():
        request = validate_systemone({**item, "model": md.name}, md.name)
        for q in request.questions:
            lang, _, prompts = render_question(request.state_text, q)
            first = len(specs)
            specs += [PromptSpec(md.tokenizer.encode(p), lang, md.tokenizer.letter_ids[: len(q.keys)]) for p in prompts]
            decisions.append((first, len(specs)))
    return specs, decisions


def logits_of(backend, specs, prefixes) -> list[np.ndarray]:
    out = []
    for start in range(0, len(specs), 16):
        pack = pack_prompts(specs[start:start + 16], prefixes)
        res = [backend.forward(b) for b in pack.batches]
        out += [res[b][r, cols] for b, r, cols in pack.readouts]
    return out


def single_ms(backend, specs, decisions, prefixes, reps: int = 30) -> float:
    first, end = decisions[0]
    pack = pack_prompts(specs[first:end], prefixes)
    batch = pack.batches[0]
    for _ in range(3):
        backend.forward(batch)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        backend.forward(batch)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def invariance(backend, specs, prefixes, trials: int = 8) -> tuple[int, float]:
    rng = random.Random(0)
    same, worst = 0, 0.0
    for _ in range(trials):
        target = rng.choice(specs)
        pack = pack_prompts([target], prefixes)
        alone = backend.forward(pack.batches[0])[pack.readouts[0][1], pack.readouts[0][2]]
        pack = pack_prompts(rng.sample(specs, 31) + [target], prefixes)
        b, r, cols = pack.readouts[-1]
        mixed = backend.forward(pack.batches[b])[r, cols]
        same += int(np.array_equal(alone, mixed))
        worst = max(worst, float(np.abs(alone - mixed).max()))
    return same, worst


def fp8_run(backend, dev: str, prefixes, specs, decisions, ref, f16_single: float, subset: str) -> None:
    backend.fwd = backend.graphs = None
    if dev == "cuda":
        torch.cuda.empty_cache()
    t = time.perf_counter()
    backend.dtype_name, backend.options = "fp8", TorchOptions.from_settings(fp8_gemms=subset)
    backend.fwd = Forward(backend, backend.options, kernels=dev == "cuda")
    backend.graphs = Graphs(backend.fwd) if dev == "cuda" else None
    for lang, ids in prefixes.items():
        backend.add_prefix(lang, ids)
    emit(step="load_fp8", fp8_gemms=subset, s=round(time.perf_counter() - t, 1),
         fp8_gb=round(backend.fwd.fp8_bytes / 1e9, 2), gemm_plan=backend.fwd.report)
    got = logits_of(backend, specs, prefixes)
    dlogit = max(float(np.abs(a - b).max()) for a, b in zip(ref, got))
    dp = max(max(abs(x - y) for x, y in zip(calibrate(softmax(a.tolist()), 1.3), calibrate(softmax(b.tolist()), 1.3)))
             for a, b in zip(ref, got))
    same_prompt = sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(ref, got))
    # a question counts as the same when every one of its orders picks the same letter
    same_dec = sum(int(all(np.argmax(ref[j]) == np.argmax(got[j]) for j in range(first, end)))
                   for first, end in decisions)
    fp8_single = single_ms(backend, specs, decisions, prefixes)
    inv, inv_worst = invariance(backend, specs, prefixes)
    emit(step="fp8", fp8_gemms=subset, prompts=len(specs), same_prompt_decisions=same_prompt,
         questions=len(decisions), questions_all_orders_same=same_dec, max_dlogit_vs_f16=round(dlogit, 5),
         max_dp_cal_vs_f16=round(dp, 5), single_ms=round(fp8_single, 3), f16_single_ms=round(f16_single, 3),
         alone_vs_amid_31=f"{inv}/8", alone_vs_amid_31_max_dlogit=inv_worst,
         peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2) if dev == "cuda" else None)


def main(model_dir: str, out: str, *flags: str) -> None:
    md = load_model_dir(model_dir)
    if "--skip-micro" not in flags and "--cpu" not in flags:
        micro(md.config)
        torch.cuda.empty_cache()
    dev = "cpu" if "--cpu" in flags else "cuda"  # --cpu: a dry run of the logic on the twins (tiny models)
    backend = TorchBackend(dev)
    t = time.perf_counter()
    backend.load(md.path, "f16")
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    for lang, ids in prefixes.items():
        backend.add_prefix(lang, ids)
    emit(step="load_f16", s=round(time.perf_counter() - t, 1), gemm_plan=backend.fwd.report)
    specs, decisions = prompt_specs(md)
    ref = logits_of(backend, specs, prefixes)
    f16_single = single_ms(backend, specs, decisions, prefixes)
    emit(step="f16", prompts=len(specs), single_ms=round(f16_single, 3))
    # --subsets "qkv,o,gate_up,down;gate_up,down": one fp8 run per fp8_gemms option value (default: all)
    subsets = next((f.split("=", 1)[1] for f in flags if f.startswith("--subsets=")), ",".join(FP8_GEMMS))
    for subset in subsets.split(";"):
        fp8_run(backend, dev, prefixes, specs, decisions, ref, f16_single, subset)
    with open(out, "w") as fh:
        json.dump(RESULTS, fh, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
