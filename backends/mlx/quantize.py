"""Quantized weights for the MLX backend: `--dtype q8|q4` in MLX's own format (group size 64).

The fused matrices (qkv, o_proj, gate_up, down_proj) are quantized once from the checkpoint and kept in the
user cache folder (`home_dirs()["cache"]/mlx-quantized`), keyed by the SHA-256 of model.safetensors, so a
model is converted on its first start only (and again whenever its content changes). Nothing is written into
the model directory. Embeddings, norms,
biases and the letter rows of lm_head stay in the compute dtype.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import mlx.core as mx

from ..host import FUSED

QUANTIZED = {"q8": 8, "q4": 4}
GROUP_SIZE = 64
log = logging.getLogger(__name__)


class Quantized:
    """One quantized weight matrix [out, in]: packed values, per-group scales and biases."""

    __slots__ = ("weight", "scales", "biases", "bits", "shape", "group_size", "mode")

    def __init__(self, weight: mx.array, scales: mx.array, biases: mx.array | None, bits: int,
                 shape: tuple[int, int], group_size: int = GROUP_SIZE, mode: str = "affine"):
        self.weight, self.scales, self.biases, self.bits, self.shape = weight, scales, biases, bits, shape
        self.group_size, self.mode = group_size, mode  # a shipped port's own (nvfp4: group 16, no biases)

    def matmul(self, x: mx.array) -> mx.array:
        """x @ W.T for x [T, in]."""
        return mx.quantized_matmul(x, self.weight, self.scales, self.biases, transpose=True,
                                   group_size=self.group_size, bits=self.bits, mode=self.mode)

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.weight, self.scales, self.biases) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    @property
    def size(self) -> int:
        """The elements of the matrix it stands for (as `mx.array.size`)."""
        return self.shape[0] * self.shape[1]


def cache_dir() -> Path:
    from basal_local.paths import home_dirs

    return home_dirs()["cache"] / "mlx-quantized"


def _stat_key(path: Path) -> str:
    """What the remembered hash of a file is valid for. Size and mtime alone are not enough: a file replaced by
    another of the same size with its mtime kept (`cp -p`, `rsync -t`, tar, a copy tool) would keep the old hash
    and load the old model's quantized weights. A replacement is a new inode; a write into the file, and every
    `utime` that sets an mtime back, moves its ctime, which no program can set."""
    stat = path.stat()
    return f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}|{stat.st_ino}|{stat.st_dev}"


def file_sha256(path: Path) -> str:
    """SHA-256 of a weight file, remembered per (path, size, mtime, ctime, inode) so a restart does not read it
    again while the file is the same one, unchanged."""
    path = Path(path).resolve()
    memo_file = cache_dir() / "hashes.json"
    key = _stat_key(path)
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return memo[key]
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            digest.update(chunk)
    if _stat_key(path) != key:  # written to while it was read: hash it on the next start, remember nothing
        return digest.hexdigest()
    memo = {k: v for k, v in memo.items() if not k.startswith(f"{path}|")}  # one entry per file: its latest
    memo[key] = digest.hexdigest()
    memo_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo_file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(memo, indent=1))
    os.replace(tmp, memo_file)
    return memo[key]


def cache_path(weights_path: Path, bits: int) -> Path:
    return cache_dir() / f"{file_sha256(weights_path)}-q{bits}-g{GROUP_SIZE}.safetensors"


def _fused(weights: dict[str, mx.array], prefix: str, name: str) -> mx.array:
    """The f32 matrix that load fuses for slot `name` (host.FUSED), from the checkpoint's parts."""
    return mx.concatenate([weights[f"{prefix}{part}.weight"].astype(mx.float32) for part in FUSED[name]], axis=0)


def _load_cached(path: Path) -> dict[str, mx.array] | None:
    """The cached conversion, or None when there is none or it cannot be read (a disk error, a copy cut short):
    a damaged file is removed, said in the log, and converted again, instead of failing every start."""
    if not path.exists():
        return None
    try:
        return mx.load(str(path))
    except Exception as exc:  # mlx raises RuntimeError/ValueError with the reader's own words
        log.warning("the quantized weights cached at %s cannot be read (%s); converting them again", path,
                    " ".join(str(exc).split())[:200])
        path.unlink(missing_ok=True)
        return None


def _save(path: Path, stored: dict[str, mx.array], bits: int) -> None:
    """Written to a file of this process and renamed into place; a write cut short (Ctrl-C, a full disk) removes
    its file, and files that stopped processes left (their pid gone, an hour old) are removed first: each was up to
    the whole quantized model."""
    from basal_local.paths import process_alive

    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob("*.tmp.safetensors"):
        pid = stale.name.split(".")[-3]
        try:  # an hour untouched as well: a pid is this machine's, and a shared home may be written from another
            old = time.time() - stale.stat().st_mtime > 3600
        except OSError:
            continue
        if old and pid.isdigit() and not process_alive(int(pid)):
            stale.unlink(missing_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), stored, metadata={"source_sha256": path.name.split("-")[0],
                                                        "bits": str(bits), "group_size": str(GROUP_SIZE)})
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def quantized_layers(weights_path: Path, weights: dict[str, mx.array], config, bits: int,
                     dtype: mx.Dtype) -> dict[str, Quantized]:
    """{"model.layers.{i}.{qkv|o_proj|gate_up|down_proj}": Quantized} from the cache, converting on a miss.

    A matrix whose input size is not a multiple of 64 stays dense (absent here)."""
    path = cache_path(weights_path, bits)
    stored = _load_cached(path)
    if stored is None:
        stored = {}
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}."
            for name in FUSED:
                dense = _fused(weights, prefix, name)
                if dense.shape[1] % GROUP_SIZE:
                    continue
                packed, scales, biases = mx.quantize(dense, group_size=GROUP_SIZE, bits=bits)
                stored.update({f"{prefix}{name}.weight": packed, f"{prefix}{name}.scales": scales,
                               f"{prefix}{name}.biases": biases})
                mx.eval(packed, scales, biases)
        _save(path, stored, bits)
        log.info("quantized %s to q%d once; cached at %s", weights_path, bits, path)
    out = {}
    for i in range(config.num_hidden_layers):
        for name in FUSED:
            key = f"model.layers.{i}.{name}"
            if key + ".weight" in stored:
                in_features = stored[key + ".scales"].shape[1] * GROUP_SIZE
                out[key] = Quantized(stored[key + ".weight"], stored[key + ".scales"].astype(dtype),
                                     stored[key + ".biases"].astype(dtype), bits,
                                     (stored[key + ".weight"].shape[0], in_features))
    return out
