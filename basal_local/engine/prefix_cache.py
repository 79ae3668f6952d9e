"""The cross-request state cache: a radix tree of computed prefixes over token ids, with their K/V in a pool.

A prompt is template + state + question. The K/V of its first n tokens depend only on those n tokens (causal
attention, positions 0..n-1), so a prompt may continue any computed prefix it shares tokens with, for as many
tokens as it shares: the backend reads those keys from the pool instead of computing them. The keys a query
sees, and the order the attention visits them in (fixed tiles of key *positions*, cuda_kernels/plan.py and
metal_shaders/tree_attention.metal), are the same whether a key comes from the pool or from the forward, and the
pool's rows are bit for bit what a forward computes (the forward is batch-invariant), so an answer with a hit is
bitwise the one without on CUDA and Metal; on the CPU the library GEMMs differ by row count (within 1e-6).

Storage: each entry is one run of contiguous pool rows holding its whole path (template included): the
attention kernels read a cached prefix as one range (`pre_off`, `n_pre`). The tree indexes entries for lookup:
a node lists the entries whose tokens pass through it, so a prompt that leaves an entry mid-way still uses its
first rows. The chat template of each language is a pinned entry; documents become entries when a batch
computes them (`Lease`: the rows are allocated at launch, written by that forward, and found by lookups only
once it completed). Entries no batch reads are evicted least recently used first when rows are needed; running
out of rows only means a prompt is computed in full, never a failed request.

Thread safety: planners (sizes), lanes (packing, leases) and the stats reader call in from several threads;
one lock guards the tree, the allocator and the counters.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..model.tokenizer import common_prefix_len

# a batch stores a request's shared prefix only when it computes at least this many tokens of it: below, a hit
# saves little and the pool's rows are better spent on documents (a state of a few sentences costs a few ms)
FILL_MIN_TOKENS = 256
# a prompt continues a document's entry only where that saves at least this many tokens over the template alone
# (documents often begin alike: reading two shared words off an entry would hold it against eviction for nothing)
HIT_MIN_TOKENS = 64
STATE = "state-"  # the names of entries a batch computed (templates are named by their language)


def is_state(name: str | None) -> bool:
    return bool(name) and name.startswith(STATE)


@dataclass(eq=False)
class Entry:
    """One stored prefix: K/V of `tokens` in pool rows offset .. offset + len(tokens) - 1."""

    name: str
    tokens: list[int] = field(repr=False)
    offset: int
    pinned: bool = False
    ready: bool = False
    refs: int = 0
    last_used: float = 0.0
    nodes: list[_Node] = field(default_factory=list, repr=False)  # the tree nodes on its path (once ready)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(eq=False)
class _Node:
    tokens: list[int]  # the edge's tokens
    children: dict[int, _Node] = field(default_factory=dict, repr=False)
    parent: _Node | None = field(default=None, repr=False)
    entries: dict[str, Entry] = field(default_factory=dict, repr=False)  # ready entries passing through this node
    pinned: Entry | None = field(default=None, repr=False)  # a template among them: what a prompt that ends its match here continues


@dataclass(eq=False)
class Walk:
    """Where a lookup stands (`PrefixCache.walk`) as of the tree's `generation`: the node reached, the tokens
    matched (i), the entry it continues, the template it passed and how far that covered."""

    node: _Node
    generation: int
    i: int = 0
    holder: Entry | None = None
    pinned: Entry | None = None
    pinned_at: int = 0
    done: bool = False  # the lookup ends here, whatever follows
    edge: _Node | None = None  # the edge that goes on past the shared tokens, and how many of its tokens match
    agreed: int = 0


@dataclass
class Match:
    """What a prompt continues: an entry's first `length` tokens (length < the prompt's)."""

    entry: Entry
    length: int


class PrefixCache:
    """The radix tree, the pool's row allocator (first fit over free runs) and the LRU eviction of one backend.

    capacity: pool rows (tokens); bytes_per_token: K/V bytes of one token over every layer; enabled False keeps
    nothing (not even the templates: `--prefix-cache off`)."""

    def __init__(self, capacity: int, bytes_per_token: int, enabled: bool = True, setting: str = "auto") -> None:
        self.capacity = max(0, int(capacity)) if enabled else 0
        self.bytes_per_token = int(bytes_per_token)
        self.enabled = enabled
        self.setting = setting
        self.lock = threading.RLock()
        self.root = _Node([])
        self.entries: dict[str, Entry] = {}  # every entry holding rows (pending and ready)
        self.pending: dict[str, Entry] = {}  # the entries a batch in flight is writing
        self.pending_changes = 0  # bumped whenever `pending` changes (with `generation`: when `in_flight` may change)
        self.free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []  # (start, length), sorted
        self._names = itertools.count(1)
        self.generation = 0  # bumped whenever what a lookup can find changes
        self.stats = {"hits": 0, "misses": 0, "hit_tokens": 0, "evictions": 0}
        self.peak_tokens = 0  # the most rows ever held at once (never more than `capacity`)
        self.on_drop: Callable[[str], None] | None = None  # the backend forgets an entry's name (MLX frees it)

    # ---- lookups ---------------------------------------------------------------------------------------------
    def match(self, ids: Sequence[int], start: Walk | None = None) -> Match | None:
        """The longest computed prefix of `ids` (at most len(ids) - 1 tokens: the last token is always computed).
        `start`: a `walk` over ids' first tokens, not read again (unless the tree changed since)."""
        ids = ids if type(ids) is list else list(ids)
        with self.lock:
            fresh = start is None or start.generation != self.generation
            limit = len(ids) - 1
            w = start if not fresh and (start.done or start.i >= limit) else \
                self._advance(ids, Walk(self.root, self.generation) if fresh else dataclasses.replace(start), limit)
            if w.holder is None or w.i <= 0:
                return None
            if not w.holder.pinned and w.pinned is not None and min(w.i, limit) - w.pinned_at < HIT_MIN_TOKENS:
                return Match(w.pinned, min(w.pinned_at, limit))
            return Match(w.holder, min(w.i, limit))

    def walk(self, ids: Sequence[int], length: int) -> Walk:
        """`match` over ids[:length], what all of a request's prompts share, once for all: `match(prompt, walk)`."""
        ids = ids if type(ids) is list else list(ids)
        with self.lock:  # below every such prompt's limit (its length - 1)
            return self._advance(ids, Walk(self.root, self.generation), min(length, len(ids)) - 1, shared=True)

    @staticmethod
    def _advance(ids: list[int], w: Walk, stop: int, shared: bool = False) -> Walk:
        """`w` walked on along `ids` up to `stop`; `shared`: where several prompts' shared tokens end (`w.edge`)."""
        while not w.done and w.i < stop:
            child = w.edge if w.edge is not None else w.node.children.get(ids[w.i])
            if child is None:
                w.done = True
                break
            n = len(child.tokens)
            if w.edge is not None:  # only the edge's tokens past the shared ones are compared
                k = w.agreed + common_prefix_len(child.tokens[w.agreed:], ids[w.i + w.agreed:w.i + n])
                w.edge, w.agreed = None, 0
            elif shared and w.i + n > stop:  # the edge goes on past the shared tokens: its part within them, once
                m = stop - w.i
                k = common_prefix_len(child.tokens[:m], ids[w.i:stop]) if m > 1 else 1
                if k == m:
                    w.edge, w.agreed = child, m
                    break
            else:
                k = common_prefix_len(child.tokens, ids[w.i:w.i + n]) if n > 1 else 1  # >= 1: the first token matched
            # within a template a prompt continues the template itself (pinned: it holds no row an eviction frees)
            w.holder = child.pinned or next(iter(child.entries.values()))
            w.i += k
            if child.pinned is not None:
                w.pinned, w.pinned_at = child.pinned, min(w.i, child.pinned.length)
            if k < n:
                w.done = True
                break
            w.node = child
        return w

    def in_flight(self, ids: Sequence[int]) -> bool:
        """Whether a batch in flight is storing at least FILL_MIN_TOKENS more of `ids` than a lookup finds now:
        a request about a document another batch is computing waits for it (`Lane._admit`) rather than
        computing it a second time beside it."""
        with self.lock:
            pending = list(self.pending.values())
            if not pending:
                return False
            ids = ids if type(ids) is list else list(ids)
            have = m.length if (m := self.match(ids)) else 0
            return any(common_prefix_len(e.tokens, ids) - have >= FILL_MIN_TOKENS for e in pending)

    def split(self, ids: Sequence[int], lang: str = "", start: Walk | None = None) -> tuple[str | None, int]:
        """(name of the entry a prompt continues, or None; how many of its tokens): the packer's view."""
        m = self.match(ids, start)
        return (m.entry.name, m.length) if m else (None, 0)

    # ---- the templates ---------------------------------------------------------------------------------------
    def pin(self, name: str, tokens: Sequence[int]) -> Entry | None:
        """Rows for a template (never evicted); the backend computes them, then `publish`. None if no room."""
        with self.lock:
            if not self.enabled:
                return None
            offset = self._allocate(len(tokens), evict=False)
            if offset is None:
                return None
            entry = Entry(name, list(tokens), offset, pinned=True)
            self.entries[name] = entry
            return entry

    def publish(self, entry: Entry) -> None:
        """The entry's rows are written: lookups may find it."""
        with self.lock:
            if entry.name not in self.entries or entry.ready:
                return
            entry.ready = True
            self._settle(entry)
            entry.last_used = time.monotonic()
            self._insert(entry)
            self.generation += 1

    # ---- leases (one per launched batch) --------------------------------------------------------------------
    def lease(self) -> Lease:
        return Lease(self)

    def reserve(self, tokens: Sequence[int]) -> Entry | None:
        """Rows for a new entry a batch will compute (evicting unused entries if needed); None if no room or the
        same tokens are already stored or being stored."""
        with self.lock:
            if not self.enabled or len(tokens) > self.capacity:
                return None
            for e in self.entries.values():
                if e.length == len(tokens) and e.tokens == list(tokens):
                    return None
            offset = self._allocate(len(tokens), evict=True)
            if offset is None:
                return None
            entry = Entry(f"{STATE}{next(self._names)}", list(tokens), offset)
            self.entries[entry.name] = entry
            self.pending[entry.name] = entry
            self.pending_changes += 1
            return entry

    def drop(self, entry: Entry) -> None:
        """Forget an entry (a failed batch's reservation, or an eviction) and free its rows."""
        with self.lock:
            if self.entries.get(entry.name) is not entry:
                return
            del self.entries[entry.name]
            self._settle(entry)
            for node in entry.nodes:
                node.entries.pop(entry.name, None)
            self._prune(entry.nodes)
            entry.nodes = []
            self._release_rows(entry.offset, entry.length)
            if entry.ready:
                self.generation += 1
            if self.on_drop is not None:
                self.on_drop(entry.name)

    def clear(self) -> None:
        """Forget every entry (a model reload): the pool's rows all free."""
        with self.lock:
            self.root = _Node([])
            self.entries.clear()
            self.pending.clear()
            self.pending_changes += 1
            self.free, self.peak_tokens = ([(0, self.capacity)] if self.capacity else []), 0
            self.generation += 1

    def _settle(self, entry: Entry) -> None:
        """A pending entry is written (or forgotten): no batch in flight stores it any more."""
        if self.pending.pop(entry.name, None) is not None:
            self.pending_changes += 1

    # ---- the tree --------------------------------------------------------------------------------------------
    def _insert(self, entry: Entry) -> None:
        node, i, ids = self.root, 0, entry.tokens
        path: list[_Node] = []
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                leaf = _Node(ids[i:], parent=node)
                node.children[ids[i]] = leaf
                path.append(leaf)
                break
            k = common_prefix_len(child.tokens, ids[i:i + len(child.tokens)])
            if k < len(child.tokens):  # split the edge at k: a middle node the old child hangs under
                mid = _Node(child.tokens[:k], parent=node, entries=dict(child.entries), pinned=child.pinned)
                node.children[ids[i]] = mid
                child.tokens = child.tokens[k:]
                child.parent = mid
                mid.children[child.tokens[0]] = child
                for e in child.entries.values():
                    e.nodes.insert(e.nodes.index(child), mid)
                child = mid
            path.append(child)
            node, i = child, i + k
        for n in path:
            n.entries[entry.name] = entry
            if entry.pinned:
                n.pinned = entry
        entry.nodes = path

    def _prune(self, nodes: list[_Node]) -> None:
        for node in reversed(nodes):
            if not node.entries and node.parent is not None:
                node.parent.children.pop(node.tokens[0], None)

    # ---- the pool's rows -------------------------------------------------------------------------------------
    def _allocate(self, n: int, evict: bool) -> int | None:
        while True:
            for i, (start, length) in enumerate(self.free):
                if length >= n:
                    if length == n:
                        del self.free[i]
                    else:
                        self.free[i] = (start + n, length - n)
                    self.peak_tokens = max(self.peak_tokens, self.capacity - sum(ln for _, ln in self.free))
                    return start
            if not evict:
                return None
            idle = [e for e in self.entries.values() if e.ready and not e.pinned and e.refs == 0]
            if not idle or not self._room_without(idle, n):
                return None  # evicting every idle entry would not make room: evict none
            victim = min(idle, key=lambda e: e.last_used)
            self.drop(victim)
            self.stats["evictions"] += 1

    def _room_without(self, idle: list[Entry], n: int) -> bool:
        """Whether a run of n free rows exists once the idle entries' rows are free."""
        held = sorted((e.offset, e.offset + e.length) for e in self.entries.values() if e not in idle)
        at = 0
        for start, end in held + [(self.capacity, self.capacity)]:
            if start - at >= n:
                return True
            at = max(at, end)
        return False

    def _release_rows(self, start: int, n: int) -> None:
        if n <= 0:
            return
        merged: list[tuple[int, int]] = []
        for s, ln in sorted(self.free + [(start, n)]):
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + ln)
            else:
                merged.append((s, ln))
        self.free = merged

    # ---- what /api/stats shows -------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        with self.lock:
            ready = [e for e in self.entries.values() if e.ready]
            tokens = sum(e.length for e in self.entries.values())
            return {"enabled": self.enabled, "setting": self.setting,
                    "budget_bytes": self.capacity * self.bytes_per_token, "bytes": tokens * self.bytes_per_token,
                    "peak_bytes": self.peak_tokens * self.bytes_per_token, "nodes": len(ready), "pinned": sum(e.pinned for e in ready), "tokens": tokens,
                    "capacity_tokens": self.capacity, **self.stats}


