"""fp8 (e4m3) GEMMs whose rows do not depend on each other: per-row activation scales, per-channel weights.

`x [M, K] @ w[N, K].T` becomes `(q(x) @ q(w).T) * sx * sw`: each activation row and each weight row (output
channel) is scaled by its own power of two so that its largest magnitude lands in (224, 448], then rounded to
float8 e4m3 (round to nearest even). A power-of-two scale keeps fp8's relative precision (it only shifts the
exponent) and makes scaling exact, so the quantization of a row is the same bits on the CPU (`quant_rows`
here) and in the Triton kernel (`kernels.quant_rows`), and depends on that row only. The GEMM itself is the
vendor's (`torch._scaled_mm`, row-wise scales, f32 accumulation); its reduction order may change with the
number of rows, which `gemm.sized_linear` handles exactly as for f16: only row counts verified to give the
same bits are ever issued.

A ModelOpt FP8 checkpoint (`Fp8Weights.add_checkpoint`, `fuse_parts`) brings its own scales instead: e4m3
weights with one f32 `weight_scale` per tensor, kept as they are on disk, and one static `input_scale` per
projection, so an activation is quantized elementwise (`quant_static`: x / input_scale rounded to e4m3 and
saturated at ±448): no per-row reduction, and a row's bits depend on that row only, as above. The fused q/k/v and
gate/up weights have one scale per part; `fuse_parts` requantizes the parts to their largest scale, as vLLM loads
these checkpoints (one scale per GEMM, `_scaled_mm` tensor-wise; exact where the parts' scales agree, and always
for o_proj and down_proj). Fused parts share one input (the same norm output), so their input scales are one: the
largest of them where a checkpoint differs.

Pure torch (the kernel is passed in), so the CPU tests run the same functions with `quant_rows`,
`quant_static` and `scaled_mm_twin` (a dequantized f32 matmul).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
Quant = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ScaledMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
StaticQuant = Callable[[torch.Tensor, float], torch.Tensor]


def pow2_scale_bits(amax: torch.Tensor) -> torch.Tensor:
    """The biased f32 exponent of each row's scale 2**e: the smallest e with amax / 2**e <= 448.

    amax = m * 2**E (1 <= m < 2): 2**(E - 8) if m <= 1.75 (448 = 1.75 * 2**8), else 2**(E - 7); 1.0 for an
    all-zero row. Clamped to f32's normal exponents so that the reciprocal 2**-e is a normal f32 too."""
    bits = amax.contiguous().view(torch.int32)
    e = (bits >> 23) & 0xFF
    se = torch.where((bits & 0x7FFFFF) > 0x600000, e - 7, e - 8)
    return torch.where(amax > 0, se, torch.full_like(se, 127)).clamp(1, 253)


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x rows in float8 e4m3 [M, K], their f32 scales [M, 1]): x ≈ q * scale, each row on its own."""
    xf = x.float()
    se = pow2_scale_bits(xf.abs().amax(dim=1))
    scale = (se << 23).view(torch.float32)
    inv = ((254 - se) << 23).view(torch.float32)
    return (xf * inv[:, None]).to(FP8), scale[:, None].contiguous()


def quant_static(x: torch.Tensor, inv_scale: float) -> torch.Tensor:
    """x [M, K] in float8 e4m3 with one static scale: x * (1 / scale) in f32, saturated at ±448, rounded to
    nearest even. `inv_scale` is an f32 value (`inverse_scale`), so the product is the same f32 everywhere."""
    return (x.float() * inv_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def inverse_scale(scale: float) -> float:
    """1 / scale rounded once to f32 (the multiplier `quant_static` and its kernel use)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32))


def fp8_supported(device: torch.device | str) -> tuple[bool, str]:
    """(whether this CUDA device has e4m3 tensor cores, its name and compute capability for a message)."""
    major, minor = torch.cuda.get_device_capability(device)
    return (major, minor) >= (8, 9), f"{torch.cuda.get_device_name(device)}, compute capability {major}.{minor}"


def requantize(q: torch.Tensor, scale: float, new_scale: float) -> torch.Tensor:
    """e4m3 values of `scale` re-expressed at `new_scale` (>= scale): q * scale / new_scale, rounded once."""
    if scale == new_scale:
        return q
    ratio = float(torch.tensor(scale, dtype=torch.float64) / new_scale)
    return (q.float() * ratio).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def fuse_parts(parts: Sequence[torch.Tensor], weight_scales: Sequence[float],
               input_scales: Sequence[float]) -> tuple[list[torch.Tensor], torch.Tensor, float, int]:
    """A fused GEMM's parts from a checkpoint (q/k/v, gate/up, or one part) at their largest scale, ready to
    concatenate along the output dimension; the fused weight's f32 scale (a scalar), its one input scale, and how
    many parts were requantized (none where the parts' scales agree)."""
    top = max(weight_scales)
    out = [requantize(q, s, top) for q, s in zip(parts, weight_scales)]
    scale = torch.tensor(top, dtype=torch.float32, device=parts[0].device)
    return out, scale, float(max(input_scales)), sum(s != top for s in weight_scales)


