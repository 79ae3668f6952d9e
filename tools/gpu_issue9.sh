#!/usr/bin/env bash
# Issue 9 in one device call: kernels vs twins and timings (tools/kernel_bench.py), the CUDA tests, then the
# 4.5B bench with the figures of the issue's table. Results land in $OUT; a short table prints last.
# Here: rm -rf .whl && .venv/bin/pip wheel -q --no-deps -w .whl . platformdirs   (then carry .whl)
# STAGES (default "kernels tests bench"): any of kernels, tests, bench, final (ours + extras + both transformers
# baselines in one JSON), compiled, gemm-triton, profile.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
STAGES=${STAGES:-kernels tests bench}
PRESET=${PRESET:-4.5B}
has() { [[ " $STAGES " == *" $1 "* ]]; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"; } | tee "$OUT/gpu.txt"
if has kernels; then
  timeout 240 python3 tools/kernel_bench.py "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.txt" | tail -40
fi
if has bench || has final || has compiled || has gemm-triton || has profile; then
  t0=$(date +%s)
  [ -d /tmp/m-$PRESET ] || (cd /tmp && python3 -m basal_local.cli make-test-model /tmp/m-$PRESET --preset $PRESET --device cuda) || exit 1
  echo "make-test-model $PRESET: $(( $(date +%s) - t0 )) s"
fi
run_bench() {  # name, extra args...
  local name=$1; shift
  (cd /tmp && BASAL_BENCH_PARTIAL="$OUT/partial-$name.json" timeout ${BENCH_TIMEOUT:-400} python3 -m basal_local.cli bench --model /tmp/m-$PRESET --device cuda \
     --repeat 2 --json "$@" > "$OUT/bench-$PRESET-$name.json" 2> "$OUT/bench-$PRESET-$name.err")
  tail -3 "$OUT/bench-$PRESET-$name.err"; cat "$OUT/bench-$PRESET-$name.json"; echo
}
has bench && run_bench tree --baseline ${BASELINE:-transformers} --invariance ${INVARIANCE:-8} ${LONG:---long-doc}
has gemm-triton && BASAL_LOCAL_GEMM=triton run_bench tree-triton-gemm --invariance ${INVARIANCE:-8} ${LONG:---long-doc}
has final && run_bench final --baseline both --invariance ${INVARIANCE:-8} --long-doc
has compiled && BENCH_TIMEOUT=${COMPILED_TIMEOUT:-400} run_bench compiled --baseline transformers-compiled
has profile && timeout ${PROFILE_TIMEOUT:-200} python3 tools/profile_forward.py /tmp/m-$PRESET "$OUT/profile.txt"
if has tests; then
  rm -rf /tmp/t && cp -r tests /tmp/t
  (cd /tmp && timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -s -x -p no:cacheprovider t/test_cuda.py 2>&1 | grep -v "it/s" > "$OUT/cuda_tests.txt")
  grep -E "passed|failed|error|vs|invariance|Error|assert" "$OUT/cuda_tests.txt" | tail -30
fi
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("bench-*.json")) + sorted(pathlib.Path(sys.argv[1]).glob("partial-*.json")):
    try:
        r = json.loads(f.read_text())
    except Exception:
        print(f.name, "no JSON"); continue
    if "single_ms" not in r: continue
    b = r.get("baseline", {}); c = r.get("baseline_compiled", {}); x = r.get("extras", {})
    print(f"{f.name}: single {r['single_ms']['median']} ms (p95 {r['single_ms']['p95']}), "
          f"batch32 {r['throughput']['batch32']['decisions_per_s']} dec/s, batch16 {r['throughput']['batch16']['decisions_per_s']}, "
          f"warmup {r['warmup_s']} s, mem {r.get('memory_after_bench')}")
    if b: print(f"   transformers eager: {b['single_ms']['median']} ms, {b['throughput']['batch32']['decisions_per_s']} dec/s")
    if c: print(f"   transformers compiled: {c.get('single_ms')}, {c.get('throughput')}, {c.get('error', '')}")
    for k, v in x.items():
        print(f"   {k}: {v}")
PY
