"""Behaviours no other test protected (issue 30's planted bugs passed the suite): each test here fails on one.

act calibrated with its base's temperature; act `max_error` equality; evidence spans within their 80-token limit;
Host/Origin matched by exact name; bombs bounded while they stream; queue time ending when the batch starts.
"""

from __future__ import annotations

import gzip
import json
import math
import threading
import time

import numpy as np
import pytest

from basal_local.protocol.act import ActSpec, act_answer
from basal_local.protocol.evidence import select_spans

from . import rawhttp
from .test_reliability import PATHS, SMALL, d  # noqa: F401  (the session daemon)

M = "basal-test-tiny"
CRITERIA = {"yes": "Refund now", "no": "Refuse the refund", "wait": "Ask for photos"}
STATE = "The parcel arrived broken and the customer wants their money back today."


def _probabilities(port: int, question: dict) -> list[float]:
    status, _, body = rawhttp.post(port, "/v1/systemone", {"model": M, "state": STATE, "questions": {"q": question}})
    assert status == 200, body
    return [body["answers"]["q"]["probabilities"][k] for k in CRITERIA]


def test_act_with_base_score_is_calibrated_with_the_score_temperature(d, tiny_model):  # noqa: F811
    temps = json.loads((tiny_model / "CALIBRATION.json").read_text())["temperature_per_prim"]
    assert temps["score"] != temps["choice"]
    choice = _probabilities(d.port, {"type": "choice", "instructions": "What should we do?", "criteria": CRITERIA})
    act = {"type": "act", "instructions": "What should we do?", "criteria": CRITERIA, "costs": {"wrong": 1}}
    as_choice = _probabilities(d.port, act)
    assert np.allclose(as_choice, choice, rtol=0, atol=1e-9)  # the same prompts, the choice temperature
    as_score = _probabilities(d.port, {**act, "base": "score"})
    # undo the choice temperature, apply the score one: p_score ∝ p_choice ** (T_choice / T_score)
    powered = [p ** (temps["choice"] / temps["score"]) for p in choice]
    expected = [p / sum(powered) for p in powered]
    assert np.allclose(as_score, expected, rtol=0, atol=1e-6), (as_score, expected)
    assert not np.allclose(as_score, choice, atol=1e-4)


def test_act_max_error_refuses_only_strictly_below_the_threshold():
    spec = ActSpec("choice", ("a", "b", "defer"), ((0, 1), (1, 0), (0.5, 0.5)), "defer", 0.05)
    thresholds = {"0.05": 0.75}
    at = act_answer(spec, ["a", "b"], [0.75, 0.25], thresholds, True)
    assert at["action"] == "a" and "refused" not in at  # equality is not below the threshold
    below = act_answer(spec, ["a", "b"], [math.nextafter(0.75, 0), 1 - math.nextafter(0.75, 0)], thresholds, True)
    assert below["action"] == "defer" and below["refused"] == "a"


def test_evidence_spans_respect_the_80_token_limit():
    n = 200
    start = np.full(n, -50.0, dtype=np.float32)
    end = np.full(n, -50.0, dtype=np.float32)
    start[0], end[150] = 0.0, 0.0  # the best pair by score is 150 tokens long: out of bounds
    start[100], end[120] = -1.0, -1.0
    rel_start = [2 * i for i in range(n)]
    rel_end = [2 * i + 2 for i in range(n)]
    text = "ab" * n
    spans = select_spans(start, end, rel_start, rel_end, text)
    assert spans
    for span in spans:
        i, j = span["start"] // 2, span["end"] // 2 - 1
        assert 0 <= j - i < 80, span
    assert spans[0]["start"] == 200 and spans[0]["end"] == 302  # tokens 100..150: the best pair within the limit


@pytest.mark.parametrize("host", ["localhost.evil.com", "evil-localhost", "127.0.0.1.evil", "localhost.evil:80",
                                  "xlocalhost", "localhost:evil", "[::1].evil", "localhost@evil.com"])
def test_host_names_match_exactly(d, host):  # noqa: F811
    for path in ("/health", *PATHS):
        body = json.dumps(SMALL).encode() if path in PATHS else b""
        method = "POST" if body else "GET"
        status, _, _ = rawhttp.exchange(d.port, rawhttp.request_bytes(method, path, body, {"host": host}))
        assert status in (400, 403), (host, path, status)


@pytest.mark.parametrize("origin", ["http://localhost.evil.com", "http://evil-localhost:3000", "http://127.0.0.1.evil",
                                    "https://xlocalhost", "http://127.0.0.1@evil.com", "http://localhost.:80.evil"])
def test_origins_match_exactly(d, origin):  # noqa: F811
    for path in PATHS:
        status, _, _ = rawhttp.exchange(d.port, rawhttp.request_bytes("POST", path, json.dumps(SMALL).encode(),
                                                                      {"origin": origin}))
        assert status == 403, (origin, path, status)


def test_queue_time_ends_when_the_batch_starts(d):  # noqa: F811
    """A lone request on an idle engine waits ~0; queue + compute never exceeds the latency."""
    body = {"model": M, "state": " ".join(["The parcel arrived broken."] * 120),
            "questions": {"q": {"type": "choice", "instructions": "Which?", "criteria": CRITERIA}}}
    queues = []
    for n in range(4):
        body["state"] += f" Note {n}."  # a fresh state each time: the same compute, no cache hit
        status, headers, answer = rawhttp.post(d.port, "/v1/systemone", body)
        assert status == 200, answer
        queue, compute = float(headers["x-basal-queue-ms"]), float(headers["x-basal-compute-ms"])
        latency = answer["usage"]["latency_ms"]
        assert compute > 0 and queue >= 0
        assert queue + compute <= latency + 0.05, (queue, compute, latency)
        queues.append((queue, compute))
    assert min(q for q, _ in queues) < min(c for _, c in queues), queues  # ~0, not the compute again


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_a_bomb_is_bounded_while_it_streams(d, kind):  # noqa: F811
    """A 512 MiB bomb is refused at the body limit (32 MiB): the daemon's memory never grows by anything like it."""
    raw = b'{"model": "' + b"a" * (512 << 20)
    if kind == "gzip":
        payload = gzip.compress(raw, compresslevel=1)
    else:
        zstd = pytest.importorskip("zstandard")
        payload = zstd.ZstdCompressor(level=1).compress(raw)
    del raw
    before = _rss_bytes(d.proc.pid)
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes(d.proc.pid))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        status, _, _ = rawhttp.post(d.port, "/v1/systemone", payload, {"content-encoding": kind})
    finally:
        done.set()
        sampler.join()
    assert status == 413
    assert peak[0] - before < 200 << 20, (before, peak[0])  # decompressed whole: > 512 MiB
