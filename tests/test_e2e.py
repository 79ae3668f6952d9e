"""End to end over a real socket: the daemon as a subprocess on a free port, checked against transformers.

The reference renders the prompts from docs/PROTOCOL.md and tokenizes them with `tokenizers` itself
(`tests/reference.py`), so a rendering or tokenization bug in the product cannot agree with itself.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from .conftest import Daemon, cli_run, http
from .hf_reference import HFModel
from .reference import TEMPS, ReferenceTokenizer, render

M = "basal-test-tiny"
STATE = {"zgłoszenie": "Paczka dotarła uszkodzona 🙁", "kwota": 129.99, "tagi": ["dostawa", None]}
QUESTIONS = {
    "kind": {"type": "choice", "instructions": "Jaki jest rodzaj zgłoszenia?",
             "criteria": {"damage": "Uszkodzenie", "late": "Opóźnienie", "other": None}},
    "urgent": {"type": "noul", "instructions": "Is it urgent?"},
    "level": {"type": "score", "instructions": "Priorytet?", "criteria": ["niski", {"p": "średni"}, ["wysoki"]]},
    "hidden": {"type": "choice", "option_keys": "hide", "criteria": {"0": "Refund", "1": "Repair"}},
}


def prompts_of(model_dir, body, dialect):
    out = cli_run(["prompts", "--model", str(model_dir),
                          "--dialect", dialect], input=json.dumps(body).encode(), capture_output=True, check=True)
    return json.loads(out.stdout)


def reference_question(tok: ReferenceTokenizer, state, question) -> list[dict]:
    """Both orders of a question as {prompt, input_ids, letter_ids}, all computed in the test."""
    _, prompts = render(state, question)
    n = 2 if question["type"] == "noul" else len(question["criteria"])
    return [{"prompt": p, "input_ids": tok.ids(p), "letter_ids": tok.letter_ids(p, n)} for p in prompts]


def reference_probabilities(hf, orders, qtype):
    """transformers logits at the last position + the protocol math written out again in numpy."""
    n = len(orders[0]["letter_ids"])
    p = np.zeros(n)
    for k, order in enumerate(orders):
        logits = hf.last_logits(order["input_ids"], order["letter_ids"]).astype(np.float64)
        q = np.exp(logits - logits.max())
        q /= q.sum()
        perm = np.arange(n) if k == 0 else np.arange(n)[::-1]
        p[perm] += q / len(orders)
    z = np.log(np.maximum(p, 1e-12)) / TEMPS[qtype]
    z = np.exp(z - z.max())
    return z / z.sum()


@pytest.mark.parametrize("dialect", ["systemone", "basal"])
def test_every_type_matches_independent_computation(daemon, tiny_model, dialect):
    hf = HFModel(tiny_model)
    body = {"model": M, "state": STATE, "questions": QUESTIONS}
    status, headers, out = http("POST", f"{daemon.url}/v1/{dialect}", body)
    assert status == 200, out
    assert out["model"] == M and list(out["answers"]) == list(QUESTIONS)
    tok = ReferenceTokenizer(tiny_model)
    reference = {qid: reference_question(tok, STATE, q) for qid, q in QUESTIONS.items()}
    # the product's own `prompts` command shows the same prompts, ids and letter ids
    shown = prompts_of(tiny_model, body, dialect)["questions"]
    assert {qid: [{k: o[k] for k in ("prompt", "input_ids", "letter_ids")} for o in shown[qid]["orders"]]
            for qid in QUESTIONS} == reference
    total_tokens = 0
    for qid, q in QUESTIONS.items():
        ref = reference_probabilities(hf, reference[qid], q["type"])
        total_tokens += sum(len(o["input_ids"]) for o in reference[qid])
        ans = out["answers"][qid]
        assert ans["type"] == q["type"]
        if q["type"] == "noul":
            assert abs(ans["noul"] - ref[0]) <= 1e-5
            if dialect == "basal":
                assert abs(ans["probabilities"]["true"] - ref[0]) <= 1e-5 and ans["confidence"] == max(
                    ans["probabilities"].values())
            else:
                assert set(ans) == {"type", "noul"}
            continue
        got = np.array(list(ans["probabilities"].values()))
        assert np.abs(got - ref).max() <= 1e-5
        n = len(ref)
        if q["type"] == "choice":
            assert ans["choice"] == list(ans["probabilities"])[int(np.argmax(got))]
            expected_conf = (got.max() - 1 / n) / (1 - 1 / n) if dialect == "systemone" else got.max()
        else:
            assert abs(ans["score"] - float(np.dot(np.arange(n), got))) <= 1e-12
            m = int(np.argmax(got))
            mad = np.abs(np.arange(n) - (n - 1) / 2).sum() / n
            expected_conf = max(0.0, 1 - float(np.dot(got, np.abs(np.arange(n) - m))) / mad) \
                if dialect == "systemone" else got.max()
            legend = ans["legend"]
            if dialect == "systemone":
                assert legend == {"0": "niski", "1": {"p": "średni"}, "2": ["wysoki"]}
            else:
                assert legend == {"0": "niski", "1": '{"p": "średni"}', "2": '["wysoki"]'}
        assert abs(ans["confidence"] - expected_conf) <= 1e-9
    assert out["usage"]["input_tokens"] == total_tokens
    assert out["usage"] | {"latency_ms": 0} == {"input_tokens": total_tokens, "output_tokens": 0, "questions": 4,
                                                "branches": 4, "latency_ms": 0}
    for name in ("x-basal-queue-ms", "x-basal-compute-ms"):
        whole, frac = headers[name].split(".")
        assert len(frac) == 3 and float(headers[name]) >= 0
    assert headers["x-basal-batch-requests"] == "1" and headers["x-request-id"]


def test_models_and_health(daemon):
    status, _, body = http("GET", daemon.url + "/v1/models")
    assert status == 200
    assert body == {"models": [{"name": M, "release_date": "2026-10-05",
                                "description": "basal typed-decision model (choice / noul / score / act / multi), "
                                               "Polish and English", "mode": "basal-local-torch-cpu",
                                "early_exit": [], "format": "bf16", "bits": 16, "dense_layers": [],
                                "quantization": {}, "calibration_file": "CALIBRATION.json",
                                "calibration_inherited": False}]}
    status, _, body = http("GET", daemon.url + "/health")
    assert status == 200
    from basal_local import __version__

    assert body == {"status": "ok", "version": __version__, "models": [M], "default_model": M, "backend": "torch",
                    "device": "cpu", "dtype": "f32",
                    "replicas": [{"model": M, "replica": 0, "device": "cpu", "alive": True, "state": "ready"}]}


def test_concurrent_clients_batch_and_answers_do_not_change(daemon):
    bodies = [{"model": M, "state": f"Ticket {i}: the parcel {'is late' if i % 2 else 'arrived broken'}.",
               "questions": {"q": {"type": "choice", "criteria": {"a": "Damage", "b": "Delay", "c": None}},
                             "n": {"type": "noul", "instructions": f"Urgent #{i % 3}?"}}} for i in range(32)]
    alone = [http("POST", daemon.url + "/v1/systemone", b)[2] for b in bodies]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda b: http("POST", daemon.url + "/v1/systemone", b), bodies * 2))
    sizes = [int(h["x-basal-batch-requests"]) for _, h, _ in together]
    assert max(sizes) > 1, sizes
    for i, (status, _, out) in enumerate(together):
        assert status == 200
        ref = alone[i % 32]["answers"]
        assert abs(out["answers"]["n"]["noul"] - ref["n"]["noul"]) <= 1e-6
        got = np.array(list(out["answers"]["q"]["probabilities"].values()))
        assert np.abs(got - np.array(list(ref["q"]["probabilities"].values()))).max() <= 1e-6
    status, _, stats = http("GET", daemon.url + "/api/stats")
    batched = [b for b in stats["batches"] if b["requests"] > 1]
    assert batched and all(b["packed_tokens"] < b["unpacked_tokens"] for b in batched)


def test_demo_command_answers_and_stops_cleanly(tmp_path):
    question = {"type": "choice", "criteria": {"damage": "Uszkodzenie", "late": "Opóźnienie"}}
    state = "Paczka dotarła uszkodzona."
    d = Daemon(["--demo"], env={"BASAL_LOCAL_HOME": str(tmp_path)})
    try:
        d.wait_ready(timeout=120)
        status, _, out = http("POST", d.url + "/v1/systemone",
                              {"model": "basal-demo", "state": state, "questions": {"kind": question}})
        assert status == 200
    finally:
        log = d.stop()
    assert d.proc.returncode == 0
    assert "RANDOM weights" in log and "curl" in log
    # the answer is the demo model's, computed independently from the directory it generated
    (demo,) = [p.parent for p in tmp_path.rglob("demo-model/basal.json")]
    hf = HFModel(demo)
    ref = reference_probabilities(hf, reference_question(ReferenceTokenizer(demo), state, question), "choice")
    ans = out["answers"]["kind"]
    assert np.abs(np.array([ans["probabilities"]["damage"], ans["probabilities"]["late"]]) - ref).max() <= 1e-5
    assert ans["choice"] == ("damage", "late")[int(np.argmax(ref))]


@pytest.mark.parametrize("key", [None, "s3cret-KEY"])
def test_the_printed_try_it_commands_work_as_printed(tmp_path, key):
    """Each command of the demo's "Try it" text, run by a shell as a user pastes it (with --api-key the key comes
    from BASAL_LOCAL_API_KEY, as the text says), answers; the key itself is never printed."""
    import subprocess
    import sys

    d = Daemon(["--demo", *(["--api-key", key] if key else [])], env={"BASAL_LOCAL_HOME": str(tmp_path)})
    try:
        d.wait_ready(timeout=120)
        text = d.log.split("Try it:", 1)[1].split("Stop with Ctrl-C.", 1)[0]
        commands = [c for c in text.split("\n\n") if c.strip()]
        commands[0] = commands[0].split("\n", 1)[1] if key else commands[0]  # after the line about the key
        assert len(commands) == 3, text
        env = {**os.environ, "BASAL_LOCAL_HOME": str(tmp_path),
               "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
        if key:
            env["BASAL_LOCAL_API_KEY"] = key
        for command in commands:
            done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and "Traceback" not in done.stderr, (command, done.stdout, done.stderr)
            assert "urgent" in done.stdout or "kind" in done.stdout or "noul" in done.stdout, done.stdout
    finally:
        log = d.stop()
    assert key is None or key not in log


def test_no_model_names_demo(tmp_path):
    out = cli_run(["serve"], capture_output=True, text=True,
                         env={"BASAL_LOCAL_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2
    assert "--demo" in out.stderr and "pull" in out.stderr


def test_prompts_cli_round_trip(tiny_model):
    body = {"model": M, "state": "Zażółć", "questions": {"n": {"type": "noul", "instructions": "Czy?"},
                                                         "one": {"type": "choice", "criteria": ["only"]}}}
    out = prompts_of(tiny_model, body, "systemone")
    assert out["language"] == "pl"
    n = out["questions"]["n"]
    assert n["type"] == "noul" and len(n["orders"]) == 2 and out["questions"]["one"]["orders"] == []
    tok = ReferenceTokenizer(tiny_model)
    reference = reference_question(tok, body["state"], body["questions"]["n"])
    assert [{k: o[k] for k in ("prompt", "input_ids", "letter_ids")} for o in n["orders"]] == reference
    assert "A. Tak\nB. Nie" in reference[0]["prompt"] and "A. Nie\nB. Tak" in reference[1]["prompt"]
    assert all(o["input_ids"][:2] == [1, 3] for o in reference)
    bad = cli_run(["prompts", "--model", str(tiny_model)],
                         input=b'{"model": "basal-test-tiny", "state": 1}', capture_output=True)
    assert bad.returncode == 2 and b"the daemon would answer this request HTTP 422 with the body above" in bad.stderr
    assert json.loads(bad.stdout)["detail"][0]["loc"] == ["body", "state", "str"]
    tree = cli_run(["prompts", "--model", str(tiny_model), "--tree"],
                          input=json.dumps(body), capture_output=True, check=True, text=True).stdout
    # the two orders share every token up to where their option lists differ: one shared block, two leaves
    ids = [o["input_ids"] for o in reference]
    common = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert f"vs {len(ids[0]) + len(ids[1])} unpacked" in tree
    blocks = [tuple(int(x) for x in m) for m in re.findall(r"block \d+: (\d+) tok @pos (\d+)", tree)]
    packed = int(re.search(r"(\d+) packed tokens", tree).group(1))
    assert sum(n_tok for n_tok, _ in blocks) == packed
    for k in (0, 1):
        (line,) = [x for x in tree.splitlines() if x.endswith(f"-> prompts [{k}]")]
        n_tok, pos = (int(x) for x in re.search(r"(\d+) tok @pos (\d+)", line).groups())
        assert (n_tok, pos) == (len(ids[k]) - common, common)


def test_headers_match_the_stats_endpoint(daemon):
    ids = []
    for i in range(3):
        status, headers, _ = http("POST", daemon.url + "/v1/basal",
                                  {"state": f"s{i}", "questions": {"n": {"type": "noul", "instructions": "i"}}},
                                  headers={"x-request-id": f"hdr-{i}"})
        assert status == 200 and headers["x-request-id"] == f"hdr-{i}"
        ids.append(headers)
    # an id too long (or not printable ASCII) to echo is replaced by one of ours, on the answer and on a 404
    for sent in ("x" * 70_000, "tab\there", "ünï"):
        for path in ("/v1/basal", "/nope"):
            status, headers, _ = http("POST", daemon.url + path, {"state": "s", "questions": {}},
                                      headers={"x-request-id": sent})
            assert headers["x-request-id"] != sent and 0 < len(headers["x-request-id"]) <= 128, path
    _, _, stats = http("GET", daemon.url + "/api/stats")
    by_id = {r["id"]: r for r in stats["requests"]}
    for i, headers in enumerate(ids):
        record = by_id[f"hdr-{i}"]
        assert f"{record['queue_ms']:.3f}" == headers["x-basal-queue-ms"]
        assert f"{record['compute_ms']:.3f}" == headers["x-basal-compute-ms"]
        assert str(record["batch_requests"]) == headers["x-basal-batch-requests"]
        batch = next(b for b in stats["batches"] if b["batch_id"] == record["batch_id"])
        assert batch["requests"] == record["batch_requests"] and batch["compute_ms"] == record["compute_ms"]


def test_two_models_in_one_process(tiny_model, tmp_path):
    from basal_local.model.testmodel import make_test_model

    other = make_test_model(tmp_path / "other", preset="tiny", seed=5, name="other-model")
    d = Daemon(["--model", str(tiny_model), "--model", str(other), "--default-model", "other-model",
                "--device", "cpu"])
    try:
        d.wait_ready()
        _, _, health = http("GET", d.url + "/health")
        assert health["models"] == [M, "other-model"] and health["default_model"] == "other-model"
        body = {"state": "s", "questions": {"n": {"type": "noul", "instructions": "Is it?"}}}
        a = http("POST", d.url + "/v1/systemone", {**body, "model": M})[2]
        b = http("POST", d.url + "/v1/systemone", {**body, "model": "other-model"})[2]
        default = http("POST", d.url + "/v1/basal", body)[2]
        assert (a["model"], b["model"], default["model"]) == (M, "other-model", "other-model")
        assert a["answers"]["n"]["noul"] != b["answers"]["n"]["noul"]  # different weights, different answers
        assert default["answers"]["n"]["noul"] == b["answers"]["n"]["noul"]
    finally:
        d.stop()


def test_bench_command_in_process_and_http(daemon, tiny_model):
    out = cli_run(["bench", "--model", str(tiny_model), "--device", "cpu", "--decisions", "20", "--json"],
                  capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["decisions"] == 20 and result["single_ms"]["median"] > 0 < result["single_forward_ms"]["median"]
    assert result["throughput"]["batch32"]["packed_tokens"] < result["throughput"]["batch32"]["unpacked_tokens"]
    assert all(result["throughput"][b]["forward_only_decisions_per_s"] > 0 for b in ("batch16", "batch32"))
    out = cli_run(["bench", "--http", daemon.url, "--clients", "8",
                          "--requests", "40", "--json"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["requests"] == 40 and result["errors"] == 0 and result["req_per_s"] > 0
    assert result["latency_ms"]["p50"] <= result["latency_ms"]["p99"]
    # the slowest 1 % (of 40: one) with the daemon's own queue and compute times
    (slow,) = result["slowest"]
    assert slow["latency_ms"] >= result["latency_ms"]["p99"] - 1e-6
    assert slow["queue_ms"] >= 0 and slow["compute_ms"] > 0 and slow["batch_requests"] >= 1
    assert slow["queue_ms"] + slow["compute_ms"] <= slow["latency_ms"] + 1


def test_access_log_line(tiny_model):
    d = Daemon(["--model", str(tiny_model), "--device", "cpu", "--access-log"])
    try:
        d.wait_ready()
        assert http("POST", d.url + "/v1/basal", {"state": "s", "questions": {"n": {"type": "noul"}}})[0] == 200
    finally:
        log = d.stop()
    line = next(x for x in log.splitlines() if "[POST]" in x)
    assert "[POST] 200 /v1/basal" in line and "(queue " in line and "batch 1)" in line
