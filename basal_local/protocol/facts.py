"""`facts: "auto"` (docs/PROTOCOL.md §6.6): a block of computed helper facts appended to a Polish state.

Written from the spec's description only. Line kinds, in this order, 12 lines in all: (1) dates with weekday
and statutory holiday, (2) gaps between consecutive dates, (3) "N dni temu" against a stated today, (4) date +
duration (calendar arithmetic, months clamped to the month end); the money kinds (5) VAT of stated rates,
(6) money arithmetic and (7) comparisons live in `facts_money.py`. Errors of the arithmetic (an amount of 1e26
or more, a date past year 9999, year 0) propagate: the dialects turn them into the spec's 422 with the
exception's text.
"""
from __future__ import annotations

import bisect
import calendar
import datetime as dt
import re

from .facts_money import MAX_AMOUNTS, MAX_COMPARE, MAX_EURO, MAX_PLAIN, format_amount, money_lines

HEADER = "Fakty pomocnicze (wyliczone automatycznie, bez oceny prawnej):"
MAX_DATES, MAX_DURATIONS, MAX_TOTAL = 6, 3, 12
__all__ = ["HEADER", "MAX_AMOUNTS", "MAX_COMPARE", "MAX_DATES", "MAX_DURATIONS", "MAX_EURO", "MAX_PLAIN",
           "MAX_TOTAL", "facts", "format_amount", "inject"]
TODAY_WINDOW = 40

MONTHS = ("stycznia", "lutego", "marca", "kwietnia", "maja", "czerwca", "lipca", "sierpnia", "września",
          "października", "listopada", "grudnia")
WEEKDAYS = ("poniedziałek", "wtorek", "środa", "czwartek", "piątek", "sobota", "niedziela")
_TEXT_DATE = re.compile(r"\b(\d{1,2})\s+(" + "|".join(MONTHS) + r")\s+(\d{4})\b(?:\s*r\.)?")
_DOTTED_DATE = re.compile(r"\b(\d{1,2})\.(\d{1,2})\.(\d{4})\b")
_ISO_DATE = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})\b")
_TODAY = re.compile(r"\b(?:dziś|dzisiaj)\b", re.IGNORECASE)
_DURATION = re.compile(r"\b(?:(\d+)\s+)?(dni|dzień|tydzień|tygodnie|tygodni|miesiąc|miesiące|miesięcy|rok|lata|lat)\b")

_UNITS = {"dni": "d", "dzień": "d", "tydzień": "w", "tygodnie": "w", "tygodni": "w", "miesiąc": "m", "miesiące": "m",
          "miesięcy": "m", "rok": "y", "lata": "y", "lat": "y"}
_UNIT_FORMS = {"d": ("dzień", "dni", "dni"), "w": ("tydzień", "tygodnie", "tygodni"),
               "m": ("miesiąc", "miesiące", "miesięcy"), "y": ("rok", "lata", "lat")}


# ---- calendar -----------------------------------------------------------------------------------------------
def easter(year: int) -> dt.date:
    """Gregorian Easter Sunday (the anonymous Gregorian algorithm)."""
    a, b, c = year % 19, year // 100, year % 100
    d, e = b // 4, b % 4
    f = (b + 8) // 25
    g = (b - f + 1) // 3
    h = (19 * a + b - d - g + 15) % 30
    i, k = c // 4, c % 4
    lw = (32 + 2 * e + 2 * i - h - k) % 7
    m = (a + 11 * h + 22 * lw) // 451
    month = (h + lw - 7 * m + 114) // 31
    day = (h + lw - 7 * m + 114) % 31 + 1
    return dt.date(year, month, day)


def holiday(day: dt.date) -> str | None:
    """The Polish statutory public holiday on `day` (ustawa o dniach wolnych od pracy), or None."""
    fixed = {(1, 1): "Nowy Rok", (1, 6): "Święto Trzech Króli", (5, 1): "Święto Pracy",
             (5, 3): "Święto Konstytucji 3 Maja", (8, 15): "Wniebowzięcie Najświętszej Maryi Panny",
             (11, 1): "Wszystkich Świętych", (11, 11): "Narodowe Święto Niepodległości",
             (12, 25): "pierwszy dzień Bożego Narodzenia", (12, 26): "drugi dzień Bożego Narodzenia"}
    if (day.month, day.day) == (12, 24) and day.year >= 2025:
        return "Wigilia Bożego Narodzenia"
    if (day.month, day.day) in fixed:
        return fixed[(day.month, day.day)]
    offset = (day - easter(day.year)).days
    return {0: "Wielkanoc", 1: "Poniedziałek Wielkanocny", 49: "Zielone Świątki", 60: "Boże Ciało"}.get(offset)


def format_date(day: dt.date) -> str:
    return f"{day.day} {MONTHS[day.month - 1]} {day.year} r."


