"""The Python steps of tools/gpu.sh, one subcommand each (every one also runs by hand):

    python tools/gpu.py summary FILE...            one line per `basal-local bench --json` output (in process or HTTP)
    python tools/gpu.py answers URL OUT [CLIENTS]  every sample question through a daemon's /v1/basal, saved
    python tools/gpu.py compare A B                two saved answer sets: bitwise equal, same decision, max |dp|
    python tools/gpu.py slow EVENTS [N]            the N slowest batches of a saved /api/events stream, how they ran
    python tools/gpu.py unload URL                 5 unload/load cycles: device memory and answers bit for bit
    python tools/gpu.py dashboard URL DEVICE GPUS  NVML telemetry, the memory split, a `device` event, the TUI
    python tools/gpu.py profile MODEL OUT [attention:gemm ...]   kernel time per family (CUDA graphs off)
    python tools/gpu.py closure DIR                every requirement of every wheel in DIR met (carried or image)
    python tools/gpu.py deps WHEEL                 the wheel's requirements the GPU image lacks (prepare fetches them)
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def call(url: str, body: dict | None = None, timeout: float = 600) -> tuple[int, dict]:
    req = urllib.request.Request(url, None if body is None else json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def summary(*paths: str) -> None:
    """One line for the bench JSON files (in process, --http or --cache): their headline figures, `; ` between."""
    out = []
    for path in paths:
        r, name = json.load(open(path)) if os.path.getsize(path) else {}, os.path.basename(path)[:-5]
        inv = (r.get("extras") or r).get("invariance_alone_vs_amid_31")
        inv = f", alone vs amid 31 {inv['bitwise_equal']}/{inv['trials']}" if inv else ""
        if "req_per_s" in r:  # bench --http
            out.append(f"{name} {r['req_per_s']} req/s, p50 {r['latency_ms']['p50']} p99 {r['latency_ms']['p99']} ms, "
                       f"errors {r.get('errors', 0)}{inv}")
        elif "per_document" in r:  # bench --cache
            out.append(f"{name} second request {r['second_speedup']}x faster ({r['second_ms']}), first "
                       f"{r['first_ratio_cached_vs_templates_only']}x, documents bitwise equal {r['bitwise_equal']}")
        elif "single_ms" in r:
            base = (f", vs {r['baseline']['mode']} {r['speedup_single_median']}x single, {r['speedup_batch32']}x b32"
                    if "baseline" in r else "")
            fwd = f" (plan+pack+forward {r['single_forward_ms']['median']} ms)" if "single_forward_ms" in r else ""
            b32 = r["throughput"]["batch32"]
            fwd32 = f" (forward only {b32['forward_only_decisions_per_s']}/s)" if "forward_only_decisions_per_s" in b32 \
                else ""
            out.append(f"{name} {r['single_ms']['median']} ms (p95 {r['single_ms']['p95']}){fwd}, b32 "
                       f"{b32['decisions_per_s']}/s{fwd32}{inv}{base}")
        else:
            out.append(f"{name} no figures")
    print("; ".join(out))


def answers(url: str, out: str, clients: str = "64") -> int:
    from basal_local.samples import single_question_requests

    url = url.rstrip("/")
    bodies = single_question_requests(call(url + "/v1/models")[1]["models"][0]["name"])
    with ThreadPoolExecutor(int(clients)) as pool:  # answers in sample order
        got = list(pool.map(lambda body: call(url + "/v1/basal", body), bodies))
    json.dump([body.get("answers") for _, body in got], open(out, "w"))
    failed = [f"{status} {body}" for status, body in got if status != 200]
    print(f"{len(got) - len(failed)}/{len(got)} answered -> {out}", *failed[:3], sep="\n")
    return 1 if failed else 0


def slow(events_path: str, n: str = "12") -> int:
    """The slowest batches of a daemon's event stream (`curl -N URL/api/events`): compute and device time, size,
    and how the forwards ran (a graph captured on first use, an eager forward, a replay)."""
    batches = []
    for line in open(events_path, encoding="utf-8", errors="replace"):
        if line.startswith("data: "):
            try:
                event = json.loads(line[6:])
            except ValueError:  # the stream cut by the kill
                continue
            if event.get("kind") == "computed":
                batches.append(event)
    print(f"{len(batches)} batches; the {min(int(n), len(batches))} slowest (compute ms, device ms, replica, "
          "requests, packed tokens, prompts, forward):")
    for b in sorted(batches, key=lambda b: -b.get("compute_ms", 0))[:int(n)]:
        print(f"  {b.get('compute_ms')}  {b.get('device_ms')}  r{b.get('replica')}  {b.get('requests')}  "
              f"{b.get('packed_tokens')}  {b.get('prompts')}  {b.get('forward') or '?'}")
    kinds: dict[str, int] = {}
    for b in batches:
        kinds[b.get("forward") or "?"] = kinds.get(b.get("forward") or "?", 0) + 1
    print("forwards:", ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    return 0


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    same_bits = sum(x == y for x, y in zip(a, b))
    same, worst = 0, 0.0
    for x, y in [(x, y) for x, y in zip(a, b) if x and y]:  # one question each; every type has probabilities
        px, py = (next(iter(v.values()))["probabilities"] for v in (x, y))
        same += max(px, key=px.get) == max(py, key=py.get)
        worst = max([worst] + [abs(px[k] - py[k]) for k in px])
    print(json.dumps({"questions": len(a), "bitwise_equal": same_bits, "same_decision": same,
                      "max_abs_dp": float(f"{worst:.3g}"), "all_bitwise": same_bits == len(a) == len(b)}))
    return 0 if len(a) == len(b) else 1


def _gpu_mib() -> int:
    import subprocess

    smi = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]
    try:
        return int(subprocess.run(smi, capture_output=True, text=True, timeout=30).stdout.split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # no GPU


def unload(url: str) -> int:
    from basal_local.samples import single_question_requests

    (model,) = [m["name"] for m in call(url + "/api/ps")[1]["models"] if m.get("default")]
    bodies = single_question_requests(model)[:32]
    ask = lambda: [call(url + "/v1/systemone", b)[1].get("answers") for b in bodies]  # noqa: E731
    first, loaded, rows = ask(), _gpu_mib(), []
    for cycle in range(5):
        t0 = time.perf_counter()
        row = {"cycle": cycle + 1, "unload": call(url + "/api/unload", {"model": model, "wait": True})[0],
               "unload_s": round(time.perf_counter() - t0, 2)}
        time.sleep(1.0)
        row["mib_unloaded"], t0 = _gpu_mib(), time.perf_counter()
        row.update(load=call(url + "/api/load", {"model": model, "wait": True})[0],
                   load_s=round(time.perf_counter() - t0, 2), mib_reloaded=_gpu_mib(), bitwise=ask() == first)
        rows.append(row)
        print(json.dumps(row), flush=True)
    ok = all(r["unload"] == r["load"] == 200 and r["bitwise"] for r in rows)
    print(f"{'ok' if ok else 'FAILED'} (5 cycles, 200s, answers bitwise), GPU MiB {loaded} loaded, freed >= "
          f"{loaded - max(r['mib_unloaded'] for r in rows)}, regrown {max(r['mib_reloaded'] for r in rows) - loaded}")
    return 0 if ok else 1


def dashboard(url: str, device: str, gpus: str) -> int:
    import asyncio
    import io

    failed = []

    def check(ok: bool, text: str) -> None:
        print(("ok   " if ok else "FAIL ") + text, flush=True)
        failed.extend([] if ok else [text])

    def post(i: int) -> int:  # documents of a few hundred tokens: the state cache keeps whole attention tiles
        state = f"Zgłoszenie {i}: " + " ".join(f"paczka {k} uszkodzona, klient czeka {k + 2} dni." for k in range(40))
        return call(url + "/v1/systemone", {"model": model, "state": state, "questions": {
            "kind": {"type": "choice", "instructions": "Rodzaj?", "criteria": {"a": "Szkoda", "b": "Inne"}},
            "urgent": {"type": "noul", "instructions": f"Pilne #{i}?"}}})[0]

    model = call(url + "/v1/models")[1]["models"][0]["name"]
    with ThreadPoolExecutor(8) as pool:  # eight at a time: every replica gets batches (and memory figures)
        codes = list(pool.map(post, range(48))) + [post(i) for i in range(8)]  # then 8 state cache hits
    check(codes.count(200) == 56, f"56 requests answered ({sorted(set(codes))})")
    call(url + "/api/stats")
    time.sleep(1.2)  # the CPU % needs two samples
    stats = call(url + "/api/stats")[1]
    tele = stats["device_telemetry"]
    print("device_telemetry", json.dumps(tele), "\nmemory", json.dumps(stats["memory"]))
    cache = stats["models"][0].get("prefix_cache") or {}
    if cache.get("enabled"):
        check(cache["hits"] > 0 and cache["bytes"] > 0, f"state cache: {cache['hits']} hits, {cache['bytes']} bytes")
    if device == "cpu":
        check(tele["type"] == "cpu" and tele["rss_bytes"] > 0, "CPU sample")
    else:
        seen = tele.get("gpus") or []
        check(tele["type"] == "nvidia" and len(seen) >= int(gpus), f"NVML reports {len(seen)} GPU(s)")
        for g in seen[:int(gpus)]:
            check(0 <= g.get("util_percent", -1) <= 100 and g.get("power_w", 0) > 0 and g.get("clock_mhz", 0) > 0
                  and 0 < g["memory_used_bytes"] <= g["memory_total_bytes"], f"GPU{g['index']}: {json.dumps(g)}")
        for r in [r for m in stats["models"] for r in m.get("replicas", [])]:
            if not (mem := r.get("memory")):  # a worker replica reports the figures of its last batch
                print(f"note: replica {r['replica']} on {r['device']} ran no batch, no memory figures")
                continue
            parts = sum(mem.get(k, 0) for k in ("weights_bytes", "graphs_bytes", "prefix_cache_bytes"))
            dev = "cuda:0" if r["device"] == "cuda" else r["device"]
            used = next((g["memory_used_bytes"] for g in seen if f"cuda:{g['index']}" == dev), 0)
            check(mem.get("graphs_bytes", 0) > 0 and parts <= used, f"replica {r['replica']} on {r['device']}: "
                  f"weights + graphs + cache {parts / 2**30:.2f} GiB of the GPU's used {used / 2**30:.2f} GiB")
    with urllib.request.urlopen(url + "/api/events", timeout=10) as events:
        kinds, deadline = [], time.time() + 8
        while time.time() < deadline and "device" not in kinds:
            line = events.readline().decode()
            kinds += [json.loads(line[5:]).get("kind")] if line.startswith("data:") else []
    check("device" in kinds, "a `device` event on /api/events")
    from rich.console import Console

    from basal_local.tui.app import DashboardApp
    from basal_local.tui.client import DaemonClient

    async def screen() -> str:  # the real dashboard (client, app, clock) headless at 120x40
        app = DashboardApp(DaemonClient(url, stats_every_s=0.5), refresh_s=0.25)
        async with app.run_test(size=(120, 40)) as pilot:
            for _ in range(100):
                await pilot.pause(0.05)
                if app.data.connected and app.data.device.get("gpus" if device != "cpu" else "rss_bytes"):
                    break
            await pilot.pause(1.5)
            app.redraw(force=True)
            await pilot.pause(0.2)
            console = Console(width=120, height=40, file=io.StringIO(), record=True, force_terminal=True)
            console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
            return console.export_text(styles=False)

    text = asyncio.run(screen())
    print(text)
    check(("GPU0" in text and "mem " in text) if device != "cpu" else "RSS" in text, "the dashboard's device pane")
    print("dashboard: all checks passed" if not failed else f"dashboard: {len(failed)} check(s) FAILED")
    return 1 if failed else 0


def profile(model_dir: str, out: str, *configs: str) -> None:
    from collections import defaultdict

    import torch

    from basal_local.api.systemone import validate_systemone
    from basal_local.backends.torch import TorchBackend
    from basal_local.backends.torch.options import TorchOptions
    from basal_local.engine.packer import PromptSpec, pack_prompts
    from basal_local.model import load_model_dir
    from basal_local.protocol.render import render_question
    from basal_local.samples import single_question_requests

    families = (("attention", ("attn", "fmha", "flash", "attention")),
                ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "ampere", "cublas")),
                ("copy/cast", ("copy", "cat", "convert")),
                ("norm/rope/swiglu/elementwise", ("rms", "rope", "silu", "elementwise", "vectorized", "mul", "add",
                                                  "reduce", "pow", "mean", "rsqrt", "letter")),
                ("index/gather", ("index", "gather", "embedding")))  # the first family that matches a kernel's name
    md = load_model_dir(model_dir)
    requests = [validate_systemone(r, md.name) for r in single_question_requests(md.name)]
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}

    def batch_of(reqs):
        specs = [PromptSpec(md.tokenizer.encode(p), lang, md.tokenizer.letter_ids[: len(q.keys)])
                 for r in reqs for q in r.questions for lang, _, prompts in [render_question(r.state_text, q)]
                 for p in prompts]
        return pack_prompts(specs, prefixes).batches[0]

    lines = []
    for attention, gemm in [tuple(c.split(":")) for c in configs] or [("tree", "verified")]:
        backend = TorchBackend("cuda", attention=attention, options=TorchOptions(cuda_graphs=False, gemm=gemm))
        backend.load(md.path, "f16")
        for lang, ids in prefixes.items():
            backend.add_prefix(lang, ids)
        for label, batch in (("single decision", batch_of(requests[:1])), ("32 decisions", batch_of(requests[:32]))):
            for _ in range(3):
                backend.forward(batch)
            torch.cuda.synchronize()
            acts = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(5):
                    backend.forward(batch)
                torch.cuda.synchronize()
            fams, kernels = defaultdict(float), []
            for t, count, name in kernel_times(prof, 5):
                fam = next((f for f, keys in families if any(k in name.lower() for k in keys)), "other")
                fams[fam] += t
                kernels.append((t, int(count), name[:90]))
            lines.append(f"{attention}/{gemm} {label} ({batch.num_tokens} packed tokens): kernel time "
                         f"{sum(fams.values()):.2f} ms, {sum(k[1] for k in kernels)} kernels per forward")
            lines += [f"    {f:32s} {t:8.2f} ms" for f, t in sorted(fams.items(), key=lambda kv: -kv[1])]
            lines += [f"      {t:8.3f} ms  {n:4d}x  {name}" for t, n, name in sorted(kernels, reverse=True)[:12]]
        del backend
        torch.cuda.empty_cache()
    print("\n".join(lines))
    open(out, "w").write("\n".join(lines) + "\n")


def kernel_times(prof, passes: int) -> list[tuple[float, float, str]]:
    """(device ms, launches, name) per pass of each CUDA kernel a torch.profiler run over `passes` passes saw."""
    import torch

    return [(ev.device_time_total / 1000.0 / passes, ev.count / passes, ev.key) for ev in prof.key_averages()
            if getattr(ev, "device_time_total", 0) and ev.device_type == torch.autograd.DeviceType.CUDA]


# what the GPU image holds and the carried folder leaves out: the daemon's heavy requirements (every other
# requirement, direct or not, is downloaded into dist/gpu/whl)
ON_IMAGE = {"torch", "numpy", "tokenizers", "safetensors", "huggingface-hub", "prometheus-client"}


def _requirements(wheel: str, pyver: str):
    import zipfile

    from pip._vendor.packaging.requirements import Requirement

    env = {"python_version": pyver, "python_full_version": pyver + ".0", "sys_platform": "linux", "extra": "",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if line.startswith("Requires-Dist: "):
            req = Requirement(line[len("Requires-Dist: "):])
            if req.marker is None or req.marker.evaluate(env):
                yield re.sub(r"[-_.]+", "-", req.name.lower()), req


def deps(wheel: str) -> None:
    """The wheel's direct requirements that the GPU image lacks (what `gpu.sh prepare` downloads)."""
    print("\n".join(str(r).split(";")[0] for name, r in _requirements(wheel, os.environ.get("PYVER", "3.12"))
                    if name not in ON_IMAGE))


def closure(root: str) -> int:
    from pathlib import Path

    from pip._vendor.packaging.version import Version

    wheels, carried = sorted(Path(root).glob("*/*.whl")), {}
    for w in wheels:
        name, version = w.name.split("-")[:2]
        if re.sub(r"[-_.]+", "-", name.lower()) in carried and w.parent.name == "whl":
            sys.exit(f"two versions of {name} in {root}/whl: pip --target would stop")
        carried.setdefault(re.sub(r"[-_.]+", "-", name.lower()), Version(version))
    missing = [f"{w.name} needs {req}" + ("" if name in carried else ": neither carried nor on the image")
               for w in wheels for name, req in _requirements(str(w), os.environ.get("PYVER", "3.12"))
               if (carried[name] not in req.specifier if name in carried else name not in ON_IMAGE)]
    if missing:
        sys.exit("\n".join(missing))
    size = sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())
    print(f"{root}: {len(wheels)} wheels, closure complete, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    command, *args = sys.argv[1:] or ["-h"]
    commands = {f.__name__: f for f in (summary, answers, compare, slow, unload, dashboard, profile, closure, deps)}
    if command not in commands:
        sys.exit(__doc__)
    sys.exit(commands[command](*args) or 0)
