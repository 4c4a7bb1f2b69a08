"""N co-located pipelines as one *ensemble* model that the unchanged executor runs.

:func:`ensemble` wraps a :class:`jpipe.Staged` into one whose ``pre``,
``layer`` and ``post`` are the original parts vmapped over a leading replica
axis of their parameters: every parameter is ``[N, ...]``, hidden activations
are ``[N, b, ...]``, so every tick of the schedule runs one batched kernel for
all N pipelines (the same time slot for the same micro-batch of every
pipeline). Its loss has the value of the replicas' mean loss and the gradient
of their *sum*, so each replica's gradient is exactly its own pipeline's.

Batches carry the replica axis second: every leaf is ``[B, R, ...]`` (row
``i`` of pipeline ``r`` is ``leaf[i, r]``), so the executor's split of the
leading axis into micro-batches gives every micro-batch one slice of every
pipeline's batch. :func:`stack_batches` and :func:`split_batch` build that
layout.

With ``data > 1`` (``Plan(pipe, data, M, pipelines=N)``) the pipelines are
*decoupled* across ``data``: each data replica's ``pipe`` devices hold N
co-located pipelines of their own, so there are ``R = N x data`` pipelines in
all, each with its own batch slice and its own optimizer state. The replica
axis of every parameter (and optimizer-state leaf) and of the batch is split
over ``data`` (pipelines ``d*N .. d*N + N - 1`` live on data replica ``d``);
there is no gradient all-reduce over ``data`` -- only the elastic centre
couples the pipelines. Batches are ``[B, N x data, ...]``; a step trains on
``N x data x B`` samples. The centre (no replica axis) is replicated over the
whole mesh (stage stacks over ``pipe``); its update sums the elastic pulls of
all R replicas, a cross-``data`` all-reduce. With the default stale centre
that sum reads only step-start values (replicas and centre), so it does not
wait for the step's gradients and XLA can run it alongside the pipeline.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jpipe import _sharding
from jpipe._executor import Layout
from jpipe._mesh import make_mesh
from jpipe._model import Component, Params, PyTree, Staged, unstack_layers
from jpipe._plan import Plan
from jpipe._state import (
    TrainState,
    build_state,
    check_batch,
    check_init_arguments,
    check_params,
    dropout_rng,
    init_pipelined,
    place_params,
)
from jpipe.averaging._elastic import ElasticAveraging, ElasticState, per_replica, replica_axes_of_state

# Where the replica axis sits in the pipelined layout: pre/post are [N, ...]; stage stacks are
# [devices, chunks, layers per chunk, N, ...].
REPLICA_AXIS = {"pre": 0, "stages": 3, "post": 0}


def _replicas(n: int, pipelined: Params) -> Params:
    """Pipelined parameters -> ``n`` equal replicas on each leaf's replica axis (:data:`REPLICA_AXIS`)."""
    def along(axis: int):
        return lambda a: jnp.broadcast_to(jnp.expand_dims(a, axis), (*a.shape[:axis], n, *a.shape[axis:]))

    return {part: jax.tree.map(along(REPLICA_AXIS[part]), pipelined[part]) for part in ("pre", "stages", "post")}


def _replicate(tree: PyTree, n: int) -> PyTree:
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *jnp.shape(a))), tree)


def _slice(tree: PyTree, n: int, axis: int) -> PyTree:
    return jax.tree.map(lambda a: jnp.take(a, n, axis=axis), tree)


