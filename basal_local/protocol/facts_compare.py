"""Netto/brutto conversions and comparisons of `facts: "auto"` (docs/PROTOCOL.md §6.6, end of kind 6 and kind 7).

An amount labelled `netto`/`brutto` (the word right after it, parentheses allowed) converts at the first stated
VAT rate; it gets its own line unless a VAT line already shows its value. Comparisons run over a pool: item
values (the list total, else each product), then the stated amounts that are no operand of another line (unit
prices, tier prices, a delivery fee, budget and spending, rates, a złoty sum equal to a euro conversion),
then euro conversions and the budget remainder. A labelled entry carries its converted value too; labelled
entries are compared among themselves first, then with the rest, then the rest pairwise; at most 6 lines.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal

from .facts_money import ARITH, VAT_RATES, Mention, format_amount, format_factor, mul, quantize

MAX_PLAIN, MAX_COMPARE = 3, 6
_LABEL = re.compile(r"[ \u00a0]*\(?(netto|brutto)(?!\w)")


def label_of(text: str, mention: Mention) -> str | None:
    m = _LABEL.match(text, mention.end)
    return m.group(1) if m else None


def convert(value: Decimal, label: str, rate: str) -> Decimal:
    factor = VAT_RATES[rate]
    return quantize(mul(value, factor) if label == "netto" else ARITH.divide(value, factor))


def net_gross_line(value: Decimal, label: str, rate: str) -> str:
    factor = format_factor(VAT_RATES[rate])
    other = convert(value, label, rate)
    if label == "netto":
        return f"{format_amount(value)} netto × {factor} = {format_amount(other)} brutto"
    return f"{format_amount(value)} brutto ÷ {factor} = {format_amount(other)} netto"


@dataclass
class Entry:
    """One compared amount and, for a labelled one, its conversion (never compared with each other)."""

    values: list[Decimal] = field(default_factory=list)
    labelled: bool = False


def entry(value: Decimal, label: str | None, rate: str | None) -> Entry:
    if label is None or rate is None:
        return Entry([value])
    return Entry([value, convert(value, label, rate)], labelled=True)


def _symbol(a: Decimal, b: Decimal) -> str:
    qa, qb = quantize(a), quantize(b)
    return ">" if qa > qb else "<" if qa < qb else "="


def _pairs(entries: list[Entry]) -> Iterator[tuple[Decimal, Decimal]]:
    """Labelled entries among themselves, then labelled × plain, then plain pairwise (lazily: the pool may be
    long and only 6 lines are kept)."""
    labelled = [(i, v) for i, e in enumerate(entries) if e.labelled for v in e.values]
    plain = [v for e in entries if not e.labelled for v in e.values]
    for k, (i, a) in enumerate(labelled):
        for j, b in labelled[k + 1:]:
            if i != j:
                yield a, b
    for _, a in labelled:
        for b in plain:
            yield a, b
    for k, a in enumerate(plain):
        for b in plain[k + 1:]:
            yield a, b


def compare_lines(entries: list[Entry]) -> list[str]:
    return [f"{format_amount(a)} {_symbol(a, b)} {format_amount(b)}"
            for a, b in itertools.islice(_pairs(entries), MAX_COMPARE)]
