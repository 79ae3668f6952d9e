"""Models at run time (server/models.py): load and unload without a restart, the keep-alive unload, a request for
an unloaded model, `basal-local load|unload|ps` with replica processes, and an unloaded engine really dropped."""

from __future__ import annotations

import gc
import os
import time
import weakref
from pathlib import Path

import pytest

from .conftest import Daemon, http
from .test_cli import assert_user_error, cli


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out waiting"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def second_model(tmp_path_factory) -> Path:
    from basal_local.model.testmodel import make_test_model

    return make_test_model(tmp_path_factory.mktemp("second"), preset="tiny", seed=3, name="second")


@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    """Two replicas of the tiny model, each in its own worker process."""
    root = tmp_path_factory.mktemp("models-home")
    d = Daemon(["--model", str(tiny_model), "--device", "cpu", "--replicas", "2", "--replica-processes"],
               env={"BASAL_LOCAL_HOME": str(root), "BASAL_LOCAL_API_KEY": ""})
    d.wait_ready(timeout=300)
    yield d
    d.stop()


def _states(live) -> dict[str, dict]:
    return {m["name"]: m for m in http("GET", live.url + "/api/stats")[2]["model_states"]}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


QUESTION = {"state": "The parcel arrived broken.", "questions": {"q": {"type": "noul", "instructions": "Urgent?"}}}


def test_ps_shows_each_worker_process_with_its_weights(live, home):
    status, _, info = http("GET", live.url + "/api/ps")
    assert status == 200
    (model,) = info["models"]
    assert model["status"] == "loaded" and model["weights_bytes"] > 0  # before any request has run
    pids = [r["pid"] for r in model["replicas"]]
    assert [r["replica"] for r in model["replicas"]] == [0, 1] and len(set(pids)) == 2
    assert info["pid"] not in pids and all(_alive(p) for p in pids)
    for r in model["replicas"]:
        assert r["worker_process"] and r["device"] == "cpu" and r["state"] == "ready"
        assert r["weights_bytes"] > 0 and r["process_rss_bytes"] > 0
    # the model's figure is what its replicas hold together (it was the first one's)
    assert model["weights_bytes"] == sum(r["weights_bytes"] for r in model["replicas"])
    done = cli("ps", "--url", live.url, env=home)
    assert done.returncode == 0, done.stderr
    for r in model["replicas"]:
        assert f"replica {r['replica']}: pid {r['pid']} (worker process), cpu, ready" in done.stdout, done.stdout
    assert "WEIGHTS" in done.stdout and " 0 B " not in done.stdout


def test_load_answer_unload_and_a_request_loads_it_again(live, home, second_model):
    done = cli("load", str(second_model), "--url", live.url, env=home)
    assert done.returncode == 0 and "second is loaded" in done.stdout, done.stderr
    status, _, body = http("POST", live.url + "/v1/basal", {**QUESTION, "model": "second"})
    assert status == 200 and body["model"] == "second"
    (entry,) = [m for m in http("GET", live.url + "/api/ps")[2]["models"] if m["name"] == "second"]
    workers = [r["pid"] for r in entry["replicas"]]
    assert len(workers) == 2 and all(_alive(p) for p in workers)
    done = cli("unload", "second", "--url", live.url, env=home)
    assert done.returncode == 0 and "second is unloaded" in done.stdout, done.stderr
    _wait_for(lambda: not any(_alive(p) for p in workers), timeout=30)  # its processes and memory are gone
    (entry,) = [m for m in http("GET", live.url + "/api/ps")[2]["models"] if m["name"] == "second"]
    assert entry["status"] == "unloaded" and entry["replicas"] == []
    assert "second" not in http("GET", live.url + "/health")[2]["models"]
    # a request for it: the dialect's 503 with Retry-After while it loads, then the answer
    status, headers, body = http("POST", live.url + "/v1/systemone", {**QUESTION, "model": "second"})
    assert status == 503 and int(headers["retry-after"]) >= 1
    assert body == {"detail": {"error_type": "unavailable_error",
                               "message": "model second is loading; retry in a few seconds"}}

    def answered() -> bool:
        return http("POST", live.url + "/v1/basal", {**QUESTION, "model": "second"})[0] == 200

    _wait_for(answered, timeout=120)
    # the other model was served throughout
    assert http("POST", live.url + "/v1/basal", QUESTION)[0] == 200
    assert http("POST", live.url + "/v1/basal", {**QUESTION, "model": "never-heard-of"})[2] == \
        {"error": "Unknown model: never-heard-of"}


