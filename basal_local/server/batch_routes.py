"""The Batch and Files API routes (`/v1/files`, `/v1/batches`), as basal-client's `files` and `batches` speak them.

Uploads are multipart/form-data (`purpose`, optional `expires_after[anchor|seconds]`, then the `file` part),
streamed to disk with the size checked as it arrives. Errors are the daemon's own shape
`{"error": message, "code": CODE}`. The work itself is `batches/runner.py`'s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import multipart
from litestar import Request, Response, delete, get, post
from litestar.response import File

from ..batches.runner import Runner
from ..batches.store import MAX_EXPIRY_S, MAX_FILE_BYTES, MIN_EXPIRY_S, TERMINAL, Store, public
from ..paths import home_dirs
from .responses import json_response

MAX_CREATE_BODY = 64 * 1024
MAX_METADATA_KEYS = 16


class BatchApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _json(status: int, body: Any, close: bool = False) -> Response:
    return json_response(status, body, {"connection": "close"} if close else None)


def _error(exc: BatchApiError, close: bool = False) -> Response:
    return _json(exc.status, {"error": exc.message, "code": exc.code}, close)


def _store(request: Request) -> Store:
    return request.app.state.batch_store


def _limit(request: Request) -> tuple[str | None, int]:
    after = request.query_params.get("after")
    raw = request.query_params.get("limit", "20")
    if not _whole_number(raw) or not 1 <= int(raw) <= 100:
        raise BatchApiError(400, "INVALID_LIMIT", f"limit must be a whole number from 1 to 100, got {raw!r}")
    return after, int(raw)


def _whole_number(text: str) -> bool:
    """ASCII digits only, few enough for int(): str.isdigit() also accepts "²" and "٣", which int() refuses or
    reads as another number."""
    return text.isascii() and text.isdigit() and len(text) <= 12


def _expiry(anchor: str | None, seconds: str | int | None, name: str) -> int | None:
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise BatchApiError(400, "INVALID_EXPIRY", f"{name}[anchor] must be created_at")
    if isinstance(seconds, bool) or not (isinstance(seconds, int) or (isinstance(seconds, str) and
                                                                     _whole_number(seconds))):
        raise BatchApiError(400, "INVALID_EXPIRY", f"{name}[seconds] must be a whole number of seconds")
    value = int(seconds)
    if not MIN_EXPIRY_S <= value <= MAX_EXPIRY_S:
        raise BatchApiError(400, "INVALID_EXPIRY", f"{name}[seconds] must be from {MIN_EXPIRY_S} to {MAX_EXPIRY_S}, "
                            f"got {value}")
    return value


async def _receive_upload(request: Request, store: Store) -> tuple[dict[str, str], str, Path]:
    """(form fields, file name, the file on disk) of a multipart upload, streamed with its size bounded."""
    ctype, options = multipart.parse_options_header(request.headers.get("content-type", ""))
    if ctype != "multipart/form-data" or not options.get("boundary"):
        raise BatchApiError(415, "UNSUPPORTED_MEDIA_TYPE", "upload the file as multipart/form-data")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and \
            (len(declared) > 12 or int(declared) > MAX_FILE_BYTES + 64 * 1024):
        raise BatchApiError(413, "FILE_TOO_LARGE", f"the file is larger than {MAX_FILE_BYTES} bytes")
    fields: dict[str, str] = {}
    filename, target = None, store.upload_path()
    handle, name, value, size = None, None, b"", 0
    try:
        with multipart.PushMultipartParser(options["boundary"], max_segment_count=8) as parser:
            async for chunk in request.stream():
                for event in parser.parse(chunk):
                    if isinstance(event, multipart.MultipartSegment):
                        name, value = event.name, b""
                        if event.filename is not None and name == "file":
                            filename, handle = event.filename, target.open("wb")
                    elif event is None:
                        if handle is not None and name == "file":
                            handle.close()
                            handle = None
                        elif name is not None:
                            fields[name] = value.decode("utf-8", "replace")
                        name = None
                    elif handle is not None:
                        size += len(event)
                        if size > MAX_FILE_BYTES:
                            raise BatchApiError(413, "FILE_TOO_LARGE", f"the file is larger than {MAX_FILE_BYTES} bytes")
                        handle.write(event)
                    elif len(value) < 4096:
                        value += event
            for _ in parser.parse(b""):
                pass
    except multipart.MultipartError as exc:
        target.unlink(missing_ok=True)
        raise BatchApiError(400, "INVALID_UPLOAD", f"the multipart body is malformed: {exc}") from None
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    finally:
        if handle is not None:
            handle.close()
    if filename is None:
        target.unlink(missing_ok=True)
        raise BatchApiError(400, "MISSING_FILE", "the upload has no part named file")
    return fields, filename, target


@post("/v1/files", request_max_body_size=None)
async def upload_file(request: Request) -> Response:
    store = _store(request)
    try:
        fields, filename, path = await _receive_upload(request, store)
        try:
            if fields.get("purpose") != "batch":
                raise BatchApiError(400, "INVALID_PURPOSE", f"purpose must be batch, got {fields.get('purpose')!r}")
            expires = _expiry(fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]"),
                              "expires_after")
        except BaseException:  # the upload is not kept: no file stays behind
            path.unlink(missing_ok=True)
            raise
        return _json(200, store.add_file(path, filename, "batch", expires))
    except BatchApiError as exc:
        return _error(exc, close=exc.status == 413)


@get("/v1/files")
async def list_files(request: Request) -> Response:
    try:
        after, limit = _limit(request)
    except BatchApiError as exc:
        return _error(exc)
    return _json(200, _store(request).list_files(after, limit, request.query_params.get("purpose")))


def _path_param(request: Request, name: str) -> str:
    """A path parameter read from the request, as events.py does: a handler argument named after it would be an
    inferred path parameter, which litestar deprecates (a warning from 2.25 on)."""
    return str(request.path_params[name])


def _file_or_404(store: Store, file_id: str) -> dict[str, Any]:
    record = store.get_file(file_id)
    if record is None:
        raise BatchApiError(404, "FILE_NOT_FOUND", f"no file {file_id}")
    return record


@get("/v1/files/{file_id:str}")
async def get_file(request: Request) -> Response:
    file_id = _path_param(request, "file_id")
    try:
        return _json(200, _file_or_404(_store(request), file_id))
    except BatchApiError as exc:
        return _error(exc)


@get("/v1/files/{file_id:str}/content")
async def file_content(request: Request) -> Response:
    file_id = _path_param(request, "file_id")
    store = _store(request)
    try:
        _file_or_404(store, file_id)
    except BatchApiError as exc:
        return _error(exc)
    return File(store.file_data(file_id), media_type="application/jsonl", content_disposition_type="inline")


@delete("/v1/files/{file_id:str}", status_code=200)
async def delete_file(request: Request) -> Response:
    file_id = _path_param(request, "file_id")
    store = _store(request)
    for record in store.all_batches():
        if record["input_file_id"] == file_id and record["status"] not in TERMINAL:
            return _error(BatchApiError(409, "FILE_IN_USE", f"file {file_id} is the input of the running batch "
                                        f"{record['id']}; cancel it first"))
    if not store.delete_file(file_id):
        return _error(BatchApiError(404, "FILE_NOT_FOUND", f"no file {file_id}"))
    return _json(200, {"id": file_id, "object": "file", "deleted": True})


def _create_fields(body: Any, store: Store) -> tuple[str, dict[str, str] | None, int | None]:
    if not isinstance(body, dict):
        raise BatchApiError(400, "INVALID_REQUEST", "the body must be a JSON object")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise BatchApiError(400, "INVALID_REQUEST", "input_file_id must be a file id")
    record = store.get_file(file_id)
    if record is None or record["purpose"] != "batch":
        raise BatchApiError(404 if record is None else 400, "FILE_NOT_FOUND" if record is None else "INVALID_FILE",
                            f"no batch input file {file_id}")
    if body.get("endpoint", "/v1/basal") != "/v1/basal":
        raise BatchApiError(400, "INVALID_ENDPOINT", f"endpoint must be /v1/basal, got {body.get('endpoint')!r}")
    if body.get("completion_window", "24h") != "24h":
        raise BatchApiError(400, "INVALID_WINDOW", "completion_window must be 24h")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS
                                 or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise BatchApiError(400, "INVALID_METADATA", f"metadata must map at most {MAX_METADATA_KEYS} strings to strings")
    expiry = body.get("output_expires_after")
    seconds = None
    if expiry is not None:
        if not isinstance(expiry, dict):
            raise BatchApiError(400, "INVALID_EXPIRY", "output_expires_after must be {anchor, seconds}")
        seconds = _expiry(expiry.get("anchor"), expiry.get("seconds"), "output_expires_after")
    return file_id, metadata, seconds


@post("/v1/batches", status_code=200)
async def create_batch(request: Request) -> Response:
    store = _store(request)
    raw = await request.body()
    try:
        if len(raw) > MAX_CREATE_BODY:
            raise BatchApiError(413, "BODY_TOO_LARGE", f"the body is larger than {MAX_CREATE_BODY} bytes")
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            raise BatchApiError(400, "INVALID_JSON", "the body is not valid JSON") from None
        except RecursionError:
            raise BatchApiError(400, "INVALID_JSON", "the body's JSON is nested too deeply") from None
        file_id, metadata, seconds = _create_fields(body, store)
        key = request.headers.get("idempotency-key")
        if key is not None:  # the same key gives the same batch (a retried create makes no second one)
            for record in store.all_batches():
                if record["_state"].get("idempotency_key") == key:
                    return _json(200, public(record))
        batch = store.add_batch(file_id, metadata, seconds)
        if key is not None:
            record = store.batch(batch["id"])
            record["_state"]["idempotency_key"] = key  # type: ignore[index]
            store.save_batch(record)  # type: ignore[arg-type]
        request.app.state.batch_runner.poke()
        return _json(200, batch)
    except BatchApiError as exc:
        return _error(exc)


@get("/v1/batches")
async def list_batches(request: Request) -> Response:
    try:
        after, limit = _limit(request)
    except BatchApiError as exc:
        return _error(exc)
    return _json(200, _store(request).list_batches(after, limit))


@get("/v1/batches/{batch_id:str}")
async def get_batch(request: Request) -> Response:
    batch_id = _path_param(request, "batch_id")
    record = _store(request).batch(batch_id)
    if record is None:
        return _error(BatchApiError(404, "BATCH_NOT_FOUND", f"no batch {batch_id}"))
    return _json(200, public(record))


@post("/v1/batches/{batch_id:str}/cancel", status_code=200)
async def cancel_batch(request: Request) -> Response:
    batch_id = _path_param(request, "batch_id")
    store = _store(request)
    with store.lock:
        record = store.batch(batch_id)
        if record is None:
            return _error(BatchApiError(404, "BATCH_NOT_FOUND", f"no batch {batch_id}"))
        if record["status"] in TERMINAL or record["status"] == "cancelling":
            return _json(200, public(record))  # a terminal batch is returned unchanged
        record = store.update_batch(batch_id, status="cancelling", cancelling_at=int(time.time()))
    request.app.state.batch_runner.cancel(batch_id)
    return _json(200, public(record))  # type: ignore[arg-type]


def batch_summary(app: Any) -> list[dict[str, Any]]:
    """The batches not finished yet, with their progress (for /api/stats and the dashboard)."""
    if "batch_store" not in app.state:
        return []
    return [{"id": r["id"], "status": r["status"], "created_at": r["created_at"], **r["request_counts"]}
            for r in app.state.batch_store.all_batches() if r["status"] not in TERMINAL]


BATCH_ROUTES = [upload_file, list_files, get_file, file_content, delete_file, create_batch, list_batches,
                get_batch, cancel_batch]


def start_batches(app: Any) -> None:
    """on_startup: the store in the user data folder (BASAL_LOCAL_HOME moves it) and its runner in this loop."""
    store = Store(home_dirs()["data"] / "batches")
    app.state.batch_store = store
    # at most a quarter of the in-flight slots, so batch lines never make interactive requests see 529
    concurrency = max(1, min(32, app.state.basal.max_inflight // 4))
    admission = app.state.basal.admission
    runner = Runner(store, app, concurrency, inflight=lambda: admission.inflight)
    app.state.batch_runner = runner
    runner.start()


async def stop_batches(app: Any) -> None:
    if "batch_runner" in app.state:
        await app.state.batch_runner.stop()
