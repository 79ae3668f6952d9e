"""engine/fills.py: what a packed batch stores in the state cache. The shared prefix of a job's prompts is read
from the packed tries (`_packed_shared`); the reference is the token comparison of the prompts themselves
(`shared_prefix`), on random request streams, at every packing depth."""

from __future__ import annotations

import random

import numpy as np
import pytest

from basal_local.engine import fills
from basal_local.engine.packer import PromptSpec, pack_prompts
from basal_local.engine.prefix_cache import FILL_MIN_TOKENS, PrefixCache


class Job:
    def __init__(self, specs):
        self.specs = specs


def _jobs(rng: random.Random) -> list[Job]:
    template = [1, 2, 3, 4, 5]
    documents = [[rng.randrange(10, 400) for _ in range(rng.choice((40, 300, 700)))] for _ in range(3)]
    jobs = []
    for _ in range(rng.randrange(1, 6)):
        doc = rng.choice(documents)
        head = [rng.randrange(10, 400) for _ in range(rng.choice((0, 3, 30)))]  # what the questions share
        prompts = []
        for _ in range(rng.randrange(1, 5)):
            kind = rng.random()
            if prompts and kind < 0.2:
                prompts.append(list(prompts[-1]))  # the same prompt twice
            elif prompts and kind < 0.35:
                prompts.append(prompts[-1][: rng.randrange(len(template) + 1, len(prompts[-1]))])  # a prefix of one
            else:
                tail = [rng.randrange(10, 400) for _ in range(rng.randrange(1, 12))]
                prompts.append(template + doc + head + tail)
        jobs.append(Job([PromptSpec(p, "en", [7, 8]) for p in prompts]))
    return jobs


def _fills(jobs: list[Job], depth: int, fast: bool, monkeypatch) -> list[tuple]:
    cache = PrefixCache(capacity=1 << 16, bytes_per_token=1)
    template = cache.pin("en", [1, 2, 3, 4, 5])
    cache.publish(template)
    specs = [s for job in jobs for s in job.specs]
    pack = pack_prompts(specs, cache, max_depth=depth)
    if not fast:
        monkeypatch.setattr(fills, "_packed_shared", lambda *a: None)
    lease = cache.lease()
    cached = fills.plan_fills(jobs, specs, pack, lease)
    monkeypatch.undo()
    out = [("cached", tuple(cached))]
    for b in pack.batches:
        for f in b.fills:
            out.append((cache.entries[f.name].tokens, f.offset, f.parent, f.parent_len, f.tokens.tolist()))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_the_packed_shared_prefix_stores_what_the_token_comparison_stores(seed, monkeypatch):
    rng = random.Random(seed)
    jobs = _jobs(rng)
    for depth in (2, 3, 8):
        assert _fills(jobs, depth, True, monkeypatch) == _fills(jobs, depth, False, monkeypatch)


@pytest.mark.parametrize("seed", range(40))
def test_a_job_is_stored_where_the_batch_computes_enough_of_its_shared_prefix(seed):
    """The rule itself, from the prompts' tokens: a job's shared prefix is stored where at least FILL_MIN_TOKENS
    of it are computed (past what its first prompt continues), whatever plan_fills skips to find that out."""
    jobs = _jobs(random.Random(seed))
    cache = PrefixCache(capacity=1 << 16, bytes_per_token=1)
    cache.publish(cache.pin("en", [1, 2, 3, 4, 5]))
    specs = [s for job in jobs for s in job.specs]
    pack = pack_prompts(specs, cache)
    want = []
    for job in jobs:
        shared = fills.shared_prefix(job.specs)
        if len(shared) - cache.split(job.specs[0].token_ids)[1] >= FILL_MIN_TOKENS and shared not in want:
            want.append(shared)
    fills.plan_fills(jobs, specs, pack, cache.lease())
    assert sorted(cache.entries[f.name].tokens for b in pack.batches for f in b.fills) == sorted(want)


@pytest.mark.parametrize("known", [False, True])
def test_a_question_about_a_document_needs_no_token_comparison(known, monkeypatch):
    """Five questions in two orders each after one long document, new or already cached: the shared length comes
    from the tries, or is not needed (cached), and the document's tokens are never compared (the lane thread's cost
    of a state-cache hit)."""
    template = [1, 2, 3, 4, 5]
    doc = [int(t) for t in np.random.default_rng(1).integers(10, 400, 2000)]
    specs = [PromptSpec(template + doc + [q, q + 1, order], "en", [7, 8]) for q in range(500, 510, 2)
             for order in (0, 1)]
    calls, answers = [], []
    real, packed = fills.shared_prefix, fills._packed_shared
    monkeypatch.setattr(fills, "shared_prefix", lambda s: calls.append(len(s)) or real(s))
    monkeypatch.setattr(fills, "_packed_shared", lambda *a: answers.append(packed(*a)) or answers[-1])
    cache = PrefixCache(capacity=1 << 14, bytes_per_token=1)
    if known:
        cache.publish(cache.reserve(template + doc))
    pack = pack_prompts(specs, cache)
    assert [b.prefix_lengths for b in pack.batches] == [[len(template + doc)] if known else []]
    fills.plan_fills([Job(specs)], specs, pack, cache.lease())
    # a cached document leaves fewer than FILL_MIN_TOKENS to store: its prompts are not compared at all
    assert calls == [] and answers == ([] if known else [len(real(specs))]) and len(real(specs)) == len(template + doc)
    stored = [cache.entries[f.name].tokens for b in pack.batches for f in b.fills]
    assert stored == ([] if known else [template + doc])


def test_with_the_cache_off_every_job_is_a_miss_and_nothing_is_stored():
    jobs = _jobs(random.Random(3))
    cache = PrefixCache(capacity=1 << 16, bytes_per_token=1, enabled=False)
    specs = [s for job in jobs for s in job.specs]
    pack = pack_prompts(specs, cache)
    assert fills.plan_fills(jobs, specs, pack, cache.lease()) == [0] * len(jobs)
    assert not any(b.fills for b in pack.batches) and not cache.entries
    assert (cache.stats["hits"], cache.stats["misses"]) == (0, len(jobs))
