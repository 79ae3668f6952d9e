"""Quantity × unit price, list totals, tiered price lists and delivery fees of `facts: "auto"` (docs/PROTOCOL.md §6.6).

An item is `3 × 19,99 zł` / `16 kg × 1 390,70 zł` (a plain integer of at most 4 digits, an optional unit, ×);
at most 5 are read, identical ones once. A price list is a set of prices each followed by a quantity condition
(`do 99 szt.`, `od 100–199 szt.`, `powyżej 199 szt.`, `min. 10 szt.`); it applies only when its tiers run without
a gap from 1 and the text orders exactly one other quantity.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from decimal import Decimal

from .facts_money import ARITH, Mention, format_amount, mul, sentence_bounds, total

MAX_ITEMS = 5
_UNIT = r"(?:szt\.?|sztuk[ia]?|godz\.|h|kg|g|t|l|m|m2|m²|mb|os\.|osób|kpl\.|op\.|opak\.|usł\.)"
# not the 200 of "1 200" (grouped numbers are no quantities) nor part of a longer number
_QTY = re.compile(r"(?<![\d,.])(?<!\d[ \u00a0])(\d{1,4})(?!\d)[ \u00a0]?(?:" + _UNIT + r"[ \u00a0]?)?[×x*][ \u00a0]?")
_PIECES = r"(?:szt\.?|sztuk[ia]?)(?!\w)"
_TIER = re.compile(r"[^\d\n;]{0,40}?(?<!\w)(?:(od)[ \u00a0]+(\d+)[ \u00a0]*(?:do|–|-)[ \u00a0]*(\d+)|"
                   r"(do|poniżej|powyżej|od|min\.|co najmniej)[ \u00a0]+(\d+))[ \u00a0]*" + _PIECES)
_COUNT = re.compile(r"(?<![\d,.])(?<!\d[ \u00a0])(\d+)[ \u00a0]" + _PIECES)
_TIER_WORD_BEFORE = re.compile(r"(?:(?<!\w)(?:do|od|poniżej|powyżej|min\.|najmniej)|[–-])[ \u00a0]*$")
_DELIVERY = re.compile(r"dostaw|wysyłk|przesyłk|transport|kurier", re.IGNORECASE)


@dataclass(frozen=True)
class Item:
    qty: int
    price: Mention
    sentence: int

    @property
    def value(self) -> Decimal:
        return mul(self.qty, self.price.value)


def find_items(text: str, pln: list[Mention]) -> list[Item]:
    by_start = {m.start: m for m in pln}
    bounds = sentence_bounds(text)
    items: list[Item] = []
    seen: set[tuple[int, Decimal]] = set()
    for m in _QTY.finditer(text):
        price = by_start.get(m.end())
        # the price must be followed by something: a list's last line at the very end is no item (golden case)
        if price is None or price.end >= len(text):
            continue
        key = (int(m.group(1)), price.value)
        if key in seen:
            continue
        seen.add(key)
        items.append(Item(key[0], price, bisect.bisect_right(bounds, m.start()) - 1))
    return items[:MAX_ITEMS]


def items_total(items: list[Item]) -> Decimal | None:
    """The list total: two or more items in one sentence."""
    if len(items) > 1 and len({i.sentence for i in items}) == 1:
        return total([i.value for i in items])
    return None


def item_lines(items: list[Item]) -> list[str]:
    lines = [f"{i.qty} × {format_amount(i.price.value)} = {format_amount(i.value)}" for i in items if i.qty != 1]
    whole = items_total(items)
    if whole is not None:
        lines.append(f"{' + '.join(format_amount(i.value) for i in items)} = {format_amount(whole)}")
    return lines


@dataclass(frozen=True)
class Tier:
    low: int
    high: int | None  # None: no upper bound
    price: Mention
    relation: str  # "range" | "do" | "poniżej" | "od" | "powyżej"
    shown: tuple[int, ...]  # the numbers the condition states


def find_tiers(text: str, pln: list[Mention]) -> list[Tier]:
    tiers = []
    for price in pln:
        m = _TIER.match(text, price.end)
        if m is None:
            continue
        if m.group(1):
            a, b = int(m.group(2)), int(m.group(3))
            tiers.append(Tier(a, b, price, "range", (a, b)))
            continue
        word, n = m.group(4), int(m.group(5))
        if word == "do":
            tiers.append(Tier(1, n, price, "do", (n,)))
        elif word == "poniżej":
            tiers.append(Tier(1, n - 1, price, "poniżej", (n,)))
        elif word == "powyżej":
            tiers.append(Tier(n + 1, None, price, "powyżej", (n,)))
        else:
            tiers.append(Tier(n, None, price, "od", (n,)))
    return tiers


def _contiguous(tiers: list[Tier]) -> bool:
    ordered = sorted(tiers, key=lambda t: t.low)
    if len(ordered) < 2 or ordered[0].low != 1:
        return False
    for a, b in zip(ordered, ordered[1:]):
        if a.high is None or b.low != a.high + 1:
            return False
    return True


def ordered_quantity(text: str) -> int | None:
    """The one quantity in pieces that is no tier condition and no item (`Zamawiamy 98 szt.`), else None."""
    found = set()
    for m in _COUNT.finditer(text):
        if _TIER_WORD_BEFORE.search(text, max(0, m.start() - 15), m.start()):
            continue
        if re.match(r"[ \u00a0]?[×x*]", text[m.end():]):
            continue
        found.add(int(m.group(1)))
    return found.pop() if len(found) == 1 else None


def tier_choice(text: str, tiers: list[Tier]) -> tuple[int, Tier] | None:
    if not _contiguous(tiers):
        return None
    qty = ordered_quantity(text)
    if qty is None:
        return None
    for tier in tiers:
        if tier.low <= qty and (tier.high is None or qty <= tier.high):
            return qty, tier
    return None


def tier_lines(choice: tuple[int, Tier] | None) -> list[str]:
    if choice is None:
        return []
    q, t = choice
    condition = {"range": lambda: f"{t.shown[0]} ≤ {q} ≤ {t.shown[1]}", "do": lambda: f"{q} ≤ {t.shown[0]}",
                 "poniżej": lambda: f"{q} < {t.shown[0]}", "od": lambda: f"{q} ≥ {t.shown[0]}",
                 "powyżej": lambda: f"{q} > {t.shown[0]}"}[t.relation]()
    return [f"{condition}; {q} × {format_amount(t.price.value)} = {format_amount(mul(q, t.price.value))}"]


def delivery_fee(text: str, pln: list[Mention], taken: set[int]) -> Mention | None:
    """The first amount whose label (its sentence before it, back to the previous amount) names a delivery."""
    bounds = sentence_bounds(text)
    previous_end = 0
    for m in pln:
        start = max(previous_end, bounds[bisect.bisect_right(bounds, m.start) - 1])
        if m.start not in taken and _DELIVERY.search(text, start, m.start):
            return m
        previous_end = m.end
    return None


def order_value(items: list[Item], choice: tuple[int, Tier] | None) -> Decimal | None:
    """The list total, or the one item's value, or the price-list total; items in several sentences are no one
    order."""
    if items:
        return items_total(items) if len(items) > 1 else items[0].value
    if choice is not None:
        return mul(choice[0], choice[1].price.value)
    return None


def delivery_lines(base: Decimal | None, fee: Mention | None) -> list[str]:
    if base is None or fee is None:
        return []
    return [f"{format_amount(base)} + {format_amount(fee.value)} = {format_amount(ARITH.add(base, fee.value))}"]
