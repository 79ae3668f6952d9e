"""`basal-local bench`: what it needs checked before it runs (device, memory, extras, the daemon of --http), then
basal_local/bench.py measures; and the torch backend's options of its parser."""

from __future__ import annotations

import argparse

from . import UserError


def bench_command(args: argparse.Namespace) -> int:
    from ..bench import run_bench
    from . import check_url, get_json
    from .serving import check_device, check_gpu_memory

    if args.http:
        from .serving import client_key

        args.http = check_url(args.http, "--http")
        args.api_key = client_key(args)
        get_json(args.http, "/v1/models", flag="--http", api_key=args.api_key)
    else:
        check_device(args.device)
        check_gpu_memory(args.gpu_memory, args.device)
        check_bench_extras(args)
        if args.model:
            from . import model_path

            args.model = str(model_path(args.model))
    return run_bench(args)


def check_bench_extras(args: argparse.Namespace) -> None:
    """What the bench needs beyond our own code, checked before it runs (not after the whole bench)."""
    import importlib.util

    if args.baseline != "none" and importlib.util.find_spec("transformers") is None:
        raise UserError(f"--baseline {args.baseline} needs Hugging Face transformers, which is not installed",
                        'install it (pip install "transformers>=4.45"), or drop --baseline')
    if args.backend == "mlx":
        from ..backends.select import mlx_importable

        if not mlx_importable():
            raise UserError("--backend mlx, but MLX is not installed (it runs on Apple Silicon)",
                            "use --backend torch (or auto), or on a Mac: pip install mlx")


def add_torch_options(p) -> None:
    """The torch backend's product options (backends/torch/options.py), for serve and bench."""
    from ..backends.torch.options import FP8_GEMMS, GEMM_ROUTES

    g = p.add_argument_group("torch backend (CUDA)")
    g.add_argument("--gemm", choices=GEMM_ROUTES, default=None,
                   help="GEMM route: cuBLAS at row counts verified to give the same bits (verified, default), fixed "
                        "row chunks, plain cuBLAS (not batch-invariant), or the Triton GEMM")
    g.add_argument("--no-cublaslt", action="store_true", dest="no_cublaslt",
                   help="no pinned cuBLASLt algorithms (default: pinned where they agree and are faster)")
    g.add_argument("--fp8-gemms", dest="fp8_gemms", metavar="LIST",
                   help=f"with --dtype fp8: the projections quantized, a comma list of {','.join(FP8_GEMMS)} "
                        "(default: all)")
    g.add_argument("--no-alt-tiling", action="store_true", dest="no_alt_tiling",
                   help="no 128-query attention tiling for small and long forwards (default: where it gives the "
                        "same bits)")
    g.add_argument("--no-cuda-graphs", action="store_true", dest="no_cuda_graphs",
                   help="run every forward eagerly (default: CUDA graphs per size)")
