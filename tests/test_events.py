"""Telemetry over real sockets: the event bus, `/api/events` (SSE), `/api/stats` counters, and the dashboard
attached headless to a live daemon (tiny generated model) under concurrent traffic."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from basal_local.telemetry import EventBus

from .conftest import free_port, http

M = "basal-test-tiny"


def body(i: int, questions: int = 2) -> dict:
    qs = {"kind": {"type": "choice", "instructions": "Rodzaj?", "criteria": {"a": "Szkoda", "b": "Zwłoka"}},
          "urgent": {"type": "noul", "instructions": f"Urgent #{i}?"}}
    return {"model": M, "state": f"Zgłoszenie {i}: paczka uszkodzona.", "questions": dict(list(qs.items())[:questions])}


DASHBOARD = {"x-basal-dashboard-token": "test-dashboard-token"}  # the daemon's own dashboards see the details


class LiveDaemon:
    """The app with the tiny model, served by uvicorn in a thread on a free port (stoppable, restartable)."""

    def __init__(self, model_dir: Path) -> None:
        from basal_local.server.app import AppState
        from basal_local.server.daemon import load_engines
        from basal_local.server.settings import Settings

        settings = Settings.load({"device": "cpu"}, config_file=Path("/nonexistent"))
        self.state = AppState(max_inflight=settings.max_inflight, dashboard_token="test-dashboard-token")
        load_engines(self.state, settings, [model_dir])
        assert self.state.ready, self.state.load_error
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = None
        self.thread = None

    def start(self) -> None:
        import uvicorn

        from basal_local.server.app import create_app

        # an SSE stream never ends by itself: at stop, uvicorn waits for it until its graceful-shutdown timeout
        # (the daemon sets one from --drain-s, at least 1 s; without one, stop() waited out its 20 s join)
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.state), host="127.0.0.1", port=self.port,
                                                    log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started and time.time() < deadline:
            time.sleep(0.01)
        assert self.server.started

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


@pytest.fixture(scope="module")
def live(tiny_model):
    d = LiveDaemon(tiny_model)
    d.start()
    yield d
    d.stop()
    for engine in d.state.engines.values():
        engine.stop()


class SseReader:
    """A raw-socket SSE client: reads `data:` lines into events on a thread."""

    def __init__(self, port: int, headers: str = "") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.sendall(f"GET /api/events HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n{headers}\r\n".encode())
        self.events: list[dict] = []
        self.head = b""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return
                buf += chunk
                if not self.head and b"\r\n\r\n" in buf:
                    self.head, buf = buf.split(b"\r\n\r\n", 1)
                for line in buf.split(b"\n")[:-1]:
                    # chunked transfer: size lines are hex without "data:"; only data lines matter here
                    if line.startswith(b"data: "):
                        self.events.append(json.loads(line[6:]))
                buf = buf.split(b"\n")[-1]
        except OSError:
            return

    def wait_for(self, predicate, timeout: float = 60) -> list[dict]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate(self.events):
                return self.events
            time.sleep(0.02)
        raise AssertionError(f"events never matched; got kinds {[e['kind'] for e in self.events][-40:]}")

    def close(self) -> None:
        self.sock.close()


def test_bus_never_blocks_and_a_slow_reader_loses_its_oldest():
    bus = EventBus(history=50)
    slow = bus.subscribe(max_queued=100)  # never drained
    started = time.perf_counter()
    for n in range(20000):
        bus.emit("x", n=n)
    assert time.perf_counter() - started < 5.0
    items, dropped = slow.drain()
    assert [e["n"] for e in items] == list(range(19900, 20000)) and dropped == 19900
    assert len(bus.history) == 50 and bus.history[-1]["seq"] == 20000
    late = bus.subscribe(since=19990)  # reconnect: the history after seq 19990 first
    assert [e["seq"] for e in late.drain()[0]] == list(range(19991, 20001))
    slow.close()
    late.close()
    assert bus.subscribers == 0


def test_batch_tree_json_is_the_packers_trie():
    from basal_local.engine.packer import PromptSpec, pack_prompts
    from basal_local.engine.pretty import batch_tree

    template, state_a, state_b = [1, 2, 3, 4], list(range(10, 30)), list(range(40, 55))
    q1, q2 = [100, 101, 102], [200, 201]
    specs, owners = [], []
    for rid, state in (("r1", state_a), ("r2", state_b)):
        for qid, q in (("q1", q1), ("q2", q2)):
            for order, tail in enumerate(([7, 8], [8, 7])):
                specs.append(PromptSpec(template + state + q + tail, "en", [7, 8]))
                owners.append((rid, qid, order, ""))
    pack = pack_prompts(specs, {"en": template})
    tree = batch_tree(pack.rows, owners)
    assert len(tree) == 1 and tree[0]["prefix"] == "en" and tree[0]["prefix_tokens"] == len(template)

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.get("children", []))

    nodes = list(walk(tree[0]["children"]))
    assert sum(n["tokens"] for n in nodes) == pack.packed_tokens == tree[0]["tokens"]
    # independent count: two states, two questions each, two 2-token order tails per question
    assert pack.packed_tokens == len(state_a) + len(state_b) + 2 * (len(q1) + len(q2)) + 8 * 2
    states = [n for n in nodes if n["kind"] == "state"]
    assert sorted(n["tokens"] for n in states) == [len(state_b), len(state_a)]
    leaves = [n for n in nodes if n["kind"] == "order"]
    assert sorted(tuple(o) for n in leaves for o in n["owners"]) == sorted(owners)
    assert all(n["tokens"] == 2 for n in leaves)


def _wait(predicate, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)


def test_trees_are_built_only_while_someone_listens(live):
    """No SSE subscriber: batches are recorded with their tree unbuilt (and the request details too). A subscriber
    gets every batch with its tree; /api/stats builds the unread ones it shows."""
    from basal_local.server.events import KEEPALIVE_S

    telemetry = live.state.telemetry
    # no reader listens: this test comes before the file's other readers, because a reader that left unseen is
    # only dropped at a failed write, and with no events that is a keepalive (every KEEPALIVE_S, 15 s): the first
    # write after a close may still succeed, the second fails (the wait below was up to 2 keepalives here)
    _wait(lambda: telemetry.bus.subscribers == 0, timeout=2 * KEEPALIVE_S + 15)
    built = telemetry.trees_built
    with ThreadPoolExecutor(4) as pool:
        quiet = list(pool.map(lambda i: http("POST", live.url + "/v1/systemone", body(i),
                                              headers={"x-request-id": f"quiet-{i}"}), range(4)))
    assert all(status == 200 for status, _, _ in quiet)
    quiet_batches = {r.batch_id for r in telemetry.batches if any(i.startswith("quiet-") for i in r.request_ids)}
    assert quiet_batches and telemetry.trees_built == built  # no tree built
    reader = SseReader(live.port)
    try:
        _wait(lambda: telemetry.bus.subscribers == 1)
        status, _, _ = http("POST", live.url + "/v1/systemone", body(7), headers={"x-request-id": "heard"})
        assert status == 200
        events = reader.wait_for(lambda ev: any(e["kind"] == "computed" and "heard" in e["request_ids"] for e in ev))
    finally:
        reader.close()
    computed = next(e for e in events if e["kind"] == "computed" and "heard" in e["request_ids"])
    assert sum(row["tokens"] for row in computed["tree"]) == computed["packed_tokens"] > 0
    assert telemetry.trees_built > built
    _, _, stats = http("GET", live.url + "/api/stats")
    for batch in stats["batches"]:
        if batch["batch_id"] in quiet_batches:  # built now, from the tries the record kept
            assert sum(row["tokens"] for row in batch["tree"]) == batch["packed_tokens"]
    detail = http("GET", live.url + "/api/requests/quiet-2", headers=DASHBOARD)[2]  # the details are built when asked, too
    assert [q["id"] for q in detail["asked"]] == ["kind", "urgent"] and set(detail["answers"]) == {"kind", "urgent"}


def test_sse_stream_and_counters_that_add_up(live):
    reader = SseReader(live.port)
    try:
        time.sleep(0.3)
        _, _, before = http("GET", live.url + "/api/stats")
        ids = [f"sse-{i}" for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: http("POST", live.url + "/v1/systemone", body(i),
                                                   headers={"x-request-id": ids[i], "user-agent": "typesafe-sdk/0.7.5"}),
                                     range(8)))
        assert all(status == 200 for status, _, _ in results)
        bad = http("POST", live.url + "/v1/systemone", {"model": M, "state": 1}, headers={"x-request-id": "sse-bad"})
        assert bad[0] == 422
        live.state.max_inflight = 0  # the next request is over the limit
        try:
            over = http("POST", live.url + "/v1/systemone", body(99), headers={"x-request-id": "sse-529"})
        finally:
            live.state.max_inflight = 1024
        assert over[0] == 529
        events = reader.wait_for(lambda ev: {"sse-bad", "sse-529"} <= {e.get("id") for e in ev if e["kind"] == "rejected"}
                                 and len([e for e in ev if e["kind"] == "answered"]) >= 8)
    finally:
        reader.close()
    assert b"text/event-stream" in reader.head
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    for rid in ids:
        kinds = [e["kind"] for e in events if e.get("id") == rid or rid in (e.get("request_ids") or [])]
        assert kinds == ["received", "planned", "queued", "batched", "computed", "answered"], (rid, kinds)
        answered = next(e for e in events if e["kind"] == "answered" and e["id"] == rid)
        assert answered["client"] == "typesafe-sdk/0.7.5" and answered["queue_ms"] >= 0 and "answers" not in answered
        computed = next(e for e in events if e["kind"] == "computed" and e["batch_id"] == answered["batch_id"])
        assert rid in computed["request_ids"] and computed["requests"] == answered["batch_requests"]
        assert sum(row["tokens"] for row in computed["tree"]) == computed["packed_tokens"]
        assert computed["packed_tokens"] < computed["unpacked_tokens"]
    statuses = {e["id"]: e["status"] for e in events if e["kind"] == "rejected"}
    assert statuses == {"sse-bad": 422, "sse-529": 529}
    _, _, after = http("GET", live.url + "/api/stats")
    t, b = after["totals"], before["totals"]
    assert t["received"] == t["answered"] + t["failed"] + t["rejected"] + t["overloaded"] + t["cancelled"] + t["in_flight"]
    assert (t["received"] - b["received"], t["answered"] - b["answered"], t["rejected"] - b["rejected"],
            t["overloaded"] - b["overloaded"], t["in_flight"]) == (10, 8, 1, 1, 0)
    assert after["version"] and after["backend"] == "torch" and after["device"] == "cpu" and after["dtype"] == "f32"
    assert after["models"][0]["name"] == M and after["limits"]["max_inflight"] == 1024
    assert after["percentiles"]["queue_ms"]["p50"] is not None and after["queues"][M]["main"]["waiting"] == 0
    detail = http("GET", live.url + "/api/requests/sse-3", headers=DASHBOARD)[2]
    assert [q["id"] for q in detail["asked"]] == ["kind", "urgent"] and set(detail["answers"]) == {"kind", "urgent"}
    assert "Zgłoszenie" not in json.dumps(detail, ensure_ascii=False)  # never the state text
    assert http("GET", live.url + "/api/requests/nope")[0] == 404


def test_reconnect_with_last_event_id_replays_what_was_missed(live):
    status, _, _ = http("POST", live.url + "/v1/basal", body(1, 1), headers={"x-request-id": "replay-1"})
    assert status == 200
    _, _, stats = http("GET", live.url + "/api/stats")
    seq = next(e["seq"] for e in live.state.telemetry.bus.history if e.get("id") == "replay-1")
    reader = SseReader(live.port, f"Last-Event-ID: {seq - 1}\r\n")
    try:
        events = reader.wait_for(lambda ev: any(e.get("id") == "replay-1" for e in ev))
    finally:
        reader.close()
    assert events[0]["seq"] == seq and events[-1]["seq"] <= stats["last_seq"] + 5


async def test_dashboard_attached_to_a_live_daemon(live, tiny_model):
    """The real client and app, headless: request ids, timings and batch trees with the daemon's token counts;
    then the daemon goes away ("DISCONNECTED") and comes back (reconnected)."""
    from basal_local.tui.app import DashboardApp
    from basal_local.tui.client import DaemonClient

    from .dashboard_canned import screen_text

    client = DaemonClient(live.url, stats_every_s=0.2, retry_s=0.2)
    app = DashboardApp(client, refresh_s=0.25)
    ids = [f"dash-{i}" for i in range(12)]
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(200):
            await pilot.pause(0.05)
            if app.data.connected:
                break
        assert app.data.connected
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(6) as pool:
            results = await asyncio.gather(*[loop.run_in_executor(pool, lambda i=i: http(
                "POST", live.url + "/v1/systemone", body(i), headers={"x-request-id": ids[i]})) for i in range(12)])
        assert all(r[0] == 200 for r in results)
        for _ in range(200):
            await pilot.pause(0.05)
            if all(app.data.requests.get(i, {}).get("status") == 200 for i in ids):
                break
        for i, (_, headers, _) in zip(ids, results):
            row = app.data.requests[i]
            assert f"{row['queue_ms']:.3f}" == headers["x-basal-queue-ms"]
            assert f"{row['compute_ms']:.3f}" == headers["x-basal-compute-ms"]
        await pilot.press("2")
        await pilot.pause(0.3)
        app.redraw(force=True)
        await pilot.pause()
        text = screen_text(app)
        assert sum(i in text for i in ids) >= 8  # the newest rows are on screen
        await pilot.press("3")
        await pilot.pause(0.3)
        tree = app.screen.query_one("#tree")
        batch = next(b for b in app.data.batches if b["batch_id"] == tree.shown)
        record = next(r for r in live.state.telemetry.batches if r.batch_id == batch["batch_id"])
        assert f"{record.packed_tokens:,}/{record.unpacked_tokens:,} tok" in tree.root.label.plain
        live.stop()
        for _ in range(200):
            await pilot.pause(0.05)
            if not app.data.connected:
                break
        app.redraw(force=True)
        await pilot.pause()
        assert "DISCONNECTED" in screen_text(app)
        live.start()
        for _ in range(200):
            await pilot.pause(0.05)
            if app.data.connected:
                break
        assert app.data.connected
        http("POST", live.url + "/v1/systemone", body(50), headers={"x-request-id": "after-restart"})
        for _ in range(200):
            await pilot.pause(0.05)
            if app.data.requests.get("after-restart", {}).get("status") == 200:
                break
        assert app.data.requests["after-restart"]["status"] == 200
    await client.aclose()
