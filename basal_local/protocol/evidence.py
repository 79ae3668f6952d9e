"""Evidence spans (docs/PROTOCOL.md §6.8): where the state sits in the prompt, and the span selection.

The head itself (model/evidence_head.py) turns hidden states into per-token start/end log-probabilities;
this module only works with character offsets and those scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

MAX_SPAN_TOKENS = 80
CANDIDATES = 4 * 5
KEEP_GREEDY = 5
KEEP_FINAL = 3
PAD_SCORE = -1e9


def state_chars(prompt: str, state_text: str) -> tuple[int, int] | None:
    """(s0, s1): the state's code-point range in the prompt (first occurrence of LF + state)."""
    at = prompt.find("\n" + state_text)
    if at < 0:
        return None
    s0 = at + 1
    return s0, s0 + len(state_text)


def state_tokens(offsets: Sequence[tuple[int, int]], s0: int, s1: int) -> tuple[int, int] | None:
    """(t0, t1): first and one-past-last token lying wholly inside [s0, s1) with a non-empty span."""
    inside = [i for i, (a, b) in enumerate(offsets) if a >= s0 and b <= s1 and b > a]
    if not inside:
        return None
    return inside[0], inside[-1] + 1


def select_spans(start: np.ndarray, end: np.ndarray, rel_start: Sequence[int], rel_end: Sequence[int],
                 state_text: str, limit: int | None = None) -> list[dict[str, Any]]:
    """Best non-overlapping spans by start_i + end_j (f32), j in [i, i+80); at most 3 items.

    `rel_start`/`rel_end` are each state token's character offsets relative to s0; `limit` (facts injected)
    drops spans starting in the facts block and clips the others to the original state.
    """
    n = int(start.shape[0])
    start = start.astype(np.float32)
    end = end.astype(np.float32)
    i_idx, j_idx = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    valid = (j_idx >= i_idx) & (j_idx < i_idx + MAX_SPAN_TOKENS)
    scores = (start[:, None] + end[None, :]).astype(np.float32)
    flat = np.where(valid, scores, -np.inf).reshape(-1)
    want = min(CANDIDATES, n * n)
    valid_flat = np.flatnonzero(valid.reshape(-1))
    # stable sort by score descending: ties keep the lower flat index i*n+j
    ranked = valid_flat[np.argsort(-flat[valid_flat], kind="stable")][:want]
    pairs = [(int(f // n), int(f % n), float(flat[f])) for f in ranked]
    while len(pairs) < want:  # never happens for n >= 1 with all-valid pairs, kept for the spec's padding
        pairs.append((-1, -1, PAD_SCORE))
    kept: list[tuple[int, int, float]] = []
    for i, j, score in pairs:
        if i < 0 or len(kept) == KEEP_GREEDY:
            continue
        a, b = rel_start[i], rel_end[j]
        if any(a < kb and ka < b for ka, kb, _ in kept):
            continue
        kept.append((a, b, score))
    items = []
    for a, b, score in kept:
        if limit is not None:
            if a >= limit:
                continue
            b = min(b, limit)
        items.append({"text": state_text[a:b], "start": a, "end": b, "probability": float(np.exp(np.float32(score)))})
    return items[:KEEP_FINAL]
