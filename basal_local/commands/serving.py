"""`basal-local serve`: settings, checks that fail fast (device, port, models), the banner, the log file."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

from .. import __version__
from ..addresses import http_url, local_url
from ..backends.memory import budget_bytes, parse_limit
from ..flags import flag_overrides
from ..paths import home_dirs, process_alive
from ..settings import Settings, config_path
from . import UserError, bind_ephemeral, check_url, listen_error
from .background import detach, read_state

DEMO_BANNER = """\
basal-local {version} demo: serving the bundled demo model "basal-demo" on {url}
  The demo model has RANDOM weights: its answers are random. It shows the API, not a real decision model.
  Get a real model with `basal-local pull mini` and start it with `basal-local serve --model mini`.

Try it:{key_note}
  curl -s {url}/v1/systemone -H 'content-type: application/json'{key_curl} -d '{{"model": "basal-demo", "state": "The parcel arrived broken.",
    "questions": {{"urgent": {{"type": "noul", "instructions": "Is this urgent?"}}}}}}'

  basal-local ask --url {url} --state "The parcel arrived broken." --noul "Is this urgent?"

  python3 - <<'PY'
import json, {py_import}urllib.request
body = {{"model": "basal-demo", "state": "Paczka dotarła uszkodzona.",
        "questions": {{"kind": {{"type": "choice", "criteria": {{"damage": "Uszkodzenie", "late": "Opóźnienie"}}}}}}}}
req = urllib.request.Request("{url}/v1/systemone", json.dumps(body).encode(){py_headers})
print(json.load(urllib.request.urlopen(req)))
PY
Stop with Ctrl-C."""

NO_MODEL = """\
basal-local: error: no model to serve.
  Try the demo (random weights, answers are random):  basal-local serve --demo
  Serve a real model: basal-local pull mini && basal-local serve --model mini
  or point at a model directory:                      basal-local serve --model /path/to/basal-1.5-mini"""


def load_settings(args: argparse.Namespace):
    """Settings from the flags present in `args`, the environment and config.toml; errors name the file."""
    config = Path(args.config).expanduser() if getattr(args, "config", None) else None
    if config is not None and not config.is_file():
        what = "a folder, not a config file" if config.is_dir() else "no such file"
        raise UserError(f"--config {config}: {what}", f"drop --config to use {config_path()}, or fix the path")
    try:
        return Settings.load(flag_overrides(args), config)
    except (ValueError, OSError) as exc:
        raise UserError(str(exc)) from None


def daemon_url(args: argparse.Namespace) -> str:
    """--url, else the background daemon's (`serve --detach`, on whatever port it was given) while it runs, else
    http://HOST:PORT of the configured daemon."""

    if getattr(args, "url", None):
        return check_url(args.url)
    running = read_state()
    if running and isinstance(running.get("pid"), int) and isinstance(running.get("url"), str) \
            and process_alive(running["pid"]):
        return running["url"]
    settings = load_settings(argparse.Namespace())
    return local_url(settings.host, settings.port)


def client_key(args: argparse.Namespace) -> str | None:
    """The API key our tools send: --api-key, else BASAL_LOCAL_API_KEY, else the config's api_key."""
    if getattr(args, "api_key", None):
        return args.api_key
    if os.environ.get("BASAL_LOCAL_API_KEY"):
        return os.environ["BASAL_LOCAL_API_KEY"]
    try:
        return load_settings(argparse.Namespace()).api_key or None
    except UserError:  # a broken config is reported by the command that needs it, not here
        return None


