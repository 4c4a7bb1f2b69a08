"""Where every array of the training state lives: one rule for parameters, gradients and optimizer state.

The pipelined parameters are ``{"pre": ..., "stages": ..., "post": ...}``; every
stage leaf is ``[pipe devices, chunks, layers per chunk, ...]`` and lives on its
row of the ``(pipe, data)`` mesh. What else is split depends on the plan's
``shard`` level (ZeRO's levels, named by what they shard):

=================  ==============================  ==============================  =====================
``Plan.shard``     ``pre`` / ``post``              stage parameters                optimizer state
=================  ==============================  ==============================  =====================
``None``           replicated on every device      over ``pipe``                   like its parameter
``"optimizer"``    over the whole mesh             over ``pipe``                   over the whole mesh
``"parameters"``   over the whole mesh             over ``pipe`` and ``data``      over the whole mesh
=================  ==============================  ==============================  =====================

"Over the whole mesh" for a stage leaf means its row's ``pipe`` device and one
of its other axes split over ``data``. A leaf is split on its largest axis that
the devices divide (the last such axis on a tie); a leaf with no such axis (a
scalar, a bias of odd size) stays whole. Gradients leave the step where the
optimizer state lives (reduce-scattered rather than all-reduced), so that the
optimizer updates only its shard; sharded parameters are gathered inside the
step, and the gathered copy counts in the step's temporary bytes, not in the
state.

An optimizer-state leaf is placed by the parameter it mirrors, found with
``optax.tree_map_params`` (so Adam's ``mu``, Adafactor's factored rows and
columns and ``MultiSteps``' accumulated gradients all count as mirrors); every
other leaf (a step count) is replicated. :func:`opt_shardings` is the one rule;
``init``, checkpoints and AvgPipe use it.

>>> from jax.sharding import PartitionSpec as P
>>> shard_axis((4, 1, 2, 256, 1024), 2, first=3)
4
>>> stage_spec((4, 1, 2, 256, 1024), data=2, split=True)
P('pipe', None, None, None, 'data')
>>> edge_spec((8192, 256), devices=8)
P(('pipe', 'data'), None)
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpipe._mesh import DATA, PIPE
from jpipe._model import Params, PyTree

PARTS = ("pre", "stages", "post")
STAGE_HEAD = 3  # [devices, chunks, layers per chunk, ...]
EVERY = (PIPE, DATA)  # both mesh axes, for leaves split over the whole mesh


def shard_axis(shape: tuple[int, ...], n: int, first: int = 0) -> int | None:
    """The largest axis of ``shape`` from ``first`` on whose size ``n`` divides (the last on a tie)."""
    best = None
    for axis in range(first, len(shape)):
        if shape[axis] % n == 0 and shape[axis] >= n and (best is None or shape[axis] >= shape[best]):
            best = axis
    return best


def _spec_with(ndim: int, axis: int | None, names: Any, head: tuple = ()) -> P:
    spec = list(head) + [None] * (ndim - len(head))
    if axis is not None:
        spec[axis] = names
    return P(*spec)


def edge_spec(shape: tuple[int, ...], devices: int) -> P:
    """A ``pre``/``post`` leaf split over the whole mesh on one axis, or whole if none divides."""
    if devices == 1:
        return P()
    return _spec_with(len(shape), shard_axis(shape, devices), EVERY)


def stage_spec(shape: tuple[int, ...], data: int, split: bool) -> P:
    """A stage leaf: over ``pipe`` on its first axis, and, if ``split``, over ``data`` on another."""
    if not split or data == 1:
        return P(PIPE)
    return _spec_with(len(shape), shard_axis(shape, data, first=STAGE_HEAD), DATA, head=(PIPE,))


def param_specs(params: Params, mesh: Mesh, shard: str | None, replicas: bool = False) -> dict[str, PyTree]:
    """How the pipelined parameters are stored, per leaf (see the table above).

    ``replicas``: co-located pipelines (AvgPipe), whose every leaf has a replica
    axis split over ``data`` (axis 0 of ``pre``/``post``, axis 3 of stage leaves).
    """
    if replicas:
        return {"pre": jax.tree.map(lambda a: P(DATA), params["pre"]),
                "stages": jax.tree.map(lambda a: P(PIPE, None, None, DATA), params["stages"]),
                "post": jax.tree.map(lambda a: P(DATA), params["post"])}
    return {part: jax.tree.map(lambda a, part=part: _spec(a.shape, part, mesh, shard), params[part])
            for part in PARTS}


def grad_specs(params: Params, mesh: Mesh, shard: str | None, replicas: bool = False) -> dict[str, PyTree]:
    """Where the step's reduced gradients live: where the optimizer state that mirrors them lives."""
    return param_specs(params, mesh, None if shard is None else "parameters", replicas)


