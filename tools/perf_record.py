"""Condense the JSON that `basal-local bench --json` (in process or `--http`) writes into one small record for
`docs/perf/`, the machine-readable source of the figures docs/PERFORMANCE.md and the README quote.

    python tools/perf_record.py docs/perf/h200-4.5B-f16.json --commit 05ef8f5 \
        --machine "1 x NVIDIA H200, driver 580.159.04" --versions "torch 2.11.0+cu130, triton 3.6.0" \
        --command "basal-local bench --model /tmp/m-4.5B --device cuda --json" \
        --bench bench.json [--http c1=http-c1.json --http c32=http-c32.json] [--baseline compiled=bench-compiled.json]

Only the figures we publish are kept (a record is a few hundred bytes, raw outputs stay out of the repository).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _in_process(raw: dict) -> dict:
    """The published figures of one in-process bench run."""
    out = {k: raw.get(k) for k in ("model", "dtype", "layers", "hidden")}
    out.update(single_ms_median=raw["single_ms"]["median"], single_ms_p95=raw["single_ms"]["p95"],
               packed_tokens_p50=raw.get("packed_tokens_p50"))
    out.update({f"{size}_decisions_per_s": f["decisions_per_s"] for size, f in sorted(raw.get("throughput", {}).items())})
    memory, extras = raw.get("memory") or {}, raw.get("extras") or {}
    if memory.get("weights_bytes"):
        out["weights_gb"] = round(memory["weights_bytes"] / 1e9, 2)
        if memory.get("device_peak_bytes"):
            out["peak_minus_weights_gb"] = round((memory["device_peak_bytes"] - memory["weights_bytes"]) / 1e9, 2)
    invariance = extras.get("invariance_alone_vs_amid_31") or raw.get("invariance_alone_vs_amid_31")
    if isinstance(invariance, dict) and "trials" in invariance:
        out["alone_vs_amid_bitwise"] = f"{invariance.get('bitwise_equal')}/{invariance['trials']}"
    for name, doc in sorted(extras.items()):
        if name.startswith("long_doc_") and isinstance(doc, dict) and "state_tokens" in doc:  # not "skipped"
            out.update({f"{name}_state_tokens": doc["state_tokens"], f"{name}_s": doc["seconds"],
                        f"{name}_peak_minus_weights_gb": doc["memory"]["peak_minus_weights_gb"]})
    return out


def _http(raw: dict) -> dict:
    out = {k: raw.get(k, 0) for k in ("clients", "requests", "errors", "req_per_s")}
    out.update(p50_ms=raw["latency_ms"]["p50"], p99_ms=raw["latency_ms"]["p99"],
               mean_batch_requests=raw.get("mean_batch_requests"))
    if inv := raw.get("invariance_alone_vs_amid_31"):
        out["alone_vs_amid_bitwise"] = f"{inv['bitwise_equal']}/{inv['trials']}"
    return out


def _pairs(pairs: list[str], flag: str) -> dict[str, str]:
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise SystemExit(f"{flag} takes NAME=VALUE, not {bad[0]!r}")
    return dict(p.split("=", 1) for p in pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("record", type=Path, help="the docs/perf/*.json file to write")
    for key in ("commit", "machine", "versions", "command"):
        parser.add_argument(f"--{key}", required=True, help={"command": "the command that reproduces the figures"}.get(key))
    parser.add_argument("--bench", help="`basal-local bench --json` output (in process)")
    parser.add_argument("--http", action="append", default=[], metavar="NAME=FILE")
    parser.add_argument("--baseline", action="append", default=[], metavar="NAME=FILE",
                        help="a bench run with --baseline: its baseline figures beside ours")
    parser.add_argument("--fact", action="append", default=[], metavar="KEY=VALUE",
                        help="a recorded result that no bench JSON holds (e.g. the GPU tests' summary line)")
    args = parser.parse_args(argv)
    record: dict = {key: getattr(args, key) for key in ("commit", "machine", "versions", "command")}
    if args.bench:
        record["in_process"] = _in_process(json.loads(Path(args.bench).read_text()))
    for name, path in _pairs(args.http, "--http").items():
        record.setdefault("http", {})[name] = _http(json.loads(Path(path).read_text()))
    for name, path in _pairs(args.baseline, "--baseline").items():
        raw = json.loads(Path(path).read_text())
        ours = _in_process(raw)
        theirs = next(v for k, v in raw.items() if k.startswith("baseline") and isinstance(v, dict))
        record.setdefault("baselines", {})[name] = {
            "ours_single_ms": ours["single_ms_median"], "ours_batch32_decisions_per_s": ours.get("batch32_decisions_per_s"),
            "theirs_mode": theirs.get("mode"), "theirs_single_ms": theirs["single_ms"]["median"],
            "theirs_batch32_decisions_per_s": theirs["throughput"]["batch32"]["decisions_per_s"]}
    if args.fact:
        record["facts"] = _pairs(args.fact, "--fact")
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