def check_device(device: str, flag: str = "") -> None:
    """Refuse --device cuda/mps on a machine without it, before anything loads (`flag`: the option named)."""
    flag = flag or f"--device {device}"
    if device not in ("cuda", "mps"):
        return
    try:
        import torch  # heavy: only to check a GPU the flags name
    except ImportError:
        raise UserError("PyTorch is not installed", 'install it: pip install "torch>=2.4"') from None
    if device == "cuda" and not torch.cuda.is_available():
        if torch.version.cuda is None:
            raise UserError(f"{flag}, but this PyTorch has no CUDA support (torch {torch.__version__})",
                            "use --device cpu (or auto), or install a CUDA build of PyTorch (https://pytorch.org)")
        raise UserError(f"{flag}, but no NVIDIA GPU is visible (torch {torch.__version__} has CUDA "
                        f"{torch.version.cuda})", "use --device cpu (or auto); a GPU needs its driver "
                        "(`nvidia-smi` should list it)")
    if device == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise UserError(f"{flag}, but Metal is not available here", "use --device cpu (or auto)")


def check_backend(backend: str) -> None:
    """Refuse --backend mlx without MLX before anything loads (it was found after `serving on`)."""
    from ..backends.select import mlx_importable  # imports nothing heavy until asked

    if backend == "mlx" and not mlx_importable():
        raise UserError("--backend mlx, but MLX is not installed",
                        "pip install mlx (Apple Silicon) or pip install 'mlx[cpu]' (Linux CPU), or use --backend "
                        "torch (or auto)")


def check_devices(spec: str | None, device: str) -> None:
    """--devices as one sentence when a name is not a device or a GPU is not there (not torch's paragraphs)."""
    from ..backends.select import expand_devices  # the backends import torch: only to check --devices

    if not spec:
        return
    try:
        devices = expand_devices(spec, device)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    for name in devices:
        if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", name):
            raise UserError(f"--devices {spec}: {name!r} is not a device",
                            "name devices as cpu, mps, cuda or cuda:N (e.g. --devices cuda:0,cuda:1), or all")
    wanted = [n for n in devices if n.startswith("cuda")]
    if not wanted:
        return
    check_device("cuda", f"--devices {spec}")
    import torch  # heavy: only when --devices names GPUs

    count = torch.cuda.device_count()
    for name in wanted:
        if ":" in name and int(name.split(":")[1]) >= count:
            raise UserError(f"--devices {spec}: there is no {name} (this machine has {count} CUDA "
                            f"GPU{'s' if count != 1 else ''}: cuda:0..cuda:{count - 1})",
                            "name the GPUs that exist, or use --devices all")


def check_gpu_memory(value, device: str, source: str = "") -> None:
    """Refuse a malformed --gpu-memory, or one given with --device cpu, before anything loads. `source`: where
    the value came from when not from the command line (the config file or the environment)."""
    if value is None:
        return
    try:
        parse_limit(value)
    except ValueError as exc:
        raise UserError(str(exc) + (f" (set in {source})" if source else "")) from None
    if device == "cpu":
        raise UserError(f"--gpu-memory {value} with --device cpu: the CPU uses the machine's memory",
                        "drop --gpu-memory, or use --device cuda (or mps)")


def _is_stderr(path: Path) -> bool:
    try:
        return path.exists() and os.path.samestat(os.fstat(sys.stderr.fileno()), path.stat())
    except (OSError, ValueError, AttributeError):  # no real stderr (captured, closed)
        return False


def log_file_handler() -> Path | None:
    """Also log to basal-local.log in the platformdirs log folder; None when that folder cannot be written."""
    folder = home_dirs()["logs"]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "basal-local.log"
        if _is_stderr(path):  # `serve --detach`: the output already goes to this file; once is enough
            logging.getLogger("basal_local.daemon").setLevel(logging.INFO)
            return path
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError:
        return None
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)  # the same records as the terminal
    # loading progress (which model, how far) is worth seeing in both places
    logging.getLogger("basal_local.daemon").setLevel(logging.INFO)
    return path


