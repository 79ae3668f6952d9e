"""Batch-invariant GPU kernels (Triton) for the torch backend, each with a plain-torch twin.

`twins` and `plan` import everywhere (CPU CI runs them); `kernels` needs Triton and a CUDA device and is
imported only through `triton_kernels()`. docs/ARCHITECTURE.md and docs/PROTOCOL.md §10 give the
contract the kernels keep: a row's result never depends on what else is in the batch.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from . import fp8, gemm, plan, twins

__all__ = ["fp8", "gemm", "plan", "twins", "triton_available", "triton_kernels"]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def triton_kernels() -> ModuleType:
    """The Triton launchers (same signatures as `twins`); raises ImportError without Triton."""
    return importlib.import_module(".kernels", __name__)
