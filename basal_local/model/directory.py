"""Open a model directory and refuse anything with a different prompt contract (docs/PROTOCOL.md §4.7)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
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
from .formats import FormatError, WeightFormat, calibration_file, detect_format, read_config
from .formats import check_weights as check_format_weights
from .tokenizer import BasalTokenizer, TokenizerError
from .weightfile import ModelLoadError

log = logging.getLogger(__name__)
REQUIRED_FILES = ("config.json", "basal.json", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json")
CALIBRATION_KEYS = {"choice", "noul", "score", "multi", "act"}
# beyond these a temperature makes log(p) / T overflow or flattens every answer: a damaged file, not a calibration
TEMPERATURE_RANGE = (1e-3, 1e3)
# real files are far smaller (tokenizer.json ~20 MB); a bigger one is refused before it is read whole
MAX_JSON_BYTES = {"tokenizer.json": 256 << 20}
MAX_SMALL_JSON_BYTES = 16 << 20


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


@contextmanager
def reading(name: str) -> Iterator[None]:
    """Whatever a damaged file makes its reader raise becomes one sentence that names the file."""
    try:
        yield
    except ModelLoadError:
        raise
    except (ConfigError, TokenizerError, EvidenceHeadError) as exc:
        message = str(exc)
        named = any(file in message for file in (*REQUIRED_FILES, "CALIBRATION.json", HEAD_FILE))
        raise ModelLoadError(message if named else f"{name}: {message}") from None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # a Rust panic in tokenizers is a BaseException
        raise ModelLoadError(f"{name}: damaged or not in the expected format ({type(exc).__name__})") from None


def _read_json(path: Path) -> Any:
    limit = MAX_JSON_BYTES.get(path.name, MAX_SMALL_JSON_BYTES)
    try:
        if path.stat().st_size > limit:
            raise ModelLoadError(f"{path.name}: {path.stat().st_size} bytes, more than the {limit} allowed")
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON or bad UTF-8
        raise ModelLoadError(f"{path.name}: cannot be read as JSON ({type(exc).__name__}: "
                             f"{str(exc)[:120]})") from None


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
        low, high = TEMPERATURE_RANGE
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not low <= value <= high):
            raise ModelLoadError(f'{calibration_path.name}: field "temperature_per_prim.{key}" must be a number from '
                                 f"{low:g} to {high:g} (got {value!r})")
    raw_thresholds = raw.get("thresholds") or {}
    if not isinstance(raw_thresholds, dict):
        raise ModelLoadError(f'{calibration_path.name}: field "thresholds" must be an object')
    thresholds = {}
    for key, value in raw_thresholds.items():
        if isinstance(value, dict) and isinstance(value.get("confidence"), (int, float)):
            confidence = value["confidence"]
            if isinstance(confidence, bool) or not (isinstance(confidence, (int, float))
                                                    and math.isfinite(confidence) and 0 <= confidence <= 1):
                raise ModelLoadError(f'{calibration_path.name}: field "thresholds.{key}.confidence" must be a number '
                                     "from 0 to 1")
            thresholds[key] = float(confidence)
    return Calibration({k: float(v) for k, v in temps.items()}, thresholds, True, calibration_path.name, inherited)


def load_model_dir(path: str | Path, check_weights: bool = True) -> ModelDir:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a model directory")
    for name in REQUIRED_FILES:
        if not (path / name).exists() and not (name == "config.json" and any(path.glob("*.gguf"))):
            raise ModelLoadError(f"{name}: missing from {path}")  # a GGUF file carries the config itself
    with reading("basal.json"):
        name, version = _check_basal_json(_read_json(path / "basal.json"))
    with reading("chat_template.jinja"):
        same = (path / "chat_template.jinja").read_bytes() == CHAT_TEMPLATE.encode("utf-8")
    if not same:
        raise ModelLoadError("chat_template.jinja: differs from the Basal chat template (byte comparison)")
    with reading("config.json"):
        if (path / "config.json").exists():
            raw_config = _read_json(path / "config.json")
        else:
            try:
                raw_config = read_config(path)  # the GGUF file's metadata
            except FormatError as exc:
                raise ModelLoadError(str(exc)) from None
        config = LlamaConfig.from_dict(raw_config)
    with reading("tokenizer_config.json"):
        tok_config = _read_json(path / "tokenizer_config.json")
        bos = tok_config.get("bos_token") if isinstance(tok_config, dict) else None
        if isinstance(bos, dict):  # older files store AddedToken objects
            bos = bos.get("content")
    if not isinstance(bos, str):
        raise ModelLoadError('tokenizer_config.json: field "bos_token" must be a string')
    with reading("tokenizer.json"):
        if (path / "tokenizer.json").stat().st_size > MAX_JSON_BYTES["tokenizer.json"]:
            raise ModelLoadError(f"tokenizer.json: larger than the {MAX_JSON_BYTES['tokenizer.json']} bytes allowed")
        tokenizer = BasalTokenizer(path / "tokenizer.json", bos)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(f"tokenizer.json: {tokenizer.vocab_size} tokens, more than config.json field "
                             f"'vocab_size' ({config.vocab_size})")
    try:  # the port formats (model/formats.py) name the file and tensor themselves
        fmt = detect_format(path, raw_config)
        if check_weights:
            with reading(fmt.weights_file.name):  # anything else a damaged file raises: one sentence too
                try:
                    check_format_weights(fmt, config)
                except FormatError as exc:
                    raise ModelLoadError(str(exc)) from None
    except FormatError as exc:
        raise ModelLoadError(str(exc)) from None
    head = None
    if (path / HEAD_FILE).exists():
        with reading(HEAD_FILE):
            head = EvidenceHead.load(path / HEAD_FILE, config.hidden_size)
    with reading("CALIBRATION.json"):
        calibration = load_calibration(path, fmt)
    return ModelDir(path, name, version, config, tokenizer, calibration, fmt.weights_file, head, fmt)
