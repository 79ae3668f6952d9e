"""The tree-attention kernel (FlexAttention) against its plain twin (dense-mask SDPA), STYLE.md habit 5.

On the CPU the kernel runs FlexAttention's eager reference path; `tests/test_cuda.py` compares the compiled
CUDA kernel with the twin.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from basal_local.backends.torch import TorchBackend
from basal_local.backends.torch.tree_attention import flex_available
from basal_local.engine.packer import pack_prompts
from basal_local.model import load_model_dir

from .test_packer import random_specs

pytestmark = pytest.mark.skipif(not flex_available(), reason="torch without FlexAttention")


def test_flex_kernel_matches_sdpa_twin(tiny_model):
    md = load_model_dir(tiny_model)
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    backends = {}
    for impl in ("sdpa", "flex"):
        backend = TorchBackend("cpu", attention=impl)
        backend.load(tiny_model, "f32")
        for lang, ids in prefixes.items():
            backend.add_prefix(lang, ids)
        backends[impl] = backend
    for seed in range(3):
        specs = random_specs(md, random.Random(seed))
        pack = pack_prompts(specs, prefixes)
        twin = [backends["sdpa"].forward(b) for b in pack.batches]
        kernel = [backends["flex"].forward(b) for b in pack.batches]
        diffs = np.concatenate([np.abs(a - b).ravel() for a, b in zip(twin, kernel)])
        print(f"flex vs sdpa twin: max {diffs.max():.3g}, mean {diffs.mean():.3g}")
        assert diffs.max() <= 1e-5
