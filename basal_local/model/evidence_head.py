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


# a real head is 4·k·d + 2·d floats (k ≈ 16–256, d ≤ 16384): far below these; a file above them is refused
MAX_PICKLE_BYTES = 1 << 20
MAX_STORAGE_BYTES = 256 << 20
MAX_TOTAL_BYTES = 512 << 20
MAX_TENSORS = 64


@dataclass(frozen=True)
class _StorageType:
    dtype: Any


def _index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < (1 << 62)


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> np.ndarray:
    """The tensor `storage[offset + Σ i_k·stride_k]`, refused unless every element lies inside the storage."""
    if not isinstance(storage, np.ndarray) or storage.ndim != 1:
        raise EvidenceHeadError(f"{HEAD_FILE}: a tensor does not point at a storage")
    if (not _index(offset) or not isinstance(size, tuple) or not isinstance(stride, tuple)
            or len(size) != len(stride) or len(size) > 8 or not all(_index(n) for n in size + stride)):
        raise EvidenceHeadError(f"{HEAD_FILE}: a tensor has an invalid size, stride or offset")
    numel = 1
    for n in size:
        numel *= n
    last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if numel else offset - 1
    if last >= storage.size or numel * storage.itemsize > MAX_STORAGE_BYTES:
        raise EvidenceHeadError(f"{HEAD_FILE}: a tensor of size {size} reaches outside its storage of "
                                f"{storage.size} elements")
    if not size:
        return storage[offset:offset + 1].reshape(()).copy()
    itemsize = storage.itemsize
    # every index was checked against the storage above, so the strided view stays inside it
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=size,
                                           strides=tuple(s * itemsize for s in stride), writeable=False)
    return np.array(view, copy=True)


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, root: str) -> None:
        super().__init__(io.BytesIO(data))
        self._archive = archive
        self._root = root
        self._storages: dict[str, np.ndarray] = {}
        self._read = 0

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
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and _index(pid[4])):
            raise EvidenceHeadError(f"{HEAD_FILE}: unexpected storage reference")
        _, kind, key, _location, numel = pid
        if key in self._storages:  # views of one storage share it
            return self._storages[key]
        if len(self._storages) >= MAX_TENSORS:
            raise EvidenceHeadError(f"{HEAD_FILE}: more than {MAX_TENSORS} storages")
        dtype = np.dtype(kind.dtype).newbyteorder("<")
        raw = _read_member(self._archive, f"{self._root}/data/{key}", min(MAX_STORAGE_BYTES,
                                                                          MAX_TOTAL_BYTES - self._read))
        self._read += len(raw)
        if numel * dtype.itemsize > len(raw):
            raise EvidenceHeadError(f"{HEAD_FILE}: storage {key!r} holds {len(raw)} bytes, its tensor needs "
                                    f"{numel * dtype.itemsize}")
        array = np.frombuffer(raw, dtype=dtype, count=numel).astype(kind.dtype)
        self._storages[key] = array
        return array


def _read_member(archive: zipfile.ZipFile, name: str, limit: int) -> bytes:
    """One zip entry, refused before inflating when it says it is larger than `limit` (and cut there if it lies)."""
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise EvidenceHeadError(f"{HEAD_FILE}: entry {name!r} is missing") from None
    if info.file_size > limit:
        raise EvidenceHeadError(f"{HEAD_FILE}: entry {name!r} inflates to {info.file_size} bytes, more than the "
                                f"{limit} an evidence head may hold")
    with archive.open(info) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise EvidenceHeadError(f"{HEAD_FILE}: entry {name!r} inflates to more than {limit} bytes")
    return data


def read_state_dict(path: Path) -> dict[str, np.ndarray]:
    """Tensors of a torch zip checkpoint as NumPy arrays, without executing anything in the pickle.

    Model directories are data from elsewhere: every size, stride and offset is checked against its storage and
    every entry's inflated size is capped, so a crafted file is refused in one sentence instead of reading out of
    bounds or filling the memory."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise EvidenceHeadError(f"{path.name}: not a torch zip checkpoint (no single data.pkl)")
            root = pickles[0][: -len("/data.pkl")]
            order = f"{root}/byteorder"
            if order in archive.namelist() and _read_member(archive, order, 64).strip() != b"little":
                raise EvidenceHeadError(f"{path.name}: big-endian checkpoints are not supported")
            state = _RestrictedUnpickler(_read_member(archive, pickles[0], MAX_PICKLE_BYTES), archive, root).load()
    except EvidenceHeadError as exc:
        raise EvidenceHeadError(f"{path.name}: {str(exc).removeprefix(HEAD_FILE + ': ')}") from None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # a damaged archive or pickle raises almost anything (zlib, struct, TypeError...)
        raise EvidenceHeadError(f"{path.name}: cannot be read ({type(exc).__name__}: {str(exc)[:120]})") from None
    if (not isinstance(state, dict) or not all(isinstance(k, str) for k in state)
            or not all(isinstance(v, np.ndarray) for v in state.values())):
        raise EvidenceHeadError(f"{path.name}: must hold a state_dict of tensors")
    return dict(state)


class EvidenceHead:
    """Start/end scorers over the state tokens' final hidden states (query = the last prompt token)."""

    def __init__(self, tensors: dict[str, np.ndarray], hidden_size: int) -> None:
        missing = [k for k in HEAD_KEYS if k not in tensors]
        if missing:
            raise EvidenceHeadError(f"{HEAD_FILE}: missing tensor {missing[0]!r}")
        t = {k: np.asarray(tensors[k], dtype=np.float32) for k in HEAD_KEYS}
        for name, tensor in t.items():
            if not np.isfinite(tensor).all():
                raise EvidenceHeadError(f"{HEAD_FILE}: tensor {name!r} holds NaN or infinite values")
        if t["ws.weight"].ndim != 2 or not 0 < t["ws.weight"].shape[0] <= 4096:
            raise EvidenceHeadError(f"{HEAD_FILE}: tensor 'ws.weight' has shape {t['ws.weight'].shape}, "
                                    f"expected (k, {hidden_size}) with 0 < k <= 4096")
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
    import torch  # only to write the file; reading it needs no torch (an MLX install has none)

    gen = torch.Generator().manual_seed(seed)
    state = OrderedDict()
    for name in ("ws", "us", "we", "ue"):
        state[f"{name}.weight"] = torch.randn(k, hidden_size, generator=gen) / hidden_size ** 0.5
    for name in ("bs", "be"):
        state[f"{name}.weight"] = torch.randn(1, hidden_size, generator=gen) / hidden_size ** 0.5
    torch.save(state, str(path))
