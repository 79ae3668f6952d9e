"""`--demo-traffic`: requests that show what the engine does, sent from a few client threads until stopped.

Mostly bursts: several clients ask different questions about one shared document at the same moment, so the
batches view shows one state block with many question branches (the tokens the prefix tree saves). Now and then a
long document (a slice of the bundled corpus) and a large choice (24 options: rounds of groups, then finalists).
"""

from __future__ import annotations

import json
import logging
import random
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import Any

from ..samples import sample_requests

log = logging.getLogger("basal_local.demo")
DEMO_AGENT = "demo-traffic"
BURST = (4, 12)  # requests per burst on one document
LONG_CHARS = (3000, 6000)  # a long document: this many characters of the corpus (~1-2k tokens)
LARGE_CHOICE = 24  # options of the large choice (11-255 runs in rounds, PROTOCOL.md §6.7)

GENERIC = {
    "en": {"upset": {"type": "noul", "instructions": "Is the writer upset?"},
           "urgency": {"type": "score", "instructions": "How urgent is this message?",
                       "criteria": ["not urgent", "this week", "today", "right now"]},
           "reply": {"type": "choice", "instructions": "Who should answer this?",
                     "criteria": {"support": "Customer support", "sales": "Sales", "legal": "Legal",
                                  "nobody": "Nobody: no answer needed"}},
           "money": {"type": "noul", "instructions": "Is money involved?"}},
    "pl": {"upset": {"type": "noul", "instructions": "Czy autor jest zdenerwowany?"},
           "urgency": {"type": "score", "instructions": "Jak pilna jest ta wiadomość?",
                       "criteria": ["niepilna", "w tym tygodniu", "dzisiaj", "natychmiast"]},
           "reply": {"type": "choice", "instructions": "Kto powinien odpowiedzieć?",
                     "criteria": {"support": "Obsługa klienta", "sales": "Sprzedaż", "legal": "Dział prawny",
                                  "nobody": "Nikt: odpowiedź niepotrzebna"}},
           "money": {"type": "noul", "instructions": "Czy chodzi o pieniądze?"}},
}
TOPICS = {
    "en": ["billing", "refund", "login", "delivery", "damage", "contract", "renewal", "cancellation", "privacy",
           "pricing", "invoice", "warranty", "installation", "outage", "performance", "security", "onboarding",
           "training", "hardware", "software", "shipping", "returns", "complaint", "praise"],
    "pl": ["rozliczenia", "zwrot", "logowanie", "dostawa", "uszkodzenie", "umowa", "przedłużenie", "rezygnacja",
           "prywatność", "cennik", "faktura", "gwarancja", "montaż", "awaria", "wydajność", "bezpieczeństwo",
           "wdrożenie", "szkolenie", "sprzęt", "oprogramowanie", "wysyłka", "zwroty", "reklamacja", "pochwała"],
}


def _lang(item: dict[str, Any]) -> str:
    return "pl" if str(item.get("id", "")).startswith("pl") else "en"


def burst(item: dict[str, Any], rng: random.Random, model: str) -> list[dict[str, Any]]:
    """K requests about one document, each with one or two of its own or the generic questions."""
    pool = {**item["questions"], **GENERIC[_lang(item)]}
    out = []
    for _ in range(rng.randint(*BURST)):
        qids = rng.sample(sorted(pool), k=min(len(pool), rng.choice((1, 1, 2))))
        out.append({"model": model, "state": item["state"], "questions": {q: pool[q] for q in qids}})
    return out


def long_document(corpus: dict[str, str], rng: random.Random, model: str) -> dict[str, Any]:
    lang = rng.choice(sorted(corpus))
    text = corpus[lang]
    size = min(len(text), rng.randint(*LONG_CHARS))
    start = rng.randrange(0, max(1, len(text) - size))
    return {"model": model, "state": text[start:start + size], "questions": dict(GENERIC[lang])}


def large_choice(item: dict[str, Any], model: str) -> dict[str, Any]:
    lang = _lang(item)
    topics = TOPICS[lang][:LARGE_CHOICE]
    instructions = "Jaki jest główny temat?" if lang == "pl" else "What is the main topic?"
    return {"model": model, "state": item["state"], "questions": {"topic": {
        "type": "choice", "instructions": instructions, "criteria": {t: t.capitalize() for t in topics}}}}


def _corpus() -> dict[str, str]:
    files = resources.files("basal_local.assets")
    return {lang: files.joinpath(f"corpus_{lang}.txt").read_text(encoding="utf-8") for lang in ("en", "pl")}


def demo_traffic(url: str, stop: threading.Event, clients: int = 3, pause_s: float = 0.3,
                 api_key: str | None = None) -> list[threading.Thread]:
    """Threads that send the demo's requests until `stop` is set (daemon threads: they never hold up an exit)."""
    samples = sample_requests()
    corpus = _corpus()
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}

    def post(body: dict[str, Any]) -> None:
        req = urllib.request.Request(f"{url}/v1/systemone", json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json", "user-agent": DEMO_AGENT, **auth})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                resp.read()
        except urllib.error.HTTPError as err:
            err.read()

    def client(n: int) -> None:
        rng = random.Random(n)
        model = ""
        with ThreadPoolExecutor(BURST[1], thread_name_prefix=f"demo-traffic-{n}") as pool:
            while not stop.is_set():
                try:
                    if not model:
                        health = urllib.request.Request(f"{url}/health", headers=auth)
                        with urllib.request.urlopen(health, timeout=5) as resp:
                            model = json.load(resp)["default_model"]
                    item = rng.choice(samples)
                    roll = rng.random()
                    if roll < 0.08:
                        bodies = [long_document(corpus, rng, model)]
                    elif roll < 0.14:
                        bodies = [large_choice(item, model)]
                    elif roll < 0.8:
                        bodies = burst(item, rng, model)
                    else:  # one question, like a small client
                        qid = rng.choice(sorted(item["questions"]))
                        bodies = [{"model": model, "state": item["state"], "questions": {qid: item["questions"][qid]}}]
                    for future in [pool.submit(post, body) for body in bodies]:  # at once: one batch
                        future.result()
                except (OSError, ValueError, KeyError):
                    stop.wait(1.0)  # loading, or the daemon went away
                    continue
                stop.wait(rng.uniform(0, 2 * pause_s))

    threads = [threading.Thread(target=client, args=(n,), name=f"demo-traffic-{n}", daemon=True)
               for n in range(clients)]
    for thread in threads:
        thread.start()
    return threads
