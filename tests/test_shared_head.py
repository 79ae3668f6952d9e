"""The once-per-request paths of planning give what the once-per-prompt computation gives: the state cache's walk
over a request's shared ids, the packer's sort after what each language's prompts share, the tokenizer's shared
head and its `shared_chars`, the planner's template + state rendered once, and a round's cost reused while the
cache is unchanged."""

from __future__ import annotations

import random

import numpy as np
import pytest

from basal_local.api.systemone import validate_systemone
from basal_local.engine.fills import shared_prefix
from basal_local.engine.packer import PrefixTrie, PromptSpec, SharedHead, pack_prompts
from basal_local.engine.plan import packed_size, plan_request
from basal_local.engine.prefix_cache import HIT_MIN_TOKENS, PrefixCache
from basal_local.model import load_model_dir
from basal_local.protocol.render import prompt_head, render_prompt

from .reference import ReferenceTokenizer, render


def _store(cache: PrefixCache, tokens: list[int]) -> None:
    lease = cache.lease()
    lease.fill(tokens)
    lease.commit()


def _random_cache(rng: random.Random, template: list[int], doc: list[int]) -> PrefixCache:
    """A tree holding the template (pinned) and pieces of the document: whole, cut short, run on past it, or
    leaving it mid-way."""
    cache = PrefixCache(100_000, bytes_per_token=1)
    pin = cache.pin("en", template)
    cache.publish(pin)
    for _ in range(rng.randrange(0, 5)):
        cut = rng.randrange(0, len(doc) + 1)
        tokens = template + doc[:cut]
        kind = rng.randrange(3)
        if kind == 1:
            tokens = tokens + [rng.randrange(900, 910) for _ in range(rng.randrange(1, 40))]
        elif kind == 2 and cut > 1:
            tokens = tokens[:-1] + [999]
        if len(tokens) > len(template):
            _store(cache, tokens)
    return cache


def _request_prompts(rng: random.Random, template: list[int], doc: list[int], n: int) -> list[list[int]]:
    """n prompts of one request: template + document + a question (some start alike, some are short)."""
    common = [rng.randrange(900, 903) for _ in range(rng.randrange(0, 6))]
    return [template + doc + common + [rng.randrange(900, 904) for _ in range(rng.randrange(1, 8))]
            for _ in range(n)]


@pytest.mark.parametrize("seed", range(60))
def test_matching_from_the_walk_over_the_shared_ids_equals_matching_each_prompt(seed):
    rng = random.Random(seed)
    template = list(range(1, 30))
    doc = [rng.randrange(100, 104) for _ in range(rng.randrange(1, 3 * HIT_MIN_TOKENS))]
    cache = _random_cache(rng, template, doc)
    prompts = _request_prompts(rng, template, doc, rng.randrange(1, 8))
    shared = min(len(p) for p in prompts)
    while any(p[:shared] != prompts[0][:shared] for p in prompts):
        shared -= 1
    for length in {shared, rng.randrange(0, shared + 1), len(template)}:
        walk = cache.walk(prompts[0], length)
        for p in prompts:
            assert cache.split(p, "en", walk) == cache.split(p, "en")


def test_a_walk_from_before_a_change_of_the_tree_is_not_used():
    cache = PrefixCache(10_000, bytes_per_token=1)
    doc = list(range(500))
    walk = cache.walk(doc + [1], 500)
    _store(cache, doc)
    assert cache.split(doc + [1], "en", walk) == cache.split(doc + [1], "en") != (None, 0)


def _pack_equal(a, b) -> None:
    assert a.readouts == b.readouts and a.packed_tokens == b.packed_tokens
    assert len(a.batches) == len(b.batches)
    for x, y in zip(a.batches, b.batches):
        for name, value in vars(x).items():
            other = getattr(y, name)
            assert (np.array_equal(value, other) if isinstance(value, np.ndarray) else value == other), name


