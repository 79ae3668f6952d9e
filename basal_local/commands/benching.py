"""`basal-local bench`: what it needs checked before it runs (device, memory, extras, the daemon of --http), then
basal_local/bench.py measures."""

from __future__ import annotations

import argparse
import importlib.util

from ..bench import run_bench
from . import UserError, check_url, get_json, model_path
from .serving import check_backend, check_device, check_gpu_memory, client_key


def bench_command(args: argparse.Namespace) -> int:
    if args.http:
        args.http = check_url(args.http, "--http")
        args.api_key = client_key(args)
        get_json(args.http, "/v1/models", flag="--http", api_key=args.api_key)
    else:
        check_device(args.device)
        check_gpu_memory(args.gpu_memory, args.device)
        check_bench_extras(args)
        if args.model:
            args.model = str(model_path(args.model))
    return run_bench(args)


def check_bench_extras(args: argparse.Namespace) -> None:
    """What the bench needs beyond our own code, checked before it runs (not after the whole bench)."""
    if args.baseline != "none" and importlib.util.find_spec("transformers") is None:
        raise UserError(f"--baseline {args.baseline} needs Hugging Face transformers, which is not installed",
                        'install it (pip install "transformers>=4.45"), or drop --baseline')
    check_backend(args.backend)
