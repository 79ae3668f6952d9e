"""The host side both backends share (`backends/host.py`): the strict load and its fusion plan, the visibility rule's
block chains, ancestor matrix and subtree groups, against references written here from the rule itself."""

from __future__ import annotations

import numpy as np
import pytest

from basal_local.backends import host
from basal_local.backends.base import PackedBatch

from .dense_reference import ancestors, dense_mask


def _random_tree(rng: np.random.Generator, n_prefixes: int) -> PackedBatch:
    """Rows of random depth and fan-out, blocks depth-first (parents first), each row continuing a prefix or none."""
    parents: list[int] = []
    prefix_of: list[int] = []

    def grow(parent: int, prefix: int, depth: int) -> None:
        me = len(parents)
        parents.append(parent)
        prefix_of.append(prefix)
        if depth < 3:
            for _ in range(int(rng.integers(0, 3))):
                grow(me, prefix, depth + 1)

    for _ in range(int(rng.integers(1, 4))):
        grow(-1, int(rng.integers(-1, n_prefixes)) if n_prefixes else -1, 0)
    lengths = rng.integers(1, 6, size=len(parents))
    token_block = np.repeat(np.arange(len(parents), dtype=np.int32), lengths)
    n = int(lengths.sum())
    return PackedBatch(token_ids=np.zeros(n, np.int64), positions=np.zeros(n, np.int64), token_block=token_block,
                       block_parent=np.array(parents, np.int32), block_prefix=np.array(prefix_of, np.int32),
                       readout_index=np.array([n - 1]), letter_ids=np.array([0]))


def test_block_chains_and_ancestor_matrix_follow_the_parents():
    rng = np.random.default_rng(0)
    for _ in range(50):
        batch = _random_tree(rng, 2)
        parents = batch.block_parent
        assert np.array_equal(host.ancestor_matrix(parents), ancestors(parents))
        for b, chain in enumerate(host.block_chains(parents)):
            walk = [b]
            while parents[walk[-1]] >= 0:
                walk.append(int(parents[walk[-1]]))
            assert chain == walk[::-1]  # root first, the block itself last
        start, end = host.block_bounds(batch.token_block, len(parents))
        assert all((batch.token_block[s:e] == b).all() for b, (s, e) in enumerate(zip(start, end)))


def test_subtree_groups_hold_each_query_once_with_every_key_it_sees():
    """Each token lands in exactly one group slot, and its group lists every key the dense rule lets it see."""
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(200):
        lengths = [int(n) for n in rng.integers(1, 30, size=2)]
        batch = _random_tree(rng, 2)
        groups = host.subtree_groups(batch, lengths)
        if groups is None:
            continue
        q_index, q_valid, k_index, k_valid, token_slot = groups
        flat_q, flat_valid = q_index.reshape(-1), q_valid.reshape(-1)
        assert np.array_equal(flat_q[token_slot], np.arange(batch.num_tokens)) and flat_valid[token_slot].all()
        assert flat_valid.sum() == batch.num_tokens
        visible = dense_mask(batch, lengths).numpy()
        for g in range(q_index.shape[0]):
            keys = set(k_index[g][k_valid[g]].tolist())
            for t in q_index[g][q_valid[g]]:
                assert set(np.nonzero(visible[t])[0].tolist()) <= keys
        checked += 1
    assert checked >= 20


def test_checkpoint_takes_every_tensor_strictly_and_fuses_in_order(tiny_model):
    from basal_local.model import load_model_dir

    cfg = load_model_dir(tiny_model).config
    shapes = cfg.weight_shapes()
    tensors = {name: np.full(shape, i, dtype=np.float32) for i, (name, shape) in enumerate(shapes.items())}
    cat = lambda parts: np.concatenate(parts, axis=0)  # noqa: E731
    checkpoint = host.Checkpoint(dict(tensors), convert=lambda t: 2 * t)
    embed, norm, head = checkpoint.top()
    assert np.array_equal(embed, 2 * tensors["model.embed_tokens.weight"]) and norm.shape == shapes["model.norm.weight"]
    layers = [host.Layer(checkpoint.layer(cfg, i, cat)) for i in range(cfg.num_hidden_layers)]
    checkpoint.done()
    p = f"model.layers.{cfg.num_hidden_layers - 1}."
    last = layers[-1]
    assert np.array_equal(last.qkv_weight, 2 * cat([tensors[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
    assert np.array_equal(last.gate_up_weight, 2 * cat([tensors[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")]))
    assert np.array_equal(last.down_proj_weight, 2 * tensors[p + "mlp.down_proj.weight"])
    assert (last.qkv_bias is None) == (not cfg.attention_bias) and (last.gate_up_bias is None) == (not cfg.mlp_bias)
    per_layer = 2 + 4 + 2 * bool(cfg.attention_bias) + 2 * bool(cfg.mlp_bias)  # norms, fused weights, biases
    assert all(len(layer.tensors()) == per_layer for layer in layers)

    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    checkpoint = host.Checkpoint(missing)
    checkpoint.top()
    checkpoint.layer(cfg, 0, cat)
    with pytest.raises(ValueError, match=r"^model\.safetensors: missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'$"):
        checkpoint.layer(cfg, 1, cat)
    checkpoint = host.Checkpoint({**tensors, "model.extra.weight": np.zeros(3)}, file="model.gguf")
    checkpoint.top()
    for i in range(cfg.num_hidden_layers):
        checkpoint.layer(cfg, i, cat)
    with pytest.raises(ValueError, match=r"^model\.gguf: unknown tensor 'model\.extra\.weight'$"):
        checkpoint.done()


def test_one_prompt_batches():
    batch = PackedBatch.single([5, 6, 7])
    assert batch.positions.tolist() == [0, 1, 2] and batch.readout_index.tolist() == [2] and batch.fills == []
    assert PackedBatch.single([5, 6, 7], readout="all").readout_index.tolist() == [0, 1, 2]
    kept = PackedBatch.prefix("en", [5, 6, 7], offset=40)
    (fill,) = kept.fills
    assert (fill.name, fill.offset, fill.parent, fill.length, fill.tokens.tolist()) == ("en", 40, None, 3, [0, 1, 2])
    assert kept.readout_index.tolist() == [2] and kept.block_prefix.tolist() == [-1]
