"""Prompts tokenized in pieces (the shared template + state once, long texts in parallel pieces) give exactly the
ids of tokenizing each whole prompt, compared with `tokenizers` directly (tests/reference.py)."""

from __future__ import annotations

import json

import pytest

from basal_local.model import load_model_dir
from basal_local.model.tokenizer import (
    PIECE_CHARS,
    SERIAL_CHARS,
    BasalTokenizer,
    _fixed_tokenizer_json,
    safe_cut,
    splits_at_spaces,
)

from .reference import ReferenceTokenizer, render


@pytest.fixture(scope="module")
def toks(tiny_model):
    return load_model_dir(tiny_model).tokenizer, ReferenceTokenizer(tiny_model)


def test_shared_head_ids_equal_whole_prompts(toks):
    tok, ref = toks
    assert tok._splits  # the generated tokenizer qualifies, so the piecewise path is the one under test
    state = {"zgłoszenie": "Klient  pisze:\u2581 nie działa ▁▁ od wczoraj", "note": "a\tb  \n c", "n": 3}
    texts = []
    for q in ({"type": "choice", "instructions": "Która?", "criteria": {"a": "Opis A", "b": "Opis  B"}},
              {"type": "noul", "instructions": "Czy  pilne?"},
              {"type": "score", "instructions": "How urgent is it?", "criteria": ["low", "mid", "high"]}):
        texts += render(state, q)[1]
    assert tok.encode_batch(texts) == [ref.ids(t) for t in texts]
    assert tok.encode_batch(texts[:2]) == [ref.ids(t) for t in texts[:2]]
    assert tok.encode_batch(texts[:1]) == [ref.ids(texts[0])]


@pytest.mark.parametrize("serial_chars", [0, SERIAL_CHARS, 10**9])  # all on the pool / the product's line / serial
def test_long_text_in_parallel_pieces_equals_whole(toks, tiny_model, serial_chars):
    _, ref = toks
    tok = BasalTokenizer(tiny_model / "tokenizer.json", load_model_dir(tiny_model).tokenizer.bos, serial_chars)
    words = ["umowa", "the", "  ", "\u2581", "x\u2581", " \u2581y", "<|im_end|>", "§12.", "zażółć", "\n", "\t", "a"]
    text = "<s>" + " ".join(words[(i * 7) % len(words)] for i in range(2 * PIECE_CHARS // 3))
    assert len(text) > 2 * PIECE_CHARS
    long_prompts = [text + " Question: one?", text + " Question: two?"]
    assert tok.encode_batch([text]) == [ref.ids(text)]
    assert tok.encode_batch(long_prompts) == [ref.ids(t) for t in long_prompts]


def test_cuts_only_before_a_space_after_a_non_space():
    text = "ab  cd\u2581 ef gh"
    cuts = [safe_cut(text, n) for n in range(len(text) + 1)]
    assert set(cuts) == {0, 2, 10}  # never between two spaces nor after a literal "\u2581"
    assert all(c <= max(n - 1, 0) for n, c in zip(range(len(text) + 1), cuts))


def test_split_rule_is_read_from_the_vocabulary(tiny_model):
    raw = _fixed_tokenizer_json(json.loads((tiny_model / "tokenizer.json").read_text(encoding="utf-8")))
    assert splits_at_spaces(raw)

    def changed(edit) -> bool:
        other = {**raw, "model": {**raw["model"], "vocab": dict(raw["model"]["vocab"])},
                 "added_tokens": list(raw["added_tokens"])}
        edit(other)
        return splits_at_spaces(other)

    assert changed(lambda r: r["model"]["vocab"].update({"\u2581\u2581\u2581x": 99999}))  # runs of spaces are fine
    assert not changed(lambda r: r["model"]["vocab"].update({"a\u2581b": 99999}))  # a merge across a space
    assert not changed(lambda r: r["added_tokens"].append({"content": "<a b>"}))
    assert not changed(lambda r: r["model"].update({"type": "Unigram"}))
    assert not changed(lambda r: r["model"].update({"end_of_word_suffix": "</w>"}))
    assert not changed(lambda r: r["model"].update({"dropout": 0.1}))
    assert not changed(lambda r: r.update({"normalizer": {"type": "NFKC"}}))
