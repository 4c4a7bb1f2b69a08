"""Elastic averaging (EASGD) as an optax ``GradientTransformation`` over a replica axis.

N replicas ``x_n`` (stacked on a *replica axis* of every parameter) are coupled
to a centre ``x_ref`` (the same parameters without that axis) by the canonical
rule of Zhang et al. (2015), which AvgPipe builds on::

    e_n   = alpha * (x_n - x_ref)
    x_n   <- x_n - lr * g_n - e_n
    x_ref <- x_ref + sum_n e_n

``alpha`` is the moving rate; ``beta = N * alpha`` (default 0.9) is how far the
centre moves towards the replicas' mean per averaging step.

The transformation goes *after* the per-replica optimizer,
``optax.chain(inner, elastic_averaging(alpha))``: ``inner`` turns each replica's
gradient into its update ``u_n`` (``-lr * g_n`` for SGD) and this
transformation adds the elastic pull ``-e_n``. Choices AvgPipe leaves open, as
made here:

* ``centre="stale"`` (default, the canonical rule above): ``e_n`` is computed
  from the step-start values ``x_n`` and ``x_ref``, so the centre reflects the
  replicas one step late. Nothing in it depends on this step's gradients:
  when the replicas span devices, the reduction ``sum_n e_n`` can start at the
  beginning of the step and overlap the whole forward/backward.
  ``centre="sync"``: ``e_n = alpha * (x_n + u_n - x_ref)`` uses the replicas
  after this step's update, so the centre is current, but the reduction
  waits for the gradients.
* ``period`` (tau): the elastic step runs on steps ``0, tau, 2 tau, ...``; in
  between the replicas train independently and the centre stays put.
* Optimizer state: each replica keeps its own inner optimizer state
  (:func:`per_replica` vmaps the inner optimizer over the replica axis, so
  that transforms that are not element-wise, such as
  ``optax.clip_by_global_norm``, see one replica at a time, and counters are
  per replica); the elastic pull is added *after* the inner optimizer, so it
  is a move in parameter space that never enters the moments or any
  preconditioner. The centre has no optimizer state.

>>> import jax.numpy as jnp, optax
>>> tx = elastic_averaging(alpha=0.25)
>>> params = jnp.array([1.0, 3.0])                 # two replicas of a scalar
>>> state = ElasticState(count=jnp.zeros((), jnp.int32), centre=jnp.array(0.0))
>>> updates, state = tx.update(jnp.array([-0.5, -0.25]), state, params)  # u_n = -lr * g_n
>>> (params + updates).tolist(), float(state.centre)  # 1 - .5 - .25, 3 - .25 - .75; 0 + .25 + .75
([0.25, 2.0], 1.0)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any
CENTRE_MODES = ("stale", "sync")


class ElasticState(NamedTuple):
    """State of :func:`elastic_averaging`: the step count and the centre (``x_ref``)."""

    count: jax.Array  # int32 scalar: update calls so far
    centre: PyTree  # the parameters without their replica axis


def _axes_tree(replica_axis: int | PyTree, params: PyTree) -> PyTree:
    """``replica_axis`` (an int or a prefix tree of ints) broadcast to every leaf of ``params``."""
    return jax.tree.map(lambda ax, sub: jax.tree.map(lambda _: int(ax), sub), replica_axis, params)


def _one_replica(tree: PyTree, axes: PyTree) -> PyTree:
    """Shape structs of one replica: ``tree`` without its replica axes."""
    def cut(a, ax):
        shape = tuple(np.shape(a))
        return jax.ShapeDtypeStruct((*shape[:ax], *shape[ax + 1:]), jnp.result_type(a))

    return jax.tree.map(cut, tree, axes)


def replica_axes_of_state(replica_axis: int | PyTree, state: PyTree) -> PyTree:
    """Where the replica axis goes in each leaf of a per-replica optimizer ``state`` (shape structs).

    A leaf that mirrors a parameter (e.g. Adam's ``mu["stages"][...]``) takes that
    parameter's axis: the first part of ``replica_axis``'s tree whose key path
    occurs in the leaf's path. Any other leaf (a step count, a scalar) gets a
    leading replica axis.
    """
    prefixes = [(tuple(map(str, path)), int(ax))
                for path, ax in jax.tree_util.tree_flatten_with_path(replica_axis)[0]]

    def pick(path, leaf) -> int:
        keys = tuple(map(str, path))
        for start in range(len(keys) + 1):
            for prefix, ax in prefixes:
                if keys[start:start + len(prefix)] == prefix and ax <= len(leaf.shape):
                    return ax
        return 0

    return jax.tree_util.tree_map_with_path(pick, state)


def per_replica(inner: optax.GradientTransformation, replica_axis: int | PyTree = 0) -> optax.GradientTransformation:
    """``inner`` applied to each replica on its own: init and update vmapped over ``replica_axis``.

    Element-wise transformations (SGD, Adam) give the same updates either way;
    those that are not, such as ``optax.clip_by_global_norm``, would otherwise
    treat the stacked replicas as one model (one global norm for all of them).
    Each replica also gets its own step count. ``replica_axis`` is as in
    :func:`elastic_averaging`; optimizer-state leaves that mirror a parameter
    keep its replica axis where the parameter has it, other leaves get a
    leading one.

    >>> import jax.numpy as jnp, optax
    >>> tx = per_replica(optax.clip_by_global_norm(1.0))
    >>> grads = jnp.array([[3.0, 4.0], [0.3, 0.4]])    # 2 replicas: norms 5 and 0.5
    >>> updates, _ = tx.update(grads, tx.init(grads))
    >>> [[round(float(v), 3) for v in row] for row in updates]  # the first clipped to norm 1, not the second
    [[0.6, 0.8], [0.3, 0.4]]
    """
    def init(params: PyTree):
        axes = _axes_tree(replica_axis, params)
        state_axes = replica_axes_of_state(replica_axis, jax.eval_shape(inner.init, _one_replica(params, axes)))
        return jax.vmap(inner.init, in_axes=(axes,), out_axes=state_axes)(params)

    def update(updates: PyTree, state, params: PyTree | None = None):
        axes = _axes_tree(replica_axis, updates)
        state_axes = replica_axes_of_state(replica_axis, jax.eval_shape(inner.init, _one_replica(updates, axes)))
        return jax.vmap(inner.update, in_axes=(axes, state_axes, None if params is None else axes),
                        out_axes=(axes, state_axes))(updates, state, params)

    return optax.GradientTransformation(init, update)


def _check_rate(alpha: float, period: int, centre: str) -> None:
    if not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"alpha (the moving rate) must be in [0, 1], got {alpha!r}")
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        raise ValueError(f"period must be an int >= 1, got {period!r}")
    if centre not in CENTRE_MODES:
        raise ValueError(f"centre must be one of {CENTRE_MODES}, got {centre!r}")


def elastic_averaging(
    alpha: float, *, period: int = 1, centre: str = "stale", replica_axis: int | PyTree = 0
) -> optax.GradientTransformation:
    """Elastic averaging of the replicas stacked on ``replica_axis`` with a centre it holds.

    ``replica_axis`` is an int (the same axis for every parameter) or a tree of
    ints that is a prefix of the parameters (e.g. ``{"pre": 0, "stages": 3,
    "post": 0}``). ``init`` starts the centre at the replicas' mean; ``update``
    needs ``params`` (the step-start replicas). See the module docstring for the
    rule and for ``period`` and ``centre``.

    >>> import jax.numpy as jnp, optax
    >>> tx = optax.chain(optax.sgd(0.1), elastic_averaging(alpha=0.45))
    >>> params = {"w": jnp.ones((2, 3))}               # 2 replicas of a [3] parameter
    >>> state = tx.init(params)
    >>> state[1].centre["w"].shape
    (3,)
    """
    _check_rate(alpha, period, centre)
    alpha = float(alpha)

    def init(params: PyTree) -> ElasticState:
        axes = _axes_tree(replica_axis, params)
        mean = jax.tree.map(lambda p, ax: jnp.mean(p, axis=ax).astype(p.dtype), params, axes)
        return ElasticState(count=jnp.zeros((), jnp.int32), centre=mean)

    def update(updates: PyTree, state: ElasticState, params: PyTree | None = None):
        if params is None:
            raise ValueError("elastic_averaging needs the replicas: call update(updates, state, params)")
        axes = _axes_tree(replica_axis, params)
        active = (state.count % period == 0) if period > 1 else jnp.bool_(True)
        rate = jnp.where(active, alpha, 0.0)

        def pull(p, u, c, ax):
            x = p + u if centre == "sync" else p
            return (rate * (x - jnp.expand_dims(c, ax))).astype(p.dtype)

        pulls = jax.tree.map(pull, params, updates, state.centre, axes)
        new_updates = jax.tree.map(lambda u, e: (u - e).astype(u.dtype), updates, pulls)
        new_centre = jax.tree.map(lambda c, e, ax: (c + jnp.sum(e, axis=ax)).astype(c.dtype),
                                  state.centre, pulls, axes)
        return new_updates, ElasticState(count=state.count + 1, centre=new_centre)

    return optax.GradientTransformation(init, update)


@dataclasses.dataclass(frozen=True)
class ElasticAveraging:
    """How N co-located pipelines are coupled: moving rate, period and centre mode.

    ``alpha`` is the moving rate; left ``None`` it is ``beta / N`` for N
    pipelines (``beta = N * alpha``, default 0.9 as EASGD suggests). ``period``
    and ``centre`` are as in :func:`elastic_averaging`.

    >>> ElasticAveraging().moving_rate(pipelines=2)
    0.45
    >>> ElasticAveraging(alpha=0.1, period=4).moving_rate(pipelines=2)
    0.1
    """

    alpha: float | None = None
    beta: float = 0.9
    period: int = 1
    centre: str = "stale"

    def __post_init__(self) -> None:
        if self.alpha is None and not 0.0 <= float(self.beta) <= 1.0:
            raise ValueError(f"beta = N * alpha must be in [0, 1] (the centre would overshoot the "
                             f"replicas' mean), got {self.beta!r}")
        _check_rate(0.0 if self.alpha is None else self.alpha, self.period, self.centre)

    def moving_rate(self, pipelines: int) -> float:
        """``alpha`` for ``pipelines`` replicas."""
        if self.alpha is not None:
            return float(self.alpha)
        return round(float(self.beta) / pipelines, 12)

    def transform(self, pipelines: int, replica_axis: int | PyTree = 0) -> optax.GradientTransformation:
        """The :func:`elastic_averaging` transformation for ``pipelines`` replicas."""
        alpha = self.moving_rate(pipelines)
        if pipelines * alpha > 1.0 + 1e-9:
            raise ValueError(f"N * alpha = {pipelines} * {alpha} = {pipelines * alpha:g} > 1: the centre "
                             f"would overshoot the replicas' mean; use alpha <= 1 / {pipelines}")
        return elastic_averaging(alpha, period=self.period, centre=self.centre, replica_axis=replica_axis)