def ensemble(model: Staged, pipelines: int) -> Staged:
    """``model`` as N pipelines batched on a leading replica axis of every parameter.

    Parameters are ``[N, ...]`` (``init`` gives N equal copies, as elastic
    averaging starts every replica at the centre); micro-batches are
    ``[b, N, ...]``; the loss's value is the mean of the N replicas' losses and
    its gradient that of their sum.

    >>> import jax, jax.numpy as jnp
    >>> from jpipe import models
    >>> base = models.mlp(in_dim=3, hidden=8, out_dim=1, num_layers=2)
    >>> ens = ensemble(base, pipelines=2)
    >>> batch = {"x": jnp.ones((4, 2, 3)), "y": jnp.zeros((4, 2, 1))}   # [B, N, ...]
    >>> params = ens.init_params(jax.random.key(0), batch)
    >>> params["pre"]["linear"]["kernel"].shape
    (2, 3, 8)
    >>> one = jax.tree.map(lambda a: a[0], params)
    >>> bool(jnp.allclose(ens.loss_value(params, batch), base.loss_value(one, batch_slice(batch, 0))))
    True
    """
    if not isinstance(model, Staged):
        raise TypeError(f"model must be a jpipe.Staged, got {type(model).__name__}")
    if not isinstance(pipelines, int) or isinstance(pipelines, bool) or pipelines < 1:
        raise ValueError(f"pipelines must be an int >= 1, got {pipelines!r}")
    n = pipelines
    pre, layer, post = model.components

    def pre_init(key: jax.Array, mb: PyTree) -> Params:
        return _replicate(pre.init(key, batch_slice(mb, 0)), n)

    # keys (stochastic models): [R, b], each replica's own sample keys
    def pre_apply(params: Params, mb: PyTree, keys: jax.Array | None = None) -> jax.Array:
        return jax.vmap(pre.apply, in_axes=(0, 1, 0))(params, mb, keys)

    def each_replica(apply):
        return lambda params, h, keys=None: jax.vmap(apply)(params, h, keys)

    def layer_init(key: jax.Array, h: jax.Array) -> Params:
        return _replicate(layer.init(key, h[0]), n)

    def post_init(key: jax.Array, h: jax.Array) -> Params:
        return _replicate(post.init(key, h[0]), n)

    def loss(outputs: PyTree, mb: PyTree) -> jax.Array:
        losses = jax.vmap(model.loss, in_axes=(0, 1))(outputs, mb).astype(jnp.float32)
        total = jnp.sum(losses)
        # Value: the mean over replicas (the metric); gradient: that of the sum, so that each
        # replica's parameters get exactly their own pipeline's gradient.
        return total - jax.lax.stop_gradient(total - total / n)

    def stochastic(i: int):  # as the model's part (jpipe.init checks the model first)
        return lambda params, x: model.stochastic_parts()[i] is True

    return Staged(
        pre=Component(pre_init, pre_apply, stochastic(0)),
        layer=Component(layer_init, each_replica(layer.apply), stochastic(1)),
        post=Component(post_init, each_replica(post.apply), stochastic(2)),
        num_layers=model.num_layers,
        loss=loss,
        check_batch=model.check_batch,  # element-wise checks hold for [B, N, ...] batches too
    )


# -- batches ---------------------------------------------------------------------------------


def stack_batches(batches: Sequence[PyTree]) -> PyTree:
    """N per-pipeline batches (same structure and shapes) -> one ensemble batch ``[B, N, ...]``.

    >>> import jax.numpy as jnp
    >>> stack_batches([{"x": jnp.zeros((4, 3))}, {"x": jnp.ones((4, 3))}])["x"].shape
    (4, 2, 3)
    """
    if not batches:
        raise ValueError("stack_batches needs at least one batch")
    return jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *batches)


