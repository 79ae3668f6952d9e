"""A fork server for the CLI processes the tests start: `basal-local ...` without paying for `import torch` again.

Every daemon and CLI process of the suite used to be a fresh interpreter: ~10 s of CPU on a 2-core machine, most
of it importing torch (torch._C, torch._prims, the meta registrations), dozens of times per run. Here one server
per test process imports torch and the daemon's modules once; each `cli_popen([...])` forks it, and the child runs
`basal_local.cli.main([...])` with the caller's argv, environment, working directory and stdin/stdout/stderr (the
file descriptors travel over a Unix socket), then leaves through the interpreter's normal exit (atexit, threads,
flushing) with main's status. It is still a separate process with its own pid, signals and exit status, so tests
of exit codes, SIGTERM, busy ports, pipes and logs see what a user's process does. (The same idea as
multiprocessing's forkserver with preloaded modules.)

What the server preloads reads no environment at import time (huggingface_hub, which does, is left out: tests
point HF_HUB_CACHE at their own folders). torch starts no threads until its first operation, which only a child
runs, so forking is safe. Set BASAL_LOCAL_TEST_FORK=0 to run every CLI process as a fresh interpreter instead.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PRELOAD = ["torch", "numpy", "safetensors", "tokenizers", "litestar", "uvicorn", "msgspec", "basal_local.cli",
           "basal_local.server.daemon", "basal_local.server.app", "basal_local.commands.serving",
           "basal_local.backends.torch"]
# what every daemon imported lazily while it started and answered its first requests (~1 s of CPU per daemon, most
# of it litestar's pydantic plugin, which imports pydantic when pydantic is installed); best effort: several are
# private modules that another litestar, uvicorn or anyio release may move (a missing one is only not preloaded)
PRELOAD_LAZY = ["litestar.plugins.pydantic", "litestar._kwargs", "litestar.exceptions.responses",
                "litestar.logging.standard", "litestar.middleware.allowed_hosts", "litestar.middleware.csrf",
                "litestar.middleware.response_cache", "litestar.middleware._internal.exceptions",
                "uvicorn.lifespan.on", "uvicorn.loops.asyncio", "uvicorn.loops.auto",
                "uvicorn.protocols.http.h11_impl", "uvicorn.protocols.websockets.auto", "anyio._backends._asyncio",
                "anyio.streams.memory", "anyio.streams.stapled", "anyio.streams.tls", "basal_local.server.openapi",
                "basal_local.server.extras", "basal_local.model.registry"]
ENABLED = os.environ.get("BASAL_LOCAL_TEST_FORK", "1") != "0" and hasattr(os, "fork") and sys.platform != "darwin"
SHARED = "BASAL_LOCAL_TEST_ZYGOTE"  # the socket of a server the pytest-xdist controller started for all workers


# ----------------------------------------------------------------------------------------------------- server side

def _child(conn: socket.socket, header: dict[str, Any], fds: list[int], closing: list[Any]) -> None:
    """In the forked child: become the requested CLI process, run it, exit with its status. Never returns."""
    for thing in closing:
        thing.close()
    # as in a fresh interpreter: SIGTERM and SIGCHLD default (SIGINT raises KeyboardInterrupt and SIGPIPE is
    # ignored in both, the server never changed them)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    conn.close()
    os.environ.clear()
    os.environ.update(header["env"])
    os.chdir(header["cwd"])
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    import numpy as np

    np.random.seed()  # a fresh interpreter seeds NumPy from the OS; every fork would share the server's state
    try:
        if "exec" in header:  # `python -c CODE` (a pytest-xdist worker: worker_python below)
            sys.argv = ["-c", *header["args"]]
            sys.stdout.reconfigure(write_through=True)  # `-u`, as execnet starts its interpreters
            sys.stderr.reconfigure(write_through=True)
            exec(header["exec"], {"__name__": "__main__", "__builtins__": __builtins__})
            code = 0
        else:
            sys.argv = ["basal-local", *header["args"]]
            from basal_local.cli import main

            code = main(header["args"])
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # what the interpreter does with an uncaught exception: the traceback, status 1
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # The interpreter's exit, less the teardown of every module (seconds with torch loaded, and nothing a user
    # sees): non-daemon threads joined, atexit handlers (logging.shutdown flushes the log file), streams flushed.
    threading._shutdown()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)


def serve(path: str) -> None:
    """The server loop: accept requests, fork a child per request, report each child's exit status."""
    try:  # Linux: go when the test process goes, even if it is killed
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    for name in PRELOAD:
        __import__(name)
    for name in PRELOAD_LAZY:
        try:
            __import__(name)
        except ImportError:
            pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # clients that wait for the path find a server that listens
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}

    def stop(*_: Any) -> None:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "signal")
    while True:
        for key, _ in sel.select():
            if key.data == "signal":
                try:
                    while wake_r.recv(512):
                        pass
                except BlockingIOError:
                    pass
                while children:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = children.pop(pid, None)
                    if conn is not None:
                        try:
                            conn.sendall(b"exit %d\n" % os.waitstatus_to_exitcode(status))
                        except OSError:
                            pass
                        conn.close()
                continue
            conn, _ = listener.accept()
            try:
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                header = json.loads(msg)
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                try:
                    _child(conn, header, fds, [listener, wake_r, wake_w, sel, *children.values()])
                finally:
                    os._exit(1)  # _child never returns; if it raised before main ran, its traceback is on stderr
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            conn.sendall(b"pid %d\n" % pid)