class Lease:
    """The entries one batch reads (held against eviction until it completes) and the ones it writes."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.used: list[Entry] = []
        self.filled: list[Entry] = []

    def use(self, name: str) -> Entry:
        with self.cache.lock:
            entry = self.cache.entries[name]
            entry.refs += 1
            entry.last_used = time.monotonic()
            self.used.append(entry)
            return entry

    def fill(self, tokens: Sequence[int]) -> Entry | None:
        entry = self.cache.reserve(tokens)
        if entry is not None:
            self.filled.append(entry)
        return entry

    def count(self, jobs: int, hit_jobs: int, hit_tokens: int) -> None:
        with self.cache.lock:
            self.cache.stats["hits"] += hit_jobs
            self.cache.stats["misses"] += jobs - hit_jobs
            self.cache.stats["hit_tokens"] += hit_tokens

    def commit(self) -> None:
        """The batch completed: its new entries become findable, the ones it read may be evicted again."""
        with self.cache.lock:
            for entry in self.filled:
                self.cache.publish(entry)
            self._release()

    def abort(self) -> None:
        """The batch failed: what it was writing is forgotten."""
        with self.cache.lock:
            for entry in self.filled:
                self.cache.drop(entry)
            self._release()

    def _release(self) -> None:
        for entry in self.used:
            entry.refs -= 1
        self.used, self.filled = [], []
