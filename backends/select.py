"""Resolve `--backend auto|torch|mlx` and `--device` once at start (DESIGN.md "The Backend protocol")."""

from __future__ import annotations

import platform
import sys

from .base import Backend


def mlx_available() -> bool:
    if sys.platform != "darwin" or platform.machine() != "arm64":
        return False
    try:
        import mlx.core as mx

        return bool(mx.metal.is_available())
    except Exception:
        return False


def expand_devices(spec: str | None, device: str = "auto") -> list[str]:
    """`--devices`: a comma list ("cuda:0,cuda:1") or "all" (every CUDA GPU); None means the one `--device`."""
    if not spec:
        return [device]
    if spec.strip() == "all":
        import torch

        count = torch.cuda.device_count()
        if not count:
            raise ValueError("--devices all: no CUDA GPU found (use --device cpu with --replicas N instead)")
        return [f"cuda:{i}" for i in range(count)]
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    if not devices:
        raise ValueError(f"--devices {spec!r}: give a comma-separated list such as cuda:0,cuda:1, or all")
    return devices


def make_backend(backend: str = "auto", device: str = "auto", attention: str = "auto") -> Backend:
    if backend == "mlx" or (backend == "auto" and device in ("auto", "mps") and mlx_available()):
        raise ValueError("the MLX backend is not implemented yet in this version of basal-local; "
                         "use --backend torch")
    if backend not in ("auto", "torch"):
        raise ValueError(f"unknown backend {backend!r} (choose auto, torch or mlx)")
    from .torch import TorchBackend

    return TorchBackend(device, attention)
