#!/usr/bin/env bash
# Build, check and time everything on a GPU host in one run (docs/PERFORMANCE.md, docs/SCALING.md).
# 1. Here, with the project's venv active (a package index reachable):
#      bash tools/gpu.sh prepare [OLD]    # dist/gpu/: new/ (a wheel of this working tree), whl/ (the daemon's
#                                         # dependency closure for PYVER, default 3.12, manylinux x86-64, checked
#                                         # complete against the GPU image), old/ (a wheel of commit OLD, for `ab`)
# 2. On the GPU host, from the repository root, carrying dist/gpu (run tool: carry=["dist/gpu"]):
#      STAGES="tests bench http" bash tools/gpu.sh
#    One line per stage: "STAGE: ok (N s) SUMMARY", "STAGE: skipped: WHY" (no second GPU, no CUDA, no old wheel,
#    or not enough of BUDGET, default 570 s, left), or "STAGE: FAILED (N s)" and the tail of its log (a daemon that
#    did not start: its own log's tail); the next stage still runs. Records (bench and HTTP JSON, answers, daemon
#    logs, STAGE.log with the stage's whole output) land in $OUT (default /tmp/out) as records.tgz, beside
#    summary.txt with these lines and machine.txt (PACK=0: as files).
# Stages (run in the order given):
#   tests      tests/test_cuda.py, test_cuda_kernels.py, test_fp8.py from a copy of tests/ ($TESTS to choose)
#   bench      per preset of PRESETS (default "mini 4.5B max"): in-process bench at f16 (--repeat 2 --invariance 8,
#              $BENCH_ARGS; PRESET also --long-doc --baseline $BASELINE), then for FP8_PRESETS (default "4.5B max")
#              the same weights as a ModelOpt FP8 checkpoint; both served once: decisions compared with f16
#   cache      bench --cache (a 17.8k-token document, DOCS of them), then the mixed HTTP stream with the state cache
#              off and on (CACHE_HTTP=0: the bench alone)
#   http       a daemon on one GPU: 1, 32 (+ invariance 8) and 64 clients; the answers saved
#   proc2      2 replica processes on one GPU, 32 clients; answers compared with http's
#   fresh      fresh daemons, 32 clients from the first request (one process, then 2 replica processes), the state
#              cache on and off: where the first sight of the samples puts the p99 (bench --http's slowest 1 %)
#   gpu2       two GPUs, one process and a worker process per GPU, 64 clients; answers compared with http's
#   dashboard  NVML telemetry in /api/stats and the event stream, the GPU memory split, the dashboard headless
#   unload     5 unload/load cycles, in process and in a worker process: memory back, answers bit for bit
#   kill       tools/loadtest.py --kill-every: worker processes (one per GPU) killed under load
#   ab         dist/gpu/old against dist/gpu/new: bench pairs (the first with --long-doc --invariance 8), HTTP 1/32
#              clients and proc2 (each daemon measured by this tree's client), answers compared; AB_PARTS (default
#              "bench http proc2 bench2") to run some of them, ORDER (default "old new") to run new first
#   abprof     a single decision and 32 of old and new, split: plan, pack, forward (host, device), kernels (tools/abprof.py)
#   profile    kernel time per family of a single decision and of 32 (tools/gpu.py profile)
# A stage starts only while BUDGET has its usual need left (NEED below; NEED_STAGE=N for a smaller run of it).
# PRESET (default 4.5B) is the model of the stages after bench. R (default /tmp/gpu) is the scratch folder: the
# installed wheels and the models, built once per preset (rm -rf it to rebuild). DEV=cpu PRESET=tiny rehearses
# every stage but profile and gpu2 here; without dist/gpu/new the installed basal_local runs.
set -uo pipefail
ROOT=$PWD; D=$ROOT/dist/gpu; R=${R:-/tmp/gpu}; OUT=${OUT:-/tmp/out}; PY=${PY:-python3}
DEV=${DEV:-cuda}; PRESET=${PRESET:-4.5B}; BUDGET=${BUDGET:-570}; M=$R/m-$PRESET
export PYTHONUNBUFFERED=1 BASAL_LOCAL_HOME=$R/home PYVER=${PYVER:-3.12}
if [ "${1:-}" = prepare ]; then
  set -e; rm -rf "$D"; mkdir -p "$D/whl"
  wheel() {  # DIR [REF]: a wheel of commit REF, or of the working tree's files that git does not ignore
    local src; src=$(mktemp -d)
    if [ -n "${2:-}" ]; then git archive "$2" | tar x -C "$src"
    else git ls-files -co --exclude-standard | tar c --ignore-failed-read -T - 2> /dev/null | tar x -C "$src"; fi
    $PY -m pip wheel -q --no-deps --no-build-isolation -w "$1" "$src"; rm -rf "$src"
  }
  wheel "$D/new"; [ -z "${2:-}" ] || wheel "$D/old" "$2"
  $PY -m pip freeze --exclude-editable > "$D/constraints.txt"  # this venv's versions where it has them
  # shellcheck disable=SC2046
  $PY -m pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp --abi "cp${PYVER/./}" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -c "$D/constraints.txt" -d "$D/whl" $($PY tools/gpu.py deps "$D"/new/*.whl)
  rm "$D/constraints.txt"; exec $PY tools/gpu.py closure "$D"
fi

mkdir -p "$OUT" "$R"; T0=$(date +%s); DPID=""
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
T() { local l; l=$(left); timeout $(( l > 10 ? l : 10 )) "$@"; }  # a step ends by the budget
cli() { (cd "$R" && T $PY -m basal_local.cli "$@"); }               # from $R: the installed wheel, not the checkout
tool() { (cd "$R" && T $PY "$ROOT/tools/$1" "${@:2}"); }
say() { echo "$*" > "$R/line"; echo "$*"; }
site() {  # install dist/gpu/$1 (new or old) with the carried dependencies into $R/$1 (afresh: a warm host keeps $R)
  rm -rf "${R:?}/$1" && $PY -m pip install -q --no-index --no-deps --no-compile --target "$R/$1" "$D"/whl/*.whl "$D/$1"/*.whl
}
if ls "$D"/new/*.whl > /dev/null 2>&1; then site new || exit 1; export PYTHONPATH=$R/new
else echo "no wheel in $D/new (bash tools/gpu.sh prepare): the installed basal_local runs"; fi
CLIENT=${PYTHONPATH:-}  # the clients (HTTP bench, answers) are always this tree's, also against the old daemon
# the run tool brings back only a few files: at exit, every record but the summary goes into records.tgz
pack() { local t; t=$(mktemp); (cd "$OUT" && tar czf "$t" --exclude=summary.txt . && find . -mindepth 1 \
  ! -name summary.txt ! -name machine.txt -delete) && mv "$t" "$OUT/records.tgz"; }
(cd "$R" && $PY -c "import basal_local.server.daemon, litestar, uvicorn" && $PY -m basal_local.cli serve -h) \
  > /dev/null || { echo "the daemon does not import: see bash tools/gpu.sh prepare"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  $PY -c "import torch, sys; print('torch', torch.__version__, torch.version.cuda, 'python', sys.version.split()[0])"
  nproc; } | tee "$OUT/machine.txt"
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")

model() {  # DIR PRESET [ARGS]: built once per scratch folder; a build cut short leaves only DIR.part
  [ -d "$1" ] || { rm -rf "$1.part" && cli make-test-model "$1.part" --preset "$2" --device "$DEV" "${@:3}" > /dev/null &&
    mv "$1.part" "$1"; }
}
serve() {  # NAME SERVE-ARGS...: a daemon on a free port in the background (U, DPID); its log's tail if it fails
  local name=$1 log=$OUT/serve-$1.log port; shift
  port=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  (cd "$R" && exec $PY -m basal_local.cli serve --port "$port" "$@") > "$log" 2>&1 & DPID=$!
  U=http://127.0.0.1:$port
  for _ in $(seq "${READY_S:-300}"); do
    curl -sf "$U/health" > /dev/null && return 0
    kill -0 $DPID 2> /dev/null || break; sleep 1
  done
  echo "daemon $name did not answer /health; its log ends:"; tail -20 "$log"; halt; return 1
}
halt() { [ -n "$DPID" ] && { kill $DPID 2> /dev/null; wait $DPID 2> /dev/null; }; DPID=""; }
trap halt EXIT
bench() {  # NAME MODEL-DIR [bench args]: in-process bench into $OUT/bench-NAME.json
  cli bench --model "$2" --device "$DEV" --json "${@:3}" > "$OUT/bench-$1.json" 2> "$OUT/bench-$1.err" \
    || { tail -5 "$OUT/bench-$1.err"; return 1; }
}
figures() { tool gpu.py summary "$@"; }

st_tests() {
  rm -rf "$R/tests" && cp -r tests "$R/tests"
  local sel=${TESTS:-tests/test_cuda.py tests/test_cuda_kernels.py tests/test_fp8.py}
  (cd "$R" && T $PY -m pytest -q -p no:cacheprovider -p no:faker -o "markers=slow: long-running" $sel) | grep -v "it/s" | tee "$OUT/tests.txt"
  local rc=${PIPESTATUS[0]}
  say "$(tail -1 "$OUT/tests.txt")"; return "$rc"
}
st_bench() {
  local line="" P m
  for P in ${PRESETS:-mini 4.5B max}; do
    m=$R/m-$P; model "$m" "$P" || return 1
    local more=(); [ "$P" = "$PRESET" ] && more=(--long-doc --baseline "${BASELINE:-transformers-compiled}")
    bench "$P-f16" "$m" --dtype f16 --repeat 2 --invariance 8 ${BENCH_ARGS:-} "${more[@]}" || return 1
    [[ " ${FP8_PRESETS-4.5B max} " == *" $P "* ]] || { [ "$m" = "$M" ] || rm -rf "$m"; continue; }
    model "$m-fp8" "$P" --format fp8 || return 1
    bench "$P-fp8" "$m-fp8" --dtype auto --repeat 2 --invariance 8 ${BENCH_ARGS:-} || return 1
    for v in f16 fp8; do
      local dir=$m; [ $v = fp8 ] && dir=$m-fp8
      serve "$P-$v" --model "$dir" --device "$DEV" --dtype "${v/fp8/auto}" || return 1
      tool gpu.py answers "$U" "$OUT/answers-$P-$v.json" 32; halt
    done
    tool gpu.py compare "$OUT/answers-$P-f16.json" "$OUT/answers-$P-fp8.json" | tee "$OUT/compare-$P-fp8.json"
    line="$line; $P fp8 vs f16: $(cat "$OUT/compare-$P-fp8.json")"
    rm -rf "$m-fp8"; [ "$m" = "$M" ] || rm -rf "$m"
  done
  say "$(figures "$OUT"/bench-*-f16.json $(ls "$OUT"/bench-*-fp8.json 2> /dev/null))$line"
}
st_cache() {
  model "$M" "$PRESET" && bench cache "$M" --cache --documents "${DOCS:-3}" || return 1
  [ "${CACHE_HTTP:-1}" = 1 ] || { say "$(figures "$OUT"/bench-cache.json)"; return 0; }
  for c in off auto; do
    serve "cache-$c" --model "$M" --device "$DEV" --prefix-cache $c || return 1
    cli bench --http "$U" --documents "${HTTP_DOCS:-20}" --per-document 10 --clients 32 --json \
      > "$OUT/http-cache-$c.json"; halt
  done
  say "$(figures "$OUT"/bench-cache.json "$OUT"/http-cache-{off,auto}.json)"
}
served() {  # NAME "CLIENTS:REQUESTS[:i] ..." SERVE-ARGS...: HTTP runs and the answers of one daemon
  local name=$1 runs=$2 r; shift 2
  model "$M" "$PRESET" && serve "$name" --model "$M" "$@" || return 1
  # every batch's record while the clients run (/api/stats keeps the last 32): `gpu.py slow` reads them
  curl -sN "$U/api/events" > "$OUT/events-$name.txt" 2> /dev/null & local events=$!
  for r in $runs; do IFS=: read -r c q i <<< "$r"
    PYTHONPATH=$CLIENT cli bench --http "$U" --json --clients "$c" --requests "$q" ${i:+--invariance 8} \
      > "$OUT/http-$name-c$c.json" || { halt; return 1; }
  done
  kill $events 2> /dev/null; PYTHONPATH=$CLIENT tool gpu.py slow "$OUT/events-$name.txt" > "$OUT/slow-$name.txt"
  PYTHONPATH=$CLIENT tool gpu.py answers "$U" "$OUT/answers-$name.json" 64; curl -s "$U/api/stats" > "$OUT/stats-$name.json"; halt
  [ "$name" = 1gpu ] || [ ! -f "$OUT/answers-1gpu.json" ] ||
    tool gpu.py compare "$OUT/answers-1gpu.json" "$OUT/answers-$name.json" | tee "$OUT/compare-$name.json"
}
st_http() {
  served 1gpu "1:268 32:1280:i 64:2560" --device "$DEV" || return 1
  say "$(figures "$OUT"/http-1gpu-c{1,32,64}.json)"
}
st_proc2() {
  served proc2 "32:1280" --device "$DEV" --replicas 2 --replica-processes || return 1
  say "$(figures "$OUT"/http-proc2-c32.json); answers vs 1gpu: $(cat "$OUT"/compare-proc2.json || echo none)"
}
st_fresh() {
  local c where
  for where in 1 2; do for c in auto off; do
    local args=(--device "$DEV" --prefix-cache $c); [ $where = 2 ] && args+=(--replicas 2 --replica-processes)
    served "fresh$where-$c" "32:1280" "${args[@]}" || return 1
  done; done
  say "$(figures "$OUT"/http-fresh{1,2}-{auto,off}-c32.json)"
}
st_gpu2() {
  [ "$GPUS" -ge 2 ] || { say "needs 2 GPUs, $GPUS here"; return 3; }
  served 2gpu "64:2560" --devices cuda:0,cuda:1 --no-replica-processes &&
    served 2gpu-proc "64:2560" --devices cuda:0,cuda:1 --replica-processes || return 1
  say "$(figures "$OUT"/http-2gpu{,-proc}-c64.json); answers vs 1gpu: $(cat "$OUT"/compare-2gpu*.json || echo none)"
}
st_dashboard() {
  model "$M" "$PRESET" && serve dash --model "$M" --device "$DEV" || return 1
  tool gpu.py dashboard "$U" "$DEV" 1 > "$OUT/dashboard-1.txt"; local rc=$?; halt; cat "$OUT/dashboard-1.txt"
  if [ "$GPUS" -ge 2 ]; then
    serve dash2 --model "$M" --devices cuda:0,cuda:1 --replica-processes || return 1
    tool gpu.py dashboard "$U" cuda 2 > "$OUT/dashboard-2.txt" || rc=1; halt; cat "$OUT/dashboard-2.txt"
  fi
  say "$(cat "$OUT"/dashboard-*.txt | grep -c "^ok") checks ok, $(cat "$OUT"/dashboard-*.txt | grep -c "^FAIL") failed"
  return $rc
}
st_unload() {
  local one=cuda:0 rc=0 how; [ "$DEV" = cpu ] && one=cpu
  model "$M" "$PRESET" || return 1
  for how in inprocess worker; do
    local where=(--device "$DEV"); [ $how = worker ] && where=(--devices $one --replica-processes)
    serve "unload-$how" --model "$M" "${where[@]}" || return 1
    tool gpu.py unload "$U" | tee "$OUT/unload-$how.jsonl"; [ "${PIPESTATUS[0]}" = 0 ] || rc=1; halt
  done
  say "in process: $(tail -1 "$OUT/unload-inprocess.jsonl"); worker: $(tail -1 "$OUT/unload-worker.jsonl")"; return $rc
}
st_kill() {
  local devs=cpu per=2
  [ "$DEV" = cpu ] || { devs=$($PY -c "print(','.join(f'cuda:{i}' for i in range($GPUS)))"); per=1; }
  model "$M" "$PRESET" && tool loadtest.py --model "$M" --devices "$devs" --replicas $per --clients 16 \
    --seconds "${KILL_S:-60}" --kill-every 6 | tee "$OUT/kill.txt"; local rc=${PIPESTATUS[0]}
  say "$(grep -E "requests|outcomes|recovery_s_median" "$OUT/kill.txt" | tr -s ' ' | paste -sd' ')"; return "$rc"
}
st_ab() {
  ls "$D"/old/*.whl > /dev/null 2>&1 || { say "no wheel in $D/old: bash tools/gpu.sh prepare OLD"; return 3; }
  site old || return 1; model "$M" "$PRESET" || return 1
  local v order=${ORDER:-old new}; local again parts=" ${AB_PARTS:-bench http proc2 bench2} "
  again=$(echo "$order" | awk '{print $2, $1}')
  [[ $parts != *" bench "* ]] || for v in $order; do
    PYTHONPATH=$R/$v bench "ab-$v" "$M" --long-doc --invariance 8 || return 1; done
  [[ $parts != *" http "* ]] || for v in $order; do
    PYTHONPATH=$R/$v served "ab-$v" "1:268 32:1280" --device "$DEV" || return 1; done
  [[ $parts != *" proc2 "* ]] || for v in $order; do [ "$(left)" -gt 120 ] &&
    { PYTHONPATH=$R/$v served "ab-proc2-$v" "32:1280" --device "$DEV" --replicas 2 --replica-processes || return 1; }
  done
  [[ $parts != *" bench2 "* ]] || for v in $again; do [ "$(left)" -gt 100 ] &&
    { PYTHONPATH=$R/$v bench "ab-$v-2" "$M" || return 1; }; done
  local pair=ab; [[ $parts == *" http "* ]] || pair=ab-proc2
  tool gpu.py compare "$OUT/answers-$pair-old.json" "$OUT/answers-$pair-new.json" | tee "$OUT/compare-ab.json"
  local f figs=(); for f in "$OUT"/bench-ab-{old,new}.json "$OUT"/http-$pair-{old,new}-c32.json; do
    [ ! -f "$f" ] || figs+=("$f"); done
  say "$(figures "${figs[@]}"); answers $(cat "$OUT/compare-ab.json")"
}
st_abprof() {
  [ "$DEV" = cuda ] || { say "needs CUDA"; return 3; }
  ls "$D"/old/*.whl > /dev/null 2>&1 || { say "no wheel in $D/old: bash tools/gpu.sh prepare OLD"; return 3; }
  site old || return 1; model "$M" "$PRESET" || return 1
  local v; for v in ${ORDER:-old new}; do PYTHONPATH=$R/$v tool abprof.py run "$M" "$OUT/abprof-$v.json" || return 1; done
  tool abprof.py compare "$OUT"/abprof-{old,new}.json | tee "$OUT/abprof.txt"
  say "$(grep -m1 -A6 "single decision" "$OUT/abprof.txt" | grep total)"
}
st_profile() {
  [ "$DEV" = cuda ] || { say "needs CUDA"; return 3; }
  model "$M" "$PRESET" && tool gpu.py profile "$M" "$OUT/profile.txt" ${PROFILE_CONFIGS:-} || return 1
  say "$(grep -m1 "single decision" "$OUT/profile.txt")"
}

declare -A NEED=([tests]=150 [bench]=240 [cache]=200 [http]=120 [proc2]=90 [fresh]=240 [gpu2]=150 [dashboard]=60 [unload]=90
                 [kill]=90 [ab]=340 [profile]=60 [abprof]=150)
for s in ${STAGES:-tests bench http}; do
  [ -n "${NEED[$s]:-}" ] || { echo "$s: unknown stage (see the header of tools/gpu.sh)"; continue; }
  t=$(date +%s); : > "$R/line"
  need=NEED_$s; need=${!need:-${NEED[$s]}}  # NEED_cache=100 ...: a smaller run of a stage needs less
  if [ "$(left)" -lt "$need" ]; then echo "$s: skipped: needs ~$need s, $(left) s of BUDGET left"
  else (trap halt EXIT; st_"$s") > "$OUT/$s.log" 2>&1; rc=$?; took="($(( $(date +%s) - t )) s)"; line=$(cat "$R/line")
    case $rc in 0) echo "$s: ok $took $line";; 3) echo "$s: skipped: $line";;
      *) echo "$s: FAILED $took${line:+ $line}; $OUT/$s.log ends:"; tail -15 "$OUT/$s.log" | sed 's/^/    /';; esac
  fi | tee -a "$OUT/summary.txt"
done
[ "${PACK:-1}" = 0 ] || pack
