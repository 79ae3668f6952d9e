"""Open a model directory and refuse anything with a different prompt contract (PROTOCOL.md §4.7)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..protocol.constants import (
    CHAT_TEMPLATE,
    LETTERS,
    PREFILL,
    READOUT_KIND,
    SYSTEM,
    TEMPLATES_1_5,
    USER_FORMAT,
)
from .config import ConfigError, LlamaConfig
from .evidence_head import HEAD_FILE, EvidenceHead, EvidenceHeadError
from .formats import FormatError, WeightFormat, calibration_file, detect_format
from .formats import check_weights as check_format_weights
from .tokenizer import BasalTokenizer, TokenizerError

log = logging.getLogger(__name__)
REQUIRED_FILES = ("config.json", "basal.json", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json")
CALIBRATION_KEYS = {"choice", "noul", "score", "multi", "act"}


class ModelLoadError(ValueError):
    """A model directory that basal-local will not load; the message names the file and the field."""


@dataclass
class Calibration:
    temperatures: dict[str, float] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)
    present: bool = False
    file: str | None = None      # the file read (CALIBRATION.json or a port's CALIBRATION.<engine>.json)
    inherited: bool = False      # a port without its own file: thresholds inherited from bf16, not validated

    def temperature(self, key: str | None) -> float:
        if key is None:
            return 1.0
        return self.temperatures.get(key, 1.0)


@dataclass
class ModelDir:
    path: Path
    name: str
    version: str | None
    config: LlamaConfig
    tokenizer: BasalTokenizer
    calibration: Calibration
    weights_path: Path
    evidence_head: EvidenceHead | None = None
    format: WeightFormat | None = None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path.name}: cannot be read as JSON ({exc})") from None


def _check_basal_json(raw: Any) -> tuple[str, str | None]:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
        raise ModelLoadError('basal.json: field "name" must be a non-empty string (the served model name)')
    readout = raw.get("readout")
    if not isinstance(readout, dict):
        raise ModelLoadError('basal.json: field "readout" must be an object')
    if readout.get("kind") != READOUT_KIND:
        raise ModelLoadError(f'basal.json: field "readout.kind" must be "{READOUT_KIND}" (got {readout.get("kind")!r})')
    if readout.get("letters") != LETTERS:
        raise ModelLoadError(f'basal.json: field "readout.letters" must be "{LETTERS}" (got {readout.get("letters")!r})')
    if readout.get("prefill") != PREFILL:
        raise ModelLoadError(f'basal.json: field "readout.prefill" must be {PREFILL!r} (got {readout.get("prefill")!r})')
    templates = readout.get("templates")
    expected = {lang: {"system": SYSTEM[lang], "user": USER_FORMAT[lang]} for lang in ("pl", "en")}
    if templates != TEMPLATES_1_5 and templates != expected:
        raise ModelLoadError('basal.json: field "readout.templates" is not the Basal prompt contract '
                             f'(expected "{TEMPLATES_1_5}" or the exact pl/en templates)')
    version = raw.get("version")
    return raw["name"], version if isinstance(version, str) else None


def load_calibration(path: Path, fmt: WeightFormat | None = None) -> Calibration:
    calibration_path, inherited = calibration_file(path, fmt)
    if calibration_path is None:
        log.warning("%s: no CALIBRATION.json, probabilities are not calibrated (T = 1)", path)
        return Calibration()
    raw = _read_json(calibration_path)
    temps = raw.get("temperature_per_prim", {}) if isinstance(raw, dict) else None
    if not isinstance(temps, dict):
        raise ModelLoadError(f'{calibration_path.name}: field "temperature_per_prim" must be an object')
    for key, value in temps.items():
        if key not in CALIBRATION_KEYS:
            raise ModelLoadError(f'{calibration_path.name}: field "temperature_per_prim.{key}" is not a question type '
                                 f"(allowed: {', '.join(sorted(CALIBRATION_KEYS))})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ModelLoadError(f'{calibration_path.name}: field "temperature_per_prim.{key}" must be a positive number')
    thresholds = {}
    for key, value in (raw.get("thresholds") or {}).items():
        if isinstance(value, dict) and isinstance(value.get("confidence"), (int, float)):
            thresholds[key] = float(value["confidence"])
    return Calibration({k: float(v) for k, v in temps.items()}, thresholds, True, calibration_path.name, inherited)


def check_weight_names(config: LlamaConfig, names_shapes: dict[str, tuple[int, ...]]) -> None:
    expected = config.weight_shapes()
    unknown = sorted(set(names_shapes) - set(expected))
    missing = sorted(set(expected) - set(names_shapes))
    if unknown:
        raise ModelLoadError(f"model.safetensors: unknown tensor {unknown[0]!r} ({len(unknown)} unknown in all)")
    if missing:
        raise ModelLoadError(f"model.safetensors: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    for name, shape in expected.items():
        if tuple(names_shapes[name]) != shape:
            raise ModelLoadError(f"model.safetensors: tensor {name!r} has shape {tuple(names_shapes[name])}, "
                                 f"config.json implies {shape}")


def read_safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes from the safetensors header; a truncated or corrupt file is refused, named.

    The header is JSON data, never code; the data itself is not read, but the file must be exactly as
    long as the header's last tensor ends (a cut download is caught here, not in the middle of serving).
    """
    file_size = path.stat().st_size
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        if file_size < 8 or size <= 0 or 8 + size > file_size:
            raise ModelLoadError(f"{path.name}: not a safetensors file or truncated ({file_size} bytes, the header "
                                 f"says {size} bytes of header)")
        try:
            header = json.loads(fh.read(size))
            shapes = {k: tuple(int(n) for n in v["shape"]) for k, v in header.items() if k != "__metadata__"}
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ModelLoadError(f"{path.name}: the safetensors header is corrupt ({type(exc).__name__})") from None
    if 8 + size + end != file_size:
        raise ModelLoadError(f"{path.name}: truncated or corrupt: the header describes {8 + size + end} bytes, "
                             f"the file has {file_size}")
    return shapes


