"""facts: "auto" (docs/PROTOCOL.md §6.6) rule by rule. Expected lines are the reference's (tests/data/facts-golden.jsonl:
the case number is given) or worked out by hand where a rule is probed beyond the golden cases."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal, InvalidOperation

import pytest

from basal_local.protocol import facts as F
from basal_local.protocol import facts_money as FM

from .test_facts_golden import GOLDEN

HEADER = "Fakty pomocnicze (wyliczone automatycznie, bez oceny prawnej):"


def golden(i: int) -> dict:
    with GOLDEN.open(encoding="utf-8") as f:
        return json.loads(f.read().splitlines()[i])


def golden_lines(i: int) -> list[str]:
    case = golden(i)
    rest = case["injected"][len(case["state"]):]
    return [line[2:] for line in rest.split("\n")[3:]] if rest else []


@pytest.mark.parametrize("year, expected", [
    (2024, dt.date(2024, 3, 31)), (2025, dt.date(2025, 4, 20)), (2019, dt.date(2019, 4, 21)),
    (2000, dt.date(2000, 4, 23)), (2038, dt.date(2038, 4, 25)), (1818, dt.date(1818, 3, 22)),
])
def test_easter(year, expected):
    assert F.easter(year) == expected


@pytest.mark.parametrize("day, name", [
    (dt.date(2025, 6, 19), "Boże Ciało"),  # Easter 20 IV + 60
    (dt.date(2025, 6, 8), "Zielone Świątki"),  # + 49
    (dt.date(2024, 4, 1), "Poniedziałek Wielkanocny"),
    (dt.date(2025, 4, 20), "Wielkanoc"),
    (dt.date(2025, 12, 24), "Wigilia Bożego Narodzenia"),
    (dt.date(2024, 12, 24), None),  # a working day before 2025
    # the reference's shorter names (golden 10, 12, 13, 14)
    (dt.date(2025, 11, 11), "Święto Niepodległości"), (dt.date(2029, 8, 15), "Wniebowzięcie NMP"),
    (dt.date(2028, 12, 25), "Boże Narodzenie"), (dt.date(2029, 1, 6), "Trzech Króli"),
    (dt.date(2025, 5, 3), "Święto Konstytucji 3 Maja"),
    (dt.date(2025, 6, 20), None),
])
def test_holidays(day, name):
    assert F.holiday(day) == name


@pytest.mark.parametrize("start, count, unit, end", [
    (dt.date(2025, 1, 31), 1, "m", dt.date(2025, 2, 28)),  # clamped to the month end
    (dt.date(2024, 1, 31), 1, "m", dt.date(2024, 2, 29)),
    (dt.date(2024, 2, 29), 1, "y", dt.date(2025, 2, 28)),
    (dt.date(2025, 3, 31), 6, "m", dt.date(2025, 9, 30)),
    (dt.date(2025, 11, 30), 3, "m", dt.date(2026, 2, 28)),
    (dt.date(2025, 3, 12), 2, "w", dt.date(2025, 3, 26)),
    (dt.date(2025, 12, 20), 14, "d", dt.date(2026, 1, 3)),
])
def test_calendar_arithmetic(start, count, unit, end):
    assert F.add_duration(start, count, unit) == end


def test_calendar_overflow_is_python_text():
    """A December 9999 target raises like the reference (golden 56: 15 XII 9998 + 12 months), days overflow
    with OverflowError (golden 53), and the year 0 is no date at all (the state stays unchanged)."""
    with pytest.raises(ValueError, match="^year 10000 is out of range$"):
        F.add_duration(dt.date(9998, 12, 15), 12, "m")
    with pytest.raises(OverflowError, match="^date value out of range$"):
        F.facts("31.12.9999, termin 14 dni")
    assert F.inject("Data 0000-01-01.") == "Data 0000-01-01."


@pytest.mark.parametrize("value, text", [
    ("1234.565", "1 234,57 zł"), ("0.005", "0,01 zł"), ("0.004", "0,00 zł"), ("1234567.8", "1 234 567,80 zł"),
    ("999.995", "1 000,00 zł"), ("12", "12,00 zł"), ("100", "100,00 zł"), ("-1500.125", "-1 500,13 zł"),
])
def test_amount_format_round_half_up(value, text):
    assert F.format_amount(Decimal(value)) == text


def test_amount_too_large_is_the_decimal_error():
    with pytest.raises(InvalidOperation) as err:
        F.format_amount(Decimal("1e26"))
    assert str(err.value) == "[<class 'decimal.InvalidOperation'>]"


def test_products_round_half_even_before_the_shown_half_up():
    """Golden 166: 74 712 092 652 804 455 673 255 541,50 × 1,23 = ...316,045 has 29 digits; the 28-digit product
    rounds half to even (...316,04), then shows ,04; golden 162's exact ...184,965 shows half up as ,97."""
    assert FM.format_amount(FM.mul(Decimal("74712092652804455673255541.50"), Decimal("1.23"))) == (
        "91 895 873 962 949 480 478 104 316,04 zł")
    assert FM.format_amount(FM.mul(Decimal("1234567890123456789012345.50"), Decimal("1.23"))) == (
        "1 518 518 504 851 851 850 485 184,97 zł")


