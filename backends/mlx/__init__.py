"""MLX backend: Apple GPUs through Metal, and the CPU (`mlx[cpu]` on Linux)."""

from .llama import MLXBackend

__all__ = ["MLXBackend"]
