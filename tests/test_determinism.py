"""The same seed, plan and data give bit-identical losses and parameters, run after run."""

from __future__ import annotations

import jax
import numpy as np
import optax
from test_executor import make_batch, make_model

import jpipe


def _run(plan: jpipe.Plan, steps: int = 4):
    model = make_model("nnx", num_layers=4)
    state = jpipe.init(model, plan, optax.adam(1e-2), make_batch(16), rng=jax.random.key(7),
                       devices=jax.devices()[: plan.num_devices])
    losses = []
    for step in range(steps):
        state, metrics = jpipe.train_step(state, make_batch(16, seed=step))
        losses.append(float(metrics["loss"]).hex())  # every bit of the float
    return losses, [np.asarray(x) for x in jax.tree.leaves(jpipe.to_sequential(state))]


def test_two_runs_are_bit_identical():
    plan = jpipe.Plan(2, 2, 2, schedule="1f1b")
    losses_a, params_a = _run(plan)
    losses_b, params_b = _run(plan)  # a fresh init, a fresh compile
    assert losses_a == losses_b
    assert len(set(losses_a)) == len(losses_a)  # it did train
    for a, b in zip(params_a, params_b):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
