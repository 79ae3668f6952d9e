#!/usr/bin/env bash
# One device call that builds, checks and times everything (docs/PERFORMANCE.md, docs/SCALING.md). Run from the
# repository root on the GPU host; results in $OUT (one folder; PACK=1 leaves a single archive of it).
#   .whl/       the basal-local wheel and the daemon's dependency wheels the host lacks (SKIP_INSTALL=1: installed)
# STAGES (default "tests bench http"), in this order:
#   tests     tests/test_cuda.py + tests/test_cuda_kernels.py from a copy of tests/
#   bench     in-process bench of PRESET (default 4.5B): --repeat 2 --invariance 8 $BENCH_ARGS (default --long-doc)
#   compiled  the same bench beside transformers under torch.compile (--baseline transformers-compiled)
#   max, mini the max preset's bench (single and batch), the mini preset's with the eager transformers baseline
#   http      a daemon on one GPU: HTTP_RUNS (default "c1 c32i c64": cN = N clients, i = + invariance 8,
#             n = a new connection per request), each with the daemon's CPU use; the answers saved
#   proc1     two replica processes on one GPU (c32), answers compared with the http stage's
#   multi     two GPUs in one process, multiproc: a worker process per GPU (MULTI_RUNS, default "c64 c128")
#   ray       `serve --ray` on a local Ray cluster (Ray Serve from RAY_SITE, default .ray/ray-site-cp312.tar.xz,
#             made by tools/ray_site.sh; RAY_RUNS default "c1 c64", RAY_ARGS default 2 GPU replicas, RAY2_ARGS)
#   prof      kernel time per family of a single decision and of 32 (tools/profile_forward.py; PROF_MODEL)
# REQ_PER_CLIENT (default 40) and C1_REQUESTS (default 268): requests per HTTP run. Each step has a timeout.
set -uo pipefail
export PYTHONUNBUFFERED=1 BASAL_LOCAL_HOME=/tmp/bh
ROOT=$PWD; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
STAGES=${STAGES:-tests bench http}; PRESET=${PRESET:-4.5B}; M=${MODEL_DIR:-/tmp/m-$PRESET}
has() { [[ " $STAGES " == *" $1 "* ]]; }
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
cli() { (cd /tmp && python3 -m basal_local.cli "$@"); }  # from /tmp: the installed wheel, not this checkout
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'python', sys.version.split()[0], 'gpus', torch.cuda.device_count())"
  nproc; } | tee "$OUT/gpu.txt"
model() { [ -d $1 ] || (cd /tmp && timeout 200 python3 -m basal_local.cli make-test-model $1 --preset $2 --device cuda > /dev/null); }
summary() {  # bench JSON files -> one line each
  python3 - "$@" <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        r = json.load(open(path))
    except Exception as exc:
        print(path, "unreadable:", exc); continue
    x, t = r.get("extras", {}), r.get("throughput", {})
    print(path.split("/")[-1], "single", r.get("single_ms"), "b32", t.get("batch32", {}).get("decisions_per_s"),
          "b16", t.get("batch16", {}).get("decisions_per_s"), "warmup_s", r.get("warmup_s"),
          "invariance", x.get("invariance_alone_vs_amid_31"), {k: v for k, v in x.items() if k.startswith(("long", "baseline"))},
          "memory", r.get("memory_after_bench"))
PY
}
bench() {  # name model-dir bench-args...
  local name=$1 dir=$2; shift 2
  (cd /tmp && BASAL_BENCH_PARTIAL=$OUT/partial-$name.json timeout ${BENCH_TIMEOUT:-300} python3 -m basal_local.cli \
     bench --model $dir --device cuda --json "$@" > $OUT/bench-$name.json 2> $OUT/bench-$name.err)
  [ -s $OUT/bench-$name.json ] || cp $OUT/partial-$name.json $OUT/bench-$name.json 2>/dev/null
  summary $OUT/bench-$name.json; el bench $name
}
if has tests; then
  rm -rf /tmp/t && cp -r tests /tmp/t
  (cd /tmp && timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -p no:faker t/test_cuda.py \
     t/test_cuda_kernels.py 2>&1 | grep -v "it/s" > "$OUT/cuda_tests.txt")
  grep -E "passed|failed|Error|FAILED" "$OUT/cuda_tests.txt" | tail -15; el tests
fi
if has bench || has compiled || has http || has proc1 || has multi || has multiproc || has ray || has prof; then
  model $M $PRESET || exit 1; el model $PRESET