# ----------------------------------------------------------------------------------------------------- client side

def start_server(env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Start a fork server in the background; (process, socket path). The path exists once it listens."""
    path = os.path.join(tempfile.mkdtemp(prefix="basal-zygote-"), "s")
    root = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {root!r}); "
                             f"from tests.zygote import serve; serve({path!r})"],
                            stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, cwd=root, env=env)
    return proc, path


class _Shared:
    """The server the xdist controller started for every worker (tests/conftest.py): wait until it listens."""

    def __init__(self, path: str) -> None:
        self.path = path
        deadline = time.monotonic() + 600
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the shared test fork server did not start ({path})")
            time.sleep(0.1)


class _Server:
    """The fork server of this test process, started on first use, stopped at exit (or the shared one)."""

    _lock = threading.Lock()
    _instance: _Server | _Shared | None = None

    def __init__(self) -> None:
        self.proc, self.path = start_server()
        self.dir = os.path.dirname(self.path)
        while not os.path.exists(self.path):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the test fork server did not start (exit {self.proc.poll()})")
            time.sleep(0.05)

    @classmethod
    def get(cls) -> _Server | _Shared:
        with cls._lock:
            if (shared := os.environ.get(SHARED)) and isinstance(cls._instance, _Shared | None):
                if cls._instance is None:
                    cls._instance = _Shared(shared)
                return cls._instance
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = _Server()
                import atexit

                atexit.register(cls._instance.close)
            return cls._instance

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        try:
            os.unlink(self.path)
            os.rmdir(self.dir)
        except OSError:
            pass


def _pipe_end(spec: Any, for_read: bool, text: bool) -> tuple[int, Any]:
    """(fd for the child, our end as a file or None) for a subprocess-style stdin/stdout/stderr argument."""
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        child, ours = (w, r) if for_read else (r, w)
        mode = ("r" if for_read else "w") + ("" if text else "b")
        return child, open(ours, mode, encoding="utf-8" if text else None, errors="replace" if text else None)
    if spec is None:
        return os.dup(1 if for_read else 0), None  # inherit ours (stdout for outputs, stdin for input)
    if spec == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_WRONLY if for_read else os.O_RDONLY), None
    fileno = spec if isinstance(spec, int) else spec.fileno()
    return os.dup(fileno), None


class ForkedProcess:
    """The Popen surface the tests use (pid, stdin/stdout/stderr, poll, wait, communicate, terminate, kill,
    send_signal, returncode) for a CLI process forked by the server."""

    def __init__(self, args: list[str], env: dict | None = None, cwd: str | os.PathLike | None = None,
                 stdin: Any = None, stdout: Any = None, stderr: Any = None, text: bool = False,
                 code: str | None = None) -> None:
        """`code`: run `python -c CODE ARGS` in the fork instead of `basal-local ARGS`."""
        self.args = args
        self.returncode: int | None = None
        fd_in, self.stdin = _pipe_end(stdin, False, text)
        fd_out, self.stdout = _pipe_end(stdout, True, text)
        if stderr == subprocess.STDOUT:
            fd_err, self.stderr = os.dup(fd_out), None
        else:
            fd_err, self.stderr = _pipe_end(stderr, True, text)
        header = {"args": [str(a) for a in args], "env": dict(os.environ if env is None else env),
                  "cwd": str(cwd or os.getcwd())}
        if code is not None:
            header["exec"] = code
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(_Server.get().path)
            socket.send_fds(self._conn, [json.dumps(header).encode()], [fd_in, fd_out, fd_err])
        finally:
            for fd in (fd_in, fd_out, fd_err):
                os.close(fd)
        self._buf = b""
        self.pid = int(self._line().split()[1])

    def _line(self, timeout: float | None = None) -> str | None:
        """The server's next line about this child; None when none came within the timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._conn.settimeout(left)
            try:
                chunk = self._conn.recv(256)
            except (TimeoutError, BlockingIOError):  # settimeout(0) makes the socket non-blocking
                return None
            if not chunk:
                raise RuntimeError("the test fork server went away")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(timeout=0)
            if line is not None:
                self.returncode = int(line.split()[1])
                self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout=timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(line.split()[1])
            self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        results: dict[str, Any] = {}

        def read(name: str, stream: Any) -> None:
            results[name] = stream.read()
            stream.close()

        readers = [threading.Thread(target=read, args=(n, s), daemon=True)
                   for n, s in (("out", self.stdout), ("err", self.stderr)) if s is not None and not s.closed]
        for thread in readers:
            thread.start()
        if self.stdin is not None:
            try:
                if input:
                    self.stdin.write(input)
                self.stdin.close()
            except BrokenPipeError:
                pass
        self.wait(timeout)
        for thread in readers:
            thread.join(timeout=30)
        return results.get("out"), results.get("err")

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None:
                stream.close()
        self.wait()


def worker_python() -> str:
    """The `python` of an execnet `popen` gateway spec that forks the shared server instead of starting an
    interpreter (tests/conftest.py gives it to the pytest-xdist workers): torch and the daemon are then imported
    once for every worker too (~11 s of CPU each on a 2-core machine). execnet appends `-u -c BOOTSTRAP`."""
    return f"{sys.executable} {Path(__file__).resolve()}"


def _exec_client(argv: list[str]) -> int:
    """`python zygote.py [-u] [-B] -c CODE [ARGS]`: CODE runs in a fork of the shared server with this process's
    stdin/stdout/stderr, environment and working directory; this process waits for it, passes it SIGTERM and
    SIGINT, and exits with its status."""
    while argv and argv[0] in ("-u", "-B"):
        argv = argv[1:]
    if len(argv) < 2 or argv[0] != "-c":
        raise SystemExit(f"usage: python {__file__} [-u] -c CODE [ARGS]")
    child = ForkedProcess(argv[2:], code=argv[1], stderr=sys.stderr)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda sig, _: child.send_signal(sig))
    return child.wait()


def cli_popen(args: list[str], **kwargs: Any) -> Any:
    """`basal-local ARGS` as its own process: forked from the server, or a fresh interpreter when disabled."""
    if ENABLED:
        return ForkedProcess(list(args), **kwargs)
    return subprocess.Popen([sys.executable, "-m", "basal_local.cli", *map(str, args)], **kwargs)


def cli_run(args: list[str], input: Any = None, capture_output: bool = False, text: bool = False,
            timeout: float | None = None, env: dict | None = None, cwd: Any = None,
            check: bool = False) -> subprocess.CompletedProcess:
    """subprocess.run for `basal-local ARGS` (the keyword arguments the tests use)."""
    if not ENABLED:
        return subprocess.run([sys.executable, "-m", "basal_local.cli", *map(str, args)], input=input,
                              capture_output=capture_output, text=text, timeout=timeout, env=env, cwd=cwd,
                              check=check)
    pipe = subprocess.PIPE if capture_output else None
    proc = ForkedProcess(list(args), env=env, cwd=cwd, stdin=subprocess.PIPE if input is not None else None,
                         stdout=pipe, stderr=pipe, text=text)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    status = _exec_client(sys.argv[1:])
    if status < 0:  # killed by a signal: end the same way
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)
