"""`facts: "auto"` (docs/PROTOCOL.md §6.6): a block of computed helper facts appended to a Polish state.

Written from the behaviour of the spec's golden cases (data/facts-golden.jsonl). Line kinds, in this order:
dates, gaps, "N dni temu", date + duration (`facts_dates.py`, never capped); then the money lines, cut so that
the block holds at most 12 lines: VAT, euro × rate, budget − spending (`facts_money.py`), items and list
totals, a tiered price list, order + delivery (`facts_items.py`), netto/brutto and comparisons
(`facts_compare.py`). Errors of the arithmetic (an amount of 1e26 or more, a date past year 9999) propagate:
the dialects turn them into the spec's 422 with the exception's text.
"""
from __future__ import annotations

from decimal import Decimal

from . import facts_compare as C
from . import facts_items as I
from . import facts_money as M
from .facts_dates import (
    MAX_DATES,
    MAX_DURATIONS,
    add_duration,
    add_months,
    date_lines,
    easter,
    format_date,
    holiday,
    unit_form,
)
from .facts_money import MAX_AMOUNTS, MAX_EURO, format_amount

HEADER = "Fakty pomocnicze (wyliczone automatycznie, bez oceny prawnej):"
MAX_TOTAL = 12
MAX_COMPARE, MAX_PLAIN = C.MAX_COMPARE, C.MAX_PLAIN
__all__ = ["HEADER", "MAX_AMOUNTS", "MAX_COMPARE", "MAX_DATES", "MAX_DURATIONS", "MAX_EURO", "MAX_PLAIN",
           "MAX_TOTAL", "add_duration", "add_months", "easter", "facts", "format_amount", "format_date",
           "holiday", "inject", "money_lines", "unit_form"]


def money_lines(text: str) -> list[str]:
    """The money lines of a state text in their order (uncapped)."""
    pln = M.pln_mentions(text)
    rates = M.stated_rates(text)
    rate_numbers = {r.num for r in rates}
    pln = [m for m in pln if m.num not in rate_numbers]
    vat = M.vat_rates(text)
    vat_amounts = M.vat_amounts(text, rate_numbers)
    conversions = M.euro_conversions(text, rates)
    spent = M.budget(text, pln)
    items = I.find_items(text, pln)
    tiers = I.find_tiers(text, pln)
    choice = I.tier_choice(text, tiers)
    taken = {i.price.start for i in items} | {t.price.start for t in tiers}
    base = I.order_value(items, choice)
    fee = I.delivery_fee(text, pln, taken) if base is not None else None

    rate = vat[0] if vat else None
    shown_by_vat = set(vat_amounts) if vat else set()
    whole = I.items_total(items)
    item_label = None
    if items:
        labels = {C.label_of(text, i.price) for i in items}
        item_label = labels.pop() if len(labels) == 1 else None
    net_gross: list[str] = []
    entries: list[C.Entry] = []
    item_values = [whole] if whole is not None else [i.value for i in items]
    if item_label and rate:  # a total or a product converts; its unit prices do not
        net_gross += [C.net_gross_line(v, item_label, rate) for v in item_values if v not in shown_by_vat]
    entries += [C.entry(v, item_label, rate) for v in item_values]

    operands = set(taken)
    if fee is not None:
        operands.add(fee.start)
    if spent is not None:
        operands |= {spent[0].start} | {m.start for _, m in spent[1]}
    euro_values = [z for _, _, z in conversions]
    euro_shown = {M.quantize(z) for z in euro_values}
    stated: list[Decimal] = []
    for m in pln:
        label = C.label_of(text, m)
        if label and rate and m.start not in taken and m.value not in shown_by_vat:
            net_gross.append(C.net_gross_line(m.value, label, rate))
        if m.start in operands or m.value in stated or m.value in euro_shown:
            continue
        stated.append(m.value)
        entries.append(C.entry(m.value, label, rate))
    entries += [C.Entry([M.quantize(z)]) for z in euro_values]
    if spent is not None:
        entries.append(C.Entry([M.remainder(spent)]))

    return (M.vat_lines(vat, vat_amounts) + M.euro_lines(conversions) + M.budget_lines(spent)
            + I.item_lines(items) + I.tier_lines(choice) + I.delivery_lines(base, fee)
            + net_gross[:MAX_PLAIN] + C.compare_lines(entries))


def facts(text: str) -> list[str]:
    """The fact lines for a state text (possibly none): every date line, then money lines up to 12 in all."""
    lines = date_lines(text)
    room = MAX_TOTAL - len(lines)
    money = money_lines(text) if room > 0 else []
    return lines + money[:max(room, 0)]


# No model's context holds a state this long (32,768 positions at most, and no token of the Basal tokenizers
# stands for 30 characters), so such a request can never be answered; refusing it here keeps a hostile
# multi-megabyte `facts: "auto"` body from costing minutes of CPU before the context check would refuse it.
MAX_SCAN_CHARS = 1_000_000


def inject(text: str) -> str:
    """The state with the facts block appended, or unchanged when there is nothing to add."""
    if len(text) > MAX_SCAN_CHARS:
        raise ValueError(f"state too long for facts: {len(text)} characters (at most {MAX_SCAN_CHARS})")
    lines = facts(text)
    if not lines:
        return text
    return text + "\n\n" + HEADER + "\n" + "\n".join("- " + line for line in lines)


def facts_error_text(exc: Exception) -> str:
    """The message a failure shows: Python's str() of the exception (e.g. `[<class 'decimal.InvalidOperation'>]`)."""
    return str(exc)
