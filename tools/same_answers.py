"""Answer every request of a JSONL file (both dialects, plus four broken variants each) through the app in
process, one at a time on the CPU; print one JSON line per answer (status and body, latency left out) so that two
checkouts can be diffed: `python tools/same_answers.py MODEL_DIR ../shared/data/decisions.jsonl > a.jsonl`."""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from litestar.testing import TestClient

from basal_local.server.app import AppState, create_app
from basal_local.server.daemon import load_engines
from basal_local.server.settings import Settings


def variants(item: dict, name: str) -> Iterator[dict]:
    """The request, then without its state, with an unknown question type, for an unknown model, asking evidence."""
    body = {k: v for k, v in item.items() if k != "id"}
    body["model"] = name
    yield body
    first = next(iter(body["questions"]))
    no_state = copy.deepcopy(body)
    no_state.pop("state", None)
    yield no_state
    bad_type = copy.deepcopy(body)
    bad_type["questions"][first]["type"] = "banana"
    yield bad_type
    yield {**copy.deepcopy(body), "model": "nope"}
    evidence = copy.deepcopy(body)
    evidence["questions"][first]["evidence"] = True
    yield evidence


def main() -> int:
    model, data = Path(sys.argv[1]), Path(sys.argv[2])
    state = AppState()
    load_engines(state, Settings.load({"device": "cpu"}, config_file=Path("/nonexistent.toml")), [model])
    name = next(iter(state.engines))
    items = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    with TestClient(create_app(state)) as client:
        for item in items:
            for n, body in enumerate(variants(item, name)):
                for dialect in ("systemone", "basal"):
                    r = client.post(f"/v1/{dialect}", json=body)
                    out = r.json()
                    if isinstance(out, dict) and "usage" in out:
                        out["usage"].pop("latency_ms", None)
                    print(json.dumps([item.get("id"), n, dialect, r.status_code, out]))
    for engine in state.engines.values():
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
