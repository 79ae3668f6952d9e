"""Llama forward over a packed prefix tree, in PyTorch (CPU reference in f32; CUDA).

Attribute names follow the Hugging Face checkpoint; loading fuses q/k/v and gate/up once. Tree attention
here is the plain twin: SDPA with a dense boolean mask built from the block tree, which is exactly
equivalent to one causal forward per prompt. The last layer runs o_proj, MLP, final norm and the letter
logits only at the readout rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

from ..base import ModelInfo, PackedBatch
from .tree_attention import TreeAttention, flex_available

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class _Layer:
    __slots__ = ("input_layernorm", "post_attention_layernorm", "qkv_weight", "qkv_bias", "o_proj_weight",
                 "o_proj_bias", "gate_up_weight", "gate_up_bias", "down_proj_weight", "down_proj_bias")


class TorchBackend:
    """Backend protocol implementation for torch (see backends/base.py)."""

    name = "torch"

    def __init__(self, device: str = "auto", attention: str = "auto") -> None:
        self.device = resolve_device(device)
        if attention == "auto":
            # measured on an H200 (docs/PERFORMANCE.md): the f32 FlexAttention kernel is still slower than the
            # fused SDPA twin, so the twin is the default until a faster tree kernel lands
            attention = "sdpa"
        if attention == "flex" and not flex_available():
            raise ValueError("attention 'flex' needs a torch with FlexAttention")
        if attention not in ("sdpa", "flex"):
            raise ValueError(f"unknown attention {attention!r} (sdpa or flex)")
        self.attention = attention
        self.prefix_kv: dict[str, tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    # ---- loading -------------------------------------------------------------------------------------------
    def load(self, model_dir: Path, dtype: str = "auto") -> ModelInfo:
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        from basal_local.model.config import LlamaConfig

        cfg = self.config = LlamaConfig.from_dict(raw)
        if dtype == "auto":
            dtype = "f32" if self.device == "cpu" else "f16"
        self.dtype_name = dtype
        self.dtype = DTYPES[dtype]
        dev = self.device
        weights: dict[str, torch.Tensor] = {}
        # bf16 on disk, converted once to the run dtype (mmap'd reads, one tensor at a time)
        with safe_open(str(model_dir / "model.safetensors"), framework="pt") as fh:
            for key in fh.keys():
                weights[key] = fh.get_tensor(key).to(device=dev, dtype=self.dtype)
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
        return ModelInfo(cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, dtype, self.device, params,
                         sum(t.numel() * t.element_size() for t in self._tensors()))

    def _tensors(self) -> Iterator[torch.Tensor]:
        yield from (self.embed_tokens, self.norm, self.lm_head)
        for layer in self.layers:
            for name in _Layer.__slots__:
                t = getattr(layer, name)
                if t is not None:
                    yield t

    def memory(self) -> dict[str, int]:
        out = {"weights_bytes": sum(t.numel() * t.element_size() for t in self._tensors())}
        if self.device.startswith("cuda"):
            out["device_allocated_bytes"] = torch.cuda.memory_allocated()
            out["device_peak_bytes"] = torch.cuda.max_memory_allocated()
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
    def forward(self, batch: PackedBatch) -> np.ndarray:
        *_, logits = self.forward_steps(batch)
        assert logits is not None
        return logits

    @torch.inference_mode()
    def forward_steps(self, batch: PackedBatch, _capture: list | None = None) -> Iterator[np.ndarray | None]:
        cfg = self.config
        n_heads, n_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        prefixes = [self.prefix_kv[name] for name in batch.prefixes]
        attention = TreeAttention(batch, [p[0] for p in prefixes], self.device, self.attention)
        cos, sin = self._rope(batch.positions)
        ids = torch.from_numpy(batch.token_ids.astype(np.int64)).to(self.device)
        readout = torch.from_numpy(batch.readout_index.astype(np.int64)).to(self.device)
        x = self.embed_tokens[ids]  # [T, H]
        q_dim, kv_dim = n_heads * d, n_kv * d
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.input_layernorm)
            qkv = self._linear(h, layer.qkv_weight, layer.qkv_bias)
            q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
            # attention in f32: q, k, v after RoPE
            q = self._apply_rope(q.float().view(-1, n_heads, d), cos, sin)
            k = self._apply_rope(k.float().view(-1, n_kv, d), cos, sin)
            v = v.float().view(-1, n_kv, d)
            if _capture is not None:
                _capture.append((k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()))
            keys = torch.cat([p[1][i][0] for p in prefixes] + [k.transpose(0, 1)], dim=1)  # [Hkv, S, D]
            values = torch.cat([p[1][i][1] for p in prefixes] + [v.transpose(0, 1)], dim=1)
            if i == last:
                # only the readout rows go on
                attn = attention(q.transpose(0, 1), keys, values, rows=readout)
                x = x[readout]
            else:
                attn = attention(q.transpose(0, 1).contiguous(), keys, values)  # [Hq, T, D]
            attn = attn.transpose(0, 1).reshape(-1, q_dim).to(x.dtype)
            x = x + self._linear(attn, layer.o_proj_weight, layer.o_proj_bias)
            h = self._rms_norm(x, layer.post_attention_layernorm)
            gate, up = self._linear(h, layer.gate_up_weight, layer.gate_up_bias).chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, layer.down_proj_weight, layer.down_proj_bias)
            if i != last:
                yield None
        h = self._rms_norm(x, self.norm).float()
        letters = torch.from_numpy(batch.letter_ids.astype(np.int64)).to(self.device)
        logits = h @ self.lm_head[letters].float().T  # [R, L]
        if not torch.isfinite(logits).all():
            raise FloatingPointError("non-finite letter logit")
        yield logits.cpu().numpy()

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
