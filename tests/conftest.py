"""Shared fixtures: generated model directories (cached per session), an in-process app, a live daemon."""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from . import hf_reference

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".test-cache"

# The README's test command installs with `pip install --no-compile` (compiling every .py of torch and
# transformers to bytecode is minutes of CPU on a 2-core machine, and the tests import a fraction of them). So
# let this process and the daemons it starts cache the bytecode of what they do import, once, even where the
# environment says PYTHONDONTWRITEBYTECODE (otherwise every daemon would compile torch again).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# One torch thread per process in an xdist worker (set before anything imports torch; the daemons inherit it):
# the suite runs two workers per core, each with a daemon beside it, and two OpenMP threads per process on 2
# cores spend their time spinning (measured: test_e2e + test_reliability 130 -> 114 s of CPU, 274 -> 234 s
# wall; docs/TESTING.md). A plain `-n 0` run keeps torch's default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: two workers per core. Half of a test's time is spent waiting for a daemon or a CLI process it
    started (sockets, start-up, shutdown), so one worker per core left the cores idle ~40 % of the run: 370 s
    with 2 workers, 291 s with 4 on 2 cores (docs/TESTING.md)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    return 2 * cores


# Files in the order the xdist workers start them: the longest first (wall seconds of the 4-worker run on a
# 2-core machine; docs/TESTING.md), the rest in collection order. With `--dist loadfile` a worker runs a whole
# file, so a long file picked up last decides when the run ends; pyproject's `--no-loadscope-reorder` makes xdist
# hand the files out in this order instead of by their number of tests.
LONGEST_FIRST = [
    "test_parity.py", "test_dashboard.py", "test_replicas.py", "test_e2e.py", "test_reliability.py", "test_mlx.py",
    "test_events.py", "test_mlx_weights.py", "test_mlx_daemon.py", "test_tree_attention.py", "test_evidence.py",
    "test_clients.py", "test_properties.py", "test_packaging.py", "test_cli.py", "test_scheduler.py",
    "test_e2e_extensions.py", "test_dashboard_snapshots.py",
]


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


_shared: list[subprocess.Popen] = []
_starting: list[threading.Thread] = []
_made: list[str] = []  # the folder of the generated test models, removed at the end

# What the workers and their daemons import, then what the transformers reference imports. A fresh
# `pip install --no-compile` has no bytecode for them, and four workers starting at once would each compile the
# same files (a cold `import torch` costs ~3x a warm one). One plain import per group writes the bytecode once.
WARM_IMPORTS = [["torch", "numpy", "litestar", "uvicorn", "basal_local.cli", "basal_local.server.daemon",
                 "basal_local.backends.torch"], ["textual", "rich", "hypothesis", "httpx", "mlx.core"], ["transformers"]]


def _bytecode_cold() -> bool:
    """Whether torch's bytecode is not cached yet (torch stands for everything the suite imports)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    return bool(spec and spec.origin) and not os.path.exists(importlib.util.cache_from_source(spec.origin))


def _import(modules: list[str], env: dict) -> subprocess.Popen:
    code = "".join(f"try:\n    import {m}\nexcept ImportError:\n    pass\n" for m in modules)
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdin=subprocess.DEVNULL)


def pytest_configure(config) -> None:
    """Under xdist the controller prepares, before the workers start, what every worker would otherwise do for
    itself: the bytecode of a fresh install (the first two groups of WARM_IMPORTS, one process per core), the
    transformers reference (tests/hf_reference.py, started in the background) and a folder for the generated test
    models (built once, by the first worker that needs one). The workers inherit the paths through the environment."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", default=0):
        return
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cold = _bytecode_cold()
    if cold:
        for proc in [_import(group, env) for group in WARM_IMPORTS[:-1]]:
            proc.wait()
    if sys.platform != "win32" and not os.environ.get(hf_reference.ENV):
        path = hf_reference.socket_path()

        def start() -> None:  # transformers' bytecode first, so the reference does not compile it itself
            if cold:
                _import(WARM_IMPORTS[-1], env).wait()
            _shared.append(hf_reference.start_server(ROOT, path)[0])

        _starting.append(threading.Thread(target=start, name="hf-reference-start", daemon=True))
        _starting[-1].start()
        os.environ[hf_reference.ENV] = path
    if sys.platform != "win32" and not os.environ.get("BASAL_LOCAL_TEST_MODELS"):
        import tempfile

        os.environ["BASAL_LOCAL_TEST_MODELS"] = tempfile.mkdtemp(prefix="basal-test-models-")
        _made.append(os.environ["BASAL_LOCAL_TEST_MODELS"])


def pytest_unconfigure(config) -> None:
    for thread in _starting:
        thread.join(timeout=300)
    for proc in _shared:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    import shutil

    for folder in _made:
        shutil.rmtree(folder, ignore_errors=True)


