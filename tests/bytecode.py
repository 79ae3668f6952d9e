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


def rewrite_tests(env: dict | None = None) -> subprocess.Popen:
    """Start one process that writes the assertion-rewritten bytecode of the test modules, and the bytecode of the
    suite's helper modules, where the workers look for them (on a fresh clone each of the four workers rewrote
    every test module while the others did the same: ~5 s of CPU each)."""
    return subprocess.Popen([sys.executable, "-m", "tests.bytecode", "--rewrite-tests"], env=env,
                            cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL)


def _rewrite_test_modules(folder: Path) -> None:
    """What pytest's import hook does on a cache miss (`AssertionRewritingHook.exec_module`), for every test
    module: rewrite, then write the pyc atomically under pytest's name for it. The hook checks a cached pyc's
    source size and mtime, so a stale or foreign one is only rewritten again. With the `enable_assertion_pass_hook`
    ini option the rewrite would differ: then nothing is written here."""
    import compileall
    import tomllib

    from _pytest.assertion import rewrite

    for helper in folder.glob("*.py"):  # plain imports (pytest rewrites the test modules and conftest.py)
        if not helper.name.startswith("test_") and helper.name != "conftest.py":
            compileall.compile_file(helper, quiet=1)
    ini = tomllib.loads((folder.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    if ini.get("enable_assertion_pass_hook") or ini.get("python_files"):
        return
    trace = _Trace()
    for fn in sorted(folder.glob("test_*.py")):
        pyc = rewrite.get_cache_dir(fn) / (fn.name[:-3] + rewrite.PYC_TAIL)
        if rewrite._read_pyc(fn, pyc, trace) is None and rewrite.try_makedirs(pyc.parent):
            source_stat, co = rewrite._rewrite_test(fn, None)  # no config: the assertion pass hook off (default)
            rewrite._write_pyc(trace, co, source_stat, pyc)


class _Trace:
    """The `state` and `trace` pytest's pyc helpers write their notes to (nobody reads them here)."""

    def __call__(self, message: str) -> None:
        pass

    def trace(self, message: str) -> None:
        pass


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
    elif sys.argv[1:] == ["--rewrite-tests"]:
        try:
            _rewrite_test_modules(Path(__file__).resolve().parent)
        except (AttributeError, ImportError, TypeError):  # pytest's private helpers changed: the workers rewrite
            pass
    else:
        sys.exit("usage: python -m tests.bytecode --write | --rewrite-tests")
