"""The tree-attention kernel (FlexAttention) against its plain twin (dense-mask SDPA).

On the CPU the kernel runs FlexAttention's eager reference path; `tests/test_cuda.py` compares the compiled
CUDA kernel with the twin.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from basal_local.backends.torch.tree_attention import flex_available, flex_fallbacks
from basal_local.engine.packer import pack_prompts
from basal_local.model import load_model_dir

from .conftest import load_backend
from .test_packer import random_specs

pytestmark = pytest.mark.skipif(not flex_available(), reason="torch without FlexAttention")


def test_flex_kernel_matches_sdpa_twin(tiny_model):
    backends = {}
    for impl in ("sdpa", "flex"):
        md, backends[impl], prefixes = load_backend(tiny_model, attention=impl)
    for seed in range(3):
        specs = random_specs(md, random.Random(seed))
        pack = pack_prompts(specs, prefixes)
        twin = [backends["sdpa"].forward(b) for b in pack.batches]
        kernel = [backends["flex"].forward(b) for b in pack.batches]
        diffs = np.concatenate([np.abs(a - b).ravel() for a, b in zip(twin, kernel)])
        print(f"flex vs sdpa twin: max {diffs.max():.3g}, mean {diffs.mean():.3g}")
        assert diffs.max() <= 1e-5
    assert flex_fallbacks() == 0, "the kernel fell back to the twin: the comparison compared the twin with itself"


def test_subtree_split_equals_dense_twin(tiny_model):
    """Independent subtrees attending alone give the dense result, on random q/k/v of a real packed batch."""
    import torch

    from basal_local.backends.torch.tree_attention import TreeAttention

    md = load_model_dir(tiny_model)
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    specs = [s for seed in range(4) for s in random_specs(md, random.Random(seed))]
    batch = pack_prompts(specs, prefixes).batches[0]
    lengths = [len(prefixes[name]) for name in batch.prefixes]
    split = TreeAttention(batch, lengths, "cpu")
    dense = TreeAttention(batch, lengths, "cpu", segment=False)
    assert split.grouped and not dense.grouped
    gen = torch.Generator().manual_seed(0)
    n, s = batch.num_tokens, sum(lengths) + batch.num_tokens
    q, k, v = (torch.randn(shape, generator=gen) for shape in ((4, n, 16), (2, s, 16), (2, s, 16)))
    diff = (split(q, k, v) - dense(q, k, v)).abs().max().item()
    assert diff <= 1e-5, diff
