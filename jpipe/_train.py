"""The training API for Flax loops: ``train_step``, ``value_and_grad``, ``to_sequential``."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpipe import _sharding
from jpipe._executor import batch_spec
from jpipe._mesh import PIPE
from jpipe._model import Params, PyTree
from jpipe._state import Program, TrainState, check_batch, per_program


class NonFiniteError(FloatingPointError):
    """A step met a NaN or inf (loss, gradients or batch) under ``nan_policy="raise"``.

    ``step`` is the failing step's number (``state.step`` after it, counting from 1)
    and ``state`` the training state without that step's update, to recover from.
    """

    def __init__(self, message: str, step: int, state: TrainState) -> None:
        super().__init__(message)
        self.step = step
        self.state = state


def step_rng(state: TrainState) -> jax.Array:
    """The key the next :func:`train_step` on ``state`` gives the stochastic layers:
    ``model.loss_value(params, batch, rng=jpipe.step_rng(state))`` is the plain model's loss with
    the same dropout masks (every sample's mask depends only on this key, the layer and the sample's
    index in the batch, not on the mesh or the schedule).

    >>> import jax, jax.numpy as jnp, optax, jpipe
    >>> from flax import nnx
    >>> class Block(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.lin, self.drop = nnx.Linear(8, 8, rngs=rngs), nnx.Dropout(0.1, rngs=rngs)
    ...     def __call__(self, h): return h + self.drop(self.lin(h))
    >>> from jpipe import models
    >>> mlp = models.mlp(in_dim=3, hidden=8, out_dim=1, num_layers=2)
    >>> model = jpipe.Staged(mlp.pre, Block, mlp.post, 2, mlp.loss)
    >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros((8, 1))}
    >>> state = jpipe.init(model, jpipe.Plan(2, 1, 2), optax.sgd(0.1), batch, rng=jax.random.key(0),
    ...                    devices=jax.devices()[:2])
    >>> loss, _ = jpipe.value_and_grad(state, batch)
    >>> ref = model.loss_value(jpipe.to_sequential(state), batch, rng=jpipe.step_rng(state))
    >>> evaluation = model.loss_value(jpipe.to_sequential(state), batch)  # dropout off
    >>> bool(jnp.allclose(loss, ref)), bool(jnp.allclose(loss, evaluation))
    (True, False)
    """
    if state.rng is None:
        raise ValueError("this state's model has no stochastic layers: its steps draw no random numbers")
    return jax.random.fold_in(state.rng, state.step)


def _grads(state: TrainState, batch: PyTree) -> tuple[jax.Array, Params]:
    """The program's loss and gradients, given the step's key where the model is stochastic."""
    key = () if state.rng is None else (step_rng(state),)
    return state.program.grads(state.params, batch, *key)


def _check_step_batch(state: TrainState, batch: PyTree) -> None:
    want = state.program.batch_spec
    if jax.tree.structure(batch) != jax.tree.structure(want):
        raise ValueError(f"batch has structure {jax.tree.structure(batch)}, but the state was "
                         f"initialised with {jax.tree.structure(want)}")
    size = check_batch(batch, state.plan, replicas_over_data=state.program.executor.replicas_over_data)
    want_size = jax.tree.leaves(want)[0].shape[0]
    if size != want_size:  # the executor's buffers are sized by the micro-batch of example_batch
        raise ValueError(f"batch has {size} samples but the state was initialised with an example_batch of "
                         f"{want_size}; every step's batch must have that size (call jpipe.init with an "
                         f"example batch of {size} samples to train on batches of {size})")
    for (path, got), w in zip(jax.tree_util.tree_leaves_with_path(batch), jax.tree.leaves(want)):
        if got.shape[1:] != w.shape[1:] or got.dtype != w.dtype:
            raise ValueError(
                f"batch{jax.tree_util.keystr(path)} is {got.dtype}{list(got.shape)}, but the state "
                f"was initialised with {w.dtype}{list(w.shape)}")


def _all_finite(tree: PyTree) -> jax.Array:
    flags = [jnp.isfinite(a).all() for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.inexact)]
    return jnp.stack(flags).all() if flags else jnp.bool_(True)


@functools.partial(jax.jit, donate_argnums=0)
def _train_step(state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, jax.Array]]:
    _check_step_batch(state, batch)
    program = state.program
    over_data = program.executor.replicas_over_data
    batch = jax.lax.with_sharding_constraint(batch, NamedSharding(program.mesh, batch_spec(over_data)))
    loss, grads = _grads(state, batch)
    updates, opt_state = program.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss}
    skipped = state.skipped_steps
    if program.nan_policy != "ignore":
        # A non-finite batch, loss, gradient or updated parameter (a learning rate too high) leaves
        # parameters and optimizer state as they were.
        inputs_finite = _all_finite(batch) & jnp.isfinite(loss) & _all_finite(grads)
        finite = inputs_finite & _all_finite(params)
        keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
        params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
        skipped = (jnp.zeros((), jnp.int32) if skipped is None else skipped) + (~finite).astype(jnp.int32)
        metrics.update(finite=finite, skipped_steps=skipped, update_finite=~inputs_finite | finite)
    params, opt_state = jax.lax.with_sharding_constraint((params, opt_state), program.shardings)
    new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, skipped_steps=skipped)
    return new, metrics


def _nonfinite_message(state: TrainState, batch: PyTree, metrics: dict[str, jax.Array]) -> str:
    step = int(state.step)
    bad = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        # each process checks the rows it holds (all of them in a single-process run)
        shards = [s.data for s in leaf.addressable_shards] if isinstance(leaf, jax.Array) else [leaf]
        if any(np.issubdtype(np.asarray(x).dtype, np.inexact) and not np.isfinite(np.asarray(x)).all()
               for x in shards):
            bad.append(f"batch{jax.tree_util.keystr(path)}")
    loss = float(metrics["loss"])
    if bad:
        cause = f"the batch has NaN or inf in {', '.join(bad)} (loss {loss})"
    elif not np.isfinite(loss):
        cause = f"the loss is {loss}"
    elif not bool(metrics["update_finite"]):
        cause = (f"the loss ({loss}) and the gradients are finite but the update made a parameter NaN or "
                 f"inf: lower the learning rate")
    else:
        cause = f"a gradient is NaN or inf (loss {loss})"
    return (f"non-finite values at step {step}: {cause}. The update was not applied; the state "
            f"without it is this error's .state. Check the data and the learning rate, or pass "
            f"nan_policy='skip' to jpipe.init to skip such steps and count them in "
            f"metrics['skipped_steps']")


def _check_not_donated(state: TrainState, what: str) -> None:
    """A state already passed to ``train_step`` has given its arrays to the new state (jaxlib would
    crash on them on several devices): refuse it by name."""
    first = jax.tree.leaves(state.params)[0]
    if isinstance(first, jax.Array) and first.is_deleted():
        raise ValueError(f"{what} got a TrainState that an earlier train_step already consumed (its arrays "
                         f"were donated to the state that call returned); use the returned state: "
                         f"state, metrics = jpipe.train_step(state, batch)")


class _TrainStep:
    """``jpipe.train_step``: the jitted step plus, under ``nan_policy="raise"``, a host-side check."""

    def __init__(self, jitted: Any) -> None:
        self._jitted = jitted
        functools.update_wrapper(self, jitted)

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, jax.Array]]:
        """One pipelined training step on the global ``batch``; returns the new state and metrics.

        ``metrics["loss"]`` is the mean loss over the global batch, ``metrics["finite"]``
        whether the step's loss, gradients and batch were all finite and
        ``metrics["skipped_steps"]`` how many steps had their update left out
        (see ``nan_policy`` in :func:`jpipe.init`). The old state is donated. The
        batch's leading size must be divisible by data x microbatches (for
        co-located pipelines, ``Plan(pipelines=N)``: batches are ``[B, N x data, ...]``
        with ``B`` divisible by microbatches; see :mod:`jpipe.averaging`).
        """
        if not isinstance(state, TrainState):
            raise TypeError(f"train_step takes a jpipe.TrainState (from jpipe.init) as its first argument, "
                            f"got {type(state).__name__}")
        _check_not_donated(state, "train_step")
        if state.program.model.check_batch is not None:
            state.program.model.check_batch(batch)
        new, metrics = self._jitted(state, batch)
        if state.program.nan_policy == "raise" and not bool(metrics["finite"]):
            raise NonFiniteError(_nonfinite_message(new, batch, metrics), int(new.step), new)
        return new, metrics

    def __getattr__(self, name: str) -> Any:  # lower, trace, eval_shape, ... of the jitted step
        if name == "_jitted":
            raise AttributeError(name)
        return getattr(self._jitted, name)


train_step = _TrainStep(_train_step)
train_step.__doc__ = _TrainStep.__call__.__doc__


def value_and_grad(state: TrainState, batch: PyTree) -> tuple[jax.Array, Params]:
    """The loss and its gradients on ``batch`` in sequential layout, the state left as it is.

    The same pipelined computation as :func:`train_step` (mean loss over the
    global batch, gradients accumulated over micro-batches in float32), without
    the optimizer; the gradients are new arrays split over the mesh, like
    :func:`to_sequential`'s. For inspecting gradients, custom updates or
    gradient checks; the state is not donated.

    >>> import jax, jax.numpy as jnp, optax, jpipe
    >>> from jpipe import models
    >>> model = models.mlp(in_dim=3, hidden=8, out_dim=1, num_layers=2)
    >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros((8, 1))}
    >>> state = jpipe.init(model, jpipe.Plan(2, 1, 2), optax.sgd(0.1), batch, rng=jax.random.key(0),
    ...                    devices=jax.devices()[:2])
    >>> loss, grads = jpipe.value_and_grad(state, batch)
    >>> ref_loss, ref_grads = jax.value_and_grad(model.loss_value)(jpipe.to_sequential(state), batch)
    >>> bool(jnp.allclose(loss, ref_loss)), int(state.step)
    (True, 0)
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"value_and_grad takes a jpipe.TrainState (from jpipe.init), got {type(state).__name__}")
    if state.plan.pipelines > 1 or state.plan.averaging is not None:
        raise ValueError("value_and_grad is for synchronous plans; co-located pipelines (Plan(pipelines=N)) "
                         "have one gradient per pipeline: read them with jpipe.averaging.replicas after a step")
    _check_not_donated(state, "value_and_grad")
    if state.program.model.check_batch is not None:
        state.program.model.check_batch(batch)
    loss, grads = _value_and_grad(state, batch)
    return loss, to_sequential(state.replace(params=grads))


