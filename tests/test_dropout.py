"""Stochastic layers (dropout) inside pre, layer and post.

Every sample's masks depend only on the step's key, the model part and the sample's
index in the global batch, so a pipelined step equals ``jax.grad`` of the plain model
given the same key (``jpipe.step_rng``) on every mesh, schedule and partition, and
evaluation (``model.loss_value`` without a key) runs with dropout off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jpipe
from jpipe import models
from jpipe.checkpoint import Checkpointer


class Embed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(3, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, mb):
        return self.drop(self.lin(mb["x"]))


class Block(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.lin = nnx.Linear(16, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, h):
        return h + self.drop(jnp.tanh(self.lin(h)))


class Head(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.lin = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, h):
        return self.lin(self.drop(h))


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h, deterministic: bool = True):
        return h + nn.Dropout(0.5)(jnp.tanh(nn.Dense(16)(h)), deterministic=deterministic)


def _loss(out, mb):
    return jnp.mean((out[:, 0] - mb["y"]) ** 2)


def nnx_model(num_layers: int = 4) -> jpipe.Staged:
    return jpipe.Staged(pre=Embed, layer=Block, post=Head, num_layers=num_layers, loss=_loss)


def linen_model(num_layers: int = 4) -> jpipe.Staged:
    return jpipe.Staged(pre=Embed, layer=LinenBlock(), post=Head, num_layers=num_layers, loss=_loss)


def _batch(size: int = 16, seed: int = 0) -> dict:
    r = np.random.default_rng(seed)
    return {"x": r.normal(size=(size, 3)).astype(np.float32), "y": r.normal(size=size).astype(np.float32)}


def _init(model, plan, optimizer, batch, **kw):
    return jpipe.init(model, plan, optimizer, batch, devices=jax.devices()[:plan.pipe * plan.data], **kw)


def _reference(model: jpipe.Staged, state: jpipe.TrainState, batch: dict):
    return jax.value_and_grad(model.loss_value)(jpipe.to_sequential(state), batch, rng=jpipe.step_rng(state))


def _close(a, b, rtol=2e-5, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


PLANS = [
    jpipe.Plan(2, 1, 4, schedule="1f1b"),
    jpipe.Plan(4, 2, 4, schedule="gpipe", remat=True),
    jpipe.Plan(2, 4, 2, schedule="zb-h1", partition=(3, 1)),
    jpipe.Plan(2, 2, 4, schedule="interleaved-1f1b", virtual_stages=2, fuse_ticks=True),
    jpipe.Plan(1, 8, 2, shard="parameters"),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.pipe}x{p.data}-M{p.microbatches}-{p.schedule}")
def test_pipelined_dropout_gradients_equal_the_plain_model_with_the_same_keys(plan):
    model, batch = nnx_model(), _batch()
    state = _init(model, plan, optax.sgd(0.1), batch, rng=jax.random.key(7))
    loss, grads = jpipe.value_and_grad(state, batch)
    ref_loss, ref_grads = _reference(model, state, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-5)
    _close(grads, ref_grads)
    # dropout was on: the deterministic (evaluation) loss is another number
    assert abs(float(model.loss_value(jpipe.to_sequential(state), batch)) - float(loss)) > 1e-3


def test_masks_do_not_depend_on_the_mesh_or_schedule_and_change_every_step():
    model, batch = nnx_model(), _batch()
    losses = []
    for plan in (jpipe.Plan(2, 1, 4), jpipe.Plan(4, 2, 2, schedule="gpipe"), jpipe.Plan(1, 8, 1)):
        state = _init(model, plan, optax.sgd(0.05), batch, rng=jax.random.key(3))
        run = []
        for _ in range(3):
            state, metrics = jpipe.train_step(state, batch)
            run.append(float(metrics["loss"]))
        losses.append(run)
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    np.testing.assert_allclose(losses[2], losses[0], rtol=1e-5)
    # the same batch and parameters at another step draw other masks
    state = _init(model, jpipe.Plan(2, 1, 4), optax.sgd(0.0), batch, rng=jax.random.key(3))
    first, _ = jpipe.value_and_grad(state, batch)
    state, _ = jpipe.train_step(state, batch)  # lr 0: the parameters stay
    second, _ = jpipe.value_and_grad(state, batch)
    assert float(first) != float(second)
    # another seed, other masks; the same seed, the same
    again = _init(model, jpipe.Plan(2, 1, 4), optax.sgd(0.0), batch, rng=jax.random.key(3))
    other = _init(model, jpipe.Plan(2, 1, 4), optax.sgd(0.0), batch, rng=jax.random.key(4))
    assert float(jpipe.value_and_grad(again, batch)[0]) == float(first)
    assert float(jpipe.value_and_grad(other, batch)[0]) != float(first)


def test_linen_dropout_is_found_and_matches_the_plain_model():
    model, batch = linen_model(), _batch()
    state = _init(model, jpipe.Plan(2, 2, 2), optax.sgd(0.1), batch, rng=jax.random.key(1))
    assert model.stochastic
    loss, grads = jpipe.value_and_grad(state, batch)
    ref_loss, ref_grads = _reference(model, state, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-5)
    _close(grads, ref_grads)
    # evaluation: Linen's deterministic=True, NNX's eval(): the same as a model without any dropout
    params = jpipe.to_sequential(state)
    h = params["pre"]["lin"]
    plain = h["kernel"], h["bias"]
    x = batch["x"] @ plain[0] + plain[1]
    for p in params["layers"]:
        x = x + jnp.tanh(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    out = x @ params["post"]["lin"]["kernel"] + params["post"]["lin"]["bias"]
    np.testing.assert_allclose(float(model.loss_value(params, batch)), float(_loss(out, batch)), rtol=1e-5)


def test_models_without_stochastic_layers_draw_no_keys():
    model = models.mlp(in_dim=3, hidden=8, out_dim=1, num_layers=2)
    batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros((8, 1))}
    state = _init(model, jpipe.Plan(2, 1, 2), optax.sgd(0.1), batch, rng=jax.random.key(0))
    assert not model.stochastic and state.rng is None
    with pytest.raises(ValueError, match="no stochastic layers"):
        jpipe.step_rng(state)
    with pytest.raises(ValueError, match="give exactly one of rng="):
        _init(model, jpipe.Plan(2, 1, 2), optax.sgd(0.1), batch, rng=jax.random.key(0),
                   params=jpipe.to_sequential(state))


def test_params_with_a_stochastic_model_need_a_key():
    model, batch = nnx_model(), _batch()
    params = model.init_params(jax.random.key(0), batch)
    with pytest.raises(ValueError, match="stochastic layers .*pass rng= as well as params="):
        _init(model, jpipe.Plan(2, 1, 2), optax.sgd(0.1), batch, params=params)
    state = _init(model, jpipe.Plan(2, 1, 2), optax.sgd(0.1), batch, params=params, rng=jax.random.key(5))
    _close(jpipe.to_sequential(state), params, rtol=0, atol=0)


def test_a_checkpoint_keeps_the_dropout_key_so_a_resumed_run_draws_the_same_masks(tmp_path):
    model, batch = nnx_model(), _batch()
    plan = jpipe.Plan(2, 2, 2)
    state = _init(model, plan, optax.adam(1e-2), batch, rng=jax.random.key(2))
    state, _ = jpipe.train_step(state, batch)
    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(state, force=True)
    ckpt.wait()
    resumed = ckpt.restore(model, jpipe.Plan(4, 1, 4, schedule="gpipe"), optax.adam(1e-2), batch,
                           devices=jax.devices()[:4])
    want = []
    for _ in range(2):
        state, m = jpipe.train_step(state, _batch(seed=len(want) + 1))
        want.append(float(m["loss"]))
    got = []
    for _ in range(2):
        resumed, m = jpipe.train_step(resumed, _batch(seed=len(got) + 1))
        got.append(float(m["loss"]))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_colocated_pipelines_draw_their_own_masks():
    from jpipe import averaging

    model = nnx_model(2)
    one = _batch(8)
    batch = averaging.stack_batches([one, one])  # the same samples in both pipelines
    plan = jpipe.Plan(2, 1, 2, schedule="advance-forward")
    state = averaging.init(model, plan, optax.sgd(0.1), batch, pipelines=2, rng=jax.random.key(0),
                           devices=jax.devices()[:2])
    state, metrics = jpipe.train_step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    first, second = averaging.replicas(state)  # same start, same samples: only the masks differ
    kernel = lambda p: np.asarray(p["post"]["lin"]["kernel"])
    assert not np.allclose(kernel(first), kernel(second))


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_zoo_gpt_dropout_matches_the_plain_model_and_is_off_in_evaluation(framework):
    model = models.gpt(vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=2, framework=framework,
                       dropout=0.2)
    r = np.random.default_rng(0)
    batch = {"tokens": r.integers(0, 32, (8, 8)).astype(np.int32),
             "targets": r.integers(0, 32, (8, 8)).astype(np.int32)}
    state = _init(model, jpipe.Plan(2, 2, 2), optax.sgd(0.1), batch, rng=jax.random.key(0))
    loss, grads = jpipe.value_and_grad(state, batch)
    ref_loss, ref_grads = _reference(model, state, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-5)
    _close(grads, ref_grads, rtol=1e-4, atol=1e-6)
    # evaluation equals the same parameters in a model without dropout
    plain = models.gpt(vocab_size=32, seq_len=8, d_model=16, num_heads=2, num_layers=2, framework=framework)
    params = jpipe.to_sequential(state)
    evaluation = float(model.loss_value(params, batch))
    assert evaluation == pytest.approx(float(plain.loss_value(params, batch)), rel=1e-6)
    plain_grads = jax.grad(plain.loss_value)(params, batch)  # training drew masks: other gradients
    kernel = lambda g: np.asarray(g["layers"][0]["fc"]["kernel"])
    assert np.abs(kernel(grads) - kernel(plain_grads)).max() > 0.1 * np.abs(kernel(plain_grads)).max()
    with pytest.raises(ValueError, match="dropout must be in"):
        models.gpt(vocab_size=32, seq_len=8, dropout=1.0)


def test_the_cli_option_is_checked():
    from jpipe.run import TrainConfig

    with pytest.raises(ValueError, match="--dropout must be in"):
        TrainConfig(dropout=1.5).check()
    TrainConfig(dropout=0.1).check()
