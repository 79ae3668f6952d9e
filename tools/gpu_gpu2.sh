#!/usr/bin/env bash
# Issues 9 and 13 in one device call (nvidia-h200-x2): the CUDA tests, the M-chunked cuBLAS microbenchmark,
# in-process benches per GEMM route, the HTTP figures against a daemon on cuda:0, then the same daemon on
# cuda:0,cuda:1 (throughput at 64 clients, answers bitwise equal to the one-GPU daemon's). Results in $OUT.
# Here: .whl holds the basal-local wheel and the daemon's wheels (litestar, msgspec, uvicorn, zstandard, ...).
# STAGES (default "tests bench http coalesce multi max"; also multiproc, ray, gemm, hostprof, mini, compiled, httptools,
# sweep, proc1, nopipe, profmax (after max), attn (tools/attn_bench.py; ATTN_TILINGS), uvloop, fp8sub (after max; FP8_SUBSETS),
# prof (4.5B kernel profile), maxab (the max bench with .whl/ab's wheel beside ours, twice), gsweep (tools/graph_sweep.py), gsweepab (graph replays on max: ab wheel / ours / ours untimed), ltprobe (tools/lt_probe.py; LTPROBE_ROWS), maxlt (after max: the max bench with and without cuBLASLt pins, twice);
# BENCH_TILINGS / MAX_TILINGS: attention tilings (block_m:block_n:warps:stages, or default) of the bench / max runs; HTTP_RUNS (default "c1 c32i c64": cN = N clients, i = + the
# invariance check, n = a new connection per request); MULTI_RUNS (default "c64 c128"); MULTI_DEVICES (multiproc's,
# default "--devices cuda:0,cuda:1"); REQ_PER_CLIENT (default 40) and C1_REQUESTS (default 268): requests of a run;
# GEMMS: the routes the bench stage runs
# (route[:chunk], default "verified"); BENCH_ARGS (default "--long-doc").
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export BASAL_LOCAL_HOME=/tmp/bh
(cd /tmp && python3 -c "import basal_local.server.daemon, basal_local.server.app, basal_local.commands.serving") || echo "DAEMON IMPORT FAILS"
STAGES=${STAGES:-tests bench http coalesce multi max}
PRESET=${PRESET:-4.5B}
M=${MODEL_DIR:-/tmp/m-$PRESET}
has() { [[ " $STAGES " == *" $1 "* ]]; }
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
  nproc; } | tee "$OUT/gpu.txt"
if has sweep; then  # attention tilings (tools/attn_sweep.py), before everything else: the fastest by >= 3 % is
  # exported for the rest of the call (tests included); the code's default is the first of SWEEP
  [ -d $M ] || (cd /tmp && python3 -m basal_local.cli make-test-model $M --preset $PRESET --device cuda > /dev/null) || exit 1
  for cfg in ${SWEEP:-64:64:4 32:64:4 64:128:8 32:128:4}; do
    IFS=: read bm bn w <<< "$cfg"
    (cd /tmp && BASAL_LOCAL_ATTN_BLOCK_M=$bm BASAL_LOCAL_ATTN_BLOCK_N=$bn BASAL_LOCAL_ATTN_WARPS=$w \
      timeout ${SWEEP_TIMEOUT:-90} python3 $OLDPWD/tools/attn_sweep.py $M 2>> $OUT/sweep.err | tail -1) | tee -a $OUT/sweep.txt
  done
  eval "$(python3 - $OUT/sweep.txt <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
if rows:
    base, best = rows[0], min(rows, key=lambda r: r["single_ms_median"])
    if best["single_ms_median"] < 0.97 * base["single_ms_median"]:
        print(f"export BASAL_LOCAL_ATTN_BLOCK_M={best['block_m']} BASAL_LOCAL_ATTN_BLOCK_N={best['block_n']} "
              f"BASAL_LOCAL_ATTN_WARPS={best['warps']}")
