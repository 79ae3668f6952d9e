"""The model's tokenizer with the fixes of PROTOCOL.md §4.6 and the letter-id rule."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from ..protocol.constants import LETTERS, PREFILL
from ..protocol.render import render_prompt


class TokenizerError(ValueError):
    pass


def _fixed_tokenizer_json(raw: dict) -> dict:
    pre = raw.get("pre_tokenizer")
    allowed = {"type": "Metaspace", "replacement": "\u2581", "split": False}
    if (not isinstance(pre, dict) or set(pre) != {"type", "replacement", "prepend_scheme", "split"}
            or any(pre.get(k) != v for k, v in allowed.items()) or pre.get("prepend_scheme") not in ("always", "first")):
        raise TokenizerError('tokenizer.json: field "pre_tokenizer" must be exactly {"type": "Metaspace", '
                             '"replacement": "\u2581", "prepend_scheme": "always"|"first", "split": false} '
                             f"(got {json.dumps(pre, ensure_ascii=False)})")
    if raw.get("normalizer") is not None:
        raise TokenizerError('tokenizer.json: field "normalizer" must be null')
    fixed = dict(raw)
    fixed["pre_tokenizer"] = {**pre, "prepend_scheme": "first"}
    # never truncate or pad: a decision reads the whole prompt
    fixed["truncation"] = None
    fixed["padding"] = None
    return fixed


class BasalTokenizer:
    """Tokenizes whole rendered prompts (special tokens are literal text in the prompt)."""

    def __init__(self, tokenizer_json: Path, bos_token: str) -> None:
        raw = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
        self._tok = Tokenizer.from_str(json.dumps(_fixed_tokenizer_json(raw)))
        self.bos = bos_token
        if self._tok.token_to_id(bos_token) is None:
            raise TokenizerError(f"tokenizer_config.json: bos_token {bos_token!r} is not in the vocabulary")
        self.letter_ids = self._derive_letter_ids()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and each token's (start, end) character offsets in `text` (evidence spans)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its vocabulary string is at least that long)."""
        return max(1, max(len(piece) for piece in self._tok.get_vocab(with_added_tokens=True)))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _derive_letter_ids(self) -> list[int]:
        """ids(prompt + L) must be ids(prompt) + [one id], distinct per letter, on a prompt ending in the prefill."""
        probe = render_prompt("x", "?", list(LETTERS), list(range(len(LETTERS))), "en", self.bos)
        if not probe.endswith(PREFILL):
            raise RuntimeError("the rendered probe prompt does not end in the prefill (a rendering bug)")
        base = self.encode(probe)
        ids = []
        for letter in LETTERS:
            extended = self.encode(probe + letter)
            if len(extended) != len(base) + 1 or extended[: len(base)] != base:
                raise TokenizerError("option letters are not single tokens for this tokenizer "
                                     f"(letter {letter!r} after the prefill)")
            ids.append(extended[-1])
        if len(set(ids)) != len(ids):
            raise TokenizerError("option letters are not single tokens for this tokenizer (ids are not distinct)")
        return ids

    def template_prefix(self, lang: str) -> list[int]:
        """The token ids every prompt of a language starts with (the cached template, 53 PL / 66 EN on Basal)."""
        states = ["a", "Z", "0", "{", "[", " ", "\n", '"', "ż", "-", "\u2581", "<", "\t", "A1"]
        first, *others = [self.encode(render_prompt(s, "q", ["x", "y"], [0, 1], lang, self.bos)) for s in states]
        common = first
        for ids in others:
            n = 0
            while n < min(len(common), len(ids)) and common[n] == ids[n]:
                n += 1
            common = common[:n]
        return common
