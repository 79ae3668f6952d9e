"""`basal-local bench` in process, through the engine's own path: requests are planned by the engine, queued as
its jobs and computed by `ModelEngine.launch_batch` / `complete_batch` (pack, forwards under the device gate,
readout, the answers), exactly what a lane does, without HTTP and without the lane threads.

`bench_in_process`: single-decision latency, decisions/s in batches of 16 and 32, packing. `bench_extras`: the
long-document figures (~4.2k and ~16.5k tokens, 5 questions) and the alone-vs-amid-31-others bitwise check.
"""

from __future__ import annotations

import gc
import platform
import random
import statistics
import time
from importlib import resources
from typing import Any

import numpy as np

from basal_local.backends.select import make_backend

from ..api.systemone import validate_systemone
from ..engine.engine import ModelEngine
from ..engine.gate import DeviceGate
from ..engine.lane import Flight
from ..engine.packer import pack_prompts
from ..engine.scheduler import Job
from ..model.directory import ModelDir, load_model_dir
from ..protocol.questions import DecisionRequest
from ..samples import single_question_requests
from ..settings import EngineSettings
from ..telemetry import Telemetry
from . import UserError
from .benchout import Ticker, percentile, phase

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


class Bench:
    """One model loaded on one backend, its engine warmed up (template K/V, CUDA graphs), and `decide`."""

    def __init__(self, model_dir, backend_name: str, device: str, dtype: str, attention: str = "auto",
                 gpu_memory: str | None = None, torch_options=None) -> None:
        self.model: ModelDir = load_model_dir(model_dir)
        try:
            self.backend = make_backend(backend_name, device, attention, memory_limit=gpu_memory,
                                        torch_options=torch_options)
        except ValueError as exc:  # an --attention this backend or device cannot run
            raise UserError(f"--attention {attention}: {exc}", "use --attention auto") from None
        phase(f"loading {self.model.name} on {self.backend.device}")
        t0 = time.perf_counter()
        try:
            self.info = self.backend.load(self.model.path, dtype)
        except ValueError as exc:  # a dtype it cannot run, weights over --gpu-memory: the user's error
            raise UserError(f"cannot load {self.model.name} on {self.backend.device}: {exc}") from None
        self.load_s = time.perf_counter() - t0
        phase("warming up (template K/V" + (", CUDA graphs" if self.cuda else "") + ", first decisions)")
        self.warm_started = time.perf_counter()
        try:
            # a pool with room for the templates only: the bench times computing, never a stored document
            # (bench --cache times the state cache)
            self.engine = ModelEngine(self.model, self.backend, DeviceGate(), Telemetry(),
                                      EngineSettings(long_tokens=0, prefix_cache=templates_only(self.model,
                                                                                                self.backend)))
        except ValueError as exc:
            if getattr(self.backend, "memory_limit", None) is None:
                raise
            raise UserError(f"cannot warm up {self.model.name} on {self.backend.device}: {exc}") from None

    @property
    def cuda(self) -> bool:
        return self.backend.device.startswith("cuda")

    def requests(self) -> list[DecisionRequest]:
        """The sample set's questions, one per request."""
        return [validate_systemone(r, self.model.name) for r in single_question_requests(self.model.name)]

    def decide(self, requests: list[DecisionRequest]) -> Flight:
        """One batch of requests through the engine's path, answered; the flight holds its pack and forwards."""
        plans = [self.engine.plan(r) for r in requests]
        jobs = [Job(p, p.packed_tokens, p.prompt_specs(), request_id=f"bench-{i}") for i, p in enumerate(plans)]
        flight = self.engine.launch_batch(jobs, self.engine.main)
        self.engine.complete_batch(flight, self.engine.main)
        for job in jobs:
            job.future.result()  # an answer that failed fails the bench
        return flight

    def forward_only(self, requests: list[DecisionRequest]) -> None:
        """The same decisions as plan -> pack -> backend.forward only (no answers, no batch record): what this
        bench timed before it went through the engine's path, for side by sides with older commits."""
        specs = [spec for r in requests for spec in self.engine.plan(r).prompt_specs()]
        for b in pack_prompts(specs, self.engine.prefixes).batches:
            self.backend.forward(b)

    def logits(self, requests: list[DecisionRequest]) -> tuple[list[np.ndarray], Flight]:
        """`decide`, and the letter logits the engine read, one array per prompt in the requests' order."""
        flight = self.decide(requests)
        outputs = [f.result() for f in flight.launched]
        return [outputs[b][r, cols] for b, r, cols in flight.pack.readouts], flight

    def memory(self) -> dict[str, float]:
        """The CUDA allocator's figures (peak since the last call), {} elsewhere."""
        if not self.cuda:
            return {}
        import torch  # only on CUDA, where the torch backend runs

        weights = self.backend.memory().get("weights_bytes", 0)
        out = {"peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
               "peak_minus_weights_gb": round((torch.cuda.max_memory_allocated() - weights) / 1e9, 3),
               "allocated_gb": round(torch.cuda.memory_allocated() / 1e9, 3),
               "reserved_gb": round(torch.cuda.memory_reserved() / 1e9, 3)}
        torch.cuda.reset_peak_memory_stats()
        return out