def scaled_mm_twin(xq: torch.Tensor, wq: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """The reference of the fp8 GEMM: exact fp8 products summed in f32, scaled, rounded once to out_dtype."""
    return ((xq.float() @ wq.float().T) * sx * sw).to(out_dtype)


def scaled_mm_cuda(xq: torch.Tensor, wq: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm with row-wise scales (wq [N, K] row-major is the column-major [K, N] it wants)."""
    return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=out_dtype)


def scaled_mm_cuda_bf16(xq: torch.Tensor, wq: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """For torch builds whose row-wise `_scaled_mm` writes only bf16: bf16 out, then out_dtype."""
    return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16).to(out_dtype)


def cuda_scaled_mm(device: torch.device | str, out_dtype: torch.dtype) -> ScaledMM:
    """The CUDA GEMM for out_dtype on this torch build: direct where supported, else through bf16."""
    x = torch.ones(16, 32, device=device).to(FP8)
    s = torch.ones(16, 1, device=device)
    try:
        scaled_mm_cuda(x, x, s, s.view(1, -1), out_dtype)
        return scaled_mm_cuda
    except RuntimeError:
        return scaled_mm_cuda_bf16


class Fp8Weights:
    """The float8 copies of a model's GEMM weights, found by the f16 weight tensor they replace.

    `linear(x, w, bias)` has F.linear's signature, so `gemm.sized_linear` and `gemm.build_linear` use it as is."""

    def __init__(self, quant: Quant = quant_rows, mm: ScaledMM = scaled_mm_twin) -> None:
        self.quant, self.mm = quant, mm
        self._by_id: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def add(self, w: torch.Tensor) -> None:
        if id(w) not in self._by_id:
            q, s = quant_rows(w)  # float8 rows [N, K], one scale per output channel (as [1, N] f32)
            self._by_id[id(w)] = (w, q, s.view(1, -1), self.quant)  # w kept: a dead tensor's id could be reused

    def add_checkpoint(self, wq: torch.Tensor, weight_scale: torch.Tensor, input_scale: float,
                       static: StaticQuant) -> None:
        """A checkpoint's e4m3 weight as it is (the key is the weight itself) with its scalar scales: activations
        quantized by `static` with the input scale."""
        inv = inverse_scale(input_scale)
        sx = torch.tensor(input_scale, dtype=torch.float32, device=wq.device)

        def quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return static(x, inv), sx
        self._by_id[id(wq)] = (wq, wq, weight_scale, quant)

    def has(self, w: torch.Tensor) -> bool:
        return id(w) in self._by_id

    def nbytes(self) -> int:
        """Bytes held beside the model's own tensors (a checkpoint's weights are the model's: scales only)."""
        return sum((q.numel() * q.element_size() if q is not w else 0) + s.numel() * 4
                   for w, q, s, _ in self._by_id.values())

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """fp8 for the weights added here; any other weight runs as is (F.linear in x's dtype)."""
        entry = self._by_id.get(id(w))
        if entry is None:
            return F.linear(x, w, bias)
        _, wq, sw, quant = entry
        xq, sx = quant(x)
        out = self.mm(xq, wq, sx, sw, x.dtype)
        if bias is not None:
            out += bias
        return out


def build_store(layers, names, device, dtype: torch.dtype, kernel: Quant | None, report: dict) -> Fp8Weights:
    """float8 copies of the named projections of every layer (`qkv`, `o`, `gate_up`, `down`) with the
    activation quantizer and the scaled GEMM of this device: `kernel` (the Triton quantizer) where it gives
    `quant_rows`' bits, else the twin; on the CPU the twin GEMM. The f16 weights stay as the keys."""
    if kernel is not None:
        x = (torch.randn(8, 320, device=device) * 9).to(dtype)
        try:
            (qa, sa), (qb, sb) = kernel(x), quant_rows(x)
            same = torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)) and torch.equal(sa, sb)
        except Exception as exc:  # noqa: BLE001 - any compile or launch failure of the kernel
            same = False
            report["fp8_quant_error"] = repr(exc)[:300]
        quant = kernel if same else quant_rows
        report["fp8_quant"] = "triton" if same else "twin"
        store = Fp8Weights(quant, cuda_scaled_mm(device, dtype))
        report["fp8_mm"] = store.mm.__name__
    else:
        store = Fp8Weights()
    report["fp8_gemms"] = ",".join(names)
    attrs = {"qkv": "qkv_weight", "o": "o_proj_weight", "gate_up": "gate_up_weight", "down": "down_proj_weight"}
    for layer in layers:
        for name in names:
            store.add(getattr(layer, attrs[name]))
    return store


def build_checkpoint_store(layers, scales: list[dict], names, device, dtype: torch.dtype, kernel: StaticQuant | None,
                           report: dict) -> Fp8Weights:
    """The GEMMs of a ModelOpt FP8 checkpoint: each layer's e4m3 weights as loaded (`fuse_parts`), `scales[i]`
    {slot attribute: (weight scale, input scale)} from the load; activations by `kernel` (the Triton static
    quantizer) where it gives `quant_static`'s bits, else the twin; `_scaled_mm` tensor-wise on CUDA, the twin
    GEMM on the CPU."""
    static: StaticQuant = quant_static
    if kernel is not None:
        x = (torch.randn(8, 320, device=device) * 9).to(dtype)
        x[0, :4] = torch.tensor([1e4, -1e4, 0.0, 3.0])  # saturation and zero on the way
        try:
            same = all(torch.equal(kernel(x, inv).view(torch.uint8), quant_static(x, inv).view(torch.uint8))
                       for inv in (inverse_scale(0.02), inverse_scale(0.7), 1.0))
        except Exception as exc:  # noqa: BLE001 - any compile or launch failure of the kernel
            same = False
            report["fp8_quant_error"] = repr(exc)[:300]
        static = kernel if same else quant_static
        report["fp8_quant"] = "triton static" if same else "twin static"
        mm = scaled_mm_cuda
    else:
        mm = scaled_mm_twin
    store = Fp8Weights(quant_rows, mm)
    report["fp8_mm"] = mm.__name__
    report["fp8_gemms"] = ",".join(names)
    report["fp8_scales"] = "checkpoint (tensor)"
    for layer, by_slot in zip(layers, scales):
        for attr, (sw, s_in) in by_slot.items():
            store.add_checkpoint(getattr(layer, attr), sw, s_in, static)
    return store
