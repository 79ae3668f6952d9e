"""Where models come from: a directory, a Hugging Face cache entry, or the generated demo model.

Downloaded models live in the Hugging Face cache (`HF_HUB_CACHE`, `models--OWNER--NAME`), so upstream tools
and `huggingface-cli` share them; nothing is ever downloaded implicitly (only `basal-local pull` downloads).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub

from ..paths import home_dirs

SHORT_NAMES = {"mini": "Remek/basal-1.5-mini", "4.5B": "Remek/basal-1.5-4.5B", "max": "Remek/basal-1.5-max"}
DEMO_NAME = "basal-demo"


class ModelNotFound(LookupError):
    pass


def hub_options() -> dict[str, str]:
    """HF_HUB_CACHE / HF_HOME / HF_ENDPOINT read now, not when huggingface_hub was imported."""
    out = {}
    cache = os.environ.get("HF_HUB_CACHE") or (os.environ.get("HF_HOME") and os.path.join(os.environ["HF_HOME"], "hub"))
    if cache:
        out["cache_dir"] = cache
    if os.environ.get("HF_ENDPOINT"):
        out["endpoint"] = os.environ["HF_ENDPOINT"]
    return out


# `pull 4.5B:TAG`: the upstream port repository of a short name, and (GGUF) the one file of it to download
PORT_TAGS = {"bf16": ("", None), "mlx-8bit": ("-MLX-8bit", None), "mlx-fp4": ("-MLX-fp4", None),
             "gguf-q8_0": ("-GGUF", "Q8_0"), "gguf-q4_k_m": ("-GGUF", "Q4_K_M"), "fp8": ("-FP8", None)}


# download sizes (GB) of the ports a Mac runs: 4.5B's as upstream lists them; mini's and max's from their parameter
# counts at 4.5B's ratios (8-bit 0.55x, fp4 0.31x of bf16)
MAC_PORT_GB = {"4.5B": {"bf16": 9.5, "mlx-8bit": 5.2, "mlx-fp4": 2.9},
               "mini": {"bf16": 3.2, "mlx-8bit": 1.8, "mlx-fp4": 1.0},
               "max": {"bf16": 33.3, "mlx-8bit": 18.2, "mlx-fp4": 10.2}}
# a port fits when its weights take at most this share of the Mac's memory (the rest: macOS, the apps, Metal's
# working-set limit, the cache and workspaces)
MAC_FIT_SHARE = 0.5


def mac_port_advice(ref: str, memory_bytes: int) -> tuple[str, bool] | None:
    """For `pull NAME` (no tag) on a Mac of `memory_bytes`: (the sentence naming the port that fits, whether the
    bf16 weights fit at all); None for a tagged ref, a repository name, or a name without port sizes."""
    base, tag = split_tag(ref)
    name = base.partition("@")[0]
    if tag is not None or name not in MAC_PORT_GB:
        return None
    sizes, gb = MAC_PORT_GB[name], memory_bytes / 1e9
    fits = [t for t in ("bf16", "mlx-8bit", "mlx-fp4") if sizes[t] <= MAC_FIT_SHARE * gb]
    listed = ", ".join(f"{name}:{t} {sizes[t]:g} GB" for t in ("bf16", "mlx-8bit", "mlx-fp4"))
    if "bf16" in fits:
        return (f"this Mac has {gb:.0f} GB of memory: {name} in bf16 ({sizes['bf16']:g} GB) fits; the MLX ports "
                f"are smaller and faster here ({listed})", True)
    if fits:
        return (f"this Mac has {gb:.0f} GB of memory: {name} in bf16 ({sizes['bf16']:g} GB) leaves too little; "
                f"pull {name}:{fits[0]} ({sizes[fits[0]]:g} GB), the largest port that fits ({listed})", False)
    return (f"this Mac has {gb:.0f} GB of memory: even {name}:mlx-fp4 ({sizes['mlx-fp4']:g} GB) leaves too little "
            f"({listed}); try a smaller model (mini)", False)


def split_tag(ref: str) -> tuple[str, str | None]:
    """(`name[@rev]`, tag) of `mini:mlx-8bit[@rev]`; an unknown tag lists the known ones."""
    name, at, revision = ref.partition("@")
    base, colon, tag = name.partition(":")
    if not colon:
        return ref, None
    if base not in SHORT_NAMES or tag not in PORT_TAGS:
        raise ModelNotFound(f"unknown model tag {ref!r}: give {'|'.join(SHORT_NAMES)} with a tag from "
                            f"{', '.join(PORT_TAGS)} (e.g. 4.5B:mlx-8bit)")
    return base + at + revision, tag


def pull_patterns(ref: str) -> list[str] | None:
    """The files `pull` downloads for a tag: everything, except a GGUF repository's other quantizations."""
    _, tag = split_tag(ref)
    quant = PORT_TAGS[tag][1] if tag else None
    if quant is None:
        return None
    return ["*.json", "*.jinja", "*.md", "*.txt", f"*{quant}.gguf", f"*{quant.lower()}.gguf"]


def split_ref(ref: str) -> tuple[str, str | None]:
    """(repo id, revision) of `mini|4.5B|max[:TAG]|OWNER/NAME[@REV]`; an unknown short name lists the known ones."""
    ref, tag = split_tag(ref)
    name, _, revision = ref.partition("@")
    repo = SHORT_NAMES.get(name, name) + (PORT_TAGS[tag][0] if tag else "")
    if repo.count("/") != 1 or not all(repo.split("/")):
        known = ", ".join(SHORT_NAMES)
        raise ModelNotFound(f"unknown model {ref!r}: the known names are {known}, or give a Hugging Face "
                            f"repo as OWNER/NAME[@REVISION] (e.g. {SHORT_NAMES['mini']})")
    return repo, revision or None


