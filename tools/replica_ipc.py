"""What replicas in processes cost per request on the CPU side (issue 13): `python tools/replica_ipc.py MODEL_DIR`.

1. The wire: encoded size and encode + decode time of each sample question's plan as sent to a worker.
2. Latency at one client: the sample questions one after the other through an in-process engine, then through a
   ProcessReplicaSet of one worker on the same device; the difference of the medians is the round trip's cost.
3. CPU per request at 8 concurrent submitters: the front process (planning, pickling, pipe, answers, telemetry)
   and each worker (its engine), from getrusage and /proc, with two workers; the planning alone is timed too.
Prints one JSON object. The device is `--device` (default cpu); figures on a loaded machine are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from basal_local.api import validate
from basal_local.backends.select import make_backend
from basal_local.bench import single_question_requests
from basal_local.engine.engine import EngineSettings, ModelEngine
from basal_local.engine.gate import DeviceGate
from basal_local.model.directory import load_model_dir
from basal_local.replicas import wire
from basal_local.replicas.front import ProcessReplicaSet
from basal_local.replicas.worker import WorkerSpec
from basal_local.telemetry import Telemetry


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = load_model_dir(args.model)
    settings = EngineSettings()
    requests = [validate(b, "systemone", model.name) for b in single_question_requests(model.name)]
    out: dict = {"questions": len(requests), "device": args.device}

    backend = make_backend("auto", args.device)
    backend.load(model.path, "auto")
    local = ModelEngine(model, backend, DeviceGate(), Telemetry(), settings)
    local.start()
    plans = [local.plan(r) for r in requests]
    sizes, times = [], []
    for p in plans:
        t0 = time.perf_counter()
        data = wire.ENCODER.encode(wire.Submit(0, "", wire.encode_plan(p)))
        wire.decode_plan(wire.TO_WORKER.decode(data).plan)
        times.append((time.perf_counter() - t0) * 1e6)
        sizes.append(len(data))
    out["wire_bytes"] = {"median": statistics.median(sizes), "max": max(sizes)}
    out["pickle_roundtrip_us"] = {"median": round(statistics.median(times), 1), "max": round(max(times), 1)}

    def one_by_one(engine) -> list[float]:
        lat = []
        for _ in range(args.rounds):
            for r in requests:
                plan = engine.plan(r)
                t0 = time.perf_counter()
                engine.submit(plan).result(60)
                lat.append((time.perf_counter() - t0) * 1e3)
        return lat

    one_by_one(local)  # warm
    in_process = one_by_one(local)
    local.stop()

    def spec(r: int) -> WorkerSpec:
        return WorkerSpec(model.path, "auto", args.device, "auto", settings, replica=r)

    single = ProcessReplicaSet(model, [spec(0)], Telemetry(), settings)
    single.wait_ready(600)
    single.start()
    one_by_one(single)
    remote = one_by_one(single)
    single.stop()
    med_in, med_out = statistics.median(in_process), statistics.median(remote)
    out["one_client_ms"] = {"in_process_median": round(med_in, 3), "worker_median": round(med_out, 3),
                            "difference": round(med_out - med_in, 3)}

    pair = ProcessReplicaSet(model, [spec(0), spec(1)], Telemetry(), settings)
    pair.wait_ready(600)
    pair.start()
    work = requests * max(1, 400 // len(requests))

    def run(r):
        return pair.submit(pair.plan(r)).result(120)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(run, requests))  # warm
        t_plan0 = time.perf_counter()
        for r in requests:
            pair.plan(r)
        plan_ms = (time.perf_counter() - t_plan0) * 1e3 / len(requests)
        pids = [r.process.pid for r in pair.replicas]
        before = (self_cpu_s(), [proc_cpu_s(p) for p in pids])
        t0 = time.perf_counter()
        list(pool.map(run, work))
        wall = time.perf_counter() - t0
        after = (self_cpu_s(), [proc_cpu_s(p) for p in pids])
    pair.stop()
    n = len(work)
    out["two_workers_8_submitters"] = {
        "requests": n, "req_per_s": round(n / wall, 1),
        "front_cpu_ms_per_request": round((after[0] - before[0]) * 1e3 / n, 3),
        "planning_ms_per_request": round(plan_ms, 3),
        "worker_cpu_ms_per_request": [round((a - b) * 1e3 / n, 3) for a, b in zip(after[1], before[1])],
        "front_cores": round((after[0] - before[0]) / wall, 2),
        "worker_cores": [round((a - b) / wall, 2) for a, b in zip(after[1], before[1])]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
