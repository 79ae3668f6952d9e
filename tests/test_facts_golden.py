"""`facts: "auto"` against the 200 golden cases of the upstream reference (docs/PROTOCOL.md §6.6), byte for byte.

Run as a script (`python tests/test_facts_golden.py [-v]`) to print the pass count and the first differing line
of every failing case.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from basal_local.protocol.facts import inject

# the upstream reference's outputs on 200 Polish states (tests/data/facts-golden.README.md explains the fields)
GOLDEN = Path(__file__).resolve().parent / "data" / "facts-golden.jsonl"


def load_cases() -> list[dict]:
    with GOLDEN.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def run_case(case: dict) -> str:
    """The reference's form of our result: the injected text, or `<ExceptionClass>: <message>`."""
    try:
        return inject(case["state"])
    except (ArithmeticError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def expected(case: dict) -> str:
    return case["injected"] if "injected" in case else case["error"]


def first_diff(want: str, got: str) -> str:
    wl, gl = want.split("\n"), got.split("\n")
    for i in range(max(len(wl), len(gl))):
        w = wl[i] if i < len(wl) else "<none>"
        g = gl[i] if i < len(gl) else "<none>"
        if w != g:
            return f"line {i}: want {w!r}\n           got  {g!r}"
    return "identical lines (bytes differ?)"


def failures() -> list[tuple[int, dict, str]]:
    out = []
    for i, case in enumerate(load_cases()):
        got = run_case(case)
        if got != expected(case):
            out.append((i, case, got))
    return out


def test_facts_golden_all_200():
    cases = load_cases()
    assert len(cases) == 200
    failed = failures()
    assert not failed, f"{200 - len(failed)}/200 pass; first failing case {failed[0][0]}: " + first_diff(
        expected(failed[0][1]), failed[0][2])


if __name__ == "__main__":
    failed = failures()
    verbose = "-v" in sys.argv
    for i, case, got in failed:
        print(f"[{i}] {case['state'][:150]!r}")
        print("   ", first_diff(expected(case), got))
        if verbose:
            print("    WANT:", expected(case))
            print("    GOT: ", got)
    print(f"{200 - len(failed)}/200 pass")
