"""`basal-local bench`: in process through the engine (`commands/benchengine.py`), or HTTP load on a running
daemon (`commands/benchhttp.py`), optionally beside Hugging Face transformers (`commands/benchhf.py`);
`commands/benchout.py` shows the result. The measuring tools import the sample requests from here.

`BASAL_BENCH_PARTIAL=FILE` writes the figures so far after each stage (a run cut off by a time limit keeps them):
a measuring harness's option, not the product's behaviour.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from basal_local.backends.select import check_dtype

from .commands import UserError
from .commands.benchhttp import bench_http, bench_http_invariance
from .commands.benchout import Ticker, http_failure, phase, print_result
from .flags import flag_overrides
from .model.registry import demo_model_dir, resolve_model
from .samples import sample_requests, single_question_requests
from .settings import torch_options as options_from

__all__ = ["Ticker", "run_bench", "sample_requests", "single_question_requests", "torch_options"]


def torch_options(args: argparse.Namespace):
    """The torch backend's options from bench's flags (the "torch" settings of basal_local/settings.py; bench
    reads no config.toml)."""
    return options_from(flag_overrides(args, "torch"))


def run_bench(args: argparse.Namespace) -> int:
    if args.http and getattr(args, "documents", 0):  # the state cache's mixed stream (commands/benchcache.py)
        from .commands.benchcache import bench_http_documents

        phase(f"{args.documents} documents x {args.per_document} requests from {args.clients} clients to {args.http}")
        ticker = Ticker("requests", args.documents * args.per_document)
        result = bench_http_documents(args.http, args.clients, args.documents, args.per_document,
                                      api_key=getattr(args, "api_key", None), progress=lambda n, total: ticker.step())
    elif args.http:
        key = getattr(args, "api_key", None)
        phase(f"{args.requests or 'the sample set of'} requests from {args.clients} clients to {args.http}")
        result = bench_http(args.http, args.clients, args.requests, not getattr(args, "new_connections", False),
                            key)
        if getattr(args, "invariance", 0) and not result.get("daemon_gone"):
            result["invariance_alone_vs_amid_31"] = bench_http_invariance(args.http, args.invariance, key)
    else:
        result = _in_process(args)
    print_result(result, args.json)
    failure = http_failure(result) if args.http else None
    if failure:
        print(f"basal-local: error: {failure}", file=sys.stderr)
        return 1
    return 0


def _in_process(args: argparse.Namespace) -> dict[str, Any]:
    # the engine, the backends and numpy: imported when a bench runs in process, not for `bench --http`
    from .commands.benchengine import bench_extras, bench_in_process

    model_dir = resolve_model(args.model) if args.model else demo_model_dir()
    if args.dtype == "fp8":
        try:
            check_dtype(getattr(args, "backend", "torch"), args.device, args.dtype)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    options = torch_options(args)
    if getattr(args, "cache", False):  # the state cache's figures instead (commands/benchcache.py)
        from .commands.benchcache import bench_cache

        return bench_cache(model_dir, args.device, args.dtype, args.doc_tokens, args.documents or 3,
                           getattr(args, "gpu_memory", None), options, progress=phase,
                           backend_name=getattr(args, "backend", "torch"), attention=args.attention)
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
        from .commands.benchhf import (
            bench_transformers_compiled,  # torch and transformers: only for a baseline
        )

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
        from .commands.benchhf import (
            bench_transformers_baseline,  # torch and transformers: only for a baseline
        )

        phase("the same decisions through Hugging Face transformers")
        base = bench_transformers_baseline(model_dir, args.device, args.dtype, args.repeat)
        result["baseline"] = base
        result["speedup_single_median"] = round(base["single_ms"]["median"] / result["single_ms"]["median"], 2)
        result["speedup_batch32"] = round(result["throughput"]["batch32"]["decisions_per_s"]
                                          / base["throughput"]["batch32"]["decisions_per_s"], 2)
    return result


def _save_partial(result: dict[str, Any]) -> None:
    path = os.environ.get("BASAL_BENCH_PARTIAL")
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(result, fh)


def _cuda_memory_now() -> dict[str, float]:
    import torch  # only after a bench on CUDA

    return {"peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
            "allocated_gb": round(torch.cuda.memory_allocated() / 1e9, 3)}
