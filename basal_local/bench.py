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
import threading
import time
import urllib.request
from importlib import resources
from typing import Any


def sample_requests() -> list[dict[str, Any]]:
    text = resources.files("basal_local.assets").joinpath("sample_requests.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


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


def bench_in_process(model_dir, device: str, dtype: str, repeat: int, attention: str = "auto") -> dict[str, Any]:
    from basal_local.backends.select import make_backend

    from .api.systemone import validate_systemone
    from .engine.engine import EngineSettings, ModelEngine
    from .engine.gate import DeviceGate
    from .engine.packer import pack_prompts
    from .model.directory import load_model_dir
    from .telemetry import Telemetry

    model = load_model_dir(model_dir)
    backend = make_backend("torch", device, attention)
    _phase(f"loading {model.name} on {backend.device}")
    t0 = time.perf_counter()
    info = backend.load(model.path, dtype)
    load_s = time.perf_counter() - t0
    _phase("warming up (template K/V" + (", CUDA graphs)" if backend.device.startswith("cuda") else ")"))
    t0 = time.perf_counter()
    engine = ModelEngine(model, backend, DeviceGate(), Telemetry(), EngineSettings(long_tokens=0))
    warmup_s = time.perf_counter() - t0  # template K/V and, on CUDA, graph capture of every bucket
    requests = [validate_systemone(r, model.name) for r in single_question_requests(model.name)]

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
    latencies = []
    packed = []
    _phase(f"single decisions ({len(requests) * repeat})")
    for _ in range(repeat):
        for r in requests:
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
        for _ in range(repeat):
            for g in groups:
                packs.append(decide(g))
                n += len(g)
        elapsed = time.perf_counter() - t
        throughput[f"batch{size}"] = {"decisions_per_s": round(n / elapsed, 2),
                                      "packed_tokens": sum(p.packed_tokens for p in packs) // len(packs),
                                      "unpacked_tokens": sum(p.unpacked_tokens for p in packs) // len(packs)}
    return {
        "mode": "in-process", "model": model.name, "backend": backend.name, "device": backend.device,
        "attention": getattr(backend, "attention", ""),
        "dtype": info.dtype, "layers": info.layers, "hidden": info.hidden_size, "load_s": round(load_s, 2),
        "warmup_s": round(warmup_s, 2),
        "decisions": len(latencies),
        "single_ms": {"median": round(statistics.median(latencies), 3), "p95": round(_percentile(latencies, .95), 3)},
        "packed_tokens_p50": statistics.median(packed), "throughput": throughput,
        "memory": backend.memory(), "python": platform.python_version(), "torch": _torch_version(),
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
    torch_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
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


def bench_http(url: str, clients: int, total: int) -> dict[str, Any]:
    url = url.rstrip("/")
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        model = json.load(resp)["models"][0]["name"]
    bodies = single_question_requests(model)
    total = total or len(bodies)
    _phase(f"{total} requests from {clients} clients to {url}")
    latencies: list[float] = []
    batch_sizes: list[int] = []
    errors = [0]
    lock = threading.Lock()
    counter = iter(range(total))

    def client():
        while True:
            with lock:
                n = next(counter, None)
            if n is None:
                return
            data = json.dumps(bodies[n % len(bodies)]).encode()
            req = urllib.request.Request(url + "/v1/systemone", data, {"Content-Type": "application/json"})
            t = time.perf_counter()
            try:
                with urllib.request.urlopen(req, timeout=600) as resp:
                    resp.read()
                    size = int(resp.headers.get("x-basal-batch-requests", "1"))
                ms = (time.perf_counter() - t) * 1000.0
                with lock:
                    latencies.append(ms)
                    batch_sizes.append(size)
            except Exception:
                with lock:
                    errors[0] += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    if not latencies:
        return {"mode": "http", "error": "no request succeeded", "errors": errors[0]}
    return {"mode": "http", "url": url, "clients": clients, "requests": len(latencies), "errors": errors[0],
            "req_per_s": round(len(latencies) / elapsed, 2),
            "latency_ms": {"p50": round(_percentile(latencies, .5), 2), "p95": round(_percentile(latencies, .95), 2),
                           "p99": round(_percentile(latencies, .99), 2)},
            "mean_batch_requests": round(sum(batch_sizes) / len(batch_sizes), 2)}


def run_bench(args: argparse.Namespace) -> int:
    if args.http:
        result = bench_http(args.http, args.clients, args.requests)
    else:
        from .model.registry import demo_model_dir, resolve_model

        model_dir = resolve_model(args.model) if args.model else demo_model_dir()
        result = bench_in_process(model_dir, args.device, args.dtype, args.repeat, args.attention)
        if args.baseline == "transformers":
            _phase("the same decisions through Hugging Face transformers")
            base = bench_transformers_baseline(model_dir, args.device, args.dtype, args.repeat)
            result["baseline"] = base
            result["speedup_single_median"] = round(base["single_ms"]["median"] / result["single_ms"]["median"], 2)
            result["speedup_batch32"] = round(result["throughput"]["batch32"]["decisions_per_s"]
                                              / base["throughput"]["batch32"]["decisions_per_s"], 2)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>20}: {value}")
    return 0
