"""The CUDA kernels' plain twins on the CPU (CI).

(Triton 3.6's interpreter, TRITON_INTERPRET=1, cannot run these kernels: their loop bounds are loaded from the
tile table in device memory, which the interpreter does not take; so the kernels are checked on a GPU only.)

The tree-attention twin walks the same tile table as the kernel (cuda_kernels/plan.py), so comparing it with
a dense mask built from the visibility rule (tests/dense_reference.py) checks the table: key ranges, prefix rows
and positions. The whole forward then runs on the twins against that dense reference forward. `tests/test_cuda.py` compares the
compiled kernels with these twins on a GPU.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from basal_local.api.systemone import validate_systemone
from basal_local.backends import host
from basal_local.backends.torch.options import TorchOptions
from basal_local.cuda_kernels import gemm, twins
from basal_local.cuda_kernels import plan as tplan
from basal_local.engine.packer import pack_prompts
from basal_local.model import load_model_dir

from . import dense_reference
from .conftest import load_backend, readout_logits
from .test_packer import random_specs


def _packed(md, seeds, use_prefix=True):
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    specs = [s for seed in seeds for s in random_specs(md, random.Random(seed))]
    return pack_prompts(specs, prefixes if use_prefix else None).batches[0], prefixes


def _random_qkv(batch, prefixes, hq=4, hkv=2, d=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [len(prefixes[name]) for name in batch.prefixes]
    n, p = batch.num_tokens, sum(lengths)
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    k, v = (torch.randn(n, hkv, d, generator=gen).to(dtype) for _ in range(2))
    pk, pv = (torch.randn(p, hkv, d, generator=gen).to(dtype) for _ in range(2))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    rows = [(int(offsets[j]), lengths[j]) for j in range(len(lengths))]
    return q, k, v, pk, pv, rows, lengths


def _dense(batch, q, k, v, pk, pv, lengths, rows=None):
    mask = dense_reference.dense_mask(batch, lengths)
    out = dense_reference.attention(q, torch.cat([pk, k]), torch.cat([pv, v]), mask)
    return out if rows is None else out[torch.as_tensor(rows)]


@pytest.mark.parametrize("use_prefix", [True, False])
def test_tile_table_twin_equals_dense_mask(tiny_model, use_prefix):
    md = load_model_dir(tiny_model)
    batch, prefixes = _packed(md, range(2), use_prefix)
    q, k, v, pk, pv, rows, lengths = _random_qkv(batch, prefixes)
    pos = torch.from_numpy(batch.positions)
    plan = tplan.tile_plan(batch.positions, batch.token_block, batch.block_parent, batch.block_prefix, rows, 32)
    assert plan.num_tiles > len(batch.block_parent) // 2 and sorted(plan.q_rows) == list(range(batch.num_tokens))
    got = twins.tree_attention(q, k, v, pk, pv, pos, plan, batch.num_tokens)
    want = _dense(batch, q, k, v, pk, pv, lengths)
    assert (got - want).abs().max().item() <= 1e-5
    # the readout rows alone (the last layer): compact output in readout order
    last = tplan.tile_plan(batch.positions, batch.token_block, batch.block_parent, batch.block_prefix, rows, 32,
                           rows=batch.readout_index)
    got = twins.tree_attention(q, k, v, pk, pv, pos, last, len(batch.readout_index), compact=True)
    want = _dense(batch, q, k, v, pk, pv, lengths, rows=batch.readout_index)
    assert (got - want).abs().max().item() <= 1e-5


def _tile_by_tile(q, k, v, pk, pv, positions, plan, out_rows, compact=False):
    """The tree-attention twin in its plainest form: per tile, its keys gathered, each K/V head repeated, one
    attention call. The CPU forward's bits are these (the twin only does the per-tile steps once)."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.zeros(out_rows, hq, q.shape[2], dtype=q.dtype)
    for rec in plan.tiles:
        q_off, n_q, n_keys, n_pre, pre_off, n_r = (int(x) for x in rec[:6])
        rows = torch.as_tensor(plan.q_rows[q_off:q_off + n_q], dtype=torch.long)
        ranges = [(int(rec[9 + 3 * r]), int(rec[10 + 3 * r])) for r in range(n_r)]
        kk = torch.cat([pk[pre_off:pre_off + n_pre]] + [k[t:t + n] for t, n in ranges])[:n_keys]
        vv = torch.cat([pv[pre_off:pre_off + n_pre]] + [v[t:t + n] for t, n in ranges])[:n_keys]
        kk, vv = (x.float().transpose(0, 1).repeat_interleave(hq // hkv, 0) for x in (kk, vv))
        mask = torch.arange(n_keys)[None, :] <= positions[rows].long()[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(q[rows].float().transpose(0, 1)[None], kk[None],
                                                             vv[None], attn_mask=mask)[0]
        out[torch.arange(q_off, q_off + n_q) if compact else rows] = o.transpose(0, 1).to(q.dtype)
    return out


@pytest.mark.parametrize("use_prefix", [True, False])
@pytest.mark.parametrize("block_m", [16, 64])
def test_tree_attention_twin_is_the_tile_by_tile_attention_bit_for_bit(tiny_model, use_prefix, block_m):
    md = load_model_dir(tiny_model)
    for seeds in (range(1), range(2, 5)):
        batch, prefixes = _packed(md, seeds, use_prefix)
        q, k, v, pk, pv, rows, _ = _random_qkv(batch, prefixes, seed=len(seeds))
        pos = torch.from_numpy(batch.positions)
        args = (batch.positions, batch.token_block, batch.block_parent, batch.block_prefix, rows, block_m)
        full, last = tplan.tile_plan(*args), tplan.tile_plan(*args, rows=batch.readout_index)
        # the forward builds both at once (the blocks' part of the records once): the very same tables
        both = tplan.tile_plans(*args, rows=batch.readout_index)
        assert all(np.array_equal(a.tiles, b.tiles) and np.array_equal(a.q_rows, b.q_rows)
                   for a, b in zip(both, (full, last)))
        assert torch.equal(twins.tree_attention(q, k, v, pk, pv, pos, full, batch.num_tokens),
                           _tile_by_tile(q, k, v, pk, pv, pos, full, batch.num_tokens))
        n = len(batch.readout_index)
        assert torch.equal(twins.tree_attention(q, k, v, pk, pv, pos, last, n, compact=True),
                           _tile_by_tile(q, k, v, pk, pv, pos, last, n, compact=True))
        # a CUDA graph's tables: the query rows padded with zeros past the tiles' queries
        padded = tplan.TilePlan(full.tiles, np.concatenate([full.q_rows, np.zeros(37, np.int32)]))
        assert torch.equal(twins.tree_attention(q, k, v, pk, pv, pos, padded, batch.num_tokens),
                           _tile_by_tile(q, k, v, pk, pv, pos, full, batch.num_tokens))


def test_tile_keys_are_the_prompt_positions(tiny_model):
    """Every tile visits keys 0..max position of its queries, and its ranges tile them without gaps."""
    md = load_model_dir(tiny_model)
    batch, prefixes = _packed(md, range(4))
    lengths = [len(prefixes[name]) for name in batch.prefixes]
    rows = [(sum(lengths[:j]), n) for j, n in enumerate(lengths)]
    plan = tplan.tile_plan(batch.positions, batch.token_block, batch.block_parent, batch.block_prefix, rows, 16)
    assert list(plan.tiles[:, 2]) == sorted(plan.tiles[:, 2], reverse=True)
    for rec in plan.tiles:
        q_off, n_q, n_keys, n_pre, _, n_r = rec[:6]
        queries = plan.q_rows[q_off:q_off + n_q]
        assert n_keys == batch.positions[queries].max() + 1
        covered = n_pre
        for r in range(n_r):
            ps, ts, ln = rec[8 + 3 * r: 11 + 3 * r]
            assert ps == covered and batch.positions[ts] == ps
            covered += ln
        assert covered >= n_keys


@pytest.mark.parametrize("readout", [False, True])
def test_a_tiles_open_range_is_keys_every_query_sees_in_one_run_of_rows(tiny_model, readout):
    """Words 59-61 (plan.OPEN): the key positions a_pos .. a_end - 1 are one range of the tile's chain (the
    longest), each key p is token p + a_shift of that range, and every query of the tile sees all of them (the
    kernel loads their whole key tiles without the lookup and the select)."""
    from basal_local.engine.packer import PromptSpec
    from basal_local.protocol.render import render_question

    from .test_packer import QUESTIONS
    from .test_prefix_cache import document

    md = load_model_dir(tiny_model)
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    specs = [s for seed in range(3) for s in random_specs(md, random.Random(seed))]  # short prompts
    long = validate_systemone({"model": md.name, "state": document(5, words=800),  # a ~1.3k-token document
                               "questions": {f"q{i}": q for i, q in enumerate(QUESTIONS[:2])}}, md.name)
    for q in long.questions:
        lang, _, prompts = render_question(long.state_text, q)
        specs += [PromptSpec(md.tokenizer.encode(p), lang, md.tokenizer.letter_ids[:len(q.keys)]) for p in prompts]
    batch = pack_prompts(specs, prefixes).batches[0]
    lengths = [len(prefixes[name]) for name in batch.prefixes]
    rows = [(sum(lengths[:j]), n) for j, n in enumerate(lengths)]
    plan = tplan.tile_plan(batch.positions, batch.token_block, batch.block_parent, batch.block_prefix, rows, 16,
                           rows=batch.readout_index if readout else None)
    pos, blocks = batch.positions, batch.token_block
    seen, short = 0, 0
    for rec in plan.tiles:
        q_off, n_q, n_keys, n_pre, _, n_r = rec[:6]
        a_pos, a_end, a_shift = rec[tplan.OPEN:tplan.OPEN + 3]
        queries = plan.q_rows[q_off:q_off + n_q]
        ranges = [tuple(rec[8 + 3 * r: 11 + 3 * r]) for r in range(n_r)]
        longest = max(ranges, key=lambda r: r[2])
        visible_end = min(longest[0] + longest[2], pos[queries].min() + 1)
        if visible_end - longest[0] < tplan.OPEN_MIN_KEYS:  # too short to pay for its loop: none
            assert a_pos == a_end == tplan.NO_OPEN
            short += 1
            continue
        assert (a_pos, a_end, a_shift) == (longest[0], visible_end, longest[1] - longest[0])
        assert a_pos >= n_pre
        tokens = np.arange(a_pos, a_end) + a_shift
        assert (pos[tokens] == np.arange(a_pos, a_end)).all()
        assert len(set(blocks[tokens])) == 1  # one block's run of rows
        seen += a_end - a_pos
    assert seen > 0 and short > 0


def test_rope_twin_stores_the_rotated_k_and_the_v_of_filled_tokens():
    """The state cache's fill (backends/torch/forward.py `fill_plan`): RoPE writes a token's K after rotation
    and its V to its pool row; other rows and the rotation itself stay as without a fill."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(11, 8 * 4, generator=g)  # 4 q heads, 2 K/V heads of 4
    pos = torch.arange(11, dtype=torch.int32)
    ang = torch.arange(16, dtype=torch.float64)[:, None] * (1e4 ** (-torch.arange(2, dtype=torch.float64) / 2))[None]
    cos, sin = ang.cos().float(), ang.sin().float()
    plain = twins.rope_(qkv.clone(), pos, cos, sin, 4, 2, 4)
    fill = torch.zeros(11, dtype=torch.int32)
    fill[[2, 3, 9]] = torch.tensor([3, 1, 5], dtype=torch.int32)
    pk, pv = torch.zeros(6, 2, 4), torch.zeros(6, 2, 4)
    out = twins.rope_(qkv.clone(), pos, cos, sin, 4, 2, 4, fill, pk, pv)
    assert torch.equal(out, plain)
    heads = plain.view(11, 8, 4)
    assert torch.equal(pk[[2, 0, 4]], heads[[2, 3, 9], 4:6]) and torch.equal(pv[[2, 0, 4]], heads[[2, 3, 9], 6:8])
    assert not pk[[1, 3, 5]].any() and not pv[[1, 3, 5]].any()
    # an independent rotation of token 9's first K head (rotate-half, f32)
    x = qkv.view(11, 8, 4)[9, 4]
    c, s_ = cos[9], sin[9]
    want = torch.cat([x[:2] * c - x[2:] * s_, x[2:] * c + x[:2] * s_])
    assert torch.allclose(pk[4, 0], want, atol=1e-6)


def test_fused_twins_match_plain_torch():
    gen = torch.Generator().manual_seed(1)
    x, delta, w = (torch.randn(5, 32, generator=gen) for _ in range(3))
    h, s = twins.add_rms_norm(x, delta, w[0], 1e-6)
    ref = (x + delta) * torch.rsqrt((x + delta).pow(2).mean(-1, keepdim=True) + 1e-6) * w[0]
    assert torch.allclose(s, x + delta) and torch.allclose(h, ref, atol=1e-6)
    gu = torch.randn(4, 20, generator=gen)
    assert torch.allclose(twins.silu_mul(gu), torch.nn.functional.silu(gu[:, :10]) * gu[:, 10:])
    # RoPE on the q and k heads only, v untouched; position 0 is the identity
    qkv = torch.randn(3, (4 + 2 + 2) * 8, generator=gen)
    pos = torch.tensor([0, 1, 7])
    inv = 10000.0 ** (-torch.arange(4, dtype=torch.float64) * 2 / 8)
    ang = torch.arange(16, dtype=torch.float64)[:, None] * inv[None]
    out = twins.rope_(qkv.clone(), pos, ang.cos().float(), ang.sin().float(), 4, 2, 8)
    assert torch.equal(out[0], qkv[0]) and torch.equal(out[:, 48:], qkv[:, 48:])
    heads = qkv.view(3, 8, 8)[1, :6]
    c, s_ = ang[1].cos().float(), ang[1].sin().float()
    want = torch.cat([heads[:, :4] * c - heads[:, 4:] * s_, heads[:, 4:] * c + heads[:, :4] * s_], -1)
    assert torch.allclose(out.view(3, 8, 8)[1, :6], want, atol=1e-6)


def reference_logits(backend, pack) -> list:
    outputs = [dense_reference.forward(backend, b) for b in pack.batches]
    return [outputs[b][r, cols] for b, r, cols in pack.readouts]


def test_fast_forward_on_twins_equals_reference(tiny_model):
    """The one forward (the fused GPU forward, here on its twins) gives the dense reference's logits."""
    md, fast, prefixes = load_backend(tiny_model)
    assert fast.fwd is not None and not fast.fwd.use_triton and fast.graphs is None
    for seed in range(2):
        pack = pack_prompts(random_specs(md, random.Random(seed)), prefixes)
        worst = max(float(np.abs(a - b).max()) for a, b in zip(reference_logits(fast, pack),
                                                                readout_logits(fast, pack)))
        assert worst <= 1e-5, worst
    # the long-lane path (one yield per layer) gives the same logits
    batch = pack_prompts(random_specs(md, random.Random(5))[:2], prefixes).batches[0]
    steps = list(fast.forward_steps(batch))
    assert len(steps) == md.config.num_hidden_layers and np.array_equal(steps[-1], fast.forward(batch))


def test_padded_gemm_inputs_are_written_in_place(tiny_model, monkeypatch):
    """Where a GEMM's verified row counts start above a forward's rows (the max preset's down projection: 384
    for a 320-token graph; o at the last layer's readout rows), the kernel before it writes a block that tall,
    so the GEMM reads it without a padding copy, and the logits are the reference's."""
    md, backend, prefixes = load_backend(tiny_model)
    fast = backend.fwd
    fast.gemm = "verified"
    fast.linear = fast._verified()  # the f16/bf16 default route (f32 keeps plain cuBLAS)
    layer = backend.layers[0]
    down = fast._gemm_key(layer.down_proj_weight, layer.down_proj_bias)
    assert down in fast._gemms
    # as a library that agrees from 256 rows on, and where (timed) 320 rows run much faster than 288 or 304
    allowed = [s for s in fast._gemms[down].sizes.sizes if s >= 256]
    assert {256, 288, 304, 320, 8192} <= set(allowed)
    fast._gemms[down].sizes = gemm.CallSizes(allowed, {256: 3.0, 288: 5.0, 304: 5.0, 320: 3.0, 336: 6.0})
    assert fast.padded_rows(200, layer.down_proj_weight, layer.down_proj_bias) == 256
    assert fast.padded_rows(280, layer.down_proj_weight, layer.down_proj_bias) == 320
    assert fast.padded_rows(330, layer.down_proj_weight, layer.down_proj_bias) == 336
    assert fast.padded_rows(9000, layer.down_proj_weight, layer.down_proj_bias) == 9000  # several calls
    calls = []
    real = gemm.sized_linear

    def spy(x, w, b, sizes, linear=torch.nn.functional.linear):
        calls.append((x.shape[0], any(w is L.down_proj_weight for L in backend.layers)))
        return real(x, w, b, sizes, linear)
    monkeypatch.setattr(gemm, "sized_linear", spy)
    pack = pack_prompts(random_specs(md, random.Random(4)), prefixes)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(reference_logits(backend, pack),
                                                            readout_logits(backend, pack)))
    assert worst <= 1e-5, worst
    down_rows = [rows for rows, is_down in calls if is_down]
    assert down_rows and all(rows in fast._gemms[down].sizes.sizes for rows in down_rows), down_rows


def test_mlp_temporaries_are_freed_as_soon_as_used(tiny_model, monkeypatch):
    """The gate/up output is freed before the down projection runs and SwiGLU's output before the next layer's
    q/k/v projection: a long document's forward holds one of them at a time (kept alive to the next layer,
    they raised a 17k-token forward's peak by 1.1 GB on the 4.5B preset)."""
    import weakref

    md, backend, prefixes = load_backend(tiny_model)
    fast = backend.fwd
    fast.gemm = "verified"
    fast.linear = fast._verified()
    downs = {id(L.down_proj_weight) for L in backend.layers}
    qkvs = {id(L.qkv_weight) for L in backend.layers}
    gate_ups, acts, checked = [], [], []
    real_silu, real_linear = twins.silu_mul, gemm.sized_linear

    def silu(gate_up, out_rows=None):
        gate_ups.append(weakref.ref(gate_up._base if gate_up._base is not None else gate_up))
        out = real_silu(gate_up, out_rows)
        acts.append(weakref.ref(out))
        return out

    def spy(x, w, b, sizes, linear=torch.nn.functional.linear):
        if id(w) in downs:
            checked.append(all(r() is None for r in gate_ups))
        if id(w) in qkvs:
            checked.append(all(r() is None for r in acts))
        return real_linear(x, w, b, sizes, linear)
    monkeypatch.setattr(twins, "silu_mul", silu)
    monkeypatch.setattr(gemm, "sized_linear", spy)
    batch = pack_prompts(random_specs(md, random.Random(6))[:3], prefixes).batches[0]
    list(backend.forward_steps(batch))
    assert len(checked) == 2 * md.config.num_hidden_layers and all(checked), checked


def test_fast_forward_alternative_attention_tiling(tiny_model):
    """Where a device gives the same bits with the alternative attention tiling (checked at load on a GPU), small
    graphs and long eager forwards plan 128-query tiles and the rest 64; a forward planned either way gives the
    same logits (the twins walk whatever table the host built)."""
    from basal_local.backends.torch.forward import ALT_MAX_TOKENS, ALT_TILING, TOKEN_BUCKETS
    from basal_local.backends.torch.graphs import dummy

    md, backend, prefixes = load_backend(tiny_model)
    fast = backend.fwd
    assert fast.alt_tiling is None  # no Triton here: the twins run, nothing to check
    pack = pack_prompts(random_specs(md, random.Random(2)), prefixes)
    before = readout_logits(backend, pack)
    fast.alt_tiling = ALT_TILING
    assert fast.block_m(ALT_MAX_TOKENS) == 128 and fast.block_m(TOKEN_BUCKETS[-1] + 1) == 128
    assert fast.block_m(ALT_MAX_TOKENS + 1) == fast.block_m(TOKEN_BUCKETS[-1]) == 64
    assert pack.batches[0].num_tokens <= ALT_MAX_TOKENS

    def tile_sizes(n: int) -> list[int]:  # queries per tile of a one-block forward of n tokens, as uploaded
        buf, layout = fast.host_inputs(dummy(n, 4), n, n, 4)
        o, size = layout["tiles"]
        return sorted(buf[o:o + size].reshape(-1, 64)[:buf[layout["nt"][0]], 1].tolist())
    assert tile_sizes(300) == [44, 128, 128] and tile_sizes(1100) == [12] + [64] * 17
    after = readout_logits(backend, pack)
    assert max(float(np.abs(a - b).max()) for a, b in zip(before, after)) <= 1e-6
    # forwards past the largest graph: the alternative tiling too
    long = TOKEN_BUCKETS[-1] + 100
    assert tile_sizes(long) == [long % 128] + [128] * (long // 128)
    assert fast.tiling_for(long) == fast.tiling_for(ALT_MAX_TOKENS) == ALT_TILING
    assert fast.tiling_for(TOKEN_BUCKETS[-1]) == fast.tiling


def test_alternative_tiling_is_dropped_where_it_differs_or_fails():
    """The load-time choice: the alternative tiling only where it gives the same bits; a device that cannot run
    it (a compile or launch error) loads without it, and says so in the plan `bench` prints."""
    from basal_local.backends.torch.forward import ALT_TILING, Forward

    class Probe(Forward):
        def __init__(self, outcome):  # only what _pick_alt_tiling needs
            self.report, self.outcome = {}, outcome

        def _alt_tiling_agrees(self, tiling):
            if isinstance(self.outcome, Exception):
                raise self.outcome
            return self.outcome

    for outcome, tiling, said in ((True, ALT_TILING, "same bits"), (False, None, "bits differ"),
                                  (RuntimeError("out of resource: shared memory"), None, "RuntimeError")):
        probe = Probe(outcome)
        assert probe._pick_alt_tiling() == tiling
        assert said in probe.report["attention_alt_tiling"]


def test_chunked_route_calls_the_library_with_whole_chunks_only(tiny_model):
    """--gemm chunked: every library call has exactly `gemm_chunk` rows whatever M is (the last piece padded), so
    a row's bits are the same alone, at any offset, or amid many rows (rows of a GEMM do not interact); the
    forward on it gives the f32 reference's logits within f16 rounding."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 16, generator=gen)
    w, b = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    rows = []

    def library(x, w, b):
        rows.append(x.shape[0])
        return torch.nn.functional.linear(x, w, b)
    chunk = gemm.CallSizes([8])
    full = gemm.sized_linear(x, w, b, chunk, library)
    assert rows == [8] * 5 and full.shape == (37, 24)
    assert torch.allclose(full, torch.nn.functional.linear(x, w, b), atol=1e-5)
    for start, n in ((0, 1), (5, 4), (30, 7), (3, 33)):
        assert torch.equal(gemm.sized_linear(x[start:start + n], w, b, chunk, library), full[start:start + n])
    strided = x.t().contiguous().t()  # a non-contiguous view gives the same bits
    assert torch.equal(gemm.sized_linear(strided, w, None, chunk), gemm.sized_linear(x, w, None, chunk))
    assert gemm.sized_linear(x[:0], w, b, chunk).shape == (0, 24)
    md, ref, prefixes = load_backend(tiny_model)
    _, chunked, _ = load_backend(tiny_model, dtype="f16", options=TorchOptions(gemm="chunked", gemm_chunk=64))
    assert chunked.fwd.gemm == "chunked"
    pack = pack_prompts(random_specs(md, random.Random(2)), prefixes)
    a, c = readout_logits(ref, pack), readout_logits(chunked, pack)
    scale = max(float(np.abs(v).max()) for v in a)
    assert max(float(np.abs(u - v).max()) for u, v in zip(a, c)) <= 1e-2 * max(1.0, scale)


def test_row_pieces_use_allowed_sizes_only():
    from basal_local.cuda_kernels.gemm import CallSizes, row_pieces

    sizes = CallSizes([256, 512])
    assert row_pieces(300, sizes) == [(0, 300, 512)]
    assert row_pieces(256, sizes) == [(0, 256, 256)]
    assert row_pieces(1100, sizes) == [(0, 512, 512), (512, 512, 512), (1024, 76, 256)]
    assert row_pieces(0, CallSizes([64])) == []


def test_verified_gemm_sizes_and_sized_linear():
    """The verified route keeps only the row counts on which a GEMM gives the largest call's bits; a GEMM that
    changes its reduction below 64 rows (as a library may, e.g. split-K) is then never called below 64 rows,
    and a row's bits are the same alone and amid others."""
    from basal_local.cuda_kernels import gemm

    def drifting(x, w, b):  # exact above 63 rows, a different rounding below (a stand-in for split-K)
        y = torch.nn.functional.linear(x, w, b)
        return y if x.shape[0] >= 64 else (y.double() + 1e-3).float()

    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    sizes, agrees = gemm.agreeing_sizes(w, b, [4, 16, 64, 128, 256], linear=drifting)
    assert sizes == [64, 128, 256] and not agrees[16] and agrees[64]
    # the verified sizes where the smallest is small enough, else one fixed chunk of rows
    verified, report = gemm.build_linear(w, b, TorchOptions(gemm_chunk=32), [4, 16, 64, 128, 256], drifting)
    assert verified.sizes.sizes == [64, 128, 256] and report["route"] == "verified" and report["disagree"] == [4, 16]
    chunk, report = gemm.build_linear(w, b, TorchOptions(gemm_chunk=32), [4, 16, 64, 128, 256], drifting,
                                      floor_max=32)
    assert chunk.sizes.sizes == [32] and report["route"] == "chunk" and report["sizes"] == 32
    x = torch.randn(600, 16, generator=gen)
    full = gemm.sized_linear(x, w, b, gemm.CallSizes(sizes), linear=drifting)
    assert torch.allclose(full, torch.nn.functional.linear(x, w, b), atol=1e-5)
    for start, rows in ((0, 1), (7, 30), (250, 100), (0, 600)):
        assert torch.equal(gemm.sized_linear(x[start:start + rows], w, b, gemm.CallSizes(sizes), linear=drifting),
                           full[start:start + rows])

    def gapped(x, w, b):  # also a different rounding at exactly 128 rows (cuBLAS's split-K in between)
        return drifting(x, w, b) if x.shape[0] != 128 else (drifting(x, w, b).double() + 1e-3).float()
    sizes, agrees = gemm.agreeing_sizes(w, b, [4, 16, 64, 128, 256], linear=gapped)
    assert sizes == [64, 256] and not agrees[128]
    timed = gemm.CallSizes(sizes, {64: 2.0, 256: 1.0})  # 256 rows timed faster than 64: every call runs at 256
    assert [p[2] for p in gemm.row_pieces(600, timed)] == [256, 256, 256] and timed.call(10) == 256
    assert gemm.CallSizes(sizes).call(10) == 64  # untimed: the smallest that holds the rows
    assert gemm.CallSizes(sizes, {64: 2.0, 256: 1.6}).call(10) == 64  # 20 % faster alone: not trusted, no padding
    full = gemm.sized_linear(x, w, b, gemm.CallSizes(sizes), linear=gapped)
    for start, rows in ((0, 1), (7, 100), (250, 128), (0, 600)):
        for allowed in (gemm.CallSizes(sizes), timed):
            assert torch.equal(gemm.sized_linear(x[start:start + rows], w, b, allowed, linear=gapped),
                               full[start:start + rows])


class _FakeLt:
    """cuBLASLt's stand-in on the CPU (`gemm.lt_choices` and `gemm.PinnedCall` take any object with these two
    methods): per row count it offers named algorithms; "same..." ones give F.linear's bits, "off" ones a
    different rounding (as a split-K algorithm would). `last` records the algorithm of the latest call."""

    def __init__(self, offered: dict[int, list[str]], no_split: dict[int, list[str]]) -> None:
        self.offered, self.no_split, self.last, self.calls = offered, no_split, None, []

    def algos(self, w, bias, m, count=16, no_split=False):
        return [name.encode() for name in (self.no_split if no_split else self.offered).get(m, [])]

    def matmul(self, x, w, bias, algo):
        self.last = algo.decode()
        self.calls.append((x.shape[0], self.last))
        y = torch.nn.functional.linear(x, w, bias)
        return y if self.last.startswith("same") else (y.double() + 1e-3).float()


def test_pinned_library_algorithms_agree_and_are_chosen_by_time():
    """A library algorithm of our choosing is pinned to a row count only where its rows give the large call's
    bits (never the fastest one that differs), where the library's own call disagrees or is slower by more than
    5 %; the pinned counts join the allowed sizes, and a row's bits stay the same alone and amid others."""
    from basal_local.cuda_kernels import gemm

    def drifting(x, w, b):  # the library's own call: exact from 64 rows, another rounding below (split-K)
        y = torch.nn.functional.linear(x, w, b)
        return y if x.shape[0] >= 64 else (y.double() + 1e-3).float()

    gen = torch.Generator().manual_seed(7)
    w, b = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    cands = [4, 16, 64, 128, 256]
    sizes, _ = gemm.agreeing_sizes(w, b, cands, linear=drifting)
    assert sizes == [64, 128, 256]
    library = {64: 2.0, 128: 3.0, 256: 5.0}
    fake = _FakeLt({4: ["off4"], 16: ["off16", "same-slow", "same-fast"], 128: ["same128"], 256: ["same256"]},
                   {16: ["same-fast", "same-ns"], 256: ["off256"]})
    seconds = {"same-slow": 1.5, "same-fast": 1.0, "same-ns": 1.2, "same128": 2.9, "same256": 4.0}
    timed_names = []

    def timer(calls, device):
        out = {}
        for key, fn in calls.items():
            fn()
            timed_names.append(fake.last)
            out[key] = seconds[fake.last]
        return out

    pins, times = gemm.lt_choices(w, b, cands[-1], cands, fake, library, timer=timer)
    assert {m: a.decode() for m, a in pins.items()} == {16: "same-fast", 256: "same256"}
    assert times == {16: 1.0, 256: 4.0}
    assert not any(n.startswith("off") for n in timed_names)  # only agreeing algorithms are timed
    assert timed_names.count("same-fast") == 1  # offered twice (split-K filtered and not), tried once
    # 128: 2.9 vs the library's 3.0 is within the 5 % margin: the library's own call stays; 4 rows: nothing agrees

    allowed = gemm.CallSizes(sorted(set(sizes) | set(pins)), {**library, **times})
    call = gemm.PinnedCall(drifting, fake, pins)
    assert allowed.call(10) == 16 and allowed.call(100) == 128
    x = torch.randn(600, 16, generator=gen)
    full = gemm.sized_linear(x, w, b, allowed, call)
    assert torch.allclose(full, torch.nn.functional.linear(x, w, b), atol=1e-5)
    fake.calls.clear()
    for start, rows in ((0, 1), (3, 10), (250, 100), (0, 600)):
        assert torch.equal(gemm.sized_linear(x[start:start + rows], w, b, allowed, call), full[start:start + rows])
    # the 1- and 10-row calls ran the pinned algorithm at 16 rows; the 100-row call the library's own at 128
    assert (16, "same-fast") in fake.calls and all(m in (16, 256) for m, _ in fake.calls)


def test_a_dropped_backend_is_freed_without_the_garbage_collector(tiny_model):
    """No reference cycle holds a backend (its forward, GEMM closures, CUDA graphs): dropped, it is freed at once,
    never by a later collection that could land inside another backend's CUDA graph capture."""
    import gc
    import weakref

    gc.disable()
    try:
        _, backend, _ = load_backend(tiny_model)
        refs = [weakref.ref(backend), weakref.ref(backend.fwd)]
        del backend
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_tree_tokens_continue_each_parent():
    """backends/host.tree_tokens, the trees the GPU checks and tools/attn_bench.py build: a root continues the
    cached prefix, a child its parent, each block's tokens in order."""
    positions, blocks, parents = host.tree_tokens(3, (2, 1, 2, 1), (-1, 0, -1, 2))
    assert positions.tolist() == [3, 4, 5, 3, 4, 5] and blocks.tolist() == [0, 0, 1, 2, 2, 3]
    assert parents.tolist() == [-1, 0, -1, 2] and parents.dtype == np.int32 and positions.dtype == np.int64


def _long_tiles(n_tiles: int, keys: list[int]) -> tplan.TilePlan:
    """A plan of `n_tiles` tiles whose key counts cycle through `keys` (the other words marked per tile)."""
    tiles = np.zeros((n_tiles, tplan.RECORD), dtype=np.int32)
    tiles[:, 0] = np.arange(n_tiles) * 4
    tiles[:, 1] = 4
    tiles[:, 2] = [keys[i % len(keys)] for i in range(n_tiles)]
    tiles[:, 8] = np.arange(n_tiles) + 1000  # a word the split copies as it is
    return tplan.TilePlan(tiles, np.arange(4 * n_tiles, dtype=np.int32))


def test_split_tiles_gives_a_record_per_chunk_where_work_is_scarce():
    c = tplan.CHUNK_KEYS
    plan = _long_tiles(6, [4 * c + 100, 300, 2 * c, c + 1])
    out, slots = tplan.split_tiles(plan, n_kv=2, programs=132, cap=100, slot_cap=100)
    chunks = {4 * c + 100: 5, 300: 1, 2 * c: 2, c + 1: 2}
    per_tile = [chunks[int(k)] for k in plan.tiles[:, 2]]
    assert out.num_tiles == sum(per_tile) and slots == sum(n for n in per_tile if n > 1)
    assert out.q_rows is plan.q_rows
    seen_slots = set()
    for t in range(plan.num_tiles):
        mine = out.tiles[out.tiles[:, 8] == 1000 + t]
        assert len(mine) == per_tile[t]
        # every word but 6 and 7 is the tile's own
        assert (np.delete(mine, [6, 7], axis=1) == np.delete(plan.tiles[t], [6, 7])).all()
        if per_tile[t] == 1:
            assert (mine[:, 6] == 0).all() and (mine[:, 7] == 0).all()
        else:  # chunk 1..n (word 6 is chunk + 1), one slot base per tile, its n slots no other tile's
            assert sorted(mine[:, 6]) == list(range(1, per_tile[t] + 1)) and len(set(mine[:, 7])) == 1
            base = int(mine[0, 7])
            tile_slots = set(range(base, base + per_tile[t]))
            assert not tile_slots & seen_slots
            seen_slots |= tile_slots
    assert seen_slots == set(range(slots))
    # the most keys of work first: a split record's own chunk, a whole tile's all
    work = [min(c, r[2] - (r[6] - 1) * c) if r[6] else r[2] for r in out.tiles]
    assert work == sorted(work, reverse=True)


def test_split_tiles_leaves_plans_with_enough_work_or_short_keys_alone():
    c = tplan.CHUNK_KEYS
    many = _long_tiles(66, [3 * c])  # 66 tiles x 2 K/V heads >= 132 programs
    assert tplan.split_tiles(many, 2, 132, 10**6, 10**6) == (many, 0)
    short = _long_tiles(4, [c, 17, 1])  # no tile of more than one chunk
    assert tplan.split_tiles(short, 2, 132, 10**6, 10**6) == (short, 0)
    empty = tplan.TilePlan(np.zeros((0, tplan.RECORD), np.int32), np.zeros(0, np.int32))
    assert tplan.split_tiles(empty, 2, 132, 10, 10) == (empty, 0)


def test_split_tiles_splits_the_longest_tiles_that_fit_the_tables():
    c = tplan.CHUNK_KEYS
    plan = _long_tiles(3, [2 * c, 5 * c, 3 * c])  # 2, 5 and 3 chunks
    out, slots = tplan.split_tiles(plan, 2, 132, cap=3 + 4, slot_cap=100)  # room for 4 more records: the 5-chunk tile
    assert out.num_tiles == 7 and slots == 5
    assert set(out.tiles[out.tiles[:, 6] > 0, 8]) == {1001}
    out, slots = tplan.split_tiles(plan, 2, 132, cap=100, slot_cap=4)  # slots for 3 + ... : the 3-chunk tile fits
    assert slots == 3 and set(out.tiles[out.tiles[:, 6] > 0, 8]) == {1002}
    assert tplan.split_tiles(plan, 2, 132, cap=3, slot_cap=100) == (plan, 0)
