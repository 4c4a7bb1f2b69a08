"""``jpipe.init``: a synchronous pipeline's training state, or AvgPipe's co-located pipelines."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import optax

from jpipe import averaging
from jpipe._model import Params, PyTree, Staged
from jpipe._plan import Plan
from jpipe._state import (
    TrainState,
    abstract_state,
    check_init_arguments,
    check_params,
    dropout_rng,
    first_microbatch,
    init_pipelined,
    place_params,
    with_fresh_counters,
)


def init(
    model: Staged,
    plan: Plan,
    optimizer: optax.GradientTransformation,
    example_batch: PyTree,
    *,
    rng: jax.Array | None = None,
    params: Params | None = None,
    devices: Sequence[jax.Device] | None = None,
    nan_policy: str = "raise",
) -> TrainState:
    """Creates the training state: parameters placed stage by stage on a ``(pipe, data)`` mesh.

    Give ``rng`` to initialise fresh parameters, or ``params`` in the sequential
    layout (what :func:`to_sequential` returns) to start from existing ones.

    ``nan_policy`` says what :func:`train_step` does when the loss, a gradient or
    a floating-point batch value is NaN or inf: ``"raise"`` (default) leaves the
    update out and raises :class:`NonFiniteError` naming the step (the host
    reads one flag per step, so steps are not queued ahead); ``"skip"`` leaves
    the update out, counts it in ``metrics["skipped_steps"]`` and goes on
    (fully asynchronous); ``"ignore"`` checks nothing.

    >>> import jax, jax.numpy as jnp, optax, jpipe
    >>> from flax import nnx
    >>> class Embed(nnx.Module):
    ...     def __init__(self, rngs): self.lin = nnx.Linear(3, 8, rngs=rngs)
    ...     def __call__(self, mb): return self.lin(mb["x"])
    >>> model = jpipe.Staged(pre=Embed, layer=lambda rngs: nnx.Linear(8, 8, rngs=rngs),
    ...                      post=lambda rngs: nnx.Linear(8, 1, rngs=rngs), num_layers=2,
    ...                      loss=lambda out, mb: jnp.mean((out[:, 0] - mb["y"]) ** 2))
    >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros(8)}
    >>> plan = jpipe.Plan(pipe=2, data=1, microbatches=4)
    >>> state = jpipe.init(model, plan, optax.sgd(0.1), batch, rng=jax.random.key(0),
    ...                    devices=jax.devices()[:2])
    >>> state, metrics = jpipe.train_step(state, batch)
    >>> metrics["loss"].shape
    ()
    """
    check_init_arguments(model, plan, rng, params, nan_policy)
    if plan.pipelines > 1 or plan.averaging is not None:  # AvgPipe: co-located pipelines
        return averaging.init(model, plan, optimizer, example_batch, rng=rng, params=params,
                              devices=devices, nan_policy=nan_policy)
    state = abstract_state(model, plan, optimizer, example_batch, devices=devices, nan_policy=nan_policy)
    state = state.replace(rng=dropout_rng(model, rng, params, state.mesh))
    program = state.program
    shardings, opt_shardings = program.shardings
    microbatch = first_microbatch(example_batch, plan)
    if params is None:
        pipelined = jax.jit(functools.partial(init_pipelined, model, program.layout),
                            out_shardings=shardings)(rng, microbatch)
    else:
        check_params(params, jax.eval_shape(model.init_params, jax.random.key(0), microbatch))
        pipelined = place_params(params, program.layout, shardings)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(pipelined)
    return with_fresh_counters(state, pipelined, opt_state)


