"""Amounts of money in a `facts: "auto"` state and the simplest money lines: VAT, euro × rate, budget − spending.

Arithmetic runs in a 28-digit context rounding half to even (Python's default context, set explicitly here so a
caller's thread context cannot change it); shown amounts are quantized to 0.01 half up, which raises
`InvalidOperation` from 1e26 on (the spec's 422). An amount is only rounded when a line shows it, so a lone
huge amount leaves the state unchanged as the reference does.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Context, Decimal

MAX_AMOUNTS, MAX_EURO = 3, 3
VAT_RATES = {"23": Decimal("1.23"), "8": Decimal("1.08"), "5": Decimal("1.05")}
RATE_RANGE = (Decimal(3), Decimal(6))  # an EUR/PLN rate; "kurs akcji 45,20 zł" or "0,95 zł za jednostkę" is none

ARITH = Context(prec=28, rounding=ROUND_HALF_EVEN)
SHOWN = Context(prec=28, rounding=ROUND_HALF_UP)
CENT = Decimal("0.01")

_SEP = "[ \u00a0\u202f]"
# 1 234,56: up to three digits, then groups of three after a space; "1500 euro" and "1000 złotych" are no amounts
NUM = r"(?<![\d,.])(\d{1,3}(?:" + _SEP + r"\d{3})*)(?:,(\d+))?(?![\d])"
_PLN = r"(?:zł|PLN)(?!\w)"
_EUR = r"(?:EUR|euro|€)(?!\w)"
_PLN_MENTION = re.compile(NUM + r"[ \u00a0]?" + _PLN)
_EUR_MENTION = re.compile(NUM + r"[ \u00a0]?" + _EUR)
# the VAT lines read only amounts written `1 234,56 zł` (one plain space before zł; not PLN, not a no-break space)
_VAT_AMOUNT = re.compile(NUM + r" zł(?!\w)")
_KURS = re.compile(r"kurs\w*", re.IGNORECASE)
_CLAUSE_STOP = re.compile(r"[.!?\n]")
_RATE_FORMS = (
    re.compile(r"(?<!\d)1[ \u00a0]?" + _EUR + r"[ \u00a0]?=[ \u00a0]?" + NUM + r"[ \u00a0]?" + _PLN),  # 1 EUR = 4,30 zł
    re.compile(NUM + r"[ \u00a0]?" + _PLN + r"[ \u00a0]?(?:/[ \u00a0]?|za[ \u00a0]+(?:1[ \u00a0]+)?)" + _EUR),
)
_EXPLICIT_RATE = re.compile(NUM + r"[ \u00a0]?" + _EUR + r"[ \u00a0]?[×x*][ \u00a0]?" + NUM + r"[ \u00a0]?" + _PLN)
_VAT_RATE = re.compile(r"(?<![\d,.])(23|8|5)[ \u00a0]?%")
_VAT_WORDS = re.compile(r"VAT|podat\w* od towarów")
# a sentence ends at a line break, or at . ! ? followed by space and a capital letter
SENTENCE = re.compile(r"\n+|(?<=[.!?])\s+(?=[A-ZĄĆĘŁŃÓŚŹŻ])")
_BUDGET = re.compile(r"(?<!\w)[Bb]udżet\w*")
_SPENT = re.compile(r"(?<!\w)(wydano|wydatkowano|zużyto|wykorzystano|rozdysponowano|zaangażowano)(?!\w)")
_LABEL_REACH = 40


@dataclass(frozen=True)
class Mention:
    """A sum of money in the text: `start`/`end` span number and currency, `num` the number's start."""

    start: int
    end: int
    num: int
    value: Decimal


def number(whole: str, frac: str | None) -> Decimal:
    digits = re.sub(_SEP, "", whole)
    return Decimal(f"{digits}.{frac}" if frac else digits)


def quantize(value: Decimal) -> Decimal:
    """ROUND_HALF_UP to 0.01 in the 28-digit context (InvalidOperation from 1e26 on)."""
    return value.quantize(CENT, context=SHOWN)


def _grouped(whole: str) -> str:
    groups = []
    while len(whole) > 3:
        groups.insert(0, whole[-3:])
        whole = whole[:-3]
    return " ".join([whole, *groups])