def serve_command(args: argparse.Namespace) -> int:
    # the server stack (litestar, uvicorn, the backends and torch, ~1 s): only to serve; `ask`, `run`, `ps` and
    # the other client commands import this module for client_key and daemon_url
    from ..backends.select import check_dtype
    from ..model.directory import ModelLoadError, load_model_dir
    from ..model.registry import ModelNotFound, demo_model_dir, resolve_model
    from ..server.daemon import serve
    from ..server.output import guard_output
    from ..server.security import public_bind_refusal

    guard_output()  # a full disk under stdout or the log is one warning, never a failed start
    ephemeral = getattr(args, "port", None) == 0
    if ephemeral:  # the settings take ports 1-65535; 0 is the command line's "pick one"
        args.port = None
    settings = load_settings(args)
    if ephemeral:
        settings.port = 0
    if getattr(args, "detach", False):
        if getattr(args, "tui", False):
            raise UserError("--detach and --tui do not go together: --tui shows the dashboard in this terminal, "
                            "--detach leaves the terminal", "drop one (a detached daemon is watched with "
                            "`basal-local top`)")
        raw = list(getattr(args, "argv", None) or [])
        argv = [a for a in raw[raw.index("serve") + 1:] if a != "--detach"] if "serve" in raw else []
        return detach(_without_port(argv), settings.host, settings.port)
    if not settings.models and not args.demo:
        print(NO_MODEL, file=sys.stderr)
        return 2
    try:
        check_dtype(settings.backend, settings.device, settings.dtype)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    refusal = public_bind_refusal(settings.host, settings.api_key, settings.insecure_public)
    if refusal:
        raise UserError(refusal)
    if settings.api_key and not all("!" <= c <= "~" for c in settings.api_key):
        # HTTP headers carry ASCII; a key with other characters or spaces could never be sent back intact
        raise UserError("the API key must be printable ASCII without spaces (it travels in an HTTP header)",
                        "choose another with --api-key KEY (or BASAL_LOCAL_API_KEY)")
    ray_mode = bool(getattr(args, "ray", False))
    check_ray_flags(args, ray_mode)
    if not ray_mode:  # with --ray the engines run on the cluster's nodes, not here
        check_backend(settings.backend)
        check_device(settings.device)
        check_devices(settings.devices, settings.device)
    check_gpu_memory(settings.gpu_memory, settings.device, "" if args.gpu_memory is not None else
                     "BASAL_LOCAL_GPU_MEMORY" if "BASAL_LOCAL_GPU_MEMORY" in os.environ else
                     f"gpu_memory of {args.config or config_path()}")
    if settings.device == "cpu" and not ray_mode:  # a GPU's room is known only once the weights are on it
        try:
            budget_bytes(settings.engine.prefix_cache, None, replicas=settings.replicas)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    dirs: list[Path] = []
    for ref in settings.models:
        try:
            path = resolve_model(ref)
            load_model_dir(path, check_weights=True)  # refuse early, with the file and field named
        except ModelNotFound as exc:
            raise UserError(str(exc)) from None
        except ModelLoadError as exc:
            raise UserError(f"{ref} is not a model basal-local can serve: {exc}",
                            "give --model a Basal model directory, or a name from `basal-local list`") from None
        dirs.append(path)
    sock = None
    if settings.port == 0:  # an ephemeral port: bound now, so the banner names the port the daemon listens on
        sock = bind_ephemeral(settings.host)
        settings.port = sock.getsockname()[1]
        if getattr(args, "tui", False):
            sock.close()  # it binds the port itself; the port was free a moment ago
            sock = None
    elif (problem := listen_error(settings.host, settings.port)) is not None:
        raise problem
    if args.demo:  # with --ray each replica also prepares the demo model on its own node
        dirs.insert(0, demo_model_dir(on_generate=lambda path: print(
            f"basal-local: preparing the demo model in {path} (generated once, a few seconds)...", flush=True)))
    cfg = args.config or config_path()
    cfg_note = f"config {cfg}" if Path(cfg).is_file() else f"no config file ({cfg}), defaults in use"
    log_path = log_file_handler()
    where = "\n".join(f"  model: {d}" for d in dirs)
    footer = f"{where}\n  {cfg_note}" + (f"\n  log: {log_path}" if log_path else "")
    banner = (f"basal-local {__version__}: serving on {http_url(settings.host, settings.port)} "
              f"(loading models...)\n{footer}")
    ready_text = ""
    if args.demo:  # the "try it" text once the demo model answers; a failed start shows only the error
        # with --api-key every call carries it: the hints read it from the environment (the key is never printed)
        keyed = bool(settings.api_key)
        ready_text = DEMO_BANNER.format(
            url=http_url(settings.host, settings.port), version=__version__,
            key_note="  (this daemon wants its API key: export BASAL_LOCAL_API_KEY=YOUR-KEY first)" if keyed else "",
            key_curl=' -H "Authorization: Bearer $BASAL_LOCAL_API_KEY"' if keyed else "",
            py_import="os, " if keyed else "",
            py_headers=', {"Authorization": "Bearer " + os.environ["BASAL_LOCAL_API_KEY"]}' if keyed else "")
    if ray_mode:
        return serve_ray_command(args, settings, dirs, banner, ready_text, sock)
    if getattr(args, "tui", False) or getattr(args, "demo_traffic", False):
        from ..server.tuimode import serve_with_options  # textual: only for the dashboard in this terminal

        return serve_with_options(settings, dirs, banner + ("\n" + ready_text if ready_text else ""), args.tui,
                                  args.demo_traffic)
    code = serve(settings, dirs, banner, ready_text, sock)
    # Everything is stopped and flushed; the interpreter's final garbage collection of a loaded model can take
    # seconds, which would stretch a SIGTERM past its drain deadline. Leave now, with the status.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _without_port(argv: list[str]) -> list[str]:
    """serve's arguments minus --port (the detached daemon is given the port chosen here)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--port":
            skip = True
        elif not arg.startswith("--port="):
            out.append(arg)
    return out


def check_ray_flags(args: argparse.Namespace, ray_mode: bool) -> None:
    """The Ray flags go with --ray, and --ray with none of the one-host options; Ray itself must import."""
    given = [flag for flag, key in (("--ray-address", "ray_address"), ("--min-replicas", "min_replicas"),
                                    ("--max-replicas", "max_replicas"))
             if getattr(args, key, None) is not None]
    if not ray_mode:
        if given:
            raise UserError(f"{given[0]} only works with --ray", "add --ray, or drop " + given[0])
        return
    for flag, key in (("--devices", "devices"), ("--replicas", "replicas"),
                      ("--replica-processes", "replica_processes"), ("--tui", "tui"),
                      ("--demo-traffic", "demo_traffic")):
        if getattr(args, key, None):
            raise UserError(f"{flag} does not go with --ray (Ray places one engine replica per actor)",
                            f"drop {flag}; use --min-replicas/--max-replicas to size the deployment")
    # the server stack (see serve_command); rayserve imports Ray itself only when asked to, an optional extra
    from ..server.rayserve import RayUnavailable, import_ray

    try:
        import_ray()
    except RayUnavailable as exc:
        raise UserError(exc.cause, exc.fix) from None


def serve_ray_command(args: argparse.Namespace, settings, dirs: list[Path], banner: str, ready_text: str,
                      sock) -> int:
    from ..server.rayserve import (  # the server stack (see serve_command)
        RayOptions,
        RayUnavailable,
        serve_ray,
    )

    options = RayOptions(address=args.ray_address, min_replicas=args.min_replicas or 1,
                         max_replicas=args.max_replicas)
    try:
        code = serve_ray(settings, dirs, options, demo=args.demo, banner=banner, ready_text=ready_text, sock=sock)
    except RayUnavailable as exc:
        print("\n".join(UserError(exc.cause, exc.fix).lines()), file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("basal-local: interrupted", file=sys.stderr)
        code = 130
    # Ray's client threads can keep the interpreter from exiting; everything is taken down and flushed by now
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
