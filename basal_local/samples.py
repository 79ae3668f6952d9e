"""The bundled sample requests (assets/sample_requests.jsonl): the bench's decisions and the demo traffic."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


def sample_requests() -> list[dict[str, Any]]:
    text = resources.files("basal_local.assets").joinpath("sample_requests.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]
