"""`--gpu-memory` (issue 9, backends/memory.py): the accepted forms, the refusals a user meets before anything
loads, the setting's sources, and the CPU backends ignoring it. Enforcement on a GPU: tests/test_cuda.py."""

from __future__ import annotations

import logging

import pytest

from basal_local.backends import memory

from .test_cli import cli


@pytest.mark.parametrize(("text", "kind", "number"), [
    ("24", "bytes", 24e9), ("24GB", "bytes", 24e9), ("24 gb", "bytes", 24e9), ("24G", "bytes", 24e9),
    ("22.5GiB", "bytes", 22.5 * 2 ** 30), ("16000MB", "bytes", 16e9), ("512MiB", "bytes", 512 * 2 ** 20),
    ("0.8", "share", 0.8), (".5", "share", 0.5), ("1", "share", 1.0), ("80%", "share", 0.8), (0.25, "share", 0.25),
    (12, "bytes", 12e9),
])
def test_memory_limit_forms(text, kind, number):
    got = memory.parse_limit(text)
    assert got[0] == kind and got[1] == pytest.approx(number)


@pytest.mark.parametrize("text", ["abc", "", "0", "0GB", "-1", "24XB", "150%", "GB", "1.2.3"])
def test_memory_limit_refusals_name_the_accepted_forms(text):
    with pytest.raises(ValueError, match="--gpu-memory") as err:
        memory.parse_limit(text)
    assert "24GB" in str(err.value) or "100%" in str(err.value)


def test_memory_limit_in_bytes_and_weights_check():
    total = 80 * 10 ** 9
    assert memory.limit_bytes("0.5", total, "cuda:0") == 40 * 10 ** 9
    assert memory.limit_bytes("24GB", total, "cuda:0") == 24 * 10 ** 9
    with pytest.raises(ValueError, match=r"more than cuda:0 has \(80.0 GB\)"):
        memory.limit_bytes("100GB", total, "cuda:0")
    memory.check_weights_fit(9 * 10 ** 9, 10 * 10 ** 9, "10GB", "cuda:0", "f16")  # fits: no error
    with pytest.raises(ValueError, match=r"need 22.3 GB in f16 on cuda:0, more than --gpu-memory 16GB allows"):
        memory.check_weights_fit(22_335_496_192, 16 * 10 ** 9, "16GB", "cuda:0", "f16")


def test_gpu_memory_user_errors_before_anything_loads(tmp_path):
    bad = cli("serve", "--demo", "--gpu-memory", "lots", "--port", "1")
    assert bad.returncode != 0 and "--gpu-memory 'lots'" in bad.stderr and "Traceback" not in bad.stderr
    cpu = cli("serve", "--demo", "--device", "cpu", "--gpu-memory", "8GB")
    assert cpu.returncode != 0 and "--device cpu" in cpu.stderr and "drop --gpu-memory" in cpu.stderr
    bench = cli("bench", "--device", "cpu", "--gpu-memory", "0.5")
    assert bench.returncode != 0 and "--gpu-memory 0.5 with --device cpu" in bench.stderr
    # from config.toml too: the file is named when the value is wrong there
    config = tmp_path / "config.toml"
    config.write_text('gpu_memory = "half"\n')
    bad_cfg = cli("serve", "--demo", "--config", str(config))
    assert bad_cfg.returncode != 0 and "--gpu-memory 'half'" in bad_cfg.stderr and str(config) in bad_cfg.stderr


def test_gpu_memory_setting_sources(tmp_path, monkeypatch):
    from basal_local.server.settings import Settings

    config = tmp_path / "config.toml"
    config.write_text("gpu_memory = 0.8\n")
    assert Settings.load({}, config).gpu_memory == 0.8
    monkeypatch.setenv("BASAL_LOCAL_GPU_MEMORY", "20GB")
    assert Settings.load({}, config).gpu_memory == "20GB"
    assert Settings.load({"gpu_memory": "30GB"}, config).gpu_memory == "30GB"


def test_cpu_backend_ignores_gpu_memory_with_a_warning(tiny_model, caplog):
    from basal_local.backends.select import make_backend

    backend = make_backend("torch", "cpu", memory_limit="1GB")
    with caplog.at_level(logging.WARNING):
        backend.load(tiny_model, "f32")
    assert "--gpu-memory 1GB ignored" in caplog.text
    assert "device_limit_bytes" not in backend.memory()


def test_out_of_memory_under_a_limit_reads_as_a_sentence_with_a_value_to_try():
    """The warm-up running out under --gpu-memory (on the H200: 4.5B, 13GB) is reported in one sentence with
    what the limit allowed and a value to try, not torch's paragraph."""
    torch_text = ("CUDA out of memory. Tried to allocate 172.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
                  "127.03 GiB is free. Including non-PyTorch memory, this process has 12.76 GiB memory in use.")
    assert memory.first_sentence(RuntimeError(torch_text)) == "CUDA out of memory. Tried to allocate 172.00 MiB"
    hint = memory.out_of_memory_hint("13GB", 13 * 10 ** 9, weights=9_514_520_576)
    assert "--gpu-memory 13GB allows 13.0 GB" in hint and "e.g. to 14GB" in hint
    assert memory.out_of_memory_hint(None, None) == ""
