"""The date lines of `facts: "auto"` (docs/PROTOCOL.md §6.6, line kinds 1-4), as the golden cases show them.

Dates (text, dotted, ISO) in order of appearance, deduplicated, at most 6; gaps between consecutive dates;
"N dni temu" against a stated today; the first 3 dates plus each of the first 3 durations. These lines are
never cut by the 12-line cap (only the money lines are). Calendar overflow (year 10000) raises as Python does.
"""

from __future__ import annotations

import bisect
import datetime as dt
import re

MAX_DATES, MAX_DURATIONS, DURATION_DATES, MAX_AGO = 6, 3, 3, 6
TODAY_WINDOW = 40

MONTHS = ("stycznia", "lutego", "marca", "kwietnia", "maja", "czerwca", "lipca", "sierpnia", "września",
          "października", "listopada", "grudnia")
WEEKDAYS = ("poniedziałek", "wtorek", "środa", "czwartek", "piątek", "sobota", "niedziela")

# the year takes four digits with no boundary after it ("12 marca 20255 r." is 12 marca 2025)
_TEXT_DATE = re.compile(r"(?<!\d)(\d{1,2})\s+(" + "|".join(MONTHS) + r")\s+(\d{4})")
_DOTTED_DATE = re.compile(r"\b(\d{1,2})\.(\d{1,2})\.(\d{4})")
_ISO_DATE = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})")
# a stated today is case-sensitive past its first letter ("DZIŚ" is not one)
_TODAY = re.compile(r"\b[Dd]zi(?:ś|siaj)(?!\w)")
_AGO = re.compile(r"(?<![\d,.])(\d+) (?:dni|dzień) temu(?!\w)")
# a number, one plain space, a unit word (no-break spaces and "3-miesięcznym" are not durations)
_NUMBERED = re.compile(r"(?<![\d,.])(\d+) (dni|dzień|dnia|tydzień|tygodnie|tygodni|miesiąc|miesiące|miesięcy|"
                       r"rok|lata|lat)(?!\w)(?! temu)")
# a unit word alone stands for one unit ("w terminie tygodnia", "do końca roku"); "dzień" alone does not
_BARE = re.compile(r"(?<![\w-])(tydzień|tygodnia|miesiąc|miesiąca|rok|roku)(?!\w)")

_UNITS = {"dni": "d", "dzień": "d", "dnia": "d", "tydzień": "w", "tygodnie": "w", "tygodni": "w",
          "tygodnia": "w", "miesiąc": "m", "miesiące": "m", "miesięcy": "m", "miesiąca": "m", "rok": "y",
          "lata": "y", "lat": "y", "roku": "y"}
# the reference writes the singular for 1 and the 2-4 plural for every other count ("12 miesiące", "5 lata")
_UNIT_FORMS = {"d": ("dzień", "dni"), "w": ("tydzień", "tygodnie"), "m": ("miesiąc", "miesiące"),
               "y": ("rok", "lata")}

_FIXED_HOLIDAYS = {(1, 1): "Nowy Rok", (1, 6): "Trzech Króli", (5, 1): "Święto Pracy",
                   (5, 3): "Święto Konstytucji 3 Maja", (8, 15): "Wniebowzięcie NMP",
                   (11, 1): "Wszystkich Świętych", (11, 11): "Święto Niepodległości",
                   (12, 25): "Boże Narodzenie", (12, 26): "drugi dzień Bożego Narodzenia"}
_EASTER_HOLIDAYS = {0: "Wielkanoc", 1: "Poniedziałek Wielkanocny", 49: "Zielone Świątki", 60: "Boże Ciało"}


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
    """The Polish statutory holiday on `day` under the reference's names, or None (24 Dec from 2025 on)."""
    if (day.month, day.day) == (12, 24) and day.year >= 2025:
        return "Wigilia Bożego Narodzenia"
    if (day.month, day.day) in _FIXED_HOLIDAYS:
        return _FIXED_HOLIDAYS[(day.month, day.day)]
    return _EASTER_HOLIDAYS.get((day - easter(day.year)).days)


def format_date(day: dt.date) -> str:
    return f"{day.day} {MONTHS[day.month - 1]} {day.year} r."