def load_model_dir(path: str | Path, check_weights: bool = True) -> ModelDir:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a model directory")
    for name in REQUIRED_FILES:
        if not (path / name).exists():
            raise ModelLoadError(f"{name}: missing from {path}")
    name, version = _check_basal_json(_read_json(path / "basal.json"))
    if (path / "chat_template.jinja").read_text(encoding="utf-8") != CHAT_TEMPLATE:
        raise ModelLoadError("chat_template.jinja: differs from the Basal chat template (byte comparison)")
    try:
        config = LlamaConfig.from_dict(_read_json(path / "config.json"))
    except ConfigError as exc:
        raise ModelLoadError(str(exc)) from None
    tok_config = _read_json(path / "tokenizer_config.json")
    bos = tok_config.get("bos_token") if isinstance(tok_config, dict) else None
    if isinstance(bos, dict):  # older files store AddedToken objects
        bos = bos.get("content")
    if not isinstance(bos, str):
        raise ModelLoadError('tokenizer_config.json: field "bos_token" must be a string')
    try:
        tokenizer = BasalTokenizer(path / "tokenizer.json", bos)
    except TokenizerError as exc:
        raise ModelLoadError(str(exc)) from None
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(f"tokenizer.json: {tokenizer.vocab_size} tokens, more than config.json field "
                             f"'vocab_size' ({config.vocab_size})")
    try:
        fmt = detect_format(path, _read_json(path / "config.json"))
        if check_weights:
            check_format_weights(fmt, config)
    except FormatError as exc:
        raise ModelLoadError(str(exc)) from None
    head = None
    if (path / HEAD_FILE).exists():
        try:
            head = EvidenceHead.load(path / HEAD_FILE, config.hidden_size)
        except EvidenceHeadError as exc:
            raise ModelLoadError(str(exc)) from None
    return ModelDir(path, name, version, config, tokenizer, load_calibration(path, fmt), fmt.weights_file,
                    head, fmt)
