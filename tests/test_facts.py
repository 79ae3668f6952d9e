"""facts: "auto" (PROTOCOL.md §6.6) line kind by line kind, with values worked out by hand."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal, InvalidOperation

import pytest

from basal_local.protocol import facts as F

HEADER = "Fakty pomocnicze (wyliczone automatycznie, bez oceny prawnej):"


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
    (dt.date(2025, 11, 11), "Narodowe Święto Niepodległości"),
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


def test_unit_agreement():
    assert [F.unit_form(n, "w") for n in (1, 2, 5, 12, 22, 25)] == [
        "tydzień", "tygodnie", "tygodni", "tygodni", "tygodnie", "tygodni"]
    assert [F.unit_form(n, "y") for n in (1, 3, 5)] == ["rok", "lata", "lat"]


def test_date_lines_forms_order_dedup():
    text = "Wpłata 2025-06-19, potem 12 marca 2025 r. i 19.06.2025 oraz 1.5.2025."
    assert F.facts(text)[:3] == [
        "19 czerwca 2025 r. to czwartek; dzień ustawowo wolny od pracy (Boże Ciało)",
        "12 marca 2025 r. to środa",
        "1 maja 2025 r. to czwartek; dzień ustawowo wolny od pracy (Święto Pracy)",
    ]


def test_gap_lines():
    lines = F.facts("Od 10.03.2025 do 2025-03-01.")
    assert lines == ["10 marca 2025 r. to poniedziałek", "1 marca 2025 r. to sobota",
                     "Od 10 marca 2025 r. do 1 marca 2025 r.: 9 dni (wcześniej)"]


def test_relative_to_today():
    lines = F.facts("Dzisiaj, czyli 20.03.2025, klient pisze o zamówieniu z 10.03.2025.")
    assert "10 marca 2025 r.: 10 dni temu" in lines


def test_duration_lines():
    lines = F.facts("Umowa z 31.01.2025, wypowiedzenie 1 miesiąc, zwrot 14 dni.")
    assert lines[1:] == ["31 stycznia 2025 r. + 1 miesiąc (kalendarzowo) = 28 lutego 2025 r. (piątek)",
                         "31 stycznia 2025 r. + 14 dni (kalendarzowo) = 14 lutego 2025 r. (piątek)"]


def test_vat_lines_and_exchange_rates():
    text = "Cena 100 zł netto, stawka 23% VAT. Kurs 4,30 zł za euro. Rabat 5% bez podatku."
    assert F.facts(text) == ["100,00 zł × 1,23 = 123,00 zł; 100,00 zł ÷ 1,23 = 81,30 zł"]


def test_comparisons_with_thousands_separator():
    lines = F.facts("Budżet 1 500 zł, wydano 1 499,99 zł.")
    assert lines == ["1 500,00 zł > 1 499,99 zł"]


def test_caps():
    text = " ".join(f"{d}.01.2025" for d in range(1, 10)) + " Termin 7 dni."
    lines = F.facts(text)
    assert len(lines) == 12 and sum(" to " in line and "Od" not in line for line in lines) == 6


def test_inject_block_and_no_facts():
    assert F.inject("Nic tu nie ma.") == "Nic tu nie ma."
    assert F.inject("Termin 2025-05-03.") == ("Termin 2025-05-03.\n\n" + HEADER + "\n- 3 maja 2025 r. to sobota; "
                                              "dzień ustawowo wolny od pracy (Święto Konstytucji 3 Maja)")


def test_overflow_errors_are_python_texts():
    with pytest.raises(OverflowError, match="date value out of range"):
        F.facts("31.12.9999, termin 14 dni")
    with pytest.raises(ValueError, match="year 0 is out of range"):
        F.facts("0000-01-01")


def test_facts_over_http(app_client):
    body = {"model": "basal-test-tiny", "state": "Termin: 2025-05-03", "facts": "auto",
            "questions": {"q": {"type": "noul", "instructions": "Is it a holiday?"}}}
    status = app_client.post("/v1/systemone", json=body)
    assert status.status_code == 200, status.text
    bad = {**body, "state": "Kwota 100000000000000000000000000 zł"}
    out = app_client.post("/v1/systemone", json=bad)
    assert out.status_code == 422 and out.json() == {"detail": [{
        "type": "value_error", "loc": ["body", "state"], "msg": "[<class 'decimal.InvalidOperation'>]",
        "input": "Kwota 100000000000000000000000000 zł"}]}
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