def format_number(value: Decimal) -> str:
    """`1 234,56`: rounded to 0.01, a space between thousands, a decimal comma."""
    q = quantize(value)
    whole, frac = f"{abs(q):f}".split(".")
    return f"{'-' if q < 0 else ''}{_grouped(whole)},{frac}"


def format_amount(value: Decimal) -> str:
    """`1 234,56 zł` (§6.6 amount format)."""
    return f"{format_number(value)} zł"


def format_euro(value: Decimal) -> str:
    """A euro amount as the reference writes it: `2 000 000` for whole euros, `1 200,50` otherwise."""
    if value == value.to_integral_value():
        return _grouped(f"{value.to_integral_value():f}")
    return format_number(value)


def format_factor(value: Decimal) -> str:
    """A rate or factor as stated, decimal comma, never rounded (`4,2735`, `1,23`)."""
    return f"{value:f}".replace(".", ",")


def mul(a: Decimal | int, b: Decimal | int) -> Decimal:
    return ARITH.multiply(Decimal(a), Decimal(b))


def total(values: list[Decimal]) -> Decimal:
    out = Decimal(0)
    for v in values:
        out = ARITH.add(out, v)
    return out


def sentence_bounds(text: str) -> list[int]:
    """The start of every sentence (see SENTENCE); `bisect` on it gives a position's sentence index."""
    return [0] + [m.end() for m in SENTENCE.finditer(text)]


def pln_mentions(text: str) -> list[Mention]:
    return [Mention(m.start(), m.end(), m.start(1), number(m.group(1), m.group(2)))
            for m in _PLN_MENTION.finditer(text)]


@dataclass(frozen=True)
class Rate:
    """A stated EUR/PLN exchange rate: where it stands, its number's start, and (explicit `× rate`) the euro
    amount it multiplies."""

    start: int
    num: int
    value: Decimal
    euro_num: int | None = None
    aside: bool = False  # stated in parentheses ("kurs karty 4,41 zł" of a card payment): applied to nothing


def _plausible(value: Decimal) -> bool:
    return RATE_RANGE[0] <= value <= RATE_RANGE[1]


def _in_parentheses(text: str, pos: int) -> bool:
    window = max(text.rfind("\n", max(0, pos - 200), pos) + 1, pos - 200)  # an aside is short
    return text.rfind("(", window, pos) > text.rfind(")", window, pos)


def _kurs_rates(text: str) -> list[tuple[int, int, Decimal]]:
    """`kurs … 4,30 zł`: the first złoty number after a `kurs` word in the same sentence (no . ! ? or line break
    between); a later `kurs` word before that number adds nothing. Linear in the text."""
    mentions = pln_mentions(text)
    starts = [m.num for m in mentions]
    stops = [m.start() for m in _CLAUSE_STOP.finditer(text)]
    out: list[tuple[int, int, Decimal]] = []
    consumed = -1
    for k in _KURS.finditer(text):
        if k.start() < consumed:
            continue
        i = bisect.bisect_left(starts, k.end())
        if i == len(starts):
            break
        j = bisect.bisect_left(stops, k.end())
        if j < len(stops) and stops[j] < starts[i]:
            continue
        out.append((k.start(), mentions[i].num, mentions[i].value))
        consumed = mentions[i].end
    return out


def stated_rates(text: str) -> list[Rate]:
    found: dict[int, Rate] = {}
    for m in _EXPLICIT_RATE.finditer(text):
        value = number(m.group(3), m.group(4))
        if _plausible(value):
            found[m.start(3)] = Rate(m.start(3), m.start(3), value, m.start(1))
    candidates = [(m.start(), m.start(1), number(m.group(1), m.group(2)))
                  for pattern in _RATE_FORMS for m in pattern.finditer(text)]
    candidates += _kurs_rates(text)
    for start, num, value in candidates:
        if _plausible(value) and num not in found:
            found[num] = Rate(start, num, value, aside=_in_parentheses(text, num))
    return sorted(found.values(), key=lambda r: r.num)


# ---- (5) VAT ------------------------------------------------------------------------------------------------
def vat_rates(text: str) -> list[str]:
    """The rates 23/8/5 % stated in a sentence that names VAT, in order of first appearance."""
    rates: list[str] = []
    for sentence in SENTENCE.split(text):
        if _VAT_WORDS.search(sentence):
            for m in _VAT_RATE.finditer(sentence):
                if m.group(1) not in rates:
                    rates.append(m.group(1))
    return rates


