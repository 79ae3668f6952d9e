"""Where models come from: a directory, a Hugging Face cache entry, or the generated demo model."""

from __future__ import annotations

import os
from pathlib import Path

SHORT_NAMES = {"mini": "Remek/basal-1.5-mini", "4.5B": "Remek/basal-1.5-4.5B", "max": "Remek/basal-1.5-max"}
DEMO_NAME = "basal-demo"


class ModelNotFound(LookupError):
    pass


def resolve_model(ref: str) -> Path:
    """A directory, or `mini`/`4.5B`/`max`/`owner/name[@rev]` already in the Hugging Face cache (never downloads)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    repo = SHORT_NAMES.get(ref, ref)
    revision = None
    if "@" in repo:
        repo, revision = repo.split("@", 1)
    if repo.count("/") != 1:
        raise ModelNotFound(f"{ref!r} is neither a model directory nor a Hugging Face repo name "
                            f"(try `basal-local serve --demo`, or `basal-local pull mini`)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except Exception:
        raise ModelNotFound(f"{repo} is not downloaded yet: run `basal-local pull {ref}` first "
                            f"(or try the demo: `basal-local serve --demo`)") from None


def pull(ref: str) -> Path:
    from huggingface_hub import snapshot_download

    repo = SHORT_NAMES.get(ref, ref)
    revision = None
    if "@" in repo:
        repo, revision = repo.split("@", 1)
    return Path(snapshot_download(repo, revision=revision))


def demo_model_dir() -> Path:
    """The demo model (tiny random weights), generated once into the cache from the bundled recipe."""
    from ..paths import home_dirs
    from .testmodel import make_test_model

    target = home_dirs()["cache"] / "demo-model"
    marker = target / "basal.json"
    if not marker.exists():
        tmp = target.with_name(f"demo-model.tmp{os.getpid()}")
        make_test_model(tmp, preset="tiny", seed=0, name=DEMO_NAME)
        if target.exists():
            import shutil

            shutil.rmtree(target)
        tmp.rename(target)
    return target