def test_keep_alive_unloads_an_idle_model(live, home, second_model):
    assert cli("load", str(second_model), "--keep-alive", "1s", "--url", live.url, env=home).returncode == 0
    assert _states(live)["second"]["keep_alive_s"] == 1.0
    _wait_for(lambda: _states(live)["second"]["status"] == "unloaded", timeout=60)
    status, _, stats = http("GET", live.url + "/api/stats")
    first = stats["model_states"][0]
    assert first["status"] == "loaded" and first["keep_alive_s"] is None and first["expires_in_s"] is None
    done = cli("ps", "--url", live.url, env=home)
    second = next(line for line in done.stdout.splitlines() if line.startswith("second "))
    assert second.split()[:2] == ["second", "unloaded"]
    # a per-model keep-alive shows as the time left
    assert cli("load", "second", "--keep-alive", "1h", "--url", live.url, env=home).returncode == 0
    again = cli("load", "second", "--keep-alive", "1h", "--url", live.url, env=home)
    assert again.returncode == 0 and "second is loaded; stays until it has been idle 60 min" in again.stdout
    state = _states(live)["second"]
    assert state["status"] == "loaded" and 3590 <= state["expires_in_s"] <= 3600
    assert "in 60 min" in cli("ps", "--url", live.url, env=home).stdout


@pytest.mark.parametrize("path, body, status, expected", [
    ("/api/load", {"model": "no-such-model-anywhere"}, 404, "MODEL_NOT_FOUND"),
    ("/api/load", {"model": "second", "keep_alive": "soon"}, 422, "INVALID_KEEP_ALIVE"),
    ("/api/load", {"model": ""}, 422, "MODEL_REQUIRED"),
    ("/api/load", {"model": "second", "colour": 1}, 422, "UNKNOWN_FIELD"),
    ("/api/load", {"model": "second", "wait": "yes"}, 422, "INVALID_WAIT"),
    ("/api/unload", {"model": "zzz"}, 404, "MODEL_NOT_FOUND"),
    ("/api/unload", ["second"], 422, "MODEL_REQUIRED"),
    pytest.param("/api/load", "[" * 100_000 + "]" * 100_000, 400, "INVALID_JSON", id="load-nested-too-deeply"),
    pytest.param("/api/unload", "[" * 100_000 + "]" * 100_000, 400, "INVALID_JSON", id="unload-nested-too-deeply"),
])
def test_bad_load_and_unload_bodies(live, path, body, status, expected):
    import json

    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    got, _, answer = http("POST", live.url + path, raw, {"content-type": "application/json"})
    assert (got, answer["code"]) == (status, expected), answer
    assert isinstance(answer["error"], str) and answer["error"]


def test_load_and_unload_mistakes_are_two_lines(live, home):
    assert_user_error(cli("load", "no-such-model-anywhere", "--url", live.url, env=home), "404", "basal-local list")
    assert_user_error(cli("load", "second", "--keep-alive", "soon", "--url", live.url, env=home),
                      "not a duration", "--keep-alive 10m")
    assert_user_error(cli("unload", "zzz", "--url", live.url, env=home), "no model named 'zzz'")
    dead = f"http://127.0.0.1:{live.port + 1 if live.port < 65535 else 1}"
    assert_user_error(cli("load", "mini", "--url", dead, env=home), "cannot reach")


@pytest.mark.parametrize("text, seconds", [("10m", 600.0), ("1h30m", 5400.0), ("90s", 90.0), ("600", 600.0),
                                           (45, 45.0), (0, 0.0), ("forever", None), (-1, None), (None, None),
                                           (float("inf"), None), ("1e400", None), (1e300, 1e300)])
