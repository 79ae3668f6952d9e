"""`basal-local run`: every request of a JSONL file through a running daemon, answers in input order.

A line is either a full System One request (it has `questions`) or a simple item
`{"state": ..., "question": "...", "options": {key: description} | [keys] | absent, "gold": ...}`:
options make it a choice, none a yes/no (noul) question. With `gold`, the summary gives the accuracy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import UserError

RETRIES = 6


def read_items(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--input {path}: cannot be read ({exc.__class__.__name__})",
                        "give --input a UTF-8 JSONL file, one request per line") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise UserError(f"{path}:{n}: not JSON ({exc.msg} at column {exc.colno})",
                            "each line must be one JSON object") from None
        if not isinstance(item, dict) or ("questions" not in item and "question" not in item):
            raise UserError(f"{path}:{n}: neither a request (with \"questions\") nor an item (with \"question\")",
                            'e.g. {"state": "...", "question": "Is it urgent?"}')
        items.append(item)
    if not items:
        raise UserError(f"--input {path} holds no requests", "one JSON request per line")
    return items


def to_request(item: dict[str, Any], model: str) -> dict[str, Any]:
    if "questions" in item:
        return {"model": model, **item}
    options = item.get("options")
    if options is None:
        question: dict[str, Any] = {"type": "noul", "instructions": item["question"]}
    else:
        question = {"type": "choice", "instructions": item["question"],
                    "criteria": options if isinstance(options, dict) else {str(k): None for k in options}}
    return {"model": model, "state": item.get("state", ""), "questions": {"q": question}}


def is_correct(item: dict[str, Any], body: dict[str, Any]) -> bool | None:
    if "gold" not in item or "questions" in item:
        return None
    answer = body.get("answers", {}).get("q", {})
    gold = item["gold"]
    if answer.get("type") == "noul":
        truth = gold if isinstance(gold, bool) else str(gold).lower() in ("true", "yes", "1", "tak")
        return (answer.get("noul", 0.0) >= 0.5) == truth
    return answer.get("choice") == gold


def send(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], float]:
    """(status, body, seconds); 503/529 are retried after the daemon's retry-after-ms."""
    data = json.dumps(body).encode()
    started = time.perf_counter()
    for attempt in range(RETRIES):
        req = urllib.request.Request(url + "/v1/systemone", data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                return resp.status, json.loads(resp.read()), time.perf_counter() - started
        except urllib.error.HTTPError as err:
            try:
                payload = json.loads(err.read())
            except ValueError:
                payload = {"error": err.reason}
            if err.code in (503, 529) and attempt < RETRIES - 1:
                wait = err.headers.get("retry-after-ms") or str(float(err.headers.get("retry-after") or 1) * 1000)
                time.sleep(min(float(wait) / 1000.0, 30.0))
                continue
            return err.code, payload, time.perf_counter() - started
        except (urllib.error.URLError, OSError) as exc:
            return 0, {"error": f"connection failed: {getattr(exc, 'reason', exc)}"}, time.perf_counter() - started
    return 0, {"error": "gave up"}, time.perf_counter() - started


class Progress:
    """A one-line progress bar on stderr when it is a terminal (else silent until the summary)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.started = total, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.lock = threading.Lock()

    def step(self) -> None:
        with self.lock:
            self.done += 1
            if self.tty:
                rate = self.done / max(time.perf_counter() - self.started, 1e-9)
                filled = int(30 * self.done / self.total)
                sys.stderr.write(f"\r  [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                                 f"{rate:.1f} items/s")
                sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def run_command(args: argparse.Namespace) -> int:
    from . import get_json
    from .serving import daemon_url

    url = daemon_url(args)
    items = read_items(Path(args.input).expanduser())
    out_path = Path(args.output).expanduser()
    if not out_path.parent.is_dir():
        raise UserError(f"--output {out_path}: folder {out_path.parent} does not exist", "create it, or pick another")
    get_json(url, "/health")  # a missing or loading daemon is one clear line, before anything is sent
    model = args.model or "jev-latest"
    results: list[Any] = [None] * len(items)
    progress = Progress(len(items))
    started = time.perf_counter()

    def one(i: int) -> None:
        status, body, seconds = send(url, to_request(items[i], model))
        results[i] = (status, body, seconds)
        progress.step()

    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(one, range(len(items))))
    elapsed = time.perf_counter() - started
    progress.close()
    correct = graded = failed = 0
    latencies = []
    with open(out_path, "w", encoding="utf-8") as out:
        for i, (status, body, seconds) in enumerate(results):
            record: dict[str, Any] = {"index": i, "status": status, "latency_ms": round(seconds * 1000, 2)}
            if status == 200:
                latencies.append(seconds)
                record["answers"] = body.get("answers", {})
                record["usage"] = body.get("usage", {})
                verdict = is_correct(items[i], body)
                if verdict is not None:
                    graded += 1
                    correct += verdict
                    record["gold"], record["correct"] = items[i]["gold"], verdict
            else:
                failed += 1
                record["error"] = body
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    median = statistics.median(latencies) * 1000 if latencies else float("nan")
    line = (f"basal-local: {len(items)} items in {elapsed:.1f} s ({len(items) / elapsed:.1f} items/s), "
            f"median latency {median:.0f} ms, {failed} failed")
    if graded:
        line += f", accuracy {correct / graded:.3f} ({correct}/{graded})"
    print(line + f"\n  answers: {out_path}")
    return 1 if failed else 0
