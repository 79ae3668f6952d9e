"""The torch backend: loading (Hugging Face names, q/k/v and gate/up fused once), memory, cached prefixes.

The forward is `forward.Forward` (its ops chosen at load: the Triton kernels on CUDA, their plain-torch twins
elsewhere, the CPU f32 reference); on CUDA `graphs.Graphs` captures it per size.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from basal_local.cuda_kernels import fp8, triton_available

from .. import host
from ..base import ModelInfo, PackedBatch, Ready
from .options import TorchOptions

log = logging.getLogger(__name__)

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float16}  # fp8: f16
# activations, float8 e4m3 GEMMs (cuda_kernels/fp8.py)


def _on_device(fn=None, inference: bool = True):
    """Run a backend method with its own GPU current (one replica per GPU: CUDA graphs, streams and Triton
    launches use the thread's current device, which is cuda:0 unless set); `inference`: in inference mode too
    (not at load: the GEMM checks capture CUDA graphs of the weights as ordinary tensors)."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with self._device_scope(), (torch.inference_mode() if inference else contextlib.nullcontext()):
            return fn(self, *args, **kwargs)
    return wrapper


def _on_device_steps(fn):
    """`_on_device` for a generator: each step runs with the device current and in inference mode (a mode
    held across a yield would leak into whatever the thread runs between the steps)."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with self._device_scope():
            yield from torch.inference_mode()(fn)(self, *args, **kwargs)
    return wrapper


class TorchBackend:
    """Backend protocol implementation for torch (see backends/base.py).

    attention: "tree" (the Triton kernels; CUDA with Triton), "sdpa" (the plain-torch twins, any device) or
    "auto" (tree where it can run)."""

    name = "torch"

    def __init__(self, device: str = "auto", attention: str = "auto", memory_limit: str | float | None = None,
                 options: TorchOptions | None = None) -> None:
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.options = options or TorchOptions()
        # --gpu-memory (backends/memory.py): the value as given, and in bytes once the device is known (load)
        self.memory_limit = memory_limit
        self.memory_limit_bytes: int | None = None
        kernels = self.device.startswith("cuda") and triton_available()
        if attention == "auto":
            attention = "tree" if kernels else "sdpa"
        if attention not in ("sdpa", "tree"):
            raise ValueError(f"unknown attention {attention!r} for the torch backend (tree or sdpa)")
        if attention == "tree" and not kernels:
            raise ValueError("attention 'tree' (the Triton kernels) needs CUDA and Triton; use sdpa")
        self.attention = attention
        self.fwd = None  # forward.Forward, made at load
        self.graphs = None  # graphs.Graphs on CUDA with the kernels
        self._legacy_end = 0  # where add_prefix without an offset puts a prefix (no state cache opened)
        self._managed = False  # open_cache ran: the engine's state cache places every prefix
        self.fp8_checkpoint: list[dict] | None = None  # a ModelOpt FP8 checkpoint's scales per layer (load)
        self.fp8_requantized = 0

    def _device_scope(self):
        if self.device.startswith("cuda"):
            return torch.cuda.device(torch.device(self.device))
        return contextlib.nullcontext()

    # ---- loading -------------------------------------------------------------------------------------------
    @functools.partial(_on_device, inference=False)
    def load(self, model_dir: Path, dtype: str = "auto") -> ModelInfo:
        from basal_local.model.formats import torch_tensors

        from .forward import Forward
        from .graphs import Graphs

        cfg, self.format = host.read_model(model_dir)  # config.json, or a GGUF file's metadata
        self.config = cfg
        if dtype == "auto" and self.format.family == "fp8" and self.device.startswith("cuda"):
            dtype = "fp8"  # the checkpoint's own e4m3 GEMMs; the CPU dequantizes it to f32 (the reference)
        self.dtype_name = host.resolve_dtype(dtype, self.device == "cpu", tuple(DTYPES), "torch")
        self.dtype = DTYPES[self.dtype_name]
        if self.dtype_name == "fp8" and self.device.startswith("cuda"):
            self._check_fp8_gpu()
        self.fp8_checkpoint = None
        self._apply_memory_limit(cfg)
        weights: dict[str, torch.Tensor] = {}
        try:
            if self.format.family == "fp8" and self.dtype_name == "fp8":
                weights, self.fp8_checkpoint = self._load_fp8_checkpoint(cfg)
            elif self.format.family != "safetensors":  # GGUF, and ModelOpt FP8 off its route, dequantized at load
                for key, t in torch_tensors(self.format, cfg):  # to the run dtype (model/formats.py)
                    weights[key] = t.to(device=self.device, dtype=self.dtype)
            else:  # bf16 on disk, converted once to the run dtype (mmap'd reads, one tensor at a time)
                with safe_open(str(self.format.weights_file), framework="pt") as fh:
                    for key in fh.keys():
                        weights[key] = fh.get_tensor(key).to(device=self.device, dtype=self.dtype)
        except torch.OutOfMemoryError as exc:
            raise self._out_of_memory(exc, "loading the weights") from None

        checkpoint = host.Checkpoint(weights)
        self.embed_tokens, self.norm, self.lm_head = checkpoint.top()  # lm_head: f32 dot products, letter rows
        self.layers = [host.Layer(checkpoint.layer(cfg, i, lambda ts: torch.cat(ts, 0)))
                       for i in range(cfg.num_hidden_layers)]
        checkpoint.done()
        params = sum(t.numel() for t in self._tensors())
        try:
            self.fwd = Forward(self, self.options, kernels=self.attention == "tree")
        except torch.OutOfMemoryError as exc:
            raise self._out_of_memory(exc, "checking the GEMMs") from None
        if self.fwd.use_triton and self.options.cuda_graphs:
            self.graphs = Graphs(self.fwd)
        return ModelInfo(cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, self.dtype_name, self.device, params,
                         sum(t.numel() * t.element_size() for t in self._tensors()))

    def _check_fp8_gpu(self) -> None:
        ok, what = fp8.fp8_supported(self.device)
        if not ok:
            dequant = " (--dtype f16 loads this FP8 checkpoint dequantized)" if self.format.family == "fp8" else ""
            raise ValueError(f"fp8 needs a GPU with fp8 tensor cores (compute capability 8.9 or later); {self.device}"
                             f" is {what}{dequant}")

    def _load_fp8_checkpoint(self, cfg) -> tuple[dict[str, torch.Tensor], list[dict]]:
        """A ModelOpt FP8 checkpoint as it is: e4m3 projection weights on the device (the fused ones' parts at
        one scale: fp8.fuse_parts), everything else in the run dtype, and per layer {weight slot: (weight scale,
        input scale)}. Projections outside `fp8_gemms` are dequantized."""
        from basal_local.model.formats import torch_tensors

        weights: dict[str, torch.Tensor] = {}
        scales: dict[str, float] = {}
        for key, t in torch_tensors(self.format, cfg, keep_fp8=True):
            if key.endswith((".weight_scale", ".input_scale")):
                scales[key] = float(t)
            else:
                weights[key] = t.to(self.device) if t.dtype == fp8.FP8 else t.to(device=self.device, dtype=self.dtype)
        names = {"qkv": "qkv", "o_proj": "o", "gate_up": "gate_up", "down_proj": "down"}
        per_layer, requantized = [], 0
        fname = self.format.weights_file.name
        for i in range(cfg.num_hidden_layers):
            by_slot = {}
            for slot, parts in host.FUSED.items():
                keys = [f"model.layers.{i}.{part}.weight" for part in parts]
                for k in keys:
                    if k not in weights or weights[k].dtype != fp8.FP8 or k[:-7] + ".input_scale" not in scales:
                        raise ValueError(f"{fname}: tensor {k!r} is not float8 e4m3 with its weight and input "
                                         "scales, as a ModelOpt FP8 checkpoint holds every projection")
                ws = [scales.pop(k[:-7] + ".weight_scale") for k in keys]
                ins = [scales.pop(k[:-7] + ".input_scale") for k in keys]
                qs = [weights[k] for k in keys]
                if names[slot] not in self.options.fp8_gemms:
                    weights.update({k: (q.float() * w).to(self.dtype) for k, q, w in zip(keys, qs, ws)})
                    continue
                qs, sw, s_in, changed = fp8.fuse_parts(qs, ws, ins)
                weights.update(zip(keys, qs))
                by_slot[f"{slot}_weight"] = (sw, s_in)
                requantized += changed
            per_layer.append(by_slot)
        if scales:
            raise ValueError(f"{fname}: unknown tensor {next(iter(scales))!r}")
        self.fp8_requantized = requantized
        return weights, per_layer

    def describe(self) -> dict:
        """What runs (for /api/stats and the bench): the ops, the options, what load chose."""
        return {"attention": self.attention, "gemm": self.fwd.gemm if self.fwd else "", "cuda_graphs":
                self.graphs is not None, "options": self.options.product(), "plan": self.fwd.report if self.fwd else {}}

    def _apply_memory_limit(self, cfg) -> None:
        """--gpu-memory: refuse weights that cannot fit (as this load will hold them: the run dtype, a ModelOpt
        FP8 checkpoint's e4m3 projections at a byte each, dtype fp8's float8 copies beside the f16 weights),
        then cap torch's allocator on this device."""
        if self.memory_limit is None:
            return
        from basal_local.model.formats import is_projection

        from .. import memory

        if not self.device.startswith("cuda"):
            log.warning("--gpu-memory %s ignored: the torch backend runs on %s here", self.memory_limit, self.device)
            return
        index = torch.device(self.device).index
        index = torch.cuda.current_device() if index is None else index
        total = torch.cuda.get_device_properties(index).total_memory
        limit = memory.limit_bytes(self.memory_limit, total, self.device)
        weights = self.planned_weight_bytes(cfg, is_projection)
        memory.check_weights_fit(weights, limit, self.memory_limit, self.device, self._dtype_label())
        torch.cuda.set_per_process_memory_fraction(limit / total, index)
        self.memory_limit_bytes = limit

    def planned_weight_bytes(self, cfg, is_projection) -> int:
        """The device bytes of the weights this load holds (memory.weights_bytes), before any is read."""
        from .. import memory

        size = torch.tensor([], dtype=self.dtype).element_size()
        names = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up",
                 "up_proj": "gate_up", "down_proj": "down"}

        def quantized(name: str) -> bool:
            part = name.split(".")[-2] if name.endswith(".weight") else ""
            return is_projection(name) and names.get(part) in self.options.fp8_gemms

        if self.dtype_name != "fp8":
            return memory.weights_bytes(cfg.weight_shapes(), size)
        return memory.weights_bytes(cfg.weight_shapes(), size, 1 if self.format.family == "fp8" else size + 1, quantized)

    def _dtype_label(self) -> str:
        if self.dtype_name == "fp8" and self.format.family == "fp8":
            return "the checkpoint's fp8"
        if self.format.family != "safetensors":
            return f"{self.dtype_name} (a {self.format.name} checkpoint dequantized at load)"
        return self.dtype_name

    def _out_of_memory(self, exc: Exception, doing: str) -> Exception:
        """An out-of-memory error while loading, with what the limit allowed (the original without one)."""
        if self.memory_limit_bytes is None:
            return exc
        from .. import memory

        weights = sum(t.numel() * t.element_size() for t in self._tensors()) if getattr(self, "layers", None) else 0
        return ValueError(f"out of memory on {self.device} while {doing}: {memory.first_sentence(exc)}"
                          + memory.out_of_memory_hint(self.memory_limit, self.memory_limit_bytes, weights))

    def _tensors(self) -> Iterator[torch.Tensor]:
        yield from (self.embed_tokens, self.norm, self.lm_head)
        for layer in self.layers:
            yield from layer.tensors()

    @_on_device
    def memory(self) -> dict[str, int]:
        # with dtype fp8 the float8 GEMM weights are held beside the f16 ones (cuda_kernels/fp8.py)
        out = {"weights_bytes": sum(t.numel() * t.element_size() for t in self._tensors())
               + (self.fwd.fp8_bytes if self.fwd is not None else 0)}
        if self.device.startswith("cuda"):
            out["device_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            out["device_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            if self.graphs is not None:
                out["graphs_bytes"] = self.graphs.memory_bytes()
        if self.memory_limit_bytes is not None:
            out["device_limit_bytes"] = self.memory_limit_bytes
        if self.fwd is not None:
            out["prefix_cache_bytes"] = self.fwd.capacity * self.fwd.kv_bytes_per_token()
        return out

    # ---- forward -------------------------------------------------------------------------------------------
    @_on_device
    def forward(self, batch: PackedBatch) -> np.ndarray:
        if self.graphs is not None:
            return self.graphs.forward(batch)
        *_, logits = self.fwd.steps(batch)
        return logits

    @_on_device
    def launch(self, batch: PackedBatch):
        """`forward` without waiting for the device where a CUDA graph runs it (`graphs.Launched`: `done()`,
        `result()`, `device_s()`); anything else computes here and comes back ready (`base.Ready`)."""
        if self.graphs is not None:
            return self.graphs.launch(batch)
        return Ready(self.forward(batch))

    @_on_device_steps
    def forward_steps(self, batch: PackedBatch, _capture: list | None = None) -> Iterator[np.ndarray | None]:
        yield from self.fwd.steps(batch, capture=_capture)

    @_on_device
    def warmup(self, max_tokens: int = 8192) -> None:
        """Capture the CUDA graphs of every bucket up to `max_tokens` now, not on the first request."""
        if self.graphs is not None:
            try:
                self.graphs.warmup(max_tokens)
            except torch.OutOfMemoryError as exc:
                raise self._out_of_memory(exc, "warming up (CUDA graphs, a long-document forward)") from None

    @_on_device
    def add_prefix(self, key: str, token_ids: list[int], offset: int | None = None) -> None:
        """Compute a prefix's K/V into the pool: at `offset` (the state cache's rows) or after the last one."""
        n = len(token_ids)
        if offset is None:
            if self._managed:
                raise ValueError("the state cache places the prefixes: give add_prefix its offset")
            offset = self._legacy_end
            self._legacy_end += n
            if self._legacy_end > self.fwd.capacity:
                self._grow(max(self._legacy_end, 2 * self.fwd.capacity))
        for _ in self.fwd.steps(PackedBatch.prefix(key, token_ids, offset)):
            pass

    def _grow(self, capacity: int) -> None:
        self.fwd.open_pool(capacity)
        if self.graphs is not None:
            self.graphs.clear()  # captured graphs read the old pool

    @_on_device
    def open_cache(self, capacity: int) -> None:
        """The pool of K/V rows the state cache places prefixes in (before warmup: the graphs read it)."""
        self._managed = True
        self._grow(max(int(capacity), self._legacy_end))

    def kv_bytes_per_token(self) -> int:
        return self.fwd.kv_bytes_per_token()

    def drop_prefix(self, key: str) -> None:
        self.fwd.prefix_rows.pop(key, None)

    def device_memory(self) -> tuple[int, int] | None:
        """(free, total) bytes the state cache may plan with on a GPU (after --gpu-memory), or None off a GPU."""
        if not self.device.startswith("cuda"):
            return None
        with self._device_scope():
            free, total = torch.cuda.mem_get_info()
            if self.memory_limit_bytes is not None:
                free = min(free, self.memory_limit_bytes - torch.cuda.memory_reserved())
                total = self.memory_limit_bytes
        return max(0, int(free)), int(total)

    @_on_device
    def final_hidden(self, token_ids: np.ndarray) -> np.ndarray:
        """One plain causal forward of a single prompt; float32 hidden states after the final RMSNorm [T, H]."""
        return self.fwd.hidden(PackedBatch.single(token_ids, readout="all")).float().cpu().numpy()
