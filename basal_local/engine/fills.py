"""The batch side of the state cache: which entries a packed batch reads, and which new entry each of its jobs
stores (the tokens all the job's prompts share, attached to the forward as a `Fill`); what routing between
replicas compares (a request's shared prefix, a replica's recent documents)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from basal_local.backends.base import Fill
from basal_local.backends.host import block_bounds, block_chains

from ..model.tokenizer import common_prefix_len
from .prefix_cache import FILL_MIN_TOKENS, Lease, is_state


def shared_prefix(specs: Sequence) -> list[int]:
    """The tokens all of a request's prompts share (template + state + what its questions share); all but the last
    token of a one-prompt request: what a batch stores for it, and what routing looks for."""
    ids0 = specs[0].token_ids if type(specs[0].token_ids) is list else list(specs[0].token_ids)
    head = specs[0].head
    # the ids the request's head says they all share are not compared again (a document's 18k per prompt)
    known = head.length if head is not None and all(s.head is head for s in specs) else 0
    shared = len(ids0) - 1
    for spec in specs[1:]:
        ids = spec.token_ids if type(spec.token_ids) is list else list(spec.token_ids)
        shared = min(shared, known + common_prefix_len(ids0[known:], ids[known:]))
    return ids0[:max(0, shared)]


REMEMBERED_DOCUMENTS = 64  # per replica: the documents recently routed to it, which routing looks for


def document_overlap(known: Sequence[list[int]], shared: list[int]) -> int:
    """The most tokens `shared` has in common with any of `known` (a replica's recent documents); a quick look at
    the first tokens first (documents after the same template differ early)."""
    best = 0
    head = min(len(shared), 256)
    for doc in known:
        if doc[:head] == shared[:head]:
            best = max(best, common_prefix_len(doc, shared))
    return best


def plan_fills(jobs: Sequence, specs: Sequence, pack, lease: Lease) -> list[int]:
    """Hold every entry the packed forwards continue, and reserve an entry for each job's shared prefix (the
    tokens all its prompts share: template + state + what the questions share; all but the last token of a
    one-prompt job) where the batch computes at least FILL_MIN_TOKENS of it, attached to the forward as a
    `Fill` of its first prompt's token indices. Returns per job the tokens its prompts continue from the cache
    (the most of any of its prompts); counts hits (a job continuing a cached state) and misses."""
    if not lease.cache.enabled:  # --prefix-cache off: nothing read, nothing stored, every job a miss
        lease.count(len(jobs), 0, 0)
        return [0] * len(jobs)
    for b in pack.batches:
        for name in dict.fromkeys(b.prefixes):
            lease.use(name)
    bounds: list = [None] * len(pack.batches)  # block bounds of a forward, once a job of it may be stored
    chains = [block_chains(b.block_parent) for b in pack.batches]
    cached, hits, hit_tokens, at = [], 0, 0, 0
    for job in jobs:
        n = len(job.specs)
        best, hit, places = 0, False, []
        for p in range(at, at + n):
            bn, r, _ = pack.readouts[p]
            b = pack.batches[bn]
            chain = chains[bn][int(b.token_block[b.readout_index[r]])]
            j = int(b.block_prefix[chain[0]])
            name = b.prefixes[j] if j >= 0 else None
            used = (b.prefix_lengths[j] if b.prefix_lengths else 0) if j >= 0 else 0
            best = max(best, used)
            hit = hit or is_state(name)
            places.append((bn, chain, name, used))
        ids0 = specs[at].token_ids
        cached.append(best)
        hits += hit
        hit_tokens += best if hit else 0
        bn, chain, name, used = places[0]
        # the shared prefix is at most all but the last token of the first prompt: a job too short to store
        # needs no comparison of its prompts
        if len(ids0) - 1 - used < FILL_MIN_TOKENS:
            at += n
            continue
        for b in {p[0] for p in places}:
            if bounds[b] is None:
                bounds[b] = block_bounds(pack.batches[b].token_block, len(pack.batches[b].block_parent))
        shared = _packed_shared(places, pack.batches, bounds)
        if shared is None:
            shared = len(shared_prefix(specs[at:at + n]))
        at += n
        if shared - used < FILL_MIN_TOKENS:
            continue
        entry = lease.fill(list(ids0[:shared]))
        if entry is None:
            continue
        starts, ends = bounds[bn]
        idx = np.concatenate([np.arange(starts[c], ends[c], dtype=np.int64) for c in chain])[: shared - used]
        pack.batches[bn].fills.append(Fill(entry.name, entry.offset, name, used, idx))
    lease.count(len(jobs), hits, hit_tokens)
    return cached


def _packed_shared(places: list[tuple[int, list[int], str | None, int]], batches, bounds) -> int | None:
    """len(shared_prefix(...)) of one job's prompts read from where the packer put them (batch, block chain, cached
    prefix, tokens of it used): blocks a trie shares hold the same tokens, so only the first blocks that differ
    are compared (a few question tokens, not the 18k of a document, in the lane thread). None where the packing
    cannot tell (prompts after different cached prefixes, or a differing block that is all a prefix of the other)."""
    bn0, chain0, name, used = places[0]
    if any(p[2] != name or p[3] != used for p in places[1:]):
        return None

    def length(bn: int, chain: list[int]) -> int:
        starts, ends = bounds[bn]
        return used + sum(int(ends[c] - starts[c]) for c in chain)

    def tokens(bn: int, c: int) -> np.ndarray:
        starts, ends = bounds[bn]
        return batches[bn].token_ids[starts[c]:ends[c]]

    shared = length(bn0, chain0) - 1  # all but the last token of the first prompt
    for bn, chain, _, _ in places[1:]:
        k = 0
        while bn == bn0 and k < len(chain0) and k < len(chain) and chain0[k] == chain[k]:
            k += 1
        if k == len(chain0) or k == len(chain):  # one prompt ends where the other goes on (or they are equal)
            shared = min(shared, length(bn0, chain0[:k]))
            continue
        x, y = tokens(bn0, chain0[k]), tokens(bn, chain[k])
        m = min(len(x), len(y))
        diff = np.flatnonzero(x[:m] != y[:m])
        if not diff.size:
            return None
        shared = min(shared, length(bn0, chain0[:k]) + int(diff[0]))
    return max(0, shared)
