"""Every setting is declared once (basal_local/settings.py): the `serve` flags, their --help defaults, the
config.toml keys, the environment and the validation all come from the declarations and agree with each other."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from basal_local.backends.torch.options import PRODUCT, TorchOptions
from basal_local.cli import build_parser
from basal_local.declare import check
from basal_local.flags import flag_overrides, shown_default
from basal_local.settings import EngineSettings, Settings, all_settings, torch_keys

from .conftest import Daemon, http


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_field_is_declared_and_every_flag_maps_to_its_field():
    declared = {key for key, *_ in all_settings()}
    names = {f.name for f in dataclasses.fields(Settings) if f.name != "engine"} | \
        {f.name for f in dataclasses.fields(EngineSettings)}
    assert declared == names
    actions = {a.option_strings[0]: a for a in serve_parser()._actions if a.option_strings}
    for key, spec, default, _ in all_settings():
        if spec.flag is None:
            continue
        action = actions[spec.flag]
        assert action.dest == (spec.dest or key)
        if spec.show_default:  # the --help default is the declared one
            assert f"(default {shown_default(default)})" in action.help, (spec.flag, action.help)


def test_a_flag_and_the_same_key_in_config_toml_give_the_same_settings(tmp_path):
    """For every flagged setting: a value given as the flag equals the value given as its config.toml key."""
    values = {"host": "127.0.0.2", "port": 8123, "backend": "torch", "device": "cpu", "devices": "cpu,cpu",
              "replicas": 2, "replica_processes": True, "dtype": "f32", "gpu_memory": "0.5",
              "default_model": "mini", "max_inflight": 7, "admission_wait_ms": 50.0, "access_log": True, "api_key": "k",
              "insecure_public": True, "allowed_hosts": ["a.example"], "allowed_origins": ["https://b.example"],
              "log_bodies": True, "body_timeout_s": 2.5, "drain_s": 3.0, "metrics": True, "models": ["mini"],
              "max_batch_tokens": 512, "schedule": "fifo", "long_tokens": 0, "long_slice_ms": 20.0,
              "prefix_cache": "2GB", "coalesce_ms": 5.0, "pipeline": False, "keep_alive_s": 600.0}
    values.update({"gemm": "chunked", "cublaslt": False, "fp8_gemms": ["gate_up", "down"],  # the "torch" group
                   "attention_alt_tiling": False, "cuda_graphs": False})
    flagged = {key for key, spec, *_ in all_settings() if spec.flag}
    assert flagged == set(values)
    argv = ["serve"]
    specs = {key: spec for key, spec, *_ in all_settings()}
    for key, value in values.items():
        spec = specs[key]
        if spec.action in ("store_true", "negate", "boolean"):
            argv.append(spec.flag)
        elif isinstance(value, list):
            argv += [spec.flag, ",".join(value) if spec.comma else value[0]]
        else:
            argv += [spec.flag, str(value)]
    toml = "\n".join(f"{k} = {v!r}".replace("'", '"').replace("True", "true").replace("False", "false")
                     for k, v in values.items())
    (tmp_path / "config.toml").write_text(toml)
    empty = tmp_path / "none.toml"
    from_flags = Settings.load(flag_overrides(build_parser().parse_args(argv)), empty)
    from_file = Settings.load({}, tmp_path / "config.toml")
    assert from_flags == from_file
    assert from_file.engine.max_batch_tokens == 512 and from_file.port == 8123 and from_file.engine.pipeline is False
    assert from_file.torch_options() == TorchOptions(gemm="chunked", cublaslt=False, fp8_gemms=("gate_up", "down"),
                                                     attention_alt_tiling=False, cuda_graphs=False)


@pytest.mark.parametrize("text, key, message", [
    ("max_inflight = -3", "max_inflight", "max_inflight = -3: must be a whole number of at least 1"),
    ("max_batch_tokens = 0", "", "must be a whole number of at least 1"),
    ("body_timeout_s = -1", "", "must be a number above 0"),
    ("long_slice_ms = -5", "", "must be a number above 0"),
    ("max_inflight = 2.5", "", "must be a whole number"),
    ("metrics = 1", "", "must be true or false"),
    ("schedule = \"lifo\"", "", "must be one of hrrn, fifo"),
    ("port = 70000", "", "must be a whole number from 1 to 65535"),
    ("max_inflght = 3", "", "unknown setting 'max_inflght' (did you mean 'max_inflight'?)"),
    ("[aliases]\njev = 3", "", "[aliases] must map names"),
    ("gemm = \"fast\"", "", "gemm = 'fast': must be one of verified, chunked, cublas"),
    ("fp8_gemms = [\"gate\", \"down\"]", "", "must be a comma list of qkv, o, gate_up, down"),
    ("fp8_gemms = \"qkv,up\"", "", "fp8_gemms = ['qkv', 'up']: must be a comma list of qkv, o, gate_up, down"),
    ("cuda_graphs = \"no\"", "", "cuda_graphs = 'no': must be true or false"),
    ("cuda_graph = false", "", "unknown setting 'cuda_graph' (did you mean 'cuda_graphs'?)"),
    # TOML's spelling of the value, and what the setting takes (it said "prefix_cache = False: must be text")
    ("prefix_cache = false", "", "prefix_cache = false: must be one of SIZE, SHARE, auto, off"),
    ("prefix_cache = 0", "", "prefix_cache = 0: --prefix-cache '0': must be more than 0"),  # a TOML number too
])
def test_bad_config_values_are_sentences_naming_the_file(tmp_path, text, key, message):
    path = tmp_path / "config.toml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError) as err:
        Settings.load({}, path)
    assert str(err.value).startswith(str(path)) and message in str(err.value)


@pytest.mark.parametrize("argv, message", [
    (["--max-batch-tokens", "0"], "0 must be a whole number of at least 1"),
    (["--body-timeout", "-1"], "-1 must be a number above 0"),
    (["--long-slice-ms", "-5"], "-5 must be a number above 0"),
    (["--drain", "x"], "x must be a number of at least 0"),
    (["--port", "70000"], "70000 must be a whole number from 1 to 65535 (or 0: a free one)"),
    (["--gemm", "fast"], "invalid choice: 'fast'"),
    (["--fp8-gemms", "gate,down"], "gate,down must be a comma list of qkv, o, gate_up, down"),
])
def test_bad_flags_are_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_environment_values_are_checked_too(tmp_path, monkeypatch):
    monkeypatch.setenv("BASAL_LOCAL_PORT", "abc")
    with pytest.raises(ValueError, match="BASAL_LOCAL_PORT: port = 'abc': must be a whole number"):
        Settings.load({}, tmp_path / "none.toml")
    monkeypatch.setenv("BASAL_LOCAL_PORT", "8100")
    assert Settings.load({"port": 8200}, tmp_path / "none.toml").port == 8200  # the flag wins
    assert Settings.load({}, tmp_path / "none.toml").port == 8100


def test_check_keeps_floats_exact_and_refuses_bools_as_numbers():
    spec = next(s for k, s, *_ in all_settings() if k == "max_inflight")
    with pytest.raises(ValueError):
        check("max_inflight", spec, True)
    assert check("max_inflight", spec, "12", from_text=True) == 12


def test_the_torch_settings_are_the_backends_product_options_with_its_defaults():
    """The "torch" settings are exactly TorchOptions' product options, with TorchOptions' own defaults."""
    assert set(torch_keys()) == set(PRODUCT)
    assert Settings().torch_options() == TorchOptions()
    assert TorchOptions().product() == {"gemm": "verified", "cublaslt": True, "fp8_gemms": "qkv,o,gate_up,down",
                                        "attention_alt_tiling": True, "cuda_graphs": True}


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_serve_and_bench_show_the_torch_options_under_one_heading(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "-h"])
    text = capsys.readouterr().out
    section = text[text.index("torch backend (CUDA):"):]
    for flag in ("--gemm", "--no-cublaslt", "--fp8-gemms", "--no-alt-tiling", "--no-cuda-graphs"):
        assert flag in section
    assert "(default verified)" in section and "(default qkv,o,gate_up,down)" in section


def test_bench_flags_give_the_backend_its_options():
    from basal_local.bench import torch_options

    args = build_parser().parse_args(["bench", "--gemm", "cublas", "--no-cuda-graphs", "--fp8-gemms", "down"])
    assert torch_options(args) == TorchOptions(gemm="cublas", cuda_graphs=False, fp8_gemms=("down",))
    assert torch_options(build_parser().parse_args(["bench"])) == TorchOptions()


def test_load_engines_hands_the_torch_options_to_every_backend(tiny_model, tmp_path):
    """In process: the settings reach the loaded torch backend (and /api/stats' record of them)."""
    from basal_local.server.daemon import load_engines
    from basal_local.server.state import AppState

    (tmp_path / "config.toml").write_text('gemm = "chunked"\nfp8_gemms = "o"\n')
    settings = Settings.load({"models": [str(tiny_model)], "device": "cpu", "replicas": 2, "cuda_graphs": False},
                             tmp_path / "config.toml")
    state = AppState()
    load_engines(state, settings, [tiny_model])
    try:
        assert state.ready, state.load_error
        engine = state.engines[next(iter(state.engines))]
        wanted = TorchOptions(gemm="chunked", fp8_gemms=("o",), cuda_graphs=False)
        assert [r.backend.options for r in engine.replicas] == [wanted, wanted]
        assert state.torch_options == wanted.product()
    finally:
        for engine in state.engines.values():
            engine.stop()


def test_api_stats_shows_the_torch_options_from_config_and_flags(tiny_model, tmp_path, home):
    (tmp_path / "config.toml").write_text('gemm = "chunked"\ncublaslt = false\n')
    daemon = Daemon(["--model", str(tiny_model), "--config", str(tmp_path / "config.toml"), "--no-cuda-graphs",
                     "--fp8-gemms", "qkv,down"], env=home)
    try:
        daemon.wait_ready(timeout=120)
        status, _, stats = http("GET", daemon.url + "/api/stats")
    finally:
        daemon.stop()
    assert status == 200 and stats["backend"] == "torch"
    assert stats["torch_options"] == {"gemm": "chunked", "cublaslt": False, "fp8_gemms": "qkv,down",
                                      "attention_alt_tiling": True, "cuda_graphs": False}


def test_a_replica_worker_loads_its_backend_with_the_options_of_its_spec(tiny_model):
    """--replica-processes: the options travel in the worker's spec (replicas/worker.py) to its backend."""
    import queue

    from basal_local.replicas.worker import WorkerSpec, load_engine

    wanted = TorchOptions(gemm="cublas", cublaslt=False)
    spec = WorkerSpec(tiny_model, "torch", "cpu", "f32", EngineSettings(), replica=0, torch_options=wanted)
    engine, _, ready = load_engine(spec, queue.SimpleQueue())
    try:
        assert engine.backend.options == wanted and ready.backend == "torch"
    finally:
        engine.stop()


@pytest.mark.parametrize("text, seconds", [("10m", 600.0), ("1h30m", 5400.0), ("600", 600.0), ("forever", None)])
def test_serve_keep_alive_takes_the_durations_load_takes(tmp_path, text, seconds):
    """`serve --keep-alive 10m` (and keep_alive_s = "10m" in config.toml) as `load --keep-alive 10m` reads it; it
    was refused as "not a number"."""
    from_flag = Settings.load(flag_overrides(build_parser().parse_args(["serve", "--keep-alive", text])),
                              tmp_path / "none.toml")
    (tmp_path / "config.toml").write_text(f'keep_alive_s = "{text}"\n')
    assert from_flag.keep_alive_s == Settings.load({}, tmp_path / "config.toml").keep_alive_s == seconds
