#!/usr/bin/env bash
# The state cache on one GPU, in one device call (docs/PERFORMANCE.md "State cache"): the CUDA tests, then
# `bench --cache` (a 17.8k-token document, 5 questions, then 5 others: templates-only engine vs cached engine),
# then the mixed HTTP stream (`bench --http --documents`) against a daemon with the cache off and one with it on.
# Here (the repo root on the device): .whl/ holds the basal-local wheel, .whl/deps the daemon's wheels and
# .whl/tests the test suite. STAGES: "tests bench http" (default all); PRESET (default 4.5B). Results in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/deps/*.whl .whl/basal_local-*.whl || exit 1
export PYTHONPATH=/tmp/site BASAL_LOCAL_HOME=/tmp/bh
STAGES=${STAGES:-tests bench http}
PRESET=${PRESET:-4.5B}
M=/tmp/m-$PRESET
has() { [[ " $STAGES " == *" $1 "* ]]; }
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} | tee "$OUT/gpu.txt"
cli() { (cd /tmp && python3 -m basal_local.cli "$@"); }
if has tests; then
  rm -rf /tmp/t && mkdir -p /tmp/t && cp -r .whl/tests /tmp/t/tests
  (cd /tmp/t && timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -n 0 -o addopts="" -p no:cacheprovider \
     ${TESTS:-tests/test_cuda.py tests/test_cuda_kernels.py} 2>&1 | tail -25) | tee "$OUT/tests.txt"
  el tests
fi
if has bench || has http; then
  [ -d $M ] || cli make-test-model $M --preset $PRESET --device cuda > /dev/null || exit 1
  el "model $PRESET"
fi
if has bench; then
  cli bench --model $M --device cuda --cache --documents ${DOCS:-3} --json > "$OUT/bench-cache.json" 2> "$OUT/bench-cache.err"
  tail -3 "$OUT/bench-cache.err"
  python3 - "$OUT/bench-cache.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print({k: r.get(k) for k in ("state_tokens", "first_ms", "second_ms", "first_ratio_cached_vs_templates_only",
                             "fill_cost_ratio_same_engine", "second_speedup", "bitwise_equal", "documents")})
print("per document:", [{k: v for k, v in d.items()} for d in r["per_document"]])
print("cache:", r["cache"], "memory:", r["memory"])
PY
  el bench
fi
if has ab; then  # the single-decision and batch figures of .whl/ab's wheel (the landed main) and ours, side by side
  rm -rf /tmp/site-ab && mkdir -p /tmp/site-ab && cp -r /tmp/site/. /tmp/site-ab/ && \
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-ab .whl/ab/*.whl
  for who in ab ours ab ours; do
    site=/tmp/site; [ $who = ab ] && site=/tmp/site-ab
    (cd /tmp && PYTHONPATH=$site python3 -m basal_local.cli bench --model $M --device cuda --json 2> /dev/null) \
      > "$OUT/ab-$who.json"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], 'single median', r['single_ms']['median'], 'p90', r['single_ms'].get('p90'), 'batch32/s', r['throughput']['batch32']['decisions_per_s'])" "$OUT/ab-$who.json" $who
  done
  el ab
fi
if has http; then
  for cache in off auto; do
    port=$((8100 + RANDOM % 500))
    (cd /tmp && python3 -m basal_local.cli serve --model $M --device cuda --port $port --prefix-cache $cache \
       > "$OUT/serve-$cache.log" 2>&1 &)
    for i in $(seq 1 240); do curl -sf localhost:$port/health > /dev/null && break; sleep 1; done
    if ! curl -sf localhost:$port/health > /dev/null; then echo "daemon ($cache) did not start:"; tail -20 "$OUT/serve-$cache.log"; continue; fi
    el "daemon $cache ready"
    cli bench --http http://127.0.0.1:$port --documents ${HTTP_DOCS:-20} --per-document ${PER_DOC:-10} \
      --clients ${CLIENTS:-32} --json > "$OUT/http-$cache.json" 2> "$OUT/http-$cache.err"
    cat "$OUT/http-$cache.json"; echo; tail -2 "$OUT/http-$cache.err"
    pkill -f "basal_local.cli serve" ; sleep 3
    el "http $cache"
  done
fi
