"""`basal-local run`: every request of a JSONL file through a running daemon, answers in input order.

A line is either a full System One request (it has `questions`) or a simple item
`{"state": ..., "question": "...", "options": {key: description} | [keys] | absent, "gold": ...}`:
options make it a choice, none a yes/no (noul) question. With `gold`, the summary gives the accuracy.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from . import UserError, auth_headers, get_json
from .ask import error_text
from .serving import client_key, daemon_url

RETRIES = 6
LOAD_WAIT_S = 900.0  # how long a 503 is retried: a large model loading from a cold disk


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


def send(url: str, body: dict[str, Any], api_key: str | None = None) -> tuple[int, dict[str, Any], float]:
    """(status, body, seconds); 503/529 are retried after the daemon's retry-after-ms (a 503 for as long as a
    model takes to load: the daemon loads an unloaded model on the first request for it)."""
    data = json.dumps(body).encode()
    started = time.perf_counter()
    attempt = -1
    while True:
        attempt += 1
        req = urllib.request.Request(url + "/v1/systemone", data,
                                     {"Content-Type": "application/json", **auth_headers(api_key)})
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                return resp.status, json.loads(resp.read()), time.perf_counter() - started
        except urllib.error.HTTPError as err:
            try:
                payload = json.loads(err.read())
            except ValueError:
                payload = {"error": err.reason}
            loading = err.code == 503 and "is loading" in json.dumps(payload) and \
                time.perf_counter() - started < LOAD_WAIT_S
            if err.code in (503, 529) and (attempt < RETRIES - 1 or loading):
                wait = err.headers.get("retry-after-ms") or str(float(err.headers.get("retry-after") or 1) * 1000)
                time.sleep(min(float(wait) / 1000.0, 30.0))
                continue
            return err.code, payload, time.perf_counter() - started
        except (urllib.error.URLError, OSError) as exc:
            return 0, {"error": f"connection failed: {getattr(exc, 'reason', exc)}"}, time.perf_counter() - started


def failure_reason(status: int, body: Any) -> str:
    """A short reason for the summary: the status and the daemon's message (cut), or the connection error."""

    text = error_text(body) if isinstance(body, dict) else str(body)
    text = text if len(text) <= 90 else text[:89] + "\u2026"
    return f"HTTP {status}: {text}" if status else text


class Progress:
    """A one-line progress bar on stderr when it is a terminal (else silent until the summary)."""

    def __init__(self, total: int, done: int = 0) -> None:
        self.total, self.done, self.started, self.first = total, done, time.perf_counter(), done
        self.tty = sys.stderr.isatty()

    def step(self) -> None:
        self.done += 1
        if self.tty:
            rate = (self.done - self.first) / max(time.perf_counter() - self.started, 1e-9)
            filled = int(30 * self.done / self.total)
            sys.stderr.write(f"\r  [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                             f"{rate:.1f} items/s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def read_done(out_path: Path, total: int) -> dict[int, dict[str, Any]]:
    """--resume: the answered rows (status 200) of an earlier run's output, by index; failures are redone."""
    done: dict[int, dict[str, Any]] = {}
    if not out_path.exists():
        return done
    try:
        lines = out_path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--output {out_path}: cannot be read to resume ({exc.__class__.__name__})",
                        "pick another --output, or replace it with --overwrite") from None
    rows = 0
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by the interruption: redone
        rows += isinstance(row, dict) and isinstance(row.get("index"), int) and "status" in row
        if isinstance(row, dict) and row.get("status") == 200 and isinstance(row.get("index"), int):
            if not 0 <= row["index"] < total:
                raise UserError(f"--output {out_path} holds answers for another input (index {row['index']})",
                                "resume with the input of that run, or drop --resume")
            done[row["index"]] = row
    if any(line.strip() for line in lines) and not rows:  # the run would rewrite it with its answers
        raise UserError(f"--output {out_path} holds no answers of a run: it is not an output of basal-local run",
                        "pick another --output, or replace it with --overwrite")
    return done


def has_lines(path: Path) -> int:
    """Non-blank lines of a file that exists (0: none, or no such file)."""
    try:
        with path.open("rb") as fh:
            return sum(1 for line in fh if line.strip())
    except OSError:
        return 0


def make_record(i: int, item: dict[str, Any], status: int, body: Any, seconds: float) -> dict[str, Any]:
    record: dict[str, Any] = {"index": i, "status": status, "latency_ms": round(seconds * 1000, 2)}
    if status == 200:
        record["answers"] = body.get("answers", {})
        record["usage"] = body.get("usage", {})
        verdict = is_correct(item, body)
        if verdict is not None:
            record["gold"], record["correct"] = item["gold"], verdict
    else:
        record["error"] = body
        record["reason"] = failure_reason(status, body)
    return record