def test_a_lone_huge_amount_is_never_rounded():
    """Only shown amounts are rounded: one 27-digit amount has no line, so the state stays as it is; with a
    VAT rate it is shown and fails (golden 161)."""
    text = "Kwota 123 456 789 012 345 678 901 234 567 zł."
    assert F.inject(text) == text
    with pytest.raises(InvalidOperation):
        F.inject(golden(161)["state"])


def test_unit_forms():
    """The reference writes the singular for 1 and the 2-4 plural for any other count (golden 29, 181, 182)."""
    assert [F.unit_form(n, "m") for n in (1, 3, 5, 12)] == ["miesiąc", "miesiące", "miesiące", "miesiące"]
    assert [F.unit_form(n, "y") for n in (1, 2, 5)] == ["rok", "lata", "lata"]
    assert [F.unit_form(n, "d") for n in (1, 14)] == ["dzień", "dni"]


@pytest.mark.parametrize("case", [7, 17, 23, 29, 30, 46, 49, 50, 52, 55])
def test_dates_gaps_durations(case):
    """Every date form, dedup, invalid dates skipped, gaps, durations on the first 3 dates; none of these lines
    is cut by the 12-line cap (golden 30 has 20)."""
    assert F.facts(golden(case)["state"]) == golden_lines(case)


def test_durations_read_as_the_reference():
    """Numbered units first, then lone `tygodnia`/`miesiąca`/`roku`/`tydzień` (1 unit); a no-break space,
    `N dni temu`, `3-miesięcznym` and a lone `dzień` are none; at most 3 (golden 40-45, 158, 181)."""
    from basal_local.protocol.facts_dates import durations

    assert durations("12 miesięcy, płatne do 10. dnia każdego miesiąca; 3 miesięcy") == [(12, "m"), (3, "m"), (1, "m")]
    assert durations("Termin 30\u00a0dni, 3-miesięczny okres, zapraszamy dzień później, 2 dni temu") == []
    assert durations("do 15 dnia miesiąca") == [(15, "d"), (1, "m")]
    assert durations("3 miesiące, 14 dni, 2 lata, 5 lat") == [(3, "m"), (14, "d"), (2, "y")]


@pytest.mark.parametrize("case", [31, 32, 33, 34, 184])
def test_days_ago_against_a_stated_today(case):
    """`N dni temu` becomes `N dni przed <today> to <date>`; `DZIŚ` in capitals is no stated today (golden 34)."""
    assert F.facts(golden(case)["state"]) == golden_lines(case)


@pytest.mark.parametrize("case", [57, 58, 60, 61, 62, 64, 66, 67, 141, 152, 154, 156, 177])
def test_vat_lines(case):
    """Per amount, per rate; only `N zł` with a plain space is read (PLN and no-break spaces are not); the rate
    needs `VAT` or `podat… od towarów` in its sentence (`Podatek od towarów` with a capital is not read)."""
    assert F.facts(golden(case)["state"]) == golden_lines(case)


@pytest.mark.parametrize("case", [68, 69, 71, 73, 74, 75, 76, 77, 79, 80, 81, 82, 84, 85, 86, 87, 88, 89, 90,
                                  91, 146, 163, 176, 182])
