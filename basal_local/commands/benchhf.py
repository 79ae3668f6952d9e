"""`basal-local bench --baseline`: the same decisions through Hugging Face transformers, side by side.

`transformers` runs it eager (SDPA, padded batches, the full lm_head); `transformers-compiled` under
`torch.compile(mode="reduce-overhead")` (CUDA graphs) with fixed shapes: every prompt padded to the sample set's
longest (rounded up to 64), so one compile serves the single decisions and one the batches of 32.
This module imports torch and transformers at the top: the bench imports it only for a baseline, after
`cli.check_bench_extras` has checked that transformers is installed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import LlamaForCausalLM

from ..api.systemone import validate_systemone
from ..engine.plan import RequestPlan, plan_request
from ..model.directory import load_model_dir
from ..samples import single_question_requests
from .benchout import percentile

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float16}


def _setup(model_dir, dev: str, torch_dtype) -> tuple[LlamaForCausalLM, list[RequestPlan]]:
    model = load_model_dir(model_dir)
    hf = LlamaForCausalLM.from_pretrained(model.path, dtype=torch_dtype, attn_implementation="sdpa").to(dev).eval()
    plans = [plan_request(validate_systemone(r, model.name), model.tokenizer, 10**9)
             for r in single_question_requests(model.name)]
    return hf, plans


def _runner(forward: Callable, dev: str, width: int | None) -> Callable[[list[RequestPlan]], None]:
    """One padded forward of a group's prompts, reading each prompt's letter logits (width None: the group's
    longest prompt)."""

    def run(group: list[RequestPlan]) -> None:
        prompts = [(ids, qp.letter_ids) for p in group for qp in p.questions for ids in qp.token_ids]
        tokens = torch.zeros((len(prompts), width or max(len(ids) for ids, _ in prompts)), dtype=torch.long)
        mask = torch.zeros_like(tokens)
        for i, (ids, _) in enumerate(prompts):
            tokens[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        with torch.inference_mode():
            logits = forward(input_ids=tokens.to(dev), attention_mask=mask.to(dev)).logits
            rows = torch.tensor([len(ids) - 1 for ids, _ in prompts], device=dev)
            last = logits[torch.arange(len(prompts), device=dev), rows].float()
            for i, (_, letters) in enumerate(prompts):
                last[i, letters].cpu()
        if dev == "cuda":
            torch.cuda.synchronize()

    return run


def _measure(run: Callable, plans: list[RequestPlan], repeat: int, size: int = 32) -> dict[str, Any]:
    latencies = []
    for _ in range(repeat):
        for p in plans:
            t = time.perf_counter()
            run([p])
            latencies.append((time.perf_counter() - t) * 1000.0)
    t = time.perf_counter()
    n = 0
    for _ in range(repeat):
        for i in range(0, len(plans) - size + 1, size):
            run(plans[i:i + size])
            n += size
    return {"single_ms": {"median": round(statistics.median(latencies), 3),
                          "p95": round(percentile(latencies, .95), 3)},
            "throughput": {"batch32": {"decisions_per_s": round(n / (time.perf_counter() - t), 2)}}}


def bench_transformers_baseline(model_dir, device: str, dtype: str, repeat: int) -> dict[str, Any]:
    """The same decisions through transformers, eager."""
    dev = "cuda" if device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    # auto: bf16 on the GPU (how transformers is usually run), the f32 reference on the CPU
    torch_dtype = DTYPES.get(dtype) or (torch.bfloat16 if dev == "cuda" else torch.float32)
    hf, plans = _setup(model_dir, dev, torch_dtype)
    run = _runner(hf, dev, None)
    for p in plans[:5]:
        run([p])
    return {"mode": "transformers", "dtype": str(torch_dtype).replace("torch.", ""), "device": dev,
            **_measure(run, plans, repeat)}


def bench_transformers_compiled(model_dir, device: str, dtype: str, repeat: int) -> dict[str, Any]:
    """The same decisions through transformers under torch.compile(mode="reduce-overhead"), on CUDA."""
    torch_dtype = DTYPES.get(dtype) or torch.bfloat16
    hf, plans = _setup(model_dir, "cuda", torch_dtype)
    longest = max(len(ids) for p in plans for qp in p.questions for ids in qp.token_ids)
    fixed_width = -(-longest // 64) * 64
    run = _runner(torch.compile(hf.forward, mode="reduce-overhead", dynamic=False), "cuda", fixed_width)
    t0 = time.perf_counter()
    for _ in range(3):  # compile and record both shapes (not timed)
        run(plans[:1])
        run(plans[:32])
    compile_s = time.perf_counter() - t0
    return {"mode": "transformers-compiled", "dtype": str(torch_dtype).replace("torch.", ""), "device": "cuda",
            "compile_s": round(compile_s, 1), "padded_width": fixed_width, **_measure(run, plans, repeat)}
