"""The Batch and Files API with the published basal-client (sync and async) against a live daemon: results in
input order equal to the interactive answers, malformed lines in the error file, cancel, a restart mid-batch,
expiry, limits; and the scheduler's background class."""

from __future__ import annotations

import asyncio
import json
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

from basal_local.engine.packer import PromptSpec
from basal_local.engine.scheduler import Job, form_batch

from . import rawhttp
from .conftest import Daemon, cli_run

pytestmark = pytest.mark.skipif(not find_spec("basal_client"), reason="basal-client is in the test extra")

STATES = ["The service is down since the morning.", "Please send me the invoice for March.",
          "Paczka przyszła uszkodzona, proszę o zwrot.", "Thank you, everything works now."]


def _line(i: int, state: str) -> dict:
    return {"custom_id": f"t-{i}", "method": "POST", "url": "/v1/basal",
            "body": {"state": state, "questions": {"urgent": {"type": "noul", "instructions": "Is this urgent?"},
                                                   "kind": {"type": "choice", "instructions": "Kind?",
                                                            "criteria": {"bug": "A fault", "admin": "Paperwork"}}}}}


def same_answers(a: dict, b: dict) -> None:
    """The CPU contract: a prompt's probabilities within 1e-6 alone and in any batch; the same decision."""
    assert a.keys() == b.keys()
    for qid in a:
        assert a[qid].get("choice") == b[qid].get("choice")
        for key, p in a[qid]["probabilities"].items():
            assert abs(p - b[qid]["probabilities"][key]) <= 1e-6, (qid, key)


def _jsonl(lines: list) -> bytes:
    return "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode()


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("batch-home")


@pytest.fixture(scope="module")
def served(tiny_model, home):
    d = Daemon(["--model", str(tiny_model), "--device", "cpu"], env={"BASAL_LOCAL_HOME": str(home)})
    d.wait_ready(timeout=600)
    yield d
    d.stop()


def test_a_batch_answers_every_line_in_input_order_as_the_interactive_api(served):
    from basal_client import BasalClient

    lines = [_line(i, s) for i, s in enumerate(STATES * 3)]
    with BasalClient(served.url) as client:
        batch = client.batches.create(requests=lines, metadata={"who": "test"})
        assert batch["status"] in ("validating", "in_progress", "finalizing", "completed")
        done = client.batches.wait(batch["id"], timeout=240, poll_interval=0.2)
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
        assert done["metadata"] == {"who": "test"} and done["error_file_id"] is None
        results = list(client.batches.results(batch["id"]))
        assert [r["custom_id"] for r in results] == [x["custom_id"] for x in lines]
        for line, result in zip(lines, results):
            assert result["response"]["status_code"] == 200 and result["error"] is None
            same_answers(result["response"]["body"]["answers"], client.decide(line["body"])["answers"])
        listed = client.batches.list(limit=100)
        assert batch["id"] in [b["id"] for b in listed["data"]]
        output = client.files.retrieve(done["output_file_id"])
        assert output["purpose"] == "batch_output" and output["bytes"] > 0


def test_malformed_lines_are_errors_with_their_line_numbers(served):
    from basal_client import BasalClient

    raw = (_jsonl([_line(0, STATES[0])]) + b"not json\n" + _jsonl([{"custom_id": "x", "url": "/v1/systemone",
                                                                     "body": {}}])
           + _jsonl([_line(0, STATES[1])])  # a custom_id used twice
           + _jsonl([{"custom_id": "bad-q", "body": {"state": "x", "questions": {"q": {"type": "choice",
                                                                                         "criteria": []}}}}]))
    with BasalClient(served.url) as client:
        file = client.files.create(raw, filename="mixed.jsonl")
        batch = client.batches.create(input_file_id=file["id"])
        done = client.batches.wait(batch["id"], timeout=240, poll_interval=0.2)
        assert done["status"] == "completed"
        assert done["request_counts"] == {"total": 5, "completed": 1, "failed": 4}
        assert [e["line"] for e in done["errors"]["data"]] == [2, 3, 4]
        errors = [json.loads(x) for x in client.files.content(done["error_file_id"]).splitlines()]
        assert [e["custom_id"] for e in errors] == ["line-2", "x", "t-0", "bad-q"]
        assert errors[0]["error"]["message"] == "line 2: the line is not valid JSON"
        assert errors[1]["error"]["message"] == "line 3: url must be /v1/basal (the batch's endpoint)"
        assert errors[2]["error"]["message"] == "line 4: custom_id t-0 is used by an earlier line"
        # a line the daemon refuses keeps the dialect's own answer: 422 with its body
        assert errors[3]["response"]["status_code"] == 422 and "error" in errors[3]["response"]["body"]


