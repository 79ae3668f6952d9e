"""`basal-local bench`: single-decision latency, decisions/s and packing in-process, or HTTP load.

In-process figures drive the real engine path (plan -> pack -> backend -> answers) without HTTP.
`--http URL --clients N` sends the sample set's questions, one per request, from N closed-loop clients.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from importlib import resources
from typing import Any

from .samples import sample_requests


def single_question_requests(model: str) -> list[dict[str, Any]]:
    """Each question of the sample set as its own System One request."""
    out = []
    for item in sample_requests():
        for qid, q in item["questions"].items():
            out.append({"model": model, "state": item["state"], "questions": {qid: q}})
    return out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(q * len(ordered) + 0.5)) - 1))
    return ordered[rank]


def _load(backend, model, dtype: str):
    """backend.load, its refusals (a dtype it cannot run, weights over --gpu-memory) as the user's error."""
    from .commands import UserError

    try:
        return backend.load(model.path, dtype)
    except ValueError as exc:
        raise UserError(f"cannot load {model.name} on {backend.device}: {exc}") from None


def _engine(model, backend):
    """The engine (its warm-up: template K/V, CUDA graphs), running out of a --gpu-memory limit as the user's error."""
    from .commands import UserError
    from .engine.engine import EngineSettings, ModelEngine
    from .engine.gate import DeviceGate
    from .telemetry import Telemetry

    try:
        return ModelEngine(model, backend, DeviceGate(), Telemetry(), EngineSettings(long_tokens=0))
    except ValueError as exc:
        if getattr(backend, "memory_limit", None) is None:
            raise
        raise UserError(f"cannot warm up {model.name} on {backend.device}: {exc}") from None


