"""Llama forward over a packed prefix tree, in MLX (Apple GPU through Metal; CPU with `mlx[cpu]`).

The same model as `backends/torch/llama.py`: Hugging Face names, q/k/v and gate/up fused at load, strict
load, tree attention with per-token RoPE positions (angles in float64 on the host), f32 attention and
letter logits, the last layer only at the readout rows. f32 on the CPU, f16 by default on Metal, bf16 and
the quantized q8/q4 (MLX's own format, group size 64) on request.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import host
from ..base import Fill, ModelInfo, PackedBatch
from .ported import fuse
from .quantize import QUANTIZED, Quantized, quantized_layers
from .tree_attention import TreeAttention

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


class _Layer:
    __slots__ = host.LAYER_SLOTS


def _linear(x: mx.array, weight: mx.array | Quantized, bias: mx.array | None) -> mx.array:
    y = weight.matmul(x) if isinstance(weight, Quantized) else x @ weight.T
    return y if bias is None else y + bias


class MLXBackend:
    """Backend protocol implementation for MLX (see backends/base.py)."""

    name = "mlx"

    def __init__(self, device: str = "auto", attention: str = "auto", memory_limit: str | float | None = None) -> None:
        self.mx_device = mx.gpu if resolve_device(device) == "gpu" else mx.cpu
        self.device = "metal" if self.mx_device == mx.gpu else "cpu"
        # --gpu-memory (backends/memory.py): MLX's memory limit on Metal, applied at load
        self.memory_limit = memory_limit
        self.memory_limit_bytes: int | None = None
        if attention == "auto":
            # the kernel is packing-invariant by construction; warmup() checks it against the twin first
            attention = "metal" if self.device == "metal" else "sdpa"
        if attention not in ("sdpa", "metal"):
            raise ValueError(f"unknown attention {attention!r} for the MLX backend (sdpa or metal)")
        if attention == "metal" and self.device != "metal":
            raise ValueError("the Metal tree-attention kernel needs --device mps")
        self.attention = attention
        self.prefix_kv: dict[str, tuple[int, list[tuple[mx.array, mx.array]]]] = {}

    # ---- loading -------------------------------------------------------------------------------------------
    def load(self, model_dir: Path, dtype: str = "auto") -> ModelInfo:
        from basal_local.model.config import LlamaConfig
        from basal_local.model.formats import detect_format, read_config

        model_dir = Path(model_dir)
        raw_config = read_config(model_dir)  # config.json, or a GGUF file's metadata
        cfg = self.config = LlamaConfig.from_dict(raw_config)
        dtype = host.resolve_dtype(dtype, self.device == "cpu", (*DTYPES, *QUANTIZED), "MLX")
        self.dtype_name = dtype
        # quantized weights compute in f16 on Metal and f32 on the CPU
        self.dtype = DTYPES.get(dtype) or (mx.float16 if self.device == "metal" else mx.float32)
        self.format = detect_format(model_dir, raw_config)
        if self.format.family != "safetensors" and dtype in QUANTIZED:
            raise ValueError(f"--dtype {dtype} quantizes bf16 weights; a {self.format.name} checkpoint is "
                             "already quantized (use --dtype auto, f16 or f32)")
        self._apply_memory_limit(cfg)
        with mx.stream(self.mx_device):
            if self.format.family != "safetensors":
                from .ported import port_weights

                weights = port_weights(self.format, cfg, self.dtype)
            else:
                weights = mx.load(str(model_dir / "model.safetensors"))
            quantized = quantized_layers(model_dir / "model.safetensors", weights, cfg, QUANTIZED[dtype],
                                         self.dtype) if dtype in QUANTIZED else {}

            def take(key: str) -> mx.array | Quantized:
                if key not in weights:
                    raise ValueError(f"model.safetensors: missing tensor {key!r}")
                value = weights.pop(key)
                return value if isinstance(value, Quantized) else value.astype(self.dtype)

            self.embed_tokens = take("model.embed_tokens.weight")
            self.norm = take("model.norm.weight")
            self.lm_head = take("lm_head.weight")  # only its letter rows are used, as f32 dot products
            self.layers: list[_Layer] = []
            for i in range(cfg.num_hidden_layers):
                layer = _Layer()
                for slot, tensor in host.load_layer(take, fuse, cfg, i).items():
                    name = slot.removesuffix("_weight")
                    setattr(layer, slot, quantized.get(f"model.layers.{i}.{name}", tensor)
                            if slot.endswith("_weight") and name in host.FUSED else tensor)
                self.layers.append(layer)
                mx.eval(*self._layer_tensors(layer))  # one layer at a time in memory twice, not the model
            if weights:
                raise ValueError(f"model.safetensors: unknown tensor {next(iter(weights))!r}")
            mx.eval(self.embed_tokens, self.norm, self.lm_head)
        self.inv_freq = host.inv_freq(cfg)
        tensors = list(self._tensors())
        params = sum(t.parameters for t in tensors)
        return ModelInfo(cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, dtype, self.device, params,
                         sum(t.nbytes for t in tensors))

    @staticmethod
    def _layer_tensors(layer: _Layer) -> list:
        out = []
        for name in _Layer.__slots__:
            t = getattr(layer, name)
            if isinstance(t, Quantized):
                out.extend(t.arrays())
            elif t is not None:
                out.append(t)
        return out

    def _tensors(self) -> Iterator:
        """Every weight, as objects with `nbytes` and `parameters` (quantized ones count their packed size)."""
        for t in (self.embed_tokens, self.norm, self.lm_head):
            yield _Sized(t.nbytes, t.size)
        for layer in self.layers:
            for name in _Layer.__slots__:
                t = getattr(layer, name)
                if isinstance(t, Quantized):
                    yield _Sized(t.nbytes, t.parameters)
                elif t is not None:
                    yield _Sized(t.nbytes, t.size)

    def memory(self) -> dict[str, int]:
        out = {"weights_bytes": sum(t.nbytes for t in self._tensors())}
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

    # ---- pieces --------------------------------------------------------------------------------------------
    def _rope(self, positions: np.ndarray) -> tuple[mx.array, mx.array]:
        cos, sin = host.rope_angles(positions, self.inv_freq)
        return (mx.array(np.concatenate([cos, cos], axis=1))[:, None, :],
                mx.array(np.concatenate([sin, sin], axis=1))[:, None, :])  # [T, 1, D]

    @staticmethod
    def _apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        half = x.shape[-1] // 2
        rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin

    def _rms_norm(self, x: mx.array, weight: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, weight, self.config.rms_norm_eps)

    def _layer(self, i: int, x: mx.array, cos: mx.array, sin: mx.array, prefixes: list, attention,
               rows: np.ndarray | None = None, capture: list | None = None) -> mx.array:
        """One decoder layer; with `rows`, only those rows leave the attention (the last layer)."""
        cfg = self.config
        layer = self.layers[i]
        n_heads, n_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_dim, kv_dim = n_heads * d, n_kv * d
        h = self._rms_norm(x, layer.input_layernorm)
        qkv = _linear(h, layer.qkv_weight, layer.qkv_bias).astype(mx.float32)
        # attention in f32: q, k, v after RoPE; q/k/v [T, H, D]
        q = self._apply_rope(qkv[:, :q_dim].reshape(-1, n_heads, d), cos, sin)
        k = self._apply_rope(qkv[:, q_dim:q_dim + kv_dim].reshape(-1, n_kv, d), cos, sin)
        v = qkv[:, q_dim + kv_dim:].reshape(-1, n_kv, d)
        if capture is not None:
            capture.append((k, v))
        keys = mx.concatenate([p[1][i][0] for p in prefixes] + [k], axis=0) if prefixes else k
        values = mx.concatenate([p[1][i][1] for p in prefixes] + [v], axis=0) if prefixes else v
        attn = attention(q, keys, values, rows=rows)
        if rows is not None:
            x = x[mx.array(rows.astype(np.int32))]
        x = x + _linear(attn.reshape(-1, q_dim).astype(x.dtype), layer.o_proj_weight, layer.o_proj_bias)
        h = self._rms_norm(x, layer.post_attention_layernorm)
        gate_up = _linear(h, layer.gate_up_weight, layer.gate_up_bias)
        gate, up = gate_up[:, : cfg.intermediate_size], gate_up[:, cfg.intermediate_size:]
        return x + _linear(gate * mx.sigmoid(gate) * up, layer.down_proj_weight, layer.down_proj_bias)

    def _letter_logits(self, x: mx.array, letter_ids: np.ndarray) -> np.ndarray:
        h = self._rms_norm(x, self.norm).astype(mx.float32)
        letters = self.lm_head[mx.array(letter_ids.astype(np.int32))].astype(mx.float32)
        logits = np.array(h @ letters.T)  # [R, L]; np.array evaluates the graph
        if not np.isfinite(logits).all():
            raise FloatingPointError("non-finite letter logit")
        return logits

    # ---- forward -------------------------------------------------------------------------------------------
    def forward(self, batch: PackedBatch) -> np.ndarray:
        # one lazy graph for the whole forward, evaluated once (no sync between layers)
        *_, logits = self.forward_steps(batch, _sync=False)
        if logits is None:
            raise RuntimeError("forward_steps ended without logits")
        return logits

    def forward_steps(self, batch: PackedBatch, _capture: list | None = None,
                      _sync: bool = True) -> Iterator[np.ndarray | None]:
        lengths = batch.prefix_lengths or [self.prefix_kv[name][0] for name in batch.prefixes]
        prefixes = [(n, [(k[:n], v[:n]) for k, v in self.prefix_kv[name][1]])
                    for name, n in zip(batch.prefixes, lengths)]
        fills = [(f, mx.array(np.asarray(f.tokens, dtype=np.int32)), []) for f in batch.fills]
        layer_kv: list | None = [] if fills else _capture
        with mx.stream(self.mx_device):
            attention = TreeAttention(batch, [p[0] for p in prefixes], self.attention)
            cos, sin = self._rope(batch.positions)
            x = self.embed_tokens[mx.array(batch.token_ids.astype(np.int32))]  # [T, H]
        last = len(self.layers) - 1
        for i in range(len(self.layers)):
            with mx.stream(self.mx_device):
                x = self._layer(i, x, cos, sin, prefixes, attention, capture=layer_kv,
                                rows=batch.readout_index if i == last else None)
                if fills:
                    k, v = layer_kv.pop()
                    if _capture is not None:
                        _capture.append((k, v))
                    for f, idx, kept in fills:  # K/V kept for later batches (the state cache)
                        new_k, new_v = k[idx], v[idx]
                        if f.parent_len:  # the rows it continues, then its own
                            pk, pv = self.prefix_kv[f.parent][1][i]
                            new_k = mx.concatenate([pk[:f.parent_len], new_k], axis=0)
                            new_v = mx.concatenate([pv[:f.parent_len], new_v], axis=0)
                        kept.append((new_k, new_v))
            if i == last:
                break
            if _sync:
                # the work of this layer is done at the yield, so a parked long lane frees the device
                mx.eval(x, *[a for _, _, kept in fills for a in kept[-1]])
                yield None
        with mx.stream(self.mx_device):
            kept_arrays = [a for _, _, kept in fills for kv in kept for a in kv]
            if kept_arrays:
                mx.eval(x, *kept_arrays)
            logits = self._letter_logits(x, batch.letter_ids)
        for f, _, kept in fills:
            self.prefix_kv[f.name] = (f.length, kept)
        yield logits

    def add_prefix(self, key: str, token_ids: list[int], offset: int | None = None) -> None:
        """Compute and keep a prefix's K/V under `key` (MLX keeps each prefix as its own arrays: `offset`, the
        state cache's pool row, only matters to backends with one pool)."""
        n = len(token_ids)
        batch = PackedBatch.single(token_ids)
        batch.fills = [Fill(key, offset or 0, None, 0, np.arange(n, dtype=np.int64))]
        for _ in self.forward_steps(batch):
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

    def final_hidden(self, token_ids: np.ndarray) -> np.ndarray:
        """The hidden states after the final RMSNorm of one prompt (plain causal forward), f32 [T, hidden]."""
        batch = PackedBatch.single(token_ids)
        with mx.stream(self.mx_device):
            attention = TreeAttention(batch, [], "sdpa")
            cos, sin = self._rope(batch.positions)
            x = self.embed_tokens[mx.array(batch.token_ids.astype(np.int32))]
            for i in range(len(self.layers)):
                x = self._layer(i, x, cos, sin, [], attention)
            return np.array(self._rms_norm(x, self.norm).astype(mx.float32))

    def warmup(self, max_tokens: int = 0) -> None:
        """On Metal, check the tree-attention kernel against its twin once; fall back to the twin if it fails."""
        if self.attention == "metal":
            from .tree_attention import kernel_matches_twin

            ok, why = kernel_matches_twin(self.config.num_attention_heads, self.config.num_key_value_heads,
                                          self.config.head_dim)
            if not ok:
                import logging

                logging.getLogger(__name__).warning("Metal tree-attention kernel not used (%s); using the "
                                                    "dense-mask twin", why)
                self.attention = "sdpa"


class _Sized:
    __slots__ = ("nbytes", "parameters")

    def __init__(self, nbytes: int, parameters: int) -> None:
        self.nbytes, self.parameters = int(nbytes), int(parameters)
