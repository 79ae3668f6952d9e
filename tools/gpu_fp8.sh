#!/usr/bin/env bash
# Issue 9, the fp8 GEMM route in one device call (nvidia-h200): the max preset's bench with --dtype fp8 (single
# decision, batches, alone vs amid 31), tools/fp8_check.py (GEMM microbench per shape, sample-set agreement with
# f16, in-process invariance), the GPU tests of the fp8 route, the f16 bench of the same model for the side by
# side, a kernel profile of the fp8 single decision, then the 4.5B preset with fp8. Stages run in that order
# while the call's elapsed time is under their guard (BUDGET_S, default 290). FP8_SUBSETS: the fp8_check runs,
# e.g. "qkv,o,gate_up,down;gate_up,down;gate_up" (BASAL_LOCAL_FP8_GEMMS values). Results in $OUT.
# Here: .whl holds the basal-local wheel and the daemon's wheels (see tools/gpu_gpu2.sh).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-290}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site BASAL_LOCAL_HOME=/tmp/bh
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/log.txt; }
left() { [ $(( $(date +%s) - T0 + $1 )) -le $BUDGET_S ]; }  # a stage of ~$1 s still fits
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cublas', torch.backends.cuda.preferred_blas_library(), 'triton', triton.__version__)"
  nproc; } | tee "$OUT/gpu.txt"
TOOLS=$PWD/tools
summary() {  # bench json -> the key figures
  python3 -c "
import json,sys
r=json.load(open(sys.argv[1])); x=r.get('extras',{})
print(sys.argv[2], 'single', r['single_ms'], 'b32', r['throughput']['batch32']['decisions_per_s'], 'b16', r['throughput']['batch16']['decisions_per_s'], 'inv', x.get('invariance_alone_vs_amid_31'), 'mem', r.get('memory_after_bench'), 'plan', r.get('gemm_plan'))
" "$1" "$2" 2>&1 | tail -1
}
(cd /tmp && timeout 120 python3 -m basal_local.cli make-test-model /tmp/m-max --preset max --device cuda > /dev/null) || exit 1
el make max
(cd /tmp && BASAL_BENCH_PARTIAL=$OUT/partial-max-fp8.json timeout 100 python3 -m basal_local.cli bench --model /tmp/m-max \
   --device cuda --dtype fp8 --repeat 1 --json --invariance 8 > $OUT/bench-max-fp8.json 2> $OUT/bench-max-fp8.err)
summary $OUT/bench-max-fp8.json max-fp8; tail -3 $OUT/bench-max-fp8.err; el bench max fp8
if left 70; then
  (cd /tmp && timeout 110 python3 $TOOLS/fp8_check.py /tmp/m-max $OUT/fp8-check-max.json "--subsets=${FP8_SUBSETS:-qkv,o,gate_up,down}" > $OUT/fp8-check-max.txt 2> $OUT/fp8-check-max.err)
  cut -c1-400 $OUT/fp8-check-max.txt; tail -3 $OUT/fp8-check-max.err; el fp8_check max
fi
if left 40; then
  rm -rf /tmp/t && cp -r tests /tmp/t
  (cd /tmp && timeout 80 python3 -m pytest -q -x -p no:cacheprovider t/test_cuda.py -k "fp8 or fused" -s 2>&1 \
     | grep -v "it/s" > "$OUT/cuda_tests.txt")
  grep -E "passed|failed|Error|assert|fp8 vs" "$OUT/cuda_tests.txt" | tail -12; el tests
fi
if left 40; then
  (cd /tmp && timeout 80 python3 -m basal_local.cli bench --model /tmp/m-max --device cuda --repeat 1 --json \
     > $OUT/bench-max-f16.json 2> $OUT/bench-max-f16.err)
  summary $OUT/bench-max-f16.json max-f16; el bench max f16
fi
if left 35; then
  (cd /tmp && timeout 60 python3 $TOOLS/profile_forward.py /tmp/m-max $OUT/profile-max-fp8.txt tree:fp8 > /dev/null \
     2> $OUT/profile-max-fp8.err); head -16 $OUT/profile-max-fp8.txt; el profile fp8
fi
if left 60; then
  rm -rf /tmp/m-max
  (cd /tmp && timeout 60 python3 -m basal_local.cli make-test-model /tmp/m-4.5B --preset 4.5B --device cuda > /dev/null) &&
  (cd /tmp && timeout 70 python3 -m basal_local.cli bench --model /tmp/m-4.5B --device cuda --dtype fp8 --repeat 1 --json \
     --invariance 8 > $OUT/bench-4.5B-fp8.json 2> $OUT/bench-4.5B-fp8.err)
  summary $OUT/bench-4.5B-fp8.json 4.5B-fp8; el bench 4.5B fp8
fi
el end
