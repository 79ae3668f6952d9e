"""The MLX backend: one Llama forward over a packed prefix tree (Apple GPU through Metal; CPU with `mlx[cpu]`).

The same model as the torch backend (`backends/torch/`): Hugging Face names, q/k/v and gate/up fused at load
(`host.Checkpoint`), strict load, tree attention with per-token RoPE positions (angles in float64 on the host),
f32 attention and letter logits, the last layer only at the readout rows. Its ops are chosen once (`ops.py`:
the Metal kernels on an Apple GPU, their MLX twins elsewhere) and each projection at load (`ops.Dense`, or
`quantize.Quantized` for the q8/q4 weights and the ports of `ported.py`). f32 on the CPU, f16 by default on
Metal, bf16 and the quantized q8/q4 (MLX's own format, group size 64) on request.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import host
from ..base import ModelInfo, PackedBatch
from . import ops as mlx_ops
from .ported import fuse
from .quantize import QUANTIZED, Quantized, quantized_layers

log = logging.getLogger(__name__)

DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}


def resolve_device(device: str) -> str:
    """`cpu`, or `gpu` (Metal); `auto` is Metal when present."""
    if device == "auto":
        return "gpu" if mx.metal.is_available() else "cpu"
    if device in ("gpu", "mps", "metal"):
        if not mx.metal.is_available():
            raise ValueError("--device mps needs Metal (an Apple Silicon Mac); use --device cpu")
        return "gpu"
    if device == "cpu":
        return "cpu"
    raise ValueError(f"the MLX backend runs on cpu or mps (Metal), not {device!r}")


def _linear(x: mx.array, weight: mlx_ops.Dense | Quantized, bias: mx.array | None) -> mx.array:
    y = weight.matmul(x)
    return y if bias is None else y + bias


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate-half RoPE on [T, H, D] with cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    return x * cos + mx.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def _arrays(t) -> list[mx.array]:
    return t.arrays() if isinstance(t, (mlx_ops.Dense, Quantized)) else [t]


class MLXBackend:
    """Backend protocol implementation for MLX (see backends/base.py)."""

    name = "mlx"

    def __init__(self, device: str = "auto", attention: str = "auto", memory_limit: str | float | None = None) -> None:
        self.mx_device = mx.gpu if resolve_device(device) == "gpu" else mx.cpu
        self.device = "metal" if self.mx_device == mx.gpu else "cpu"
        # --gpu-memory (backends/memory.py): MLX's memory limit on Metal, applied at load
        self.memory_limit = memory_limit
        self.memory_limit_bytes: int | None = None
        self.ops = mlx_ops.choose(self.device, attention)
        self.prefix_kv: dict[str, tuple[int, list[tuple[mx.array, mx.array]]]] = {}

    @property
    def attention(self) -> str:
        """The tree attention that runs: "metal" (the kernel) or "sdpa" (the twin)."""
        return self.ops.attention

    def describe(self) -> dict:
        """What runs (for the bench): the ops and how the projections are held."""
        layers = getattr(self, "layers", [])
        quantized = bool(layers) and isinstance(layers[0].qkv_weight, Quantized)
        return {**self.ops.describe(), "linear": "quantized" if quantized else "dense"}

    # ---- loading -------------------------------------------------------------------------------------------
    def load(self, model_dir: Path, dtype: str = "auto") -> ModelInfo:
        cfg, self.format = host.read_model(model_dir)  # config.json, or a GGUF file's metadata
        self.config = cfg
        dtype = host.resolve_dtype(dtype, self.device == "cpu", (*DTYPES, *QUANTIZED), "MLX")
        self.dtype_name = dtype
        # quantized weights compute in f16 on Metal and f32 on the CPU
        self.dtype = DTYPES.get(dtype) or (mx.float16 if self.device == "metal" else mx.float32)
        if self.format.family != "safetensors" and dtype in QUANTIZED:
            raise ValueError(f"--dtype {dtype} quantizes bf16 weights; a {self.format.name} checkpoint is "
                             "already quantized (use --dtype auto, f16 or f32)")
        self._apply_memory_limit(cfg)
        with mx.stream(self.mx_device):
            if self.format.family != "safetensors":
                from .ported import port_weights

                weights = port_weights(self.format, cfg, self.dtype)
            else:
                weights = mx.load(str(self.format.weights_file))
            quantized = quantized_layers(self.format.weights_file, weights, cfg, QUANTIZED[dtype],
                                         self.dtype) if dtype in QUANTIZED else {}
            checkpoint = host.Checkpoint(weights, lambda t: t if isinstance(t, Quantized) else t.astype(self.dtype))
            self.embed_tokens, self.norm, self.lm_head = checkpoint.top()  # lm_head: f32 dot products, letter rows
            self.layers: list[host.Layer] = []
            for i in range(cfg.num_hidden_layers):
                tensors = checkpoint.layer(cfg, i, fuse)
                for name in host.FUSED:  # each projection's matmul, chosen here once
                    w = quantized.get(f"model.layers.{i}.{name}", tensors[f"{name}_weight"])
                    tensors[f"{name}_weight"] = w if isinstance(w, Quantized) else mlx_ops.Dense(w)
                layer = host.Layer(tensors)
                mx.eval(*[a for t in layer.tensors() for a in _arrays(t)])  # one layer at a time in memory twice
                self.layers.append(layer)
            checkpoint.done()
            mx.eval(self.embed_tokens, self.norm, self.lm_head)
        self.inv_freq = host.inv_freq(cfg)
        weights = self._weights()
        return ModelInfo(cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, dtype, self.device,
                         sum(t.size for t in weights), sum(t.nbytes for t in weights))

    def _weights(self) -> list:
        """Every weight: arrays, and `Dense` / `Quantized` matrices (`size` their elements, `nbytes` as held)."""
        return [self.embed_tokens, self.norm, self.lm_head] + [t for layer in self.layers for t in layer.tensors()]

    def memory(self) -> dict[str, int]:
        out = {"weights_bytes": sum(t.nbytes for t in self._weights())}
        out["device_allocated_bytes"] = int(mx.get_active_memory())
        out["device_peak_bytes"] = int(mx.get_peak_memory())
        if self.memory_limit_bytes is not None:
            out["device_limit_bytes"] = self.memory_limit_bytes
        return out

    def _apply_memory_limit(self, cfg) -> None:
        """--gpu-memory on Metal: refuse weights that cannot fit (as this load will hold them: a port's packed
        words as the checkpoint has them, not its bf16 size), then set MLX's memory limit (a bound on what a
        computation may hold; beyond it and the machine's memory an allocation fails). The CPU device uses the
        machine's memory: ignored there."""
        if self.memory_limit is None:
            return
        from .. import memory

        if self.device != "metal":
            log.warning("--gpu-memory %s ignored: the MLX backend runs on the CPU here", self.memory_limit)
            return
        total = int(mx.device_info().get("memory_size", 0))
        if total <= 0:
            raise ValueError("--gpu-memory: this MLX build does not report the GPU's memory; drop --gpu-memory")
        limit = memory.limit_bytes(self.memory_limit, total, "the Metal GPU")
        memory.check_weights_fit(self.planned_weight_bytes(cfg), limit, self.memory_limit, "the Metal GPU",
                                 self._dtype_label())
        mx.set_memory_limit(limit)
        self.memory_limit_bytes = limit

    def planned_weight_bytes(self, cfg) -> int:
        """The bytes of the weights this load holds (`ported.planned_bytes`), before any is read."""
        from .ported import planned_bytes

        return planned_bytes(self.format, cfg, self.dtype.size, QUANTIZED.get(self.dtype_name))

    def _dtype_label(self) -> str:
        """How the weights are held, for the --gpu-memory refusal."""
        from .ported import GGUF_BITS, native_gguf

        fmt = self.format
        if fmt.family == "mlx":
            return f"the checkpoint's {fmt.bits}-bit {fmt.mode} (group {fmt.group_size})"
        if native_gguf(fmt):
            return f"the checkpoint's {'/'.join(sorted(set(fmt.tensor_types) & set(GGUF_BITS)))}"
        if fmt.family != "safetensors":
            return f"{self.dtype_name} (a {fmt.name} checkpoint dequantized at load)"
        return self.dtype_name

    # ---- the forward ---------------------------------------------------------------------------------------
    def _rope(self, positions: np.ndarray) -> tuple[mx.array, mx.array]:
        cos, sin = host.rope_angles(positions, self.inv_freq)
        return (mx.array(np.concatenate([cos, cos], axis=1))[:, None, :],
                mx.array(np.concatenate([sin, sin], axis=1))[:, None, :])  # [T, 1, D]

    def _steps(self, batch: PackedBatch, sync: bool = True, hidden: bool = False) -> Iterator[np.ndarray | None]:
        """The one forward. Per layer: residual + RMSNorm, the q/k/v matmul, RoPE, tree attention in f32 (the
        cached prefixes' K/V first), o_proj, residual + RMSNorm, gate/up, SwiGLU, down; the last layer leaves
        the attention at the readout rows only. With `sync`, each layer but the last is computed before it
        yields None (so a parked long lane frees the device); else the forward is one lazy graph, evaluated
        once. Last: the letter logits [R, L] f32, or with `hidden` the final hidden states of the readout rows
        [R, hidden] f32. The K/V of `batch.fills` are kept for later batches (the state cache)."""
        lengths = batch.prefix_lengths or [self.prefix_kv[name][0] for name in batch.prefixes]
        prefixes = [[(k[:n], v[:n]) for k, v in self.prefix_kv[name][1]] for name, n in zip(batch.prefixes, lengths)]
        fills = [(f, mx.array(np.asarray(f.tokens, dtype=np.int32)), []) for f in batch.fills]
        last = len(self.layers) - 1
        with mx.stream(self.mx_device):
            attention = self.ops.tree_attention(batch, lengths)
            cos, sin = self._rope(batch.positions)
            x = self.embed_tokens[mx.array(batch.token_ids.astype(np.int32))]  # [T, H]
        delta = None
        for i in range(len(self.layers)):
            with mx.stream(self.mx_device):
                rows = batch.readout_index if i == last else None
                x, delta, k, v = self._layer(i, x, delta, cos, sin, [p[i] for p in prefixes], attention, rows)
                for f, idx, kept in fills:
                    new_k, new_v = k[idx], v[idx]
                    if f.parent_len:  # the rows it continues, then its own
                        pk, pv = self.prefix_kv[f.parent][1][i]
                        new_k = mx.concatenate([pk[:f.parent_len], new_k], axis=0)
                        new_v = mx.concatenate([pv[:f.parent_len], new_v], axis=0)
                    kept.append((new_k, new_v))
                del k, v  # a parked long lane holds the residual stream and what it keeps, nothing else
            if sync and i < last:
                mx.eval(x, delta, *[a for _, _, kept in fills for a in kept[-1]])
                yield None
        with mx.stream(self.mx_device):
            h = self.ops.add_rms_norm(x, delta, self.norm, self.config.rms_norm_eps)[0].astype(mx.float32)
            kept_arrays = [a for _, _, kept in fills for kv in kept for a in kv]
            if kept_arrays:
                mx.eval(h, *kept_arrays)
            out = np.array(h) if hidden else self._letter_logits(h, batch.letter_ids)
        for f, _, kept in fills:
            self.prefix_kv[f.name] = (f.length, kept)
        yield out

    def _layer(self, i: int, x: mx.array, delta: mx.array | None, cos: mx.array, sin: mx.array, cached: list,
               attention, rows: np.ndarray | None) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Decoder layer i on the residual stream x + delta: (its x, its delta, its K, its V); `cached` the
        cached prefixes' (K, V) of this layer; with `rows`, only those rows leave the attention."""
        cfg, ops, layer = self.config, self.ops, self.layers[i]
        n_heads, n_kv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        q_dim, kv_dim = n_heads * d, n_kv * d
        h, x = ops.add_rms_norm(x, delta, layer.input_layernorm, eps)
        qkv = _linear(h, layer.qkv_weight, layer.qkv_bias).astype(mx.float32)
        q = _rotate(qkv[:, :q_dim].reshape(-1, n_heads, d), cos, sin)  # q/k/v [T, heads, D]
        k = _rotate(qkv[:, q_dim:q_dim + kv_dim].reshape(-1, n_kv, d), cos, sin)
        v = qkv[:, q_dim + kv_dim:].reshape(-1, n_kv, d)
        keys = mx.concatenate([c[0] for c in cached] + [k], axis=0) if cached else k
        values = mx.concatenate([c[1] for c in cached] + [v], axis=0) if cached else v
        attn = attention(q, keys, values, rows=rows)
        if rows is not None:
            x = x[mx.array(rows.astype(np.int32))]
        h, x = ops.add_rms_norm(x, _linear(attn.reshape(-1, q_dim).astype(x.dtype), layer.o_proj_weight,
                                           layer.o_proj_bias), layer.post_attention_layernorm, eps)
        gate_up = _linear(h, layer.gate_up_weight, layer.gate_up_bias)
        gate, up = gate_up[:, : cfg.intermediate_size], gate_up[:, cfg.intermediate_size:]
        return x, _linear(gate * mx.sigmoid(gate) * up, layer.down_proj_weight, layer.down_proj_bias), k, v

    def _letter_logits(self, h: mx.array, letter_ids: np.ndarray) -> np.ndarray:
        letters = self.lm_head[mx.array(letter_ids.astype(np.int32))].astype(mx.float32)
        logits = np.array(h @ letters.T)  # [R, L]; np.array evaluates the graph
        if not np.isfinite(logits).all():
            raise FloatingPointError("non-finite letter logit")
        return logits

    def forward(self, batch: PackedBatch) -> np.ndarray:
        *_, logits = self._steps(batch, sync=False)
        return logits

    def forward_steps(self, batch: PackedBatch) -> Iterator[np.ndarray | None]:
        yield from self._steps(batch)

    def final_hidden(self, token_ids: np.ndarray) -> np.ndarray:
        """The hidden states after the final RMSNorm of one prompt (plain causal forward), f32 [T, hidden]."""
        *_, out = self._steps(PackedBatch.single(token_ids, readout="all"), sync=False, hidden=True)
        return out

    def add_prefix(self, key: str, token_ids: list[int], offset: int | None = None) -> None:
        """Compute and keep a prefix's K/V under `key` (MLX keeps each prefix as its own arrays: `offset`, the
        state cache's pool row, only matters to backends with one pool)."""
        for _ in self._steps(PackedBatch.prefix(key, token_ids, offset or 0)):
            pass

    def open_cache(self, capacity: int) -> None:
        """Nothing to allocate: each cached prefix is its own arrays (the state cache counts their bytes)."""

    def kv_bytes_per_token(self) -> int:
        cfg = self.config
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # f32 K/V

    def drop_prefix(self, key: str) -> None:
        self.prefix_kv.pop(key, None)

    def device_memory(self) -> None:
        """The state cache plans with the RAM here (unified memory on a Mac, the CPU otherwise)."""
        return None

    def warmup(self, max_tokens: int = 0) -> None:
        """On Metal, check each kernel against its twin once; a kernel that fails it gives way to its twin."""
        cfg = self.config
        self.ops = mlx_ops.checked(self.ops, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   cfg.hidden_size, self.dtype)
