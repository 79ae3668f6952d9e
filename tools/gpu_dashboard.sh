#!/usr/bin/env bash
# The dashboard's device telemetry on a real GPU (issue 32): a daemon on a generated test model with the
# [nvidia] extra, then /api/stats' device_telemetry (NVML), the backend's memory split (weights, CUDA graphs'
# pool, state cache), a `device` event off the SSE stream, and the dashboard itself headless at 120x40 against it.
# With two GPUs or more, the same for a model on cuda:0,cuda:1 (replicas in worker processes: the daemon's own
# process never initializes CUDA, and NVML must still report the GPUs).
# Here: .whl holds the basal-local wheel and the daemon's wheels, nvidia_ml_py-*.whl among them (SKIP_INSTALL=1:
# all installed already). DEVICE=cpu runs it without a GPU (the NVML checks then expect the CPU sample).
# Prints one line per check ("ok ..." or "FAIL ...") and exits 1 if one failed; files in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export BASAL_LOCAL_HOME=/tmp/bh-dash
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-small}
M=${MODEL_DIR:-/tmp/m-dash-$PRESET}
[ "$DEVICE" = cpu ] || python3 -c "import pynvml" 2>/dev/null \
  || { echo "FAIL nvidia-ml-py is not installed: put nvidia_ml_py-*.whl in .whl (basal-local[nvidia])"; exit 1; }
[ -d "$M" ] || (cd /tmp && python3 -m basal_local.cli make-test-model "$M" --preset "$PRESET" > /dev/null) || exit 1
cd /tmp && python3 - "$M" "$DEVICE" "$OUT" <<'PY'
import asyncio, io, json, os, socket, subprocess, sys, time, urllib.request

model, device, out = sys.argv[1:4]
failed = []


