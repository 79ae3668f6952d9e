"""The model's tokenizer with the fixes of docs/PROTOCOL.md §4.6 and the letter-id rule."""

from __future__ import annotations

import collections
import functools
import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from tokenizers import Tokenizer

from ..protocol.constants import LETTERS, PREFILL
from ..protocol.render import render_prompt


class TokenizerError(ValueError):
    pass


# prompts sharing at least this many leading characters tokenize the shared part once (`encode_batch`)
SHARED_MIN_CHARS = 256
# texts of twice this many characters are tokenized in parallel pieces of about this size
PIECE_CHARS = 4096
# texts of fewer characters in all are tokenized one by one, not on the tokenizer's thread pool (BasalTokenizer._run)
SERIAL_CHARS = 8192
# shared texts this long are remembered (their ids), the last REMEMBER_TEXTS of them
REMEMBER_MIN_CHARS = 2048
REMEMBER_TEXTS = 32
REMEMBER_CHARS = 16_000_000  # and at most this many characters of them in all


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two strings or two lists: a binary search over slice comparisons,
    which run in C (long states here; token lists of a few hundred ids, many times per batch, in the packer)."""
    n = min(len(a), len(b))
    # whole sequences compare in place; a slice is a copy (18k ids: the copy costs about twice the comparison)
    if (a if len(a) == n else a[:n]) == (b if len(b) == n else b[:n]):
        return n
    lo, hi = 0, n - 1  # a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:  # only the part not known to agree (a document's ids: 18k per prompt)
            lo = mid
        else:
            hi = mid - 1
    return lo


_SPACES = (" ", "\u2581")  # both are "\u2581" after Metaspace: never cut between two of them


def safe_cut(text: str, limit: int) -> int:
    """The last position < limit where `text` may be cut for `splits_at_spaces` tokenizers: a space that
    follows a character other than a space or "\u2581" (0 if none)."""
    at = text.rfind(" ", 0, limit)
    while at > 0 and text[at - 1] in _SPACES:
        at = text.rfind(" ", 0, at)
    return max(at, 0)


def splits_at_spaces(raw: dict) -> bool:
    """Whether ids(a + b) == ids(a) + ids(b) whenever b starts with a space that follows a non-space in a + b.

    True for a BPE model (no dropout, merges applied as usual) without a normalizer under the Metaspace
    pre-tokenizer, when no vocabulary token holds "▁" right after another character than "▁" and no
    added token holds a space: the space becomes "▁", which then can never merge with the symbol on its
    left (that token would hold "x▁"), so BPE works on the two sides independently; the right side starts
    with "▁", so Metaspace prepends nothing to it either. Checked on the vocabulary, never assumed.
    """
    model = raw.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0) or model.get("ignore_merges"):
        return False
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return False  # word-boundary markers would change at a cut
    if raw.get("normalizer") is not None or (raw.get("pre_tokenizer") or {}).get("type") != "Metaspace":
        return False
    if (raw.get("pre_tokenizer") or {}).get("replacement") != "▁":
        return False
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or "\u2581" not in vocab:
        return False  # an unknown "\u2581" could fuse with an unknown symbol on its left (fuse_unk)
    if any(" " in (t.get("content") or "") or "▁" in (t.get("content") or "")
           for t in raw.get("added_tokens") or []):
        return False
    for piece in vocab:
        at = piece.find("▁", 1)
        while at > 0:
            if piece[at - 1] != "▁":
                return False
            at = piece.find("▁", at + 1)
    return True


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

    def __init__(self, tokenizer_json: Path, bos_token: str, serial_chars: int = SERIAL_CHARS) -> None:
        raw = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
        fixed = _fixed_tokenizer_json(raw)
        self._tok = Tokenizer.from_str(json.dumps(fixed))
        self._splits = splits_at_spaces(fixed)
        # encode_batch_fast (tokenizers >= 0.20.2) skips the character offsets that ids alone never need
        self._batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        self.serial_chars = serial_chars  # below this many characters in all, `_run` tokenizes one text at a time
        self.bos = bos_token
        # the ids of the text recent requests' prompts shared (template + state): a new question about a known
        # document tokenizes only its own text (encode is deterministic, so a hit returns exactly its ids)
        self._shared: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self._shared_lock = threading.Lock()
        if self._tok.token_to_id(bos_token) is None:
            raise TokenizerError(f"tokenizer_config.json: bos_token {bos_token!r} is not in the vocabulary")
        self.letter_ids = self._derive_letter_ids()

    @property
    def splits(self) -> bool:
        """Whether `encode_batch` tokenizes the text its prompts share once (the vocabulary allows exact cuts)."""
        return self._splits

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and each token's (start, end) character offsets in `text` (evidence spans)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def encode_batch(self, texts: Sequence[str], remember: int = 0) -> list[list[int]]:
        """Ids of each text, equal to `encode` of each. Where the vocabulary allows exact splits (`_splits`),
        the text the prompts share (template + state) is tokenized once and long texts in pieces; with
        `remember` (the characters of the first text that are template + state), that shared text's ids are kept,
        so the next request about the same document tokenizes only its questions (`REMEMBER_*`)."""
        return self.encode_shared(texts, remember)[0]

    def encode_shared(self, texts: Sequence[str], remember: int = 0,
                      shared_chars: int = 0) -> tuple[list[list[int]], int]:
        """`encode_batch`, and how many leading ids every text's ids share because they were tokenized once for
        all of them (at most their common prefix; 0 where nothing was shared, all of a single text's ids).
        `shared_chars`: the caller knows that every text starts with the first that many characters of the first
        (rendered from one template + state): they are compared once, not once per text."""
        texts = list(texts)
        if not texts:
            return [], 0
        if not self._splits:
            ids = self._run(texts)
            return ids, len(ids[0]) if len(ids) == 1 else 0
        known = self._known(texts, shared_chars)
        if known is not None:  # a kept text every prompt starts with, at a point where ids may be cut
            head, ids = known
            tails, shared = self.encode_shared([t[len(head):] for t in texts])
            return [ids + tail for tail in tails], len(ids) + shared
        cut = len(texts[0])
        if len(texts) > 1:
            skip = min(shared_chars, len(texts[0]))
            rest = texts[0][skip:]
            cut = safe_cut(texts[0], skip + min(common_prefix_len(rest, t[skip:]) for t in texts[1:]))
        keep = safe_cut(texts[0], min(remember, cut) + 1) if remember else 0
        if keep >= REMEMBER_MIN_CHARS:
            head = texts[0][:keep]
            ids = [i for chunk in self._run(self._pieces(head)) for i in chunk]
            self._remember(head, ids)
            tails, shared = self.encode_shared([t[keep:] for t in texts])
            return [ids + tail for tail in tails], len(ids) + shared
        if len(texts) == 1:
            ids = [i for chunk in self._run(self._pieces(texts[0])) for i in chunk]
            return [ids], len(ids)
        shared = cut >= SHARED_MIN_CHARS
        parts = [self._pieces(texts[0][:cut])] + [[t[cut:]] for t in texts] if shared else \
            [self._pieces(t) for t in texts]
        ids = self._run([p for ps in parts for p in ps])
        joined, at = [], 0
        for ps in parts:
            joined.append([i for chunk in ids[at:at + len(ps)] for i in chunk])
            at += len(ps)
        if shared:
            return [joined[0] + tail for tail in joined[1:]], len(joined[0])
        return joined, 0

    def encode_after(self, head: str, tails: Sequence[str], remember: int = 0) -> tuple[list[list[int]], int]:
        """`encode_shared` of the texts `head + tail` for each tail (every prompt of a request in one language:
        template + state, then a question), with `shared_chars` = len(head). Where a kept text ends in `head` (the
        document was asked about before), only the rest of `head` and the tails are tokenized, and no prompt is
        built whole (a long document's text is copied and compared once, not once per prompt)."""
        known = self._known_head(head, tails) if self._splits and tails else None
        if known is None:
            return self.encode_shared([head + tail for tail in tails], remember, len(head))
        kept, ids = known
        rest = head[len(kept):]
        more, shared = self.encode_shared([rest + tail for tail in tails])
        return [ids + m for m in more], len(ids) + shared

    def _known(self, texts: list[str], shared_chars: int = 0) -> tuple[str, list[int]] | None:
        """The longest kept text that every one of `texts` starts with, followed by a space (a safe cut); the
        texts all start with the first `shared_chars` characters of the first (`encode_shared`)."""
        return self._longest_kept(texts[0], lambda n: all(len(t) > n and t[n] == " " for t in texts),
                                  lambda n, kept: n <= shared_chars or all(t[:n] == kept for t in texts[1:]))

    def _known_head(self, head: str, tails: Sequence[str]) -> tuple[str, list[int]] | None:
        """The longest kept text that `head` starts with, followed by a space in every `head + tail`."""
        def space_after(n: int) -> bool:
            return head[n] == " " if n < len(head) else n == len(head) and all(t[:1] == " " for t in tails)

        return self._longest_kept(head, space_after, lambda n, kept: True)

    def _longest_kept(self, first: str, space_after: Callable[[int], bool],
                      others_start: Callable[[int, str], bool]) -> tuple[str, list[int]] | None:
        """The longest kept text that `first` starts with where `space_after(its length)` and `others_start(its
        length, it)` (every other text starts with it too)."""
        with self._shared_lock:
            best = None
            for head, ids in self._shared.items():
                n = len(head)
                if best is not None and n <= len(best[0]):
                    continue
                if n > len(first) or first[max(0, n - 16):n] != head[-16:] or not space_after(n):
                    continue  # a quick look at where the kept text ends, before comparing all of it
                # first[:n] == head, not first.startswith(head): a slice has the narrowest character width of
                # its content, as head does, so the two compare as bytes; startswith compares char by char when
                # the widths differ (a wide character after the state: 2 ms per 70k-character prompt)
                if first[:n] == head and others_start(n, head):
                    best = (head, ids)
            if best is not None:
                self._shared.move_to_end(best[0])
            return best

    def _remember(self, text: str, ids: list[int]) -> None:
        with self._shared_lock:
            self._shared[text] = ids
            while len(self._shared) > REMEMBER_TEXTS or \
                    len(self._shared) > 1 and sum(len(t) for t in self._shared) > REMEMBER_CHARS:
                self._shared.popitem(last=False)

    def _run(self, texts: list[str]) -> list[list[int]]:
        """Short work one text after another with `encode` in the calling thread, the rest in one call on the
        pool, which also releases the GIL for the daemon's other threads; `serial_chars` draws the line (0: always
        the pool, as the tests use it).
        `encode_batch_fast` one text at a time is faster alone (157 vs 233 us a single decision's texts on the
        H200 host, `git show 56232b5:tools/tok_bench.py`) but through the pool: with 32 clients the daemon's planning p50 went 0.6 ->
        3.4 ms and 190-199 -> 183 req/s, and 1 client gained nothing measurable."""
        if sum(len(t) for t in texts) < self.serial_chars:
            return [self._tok.encode(t, add_special_tokens=False).ids for t in texts]
        return [e.ids for e in self._batch(texts, add_special_tokens=False)]

    @staticmethod
    def _pieces(text: str) -> list[str]:
        """A long text cut at safe points into pieces of about PIECE_CHARS (tokenized in parallel)."""
        cuts = [0]
        while len(text) - cuts[-1] >= 2 * PIECE_CHARS:
            at = text.find(" ", cuts[-1] + PIECE_CHARS)
            while at > 0 and text[at - 1] in _SPACES:
                at = text.find(" ", at + 1)
            if at <= 0:
                break
            cuts.append(at)
        return [text[a:b] for a, b in zip(cuts, cuts[1:] + [len(text)])]

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
