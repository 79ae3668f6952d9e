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


def test_split_work_covers_every_key_of_every_tile_once_in_chunks():
    """plan.split_work: a tile whose keys fit one KEY_CHUNK is one entry (chunk -1); a longer one is an entry
    per chunk, whose key ranges [c * K, min((c + 1) * K, n_keys)) cover its keys exactly once; each split tile
    has one merge and scratch units of its own (n_q per chunk); the longest entries come first."""
    rng = np.random.default_rng(5)
    k = 256
    tiles = np.zeros((40, tplan.RECORD), np.int32)
    tiles[:, 1] = rng.integers(1, 9, 40)  # queries
    tiles[:, 2] = rng.integers(1, 6 * k, 40)  # keys
    tiles[:3, 2] = (k, k + 1, 2 * k)  # the boundaries
    work, merge, units = tplan.split_work(tiles, k)
    chunks = -(-tiles[:, 2].astype(np.int64) // k)
    assert units == int(sum(tiles[t, 1] * chunks[t] for t in range(40) if chunks[t] > 1))
    covered = {t: np.zeros(tiles[t, 2], int) for t in range(40)}
    lengths = []
    for tile, chunk, n_ch, _ in work.tolist():
        n_keys = int(tiles[tile, 2])
        if chunk < 0:
            assert n_keys <= k and n_ch == 1
            lo, hi = 0, n_keys
        else:
            assert n_keys > k and n_ch == chunks[tile] and 0 <= chunk < n_ch
            lo, hi = chunk * k, min((chunk + 1) * k, n_keys)
        covered[tile][lo:hi] += 1
        lengths.append(hi - lo)
    assert all((c == 1).all() for c in covered.values())
    assert lengths == sorted(lengths, reverse=True)
    assert sorted(merge[:, 0].tolist()) == [t for t in range(40) if chunks[t] > 1]
    spans = sorted((int(b), int(b + tiles[t, 1] * c)) for t, c, b, _ in merge.tolist())
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and spans[0][0] == 0 and spans[-1][1] == units
    assert {tuple(r) for r in work[work[:, 1] >= 0][:, [0, 3]].tolist()} == {(t, b) for t, _, b, _ in merge.tolist()}


def test_chunked_softmax_with_ordered_merge_is_the_softmax():
    """The arithmetic of kernels.py's split tiles, in NumPy f64: an online softmax per KEY_CHUNK of keys, merged
    in chunk order (a chunk of no visible key adds exactly zero), equals the dense softmax; a query before the
    first chunk's end gets exactly the single online softmax's result."""
    rng = np.random.default_rng(2)
    n, d, k, tile = 700, 8, 256, 64
    q, keys, vals = rng.normal(size=(5, d)), rng.normal(size=(n, d)), rng.normal(size=(n, d))
    q_pos = np.array([10, 255, 256, 600, 699])

    def online(qi, lo, hi, pos):
        m, s, acc = -np.inf, 0.0, np.zeros(d)
        for start in range(lo, hi, tile):
            idx = np.arange(start, min(start + tile, hi))
            sc = np.where(idx <= pos, keys[idx] @ qi, -np.inf)
            m_new = max(m, sc.max())
            m_exp = 0.0 if m_new == -np.inf else m_new
            alpha, pr = np.exp(m - m_exp), np.exp(sc - m_exp)
            s, acc, m = s * alpha + pr.sum(), acc * alpha + pr @ vals[idx], m_new
        return m, s, acc

    for qi, pos in zip(q, q_pos):
        parts = [online(qi, c * k, min((c + 1) * k, n), pos) for c in range(-(-n // k))]
        m, s, acc = parts[0]
        for m_c, s_c, acc_c in parts[1:]:
            m_new = max(m, m_c)
            a, b = np.exp(m - m_new), np.exp(m_c - m_new)
            acc, s, m = acc * a + acc_c * b, s * a + s_c * b, m_new
        w = np.exp(keys[:pos + 1] @ qi - (keys[:pos + 1] @ qi).max())
        assert np.allclose(acc / s, (w / w.sum()) @ vals[:pos + 1], atol=1e-12)
        if pos < k:
            m1, s1, acc1 = online(qi, 0, n, pos)
            assert np.array_equal(acc / s, acc1 / s1)