def add_months(day: dt.date, months: int) -> dt.date:
    """Calendar months; a day past the end of the target month is clamped to its last day."""
    year, month = divmod(day.year * 12 + day.month - 1 + months, 12)
    month += 1
    last = calendar.monthrange(year, month)[1] if 1 <= year else 31
    return dt.date(year, month, min(day.day, last))


def add_duration(day: dt.date, count: int, unit: str) -> dt.date:
    if unit == "d":
        return day + dt.timedelta(days=count)
    if unit == "w":
        return day + dt.timedelta(weeks=count)
    return add_months(day, count * (12 if unit == "y" else 1))


def unit_form(count: int, unit: str) -> str:
    """Polish agreement: 1 -> singular, 2-4 (not 12-14) -> plural, else genitive plural."""
    one, few, many = _UNIT_FORMS[unit]
    if count == 1:
        return one
    if 2 <= count % 10 <= 4 and not 12 <= count % 100 <= 14:
        return few
    return many


# ---- line kinds ---------------------------------------------------------------------------------------------
def _make_date(year: str, month: str | int, day: str) -> dt.date | None:
    month_no = MONTHS.index(month) + 1 if isinstance(month, str) and not month.isdigit() else int(month)
    y, d = int(year), int(day)
    if not 1 <= month_no <= 12 or not 1 <= d <= 31:
        return None
    try:
        return dt.date(y, month_no, d)
    except ValueError as exc:
        if "year" in str(exc):
            raise
        return None  # 31.02 and the like: not a date


def find_dates(text: str) -> list[tuple[int, dt.date]]:
    """(position, date) of every text/dotted/ISO date, in order of appearance."""
    found = []
    for m in _TEXT_DATE.finditer(text):
        found.append((m.start(), _make_date(m.group(3), m.group(2), m.group(1))))
    for m in _DOTTED_DATE.finditer(text):
        found.append((m.start(), _make_date(m.group(3), m.group(2), m.group(1))))
    for m in _ISO_DATE.finditer(text):
        found.append((m.start(), _make_date(m.group(1), m.group(2), m.group(3))))
    return sorted((pos, day) for pos, day in found if day is not None)


def _date_lines(dates: list[dt.date]) -> list[str]:
    lines = []
    for day in dates:
        line = f"{format_date(day)} to {WEEKDAYS[day.weekday()]}"
        name = holiday(day)
        if name:
            line += f"; dzień ustawowo wolny od pracy ({name})"
        lines.append(line)
    return lines


def _gap_lines(dates: list[dt.date]) -> list[str]:
    lines = []
    for a, b in zip(dates, dates[1:]):
        days = (b - a).days
        lines.append(f"Od {format_date(a)} do {format_date(b)}: {abs(days)} dni "
                     f"({'później' if days > 0 else 'wcześniej'})")
    return lines


def _today(text: str, positions: list[tuple[int, dt.date]]) -> dt.date | None:
    """The first date starting within 40 characters after a `dziś`/`dzisiaj` (positions are sorted)."""
    starts = [pos for pos, _ in positions]
    for m in _TODAY.finditer(text):
        i = bisect.bisect_left(starts, m.end())
        if i < len(starts) and starts[i] <= m.end() + TODAY_WINDOW:
            return positions[i][1]
    return None


def _relative_lines(today: dt.date | None, dates: list[dt.date]) -> list[str]:
    if today is None:
        return []
    return [f"{format_date(day)}: {(today - day).days} dni temu" for day in dates if day < today]


def _durations(text: str) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for m in _DURATION.finditer(text):
        if m.group(1) is None and m.group(2) != "rok":
            continue  # a bare plural noun is not a duration; a bare "rok" means one year
        item = (int(m.group(1) or 1), _UNITS[m.group(2)])
        if item[0] > 0 and item not in found:
            found.append(item)
            if len(found) == MAX_DURATIONS:
                break
    return found


def _duration_lines(dates: list[dt.date], durations: list[tuple[int, str]]) -> list[str]:
    lines = []
    for day in dates[:3]:
        for count, unit in durations:
            end = add_duration(day, count, unit)
            lines.append(f"{format_date(day)} + {count} {unit_form(count, unit)} (kalendarzowo) = "
                         f"{format_date(end)} ({WEEKDAYS[end.weekday()]})")
    return lines


def facts(text: str) -> list[str]:
    """The fact lines for a state text (possibly none)."""
    positions = find_dates(text)
    dates: list[dt.date] = []
    for _, day in positions:
        if day not in dates:
            dates.append(day)
            if len(dates) == MAX_DATES:
                break
    lines = (_date_lines(dates) + _gap_lines(dates) + _relative_lines(_today(text, positions), dates)
             + _duration_lines(dates, _durations(text)) + money_lines(text))
    return lines[:MAX_TOTAL]


# No model's context holds a state this long (32,768 positions at most, and no token of the Basal tokenizers
# stands for 30 characters), so such a request can never be answered; refusing it here keeps a hostile
# multi-megabyte `facts: "auto"` body from costing minutes of CPU (the scan runs ~10 s per MB) before the
# context check would refuse it anyway.
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
