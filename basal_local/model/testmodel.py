"""`basal-local make-test-model`: a complete model directory of the contract with random weights.

The tokenizer is a real BPE trained with `tokenizers` on the Polish and English texts in `assets/`
(Metaspace, `<s>`=1, `<|im_start|>`=3, `<|im_end|>`=4 as in the Basal tokenizer; the letters A-J get
scattered, unsorted ids like the real ones). Presets `mini`, `4.5B`
and `max` have the real architectures (BENCHMARKS.md), for speed measurements; `tiny` and `small` are for tests.
"""

from __future__ import annotations

import importlib.util
import json
import math
from importlib import resources
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from ..protocol.constants import CHAT_TEMPLATE, LETTERS, PREFILL, SYSTEM, TEMPLATES_1_5, USER_FORMAT
from .config import LlamaConfig
from .evidence_head import HEAD_FILE, write_random_head

PRESETS: dict[str, dict] = {
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=160, attention_bias=True, max_position_embeddings=4096, rope_theta=10000.0,
                 rms_norm_eps=1e-6, vocab_size=None),
    "small": dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                  intermediate_size=320, attention_bias=False, max_position_embeddings=8192, rope_theta=500000.0,
                  rms_norm_eps=1e-5, vocab_size=None),
    # every matrix's input size divides by 64: MLX q8/q4 (group size 64) quantizes all of it
    "tiny64": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=128, attention_bias=False, max_position_embeddings=4096, rope_theta=10000.0,
                   rms_norm_eps=1e-6, vocab_size=None),
    # rows of 256: GGUF K-quants (Q4_K_M) quantize every matrix
    "tiny256": dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    intermediate_size=512, attention_bias=False, max_position_embeddings=4096, rope_theta=10000.0,
                    rms_norm_eps=1e-6, vocab_size=None),
    "mini": dict(num_hidden_layers=32, hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                 intermediate_size=8960, attention_bias=True, max_position_embeddings=8192, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, vocab_size=32000),
    "4.5B": dict(num_hidden_layers=60, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
                 intermediate_size=11008, attention_bias=True, max_position_embeddings=32768, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, vocab_size=32000),
    "max": dict(num_hidden_layers=50, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=14336, attention_bias=False, max_position_embeddings=32768, rope_theta=1000000.0,
                rms_norm_eps=1e-5, vocab_size=32000),
}
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TEST_CALIBRATION = {
    "temperature_per_prim": {"choice": 1.1387886347566916, "noul": 1.3939382634489992, "score": 1.5422108254079405},
    "thresholds": {"0.01": {"confidence": 0.955}, "0.05": {"confidence": 0.763}},
}


def _corpus() -> list[str]:
    assets = resources.files("basal_local.assets")
    lines = []
    for name in ("corpus_pl.txt", "corpus_en.txt"):
        lines.extend(assets.joinpath(name).read_text(encoding="utf-8").splitlines())
    for lang in ("pl", "en"):
        lines.append(SYSTEM[lang])
        lines.append(USER_FORMAT[lang])
    lines.append(PREFILL + " ".join(LETTERS))
    return lines


