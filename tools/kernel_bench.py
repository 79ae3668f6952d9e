# ruff: noqa: B023  (each lambda is timed at once, inside its loop iteration)
"""Issue 9 kernel checks and timings on one GPU: every Triton kernel vs its twin, bitwise batch invariance of
attention and of each GEMM route, and the time of each variant at the 4.5B shapes (single decision ~320 rows,
a batch of 32 decisions ~8,000 rows). Writes JSON to argv[1]; prints a short table last.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.nn.functional as F
from triton.testing import do_bench

from basal_local.backends.base import PackedBatch
from basal_local.backends.torch.options import DEFAULT_TILING
from basal_local.cuda_kernels import plan as tplan
from basal_local.cuda_kernels import triton_kernels, twins
from basal_local.engine.packer import PromptSpec, pack_prompts

K = triton_kernels()
DEV = "cuda"
HQ, HKV, D = 16, 2, 128
rows_out: list[str] = []


def ms(fn) -> float:
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def synthetic_batch(n_states: int, questions: int, rng: np.random.Generator, prefix: list[int]) -> PackedBatch:
    specs = []
    for _ in range(n_states):
        state = list(rng.integers(100, 2000, int(rng.integers(120, 260))))
        for _ in range(questions):
            q = list(rng.integers(100, 2000, int(rng.integers(15, 40))))
            opts = list(rng.integers(100, 2000, int(rng.integers(20, 40))))
            for order in (opts, opts[::-1]):
                specs.append(PromptSpec(prefix + state + q + order + [5, 6], "en", [7, 8]))
    return pack_prompts(specs, {"en": prefix}, max_forward_tokens=10**6).batches[0], specs


def attention_inputs(batch, n_prefix, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    t = batch.num_tokens
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=DEV, generator=g).to(dtype)
    pk = torch.randn(n_prefix, HKV, D, device=DEV, generator=g).to(dtype)
    pv = torch.randn(n_prefix, HKV, D, device=DEV, generator=g).to(dtype)
    return qkv, pk, pv


def split(qkv):
    t = qkv.shape[0]
    return (qkv[:, :HQ * D].view(t, HQ, D), qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D),
            qkv[:, (HQ + HKV) * D:].view(t, HKV, D))


def run_kernel(batch, qkv, pk, pv, n_prefix, rows=None):
    q, k, v = split(qkv)
    p = tplan.tile_plan(batch.positions, batch.token_block, batch.block_parent, batch.block_prefix,
                        [(0, n_prefix)], DEFAULT_TILING[0], rows=rows)
    tiles = torch.from_numpy(p.tiles).to(DEV)
    q_rows = torch.from_numpy(p.q_rows).to(DEV)
    nt = torch.tensor([p.num_tiles], dtype=torch.int32, device=DEV)
    pos = torch.from_numpy(batch.positions.astype(np.int32)).to(DEV)
    n_out = len(p.q_rows) if rows is not None else batch.num_tokens
    out = torch.full((n_out, HQ * D), float("nan"), dtype=qkv.dtype, device=DEV)

    def go():
        return K.tree_attention(q, k, v, pk, pv, pos, tiles, q_rows, nt, out, compact=rows is not None,
                                  tiling=DEFAULT_TILING)
    return go, p, pos


def attention_checks(result):
    rng = np.random.default_rng(0)
    prefix = list(rng.integers(100, 2000, 66))
    for name, n_states, qs in (("single", 1, 1), ("batch32", 32, 1)):
        batch, specs = synthetic_batch(n_states, qs, rng, prefix)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            qkv, pk, pv = attention_inputs(batch, len(prefix), dtype)
            go, p, pos = run_kernel(batch, qkv, pk, pv, len(prefix))
            got = go().float()
            q, k, v = split(qkv)
            want = twins.tree_attention(q.float(), k.float(), v.float(), pk.float(), pv.float(), pos, p,
                                        batch.num_tokens).view_as(got)
            err = float(((got - want).norm() / want.norm()).item())
            entry = {"tokens": batch.num_tokens, "tiles": p.num_tiles, "rel_err_vs_twin": err,
                     "unwritten": int(torch.isnan(got).sum().item())}
            if dtype != torch.float32:
                entry["kernel_ms"] = ms(go)
            result[f"attention_{name}_{str(dtype)[6:]}"] = entry
            rows_out.append(f"attn {name:8s} {str(dtype)[6:]:8s} T={batch.num_tokens:5d} err {err:.2e} "
                            f"kernel {entry.get('kernel_ms', 0):.3f} ms")
    # bitwise: a prompt alone vs amid 31 other states (readout rows and every row of the prompt)
    for dtype in (torch.float16, torch.bfloat16):
        equal, trials = 0, 5
        for trial in range(trials):
            target_batch, target_specs = synthetic_batch(1, 1, np.random.default_rng(100 + trial), prefix)
            others, other_specs = synthetic_batch(31, 1, np.random.default_rng(200 + trial), prefix)
            mixed = pack_prompts(other_specs + target_specs, {"en": prefix}, max_forward_tokens=10**6)
            alone = pack_prompts(target_specs, {"en": prefix})
            b_alone, b_mixed = alone.batches[0], mixed.batches[0]
            g = torch.Generator(device=DEV).manual_seed(trial)
            # the same per-token q/k/v for the target's tokens: derive them from (token id, position)
            table = torch.randn(4096, (HQ + 2 * HKV) * D, device=DEV, generator=g).to(dtype)
            pk = torch.randn(len(prefix), HKV, D, device=DEV, generator=g).to(dtype)
            pv = torch.randn(len(prefix), HKV, D, device=DEV, generator=g).to(dtype)

            def qkv_of(b):
                ids = torch.from_numpy((b.token_ids * 7 + b.positions) % 4096).to(DEV)
                return table[ids].contiguous()
            outs = []
            for b, pack, idx in ((b_alone, alone, len(target_specs) - 1), (b_mixed, mixed, len(mixed.readouts) - 1)):
                go, _, _ = run_kernel(b, qkv_of(b), pk, pv, len(prefix), rows=b.readout_index)
                o = go()
                outs.append(torch.stack([o[pack.readouts[i][1]] for i in range(idx - len(target_specs) + 1, idx + 1)]))
            equal += int(torch.equal(outs[0], outs[1]))
        result[f"attention_bitwise_alone_vs_amid_31_{str(dtype)[6:]}"] = f"{equal}/{trials}"
        rows_out.append(f"attn bitwise alone vs amid 31 ({str(dtype)[6:]}): {equal}/{trials}")


GEMM_CONFIGS = [(64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3),
                (64, 256, 64, 4, 3), (64, 64, 64, 4, 4)]


def gemm_checks(result):
    shapes = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (22016, 2048), "down": (2048, 11008)}
    g = torch.Generator(device=DEV).manual_seed(0)
    best = {}
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=DEV, generator=g) * 0.02).half()
        bias = torch.randn(n, device=DEV, generator=g).half() if name == "qkv" else None
        x_big = torch.randn(8192, k, device=DEV, generator=g).half()
        x_small = x_big[:320].contiguous()
        entry = {}
        ref_small = F.linear(x_small, w, bias)
        ref_big = F.linear(x_big, w, bias)
        entry["cublas"] = {"ms_320": ms(lambda: F.linear(x_small, w, bias)),
                           "ms_8192": ms(lambda: F.linear(x_big, w, bias)),
                           "bitwise_320_vs_8192": bool(torch.equal(ref_small, ref_big[:320]))}
        for cfg in GEMM_CONFIGS:
            try:
                small = K.linear(x_small, w, bias, cfg)
                big = K.linear(x_big, w, bias, cfg)
                err = float(((small.float() - ref_small.float()).norm() / ref_small.float().norm()).item())
                entry[str(cfg)] = {"ms_320": ms(lambda: K.linear(x_small, w, bias, cfg)),
                                   "ms_8192": ms(lambda: K.linear(x_big, w, bias, cfg)),
                                   "bitwise_320_vs_8192": bool(torch.equal(small, big[:320])),
                                   "bitwise_1_vs_8192": bool(torch.equal(K.linear(x_big[:1], w, bias, cfg), big[:1])),
                                   "rel_err_vs_cublas": err}
            except Exception as exc:
                entry[str(cfg)] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        result[f"gemm_{name}"] = entry
        c = entry["cublas"]
        rows_out.append(f"gemm {name:8s} cublas   320: {c['ms_320']:.4f} ms 8192: {c['ms_8192']:.4f} ms "
                        f"bitwise {c['bitwise_320_vs_8192']}")
        ok = {cfg: e for cfg, e in entry.items() if cfg != "cublas" and "ms_320" in e}
        for cfg, e in ok.items():
            rows_out.append(f"gemm {name:8s} {cfg:22s} 320: {e['ms_320']:.4f} 8192: {e['ms_8192']:.4f} "
                            f"bitwise {e['bitwise_320_vs_8192']}/{e['bitwise_1_vs_8192']} err {e['rel_err_vs_cublas']:.1e}")
        if ok:
            # weight the single decision and the batch equally, relative to cuBLAS
            best[name] = min(ok, key=lambda c: ok[c]["ms_320"] / entry["cublas"]["ms_320"]
                             + ok[c]["ms_8192"] / entry["cublas"]["ms_8192"])
    result["gemm_best"] = best
    rows_out.append(f"gemm best per shape: {best}")


def fused_checks(result):
    g = torch.Generator(device=DEV).manual_seed(1)
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(300, 2048, device=DEV, generator=g).to(dtype)
        d = torch.randn(300, 2048, device=DEV, generator=g).to(dtype)
        w = torch.rand(2048, device=DEV, generator=g).to(dtype)
        h1, s1 = K.add_rms_norm(x, d, w, 1e-6)
        h2, s2 = twins.add_rms_norm(x, d, w, 1e-6)
        gu = torch.randn(300, 2 * 5504, device=DEV, generator=g).to(dtype)
        qkv = torch.randn(300, 20 * 128, device=DEV, generator=g).to(dtype)
        pos = torch.randint(0, 4000, (300,), device=DEV, dtype=torch.int32)
        ang = torch.arange(4096, device=DEV, dtype=torch.float64)[:, None] * (1e6 ** (-torch.arange(64, device=DEV,
                                                                                                       dtype=torch.float64) / 64))[None]
        cos, sin = ang.cos().float(), ang.sin().float()
        r1 = K.rope_(qkv.clone(), pos, cos, sin, 16, 2, 128)
        r2 = twins.rope_(qkv.clone(), pos, cos, sin, 16, 2, 128)
        hh = torch.randn(5, 2048, device=DEV, generator=g).to(dtype)
        lm = torch.randn(1000, 2048, device=DEV, generator=g).to(dtype)
        letters = torch.tensor([3, 9, 100, 999], device=DEV)
        entry = {"add_rms_norm_max": float((h1.float() - h2.float()).abs().max()),
                 "residual_equal": bool(torch.equal(s1, s2)),
                 "silu_mul_max": float((K.silu_mul(gu).float() - twins.silu_mul(gu).float()).abs().max()),
                 "rope_max": float((r1.float() - r2.float()).abs().max()),
                 "letter_logits_max": float((K.letter_logits(hh, lm, letters) - twins.letter_logits(hh, lm, letters))
                                            .abs().max()),
                 "add_rms_norm_ms": ms(lambda: K.add_rms_norm(x, d, w, 1e-6)),
                 "add_rms_norm_twin_ms": ms(lambda: twins.add_rms_norm(x, d, w, 1e-6))}
        result[f"fused_{str(dtype)[6:]}"] = entry
        rows_out.append(f"fused {str(dtype)[6:]}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                                for k, v in entry.items()))


def main(path: str) -> None:
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, fn in (("fused", fused_checks), ("attention", attention_checks), ("gemm", gemm_checks)):
        try:
            fn(result)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            result[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            rows_out.append(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)
    print("\n".join(rows_out))


if __name__ == "__main__":
    main(sys.argv[1])
