#!/usr/bin/env bash
# One device call: install the carried wheels, run the CUDA tests, build the 4.5B preset, benchmark it side by
# side with transformers, and measure f16 batch invariance. Results land in $OUT.
# Here: rm -rf .whl && .venv/bin/pip wheel -q --no-deps -w .whl . platformdirs
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  rm -rf /tmp/t && cp -r tests /tmp/t
  (cd /tmp && python3 -m pytest -q -s -p no:cacheprovider -p no:logging t/test_cuda.py 2>&1 | tee "$OUT/cuda_tests.txt" | grep -v "it/s")
fi
PRESETS=${PRESETS:-4.5B}
for preset in $PRESETS; do
  t0=$(date +%s)
  (cd /tmp && python3 -m basal_local.cli make-test-model /tmp/m-$preset --preset $preset --device cuda) || exit 1
  echo "make-test-model $preset: $(( $(date +%s) - t0 )) s"
  if [ -z "${SKIP_SDPA:-}" ]; then
    (cd /tmp && python3 -m basal_local.cli bench --model /tmp/m-$preset --device cuda --repeat 2 --attention sdpa \
      --json > "$OUT/bench-$preset-sdpa.json" 2> "$OUT/bench-$preset-sdpa.err")
    tail -3 "$OUT/bench-$preset-sdpa.err"; cat "$OUT/bench-$preset-sdpa.json"; echo
  fi
  (cd /tmp && python3 -m basal_local.cli bench --model /tmp/m-$preset --device cuda --repeat 2 --attention ${ATTN:-auto} \
    --baseline transformers --json > "$OUT/bench-$preset.json" 2> "$OUT/bench-$preset.err")
  tail -3 "$OUT/bench-$preset.err"; cat "$OUT/bench-$preset.json"; echo
  python3 "$PWD/tools/invariance.py" /tmp/m-$preset | tee "$OUT/invariance-$preset.txt"
done
