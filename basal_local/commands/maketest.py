"""`basal-local make-test-model`: a random-weight model folder of the contract, in any shipped port's layout.

The model is written into a side folder inside the target and moved into place only when complete (the earlier
test model there set aside first and put back on any failure): an interrupt, a failed conversion or a full disk
leave the folder as it was, never half a model or a bf16 one where another format was asked for. Inside the
target, not beside it: a mount point (a container's volume) is its own filesystem, across which files cannot be
renamed, and its parent may not be writable.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
from pathlib import Path

from ..model.testformats import check_format, convert_test_model
from ..model.testmodel import PRESETS
from ..model.testmodel import make_test_model as write_model
from ..paths import process_alive
from . import UserError
from .serving import check_device

SIDE = (".making-", ".previous-")  # this command's side folders: `.making-PID`, `.previous-PID`


def make_test_model(args: argparse.Namespace) -> int:
    out = Path(args.directory).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file", "give make-test-model a new or empty folder")
    _drop_stale_sides(out)
    if out.is_dir() and any(not p.name.startswith(SIDE) for p in out.iterdir()) and not (out / "basal.json").exists():
        raise UserError(f"{out} is not empty and holds no model",
                        "give make-test-model a new or empty folder (an existing test model is overwritten)")
    if args.device == "cuda":
        check_device("cuda")
    # the package a shipped port's layout is written with, checked before a bf16 model is written to convert
    needs = "mlx" if args.format.startswith("mlx") else "gguf" if args.format.startswith("gguf") else None
    if needs and importlib.util.find_spec(needs) is None:
        raise UserError(f"--format {args.format} is written with the {needs} package, which is not installed",
                        "pip install 'mlx[cpu]' (Linux; mlx on a Mac)" if needs == "mlx" else "pip install gguf")
    if args.format != "bf16":
        try:
            check_format(PRESETS[args.preset], args.format)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    created = not out.exists()
    work = out / f"{SIDE[0]}{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK):
            raise PermissionError(13, "Permission denied")
        work.mkdir()
    except OSError as exc:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise UserError(f"cannot write the test model to {out} ({exc.strerror or exc})",
                        "give make-test-model a folder you can write to") from None
    print(f"basal-local: making the {args.preset} test model in {out}", flush=True)
    try:
        write_model(work, preset=args.preset, seed=args.seed, name=args.name, device=args.device,
                    progress=lambda step: print(f"  {step}...", flush=True), evidence_head=args.evidence_head)
        if args.format != "bf16":
            print(f"  writing the {args.format} layout...", flush=True)
            convert_test_model(work, args.format, seed=args.seed, device=args.device)
        _swap_in(out, work)
    except KeyboardInterrupt:
        raise UserError(f"interrupted: {out} is as it was", "run the same command again", status=130) from None
    except ValueError as exc:
        raise UserError(f"{exc}; {out} is as it was") from None
    except OSError as exc:  # the disk filled up, or a file in the folder could not be replaced
        raise UserError(f"cannot write the test model to {out} ({exc.strerror or exc}); it is as it was",
                        "free disk space, or give make-test-model another folder") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # a folder this run made and did not fill
    print(f"basal-local: wrote {args.preset} test model ({args.format}) to {out}")
    return 0


def _swap_in(out: Path, work: Path) -> None:
    """The finished model in `work` moved into `out`, the earlier test model there set aside first and put back if
    a move fails (renames within one folder: one filesystem)."""
    previous = out / f"{SIDE[1]}{os.getpid()}"
    previous.mkdir()
    placed: list[Path] = []
    try:
        for old in [p for p in out.iterdir() if not p.name.startswith(SIDE)]:
            old.rename(previous / old.name)
        for new in list(work.iterdir()):
            new.rename(out / new.name)
            placed.append(out / new.name)
    except BaseException:
        for p in placed:
            _remove(p)
        for old in list(previous.iterdir()):
            old.rename(out / old.name)
        raise
    finally:
        shutil.rmtree(previous, ignore_errors=True)


def _drop_stale_sides(out: Path) -> None:
    """Side folders a killed run left (its process gone)."""
    if not out.is_dir():
        return
    for side in out.iterdir():
        pid = side.name.rsplit("-", 1)[-1]
        if side.name.startswith(SIDE) and pid.isdigit() and not process_alive(int(pid)):
            _remove(side)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