def test_euro_times_rate(case):
    """The rate multiplied beside it, else the only rate of its sentence, else the only rate of the text; a
    rate outside 3-6 zł, in parentheses, or an amount `za 100 euro` gets no line."""
    assert F.facts(golden(case)["state"]) == golden_lines(case)


@pytest.mark.parametrize("case", [93, 94, 95, 96, 164, 171, 172, 192])
def test_budget_minus_spending(case):
    """Lowercase spending verbs only (`Wydano` at a sentence start is not read: golden 171)."""
    assert F.facts(golden(case)["state"]) == golden_lines(case)


@pytest.mark.parametrize("case", [97, 101, 102, 103, 104, 110, 111, 113, 114, 178, 183, 189, 193])
def test_items_and_list_totals(case):
    """No line for 1 ×; a list total for 2+ items of one sentence; at most 5 items; `1 200 ×`, `10000 ×` and
    `4 dni ×` are no items."""
    assert F.facts(golden(case)["state"]) == golden_lines(case)


@pytest.mark.parametrize("case", [115, 116, 117, 118, 119, 120, 121, 122, 124, 125, 126, 127, 128, 129, 130,
                                  155, 167, 168, 169])
def test_tiered_price_lists(case):
    """The tier's own condition is echoed (`100 ≤ 138 ≤ 149`, `85 ≤ 99`, `30 < 50`, `316 ≥ 150`, `250 > 100`);
    tiers must run from 1 without a gap and the text must order exactly one quantity."""
    assert F.facts(golden(case)["state"]) == golden_lines(case)


@pytest.mark.parametrize("case", [109, 131, 132, 133, 134, 135, 179, 186, 191])
def test_delivery(case):
    assert F.facts(golden(case)["state"]) == golden_lines(case)


@pytest.mark.parametrize("case", [112, 136, 137, 138, 139, 145, 150, 157, 173, 174, 175])
def test_net_gross(case):
    """A labelled amount converts at the first stated rate unless a VAT line shows it; a list total takes its
    items' label; without a stated rate nothing converts."""
    assert F.facts(golden(case)["state"]) == golden_lines(case)


@pytest.mark.parametrize("case", [58, 63, 108, 138, 142, 143, 144, 147, 148, 170, 175, 179, 185, 197])
def test_comparisons(case):
    """All pairs (`=` too) of the pool; labelled entries carry their conversion; at most 6."""
    assert F.facts(golden(case)["state"]) == golden_lines(case)


def test_comparison_order_by_hand():
    """Labelled entries first among themselves, then with the plain ones, then plain pairs: 50 netto at 23 % is
    [50, 61,50]; 40 and 70 are plain."""
    lines = F.facts("Kwota 50,00 PLN netto, VAT 23%. Inne: 40,00 zł, 70,00 zł.")
    assert lines == ["40,00 zł × 1,23 = 49,20 zł; 40,00 zł ÷ 1,23 = 32,52 zł",
                     "70,00 zł × 1,23 = 86,10 zł; 70,00 zł ÷ 1,23 = 56,91 zł",
                     "50,00 zł netto × 1,23 = 61,50 zł brutto",
                     "50,00 zł > 40,00 zł", "50,00 zł < 70,00 zł", "61,50 zł > 40,00 zł", "61,50 zł < 70,00 zł",
                     "40,00 zł < 70,00 zł"]


@pytest.mark.parametrize("case", [149, 150, 151, 152, 153])
def test_only_money_lines_are_capped(case):
    """Money lines fill what the date lines leave of 12 (golden 151: 11 date lines leave room for the euro line
    only)."""
    lines = F.facts(golden(case)["state"])
    assert lines == golden_lines(case) and len(lines) <= 12


def test_inject_block_and_no_facts():
    assert F.inject("Nic tu nie ma.") == "Nic tu nie ma."
    assert F.inject("Termin 2025-05-03.") == ("Termin 2025-05-03.\n\n" + HEADER + "\n- 3 maja 2025 r. to sobota; "
                                              "dzień ustawowo wolny od pracy (Święto Konstytucji 3 Maja)")


