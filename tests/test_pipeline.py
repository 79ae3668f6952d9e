"""The main lane's pipelining (engine/engine.py): with a backend that launches without waiting, the next batch is
formed, packed and launched while the device still computes the one before, from everything that queued
meanwhile; without `launch` (or with `pipeline=False`) a batch is answered before the next one forms."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from basal_local.api.answers import response_body
from basal_local.api.systemone import validate_systemone
from basal_local.engine.engine import EngineSettings, ModelEngine
from basal_local.engine.gate import DeviceGate
from basal_local.engine.lane import PIPELINE_MIN_S, _size_class
from basal_local.model import load_model_dir
from basal_local.telemetry import Telemetry

WAIT = 20.0  # seconds before a test calls a hang a hang


class _Handle:
    def __init__(self, device: HeldDevice, number: int, logits: np.ndarray) -> None:
        self.device, self.number, self.logits = device, number, logits

    def done(self) -> bool:
        return self.device.released.is_set()

    def result(self) -> np.ndarray:
        if not self.device.released.wait(WAIT):
            raise TimeoutError("the test never released the device")
        return self.logits

    def device_s(self) -> float:
        return 0.3


class HeldDevice:
    """A fake backend whose launches return at once and whose device finishes nothing until `release()`.

    Logits depend only on the prompt's own tokens (as the real kernels guarantee), so answers can be compared
    across batchings. `log` records (launch number, readout rows, whether the device was released then)."""

    name = "held"
    device = "cpu"

    def __init__(self) -> None:
        self.released = threading.Event()
        self.launched = threading.Semaphore(0)
        self.log: list[tuple[int, int, bool]] = []

    def add_prefix(self, key, ids) -> None:
        pass

    def _logits(self, batch) -> np.ndarray:
        rows = batch.token_ids[batch.readout_index].astype(np.float32)
        return (rows[:, None] % 7 + np.arange(len(batch.letter_ids), dtype=np.float32)[None, :]) / 7.0

    def launch(self, batch) -> _Handle:
        self.log.append((len(self.log), len(batch.readout_index), self.released.is_set()))
        self.launched.release()
        return _Handle(self, len(self.log) - 1, self._logits(batch))

    def forward(self, batch) -> np.ndarray:
        return self.launch(batch).result()

    def forward_steps(self, batch):
        yield self.forward(batch)


@pytest.fixture(scope="module")
def model(tiny_model):
    return load_model_dir(tiny_model)


def _plan(engine: ModelEngine, tag: str):
    body = {"model": engine.model.name, "state": f"State {tag}.",
            "questions": {"q": {"type": "noul", "instructions": f"Is {tag} urgent?"}}}
    return engine.plan(validate_systemone(body, engine.model.name))


def _run(model, pipeline: bool, expected_s: float = 0.3) -> tuple[HeldDevice, list, list]:
    """A blocker batch on a held device, ten requests queued behind it, then the device released."""
    device = HeldDevice()
    engine = ModelEngine(model, device, DeviceGate(), Telemetry(), EngineSettings(long_tokens=0, pipeline=pipeline))
    engine.start()
    try:
        blocker = _plan(engine, "blocker")
        plans = [_plan(engine, f"r{i}") for i in range(10)]
        # the device time the lane expects for the blocker: its next batch is due that long after the launch
        engine.main.device_est[_size_class(blocker.packed_tokens)] = expected_s
        jobs = [engine.submit(blocker)]
        assert device.launched.acquire(timeout=WAIT)
        jobs += [engine.submit(p) for p in plans]
        if pipeline and expected_s >= PIPELINE_MIN_S:  # the second batch launches while the device holds the first
            assert device.launched.acquire(timeout=WAIT)
        device.released.set()
        results = [job.result(timeout=WAIT) for job in jobs]
        return device, results, [b.requests for b in engine.telemetry.batches]
    finally:
        device.released.set()
        engine.stop(timeout=WAIT)


def test_the_next_batch_is_launched_before_the_device_ends_the_one_before(model):
    device, results, batches = _run(model, pipeline=True)
    assert [(n, released) for n, _, released in device.log] == [(0, False), (1, False)]
    assert batches == [1, 10]  # everything that queued during the blocker went in one batch
    assert [r.batch_requests for r in results] == [1] + [10] * 10


def test_pipelining_changes_no_answer_and_is_off_when_asked(model):
    on_device, on, _ = _run(model, pipeline=True)
    off_device, off, batches = _run(model, pipeline=False)
    assert [released for *_, released in off_device.log] == [False, True]  # formed after the blocker's end
    assert batches == [1, 10]
    bodies = [[{k: v for k, v in response_body(r, "systemone", 0.0).items() if k != "usage"} for r in res] for res in (on, off)]
    assert bodies[0] == bodies[1]


def test_a_short_batch_is_answered_before_the_next_one_forms(model):
    """Overlap would gain little on a short batch, and a lone request would wait on the estimate."""
    device, _, batches = _run(model, pipeline=True, expected_s=PIPELINE_MIN_S / 2)
    assert [released for *_, released in device.log] == [False, True]
    assert batches == [1, 10]


def test_no_pipeline_flag_reaches_the_engine_settings():
    from basal_local.cli import build_parser
    from basal_local.commands.serving import load_settings

    args = build_parser().parse_args(["serve", "--no-pipeline"])
    assert load_settings(args).engine.pipeline is False
    args = build_parser().parse_args(["serve"])
    assert load_settings(args).engine.pipeline is True
