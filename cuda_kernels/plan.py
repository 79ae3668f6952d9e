"""The work table of the tree-attention kernel: which queries a tile holds and which key ranges it visits.

Pure NumPy (built on the host once per forward, sent as one int32 buffer). ENGINE.md §1-§2: the keys a query
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
  [8 + 3r..] (position of the range's first key, its token index in the forward, length), root first
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RECORD = 64
MAX_RANGES = (RECORD - 8) // 3  # 18 blocks deep (the packer stops at 8)


@dataclass
class TilePlan:
    tiles: np.ndarray  # [n_tiles, RECORD] int32
    q_rows: np.ndarray  # [n_queries] int32 token index of each query, tile after tile

    @property
    def num_tiles(self) -> int:
        return int(self.tiles.shape[0])


def block_bounds(token_block: np.ndarray, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    start = np.searchsorted(token_block, np.arange(n_blocks)).astype(np.int64)
    end = np.append(start[1:], token_block.shape[0]).astype(np.int64)
    return start, end


def tile_plan(positions: np.ndarray, token_block: np.ndarray, block_parent: np.ndarray,
              block_prefix: np.ndarray, prefix_rows: list[tuple[int, int]], block_m: int,
              rows: np.ndarray | None = None) -> TilePlan:
    """Tiles of at most `block_m` queries of one block each.

    prefix_rows[j] = (row offset in the prefix K/V buffer, length) of the batch's j-th cached prefix.
    `rows`: only these queries (the readout rows of the last layer), one tile each; else every token.
    """
    n_blocks = len(block_parent)
    start, end = block_bounds(token_block, n_blocks)
    chains: list[list[int]] = []
    for b in range(n_blocks):
        p = int(block_parent[b])
        chains.append((chains[p] if p >= 0 else []) + [b])
    records = []
    q_rows: list[np.ndarray] = []
    q_off = 0

    def record(b: int, queries: np.ndarray) -> np.ndarray:
        chain = [c for c in chains[b] if end[c] > start[c]]
        if len(chain) > MAX_RANGES:
            raise ValueError(f"tree depth {len(chain)} exceeds the kernel's {MAX_RANGES} key ranges")
        rec = np.zeros(RECORD, dtype=np.int32)
        j = int(block_prefix[b])
        pre_off, n_pre = prefix_rows[j] if j >= 0 else (0, 0)
        rec[:6] = (q_off, len(queries), int(positions[queries].max()) + 1, n_pre, pre_off, len(chain))
        for r, c in enumerate(chain):
            rec[8 + 3 * r: 11 + 3 * r] = (positions[start[c]], start[c], end[c] - start[c])
        return rec

    if rows is None:
        for b in range(n_blocks):
            for s in range(int(start[b]), int(end[b]), block_m):
                queries = np.arange(s, min(s + block_m, int(end[b])), dtype=np.int64)
                records.append(record(b, queries))
                q_rows.append(queries)
                q_off += len(queries)
    else:
        for r in np.asarray(rows, dtype=np.int64):
            queries = np.array([r])
            records.append(record(int(token_block[r]), queries))
            q_rows.append(queries)
            q_off += 1
    tiles = np.stack(records) if records else np.zeros((0, RECORD), dtype=np.int32)
    # the longest tiles first: a persistent grid then ends evenly (the order never changes a result)
    tiles = tiles[np.argsort(-tiles[:, 2], kind="stable")]
    rows_out = np.concatenate(q_rows).astype(np.int32) if q_rows else np.zeros(0, dtype=np.int32)
    return TilePlan(tiles, rows_out)