def test_facts_over_http(app_client):
    body = {"model": "basal-test-tiny", "state": "Termin: 2025-05-03", "facts": "auto",
            "questions": {"q": {"type": "noul", "instructions": "Is it a holiday?"}}}
    status = app_client.post("/v1/systemone", json=body)
    assert status.status_code == 200, status.text
    bad = {**body, "state": golden(161)["state"]}  # the reference raises InvalidOperation
    out = app_client.post("/v1/systemone", json=bad)
    assert out.status_code == 422 and out.json() == {"detail": [{
        "type": "value_error", "loc": ["body", "state"], "msg": "[<class 'decimal.InvalidOperation'>]",
        "input": golden(161)["state"]}]}
    out = app_client.post("/v1/basal", json=bad)
    assert out.status_code == 422 and out.json() == {"error": "[<class 'decimal.InvalidOperation'>]"}


def test_facts_switch_language_and_evidence_stays_in_the_original_state(app_client):
    """The block is appended before language detection (its lines carry Polish letters) and evidence spans are
    clipped to the original state."""
    from basal_local.protocol.render import render_question

    state = "Order 2025-05-03, total 100 zl"
    body = {"model": "basal-test-tiny", "state": state, "facts": "auto",
            "questions": {"q": {"type": "choice", "criteria": ["yes", "no"], "evidence": True}}}
    out = app_client.post("/v1/basal", json=body)
    assert out.status_code == 200, out.text
    spans = out.json()["answers"]["q"]["evidence"]
    assert isinstance(spans, list) and len(spans) <= 3
    for span in spans:
        assert 0 <= span["start"] < span["end"] <= len(state) and span["text"] == state[span["start"]:span["end"]]
    injected = F.inject(state)
    assert injected != state
    from basal_local.protocol.questions import Question

    lang, _, prompts = render_question(injected, Question("q", "choice", "", ("yes", "no"), ("yes", "no"), "choice"))
    assert lang == "pl" and injected in prompts[0]


# A corpus of golden cases (state, the reference's lines) for tests elsewhere; [4] has budget, spending, a euro
# amount and an exchange rate (golden 151).
CORPUS = [(golden(i)["state"], golden_lines(i)) for i in (194, 31, 29, 112, 151, 93, 116, 197)]


@pytest.mark.parametrize("text, lines", CORPUS, ids=[f"corpus{i}" for i in range(len(CORPUS))])
def test_corpus_blocks(text, lines):
    expected = text if not lines else text + "\n\n" + HEADER + "\n" + "\n".join("- " + line for line in lines)
    assert F.inject(text) == expected


def test_a_large_state_takes_linear_time():
    """100 KB of dates, amounts, rates and items: about 1 s of CPU (the quadratic version took 53 s here);
    the bound is generous for a loaded 2-core machine."""
    import time

    parts = ["2 x 3 zł", "kurs 4,30", "1 EUR = 4,2 zł", "Budżet 100 zł", "wydano 5 zł", "VAT 23%.", "12.03.2025",
             "od 11 szt. 4 zł", "dziś", "14 dni", "Zamawiam 5 szt.", "netto 7 zł", "Dostawa 9 zł", "100 EUR", "\n"]
    text = " ".join(parts[(i * 7) % len(parts)] for i in range(10000))
    assert len(text) > 100_000
    started = time.process_time()
    assert len(F.facts(text)) == 12
    assert time.process_time() - started < 20


def test_a_state_longer_than_any_context_is_refused_before_the_scan(app_client):
    """facts: "auto" on a state over MAX_SCAN_CHARS is the spec's 422 at once (no minutes of scanning for a
    request the context check would refuse anyway); one character less is scanned as usual."""
    import time

    assert F.inject("x" * F.MAX_SCAN_CHARS) == "x" * F.MAX_SCAN_CHARS  # at the limit: scanned, nothing found
    too_long = "x" * (F.MAX_SCAN_CHARS + 1)
    started = time.process_time()
    with pytest.raises(ValueError, match="state too long for facts"):
        F.inject(too_long)
    assert time.process_time() - started < 0.5
    body = {"model": "basal-test-tiny", "state": too_long, "facts": "auto",
            "questions": {"q": {"type": "noul", "instructions": "Late?"}}}
    out = app_client.post("/v1/systemone", json=body)
    assert out.status_code == 422 and out.json()["detail"][0]["type"] == "value_error"
    assert out.json()["detail"][0]["loc"] == ["body", "state"]
    out = app_client.post("/v1/basal", json=body)
    assert out.status_code == 422 and out.json()["error"].startswith("state too long for facts")
