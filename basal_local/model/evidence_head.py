"""The evidence head (`evidence_head.pt`, docs/PROTOCOL.md §6.8): a safe loader and its scores, in NumPy.

A `.pt` file is a zip archive holding a pickle (`data.pkl`) whose tensors point at raw storages
(`data/<key>`). Unpickling arbitrary files runs arbitrary code, so this reader allows exactly the globals a
plain tensor state_dict uses (OrderedDict, `_rebuild_tensor_v2`, the typed storages) and maps each tensor to
a NumPy array. It needs no torch, so it works on every backend.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HEAD_FILE = "evidence_head.pt"
HEAD_KEYS = ("ws.weight", "us.weight", "we.weight", "ue.weight", "bs.weight", "be.weight")
LAYER_NORM_EPS = 1e-5
_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "LongStorage": np.int64, "IntStorage": np.int32,
}


class EvidenceHeadError(ValueError):
    """An evidence_head.pt that is not a plain state_dict of the expected tensors."""


@dataclass(frozen=True)
class _StorageType:
    dtype: Any


def _rebuild_tensor(storage: np.ndarray, offset: int, size: tuple, stride: tuple, *_rest: Any) -> np.ndarray:
    if not size:
        return storage[offset:offset + 1].reshape(()).copy()
    itemsize = storage.itemsize
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                           strides=tuple(s * itemsize for s in stride))
    return np.array(view, copy=True)


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, root: str) -> None:
        super().__init__(io.BytesIO(data))
        self._archive = archive
        self._root = root

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise EvidenceHeadError(f"{HEAD_FILE}: refusing to load {module}.{name} (only plain float tensors are allowed)")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise EvidenceHeadError(f"{HEAD_FILE}: unexpected storage reference {pid!r}")
        _, kind, key, _location, numel = pid
        raw = self._archive.read(f"{self._root}/data/{key}")
        array = np.frombuffer(raw, dtype=np.dtype(kind.dtype).newbyteorder("<"))
        return array[:numel].astype(kind.dtype)


def read_state_dict(path: Path) -> dict[str, np.ndarray]:
    """Tensors of a torch zip checkpoint as NumPy arrays, without executing anything in the pickle."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise EvidenceHeadError(f"{path.name}: not a torch zip checkpoint (no single data.pkl)")
            root = pickles[0][: -len("/data.pkl")]
            order = f"{root}/byteorder"
            if order in archive.namelist() and archive.read(order).strip() != b"little":
                raise EvidenceHeadError(f"{path.name}: big-endian checkpoints are not supported")
            state = _RestrictedUnpickler(archive.read(pickles[0]), archive, root).load()
    except (zipfile.BadZipFile, OSError, pickle.UnpicklingError, EOFError) as exc:
        raise EvidenceHeadError(f"{path.name}: cannot be read ({exc})") from None
    if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise EvidenceHeadError(f"{path.name}: must hold a state_dict of tensors")
    return dict(state)


class EvidenceHead:
    """Start/end scorers over the state tokens' final hidden states (query = the last prompt token)."""

    def __init__(self, tensors: dict[str, np.ndarray], hidden_size: int) -> None:
        missing = [k for k in HEAD_KEYS if k not in tensors]
        if missing:
            raise EvidenceHeadError(f"{HEAD_FILE}: missing tensor {missing[0]!r}")
        t = {k: np.asarray(tensors[k], dtype=np.float32) for k in HEAD_KEYS}
        k_dim = t["ws.weight"].shape[0]
        for name in ("ws.weight", "us.weight", "we.weight", "ue.weight"):
            if t[name].shape != (k_dim, hidden_size):
                raise EvidenceHeadError(f"{HEAD_FILE}: tensor {name!r} has shape {t[name].shape}, "
                                        f"expected ({k_dim}, {hidden_size})")
        for name in ("bs.weight", "be.weight"):
            if t[name].shape != (1, hidden_size):
                raise EvidenceHeadError(f"{HEAD_FILE}: tensor {name!r} has shape {t[name].shape}, "
                                        f"expected (1, {hidden_size})")
        self.t = t
        self.k = k_dim

    @classmethod
    def load(cls, path: Path, hidden_size: int) -> EvidenceHead:
        return cls(read_state_dict(path), hidden_size)

    @staticmethod
    def _norm(x: np.ndarray) -> np.ndarray:
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + np.float32(LAYER_NORM_EPS))

    def scores(self, hidden: np.ndarray, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Log-softmax start and end scores (f32) for each row of `hidden` [n, d] given `query` [d]."""
        h = self._norm(hidden.astype(np.float32))
        q = self._norm(query.astype(np.float32)[None, :])
        scale = np.float32(np.sqrt(self.k))
        out = []
        for w, u, b in (("ws", "us", "bs"), ("we", "ue", "be")):
            logits = (h @ self.t[f"{w}.weight"].T) @ (q @ self.t[f"{u}.weight"].T).T / scale
            logits = logits[:, 0] + (h @ self.t[f"{b}.weight"].T)[:, 0]
            top = logits.max()
            out.append((logits - top - np.log(np.exp(logits - top).sum())).astype(np.float32))
        return out[0], out[1]


def write_random_head(path: Path, hidden_size: int, k: int = 16, seed: int = 0) -> None:
    """A random head in the real file format (torch zip pickle), for generated test models."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    state = OrderedDict()
    for name in ("ws", "us", "we", "ue"):
        state[f"{name}.weight"] = torch.randn(k, hidden_size, generator=gen) / hidden_size ** 0.5
    for name in ("bs", "be"):
        state[f"{name}.weight"] = torch.randn(1, hidden_size, generator=gen) / hidden_size ** 0.5
    torch.save(state, str(path))