@pytest.mark.parametrize("seed", range(40))
def test_packing_and_sizing_with_shared_heads_equal_them_without(seed):
    """Several requests (some about the same document, some in another language) in one batch, against a
    state cache and against templates alone: the same packed batches, readouts and sizes with the requests'
    heads as without them."""
    rng = random.Random(seed)
    template = {"en": list(range(1, 30)), "pl": list(range(40, 66))}
    docs = [[rng.randrange(100, 104) for _ in range(rng.randrange(1, 200))] for _ in range(3)]
    docs.append(docs[0][: len(docs[0]) // 2] + [7] * 5)  # leaves the first document mid-way
    cache = _random_cache(rng, template["en"], docs[0])
    with_heads, without = [], []
    for _ in range(rng.randrange(1, 5)):
        lang = rng.choice(["en", "en", "pl"])
        doc = rng.choice(docs)
        prompts = _request_prompts(rng, template[lang], doc, rng.randrange(1, 6))
        exact = min(len(p) for p in prompts)
        while any(p[:exact] != prompts[0][:exact] for p in prompts):
            exact -= 1
        # the head is a lower bound of what they share: at most all of it
        known = rng.choice([exact, min(exact, len(template[lang]) + rng.randrange(0, len(doc) + 1))])
        head = SharedHead(prompts[0], known)
        with_heads += [PromptSpec(p, lang, [3, 4], head=head) for p in prompts]
        without += [PromptSpec(list(p), lang, [3, 4]) for p in prompts]
    at = 0
    while at < len(with_heads):  # each request's shared prefix (what a batch stores, what routing compares)
        n = sum(1 for spec in with_heads if spec.head is with_heads[at].head)
        ids = [list(spec.token_ids) for spec in without[at:at + n]]
        common = len(ids[0]) - 1  # token by token: all but the last token of the first prompt at most
        while any(p[:common] != ids[0][:common] for p in ids):
            common -= 1
        assert shared_prefix(with_heads[at:at + n]) == shared_prefix(without[at:at + n]) == ids[0][:common]
        at += n
    for prefixes in (cache, template):
        assert packed_size(with_heads, prefixes) == packed_size(without, prefixes)
        for depth in (2, 3, 8):
            _pack_equal(pack_prompts(with_heads, prefixes, 300, 400, depth), pack_prompts(without, prefixes, 300, 400,
                                                                                          depth))


def _shape(trie: PrefixTrie) -> list:
    return [(b.tokens, b.depth, b.start, b.readouts, sorted(b.index), parent) for b, parent in trie.blocks()]


@pytest.mark.parametrize("seed", range(80))
def test_a_trie_walks_a_requests_shared_blocks_as_it_would_compare_them(seed):
    """Prompts inserted after the cached prefix (`start`), requests one after another or interleaved, deep
    enough for the depth limit: the same blocks, depths, readouts and sizes with the heads as without."""
    rng = random.Random(seed)
    depth = rng.choice([1, 2, 3, 4, 8])
    start = rng.randrange(0, 4)
    with_heads, without = PrefixTrie(start, depth), PrefixTrie(start, depth)
    base = [rng.randrange(0, 3) for _ in range(rng.randrange(5, 60))]
    requests = []
    for _ in range(rng.randrange(1, 5)):
        doc = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(0, 3) for _ in range(rng.randrange(0, 9))]
        prompts = [doc + [rng.randrange(0, 3) for _ in range(rng.randrange(0, 6))] for _ in range(rng.randrange(1, 7))]
        prompts = [p for p in prompts if len(p) > start] or [doc + [5] * (start + 1)]
        shared = min(len(p) for p in prompts)
        while any(p[:shared] != prompts[0][:shared] for p in prompts):
            shared -= 1
        head = SharedHead(prompts[0], rng.randrange(0, shared + 1))
        requests.append([(p, head) for p in prompts])
    order = [x for r in requests for x in r]
    if rng.random() < 0.5:
        rng.shuffle(order)
    for n, (p, head) in enumerate(order):
        assert with_heads.insert(p, n, start, head) == without.insert(p[start:], n)
        assert with_heads.num_tokens == without.num_tokens
    assert _shape(with_heads) == _shape(without)


@pytest.fixture(scope="module")
def toks(tiny_model):
    return load_model_dir(tiny_model).tokenizer, ReferenceTokenizer(tiny_model)


def test_the_shared_head_of_encode_shared_is_shared_and_the_ids_are_whole_prompts(toks):
    tok, ref = toks
    state = {"text": " ".join(["Umowa  stron zażółć\u2581 ▁▁ §3."] * 200), "n": 3}
    texts = []
    for q in ({"type": "choice", "instructions": "Która?", "criteria": {"a": "Opis A", "b": "Opis  B"}},
              {"type": "noul", "instructions": "Czy  pilne?"}):
        texts += render(state, q)[1]
    head = texts[0][: texts[0].index("\n\nPytanie")]
    assert all(t.startswith(head) for t in texts)
    for remember, chars in ((0, 0), (len(head), 0), (len(head), len(head)), (0, len(head))):
        for batch in (texts, texts[:1], texts[1:]):
            ids, shared = tok.encode_shared(batch, remember, chars)
            assert ids == [ref.ids(t) for t in batch]
            assert 0 <= shared <= min(len(i) for i in ids)
            assert all(i[:shared] == ids[0][:shared] for i in ids)
    _, shared = tok.encode_shared(texts, len(head), len(head))
    # the kept text (template + state, cut at its last safe space) is tokenized once: the prompts share its ids
    assert shared > 0.9 * len(ref.ids(head))


def test_a_prompt_is_its_languages_head_and_what_follows():
    for lang in ("pl", "en"):
        for state in ("", "{state} {{x}}", "a\n" * 5):
            prompt = render_prompt(state, "Q {q}?", ["x {opts}", "y"], [1, 0], lang, "<s>")
            head = prompt_head(state, lang, "<s>")
            assert prompt.startswith(head) and head.endswith(state)
            assert prompt[len(head):].startswith("\n\n")


@pytest.mark.parametrize("splits", [True, False])
def test_a_plans_prompts_all_start_with_its_shared_head(tiny_model, splits, monkeypatch):
    md = load_model_dir(tiny_model)
    monkeypatch.setattr(md.tokenizer, "_splits", splits)  # False: every prompt tokenized whole
    state = "Umowa między stronami. " * 150
    body = {"model": md.name, "state": state, "questions": {
        "a": {"type": "noul", "instructions": "Czy umowa jest ważna?"},
        "b": {"type": "choice", "instructions": "Kto płaci?", "criteria": {"x": "Dostawca", "y": "Klient"}},
        "c": {"type": "multi", "instructions": "Co dotyczy?", "criteria": {"p": "Płatność", "t": "Termin"}}}}
    for max_positions in (md.config.max_position_embeddings, len(state) - 1):  # also the long-state path
        plan = plan_request(validate_systemone(body, md.name), md.tokenizer, max_positions)
        specs = plan.prompt_specs()
        head = specs[0].head
        if not splits:  # nothing was tokenized once for all of them: no head, nothing assumed
            assert head is None
            assert all(list(s.token_ids) == md.tokenizer.encode(p) for s, p in
                       zip(specs, [p for qp in plan.questions for p in qp.prompts]))
            continue
        assert head is not None and head.length > len(md.tokenizer.encode(state)) // 2
        assert all(s.head is head and list(s.token_ids[: head.length]) == list(head.ids[: head.length])
                   for s in specs)
        assert all(list(s.token_ids) == md.tokenizer.encode(p) for s, p in
                   zip(specs, [p for qp in plan.questions for p in qp.prompts]))


def test_a_rounds_cost_is_sized_again_once_the_cache_changed(tiny_model):
    md = load_model_dir(tiny_model)
    cache = PrefixCache(100_000, bytes_per_token=1)
    body = {"model": md.name, "state": "Umowa między stronami. " * 40,
            "questions": {"a": {"type": "noul", "instructions": "Czy umowa jest ważna?"}}}
    plan = plan_request(validate_systemone(body, md.name), md.tokenizer, 4096, cache)
    assert plan.size_against(cache) == plan.packed_tokens == packed_size(plan.prompt_specs(), cache)
    ids = plan.prompt_specs()[0].token_ids
    _store(cache, list(ids[:-5]))
    assert plan.size_against(cache) == packed_size(plan.prompt_specs(), cache) < plan.packed_tokens
    other = PrefixCache(100_000, bytes_per_token=1)  # another replica's cache: sized against it
    assert plan.size_against(other) == packed_size(plan.prompt_specs(), other)
