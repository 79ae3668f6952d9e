"""`config.json` as a dataclass, with the architecture checks of docs/PROTOCOL.md §4.7."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INT_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class LlamaConfig:
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    mlp_bias: bool

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Check and read config.json; unknown keys are ignored. Raises ConfigError naming the field."""
        def need(cond: bool, field: str, what: str) -> None:
            if not cond:
                raise ConfigError(f"config.json: field {field!r} {what} (got {raw.get(field)!r})")

        need(raw.get("model_type") == "llama", "model_type", 'must be "llama"')
        need(raw.get("architectures") == ["LlamaForCausalLM"], "architectures", 'must be ["LlamaForCausalLM"]')
        need(isinstance(raw.get("attention_bias"), bool), "attention_bias", "must be true or false")
        need(raw.get("mlp_bias", False) == raw["attention_bias"], "mlp_bias", "must equal attention_bias")
        need(raw.get("hidden_act") == "silu", "hidden_act", 'must be "silu"')
        need(raw.get("tie_word_embeddings") is False, "tie_word_embeddings", "must be false")
        need(raw.get("pretraining_tp", 1) == 1, "pretraining_tp", "must be 1")
        need(raw.get("rope_scaling") is None, "rope_scaling", "must be absent (only default RoPE is supported)")
        rope = raw.get("rope_parameters")
        if not isinstance(rope, dict):
            raise ConfigError("config.json: field 'rope_parameters' must be an object with rope_theta "
                              f"(transformers 5 layout) (got {rope!r})")
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"config.json: field 'rope_parameters.rope_type' must be \"default\" "
                              f"(got {rope.get('rope_type')!r})")
        theta = rope.get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)):
            raise ConfigError(f"config.json: field 'rope_parameters.rope_theta' must be a number (got {theta!r})")
        for field in INT_FIELDS:
            value = raw.get(field)
            need(isinstance(value, int) and not isinstance(value, bool) and value > 0, field,
                 "must be a positive integer")
        eps = raw.get("rms_norm_eps")
        need(isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0, "rms_norm_eps",
             "must be a positive number")
        need(raw["num_attention_heads"] * raw["head_dim"] == raw["hidden_size"], "hidden_size",
             "must equal num_attention_heads * head_dim")
        need(raw["num_attention_heads"] % raw["num_key_value_heads"] == 0, "num_key_value_heads",
             "must divide num_attention_heads")
        need(raw["head_dim"] % 2 == 0, "head_dim", "must be even")
        return cls(**{f: raw[f] for f in INT_FIELDS}, rms_norm_eps=float(eps), rope_theta=float(theta),
                   attention_bias=raw["attention_bias"], mlp_bias=raw.get("mlp_bias", False))

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint must hold, with its shape (Hugging Face names)."""
        h, d = self.hidden_size, self.head_dim
        q, kv, inter = self.num_attention_heads * d, self.num_key_value_heads * d, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, h),
            "model.norm.weight": (h,),
            "lm_head.weight": (self.vocab_size, h),
        }
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            for name, out_dim, in_dim in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
                shapes[p + f"self_attn.{name}.weight"] = (out_dim, in_dim)
                if self.attention_bias:
                    shapes[p + f"self_attn.{name}.bias"] = (out_dim,)
            for name, out_dim, in_dim in (("gate_proj", inter, h), ("up_proj", inter, h), ("down_proj", h, inter)):
                shapes[p + f"mlp.{name}.weight"] = (out_dim, in_dim)
                if self.mlp_bias:
                    shapes[p + f"mlp.{name}.bias"] = (out_dim,)
        return shapes