def _spec(shape: tuple[int, ...], part: str, mesh: Mesh, shard: str | None) -> P:
    if part == "stages":
        return stage_spec(shape, mesh.shape[DATA], shard == "parameters")
    return P() if shard is None else edge_spec(shape, mesh.size)


def _mirror_spec(leaf: Any, param: Any, part: str, mesh: Mesh, shard: str | None, replicas: bool) -> P:
    """The spec of an optimizer-state leaf that mirrors ``param`` of ``part``; its shape may differ
    (Adafactor's factored moments drop an axis)."""
    shape, like = tuple(leaf.shape), tuple(param.shape)
    if part == "stages" and shape[:STAGE_HEAD] != like[:STAGE_HEAD]:
        return P()
    if replicas:  # the replica axis, where the parameter has it
        axis = STAGE_HEAD if part == "stages" else 0
        if len(shape) <= axis or shape[axis] != like[axis]:
            return P(PIPE) if part == "stages" else P()
        return P(*([PIPE, None, None] if part == "stages" else []), DATA)
    return _spec(shape, part, mesh, None if shard is None else "parameters")


def opt_specs(optimizer: optax.GradientTransformation, params: Params, mesh: Mesh,
              shard: str | None, replicas: bool = False,
              mirrors: optax.GradientTransformation | None = None) -> PyTree:
    """The one rule for optimizer state: mirrors of a parameter are placed by it, the rest replicated.

    With ``shard`` set, every mirror is split over the whole mesh (ZeRO-1).
    ``mirrors`` finds the mirrors when ``optimizer`` cannot (it defaults to
    ``optimizer``; AvgPipe passes the per-replica optimizer's inner one, whose
    state has the same tree).

    >>> import jax, jax.numpy as jnp, optax
    >>> from jpipe._mesh import make_mesh
    >>> mesh = make_mesh(2, 4, jax.devices()[:8])
    >>> params = {"pre": {"w": jnp.zeros((64, 8))}, "stages": {"w": jnp.zeros((2, 1, 3, 8, 8))},
    ...           "post": {"w": jnp.zeros((8, 3))}}
    >>> specs = opt_specs(optax.adam(1e-3), params, mesh, "optimizer")
    >>> specs[0].mu["pre"]["w"], specs[0].mu["stages"]["w"], specs[0].count
    (P(('pipe', 'data'), None), P('pipe', None, None, None, 'data'), P())
    """
    abstract = jax.eval_shape(optimizer.init, params)
    parts = {k: jax.tree.map(lambda _, k=k: k, params[k]) for k in PARTS}
    return optax.tree_map_params(
        mirrors or optimizer, lambda leaf, param, part: _mirror_spec(leaf, param, part, mesh, shard, replicas),
        abstract, params, parts, transform_non_params=lambda _: P())


def named(mesh: Mesh, specs: PyTree) -> PyTree:
    """PartitionSpecs -> NamedShardings on ``mesh``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def param_shardings(params: Params, mesh: Mesh, shard: str | None, replicas: bool = False) -> PyTree:
    return named(mesh, param_specs(params, mesh, shard, replicas))


def opt_shardings(optimizer: optax.GradientTransformation, params: Params, mesh: Mesh,
                  shard: str | None, replicas: bool = False,
                  mirrors: optax.GradientTransformation | None = None) -> PyTree:
    return named(mesh, opt_specs(optimizer, params, mesh, shard, replicas, mirrors))


def split_axis(spec: P) -> tuple[int | None, Any]:
    """The axis of a spec split over ``data`` or the whole mesh (``pipe`` on axis 0 of stages aside)."""
    for axis, names in enumerate(spec):
        if names is not None and not (axis == 0 and names == PIPE):
            return axis, names
    return None, None