def check(ok: bool, text: str) -> None:
    print(("ok   " if ok else "FAIL ") + text, flush=True)
    if not ok:
        failed.append(text)


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def post(url: str, i: int) -> int:
    # documents of a few hundred tokens: long enough for the state cache to keep (it keeps whole attention tiles)
    state = f"Zgłoszenie {i}: " + " ".join(f"paczka {k} uszkodzona, klient czeka od {k + 2} dni." for k in range(40))
    body = {"model": "jev-latest", "state": state,
            "questions": {"kind": {"type": "choice", "instructions": "Rodzaj?", "criteria": {"a": "Szkoda", "b": "Inne"}},
                          "urgent": {"type": "noul", "instructions": f"Pilne #{i}?"}}}
    req = urllib.request.Request(url + "/v1/systemone", json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def serve(name: str, args: list[str]):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    log = open(os.path.join(out, f"serve-{name}.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "basal_local.cli", "serve", "--model", model, "--port", str(port),
                             *args], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if get(url + "/health").get("status") == "ok":
                return proc, url
        except Exception:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"FAIL daemon {name} did not start (see {out}/serve-{name}.log)")


def screen(url: str) -> str:
    """The real dashboard (client, app, clock) headless at 120x40 against the daemon, as text."""
    from rich.console import Console

    from basal_local.tui.app import DashboardApp
    from basal_local.tui.client import DaemonClient

    async def run() -> str:
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

    return asyncio.run(run())


def device_event(url: str) -> dict | None:
    with urllib.request.urlopen(url + "/api/events", timeout=10) as r:
        deadline = time.time() + 8
        while time.time() < deadline:
            line = r.readline().decode()
            if line.startswith("data:"):
                event = json.loads(line[5:])
                if event.get("kind") == "device":
                    return event
    return None


def stage(name: str, args: list[str], gpus_expected: int) -> None:
    proc, url = serve(name, args)
    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:  # eight at a time: every replica gets batches (and memory figures)
            codes = list(pool.map(lambda i: post(url, i), range(48)))
        check(codes.count(200) == 48, f"[{name}] 48 requests answered ({sorted(set(codes))})")
        again = [post(url, i) for i in range(8)]  # the same documents again, one at a time: state cache hits
        check(again.count(200) == 8, f"[{name}] 8 repeated documents answered")
        get(url + "/api/stats")
        time.sleep(1.2)  # the CPU % needs two samples
        stats = get(url + "/api/stats")
        json.dump(stats, open(os.path.join(out, f"stats-{name}.json"), "w"), indent=1)
        tele, memory = stats["device_telemetry"], stats["memory"]
        print(f"[{name}] device_telemetry: {json.dumps(tele)}")
        print(f"[{name}] memory: {json.dumps(memory)}")
        for m in stats["models"]:
            print(f"[{name}] {m['name']} engine.prefix_cache={m['engine'].get('prefix_cache')!r} "
                  f"prefix_cache={json.dumps(m.get('prefix_cache'))}")
            for r in m.get("replicas", []):
                print(f"[{name}]   replica {json.dumps(r)}")
        cache = stats["models"][0].get("prefix_cache") or {}
        if cache.get("enabled"):
            check(cache["hits"] > 0 and cache["bytes"] > 0, f"[{name}] state cache: {cache['hits']} hits, "
                  f"{cache['misses']} misses, {cache['bytes'] / 2**20:.1f} of {cache['budget_bytes'] / 2**20:.0f} MiB")
        else:
            print(f"note [{name}] no state cache in this daemon (or it is off): {cache or 'not reported'}")
        if device == "cpu":
            check(tele["type"] == "cpu" and tele["rss_bytes"] > 0, f"[{name}] CPU sample")
        else:
            gpus = tele.get("gpus") or []
            check(tele["type"] == "nvidia" and len(gpus) >= gpus_expected, f"[{name}] NVML reports {len(gpus)} GPU(s)")
            for g in gpus[:gpus_expected]:
                check(0 <= g.get("util_percent", -1) <= 100 and g.get("power_w", 0) > 0 and g.get("clock_mhz", 0) > 0,
                      f"[{name}] GPU{g['index']} {g.get('name')}: util {g.get('util_percent')} %, "
                      f"{g.get('power_w')} W, {g.get('clock_mhz')} MHz, {g.get('temperature_c')} C")
                check(0 < g["memory_used_bytes"] <= g["memory_total_bytes"],
                      f"[{name}] GPU{g['index']} memory {g['memory_used_bytes'] / 2**30:.2f} of "
                      f"{g['memory_total_bytes'] / 2**30:.1f} GiB")
            replicas = [r for m in stats["models"] for r in m.get("replicas", [])]
            for r in replicas:
                mem = r.get("memory") or {}
                if not mem:  # a worker replica reports the figures of its last batch: it had none
                    print(f"note [{name}] replica {r['replica']} on {r['device']} ran no batch: no memory figures")
                    continue
                gpu = next((g for g in gpus if r["device"] in (f"cuda:{g['index']}", "cuda" if g["index"] == 0 else "")),
                           None)
                graphs, weights = mem.get("graphs_bytes", 0), mem.get("weights_bytes", 0)
                parts = weights + graphs + mem.get("prefix_cache_bytes", 0)
                check(graphs > 0, f"[{name}] replica {r['replica']} on {r['device']}: graphs_bytes "
                                  f"{graphs / 2**20:.1f} MiB (weights {weights / 2**20:.1f} MiB)")
                if gpu is not None:
                    check(parts <= gpu["memory_used_bytes"], f"[{name}] replica {r['replica']}: weights + graphs + "
                          f"cache {parts / 2**30:.2f} GiB <= the GPU's used {gpu['memory_used_bytes'] / 2**30:.2f} GiB")
        event = device_event(url)
        check(event is not None and event.get("type") == tele["type"], f"[{name}] a `device` event on /api/events "
              f"({None if event is None else event.get('type')})")
        text = screen(url)
        open(os.path.join(out, f"top-{name}.txt"), "w").write(text)
        print(text)
        check(("GPU0" in text and "mem " in text) if device != "cpu" else "RSS" in text,
              f"[{name}] the dashboard's device pane shows the {'GPU' if device != 'cpu' else 'CPU'}")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


stage("1gpu" if device != "cpu" else "cpu", ["--device", device], 1)
if device != "cpu":
    import torch

    if torch.cuda.device_count() >= 2:
        stage("2gpu", ["--devices", "cuda:0,cuda:1"], 2)
print("all checks passed" if not failed else f"{len(failed)} check(s) failed")
sys.exit(1 if failed else 0)
PY
