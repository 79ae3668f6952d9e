#!/usr/bin/env bash
# Issue 27's H200 figures in one device call (nvidia-h200, < 9 minutes, no network): per preset (4.5B, max) the
# bf16 test model at f16 and the same weights as a ModelOpt FP8 checkpoint on its own e4m3 GEMMs (`--dtype auto`,
# fused parts at one scale: "tensor") side by side: `basal-local bench` single decision, batch 32 and memory; per
# route one more load (no GEMM timing, no cuBLASLt pins: neither changes a bit) for the sample set's decisions
# (agreement with f16) and 8 trials of a request alone vs amid 31 others, bitwise. Then the CUDA fp8 tests and,
# while the call has time, the checkpoints with a scale per channel ("channel"). Results in $OUT, a table at the
# end. Here: .whl holds the basal-local wheel and its pure-Python dependencies (as for tools/gpu_gpu2.sh).
# PRESETS (default "4.5B max"); STAGES (default "bench tests channel", run in that order, the must first);
# DEADLINE (default 530 s: no step starts after it, each step's timeout ends by it; then the table).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export BASAL_LOCAL_HOME=/tmp/bh
STAGES=${STAGES:-bench tests channel}
DEADLINE=${DEADLINE:-530}
has() { [[ " $STAGES " == *" $1 "* ]]; }
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
# step LIMIT CMD...: CMD under timeout min(LIMIT, time left); skipped (status 1) when under 20 s are left
step() { local t=$1; shift; local l=$(left); [ $l -lt 20 ] && { echo "skipped (deadline): $*" >&2; return 1; }
  [ $l -lt $t ] && t=$l; (cd /tmp && timeout $t "$@"); local rc=$?; [ $rc = 124 ] && echo "timed out after $t s: $*" >&2
  return $rc; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nproc; df -h /tmp | tail -1; } | tee "$OUT/gpu.txt"

cat > /tmp/fp8_tool.py <<'PY'
"""check DIR DTYPE OUT [MODE] | bench-channel DIR OUT | summary OUT PRESETS..."""
import json
import sys

import numpy as np


def check(model_dir, dtype, out, mode="tensor"):
    """The sample set's decisions (top answer, calibrated probabilities) through the engine, and 8 trials of a
    request alone vs amid 31 others (bitwise?), on CUDA. Loaded without GEMM timing or cuBLASLt pins: those only
    choose among row counts verified to give the same bits."""
    import random

    from basal_local.api.answers import response_body
    from basal_local.api.systemone import validate_systemone
    from basal_local.backends.torch import TorchBackend
    from basal_local.backends.torch.options import TorchOptions
    from basal_local.bench import single_question_requests
    from basal_local.engine.engine import EngineSettings, ModelEngine
    from basal_local.engine.gate import DeviceGate
    from basal_local.engine.packer import pack_prompts
    from basal_local.model.directory import load_model_dir
    from basal_local.telemetry import Telemetry

    md = load_model_dir(model_dir)
    backend = TorchBackend("cuda", options=TorchOptions(gemm_timed=False, cublaslt=False, fp8_scales=mode))
    backend.load(md.path, dtype)
    for lang in ("pl", "en"):
        backend.add_prefix(lang, md.tokenizer.template_prefix(lang))
    engine = ModelEngine(md, backend, DeviceGate(), Telemetry(), EngineSettings(long_tokens=0))
    bodies = single_question_requests(md.name)
    requests = [validate_systemone(b, md.name) for b in bodies]

    def logits_of(reqs):
        specs = [s for r in reqs for s in engine.plan(r).prompt_specs()]
        pack = pack_prompts(specs, engine.prefixes)
        outputs = [backend.forward(b) for b in pack.batches]
        return [outputs[b][r, cols] for b, r, cols in pack.readouts]

    rng = random.Random(0)
    bitwise, worst = 0, 0.0
    for _ in range(8):
        target = rng.choice(requests)
        alone = logits_of([target])
        others = rng.sample([r for r in requests if r is not target], 31)
        at = rng.randint(0, 31)
        mixed = logits_of(others[:at] + [target] + others[at:])
        before = sum(len(engine.plan(r).prompt_specs()) for r in others[:at])
        mine = mixed[before:before + len(alone)]
        worst = max(worst, max(float(np.abs(a - b).max()) for a, b in zip(alone, mine)))
        bitwise += all(np.array_equal(a, b) for a, b in zip(alone, mine))
    engine.start()
    try:
        rows = []
        for body in bodies:
            job = engine.submit(engine.plan(validate_systemone(body, md.name)))
            (ans,) = response_body(job.result(timeout=300), "systemone", 0.0)["answers"].values()
            probs = ({"true": ans["noul"], "false": 1.0 - ans["noul"]} if ans["type"] == "noul"
                     else ans["probabilities"])
            rows.append([max(probs, key=probs.get), probs])
    finally:
        engine.stop()
    json.dump({"dtype": backend.dtype_name, "plan": backend.fwd.report, "rows": rows,
               "invariance": {"trials": 8, "bitwise_equal": bitwise, "max_abs_dlogit": worst}}, open(out, "w"))


def bench_channel(model_dir, out):
    from basal_local.backends.torch.options import TorchOptions
    from basal_local.bench import bench_in_process

    result = bench_in_process(model_dir, "cuda", "auto", 1, torch_options=TorchOptions(fp8_scales="channel"))
    json.dump(result, open(out, "w"), indent=1)


