"""The bundled sample requests (assets/sample_requests.jsonl): the bench's decisions, the measuring tools' and the
demo traffic."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


def sample_requests() -> list[dict[str, Any]]:
    text = resources.files("basal_local.assets").joinpath("sample_requests.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def single_question_requests(model: str) -> list[dict[str, Any]]:
    """Each question of the sample set as its own System One request."""
    out = []
    for item in sample_requests():
        for qid, q in item["questions"].items():
            out.append({"model": model, "state": item["state"], "questions": {qid: q}})
    return out
