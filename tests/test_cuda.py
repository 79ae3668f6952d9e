"""GPU checks of the torch backend; they skip themselves without CUDA (run them on the device machine)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from basal_local.backends.host import tree_tokens
from basal_local.backends.torch.options import DEFAULT_TILING, TorchOptions
from basal_local.engine.packer import pack_prompts
from basal_local.model import load_model_dir

from .conftest import load_backend as loaded
from .conftest import readout_logits
from .hf_reference import HFModel
from .test_packer import random_specs
from .test_parity import hf_last_logits, sample_prompt_specs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def agreement(ref: list, got: list) -> tuple[float, float, int]:
    """(max |dlogit|, max |dp_cal| per order at temperature 1.3, same decisions) of two readouts."""
    from basal_local.protocol.decision import calibrate, softmax

    dlogit = max(float(np.abs(a - b).max()) for a, b in zip(ref, got))
    dp = max(max(abs(x - y) for x, y in zip(calibrate(softmax(a.tolist()), 1.3), calibrate(softmax(b.tolist()), 1.3)))
             for a, b in zip(ref, got))
    return dlogit, dp, sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(ref, got))


def test_cuda_f32_matches_transformers(small_model):
    hf = HFModel(small_model)  # transformers f32 on the CPU (tests/hf_reference.py)
    md, backend, prefixes = loaded(small_model, "cuda", "f32")
    specs = sample_prompt_specs(small_model, 8)
    ours = readout_logits(backend, pack_prompts(specs, prefixes))
    worst = max(float(np.abs(o - hf_last_logits(hf, list(s.token_ids), list(s.letter_ids))).max())
                for o, s in zip(ours, specs))
    print(f"cuda f32 vs transformers f32 (cpu): max |dlogit| = {worst:.3g}")
    assert worst <= 1e-3


def test_cuda_f16_default_close_to_f32_reference(small_model):
    specs = sample_prompt_specs(small_model, 48)
    _, ref_backend, prefixes = loaded(small_model, "cpu", "f32")
    md, backend, _ = loaded(small_model, "cuda", "auto")
    ref = readout_logits(ref_backend, pack_prompts(specs, prefixes))
    got = readout_logits(backend, pack_prompts(specs, prefixes))
    dlogit, dp, same = agreement(ref, got)
    print(f"cuda f16 vs cpu f32: max |dlogit| = {dlogit:.3g}, max |dp_cal| per order = {dp:.3g}, "
          f"same decision {same}/{len(ref)}")
    assert dp <= 1e-3 and same == len(ref)


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


def test_cuda_forward_on_kernels_matches_forward_on_twins(small_model):
    """The one forward with its ops chosen as Triton kernels (attention tree) or as their twins (sdpa), f32."""
    results = {}
    for impl in ("sdpa", "tree"):
        md, backend, prefixes = loaded(small_model, "cuda", "f32", attention=impl)
        assert backend.fwd.use_triton == (impl == "tree")
        specs = [s for seed in range(3) for s in random_specs(md, random.Random(seed))]
        results[impl] = readout_logits(backend, pack_prompts(specs, prefixes))
    diffs = np.concatenate([np.abs(a - b).ravel() for a, b in zip(results["sdpa"], results["tree"])])
    print(f"cuda kernels vs twins (f32): max {diffs.max():.3g}, mean {diffs.mean():.3g}")
    assert diffs.max() <= 1e-4


def test_cuda_graphs_match_eager(small_model):
    md = load_model_dir(small_model)
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    specs = [s for seed in range(3) for s in random_specs(md, random.Random(seed))]
    for dtype, bound in (("f32", 1e-4), ("f16", 5e-2)):
        results = {}
        for graphs in (False, True):
            _, backend, _ = loaded(small_model, "cuda", dtype, options=TorchOptions(cuda_graphs=graphs))
            # single prompts (several buckets) and one packed batch
            results[graphs] = [readout_logits(backend, pack_prompts([s], prefixes))[0] for s in specs[:6]]
            results[graphs] += readout_logits(backend, pack_prompts(specs, prefixes))
            if graphs:
                assert backend.graphs.graphs, "no CUDA graph was captured"
            else:
                assert backend.graphs is None
        worst = max(float(np.abs(a - b).max()) for a, b in zip(results[False], results[True]))
        print(f"cuda graphs vs eager ({dtype}): max |dlogit| = {worst:.3g}")
        assert worst <= bound


def test_cuda_a_graph_captured_on_first_use_says_so(small_model):
    """A (tokens, readouts) size not captured at warm-up is captured when a batch first needs it (two eager runs
    and the capture): its launch says so, for the batch's record; the next one of that size replays."""
    md = load_model_dir(small_model)
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    _, backend, _ = loaded(small_model, "cuda", "f16")
    batch = pack_prompts(random_specs(md, random.Random(0))[:1], prefixes).batches[0]
    backend.graphs.clear()
    first = backend.launch(batch)
    first.result()
    again = backend.launch(batch)
    again.result()
    assert (first.kind, again.kind) == ("graph captured now", "graph") and again.device_s() > 0


