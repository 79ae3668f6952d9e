#!/usr/bin/env bash
# Two commits side by side on one H200, interleaved (issue 24's proof): the 4.5B test model, the in-process bench of
# both, HTTP 1 and 32 clients against a daemon of each, 2 replica processes on one GPU (32 clients), the answers of
# both daemons compared bitwise, then a second in-process pair if time is left.
# Prepare here (the folder is ignored by git; copy it to the GPU machine with the checkout):
#   bash tools/ab_prepare.sh OLD NEW dist/engine     # old/, new/ (one wheel each) and whl/ (the dependency closure)
# then on the GPU machine, from the repository root, carrying dist/engine:
#   bash tools/engine_ab.sh                          # ORDER="new old" runs every pair the other way round
# STAGES (default "bench http proc2 bench2"): bench = in-process pair, http = a daemon of each (1 and 32 clients, the
# answers compared), proc2 = 2 replica processes on one GPU (32 clients), bench2 = a second in-process pair, reversed.
# (DEV=cpu PRESET=tiny PY=python3.11 rehearse the script on a CPU, with wheels prepared by PYVER=3.11 ab_prepare.sh)
# Nothing runs before both versions import their daemon and answer `serve -h`; a daemon that does not answer
# /health (or exits) is reported with the tail of its log and its stage is skipped.
set -uo pipefail
R=${R:-/tmp}  # the scratch folder
export PYTHONUNBUFFERED=1 BASAL_LOCAL_HOME=$R/bh
# every record goes to $W; $OUT/ab.tgz holds them all after each stage (one archive to bring back from the GPU machine)
D=${AB_DIR:-$PWD/dist/engine}; OUT=${OUT:-/tmp/out}; W=$R/ab; mkdir -p $OUT $W
DEV=${DEV:-cuda}; PRESET=${PRESET:-4.5B}; PY=${PY:-python3}; ORDER=${ORDER:-old new}; STAGES=${STAGES:-bench http proc2 bench2}; REVERSE=$(echo $ORDER | awk '{print $2, $1}')
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; tar czf $OUT/ab.tgz -C $W .; }
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
for v in whl old new; do
  [ -n "$(ls $D/$v/*.whl 2>/dev/null)" ] || { echo "no wheels in $D/$v: run tools/ab_prepare.sh first"; exit 1; }
done
$PY -m pip install -q --no-index --no-deps --no-compile --target $R/deps $D/whl/*.whl || exit 1
$PY -m pip install -q --no-index --no-deps --no-compile --target $R/old $D/old/*.whl || exit 1
$PY -m pip install -q --no-index --no-deps --no-compile --target $R/new $D/new/*.whl || exit 1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || nproc; } | tee $W/gpu.txt
run() { local v=$1; shift; (cd $R && PYTHONPATH=$R/$v:$R/deps "$@"); }
for v in old new; do  # the daemon's whole import path and its HTTP stack, before any device time is spent
  run $v $PY -c "import basal_local.server.daemon, basal_local.server.app, litestar, uvicorn" \
    && run $v $PY -m basal_local.cli serve -h > /dev/null \
    || { echo "$v: the daemon does not import with the carried wheels ($D/whl); see tools/ab_prepare.sh"; exit 1; }
done
el imports
M=$R/m-$PRESET
run new timeout 120 $PY -m basal_local.cli make-test-model $M --preset $PRESET --device $DEV > /dev/null || exit 1
el model
bench() {
  local v=$1 n=$1; [ -e $W/bench-$v.json ] && n=$v-2
  run $v timeout 120 $PY -m basal_local.cli bench --model $M --device $DEV --json > $W/bench-$n.json 2> $W/bench-$n.err
  $PY -c "
import json; r = json.load(open('$W/bench-$n.json')); s = r.get('single_ms') or {}
print('bench $n single_ms', s.get('median'), 'p95', s.get('p95'), 'b16', r['throughput']['batch16']['decisions_per_s'], 'b32', r['throughput']['batch32']['decisions_per_s'])" 2>&1 | tail -1
  el bench $n
}
serve() {  # version name runs(cN:requests ...) serve-args...
  local v=$1 name=$2 runs=$3; shift 3
  local port=$((18000 + RANDOM % 1000)) log=$W/serve-$v-$name.log
  (cd $R && PYTHONPATH=$R/$v:$R/deps exec $PY -m basal_local.cli serve --model $M --port $port "$@") > $log 2>&1 &
  local pid=$! up=""
  for _ in $(seq 1 150); do
    curl -sf http://127.0.0.1:$port/health > /dev/null && up=1 && break
    kill -0 $pid 2>/dev/null || break  # it exited: its log says why
    sleep 1
  done
  if [ -z "$up" ]; then
    if kill -0 $pid 2>/dev/null; then echo "daemon $v $name: no /health 200 in 150 s; its log ends:"; kill $pid
    else wait $pid; echo "daemon $v $name exited with status $?; its log ends:"; fi
    tail -20 $log; wait $pid 2>/dev/null; return 1
  fi
  el "daemon $v $name ready"
  local U=http://127.0.0.1:$port
  for r in $runs; do
    local c=${r%%:*} q=${r#*:}
    run $v timeout 90 $PY -m basal_local.cli bench --http $U --json --clients $c --requests $q > $W/http-$v-$name-c$c.json
    echo "$v $name c$c: $(cat $W/http-$v-$name-c$c.json)"
  done
  [ $name = 1gpu ] && run $v timeout 60 $PY $PWD/tools/http_answers.py $U $W/answers-$v.json 32 > /dev/null
  kill $pid; wait $pid 2>/dev/null
  el "http $v $name"
}
has() { [[ " $STAGES " == *" $1 "* ]]; }
has bench && for v in $ORDER; do bench $v; done
has http && for v in $ORDER; do serve $v 1gpu "1:200 32:960" --device $DEV; done
has proc2 && for v in $ORDER; do [ $(left) -gt 90 ] && serve $v proc2 "32:960" --device $DEV --replicas 2 --replica-processes; done
if [ -e $W/answers-old.json ] && [ -e $W/answers-new.json ]; then
  (cd $R && PYTHONPATH=$R/new:$R/deps $PY $OLDPWD/tools/http_answers.py --compare $W/answers-old.json $W/answers-new.json) | tee $W/answers-compare.txt
fi
has bench2 && for v in $REVERSE; do [ $(left) -gt 100 ] && bench $v; done
el done
