"""Resolve `--backend auto|torch|mlx` and `--device` once at start (docs/ARCHITECTURE.md "Torch backend").

auto: MLX on an Apple Silicon Mac whose MLX sees Metal, torch with CUDA when a CUDA GPU is present, torch on
the CPU otherwise (MLX on the CPU where torch is not installed). `--backend mlx` works wherever MLX imports
(`mlx[cpu]` on Linux included): `--device cpu` is the CPU, `--device mps` Metal.
"""

from __future__ import annotations

import importlib.util
import platform
import sys

from .base import Backend

MLX_MISSING = ("the MLX backend needs the mlx package: pip install mlx (Apple Silicon) "
               "or pip install 'mlx[cpu]' (Linux CPU)")
TORCH_MISSING = "the torch backend needs PyTorch: pip install torch (or use --backend mlx where MLX is installed)"


def mlx_importable() -> bool:
    try:
        import mlx.core  # noqa: F401
    except Exception:
        return False
    return True


def mlx_available() -> bool:
    """MLX with Metal on an Apple Silicon Mac: the auto choice there."""
    if sys.platform != "darwin" or platform.machine() != "arm64" or not mlx_importable():
        return False
    import mlx.core as mx

    try:
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


def resolve_backend(backend: str = "auto", device: str = "auto") -> str:
    """The backend name (`torch` or `mlx`) that `make_backend` will build."""
    if backend not in ("auto", "torch", "mlx"):
        raise ValueError(f"unknown backend {backend!r} (choose auto, torch or mlx)")
    if backend != "auto":
        return backend
    if device in ("auto", "mps") and mlx_available():
        return "mlx"
    if importlib.util.find_spec("torch") is None and mlx_importable() and device in ("auto", "cpu"):
        return "mlx"  # a Mac install without torch, or MLX on the CPU where only mlx[cpu] is present
    return "torch"


def make_backend(backend: str = "auto", device: str = "auto", attention: str = "auto",
                 memory_limit: str | float | None = None, torch_options=None) -> Backend:
    """A backend; `memory_limit` is --gpu-memory (backends/memory.py), applied when the model loads;
    `torch_options` the torch backend's declared options (backends/torch/options.py; None: the defaults)."""
    name = resolve_backend(backend, device)
    if name == "mlx":
        if not mlx_importable():
            raise ValueError(MLX_MISSING)
        from .mlx import MLXBackend

        return MLXBackend(device, attention, memory_limit=memory_limit)
    if importlib.util.find_spec("torch") is None:
        raise ValueError(TORCH_MISSING)
    from .torch import TorchBackend

    return TorchBackend(device, attention, memory_limit=memory_limit, options=torch_options)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check_dtype(backend: str, device: str, dtype: str) -> None:
    """Refuse a dtype the resolved backend cannot run, before anything loads."""
    if dtype in ("q8", "q4") and resolve_backend(backend, device) != "mlx":
        raise ValueError(f"--dtype {dtype} needs the MLX backend (--backend mlx); the torch backend runs "
                         "f32, f16, bf16 or fp8")
    if dtype == "fp8" and (resolve_backend(backend, device) != "torch" or device in ("cpu", "mps")
                           or (device == "auto" and not _cuda_available())):
        raise ValueError("--dtype fp8 runs on NVIDIA GPUs only (the torch backend on CUDA); use f16 or bf16 "
                         "elsewhere")
