#!/usr/bin/env bash
# Dead replica workers on GPUs (nvidia-h200-x2 or more): tools/killtest.py against a daemon with one worker process
# per GPU (CUDA workers killed and started again under load). Results in $OUT/killtest.txt.
# Here: .whl holds the basal-local wheel and the daemon's wheels, as for tools/gpu_gpu2.sh; SKIP_INSTALL=1 uses
# the installed package. DEVICES (default: every GPU), SECONDS_RUN (default 60), PRESET (default tiny).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -z "${SKIP_INSTALL:-}" ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export BASAL_LOCAL_HOME=/tmp/bh-kill
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
DEVICES=${DEVICES:-$(python3 -c "print(','.join(f'cuda:{i}' for i in range($N)))")}
M=/tmp/m-kill-${PRESET:-tiny}
[ -d $M ] || (cd /tmp && python3 -m basal_local.cli make-test-model $M --preset ${PRESET:-tiny} --device cuda > /dev/null) || exit 1
echo "gpus $N, devices $DEVICES" | tee "$OUT/killtest.txt"
timeout 400 python3 tools/killtest.py --model $M --devices "$DEVICES" --replicas 1 --clients 16 \
  --seconds ${SECONDS_RUN:-60} --every 6 2>&1 | tee -a "$OUT/killtest.txt"
echo "killtest exit ${PIPESTATUS[0]}" | tee -a "$OUT/killtest.txt"
