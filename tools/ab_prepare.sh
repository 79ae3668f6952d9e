#!/usr/bin/env bash
# Prepare the folder that tools/engine_ab.sh and tools/gpu_ab.sh carry to a GPU machine without a package index
# (run here, in the repository root, with the project's venv active):
#   bash tools/ab_prepare.sh OLD NEW [DIR] [--tests]     (bash tools/ab_prepare.sh --check DIR: only the check)
# DIR (default dist/engine) gets old/ and new/ (one basal-local wheel each, `pip wheel --no-deps` of each commit),
# whl/ (the daemon's dependency closure for CPython $PYVER, default 3.12, on manylinux x86-64, at the versions of
# this venv where it has them), and with --tests the tests folders of both commits (tests/, oldtests/: gpu_ab.sh's
# CUDA tests).
# The heavy packages the GPU image already holds (torch, numpy, tokenizers, safetensors, huggingface_hub,
# prometheus-client) are not carried; the check at the end proves that every requirement of every carried wheel is
# met by another carried wheel or by a package of that image, and prints the folder's size (a call carries 64 MiB).
set -euo pipefail
PY=${PYTHON:-python}; export PYVER=${PYVER:-3.12}  # the Python of the machine that runs the wheels
check_closure() { $PY - "$1" <<'PY'
"""Every requirement of every carried wheel is met by a carried wheel (name and version) or by the GPU image."""
import os, re, sys, zipfile
from pathlib import Path
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.version import Version

# the Python packages preinstalled on the GPU machines (their image's package list; a name only, versions unknown)
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnxruntime opencv-python-headless optax
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow
pybind11 py-cpuinfo pygments pyparsing pyproject-hooks python-dateutil pyyaml regex requests rich safetensors scipy
setuptools shellingham simplejson six sortedcontainers sympy tabulate threadpoolctl tokenizers toolz torch tqdm
transformers triton typer typing-extensions typing-inspect urllib3 uvloop werkzeug wheel wrapt xxhash yarl zipp""".split())
norm = lambda name: re.sub(r"[-_.]+", "-", name.lower())
root = Path(sys.argv[1])
wheels = sorted(root.glob("*/*.whl"))
carried = {}
for w in wheels:
    name, version = w.name.split("-")[:2]
    if norm(name) in carried and w.parent.name == "whl":
        sys.exit(f"two versions of {name} in {root}/whl: pip --target would stop")
    carried.setdefault(norm(name), Version(version))
env = {"python_version": os.environ["PYVER"], "python_full_version": os.environ["PYVER"] + ".0", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}
missing = []
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = Requirement(line[len("Requires-Dist: "):])
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = norm(req.name)
        if name in carried:
            if carried[name] not in req.specifier:
                missing.append(f"{w.name} needs {req}, carried {carried[name]}")
        elif name not in IMAGE:
            missing.append(f"{w.name} needs {req}: neither carried nor on the image")
if missing:
    sys.exit("\n".join(missing))
size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
print(f"{root}: {len(wheels)} wheels, closure complete, {size / 2**20:.1f} MiB")
PY
}
if [ "${1:-}" = --check ]; then check_closure "${2:?usage: ab_prepare.sh --check DIR}"; exit; fi
OLD=${1:?usage: ab_prepare.sh OLD NEW [DIR] [--tests]}; NEW=${2:?usage: ab_prepare.sh OLD NEW [DIR] [--tests]}
DIR=${3:-dist/engine}; [ "$DIR" = --tests ] && DIR=dist/engine
TESTS=""; for a in "$@"; do [ "$a" = --tests ] && TESTS=1; done
rm -rf "$DIR" && mkdir -p "$DIR"/old "$DIR"/new "$DIR"/whl
SRC=$(mktemp -d); trap 'rm -rf "$SRC"' EXIT
for v in old new; do
  ref=$OLD; [ $v = new ] && ref=$NEW
  mkdir -p "$SRC/$v" && git archive "$ref" | tar x -C "$SRC/$v"
  $PY -m pip wheel -q --no-deps --no-build-isolation -w "$DIR/$v" "$SRC/$v"
  if [ -n "$TESTS" ]; then t=tests; [ $v = old ] && t=oldtests; cp -r "$SRC/$v/tests" "$DIR/$t"; fi
done
# the daemon's direct requirements without the heavy ones the image holds; pinned to this venv's versions
DEPS=$($PY - "$DIR"/new/*.whl <<'PY'
import os, re, sys, zipfile
from pip._vendor.packaging.requirements import Requirement
ON_IMAGE = {"torch", "numpy", "tokenizers", "safetensors", "huggingface-hub", "prometheus-client", "mlx"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
env = {"python_version": os.environ["PYVER"], "sys_platform": "linux", "platform_machine": "x86_64", "extra": ""}
for line in meta.splitlines():
    if line.startswith("Requires-Dist: "):
        req = Requirement(line[len("Requires-Dist: "):])
        if (req.marker is None or req.marker.evaluate(env)) and re.sub(r"[-_.]+", "-", req.name.lower()) not in ON_IMAGE:
            print(str(req).split(";")[0])
PY
)
$PY -m pip freeze --exclude-editable > "$SRC/constraints.txt"
# shellcheck disable=SC2086
$PY -m pip download -q --only-binary=:all: --python-version $PYVER --implementation cp --abi cp${PYVER/./} \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -c "$SRC/constraints.txt" -d "$DIR/whl" $DEPS 2> >(grep -v "is ignored: it is neither" >&2)
check_closure "$DIR"