def train_tokenizer(vocab_size: int = 4000) -> dict:
    """A BPE tokenizer.json in the Basal layout, trained on the bundled texts. Deterministic."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    alphabet = sorted(set("".join(_corpus())) | set(LETTERS) | set("{}[]\":,.0123456789-+eE\n\t <>|_"))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    raw = json.loads(tok.to_str())
    # The Basal layout: one Metaspace word per section; letters after the prefill stay single tokens.
    raw["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
    raw["normalizer"] = None
    merges = raw["model"]["merges"]
    raw["model"]["merges"] = [m for m in merges if not _joins_quote_and_letter(m)]
    _scatter_letter_ids(raw["model"]["vocab"])
    return raw


def _scatter_letter_ids(vocab: dict[str, int]) -> None:
    """Give the letter tokens A-J scattered, unsorted ids, as real tokenizers do (A=31928, B=31936, C=31935).

    Training hands out consecutive alphabetical ids to the single characters, so a bug that derived letter ids
    from the bare letters, sorted them or shifted them by one could still agree with the model. Each letter
    swaps ids with the token at a spread-out position; BPE merges name tokens by text, so they stay valid.
    """
    n = len(vocab)
    by_id = {i: tok for tok, i in vocab.items()}
    targets = [n - 72, n - 3, n - 17, n // 4 + 11, (3 * n) // 5 + 3, 57, n // 2 - 9, n - 401, n // 12, (3 * n) // 4]
    for letter, target in zip(LETTERS, targets):
        current = vocab[letter]
        other = by_id[target]
        if other in SPECIAL_TOKENS or other in LETTERS:
            raise RuntimeError(f"test tokenizer: cannot move letter {letter} to id {target} ({other!r})")
        vocab[letter], vocab[other] = target, current
        by_id[target], by_id[current] = letter, other


def _joins_quote_and_letter(merge) -> bool:
    left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
    return left.endswith('"') and right[:1] in LETTERS


def _random_weights(shapes: dict[str, tuple[int, ...]], seed: int, device: str = "cpu"):
    import torch  # optional here: without torch the weights are drawn with numpy (write_numpy_weights)

    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
        elif name.endswith(".bias"):
            t = 0.05 * torch.randn(shape, generator=gen, device=device)
        elif name.endswith("embed_tokens.weight"):
            t = torch.randn(shape, generator=gen, device=device)
        else:
            fan_in = shape[1]
            t = torch.randn(shape, generator=gen, device=device) / math.sqrt(fan_in)
        out[name] = t.to(torch.bfloat16).cpu()
    return out


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even as torch's `.to(torch.bfloat16)`."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():  # a NaN stays a (quiet) NaN instead of rounding into the exponent
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


def write_numpy_weights(path: Path, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
    """Random bf16 weights drawn with NumPy and written as safetensors without torch (Apple Silicon installs).

    The same distributions as the torch path (other draws: a seed gives other weights than with torch).
    Written one tensor at a time, so the big presets need one tensor of memory, not the model."""
    rng = np.random.default_rng(seed)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for name, shape in shapes.items():
            draw = rng.standard_normal(shape, dtype=np.float32)
            if name.endswith("norm.weight"):
                draw = 1.0 + 0.1 * draw
            elif name.endswith(".bias"):
                draw = 0.05 * draw
            elif not name.endswith("embed_tokens.weight"):
                draw = draw / np.float32(math.sqrt(shape[1]))
            fh.write(bf16_bits(draw).tobytes())


def torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def make_test_model(directory: str | Path, preset: str = "tiny", seed: int = 0, name: str | None = None,
                    device: str = "cpu", weights: str = "auto", evidence_head: bool | None = None,
                    progress=None) -> Path:
    """weights: "torch" (the torch generator, on `device`), "numpy" (no torch needed), or "auto" (torch when
    it is installed, as before; NumPy on a torch-less install such as Apple Silicon).
    `evidence_head` (default: for the test presets tiny/small, where torch can write the file) adds a random
    evidence head. `progress(step)` is told each phase (the CLI prints them)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    out = Path(directory).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if evidence_head is None:  # the head file is a torch pickle: written only where torch is installed
        evidence_head = preset in ("tiny", "small") and torch_installed()
    arch = dict(PRESETS[preset])
    say = progress or (lambda step: None)
    say("training the tokenizer")
    tokenizer_json = train_tokenizer()
    n_tokens = len(tokenizer_json["model"]["vocab"])
    vocab = arch.pop("vocab_size") or (n_tokens + 63) // 64 * 64
    rope_theta = arch.pop("rope_theta")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "tie_word_embeddings": False, "mlp_bias": arch["attention_bias"], "vocab_size": vocab,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta}, "bos_token_id": 1,
        "eos_token_id": 4, "torch_dtype": "bfloat16", "initializer_range": 0.02, "attention_dropout": 0.0,
        **arch,
    }
    parsed = LlamaConfig.from_dict(config)
    files = {
        "config.json": config,
        "basal.json": {"name": name or f"basal-test-{preset}", "version": f"test-{preset}-seed{seed}",
                       "readout": {"kind": "letter logits", "letters": LETTERS, "prefill": PREFILL,
                                   "templates": TEMPLATES_1_5}},
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>",
                                  "model_max_length": config["max_position_embeddings"],
                                  "tokenizer_class": "PreTrainedTokenizerFast"},
        "CALIBRATION.json": TEST_CALIBRATION,
    }
    for filename, content in files.items():
        (out / filename).write_text(json.dumps(content, ensure_ascii=False, indent=1), encoding="utf-8")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    if weights == "auto":
        weights = "torch" if torch_installed() else "numpy"
    params = sum(math.prod(shape) for shape in parsed.weight_shapes().values())
    say(f"drawing {params / 1e6:,.1f} M random weights on {device} ({weights})")
    if weights == "numpy":
        if device != "cpu":
            raise ValueError("random weights on a GPU need torch; without torch use --device cpu")
        write_numpy_weights(out / "model.safetensors", parsed.weight_shapes(), seed)
    else:
        from safetensors.torch import save_file  # imports torch (see _random_weights)

        tensors = _random_weights(parsed.weight_shapes(), seed, device)
        say("writing model.safetensors")
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if evidence_head:
        write_random_head(out / HEAD_FILE, parsed.hidden_size, seed=seed)
    return out