def add_months(day: dt.date, months: int) -> dt.date:
    """Calendar months, clamped to the target month's last day. The last day is found from the first day of
    the month after, so a December 9999 target raises `year 10000 is out of range` as the reference does."""
    year, month = divmod(day.year * 12 + day.month - 1 + months, 12)
    month += 1
    after = dt.date(year + month // 12, month % 12 + 1, 1)
    last = (after - dt.timedelta(days=1)).day
    return dt.date(year, month, min(day.day, last))


def add_duration(day: dt.date, count: int, unit: str) -> dt.date:
    if unit == "d":
        return day + dt.timedelta(days=count)
    if unit == "w":
        return day + dt.timedelta(weeks=count)
    return add_months(day, count * (12 if unit == "y" else 1))


def unit_form(count: int, unit: str) -> str:
    one, other = _UNIT_FORMS[unit]
    return one if count == 1 else other


# ---- finding ------------------------------------------------------------------------------------------------
def _make_date(year: str, month: str, day: str) -> dt.date | None:
    month_no = MONTHS.index(month) + 1 if not month.isdigit() else int(month)
    try:
        return dt.date(int(year), month_no, int(day))
    except ValueError:
        return None  # 31.02, 32.01, the year 0: not a date, the text stays as it is


def find_dates(text: str) -> list[tuple[int, dt.date]]:
    """(position, date) of every valid text/dotted/ISO date, in order of appearance."""
    found = []
    for m in _TEXT_DATE.finditer(text):
        found.append((m.start(), _make_date(m.group(3), m.group(2), m.group(1))))
    for m in _DOTTED_DATE.finditer(text):
        found.append((m.start(), _make_date(m.group(3), m.group(2), m.group(1))))
    for m in _ISO_DATE.finditer(text):
        found.append((m.start(), _make_date(m.group(1), m.group(2), m.group(3))))
    return sorted((pos, day) for pos, day in found if day is not None)


def _today(text: str, positions: list[tuple[int, dt.date]]) -> dt.date | None:
    """The first date starting within 40 characters after the first `dziś`/`dzisiaj` that has one."""
    starts = [pos for pos, _ in positions]
    for m in _TODAY.finditer(text):
        i = bisect.bisect_left(starts, m.end())
        if i < len(starts) and starts[i] <= m.end() + TODAY_WINDOW:
            return positions[i][1]
    return None


def durations(text: str) -> list[tuple[int, str]]:
    """(count, unit) of the numbered durations in order, then the lone unit words; deduplicated, at most 3."""
    found: list[tuple[int, str]] = []
    items = [(int(m.group(1)), _UNITS[m.group(2)]) for m in _NUMBERED.finditer(text)]
    items += [(1, _UNITS[m.group(1)]) for m in _BARE.finditer(text)
              if not re.search(r"\d $", text[max(0, m.start() - 2): m.start()])]
    for item in items:
        if item[0] > 0 and item not in found:
            found.append(item)
    return found[:MAX_DURATIONS]


# ---- lines --------------------------------------------------------------------------------------------------
def _date_line(day: dt.date) -> str:
    line = f"{format_date(day)} to {WEEKDAYS[day.weekday()]}"
    name = holiday(day)
    return line + (f"; dzień ustawowo wolny od pracy ({name})" if name else "")


def _gap_line(a: dt.date, b: dt.date) -> str:
    days = (b - a).days
    return f"Od {format_date(a)} do {format_date(b)}: {abs(days)} dni ({'później' if days > 0 else 'wcześniej'})"


def date_lines(text: str) -> list[str]:
    """Line kinds 1-4 for a state text."""
    positions = find_dates(text)
    dates: list[dt.date] = []
    for _, day in positions:
        if day not in dates:
            dates.append(day)
    dates = dates[:MAX_DATES]
    if not dates:
        return []
    lines = [_date_line(day) for day in dates]
    lines += [_gap_line(a, b) for a, b in zip(dates, dates[1:])]
    today = _today(text, positions)
    if today is not None:
        counts: list[int] = []
        for m in _AGO.finditer(text):
            if int(m.group(1)) not in counts:
                counts.append(int(m.group(1)))
        for count in counts[:MAX_AGO]:  # no golden case has more than two; a bound keeps the block short
            lines.append(f"{count} dni przed {format_date(today)} to {format_date(today - dt.timedelta(days=count))}")
    spans = durations(text)
    for day in dates[:DURATION_DATES]:
        for count, unit in spans:
            end = add_duration(day, count, unit)
            lines.append(f"{format_date(day)} + {count} {unit_form(count, unit)} (kalendarzowo) = "
                         f"{format_date(end)} ({WEEKDAYS[end.weekday()]})")
    return lines
