"""A Basal model directory: load checks (docs/PROTOCOL.md §4.7), config, tokenizer, calibration, weights."""

from .directory import ModelDir, ModelLoadError, load_model_dir

__all__ = ["ModelDir", "ModelLoadError", "load_model_dir"]
