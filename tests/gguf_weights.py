"""Real pretrained Llama weights out of a GGUF file, fast: for the SmolLM2 parity test.

transformers can load a GGUF itself, but its reader (the `gguf` package's `GGUFReader`) builds a NumPy view per
metadata item: SmolLM2's 49k-token vocabulary and 49k merges cost minutes of CPU per read, and transformers reads
the file twice (config, then weights). The test needs only the architecture numbers and the tensors, so this
module walks the metadata with `struct` (skipping the vocabulary), dequantizes the tensors with the `gguf`
package's own dequantization, undoes llama.cpp's q/k row permutation and names them as Hugging Face does.
Both sides of the parity test then load the same f32 weights; what the test compares is the forward.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np

# GGUF value types (GGUF v3): sizes of the fixed-width ones; 8 = string, 9 = array
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_FORMAT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


class _Cursor:
    def __init__(self, buf) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8", "replace")

    def value(self, vtype: int, keep: bool):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _FIXED and not keep:
                self.pos += _FIXED[etype] * count
                return count
            items = [self.value(etype, keep) for _ in range(count)]
            return items if keep else count
        return self.take(_FORMAT[vtype])


def read_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata with arrays replaced by their lengths, {GGUF tensor name: f32 array in NumPy's row-major shape})."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    cur.pos = 4
    version, n_tensors, n_kv = cur.take("<I"), cur.take("<Q"), cur.take("<Q")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    meta = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.take("<I"), keep=False)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    align = int(meta.get("general.alignment", 32))
    start = (cur.pos + align - 1) // align * align
    tensors = {}
    for name, dims, qtype, offset in infos:
        qt = GGMLQuantizationType(qtype)
        block, size = GGML_QUANT_SIZES[qt]
        count = int(np.prod(dims))
        nbytes = count // block * size
        raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=start + offset)
        rows = raw.reshape(count // dims[0], dims[0] // block * size)  # one row per innermost dimension
        tensors[name] = np.ascontiguousarray(_dequantize(quants, rows, qt), dtype=np.float32).reshape(dims[::-1])
    return meta, tensors


def _dequantize(quants, rows: np.ndarray, qt) -> np.ndarray:
    """The `gguf` package's dequantization of a whole tensor: its quantization class's `dequantize_rows` on all
    rows at once (`quants.dequantize` applies the same function to groups of 16 rows: SmolLM2's 49k-row
    embedding is 3,000 calls; 9.5 -> 6.1 s of CPU for the file, the same bits)."""
    cls = getattr(quants, qt.name, None)
    if isinstance(cls, type) and hasattr(cls, "dequantize_rows") and hasattr(cls, "init_grid"):
        cls.init_grid()
        return cls.dequantize_rows(rows)
    return quants.dequantize(rows, qt)  # F32, F16 and anything without a class of its own


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of q/k rows (its rotary layout) back to Hugging Face's."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def llama_from_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(Hugging Face LlamaConfig fields, Hugging Face state dict) of a llama-architecture GGUF."""
    meta, tensors = read_gguf(path)
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r}, expected llama")
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    hidden = meta["llama.embedding_length"]
    config = {
        "num_hidden_layers": meta["llama.block_count"], "hidden_size": hidden,
        "intermediate_size": meta["llama.feed_forward_length"], "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "max_position_embeddings": meta["llama.context_length"],
        "rms_norm_eps": meta["llama.attention.layer_norm_rms_epsilon"],
        "rope_theta": meta.get("llama.rope.freq_base", 10000.0),
    }
    state = {"model.embed_tokens.weight": tensors["token_embd.weight"],
             "model.norm.weight": tensors["output_norm.weight"],
             "lm_head.weight": tensors.get("output.weight", tensors["token_embd.weight"])}
    for name, w in tensors.items():
        if not name.startswith("blk."):
            continue
        _, layer, kind, _ = name.split(".")
        if kind == "attn_q":
            w = _unpermute(w, heads)
        elif kind == "attn_k":
            w = _unpermute(w, kv_heads)
        state[f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"] = w
    return config, state
