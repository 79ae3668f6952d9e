"""The work table of the tree-attention kernel: which queries a tile holds and which key ranges it visits.

Pure NumPy (built on the host once per forward, sent as one int32 buffer). docs/ARCHITECTURE.md: the keys a query
of block b sees are exactly the positions 0..pos(query) of its own prompt: the cached prefix (positions
0..n_pre-1), then each ancestor block root first, then its own block up to itself. So a tile of queries of
one block needs only its key *ranges* in position order; visibility is `key position <= query position`,
and no mask tensor exists. Keys are visited in fixed tiles of key *position* (0..BLOCK_N-1, BLOCK_N.., ...),
so the reduction order of a query never depends on what else is packed beside it (bitwise batch invariance).

One record of `RECORD` int32 per tile:
  [0] q_off   first entry of the tile in the query-row list
  [1] n_q     queries in the tile (<= BLOCK_M)
  [2] n_keys  key positions the tile visits (max query position + 1)
  [3] n_pre   cached-prefix length (keys at positions < n_pre are prefix keys)
  [4] pre_off row of the prefix in the per-layer prefix K/V buffer
  [5] n_r     number of forward key ranges
  [6] chunk   1 + the chunk of keys this record computes (a split tile, `split_tiles`); 0: the whole tile
  [7] slot    the split tile's first scratch slot (its chunk c writes its partial to slot + c)
  [8 + 3r..] (position of the range's first key, its token index in the forward, length), root first
  [59] a_pos  [60] a_end  [61] a_shift: the tile's open range, the longest range of its chain, from key
              position a_pos up to a_end (its end, or past the tile's first query: keys every query of the tile
              sees); a key p there is token p + a_shift. Its whole key tiles load without the range lookup and
              without the select (kernels.py), as a cached prefix's do. NO_OPEN twice where it would be short.

Chunks: a query reduces its keys in chunks of CHUNK_KEYS positions (0..C-1, C..2C-1, ...), each an online
softmax of its own, merged in chunk order (kernels.py `_merge`); a query with at most C keys is one chunk and
nothing is merged. The chunk bounds are fixed positions, so this changes no invariance, and it lets a few long
tiles (questions about a long cached document: a state-cache hit) spread over the device: `split_tiles` gives
such a tile one record per chunk, each its own work item, and the last of them to finish merges the partials in
chunk order, the same arithmetic on the same values as one program walking every chunk: the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from basal_local.backends.host import block_bounds, block_chains

RECORD = 64
MAX_RANGES = (RECORD - 8 - 3) // 3  # 17 blocks deep (the packer stops at 8); words 59-61: the open range
OPEN = RECORD - 5  # word of the open range's first position (then its end, then its shift)
# an open range shorter than this many keys is left out (a third key loop costs more than its few tiles gain: 32
# prompts of 200 tokens ran their attention ~20 % slower with it); NO_OPEN marks none (every key loop bound then
# falls back to the tile's: kernels.py)
OPEN_MIN_KEYS = 640
NO_OPEN = 1 << 30
# key positions per chunk (a multiple of every tiling's BLOCK_N): a state-cache hit's ~18k cached keys are 5 chunks
CHUNK_KEYS = 4096
# tilings of at most this many rows split tiles (a wider one runs forwards of many tiles; its kernel leaves it out)
SPLIT_ROWS = 128


@dataclass
class TilePlan:
    tiles: np.ndarray  # [n_tiles, RECORD] int32
    q_rows: np.ndarray  # [n_queries] int32 token index of each query, tile after tile

    @property
    def num_tiles(self) -> int:
        return int(self.tiles.shape[0])


def tile_plan(positions: np.ndarray, token_block: np.ndarray, block_parent: np.ndarray,
              block_prefix: np.ndarray, prefix_rows: list[tuple[int, int]], block_m: int,
              rows: np.ndarray | None = None) -> TilePlan:
    """Tiles of at most `block_m` queries of one block each.

    prefix_rows[j] = (row offset in the prefix K/V buffer, length) of the batch's j-th cached prefix.
    `rows`: only these queries (the readout rows of the last layer), one tile each; else every token.
    Built per block in Python and per tile in NumPy (this runs on the host before every forward).
    """
    blocks = _blocks(positions, token_block, block_parent, block_prefix, prefix_rows)
    return _tiles(blocks, positions, token_block, block_m, rows)


def tile_plans(positions: np.ndarray, token_block: np.ndarray, block_parent: np.ndarray,
               block_prefix: np.ndarray, prefix_rows: list[tuple[int, int]], block_m: int,
               rows: np.ndarray) -> tuple[TilePlan, TilePlan]:
    """`tile_plan` of every token and of `rows` (a forward's layers and its last layer's readouts), the blocks'
    part of the records built once for both (the host's work before every forward)."""
    blocks = _blocks(positions, token_block, block_parent, block_prefix, prefix_rows)
    return (_tiles(blocks, positions, token_block, block_m, None),
            _tiles(blocks, positions, token_block, block_m, rows))


def _blocks(positions, token_block, block_parent, block_prefix, prefix_rows) -> tuple[list, list, list[list[int]]]:
    """Each block's bounds and the part of its tiles' records that does not depend on the tile."""
    n_blocks = len(block_parent)
    start, end = block_bounds(token_block, n_blocks)
    starts, ends = start.tolist(), end.tolist()
    prefixes = np.asarray(block_prefix).tolist()
    pos = np.asarray(positions, dtype=np.int64)
    n = pos.shape[0]
    first_pos = pos[np.minimum(start, max(n - 1, 0))].tolist() if n else [0] * n_blocks
    # per block: the part of a record that does not depend on the tile (n_pre, pre_off, n_r, key ranges);
    # plain lists: a single decision has a handful of blocks and NumPy's per-call cost would dominate
    heads: list[list[int]] = []
    chains = block_chains(block_parent)
    for b in range(n_blocks):
        chain = [c for c in chains[b] if ends[c] > starts[c]]
        if len(chain) > MAX_RANGES:
            raise ValueError(f"tree depth {len(chain)} exceeds the kernel's {MAX_RANGES} key ranges")
        j = prefixes[b]
        pre_off, n_pre = prefix_rows[j] if j >= 0 else (0, 0)
        rec = [0, 0, 0, n_pre, pre_off, len(chain), 0, 0]
        for c in chain:
            rec += (first_pos[c], starts[c], ends[c] - starts[c])
        rec += [0] * (RECORD - len(rec))
        if chain:  # the open range: the longest (ties: the first, nearest the root)
            c = max(chain, key=lambda c: ends[c] - starts[c])
            rec[OPEN:OPEN + 3] = first_pos[c], first_pos[c] + ends[c] - starts[c], starts[c] - first_pos[c]
        heads.append(rec)
    return starts, ends, heads


def _tiles(blocks: tuple[list, list, list[list[int]]], positions: np.ndarray, token_block: np.ndarray, block_m: int,
           rows: np.ndarray | None) -> TilePlan:
    """The tiles of `blocks` (`_blocks`): of every token, or one per row of `rows`."""
    starts, ends, heads = blocks
    n_blocks = len(heads)
    pos = np.asarray(positions, dtype=np.int64)
    if rows is None:
        tile_block = [b for b in range(n_blocks) for _ in range(starts[b], ends[b], block_m)]
        q_rows = np.arange(starts[0], ends[-1], dtype=np.int64) if n_blocks else np.zeros(0, np.int64)
        if n_blocks and q_rows.size != sum(e - s for s, e in zip(starts, ends)):  # blocks not contiguous
            q_rows = np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in zip(starts, ends)])
        n_q = [min(block_m, ends[b] - s) for b in range(n_blocks) for s in range(starts[b], ends[b], block_m)]
    else:
        q_rows = np.asarray(rows, dtype=np.int64).ravel()
        tile_block = np.asarray(token_block)[q_rows].tolist() if q_rows.size else []
        n_q = [1] * len(tile_block)
    if not tile_block:
        return TilePlan(np.zeros((0, RECORD), dtype=np.int32), np.zeros(0, dtype=np.int32))
    n_q_arr = np.asarray(n_q, dtype=np.int64)
    q_off = np.concatenate([[0], np.cumsum(n_q_arr)[:-1]])
    tiles = np.array(heads, dtype=np.int32)[np.asarray(tile_block)]
    tiles[:, 0] = q_off
    tiles[:, 1] = n_q_arr
    tiles[:, 2] = np.maximum.reduceat(pos[q_rows], q_off) + 1
    # every query of a tile sees the open range up to its first query (a tile's queries are one block's, in order;
    # an ancestor's range ends before the block starts, so only the tile's own block's range is cut)
    tiles[:, OPEN + 1] = np.minimum(tiles[:, OPEN + 1], pos[q_rows[q_off]] + 1)
    tiles[tiles[:, OPEN + 1] - tiles[:, OPEN] < OPEN_MIN_KEYS, OPEN:OPEN + 2] = NO_OPEN
    # the longest tiles first: a persistent grid then ends evenly (the order never changes a result)
    tiles = tiles[np.argsort(-tiles[:, 2], kind="stable")]
    return TilePlan(np.ascontiguousarray(tiles), q_rows.astype(np.int32))