def generated_model(tmp_path_factory, preset: str, seed: int) -> Path:
    """A generated model directory; shared through $BASAL_LOCAL_TEST_MODELS when that is set.

    The xdist controller sets it for one run (pytest_configure), so the workers build each model once;
    `tools/mutate.py` sets it so that each planted bug does not pay for training the test tokenizer again."""
    from basal_local.model.testmodel import make_test_model

    cache = os.environ.get("BASAL_LOCAL_TEST_MODELS")
    if not cache:
        return make_test_model(tmp_path_factory.mktemp(preset), preset=preset, seed=seed)
    target = Path(cache) / f"{preset}-seed{seed}"
    import fcntl

    with open(Path(cache) / f".{preset}-seed{seed}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds it (training the tokenizer), the others wait
        if not (target / "model.safetensors").exists():
            tmp = make_test_model(Path(cache) / f".{preset}-seed{seed}.tmp{os.getpid()}", preset=preset, seed=seed)
            tmp.rename(target)
    return target


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return generated_model(tmp_path_factory, "tiny", 1)


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> Path:
    return generated_model(tmp_path_factory, "small", 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _interruptible() -> None:
    """In the child before it runs: Ctrl-C's signal as a terminal user's shell leaves it. A test run started in the
    background (`&`, nohup, some CI runners) ignores SIGINT, children inherit that, and Python then installs no
    KeyboardInterrupt handler: the Ctrl-C tests would test nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cli_popen(args: list, **kwargs) -> subprocess.Popen:
    """`basal-local ARGS` as its own process (subprocess.Popen's keyword arguments)."""
    kwargs.setdefault("preexec_fn", _interruptible)
    return subprocess.Popen([sys.executable, "-m", "basal_local.cli", *map(str, args)], **kwargs)


def cli_run(args: list, **kwargs) -> subprocess.CompletedProcess:
    """`basal-local ARGS` run to its end (subprocess.run's keyword arguments)."""
    kwargs.setdefault("preexec_fn", _interruptible)
    return subprocess.run([sys.executable, "-m", "basal_local.cli", *map(str, args)], **kwargs)


def http(method: str, url: str, body: bytes | dict | None = None, headers: dict | None = None, timeout: float = 60):
    """(status, headers, parsed JSON body) for a request; errors are answers too."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


class Daemon:
    """`basal-local serve` as a subprocess; its output is drained by a thread into a bounded buffer.

    Without the drain a chatty daemon fills the pipe and blocks on its next log line, which hangs the test.
    """

    LOG_LINES = 5000  # the last lines kept; older ones are dropped

    def __init__(self, args: list[str], env: dict | None = None, command: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        options = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True,
                   "env": {**os.environ, **(env or {})}}
        command = command or [sys.executable, "-m", "basal_local.cli", "serve"]
        self.proc = subprocess.Popen([*command, "--port", str(self.port), *args], **options)
        self._lines: collections.deque[str] = collections.deque(maxlen=self.LOG_LINES)
        self._drain = threading.Thread(target=self._read, daemon=True)
        self._drain.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)

    @property
    def log(self) -> str:
        return "".join(list(self._lines))

    def wait_ready(self, timeout: float = 240) -> None:
        """Wait for /health 200; a daemon that exits or never gets ready is stopped (no orphan) and reported."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self._drain.join(timeout=5)
                raise RuntimeError(f"daemon exited: {self.log}")
            try:
                status, _, _ = http("GET", self.url + "/health", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        log = self.stop()
        raise TimeoutError(f"daemon did not become ready within {timeout:.0f} s:\n{log[-2000:]}")

    def stop(self) -> str:
        """Terminate the daemon and return its output (the last LOG_LINES lines)."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._drain.join(timeout=10)
        return self.log


def InProcessDaemon(model_dirs: list, **settings):
    """The daemon's own guarded app (`server/daemon.py` `InThread`: Host/Origin guard, body limits, drain), its
    models loading in the background, served by uvicorn in a thread of this process on a free port. For tests that
    only talk HTTP to a daemon; exit codes, signals, ports and killed processes need `Daemon` (a real process)."""
    from basal_local.server.daemon import InThread
    from basal_local.settings import Settings

    values = Settings.load({"device": "cpu", **settings, "port": free_port()}, config_file=Path("/nonexistent"))
    return InThread(values, [Path(d) for d in model_dirs])


@pytest.fixture(scope="module")
def daemon(tiny_model):
    """A daemon with the tiny model on the CPU, in this process (`InProcessDaemon`), for a module's tests."""
    d = InProcessDaemon([tiny_model])
    d.wait_ready()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def app_client(tiny_model):
    """The litestar app in-process with the tiny model loaded (no socket)."""
    from litestar.testing import TestClient

    from basal_local.server.app import AppState, create_app
    from basal_local.server.daemon import load_engines
    from basal_local.server.settings import Settings

    settings = Settings.load({"device": "cpu"}, config_file=Path("/nonexistent"))
    state = AppState(max_inflight=settings.max_inflight)
    load_engines(state, settings, [tiny_model])
    assert state.ready, state.load_error
    with TestClient(create_app(state)) as client:
        client.basal_state = state
        yield client
    for engine in state.engines.values():
        engine.stop()


def load_backend(model_dir, device: str = "cpu", dtype: str = "f32", **options):
    """(model dir, torch backend with the templates cached, template prefixes) for backend-level tests."""
    from basal_local.backends.torch import TorchBackend
    from basal_local.model import load_model_dir

    md = load_model_dir(model_dir)
    backend = TorchBackend(device, **options)
    backend.load(model_dir, dtype)
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    for lang, ids in prefixes.items():
        backend.add_prefix(lang, ids)
    return md, backend, prefixes


def readout_logits(backend, pack) -> list:
    """Each input prompt's letter logits from the forwards of a PackPlan."""
    outputs = [backend.forward(b) for b in pack.batches]
    return [outputs[b][r, cols] for b, r, cols in pack.readouts]


@pytest.fixture
def home(tmp_path) -> dict:
    """The environment of an isolated user: its own BASAL_LOCAL_HOME, config and an empty Hugging Face cache (the
    hub endpoint is a dead port), no API key. Modules that need another home define their own `home`."""
    (tmp_path / "hub").mkdir()
    return {"BASAL_LOCAL_HOME": str(tmp_path / "basal"), "HF_HUB_CACHE": str(tmp_path / "hub"),
            "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HUB_DISABLE_TELEMETRY": "1",
            "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "BASAL_LOCAL_API_KEY": ""}
