"""The normalized question model both dialects validate into (docs/PROTOCOL.md §2, §4.4, §8)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from .constants import MAX_OPTIONS, PL_CHARS

Dialect = Literal["systemone", "basal"]
QuestionType = Literal["choice", "noul", "score", "multi", "act"]


def detect_language(state_text: str, instructions_text: str) -> str:
    """§4.2: Polish iff any Polish diacritic occurs in the state or the instructions."""
    if _has_polish(state_text) or not PL_CHARS.isdisjoint(instructions_text):
        return "pl"
    return "en"


_PL_SEARCH = re.compile("[" + "".join(sorted(PL_CHARS)) + "]").search


@functools.lru_cache(maxsize=4)  # a few recent states (a state may be megabytes)
def _has_polish(text: str) -> bool:
    """The state's scan, once per state (every question of a request asks it). An ASCII text has none (checked in
    C); else one regex search: a set walk over the characters took 1 ms per 60k of them."""
    return not text.isascii() and _PL_SEARCH(text) is not None


@dataclass(frozen=True)
class Question:
    """One question ready to render. `options` are the shown option texts in criteria order."""

    qid: str
    qtype: QuestionType
    instructions_text: str
    keys: tuple[str, ...]
    options: tuple[str, ...]
    # calibration key of CALIBRATION.json (None = no calibration, upstream unknown type)
    calibration_key: str | None
    # score legend values keyed like `keys` (TypeSafe: original JSON values; upstream: shown texts)
    legend: dict[str, Any] | None = None
    # noul without given descriptions: default Tak/Nie or Yes/No depending on the language
    default_yes_no: tuple[bool, bool] = (False, False)
    # multi: MultiSpec (keys = labels, options = label texts); act: ActSpec (keys = outcomes)
    spec: Any = None
    evidence: bool = False
    # tool questions (protocol/tools.py): asked as this choice or multi, answered as a tool answer
    tool: Any = None

    @property
    def fixed(self) -> bool:
        """A single option is answered without the model (p = 1)."""
        return len(self.keys) == 1 and self.qtype != "multi"

    @property
    def large(self) -> bool:
        """11-255 options: the grouped luce2-1o strategy (§6.7)."""
        return self.qtype == "choice" and len(self.keys) > MAX_OPTIONS


@dataclass
class DecisionRequest:
    """A validated request: everything the engine needs, nothing of HTTP."""

    dialect: Dialect
    model: str
    state_text: str
    questions: list[Question] = field(default_factory=list)
    # character length of the state before facts were appended (evidence spans stay inside it)
    state_limit: int | None = None
