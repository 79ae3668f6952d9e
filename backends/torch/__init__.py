"""PyTorch backend: the CPU f32 reference and CUDA."""

from .llama import TorchBackend

__all__ = ["TorchBackend"]
