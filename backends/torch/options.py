"""The torch backend's declared options: the product choices (shown in `serve -h`, `bench -h`, config.toml and
`/api/stats`) and measurement knobs, set from Python (`TorchOptions(attention_tiling=...)`) by whoever measures
them (the sweeps that chose the defaults: docs/CUDA_NOTES.md).

Every option is read once, when the model loads; nothing on the compute path reads the environment.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

# the GEMM routes (cuda_kernels/gemm.py): cuBLAS at row counts verified to agree, fixed chunks of rows, plain
# cuBLAS (not batch-invariant: for measuring)
GEMM_ROUTES = ("verified", "chunked", "cublas")
# the projections that dtype fp8 may quantize; the others stay f16 at their own verified row counts
FP8_GEMMS = ("qkv", "o", "gate_up", "down")
# tree attention's (block_m, block_n, warps, stages): part of the numerics contract (the key tile fixes the
# order of the softmax reduction), the same for every call of a process
DEFAULT_TILING = (64, 64, 4, 2)
# the options a user chooses, declared as the settings of the group "torch" in basal_local/settings.py (the rest exist for the
# measuring tools)
PRODUCT = ("gemm", "cublaslt", "fp8_gemms", "attention_alt_tiling", "cuda_graphs")


@dataclass(frozen=True)
class TorchOptions:
    gemm: str = "verified"
    cublaslt: bool = True  # pinned cuBLASLt algorithms where they agree and are faster
    fp8_gemms: tuple[str, ...] = FP8_GEMMS  # with dtype fp8
    attention_alt_tiling: bool = True  # the 128- and 256-query tilings where they give the default tiling's bits
    cuda_graphs: bool = True
    # measurement-only
    attention_tiling: tuple[int, int, int, int] = DEFAULT_TILING
    gemm_chunk: int = 512  # rows per call of the chunked route (and the verified route's fallback)

    def __post_init__(self) -> None:
        if self.gemm not in GEMM_ROUTES:
            raise ValueError(f"unknown GEMM route {self.gemm!r} ({', '.join(GEMM_ROUTES)})")
        unknown = sorted(set(self.fp8_gemms) - set(FP8_GEMMS))
        if unknown:
            raise ValueError(f"fp8_gemms: unknown projection {unknown[0]!r} ({', '.join(FP8_GEMMS)})")
        if len(self.attention_tiling) != 4 or min(self.attention_tiling) < 1 or self.gemm_chunk < 1:
            raise ValueError("attention_tiling takes 4 positive integers, gemm_chunk a positive integer")

    @classmethod
    def from_settings(cls, **values) -> TorchOptions:
        """From plain values (flags, config.toml): None means the default; `fp8_gemms` and `attention_tiling`
        may be comma lists ("gate_up,down", "64,64,4,2")."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown torch option {unknown[0]!r}")
        kw = {k: v for k, v in values.items() if v is not None}
        for key, conv in (("fp8_gemms", str), ("attention_tiling", int)):
            if isinstance(kw.get(key), str):
                kw[key] = tuple(conv(p.strip()) for p in kw[key].split(",") if p.strip())
            elif key in kw:
                kw[key] = tuple(kw[key])
        return cls(**kw)

    def product(self) -> dict:
        """The user's choices, as /api/stats and the bench report them."""
        d = asdict(self)
        return {k: (",".join(d[k]) if k == "fp8_gemms" else d[k]) for k in PRODUCT}
