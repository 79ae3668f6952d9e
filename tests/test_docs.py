"""The figures the README quotes are the recorded ones (docs/perf/*.json), and the performance page names only
records that exist."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PERF = ROOT / "docs" / "perf"


def _record(name: str) -> dict:
    return json.loads((PERF / f"{name}.json").read_text())


def _readme() -> str:
    return " ".join((ROOT / "README.md").read_text().split())  # line breaks are spaces


def test_readme_quotes_the_recorded_figures():
    mini, b45, big = (_record(f"h200-{p}-f16")["in_process"] for p in ("mini", "4.5B", "max"))
    compiled = _record("h200-4.5B-f16")["baselines"]["transformers_compiled"]
    http = _record("h200-4.5B-f16")["http"]
    two = _record("h200x2-replicas")["http"]
    expected = [
        f"{mini['single_ms_median']:.2f} ms (mini) / {b45['single_ms_median']:.2f} ms (4.5B) / "
        f"{big['single_ms_median']:.2f} ms (max)",
        f"{mini['batch32_decisions_per_s']:.1f} / {b45['batch32_decisions_per_s']:.1f} / "
        f"{big['batch32_decisions_per_s']:.1f} decisions/s",
        f"{compiled['theirs_single_ms'] / compiled['ours_single_ms']:.2f}× faster on a single decision",
        f"{compiled['ours_batch32_decisions_per_s'] / compiled['theirs_batch32_decisions_per_s']:.2f}× the decisions/s",
        f"{http['c1']['p50_ms']:.2f} ms at 1 client",
        f"{http['c32']['req_per_s']:.1f} req/s to 32 clients",
        f"{two['two_gpus_worker_processes']['req_per_s'] / two['one_gpu']['req_per_s']:.2f}× one",
    ]
    readme = _readme()
    for text in expected:
        assert text in readme, f"README should say {text!r} (docs/perf records)"


def test_performance_page_names_existing_records_and_their_figures():
    page = (ROOT / "docs" / "PERFORMANCE.md").read_text()
    named = set(re.findall(r"`(?:docs/perf/)?([\w.-]+)\.json`", page))
    assert named, "the page should name its records"
    for name in named:
        assert (PERF / f"{name}.json").is_file(), f"docs/PERFORMANCE.md names {name}.json, which is not in docs/perf"
    b45 = _record("h200-4.5B-f16")
    assert f"**{b45['in_process']['single_ms_median']:.2f} ms**" in page
    assert f"`{b45['commit']}`" in page


def test_records_say_how_they_were_made():
    for path in PERF.glob("*.json"):
        record = json.loads(path.read_text())
        for key in ("commit", "machine", "versions", "command"):
            assert record.get(key), f"{path.name} lacks {key}"


def test_architecture_map_names_only_paths_that_exist():
    """Every file or folder docs/ARCHITECTURE.md names in backticks exists (a bare module name is looked up in the
    folder its paragraph names: the rooms speak of `app.py` inside **server/**)."""
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert len(page.splitlines()) <= 200, "the map stays short: detail goes to module docstrings"
    folders = [ROOT / p for p in ("", "basal_local", "basal_local/server", "basal_local/engine", "basal_local/api",
                                  "basal_local/protocol", "basal_local/model", "basal_local/replicas",
                                  "basal_local/batches", "basal_local/telemetry", "basal_local/commands",
                                  "backends", "backends/torch", "backends/mlx", "cuda_kernels", "tui", "tests")]
    missing = []
    for name in set(re.findall(r"`([\w./*-]+(?:\.py|\.md|\.metal|\.tcss|/))`", page)):
        if "*" in name:
            found = any(any(f.glob(name)) for f in folders)
        else:
            found = any((f / name).exists() for f in folders)
        if not found:
            missing.append(name)
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {sorted(missing)}"


def test_documents_name_only_tools_that_exist():
    """A tool a document names is in tools/, or the paragraph says which commit still has it (`git show C:tools/X`,
    "a checkout of `C`")."""
    missing = []
    for page in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for paragraph in page.read_text().split("\n\n"):
            for name in set(re.findall(r"(?<![\w:/])tools/([\w.-]+\.(?:py|sh))", paragraph)):
                if not (ROOT / "tools" / name).is_file() and not re.search(r"git show|checkout of `", paragraph):
                    missing.append(f"{page.name}: tools/{name}")
    assert not missing, f"documents name tools that are gone: {sorted(missing)}"
