"""`--gpu-memory`: how much device memory a backend may use, as a size or as a fraction of the device (and what
`--prefix-cache` gives the state cache's pool, `budget_bytes`).

Checked before the weights load (the weights alone must fit: a clear refusal instead of an out-of-memory error
half-way through loading) and then enforced by the framework's own allocator: torch's caching allocator per
process and device (`torch.cuda.set_per_process_memory_fraction`), MLX's memory limit. A forward that needs more
than is left fails with the framework's out-of-memory error, which the daemon answers as a 503 for that batch
only (server/app.py); everything else keeps being served.
"""

from __future__ import annotations

import os
import re

GB = 1e9
_UNITS = {"": GB, "g": GB, "gb": GB, "gib": 2 ** 30, "m": 1e6, "mb": 1e6, "mib": 2 ** 20, "t": 1e12, "tb": 1e12}
HELP = ("a size (24, 24GB, 22.5GiB, 16000MB) or a share of the GPU's memory (0.8 or 80%); a plain number up to 1 is "
        "a share")


def parse_limit(value: str | float | int, flag: str = "--gpu-memory") -> tuple[str, float]:
    """("share", 0 < s <= 1) or ("bytes", n) from a --gpu-memory (or --prefix-cache) value; ValueError with the
    accepted forms."""
    text = str(value).strip().lower().replace(" ", "")
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)(%|[a-z]*)", text)
    if not match or match.group(2) not in (*_UNITS, "%"):
        raise ValueError(f"{flag} {value!r}: not a memory size; give {HELP}" + (", auto or off" if flag != "--gpu-memory" else ""))
    number, unit = float(match.group(1)), match.group(2)
    if number <= 0:
        raise ValueError(f"{flag} {value!r}: must be more than 0; give {HELP}"
                         + (", or off to keep nothing" if flag != "--gpu-memory" else ""))
    if unit == "%":
        if number > 100:
            raise ValueError(f"{flag} {value!r}: a share is at most 100%")
        return "share", number / 100.0
    if unit == "" and number <= 1:
        return "share", number
    return "bytes", number * _UNITS[unit]


def limit_bytes(value: str | float | int, total: int, device: str) -> int:
    """The limit in bytes on a device of `total` bytes (refused if larger than the device)."""
    kind, number = parse_limit(value)
    limit = int(number * total) if kind == "share" else int(number)
    if limit > total:
        raise ValueError(f"--gpu-memory {value}: {limit / GB:.1f} GB is more than {device} has "
                         f"({total / GB:.1f} GB); give at most that, or a share such as 0.9")
    return limit


def weights_bytes(shapes: dict[str, tuple[int, ...]], size: int, projection_size: int | None = None,
                  projection=None) -> int:
    """Device bytes of a model's weights: every tensor at `size` bytes an element, the GEMM weights for which
    `projection(name)` holds at `projection_size` (a ModelOpt FP8 checkpoint on its fp8 route: 1; dtype fp8 on
    bf16 weights: size + 1, the float8 copy beside the f16 weight; scales are left out, a few KB)."""
    total = 0
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= int(d)
        fast = projection_size is not None and projection is not None and projection(name)
        total += n * (projection_size if fast else size)
    return total


def check_weights_fit(weights: int, limit: int, value: str | float | int, device: str, dtype: str) -> None:
    """Refuse, before loading, a model whose weights alone exceed the limit."""
    if weights > limit:
        raise ValueError(f"the model's weights need {weights / GB:.1f} GB in {dtype} on {device}, more than "
                         f"--gpu-memory {value} allows ({limit / GB:.1f} GB); raise --gpu-memory or serve a "
                         "smaller model")


# what a CUDA backend holds at its peak on top of the weights after warm-up (the 4.5B preset: CUDA graphs of every
# token bucket ~1.3 GB, a ~17k-token document's eager forward ~2.8 GB, the allocator's cache): the first
# --gpu-memory worth trying when the weights fit but the warm-up does not (on the H200, 13 GB failed for 9.5 GB
# of weights; 12.4 GB peak allocated without a limit)
WARM_OVERHEAD = 4 * GB


