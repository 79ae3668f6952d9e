"""The safetensors header checks and the load error, shared by directory.py (the load checks of docs/PROTOCOL.md
§4.7) and formats.py (the port formats), which directory.py imports."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .config import LlamaConfig

SAFETENSORS_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}  # what the backends convert from
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


class ModelLoadError(ValueError):
    """A model directory that basal-local will not load; the message names the file and the field."""


def check_weight_names(config: LlamaConfig, names_shapes: dict[str, tuple[int, ...]]) -> None:
    expected = config.weight_shapes()
    unknown = sorted(set(names_shapes) - set(expected))
    missing = sorted(set(expected) - set(names_shapes))
    if unknown:
        raise ModelLoadError(f"model.safetensors: unknown tensor {unknown[0]!r} ({len(unknown)} unknown in all)")
    if missing:
        raise ModelLoadError(f"model.safetensors: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    for name, shape in expected.items():
        if tuple(names_shapes[name]) != shape:
            raise ModelLoadError(f"model.safetensors: tensor {name!r} has shape {tuple(names_shapes[name])}, "
                                 f"config.json implies {shape}")


def read_safetensors_header(path: Path, itemsize: dict[str, int] = SAFETENSORS_ITEMSIZE) -> dict[str, tuple[int, ...]]:
    """Names and shapes from the safetensors header; a truncated or corrupt file is refused, named.

    The header is JSON data, never code; the data itself is not read, but the file must be exactly as
    long as the header's last tensor ends (a cut download is caught here, not in the middle of serving).
    """
    file_size = path.stat().st_size
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        if file_size < 8 or size <= 0 or 8 + size > file_size or size > MAX_HEADER_BYTES:
            raise ModelLoadError(f"{path.name}: not a safetensors file or truncated ({file_size} bytes, the header "
                                 f"says {size} bytes of header)")
        try:
            header = json.loads(fh.read(size))
            entries = [(k, v) for k, v in header.items() if k != "__metadata__"]
            shapes = {k: tuple(int(n) for n in v["shape"]) for k, v in entries}
            spans = {k: (int(v["data_offsets"][0]), int(v["data_offsets"][1]), v["dtype"]) for k, v in entries}
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as exc:
            raise ModelLoadError(f"{path.name}: the safetensors header is corrupt ({type(exc).__name__})") from None
    for key, (begin, stop, dtype) in spans.items():
        numel = math.prod(shapes[key]) if all(n >= 0 for n in shapes[key]) else -1
        if dtype not in itemsize or not 0 <= begin <= stop or stop - begin != numel * itemsize.get(
                dtype, 0):
            raise ModelLoadError(f"{path.name}: tensor {str(key)[:80]!r} is corrupt in the header (dtype {dtype!r} "
                                 f"of {', '.join(itemsize)}, shape and byte range must agree)")
    end = max((stop for _, stop, _ in spans.values()), default=0)
    if 8 + size + end != file_size:
        raise ModelLoadError(f"{path.name}: truncated or corrupt: the header describes {8 + size + end} bytes, "
                             f"the file has {file_size}")
    return shapes
