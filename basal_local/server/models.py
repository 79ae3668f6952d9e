"""Models at run time: load and unload without a restart, and an idle unload after a keep-alive time per model.

The registry knows every model this daemon served or was asked to load (name -> directory) and the state of
each: `loaded`, `loading`, `unloading`, `unloaded` or `failed`. A request for a known model that is not loaded
starts its load and is answered 503 + `Retry-After` (the dialect's shape) until it is in; an unknown name keeps
the dialect's unknown-model error. Unloading takes the model out of routing first, lets the requests it holds
finish (up to `DRAIN_S`), then stops the engine and drops it whole: its backend, weights and any cache inside
it go with it (nothing here caches).

Routes (`model_routes.py`): `POST /api/load {"model": NAME|REF|DIR, "keep_alive": "10m"|600|"forever", "wait":
false}` and `POST /api/unload {"model": NAME}`; the states ride in `/api/ps` (`models[].status`) and `/api/stats`
(`model_states`), and each change is an event (`model_loading`, `model_loaded`, `model_load_failed`,
`model_unloading`, `model_unloaded`).
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..api.errors import ApiError, http_error
from ..engine.protocol import Engine
from ..model.directory import ModelLoadError, load_model_dir
from ..model.formats import port_summary
from ..model.registry import ModelNotFound, resolve_model

log = logging.getLogger("basal_local.daemon")
DRAIN_S = 30.0  # an unload waits this long for the requests the model holds
GRACE_S = 0.5  # ...and at least this long, for a request that was routed just before
RETRY_S = 30.0  # a failed load is tried again by a request only after this long
TICK_S = 1.0  # how often idle models are looked at


@dataclass
class Entry:
    name: str
    path: Path
    keep_alive_s: float | None  # None: forever
    status: str = "unloaded"
    since: float = 0.0  # wall clock of the last change of status
    last_used: float = 0.0  # monotonic: the last request routed to it
    error: str | None = None
    load_s: float | None = None
    listing: dict[str, Any] | None = None  # its /v1/models fields while it is not loaded (from its last load)


class ModelRegistry:
    """Every known model's state; loads and unloads on helper threads, never on the event loop."""

    def __init__(self, state, loader: Callable[[Path], Engine], keep_alive_s: float | None,
                 frozen: bool = False) -> None:
        self.state, self.loader, self.keep_alive_s, self.frozen = state, loader, keep_alive_s, frozen
        self.entries: dict[str, Entry] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="basal-local-keep-alive", daemon=True)

    # ---- what the daemon and the handlers call --------------------------------------------------------------
    def loaded_at_start(self, engine: Engine) -> None:
        self._set(Entry(engine.model.name, Path(engine.model.path), self.keep_alive_s), "loaded")
        self.entries[engine.model.name].last_used = time.monotonic()
        self.entries[engine.model.name].listing = _listing(engine)

    def unloaded_listings(self) -> dict[str, dict[str, Any]]:
        """/v1/models fields of the known models that are not loaded now (a request for one loads it)."""
        return {e.name: e.listing for e in list(self.entries.values())
                if e.listing is not None and e.name not in self.state.engines}

    def start(self) -> None:
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()

    def routable(self) -> dict[str, Any]:
        """The names a request may ask for: the loaded engines and the known models that are not loaded."""
        served: dict[str, Any] = {name: None for name in self.entries}
        served.update(self.state.engines)
        return served

    def touch(self, name: str) -> None:
        entry = self.entries.get(name)
        if entry is not None:
            entry.last_used = time.monotonic()

    def not_loaded(self, name: str, dialect: str | None) -> ApiError:
        """A request for a known model that is not loaded: start its load; the 503 that says to retry."""
        entry = self.entries[name]
        if entry.status == "unloading":
            message, retry = f"model {name} is being unloaded; it loads again on a request after that", 2
        elif entry.status == "failed" and time.time() - entry.since < RETRY_S:
            message, retry = f"model {name} failed to load: {entry.error}", int(RETRY_S)
        else:
            self.load(name)
            message, retry = f"model {name} is loading; retry in a few seconds", 5
        return http_error(503, "MODEL_LOADING", message, dialect, {"retry-after": str(retry)})

    def resolve(self, ref: str) -> tuple[str | None, Path]:
        """A known name, or a reference `model/registry.py` resolves (directory, mini, OWNER/NAME[@REV]; never
        downloading): (known name or None, directory). LookupError says why not."""
        if ref in self.entries:
            return ref, self.entries[ref].path
        if ref in self.state.aliases and self.state.aliases[ref] in self.entries:
            name = self.state.aliases[ref]
            return name, self.entries[name].path
        try:
            path = resolve_model(ref)
            name = load_model_dir(path, check_weights=False).name
        except (ModelNotFound, ModelLoadError, OSError) as exc:
            raise LookupError(str(exc)) from None
        return (name if name in self.entries else None), path

    def add(self, path: Path) -> str:
        name = load_model_dir(path, check_weights=False).name
        with self.lock:
            if name not in self.entries:
                self.entries[name] = Entry(name, path, self.keep_alive_s, since=time.time())
            elif self.entries[name].path != path and self.entries[name].status != "unloaded":
                raise LookupError(f"another model named {name!r} is served from {self.entries[name].path}")
            else:
                self.entries[name].path = path
        return name

    def load(self, name: str, keep_alive_s: float | None | str = "unchanged") -> threading.Thread | None:
        """Start loading `name` (known) unless it is loaded or loading; the thread that loads it, or None."""
        with self.lock:
            entry = self.entries[name]
            if keep_alive_s != "unchanged":
                entry.keep_alive_s = keep_alive_s  # type: ignore[assignment]
            if entry.status in ("loaded", "loading", "unloading"):
                return None
            self._set(entry, "loading")
        thread = threading.Thread(target=self._load, args=(entry,), name=f"basal-local-load-{name}", daemon=True)
        thread.start()
        return thread

    def unload(self, name: str) -> threading.Thread | None:
        """Start unloading `name` unless it is not loaded; the thread that unloads it, or None."""
        with self.lock:
            entry = self.entries[name]
            engine = self.state.engines.get(name)
            if entry.status != "loaded" or engine is None:
                return None
            self._set(entry, "unloading")
            self.state.engines = {k: v for k, v in self.state.engines.items() if k != name}  # no new requests
        # in a box the thread empties: a Thread keeps its args until its target returns, which would hold the
        # engine through the collection below
        thread = threading.Thread(target=self._unload, args=(entry, [engine]), name=f"basal-local-unload-{name}",
                                  daemon=True)
        thread.start()
        return thread

    def snapshot(self) -> list[dict[str, Any]]:
        """Each known model's state for /api/ps and /api/stats."""
        now = time.monotonic()
        out = []
        for e in list(self.entries.values()):
            idle = now - e.last_used if e.status == "loaded" else None
            expires = None
            if idle is not None and e.keep_alive_s is not None:
                expires = round(max(0.0, e.keep_alive_s - idle), 1)
            out.append({"name": e.name, "status": e.status, "since": e.since, "path": str(e.path),
                        "keep_alive_s": e.keep_alive_s, "idle_s": None if idle is None else round(idle, 1),
                        "expires_in_s": expires, "load_s": e.load_s, "error": e.error,
                        "default": e.name == self.state.default_model})
        return out

    # ---- the work, on helper threads ----------------------------------------------------------------------
    def _set(self, entry: Entry, status: str, **fields: Any) -> None:
        entry.status, entry.since = status, time.time()
        self.entries[entry.name] = entry
        kind = {"loading": "model_loading", "loaded": "model_loaded", "failed": "model_load_failed",
                "unloading": "model_unloading", "unloaded": "model_unloaded"}[status]
        self.state.telemetry.emit(kind, model=entry.name, **fields)

    def _load(self, entry: Entry) -> None:
        started = time.perf_counter()
        log.info("loading %s from %s", entry.name, entry.path)
        try:
            engine = self.loader(entry.path)
        except Exception as exc:
            log.debug("loading %s failed", entry.name, exc_info=True)
            log.error("loading %s failed: %s", entry.name, exc)
            entry.error = str(exc)
            self._set(entry, "failed", error=entry.error)
            return
        if self.state.stopping:  # the daemon stopped while this one loaded
            engine.stop(5.0)
            return
        with self.lock:
            self.state.engines = {**self.state.engines, entry.name: engine}
            entry.error, entry.load_s = None, round(time.perf_counter() - started, 3)
            entry.listing = _listing(engine)
            entry.last_used = time.monotonic()
            if self.state.default_model is None:
                self.state.default_model = entry.name
            self._set(entry, "loaded", load_s=entry.load_s)
        if self.frozen:  # as at start (engine.freeze_heap): what the model brought stays out of full collections
            gc.collect()
            gc.freeze()
        log.info("loaded %s in %.1f s", entry.name, entry.load_s)

    def _unload(self, entry: Entry, box: list[Engine]) -> None:
        engine = box.pop()
        log.info("unloading %s", entry.name)
        routed = time.monotonic()
        while time.monotonic() - routed < DRAIN_S:
            held = sum(r.get("requests", 0) for r in engine.describe())
            if not held and time.monotonic() - routed >= GRACE_S:
                break
            time.sleep(0.05)
        if not engine.stop(DRAIN_S):
            log.warning("engine %s did not stop within %.0f s", entry.name, DRAIN_S)
        if _owned_by(self.state.telemetry.memory_probe, engine):
            others = list(self.state.engines.values())
            self.state.telemetry.memory_probe = others[-1].memory if others else None
        del engine  # the last reference: its backend, graphs and device memory go with it
        self._release_memory()
        with self.lock:
            self._set(entry, "unloaded")
        log.info("unloaded %s", entry.name)

    def _release_memory(self) -> None:
        """Collect what the engine held (a frozen heap first thawed, so its cycles can go) and give the device's
        cached blocks back, so `nvidia-smi` shows the memory free."""
        if self.frozen:
            gc.unfreeze()
        gc.collect()
        if self.frozen:
            gc.freeze()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _reap(self) -> None:
        while not self._stop.wait(TICK_S):
            now = time.monotonic()
            for entry in list(self.entries.values()):
                if entry.status != "loaded" or entry.keep_alive_s is None:
                    continue
                engine = self.state.engines.get(entry.name)
                if engine is None or now - entry.last_used < entry.keep_alive_s:
                    continue
                if any(r.get("requests", 0) for r in engine.describe()):
                    entry.last_used = now  # still answering: idle starts when it is done
                    continue
                log.info("%s idle for %.0f s (keep-alive): unloading", entry.name, now - entry.last_used)
                self.unload(entry.name)


def _listing(engine: Engine) -> dict[str, Any]:
    return port_summary(engine.model)


def _owned_by(probe: Callable | None, engine: Engine) -> bool:
    """Whether the telemetry's memory probe is this engine's (a bound `memory`)."""
    return getattr(probe, "__self__", None) is engine