def test_hostile_lines_fail_alone_and_the_good_lines_are_answered(served):
    """A line nested 100,000 deep, a lone surrogate in a body's state and one in a custom_id (all valid JSON
    grammar) between good lines: each fails alone with its reason; the batch completes, the good lines answered."""
    from basal_client import BasalClient

    good = [_line(i, STATES[i]) for i in range(3)]
    deep = b'{"custom_id": "deep", "body": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    surrogate = (b'{"custom_id": "sur", "body": {"state": "\\ud800 broken", "questions": {"q": {"type": "noul", '
                 b'"instructions": "x"}}}}\n')
    bad_id = b'{"custom_id": "\\udc00", "body": {"state": "x", "questions": {}}}\n'
    raw = _jsonl(good[:1]) + deep + _jsonl(good[1:2]) + surrogate + bad_id + _jsonl(good[2:])
    with BasalClient(served.url) as client:
        interactive = rawhttp.post(served.port, "/v1/basal", surrogate[surrogate.index(b'{"state"'):-2])
        file = client.files.create(raw, filename="hostile.jsonl")
        done = client.batches.wait(client.batches.create(input_file_id=file["id"])["id"], timeout=240,
                                   poll_interval=0.2)
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 6, "completed": 3, "failed": 3}
        results = list(client.batches.results(done["id"]))
        assert [r["custom_id"] for r in results if r["error"] is None and r["response"]["status_code"] == 200] \
            == ["t-0", "t-1", "t-2"]
        errors = {e["custom_id"]: e for e in map(json.loads, client.files.content(done["error_file_id"]).splitlines())}
    assert errors["line-2"]["error"]["message"] == "line 2: the line's JSON is nested too deeply"
    assert errors["line-5"]["error"]["message"] == "line 5: custom_id must be a non-empty string of Unicode text"
    # the lone surrogate reaches the handler as an HTTP client would send it, and gets that client's answer
    assert (errors["sur"]["response"]["status_code"], errors["sur"]["response"]["body"]) == interactive[::2]
    assert interactive[0] == 422


def test_async_client_files_and_cancel(served):
    from basal_client import AsyncBasalClient

    async def main():
        async with AsyncBasalClient(served.url) as client:
            file = await client.files.create(_jsonl([_line(i, STATES[i % 4]) for i in range(60)]))
            assert (await client.files.retrieve(file["id"]))["bytes"] == file["bytes"]
            batch = await client.batches.create(input_file_id=file["id"])
            cancelled = await client.batches.cancel(batch["id"])
            assert cancelled["status"] in ("cancelling", "cancelled")
            final = await client.batches.wait(batch["id"], timeout=120, poll_interval=0.2)
            assert final["status"] == "cancelled" and final["request_counts"]["completed"] < 60
            files = await client.files.list(purpose="batch", limit=100)
            assert file["id"] in [f["id"] for f in files["data"]]
            assert (await client.files.delete(file["id"]))["deleted"] is True
            return await client.batches.cancel(batch["id"])  # a terminal batch comes back unchanged

    assert asyncio.run(main())["status"] == "cancelled"


def test_bad_uploads_and_creates_get_clear_errors(served, home):
    from basal_client import BasalClient
    from basal_client.errors import BasalHTTPError

    with BasalClient(served.url) as client:
        with pytest.raises(BasalHTTPError) as err:
            client.files.create(b"x", expires_after={"anchor": "created_at", "seconds": 60})
        assert err.value.status_code == 400 and err.value.body["code"] == "INVALID_EXPIRY"
        with pytest.raises(BasalHTTPError) as err:
            client.batches.create(input_file_id="file-00ff")
        assert err.value.status_code == 404 and err.value.body == {"error": "no batch input file file-00ff",
                                                                   "code": "FILE_NOT_FOUND"}
        with pytest.raises(BasalHTTPError) as err:
            client.files.retrieve("../../etc")
        assert err.value.status_code == 404
    for path in ("/v1/files", "/v1/batches"):  # "²".isdigit() is true, int("²") fails; "٣" would read as 3
        for limit in ("%C2%B2", "%D9%A3", "1" * 5000, "0", "abc"):
            status, _, body = rawhttp.get(served.port, f"{path}?limit={limit}")
            assert (status, body["code"]) == (400, "INVALID_LIMIT"), (path, limit, body)
    for seconds in ("\u00b2", "9" * 5000, "-5"):  # sent as a client that does not check them would
        parts = [("purpose", None, "batch"), ("expires_after[anchor]", None, "created_at"),
                 ("expires_after[seconds]", None, seconds), ("file", "in.jsonl", "{}")]
        form = "".join(f'--XyZ\r\nContent-Disposition: form-data; name="{name}"'
                       + (f'; filename="{filename}"' if filename else "") + f"\r\n\r\n{value}\r\n"
                       for name, filename, value in parts) + "--XyZ--\r\n"
        status, _, body = rawhttp.post(served.port, "/v1/files", form.encode(),
                                       {"content-type": "multipart/form-data; boundary=XyZ"})
        assert (status, body["code"]) == (400, "INVALID_EXPIRY"), (seconds, body)
    status, _, body = rawhttp.post(served.port, "/v1/batches", b'{"input_file_id": ' + b"[" * 30000 + b"]" * 30000
                                   + b"}")
    assert (status, body) == (400, {"error": "the body's JSON is nested too deeply", "code": "INVALID_JSON"})
    assert not list(home.rglob("upload-*.part"))  # no refused upload stays behind
    raw = rawhttp.request_bytes("POST", "/v1/files", headers={"content-type": "multipart/form-data; boundary=b"},
                                content_length=300_000_000)
    status, _, body = rawhttp.exchange(served.port, raw)
    assert status == 413 and body["code"] == "FILE_TOO_LARGE"


def test_a_restart_mid_batch_resumes_and_loses_nothing(tiny_model, tmp_path):
    from basal_client import BasalClient

    lines = [_line(i, STATES[i % 4] + f" ({i})") for i in range(600)]  # minutes of work, stopped early
    env = {"BASAL_LOCAL_HOME": str(tmp_path)}
    first = Daemon(["--model", str(tiny_model), "--device", "cpu"], env=env)
    first.wait_ready(timeout=600)
    with BasalClient(first.url) as client:
        batch = client.batches.create(requests=lines)
        deadline = time.time() + 120
        while client.batches.retrieve(batch["id"])["request_counts"]["completed"] < 5 and time.time() < deadline:
            time.sleep(0.05)
    first.stop()
    counts = json.loads((tmp_path / "data" / "batches" / "batches" / f"{batch['id']}.json").read_text())
    assert counts["status"] == "in_progress" and 0 < counts["request_counts"]["completed"] < 600
    second = Daemon(["--model", str(tiny_model), "--device", "cpu"], env=env)
    second.wait_ready(timeout=600)
    try:
        with BasalClient(second.url) as client:
            done = client.batches.wait(batch["id"], timeout=400, poll_interval=0.5)
            assert done["status"] == "completed" and done["request_counts"]["completed"] == 600
            results = list(client.batches.results(batch["id"]))
            assert [r["custom_id"] for r in results] == [x["custom_id"] for x in lines]
            for line, result in list(zip(lines, results))[::50]:
                same_answers(result["response"]["body"]["answers"], client.decide(line["body"])["answers"])
    finally:
        second.stop()


async def _fake_app(scope, receive, send):
    """A stand-in for the daemon's app: every line answered 200 after a short compute."""
    await receive()
    await asyncio.sleep(0.01)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b'{"answers": {}}'})


