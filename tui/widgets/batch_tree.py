"""A batch as the engine packed it: rows (one prefix trie per language) -> template -> state -> question -> orders.

A row that continues a state the state cache holds (`cache_hit`) gets the cached template + state as its first
block, marked as coming from the cache; its computed blocks hang below it.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from .format import ms, short_id

KIND_STYLE = {"template": "magenta", "state": "cyan", "question": "yellow", "order": "green"}
CACHED = "\u21ba"  # the mark of what a row continues from the state cache
CACHED_STYLE = "bold magenta"


def cached_tokens(row: dict[str, Any]) -> int:
    """Tokens a row continues from a cached node (the template, or a cached template + state)."""
    if "cached_tokens" in row:
        return int(row.get("cached_tokens") or 0)
    return int(row.get("prefix_tokens") or 0) if row.get("prefix") else 0  # a daemon without the state cache


def hit_tokens(batch: dict[str, Any]) -> int:
    """Tokens the batch's rows continued from cached states (0: no row hit the state cache)."""
    return sum(cached_tokens(row) for row in batch.get("tree") or [] if row.get("cache_hit"))


def batch_label(batch: dict[str, Any]) -> Text:
    packed, unpacked = batch.get("packed_tokens", 0), batch.get("unpacked_tokens", 0)
    saved = 100.0 * (1 - packed / unpacked) if unpacked else 0.0
    text = Text()
    text.append(f"batch {batch.get('batch_id')}", style="bold")
    text.append(f"  {batch.get('model')}/{batch.get('lane')}  {batch.get('requests')} req "
                f"{batch.get('questions')} q  {packed:,}/{unpacked:,} tok ({saved:.0f} % saved)  "
                f"{ms(batch.get('compute_ms'))} ms")
    return text


def row_label(n: int, row: dict[str, Any]) -> Text:
    text = Text(f"row {n} [{row.get('lang')}] ", style="bold")
    if row.get("cache_hit"):
        text.append(f"{CACHED} {cached_tokens(row):,} tok from the state cache + ", style=CACHED_STYLE)
    elif cached_tokens(row):
        text.append(f"cached template {cached_tokens(row):,} tok + ", style=KIND_STYLE["template"])
    text.append(f"{row.get('tokens', 0):,} tok, {row.get('prompts', 0)} prompts")
    return text


def cached_label(row: dict[str, Any]) -> Text:
    """The block a cache-hit row continues: the template and the state, computed by an earlier batch."""
    text = Text(f"{CACHED} template + state {cached_tokens(row):,} tok", style=CACHED_STYLE)
    text.append("  cached: not computed in this batch", style="dim")
    return text


def block_label(block: dict[str, Any], labelled: bool = False) -> Text:
    """`kind N tok`, the unit ("multi: label", "round 2") of a question block, the owners of a leaf; a leaf
    names its owners' unit unless a block above it (`labelled`) already did."""
    kind = block.get("kind", "block")
    text = Text()
    text.append(f"{kind} ", style=KIND_STYLE.get(kind, ""))
    text.append(f"{block.get('tokens', 0)} tok")
    if block.get("unit"):
        text.append(f"  {block['unit']}", style="bold")
    owners = block.get("owners") or []
    if owners:
        names = ", ".join(f"{short_id(str(o[0]))}:{o[1]}#{o[2]}" for o in owners[:3])
        more = f" +{len(owners) - 3}" if len(owners) > 3 else ""
        text.append(f"  \u2190 {names}{more}", style="dim")
        units = {o[3] for o in owners if len(o) > 3 and o[3]}
        if units and not labelled and not block.get("unit"):
            text.append(f" ({', '.join(sorted(units))})", style="bold")
    return text


def _add_blocks(node: TreeNode, blocks: list[dict[str, Any]], expand_depth: int, labelled: bool = False) -> None:
    for block in blocks:
        children = block.get("children") or []
        if children:
            child = node.add(block_label(block, labelled), expand=expand_depth > 0)
            _add_blocks(child, children, expand_depth - 1, labelled or bool(block.get("unit")))
        else:
            node.add_leaf(block_label(block, labelled))


def fill_tree(tree: Tree, batch: dict[str, Any] | None, expand_depth: int = 3) -> None:
    tree.clear()
    if batch is None:
        tree.root.set_label(Text("no batch yet"))
        return
    tree.root.set_label(batch_label(batch))
    if batch.get("tree") is None:  # the daemon let an unread batch's tree go (it keeps the last 64 unread)
        tree.root.add_leaf(Text("tree not kept: the dashboard read this batch too late", style="dim"))
    for n, row in enumerate(batch.get("tree") or []):
        node = tree.root.add(row_label(n, row), expand=True)
        if row.get("cache_hit"):
            node = node.add(cached_label(row), expand=True)
        _add_blocks(node, row.get("children") or [], expand_depth)
    tree.root.expand()


class BatchTree(Tree):
    DEFAULT_CSS = """
    BatchTree { height: 1fr; }
    """

    def __init__(self, id: str | None = None) -> None:
        super().__init__("no batch yet", id=id)
        self.shown: int | None = None

    def show(self, batch: dict[str, Any] | None) -> None:
        batch_id = None if batch is None else batch.get("batch_id")
        if batch_id == self.shown and batch is not None:
            return
        self.shown = batch_id
        fill_tree(self, batch)
