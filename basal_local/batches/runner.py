"""Runs the Batch API's batches: validate every line, send each through the daemon's own `/v1/basal` handler,
write the results in input order, finalize into output and error files. One asyncio task in the server's loop.

Each line is an ASGI call into the app itself (no socket): it passes through exactly what an HTTP request does
(validation, exact error bodies, planning, the engine, telemetry), so a batch's answers are the interactive
ones. Marked `x-basal-priority: batch`, it is a background job for the scheduler: computed only when no
interactive request waits, never in an interactive request's batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..protocol.textrule import has_surrogate
from .store import MAX_LINES, TERMINAL, Store

log = logging.getLogger("basal_local.batches")
MAX_LISTED_ERRORS = 100  # batch.errors lists the first ones; the error file has every line
RETRY_STATUSES = (503, 529)
SYNC_S = 0.25  # how often a running batch's record is read (cancel, expiry) and its counts written  # overload or loading: the line waits and is sent again, it does not fail


@dataclass
class Line:
    number: int  # 1-based line of the input file
    custom_id: str
    body: dict[str, Any] | None
    error: str | None = None  # why the line is invalid


def parse_input(path: Path) -> list[Line]:
    """Every non-blank line of a JSONL input file, checked; an invalid line keeps its reason."""
    lines: list[Line] = []
    seen: set[str] = set()
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            try:
                item = json.loads(raw)
            except ValueError:
                lines.append(Line(number, f"line-{number}", None, "the line is not valid JSON"))
                continue
            except RecursionError:
                lines.append(Line(number, f"line-{number}", None, "the line's JSON is nested too deeply"))
                continue
            if not isinstance(item, dict):
                lines.append(Line(number, f"line-{number}", None, "the line is not a JSON object"))
                continue
            custom_id = item.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id or has_surrogate(custom_id):
                lines.append(Line(number, f"line-{number}", None, "custom_id must be a non-empty string of "
                                  "Unicode text"))
                continue
            if custom_id in seen:
                lines.append(Line(number, custom_id, None, f"custom_id {custom_id} is used by an earlier line"))
                continue
            seen.add(custom_id)
            if item.get("method", "POST") != "POST":
                error = "method must be POST"
            elif item.get("url", "/v1/basal") != "/v1/basal":
                error = "url must be /v1/basal (the batch's endpoint)"
            elif not isinstance(item.get("body"), dict):
                error = "body must be a /v1/basal request object"
            else:
                error = None
            lines.append(Line(number, custom_id, item.get("body") if error is None else None, error))
    return lines


def _count_lines(path: Path) -> int:
    """Complete lines of a results file; a partial last line (a crash mid-write) is cut off."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1
    if complete != len(data):
        with path.open("r+b") as handle:
            handle.truncate(complete)
    return data[:complete].count(b"\n")


async def call_app(app: Callable[..., Awaitable[None]], body: bytes, request_id: str) -> tuple[int, dict[str, Any]]:
    """POST /v1/basal into the ASGI app; (status, JSON body)."""
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"), (b"user-agent", b"basal-local-batch"),
               (b"content-length", str(len(body)).encode()), (b"x-request-id", request_id.encode()),
               (b"x-basal-priority", b"batch")]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/basal", "raw_path": b"/v1/basal", "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    sent = False
    never = asyncio.Event()
    out: dict[str, Any] = {"status": 500, "chunks": []}

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # nobody disconnects: the handler waits for its answer
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            out["chunks"].append(message.get("body", b""))

    await app(scope, receive, send)
    raw = b"".join(out["chunks"])
    try:
        parsed = json.loads(raw) if raw else {}
    except ValueError:
        parsed = {"error": raw.decode("utf-8", "replace")}
    return out["status"], parsed if isinstance(parsed, dict) else {"value": parsed}