def test_an_expired_batch_ends_with_the_rest_as_errors(tmp_path):
    from basal_local.batches.runner import Runner
    from basal_local.batches.store import Store

    store = Store(tmp_path)
    upload = store.upload_path()
    upload.write_bytes(_jsonl([_line(i, STATES[0]) for i in range(30)]))
    file = store.add_file(upload, "in.jsonl", "batch", None)
    batch = store.add_batch(file["id"], None, None)
    store.update_batch(batch["id"], expires_at=0)  # its 24 h window ran out before it started

    async def main():
        runner = Runner(store, _fake_app, concurrency=4)
        runner.start()
        deadline = time.time() + 30
        while store.batch(batch["id"])["status"] != "expired" and time.time() < deadline:
            await asyncio.sleep(0.02)
        await runner.stop()

    asyncio.run(main())
    done = store.batch(batch["id"])
    assert done["status"] == "expired" and done["expired_at"] is not None
    assert done["request_counts"] == {"total": 30, "completed": 0, "failed": 30}
    errors = [json.loads(x) for x in store.file_data(done["error_file_id"]).read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == [f"t-{i}" for i in range(30)]
    assert all(e["error"]["code"] == "batch_expired" and e["response"] is None for e in errors)


_fresh = iter(range(10_000, 10**9))


def _job(tokens: int, background: bool, arrival: float) -> Job:
    """A stand-in job: one prompt of `tokens` fresh token ids (it shares no prefix with another)."""
    ids = [next(_fresh) for _ in range(tokens)]
    return Job(None, tokens, [PromptSpec(ids, "en", [1, 2])], arrival=arrival, background=background)


def test_background_jobs_wait_for_interactive_ones_and_never_share_their_batch():
    old_batch = _job(10, True, 0.0)
    fresh = _job(10, False, 99.0)
    batch, rest = form_batch([old_batch, fresh], 8192, {"en": []}, "hrrn", rate=1000.0, now=100.0)
    assert batch == [fresh] and rest == [old_batch]  # however long the background job waited
    batch, rest = form_batch([old_batch, _job(10, True, 1.0)], 8192, {"en": []}, "fifo", rate=1000.0, now=100.0)
    assert len(batch) == 2 and rest == []  # alone, background jobs batch together


def test_the_batch_command_submits_follows_and_fetches(served, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl([_line(i, s) for i, s in enumerate(STATES)]))
    done = cli_run(["batch", "submit", str(src), "--wait", "--url", served.url, "--json"], capture_output=True,
                   text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    batch = json.loads(done.stdout.strip().splitlines()[-1])
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 4
    listed = cli_run(["batch", "list", "--url", served.url], capture_output=True, text=True, timeout=60)
    assert batch["id"] in listed.stdout
    out = tmp_path / "out.jsonl"
    got = cli_run(["batch", "results", batch["id"], "--url", served.url, "--output", str(out)], capture_output=True,
                  text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["t-0", "t-1", "t-2", "t-3"]
    missing = cli_run(["batch", "status", "batch_00ff", "--url", served.url], capture_output=True, text=True,
                      timeout=60)
    assert missing.returncode == 2 and "no batch batch_00ff (HTTP 404)" in missing.stderr
    assert "Traceback" not in missing.stderr
    # a file of bad lines only: the batch fails, and each command says why, once per line
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n{}\n")
    done = cli_run(["batch", "submit", str(bad), "--wait", "--url", served.url], capture_output=True, text=True,
                   timeout=240)
    assert done.returncode == 1 and "failed" in done.stdout, (done.stdout, done.stderr)
    assert "  line 1: the line is not valid JSON" in done.stderr and "line 1: line 1" not in done.stderr
    assert "  line 2: custom_id must be" in done.stderr
    batch_id = done.stderr.split()[1]  # "submitted ID (...)"
    status = cli_run(["batch", "status", batch_id, "--url", served.url], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "  line 1: the line is not valid JSON" in status.stderr
    results = cli_run(["batch", "results", batch_id, "--url", served.url], capture_output=True, text=True,
                      timeout=60)
    assert results.returncode != 0 and "Traceback" not in results.stderr
    assert f"batch {batch_id} failed without results: line 1: the line is not valid JSON" in results.stderr
    assert "no results yet" not in results.stderr and "submit it again" in results.stderr


def test_stats_show_a_running_batch(tiny_model, tmp_path):
    from basal_client import BasalClient

    from .conftest import http

    d = Daemon(["--model", str(tiny_model), "--device", "cpu"], env={"BASAL_LOCAL_HOME": str(tmp_path)})
    d.wait_ready(timeout=600)
    try:
        with BasalClient(d.url) as client:
            batch = client.batches.create(requests=[_line(i, STATES[i % 4] + str(i)) for i in range(400)])
            _, _, stats = http("GET", d.url + "/api/stats")
            running = [b for b in stats["batch_jobs"] if b["id"] == batch["id"]]
            assert running and running[0]["total"] in (0, 400) and running[0]["status"] != "completed"
            client.batches.wait(batch["id"], timeout=300, poll_interval=0.5)
        _, _, stats = http("GET", d.url + "/api/stats")
        assert stats["batch_jobs"] == []
    finally:
        d.stop()


def test_background_batches_hold_a_quarter_of_the_budget():
    jobs = [_job(100, True, float(i)) for i in range(40)]
    batch, rest = form_batch(jobs, 1000, {"en": []}, "fifo", rate=1000.0, now=100.0)
    assert sum(j.tokens for j in batch) == 200 and len(batch) + len(rest) == 40  # 1000 // 4 holds two
    interactive = [_job(100, False, float(i)) for i in range(40)]
    batch, _ = form_batch(interactive, 1000, {"en": []}, "fifo", rate=1000.0, now=100.0)
    assert sum(j.tokens for j in batch) == 1000


def _run_until(store, batch_id: str, statuses: tuple[str, ...]) -> dict:
    from basal_local.batches.runner import Runner

    async def main():
        runner = Runner(store, _fake_app, concurrency=4)
        runner.start()
        deadline = time.time() + 30
        while store.batch(batch_id)["status"] not in statuses and time.time() < deadline:
            await asyncio.sleep(0.02)
        await runner.stop()

    asyncio.run(main())
    return store.batch(batch_id)


def test_a_file_over_the_line_limit_fails_its_batch_with_the_reason(tmp_path, monkeypatch):
    from basal_local.batches import runner as runner_module
    from basal_local.batches.store import Store

    monkeypatch.setattr(runner_module, "MAX_LINES", 5)  # the limit's rule, on a small file
    store = Store(tmp_path)
    upload = store.upload_path()
    upload.write_bytes(_jsonl([_line(i, STATES[0]) for i in range(6)]))
    batch = store.add_batch(store.add_file(upload, "in.jsonl", "batch", None)["id"], None, None)
    done = _run_until(store, batch["id"], ("failed",))
    assert done["status"] == "failed" and done["failed_at"] is not None
    assert done["errors"]["data"][0]["code"] == "too_many_lines"
    assert done["errors"]["data"][0]["message"] == "the input file holds 6 lines; a batch takes at most 5"


def test_expired_files_are_gone(tmp_path):
    from basal_local.batches.store import Store

    store = Store(tmp_path)
    upload = store.upload_path()
    upload.write_bytes(b"{}\n")
    kept = store.add_file(upload, "a.jsonl", "batch", 3600)
    assert kept["expires_at"] == kept["created_at"] + 3600 and store.get_file(kept["id"]) == kept
    record = json.loads((tmp_path / "files" / f"{kept['id']}.json").read_text())
    record["expires_at"] = int(time.time()) - 1
    (tmp_path / "files" / f"{kept['id']}.json").write_text(json.dumps(record))
    assert store.get_file(kept["id"]) is None
    assert not (tmp_path / "files" / kept["id"]).exists()
    assert store.list_files(None, 20, None)["data"] == []
