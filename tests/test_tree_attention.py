"""Tree attention through the whole forward: a prompt packed with others (sharing template and state blocks)
gets the logits it gets alone (the CPU twins: within 1e-5; bitwise is the CUDA contract, tests/test_cuda.py),
and the tile plan's visibility equals the dense rule of tests/dense_reference.py for every packed batch."""

from __future__ import annotations

import random

import numpy as np

from basal_local.cuda_kernels import plan as tplan
from basal_local.engine.packer import pack_prompts

from . import dense_reference
from .conftest import load_backend, readout_logits
from .test_packer import random_specs


def test_packed_equals_one_prompt_at_a_time(tiny_model):
    md, backend, prefixes = load_backend(tiny_model)
    specs = [s for seed in range(3) for s in random_specs(md, random.Random(seed))]
    packed = readout_logits(backend, pack_prompts(specs, prefixes))
    for spec, got in zip(specs[::4], packed[::4]):
        alone = readout_logits(backend, pack_prompts([spec], prefixes))[0]
        assert float(np.abs(alone - got).max()) <= 1e-5


def test_tile_plan_visibility_is_the_dense_rule(tiny_model):
    """Every query's keys in the plan (prefix rows, then forward tokens of its ranges, up to its position) are
    exactly the keys the dense mask lets it see."""
    md, backend, prefixes = load_backend(tiny_model)
    specs = [s for seed in range(4) for s in random_specs(md, random.Random(seed))]
    batch = pack_prompts(specs, prefixes).batches[0]
    lengths = [len(prefixes[name]) for name in batch.prefixes]
    rows = [(sum(lengths[:j]), n) for j, n in enumerate(lengths)]
    mask = dense_reference.dense_mask(batch, lengths).numpy()
    p = sum(lengths)
    plan = tplan.tile_plan(batch.positions, batch.token_block, batch.block_parent, batch.block_prefix, rows, 16)
    seen = np.zeros_like(mask)
    for rec in plan.tiles:
        q_off, n_q, _, n_pre, pre_off, n_r = (int(x) for x in rec[:6])
        for t in plan.q_rows[q_off:q_off + n_q]:
            pos = batch.positions[t]
            seen[t, pre_off:pre_off + min(n_pre, pos + 1)] = True
            for r in range(n_r):
                ps, ts, ln = (int(x) for x in rec[8 + 3 * r: 11 + 3 * r])
                keys = np.arange(ts, ts + ln)[np.arange(ps, ps + ln) <= pos]
                seen[t, p + keys] = True
    assert np.array_equal(seen, mask)