def split_batch(batch: PyTree, pipelines: int) -> PyTree:
    """A global batch ``[N * B, ...]`` -> ``[B, N, ...]``; pipeline ``n`` gets rows ``n*B .. (n+1)*B - 1``.

    With ``data > 1`` pass ``pipelines = N x data`` (every pipeline of every data replica).

    >>> import jax.numpy as jnp
    >>> split_batch({"x": jnp.arange(6)}, pipelines=2)["x"].tolist()
    [[0, 3], [1, 4], [2, 5]]
    """
    def split(a):
        a = jnp.asarray(a)
        if a.ndim == 0 or a.shape[0] % pipelines:
            raise ValueError(f"a batch leaf of shape {a.shape} cannot be split into {pipelines} "
                             f"pipelines: its leading size must be a multiple of {pipelines}")
        return jnp.swapaxes(a.reshape(pipelines, a.shape[0] // pipelines, *a.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def batch_slice(batch: PyTree, n: int) -> PyTree:
    """Pipeline ``n``'s batch out of an ensemble batch ``[B, N, ...]``."""
    return jax.tree.map(lambda a: a[:, n], batch)


def _check_ensemble_batch(batch: PyTree, total: int, what: str, plan: Plan) -> None:
    counts = f"pipelines={plan.pipelines}" + (f" x data={plan.data}" if plan.data > 1 else "")
    for path, a in jax.tree_util.tree_leaves_with_path(batch):
        if np.ndim(a) < 2 or np.shape(a)[1] != total:
            raise ValueError(
                f"{what}{jax.tree_util.keystr(path)} has shape {np.shape(a)}; with {counts} every leaf "
                f"must be [B, {total}, ...] (replica axis second, one entry per pipeline): build it with "
                f"jpipe.averaging.stack_batches(batches) or split_batch(global_batch, {total})")


# -- training state --------------------------------------------------------------------------


def init(
    model: Staged,
    plan: Plan,
    optimizer: optax.GradientTransformation,
    example_batch: PyTree,
    *,
    pipelines: int | None = None,
    averaging: ElasticAveraging | None = None,
    rng: jax.Array | None = None,
    params: Params | None = None,
    devices: Sequence[jax.Device] | None = None,
    nan_policy: str = "raise",
) -> TrainState:
    """A :class:`jpipe.TrainState` for N co-located pipelines per data replica, coupled by elastic averaging.

    There are ``R = pipelines x plan.data`` pipelines in all (N on each data
    replica's ``pipe`` devices; see the module docstring); ``example_batch`` is
    laid out ``[B, R, ...]`` (``B`` per pipeline, divisible by
    ``plan.microbatches``). Every pipeline starts from the same parameters
    (fresh from ``rng``, or ``params`` in sequential layout), which are also the
    centre. ``pipelines`` and ``averaging`` default to the plan's fields of
    those names, when it has them (else ``averaging`` is ``ElasticAveraging()``,
    whose default moving rate is ``beta / R``). ``optimizer`` is each
    pipeline's own optimizer, applied per replica (:func:`per_replica`: its own
    state, and global-norm clipping sees only its own gradients). The state
    works with :func:`jpipe.train_step` on ``[B, R, ...]`` batches; its
    ``metrics["loss"]`` is the replicas' mean loss; its plan records
    ``pipelines`` and ``averaging``. Read the centre with :func:`centre` and the
    replicas with :func:`replicas`.

    >>> import jax, jax.numpy as jnp, optax, jpipe
    >>> from jpipe import averaging, models
    >>> model = models.mlp(in_dim=3, hidden=8, out_dim=1, num_layers=2)
    >>> batch = averaging.stack_batches([{"x": jnp.ones((8, 3)), "y": jnp.zeros((8, 1))}] * 2)
    >>> plan = jpipe.Plan(pipe=2, data=1, microbatches=4, schedule="advance-forward")
    >>> state = averaging.init(model, plan, optax.sgd(0.1), batch, pipelines=2,
    ...                        rng=jax.random.key(0), devices=jax.devices()[:2])
    >>> state, metrics = jpipe.train_step(state, batch)
    >>> len(averaging.replicas(state)), sorted(averaging.centre(state))
    (2, ['layers', 'post', 'pre'])
    """
    check_init_arguments(model, plan, rng, params, nan_policy)
    # Explicit arguments win over the plan's fields.
    pipelines = plan.pipelines if pipelines is None else pipelines
    averaging = averaging if averaging is not None else plan.averaging
    averaging = ElasticAveraging() if averaging is None else averaging
    if not isinstance(averaging, ElasticAveraging):
        raise TypeError(f"averaging must be a jpipe.averaging.ElasticAveraging, got {type(averaging).__name__}")
    plan = dataclasses.replace(plan, pipelines=pipelines, averaging=averaging, shard=None)
    total = pipelines * plan.data  # every pipeline of every data replica
    ens = ensemble(model, pipelines)  # what one data device runs: its N pipelines
    _check_ensemble_batch(example_batch, total, "example_batch", plan)
    size = check_batch(example_batch, plan, "example_batch", replicas_over_data=True)
    microbatch = jax.tree.map(lambda a: jnp.asarray(a[: size // plan.microbatches]), example_batch)
    one = batch_slice(microbatch, 0)
    model.check(one)
    partition = plan.stage_partition(model.num_layers)
    table = plan.table()
    mesh = make_mesh(plan.pipe, plan.data, devices)
    layout = Layout.from_partition(partition, plan.pipe)
    # One model, stage-local and split over the mesh (as jpipe.init builds it), then broadcast to
    # every replica by a program whose outputs are split over the replica axis: no device ever
    # holds more than its own pipelines' share.
    single = jax.eval_shape(functools.partial(init_pipelined, model, layout), jax.random.key(0), one)
    single_shardings = _sharding.param_shardings(single, mesh, "parameters")
    if params is None:
        single = jax.jit(functools.partial(init_pipelined, model, layout),
                         out_shardings=single_shardings)(rng, one)
    else:
        check_params(params, jax.eval_shape(model.init_params, jax.random.key(0), one))
        single = place_params(params, layout, single_shardings)
    return _assemble(ens, plan, optimizer, averaging, single, None, mesh, layout, table, example_batch,
                     microbatch, nan_policy, dropout_rng(model, rng, params, mesh))


def _assemble(ens: Staged, plan: Plan, optimizer: optax.GradientTransformation, averaging: ElasticAveraging,
              single: Params, single_opt: PyTree | None, mesh: jax.sharding.Mesh, layout: Layout, table,
              example_batch: PyTree, microbatch: PyTree, nan_policy: str,
              rng: jax.Array | None) -> TrainState:
    """The ensemble's state from one pipelined model ``single`` (split over the mesh as ``Plan.shard=
    "parameters"`` keeps it): every replica starts from it, and so does the centre. ``single_opt``, if
    given, is that model's optimizer state (a synchronous run's), which every replica then starts
    from; otherwise each replica's optimizer state is fresh."""
    total = plan.pipelines * plan.data
    replicated = jax.eval_shape(functools.partial(_replicas, total), single)
    param_shardings = _sharding.param_shardings(replicated, mesh, None, replicas=True)
    pipelined = jax.jit(functools.partial(_replicas, total), out_shardings=param_shardings)(single)
    inner = per_replica(optimizer, REPLICA_AXIS)
    full = optax.chain(inner, averaging.transform(total, replica_axis=REPLICA_AXIS))
    # Each replica's optimizer state lives with the replica; the centre is replicated over the
    # whole mesh, its stage stacks over `pipe` (where the replicas' stage stacks are).
    centre_shape = jax.eval_shape(full.init, pipelined)[1].centre
    shardings = (_sharding.opt_shardings(inner, pipelined, mesh, None, replicas=True, mirrors=optimizer),
                 ElasticState(NamedSharding(mesh, P()), _sharding.param_shardings(centre_shape, mesh, None)))

    def opt_init(pipelined: Params, single_opt: PyTree | None) -> PyTree:
        fresh = full.init(pipelined)
        if single_opt is None:
            return fresh
        axes = replica_axes_of_state(REPLICA_AXIS, jax.eval_shape(optimizer.init, single))
        copies = jax.vmap(lambda _, s: s, in_axes=(0, None), out_axes=axes)(jnp.arange(total), single_opt)
        return copies, fresh[1]

    opt_state = jax.jit(opt_init, out_shardings=shardings)(pipelined, single_opt)
    # which parts are stochastic (as the model's), traced on what one data device runs: its N pipelines
    ens.check(jax.tree.map(lambda a: a[:, :plan.pipelines], microbatch))
    return build_state(ens, plan, full, table, layout, mesh, pipelined, opt_state, example_batch, microbatch,
                      nan_policy, replicas_over_data=True, shardings=(param_shardings, shardings), rng=rng,
                       sequential=centre)


def from_synchronous(sync: TrainState, plan: Plan, optimizer: optax.GradientTransformation,
                     example_batch: PyTree) -> TrainState:
    """AvgPipe's state for ``plan`` from a synchronous one on the same devices and stage partition (as
    :meth:`jpipe.checkpoint.Checkpointer.restore` builds it from a synchronous checkpoint): every
    pipeline and the centre start from ``sync``'s parameters, every pipeline's optimizer state from
    ``sync``'s, and the step count goes on."""
    program = sync.program
    if sync.plan.pipelines > 1 or sync.plan.shard != "parameters":
        raise ValueError("from_synchronous takes a synchronous state with Plan.shard='parameters'")
    plan = dataclasses.replace(plan, shard=None, averaging=plan.averaging or ElasticAveraging())
    size = check_batch(example_batch, plan, "example_batch", replicas_over_data=True)
    microbatch = jax.tree.map(lambda a: jnp.asarray(a[: size // plan.microbatches]), example_batch)
    state = _assemble(ensemble(program.model, plan.pipelines), plan, optimizer, plan.averaging, sync.params,
                      sync.opt_state, program.mesh, program.layout, plan.table(), example_batch, microbatch,
                      program.nan_policy, sync.rng)
    return state.replace(step=sync.step, skipped_steps=sync.skipped_steps)


def _elastic_state(state: TrainState) -> ElasticState:
    found = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, ElasticState))
             if isinstance(s, ElasticState)]
    if len(found) != 1:
        raise ValueError("this TrainState has no elastic-averaging state; make it with jpipe.averaging.init")
    return found[0]


def centre(state: TrainState) -> Params:
    """The centre (reference) model in sequential layout -- the model to evaluate and export.

    Use it with the original (not the ensemble) model: ``model.loss_value(centre(state), batch)``.
    New arrays: they never alias the state, which the next ``train_step`` donates.
    """
    c = _elastic_state(state).centre
    layers = state.program.layout.from_stages(c["stages"])
    return unstack_layers({"pre": jax.tree.map(jnp.copy, c["pre"]), "layers": layers,
                           "post": jax.tree.map(jnp.copy, c["post"])})


to_sequential = centre


def replicas(state: TrainState) -> list[Params]:
    """Each pipeline's own parameters in sequential layout: all ``N x data`` of them, in replica-axis order."""
    p = state.params
    layers = state.program.layout.from_stages(p["stages"])  # [L, N, ...]
    n = jax.tree.leaves(layers)[0].shape[1]
    return [unstack_layers({"pre": _slice(p["pre"], i, 0), "layers": _slice(layers, i, 1),
                            "post": _slice(p["post"], i, 0)}) for i in range(n)]
