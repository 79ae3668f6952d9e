"""A printable picture of a packed batch: rows, blocks, token counts, owners, packed vs unpacked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .packer import PackPlan
from .prefix_cache import is_state


def format_pack(pack: PackPlan, tokenizer=None, width: int = 60) -> str:
    lines = [f"{len(pack.batches)} forward(s), {len(pack.rows)} row(s): {pack.packed_tokens} packed tokens "
             f"vs {pack.unpacked_tokens} unpacked "
             f"({100.0 * (1 - pack.packed_tokens / max(pack.unpacked_tokens, 1)):.1f} % saved)"]
    for n, row in enumerate(pack.rows):
        prefix = (f"cached {'state' if is_state(row.prefix) else 'template'} {row.prefix} ({row.used} tok) + "
                  if row.prefix else "")
        lines.append(f"row {n} [{row.lang}] {prefix}{row.trie.num_tokens} tokens, {row.trie.num_prompts} prompts")
        depth_of: dict[int, int] = {}
        for i, (block, parent) in enumerate(row.trie.blocks()):
            depth = 0 if parent < 0 else depth_of[parent] + 1
            depth_of[i] = depth
            text = ""
            if tokenizer is not None:
                text = tokenizer._tok.decode(block.tokens, skip_special_tokens=False).replace("\n", "\u21b5")
                if len(text) > width:
                    text = text[: width // 2 - 2] + " \u2026 " + text[-(width // 2 - 2):]
                text = f"  {text!r}"
            owners = f"  -> prompts {block.readouts}" if block.readouts else ""
            lines.append(f"{'  ' * (depth + 1)}block {i}: {len(block.tokens)} tok @pos {block.start}{text}{owners}")
    return "\n".join(lines)


def unit_label(role: str, index: int, keys: Sequence[str]) -> str:
    """How the dashboard names a readout unit that is not a plain question: "multi: <label>" for a branch of a
    multi question, "round 1, group 2" for a large choice's first round, "round 2" for its finalists."""
    if role == "branch":
        return f"multi: {keys[index]}" if index < len(keys) else f"multi: #{index}"
    if role == "group":
        return f"round 1, group {index + 1}"
    if role == "final":
        return "round 2"
    return ""


def batch_tree(rows_: Sequence[Any], owners: list[tuple[str, str, int, str]]) -> list[dict[str, Any]]:
    """The batch's real tries (`PackPlan.rows`) as JSON for telemetry: one node per row, its blocks nested below.

    `owners[p]` = (request id, question id, order, unit label) of input prompt p (the label from `unit_label`,
    "" for a plain question). A block's `kind` says what it holds: "template" (the chat template, when it is not
    cached), "state" (shared by several questions or units), "question" (both orders of one question, or of
    one unit: then its `unit` names it) or "order" (one prompt's own tail, where it reads out).
    The engine builds this only when someone reads it (telemetry.Lazy): it costs far more than the packing walk.
    """
    rows = []
    for row in rows_:
        blocks = row.trie.blocks()
        children: list[list[dict[str, Any]]] = [[] for _ in blocks]
        # the one (request, question, unit) below a block, or MIXED when there are several (a shared state)
        below: list[Any] = [None] * len(blocks)
        nodes: list[dict[str, Any]] = []
        for block, _parent in blocks:
            node: dict[str, Any] = {"tokens": len(block.tokens), "start": block.start}
            if block.readouts:
                node["owners"] = [list(owners[p]) for p in block.readouts]
            nodes.append(node)
        # blocks come parent-first, so a reverse walk sees every child before its parent
        for i in range(len(blocks) - 1, -1, -1):
            block, parent = blocks[i]
            node = nodes[i]
            for p in block.readouts:
                below[i] = _merge(below[i], (owners[p][0], owners[p][1], owners[p][3]))
            if children[i]:
                node["children"] = children[i][::-1]
            if not block.children:
                node["kind"] = "order"
            elif row.prefix is None and block.start == 0 and parent < 0:
                node["kind"] = "template"
            else:
                node["kind"] = "state" if below[i] is _MIXED else "question"
                if node["kind"] == "question" and below[i] is not None and below[i][2]:
                    node["unit"] = below[i][2]
            if parent >= 0:
                children[parent].append(node)
                below[parent] = _merge(below[parent], below[i])
        top = [nodes[i] for i, (_b, parent) in enumerate(blocks) if parent < 0]
        prefix_tokens = row.trie.root.start  # the cached prefix's tokens the row continues (0 when none)
        # cached_tokens: continued from the cache (the template, or a template + state: then cache_hit)
        rows.append({"lang": row.lang, "prefix": row.prefix, "prefix_tokens": prefix_tokens,
                     "cached_tokens": prefix_tokens, "cache_hit": is_state(row.prefix),
                     "tokens": row.trie.num_tokens, "prompts": row.trie.num_prompts, "children": top})
    return rows


_MIXED = object()


def _merge(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None or a == b:
        return a
    return _MIXED
