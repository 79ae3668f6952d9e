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


def test_split_tiles_are_fixed_chunks_of_each_tile_and_the_twin_reads_them_whole(tiny_model):
    """With `split`, a tile of more key positions becomes one record per chunk of `split` positions (the
    tile's queries and key ranges, keys j*split up to the next bound or the tile's end), with consecutive
    scratch slots; shorter tiles stay as they are; the twin computes the same outputs from either plan."""
    import torch

    from basal_local.cuda_kernels import twins

    md, _, prefixes = load_backend(tiny_model)
    specs = [s for seed in range(4) for s in random_specs(md, random.Random(seed))]
    batch = pack_prompts(specs, prefixes).batches[0]
    lengths = [len(prefixes[name]) for name in batch.prefixes]
    rows = [(sum(lengths[:j]), n) for j, n in enumerate(lengths)]
    args = (batch.positions, batch.token_block, batch.block_parent, batch.block_prefix, rows, 16)
    split = 32
    for readout in (None, batch.readout_index):
        whole = tplan.tile_plan(*args, rows=readout)
        chunked = tplan.tile_plan(*args, rows=readout, split=split)
        assert not whole.n_slots and not whole.tiles[:, [6, 7, 62, 63]].any()
        by_tile: dict[tuple, list] = {}
        for rec in chunked.tiles:
            by_tile.setdefault((int(rec[0]), int(rec[1])), []).append(rec)
        assert len(by_tile) == whole.num_tiles
        for rec in whole.tiles:
            parts = sorted(by_tile[(int(rec[0]), int(rec[1]))], key=lambda r: int(r[6]))
            n_keys = int(rec[2])
            if n_keys <= split:
                assert len(parts) == 1 and np.array_equal(parts[0], rec)
                continue
            chunks = -(-n_keys // split)
            assert [int(r[6]) for r in parts] == [j * split for j in range(chunks)]
            assert [int(r[2]) for r in parts] == [min(n_keys, (j + 1) * split) for j in range(chunks)]
            slots = [int(r[7]) for r in parts]
            assert slots == list(range(slots[0], slots[0] + chunks)) and slots[0] >= 1
            for r in parts:
                assert int(r[62]) == chunks and int(r[63]) == n_keys
                assert np.array_equal(np.delete(r, [2, 6, 7, 62, 63]), np.delete(rec, [2, 6, 7, 62, 63]))
        assert sorted(int(s) for s in chunked.tiles[:, 7] if s) == list(range(1, chunked.n_slots + 1))
        assert chunked.n_slots > 0
        g = torch.Generator().manual_seed(3)
        t, hq, hkv, d = batch.num_tokens, 4, 2, 8
        q = torch.randn(t, hq, d, generator=g)
        k, v = (torch.randn(t, hkv, d, generator=g) for _ in range(2))
        pk, pv = (torch.randn(sum(lengths), hkv, d, generator=g) for _ in range(2))
        pos = torch.from_numpy(batch.positions)
        n_out = t if readout is None else len(readout)
        want = twins.tree_attention(q, k, v, pk, pv, pos, whole, n_out, compact=readout is not None)
        got = twins.tree_attention(q, k, v, pk, pv, pos, chunked, n_out, compact=readout is not None)
        assert torch.equal(got, want)
