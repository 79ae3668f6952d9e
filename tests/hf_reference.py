"""transformers, the suite's independent reference, computed in one process that every test worker shares.

`from transformers import LlamaForCausalLM` costs ~17-27 s of CPU here (transformers pulls in torch.distributed's
tensor module and sympy). Each xdist worker that ran a reference test paid it again; with a worker per half core
that was a minute of CPU per run. Under xdist the controller starts one reference server before the workers
start (tests/conftest.py) and hands them its socket in BASAL_LOCAL_TEST_HF; without it (`-n 0`) the same code
runs in the test process. Either way the numbers are transformers' own: the server loads the model directory with
`LlamaForCausalLM.from_pretrained(dir, dtype=float32)` and runs the forward the test asks for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the pytest controller imports this module: it needs no NumPy
    import numpy as np

ENV = "BASAL_LOCAL_TEST_HF"
_AUTH = b"basal-local-tests"


class _Models:
    """Loaded transformers models by directory (and the weights' mtime, so a regenerated directory reloads)."""

    def __init__(self) -> None:
        self._models: dict[tuple[str, float], Any] = {}
        self._lock = threading.Lock()

    def get(self, model_dir: str) -> Any:
        import torch
        from transformers import LlamaForCausalLM

        weights = Path(model_dir) / "model.safetensors"
        key = (str(model_dir), weights.stat().st_mtime if weights.exists() else 0.0)
        if key not in self._models:
            self._models[key] = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        return self._models[key]

    def run(self, op: str, model_dir: str, ids: list[int], columns: list[int] | None, keep: int) -> np.ndarray:
        import torch

        with self._lock, torch.no_grad():
            hf = self.get(model_dir)
            x = torch.tensor([list(ids)])
            if op == "hidden":
                return hf.model(x).last_hidden_state[0].numpy().copy()
            row = hf(x, logits_to_keep=keep).logits[0, -1]
            return (row if columns is None else row[list(columns)]).numpy().copy()


def serve(path: str) -> None:
    """The shared server: import transformers once, answer (op, dir, ids, columns, keep) from any worker."""
    try:  # Linux: go when the pytest controller goes, even if it is killed
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    import torch  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401  (the import is what the workers wait for)

    models = _Models()
    listener = Listener(path + ".tmp", family="AF_UNIX", authkey=_AUTH)
    os.rename(path + ".tmp", path)  # the socket appears under its name only once the server can answer

    def handle(conn: Any) -> None:
        with conn:
            while True:
                try:
                    request = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    reply = ("ok", models.run(*request))
                except Exception as exc:  # the test that asked gets the error, the server goes on
                    reply = ("error", f"{type(exc).__name__}: {exc}")
                conn.send(reply)

    while True:
        conn = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def socket_path() -> str:
    """A fresh path for the server's socket (a new temporary folder)."""
    import tempfile

    return os.path.join(tempfile.mkdtemp(prefix="basal-hfref-"), "s")


def start_server(root: Path, path: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start the shared server in the background (the caller does not wait for it); (process, socket path)."""
    path = path or socket_path()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # read when torch loads: one thread, as in the workers
    code = f"import sys; sys.path.insert(0, {str(root)!r}); from tests.hf_reference import serve; serve({path!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, cwd=root, env=env)
    return proc, path


_client: Any = None
_client_lock = threading.Lock()
_local: _Models | None = None


def _call(*request: Any) -> np.ndarray:
    global _client, _local
    path = os.environ.get(ENV)
    if not path:
        if _local is None:
            _local = _Models()
        return _local.run(*request)
    with _client_lock:
        if _client is None:
            deadline = time.monotonic() + 600
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the shared transformers reference did not start ({path})")
                time.sleep(0.2)
            _client = Client(path, family="AF_UNIX", authkey=_AUTH)
        _client.send(request)
        status, value = _client.recv()
    if status != "ok":
        raise RuntimeError(f"transformers reference failed: {value}")
    return value


class HFModel:
    """A transformers LlamaForCausalLM (f32) loaded from `model_dir`, asked through the shared server."""

    def __init__(self, model_dir: str | os.PathLike) -> None:
        self.dir = str(model_dir)

    def last_logits(self, ids: list[int], columns: list[int] | None = None, keep: int = 0) -> np.ndarray:
        """f32 logits of the last position (`columns` of them). keep=1 asks transformers for the last
        position's head only (`logits_to_keep`); 0 computes every position's, as a plain forward does."""
        return _call("logits", self.dir, list(map(int, ids)), None if columns is None else list(map(int, columns)),
                     keep)

    def hidden(self, ids: list[int]) -> np.ndarray:
        """The final hidden states [T, H] (f32) of `model.model`."""
        return _call("hidden", self.dir, list(map(int, ids)), None, 0)
