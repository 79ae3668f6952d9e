#!/usr/bin/env bash
# Models at run time on a GPU (server/models.py): does an unload give the device memory back, and does a reload
# answer bit for bit as before? One daemon on cuda:0 in process, then one with the model in a worker process:
# 32 sample decisions, then 5 x (unload, load, the same 32 decisions). Prints one JSON line per step and a verdict
# line per daemon; outputs in $OUT. Run from the repo root on a CUDA machine (no network):
#   bash tools/gpu_unload.sh              (PRESET=4.5B by default; MODEL_DIR=... to reuse a model directory)
# Here: .whl holds the basal-local wheel and the daemon's wheels as for tools/gpu_gpu2.sh; SKIP_INSTALL=1 runs the
# checkout itself (its dependencies installed).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -z "${SKIP_INSTALL:-}" ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export BASAL_LOCAL_HOME=/tmp/bh-unload
PRESET=${PRESET:-4.5B}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu PRESET=tiny SKIP_INSTALL=1: the same steps without a GPU (no memory figures)
M=${MODEL_DIR:-/tmp/m-$PRESET}
[ -d "$M" ] || python3 -m basal_local.cli make-test-model "$M" --preset "$PRESET" --device "$DEVICE" > /dev/null || exit 1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"

check() {  # name, serve args...
  local name=$1; shift
  local port=$((8700 + RANDOM % 200))
  python3 -m basal_local.cli serve --model "$M" --port $port "$@" > "$OUT/serve-$name.log" 2>&1 &
  local pid=$!
  python3 - "$name" "http://127.0.0.1:$port" <<'PY' | tee "$OUT/unload-$name.jsonl"
import json, subprocess, sys, time, urllib.error, urllib.request

name, url = sys.argv[1], sys.argv[2]

def call(method, path, body=None, timeout=900):
    req = urllib.request.Request(url + path, None if body is None else json.dumps(body).encode(),
                                 {"content-type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())

deadline = time.time() + 900
while True:
    try:
        if call("GET", "/health", timeout=2)[0] == 200:
            break
    except OSError:
        pass
    if time.time() > deadline:
        sys.exit(f"{name}: the daemon did not get ready")
    time.sleep(0.5)

def smi_mib():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # no GPU (DEVICE=cpu)

def ps():
    (m,) = [m for m in call("GET", "/api/ps")[1]["models"] if m.get("default")]
    return m

from basal_local.bench import single_question_requests  # the bench's sample decisions

model = ps()["name"]
bodies = single_question_requests(model)[:32]

def answers():
    out = []
    for body in bodies:
        status, answer = call("POST", "/v1/systemone", body)
        assert status == 200, (status, answer)
        out.append(answer["answers"])
    return out

first = answers()
loaded = {"step": "loaded", "smi_mib": smi_mib(), "device_allocated_bytes": ps().get("device_allocated_bytes"),
          "weights_bytes": ps().get("weights_bytes")}
print(json.dumps(loaded), flush=True)
rows, same = [], True
for cycle in range(5):
    t0 = time.perf_counter()
    status, body = call("POST", "/api/unload", {"model": model, "wait": True})
    unload_s = time.perf_counter() - t0
    time.sleep(1.0)
    gone = smi_mib()
    t0 = time.perf_counter()
    status2, body2 = call("POST", "/api/load", {"model": model, "wait": True})
    load_s = time.perf_counter() - t0
    again = answers()
    same = same and again == first
    row = {"step": f"cycle {cycle + 1}", "unload_status": status, "unloaded": body.get("unloaded"),
           "unload_s": round(unload_s, 2), "smi_mib_unloaded": gone, "load_status": status2,
           "load_s": round(load_s, 2), "smi_mib_reloaded": smi_mib(), "answers_bitwise_equal": again == first}
    rows.append(row)
    print(json.dumps(row), flush=True)
freed = loaded["smi_mib"] - max(r["smi_mib_unloaded"] for r in rows)
growth = max(r["smi_mib_reloaded"] for r in rows) - loaded["smi_mib"]
print(json.dumps({"verdict": name, "freed_mib_at_least": freed, "weights_mib": (loaded["weights_bytes"] or 0) >> 20,
                  "reloaded_growth_mib": growth, "answers_bitwise_equal_every_cycle": same}), flush=True)
PY
  kill -INT $pid; wait $pid
  echo "$name: daemon exit status $?"
}

if [ "$DEVICE" = cuda ]; then
  check inprocess --device cuda
  check process --devices cuda:0 --replica-processes
else
  check inprocess --device cpu
  check process --devices cpu --replica-processes
fi