PY
)"
  echo "attention tiling for the rest of the call: ${BASAL_LOCAL_ATTN_BLOCK_M:-64} x ${BASAL_LOCAL_ATTN_BLOCK_N:-64}, ${BASAL_LOCAL_ATTN_WARPS:-4} warps" | tee -a $OUT/sweep.txt
  el sweep
fi
tiling_env() {  # block_m:block_n:warps:stages -> the attention tiling variables (tools/attn_bench.py's notation)
  IFS=: read bm bn w st <<< "$1"; echo "BASAL_LOCAL_ATTN_BLOCK_M=$bm BASAL_LOCAL_ATTN_BLOCK_N=$bn BASAL_LOCAL_ATTN_WARPS=$w BASAL_LOCAL_ATTN_STAGES=$st"
}
if has attn; then  # tree-attention variants per call inside a CUDA graph (tools/attn_bench.py)
  timeout ${ATTN_TIMEOUT:-240} python3 tools/attn_bench.py $OUT/attn.jsonl ${ATTN_TILINGS:-} > $OUT/attn.txt 2> $OUT/attn.err
  grep -v '^{' $OUT/attn.txt | tail -40; tail -3 $OUT/attn.err
  # "auto" in BENCH_TILINGS / MAX_TILINGS: the tiling with the least single-decision time (4.5B + max) whose batch
  # of 32 and long document take at most 3 % / 10 % more than the first tiling's
  python3 - $OUT/attn.jsonl <<'PY' | tee $OUT/attn-best.txt
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "ms" in l]
by = {}
for r in rows:
    if "ms" in r:
        by.setdefault(r["tiling"], {})[(r["preset"], r["case"])] = r["ms"]
specs = list(by)
base = by[specs[0]]
ok = [s for s in specs if by[s].get(("4.5B", "batch32"), 9e9) <= 1.03 * base[("4.5B", "batch32")]
      and by[s].get(("4.5B", "long17k"), 9e9) <= 1.10 * base[("4.5B", "long17k")]]
print(min(ok or specs[:1], key=lambda s: by[s].get(("4.5B", "single"), 9e9) + by[s].get(("max", "single"), 9e9)))
PY
  if [ -n "${ATTN_EXPORT:-}" ] && [ "$(cat $OUT/attn-best.txt)" != "$(echo $ATTN_TILINGS | cut -d' ' -f1)" ]; then
    export $(tiling_env $(cat $OUT/attn-best.txt))  # ATTN_EXPORT: the pick runs the rest of the call (tests too)
    echo "attention tiling for the rest of the call: $(cat $OUT/attn-best.txt)"
  fi
  el attn
fi
if has ltprobe; then  # cuBLASLt algorithms per shape and row count: bits vs the 1,024-row call, time (tools/lt_probe.py)
  (cd /tmp && timeout ${LTPROBE_TIMEOUT:-240} python3 $OLDPWD/tools/lt_probe.py $OUT/lt_probe.jsonl ${LTPROBE_ROWS:-} \
     > $OUT/lt_probe.txt 2> $OUT/lt_probe.err); cut -c1-260 $OUT/lt_probe.txt | tail -60; tail -3 $OUT/lt_probe.err
  el ltprobe
fi
if has tests; then
  rm -rf /tmp/t && cp -r tests /tmp/t
  (cd /tmp && timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -x -p no:cacheprovider t/test_cuda.py t/test_cuda_kernels.py 2>&1 \
     | grep -v "it/s" > "$OUT/cuda_tests.txt")
  grep -E "passed|failed|Error|assert" "$OUT/cuda_tests.txt" | tail -15; el tests
fi
if has gemm; then
  timeout ${GEMM_TIMEOUT:-120} python3 tools/gemm_chunks.py "$OUT/gemm_chunks.json" ${GEMM_PRESETS:-4.5B} 2>&1 | tail -4; el gemm
