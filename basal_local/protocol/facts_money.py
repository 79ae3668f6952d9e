"""The money lines of `facts: "auto"` (docs/PROTOCOL.md §6.6, line kinds 5-7): VAT, money arithmetic, comparisons.

Written from the spec's description only. Amounts are `decimal.Decimal` in a 28-digit ROUND_HALF_UP context
(an amount of 1e26 or more raises `InvalidOperation` when it is rounded to 0.01: the spec's 422) and print as
`1 234,56 zł`. §6.6 names the kinds of line (6) but not their wording; the texts here follow the pattern of
the lines it does spell out (`X × 1,23 = Y`), and docs/ARCHITECTURE.md lists every choice we made.

A *mention* is a number followed by a currency (`zł`, `złotych`, `PLN`; `EUR`, `euro`, `€`). A *stated exchange
rate* is `kurs … 4,30`, `1 EUR = 4,30 zł` or `4,30 zł/EUR` (`za euro`): its number is no amount of money.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Context, Decimal

MAX_AMOUNTS, MAX_COMPARE, MAX_PLAIN, MAX_EURO = 3, 6, 3, 3
VAT_RATES = {"23": Decimal("1.23"), "8": Decimal("1.08"), "5": Decimal("1.05")}

CTX = Context(prec=28, rounding=ROUND_HALF_UP)
CENT = Decimal("0.01")

# 1 500 / 1.500 / 1500 (thousands), then ,5 / ,2735 (comma decimals) or .50 (dot decimals, two digits at most)
_NUM = r"(?<![\d,.])(\d{1,3}(?:[ \u00a0\u202f.]\d{3})+(?!\d)|\d+)(?:,(\d+)|\.(\d{1,2})(?!\d))?"
_PLN = r"(?:zł|złotych|złote|złoty|PLN)(?!\w)"
_EUR = r"(?:EUR|euro|€)(?!\w)"
_MENTION = re.compile(_NUM + r"\s?(?:(" + _PLN + r")|(" + _EUR + r"))")
_RATE_STATED = (
    # kurs EUR/PLN: 4,30 in one clause (not the 1 of "kurs 1 EUR = 4,30 zł", which the next form reads)
    re.compile(r"\bkurs\w*(?:[^\d\n.,;!?]|\.(?!\s)){0,40}?" + _NUM + r"(?!\s?" + _EUR + ")", re.IGNORECASE),
    re.compile(r"(?<!\d)1\s?" + _EUR + r"\s?=\s?" + _NUM),  # 1 EUR = 4,30 zł
    re.compile(_NUM + r"\s?" + _PLN + r"\s?(?:/\s?|za\s+(?:1\s+)?)" + _EUR, re.IGNORECASE),  # 4,30 zł/EUR
)
_VAT_RATE = re.compile(r"(?<![\d,.])(23|8|5)\s?%")
_VAT_WORDS = re.compile(r"\bVAT|\bpodat\w* od towarów", re.IGNORECASE)
# a sentence ends at a line break, or at . ! ? followed by space and a capital letter ("12 marca 2025 r. dnia"
# and "5 szt. po" stay inside their sentence)
_SENTENCE = re.compile(r"\n+|(?<=[.!?])\s+(?=[A-ZĄĆĘŁŃÓŚŹŻ])")

_BUDGET = re.compile(r"\bbudżet", re.IGNORECASE)
_SPENT = re.compile(r"\bwyda|\bkoszt|\bzapłac|\bspent", re.IGNORECASE)
_DELIVERY = re.compile(r"\bdostaw|\bwysyłk|\bprzesyłk|\bkurier", re.IGNORECASE)
_FREE = re.compile(r"\b(?:darmow|bezpłatn|gratis)", re.IGNORECASE)
_THRESHOLD_BEFORE = re.compile(r"(?:\bod|\bpowyżej|\bponad)\s*$", re.IGNORECASE)
_ORDER = re.compile(r"\b(?:zamówien|wartoś|koszyk|suma|razem|łącznie)", re.IGNORECASE)
_NET_GROSS_AFTER = re.compile(r"\s*\b(netto|brutto)\b", re.IGNORECASE)
_NET_GROSS_BEFORE = re.compile(r"\b(netto|brutto)\b[^\d]*$", re.IGNORECASE)
_PIECES = r"(?:szt\.?|sztuk[ia]?)"
_QTY_PRICE = re.compile(r"(?<![\d,.])(\d+)\s?(?:" + _PIECES + r"\s?)?(?:×|x|po)\s?(?=\d)", re.IGNORECASE)
_TIER = re.compile(r"\b(od|powyżej|ponad|do)\s+(\d+)\s?" + _PIECES + r"[^\d\n]{0,15}?(?=\d)", re.IGNORECASE)
_TIER_BEFORE = re.compile(r"(?:\bod|\bdo|\bpowyżej|\bponad)\s+$", re.IGNORECASE)
_ORDERED = re.compile(r"\b(?:zamawia|zamówi|zamówienie\s+na|kupuj|kupi)\w*[^\d\n]{0,20}?(\d+)\s?" + _PIECES,
                      re.IGNORECASE)
_LABEL_WINDOW = 40  # characters before an amount searched for its label (budżet, wydano, dostawa, netto...)


@dataclass(frozen=True)
class Mention:
    """A sum of money in the text: `start`/`end` span number and currency, `value` the number."""

    start: int
    end: int
    value: Decimal
    currency: str  # "PLN" | "EUR"


# ---- numbers and amounts ------------------------------------------------------------------------------------
_SEPARATORS = str.maketrans("", "", " \u00a0\u202f.")


def _number(whole: str, comma: str | None, dot: str | None) -> Decimal:
    digits = whole.translate(_SEPARATORS)
    frac = comma if comma is not None else dot
    return Decimal(f"{digits}.{frac}" if frac else digits)


def quantize(value: Decimal) -> Decimal:
    """ROUND_HALF_UP to 0.01 in the 28-digit context (InvalidOperation from 1e26 on)."""
    return value.quantize(CENT, context=CTX)


def format_number(value: Decimal) -> str:
    """`1 234,56`: rounded to 0.01, a space between thousands, a decimal comma."""
    q = quantize(value)
    sign = "-" if q < 0 else ""
    whole, frac = f"{abs(q):f}".split(".")
    groups = []
    while len(whole) > 3:
        groups.insert(0, whole[-3:])
        whole = whole[:-3]
    groups.insert(0, whole)
    return f"{sign}{' '.join(groups)},{frac}"


def format_amount(value: Decimal) -> str:
    """`1 234,56 zł` (§6.6 amount format)."""
    return f"{format_number(value)} zł"


def format_factor(value: Decimal) -> str:
    """A rate or factor as stated, decimal comma, never rounded (`4,2735`, `1,23`)."""
    return f"{value:f}".replace(".", ",")


def stated_rates(text: str) -> list[tuple[int, int, int, Decimal]]:
    """(match start, match end, number start, rate) of every stated exchange rate, in order of appearance."""
    found = []
    for pattern in _RATE_STATED:
        for m in pattern.finditer(text):
            found.append((m.start(), m.end(), m.start(1), _number(m.group(1), m.group(2), m.group(3))))
    return sorted(found)


def mentions(text: str, rates: list[tuple[int, int, int, Decimal]] | None = None) -> list[Mention]:
    """Every sum of money in order of appearance; a stated exchange rate (and its `1 EUR`) is none."""
    rates = stated_rates(text) if rates is None else rates
    # the mentions a rate holds: its number (`4,30 zł`) and the `1 EUR` its match starts with
    numbers = {number for _, _, number, _ in rates}
    starts = {start for start, _, _, _ in rates}
    found = []
    for m in _MENTION.finditer(text):
        if m.start(1) in numbers or m.start() in starts:
            continue
        found.append(Mention(m.start(), m.end(), _number(m.group(1), m.group(2), m.group(3)),
                             "PLN" if m.group(4) else "EUR"))
    return found


def _total(values: list[Decimal]) -> Decimal:
    """A sum in the 28-digit ROUND_HALF_UP context (never the thread's default context)."""
    total = Decimal(0)
    for v in values:
        total = CTX.add(total, v)
    return total


def _unique(values: list[Decimal]) -> list[Decimal]:
    """First occurrences in order (12,5 and 12,50 are one value)."""
    seen: set[Decimal] = set()
    out: list[Decimal] = []
    for v in values:
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


def _window(text: str, mention: Mention, previous_end: int) -> str:
    """The label before a mention: at most 40 characters, not past the previous mention or a clause end."""
    start = max(previous_end, mention.start - _LABEL_WINDOW)
    window = text[start: mention.start]
    if previous_end and start == previous_end:  # "100 zł netto, 50 zł": the netto is the previous amount's
        window = re.sub(r"^\s*(?:netto|brutto)\b", "", window, flags=re.IGNORECASE)
    return re.split(r"[;!?\n]|\.\s", window)[-1]


def _labelled(text: str, pln: list[Mention]) -> list[tuple[Mention, str]]:
    return [(m, _window(text, m, pln[i - 1].end if i else 0)) for i, m in enumerate(pln)]


# ---- (5) VAT ------------------------------------------------------------------------------------------------
def vat_rates(text: str) -> list[str]:
    """The rates 23/8/5 % stated in a sentence that names VAT, in order of first appearance."""
    rates: list[str] = []
    for sentence in _SENTENCE.split(text):
        if _VAT_WORDS.search(sentence):
            for m in _VAT_RATE.finditer(sentence):
                if m.group(1) not in rates:
                    rates.append(m.group(1))
    return rates


def vat_lines(rates: list[str], amounts: list[Decimal]) -> list[str]:
    lines = []
    for rate in rates:
        factor = VAT_RATES[rate]
        shown = format_factor(factor)
        for amount in amounts[:MAX_AMOUNTS]:
            lines.append(f"{format_amount(amount)} × {shown} = {format_amount(CTX.multiply(amount, factor))}; "
                         f"{format_amount(amount)} ÷ {shown} = {format_amount(CTX.divide(amount, factor))}")
    return lines


# ---- (6) money arithmetic -----------------------------------------------------------------------------------
def euro_lines(rates: list[tuple[int, int, int, Decimal]], found: list[Mention]) -> list[str]:
    """Euro amounts × the first stated exchange rate."""
    if not rates:
        return []
    rate = rates[0][3]
    euros = _unique([m.value for m in found if m.currency == "EUR"])[:MAX_EURO]
    return [f"{format_number(e)} EUR × {format_factor(rate)} = {format_amount(CTX.multiply(e, rate))}"
            for e in euros]


def _nearest(label: str, words: dict[str, re.Pattern[str]]) -> str | None:
    """Which word stands last in the label ("Z budżetu wydano 300 zł" is spending, "wydatki: budżet 9 zł" a
    budget)."""
    best, where = None, -1
    for name, pattern in words.items():
        for m in pattern.finditer(label):
            if m.start() > where:
                best, where = name, m.start()
    return best


def budget_lines(labelled: list[tuple[Mention, str]]) -> list[str]:
    """The first budget minus every spending stated after a spending word."""
    kinds = [(m.value, _nearest(label, {"budget": _BUDGET, "spent": _SPENT})) for m, label in labelled]
    budget = next((value for value, kind in kinds if kind == "budget"), None)
    spent = [value for value, kind in kinds if kind == "spent"]
    if budget is None or not spent:
        return []
    rest = CTX.subtract(budget, _total(spent))
    terms = " − ".join(format_amount(v) for v in [budget, *spent])
    return [f"Budżet − wydatki: {terms} = {format_amount(rest)}"]


def _items(text: str, pln: list[Mention]) -> list[tuple[int, Decimal]]:
    """(quantity, unit price) of `3 szt. po 25 zł`, `2 × 19,99 zł`, `5 x 10 zł` (not a price-list tier)."""
    by_start = {m.start: m for m in pln}
    items = []
    for m in _QTY_PRICE.finditer(text):
        price = by_start.get(m.end())
        if price is None or _TIER_BEFORE.search(text, max(0, m.start() - 20), m.start()):
            continue
        items.append((int(m.group(1)), price.value))
    return items


def item_lines(items: list[tuple[int, Decimal]]) -> list[str]:
    """Quantity × unit price per item (the first 3), then the total of every item when there are several."""
    lines = [f"{q} × {format_amount(p)} = {format_amount(CTX.multiply(q, p))}" for q, p in items[:MAX_PLAIN]]
    if len(items) > 1:
        values = [CTX.multiply(q, p) for q, p in items]
        total = _total(values)
        lines.append(f"Razem: {' + '.join(format_amount(v) for v in values)} = {format_amount(total)}")
    return lines


def _tier_price(text: str, pln: list[Mention]) -> tuple[int, Decimal, int] | None:
    """(ordered quantity, unit price, tier threshold) of a price list by quantity (`do 10 szt. 5 zł, od 11 szt.
    4 zł`, at least two tiers) applied to an ordered quantity (`zamawiam 15 szt.`)."""
    by_start = {m.start: m for m in pln}
    tiers: list[tuple[int, Decimal]] = []
    for m in _TIER.finditer(text):
        price = by_start.get(m.end())
        if price is None:
            continue
        word, count = m.group(1).lower(), int(m.group(2))
        low = count + 1 if word in ("powyżej", "ponad") else count if word == "od" else 1
        tiers.append((low, price.value))
    ordered = _ORDERED.search(text)
    if len(tiers) < 2 or ordered is None:
        return None
    qty = int(ordered.group(1))
    eligible = [t for t in tiers if t[0] <= qty]
    if not eligible:
        return None
    low, price = max(eligible, key=lambda t: t[0])  # the highest threshold reached (the first of equal ones)
    return qty, price, low


def tier_lines(tier: tuple[int, Decimal, int] | None) -> list[str]:
    if tier is None:
        return []
    qty, price, low = tier
    return [f"Cennik progowy: {qty} szt. × {format_amount(price)} = {format_amount(CTX.multiply(qty, price))} "
            f"(próg od {low} szt.)"]


def delivery_lines(labelled: list[tuple[Mention, str]], items: list[tuple[int, Decimal]],
                   tier: tuple[int, Decimal, int] | None) -> list[str]:
    """Order value + delivery fee; no fee from a stated free-delivery threshold on. The order value is the
    total of the items, else the price-list total, else the first amount labelled as an order's value."""
    fee = threshold = base = None
    for m, label in labelled:
        if _DELIVERY.search(label) or _FREE.search(label):
            if _THRESHOLD_BEFORE.search(label):
                threshold = m.value if threshold is None else threshold
            elif fee is None and _DELIVERY.search(label):
                fee = m.value
        elif base is None and _ORDER.search(label):
            base = m.value
    if items:
        base = _total([CTX.multiply(q, p) for q, p in items])
    elif tier is not None:
        base = CTX.multiply(tier[0], tier[1])
    if fee is None or base is None:
        return []
    if threshold is not None and base >= threshold:
        return [f"Zamówienie + dostawa: {format_amount(base)} + {format_amount(Decimal(0))} = {format_amount(base)} "
                f"(darmowa dostawa od {format_amount(threshold)})"]
    return [f"Zamówienie + dostawa: {format_amount(base)} + {format_amount(fee)} = "
            f"{format_amount(CTX.add(base, fee))}"]


def net_gross_lines(text: str, labelled: list[tuple[Mention, str]], rates: list[str]) -> list[str]:
    """Amounts labelled netto or brutto converted at the first stated VAT rate (23 % when none is stated)."""
    rate = rates[0] if rates else "23"
    factor = VAT_RATES[rate]
    lines = []
    for m, label in labelled:
        after = _NET_GROSS_AFTER.match(text, m.end)
        before = _NET_GROSS_BEFORE.search(label)
        kind = (after or before).group(1).lower() if (after or before) else None
        if kind == "netto":
            gross = quantize(CTX.multiply(m.value, factor))
            lines.append(f"{format_amount(m.value)} netto × {format_factor(factor)} = {format_amount(gross)} brutto "
                         f"(VAT {rate}%: {format_amount(CTX.subtract(gross, quantize(m.value)))})")
        elif kind == "brutto":
            net = quantize(CTX.divide(m.value, factor))
            lines.append(f"{format_amount(m.value)} brutto ÷ {format_factor(factor)} = {format_amount(net)} netto "
                         f"(VAT {rate}%: {format_amount(CTX.subtract(quantize(m.value), net))})")
    return lines[:MAX_PLAIN]


# ---- (7) comparisons ----------------------------------------------------------------------------------------
def compare_lines(amounts: list[Decimal]) -> list[str]:
    """Consecutive distinct amounts with the symbol between them."""
    lines = [f"{format_amount(a)} {'>' if a > b else '<'} {format_amount(b)}" for a, b in zip(amounts, amounts[1:])
             if a != b]
    return lines[:MAX_COMPARE]


def money_lines(text: str) -> list[str]:
    """Line kinds 5, 6 and 7 in order; every amount is rounded once first, so 1e26 fails whatever is shown."""
    stated = stated_rates(text)
    found = mentions(text, stated)
    for m in found:
        quantize(m.value)
    pln = [m for m in found if m.currency == "PLN"]
    amounts = _unique([m.value for m in pln])
    labelled = _labelled(text, pln)
    rates = vat_rates(text)
    items = _items(text, pln)
    tier = _tier_price(text, pln)
    return (vat_lines(rates, amounts) + euro_lines(stated, found) + budget_lines(labelled) + item_lines(items)
            + tier_lines(tier) + delivery_lines(labelled, items, tier) + net_gross_lines(text, labelled, rates)
            + compare_lines(amounts))
