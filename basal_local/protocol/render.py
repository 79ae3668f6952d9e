"""Prompt rendering (docs/PROTOCOL.md §4.4-§4.5): option texts, the two orders and the chat template."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from .constants import LETTERS, PREFILL, SYSTEM, USER_FORMAT, YES_NO
from .questions import Question, detect_language
from .textrule import to_text


def named_option_texts(criteria: dict[str, Any], option_keys: str) -> tuple[list[str], list[str]]:
    """§4.4 named options: returns (keys, shown texts). `option_keys` is "show" or "hide"."""
    keys = list(criteria)
    texts = [key if desc is None else to_text(desc) for key, desc in criteria.items()]
    counts = Counter(texts)
    shown = []
    for key, text, desc in zip(keys, texts, criteria.values()):
        if desc is None or (option_keys == "hide" and counts[text] == 1):
            shown.append(text)
        else:
            shown.append(f"{key}: {text}")
    return keys, shown


def option_texts(question: Question, lang: str) -> list[str]:
    """Shown texts with the language's defaults filled in for noul options without a description."""
    texts = list(question.options)
    for i, use_default in enumerate(question.default_yes_no):
        if use_default:
            texts[i] = YES_NO[lang][i]
    return texts


def orders(n: int) -> list[list[int]]:
    """The two option orders (CONSTANT): original and reversed."""
    return [list(range(n)), list(range(n - 1, -1, -1))]


def render_prompt(state_text: str, question_text: str, texts: Sequence[str], perm: Sequence[int], lang: str,
                  bos: str = "<s>") -> str:
    """One prompt string, byte-exact to the chat template + prefill. Values are never re-scanned."""
    return prompt_head(state_text, lang, bos) + prompt_tail(question_text, texts, perm, lang)


def _user_parts(lang: str) -> tuple[str, str]:
    """The user turn's format around its {state} field: the literal text before it, the format after it."""
    before, after = USER_FORMAT[lang].split("{state}")
    return before.format(), after


def prompt_head(state_text: str, lang: str, bos: str = "<s>") -> str:
    """What every prompt of `lang` about `state_text` starts with: the template up to the state, and the state."""
    # str.format inserts values verbatim, so braces inside the state are safe; the state is inserted as is here
    return f"{bos}<|im_start|>system\n{SYSTEM[lang]}<|im_end|>\n<|im_start|>user\n{_user_parts(lang)[0]}{state_text}"


def prompt_tail(question_text: str, texts: Sequence[str], perm: Sequence[int], lang: str) -> str:
    """The rest of a prompt after its `prompt_head`: the question, its options in order `perm`, the prefill."""
    opts = "\n".join(f"{LETTERS[k]}. {texts[perm[k]]}" for k in range(len(perm)))
    return f"{_user_parts(lang)[1].format(q=question_text, opts=opts)}<|im_end|>\n<|im_start|>assistant\n{PREFILL}"


def kept_head(heads: dict[str, str], state_text: str, lang: str, bos: str = "<s>") -> str:
    """`prompt_head`, built once per language into `heads` (a request's prompts copy a long state once per
    language, not once per prompt)."""
    head = heads.get(lang)
    if head is None:
        head = heads[lang] = prompt_head(state_text, lang, bos)
    return head


def question_tails(state_text: str, question: Question) -> tuple[str, list[list[int]], list[str]]:
    """Both orders of one question after the head: (language, perms, each order's `prompt_tail`)."""
    lang = detect_language(state_text, question.instructions_text)
    texts = option_texts(question, lang)
    perms = orders(len(texts))
    return lang, perms, [prompt_tail(question.instructions_text, texts, p, lang) for p in perms]


def render_question(state_text: str, question: Question, bos: str = "<s>",
                    heads: dict[str, str] | None = None) -> tuple[str, list[list[int]], list[str]]:
    """Both orders of one question: (language, perms, prompts); `heads`: `kept_head`'s, shared across calls."""
    lang, perms, tails = question_tails(state_text, question)
    head = kept_head({} if heads is None else heads, state_text, lang, bos)
    return lang, perms, [head + tail for tail in tails]