def test_cuda_a_launch_with_pool_copies_does_not_wait_for_the_device(small_model):
    """Two fills keeping the same tokens (two requests bringing one new document) copy pool rows to pool rows
    after the forward (forward.py `copy_after`): the launch queues the copies and returns while the device is
    still busy (the lane launches the next batch meanwhile), and the second fill's rows hold the first's K/V."""
    import dataclasses
    import time

    from basal_local.backends.base import Fill

    md = load_model_dir(small_model)
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    _, backend, _ = loaded(small_model, "cuda", "f16")
    backend.open_cache(8192)
    batch = pack_prompts(random_specs(md, random.Random(0))[:1], prefixes).batches[0]
    cap, tokens = backend.fwd.capacity, np.arange(0, 32)
    fills = [Fill("a", cap - 100, None, 0, tokens), Fill("b", cap - 50, None, 0, tokens)]
    batch = dataclasses.replace(batch, fills=fills)
    assert backend.fwd.fill_plan(batch)[1]  # the second fill's rows are copied after the forward
    backend.launch(batch).result()  # its graph captured
    with torch.inference_mode():  # the pools are inference tensors: written only in inference mode
        for pool in (*backend.fwd.prefix_k, *backend.fwd.prefix_v):
            pool[cap - 50:cap - 18] = 0  # what the copy of the launch below must fill again
    torch.cuda._sleep(1 << 30)  # the device busy for a while (~0.5 s) before the launch's work
    started = time.perf_counter()
    launched = backend.launch(batch)
    took = time.perf_counter() - started
    busy = not launched.done()
    launched.result()
    assert launched.kind == "graph" and busy and took < 0.1, took
    for pool in (*backend.fwd.prefix_k, *backend.fwd.prefix_v):
        assert torch.equal(pool[cap - 50:cap - 18], pool[cap - 100:cap - 68]) and pool[cap - 100:cap - 68].any()


