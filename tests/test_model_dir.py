"""Model directory load checks (docs/PROTOCOL.md §4.7): every refusal names the file and the field."""

from __future__ import annotations

import json
import shutil

import pytest

from basal_local.model import ModelLoadError, load_model_dir
from basal_local.protocol.constants import CHAT_TEMPLATE


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    target = tmp_path / "m"
    shutil.copytree(tiny_model, target)
    return target


def edit_json(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def test_generated_model_loads(tiny_model):
    md = load_model_dir(tiny_model)
    assert md.name == "basal-test-tiny" and md.calibration.present
    assert md.calibration.temperature("choice") == 1.1387886347566916 and md.calibration.temperature(None) == 1.0
    assert len(set(md.tokenizer.letter_ids)) == 10
    # the special tokens have the Basal ids
    assert md.tokenizer.encode("<s><|im_start|>system\n<|im_end|>")[:2] == [1, 3]


@pytest.mark.parametrize("file, edit, message", [
    ("basal.json", lambda d: d.pop("name"), 'basal.json: field "name"'),
    ("basal.json", lambda d: d["readout"].update(kind="hidden states"), 'basal.json: field "readout.kind"'),
    ("basal.json", lambda d: d["readout"].update(letters="ABCD"), 'basal.json: field "readout.letters"'),
    ("basal.json", lambda d: d["readout"].update(prefill='{"a": "'), 'basal.json: field "readout.prefill"'),
    ("basal.json", lambda d: d["readout"].update(templates="other"), 'basal.json: field "readout.templates"'),
    ("config.json", lambda d: d.update(model_type="qwen2"), "config.json: field 'model_type'"),
    ("config.json", lambda d: d.update(tie_word_embeddings=True), "config.json: field 'tie_word_embeddings'"),
    ("config.json", lambda d: d.update(mlp_bias=False), "config.json: field 'mlp_bias'"),
    ("config.json", lambda d: d.update(rope_scaling={"type": "linear"}), "config.json: field 'rope_scaling'"),
    ("config.json", lambda d: d.pop("rope_parameters"), "config.json: field 'rope_parameters'"),
    ("config.json", lambda d: d["rope_parameters"].update(rope_type="yarn"), "rope_parameters.rope_type"),
    ("config.json", lambda d: d.update(hidden_act="gelu"), "config.json: field 'hidden_act'"),
    ("config.json", lambda d: d.update(head_dim=15), "config.json: field 'hidden_size'"),
    ("config.json", lambda d: d.update(num_key_value_heads=3), "config.json: field 'num_key_value_heads'"),
    ("config.json", lambda d: d.update(num_hidden_layers=3), "model.safetensors: missing tensor"),
    ("config.json", lambda d: d.update(num_hidden_layers=1), "model.safetensors: unknown tensor"),
    ("config.json", lambda d: d.update(vocab_size=100), "more than config.json field 'vocab_size'"),
    ("tokenizer.json", lambda d: d.update(normalizer={"type": "NFC"}), 'tokenizer.json: field "normalizer"'),
    ("tokenizer.json", lambda d: d["pre_tokenizer"].update(split=True), 'tokenizer.json: field "pre_tokenizer"'),
    ("tokenizer_config.json", lambda d: d.update(bos_token="<bos>"), "tokenizer_config.json: bos_token '<bos>'"),
    ("CALIBRATION.json", lambda d: d["temperature_per_prim"].update(rank=1.0),
     'CALIBRATION.json: field "temperature_per_prim.rank"'),
])
def test_refusals_name_file_and_field(model_copy, file, edit, message):
    edit_json(model_copy / file, edit)
    with pytest.raises(ModelLoadError) as err:
        load_model_dir(model_copy)
    assert message in str(err.value)


def test_chat_template_must_be_byte_equal(model_copy):
    (model_copy / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n")
    with pytest.raises(ModelLoadError, match="chat_template.jinja"):
        load_model_dir(model_copy)


def test_missing_file_and_missing_calibration(model_copy, caplog):
    (model_copy / "CALIBRATION.json").unlink()
    md = load_model_dir(model_copy)
    assert not md.calibration.present and md.calibration.temperature("choice") == 1.0
    assert "no CALIBRATION.json" in caplog.text
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json: missing"):
        load_model_dir(model_copy)


def test_letters_not_single_tokens_are_refused(model_copy):
    def add_merge(d):
        d["model"]["vocab"]["\"A"] = max(d["model"]["vocab"].values()) + 1
        d["model"]["merges"].insert(0, ['"', "A"])
    edit_json(model_copy / "tokenizer.json", add_merge)
    with pytest.raises(ModelLoadError, match="option letters are not single tokens"):
        load_model_dir(model_copy)