def bench_in_process(model_dir, device: str, dtype: str, repeat: int, attention: str = "auto",
                     backend_name: str = "torch", decisions: int = 0,
                     gpu_memory: str | None = None, torch_options=None) -> dict[str, Any]:
    bench = Bench(model_dir, backend_name, device, dtype, attention, gpu_memory, torch_options)
    backend = bench.backend
    requests = bench.requests()
    if decisions:  # --decisions N: the first N of the sample set (a quick run)
        requests = requests[:decisions]
    for r in requests[:5]:  # warm-up
        bench.decide([r])
    # all of it: template K/V, on CUDA graph capture of every bucket, and the first forwards (kernel compiles)
    warmup_s = time.perf_counter() - bench.warm_started
    latencies, forward_only = [], []
    packed = []
    phase(f"single decisions ({len(requests) * repeat})")
    ticker = Ticker("single decisions", len(requests) * repeat)
    for _ in range(repeat):
        for r in requests:
            ticker.step()
            t = time.perf_counter()
            pack = bench.decide([r]).pack
            latencies.append((time.perf_counter() - t) * 1000.0)
            packed.append(pack.packed_tokens + sum(row.used for row in pack.rows))
            t = time.perf_counter()
            bench.forward_only([r])
            forward_only.append((time.perf_counter() - t) * 1000.0)
    throughput = {}
    for size in (16, 32):
        phase(f"batches of {size}")
        groups = [requests[i:i + size] for i in range(0, len(requests) - size + 1, size)] or [requests[:size]]
        t = time.perf_counter()
        n = 0
        packs = []
        ticker = Ticker(f"batches of {size}", len(groups) * repeat)
        for _ in range(repeat):
            for g in groups:
                ticker.step()
                packs.append(bench.decide(g).pack)
                n += len(g)
        elapsed = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(repeat):
            for g in groups:
                bench.forward_only(g)
        forward_s = time.perf_counter() - t
        throughput[f"batch{size}"] = {"decisions_per_s": round(n / elapsed, 2),
                                      "forward_only_decisions_per_s": round(n / forward_s, 2),
                                      "packed_tokens": sum(p.packed_tokens for p in packs) // len(packs),
                                      "unpacked_tokens": sum(p.unpacked_tokens for p in packs) // len(packs)}
    described = backend.describe() if hasattr(backend, "describe") else {}
    # the GEMM route and the torch options act on CUDA only: elsewhere the forward calls torch's linear as is
    cuda = str(backend.device).startswith("cuda")
    routes = {"gemm": described.get("gemm", ""), "gemm_plan": described.get("plan", {}),
              "torch_options": described.get("options", {})} if cuda else {"gemm": "torch linear" if described else ""}
    info = bench.info
    return {
        "mode": "in-process", "model": bench.model.name, "backend": backend.name, "device": backend.device,
        "attention": getattr(backend, "attention", ""), **routes,
        "dtype": info.dtype, "layers": info.layers, "hidden": info.hidden_size, "load_s": round(bench.load_s, 2),
        "warmup_s": round(warmup_s, 2),
        "decisions": len(latencies),
        "single_ms": {"median": round(statistics.median(latencies), 3), "p95": round(percentile(latencies, .95), 3)},
        "single_forward_ms": {"median": round(statistics.median(forward_only), 3),
                              "p95": round(percentile(forward_only, .95), 3)},
        "packed_tokens_p50": statistics.median(packed), "throughput": throughput,
        "memory": backend.memory(), "python": platform.python_version(),
        **({"mlx": _mlx_version()} if backend.name == "mlx" else {"torch": _torch_version()}),
    }


def long_document(tokenizer, target_tokens: int) -> str:
    """A deterministic synthetic contract of about `target_tokens` tokens (numbered clauses from the corpus)."""
    corpus = resources.files("basal_local.assets").joinpath("corpus_en.txt").read_text(encoding="utf-8")
    sentences = [s.strip() for s in corpus.replace("\n", " ").split(". ") if len(s.strip()) > 20]
    parts = ["FRAMEWORK SERVICES AGREEMENT between Northwind Analytics (the Supplier) and Contoso Retail "
             "(the Customer)."]
    clause = 0
    step = max(1, min(40, target_tokens // 100))  # a clause is ~90 tokens: a short document is not 40 of them
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


def bench_extras(model_dir, device: str, dtype: str, attention: str = "auto", long_doc: bool = False,
                 invariance: int = 0, repeat: int = 1, gpu_memory: str | None = None,
                 torch_options=None) -> dict[str, Any]:
    """The long-document figures and the alone-vs-amid-31-others bitwise check, in-process."""
    gc.collect()  # the in-process bench's backend (a backend <-> Forward cycle) must not count in these figures
    bench = Bench(model_dir, "torch", device, dtype, attention, gpu_memory, torch_options)
    model = bench.model
    out: dict[str, Any] = {"attention": getattr(bench.backend, "attention", ""), "memory_after_load": bench.memory()}
    if invariance:
        requests = bench.requests()
        rng = random.Random(0)
        bitwise, worst = 0, 0.0
        for _ in range(invariance):
            target = rng.choice(requests)
            alone, _ = bench.logits([target])
            others = rng.sample([r for r in requests if r is not target], 31)
            position = rng.randint(0, 31)
            mixed, _ = bench.logits(others[:position] + [target] + others[position:])
            n_before = sum(len(bench.engine.plan(r).prompt_specs()) for r in others[:position])
            mine = mixed[n_before:n_before + len(alone)]
            worst = max(worst, max(float(np.abs(a - b).max()) for a, b in zip(alone, mine)))
            bitwise += all(np.array_equal(a, b) for a, b in zip(alone, mine))
        out["invariance_alone_vs_amid_31"] = {"trials": invariance, "bitwise_equal": bitwise,
                                              "max_abs_dlogit": worst}
        out["memory_after_invariance"] = bench.memory()
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
                pack = bench.decide([request]).pack
                times.append(time.perf_counter() - t)
            out[f"long_doc_{target}"] = {"state_tokens": len(model.tokenizer.encode(text)),
                                         "packed_tokens": pack.packed_tokens, "forwards": len(pack.batches),
                                         "seconds": [round(x, 3) for x in times], "memory": bench.memory()}
            if bench.cuda:
                import torch  # only on CUDA, where the torch backend runs

                torch.cuda.empty_cache()
                out[f"long_doc_{target}"]["allocated_after_empty_cache_gb"] = round(
                    torch.cuda.memory_allocated() / 1e9, 3)
    return out


def _torch_version() -> str:
    try:
        import torch  # not on a Mac that runs MLX alone

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        return f"{torch.__version__} ({gpu})"
    except Exception:
        return "n/a"


def _mlx_version() -> str:
    import mlx.core as mx  # only where MLX runs

    return f"{mx.__version__} ({'metal' if mx.metal.is_available() else 'cpu'})"


def templates_only(model, backend) -> str:
    """A --prefix-cache size with room for the model's templates and nothing more (no document is stored)."""
    templates = sum(len(model.tokenizer.template_prefix(lang)) for lang in ("pl", "en"))
    per_token = backend.kv_bytes_per_token() if hasattr(backend, "kv_bytes_per_token") else 0
    return f"{(templates + 1) * per_token / 1e6:.6f}MB" if per_token else "auto"
