"""GPU checks of the torch backend; they skip themselves without CUDA (run them on the device machine)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from basal_local.engine.packer import pack_prompts
from basal_local.model import load_model_dir

from .conftest import load_backend as loaded
from .conftest import readout_logits
from .test_packer import random_specs
from .test_parity import hf_last_logits, sample_prompt_specs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_f32_matches_transformers(small_model):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(small_model, dtype=torch.float32).eval()
    md, backend, prefixes = loaded(small_model, "cuda", "f32")
    specs = sample_prompt_specs(small_model, 8)
    ours = readout_logits(backend, pack_prompts(specs, prefixes))
    worst = max(float(np.abs(o - hf_last_logits(hf, list(s.token_ids), list(s.letter_ids))).max())
                for o, s in zip(ours, specs))
    print(f"cuda f32 vs transformers f32 (cpu): max |dlogit| = {worst:.3g}")
    assert worst <= 1e-3


def test_cuda_f16_default_close_to_f32_reference(small_model):
    from basal_local.protocol.decision import calibrate, softmax

    specs = sample_prompt_specs(small_model, 48)
    _, ref_backend, prefixes = loaded(small_model, "cpu", "f32")
    md, backend, _ = loaded(small_model, "cuda", "auto")
    ref = readout_logits(ref_backend, pack_prompts(specs, prefixes))
    got = readout_logits(backend, pack_prompts(specs, prefixes))
    dlogit = max(float(np.abs(a - b).max()) for a, b in zip(ref, got))
    dp = max(max(abs(x - y) for x, y in zip(calibrate(softmax(a.tolist()), 1.3), calibrate(softmax(b.tolist()), 1.3)))
             for a, b in zip(ref, got))
    print(f"cuda f16 vs cpu f32: max |dlogit| = {dlogit:.3g}, max |dp_cal| per order = {dp:.3g}")
    assert dp <= 1e-3


def test_cuda_f32_batch_independence(small_model):
    """A prompt alone vs among random siblings on the GPU, f32 path (the bitwise f16 contract is not met yet)."""
    md, backend, prefixes = loaded(small_model, "cuda", "f32")
    rng = random.Random(0)
    target = random_specs(md, rng)[:1]
    alone = readout_logits(backend, pack_prompts(target, prefixes))[0]
    worst = 0.0
    for _ in range(5):
        mixed = readout_logits(backend, pack_prompts(random_specs(md, rng) + target, prefixes))[-1]
        worst = max(worst, float(np.abs(mixed - alone).max()))
    print(f"batch independence on cuda (f32): max |dlogit| alone vs with siblings = {worst:.3g}")
    assert worst <= 1e-5


def test_cuda_flex_kernel_matches_sdpa_twin(small_model):
    results = {}
    for impl in ("sdpa", "flex"):
        md, backend, prefixes = loaded(small_model, "cuda", "f32", attention=impl)
        specs = [s for seed in range(3) for s in random_specs(md, random.Random(seed))]
        results[impl] = readout_logits(backend, pack_prompts(specs, prefixes))
    diffs = np.concatenate([np.abs(a - b).ravel() for a, b in zip(results["sdpa"], results["flex"])])
    print(f"cuda flex kernel vs sdpa twin (f32): max {diffs.max():.3g}, mean {diffs.mean():.3g}")
    assert diffs.max() <= 1e-4
    from basal_local.backends.torch.tree_attention import flex_fallbacks

    assert flex_fallbacks() == 0, "the compiled kernel fell back to the twin: the comparison compared the twin"


def test_cuda_graphs_match_eager(small_model):
    md = load_model_dir(small_model)
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    specs = [s for seed in range(3) for s in random_specs(md, random.Random(seed))]
    for dtype, bound in (("f32", 1e-4), ("f16", 5e-2)):
        results = {}
        for graphs in (False, True):
            _, backend, _ = loaded(small_model, "cuda", dtype, cuda_graphs=graphs)
            # single prompts (several buckets) and one packed batch
            results[graphs] = [readout_logits(backend, pack_prompts([s], prefixes))[0] for s in specs[:6]]
            results[graphs] += readout_logits(backend, pack_prompts(specs, prefixes))
            if graphs:
                assert backend._graphs, "no CUDA graph was captured"
        worst = max(float(np.abs(a - b).max()) for a, b in zip(results[False], results[True]))
        print(f"cuda graphs vs eager ({dtype}): max |dlogit| = {worst:.3g}")
        assert worst <= bound