def vat_amounts(text: str, rate_numbers: set[int]) -> list[Decimal]:
    """The first 3 distinct amounts written `N zł`, exchange rates left out."""
    out: list[Decimal] = []
    for m in _VAT_AMOUNT.finditer(text):
        value = number(m.group(1), m.group(2))
        if m.start(1) not in rate_numbers and value not in out:
            out.append(value)
    return out[:MAX_AMOUNTS]


def vat_lines(rates: list[str], amounts: list[Decimal]) -> list[str]:
    lines = []
    for amount in amounts:
        for rate in rates:
            factor = VAT_RATES[rate]
            shown = format_factor(factor)
            lines.append(f"{format_amount(amount)} × {shown} = {format_amount(mul(amount, factor))}; "
                         f"{format_amount(amount)} ÷ {shown} = {format_amount(ARITH.divide(amount, factor))}")
    return lines


# ---- (6a) euro × rate ---------------------------------------------------------------------------------------
def euro_conversions(text: str, rates: list[Rate]) -> list[tuple[Decimal, Decimal, Decimal]]:
    """(euro, rate, złoty) for the first 3 distinct euro amounts that have a rate: the one multiplied next to it,
    else the only rate value in its sentence, else the only rate value in the text."""
    bounds = sentence_bounds(text)
    by_sentence: dict[int, set[Decimal]] = {}
    for r in rates:
        if r.aside:
            continue
        by_sentence.setdefault(_index(bounds, r.num), set()).add(r.value)
    everywhere = {r.value for r in rates if not r.aside}
    explicit = {r.euro_num: r.value for r in rates if r.euro_num is not None}
    rate_spans = {r.num for r in rates} | {r.start for r in rates}
    out: list[tuple[Decimal, Decimal, Decimal]] = []
    seen: set[Decimal] = set()
    for m in _EUR_MENTION.finditer(text):
        if m.start() in rate_spans or text[max(0, m.start() - 3): m.start()] == "za ":
            continue  # "1 EUR = 4,30 zł", "4,30 zł za 1 euro"; a price "za 100 euro" is no amount to convert
        value = number(m.group(1), m.group(2))
        if value in seen:
            continue
        seen.add(value)
        rate = explicit.get(m.start(1))
        if rate is None:
            local = by_sentence.get(_index(bounds, m.start()), set())
            pool = local or everywhere
            rate = next(iter(pool)) if len(pool) == 1 else None
        if rate is not None:
            out.append((value, rate, mul(value, rate)))
    return out[:MAX_EURO]


def _index(bounds: list[int], pos: int) -> int:
    return bisect.bisect_right(bounds, pos) - 1


def euro_lines(conversions: list[tuple[Decimal, Decimal, Decimal]]) -> list[str]:
    return [f"{format_euro(e)} euro × {format_factor(r)} zł = {format_amount(z)}" for e, r, z in conversions]


# ---- (6b) budget − spending ---------------------------------------------------------------------------------
def _first_after(mentions: list[Mention], starts: list[int], pos: int) -> Mention | None:
    i = bisect.bisect_left(starts, pos)
    return mentions[i] if i < len(mentions) and mentions[i].start <= pos + _LABEL_REACH else None


def budget(text: str, mentions: list[Mention]) -> tuple[Mention, list[tuple[str, Mention]]] | None:
    """The first amount after a budget word and each amount after a (lowercase) spending verb."""
    base = None
    starts = [m.start for m in mentions]
    for m in _BUDGET.finditer(text):
        base = _first_after(mentions, starts, m.end())
        if base is not None:
            break
    if base is None:
        return None
    spent = []
    for m in _SPENT.finditer(text):
        amount = _first_after(mentions, starts, m.end())
        if amount is not None and amount is not base:
            spent.append((m.group(1), amount))
    return (base, spent) if spent else None


def remainder(found: tuple[Mention, list[tuple[str, Mention]]]) -> Decimal:
    base, spent = found
    return ARITH.subtract(base.value, total([m.value for _, m in spent]))


def budget_lines(found: tuple[Mention, list[tuple[str, Mention]]] | None) -> list[str]:
    if found is None:
        return []
    base, spent = found
    terms = " − ".join(f"{verb} {format_amount(m.value)}" for verb, m in spent)
    return [f"budżet {format_amount(base.value)} − {terms} = {format_amount(remainder(found))}"]