# ---- issue 9: the Triton kernels against their twins, and bitwise batch invariance --------------------------
def test_cuda_tree_kernel_matches_twin(small_model):
    from basal_local.cuda_kernels import plan as tplan
    from basal_local.cuda_kernels import triton_kernels, twins

    kernels = triton_kernels()
    md = load_model_dir(small_model)
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    specs = [s for seed in range(4) for s in random_specs(md, random.Random(seed))]
    batch = pack_prompts(specs, prefixes).batches[0]
    lengths = [len(prefixes[n]) for n in batch.prefixes]
    rows = [(sum(lengths[:j]), n) for j, n in enumerate(lengths)]
    pos = torch.from_numpy(batch.positions.astype(np.int32)).cuda()
    for dtype, bound in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)):
        g = torch.Generator(device="cuda").manual_seed(0)
        t, hq, hkv, d = batch.num_tokens, 8, 2, 64
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", generator=g).to(dtype)
        pk, pv = (torch.randn(sum(lengths), hkv, d, device="cuda", generator=g).to(dtype) for _ in range(2))
        q = qkv[:, :hq * d].view(t, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        for readout in (None, batch.readout_index):
            p = tplan.tile_plan(batch.positions, batch.token_block, batch.block_parent, batch.block_prefix, rows,
                                kernels.queries_per_tile(DEFAULT_TILING[0], hq, hkv), rows=readout)
            n_out = t if readout is None else len(readout)
            out = torch.full((n_out, hq * d), float("nan"), dtype=dtype, device="cuda")
            kernels.tree_attention(q, k, v, pk, pv, pos, torch.from_numpy(p.tiles).cuda(),
                                   torch.from_numpy(p.q_rows).cuda(),
                                   torch.tensor([p.num_tiles], dtype=torch.int32, device="cuda"), out,
                                   compact=readout is not None, tiling=DEFAULT_TILING)
            want = twins.tree_attention(q.float(), k.float(), v.float(), pk.float(), pv.float(), pos, p, n_out,
                                        compact=readout is not None).view(n_out, -1)
            assert not torch.isnan(out).any(), "a row was not written"
            err = ((out.float() - want).norm() / want.norm()).item()
            print(f"tree kernel vs twin {dtype} rows={'readout' if readout is not None else 'all'}: rel {err:.3g}")
            assert err <= bound


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_split_chunks_give_the_bits_of_one_program(dtype):
    """Keys reduced in chunks of CHUNK_KEYS positions (cuda_kernels/plan.py): a tile split into a work item per
    chunk (the last to end merges) gives bitwise what one program walking every chunk gives, for every tiling,
    all rows and readout rows; and questions reading a long document from the pool (a state-cache hit, whose
    tiles split) get the bits of the same document computed in the forward (a miss, whose tiles do not)."""
    from basal_local.backends.torch.forward import ALT_TILING
    from basal_local.cuda_kernels import plan as tplan
    from basal_local.cuda_kernels import triton_kernels

    kernels = triton_kernels()
    hq, hkv, d = 16, 2, 128
    template, doc = 40, 2 * tplan.CHUNK_KEYS + 700  # three chunks
    sizes, parents = (24, 29, 29, 18, 77, 77, 41), (-1, 0, 0, -1, 3, 3, -1)
    miss_tree = tree_tokens(template, (doc,) + sizes, (-1,) + tuple(p + 1 if p >= 0 else 0 for p in parents))
    hit_tree = tree_tokens(template + doc, sizes, parents)
    g = torch.Generator(device="cuda").manual_seed(3)
    n = len(miss_tree[0])
    q = torch.randn(n, hq, d, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(n, hkv, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    pk, pv = (torch.randn(template, hkv, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    scratch = kernels.Scratch("cuda", hkv, d, kernels.Scratch.needs(256, 64, 64, hkv), 64, 64)
    leaf_ends = np.cumsum(sizes)[[1, 2, 4, 5, 6]] - 1

    def run(tree, qkv, pool, n_pre, tiling, split, rows=None):
        pos, blocks, par = tree
        p = tplan.tile_plan(pos, blocks, par, np.zeros(len(par), np.int32), [(0, n_pre)],
                            kernels.queries_per_tile(tiling[0], hq, hkv), rows=rows)
        if split:
            p, slots = tplan.split_tiles(p, hkv, 10**6, 10**6, 64)
            assert slots > 0
        out = torch.full((len(pos) if rows is None else len(rows), hq * d), float("nan"), dtype=dtype, device="cuda")
        kernels.tree_attention(*qkv, *pool, torch.from_numpy(pos.astype(np.int32)).cuda(),
                               torch.from_numpy(p.tiles).cuda(), torch.from_numpy(p.q_rows).cuda(),
                               torch.tensor([p.num_tiles], dtype=torch.int32, device="cuda"), out,
                               compact=rows is not None, tiling=tiling, scratch=scratch)
        assert not torch.isnan(out).any(), "a row was not written"
        assert int(scratch.counts.abs().sum()) == 0, "a split tile's count was not reset"
        return out

    qkv_hit = (q[doc:].contiguous(), k[doc:].contiguous(), v[doc:].contiguous())
    pool_hit = (torch.cat([pk, k[:doc]]), torch.cat([pv, v[:doc]]))
    miss = run(miss_tree, (q, k, v), (pk, pv), template, ALT_TILING, False)[doc:]
    for tiling in (DEFAULT_TILING, ALT_TILING):
        whole = run(hit_tree, qkv_hit, pool_hit, template + doc, tiling, False)
        split = run(hit_tree, qkv_hit, pool_hit, template + doc, tiling, True)
        assert torch.equal(whole, split) and torch.equal(split, miss)
        readout = run(hit_tree, qkv_hit, pool_hit, template + doc, tiling, True, rows=leaf_ends)
        assert torch.equal(readout, miss[leaf_ends])


def test_cuda_fused_kernels_match_twins():
    from basal_local.cuda_kernels import triton_kernels, twins

    kernels = triton_kernels()
    g = torch.Generator(device="cuda").manual_seed(3)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x, d = (torch.randn(37, 256, device="cuda", generator=g).to(dtype) for _ in range(2))
        w = torch.rand(256, device="cuda", generator=g).to(dtype)
        h1, s1 = kernels.add_rms_norm(x, d, w, 1e-5)
        h2, s2 = twins.add_rms_norm(x, d, w, 1e-5)
        assert torch.equal(s1, s2)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (h1.float() - h2.float()).abs().max().item() <= tol * max(1.0, h2.float().abs().max().item())
        gu = torch.randn(37, 2 * 300, device="cuda", generator=g).to(dtype)
        assert (kernels.silu_mul(gu).float() - twins.silu_mul(gu).float()).abs().max().item() <= tol * 4
        tall = kernels.silu_mul(gu, 64)  # written as the first rows of a block a padded GEMM reads in place
        assert tall.shape == (64, 300) and torch.equal(tall[:37], kernels.silu_mul(gu))
        qkv = torch.randn(37, 8 * 32, device="cuda", generator=g).to(dtype)
        pos = torch.randint(0, 500, (37,), device="cuda", dtype=torch.int32)
        ang = torch.arange(512, device="cuda", dtype=torch.float64)[:, None] * \
            (1e4 ** (-torch.arange(16, device="cuda", dtype=torch.float64) / 16))[None]
        a = kernels.rope_(qkv.clone(), pos, ang.cos().float(), ang.sin().float(), 4, 2, 32)
        b = twins.rope_(qkv.clone(), pos, ang.cos().float(), ang.sin().float(), 4, 2, 32)
        assert (a.float() - b.float()).abs().max().item() <= tol * 8
        fill = torch.zeros(37, dtype=torch.int32, device="cuda")  # pool row + 1 per token, 0: none
        fill[[5, 6, 7, 20]] = torch.tensor([1, 2, 3, 8], dtype=torch.int32, device="cuda")
        pk, pv = (torch.zeros(9, 2, 32, device="cuda", dtype=dtype) for _ in range(2))
        c = kernels.rope_(qkv.clone(), pos, ang.cos().float(), ang.sin().float(), 4, 2, 32, fill, pk, pv)
        assert torch.equal(c, a)  # storing the pool rows changes nothing else
        heads = c.view(37, 8, 32)
        assert torch.equal(pk[[0, 1, 2, 7]], heads[[5, 6, 7, 20], 4:6])  # the rotated K, bit for bit
        assert torch.equal(pv[[0, 1, 2, 7]], heads[[5, 6, 7, 20], 6:8])
        assert not pk[3:7].any() and not pv[3:7].any() and not pk[8].any()
        lm = torch.randn(50, 256, device="cuda", generator=g).to(dtype)
        letters = torch.tensor([1, 7, 49], device="cuda")
        la, lb = kernels.letter_logits(h2, lm, letters), twins.letter_logits(h2, lm, letters)
        assert (la - lb).abs().max().item() <= 1e-3 * max(1.0, lb.abs().max().item())


@pytest.mark.parametrize("gemm", ["verified", "chunked", "fp8"])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_cuda_bitwise_batch_invariance(small_model, dtype, gemm):
    """A prompt alone, in a batch, in a tree beside its question's other order and beside other questions of
    the same state: bitwise equal letter logits with each GEMM route: cuBLAS at verified row counts (the
    default), fixed chunks, fp8 GEMMs."""
    from basal_local.engine.packer import PromptSpec

    if gemm == "fp8" and dtype == "bf16":
        pytest.skip("fp8 GEMMs run with f16 activations (dtype fp8)")
    options = TorchOptions(gemm="verified" if gemm == "fp8" else gemm)
    md, backend, prefixes = loaded(small_model, "cuda", "fp8" if gemm == "fp8" else dtype, options=options)
    assert backend.fwd.gemm == gemm
    rng = random.Random(7)
    specs = [s for seed in range(6) for s in random_specs(md, random.Random(seed))]
    for trial in range(6):
        target = rng.choice(specs)
        alone = readout_logits(backend, pack_prompts([target], prefixes))[0]
        others = rng.sample(specs, rng.randint(3, 40))
        mixed = readout_logits(backend, pack_prompts(others + [target], prefixes))[-1]
        same_state = [s for s in specs if s.token_ids[:60] == target.token_ids[:60] and s is not target]
        tree = readout_logits(backend, pack_prompts(same_state + [target], prefixes))[-1]
        eager = readout_logits(backend, pack_prompts([PromptSpec(target.token_ids, target.lang,
                                                                  target.letter_ids)], prefixes))[0]
        assert np.array_equal(alone, mixed) and np.array_equal(alone, tree) and np.array_equal(alone, eager), \
            (trial, float(np.abs(alone - mixed).max()), float(np.abs(alone - tree).max()))
    # the long lane (forward_steps, eager) gives the same bits as the graphed forward
    pack = pack_prompts(specs[:10], prefixes)
    steps = list(backend.forward_steps(pack.batches[0]))
    assert np.array_equal(steps[-1], backend.forward(pack.batches[0]))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_cuda_alternative_attention_tiling_gives_the_same_bits(small_model, dtype):
    """The 128-query / 8-warp attention tiling that small graphs and long eager forwards use passed its load-time
    check (same bits as 64 / 4 warps), and a forward gives the same letter logits with it and without it."""
    from basal_local.backends.torch.forward import ALT_TILING

    md, backend, prefixes = loaded(small_model, "cuda", dtype)
    fast = backend.fwd
    assert fast.alt_tiling == ALT_TILING, fast.report.get("attention_alt_tiling")
    specs = [s for seed in range(3) for s in random_specs(md, random.Random(seed))]
    packs = [pack_prompts(specs[:2], prefixes), pack_prompts(specs, prefixes)]
    with_alt = [readout_logits(backend, p) for p in packs]
    fast.alt_tiling = None
    backend.graphs.clear()
    without = [readout_logits(backend, p) for p in packs]
    for a, b in zip(with_alt, without):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_alternative_tiling_gives_the_default_bits_on_a_long_tree(dtype):
    """A document of 5,000 tokens (two chunks of keys, an open range) after a cached template and three questions
    off it, at the 4.5B model's heads: the tree kernel writes the same bits with the 128-query tiling as with the
    default one, every row and the readout rows."""
    from basal_local.backends.torch.forward import ALT_TILING
    from basal_local.cuda_kernels import plan as tplan
    from basal_local.cuda_kernels import triton_kernels

    kernels = triton_kernels()
    hq, hkv, d, n_pre, sizes = 16, 2, 128, 60, (5000, 119, 119, 40)
    positions, token_block, parents = tree_tokens(n_pre, sizes, (-1, 0, 0, 0))
    prefix = np.array([0, -1, -1, -1], np.int32)
    readout = np.cumsum(sizes) - 1
    t = len(positions)
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(t, hq, d, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(t, hkv, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    pk, pv = (torch.randn(n_pre, hkv, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    pos = torch.from_numpy(positions.astype(np.int32)).cuda()
    for rows in (None, readout):
        outs = []
        for tiling in (DEFAULT_TILING, ALT_TILING):
            p = tplan.tile_plan(positions, token_block, parents, prefix, [(0, n_pre)],
                                kernels.queries_per_tile(tiling[0], hq, hkv), rows=rows)
            out = torch.full((t if rows is None else len(rows), hq * d), float("nan"), dtype=dtype, device="cuda")
            kernels.tree_attention(q, k, v, pk, pv, pos, torch.from_numpy(p.tiles).cuda(),
                                   torch.from_numpy(p.q_rows).cuda(),
                                   torch.tensor([p.num_tiles], dtype=torch.int32, device="cuda"), out,
                                   compact=rows is not None, tiling=tiling)
            outs.append(out)
        assert not torch.isnan(outs[1]).any() and torch.equal(outs[0], outs[1])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_second_gpu_gives_the_same_bits(small_model):
    """One replica per GPU (issue 13): a backend on cuda:1 (graphs, Triton launches on its own device) returns
    the same letter logits, bit for bit, as on cuda:0, alone and in a batch."""
    md, b0, prefixes = loaded(small_model, "cuda:0", "f16")
    _, b1, _ = loaded(small_model, "cuda:1", "f16")
    specs = [s for seed in range(3) for s in random_specs(md, random.Random(seed))]
    for group in (specs[:1], specs):
        pack = pack_prompts(group, prefixes)
        assert all(np.array_equal(a, b) for a, b in zip(readout_logits(b0, pack), readout_logits(b1, pack)))
    assert torch.cuda.memory_allocated(1) > 0


def test_cuda_fp8_quantizer_matches_twin_and_gemm_matches_dequantized():
    """The Triton row quantizer gives the twin's bits; torch._scaled_mm (row-wise scales) is within f16
    rounding of the dequantized f32 product, and a row's bits do not change at the verified sizes."""
    from basal_local.cuda_kernels import fp8, triton_kernels

    kernels = triton_kernels()
    g = torch.Generator(device="cuda").manual_seed(3)
    for m, k in ((1, 64), (317, 4096), (70, 14336), (5, 160)):
        x = (torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.float16)
        x[0, :3] = torch.tensor([448.0, -1e-7, 6e4])
        qa, sa = kernels.quant_rows(x)
        qb, sb = fp8.quant_rows(x)
        assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)) and torch.equal(sa, sb), (m, k)
    w = (torch.randn(384, 256, device="cuda", generator=g) * 0.05).to(torch.float16)
    x = torch.randn(300, 256, device="cuda", generator=g).to(torch.float16)
    wq, sw = fp8.quant_rows(w)
    sw = sw.view(1, -1)  # the weight's scales per output channel
    xq, sx = kernels.quant_rows(x)
    mm = fp8.cuda_scaled_mm("cuda", torch.float16)
    got = mm(xq, wq, sx, sw, torch.float16).float()
    ref = fp8.scaled_mm_twin(xq, wq, sx, sw, torch.float32)
    assert float((got - ref).abs().max()) <= 2e-3 * float(ref.abs().max())


def test_cuda_fp8_accuracy_envelope_vs_f32_reference(small_model):
    """dtype fp8 vs the CPU f32 reference on the sample set. fp8 does NOT meet the issue's bar for the default
    path (identical decisions, |dp_cal| <= 2e-3): on this random-weight model the H200 measured 131/134 same
    decisions and max |dp_cal| 0.040, which is why fp8 is opt-in (--dtype fp8). This guards that envelope."""
    specs = sample_prompt_specs(small_model, 48)
    _, ref_backend, prefixes = loaded(small_model, "cpu", "f32")
    _, backend, _ = loaded(small_model, "cuda", "fp8")
    assert backend.fwd.gemm == "fp8"
    ref = readout_logits(ref_backend, pack_prompts(specs, prefixes))
    got = readout_logits(backend, pack_prompts(specs, prefixes))
    dlogit, dp, same = agreement(ref, got)
    print(f"cuda fp8 vs cpu f32: max |dlogit| = {dlogit:.3g}, max |dp_cal| per order = {dp:.3g}, "
          f"same decision {same}/{len(ref)}")
    assert same >= 0.95 * len(ref) and dp <= 0.08


@pytest.mark.parametrize("bias", [False, True])
def test_cuda_cublaslt_pinned_algorithms_give_the_large_calls_bits(bias):
    """cuBLASLt algorithms pinned to a row count (`gemm.lt_choices`, chosen on one random block) give the bits of
    torch's large-M call on another input too, called directly and replayed in a CUDA graph. The max preset's down
    projection shape: torch's own call splits K below 352 rows; a probe (`git show 56232b5:tools/lt_probe.py`) found agreeing algorithms
    without split-K at 304 and 320 rows on the H200 (without a bias; with one, whatever agrees is checked)."""
    import torch.nn.functional as F

    from basal_local.cuda_kernels import cublaslt, gemm

    if not cublaslt.available():
        pytest.skip("cuBLASLt is not loaded in this process")
    lt = cublaslt.LtGemm("cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(4096, 14336, device="cuda", generator=gen) * 14336 ** -0.5).half()
    b = torch.randn(4096, device="cuda", generator=gen).half() if bias else None
    top = 2048
    pins, times = gemm.lt_choices(w, b, top, [16, 304, 320], lt, {})
    if not bias:
        assert 304 in pins and 320 in pins, pins
    assert set(times) == set(pins)
    x = torch.randn(top, 14336, device="cuda", generator=gen).half()  # not the block they were chosen on
    full = F.linear(x, w, b)
    call = gemm.PinnedCall(F.linear, lt, pins)
    for m in pins:
        assert torch.equal(call(x[:m].contiguous(), w, b), full[:m]), m
        static = x[top - m:].contiguous()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call(static, w, b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(static, w, b)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, full[top - m:]), m


def test_cuda_gpu_memory_limit_refuses_and_is_enforced(small_model):
    """--gpu-memory on a GPU: weights over the limit are refused before loading, with the figures; a model that
    fits loads, reports its limit, and torch's allocator then refuses what would pass it."""
    from basal_local.backends.select import make_backend

    index = torch.cuda.current_device()
    try:
        too_small = make_backend("torch", "cuda", memory_limit="0.1MB")
        with pytest.raises(ValueError, match=r"more than --gpu-memory 0.1MB allows \(0.0 GB\)"):
            too_small.load(small_model, "f16")
        backend = make_backend("torch", "cuda", memory_limit="4GB")
        backend.load(small_model, "f16")
        assert backend.memory()["device_limit_bytes"] == 4 * 10 ** 9
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(5 * 10 ** 9, dtype=torch.uint8, device="cuda")
        torch.empty(10 ** 8, dtype=torch.uint8, device="cuda")  # within the limit: fine
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_cuda_state_cache_hit_gives_the_bits_of_a_miss(small_model, dtype):
    """The numerics contract of the state cache (engine/prefix_cache.py): a new question about a cached document,
    answered from the pool (CUDA graphs for the short one, the long lane for the long one), gives bitwise the
    logits of the same request on an engine that never saw the document; the document's first request too."""
    from basal_local.backends.torch import TorchBackend
    from basal_local.engine.engine import EngineSettings, ModelEngine
    from basal_local.engine.gate import DeviceGate
    from basal_local.telemetry import Telemetry

    from .test_prefix_cache import body, document, validate_systemone

    md = load_model_dir(small_model)

    graphed_fills = []  # per forward that filled the cache: did it run as a CUDA graph

    def engine():
        b = TorchBackend(device="cuda")
        b.load(small_model, dtype)
        found = b.graphs._graph_for

        def graph_for(batch):
            out = found(batch)
            if batch.fills:
                graphed_fills.append(out is not None)
            return out

        b.graphs._graph_for = graph_for
        e = ModelEngine(md, b, DeviceGate(), Telemetry(), EngineSettings(prefix_cache="2GB"))
        e.start()
        return e

    def logits(e, payload):
        plan = e.plan(validate_systemone({**payload, "model": md.name}, md.name))
        job_logits = []
        original = e.complete_batch

        def capture(flight, lane):  # the raw letter logits of the request's prompts, as the lane read them
            outputs = [f.result() for f in flight.launched]
            job_logits.extend(outputs[b][r, cols].copy() for b, r, cols in flight.pack.readouts)
            return original(flight, lane)

        e.complete_batch = capture
        try:
            outcome = e.submit(plan).result(600)
        finally:
            e.complete_batch = original
        return job_logits, outcome

    cached, fresh = engine(), engine()
    try:
        for doc in (document(80, words=300), document(81, words=3000)):  # main lane, then the long lane
            first, _ = logits(cached, body(doc, 1))
            hit, outcome = logits(cached, body(doc, 2))
            assert outcome.cached_tokens > 250
            miss, _ = logits(fresh, body(doc, 2))
            assert len(hit) == len(miss) and all(np.array_equal(a, b) for a, b in zip(hit, miss))
            again, _ = logits(fresh, body(doc, 1))  # fresh computed doc for question 2 first: a hit for 1 now
            assert all(np.array_equal(a, b) for a, b in zip(first, again))
        assert cached.cache_snapshot()["hits"] == 2
        assert True in graphed_fills  # the short document's fill ran in a graph (RoPE stores the pool rows)
    finally:
        cached.stop(60)
        fresh.stop(60)