@jax.jit
def _value_and_grad(state: TrainState, batch: PyTree) -> tuple[jax.Array, Params]:
    _check_step_batch(state, batch)
    program = state.program
    batch = jax.lax.with_sharding_constraint(
        batch, NamedSharding(program.mesh, batch_spec(program.executor.replicas_over_data)))
    return _grads(state, batch)


def to_sequential(state: TrainState) -> Params:
    """The parameters in sequential layout: ``{"pre": ..., "layers": [L dicts], "post": ...}``.

    New arrays (they never alias the state, which the next ``train_step``
    donates) on the state's mesh, every leaf split over all its devices where
    one of its axes divides (so the whole model is never on one device). Use
    them with ``model.loss_value``, as ``jpipe.init(..., params=...)``, or
    fetch them with ``jax.device_get``; for models larger than a host's memory
    read one layer at a time with :func:`sequential_layers`. Any tree shaped
    like ``state.params`` converts too: ``to_sequential(state.replace(params=grads))``.
    For co-located pipelines (``Plan(pipelines=N)``) this is the centre model.
    """
    if state.program.sequential is not None:
        return state.program.sequential(state)
    return _sequential_converter(state.program)(state.params)


def sequential_layers(state: TrainState) -> Iterator[tuple[str | int, Params]]:
    """The sequential parameters one part at a time, as host NumPy arrays, for exporting models that
    fit on no single device: yields ``("pre", tree)``, then ``(i, layer_i)`` for every layer in order,
    then ``("post", tree)``. Only one part is gathered at a time; every process gets every part.

    >>> import jax, jax.numpy as jnp, optax, jpipe
    >>> from jpipe import models
    >>> model = models.mlp(in_dim=3, hidden=8, out_dim=1, num_layers=4)
    >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros((8, 1))}
    >>> state = jpipe.init(model, jpipe.Plan(2, 2, 2), optax.adam(1e-3), batch, rng=jax.random.key(0),
    ...                    devices=jax.devices()[:4])
    >>> [name for name, _ in jpipe.sequential_layers(state)]
    ['pre', 0, 1, 2, 3, 'post']
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"sequential_layers takes a jpipe.TrainState, got {type(state).__name__}")
    whole = _replicated(state.mesh)
    if state.program.sequential is not None:
        seq = state.program.sequential(state)
        parts = [("pre", seq["pre"]), *enumerate(seq["layers"]), ("post", seq["post"])]
        for name, part in parts:
            yield name, jax.tree.map(np.asarray, whole(part))
        return
    yield "pre", jax.tree.map(np.asarray, whole(state.params["pre"]))
    take = _layer_taker(state.program)
    for i, (d, c, j) in enumerate(state.program.layout.positions()):
        yield i, jax.tree.map(np.asarray, take(state.params["stages"], d, c, j))
    yield "post", jax.tree.map(np.asarray, whole(state.params["post"]))


@functools.cache
def _replicated(mesh: Mesh) -> Any:
    return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))


@per_program
def _layer_taker(program: Program) -> Any:
    """``take(stages, d, c, j)``: one layer, replicated; only that layer moves between devices."""
    specs = jax.tree.map(lambda s: s.spec, program.shardings[0]["stages"])

    def body(stages: PyTree, d: jax.Array, c: jax.Array, j: jax.Array) -> PyTree:
        def one(a: jax.Array, spec: P) -> jax.Array:
            mine = jnp.where(jax.lax.axis_index(PIPE) == d, a[0, c, j], jnp.zeros((), a.dtype))
            layer = jax.lax.psum(mine, PIPE)
            axis, names = _sharding.split_axis(spec)
            if axis is not None:  # a stage leaf split over `data` too
                layer = jax.lax.all_gather(layer, names, axis=axis - _sharding.STAGE_HEAD, tiled=True)
            return layer

        return jax.tree.map(one, stages, specs)

    return jax.jit(jax.shard_map(body, mesh=program.mesh, in_specs=(specs, P(), P(), P()), out_specs=P(),
                                 check_vma=False))


@per_program
def _sequential_converter(program: Program) -> Any:
    layout, mesh = program.layout, program.mesh
    positions = layout.positions()

    def convert(params: Params) -> Params:
        stages = params["stages"]
        return {"pre": params["pre"], "layers": [jax.tree.map(lambda a, p=p: a[p], stages) for p in positions],
                "post": params["post"]}

    def spread(leaf: Any) -> NamedSharding:
        return NamedSharding(mesh, _sharding.edge_spec(leaf.shape, mesh.size))

    def run(params: Params) -> Params:
        out = jax.eval_shape(convert, params)
        return jax.jit(convert, out_shardings=jax.tree.map(spread, out))(params)

    return run


def compiled_memory(state: TrainState, batch: PyTree) -> dict[str, int]:
    """Per-device bytes of the compiled ``train_step``: temp, argument, output, generated code.

    Exact and repeatable on every backend, CPU included (XLA's memory analysis).
    """
    analysis = train_step.lower(state, batch).compile().memory_analysis()
    return {
        "temp": int(analysis.temp_size_in_bytes),
        "argument": int(analysis.argument_size_in_bytes),
        "output": int(analysis.output_size_in_bytes),
        "alias": int(analysis.alias_size_in_bytes),
        "code": int(analysis.generated_code_size_in_bytes),
    }
