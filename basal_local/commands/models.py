"""Models the Ollama way: `pull`, `list`, `show`, `rm` (the Hugging Face cache), `ps` (a running daemon) and
`make-test-model` (a random-weight model directory)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

from ..model.directory import ModelLoadError, load_model_dir
from ..model.formats import FormatError, detect_format, port_summary
from ..model.registry import ModelNotFound, cached_models, find_cached, mac_port_advice, split_ref
from ..model.registry import pull as hub_pull
from . import UserError, get_json, human_bytes, key_refused, model_path
from .ask import error_text, post
from .serving import client_key, daemon_url


def _offline(exc: BaseException) -> bool:
    """Whether a download failed because the Hub cannot be reached (vs. a missing repo or a refusal)."""
    names = {type(e).__name__ for e in _chain(exc)}
    return bool(names & {"ConnectionError", "ConnectError", "ConnectTimeout", "Timeout", "ReadTimeout",
                         "LocalEntryNotFoundError", "OfflineModeIsEnabled", "MaxRetryError", "NameResolutionError",
                         "gaierror", "ConnectionRefusedError"})


def _chain(exc: BaseException | None):
    seen = 0
    while exc is not None and seen < 10:
        yield exc
        exc = exc.__cause__ or exc.__context__
        seen += 1


def pull(args: argparse.Namespace) -> int:
    try:
        repo, revision = split_ref(args.ref)
    except ModelNotFound as exc:
        raise UserError(str(exc)) from None
    advice = _mac_advice(args.ref)
    if advice is not None:
        text, bf16_fits = advice
        if not bf16_fits:
            raise UserError(text, f"`basal-local pull {args.ref.partition('@')[0]}:bf16` downloads the bf16 "
                            "weights anyway")
        print(f"basal-local: {text}", flush=True)
    print(f"basal-local: pulling {repo}{'@' + revision if revision else ''} into the Hugging Face cache "
          "(an interrupted pull resumes where it stopped)", flush=True)
    try:
        path = hub_pull(args.ref)
    except KeyboardInterrupt:
        raise UserError("pull interrupted", f"run `basal-local pull {args.ref}` again to resume") from None
    except Exception as exc:
        name = type(exc).__name__
        if _offline(exc):
            raise UserError(f"cannot reach the Hugging Face Hub to download {repo} (offline?)",
                            "check the network or proxy (HF_ENDPOINT, HTTPS_PROXY) and run pull again") from None
        if name in ("RepositoryNotFoundError", "GatedRepoError"):
            raise UserError(f"{repo} does not exist on the Hugging Face Hub or needs a login",
                            "check the name (`basal-local pull mini`), or log in: huggingface-cli login") from None
        if name == "RevisionNotFoundError":
            raise UserError(f"{repo} has no revision {revision!r}", "drop @REVISION to get the newest") from None
        raise UserError(f"downloading {repo} failed: {name}: {exc}".splitlines()[0],
                        f"run `basal-local pull {args.ref}` again (it resumes)") from None
    try:
        load_model_dir(path, check_weights=True)
    except ModelLoadError as exc:
        print(f"basal-local: warning: {repo} downloaded, but it is not a model basal-local can serve: {exc}",
              file=sys.stderr)
        return 1
    print(f"basal-local: {repo} is in {path}\n  serve it: basal-local serve --model {args.ref}")
    return 0


def _mac_advice(ref: str) -> tuple[str, bool] | None:
    """On an Apple Silicon Mac, which port of a short name fits its memory (registry.mac_port_advice)."""
    if sys.platform != "darwin" or platform.machine() != "arm64":
        return None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return mac_port_advice(ref, memory)


def list_(args: argparse.Namespace) -> int:
    rows = cached_models()
    formats = {m.path: _format_name(m.path) for m in rows}
    if args.json:
        print(json.dumps([{"name": m.name, "repo": m.repo, "revision": m.revision, "refs": m.refs,
                           "format": formats[m.path], "size_bytes": m.size, "path": str(m.path)} for m in rows],
                         indent=1))
        return 0
    if not rows:
        print("no models yet: `basal-local pull mini` downloads one, `basal-local serve --demo` makes the demo")
        return 0
    table = [("NAME", "REVISION", "FORMAT", "SIZE", "PATH")]
    for m in rows:
        rev = m.revision[:12] + (f" ({', '.join(m.refs)})" if m.refs else "")
        table.append((m.name, rev, formats[m.path], human_bytes(m.size), str(m.path)))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    for r in table:
        print(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}")
    return 0


def _format_name(path: Path) -> str:
    """The weight format of a cached snapshot (`?` when its files cannot tell)."""
    try:
        return detect_format(path, json.loads((path / "config.json").read_text(encoding="utf-8"))).name
    except (OSError, ValueError, FormatError, AttributeError):
        return "?"


def describe(path: Path) -> dict[str, Any]:
    """What `show` prints: name, architecture, calibration, files."""
    md = load_model_dir(path, check_weights=False)
    c = md.config
    params = sum(_prod(shape) for shape in c.weight_shapes().values())
    files = {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file()}
    return {
        "name": md.name, "version": md.version, "path": str(path),
        "architecture": {"type": "llama", "parameters": params, "layers": c.num_hidden_layers,
                         "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                         "attention_heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
                         "head_dim": c.head_dim, "vocab_size": c.vocab_size,
                         "context_length": c.max_position_embeddings, "rope_theta": c.rope_theta},
        "calibration": {"present": md.calibration.present, "temperatures": md.calibration.temperatures,
                        "thresholds": md.calibration.thresholds, "file": md.calibration.file,
                        "inherited": md.calibration.inherited},
        "port": port_summary(md),
        "files": files,
    }


def _prod(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def show(args: argparse.Namespace) -> int:
    info = describe(model_path(args.ref, "show"))
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    a = info["architecture"]
    print(f"{info['name']}  ({info['version'] or 'no version'})\n  path  {info['path']}\n")
    print("  architecture")
    print(f"    llama, {a['parameters'] / 1e9:.2f} B parameters" if a["parameters"] >= 1e8
          else f"    llama, {a['parameters'] / 1e6:.1f} M parameters")
    for key in ("layers", "hidden_size", "intermediate_size", "attention_heads", "kv_heads", "head_dim",
                "vocab_size", "context_length", "rope_theta"):
        print(f"    {key:<18} {a[key]:g}" if isinstance(a[key], float) else f"    {key:<18} {a[key]}")
    port = info["port"]
    print(f"\n  format\n    {port['format']}, {port['bits']} bits"
          + "".join(f", {k} {v}" for k, v in port["quantization"].items() if k != "tensor_types"))
    if port["dense_layers"]:
        print(f"    kept dense         {', '.join(port['dense_layers'])}")
    cal = info["calibration"]
    print("\n  calibration" + (f"  ({cal['file']}" + (", thresholds inherited from bf16, not validated for this port)"
                                                      if cal["inherited"] else ")") if cal["present"]
                              else "  (none: probabilities are not calibrated, T = 1)"))
    for key, value in sorted(cal["temperatures"].items()):
        print(f"    temperature {key:<8} {value:g}")
    for key, value in sorted(cal["thresholds"].items()):
        print(f"    threshold   {key:<8} {value:g}")
    print("\n  files")
    for name, size in info["files"].items():
        print(f"    {name:<24} {human_bytes(size):>10}")
    return 0


def rm(args: argparse.Namespace) -> int:
    try:
        found = find_cached(args.ref)
    except ModelNotFound as exc:
        raise UserError(str(exc)) from None
    if not found:
        raise UserError(f"{args.ref} is not downloaded", "`basal-local list` shows what is")
    targets = {m.repo_path: m for m in found}  # a repo's revisions share blobs: remove the whole entry
    size = sum(m.size for m in found)
    what = ", ".join(f"{m.name} ({m.path if m.repo_path == m.path else m.repo_path})" for m in targets.values())
    if not args.yes:
        if not sys.stdin.isatty():
            raise UserError(f"not removing {what} without confirmation", f"add --yes: basal-local rm {args.ref} --yes")
        answer = input(f"remove {what}, {human_bytes(size)}? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            print("basal-local: nothing removed")
            return 1
    for path in targets:
        shutil.rmtree(path)
    print(f"basal-local: removed {what} ({human_bytes(size)} freed)")
    return 0


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "forever"
    seconds = float(seconds)
    if seconds >= 7200:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def _cache_cell(cache: dict | None) -> str:
    """The state cache as `ps` shows it: what it holds of its budget, or off."""
    if not cache or not cache.get("enabled"):
        return "off"
    return f"{human_bytes(cache.get('bytes', 0))}/{human_bytes(cache.get('budget_bytes', 0))}"


def ps(args: argparse.Namespace) -> int:
    url = daemon_url(args)
    info = get_json(url, "/api/ps", api_key=client_key(args))
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    state = "ready" if info.get("ready") else ("error: " + info["error"] if info.get("error") else "loading")
    rss = info.get("process_rss_bytes")
    print(f"basal-local {info.get('version', '?')} at {url}: {state}, pid {info.get('pid')}, "
          f"process memory {human_bytes(rss) if rss else 'n/a'}, {info.get('inflight', 0)} in flight")
    table = [("NAME", "STATUS", "DEVICE", "DTYPE", "WEIGHTS", "DEVICE MEM", "CACHE", "QUEUE", "UNLOAD", "PATH")]
    replicas = []
    for m in info.get("models", []):
        name = m["name"] + (" (default)" if m.get("default") else "")
        status = m.get("status", "loaded")
        loaded = status == "loaded"
        dev_mem = human_bytes(m["device_allocated_bytes"]) if "device_allocated_bytes" in m else "-"
        if loaded and m.get("expires_in_s") is not None:
            until = f"in {_duration(m['expires_in_s'])}"  # unless a request comes first
        else:
            until = "never" if loaded else "-"
        table.append((name, status, m.get("device", "") if loaded else "-", m.get("dtype", "") if loaded else "-",
                      human_bytes(m.get("weights_bytes", 0)) if loaded else "-", dev_mem if loaded else "-",
                      _cache_cell(m.get("prefix_cache")) if loaded else "-", str(m.get("queue", 0)) if loaded else "-",
                      until, m.get("path", "")))
        if m.get("error") and status == "failed":
            replicas.append(f"  {m['name']}: {m['error']}")
        shown = m.get("replicas") or []
        if len(shown) > 1 or any(r.get("worker_process") for r in shown):
            for r in shown:
                mem = ", ".join(f"{label} {human_bytes(r[key])}" for label, key in
                                (("weights", "weights_bytes"), ("device", "device_allocated_bytes"),
                                 ("process", "process_rss_bytes")) if r.get(key))
                replicas.append(f"  {m['name']} replica {r['replica']}: pid {r['pid']}"
                                f"{' (worker process)' if r.get('worker_process') else ''}, {r.get('device')}, "
                                f"{r.get('state')}" + (f" (restarts {r['restarts']})" if r.get("restarts") else "")
                                + (f", exited {r['exit_code']}" if r.get("exit_code") is not None and not r.get("alive")
                                   else "") + (f", back in {r['restart_in_s']:g} s" if r.get("restart_in_s") else "")
                                + f", {r.get('in_flight', 0)} in flight, {r.get('batches', 0)} batches"
                                + (f", {mem}" if mem else ""))
    n = len(table[0]) - 1
    widths = [max(len(r[i]) for r in table) for i in range(n)]
    for r in table:
        print("  ".join(f"{r[i]:<{widths[i]}}" for i in range(n)) + "  " + r[n])
    if replicas:
        print("\n".join(["", *replicas]))
    return 0


def load(args: argparse.Namespace) -> int:
    """`basal-local load NAME`: a running daemon loads a model (and keeps it for --keep-alive)."""
    url, key = daemon_url(args), client_key(args)
    body: dict[str, Any] = {"model": _model_ref(args.model), "wait": not args.no_wait}
    if args.keep_alive is not None:
        body["keep_alive"] = args.keep_alive
    get_json(url, "/api/ps", api_key=key)  # reachable, ready and the key right, before saying anything
    if not args.no_wait:
        print(f"basal-local: loading {args.model} in the daemon at {url}...", flush=True)
    try:
        status, answer = post(url, "/api/load", body, timeout=900.0, api_key=key)
    except KeyboardInterrupt:
        raise UserError(f"interrupted: the daemon goes on loading {args.model}",
                        "`basal-local ps` shows when it is in; `basal-local unload NAME` drops it", status=130) from None
    _refused(url, key, status, answer, error_text, "load")
    name = answer.get("name", args.model)
    if answer.get("status") == "loaded":
        took = f" in {answer['load_s']:.1f} s" if answer.get("load_s") and not answer.get("already_loaded") else ""
        print(f"basal-local: {name} is loaded{took}; stays {_stay(answer.get('keep_alive_s'))}")
    else:
        print(f"basal-local: {name} is {answer.get('status')}; `basal-local ps` shows when it is in")
    return 0


def unload(args: argparse.Namespace) -> int:
    """`basal-local unload NAME`: a running daemon drops a model (its memory is freed; a request loads it again)."""
    url, key = daemon_url(args), client_key(args)
    status, answer = post(url, "/api/unload", {"model": args.model, "wait": not args.no_wait}, timeout=120.0,
                          api_key=key)
    _refused(url, key, status, answer, error_text, "unload")
    name, now = answer.get("name", args.model), answer.get("status")
    if not answer.get("unloaded"):
        print(f"basal-local: {name} is {now}; `basal-local ps` shows when it is out")
    elif now == "unloaded":
        print(f"basal-local: {name} is unloaded; a request for it loads it again")
    else:
        print(f"basal-local: {name} was unloaded, and a request has loaded it again since (it is {now})")
    return 0


def _model_ref(ref: str) -> str:
    """A directory given on this machine goes to the daemon as an absolute path; names and refs as they are."""
    path = Path(ref).expanduser()
    return str(path.resolve()) if path.is_dir() else ref


def _stay(keep_alive_s: float | None) -> str:
    return "loaded until the daemon stops" if keep_alive_s is None else \
        f"until it has been idle {_duration(keep_alive_s)}"


def _refused(url: str, key: str | None, status: int, answer: dict[str, Any], error_text, what: str) -> None:
    if status in (200, 202):
        return
    if status == 401:
        raise key_refused(url, key)
    if status == 404 and answer.get("code") not in ("MODEL_NOT_FOUND",):
        raise UserError(f"the daemon at {url} has no /api/{what} (HTTP 404)",
                        "is it an older basal-local? restart it with this version", status=1)
    fix = {"MODEL_NOT_FOUND": "`basal-local list` shows the downloaded models; `basal-local ps` the daemon's",
           "INVALID_KEEP_ALIVE": "e.g. --keep-alive 10m, 1h, 600 (seconds) or forever",
           "LOAD_FAILED": "see the daemon's log (`basal-local logs`)",
           "MODEL_LOADING": "wait until `basal-local ps` shows it loaded"}.get(answer.get("code", ""),
                                                                              f"`basal-local {what} -h`")
    raise UserError(f"the daemon answered {status}: {error_text(answer)}", fix, status=1)
