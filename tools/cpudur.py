"""pytest plugin: CPU seconds (user+sys of the process and its reaped children) and wall seconds per test phase.

On a shared machine wall time says more about the neighbours than about the test; CPU time is steadier.
Use: `PYTHONPATH=tools .venv/bin/python -m pytest -n 0 -p no:randomly -p cpudur FILES`. With CPUDUR_LOG=PATH
each phase is also appended there as it ends (cpu, wall, phase, test id, xdist worker, end time;
tab-separated), so a run cut short
still leaves its figures. A daemon's CPU counts where it is reaped (the teardown of its fixture).
"""

from __future__ import annotations

import os
import resource
import time

import pytest

_rows: list[tuple[str, str, float, float]] = []


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _measure(item, phase: str):
    cpu, wall = _cpu(), time.perf_counter()
    yield
    row = (item.nodeid, phase, _cpu() - cpu, time.perf_counter() - wall)
    _rows.append(row)
    if log := os.environ.get("CPUDUR_LOG"):
        with open(log, "a", encoding="utf-8") as fh:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
            fh.write(f"{row[2]:.2f}\t{row[3]:.2f}\t{phase}\t{item.nodeid}\t{worker}\t{time.time():.2f}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _measure(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _measure(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _measure(item, "teardown")


def pytest_terminal_summary(terminalreporter) -> None:
    tr = terminalreporter
    tr.section("CPU seconds per test phase (self + reaped children), wall seconds")
    for nodeid, phase, cpu, wall in sorted(_rows, key=lambda r: -r[2])[:40]:
        if cpu >= 0.5 or wall >= 0.5:
            tr.write_line(f"{cpu:7.2f} cpu {wall:7.2f} wall  {phase:8s} {nodeid}")
    files: dict[str, list[float]] = {}
    for nodeid, _, cpu, wall in _rows:
        sums = files.setdefault(nodeid.split("::")[0], [0.0, 0.0])
        sums[0] += cpu
        sums[1] += wall
    for name, (cpu, wall) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        tr.write_line(f"{cpu:7.2f} cpu {wall:7.2f} wall  {name}")
