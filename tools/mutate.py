"""Plant known bugs one at a time in a temporary copy of the repository and check that the tests catch each.

    .venv/bin/python tools/mutate.py [--list | --only NAME ... | --baseline | --markdown | -v]

Each mutation (tests/mutations.py) names a file, an exact snippet (found exactly once, or the mutation is STALE),
its replacement, and the narrow set of tests that must fail. A fresh copy per mutation keeps them independent; the
copy imports its own package, laid out as the wheel installs it, never the source tree's editable install. The
result is "caught" only when pytest reported failing tests (exit 1) or ran past its timeout; an import or
collection error (exit 2-4) is an ERROR. --baseline runs the same selections on the unmutated copy; --markdown
prints the table as docs/TESTING.md shows it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IGNORE = shutil.ignore_patterns(".git", ".venv", ".test-cache", "build", "dist", "*.egg-info", "__pycache__",
                                ".*_cache", "*.whl")
sys.path.insert(0, str(ROOT))
from tests.mutations import MUTATIONS, Mutation  # noqa: E402


def make_copy(target: Path) -> None:
    shutil.copytree(ROOT, target, ignore=IGNORE)
    # import the copy as the wheel lays it out: basal_local.backends, .cuda_kernels, .metal_shaders, .assets, .tui
    # (a folder left out here is imported from the source tree's editable install: its mutations never show)
    for name in ("backends", "cuda_kernels", "metal_shaders", "assets", "tui"):
        (target / "basal_local" / name).symlink_to(Path("..") / name, target_is_directory=True)


def apply(mutation: Mutation, root: Path) -> str | None:
    """Apply the edits; returns None, or why the mutation no longer fits the code (STALE)."""
    path = root / mutation.file
    text = path.read_text(encoding="utf-8")
    for original, replacement in mutation.edits:
        count = text.count(original)
        if count != 1:
            return f"snippet found {count} times in {mutation.file}: {original.strip()[:60]!r}"
        text = text.replace(original, replacement)
    path.write_text(text, encoding="utf-8")
    return None


def run_tests(root: Path, tests: tuple[str, ...], timeout: int, models: Path | None) -> tuple[int | None, str, float]:
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    if models is not None:  # test models generated once by the unmutated code (tests/conftest.py)
        env["BASAL_LOCAL_TEST_MODELS"] = str(models)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", *tests]
    started = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-2000:]
        return None, tail.decode(errors="replace") if isinstance(tail, bytes) else tail, time.perf_counter() - started
    return out.returncode, (out.stdout + out.stderr)[-2000:], time.perf_counter() - started


def verdict(rc: int | None) -> str:
    return "caught (timeout)" if rc is None else {0: "MISSED", 1: "caught"}.get(rc, f"ERROR (pytest exit {rc})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    ap.add_argument("--baseline", action="store_true", help="run each selection on the unmutated copy")
    ap.add_argument("--markdown", action="store_true", help="print the result table in Markdown")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the test output of each run")
    args = ap.parse_args(argv)
    chosen = MUTATIONS
    if args.only:
        unknown = set(args.only) - {x.name for x in MUTATIONS}
        if unknown:
            ap.error(f"unknown mutation(s): {', '.join(sorted(unknown))} (see --list)")
        chosen = [x for x in MUTATIONS if x.name in args.only]
    if args.list:
        for x in chosen:
            print(f"{x.name:26} {x.file:36} {' '.join(x.tests)}\n{'':26} {x.behaviour}")
        return 0
    rows = []
    models_dir = tempfile.TemporaryDirectory(prefix="mutate-models-")
    models = Path(models_dir.name)
    for preset, seed in (("tiny", 1), ("small", 2)):  # as tests/conftest.py names them
        from basal_local.model.testmodel import make_test_model

        make_test_model(models / f"{preset}-seed{seed}", preset=preset, seed=seed)
    for x in chosen:
        with tempfile.TemporaryDirectory(prefix=f"mutate-{x.name}-") as tmp:
            root = Path(tmp) / "repo"
            make_copy(root)
            stale = None if args.baseline else apply(x, root)
            # a planted bug in the model generator must generate its own models
            shared = None if x.file == "basal_local/model/testmodel.py" else models
            if stale:
                result, seconds, tail = f"STALE ({stale})", 0.0, ""
            else:
                rc, tail, seconds = run_tests(root, x.tests, x.timeout, shared)
                result = ("ok" if rc == 0 else f"BASELINE FAILS (exit {rc})") if args.baseline else verdict(rc)
        rows.append((x, result, seconds))
        print(f"{x.name:26} {result:18} {seconds:6.1f} s  {x.behaviour}", flush=True)
        if args.verbose or result.startswith(("ERROR", "BASELINE FAILS")):
            print("    " + tail.strip().replace("\n", "\n    "))
    models_dir.cleanup()
    good = "ok" if args.baseline else "caught"
    n_good = sum(r.startswith(good) for _, r, _ in rows)
    print(f"\n{n_good}/{len(rows)} {good}")
    if args.markdown:
        print("\n| mutation | behaviour protected | file | tests run | result | s |\n|---|---|---|---|---|---|")
        for x, result, seconds in rows:
            tests = ", ".join(f"`{t.removeprefix('tests/')}`" for t in x.tests)
            print(f"| `{x.name}` | {x.behaviour} | `{x.file}` | {tests} | {result} | {seconds:.0f} |")
    return 0 if n_good == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
