"""Kernel time per family (attention, GEMM, norms, copies) of a single decision and of 32, on CUDA.

    python tools/profile_forward.py MODEL_DIR OUT.txt [attention:gemm ...]

CUDA graphs off, so every kernel is seen by name; the default configuration is the product's (tree:verified),
others are `--attention` and `--gemm` values of `basal-local bench`. Each also lists its costliest kernels.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch

from basal_local.api.systemone import validate_systemone
from basal_local.backends.torch import TorchBackend
from basal_local.backends.torch.options import TorchOptions
from basal_local.bench import single_question_requests
from basal_local.engine.packer import PromptSpec, pack_prompts
from basal_local.model import load_model_dir
from basal_local.protocol.render import render_question

FAMILIES = (("attention", ("attn", "fmha", "flash", "attention")),
            ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "ampere", "cublas")),
            ("copy/cast", ("copy", "cat", "to_copy", "convert", "CatArray")),
            ("norm/rope/swiglu/elementwise", ("rms", "rope", "silu", "elementwise", "vectorized", "mul", "add",
                                              "reduce", "pow", "mean", "rsqrt", "letter")),
            ("index/gather", ("index", "gather", "embedding")))


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k.lower() in low for k in keys):
            return fam
    return "other"


def profile(md, attention: str, gemm: str, batches) -> str:
    backend = TorchBackend("cuda", attention=attention, options=TorchOptions(cuda_graphs=False, gemm=gemm))
    backend.load(md.path, "f16")
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    for lang, ids in prefixes.items():
        backend.add_prefix(lang, ids)
    lines = []
    for label, specs in batches:
        pack = pack_prompts(specs, prefixes)
        for _ in range(3):
            backend.forward(pack.batches[0])
        torch.cuda.synchronize()
        n = 5
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                backend.forward(pack.batches[0])
            torch.cuda.synchronize()
        fams: dict[str, float] = defaultdict(float)
        kernels: list[tuple[float, int, str]] = []
        count = 0
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
            if t and ev.device_type == torch.autograd.DeviceType.CUDA:
                fams[family(ev.key)] += t / n / 1000.0
                count += ev.count
                kernels.append((t / n / 1000.0, ev.count // n, ev.key[:90]))
        total = sum(fams.values())
        lines.append(f"{attention}/{gemm} {label} ({pack.batches[0].num_tokens} packed tokens): kernel time "
                     f"{total:.2f} ms, {count // n} kernels per forward")
        for fam, t in sorted(fams.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {fam:32s} {t:8.2f} ms")
        for t, calls, name in sorted(kernels, reverse=True)[:12]:
            lines.append(f"      {t:8.3f} ms  {calls:4d}x  {name}")
    del backend
    torch.cuda.empty_cache()
    return "\n".join(lines)


def main(model_dir: str, out: str, *configs: str) -> None:
    md = load_model_dir(model_dir)
    requests = [validate_systemone(r, md.name) for r in single_question_requests(md.name)]

    def specs_of(reqs):
        specs = []
        for request in reqs:
            for q in request.questions:
                lang, _, prompts = render_question(request.state_text, q)
                specs += [PromptSpec(md.tokenizer.encode(p), lang, md.tokenizer.letter_ids[: len(q.keys)])
                          for p in prompts]
        return specs
    batches = [("single decision", specs_of(requests[:1])), ("32 decisions", specs_of(requests[:32]))]
    pairs = [tuple(c.split(":")) for c in configs] or [("tree", "verified")]
    text = "\n".join(profile(md, a, g, batches) for a, g in pairs)
    print(text)
    with open(out, "w") as fh:
        fh.write(text + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