fi
has bench && bench $PRESET $M --repeat 2 --invariance ${INVARIANCE:-8} ${BENCH_ARGS---long-doc}
has compiled && bench $PRESET-compiled $M --repeat 2 --baseline transformers-compiled
has max && model /tmp/m-max max && bench max /tmp/m-max --repeat 1
has mini && model /tmp/m-mini mini && bench mini /tmp/m-mini --repeat 2 --invariance ${INVARIANCE:-8} --baseline transformers
tree_of() { echo $1; for c in $(pgrep -P $1); do tree_of $c; done; }
cpu_ticks() {  # pid -> "name ticks" per thread of the process and every process below it (replica workers, Ray)
  for p in $(tree_of $1); do
    local name; name=$(tr '\0\n' '  ' < /proc/$p/cmdline 2>/dev/null | cut -c1-40)
    for t in /proc/$p/task/*; do echo "$p:$(cat $t/comm 2>/dev/null | tr ' ' _)/${name// /_} $(awk '{print $14+$15}' $t/stat 2>/dev/null)"; done
  done 2>/dev/null
}
cpu_report() {  # before-file after-file seconds label: cores used by the daemon and its busiest threads
  python3 - "$@" <<'PY' | tee -a $OUT/cpu.txt
import sys
before = dict(l.split() for l in open(sys.argv[1]) if len(l.split()) == 2)
rows = sorted(((int(t) - int(before.get(n, 0))) / 100 / float(sys.argv[3]), n)
              for n, t in (l.split() for l in open(sys.argv[2]) if len(l.split()) == 2))[::-1]
print(sys.argv[4], "cores used %.2f; busiest threads:" % sum(c for c, _ in rows),
      ", ".join("%s %.2f" % (n[:60], c) for c, n in rows[:8]))
PY
}
serve_and_measure() {  # name "runs" serve-args...
  local name=$1 runs=$2; shift 2
  local port=$((18000 + RANDOM % 1000)) up=""
  (cd /tmp && exec python3 -m basal_local.cli serve --model $M --port $port "$@") > $OUT/serve-$name.log 2>&1 &
  local pid=$!
  for _ in $(seq 1 ${READY_S:-150}); do
    curl -sf http://127.0.0.1:$port/health > /dev/null && up=1 && break
    kill -0 $pid 2>/dev/null || break; sleep 1
  done
  if [ -z "$up" ]; then echo "daemon $name did not start:"; tail -15 $OUT/serve-$name.log; kill $pid 2>/dev/null; return 1; fi
  el "daemon $name ready"
  local U=http://127.0.0.1:$port
  for r in $runs; do
    local n=${r//[cin]/} extra="" tag=""
    [[ $r == *i ]] && extra="--invariance ${INVARIANCE:-8}"
    [[ $r == *n ]] && extra="$extra --new-connections" && tag=n
    local total=$((n * ${REQ_PER_CLIENT:-40})); [ $n = 1 ] && total=${C1_REQUESTS:-268}
    [ -e $OUT/http-$name-c$n$tag.json ] && tag=$tag-2
    cpu_ticks $pid > /tmp/before.txt; local t0=$(date +%s.%N)
    cli bench --http $U --json --clients $n --requests $total $extra > $OUT/http-$name-c$n$tag.json
    cpu_ticks $pid > /tmp/after.txt
    cpu_report /tmp/before.txt /tmp/after.txt $(python3 -c "import time; print(time.time() - $t0)") "$name c$n$tag"
    echo "$name c$n$tag: $(cat $OUT/http-$name-c$n$tag.json)"
  done
  [ -n "${ANSWERS-1}" ] && (cd /tmp && timeout 300 python3 $ROOT/tools/http_answers.py $U $OUT/answers-$name.json 64)
  curl -s $U/api/stats > $OUT/stats-$name.json
  kill $pid; wait $pid 2>/dev/null; el "daemon $name done"
}
compare() { [ -f $OUT/answers-1gpu.json ] && [ -f $OUT/answers-$1.json ] && (cd /tmp && python3 \
  $ROOT/tools/http_answers.py --compare $OUT/answers-1gpu.json $OUT/answers-$1.json) | tee $OUT/answers-compare-$1.txt; }
has http && serve_and_measure 1gpu "${HTTP_RUNS:-c1 c32i c64}" --device cuda
has proc1 && serve_and_measure 1gpu-proc2 "c32" --device cuda --replicas 2 --replica-processes && compare 1gpu-proc2
has multi && serve_and_measure 2gpu "${MULTI_RUNS:-c64 c128}" --devices cuda:0,cuda:1 --no-replica-processes && compare 2gpu
has multiproc && serve_and_measure 2gpu-proc "${MULTI_RUNS:-c64 c128}" --devices cuda:0,cuda:1 --replica-processes && compare 2gpu-proc
if has ray; then  # Ray Serve travels as a pruned site folder; its memory monitor and usage reports off here
  RSITE=/tmp/rsite/site; rm -rf /tmp/rsite && mkdir -p /tmp/rsite
  [ -f ${RAY_SITE:-.ray/ray-site-cp312.tar.xz} ] && tar -xJf ${RAY_SITE:-.ray/ray-site-cp312.tar.xz} -C /tmp/rsite
  for w in $(ls .ray/*.whl 2>/dev/null); do python3 -m zipfile -e $w $RSITE; done  # wheels beside it go over it
  RAY_PATH=${PYTHONPATH:-}; [ -d $RSITE/ray ] && RAY_PATH=$RSITE:$RAY_PATH
  if PYTHONPATH=$RAY_PATH python3 -c "import ray.serve" 2> $OUT/ray-import.err; then
    ( export PYTHONPATH=$RAY_PATH RAY_AUTH_MODE=disabled READY_S=300 RAY_memory_monitor_refresh_ms=0 RAY_USAGE_STATS_ENABLED=0
      serve_and_measure ray "${RAY_RUNS:-c1 c64}" --ray ${RAY_ARGS:---device cuda --min-replicas 2} && compare ray
      # RAY2_ARGS: a second deployment after it (e.g. more fronts), RAY2_RUNS its runs, without the answers
      [ -n "${RAY2_ARGS:-}" ] && ANSWERS= serve_and_measure ray-b "${RAY2_RUNS:-c64}" --ray $RAY2_ARGS )
  else
    echo "ray stage skipped: Ray Serve does not import"; tail -3 $OUT/ray-import.err
  fi
fi
if has prof; then
  (cd /tmp && timeout ${PROF_TIMEOUT:-200} python3 $ROOT/tools/profile_forward.py ${PROF_MODEL:-$M} $OUT/profile.txt \
     > /dev/null 2> $OUT/profile.err); head -40 $OUT/profile.txt; el prof
fi
el end
if [ -n "${PACK:-}" ]; then (cd $OUT && tar -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz $OUT/all.tgz); fi