def split_tiles(plan: TilePlan, n_kv: int, programs: int, cap: int, slot_cap: int,
                chunk: int = CHUNK_KEYS) -> tuple[TilePlan, int]:
    """The plan with its longest tiles split into one record per chunk of keys (words 6 and 7) where its work
    items (tiles x K/V heads) are fewer than `programs` (the device's SMs) and would leave most of it idle; at most
    `cap` records and `slot_cap` scratch slots in all. Returns the plan and the slots it uses. Splitting never
    changes a result (module doc), so any choice here is as exact as any other: this one aims at an even end."""
    tiles = plan.tiles
    n = tiles.shape[0]
    if n == 0 or n * n_kv >= programs or int(tiles[:, 2].max()) <= chunk:  # (a single decision: no long tile)
        return plan, 0
    n_keys = tiles[:, 2].astype(np.int64)
    chunks = -(-n_keys // chunk)
    if int(chunks.max()) < 2:
        return plan, 0
    split = np.zeros(n, dtype=bool)
    records, slots = n, 0
    for t in np.argsort(-n_keys, kind="stable").tolist():  # the longest first, while they fit
        c = int(chunks[t])
        if c < 2 or records + c - 1 > cap or slots + c > slot_cap:
            continue
        split[t] = True
        records += c - 1
        slots += c
    if not split.any():
        return plan, 0
    per = np.where(split, chunks, 1)
    out = tiles[np.repeat(np.arange(n), per)].copy()
    first = np.repeat(np.cumsum(per) - per, per)
    c = np.arange(out.shape[0]) - first  # the chunk of each record within its tile
    is_split = np.repeat(split, per)
    base = np.cumsum(np.where(split, chunks, 0)) - np.where(split, chunks, 0)  # each split tile's first slot
    out[:, 6] = np.where(is_split, c + 1, 0)
    out[:, 7] = np.where(is_split, np.repeat(base, per), 0)
    # the most keys first (a chunk of a split tile: its own keys), so the persistent grid ends evenly
    work = np.where(is_split, np.minimum(chunk, np.repeat(n_keys, per) - c * chunk), np.repeat(n_keys, per))
    out = out[np.argsort(-work, kind="stable")]
    return TilePlan(np.ascontiguousarray(out), plan.q_rows), slots
