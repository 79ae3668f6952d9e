"""Evidence (docs/PROTOCOL.md §6.8): the safe head loader, the span selection, final hidden states, the 422."""

from __future__ import annotations

import pickle
import zipfile

import numpy as np
import pytest
import torch

from basal_local.model.evidence_head import EvidenceHead, EvidenceHeadError, read_state_dict
from basal_local.protocol.evidence import select_spans, state_chars, state_tokens


def test_loader_matches_torch_weights_only(tiny_model):
    ours = read_state_dict(tiny_model / "evidence_head.pt")
    ref = torch.load(tiny_model / "evidence_head.pt", weights_only=True)
    assert list(ours) == list(ref) == ["ws.weight", "us.weight", "we.weight", "ue.weight", "bs.weight", "be.weight"]
    for name, tensor in ref.items():
        assert ours[name].dtype == np.float32 and np.array_equal(ours[name], tensor.numpy())


def test_loader_reads_strided_and_offset_tensors(tmp_path):
    base = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    state = {"t": base.t(), "view": base[2:, 3:5], "half": torch.ones(3, dtype=torch.float16) * 1.5}
    torch.save(state, tmp_path / "x.pt")
    got = read_state_dict(tmp_path / "x.pt")
    for name, tensor in state.items():
        assert np.array_equal(got[name], tensor.numpy())


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/basal-local-pwned",))


def test_loader_refuses_code(tmp_path):
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("evil/data.pkl", pickle.dumps({"ws.weight": _Exploit()}, protocol=2))
    with pytest.raises(EvidenceHeadError, match="refusing to load"):
        read_state_dict(path)
    with pytest.raises(EvidenceHeadError, match="cannot be read"):
        p = tmp_path / "plain.pt"
        p.write_bytes(b"not a zip")
        read_state_dict(p)


def test_head_scores_by_hand():
    d, k = 4, 2
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal((k, d)).astype(np.float32) for n in ("ws.weight", "us.weight", "we.weight",
                                                                          "ue.weight")}
    tensors |= {n: rng.standard_normal((1, d)).astype(np.float32) for n in ("bs.weight", "be.weight")}
    head = EvidenceHead(tensors, d)
    hidden = rng.standard_normal((3, d)).astype(np.float32)
    query = rng.standard_normal(d).astype(np.float32)
    start, end = head.scores(hidden, query)
    ln = torch.nn.functional.layer_norm
    h = ln(torch.from_numpy(hidden), (d,), eps=1e-5).double()
    q = ln(torch.from_numpy(query)[None], (d,), eps=1e-5).double()
    t = {n: torch.from_numpy(v).double() for n, v in tensors.items()}
    s = (h @ t["ws.weight"].T) @ (q @ t["us.weight"].T).T / np.sqrt(k) + h @ t["bs.weight"].T
    assert np.allclose(start, torch.log_softmax(s[:, 0], 0).numpy(), atol=1e-5)
    e = (h @ t["we.weight"].T) @ (q @ t["ue.weight"].T).T / np.sqrt(k) + h @ t["be.weight"].T
    assert np.allclose(end, torch.log_softmax(e[:, 0], 0).numpy(), atol=1e-5)
    with pytest.raises(EvidenceHeadError, match="shape"):
        EvidenceHead(tensors, d + 1)


def test_state_location():
    prompt = "sys\nStan:\nab cd\n\nPytanie: ab"
    s0, s1 = state_chars(prompt, "ab cd")
    assert prompt[s0:s1] == "ab cd" and s0 == 10
    offsets = [(0, 3), (3, 10), (10, 12), (12, 15), (15, 17)]
    assert state_tokens(offsets, s0, s1) == (2, 4)
    assert state_tokens([(0, 3), (9, 11)], s0, s1) is None


def test_span_selection_worked_example():
    """Three tokens "ab", " cd", " ef" (chars 0-2, 2-5, 5-8); scores chosen so the order is clear."""
    start = np.log(np.array([0.6, 0.3, 0.1], dtype=np.float32))
    end = np.log(np.array([0.1, 0.2, 0.7], dtype=np.float32))
    text = "ab cd ef"
    spans = select_spans(start, end, [0, 2, 5], [2, 5, 8], text)
    # pairs by score: (0,2) .42, (1,2) .21, (0,1) .12, (2,2) .07, (0,0) .06, (1,1) .06 ...
    # kept greedily: (0,2) [0,8); everything else overlaps it
    assert [(s["text"], s["start"], s["end"]) for s in spans] == [("ab cd ef", 0, 8)]
    assert abs(spans[0]["probability"] - 0.42) < 1e-6
    # the facts limit drops spans starting at/after it and clips the rest
    assert select_spans(start, end, [0, 2, 5], [2, 5, 8], text, limit=4)[0] == {
        "text": "ab c", "start": 0, "end": 4, "probability": spans[0]["probability"]}


def test_span_selection_non_overlapping_and_ties():
    start = np.log(np.array([0.5, 0.5, 1e-6, 1e-6], dtype=np.float32))
    end = np.log(np.array([0.5, 0.5, 1e-6, 1e-6], dtype=np.float32))
    spans = select_spans(start, end, [0, 1, 2, 3], [1, 2, 3, 4], "abcd")
    # (0,0), (0,1), (1,1) tie at .25: (0,0) first (lower flat index), then (1,1) (no overlap), (0,1) overlaps
    assert [(s["start"], s["end"]) for s in spans][:2] == [(0, 1), (1, 2)]
    assert len(spans) == 3


def test_final_hidden_matches_transformers(tiny_model):
    from .conftest import load_backend
    from .hf_reference import HFModel

    _, backend, _ = load_backend(tiny_model)
    ids = np.array([1, 3, 40, 41, 17, 200, 5, 9, 300], dtype=np.int64)
    ours = backend.final_hidden(ids)
    ref = HFModel(tiny_model).hidden(ids.tolist())  # transformers' `model.model` forward, f32 (shared server)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.abs(ours - ref).max() < 1e-4


def test_no_head_is_a_clear_422(tmp_path):
    from litestar.testing import TestClient

    from basal_local.model.testmodel import make_test_model
    from basal_local.server.app import AppState, create_app
    from basal_local.server.daemon import load_engines
    from basal_local.server.settings import Settings

    model = make_test_model(tmp_path / "nohead", preset="tiny", seed=3, evidence_head=False)
    assert not (model / "evidence_head.pt").exists()
    state = AppState()
    load_engines(state, Settings.load({"device": "cpu"}, config_file=tmp_path / "none.toml"), [model])
    body = {"model": "basal-test-tiny", "state": "s",
            "questions": {"q": {"type": "noul", "instructions": "i", "evidence": True}}}
    try:
        with TestClient(create_app(state)) as client:
            for route in ("systemone", "basal"):
                out = client.post(f"/v1/{route}", json=body)
                assert out.status_code == 422 and out.json() == {"error": "unsupported", "detail": [{
                    "type": "unsupported_feature", "loc": ["body", "questions", "q"],
                    "msg": "evidence is not available for this model (no evidence_head.pt)"}]}
    finally:
        for engine in state.engines.values():
            engine.stop()
