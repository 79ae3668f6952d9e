"""Models the Ollama way: `pull`, `list`, `show`, `rm` (the Hugging Face cache) and `ps` (a running daemon)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from . import UserError, get_json, human_bytes, model_path


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
    from ..model.directory import ModelLoadError, load_model_dir
    from ..model.registry import ModelNotFound, split_ref
    from ..model.registry import pull as hub_pull

    try:
        repo, revision = split_ref(args.ref)
    except ModelNotFound as exc:
        raise UserError(str(exc)) from None
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


def list_(args: argparse.Namespace) -> int:
    from ..model.registry import cached_models

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
    from ..model.formats import FormatError, detect_format

    try:
        return detect_format(path, json.loads((path / "config.json").read_text(encoding="utf-8"))).name
    except (OSError, ValueError, FormatError, AttributeError):
        return "?"


def describe(path: Path) -> dict[str, Any]:
    """What `show` prints: name, architecture, calibration, files."""
    from ..model.directory import load_model_dir
    from ..model.formats import port_summary

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
    from ..model.registry import ModelNotFound, find_cached

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


def ps(args: argparse.Namespace) -> int:
    from .serving import client_key, daemon_url

    url = daemon_url(args)
    info = get_json(url, "/api/ps", api_key=client_key(args))
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    state = "ready" if info.get("ready") else ("error: " + info["error"] if info.get("error") else "loading")
    rss = info.get("process_rss_bytes")
    print(f"basal-local {info.get('version', '?')} at {url}: {state}, pid {info.get('pid')}, "
          f"process memory {human_bytes(rss) if rss else 'n/a'}, {info.get('inflight', 0)} in flight")
    table = [("NAME", "DEVICE", "DTYPE", "WEIGHTS", "DEVICE MEM", "QUEUE", "PATH")]
    for m in info.get("models", []):
        name = m["name"] + (" (default)" if m.get("default") else "")
        dev_mem = human_bytes(m["device_allocated_bytes"]) if "device_allocated_bytes" in m else "-"
        table.append((name, m.get("device", ""), m.get("dtype", ""), human_bytes(m.get("weights_bytes", 0)),
                      dev_mem, str(m.get("queue", 0)), m.get("path", "")))
    widths = [max(len(r[i]) for r in table) for i in range(6)]
    for r in table:
        print("  ".join(f"{r[i]:<{widths[i]}}" for i in range(6)) + "  " + r[6])
    for m in info.get("models", []):  # replicas: each one's state (a dead worker process restarting, loading)
        replicas = m.get("replicas") or []
        if len(replicas) > 1 or any(r.get("state") != "ready" for r in replicas):
            print(f"{m['name']} replicas: " + ", ".join(
                f"{r['replica']} on {r['device']} {r.get('state', '?')}"
                + (f" (restarts {r['restarts']})" if r.get("restarts") else "") for r in replicas))
    return 0
