"""The model zoo, the standard-library corpus and the ``jpipe train`` command."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe import data, models

SMALL_CORPUS = 300_000


@functools.cache
def _gpt(framework: str) -> jpipe.Staged:
    """One tiny GPT per framework, shared by the tests (building an NNX model takes a few seconds)."""
    return models.gpt(vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=4, framework=framework)


def _tree_max_abs(tree) -> float:
    return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_pipelined_gpt_step_matches_sequential_gradient(framework):
    model = _gpt(framework)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32, size=(8, 9)).astype(np.int32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = model.init_params(jax.random.key(1), batch)
    # Make the biases and LayerNorm parameters non-trivial so their gradients are exercised fully.
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    noise = [0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    params = jax.tree.unflatten(treedef, [x + n for x, n in zip(leaves, noise, strict=True)])

    loss, grads = jax.jit(jax.value_and_grad(model.loss_value))(params, batch)
    plan = jpipe.Plan(pipe=2, data=2, microbatches=2, schedule="1f1b")
    state = jpipe.init(model, plan, optax.sgd(1.0), batch, params=params, devices=jax.devices()[:4])
    state, metrics = jpipe.train_step(state, batch)
    new = jpipe.to_sequential(state)

    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    assert jax.tree.structure(new) == jax.tree.structure(params)
    pipelined_update = jax.tree.map(lambda n, p: np.asarray(n) - np.asarray(p), new, params)
    sequential_update = jax.tree.map(lambda g: -np.asarray(g), grads)
    diff = _tree_max_abs(jax.tree.map(lambda a, b: a - b, pipelined_update, sequential_update))
    scale = _tree_max_abs(grads)
    assert scale > 0
    assert diff <= 1e-5 * scale, (diff, scale)


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_gpt_is_causal(framework):
    model = _gpt(framework)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 32
    batch = {"tokens": tokens, "targets": tokens}
    params = model.init_params(jax.random.key(0), batch)

    @jax.jit
    def logits(tokens):
        h = model.embed(params["pre"], {"tokens": tokens})
        for layer in params["layers"]:
            h = model.layer_apply(layer, h)
        return model._post.apply(params["post"], h)

    changed = tokens.at[:, 4].set((tokens[:, 4] + 1) % 32)
    a, b = logits(tokens), logits(changed)
    np.testing.assert_allclose(a[:, :4], b[:, :4], atol=1e-6)  # earlier positions cannot see position 4
    assert float(jnp.max(jnp.abs(a[:, 4:] - b[:, 4:]))) > 1e-4


def test_gpt_and_mlp_reject_bad_arguments():
    with pytest.raises(ValueError, match="framework"):
        models.gpt(16, 8, framework="torch")
    with pytest.raises(ValueError, match="divisible"):
        models.gpt(16, 8, d_model=10, num_heads=4)
    for dtype in (jnp.int32, None, "fp8"):
        with pytest.raises(ValueError, match="floating-point dtype"):
            models.gpt(16, 8, dtype=dtype)
    with pytest.raises(ValueError, match="num_layers"):
        models.mlp(3, 8, 1, num_layers=0)


def test_corpus_is_deterministic_and_splits_are_disjoint():
    data.load.cache_clear()
    a = data.load(SMALL_CORPUS)
    data.load.cache_clear()
    b = data.load(SMALL_CORPUS)
    assert a is not b
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.heldout, b.heldout)
    assert a.train_files == b.train_files and a.heldout_files == b.heldout_files
    assert len(a) == SMALL_CORPUS
    assert len(a.train) > 0 and len(a.heldout) > 0
    assert set(a.train_files).isdisjoint(a.heldout_files)
    assert a.vocab_size == 256 and a.train.dtype == np.uint8
    # A larger corpus only appends: the first files keep their split.
    bigger = data.load(2 * SMALL_CORPUS)
    assert bigger.train_files[: len(a.train_files) - 1] == a.train_files[:-1]
    assert bigger.heldout_files[: len(a.heldout_files) - 1] == a.heldout_files[:-1]
    assert set(bigger.train_files).isdisjoint(bigger.heldout_files)
    # The text is Python source.
    assert "def " in data.decode(a.train[:20_000]) and "import " in data.decode(a.heldout)


def test_batches_are_deterministic_windows_of_their_split():
    corpus = data.load(SMALL_CORPUS)
    first = list(corpus.batches(seq_len=16, batch_size=4, seed=3, split="heldout", num_batches=3))
    again = list(data.batches(seq_len=16, batch_size=4, seed=3, split="heldout", max_chars=SMALL_CORPUS,
                              num_batches=3))
    assert len(first) == 3
    for x, y in zip(first, again, strict=True):
        np.testing.assert_array_equal(x["tokens"], y["tokens"])
        np.testing.assert_array_equal(x["targets"], y["targets"])
    other = next(corpus.batches(seq_len=16, batch_size=4, seed=4, split="heldout"))
    assert not np.array_equal(other["tokens"], first[0]["tokens"])

    heldout = corpus.heldout.tobytes()
    for b in first:
        assert b["tokens"].dtype == np.int32 and b["tokens"].shape == (4, 16)
        np.testing.assert_array_equal(b["tokens"][:, 1:], b["targets"][:, :-1])
        for tokens, targets in zip(b["tokens"], b["targets"], strict=True):
            window = bytes(tokens.astype(np.uint8).tolist()) + bytes([int(targets[-1])])
            assert window in heldout
    with pytest.raises(ValueError, match="split"):
        next(corpus.batches(16, 4, split="test"))
