"""Compile, on every core, the bytecode of the installed modules the suite imports (a fresh install has none).

The README installs with `pip install --no-compile` (compiling every .py of torch, transformers and sympy is
~12,000 files, minutes of CPU, and the tests import a third of them). Python then compiles a module the first time
a process imports it, in that process, one file after another: on a fresh clone the first `import torch` costs
~31 s of CPU instead of ~9 s, and the fork server, the transformers reference and the collection each compiled
their own import chain on one core. `tests/bytecode.txt` lists the site-packages files a whole run imports (any
process of it); `compile_listed` compiles them in one process per core before anything imports them. A file the
list misses is compiled on import as before, and a listed file that is not installed is skipped, so a list older
than the installed versions costs a little time, never a failure.

Regenerate the list after a whole run on a fresh install (its `__pycache__` folders are then exactly what the run
imported): `.venv/bin/python -m tests.bytecode --write`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

LIST = Path(__file__).with_name("bytecode.txt")
SKIP = ("pip", "setuptools", "_distutils_hack", "pkg_resources", "__editable__")  # the installer's, or per install


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def listed(site: Path) -> list[Path]:
    """The installed files of the list (a line is a folder relative to site-packages, then its module names)."""
    files = []
    for line in LIST.read_text().splitlines():
        folder, *names = line.split()
        files += [site / folder / f"{name}.py" for name in names]
    return [f for f in files if f.exists()]


# What the fork server (tests/zygote.py) does not import, in the order the late pass compiles it: the workers'
# collection imports the first ones (the dashboard's and the property tests' libraries), the transformers reference
# the rest (transformers pulls in torch's dynamo and distributed packages, sympy and networkx).
LATE = ("textual", "rich", "pygments", "jinja2", "markupsafe", "hypothesis", "gguf", "huggingface_hub", "transformers",
        "torch/_dynamo", "torch/_inductor", "torch/onnx", "sympy", "mpmath", "networkx")


def _late_rank(site: Path, f: Path) -> int:
    rel = f.relative_to(site).as_posix()
    return next((i for i, top in enumerate(LATE) if rel.startswith(top + "/")), -1)


def compile_listed(env: dict | None = None, jobs: int | None = None, late: bool | None = None) -> list[subprocess.Popen]:
    """Start one `compileall` per core on a share of the listed files (biggest first, dealt round-robin so the
    shares are even); returns the processes (wait for them). compileall writes where an import looks
    (`importlib.util.cache_from_source`, PYTHONPYCACHEPREFIX included). `late=False`: only what the fork server
    imports; `late=True`: only the rest (LATE), in LATE's order."""
    site = site_packages()
    files = sorted(listed(site), key=lambda f: f.stat().st_size, reverse=True)
    if late is not None:
        files = [f for f in files if (_late_rank(site, f) >= 0) == late]
    if late:
        files.sort(key=lambda f: _late_rank(site, f))  # stable: biggest first within a package
    if jobs is None:
        try:
            jobs = len(os.sched_getaffinity(0))
        except AttributeError:  # macOS, Windows
            jobs = os.cpu_count() or 1
    procs = []
    for share in (files[i::jobs] for i in range(jobs)):
        if share:
            proc = subprocess.Popen([sys.executable, "-m", "compileall", "-q", "-i", "-"], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, env=env, text=True)
            proc.stdin.write("\n".join(map(str, share)) + "\n")
            proc.stdin.close()
            procs.append(proc)
    return procs


def write_list(site: Path) -> int:
    """Write tests/bytecode.txt from the bytecode cached under `site` (after a whole run on a fresh install)."""
    folders: dict[str, list[str]] = {}
    tag = sys.implementation.cache_tag
    for pyc in site.rglob(f"__pycache__/*.{tag}.pyc"):
        source = pyc.parent.parent / (pyc.name.split(".")[0] + ".py")
        rel = source.relative_to(site)
        if source.exists() and not rel.parts[0].startswith(SKIP):
            folders.setdefault(rel.parent.as_posix(), []).append(rel.stem)
    LIST.write_text("".join(f"{folder} {' '.join(sorted(names))}\n" for folder, names in sorted(folders.items())))
    return sum(map(len, folders.values()))


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        print(f"{write_list(site_packages())} files listed in {LIST}")
    else:
        sys.exit("usage: python -m tests.bytecode --write")
