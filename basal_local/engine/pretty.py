"""A printable picture of a packed batch: rows, blocks, token counts, owners, packed vs unpacked."""

from __future__ import annotations

from .packer import PackPlan


def format_pack(pack: PackPlan, tokenizer=None, width: int = 60) -> str:
    lines = [f"{len(pack.batches)} forward(s), {len(pack.rows)} row(s): {pack.packed_tokens} packed tokens "
             f"vs {pack.unpacked_tokens} unpacked "
             f"({100.0 * (1 - pack.packed_tokens / max(pack.unpacked_tokens, 1)):.1f} % saved)"]
    for n, row in enumerate(pack.rows):
        prefix = f"cached template {row.prefix} + " if row.prefix else ""
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