def _looks_like_path(ref: str) -> bool:
    return ref.startswith(("/", ".", "~", "\\")) or ref.count("/") > 1 or ref.count("\\") > 0 or (
        len(ref) > 1 and ref[1] == ":")


def resolve_model(ref: str) -> Path:
    """A directory, or `mini`/`4.5B`/`max`/`owner/name[@rev]` already in the Hugging Face cache (never downloads)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFound(f"{ref} is a file, not a model directory (give the folder that holds config.json)")
    if _looks_like_path(ref):
        raise ModelNotFound(f"no directory {ref} (give an existing model directory, or a name such as `mini`; "
                            f"`basal-local list` shows the downloaded models)")
    try:
        repo, revision = split_ref(ref)
    except ModelNotFound as exc:
        raise ModelNotFound(f"{exc}; or a model directory") from None
    try:
        options = {k: v for k, v in hub_options().items() if k == "cache_dir"}
        return Path(huggingface_hub.snapshot_download(repo, revision=revision, local_files_only=True, **options))
    except Exception:
        raise ModelNotFound(f"{repo} is not downloaded yet: run `basal-local pull {ref}` first "
                            f"(or try the demo: `basal-local serve --demo`)") from None


def pull(ref: str) -> Path:
    """Download (or finish downloading) a model into the HF cache, with huggingface_hub's own progress bars."""
    repo, revision = split_ref(ref)
    patterns = pull_patterns(ref)
    extra = {"allow_patterns": patterns} if patterns else {}
    return Path(huggingface_hub.snapshot_download(repo, revision=revision, **extra, **hub_options()))


@dataclass
class CachedModel:
    name: str          # the short name when there is one, else OWNER/NAME
    repo: str
    revision: str      # commit hash (refs such as main in `refs`)
    refs: list[str]
    size: int          # bytes on disk
    path: Path         # the snapshot folder to give --model
    repo_path: Path    # the whole cache entry (what `rm` deletes)


def cached_models() -> list[CachedModel]:
    """Every revision of a Basal model (a snapshot with basal.json) in the HF cache, plus the demo model."""
    out: list[CachedModel] = []
    short = {repo: name for name, repo in SHORT_NAMES.items()}
    short.update({repo + suffix: f"{name}:{tag}" for name, repo in SHORT_NAMES.items()
                  for tag, (suffix, _) in PORT_TAGS.items() if suffix and not suffix.endswith("GGUF")})
    short.update({repo + "-GGUF": f"{name}:gguf" for name, repo in SHORT_NAMES.items()})
    try:
        info = huggingface_hub.scan_cache_dir(hub_options().get("cache_dir"))
        repos = [r for r in info.repos if r.repo_type == "model"]
    except Exception:  # no cache folder yet
        repos = []
    for repo in sorted(repos, key=lambda r: r.repo_id):
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            if not (Path(rev.snapshot_path) / "basal.json").exists():
                continue
            out.append(CachedModel(short.get(repo.repo_id, repo.repo_id), repo.repo_id, rev.commit_hash,
                                   sorted(rev.refs), rev.size_on_disk, Path(rev.snapshot_path),
                                   Path(repo.repo_path)))
    demo = demo_model_path()
    if (demo / "basal.json").exists():
        size = sum(f.stat().st_size for f in demo.iterdir() if f.is_file())
        out.append(CachedModel(DEMO_NAME, "(generated)", "-", [], size, demo, demo))
    return out


def find_cached(ref: str) -> list[CachedModel]:
    """The cached revisions a name refers to (`mini`, `Remek/basal-1.5-mini`, `...@rev`, `basal-demo`)."""
    if ref == DEMO_NAME:
        return [m for m in cached_models() if m.name == DEMO_NAME]
    repo, revision = split_ref(ref)
    return [m for m in cached_models() if m.repo == repo and (
        revision is None or m.revision.startswith(revision) or revision in m.refs)]


def demo_model_path() -> Path:
    return home_dirs()["cache"] / "demo-model"


def demo_model_dir(on_generate=None) -> Path:
    """The demo model (tiny random weights), generated once into the cache from the bundled recipe.

    `on_generate(path)` is called just before it is really generated (not when it is already there).
    """
    from .testmodel import make_test_model  # numpy and the tokenizer trainer: only to generate the demo model

    target = demo_model_path()
    marker = target / "basal.json"
    if not marker.exists():
        if on_generate is not None:
            on_generate(target)
        _drop_abandoned(target.parent)
        tmp = target.with_name(f"demo-model.tmp{os.getpid()}")
        try:
            make_test_model(tmp, preset="tiny", seed=0, name=DEMO_NAME)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        except BaseException:  # Ctrl-C or a full disk: no half-written folder stays behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _drop_abandoned(cache: Path) -> None:
    """Half-written demo models of processes that are gone (a kill -9 mid-generation)."""
    for tmp in cache.glob("demo-model.tmp*"):
        pid = tmp.name.removeprefix("demo-model.tmp")
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                shutil.rmtree(tmp, ignore_errors=True)
            except OSError:  # alive under another user, or no way to tell: left alone
                pass