def bench_in_process(model_dir, device: str, dtype: str, repeat: int, attention: str = "auto",
                     backend_name: str = "torch", decisions: int = 0,
                     gpu_memory: str | None = None, torch_options=None) -> dict[str, Any]:
    from basal_local.backends.select import make_backend

    from .api.systemone import validate_systemone
    from .engine.packer import pack_prompts
    from .model.directory import load_model_dir

    model = load_model_dir(model_dir)
    backend = make_backend(backend_name, device, attention, memory_limit=gpu_memory, torch_options=torch_options)
    _phase(f"loading {model.name} on {backend.device}")
    t0 = time.perf_counter()
    info = _load(backend, model, dtype)
    load_s = time.perf_counter() - t0
    _phase("warming up (template K/V" + (", CUDA graphs" if backend.device.startswith("cuda") else "")
           + ", first decisions)")
    t0 = time.perf_counter()
    engine = _engine(model, backend)
    requests = [validate_systemone(r, model.name) for r in single_question_requests(model.name)]
    if decisions:  # --decisions N: the first N of the sample set (a quick run)
        requests = requests[:decisions]

    def sync():
        if backend.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def decide(batch_requests):
        plans = [engine.plan(r) for r in batch_requests]
        specs = [s for p in plans for s in p.prompt_specs()]
        pack = pack_prompts(specs, engine.prefixes)
        for b in pack.batches:
            backend.forward(b)
        sync()
        return pack

    for r in requests[:5]:  # warm-up
        decide([r])
    # all of it: template K/V, on CUDA graph capture of every bucket, and the first forwards (kernel compiles)
    warmup_s = time.perf_counter() - t0
    latencies = []
    packed = []
    _phase(f"single decisions ({len(requests) * repeat})")
    ticker = Ticker("single decisions", len(requests) * repeat)
    for _ in range(repeat):
        for r in requests:
            ticker.step()
            t = time.perf_counter()
            pack = decide([r])
            latencies.append((time.perf_counter() - t) * 1000.0)
            packed.append(pack.packed_tokens + sum(len(engine.prefixes.get(row.lang, [])) for row in pack.rows
                                                   if row.prefix))
    throughput = {}
    for size in (16, 32):
        _phase(f"batches of {size}")
        groups = [requests[i:i + size] for i in range(0, len(requests) - size + 1, size)] or [requests[:size]]
        t = time.perf_counter()
        n = 0
        packs = []
        ticker = Ticker(f"batches of {size}", len(groups) * repeat)
        for _ in range(repeat):
            for g in groups:
                ticker.step()
                packs.append(decide(g))
                n += len(g)
        elapsed = time.perf_counter() - t
        throughput[f"batch{size}"] = {"decisions_per_s": round(n / elapsed, 2),
                                      "packed_tokens": sum(p.packed_tokens for p in packs) // len(packs),
                                      "unpacked_tokens": sum(p.unpacked_tokens for p in packs) // len(packs)}
    return {
        "mode": "in-process", "model": model.name, "backend": backend.name, "device": backend.device,
        "attention": getattr(backend, "attention", ""),
        "gemm": backend.describe()["gemm"] if hasattr(backend, "describe") else "",
        "gemm_plan": backend.describe()["plan"] if hasattr(backend, "describe") else {},
        "torch_options": backend.describe()["options"] if hasattr(backend, "describe") else {},
        "dtype": info.dtype, "layers": info.layers, "hidden": info.hidden_size, "load_s": round(load_s, 2),
        "warmup_s": round(warmup_s, 2),
        "decisions": len(latencies),
        "single_ms": {"median": round(statistics.median(latencies), 3), "p95": round(_percentile(latencies, .95), 3)},
        "packed_tokens_p50": statistics.median(packed), "throughput": throughput,
        "memory": backend.memory(), "python": platform.python_version(),
        **({"mlx": _mlx_version()} if backend.name == "mlx" else {"torch": _torch_version()}),
    }


def bench_transformers_baseline(model_dir, device: str, dtype: str, repeat: int) -> dict[str, Any]:
    """The same decisions through Hugging Face transformers (eager, SDPA, padded batches, full lm_head)."""
    import torch
    from transformers import LlamaForCausalLM

    from .api.systemone import validate_systemone
    from .engine.plan import plan_request
    from .model.directory import load_model_dir

    model = load_model_dir(model_dir)
    dev = "cuda" if device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    # auto: bf16 on the GPU (how transformers is usually run), the f32 reference on the CPU
    torch_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float16,
                   "auto": torch.bfloat16 if dev == "cuda" else torch.float32}[dtype]
    hf = LlamaForCausalLM.from_pretrained(model.path, dtype=torch_dtype, attn_implementation="sdpa").to(dev).eval()
    plans = [plan_request(validate_systemone(r, model.name), model.tokenizer, 10**9)
             for r in single_question_requests(model.name)]

    def run(group) -> None:
        prompts = [(ids, qp.letter_ids) for p in group for qp in p.questions for ids in qp.token_ids]
        width = max(len(ids) for ids, _ in prompts)
        tokens = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(tokens)
        for i, (ids, _) in enumerate(prompts):
            tokens[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        with torch.inference_mode():
            logits = hf(tokens.to(dev), attention_mask=mask.to(dev)).logits
            rows = torch.tensor([len(ids) - 1 for ids, _ in prompts], device=dev)
            last = logits[torch.arange(len(prompts), device=dev), rows].float()
            for i, (_, letters) in enumerate(prompts):
                last[i, letters].cpu()
        if dev == "cuda":
            torch.cuda.synchronize()

    for p in plans[:5]:
        run([p])
    latencies = []
    for _ in range(repeat):
        for p in plans:
            t = time.perf_counter()
            run([p])
            latencies.append((time.perf_counter() - t) * 1000.0)
    size = 32
    t = time.perf_counter()
    n = 0
    for _ in range(repeat):
        for i in range(0, len(plans) - size + 1, size):
            run(plans[i:i + size])
            n += size
    return {"mode": "transformers", "dtype": str(torch_dtype).replace("torch.", ""), "device": dev,
            "single_ms": {"median": round(statistics.median(latencies), 3),
                          "p95": round(_percentile(latencies, .95), 3)},
            "throughput": {"batch32": {"decisions_per_s": round(n / (time.perf_counter() - t), 2)}}}


def _save_partial(result: dict[str, Any]) -> None:
    """With BASAL_BENCH_PARTIAL=FILE, the figures so far are written there after each stage (a run cut off by
    a time limit keeps them)."""
    import os

    path = os.environ.get("BASAL_BENCH_PARTIAL")
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(result, fh)


def _cuda_memory_now() -> dict[str, float]:
    import torch

    return {"peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
            "allocated_gb": round(torch.cuda.memory_allocated() / 1e9, 3)}


class Ticker:
    """Progress inside a long step: `done/total` and the time left, on stderr, at most every `every_s`."""

    def __init__(self, label: str, total: int, every_s: float = 5.0, clock=time.perf_counter) -> None:
        self.label, self.total, self.every_s, self.clock = label, total, every_s, clock
        self.done, self.started = 0, clock()
        self.last = self.started

    def step(self) -> str | None:
        """Count the item about to start; the line printed, if one was due."""
        now = self.clock()
        line = None
        if self.done and now - self.last >= self.every_s:
            left = (now - self.started) / self.done * (self.total - self.done)
            line = f"{self.label} {self.done}/{self.total}, about {left:.0f} s left"
            _phase(line)
            self.last = now
        self.done += 1
        return line


def _phase(text: str) -> None:
    """Progress of a long measurement, on stderr (stdout stays the result, --json included)."""
    print(f"basal-local bench: {text}...", file=sys.stderr, flush=True)


def _torch_version() -> str:
    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        return f"{torch.__version__} ({gpu})"
    except Exception:
        return "n/a"


def _mlx_version() -> str:
    import mlx.core as mx

    return f"{mx.__version__} ({'metal' if mx.metal.is_available() else 'cpu'})"


def run_bench(args: argparse.Namespace) -> int:
    if args.http:
        from .commands.benchhttp import bench_http, bench_http_invariance

        key = getattr(args, "api_key", None)
        _phase(f"{args.requests or 'the sample set of'} requests from {args.clients} clients to {args.http}")
        result = bench_http(args.http, args.clients, args.requests, not getattr(args, "new_connections", False),
                            key)
        if getattr(args, "invariance", 0) and not result.get("daemon_gone"):
            result["invariance_alone_vs_amid_31"] = bench_http_invariance(args.http, args.invariance, key)
    else:
        from .model.registry import demo_model_dir, resolve_model

        model_dir = resolve_model(args.model) if args.model else demo_model_dir()
        if args.dtype == "fp8":
            from .backends.select import check_dtype
            from .commands import UserError

            try:
                check_dtype(getattr(args, "backend", "torch"), args.device, args.dtype)
            except ValueError as exc:
                raise UserError(str(exc)) from None
        options = torch_options(args)
        result = bench_in_process(model_dir, args.device, args.dtype, args.repeat, args.attention,
                                  getattr(args, "backend", "torch"), getattr(args, "decisions", 0),
                                  getattr(args, "gpu_memory", None), options)
        _save_partial(result)
        if result["device"].startswith("cuda"):
            result["memory_after_bench"] = _cuda_memory_now()
        if getattr(args, "long_doc", False) or getattr(args, "invariance", 0):
            result["extras"] = bench_extras(model_dir, args.device, args.dtype, args.attention,
                                            long_doc=getattr(args, "long_doc", False),
                                            invariance=getattr(args, "invariance", 0), repeat=args.repeat,
                                            gpu_memory=getattr(args, "gpu_memory", None), torch_options=options)
            _save_partial(result)
        if args.baseline in ("transformers-compiled", "both"):
            try:
                comp = bench_transformers_compiled(model_dir, args.device, args.dtype, args.repeat)
            except Exception as exc:  # a compiler failure is a figure we could not take, not a crash
                comp = {"mode": "transformers-compiled", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            result["baseline_compiled"] = comp
            _save_partial(result)
            if "single_ms" in comp:
                result["speedup_single_median_vs_compiled"] = round(
                    comp["single_ms"]["median"] / result["single_ms"]["median"], 2)
                result["speedup_batch32_vs_compiled"] = round(
                    result["throughput"]["batch32"]["decisions_per_s"]
                    / comp["throughput"]["batch32"]["decisions_per_s"], 2)
        if args.baseline in ("transformers", "both"):
            _phase("the same decisions through Hugging Face transformers")
            base = bench_transformers_baseline(model_dir, args.device, args.dtype, args.repeat)
            result["baseline"] = base
            result["speedup_single_median"] = round(base["single_ms"]["median"] / result["single_ms"]["median"], 2)
            result["speedup_batch32"] = round(result["throughput"]["batch32"]["decisions_per_s"]
                                              / base["throughput"]["batch32"]["decisions_per_s"], 2)
    from .commands.benchout import http_failure, print_result

    print_result(result, args.json)
    failure = http_failure(result) if args.http else None
    if failure:
        print(f"basal-local: error: {failure}", file=sys.stderr)
        return 1
    return 0


# ---- issue 9 figures: long documents, batch invariance, the compiled transformers baseline ------------------
LONG_DOC_QUESTIONS = {
    "party": {"type": "choice", "instructions": "Which party bears the cost of the annual audit?",
              "criteria": {"supplier": "The Supplier", "customer": "The Customer", "shared": "Both, in equal shares",
                           "none": "The contract does not say"}},
    "renewal": {"type": "noul", "instructions": "Does the contract renew automatically at the end of the term?",
                "criteria": {"true": "Yes, it renews automatically", "false": "No, it needs a written renewal"}},
    "risk": {"type": "score", "instructions": "How risky is this contract for the Customer?",
             "criteria": ["very low", "low", "moderate", "high", "very high"]},
    "law": {"type": "choice", "instructions": "Which law governs the contract?",
            "criteria": {"pl": "Polish law", "en": "English law", "de": "German law", "other": "Another law"}},
    "penalty": {"type": "noul", "instructions": "Is there a contractual penalty for late delivery?"},
}


def long_document(tokenizer, target_tokens: int) -> str:
    """A deterministic synthetic contract of about `target_tokens` tokens (numbered clauses from the corpus)."""
    corpus = resources.files("basal_local.assets").joinpath("corpus_en.txt").read_text(encoding="utf-8")
    sentences = [s.strip() for s in corpus.replace("\n", " ").split(". ") if len(s.strip()) > 20]
    parts = ["FRAMEWORK SERVICES AGREEMENT between Northwind Analytics (the Supplier) and Contoso Retail "
             "(the Customer)."]
    clause = 0
    step = 40
    while True:
        for _ in range(step):
            clause += 1
            s = sentences[(clause * 7) % len(sentences)]
            parts.append(f"§{clause}. Clause {clause} ({['scope', 'fees', 'audit', 'term', 'liability'][clause % 5]})"
                         f": {s}.")
        text = "\n".join(parts)
        n = len(tokenizer.encode(text))
        if n >= target_tokens:
            return text
        step = max(1, min(40, int((target_tokens - n) / max(1, n / clause))))


def _cuda_memory(backend) -> dict[str, float]:
    if not backend.device.startswith("cuda"):
        return {}
    import torch

    weights = backend.memory().get("weights_bytes", 0)
    out = {"peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
           "peak_minus_weights_gb": round((torch.cuda.max_memory_allocated() - weights) / 1e9, 3),
           "allocated_gb": round(torch.cuda.memory_allocated() / 1e9, 3),
           "reserved_gb": round(torch.cuda.memory_reserved() / 1e9, 3)}
    torch.cuda.reset_peak_memory_stats()
    return out


def torch_options(args):
    """The torch backend's options from bench's flags (basal_local/settings.py TorchSettings)."""
    from .settings import TorchSettings

    return TorchSettings.from_flags(args).options()


def bench_extras(model_dir, device: str, dtype: str, attention: str = "auto", long_doc: bool = False,
                 invariance: int = 0, repeat: int = 1, gpu_memory: str | None = None,
                 torch_options=None) -> dict[str, Any]:
    """The long-document figures and the alone-vs-amid-31-others bitwise check, in-process."""
    import gc
    import random

    import numpy as np

    from basal_local.backends.select import make_backend

    from .api.systemone import validate_systemone
    from .engine.packer import pack_prompts
    from .model.directory import load_model_dir

    gc.collect()  # the in-process bench's backend (a backend <-> Forward cycle) must not count in these figures
    model = load_model_dir(model_dir)
    backend = make_backend("torch", device, attention, memory_limit=gpu_memory, torch_options=torch_options)
    _load(backend, model, dtype)
    engine = _engine(model, backend)
    out: dict[str, Any] = {"attention": getattr(backend, "attention", ""), "memory_after_load": _cuda_memory(backend)}

    def sync():
        if backend.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def logits_of(reqs):
        plans = [engine.plan(r) for r in reqs]
        specs = [s for p in plans for s in p.prompt_specs()]
        pack = pack_prompts(specs, engine.prefixes)
        outputs = [backend.forward(b) for b in pack.batches]
        sync()
        return [outputs[b][r, cols] for b, r, cols in pack.readouts], pack

    if invariance:
        requests = [validate_systemone(r, model.name) for r in single_question_requests(model.name)]
        rng = random.Random(0)
        bitwise, worst = 0, 0.0
        for _ in range(invariance):
            target = rng.choice(requests)
            alone, _ = logits_of([target])
            others = rng.sample([r for r in requests if r is not target], 31)
            position = rng.randint(0, 31)
            mixed, _ = logits_of(others[:position] + [target] + others[position:])
            n_before = sum(len(engine.plan(r).prompt_specs()) for r in others[:position])
            mine = mixed[n_before:n_before + len(alone)]
            worst = max(worst, max(float(np.abs(a - b).max()) for a, b in zip(alone, mine)))
            bitwise += all(np.array_equal(a, b) for a, b in zip(alone, mine))
        out["invariance_alone_vs_amid_31"] = {"trials": invariance, "bitwise_equal": bitwise,
                                              "max_abs_dlogit": worst}
        out["memory_after_invariance"] = _cuda_memory(backend)
    if long_doc:
        for target in (4200, 16500):
            if target + 700 > model.config.max_position_embeddings:
                out[f"long_doc_{target}"] = {"skipped": f"longer than the model's context "
                                                        f"({model.config.max_position_embeddings} tokens)"}
                continue
            text = long_document(model.tokenizer, target)
            request = validate_systemone({"model": model.name, "state": text, "questions": LONG_DOC_QUESTIONS},
                                         model.name)
            times = []
            for _ in range(max(1, repeat)):
                t = time.perf_counter()
                _, pack = logits_of([request])
                times.append(time.perf_counter() - t)
            out[f"long_doc_{target}"] = {"state_tokens": len(model.tokenizer.encode(text)),
                                         "packed_tokens": pack.packed_tokens, "forwards": len(pack.batches),
                                         "seconds": [round(x, 3) for x in times],
                                         "memory": _cuda_memory(backend)}
            if backend.device.startswith("cuda"):
                import torch

                torch.cuda.empty_cache()
                out[f"long_doc_{target}"]["allocated_after_empty_cache_gb"] = round(
                    torch.cuda.memory_allocated() / 1e9, 3)
    return out


def bench_transformers_compiled(model_dir, device: str, dtype: str, repeat: int) -> dict[str, Any]:
    """transformers under torch.compile(mode="reduce-overhead") (CUDA graphs) with fixed shapes: every prompt
    padded to the sample set's longest (rounded up to 64), so one compile serves the single decisions (2 rows)
    and one the batches of 32 (64 rows)."""
    import torch
    from transformers import LlamaForCausalLM

    from .api.systemone import validate_systemone
    from .engine.plan import plan_request
    from .model.directory import load_model_dir

    model = load_model_dir(model_dir)
    torch_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float16,
                   "auto": torch.bfloat16}[dtype]
    hf = LlamaForCausalLM.from_pretrained(model.path, dtype=torch_dtype, attn_implementation="sdpa").to("cuda").eval()
    forward = torch.compile(hf.forward, mode="reduce-overhead", dynamic=False)
    plans = [plan_request(validate_systemone(r, model.name), model.tokenizer, 10**9)
             for r in single_question_requests(model.name)]
    longest = max(len(ids) for p in plans for qp in p.questions for ids in qp.token_ids)
    fixed_width = -(-longest // 64) * 64

    def run(group) -> None:
        prompts = [(ids, qp.letter_ids) for p in group for qp in p.questions for ids in qp.token_ids]
        width = fixed_width
        tokens = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(tokens)
        for i, (ids, _) in enumerate(prompts):
            tokens[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        with torch.inference_mode():
            logits = forward(input_ids=tokens.cuda(), attention_mask=mask.cuda()).logits
            rows = torch.tensor([len(ids) - 1 for ids, _ in prompts], device="cuda")
            last = logits[torch.arange(len(prompts), device="cuda"), rows].float()
            for i, (_, letters) in enumerate(prompts):
                last[i, letters].cpu()
        torch.cuda.synchronize()

    t0 = time.perf_counter()
    size = 32
    groups = [plans[i:i + size] for i in range(0, len(plans) - size + 1, size)]
    for _ in range(3):  # compile and record both shapes (not timed)
        run(plans[:1])
        run(groups[0])
    compile_s = time.perf_counter() - t0
    latencies = []
    for _ in range(repeat):
        for p in plans:
            t = time.perf_counter()
            run([p])
            latencies.append((time.perf_counter() - t) * 1000.0)
    t = time.perf_counter()
    n = 0
    for _ in range(repeat):
        for g in groups:
            run(g)
            n += size
    return {"mode": "transformers-compiled", "dtype": str(torch_dtype).replace("torch.", ""), "device": "cuda",
            "compile_s": round(compile_s, 1), "padded_width": fixed_width,
            "single_ms": {"median": round(statistics.median(latencies), 3),
                          "p95": round(_percentile(latencies, .95), 3)},
            "throughput": {"batch32": {"decisions_per_s": round(n / (time.perf_counter() - t), 2)}}}
