"""Llama forward over a packed prefix tree, in PyTorch (CPU reference in f32; CUDA).

Attribute names follow the Hugging Face checkpoint; loading fuses q/k/v and gate/up once. Tree attention
here is the plain twin: SDPA with a dense boolean mask built from the block tree, which is exactly
equivalent to one causal forward per prompt. `attention="tree"` (the CUDA default where Triton exists) runs
the whole forward through `fast.FastPath`: the Triton tree-attention kernel and fused kernels. The last
layer runs o_proj, MLP, final norm and the letter logits only at the readout rows.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

from ..base import ModelInfo, PackedBatch, Ready
from .tree_attention import StaticMaskAttention, TreeAttention, flex_available

log = logging.getLogger(__name__)

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}  # and "fp8": f16 + fp8 GEMMs
# token counts a CUDA graph is captured for; a forward is padded up to the next one
GRAPH_BUCKETS = (64, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
GRAPH_EAGER_ABOVE = 768  # a forward of several subtrees above this many tokens runs eagerly


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _on_device(fn):
    """Run a backend method with its own GPU current (one replica per GPU: CUDA graphs, streams and Triton
    launches use the thread's current device, which is cuda:0 unless set)."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with self._device_scope():
            return fn(self, *args, **kwargs)
    return wrapper


def _on_device_steps(fn):
    """`_on_device` for a generator: the device stays current while its steps run."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with self._device_scope():
            yield from fn(self, *args, **kwargs)
    return wrapper


class _Layer:
    __slots__ = ("input_layernorm", "post_attention_layernorm", "qkv_weight", "qkv_bias", "o_proj_weight",
                 "o_proj_bias", "gate_up_weight", "gate_up_bias", "down_proj_weight", "down_proj_bias")


class TorchBackend:
    """Backend protocol implementation for torch (see backends/base.py)."""

    name = "torch"

    def __init__(self, device: str = "auto", attention: str = "auto", cuda_graphs: bool = True,
                 gemm: str = "auto", memory_limit: str | float | None = None) -> None:
        self.device = resolve_device(device)
        self.gemm = gemm
        # --gpu-memory (backends/memory.py): the value as given, and in bytes once the device is known (load)
        self.memory_limit = memory_limit
        self.memory_limit_bytes: int | None = None
        self.fast = None  # the FastPath of attention "tree", made at load
        # one CUDA graph per bucket replays layers 0..L-2 with a single launch; the last layer runs eagerly
        self.cuda_graphs = cuda_graphs and self.device.startswith("cuda")
        self._graphs: dict[tuple, tuple] = {}
        self._graph_pool = None
        if attention == "auto":
            # CUDA: the Triton tree kernel and fused path (docs/PERFORMANCE.md); CPU: the f32 reference twin
            from basal_local.cuda_kernels import triton_available

            attention = "tree" if self.device.startswith("cuda") and triton_available() else "sdpa"
        if attention == "flex" and not flex_available():
            raise ValueError("attention 'flex' needs a torch with FlexAttention")
        if attention not in ("sdpa", "flex", "tree"):
            raise ValueError(f"unknown attention {attention!r} (tree, sdpa or flex)")
        self.attention = attention
        self.prefix_kv: dict[str, tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    def _device_scope(self):
        if self.device.startswith("cuda"):
            return torch.cuda.device(torch.device(self.device))
        return contextlib.nullcontext()

    # ---- loading -------------------------------------------------------------------------------------------
    @_on_device
    def load(self, model_dir: Path, dtype: str = "auto") -> ModelInfo:
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        from basal_local.model.config import LlamaConfig

        cfg = self.config = LlamaConfig.from_dict(raw)
        if dtype == "auto":
            dtype = "f32" if self.device == "cpu" else "f16"
        if dtype == "fp8":
            # f16 activations, float8 e4m3 GEMMs (fast.FastPath route "fp8", cuda_kernels/fp8.py)
            if self.attention != "tree":
                raise ValueError("dtype fp8 runs on the tree path only (CUDA with Triton); use f16 or bf16 here")
            self.gemm = "fp8"
        elif dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r} for the torch backend (f16, bf16, f32 or fp8)")
        self.dtype_name = dtype
        self.dtype = DTYPES.get(dtype, torch.float16)
        dev = self.device
        weights: dict[str, torch.Tensor] = {}
        from basal_local.model.formats import detect_format, torch_tensors

        self.format = detect_format(model_dir, raw)
        if self.format.family != "safetensors":
            # GGUF and ModelOpt FP8 are dequantized at load to the run dtype (model/formats.py)
            for key, t in torch_tensors(self.format, cfg):
                weights[key] = t.to(device=dev, dtype=self.dtype)
        else:
            # bf16 on disk, converted once to the run dtype (mmap'd reads, one tensor at a time)
            with safe_open(str(model_dir / "model.safetensors"), framework="pt") as fh:
                self._apply_memory_limit(fh)
                try:
                    for key in fh.keys():
                        weights[key] = fh.get_tensor(key).to(device=dev, dtype=self.dtype)
                except torch.OutOfMemoryError as exc:
                    raise self._out_of_memory(exc, "loading the weights") from None
        self.embed_tokens = weights.pop("model.embed_tokens.weight")
        self.norm = weights.pop("model.norm.weight")
        # letter logits are f32 dot products with the lm_head rows
        self.lm_head = weights.pop("lm_head.weight")
        self.layers: list[_Layer] = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            layer = _Layer()
            layer.input_layernorm = weights.pop(p + "input_layernorm.weight")
            layer.post_attention_layernorm = weights.pop(p + "post_attention_layernorm.weight")
            qkv = [weights.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
            layer.qkv_weight = torch.cat(qkv, 0)
            layer.qkv_bias = (torch.cat([weights.pop(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
                              if cfg.attention_bias else None)
            layer.o_proj_weight = weights.pop(p + "self_attn.o_proj.weight")
            layer.o_proj_bias = weights.pop(p + "self_attn.o_proj.bias") if cfg.attention_bias else None
            layer.gate_up_weight = torch.cat([weights.pop(p + "mlp.gate_proj.weight"),
                                              weights.pop(p + "mlp.up_proj.weight")], 0)
            layer.gate_up_bias = (torch.cat([weights.pop(p + "mlp.gate_proj.bias"), weights.pop(p + "mlp.up_proj.bias")])
                                  if cfg.mlp_bias else None)
            layer.down_proj_weight = weights.pop(p + "mlp.down_proj.weight")
            layer.down_proj_bias = weights.pop(p + "mlp.down_proj.bias") if cfg.mlp_bias else None
            self.layers.append(layer)
        if weights:
            raise ValueError(f"model.safetensors: unknown tensor {next(iter(weights))!r}")
        # RoPE frequencies in float64 on the host; cos/sin are sent as f32
        half = cfg.head_dim // 2
        self.inv_freq = cfg.rope_theta ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.head_dim)
        params = sum(t.numel() for t in self._tensors())
        if self.attention == "tree":
            from .fast import FastPath

            try:
                self.fast = FastPath(self, use_triton=self.device.startswith("cuda"), gemm=self.gemm)
            except torch.OutOfMemoryError as exc:
                raise self._out_of_memory(exc, "checking the GEMMs") from None
        return ModelInfo(cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, dtype, self.device, params,
                         sum(t.numel() * t.element_size() for t in self._tensors()))

    def _apply_memory_limit(self, fh) -> None:
        """--gpu-memory: refuse weights that cannot fit, then cap torch's allocator on this device."""
        if self.memory_limit is None:
            return
        from .. import memory

        if not self.device.startswith("cuda"):
            log.warning("--gpu-memory %s ignored: the torch backend runs on %s here", self.memory_limit, self.device)
            return
        index = torch.device(self.device).index
        index = torch.cuda.current_device() if index is None else index
        total = torch.cuda.get_device_properties(index).total_memory
        limit = memory.limit_bytes(self.memory_limit, total, self.device)
        size = torch.tensor([], dtype=self.dtype).element_size()
        weights = sum(int(np.prod(fh.get_slice(k).get_shape())) for k in fh.keys()) * size
        if self.dtype_name == "fp8":  # the float8 copies of the GEMM weights are held beside the f16 ones
            weights += weights // size
        memory.check_weights_fit(weights, limit, self.memory_limit, self.device, self.dtype_name)
        torch.cuda.set_per_process_memory_fraction(limit / total, index)
        self.memory_limit_bytes = limit

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
            for name in _Layer.__slots__:
                t = getattr(layer, name)
                if t is not None:
                    yield t

    @_on_device
    def memory(self) -> dict[str, int]:
        # with dtype fp8 the float8 GEMM weights are held beside the f16 ones (cuda_kernels/fp8.py)
        out = {"weights_bytes": sum(t.numel() * t.element_size() for t in self._tensors())
               + (self.fast.fp8_bytes if self.fast is not None else 0)}
        if self.device.startswith("cuda"):
            out["device_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            out["device_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
        if self.memory_limit_bytes is not None:
            out["device_limit_bytes"] = self.memory_limit_bytes
        return out

    # ---- pieces --------------------------------------------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _rope(self, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.astype(np.float64)[:, None] * self.inv_freq[None, :]
        angles = np.concatenate([angles, angles], axis=1)
        cos = torch.from_numpy(np.cos(angles).astype(np.float32)).to(self.device)
        sin = torch.from_numpy(np.sin(angles).astype(np.float32)).to(self.device)
        return cos[:, None, :], sin[:, None, :]  # [T, 1, D]

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @staticmethod
    def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    # ---- forward -------------------------------------------------------------------------------------------
    def _layer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prefixes: list, attention,
               rows: torch.Tensor | None = None, capture: list | None = None) -> torch.Tensor:
        """One decoder layer; with `rows`, only those rows leave the attention (the last layer)."""
        cfg = self.config
        layer = self.layers[i]
        n_heads, n_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_dim, kv_dim = n_heads * d, n_kv * d
        h = self._rms_norm(x, layer.input_layernorm)
        q, k, v = self._linear(h, layer.qkv_weight, layer.qkv_bias).split([q_dim, kv_dim, kv_dim], dim=-1)
        # attention in f32: q, k, v after RoPE
        q = self._apply_rope(q.float().view(-1, n_heads, d), cos, sin)
        k = self._apply_rope(k.float().view(-1, n_kv, d), cos, sin)
        v = v.float().view(-1, n_kv, d)
        if capture is not None:
            capture.append((k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()))
        keys = torch.cat([p[1][i][0] for p in prefixes] + [k.transpose(0, 1)], dim=1)  # [Hkv, S, D]
        values = torch.cat([p[1][i][1] for p in prefixes] + [v.transpose(0, 1)], dim=1)
        if rows is not None:
            attn = attention(q.transpose(0, 1), keys, values, rows=rows)
            x = x[rows]
        else:
            attn = attention(q.transpose(0, 1).contiguous(), keys, values)  # [Hq, T, D]
        attn = attn.transpose(0, 1).reshape(-1, q_dim).to(x.dtype)
        x = x + self._linear(attn, layer.o_proj_weight, layer.o_proj_bias)
        h = self._rms_norm(x, layer.post_attention_layernorm)
        gate, up = self._linear(h, layer.gate_up_weight, layer.gate_up_bias).chunk(2, dim=-1)
        return x + self._linear(F.silu(gate) * up, layer.down_proj_weight, layer.down_proj_bias)

    def _letter_logits(self, x: torch.Tensor, letter_ids: np.ndarray) -> np.ndarray:
        h = self._rms_norm(x, self.norm).float()
        letters = torch.from_numpy(letter_ids.astype(np.int64)).to(self.device)
        logits = h @ self.lm_head[letters].float().T  # [R, L]
        if not torch.isfinite(logits).all():
            raise FloatingPointError("non-finite letter logit")
        return logits.cpu().numpy()

    @_on_device
    def forward(self, batch: PackedBatch) -> np.ndarray:
        if self.fast is not None:
            with torch.inference_mode():
                return self.fast.forward(batch)
        attention = None
        if self.cuda_graphs and self.attention == "sdpa" and batch.num_tokens <= GRAPH_BUCKETS[-1]:
            # small forwards are launch-bound: graphs; bigger ones that split into independent subtree
            # groups are attention-bound: eager, per-group attention
            if batch.num_tokens <= GRAPH_EAGER_ABOVE:
                return self._forward_graphed(batch)
            attention = TreeAttention(batch, [self.prefix_kv[n][0] for n in batch.prefixes], self.device)
            if not attention.grouped:
                return self._forward_graphed(batch)
        *_, logits = self.forward_steps(batch, _attention=attention)
        if logits is None:
            raise RuntimeError("forward_steps ended without letter logits")
        return logits

    @_on_device
    def launch(self, batch: PackedBatch):
        """`forward` without waiting for the device where a CUDA graph runs it (`fast.Launched`: `done()`,
        `result()`, `device_s()`); anything else computes here and comes back ready (`base.Ready`)."""
        if self.fast is not None and self.cuda_graphs:
            with torch.inference_mode():
                return self.fast.launch(batch)
        return Ready(self.forward(batch))

    @_on_device_steps
    @torch.inference_mode()
    def forward_steps(self, batch: PackedBatch, _capture: list | None = None,
                      _attention: TreeAttention | None = None) -> Iterator[np.ndarray | None]:
        if self.fast is not None:
            yield from self.fast.forward_steps(batch, capture=_capture)
            return
        prefixes = [self.prefix_kv[name] for name in batch.prefixes]
        attention = _attention or TreeAttention(batch, [p[0] for p in prefixes], self.device, self.attention)
        cos, sin = self._rope(batch.positions)
        ids = torch.from_numpy(batch.token_ids.astype(np.int64)).to(self.device)
        readout = torch.from_numpy(batch.readout_index.astype(np.int64)).to(self.device)
        x = self.embed_tokens[ids]  # [T, H]
        last = len(self.layers) - 1
        for i in range(last):
            x = self._layer(i, x, cos, sin, prefixes, attention, capture=_capture)
            if x.is_cuda:
                # the device is idle at a yield, so a parked long lane really hands it over
                torch.cuda.synchronize()
            yield None
        x = self._layer(last, x, cos, sin, prefixes, attention, rows=readout, capture=_capture)
        yield self._letter_logits(x, batch.letter_ids)

    # ---- CUDA graphs ---------------------------------------------------------------------------------------
    def _padded(self, batch: PackedBatch, size: int, names: list[str]) -> PackedBatch:
        """The batch padded to `size` tokens in one extra block that nothing sees, with every cached prefix."""
        pad = size - batch.num_tokens
        n_blocks = len(batch.block_parent)
        block_prefix = batch.block_prefix.copy()
        if batch.prefixes:
            remap = np.array([names.index(p) for p in batch.prefixes], dtype=np.int32)
            block_prefix = np.where(block_prefix >= 0, remap[np.maximum(block_prefix, 0)], -1).astype(np.int32)
        return PackedBatch(
            token_ids=np.concatenate([batch.token_ids, np.zeros(pad, dtype=np.int64)]),
            positions=np.concatenate([batch.positions, np.zeros(pad, dtype=np.int64)]),
            token_block=np.concatenate([batch.token_block, np.full(pad, n_blocks, dtype=np.int32)]),
            block_parent=np.append(batch.block_parent, np.int32(-1)).astype(np.int32),
            block_prefix=np.append(block_prefix, np.int32(-1)).astype(np.int32),
            readout_index=batch.readout_index, letter_ids=batch.letter_ids, prefixes=list(names))

    def _graph_body(self, static: dict[str, torch.Tensor], prefixes: list) -> torch.Tensor:
        x = self.embed_tokens[static["ids"]]
        attention = StaticMaskAttention(static["mask"])
        for i in range(len(self.layers) - 1):
            x = self._layer(i, x, static["cos"], static["sin"], prefixes, attention)
        return x

    def _graph(self, size: int, names: list[str]) -> tuple:
        key = (size, tuple(names))
        if key not in self._graphs:
            dev, d = self.device, self.config.head_dim
            keys = sum(self.prefix_kv[n][0] for n in names) + size
            static = {"ids": torch.zeros(size, dtype=torch.long, device=dev),
                      "cos": torch.ones(size, 1, d, device=dev), "sin": torch.zeros(size, 1, d, device=dev),
                      "mask": torch.ones(size, keys, dtype=torch.bool, device=dev)}
            prefixes = [self.prefix_kv[n] for n in names]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the capture (allocator, cuBLAS handles)
                for _ in range(2):
                    self._graph_body(static, prefixes)
            torch.cuda.current_stream().wait_stream(side)
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # a capture stream of this backend's device (torch's default one lives on the first device used)
            with torch.cuda.graph(graph, pool=self._graph_pool, stream=torch.cuda.Stream()):
                out = self._graph_body(static, prefixes)
            self._graphs[key] = (graph, static, out, prefixes)
        return self._graphs[key]

    @_on_device
    @torch.inference_mode()
    def warmup(self, max_tokens: int = GRAPH_BUCKETS[-1]) -> None:
        """Capture the CUDA graphs of every bucket up to `max_tokens` now, not on the first request."""
        if self.fast is not None:
            if self.cuda_graphs:
                try:
                    self.fast.warmup(max_tokens)
                except torch.OutOfMemoryError as exc:
                    raise self._out_of_memory(exc, "warming up (CUDA graphs, a long-document forward)") from None
            return
        if self.cuda_graphs and self.attention == "sdpa":
            for size in GRAPH_BUCKETS:
                if size <= max(max_tokens, GRAPH_BUCKETS[0]):
                    self._graph(size, list(self.prefix_kv))

    @torch.inference_mode()
    def _forward_graphed(self, batch: PackedBatch) -> np.ndarray:
        size = next(b for b in GRAPH_BUCKETS if b >= batch.num_tokens)
        names = list(self.prefix_kv)
        padded = self._padded(batch, size, names)
        attention = TreeAttention(padded, [self.prefix_kv[n][0] for n in names], self.device, "sdpa", segment=False)
        graph, static, out, prefixes = self._graph(size, names)
        cos, sin = self._rope(padded.positions)
        static["ids"].copy_(torch.from_numpy(padded.token_ids).to(self.device))
        static["cos"].copy_(cos)
        static["sin"].copy_(sin)
        static["mask"].copy_(attention.dense_mask())
        graph.replay()
        readout = torch.from_numpy(batch.readout_index.astype(np.int64)).to(self.device)
        x = self._layer(len(self.layers) - 1, out, cos, sin, prefixes, attention, rows=readout)
        return self._letter_logits(x, batch.letter_ids)

    @_on_device
    def add_prefix(self, key: str, token_ids: list[int]) -> None:
        n = len(token_ids)
        batch = PackedBatch(
            token_ids=np.asarray(token_ids, dtype=np.int64), positions=np.arange(n, dtype=np.int64),
            token_block=np.zeros(n, dtype=np.int32), block_parent=np.array([-1], dtype=np.int32),
            block_prefix=np.array([-1], dtype=np.int32), readout_index=np.array([n - 1], dtype=np.int64),
            letter_ids=np.array([0], dtype=np.int64), prefixes=[])
        captured: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _ in self.forward_steps(batch, _capture=captured):
            pass
        self.prefix_kv[key] = (n, captured)
        if self.fast is not None:
            self.fast.set_prefixes(self.prefix_kv)

    @_on_device
    @torch.inference_mode()
    def final_hidden(self, token_ids: np.ndarray) -> np.ndarray:
        """One plain causal forward of a single prompt; float32 hidden states after the final RMSNorm [T, H]."""
        n = int(token_ids.shape[0])
        batch = PackedBatch(
            token_ids=np.asarray(token_ids, dtype=np.int64), positions=np.arange(n, dtype=np.int64),
            token_block=np.zeros(n, dtype=np.int32), block_parent=np.array([-1], dtype=np.int32),
            block_prefix=np.array([-1], dtype=np.int32), readout_index=np.array([n - 1], dtype=np.int64),
            letter_ids=np.array([0], dtype=np.int64), prefixes=[])
        # the plain twin: one prompt, no tree (the evidence forward is not on the hot path)
        attention = TreeAttention(batch, [], self.device, "flex" if self.attention == "flex" else "sdpa")
        cos, sin = self._rope(batch.positions)
        x = self.embed_tokens[torch.from_numpy(batch.token_ids).to(self.device)]
        for i in range(len(self.layers)):
            x = self._layer(i, x, cos, sin, [], attention)
        return self._rms_norm(x, self.norm).float().cpu().numpy()
