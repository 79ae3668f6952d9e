"""Files and batches of the Batch API on disk: one folder in the user data folder, JSON records written atomically.

Layout under the root: `files/<id>` (the bytes) and `files/<id>.json` (the FileObject), `batches/<id>.json` (the
Batch object plus our `_state`: where the run stands), and while a batch runs `batches/<id>.out` / `.err` (its
result lines so far, in input order). A daemon restart finds everything as it was and resumes.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

MAX_FILE_BYTES = 200_000_000  # the client's own limit for one upload (basal-client builds at most this)
MAX_LINES = 50_000
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 2_592_000
BATCH_WINDOW_S = 24 * 3600  # completion_window "24h"
TERMINAL = ("completed", "failed", "expired", "cancelled")


def _now() -> int:
    return int(time.time())


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)  # a reader (or a crash) sees the old record or the new one, never half of one


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _page(records: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """Newest first; `after` = the last id of the previous page."""
    records.sort(key=lambda r: (-r["created_at"], r["id"]))
    if after is not None:
        ids = [r["id"] for r in records]
        records = records[ids.index(after) + 1:] if after in ids else []
    data = records[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(records) > limit}


class Store:
    """Thread-safe access to the files and batches under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = root / "files"
        self.batches = root / "batches"
        self.files.mkdir(parents=True, exist_ok=True)
        self.batches.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()

    # --- files ---
    def add_file(self, data_path: Path, filename: str, purpose: str, expires_after_s: int | None) -> dict[str, Any]:
        """Move an uploaded (or written) file into the store and record it."""
        file_id = "file-" + secrets.token_hex(12)
        created = _now()
        record = {"id": file_id, "object": "file", "bytes": data_path.stat().st_size, "created_at": created,
                  "expires_at": created + expires_after_s if expires_after_s else None, "filename": filename,
                  "purpose": purpose, "status": "processed", "status_details": None}
        with self.lock:
            os.replace(data_path, self.files / file_id)
            _write_json(self.files / f"{file_id}.json", record)
        return record

    def get_file(self, file_id: str) -> dict[str, Any] | None:
        if not _safe_id(file_id, "file-"):
            return None
        with self.lock:
            record = _read_json(self.files / f"{file_id}.json")
            if record is not None and record["expires_at"] is not None and record["expires_at"] <= _now():
                self._remove_file(file_id)
                return None
            return record

    def file_data(self, file_id: str) -> Path:
        return self.files / file_id

    def list_files(self, after: str | None, limit: int, purpose: str | None) -> dict[str, Any]:
        with self.lock:
            ids = [p.stem for p in self.files.glob("file-*.json")]
            records = [r for r in (self.get_file(i) for i in ids) if r is not None]
        if purpose is not None:
            records = [r for r in records if r["purpose"] == purpose]
        return _page(records, after, limit)

    def delete_file(self, file_id: str) -> bool:
        with self.lock:
            if self.get_file(file_id) is None:
                return False
            self._remove_file(file_id)
            return True

    def _remove_file(self, file_id: str) -> None:
        for path in (self.files / file_id, self.files / f"{file_id}.json"):
            path.unlink(missing_ok=True)

    def upload_path(self) -> Path:
        """A temporary path in the store's file system for an upload in progress (then moved by add_file)."""
        return self.files / f"upload-{secrets.token_hex(8)}.part"

    # --- batches ---
    def add_batch(self, input_file_id: str, metadata: dict[str, str] | None,
                  output_expires_s: int | None) -> dict[str, Any]:
        batch_id = "batch_" + secrets.token_hex(12)
        created = _now()
        record: dict[str, Any] = {
            "id": batch_id, "object": "batch", "endpoint": "/v1/basal", "model": None, "errors": None,
            "input_file_id": input_file_id, "completion_window": "24h", "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": created, "in_progress_at": None,
            "expires_at": created + BATCH_WINDOW_S, "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
            "_state": {"output_expires_s": output_expires_s},
        }
        with self.lock:
            _write_json(self.batches / f"{batch_id}.json", record)
        return public(record)

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        """The whole record, `_state` included (None if there is none)."""
        if not _safe_id(batch_id, "batch_"):
            return None
        with self.lock:
            return _read_json(self.batches / f"{batch_id}.json")

    def save_batch(self, record: dict[str, Any]) -> None:
        with self.lock:
            _write_json(self.batches / f"{record['id']}.json", record)

    def update_batch(self, batch_id: str, **fields: Any) -> dict[str, Any] | None:
        with self.lock:
            record = self.batch(batch_id)
            if record is None:
                return None
            record.update(fields)
            self.save_batch(record)
            return record

    def all_batches(self) -> list[dict[str, Any]]:
        with self.lock:
            records = [_read_json(p) for p in self.batches.glob("batch_*.json")]
        return sorted((r for r in records if r is not None), key=lambda r: (r["created_at"], r["id"]))

    def list_batches(self, after: str | None, limit: int) -> dict[str, Any]:
        return _page([public(r) for r in self.all_batches()], after, limit)

    def results_path(self, batch_id: str, kind: str) -> Path:
        return self.batches / f"{batch_id}.{kind}"


def public(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not k.startswith("_")}


def _safe_id(value: str, prefix: str) -> bool:
    """Ids are ours: a prefix and hex digits (a path segment from a client never reaches the file system)."""
    rest = value[len(prefix):]
    return value.startswith(prefix) and 0 < len(rest) <= 64 and all(c in "0123456789abcdef" for c in rest)
