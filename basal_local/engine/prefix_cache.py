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

import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from basal_local.backends.memory import WARM_OVERHEAD, parse_limit

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


def budget_bytes(setting: str | float, device_memory: tuple[int, int] | None, ram: int | None = None) -> int:
    """`--prefix-cache`: the pool's bytes. `device_memory`: (free, total) of the GPU after the weights (None off a
    GPU). auto: on a GPU of 40 GB or more 60 % of what is free after the warm-up's reserve, 25 % on a smaller one;
    on the CPU or a Mac (unified memory) 5 % of the RAM, at most 2 GiB. A share is of the GPU's free memory (of
    the RAM without a GPU)."""
    text = str(setting).strip().lower()
    if text == "off":
        return 0
    ram = ram if ram is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if text == "auto":
        if device_memory is not None:
            free, total = device_memory
            return int(max(0, free - WARM_OVERHEAD) * (0.6 if total >= 40e9 else 0.25))
        return int(min(2 ** 31, 0.05 * ram))
    kind, number = parse_limit(text, flag="--prefix-cache")
    if kind == "bytes":
        return int(number)
    return int(number * (device_memory[0] if device_memory is not None else ram))


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
    """Where a lookup stands after the edges within a request's shared tokens (`PrefixCache.walk`), as of the
    tree's `generation`: the node reached, the tokens matched, the entry and the template passed; `done` when the
    lookup ends there whatever follows; `edge` and `agreed`, the next edge where it goes on past the shared tokens
    and how many of its tokens they match."""

    node: _Node
    generation: int
    i: int = 0
    holder: Entry | None = None
    pinned: Entry | None = None
    pinned_at: int = 0
    done: bool = False
    edge: _Node | None = None
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
        self.on_drop: Callable[[str], None] | None = None  # the backend forgets an entry's name (MLX frees it)

    # ---- lookups ---------------------------------------------------------------------------------------------
    def match(self, ids: Sequence[int], start: Walk | None = None) -> Match | None:
        """The longest computed prefix of `ids` (at most len(ids) - 1 tokens: the last token is always computed).
        `start`: `walk` over ids' first tokens, the same answer without reading them again (ignored once the tree
        changed since)."""
        ids = ids if type(ids) is list else list(ids)
        with self.lock:
            if start is None or start.generation != self.generation:
                start = Walk(self.root, self.generation)
            node, i, holder, pinned, pinned_at = start.node, start.i, start.holder, start.pinned, start.pinned_at
            edge, agreed = start.edge, start.agreed  # the walk's next edge and how many of its tokens match
            limit = len(ids) - 1
            while not start.done and i < limit:
                child = edge if edge is not None else node.children.get(ids[i])
                if child is None:
                    break
                n = len(child.tokens)
                if edge is not None:  # only the edge's tokens past the walk's are compared
                    k = agreed + common_prefix_len(child.tokens[agreed:], ids[i + agreed:i + n])
                    edge = None
                else:
                    k = common_prefix_len(child.tokens, ids[i:i + n]) if n > 1 else 1  # >= 1: the first token matched
                holder, i, pinned, pinned_at = self._passed(child, k, i, holder, pinned, pinned_at)
                if k < n:
                    break
                node = child
            if holder is None or i <= 0:
                return None
            if not holder.pinned and pinned is not None and min(i, limit) - pinned_at < HIT_MIN_TOKENS:
                return Match(pinned, min(pinned_at, limit))
            return Match(holder, min(i, limit))

    @staticmethod
    def _passed(child: _Node, k: int, i: int, holder: Entry | None, pinned: Entry | None,
                pinned_at: int) -> tuple[Entry, int, Entry | None, int]:
        """A lookup matched k tokens of `child`'s edge from ids[i]: the entry it continues, its new length, the
        template it passed and how far that covered."""
        # within a template a prompt continues the template itself (pinned: it never holds a row a document's
        # entry would otherwise free)
        holder = child.pinned or next(iter(child.entries.values()))
        i += k
        if child.pinned is not None:
            pinned, pinned_at = child.pinned, min(i, child.pinned.length)
        return holder, i, pinned, pinned_at

    def walk(self, ids: Sequence[int], length: int) -> Walk:
        """`match`'s walk over the first `length` of `ids` (the tokens every prompt of a request shares, each
        prompt at least `length` long), once for all those prompts: `match(prompt, walk)` goes on from there."""
        ids = ids if type(ids) is list else list(ids)
        with self.lock:
            w = Walk(self.root, self.generation)
            stop = min(length, len(ids)) - 1  # below every such prompt's limit (its length - 1)
            while w.i < stop:
                child = w.node.children.get(ids[w.i])
                if child is None:
                    w.done = True
                    break
                n = len(child.tokens)
                if w.i + n > stop:  # the edge goes on past the shared tokens: compare its part within them once
                    m = stop - w.i
                    k = common_prefix_len(child.tokens[:m], ids[w.i:stop]) if m > 1 else 1
                    if k == m:
                        w.edge, w.agreed = child, m
                        break
                else:
                    k = common_prefix_len(child.tokens, ids[w.i:w.i + n]) if n > 1 else 1
                w.holder, w.i, w.pinned, w.pinned_at = self._passed(child, k, w.i, w.holder, w.pinned, w.pinned_at)
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
            m = self.match(ids)
            have = m.length if m else 0
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
            self.free = [(0, self.capacity)] if self.capacity else []
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
        self.free.append((start, n))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for s, ln in self.free:
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
                    "nodes": len(ready), "pinned": sum(e.pinned for e in ready), "tokens": tokens,
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
