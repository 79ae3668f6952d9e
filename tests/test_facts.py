"""facts: "auto" (docs/PROTOCOL.md §6.6) line kind by line kind, with values worked out by hand."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal, InvalidOperation

import pytest

from basal_local.protocol import facts as F
from basal_local.protocol import facts_money as FM

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
    """(3) one line per listed date before the stated today (20 III - 10 III = 10 days, 20 III - 28 II = 20)."""
    lines = F.facts("Dzisiaj, czyli 20.03.2025, klient pisze o zamówieniu z 10.03.2025 i fakturze z 28.02.2025.")
    assert lines[5:7] == ["10 marca 2025 r.: 10 dni temu", "28 lutego 2025 r.: 20 dni temu"]
    assert lines[3:5] == ["Od 20 marca 2025 r. do 10 marca 2025 r.: 10 dni (wcześniej)",
                          "Od 10 marca 2025 r. do 28 lutego 2025 r.: 10 dni (wcześniej)"]  # 28 II + 10 = 10 III
    # a later date is no "temu"; the today date must start within 40 characters after dziś/dzisiaj
    assert not any("temu" in line for line in F.facts("Dziś jest 1.03.2025, dostawa 5.03.2025."))
    near = "dziś" + "-" * 40 + " 5.03.2025, wcześniej 1.03.2025"
    assert "1 marca 2025 r.: 4 dni temu" in F.facts(near.replace("-" * 40 + " ", "-" * 39 + " "))  # at 40
    assert not any("temu" in line for line in F.facts(near))  # at 41


def test_gap_of_one_day_says_dni():
    """§6.6 writes the gap as `N dni`; we keep it for N = 1 too (the spec's literal, not Polish agreement)."""
    assert F.facts("2025-03-03 i 2025-03-04")[2] == "Od 3 marca 2025 r. do 4 marca 2025 r.: 1 dni (później)"


def test_duration_lines():
    lines = F.facts("Umowa z 31.01.2025, wypowiedzenie 1 miesiąc, zwrot 14 dni.")
    assert lines[1:] == ["31 stycznia 2025 r. + 1 miesiąc (kalendarzowo) = 28 lutego 2025 r. (piątek)",
                         "31 stycznia 2025 r. + 14 dni (kalendarzowo) = 14 lutego 2025 r. (piątek)"]


def test_vat_lines_and_exchange_rates():
    """Only 23 % stands in a sentence naming VAT (5 % stands beside "podatku", not "podatek od towarów"); the
    exchange rate 4,30 zł is no amount. 100 / 1.23 = 81.3008... -> 81,30. The netto label adds its kind-6 line."""
    text = "Cena 100 zł netto, stawka 23% VAT. Kurs 4,30 zł za euro. Rabat 5% bez podatku."
    assert F.facts(text) == ["100,00 zł × 1,23 = 123,00 zł; 100,00 zł ÷ 1,23 = 81,30 zł",
                             "100,00 zł netto × 1,23 = 123,00 zł brutto (VAT 23%: 23,00 zł)"]


def test_vat_rates_by_sentence():
    """A sentence ends at a line break or at . ! ? before a capital letter: "2025 r. dla" stays one sentence,
    so 23 % is a VAT rate; 8 % is in a sentence without VAT; 5 % is stated in a line of its own after "VAT"."""
    text = ("Stawka 23% obowiązuje od 12 marca 2025 r. dla towarów objętych VAT. Stawka 8% dotyczy usług. "
            "Kwota 99,99 zł.")
    # 99.99 x 1.23 = 122.9877 -> 122,99; 99.99 / 1.23 = 81.2926... -> 81,29
    assert F.facts(text) == ["12 marca 2025 r. to środa",
                             "99,99 zł × 1,23 = 122,99 zł; 99,99 zł ÷ 1,23 = 81,29 zł"]
    assert FM.vat_rates("Podatek od towarów i usług\n5% dla książek") == []
    assert FM.vat_rates("Podatek od towarów i usług: 5% dla książek, 8 % dla usług, 15% nic. Potem 23% bez.") == ["5", "8"]
    assert FM.vat_rates("Stawka VAT: 23%! Druga 8%.") == ["23"]


def test_vat_rounding_half_up_and_three_amounts():
    """8 %: 0.10 / 1.08 = 0.0925... -> 0,09; 12.50 x 1.08 = 13.5; 200 / 1.08 = 185.185... -> 185,19; the fourth
    amount gets no line (first 3 amounts), a repeated amount counts once."""
    text = "VAT 8%: 12,50 zł, 12,50 zł, 0,10 zł, 200 zł i 7 zł."
    assert F.facts(text)[:3] == ["12,50 zł × 1,08 = 13,50 zł; 12,50 zł ÷ 1,08 = 11,57 zł",
                                 "0,10 zł × 1,08 = 0,11 zł; 0,10 zł ÷ 1,08 = 0,09 zł",
                                 "200,00 zł × 1,08 = 216,00 zł; 200,00 zł ÷ 1,08 = 185,19 zł"]


@pytest.mark.parametrize("text, rate", [
    ("Kurs EUR/PLN 4,2735.", Decimal("4.2735")), ("kurs wymiany: 4,30 zł", Decimal("4.30")),
    ("Po kursie 1 EUR = 4,31 zł.", Decimal("4.31")), ("1 euro = 4,32 zł", Decimal("4.32")),
    ("4,33 zł/EUR", Decimal("4.33")), ("4,34 zł za 1 euro", Decimal("4.34")), ("4.35 PLN za EUR", Decimal("4.35")),
])
def test_stated_exchange_rates(text, rate):
    assert [r for *_, r in FM.stated_rates(text)][:1] == [rate]
    assert [m for m in FM.mentions(text) if m.currency == "PLN"] == []  # a rate is no amount of money


def test_amounts_beside_euro_are_amounts():
    """Only a stated rate is excluded: "100 EUR, czyli 430 zł" has an amount of 430 zł (and no rate)."""
    found = FM.mentions("Faktura 100 EUR, czyli 430 zł; wcześniej 1.250,5 zł i 2 000 złotych.")
    assert [(m.value, m.currency) for m in found] == [(Decimal(100), "EUR"), (Decimal(430), "PLN"),
                                                       (Decimal("1250.5"), "PLN"), (Decimal(2000), "PLN")]
    assert FM.stated_rates("Faktura 100 EUR, czyli 430 zł") == []
    assert FM.stated_rates("Kursu nie podano, zapłacono 100 zł.") == []  # "kurs" and a number in one clause


def test_euro_times_stated_rate():
    """(6) euro x the first stated rate, first 3 euro amounts: 200 x 4.2735 = 854.70; 50.50 x 4.2735 =
    215.81175 -> 215,81; 2.5 x 4.2735 = 10.68375 -> 10,68; the fourth euro amount gets no line."""
    text = "Faktury: 200 EUR, 50,50 euro, 2,5 € i 7 EUR. Kurs EUR/PLN 4,2735."
    assert F.facts(text) == ["200,00 EUR × 4,2735 = 854,70 zł", "50,50 EUR × 4,2735 = 215,81 zł",
                             "2,50 EUR × 4,2735 = 10,68 zł"]
    # ROUND_HALF_UP: 2.5 x 4.25 = 10.625 -> 10,63 (half-even would give 10,62)
    assert F.facts("Opłata 2,5 EUR, 1 EUR = 4,25 zł.") == ["2,50 EUR × 4,25 = 10,63 zł"]
    assert F.facts("Opłata 2,5 EUR.") == []  # no stated rate, nothing to multiply


def test_budget_minus_spending():
    """(6) the budget minus every amount after a spending word (wydano, wydatki, koszt, zapłacono)."""
    text = "Budżet: 10 000 zł. Wydano 3 450,75 zł na sprzęt, wydatki na szkolenia: 1 200 zł, bonus 99 zł."
    assert F.facts(text)[0] == "Budżet − wydatki: 10 000,00 zł − 3 450,75 zł − 1 200,00 zł = 5 349,25 zł"
    assert F.facts("Budżet 1 500 zł, wydano 1 499,99 zł.") == [
        "Budżet − wydatki: 1 500,00 zł − 1 499,99 zł = 0,01 zł", "1 500,00 zł > 1 499,99 zł"]
    assert F.facts("Budżet 100 zł, zapłacono 250 zł.")[0] == "Budżet − wydatki: 100,00 zł − 250,00 zł = -150,00 zł"
    # the word nearest the amount decides: "z budżetu wydano" is spending
    assert F.facts("Budżet 900 zł. Z budżetu wydano 300 zł.")[0] == (
        "Budżet − wydatki: 900,00 zł − 300,00 zł = 600,00 zł")


def test_quantity_times_unit_price_and_total():
    """(6) `3 szt. po 49,99 zł`, `2 × 120 zł`, `4 x 0,125 zł`: 149.97, 240, 0.5; the total of every item."""
    text = "Pozycje: 3 szt. po 49,99 zł, 2 × 120 zł, 4 x 0,125 zł oraz 1 sztuka po 0,005 zł."
    assert F.facts(text)[:4] == ["3 × 49,99 zł = 149,97 zł", "2 × 120,00 zł = 240,00 zł",
                                 "4 × 0,13 zł = 0,50 zł",
                                 # 149.97 + 240 + 0.5 + 0.005 = 390.475 -> 390,48 (each item shown rounded)
                                 "Razem: 149,97 zł + 240,00 zł + 0,50 zł + 0,01 zł = 390,48 zł"]
    assert F.facts("Kupiono 1 x 0,125 zł.") == ["1 × 0,13 zł = 0,13 zł"]  # half up: 0.125 -> 0,13


def test_tiered_price_list():
    """(6) the highest tier reached by the ordered quantity: 60 >= 51 -> 9 zł; 60 x 9 = 540."""
    text = ("Cennik: do 10 szt. – 12 zł/szt., od 11 szt. – 10,50 zł/szt., powyżej 50 szt. – 9 zł/szt. "
            "Klient zamawia 60 szt.")
    assert F.facts(text)[0] == "Cennik progowy: 60 szt. × 9,00 zł = 540,00 zł (próg od 51 szt.)"
    assert F.facts(text.replace("60 szt.", "11 szt."))[0] == (
        "Cennik progowy: 11 szt. × 10,50 zł = 115,50 zł (próg od 11 szt.)")
    assert F.facts(text.replace("60 szt.", "10 szt."))[0] == (
        "Cennik progowy: 10 szt. × 12,00 zł = 120,00 zł (próg od 1 szt.)")
    assert not any(line.startswith("Cennik") for line in F.facts("Od 11 szt. 10 zł. Zamawiam 20 szt."))


def test_delivery_fee():
    """(6) order value + delivery fee, none from the free-delivery threshold on."""
    assert F.facts("Wartość zamówienia 180 zł. Dostawa 12,99 zł, darmowa dostawa od 200 zł.")[0] == (
        "Zamówienie + dostawa: 180,00 zł + 12,99 zł = 192,99 zł")
    assert F.facts("Wartość zamówienia 200 zł. Dostawa 12,99 zł, gratis od 200 zł.")[0] == (
        "Zamówienie + dostawa: 200,00 zł + 0,00 zł = 200,00 zł (darmowa dostawa od 200,00 zł)")
    assert F.facts("2 × 30 zł. Koszt wysyłki 9 zł.")[:2] == [
        "2 × 30,00 zł = 60,00 zł", "Zamówienie + dostawa: 60,00 zł + 9,00 zł = 69,00 zł"]
    assert not any(line.startswith("Zamówienie") for line in F.facts("Dostawa 15 zł."))  # no order value


def test_net_and_gross_of_labelled_amounts():
    """(6) netto x factor / brutto ÷ factor at the first stated VAT rate, 23 % when none is stated; the VAT is
    the difference of the rounded amounts. 540 / 1.08 = 500; 99.99 x 1.23 = 122.9877 -> 122,99."""
    lines = F.facts("Cena netto 1 000 zł, stawka VAT 8%. Cena 540 zł brutto.")
    assert lines[2:4] == ["1 000,00 zł netto × 1,08 = 1 080,00 zł brutto (VAT 8%: 80,00 zł)",
                          "540,00 zł brutto ÷ 1,08 = 500,00 zł netto (VAT 8%: 40,00 zł)"]
    assert F.facts("Usługa 99,99 zł netto, 10 zł.") == [
        "99,99 zł netto × 1,23 = 122,99 zł brutto (VAT 23%: 23,00 zł)", "99,99 zł > 10,00 zł"]


def test_comparisons_of_consecutive_amounts():
    """(7) consecutive distinct amounts, symbols only, at most 6."""
    text = "Kwoty: " + ", ".join(f"{v} zł" for v in (5, 7, 7, 3, 9, 1, 8, 2, 6, 4))
    assert F.facts(text) == ["5,00 zł < 7,00 zł", "7,00 zł > 3,00 zł", "3,00 zł < 9,00 zł", "9,00 zł > 1,00 zł",
                             "1,00 zł < 8,00 zł", "8,00 zł > 2,00 zł"]


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


# A corpus of Polish texts with dates and amounts; each block worked out by hand from §6.6 (weekdays from a
# calendar, day counts and amounts by hand; the comments give the arithmetic).
CORPUS = [
    ("Klient pyta o status paczki.", []),
    ("Dzisiaj, 14.04.2025, klient pisze, że zamówienie z 2025-03-28 (wartość 1 299,99 zł) nie dotarło. "
     "Zwrot w ciągu 14 dni.", [
         "14 kwietnia 2025 r. to poniedziałek",
         "28 marca 2025 r. to piątek",
         "Od 14 kwietnia 2025 r. do 28 marca 2025 r.: 17 dni (wcześniej)",  # 3 days to 31 III + 14
         "28 marca 2025 r.: 17 dni temu",
         "14 kwietnia 2025 r. + 14 dni (kalendarzowo) = 28 kwietnia 2025 r. (poniedziałek)",
         "28 marca 2025 r. + 14 dni (kalendarzowo) = 11 kwietnia 2025 r. (piątek)",
     ]),
    ("Umowa najmu z 31.01.2025 r. na 6 miesięcy; kaucja 2 000 zł, czynsz 1 850,50 zł. "
     "Spotkanie 1 listopada 2025 r.", [
         "31 stycznia 2025 r. to piątek",
         "1 listopada 2025 r. to sobota; dzień ustawowo wolny od pracy (Wszystkich Świętych)",
         # 28 (to 28 II) + 31 + 30 + 31 + 30 + 31 + 31 + 30 + 31 (to 31 X) + 1
         "Od 31 stycznia 2025 r. do 1 listopada 2025 r.: 274 dni (później)",
         "31 stycznia 2025 r. + 6 miesięcy (kalendarzowo) = 31 lipca 2025 r. (czwartek)",
         "1 listopada 2025 r. + 6 miesięcy (kalendarzowo) = 1 maja 2026 r. (piątek)",
         "2 000,00 zł > 1 850,50 zł",
     ]),
    ("Faktura VAT z 2025-12-24: usługa 1 000 zł netto, stawka 23%. Zaliczka 246 zł brutto. Kurs 4,25 zł za euro.", [
        "24 grudnia 2025 r. to środa; dzień ustawowo wolny od pracy (Wigilia Bożego Narodzenia)",
        "1 000,00 zł × 1,23 = 1 230,00 zł; 1 000,00 zł ÷ 1,23 = 813,01 zł",  # 813.008...
        "246,00 zł × 1,23 = 302,58 zł; 246,00 zł ÷ 1,23 = 200,00 zł",
        "1 000,00 zł netto × 1,23 = 1 230,00 zł brutto (VAT 23%: 230,00 zł)",
        "246,00 zł brutto ÷ 1,23 = 200,00 zł netto (VAT 23%: 46,00 zł)",
        "1 000,00 zł > 246,00 zł",
    ]),
    ("Budżet projektu: 10 000 zł. Wydano 3 450,75 zł na sprzęt, wydatki na szkolenia: 1 200 zł. "
     "Licencja kosztuje 500 EUR, kurs 1 EUR = 4,2650 zł.", [
         "500,00 EUR × 4,2650 = 2 132,50 zł",
         "Budżet − wydatki: 10 000,00 zł − 3 450,75 zł − 1 200,00 zł = 5 349,25 zł",
         "10 000,00 zł > 3 450,75 zł",
         "3 450,75 zł > 1 200,00 zł",
     ]),
    ("Zamówienie z 5.05.2025: 3 szt. po 49,99 zł i 2 × 120 zł. Dostawa kurierem 18,50 zł, darmowa dostawa "
     "od 300 zł.", [
         "5 maja 2025 r. to poniedziałek",
         "3 × 49,99 zł = 149,97 zł",
         "2 × 120,00 zł = 240,00 zł",
         "Razem: 149,97 zł + 240,00 zł = 389,97 zł",
         "Zamówienie + dostawa: 389,97 zł + 0,00 zł = 389,97 zł (darmowa dostawa od 300,00 zł)",
         "49,99 zł < 120,00 zł",
         "120,00 zł > 18,50 zł",
         "18,50 zł < 300,00 zł",
     ]),
    ("Cennik: do 10 szt. – 12 zł/szt., od 11 szt. – 10,50 zł/szt., powyżej 50 szt. – 9 zł/szt. "
     "Klient zamawia 60 szt. Wysyłka 15 zł.", [
         "Cennik progowy: 60 szt. × 9,00 zł = 540,00 zł (próg od 51 szt.)",
         "Zamówienie + dostawa: 540,00 zł + 15,00 zł = 555,00 zł",
         "12,00 zł > 10,50 zł",
         "10,50 zł > 9,00 zł",
         "9,00 zł < 15,00 zł",
     ]),
    ("Terminy: 2.01.2025, 9.01.2025, 16.01.2025, 23.01.2025, 30.01.2025, 6.02.2025, 13.02.2025. "
     "Przerwa 2 tygodnie.", [
         "2 stycznia 2025 r. to czwartek", "9 stycznia 2025 r. to czwartek", "16 stycznia 2025 r. to czwartek",
         "23 stycznia 2025 r. to czwartek", "30 stycznia 2025 r. to czwartek", "6 lutego 2025 r. to czwartek",
         "Od 2 stycznia 2025 r. do 9 stycznia 2025 r.: 7 dni (później)",
         "Od 9 stycznia 2025 r. do 16 stycznia 2025 r.: 7 dni (później)",
         "Od 16 stycznia 2025 r. do 23 stycznia 2025 r.: 7 dni (później)",
         "Od 23 stycznia 2025 r. do 30 stycznia 2025 r.: 7 dni (później)",
         "Od 30 stycznia 2025 r. do 6 lutego 2025 r.: 7 dni (później)",
         # the 12th line: 3 duration lines are cut to 1 by the total cap
         "2 stycznia 2025 r. + 2 tygodnie (kalendarzowo) = 16 stycznia 2025 r. (czwartek)",
     ]),
    ("Reklamacja z 2024-05-30 (Boże Ciało) i zwrot 31 marca 2024 r.; termin: rok.", [
        "30 maja 2024 r. to czwartek; dzień ustawowo wolny od pracy (Boże Ciało)",  # Easter 31 III 2024 + 60
        "31 marca 2024 r. to niedziela; dzień ustawowo wolny od pracy (Wielkanoc)",
        "Od 30 maja 2024 r. do 31 marca 2024 r.: 60 dni (wcześniej)",
        "30 maja 2024 r. + 1 rok (kalendarzowo) = 30 maja 2025 r. (piątek)",
        "31 marca 2024 r. + 1 rok (kalendarzowo) = 31 marca 2025 r. (poniedziałek)",
    ]),
]


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
