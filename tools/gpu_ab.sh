#!/usr/bin/env bash
# Old main and a branch side by side in one device call. Prepare here (an ignored folder that the call carries):
#   bash tools/ab_prepare.sh OLD NEW dist/torchgpu --tests   # whl/ (the daemon's dependency closure, checked),
#                                                            # old/, new/ (a wheel each), tests/, oldtests/
# then run: bash tools/gpu_ab.sh A (or B) with carry dist/torchgpu.
# Old main and the torch branch side by side on one H200: PHASE A = build the 4.5B model, in-process bench of
# both (single, batch 16/32, long document, memory, invariance 8), then the CUDA tests of the branch;
# PHASE B = the model, the CUDA tests (the fp8 invariance test alone, and old main's for comparison), both over
# HTTP (c1, c32 + invariance 8), then a second in-process pair. The log is stdout.
set -uo pipefail
export PYTHONUNBUFFERED=1 BASAL_LOCAL_HOME=/tmp/bh
# every record goes to $W; $OUT/ab.tgz holds them all after each stage (one archive to bring back from the GPU machine)
D=${D:-$PWD/dist/torchgpu}; OUT=${OUT:-/tmp/out}; W=/tmp/ab; mkdir -p $OUT $W
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; tar czf $OUT/ab.tgz -C $W .; }
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/deps $D/whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/old $D/old/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/new $D/new/*.whl || exit 1
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton, transformers, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'python', sys.version.split()[0])"; nproc; } | tee $W/gpu.txt
run() { local v=$1; shift; (cd /tmp && PYTHONPATH=/tmp/$v:/tmp/deps "$@"); }
for v in old new; do  # the daemon's whole import path, before any device time is spent
  run $v python3 -c "import basal_local.server.daemon, basal_local.server.app, litestar, uvicorn" \
    && run $v python3 -m basal_local.cli serve -h > /dev/null \
    || { echo "$v: the daemon does not import with the carried wheels ($D/whl); see tools/ab_prepare.sh"; exit 1; }
done
M=/tmp/m-4.5B
run new timeout 120 python3 -m basal_local.cli make-test-model $M --preset 4.5B --device cuda > /dev/null || exit 1
el model
summary() { python3 - "$@" <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        r = json.load(open(path))
    except Exception as exc:
        print(path, "unreadable", exc); continue
    x = r.get("extras", {})
    s = r.get("single_ms") or {}
    print(path.split("/")[-1], "single_ms", s.get("median"), "p95", s.get("p95"),
          "b16", r["throughput"]["batch16"]["decisions_per_s"], "b32", r["throughput"]["batch32"]["decisions_per_s"],
          "warmup_s", r.get("warmup_s"), "inv", x.get("invariance_alone_vs_amid_31"),
          {k: v for k, v in x.items() if k.startswith("long")}, "mem", r.get("memory_after_bench"))
PY
}
bench_pair() {
  for v in "$@"; do
    [ $(left) -lt 200 ] && break
    n=$v; [ -e $W/bench-$v.json ] && n=$v-2
    run $v timeout 150 python3 -m basal_local.cli bench --model $M --device cuda --repeat 2 --json --invariance 8 \
      --long-doc > $W/bench-$n.json 2> $W/bench-$n.err; el bench $n; summary $W/bench-$n.json
  done
}
[ "$1" = A ] && bench_pair old new
if [ "$1" = B ]; then
  rm -rf /tmp/t && cp -r $D/tests /tmp/t
  (cd /tmp && PYTHONPATH=/tmp/new:/tmp/deps timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:faker t/test_cuda.py t/test_cuda_kernels.py t/test_fp8.py -k "not (bitwise_batch_invariance and fp8)" 2>&1 | grep -v "it/s" > $W/cuda_tests-B.txt)
  grep -E "passed|failed|Error|FAILED" $W/cuda_tests-B.txt | tail -12; el tests new
  (cd /tmp && PYTHONPATH=/tmp/new:/tmp/deps timeout 60 python3 -m pytest -q -p no:cacheprovider -p no:faker t/test_cuda.py -k "bitwise_batch_invariance and fp8" 2>&1 | grep -v "it/s" > $W/cuda_tests-new-fp8.txt)
  grep -E "passed|failed|Error|FAILED" $W/cuda_tests-new-fp8.txt | tail -5; el tests new fp8
  # the same fp8 invariance test on old main, for comparison
  rm -rf /tmp/to && mkdir /tmp/to && cp -r $D/oldtests /tmp/to/t
  (cd /tmp/to && PYTHONPATH=/tmp/old:/tmp/deps timeout 60 python3 -m pytest -q -p no:cacheprovider -p no:faker t/test_cuda.py -k "bitwise_batch_invariance and fp8" 2>&1 | grep -v "it/s" > $W/cuda_tests-old-fp8.txt)
  grep -E "passed|failed|Error|FAILED" $W/cuda_tests-old-fp8.txt | tail -5; el tests old fp8
  for v in old new; do
    port=$((18000 + RANDOM % 1000))
    (cd /tmp && PYTHONPATH=/tmp/$v:/tmp/deps exec python3 -m basal_local.cli serve --model $M --device cuda --port $port) > $W/serve-$v.log 2>&1 &
    pid=$! up=""
    for _ in $(seq 1 150); do
      curl -sf http://127.0.0.1:$port/health > /dev/null && up=1 && break
      kill -0 $pid 2>/dev/null || break  # it exited: its log says why
      sleep 1
    done
    if [ -z "$up" ]; then
      if kill -0 $pid 2>/dev/null; then echo "daemon $v: no /health 200 in 150 s; its log ends:"; kill $pid
      else wait $pid; echo "daemon $v exited with status $?; its log ends:"; fi
      tail -20 $W/serve-$v.log; wait $pid 2>/dev/null; continue
    fi
    el "daemon $v ready"
    U=http://127.0.0.1:$port
    run $v timeout 60 python3 -m basal_local.cli bench --http $U --json --clients 1 --requests 268 > $W/http-$v-c1.json
    run $v timeout 90 python3 -m basal_local.cli bench --http $U --json --clients 32 --requests 1280 --invariance 8 > $W/http-$v-c32i.json
    curl -s $U/api/stats > $W/stats-$v.json; kill $pid; wait $pid 2>/dev/null
    echo "$v c1: $(cat $W/http-$v-c1.json)"; echo "$v c32i: $(cat $W/http-$v-c32i.json)"; el "http $v"
  done
  bench_pair new old
fi
if [ "$1" = A ]; then
rm -rf /tmp/t && cp -r $D/tests /tmp/t
  sel=${TESTS:-"t/test_cuda.py t/test_cuda_kernels.py"}
  (cd /tmp && PYTHONPATH=/tmp/new:/tmp/deps timeout $(( $(left) > 30 ? $(left) : 30 )) python3 -m pytest -q -p no:cacheprovider -p no:faker $sel 2>&1 | grep -v "it/s" > $W/cuda_tests-$1.txt)
  grep -E "passed|failed|Error|assert|FAILED" $W/cuda_tests-$1.txt | tail -15; el tests
fi
