"""Every question of the sample set through `/v1/basal` of a running daemon, N clients at once; the answers
(probabilities print every bit of a float64) go to a JSON file, in sample order, for bitwise comparison
between two deployments (e.g. one GPU vs two: `python tools/http_answers.py URL out.json 64`, then
`python tools/http_answers.py --compare a.json b.json`)."""

from __future__ import annotations

import json
import sys
import threading
import urllib.request

from basal_local.bench import single_question_requests


def collect(url: str, clients: int) -> list:
    url = url.rstrip("/")
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        model = json.load(resp)["models"][0]["name"]
    bodies = single_question_requests(model)
    answers: list = [None] * len(bodies)
    todo = iter(range(len(bodies)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            req = urllib.request.Request(url + "/v1/basal", json.dumps(bodies[i]).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as resp:
                answers[i] = json.load(resp)["answers"]

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return answers


def main() -> int:
    if sys.argv[1] == "--compare":
        a, b = (json.load(open(p, encoding="utf-8")) for p in sys.argv[2:4])
        same = sum(x == y for x, y in zip(a, b))
        print(json.dumps({"questions": len(a), "bitwise_equal": same, "all_equal": same == len(a) == len(b)}))
        return 0 if same == len(a) == len(b) else 1
    answers = collect(sys.argv[1], int(sys.argv[3]) if len(sys.argv) > 3 else 64)
    with open(sys.argv[2], "w", encoding="utf-8") as fh:
        json.dump(answers, fh)
    print(f"{sum(a is not None for a in answers)} answers -> {sys.argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
