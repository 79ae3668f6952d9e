"""The tree-attention kernel compiled for a Hopper GPU on any machine (no GPU needed): registers, spills and the
instructions of its key loops, per tiling, against another version of `kernels.py`.

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch numpy triton==3.6.0 && /tmp/tv/bin/pip install --no-deps -e .
    git show REF:cuda_kernels/kernels.py | sed 's/^from .plan import/from basal_local.cuda_kernels.plan import/' > /tmp/k.py
    /tmp/tv/bin/python tools/kernel_report.py [/tmp/k.py]

Triton's own ptxas and cuobjdump (in its wheel) compile and disassemble for sm_90a, with the arguments the
forward passes (pointers and strides divisible by 16, as Triton specialises them at run time). Use the Triton
of the GPU image (KINDS.md of the device tool: 3.6.0), or the figures describe another compiler. A key loop is a
loop holding the tensor-core instructions (HGMMA); per loop: its instructions, and the local-memory loads and
stores in it (spills in the hottest code). Static counts, not times: a loop with fewer instructions and no
spills is usually faster, which a GPU run must confirm (tools/attn_bench.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TYPES = {"Q": "*fp16", "K": "*fp16", "V": "*fp16", "PK": "*fp16", "PV": "*fp16", "OUT": "*fp16", "POS": "*i32",
         "TILES": "*i32", "QROWS": "*i32", "NT": "*i32", "SLOTS": "*fp32", "COUNTS": "*i32", "stride_qt": "i32",
         "stride_kt": "i32", "stride_vt": "i32", "stride_pt": "i32", "stride_ot": "i32", "qk_scale": "fp32",
         "n_slots": "i32"}
UNALIGNED = {"qk_scale", "n_slots"}
TILINGS = ((64, 64, 4, 2), (128, 64, 8, 3), (256, 64, 16, 2))


def tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_kernel(module, block_m: int, warps: int, stages: int, compact: bool):
    fn = module._tree_attn_kernel
    params = list(inspect.signature(fn.fn).parameters)
    const = dict(N_HEADS=16, REP=8, HEAD_DIM=128, BLOCK_M=block_m, BLOCK_N=64, NPROG=528, COMPACT=compact,
                 IEEE=False, REC=64, RANGES=32, CHUNK=4096, SLICE=32, OPEN=59)
    const = {k: v for k, v in const.items() if k in params}
    sig = {p: TYPES.get(p, "constexpr") for p in params}
    missing = [p for p in params if sig[p] == "constexpr" and p not in const and
               inspect.signature(fn.fn).parameters[p].default is inspect.Parameter.empty]
    if missing:
        raise SystemExit(f"{module.__name__}: unknown kernel arguments {missing} (teach TYPES or const)")
    attrs = {(params.index(k),): [["tt.divisibility", 16]] for k, t in sig.items()
             if t != "constexpr" and k not in UNALIGNED}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs, constexprs={(params.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def report(compiled) -> dict:
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        info = subprocess.run([tool("ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True,
                              text=True).stderr
        sass = subprocess.run([tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    code = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(m.group(1), 16), a) for a, t in code if (m := re.search(r"BRA (0x[0-9a-f]+)", t))
             and int(m.group(1), 16) < a]
    key_loops = []
    for lo, hi in loops:
        body = [t for a, t in code if lo <= a <= hi]
        inner = any(lo < l2 and h2 < hi for l2, h2 in loops if (l2, h2) != (lo, hi))
        if not inner and any("HGMMA" in t for t in body):
            key_loops.append({"instructions": len(body), "local_loads": sum("LDL" in t for t in body),
                              "local_stores": sum("STL" in t for t in body)})
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": tuple(int(x) for x in spill.groups()) if spill else None, "key_loops": key_loops}


def load(path: str):
    spec = importlib.util.spec_from_file_location(os.path.basename(path).removesuffix(".py"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reference", nargs="?", help="another kernels.py (its plan import made absolute)")
    a = ap.parse_args()
    from basal_local.cuda_kernels import kernels

    versions = [("this tree", kernels)] + ([("reference", load(a.reference))] if a.reference else [])
    print(f"triton {triton.__version__}; per tiling (rows x keys x warps x stages), all rows then readout rows")
    for block_m, block_n, warps, stages in TILINGS:
        for compact in (False, True):
            for name, module in versions:
                r = report(compile_kernel(module, block_m, warps, stages, compact))
                print(f"{block_m}x{block_n}x{warps}x{stages} {'readout' if compact else 'all    '} {name:9}: "
                      f"{r['registers']} registers, spills (stored, loaded) {r['spill_bytes']} bytes, key loops "
                      + ", ".join(f"{k['instructions']} instr ({k['local_loads']} LDL, {k['local_stores']} STL)"
                                  for k in r["key_loops"]), flush=True)


if __name__ == "__main__":
    main()
