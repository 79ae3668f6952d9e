"""PyTorch backend: the CPU f32 reference and CUDA. `options` imports without torch (the CLI's --help)."""

__all__ = ["TorchBackend"]


def __getattr__(name: str):
    if name == "TorchBackend":
        from .llama import TorchBackend

        return TorchBackend
    raise AttributeError(name)