def test_keep_alive_durations(text, seconds):
    from basal_local.declare import parse_keep_alive

    assert parse_keep_alive(text) == seconds


@pytest.mark.parametrize("text", ["soon", "-5", "10x", "", True, float("nan")])
def test_keep_alive_refuses_what_is_not_a_duration(text):
    from basal_local.declare import parse_keep_alive

    with pytest.raises(ValueError):
        parse_keep_alive(text)


def test_an_unloaded_engine_is_dropped_whole(tiny_model, second_model):
    """Nothing keeps an unloaded model's engine or backend alive (so whatever it caches goes with it), even after
    the daemon froze its heap at start; the memory probe moves to a model still loaded."""
    from basal_local.server.daemon import Loader
    from basal_local.server.models import ModelRegistry
    from basal_local.server.state import AppState
    from basal_local.settings import Settings

    state = AppState()
    settings = Settings.load({"device": "cpu"}, config_file=Path("/nonexistent"))
    loader = Loader(state, settings)
    state.models = ModelRegistry(state, loader, None, frozen=True)
    first = loader(tiny_model)
    state.engines = {first.model.name: first}
    state.models.loaded_at_start(first)
    gc.freeze()
    try:
        name = state.models.add(second_model)
        state.models.load(name).join(60)
        engine = state.engines[name]
        assert state.telemetry.memory_probe.__self__ is engine
        refs = [weakref.ref(engine), weakref.ref(engine.backend)]
        del engine
        state.models.unload(name).join(60)
        gc.collect()
        assert [r() for r in refs] == [None, None]
        assert state.telemetry.memory_probe.__self__ is first
        assert state.models.entries[name].status == "unloaded"
    finally:
        gc.unfreeze()
        for e in state.engines.values():
            e.stop(5)
    assert os.getpid()  # the test ran in this process: no daemon to stop


def test_ask_waits_while_the_daemon_loads_the_model_it_names(live, home, second_model):
    assert cli("load", str(second_model), "--url", live.url, env=home).returncode == 0
    assert cli("unload", "second", "--url", live.url, env=home).returncode == 0
    done = cli("ask", "--url", live.url, "--model", "second", "--state", "x", "--noul", "ok?", env=home)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "basal-local: model second is loading; waiting for it (Ctrl-C stops)"
    assert "model second" in done.stdout


def test_bench_http_loads_an_unloaded_default_model_first(live, home):
    import json

    default = next(m["name"] for m in http("GET", live.url + "/api/ps")[2]["models"] if m["default"])
    assert cli("unload", default, "--url", live.url, env=home).returncode == 0
    # still listed: a request for it loads it
    assert default in [m["name"] for m in http("GET", live.url + "/v1/models")[2]["models"]]
    assert default not in http("GET", live.url + "/health")[2]["models"]
    done = cli("bench", "--http", live.url, "--requests", "4", "--json", env=home)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["requests"] == 4 and json.loads(done.stdout)["errors"] == 0
    assert f"loading {default} first (it is unloaded)" in done.stderr


def test_each_change_of_state_is_an_event(live, home, second_model):
    """The dashboard's stream carries model_loading, model_loaded, model_unloading, model_unloaded in order."""
    import json
    import socket

    assert cli("load", str(second_model), "--url", live.url, env=home).returncode == 0
    assert cli("unload", "second", "--url", live.url, env=home).returncode == 0
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=10)
    sock.sendall(f"GET /api/events?since=0 HTTP/1.1\r\nHost: 127.0.0.1:{live.port}\r\n\r\n".encode())
    data = b""
    deadline = time.time() + 20
    while b'"model_unloaded"' not in data.split(b'"model_loaded"')[-1] and time.time() < deadline:
        data += sock.recv(65536)
    sock.close()
    events = [json.loads(line[6:]) for line in data.decode("utf-8", "replace").splitlines()
              if line.startswith("data: {") and '"model_' in line]
    kinds = [e["kind"] for e in events if e.get("model") == "second"]
    last = len(kinds) - 1 - kinds[::-1].index("model_loading")
    assert kinds[last:last + 4] == ["model_loading", "model_loaded", "model_unloading", "model_unloaded"], kinds
    loaded = next(e for e in events[::-1] if e["kind"] == "model_loaded" and e["model"] == "second")
    assert loaded["load_s"] > 0


