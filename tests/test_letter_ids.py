"""Letter ids (docs/PROTOCOL.md §4.6) against ids computed here with `tokenizers`, not through the product.

The generated tokenizer gives A-J scattered, unsorted ids (like A=31928, B=31936, C=31935 of the real one), so
deriving them from the bare letters, sorting them or shifting them by one cannot agree with the reference.
"""

from __future__ import annotations

import pytest

from basal_local.api.systemone import validate_systemone
from basal_local.engine.plan import plan_request
from basal_local.model import load_model_dir

from .reference import LETTERS, ReferenceTokenizer, render


@pytest.fixture(scope="module")
def ref(tiny_model):
    return ReferenceTokenizer(tiny_model)


def test_generated_tokenizer_has_scattered_letter_ids(ref):
    ids = [ref.tok.token_to_id(letter) for letter in LETTERS]
    assert None not in ids and len(set(ids)) == 10
    assert ids != sorted(ids) and ids != sorted(ids, reverse=True)
    assert all(abs(a - b) > 1 for a, b in zip(ids, ids[1:])), ids  # no two neighbours consecutive
    assert [ref.tok.token_to_id(t) for t in ("<s>", "<|im_start|>", "<|im_end|>")] == [1, 3, 4]
    # a bare letter at the start of a text is another token ("▁A"): the rule must read letters after the prefill
    assert all(ref.ids(letter) != [i] for letter, i in zip(LETTERS, ids))


def test_model_letter_ids_follow_the_rule(tiny_model, ref):
    """BasalTokenizer.letter_ids = the §4.6 rule on a prompt that ends in the prefill, computed independently."""
    _, prompts = render("x", {"type": "choice", "instructions": "?", "criteria": list(LETTERS)})
    expected = ref.letter_ids(prompts[0], 10)
    assert expected == [ref.tok.token_to_id(letter) for letter in LETTERS]
    assert load_model_dir(tiny_model).tokenizer.letter_ids == expected


@pytest.mark.parametrize("k", [2, 3, 7, 10])
def test_planned_prompts_ids_and_letter_ids(tiny_model, ref, k):
    """Every order of a planned question: the prompt, its token ids and its k letter ids equal the reference."""
    md = load_model_dir(tiny_model)
    state = {"zgłoszenie": f"opcji {k}", "n": k}
    question = {"type": "choice", "instructions": "Która?", "criteria": {f"o{i}": f"Opis {i}" for i in range(k)}}
    request = validate_systemone({"model": md.name, "state": state, "questions": {"q": question}}, md.name)
    plan = plan_request(request, md.tokenizer, md.config.max_position_embeddings)
    (qp,) = plan.questions
    lang, prompts = render(state, question)
    assert (qp.lang, qp.prompts) == (lang, prompts)
    assert qp.token_ids == [ref.ids(p) for p in prompts]
    assert qp.letter_ids == ref.letter_ids(prompts[0], k) == ref.letter_ids(prompts[1], k)