class Runner:
    """The one task that works through the batches of a store, oldest first."""

    def __init__(self, store: Store, app: Callable[..., Awaitable[None]], concurrency: int = 32,
                 inflight: Callable[[], int] = lambda: 0) -> None:
        self.store = store
        self.app = app
        self.concurrency = concurrency
        self.inflight = inflight  # requests in flight in the daemon, batch lines included
        self.sending = 0  # batch lines in flight
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None
        self._lock: Any = None  # the open lock file while this daemon runs the store's batches
        self.cancelled: set[str] = set()  # cancels of this daemon's API, seen at once (others with the record)

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass
        if self._lock is not None:
            self._lock.close()  # releases the lock
            self._lock = None

    def poke(self) -> None:
        self.wake.set()

    def cancel(self, batch_id: str) -> None:
        """The API set the batch to cancelling: stop sending its lines before the next one."""
        self.cancelled.add(batch_id)
        self.wake.set()

    def _own_store(self) -> bool:
        """Whether this daemon runs the store's batches: one daemon at a time (several may share a data folder)."""
        if self._lock is not None:
            return True
        try:
            import fcntl  # POSIX; on Windows every daemon runs batches (one daemon per user there)
        except ImportError:
            return True
        handle = (self.store.root / ".runner.lock").open("a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            return False
        self._lock = handle
        return True

    async def _loop(self) -> None:
        while True:
            if not self._own_store():  # another daemon runs them; look again later
                await asyncio.sleep(5.0)
                continue
            pending = [r for r in self.store.all_batches() if r["status"] not in TERMINAL]
            if not pending:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=5.0)
                except TimeoutError:
                    pass
                continue
            try:
                await self._run(pending[0])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not stop the other batches: this one fails, with the reason
                log.exception("batch %s failed", pending[0]["id"])
                self._fail(pending[0]["id"], "internal_error", f"{type(exc).__name__}: {exc}")

    def _fail(self, batch_id: str, code: str, message: str, line: int | None = None,
              more: list[dict[str, Any]] | None = None) -> None:
        first = {"code": code, "message": message, "param": None, "line": line}
        self.store.update_batch(batch_id, status="failed", failed_at=int(time.time()),
                                errors={"object": "list", "data": [first, *(more or [])]})

    async def _run(self, record: dict[str, Any]) -> None:
        batch_id = record["id"]
        source = self.store.get_file(record["input_file_id"])
        if source is None:
            self._fail(batch_id, "input_file_missing", f"the input file {record['input_file_id']} no longer exists")
            return
        lines = await asyncio.to_thread(parse_input, self.store.file_data(source["id"]))
        if record["status"] == "validating":
            if not lines:
                self._fail(batch_id, "empty_file", "the input file holds no request lines")
                return
            if len(lines) > MAX_LINES:
                self._fail(batch_id, "too_many_lines", f"the input file holds {len(lines)} lines; a batch takes at "
                           f"most {MAX_LINES}")
                return
            invalid = [ln for ln in lines if ln.error is not None]
            errors = [{"code": "invalid_request", "message": f"line {ln.number}: {ln.error}", "param": None,
                       "line": ln.number} for ln in invalid[:MAX_LISTED_ERRORS]]
            if len(invalid) == len(lines):  # the first line's reason, then every listed line's
                self._fail(batch_id, "invalid_file", f"line {invalid[0].number}: {invalid[0].error}",
                           invalid[0].number, errors[1:])
                return
            with self.store.lock:  # a cancel may have come while the file was read: it stays cancelling
                current = self.store.batch(batch_id) or record
                fields: dict[str, Any] = {"errors": {"object": "list", "data": errors} if errors else None,
                                          "request_counts": {"total": len(lines), "completed": 0, "failed": 0}}
                if current["status"] == "validating":
                    fields.update(status="in_progress", in_progress_at=int(time.time()))
                record = self.store.update_batch(batch_id, **fields)
        out_path = self.store.results_path(batch_id, "out")
        err_path = self.store.results_path(batch_id, "err")
        # what the files hold is what is done (a crash may have come between a write and the record's update)
        counts = {"total": len(lines), "completed": _count_lines(out_path), "failed": _count_lines(err_path)}
        if record["status"] == "in_progress":
            await self._lines(batch_id, lines, counts, out_path, err_path)
        self._finalize(batch_id, out_path, err_path)

    async def _lines(self, batch_id: str, lines: list[Line], counts: dict[str, int], out_path: Path,
                     err_path: Path) -> None:
        """Send the lines not done yet, `concurrency` at a time; write results in input order."""
        results: dict[int, tuple[bool, dict[str, Any]]] = {}
        running: set[asyncio.Task] = set()
        done = next_line = counts["completed"] + counts["failed"]
        stop_reason = None
        synced = -SYNC_S  # when the record was last read and the counts written (not once per line: a file each)
        with out_path.open("ab") as out, err_path.open("ab") as err:
            while done < len(lines):
                if stop_reason is None and batch_id in self.cancelled:
                    stop_reason = "cancelled"
                if stop_reason is None and time.monotonic() - synced >= SYNC_S:
                    synced = time.monotonic()
                    record = self.store.update_batch(batch_id, request_counts=counts) or {}
                    if record.get("status") == "cancelling":
                        stop_reason = "cancelled"
                    elif time.time() >= record.get("expires_at", float("inf")):
                        stop_reason = "expired"
                while stop_reason is None and next_line < len(lines) and len(running) < self._room():
                    running.add(asyncio.ensure_future(self._one(next_line, lines[next_line], results)))
                    next_line += 1
                if not running:
                    break
                finished, running = await asyncio.wait(running, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    task.result()  # a bug in _one surfaces here
                while done in results:
                    ok, result = results.pop(done)
                    (out if ok else err).write(_jsonl(result))
                    counts["completed" if ok else "failed"] += 1
                    done += 1
                out.flush()
                err.flush()
            if stop_reason == "expired":  # the lines never sent are errors of the expired batch
                for line in lines[done:]:
                    err.write(_jsonl(_error_line(line, "batch_expired", "the batch expired before this line ran")))
                    counts["failed"] += 1
        if stop_reason == "cancelled":
            self.store.update_batch(batch_id, request_counts=counts, status="cancelling")
        elif stop_reason == "expired":
            self.store.update_batch(batch_id, request_counts=counts, status="expired", expired_at=int(time.time()))
        else:
            with self.store.lock:
                current = self.store.batch(batch_id) or {}
                done_fields: dict[str, Any] = {"request_counts": counts}
                if current.get("status") == "in_progress":
                    done_fields.update(status="finalizing", finalizing_at=int(time.time()))
                self.store.update_batch(batch_id, **done_fields)

    def _room(self) -> int:
        """Lines to keep in flight: all `concurrency` while the daemon is otherwise idle, one while interactive
        requests are in flight (their planning and HTTP work share the CPU with the batch's)."""
        interactive = self.inflight() - self.sending
        return 1 if interactive > 0 else self.concurrency

    async def _one(self, index: int, line: Line, results: dict[int, tuple[bool, dict[str, Any]]]) -> None:
        """One line's result into `results`; whatever goes wrong with it fails this line alone."""
        try:
            await self._send(index, line, results)
        except Exception:  # noqa: BLE001 - a bug on one line must not fail the batch's other lines
            log.exception("batch line %d failed", line.number)
            results[index] = (False, _error_line(line, "internal_error", f"line {line.number}: the daemon could "
                                                 "not run this line (its log has the reason)"))

    async def _send(self, index: int, line: Line, results: dict[int, tuple[bool, dict[str, Any]]]) -> None:
        if line.body is None:
            results[index] = (False, _error_line(line, "invalid_request", f"line {line.number}: {line.error}"))
            return
        body = _jsonl(line.body)
        delay = 0.25
        while True:
            request_id = secrets.token_hex(16)
            self.sending += 1
            try:
                status, answer = await call_app(self.app, body, request_id)
            finally:
                self.sending -= 1
            if status not in RETRY_STATUSES:
                break
            await asyncio.sleep(delay)  # overloaded or loading: this line waits, it does not fail
            delay = min(delay * 2, 5.0)
        result = {"id": "batch_req_" + secrets.token_hex(12), "custom_id": line.custom_id,
                  "response": {"status_code": status, "request_id": request_id, "body": answer}, "error": None}
        results[index] = (status == 200, result)

    def _finalize(self, batch_id: str, out_path: Path, err_path: Path) -> None:
        self.cancelled.discard(batch_id)
        record = self.store.batch(batch_id)
        if record is None or record["status"] in ("completed", "failed", "cancelled"):
            return
        expires = record["_state"].get("output_expires_s")
        fields: dict[str, Any] = {}
        for path, key, name in ((out_path, "output_file_id", "output"), (err_path, "error_file_id", "errors")):
            if path.exists() and path.stat().st_size:
                fields[key] = self.store.add_file(path, f"{batch_id}_{name}.jsonl", "batch_output", expires)["id"]
            else:
                path.unlink(missing_ok=True)
        now = int(time.time())
        if record["status"] == "cancelling":
            fields.update(status="cancelled", cancelled_at=now)
        elif record["status"] == "finalizing":
            fields.update(status="completed", completed_at=now)
        self.store.update_batch(batch_id, **fields)
        log.info("batch %s %s: %s", batch_id, fields.get("status", record["status"]),
                 record["request_counts"])


def _jsonl(item: dict[str, Any]) -> bytes:
    """One line of JSON in UTF-8 (a body sent to the handler, a line of the output or error file); where a text
    holds a lone surrogate (JSON lets one through as an escape), the line keeps it as that escape: the handler
    answers it as it answers an HTTP client sending it, and a file line stays UTF-8."""
    try:
        return json.dumps(item, ensure_ascii=False).encode("utf-8") + b"\n"
    except UnicodeEncodeError:
        return json.dumps(item).encode("ascii") + b"\n"


def _error_line(line: Line, code: str, message: str) -> dict[str, Any]:
    return {"id": "batch_req_" + secrets.token_hex(12), "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message}}