def run_command(args: argparse.Namespace) -> int:

    url = daemon_url(args)
    key = client_key(args)
    in_path, out_path = Path(args.input).expanduser(), Path(args.output).expanduser()
    if same_file(in_path, out_path):
        raise UserError(f"--output {out_path} is the input file: it would be overwritten",
                        "write the answers to another file, e.g. --output answers.jsonl")
    if out_path.is_dir():
        raise UserError(f"--output {out_path} is a folder",
                        f"give a file in it, e.g. --output {out_path / 'answers.jsonl'}")
    items = read_items(in_path)
    if not out_path.parent.is_dir():
        raise UserError(f"--output {out_path}: folder {out_path.parent} does not exist", "create it, or pick another")
    lines = 0 if args.resume or args.overwrite else has_lines(out_path)
    if lines:  # an earlier run's answers (or any file) are never replaced without being asked to
        raise UserError(f"--output {out_path} already holds {lines} line{'s' * (lines != 1)}",
                        "continue that run with --resume, or replace the file with --overwrite")
    get_json(url, "/health", api_key=key)  # a missing or loading daemon is one clear line, before anything is sent
    get_json(url, "/v1/models", api_key=key)  # and a missing key (/health answers without one)
    model = args.model or "jev-latest"
    done = read_done(out_path, len(items)) if args.resume else {}
    todo = [i for i in range(len(items)) if i not in done]
    rows = dict(done)
    progress = Progress(len(items), len(done))
    jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    results: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    stop = threading.Event()
    for i in todo:
        jobs.put(i)

    def worker() -> None:
        while not stop.is_set():
            try:
                i = jobs.get_nowait()
            except queue.Empty:
                return
            status, body, seconds = send(url, to_request(items[i], model), key)
            results.put(make_record(i, items[i], status, body, seconds))

    # daemon threads: on Ctrl-C the answers so far are kept and nobody waits for the requests still in flight
    for _ in range(min(args.concurrency, len(todo))):
        threading.Thread(target=worker, daemon=True).start()
    started = time.perf_counter()
    try:
        # answers are written as they come (an `index` column gives the input order); sorted at the end
        with open(out_path, "a" if args.resume else "w", encoding="utf-8") as out:
            for _ in todo:
                record = _next(results)
                rows[record["index"]] = record
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                out.flush()
                progress.step()
    except KeyboardInterrupt:
        stop.set()
        progress.close()
        answered = sum(1 for r in rows.values() if r["status"] == 200)
        print(f"basal-local: interrupted: {answered} of {len(items)} answered, kept in {out_path}\n"
              f"  continue with the same command and --resume", file=sys.stderr)
        return 130
    elapsed = time.perf_counter() - started
    progress.close()
    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        for i in range(len(items)):
            out.write(json.dumps(rows[i], ensure_ascii=False) + "\n")
    os.replace(tmp, out_path)
    return summary(items, rows, todo, elapsed, out_path)


def _next(results: queue.SimpleQueue) -> dict[str, Any]:
    while True:  # a timed wait, so that Ctrl-C reaches the main thread at once
        try:
            return results.get(timeout=0.2)
        except queue.Empty:
            continue


def summary(items: list, rows: dict[int, dict[str, Any]], todo: list[int], elapsed: float, out_path: Path) -> int:
    """The run's line (rate, latency, failures by reason, accuracy); non-zero when any item failed."""
    latencies = [rows[i]["latency_ms"] for i in todo if rows[i]["status"] == 200]
    graded = [r for r in rows.values() if "correct" in r]
    correct = sum(r["correct"] for r in graded)
    reasons = collections.Counter(r["reason"] for r in rows.values() if r["status"] != 200)
    failed = sum(reasons.values())
    took = f"{elapsed:.1f} s" if elapsed >= 0.1 else f"{elapsed * 1000:.0f} ms"
    line = f"basal-local: {len(todo)} item{'s' * (len(todo) != 1)} in {took}"
    if todo:
        line += f" ({len(todo) / max(elapsed, 1e-9):.1f} items/s)"
    if latencies:
        line += f", median latency {statistics.median(latencies):.0f} ms"
    line += f", {failed} failed"
    if len(todo) < len(items):
        line += f" ({len(items) - len(todo)} answered before, resumed)"
    if graded:
        line += f", accuracy {correct / len(graded):.3f} ({correct}/{len(graded)})"
    print(line + f"\n  answers: {out_path}")
    for reason, count in reasons.most_common():
        print(f"  {count} failed: {reason}")
    return 1 if failed else 0
