"""`basal-local batch submit|list|status|cancel|results`: the Batch API of a running daemon from the terminal.

`submit FILE` uploads a JSONL file of `/v1/basal` lines (`{"custom_id", "body"}`; `method` and `url` optional) and
creates a batch; `--wait` follows it with a progress bar. `results ID` writes the output lines (and, with
`--errors`, the error lines) to stdout or `--output`.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from . import UserError, auth_headers, get_json, key_refused
from .serving import client_key, daemon_url


def _call(url: str, method: str, path: str, key: str | None, body: bytes | None = None,
          content_type: str = "application/json", raw: bool = False) -> Any:
    headers = {**auth_headers(key), "content-type": content_type}
    req = urllib.request.Request(url + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            data = resp.read()
            return data if raw else json.loads(data)
    except urllib.error.HTTPError as err:
        if err.code == 401:
            raise key_refused(url, key) from None
        try:
            message = json.loads(err.read()).get("error", err.reason)
        except ValueError:
            message = err.reason
        raise UserError(f"{method} {path}: {message} (HTTP {err.code})",
                        "check the id (`basal-local batch list`) or the file") from None
    except (urllib.error.URLError, OSError) as exc:
        raise UserError(f"cannot reach a daemon at {url} ({getattr(exc, 'reason', exc)})",
                        "start one with `basal-local serve`, or point --url at it") from None


def _upload(url: str, key: str | None, path: Path) -> dict[str, Any]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}", "give a JSONL file of /v1/basal lines") from None
    boundary = "basal-local-" + secrets.token_hex(12)
    name = path.name.replace('"', "_")
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return _call(url, "POST", "/v1/files", key, body, f"multipart/form-data; boundary={boundary}")


def _line(batch: dict[str, Any]) -> str:
    c = batch["request_counts"]
    return (f"{batch['id']}  {batch['status']:<11} {c['completed'] + c['failed']}/{c['total']} done "
            f"({c['failed']} failed)  created {time.strftime('%Y-%m-%d %H:%M', time.localtime(batch['created_at']))}")


def _show_errors(batch: dict[str, Any]) -> None:
    """The first lines' errors of a batch (the whole list: its error file, `batch results ID --errors`)."""
    for error in (batch.get("errors") or {}).get("data", [])[:10]:
        message, line = str(error.get("message", "")), error.get("line")
        print(f"  {message}" if line is None or message.startswith(f"line {line}:") else f"  line {line}: {message}",
              file=sys.stderr)


def _follow(url: str, key: str | None, batch: dict[str, Any]) -> dict[str, Any]:
    # rich's progress bar (~0.1 s to import): only for --follow
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    terminal = ("completed", "failed", "expired", "cancelled")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  transient=False) as bar:
        task = bar.add_task(batch["status"], total=None)
        while batch["status"] not in terminal:
            time.sleep(0.5)
            batch = _call(url, "GET", f"/v1/batches/{batch['id']}", key)
            c = batch["request_counts"]
            bar.update(task, description=batch["status"], total=c["total"] or None,
                       completed=c["completed"] + c["failed"])
    return batch


def batch_command(args: argparse.Namespace) -> int:
    url, key = daemon_url(args), client_key(args)
    get_json(url, "/health", api_key=key)
    if args.action == "submit":
        if not args.target:
            raise UserError("batch submit needs a JSONL file", "basal-local batch submit requests.jsonl --wait")
        file = _upload(url, key, Path(args.target).expanduser())
        batch = _call(url, "POST", "/v1/batches", key, json.dumps({"input_file_id": file["id"], "endpoint":
                                                                     "/v1/basal", "completion_window": "24h"}).encode())
        print(f"submitted {batch['id']} ({file['bytes']} bytes from {args.target})", file=sys.stderr)
        if args.wait:
            try:
                batch = _follow(url, key, batch)
            except KeyboardInterrupt:
                print(f"stopped following; the batch goes on in the daemon: basal-local batch status {batch['id']}",
                      file=sys.stderr)
                return 130
        print(json.dumps(batch) if args.json else _line(batch))
        if not args.json:
            _show_errors(batch)
        return 0 if batch["status"] in ("completed", "validating", "in_progress", "finalizing") else 1
    if args.action == "list":
        page = _call(url, "GET", "/v1/batches?limit=100", key)
        if args.json:
            print(json.dumps(page["data"]))
        for batch in [] if args.json else page["data"]:
            print(_line(batch))
        return 0
    if not args.target:
        raise UserError(f"batch {args.action} needs a batch id", "see them with `basal-local batch list`")
    if args.action == "status":
        batch = _call(url, "GET", f"/v1/batches/{args.target}", key)
        print(json.dumps(batch) if args.json else _line(batch))
        if not args.json:
            _show_errors(batch)
        return 0
    if args.action == "cancel":
        print(_line(_call(url, "POST", f"/v1/batches/{args.target}/cancel", key)))
        return 0
    batch = _call(url, "GET", f"/v1/batches/{args.target}", key)
    ids = [batch.get("output_file_id")] + ([batch.get("error_file_id")] if args.errors else [])
    ids = [i for i in ids if i]
    if not ids and batch["status"] in ("failed", "expired", "cancelled"):  # it never will have
        first = ((batch.get("errors") or {}).get("data") or [{}])[0].get("message")
        raise UserError(f"batch {args.target} {batch['status']} without results" + (f": {first}" if first else ""),
                        f"every reason: basal-local batch status {args.target}; fix the input and submit it again"
                        if batch["status"] == "failed" else "submit the input again")
    if not ids:
        raise UserError(f"batch {args.target} has no results yet ({batch['status']})",
                        f"follow it: basal-local batch status {args.target}")
    out = open(args.output, "wb") if args.output else sys.stdout.buffer  # noqa: SIM115 -- stdout stays open
    try:
        for file_id in ids:
            out.write(_call(url, "GET", f"/v1/files/{file_id}/content", key, raw=True))
    finally:
        if args.output:
            out.close()
    return 0