def test_run_goes_on_through_an_unload_in_the_middle(live, home, tmp_path):
    """`basal-local run` while its model is unloaded mid-way: requests in flight finish, later ones wait for the
    reload (503s retried), nothing fails."""
    import json
    import threading

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"state": f"m{i}", "question": "urgent?"}) + "\n" for i in range(150)))
    default = next(m["name"] for m in http("GET", live.url + "/api/ps")[2]["models"] if m["default"])
    if _states(live)[default]["status"] != "loaded":
        assert cli("load", default, "--url", live.url, env=home).returncode == 0
    result = {}
    runner = threading.Thread(target=lambda: result.update(done=cli("run", "--url", live.url, "--input", str(src),
                                                                    "--output", str(out), env=home)))
    runner.start()
    _wait_for(lambda: out.exists() and len(out.read_text().splitlines()) >= 20, timeout=120)
    status, _, answer = http("POST", live.url + "/api/unload", {"model": default, "wait": True})
    assert status == 200 and answer["unloaded"], answer
    runner.join(300)
    done = result["done"]
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 150 and all(r["status"] == 200 for r in rows)


def test_a_request_planned_while_its_model_unloads_gets_a_retryable_503(tiny_model):
    """The unload's grace can end while a long request is still being planned: its submit then meets a stopped
    engine, and the answer is the 503 to retry (the model loads again), never a 500."""
    from litestar.testing import TestClient

    from basal_local.server.app import create_app
    from basal_local.server.daemon import load_engines
    from basal_local.server.state import AppState
    from basal_local.settings import Settings

    settings = Settings.load({"device": "cpu"}, config_file=Path("/nonexistent"))
    state = AppState()
    load_engines(state, settings, [tiny_model])
    assert state.ready, state.load_error
    name = next(iter(state.engines))
    engine = state.engines[name]
    real_plan = engine.plan

    def plan_slowly(request):
        state.models.unload(name).join(60)  # the whole unload happens while this request plans
        return real_plan(request)

    engine.plan = plan_slowly
    del engine
    try:
        with TestClient(create_app(state)) as client:
            resp = client.post("/v1/basal", json=QUESTION)
            assert resp.status_code == 503 and resp.headers["retry-after"], resp.text
            assert resp.json()["error"].startswith(f"model {name} is ")
            _wait_for(lambda: client.post("/v1/basal", json=QUESTION).status_code == 200, timeout=60)
    finally:
        for e in state.engines.values():
            e.stop(5)
        state.models.stop()


def test_health_is_not_ok_while_nothing_serves_and_a_load_failed(tiny_model, tmp_path):
    """The only model unloaded, then its load failed (a truncated weights file): /health said 200 "ok" while every
    decision got 503. It is 503 "error" with the reason until a load succeeds."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    d = Daemon(["--model", str(model), "--device", "cpu"], env={"BASAL_LOCAL_HOME": str(tmp_path / "home")})
    try:
        d.wait_ready()
        name = http("GET", d.url + "/v1/models")[2]["models"][0]["name"]
        post = lambda path, body: http("POST", d.url + path, json.dumps(body).encode(),  # noqa: E731
                                       {"content-type": "application/json"})
        assert post("/api/unload", {"model": name, "wait": True})[0] == 200
        assert http("GET", d.url + "/health")[0] == 200  # unloaded by hand: it loads again on demand
        weights = model / "model.safetensors"
        kept = weights.read_bytes()
        weights.write_bytes(kept[:1000])
        assert post("/api/load", {"model": name, "wait": True})[0] == 500
        status, headers, body = http("GET", d.url + "/health")
        assert (status, body["status"], headers.get("retry-after")) == (503, "error", "5"), body
        assert f"model {name} failed to load" in body["error"]
        weights.write_bytes(kept)
        assert post("/api/load", {"model": name, "wait": True})[0] == 200
        assert http("GET", d.url + "/health")[2]["status"] == "ok"
    finally:
        d.stop()
