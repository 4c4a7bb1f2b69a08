"""Mixed precision: gradients accumulate over micro-batches in float32 whatever the parameter dtype,
and the model zoo's GPT computes in bfloat16 with float32 parameters (``models.gpt(dtype=...)``).

Everything here is tiny (a 2-layer MLP of width 64, a 2-layer GPT of width 16) so that the few
compilations dominate. (``models.gpt``'s doctest covers the NNX GPT in bfloat16, the test here
the Linen one.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe import models

BATCH = 128


def _recorder() -> optax.GradientTransformation:
    """An optimizer whose state is the last gradient it was given, exactly, and whose updates are zero."""

    def init(params):
        return jax.tree.map(jnp.zeros_like, params)

    def update(grads, state, params=None):
        return jax.tree.map(jnp.zeros_like, grads), grads

    return optax.GradientTransformation(init, update)


@functools.cache
def _mlp_problem():
    model = models.mlp(in_dim=4, hidden=64, out_dim=2, num_layers=2, framework="linen")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 4)).astype(np.float32)
    y = np.stack([np.sin(x.sum(1)), np.cos(x[:, 0])], axis=1).astype(np.float32)
    batch = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
    params = model.init_params(jax.random.key(0), batch)
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    # The reference: float32 gradient of the plain model at the very same (bfloat16-valued) point.
    ref = jax.jit(jax.grad(model.loss_value))(jax.tree.map(lambda a: a.astype(jnp.float32), bf16), batch)
    return model, batch, bf16, ref


def _rel_error(grads, ref) -> float:
    diff = sum(float(jnp.sum((g.astype(jnp.float32) - r) ** 2)) for g, r in
               zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True))
    norm = sum(float(jnp.sum(r**2)) for r in jax.tree.leaves(ref))
    return (diff / norm) ** 0.5


def _pipelined_grads(microbatches: int):
    model, batch, bf16, _ = _mlp_problem()
    plan = jpipe.Plan(pipe=2, data=1, microbatches=microbatches)
    state = jpipe.init(model, plan, _recorder(), batch, params=bf16, devices=jax.devices()[:2])
    state, _ = jpipe.train_step(state, batch)
    return jpipe.to_sequential(state.replace(params=state.opt_state))


def _bf16_accumulated_grads(microbatches: int):
    """What a bfloat16 accumulator would give: per-micro-batch bfloat16 gradients summed in bfloat16."""
    model, batch, bf16, _ = _mlp_problem()
    mbs = jax.tree.map(lambda a: a.reshape(microbatches, -1, *a.shape[1:]), batch)
    per_mb = jax.jit(jax.vmap(jax.grad(model.loss_value), in_axes=(None, 0)))(bf16, mbs)

    def accumulate(g):  # one micro-batch after the other, as the executor's carry did
        g = np.asarray(g)
        acc = g[0]
        for i in range(1, microbatches):
            acc = (acc + g[i]).astype(g.dtype)
        return (acc.astype(np.float32) / microbatches).astype(g.dtype)

    return jax.tree.map(accumulate, per_mb)


def test_float32_accumulator_keeps_bf16_gradient_error_flat_in_microbatches():
    """Pipelined gradients of bfloat16 parameters against the float32 gradient at the same point.

    What is left at M = 1 is the one rounding of the gradient to bfloat16. At M = 64 (micro-batches
    of 2) each micro-batch's gradient is itself bfloat16 (the parameters' dtype), which adds a
    little rounding noise that averages out over micro-batches (a few % here, over seeds 1.02 to
    1.04); a bfloat16 accumulator instead adds a rounding of the running sum per micro-batch.
    """
    *_, ref = _mlp_problem()
    grads = {m: _pipelined_grads(m) for m in (1, 64)}
    # The gradient comes back in the parameters' dtype: accumulated in float32, cast once at the end.
    for g in grads.values():
        assert {a.dtype for a in jax.tree.leaves(g)} == {jnp.dtype(jnp.bfloat16)}
    errors = {m: _rel_error(g, ref) for m, g in grads.items()}
    print(f"relative gradient error (float32 accumulator): M=1 {errors[1]:.3g}, M=64 {errors[64]:.3g}")
    assert 0 < errors[1] < 1e-2  # bfloat16 rounding of the gradient, about 2**-9
    assert errors[64] <= 1.1 * errors[1], errors
    # The check has teeth: summing the 64 micro-batch gradients in bfloat16 is several times worse.
    bf16_acc = _rel_error(_bf16_accumulated_grads(64), ref)
    print(f"relative gradient error (bfloat16 accumulator, M=64): {bf16_acc:.3g}")
    assert bf16_acc > 2 * errors[64], (bf16_acc, errors)


def _floating_dtypes(tree) -> set:
    return {a.dtype for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.floating)}


def test_bf16_gpt_trains_with_float32_parameters_and_optimizer_state():
    config = {"vocab_size": 32, "seq_len": 8, "d_model": 16, "num_heads": 2, "num_layers": 2, "framework": "linen"}
    model = models.gpt(**config, dtype=jnp.bfloat16)
    model_f32 = models.gpt(**config)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32, size=(8, 9)).astype(np.int32)
    batch = {"tokens": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
    plan = jpipe.Plan(pipe=2, data=1, microbatches=2)
    state = jpipe.init(model, plan, optax.adam(1e-2), batch, rng=jax.random.key(0), devices=jax.devices()[:2])
    params = jpipe.to_sequential(state)
    f32 = jnp.dtype(jnp.float32)
    assert _floating_dtypes(state.params) == {f32}
    assert _floating_dtypes(state.opt_state) == {f32}
    # The hidden activations (what a stage sends the next) are bfloat16; the float32 model's are not.
    microbatch = jax.tree.map(lambda a: a[:4], batch)
    assert model.hidden_shape(params["pre"], microbatch).dtype == jnp.bfloat16
    assert model_f32.hidden_shape(params["pre"], microbatch).dtype == f32
    # So are the step's two collective permutes: activations a stage forward, cotangents a stage back.
    permutes = [line for line in jpipe.train_step.lower(state, batch).as_text().splitlines()
                if "collective_permute" in line]
    assert permutes and all("(tensor<4x8x16xbf16>)" in line for line in permutes), permutes

    ref = float(model_f32.loss_value(params, batch))
    losses = []
    for _ in range(3):
        state, metrics = jpipe.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all()
    assert losses[0] == pytest.approx(ref, rel=0.03)  # the same parameters, computed in bfloat16
    assert losses[-1] < losses[0]
    assert _floating_dtypes(state.params) == {f32} and _floating_dtypes(state.opt_state) == {f32}
