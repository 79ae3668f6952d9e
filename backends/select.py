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


def make_backend(backend: str = "auto", device: str = "auto", attention: str = "auto") -> Backend:
    if backend == "mlx" or (backend == "auto" and device in ("auto", "mps") and mlx_available()):
        raise ValueError("the MLX backend is not implemented yet in this version of basal-local; "
                         "use --backend torch")
    if backend not in ("auto", "torch"):
        raise ValueError(f"unknown backend {backend!r} (choose auto, torch or mlx)")
    from .torch import TorchBackend

    return TorchBackend(device, attention)