def agreement(a, b):
    ra, rb = json.load(open(a))["rows"], json.load(open(b))["rows"]
    same = sum(x[0] == y[0] for x, y in zip(ra, rb))
    d = [abs(x[1][k] - y[1][k]) for x, y in zip(ra, rb) for k in x[1]]
    return f"{same}/{len(ra)} same decisions, max |dp_cal| {max(d):.4f}, median {float(np.median(d)):.5f}"


def summary(out, *presets):
    import os

    def load(path):
        return json.load(open(path)) if os.path.exists(path) else None

    print(f"{'preset':7} {'route':24} {'single ms':>10} {'p95':>8} {'batch32/s':>10} {'bitwise':>8} "
          f"{'weights GB':>10} {'peak-w GB':>9}  agreement with f16")
    for p in presets:
        for name, label in (("f16", "f16 (bf16 source)"), ("fp8", "fp8 checkpoint, tensor"),
                            ("fp8-channel", "fp8 checkpoint, channel")):
            r = load(f"{out}/{p}-{name}.json")
            if r is None or "single_ms" not in r:
                print(f"{p:7} {label:24} (no result)")
                continue
            dec = f"{out}/{p}-{name}-check.json"
            inv = load(dec)["invariance"] if os.path.exists(dec) else None
            bitwise = f"{inv['bitwise_equal']}/{inv['trials']}" if inv else "-"
            mem = r.get("memory", {})
            peak = (mem.get("device_peak_bytes", 0) - mem.get("weights_bytes", 0)) / 1e9
            agree = "(reference)" if name == "f16" else (
                agreement(f"{out}/{p}-f16-check.json", dec) if os.path.exists(dec) and
                os.path.exists(f"{out}/{p}-f16-check.json") else "-")
            print(f"{p:7} {label:24} {r['single_ms']['median']:10.2f} {r['single_ms']['p95']:8.2f} "
                  f"{r['throughput']['batch32']['decisions_per_s']:10.1f} {bitwise:>8} "
                  f"{mem.get('weights_bytes', 0) / 1e9:10.2f} {peak:9.2f}  {agree}")
            if name != "f16":
                plan = r.get("gemm_plan", {})
                print(f"{'':7}   plan: " + ", ".join(f"{k}={plan.get(k)}" for k in (
                    "fp8_scales", "fp8_quant", "fp8_mm", "fp8_requantized_parts", "fp8_quant_error") if k in plan))


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    {"check": check, "bench-channel": bench_channel, "summary": summary}[cmd](*args)
PY
TOOL="python3 /tmp/fp8_tool.py"
CLI="python3 -m basal_local.cli"

if has bench; then
  for P in ${PRESETS:-4.5B max}; do
    M=/tmp/m-$P; rm -rf $M
    step 150 $CLI make-test-model $M --preset $P --device cuda > /dev/null || { echo "make-test-model $P: no model"; continue; }
    el "$P bf16 built"
    step 150 $CLI bench --model $M --device cuda --dtype f16 --json > $OUT/$P-f16.json 2> $OUT/$P-f16.err || tail -3 $OUT/$P-f16.err
    el "$P f16 bench"
    step 120 $TOOL check $M f16 $OUT/$P-f16-check.json 2> $OUT/$P-f16-check.err || tail -3 $OUT/$P-f16-check.err
    el "$P f16 decisions + invariance"
    # the same weights as a ModelOpt FP8 checkpoint (per-tensor weight scales, input scales calibrated on CUDA)
    step 150 python3 -c "import sys; from pathlib import Path; from basal_local.model.testformats import convert_test_model; convert_test_model(Path(sys.argv[1]), 'fp8', device='cuda')" $M 2> $OUT/$P-convert.err \
      || { tail -3 $OUT/$P-convert.err; rm -rf $M; continue; }
    du -sh $M/model.safetensors; el "$P fp8 checkpoint written"
    step 150 $CLI bench --model $M --device cuda --dtype auto --json > $OUT/$P-fp8.json 2> $OUT/$P-fp8.err || tail -3 $OUT/$P-fp8.err
    el "$P fp8 bench"
    step 120 $TOOL check $M auto $OUT/$P-fp8-check.json 2> $OUT/$P-fp8-check.err || tail -3 $OUT/$P-fp8-check.err
    el "$P fp8 decisions + invariance"
  done
fi
if has tests; then  # the fp8 tests (the checkpoint route's GPU tests and the on-the-fly route's)
  rm -rf /tmp/t && cp -r tests /tmp/t
  step ${TEST_TIMEOUT:-120} python3 -m pytest -q -x -p no:cacheprovider t/test_fp8.py -k cuda \
     "t/test_cuda.py::test_cuda_fp8_quantizer_matches_twin_and_gemm_matches_dequantized" 2>&1 \
     | grep -v "it/s" > "$OUT/fp8_tests.txt"
  grep -E "passed|failed|Error|assert" "$OUT/fp8_tests.txt" | tail -15; el tests
fi

if has channel; then  # the fp8 checkpoints kept above (4.5B ~5 GB, max ~17 GB on disk), while time is left
  for P in ${PRESETS:-4.5B max}; do
    M=/tmp/m-$P; [ -f $M/hf_quant_config.json ] || continue
    step 150 $TOOL bench-channel $M $OUT/$P-fp8-channel.json 2> $OUT/$P-fp8-channel.err || tail -3 $OUT/$P-fp8-channel.err
    step 120 $TOOL check $M auto $OUT/$P-fp8-channel-check.json channel 2>> $OUT/$P-fp8-channel.err || tail -3 $OUT/$P-fp8-channel.err
    el "$P fp8 channel bench + decisions"
  done
fi
python3 /tmp/fp8_tool.py summary $OUT ${PRESETS:-4.5B max} | tee $OUT/summary.txt
rm -rf /tmp/m-4.5B /tmp/m-max
el done
