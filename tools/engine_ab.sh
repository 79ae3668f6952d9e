#!/usr/bin/env bash
# Issue 24: old main and the engine branch side by side on one H200, interleaved: the 4.5B test model, then the
# in-process bench of both, HTTP 1 and 32 clients against a daemon of each, 2 replica processes on one GPU
# (32 clients), answers of both daemons compared bitwise; a second in-process bench pair (new first) if time is left.
set -uo pipefail
export PYTHONUNBUFFERED=1 BASAL_LOCAL_HOME=/tmp/bh
# AB_DIR holds whl/ (the daemon's dependency wheels) and old/ and new/ (one basal-local wheel each)
D=${AB_DIR:-$PWD/dist/engine}; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( ${BUDGET:-460} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/deps $D/whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/old $D/old/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/new $D/new/*.whl || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/gpu.txt
run() { local v=$1; shift; (cd /tmp && PYTHONPATH=/tmp/$v:/tmp/deps "$@"); }
M=/tmp/m-4.5B
run new timeout 120 python3 -m basal_local.cli make-test-model $M --preset 4.5B --device cuda > /dev/null || exit 1
el model
bench() {
  local v=$1 n=$1; [ -e $OUT/bench-$v.json ] && n=$v-2
  run $v timeout 120 python3 -m basal_local.cli bench --model $M --device cuda --json > $OUT/bench-$n.json 2> $OUT/bench-$n.err
  python3 -c "
import json; r = json.load(open('$OUT/bench-$n.json'))
print('bench $n single_ms', r.get('single_ms'), 'p95', r.get('single_ms_p95'), 'b16', r['throughput']['batch16']['decisions_per_s'], 'b32', r['throughput']['batch32']['decisions_per_s'])" 2>&1 | tail -1
  el bench $n
}
serve() {  # version name runs(cN:requests ...) serve-args...
  local v=$1 name=$2 runs=$3; shift 3
  local port=$((18000 + RANDOM % 1000))
  (cd /tmp && PYTHONPATH=/tmp/$v:/tmp/deps exec python3 -m basal_local.cli serve --model $M --port $port "$@") > $OUT/serve-$v-$name.log 2>&1 &
  local pid=$!
  local up=""
  for _ in $(seq 1 120); do
    curl -sf http://127.0.0.1:$port/health > /dev/null && up=1 && break
    kill -0 $pid 2>/dev/null || break  # it exited: its log says why
    sleep 1
  done
  if [ -z "$up" ]; then echo "daemon $v $name did not come up:"; tail -15 $OUT/serve-$v-$name.log; kill $pid 2>/dev/null; return 1; fi
  el "daemon $v $name ready"
  local U=http://127.0.0.1:$port
  for r in $runs; do
    local c=${r%%:*} q=${r#*:}
    run $v timeout 90 python3 -m basal_local.cli bench --http $U --json --clients $c --requests $q > $OUT/http-$v-$name-c$c.json
    echo "$v $name c$c: $(cat $OUT/http-$v-$name-c$c.json)"
  done
  [ $name = 1gpu ] && run $v timeout 60 python3 $PWD/tools/http_answers.py $U $OUT/answers-$v.json 32 > /dev/null
  kill $pid; wait $pid 2>/dev/null
  el "http $v $name"
}
bench old; bench new
for v in old new; do serve $v 1gpu "1:200 32:960" --device cuda; done
for v in old new; do [ $(left) -gt 90 ] && serve $v proc2 "32:960" --device cuda --replicas 2 --replica-processes; done
(cd /tmp && PYTHONPATH=/tmp/new:/tmp/deps python3 $OLDPWD/tools/http_answers.py --compare $OUT/answers-old.json $OUT/answers-new.json) | tee $OUT/answers-compare.txt
[ $(left) -gt 100 ] && bench new
[ $(left) -gt 100 ] && bench old
el done