def out_of_memory_hint(value: str | float | int | None, limit: int | None, weights: int = 0) -> str:
    """The sentence added to an out-of-memory error while loading or warming up under a limit."""
    if value is None or limit is None:
        return ""
    need = max(weights + WARM_OVERHEAD, limit + GB)
    return (f" (--gpu-memory {value} allows {limit / GB:.1f} GB: the weights fit, but not the CUDA graphs and "
            f"workspaces on top of them; raise --gpu-memory, e.g. to {need / GB:.0f}GB)")


def first_sentence(exc: BaseException) -> str:
    """The first sentence of a framework's (long) error message: "CUDA out of memory. Tried to allocate 172 MiB"."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    parts = text.split(". ")
    return ". ".join(parts[:2]).rstrip(".")


def budget_bytes(setting: str | float, device_memory: tuple[int, int] | None, ram: int | None = None,
                 replicas: int = 1, weights: int = 0) -> int:
    """`--prefix-cache`: the pool's bytes. `device_memory`: (free, total) of the GPU after the weights (None off a
    GPU). auto: on a GPU of 40 GB or more 60 % of what is free after the warm-up's reserve, 25 % on a smaller
    one; on the CPU or a Mac (unified memory) 5 % of the RAM, at most 2 GiB. A size or a share is per replica; a
    share is of the GPU's free memory (with `replicas` on it, of each one's equal part, as auto), without a GPU
    of the memory the system has available now (`ram` in tests; on a Mac, which does not report it, all of the
    RAM), not of all of it, which left nothing for the weights and the rest of the machine. `replicas` of one
    model on the GPU (each with `weights` bytes of weights): auto gives each the same part of what the GPU holds
    after all their weights, at most 60 % of what is free, whichever of them opens its pool first (they load
    side by side; each taking 60 % of what it saw free, two replicas on an H200 took 74 and 29 GB, and two that
    looked at the same moment would have asked for more than the GPU holds)."""
    text = str(setting).strip().lower()
    if text == "off":
        return 0
    total_ram = ram if ram is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if text == "auto":
        if device_memory is not None:
            free, total = device_memory
            part = 0.6 if total >= 40e9 else 0.25
            if replicas > 1:
                room = max(0, total - replicas * (weights + WARM_OVERHEAD))
                return int(min(max(0, free - WARM_OVERHEAD), room / replicas) * part)
            return int(max(0, free - WARM_OVERHEAD) * part)
        return int(min(2 ** 31, 0.05 * total_ram))
    kind, number = parse_limit(text, flag="--prefix-cache")
    room = device_memory[0] if device_memory is not None else (ram if ram is not None else available_ram())
    if kind == "bytes":
        # without a GPU every replica's pool is planned against the same available RAM (pages are taken as the
        # cache fills): all of them must fit it; on a GPU each pool is allocated whole before the next one looks
        each = replicas if device_memory is None else 1
        if number * each > room:  # it would fail to allocate (a CPU allocator's paragraph), or take the machine's
            where = ("the GPU has free after the weights" if device_memory is not None
                     else "this machine has available" + (f" for {replicas} replicas" if each > 1 else ""))
            raise ValueError(f"--prefix-cache {setting}: more than the {room / 1e9:,.1f} GB {where}; give a "
                             "smaller size, a share such as 0.5, or auto")
        return int(number)
    if device_memory is not None and replicas > 1:  # of each replica's equal part, whichever opens its pool first
        room = min(room, max(0, device_memory[1] - replicas * (weights + WARM_OVERHEAD)) / replicas)
    return int(number * room)


def available_ram() -> int:
    """Bytes the system can give without swapping: Linux's MemAvailable; elsewhere (a Mac) the free pages where the
    system reports them, else all of the RAM."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        return page * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):  # macOS has no SC_AVPHYS_PAGES
        return page * os.sysconf("SC_PHYS_PAGES")