fi
if has bench || has http || has multi || has multiproc || has ray || has hostprof || has compiled; then
  [ -d $M ] || (cd /tmp && python3 -m basal_local.cli make-test-model $M --preset $PRESET --device cuda > /dev/null) || exit 1
  el make-test-model
fi
if has bench; then
  for tl_ in ${BENCH_TILINGS:-default}; do
  [ $tl_ = auto ] && tl_=$(cat $OUT/attn-best.txt 2>/dev/null || echo default)
  for g in ${GEMMS:-verified}; do
    route=${g%%:*}; chunk=${g#*:}; [ "$chunk" = "$g" ] && chunk=256
    name=$route$([ $route = chunked ] && echo $chunk)$([ $tl_ = default ] || echo "-${tl_//:/x}")
    (cd /tmp && env $([ $tl_ = default ] || tiling_env $tl_) BASAL_LOCAL_GEMM=$route BASAL_LOCAL_GEMM_CHUNK=$chunk BASAL_BENCH_PARTIAL=$OUT/partial-$name.json \
      timeout ${BENCH_TIMEOUT:-150} python3 -m basal_local.cli bench --model $M --device cuda --repeat 2 --json \
      --invariance ${INVARIANCE:-8} ${BENCH_ARGS---long-doc} > $OUT/bench-$name.json 2> $OUT/bench-$name.err)
    python3 -c "
import json,sys
r=json.load(open('$OUT/bench-$name.json')) if open('$OUT/bench-$name.json').read().strip() else json.load(open('$OUT/partial-$name.json'))
x=r.get('extras',{})
print('$name', r.get('gemm_plan'))
print('$name', r['single_ms'], r['throughput']['batch32']['decisions_per_s'], r['throughput']['batch16']['decisions_per_s'], 'warmup', r['warmup_s'], x.get('invariance_alone_vs_amid_31'), {k: v for k, v in x.items() if k.startswith('long')}, r.get('memory_after_bench'))
" 2>&1 | tail -2
    el bench $name
  done
  done
fi
wait_ready() {  # port pid (READY_S: seconds to wait, default 150)
  for _ in $(seq 1 ${READY_S:-150}); do
    curl -sf http://127.0.0.1:$1/health > /dev/null && return 0
    kill -0 $2 2>/dev/null || return 1
    sleep 1
  done; return 1
}
ticks() {  # pid -> "tid pid:name cputicks" per thread, of the process and every process below it (replica
  # processes, a local Ray cluster's raylet, GCS, proxy and actors); name: the program's base name, or Ray's title
  for p in $(ps -e -o pid=,ppid= | awk -v root=$1 '{kids[$2] = kids[$2] " " $1} END {todo = root; while (todo != "") {
      split(todo, a, " "); todo = ""; for (i in a) { print a[i]; todo = todo " " kids[a[i]] } } }'); do
    local name; name=$(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | awk '{n = $1; if (n !~ /^ray::/) sub(/.*\//, "", n)
      if (n ~ /^python/) for (i = 2; i <= NF; i++) if ($i !~ /^-/ || $i == "-m" || $i == "-c") {
        x = ($i == "-m") ? $(i + 1) : $i; sub(/.*\//, "", x); n = n "/" x; break }
      print substr(n, 1, 40)}')
    for t in /proc/$p/task/*; do echo "$(basename $t) $p:${name:-?} $(awk '{print $14+$15}' $t/stat)"; done
  done 2>/dev/null
}
cpu_report() {  # pid, before-file, seconds, label: process cores used and the busiest threads
  ticks $1 > /tmp/after.txt
  python3 - /tmp/before.txt /tmp/after.txt $3 "$4" <<'PY' | tee -a $OUT/cpu.txt
import sys
b = {l.split()[0]: int(l.split()[2]) for l in open(sys.argv[1]) if len(l.split()) == 3}
rows = []
for l in open(sys.argv[2]):
    p = l.split()
    if len(p) == 3:
        rows.append(((int(p[2]) - b.get(p[0], 0)) / 100.0 / float(sys.argv[3]), p[1]))
rows.sort(reverse=True)
procs = {}
for c, n in rows:
    procs[n] = procs.get(n, 0.0) + c
print(sys.argv[4], "cores used %.2f;" % sum(r[0] for r in rows), "per process:",
      ", ".join("%s %.2f" % kv for kv in sorted(procs.items(), key=lambda kv: -kv[1]) if kv[1] >= 0.005),
      "; busiest threads:",
      ", ".join("%s %.2f" % (n, c) for c, n in rows[:8]))
PY
}
serve_and_measure() {  # name, "runs" (cN or cNi: N clients, i: + invariance), serve args...
  local name=$1 runs=$2; shift 2
  local port=$((18000 + RANDOM % 1000))
  (cd /tmp && exec python3 -m basal_local.cli serve --model $M --port $port "$@") > $OUT/serve-$name.log 2>&1 &
  local pid=$!
  if ! wait_ready $port $pid; then echo "daemon $name did not start"; tail -5 $OUT/serve-$name.log; kill $pid; return 1; fi
  el "daemon $name ready"
  local U=http://127.0.0.1:$port
  local B="python3 -m basal_local.cli bench --http $U --json"
  for r in $runs; do
    local n=${r//[cin]/} extra="" tag=""
    [[ $r == *i ]] && extra="--invariance ${INVARIANCE:-8}"
    [[ $r == *n ]] && extra="$extra --new-connections" && tag=n
    local total=$((n * ${REQ_PER_CLIENT:-40})); [ $n = 1 ] && total=${C1_REQUESTS:-268}
    [ -e $OUT/http-$name-c$n$tag.json ] && tag=$tag-2  # a repeated run (c32i then c32) keeps both results
    ticks $pid > /tmp/before.txt; local t0=$(date +%s.%N)
    (cd /tmp && $B --clients $n --requests $total $extra) > $OUT/http-$name-c$n$tag.json
    cpu_report $pid /tmp/before.txt $(python3 -c "import time; print(time.time() - $t0)") "$name c$n$tag"
    curl -s $U/api/stats > $OUT/stats-$name-c$n$tag.json
    python3 - $OUT/stats-$name-c$n$tag.json "$name c$n$tag" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
b = s.get("batches", [])
print(sys.argv[2], "last batches (requests/compute ms):", " ".join(f"{x['requests']}/{x['compute_ms']:.0f}" for x in b[-16:]),
      "| p50 queue/compute/total ms:", {k: s["percentiles"][k]["p50"] for k in ("queue_ms", "compute_ms", "total_ms", "planning_ms")})
PY
  done
  [ -n "${ANSWERS-1}" ] && (cd /tmp && python3 $OLDPWD/tools/http_answers.py $U $OUT/answers-$name.json 64)
  curl -s $U/api/stats > $OUT/stats-$name.json
  kill $pid; wait $pid 2>/dev/null
  for f in $OUT/http-$name-*.json; do echo "$(basename $f): $(cat $f)"; done
  el "daemon $name done"
}
has http && serve_and_measure 1gpu "${HTTP_RUNS:-c1 c32i c64}" --device ${DEV:-cuda}
if has httptools; then  # the same daemon with httptools parsing HTTP instead of h11 (.whl-extra/httptools-*.whl)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl-extra/httptools-*.whl &&
    PYTHONPATH=/tmp/site2:$PYTHONPATH ANSWERS= serve_and_measure 1gpu-httptools "c1 c32" --device ${DEV:-cuda}
fi
# the same daemon on uvloop + httptools (what uvicorn[standard] installs; wheels in .whl/extra), UVLOOP_RUNS
if has uvloop; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site3 .whl/extra/*.whl &&
    PYTHONPATH=/tmp/site3:$PYTHONPATH ANSWERS= serve_and_measure 1gpu-uvloop "${UVLOOP_RUNS:-c1 c32}" --device ${DEV:-cuda}
fi
# two replica processes on one GPU (workers forked from the forkserver): they start, answer, and answer bitwise alike
if has proc1; then
  serve_and_measure 1gpu-proc2 "c32" --device ${DEV:-cuda} --replicas 2 --replica-processes
  has http && (cd /tmp && python3 $OLDPWD/tools/http_answers.py --compare $OUT/answers-1gpu.json $OUT/answers-1gpu-proc2.json) | tee $OUT/answers-compare-proc1.txt
fi
has coalesce && ANSWERS= serve_and_measure 1gpu-coalesce20 "c32" --device ${DEV:-cuda} --coalesce-ms 20
# the same daemon answering each batch before forming the next (the main lane's pipelining off)
has nopipe && ANSWERS= serve_and_measure 1gpu-nopipe "${NOPIPE_RUNS:-c32}" --device ${DEV:-cuda} --no-pipeline
has multi && serve_and_measure 2gpu "${MULTI_RUNS:-c64 c128}" --devices cuda:0,cuda:1 --no-replica-processes
# issue 13: each replica in its own process (the front keeps HTTP, planning, routing)
has multiproc && serve_and_measure 2gpu-proc "${MULTI_RUNS:-c64 c128}" ${MULTI_DEVICES:---devices cuda:0,cuda:1} --replica-processes
if has http && has multi; then
  (cd /tmp && python3 $OLDPWD/tools/http_answers.py --compare $OUT/answers-1gpu.json $OUT/answers-2gpu.json) | tee $OUT/answers-compare.txt
fi
if has http && has multiproc; then
  (cd /tmp && python3 $OLDPWD/tools/http_answers.py --compare $OUT/answers-1gpu.json $OUT/answers-2gpu-proc.json) | tee $OUT/answers-compare-proc.txt
fi
# issue 13 through Ray Serve: `serve --ray` on a local Ray cluster, one engine replica per GPU (num_gpus 1) behind
# Ray's HTTP proxy and the front deployment. Ray Serve travels as a pruned site folder (tools/ray_site.sh 3.12 DIR;
# RAY_SITE, default .ray/ray-site-cp312.tar.xz); RAY_RUNS (default "c1 c64"), RAY_ARGS (default: 2 GPU replicas)
# RAY2_ARGS: a second deployment after it (serve args after --ray), RAY2_RUNS its runs (default "c64")
if has ray; then
  RSITE=${RAY_SITE_DIR:-/tmp/rsite/site}  # RAY_SITE_DIR: a site folder already unpacked (a dry run on the CPU)
  if [ -z "${RAY_SITE_DIR:-}" ] && [ -f ${RAY_SITE:-.ray/ray-site-cp312.tar.xz} ]; then
    rm -rf /tmp/rsite && mkdir -p /tmp/rsite && tar -xJf ${RAY_SITE:-.ray/ray-site-cp312.tar.xz} -C /tmp/rsite &&
      el "ray site unpacked"
    for w in $(ls .ray/*.whl 2>/dev/null); do  # wheels beside it go over it (a site built without one they need)
      python3 -m zipfile -e $w $RSITE && echo "ray site: + $(basename $w)"; done
  fi
  RAY_PATH=${PYTHONPATH:-}; [ -d $RSITE/ray ] && RAY_PATH=$RSITE:$RAY_PATH  # else: the Ray installed there, if any
  # Ray's memory monitor kills workers past 95 % of MemTotal, which on this host starts at 31 GiB and grows as
  # memory is used (KINDS.md): off here. No usage reports (nothing outside can be reached).
  if PYTHONPATH=$RAY_PATH python3 -c "import ray.serve" 2> $OUT/ray-import.err; then
    PYTHONPATH=$RAY_PATH RAY_AUTH_MODE=disabled READY_S=${RAY_READY_S:-300} RAY_memory_monitor_refresh_ms=0 \
      RAY_USAGE_STATS_ENABLED=0 serve_and_measure ray "${RAY_RUNS:-c1 c64}" --ray ${RAY_ARGS:---device cuda --min-replicas 2}
    [ -f $OUT/serve-ray.log ] && grep -v "^\s*$" $OUT/serve-ray.log | tail -${RAY_LOG_LINES:-8}
    if [ -n "${RAY2_ARGS:-}" ]; then  # a second Ray deployment (e.g. more fronts), measured without the answers
      PYTHONPATH=$RAY_PATH RAY_AUTH_MODE=disabled READY_S=${RAY_READY_S:-300} RAY_memory_monitor_refresh_ms=0 \
        RAY_USAGE_STATS_ENABLED=0 ANSWERS= serve_and_measure ray-b "${RAY2_RUNS:-c64}" --ray $RAY2_ARGS
    fi
  else
    echo "ray stage skipped: Ray Serve does not import"; tail -3 $OUT/ray-import.err
  fi
  if has http && [ -f $OUT/answers-ray.json ]; then
    (cd /tmp && python3 $OLDPWD/tools/http_answers.py --compare $OUT/answers-1gpu.json $OUT/answers-ray.json) | tee $OUT/answers-compare-ray.txt
  fi
fi
if has max; then  # the max preset: single and batch figures only (MAX_TILINGS: one run per attention tiling)
  (cd /tmp && timeout ${MAX_MAKE_TIMEOUT:-150} python3 -m basal_local.cli make-test-model /tmp/m-max --preset max --device cuda > /dev/null) && el make max
  # CLOCKS=1: the SM clock and the power draw every 100 ms while the max bench runs (nvidia-smi)
  [ -n "${CLOCKS:-}" ] && { nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks.max.sm \
    --format=csv,noheader -lms 100 > $OUT/clocks-max.csv 2>&1 & CLOCKS_PID=$!; }
  for tl_ in ${MAX_TILINGS:-default}; do
    [ $tl_ = auto ] && tl_=$(cat $OUT/attn-best.txt 2>/dev/null || echo default)
    name=max$([ $tl_ = default ] || echo "-${tl_//:/x}")
    (cd /tmp && env $([ $tl_ = default ] || tiling_env $tl_) BASAL_BENCH_PARTIAL=$OUT/partial-$name.json timeout ${MAX_TIMEOUT:-150} \
       python3 -m basal_local.cli bench --model /tmp/m-max --device cuda --repeat 1 --json > $OUT/bench-$name.json 2> $OUT/bench-$name.err)
    python3 -c "
import json; r=json.load(open('$OUT/bench-$name.json')); print('$name', r['single_ms'], r['throughput']['batch32']['decisions_per_s'], r.get('memory_after_bench'))" 2>&1 | tail -1
    el bench $name
  done
  if [ -n "${CLOCKS:-}" ]; then kill $CLOCKS_PID; python3 - $OUT/clocks-max.csv <<'PY'
import sys
rows = [l.strip().split(", ") for l in open(sys.argv[1]) if l.count(",") >= 4]
busy = [r for r in rows if r[2].replace(" W", "").replace(".", "").isdigit() and float(r[2].split()[0]) > 250]
if busy:
    mhz = sorted(int(r[1].split()[0]) for r in busy)
    watts = sorted(float(r[2].split()[0]) for r in busy)
    print(f"max bench, samples over 250 W: {len(busy)}; SM clock p10/p50/p90 {mhz[len(mhz)//10]}/{mhz[len(mhz)//2]}/{mhz[9*len(mhz)//10]} MHz;"
          f" power p50/p90 {watts[len(watts)//2]}/{watts[9*len(watts)//10]} W; max SM clock {busy[0][4]}")
else:
    print("clocks: no busy samples;", rows[:2] or open(sys.argv[1]).read()[:300])
PY
  fi
fi
if has maxab; then  # the max preset's bench again with another basal-local wheel (.whl/ab/*.whl): an A/B in one call
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_ab .whl/ab/*.whl &&
  for i in 1 2; do
    for side in ${AB_ORDER:-new ab}; do
      sp=/tmp/site; [ $side = ab ] && sp=/tmp/site_ab:/tmp/site
      (cd /tmp && PYTHONPATH=$sp BASAL_BENCH_PARTIAL=$OUT/partial-max-$side$i.json timeout ${MAX_TIMEOUT:-150} \
         python3 -m basal_local.cli bench --model /tmp/m-max --device cuda --repeat 1 --json > $OUT/bench-max-$side$i.json 2> $OUT/bench-max-$side$i.err)
      python3 -c "
import json; r=json.load(open('$OUT/bench-max-$side$i.json')); print('max $side$i', r['single_ms'], r['throughput']['batch32']['decisions_per_s'])" 2>&1 | tail -1
    done
  done
  el maxab
fi
if has maxlt; then  # the max preset's bench with the pinned cuBLASLt algorithms and without (BASAL_LOCAL_GEMM_LT=0), interleaved
  # (LT_ORDER: sides among nolt, lt, and ltNN = pinned with a margin of NN %)
  for i in 1 2; do
    for side in ${LT_ORDER:-nolt lt}; do
      margin=; [[ $side == lt?* ]] && margin=0.${side#lt}
      (cd /tmp && env BASAL_LOCAL_GEMM_LT=$([ $side = nolt ] && echo 0 || echo 1) ${margin:+BASAL_LOCAL_GEMM_LT_MARGIN=$margin} BASAL_BENCH_PARTIAL=$OUT/partial-max-$side$i.json \
         timeout ${MAX_TIMEOUT:-150} python3 -m basal_local.cli bench --model /tmp/m-max --device cuda --repeat 1 --json \
         > $OUT/bench-max-$side$i.json 2> $OUT/bench-max-$side$i.err)
      python3 -c "
import json; r=json.load(open('$OUT/bench-max-$side$i.json')); print('max $side$i', r['single_ms'], r['throughput']['batch32']['decisions_per_s'], 'warmup', r['warmup_s'])" 2>&1 | tail -1
    done
  done
  el maxlt
fi
if has gsweep; then  # GEMM time per row count and graph replay per bucket (tools/graph_sweep.py)
  [ -d /tmp/m-max ] || (cd /tmp && python3 -m basal_local.cli make-test-model /tmp/m-max --preset max --device cuda > /dev/null)
  (cd /tmp && timeout ${GSWEEP_TIMEOUT:-240} python3 $OLDPWD/tools/graph_sweep.py $OUT/graph_sweep.json $M /tmp/m-max ${GSWEEP_ARGS:-} \
     > $OUT/graph_sweep.txt 2> $OUT/graph_sweep.err); grep -v '^{' $OUT/graph_sweep.txt; tail -2 $OUT/graph_sweep.err
  python3 - $OUT/graph_sweep.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for m in r["models"]:
    print(m["model"], "graphs ms:", m["graphs"], "| profile of", m["profile_bucket"], {k: v for k, v in m["profile"].items() if k != "top"})
    for t in m["profile"]["top"][:8]:
        print("   ", t)
PY
  el gsweep
fi
if has gsweepab; then  # graph replay per bucket on max: this wheel, .whl/ab's wheel, and this one untimed (twice)
  [ -d /tmp/site_ab ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_ab .whl/ab/*.whl
  [ -d /tmp/m-max ] || (cd /tmp && python3 -m basal_local.cli make-test-model /tmp/m-max --preset max --device cuda > /dev/null)
  for i in 1 2; do
    for side in ${GAB_ORDER:-ab new untimed}; do
      sp=/tmp/site; [ $side = ab ] && sp=/tmp/site_ab:/tmp/site
      (cd /tmp && PYTHONPATH=$sp BASAL_LOCAL_GEMM_TIMED=$([ $side = untimed ] && echo 0 || echo 1) timeout 120 \
         python3 $OLDPWD/tools/graph_sweep.py $OUT/gab-$side$i.json /tmp/m-max --no-gemm > /dev/null 2> $OUT/gab-$side$i.err)
      python3 - $OUT/gab-$side$i.json $side$i <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))["models"][0]
g = m["graphs"]
print(sys.argv[2], " ".join(f"{k.split('x')[0]}:{v}" for k, v in g.items() if k.endswith("x4") and int(k.split("x")[0]) <= 512),
      "| median bucket", m["profile_bucket"], "spaced", m.get("spaced_ms"), {k: v for k, v in m["profile"].items() if k != "top"})
PY
    done
  done
  el gsweepab
fi
if has fp8sub; then  # fp8 agreement with f16 on the max preset per subset of projections (tools/fp8_check.py)
  (cd /tmp && timeout ${FP8_TIMEOUT:-150} python3 $OLDPWD/tools/fp8_check.py /tmp/m-max $OUT/fp8-check-max.json --skip-micro \
     "--subsets=${FP8_SUBSETS:-gate_up,down;gate_up}" > $OUT/fp8-check-max.txt 2> $OUT/fp8-check-max.err)
  cut -c1-400 $OUT/fp8-check-max.txt; tail -2 $OUT/fp8-check-max.err; el fp8sub
fi
if has prof; then  # kernel time of one 4.5B single decision and of 32, by family and costliest kernels
  (cd /tmp && timeout ${PROF_TIMEOUT:-150} python3 $OLDPWD/tools/profile_forward.py $M $OUT/profile-$PRESET.txt \
     tree:verified > /dev/null 2> $OUT/profile-$PRESET.err); head -40 $OUT/profile-$PRESET.txt; el prof
fi
if has profmax; then  # kernel time of one max-preset single decision and of 32, by family and costliest kernels
  (cd /tmp && timeout ${PROF_TIMEOUT:-150} python3 $OLDPWD/tools/profile_forward.py /tmp/m-max $OUT/profile-max.txt \
     tree:verified > /dev/null 2> $OUT/profile-max.err); cat $OUT/profile-max.txt; el profmax
fi
if has hostprof; then
  (cd /tmp && timeout ${HOSTPROF_TIMEOUT:-120} python3 $OLDPWD/tools/host_profile.py $M $OUT/host_profile.txt); el hostprof
fi
if has mini; then
  (cd /tmp && python3 -m basal_local.cli make-test-model /tmp/m-mini --preset mini --device cuda > /dev/null) &&
  (cd /tmp && BASAL_BENCH_PARTIAL=$OUT/partial-mini.json timeout ${MINI_TIMEOUT:-200} python3 -m basal_local.cli bench --model /tmp/m-mini \
     --device cuda --repeat 2 --json --invariance ${INVARIANCE:-8} --baseline transformers > $OUT/bench-mini.json 2> $OUT/bench-mini.err)
  cat $OUT/bench-mini.json; el mini
fi
if has compiled; then
  (cd /tmp && BASAL_BENCH_PARTIAL=$OUT/partial-compiled.json timeout ${COMPILED_TIMEOUT:-300} python3 -m basal_local.cli bench --model $M \
     --device cuda --repeat 2 --json --baseline transformers-compiled > $OUT/bench-compiled.json 2> $OUT/bench-compiled.err)
  cat $OUT/bench-compiled.json; el compiled
fi
el end
# the device returns at most 8 files: PACK=1 leaves one archive of everything (and the log) instead
if [ -n "${PACK:-}" ]; then
  (cd $OUT && tar -czf /tmp/all.tgz . && rm -rf ./* && mv /tmp/all.tgz $OUT/all.tgz)
fi
