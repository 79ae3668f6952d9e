"""MLX behaviours that equal answers cannot show (issue 30's blind spots), on mlx[cpu].

- `forward_steps` computes each layer before it yields, so a long lane parked at a yield leaves nothing of its
  own queued on the device (MLX is lazy: without an `eval` per step every layer would run at the last step, and
  the answers would be the same).
- the q8/q4 weights cache follows the model file's content: a model.safetensors replaced by another of the same
  size, its mtime kept (`cp -p`, `rsync -t`, tar), or rewritten in place, is quantized again.
"""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'mlx[cpu]' on Linux)")

from basal_local.engine.packer import pack_prompts  # noqa: E402
from basal_local.model import load_model_dir  # noqa: E402

from .test_mlx import load_mlx  # noqa: E402
from .test_packer import random_specs  # noqa: E402


def test_each_step_of_the_long_lane_is_computed_before_it_yields(small_model):
    md = load_model_dir(small_model)
    backend = load_mlx(small_model)
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    batch = pack_prompts(random_specs(md, random.Random(5)), prefixes).batches[0]
    # a computed layer held its gate/up output ([T, 2 x intermediate] f32) at some moment; an uncomputed one
    # holds only the graph's nodes (MLX allocates a buffer when it evaluates)
    need = batch.num_tokens * 2 * md.config.intermediate_size * 4
    mx.eval()
    peaks, outputs = [], []
    start = mx.get_active_memory()
    mx.reset_peak_memory()
    for out in backend.forward_steps(batch):  # the long lane's loop (engine.py), parking at each None
        outputs.append(out)
        peaks.append(mx.get_peak_memory() - start)
        start = mx.get_active_memory()
        mx.reset_peak_memory()
    assert len(peaks) == md.config.num_hidden_layers == 4
    assert all(p >= need for p in peaks), (peaks, need)  # every step, not only the last, did its layer's work
    assert outputs[:-1] == [None] * 3 and np.array_equal(outputs[-1], backend.forward(batch))


def _replace_keeping_size_and_mtime(target, source, in_place: bool) -> None:
    old = os.stat(target)
    assert os.path.getsize(source) == old.st_size  # the same architecture: a header and tensors of one size
    if in_place:  # the same inode, its bytes overwritten
        with open(source, "rb") as src, open(target, "r+b") as dst:
            shutil.copyfileobj(src, dst)
    else:  # another file renamed over it (what a copy tool or an unpacked archive leaves)
        tmp = target.with_name(target.name + ".new")
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
    os.utime(target, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert os.stat(target).st_size == old.st_size and os.stat(target).st_mtime_ns == old.st_mtime_ns


@pytest.mark.parametrize("in_place", [False, True], ids=["renamed-over", "rewritten-in-place"])
def test_quantized_cache_follows_the_content_of_a_model_file_replaced_with_the_same_size(
        tmp_path, monkeypatch, in_place):
    from basal_local.backends.mlx.quantize import cache_dir
    from basal_local.model.testmodel import make_test_model

    monkeypatch.setenv("BASAL_LOCAL_HOME", str(tmp_path / "home"))
    first = make_test_model(tmp_path / "first", preset="tiny64", seed=3)
    second = make_test_model(tmp_path / "second", preset="tiny64", seed=4)
    md = load_model_dir(first)
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    batch = pack_prompts(random_specs(md, random.Random(3)), prefixes).batches[0]
    before = load_mlx(first, "q8").forward(batch)
    _replace_keeping_size_and_mtime(first / "model.safetensors", second / "model.safetensors", in_place)
    after = load_mlx(first, "q8").forward(batch)
    # what the new file quantizes to, computed with a cache of its own
    monkeypatch.setenv("BASAL_LOCAL_HOME", str(tmp_path / "fresh"))
    want = load_mlx(first, "q8").forward(batch)
    assert not np.array_equal(before, want)  # the two models differ, so the check below means something
    assert np.array_equal(after, want)
    monkeypatch.setenv("BASAL_LOCAL_HOME", str(tmp_path / "home"))
    assert len(list(cache_dir().glob("*-q8-g64.safetensors"))) == 2  # one per content


def test_a_damaged_or_half_written_quantized_cache_is_converted_again_and_leaves_no_file(tmp_path, monkeypatch):
    """A cached q8 file cut short failed every later start ("invalid data offsets"); a Ctrl-C while it was written
    left its temporary file (up to the whole quantized model) for good. Now a damaged file is converted again,
    an interrupted write removes its file, and files of processes that are gone are removed."""
    import subprocess

    from basal_local.backends.mlx import quantize
    from basal_local.model.testmodel import make_test_model

    monkeypatch.setenv("BASAL_LOCAL_HOME", str(tmp_path / "home"))
    model = make_test_model(tmp_path / "m", preset="tiny64", seed=3)
    md = load_model_dir(model)
    prefixes = {lang: md.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
    batch = pack_prompts(random_specs(md, random.Random(3)), prefixes).batches[0]
    want = load_mlx(model, "q8").forward(batch)
    (cached,) = quantize.cache_dir().glob("*-q8-g64.safetensors")
    whole = cached.read_bytes()
    cached.write_bytes(whole[: len(whole) // 2])  # a copy cut short
    assert np.array_equal(load_mlx(model, "q8").forward(batch), want)
    assert cached.read_bytes() == whole  # written again, whole

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = cached.with_name(f"{cached.stem}.{dead.pid}.tmp.safetensors")
    stale.write_bytes(b"half")
    os.utime(stale, (os.stat(stale).st_atime, os.stat(stale).st_mtime - 7200))  # two hours untouched
    young = cached.with_name(f"other-q8-g64.{dead.pid}.tmp.safetensors")  # a shared home: maybe being written
    young.write_bytes(b"half")
    cached.unlink()
    real = mx.save_safetensors

    def interrupted(file, arrays, metadata=None):
        real(file, arrays, metadata=metadata)
        raise KeyboardInterrupt

    monkeypatch.setattr(mx, "save_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_mlx(model, "q8")
    assert list(quantize.cache_dir().glob("*.safetensors")) == [young]  # neither its own file nor the stale one
