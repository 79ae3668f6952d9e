"""Model directories are data from elsewhere: crafted and damaged files are refused in one sentence naming the file.

Crafted evidence heads (out-of-bounds strides, huge shapes, inflating entries), CALIBRATION.json temperatures that
would give NaN probabilities, and a seeded fuzz of every file the loader reads (safetensors header, evidence head,
tokenizer and JSON files): never a crash, never an internal error, always the file's name.
"""

from __future__ import annotations

import io
import json
import pickle
import random
import shutil
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from basal_local.model.directory import ModelLoadError, load_model_dir
from basal_local.model.evidence_head import EvidenceHeadError, read_state_dict

from .conftest import cli_run, free_port

HEAD = "evidence_head.pt"


class _StorageRef:
    def __init__(self, key: str, numel: int, kind=torch.FloatStorage) -> None:
        self.key, self.numel, self.kind = key, numel, kind


class _Tensor:
    """Pickles as torch's own `_rebuild_tensor_v2(storage, offset, size, stride, ...)` with any arguments."""

    def __init__(self, storage, offset, size, stride) -> None:
        self.args = (storage, offset, size, stride, False, OrderedDict())

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            return ("storage", obj.kind, obj.key, "cpu", obj.numel)
        return None


def crafted_head(path: Path, tensors: dict, storages: dict[str, bytes], declared: dict[str, int] | None = None) -> Path:
    """A torch-format zip whose pickle holds exactly `tensors` and whose data/ entries hold `storages`."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(OrderedDict(tensors))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", "little")
        for key, data in storages.items():
            z.writestr(f"archive/data/{key}", data)
    for key, size in (declared or {}).items():  # a central directory that claims another inflated size
        raw = bytearray(path.read_bytes())
        name = f"archive/data/{key}".encode()
        at = raw.rindex(name) - 46  # the central directory entry (46 fixed bytes, then the name)
        assert raw[at:at + 4] == b"PK\x01\x02"
        raw[at + 24:at + 28] = struct.pack("<I", size)
        path.write_bytes(bytes(raw))
    return path


FLOATS16 = struct.pack("<16f", *range(16))


@pytest.mark.parametrize("offset,size,stride,numel,match", [
    (0, (4, 4), (1000, 1), 16, "outside its storage"),        # a stride that reads past the storage
    (15, (4, 4), (4, 1), 16, "outside its storage"),          # an offset that does
    (0, (2 ** 40, 64), (64, 1), 16, "outside its storage"),   # the (2^40, 64) shape: no MemoryError
    (0, (4, 4), (-4, 1), 16, "invalid size"),                 # negative strides walk backwards out of bounds
    (-8, (2,), (1,), 16, "invalid size"),
    (0, "abcd", (1,), 16, "invalid size"),
    (0, (4, 4), (4, 1), 1 << 20, "holds 64 bytes"),           # the storage says it has more elements than bytes
])
def test_a_crafted_tensor_is_refused_naming_the_file(tmp_path, offset, size, stride, numel, match):
    path = crafted_head(tmp_path / HEAD, {"ws.weight": _Tensor(_StorageRef("0", numel), offset, size, stride)},
                        {"0": FLOATS16})
    with pytest.raises(EvidenceHeadError, match=match) as info:
        read_state_dict(path)
    assert str(info.value).startswith(f"{HEAD}: ")


def test_a_valid_crafted_tensor_still_loads(tmp_path):
    path = crafted_head(tmp_path / HEAD, {"t": _Tensor(_StorageRef("0", 16), 2, (2, 3), (1, 4))}, {"0": FLOATS16})
    assert read_state_dict(path)["t"].tolist() == [[2, 6, 10], [3, 7, 11]]  # strided, offset view of 0..15


def test_a_storage_that_is_not_a_storage_and_a_missing_entry_are_refused(tmp_path):
    path = crafted_head(tmp_path / HEAD, {"t": _Tensor(7, 0, (1,), (1,))}, {})
    with pytest.raises(EvidenceHeadError, match="does not point at a storage"):
        read_state_dict(path)
    path = crafted_head(tmp_path / HEAD, {"t": _Tensor(_StorageRef("9", 1), 0, (1,), (1,))}, {})
    with pytest.raises(EvidenceHeadError, match="missing"):
        read_state_dict(path)


def test_an_inflating_entry_is_refused_before_it_is_inflated(tmp_path):
    # a 1 KiB entry whose directory claims 1 GiB, and one that really inflates past the cap (deflated zeros)
    path = crafted_head(tmp_path / HEAD, {"t": _Tensor(_StorageRef("0", 4), 0, (4,), (1,))}, {"0": bytes(1024)},
                        declared={"0": 1 << 30})
    with pytest.raises(EvidenceHeadError, match="inflates to 1073741824 bytes"):
        read_state_dict(path)
    path = tmp_path / "real.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(OrderedDict(t=_Tensor(_StorageRef("0", 4), 0, (4,), (1,))))
        z.writestr("archive/data.pkl", buf.getvalue())
        with z.open("archive/data/0", "w", force_zip64=True) as fh:
            chunk = bytes(16 << 20)
            for _ in range((300 << 20) // len(chunk)):
                fh.write(chunk)
    assert path.stat().st_size < 2 << 20
    with pytest.raises(EvidenceHeadError, match="inflates to"):
        read_state_dict(path)


@pytest.fixture
def model_copy(tiny_model, tmp_path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(tiny_model, target)
    return target


def test_a_crafted_head_is_refused_by_serve_and_show_without_a_crash(model_copy):
    crafted_head(model_copy / HEAD, {"ws.weight": _Tensor(_StorageRef("0", 16), 0, (1 << 20, 64), (1 << 30, 1))},
                 {"0": FLOATS16})
    for argv in (["show", str(model_copy)], ["serve", "--model", str(model_copy), "--port", str(free_port())]):
        out = cli_run(argv, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, (argv, out.returncode, out.stderr)  # not 139 (segfault), not 1 (internal error)
        assert HEAD in out.stderr and "outside its storage" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and "internal error" not in out.stderr, out.stderr


def test_non_finite_head_weights_are_refused(model_copy):
    state = torch.load(model_copy / HEAD, weights_only=True)
    state["ue.weight"][0, 0] = float("nan")
    torch.save(state, model_copy / HEAD)
    with pytest.raises(ModelLoadError, match="evidence_head.pt: tensor 'ue.weight' holds NaN"):
        load_model_dir(model_copy)


@pytest.mark.parametrize("value", [float("nan"), 0, 1e-320, float("inf"), -1.5, 1e300])
def test_calibration_temperatures_that_break_the_math_are_refused(model_copy, value):
    path = model_copy / "CALIBRATION.json"
    raw = json.loads(path.read_text())
    raw["temperature_per_prim"]["score"] = value
    path.write_text(json.dumps(raw))  # NaN and Infinity as Python's json writes them
    with pytest.raises(ModelLoadError, match=r'^CALIBRATION.json: field "temperature_per_prim.score" must be a number'):
        load_model_dir(model_copy)


def test_a_nan_temperature_is_refused_by_serve(model_copy):
    path = model_copy / "CALIBRATION.json"
    raw = json.loads(path.read_text())
    raw["temperature_per_prim"]["score"] = float("nan")
    path.write_text(json.dumps(raw))
    assert '"score": NaN' in path.read_text()
    out = cli_run(["serve", "--model", str(model_copy), "--port", str(free_port())], capture_output=True, text=True,
                  timeout=120)
    assert out.returncode == 2 and "CALIBRATION.json" in out.stderr and "Traceback" not in out.stderr, out.stderr


# --------------------------------------------------------------------------------------------- the loader fuzz

HOSTILE_VALUES = [None, True, -1, 0, 2 ** 70, 1e308, float("nan"), "", "x" * 300, [], {}, [[[[[]]]]], {"a": None}]


def _mutate_json(data: bytes, rng: random.Random) -> bytes:
    """A structurally valid JSON file with one value replaced by something hostile (or the file itself)."""
    try:
        doc = json.loads(data)
    except ValueError:
        return data
    paths = []

    def walk(node, trail):
        paths.append(trail)
        if isinstance(node, dict) and len(paths) < 4000:
            for k, v in list(node.items())[:200]:
                walk(v, trail + [k])
        elif isinstance(node, list) and len(paths) < 4000:
            for i, v in enumerate(node[:50]):
                walk(v, trail + [i])

    walk(doc, [])
    trail = rng.choice(paths)
    if not trail:
        return json.dumps(rng.choice(HOSTILE_VALUES)).encode()
    node = doc
    for step in trail[:-1]:
        node = node[step]
    node[trail[-1]] = rng.choice(HOSTILE_VALUES)
    return json.dumps(doc).encode()


def _mutate_bytes(data: bytes, rng: random.Random, lo: int = 0, hi: int | None = None) -> bytes:
    """Truncation, flipped bytes, inserted bytes, non-UTF-8, or garbage, inside data[lo:hi]."""
    hi = len(data) if hi is None else hi
    raw = bytearray(data)
    kind = rng.randrange(6)
    if kind == 0:
        return bytes(raw[:rng.randrange(0, max(hi, 1))])
    if kind == 1:
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(lo, max(hi, lo + 1))
            if at < len(raw):
                raw[at] = rng.randrange(256)
        return bytes(raw)
    if kind == 2:
        at = rng.randrange(lo, max(hi, lo + 1))
        return bytes(raw[:at]) + rng.randbytes(rng.randint(1, 16)) + bytes(raw[at:])
    if kind == 3:
        at = rng.randrange(lo, max(hi, lo + 1))
        return bytes(raw[:at]) + b"\xff\xfe\xc3" + bytes(raw[at:])
    if kind == 4:
        return b""
    return rng.randbytes(rng.randint(1, 64))


def _mutate_head(data: bytes, rng: random.Random) -> bytes:
    """Either raw damage to the zip, or damage to the pickle inside a well-formed zip (valid CRCs)."""
    if rng.random() < 0.4:
        return _mutate_bytes(data, rng)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        members = {n: z.read(n) for n in z.namelist()}
    target = rng.choice([n for n in members if n.endswith("data.pkl")] * 3 + list(members))
    members[target] = _mutate_bytes(members[target], rng)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, body in members.items():
            z.writestr(name, body)
    return out.getvalue()


FILES = ["config.json", "basal.json", "tokenizer.json", "tokenizer_config.json", "CALIBRATION.json",
         "chat_template.jinja", "model.safetensors", HEAD]


def test_fuzzed_model_files_are_refused_with_their_name(model_copy):
    rng = random.Random(20261201)
    originals = {name: (model_copy / name).read_bytes() for name in FILES}
    header_end = 8 + int.from_bytes(originals["model.safetensors"][:8], "little")
    refused = loaded = 0
    for round_ in range(200):  # seconds: each load parses the tiny model's files once
        name = FILES[round_ % len(FILES)]
        data = originals[name]
        if name == HEAD:
            damaged = _mutate_head(data, rng)
        elif name == "model.safetensors":
            head = _mutate_json(data[8:header_end], rng) if rng.random() < 0.5 else \
                _mutate_bytes(data[8:header_end], rng)
            size = len(head) if rng.random() < 0.8 else rng.choice([0, 7, 2 ** 63, header_end * 2])
            damaged = size.to_bytes(8, "little") + head + data[header_end:]
        elif name.endswith(".json") and rng.random() < 0.6:
            damaged = _mutate_json(data, rng)
        else:
            damaged = _mutate_bytes(data, rng)
        (model_copy / name).write_bytes(damaged)
        try:
            load_model_dir(model_copy)
            loaded += 1
        except ModelLoadError as exc:
            refused += 1
            assert name in str(exc), (name, str(exc))
            assert "\n" not in str(exc) and len(str(exc)) < 600, str(exc)
        finally:
            (model_copy / name).write_bytes(data)
    assert refused > 150 and refused + loaded == 200  # most damage is caught; the rest loads (e.g. a value unused)


@pytest.mark.parametrize("key", ["zażółć-key", "two words", "tab\tkey"])
def test_an_api_key_that_could_never_match_is_refused_at_start(tiny_model, key):
    out = cli_run(["serve", "--model", str(tiny_model), "--port", str(free_port()), "--api-key", key],
                  capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "API key must be printable ASCII" in out.stderr and "Traceback" not in out.stderr, out.stderr
