"""`basal-local doctor`: is this machine ready? Each line ok / warn / fail with the fix; exit 1 on a failure."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from .. import __version__
from ..model.registry import cached_models
from ..paths import home_dirs
from ..settings import Settings, config_path
from . import UserError, get_json, human_bytes, port_free

PACKAGES = ("torch", "litestar", "uvicorn", "msgspec", "tokenizers", "safetensors", "huggingface_hub", "numpy",
            "platformdirs", "zstandard")


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def available_memory() -> int | None:
    """Bytes of RAM available now (Linux /proc/meminfo, macOS/Windows via psutil when installed)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil  # optional: only where /proc/meminfo is missing (macOS, Windows)

        return int(psutil.virtual_memory().available)
    except Exception:
        return None


def run_checks(port: int | None = None) -> list[Check]:
    checks: list[Check] = []
    py = platform.python_version()
    checks.append(Check("python", "ok" if sys.version_info >= (3, 11) else "fail", f"{py} ({sys.executable})",
                        "" if sys.version_info >= (3, 11) else "install Python 3.11 or newer"))
    missing = [p for p in PACKAGES if _version(p) is None]
    versions = ", ".join(f"{p} {_version(p)}" for p in PACKAGES if p not in missing)
    checks.append(Check("packages", "fail" if missing else "ok", f"basal-local {__version__}; {versions}",
                        f"pip install {' '.join(missing)}" if missing else ""))

    # devices
    gpu_memory = None
    try:
        import torch  # heavy (seconds on a small machine), and its failure to import is a check's result

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            gpu_memory = free
            checks.append(Check("cuda", "ok", f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), "
                                f"{human_bytes(free)} free of {human_bytes(total)}"))
        else:
            if torch.version.cuda is None:
                why, fix = "this PyTorch build has no CUDA", "for an NVIDIA GPU install a CUDA build of PyTorch (pytorch.org)"
            else:  # the build is right; the GPU or its driver is what is missing
                why = f"this PyTorch has CUDA {torch.version.cuda} but sees no NVIDIA GPU"
                fix = "on a machine with an NVIDIA GPU, install or update its driver (`nvidia-smi` should list it)"
            checks.append(Check("cuda", "warn", f"{why}: models run on the CPU (fine for the demo, slow for "
                                "real models)", fix))
    except Exception as exc:
        checks.append(Check("torch", "fail", f"PyTorch does not import ({type(exc).__name__})",
                            'pip install "torch>=2.4"'))
    if sys.platform == "darwin" and platform.machine() == "arm64":
        from basal_local.backends.select import mlx_available  # the backends import torch: only on a Mac

        checks.append(Check("mlx", "ok" if mlx_available() else "warn",
                            "MLX + Metal available (the MLX backend is not implemented yet: torch on the CPU)"
                            if mlx_available() else "MLX/Metal not available", "" if mlx_available()
                            else "pip install mlx"))
    memory = available_memory()
    checks.append(Check("memory", "ok" if memory else "warn",
                        f"{human_bytes(memory)} RAM available" if memory else "cannot tell the available RAM",
                        "" if memory else "pip install psutil (lets doctor read it)"))

    # models
    try:
        models = cached_models()
    except Exception as exc:
        models = []
        checks.append(Check("models", "warn", f"cannot read the model cache ({type(exc).__name__})"))
    real = [m for m in models if m.repo != "(generated)"]
    if not real:
        checks.append(Check("models", "warn", "no model downloaded", "basal-local pull mini"))
    budget = gpu_memory or memory
    for m in real:
        # the weights are bf16 on disk; f16 on a GPU needs the same, f32 on the CPU twice as much
        need = m.size if gpu_memory else 2 * m.size
        fits = budget is None or need < budget
        checks.append(Check(f"model {m.name}", "ok" if fits else "warn",
                            f"{human_bytes(m.size)} on disk, needs about {human_bytes(need)} "
                            f"{'of GPU memory' if gpu_memory else 'of RAM (f32 on the CPU)'}",
                            "" if fits else "free memory, or use a smaller model (mini)"))

    # disk, port, config, log folder
    cache = Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or Path.home() / ".cache")
    probe = cache
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    checks.append(Check("disk", "ok" if free > 20e9 else ("warn" if free > 2e9 else "fail"),
                        f"{human_bytes(free)} free for models ({cache})",
                        "" if free > 20e9 else "free disk space: the 4.5B model needs about 9 GB"))
    try:
        settings = Settings.load({}, None)
        cfg = config_path()
        checks.append(Check("config", "ok", f"{cfg}" if cfg.is_file() else f"none at {cfg} (defaults in use)"))
    except ValueError as exc:
        settings = Settings()
        checks.append(Check("config", "fail", str(exc), "fix the file, or move it away to use the defaults"))
    port = port or settings.port
    if port_free(settings.host, port):
        checks.append(Check("port", "ok", f"{settings.host}:{port} is free"))
    else:
        try:
            health = get_json(f"http://127.0.0.1:{port}", "/health", timeout=2)
            checks.append(Check("port", "ok", f"a basal-local daemon answers on port {port} "
                                f"({health.get('status')}, {', '.join(health.get('models', []))})"))
        except UserError:
            checks.append(Check("port", "warn", f"port {port} is used by another program",
                                f"serve on another port: basal-local serve --port {port + 1}"))
    checks.append(log_check(home_dirs()["logs"] / "basal-local.log"))
    return checks


def log_check(path: Path) -> Check:
    """The daemon's log folder takes a line (a folder that is writable but a file that stays empty is no log),
    tried on a probe file beside the log, so the log itself holds only the daemon's lines; the log, where it
    exists, must be writable too."""
    fix = "make the folder writable (or set BASAL_LOCAL_HOME)"
    probe = path.with_name(f".doctor-probe-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(probe, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler.emit(logging.LogRecord("basal_local.doctor", logging.INFO, __file__, 0,
                                       "doctor: the log folder takes a line", None, None))
        handler.close()
        grew = probe.stat().st_size > 0
    except OSError as exc:
        return Check("logs", "warn", f"{path}: cannot be written ({exc.strerror or exc})", fix)
    finally:
        probe.unlink(missing_ok=True)
    if not grew:
        return Check("logs", "warn", f"{path.parent} did not keep a line written to it", fix)
    if path.exists() and not (path.is_file() and os.access(path, os.W_OK)):
        why = "no permission" if path.is_file() else "not a file"
        return Check("logs", "warn", f"{path}: cannot be written ({why})", fix)
    return Check("logs", "ok", f"{path} (its folder takes a line)")


def doctor_command(args: argparse.Namespace) -> int:
    checks = run_checks(args.port)
    failed = any(c.status == "fail" for c in checks)
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=1))
        return 1 if failed else 0
    color = sys.stdout.isatty()
    tint = {"ok": "\033[32m", "warn": "\033[33m", "fail": "\033[31m"}
    for c in checks:
        mark = f"{tint[c.status]}{c.status:<4}\033[0m" if color else f"{c.status:<4}"
        print(f"{mark}  {c.name:<12} {c.detail}")
        if c.fix:
            print(f"{'':6}{'':<12} fix: {c.fix}")
    return 1 if failed else 0
