"""Prefix-tree packing: exact equivalence with one forward per prompt, tree layout invariants, limits."""

from __future__ import annotations

import random

import numpy as np
import pytest

from basal_local.api.systemone import validate_systemone
from basal_local.backends.host import ancestor_matrix
from basal_local.engine.packer import MAX_TREE_DEPTH, PromptSpec, pack_prompts
from basal_local.engine.pretty import format_pack
from basal_local.protocol.render import render_question

from .conftest import load_backend, readout_logits

STATES = ["Paczka dotarła uszkodzona, proszę o zwrot.", "The invoice was paid twice in March.",
          {"ticket": "Login fails", "vip": True, "amount": 12.5}, "Umowa wygasa 31 grudnia, czy mogę ją przedłużyć?"]
QUESTIONS = [
    {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "Payments", "tech": "Bugs", "x": None}},
    {"type": "noul", "instructions": "Czy pilne?"},
    {"type": "noul", "instructions": "Is it urgent?"},
    {"type": "score", "instructions": "Priority?", "criteria": ["low", "mid", "high", "critical"]},
    {"type": "choice", "option_keys": "hide", "criteria": {"0": "Refund", "1": "Repair"}},
]


@pytest.fixture(scope="module")
def engine_parts(tiny_model):
    return load_backend(tiny_model)


def random_specs(md, rng: random.Random) -> list[PromptSpec]:
    specs = []
    for _ in range(rng.randint(2, 6)):
        state = rng.choice(STATES)
        chosen = rng.sample(QUESTIONS, rng.randint(1, 3))
        request = validate_systemone({"model": md.name, "state": state,
                                      "questions": {f"q{i}": q for i, q in enumerate(chosen)}}, md.name)
        for q in request.questions:
            lang, _, prompts = render_question(request.state_text, q)
            specs.extend(PromptSpec(md.tokenizer.encode(p), lang, md.tokenizer.letter_ids[: len(q.keys)])
                         for p in prompts)
    return specs


@pytest.mark.parametrize("seed", range(4))
def test_tree_packing_equals_separate_forwards(engine_parts, seed):
    md, backend, prefixes = engine_parts
    specs = random_specs(md, random.Random(seed))
    separate = [readout_logits(backend, pack_prompts([s]))[0] for s in specs]
    for use_prefix, row_limit, forward_limit in ((True, 32768, 8192), (False, 32768, 8192), (True, 150, 300)):
        pack = pack_prompts(specs, prefixes if use_prefix else None, max_row_tokens=row_limit,
                            max_forward_tokens=forward_limit)
        worst = max(float(np.abs(a - b).max()) for a, b in zip(readout_logits(backend, pack), separate))
        assert worst <= 1e-5, (use_prefix, forward_limit, worst)
        if forward_limit == 300:  # small limits: several rows and forwards, a bigger row runs alone
            assert len(pack.rows) > 2 and len(pack.batches) > 1
            assert all(b.num_tokens <= 300 or (b.block_parent == -1).sum() <= 2 for b in pack.batches)


def reconstruct(batch, readout: int) -> tuple[list[int], list[int]]:
    """The prompt (after its cached prefix) that ends at a readout: tokens and positions of its ancestor chain."""
    token = int(batch.readout_index[readout])
    block = int(batch.token_block[token])
    anc = ancestor_matrix(batch.block_parent)[block]
    keep = anc[batch.token_block] & (np.arange(batch.num_tokens) <= token)
    return batch.token_ids[keep].tolist(), batch.positions[keep].tolist()


def test_layout_positions_readouts_and_dedupe(engine_parts):
    md, _, prefixes = engine_parts
    specs = random_specs(md, random.Random(11))
    specs.append(specs[0])  # an identical prompt shares a readout
    pack = pack_prompts(specs, prefixes)
    assert pack.readouts[-1][:2] == pack.readouts[0][:2]
    for spec, (b, r, cols) in zip(specs, pack.readouts):
        batch = pack.batches[b]
        ids, pos = reconstruct(batch, r)
        offset = len(prefixes[spec.lang])
        assert ids == list(spec.token_ids)[offset:]
        assert pos == list(range(offset, len(spec.token_ids)))  # position = index in its own prompt
        assert batch.letter_ids[cols].tolist() == list(spec.letter_ids)
        # parents come before children
        assert all(p < i for i, p in enumerate(batch.block_parent.tolist()))
    text = format_pack(pack, md.tokenizer)
    assert f"{pack.packed_tokens} packed tokens vs {pack.unpacked_tokens} unpacked" in text


def test_depth_limit_and_equivalence_on_a_deep_tree(engine_parts):
    _, backend, _ = engine_parts
    rng = np.random.default_rng(3)
    base = rng.integers(5, 2000, 12).tolist()
    # each prompt diverges one token later than the previous: a chain of nested splits
    specs = []
    for depth in range(14):
        tail = rng.integers(5, 2000, 3).tolist()
        specs.append(PromptSpec(base[: depth % 12] + [7 + depth] + tail, "en", [39, 40]))
    specs += [PromptSpec(list(s.token_ids), "en", [39, 40]) for s in specs[:3]]
    pack = pack_prompts(specs)
    for batch in pack.batches:
        depth = ancestor_matrix(batch.block_parent).sum(axis=1)
        assert depth.max() <= MAX_TREE_DEPTH
    separate = [readout_logits(backend, pack_prompts([s]))[0] for s in specs]
    assert max(float(np.abs(a - b).max()) for a, b in zip(readout_logits(backend, pack), separate)) <= 1e-5


def test_languages_get_separate_rows(engine_parts):
    md, _, prefixes = engine_parts
    specs = random_specs(md, random.Random(5))
    pack = pack_prompts(specs, prefixes)
    langs = {row.lang for row in pack.rows}
    assert len(pack.rows) == len(langs) and langs == {s.lang for s in specs}


def test_padding_for_cuda_graphs_changes_nothing(engine_parts):
    """The inputs laid out in a larger graph's buffer (padding tokens nothing sees, larger tile tables) give the
    same logits as the forward of the batch's own size."""
    import torch

    md, backend, prefixes = engine_parts
    fwd = backend.fwd
    specs = random_specs(md, random.Random(21))
    for use_prefix in (True, False):
        batch = pack_prompts(specs, prefixes if use_prefix else None).batches[0]
        *_, plain = backend.forward_steps(batch)
        size = batch.num_tokens + 37
        buf, layout = fwd.host_inputs(batch, size, size, 64)
        with torch.inference_mode():
            v = fwd.views(torch.from_numpy(buf), layout)
            *_, h = fwd.layers(v)
            padded = fwd.letter_logits(h, v["letters"]).numpy()[:len(batch.readout_index), :len(batch.letter_ids)]
        assert np.abs(plain - padded).max() <= 1e-6
