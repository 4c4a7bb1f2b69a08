"""The training state and how it is built: the one seam that ``jpipe.init``, AvgPipe's
``averaging.init`` and checkpoint restores share.

- :class:`TrainState` (a pytree) holds the arrays; its :class:`Program` everything static.
- :func:`check_batch`, :func:`check_params`: the boundary checks of every builder.
- :func:`init_pipelined` (fresh parameters) and :func:`place_params` (existing ones) give
  parameters in the pipelined layout, each device computing or receiving only what it holds.
- :func:`abstract_state` and :func:`build_state` wrap placed arrays into a state whose program
  is built; where the optimizer state lives is :func:`jpipe._sharding.opt_shardings`'s rule.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpipe import _sharding
from jpipe._executor import Executor, Layout
from jpipe._mesh import make_mesh
from jpipe._model import Params, PyTree, Staged
from jpipe._plan import Plan


def per_program(build):
    """Caches ``build(program)`` for as long as the program lives (a ``functools.cache`` would keep
    every program, and what its jitted functions hold, alive for the whole process)."""
    cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @functools.wraps(build)
    def get(program):
        value = cache.get(program)
        if value is None:
            value = cache[program] = build(program)
        return value

    return get


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """Everything static about a training run; hashed by identity so jit caches per run."""

    model: Staged
    plan: Plan
    optimizer: optax.GradientTransformation
    mesh: Mesh
    layout: Layout
    executor: Executor
    batch_spec: PyTree  # ShapeDtypeStructs of the global batch
    grads: Any  # (params, batch) -> (loss, grads), a shard_map'ed function
    nan_policy: str = "raise"  # what train_step does on a non-finite loss: see NAN_POLICIES
    shardings: Any = None  # (params, opt_state) NamedShardings: where train_step leaves the state
    # state -> the model's parameters in sequential layout, where the default (the pipelined
    # parameters) does not apply: AvgPipe's states give their centre
    sequential: Callable[[TrainState], Params] | None = None


NAN_POLICIES = ("raise", "skip", "ignore")


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["step", "params", "opt_state", "skipped_steps", "rng"],
    meta_fields=["program"]
)
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Parameters (pipelined layout), optimizer state, step count and skipped steps; a pytree.

    ``rng`` seeds the stochastic layers (dropout) of models that have them (``None``
    otherwise): step ``s`` draws from ``jax.random.fold_in(rng, s)`` (:func:`step_rng`).
    """

    step: jax.Array
    params: Params
    opt_state: optax.OptState
    program: Program
    skipped_steps: jax.Array | None = None  # steps whose update was skipped (non-finite loss)
    rng: jax.Array | None = None  # stochastic models: the key their training steps draw from

    @property
    def plan(self) -> Plan:
        return self.program.plan

    @property
    def mesh(self) -> Mesh:
        return self.program.mesh

    @property
    def table(self):
        return self.program.executor.table

    def replace(self, **changes: Any) -> TrainState:
        return dataclasses.replace(self, **changes)


def check_init_arguments(model: Staged, plan: Plan, rng: jax.Array | None, params: Params | None,
                         nan_policy: str) -> None:
    """What every state builder checks first: the types, a key or parameters, a known ``nan_policy``."""
    if not isinstance(model, Staged):
        raise TypeError(f"model must be a jpipe.Staged, got {type(model).__name__}")
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a jpipe.Plan, got {type(plan).__name__}")
    if rng is None and params is None:
        raise ValueError("give exactly one of rng= (fresh parameters) or params= (existing ones)")
    if nan_policy not in NAN_POLICIES:
        raise ValueError(f"nan_policy must be one of {list(NAN_POLICIES)}, got {nan_policy!r}")


def check_batch(batch: PyTree, plan: Plan, what: str = "batch", replicas_over_data: bool = False) -> int:
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError(f"{what} is empty; pass a pytree of arrays with the batch on the leading axis")
    sizes = {np.shape(a)[0] if np.ndim(a) else None for a in leaves}
    if None in sizes:
        raise ValueError(f"{what} has a scalar leaf; every leaf needs the batch on its leading axis")
    if len(sizes) != 1:
        raise ValueError(f"{what} leaves disagree on the leading (batch) size: {sorted(sizes)}")
    (size,) = sizes
    if replicas_over_data:  # co-located pipelines: [B, R, ...], `data` splits R, micro-batches split B
        if size % plan.microbatches:
            raise ValueError(
                f"{what} has {size} samples per pipeline, not divisible by microbatches = "
                f"{plan.microbatches}; use a per-pipeline batch size that is a multiple of {plan.microbatches}")
        replicas = {np.shape(a)[1] if np.ndim(a) > 1 else None for a in leaves}
        if None in replicas or len(replicas) != 1 or next(iter(replicas)) % plan.data:
            raise ValueError(
                f"{what} leaves have replica axes (the second) of sizes {sorted(map(str, replicas))}; they "
                f"must all be pipelines x data, a multiple of data = {plan.data}")
        return size
    per = plan.data * plan.microbatches
    if size % per:
        raise ValueError(
            f"{what} has {size} samples, not divisible by data x microbatches = {plan.data} x "
            f"{plan.microbatches} = {per}; use a batch size that is a multiple of {per}"
        )
    return size


def batch_size_of(batch: PyTree) -> int:
    """The leading (batch) size that every array leaf of ``batch`` shares.

    >>> batch_size_of({"x": np.ones((8, 3)), "y": np.zeros(8)})
    8
    """
    sizes = {np.shape(a)[0] for a in jax.tree.leaves(batch) if np.ndim(a)}
    if len(sizes) != 1:
        raise ValueError(f"example_batch needs one leading (batch) size on every leaf, got {sorted(sizes)}")
    return int(sizes.pop())


def first_microbatch(batch: PyTree, plan: Plan) -> PyTree:
    size = jax.tree.leaves(batch)[0].shape[0] // (plan.data * plan.microbatches)
    return jax.tree.map(lambda a: jnp.asarray(a[:size]), batch)


def check_params(params: Params, expected: Params) -> None:
    if not isinstance(params, dict) or set(params) != {"pre", "layers", "post"}:
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"params must be a dict with keys 'pre', 'layers', 'post' "
                         f"(what jpipe.to_sequential returns), got {got}")
    if len(params["layers"]) != len(expected["layers"]):
        raise ValueError(f"params['layers'] has {len(params['layers'])} entries, the model has "
                         f"{len(expected['layers'])} layers")
    for key in ("pre", "post"):
        _check_tree(params[key], expected[key], f"params[{key!r}]")
    for i, layer in enumerate(params["layers"]):
        _check_tree(layer, expected["layers"][i], f"params['layers'][{i}]")


def _check_tree(got: PyTree, want: PyTree, where: str) -> None:
    if jax.tree.structure(got) != jax.tree.structure(want):
        raise ValueError(f"{where} has structure {jax.tree.structure(got)}, expected {jax.tree.structure(want)}")
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        if np.shape(g) != w.shape:
            raise ValueError(f"{where}{jax.tree_util.keystr(path)} has shape {np.shape(g)}, expected {w.shape}")


def abstract_state(model: Staged, plan: Plan, optimizer: optax.GradientTransformation, example_batch: PyTree,
                   *, devices: Sequence[jax.Device] | None = None, nan_policy: str = "raise") -> TrainState:
    """The :class:`TrainState` that :func:`init` would build, with shape structs (carrying their
    shardings) for parameters and optimizer state: its program is built, nothing is allocated.
    Checkpoints restore into it."""
    partition = plan.stage_partition(model.num_layers)
    table = plan.table()
    mesh = make_mesh(plan.pipe, plan.data, devices)
    check_batch(example_batch, plan, "example_batch")
    microbatch = first_microbatch(example_batch, plan)
    model.check(microbatch)
    layout = Layout.from_partition(partition, plan.pipe)
    params = jax.eval_shape(functools.partial(init_pipelined, model, layout), jax.random.key(0), microbatch)
    shardings = _sharding.param_shardings(params, mesh, plan.shard)
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_shardings = _sharding.opt_shardings(optimizer, params, mesh, plan.shard)

    def placed(tree: PyTree, where: PyTree) -> PyTree:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, where)

    return build_state(model, plan, optimizer, table, layout, mesh, placed(params, shardings),
                      placed(opt_state, opt_shardings), example_batch, microbatch, nan_policy,
                      shardings=(shardings, opt_shardings))


_DROPOUT_STREAM = 0x64726F70  # "drop": dropout keys are a stream of the init key of their own


def dropout_rng(model: Staged, rng: jax.Array | None, params: Params | None, mesh: Mesh) -> jax.Array | None:
    """The key a stochastic model's steps draw from (``None`` for other models), from ``init``'s
    ``rng``; with ``params=`` a stochastic model needs ``rng=`` too, other models refuse both."""
    if not model.stochastic:
        if rng is not None and params is not None:
            raise ValueError("give exactly one of rng= (fresh parameters) or params= (existing ones); a "
                             "model without stochastic layers takes no key with params=")
        return None
    if rng is None:
        raise ValueError("the model has stochastic layers (dropout): pass rng= as well as params=; it "
                         "seeds their masks (step s draws from jax.random.fold_in(rng', s))")
    if not jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(jnp.asarray(rng, jnp.uint32))
    return jax.device_put(jax.random.fold_in(rng, _DROPOUT_STREAM), NamedSharding(mesh, P()))


def with_fresh_counters(state: TrainState, params: Params, opt_state: PyTree) -> TrainState:
    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(state.mesh, P()))  # as train_step returns it
    skipped = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(state.mesh, P()))
    return state.replace(step=step, params=params, opt_state=opt_state, skipped_steps=skipped)


def init_pipelined(model: Staged, layout: Layout, key: jax.Array, microbatch: PyTree) -> Params:
    """Fresh parameters in the pipelined layout; under jit with output shardings each device computes
    only what it holds, and the values are those of ``model.init_params(key, ...)`` on every plan."""
    p = model.init_slots(key, microbatch, layout.slots())
    return {"pre": p["pre"], "stages": p["layers"], "post": p["post"]}


def place_params(params: Params, layout: Layout, shardings: PyTree) -> Params:
    """Sequential parameters (host or device arrays) -> the pipelined layout, built shard by shard.

    Each device receives only the slice it holds, read from the given arrays
    (``np.asarray`` of each), so the whole model is never on one device. The
    result never aliases the given arrays (``train_step`` donates the state).
    """
    host: dict = {}

    def array(leaf: Any) -> np.ndarray:
        if id(leaf) not in host:
            host[id(leaf)] = (leaf, np.asarray(leaf))  # keep `leaf` alive: ids are reused
        return host[id(leaf)][1]

    def edge(leaf: Any, sharding: NamedSharding) -> jax.Array:
        shape = np.shape(leaf)
        return jax.make_array_from_callback(shape, sharding, lambda index: np.array(array(leaf)[index]))

    slots = layout.slots()

    def stage(sharding: NamedSharding, *layers: Any) -> jax.Array:
        inner = np.shape(layers[0])
        dtype = np.result_type(array(layers[0]))

        def shard(index: tuple) -> np.ndarray:
            index = tuple(index) + (slice(None),) * (3 + len(inner) - len(index))
            rows = slots[index[:3]]
            out = np.zeros((*rows.shape, *np.empty(inner)[index[3:]].shape), dtype)
            for pos, layer in np.ndenumerate(rows):
                if layer >= 0:
                    out[pos] = array(layers[layer])[index[3:]]
            return out

        return jax.make_array_from_callback((*slots.shape, *inner), sharding, shard)

    return {"pre": jax.tree.map(edge, params["pre"], shardings["pre"]),
            "stages": jax.tree.map(stage, shardings["stages"], *params["layers"]),
            "post": jax.tree.map(edge, params["post"], shardings["post"])}


def build_state(model: Staged, plan: Plan, optimizer, table, layout: Layout, mesh: Mesh, pipelined: Params,
               opt_state, example_batch: PyTree, microbatch: PyTree, nan_policy: str,
               replicas_over_data: bool = False, shardings: Any = None,
               rng: jax.Array | None = None,
               sequential: Callable[[TrainState], Params] | None = None) -> TrainState:
    """The step-0 :class:`TrainState` around placed parameters and optimizer state: builds the program.

    ``sequential`` is what ``jpipe.to_sequential`` returns for such a state where it is not the
    pipelined parameters themselves (AvgPipe: the centre model).
    """
    executor = Executor(model, table, layout, mesh, plan.remat, replicas_over_data=replicas_over_data,
                        shard=plan.shard)
    batch_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.asarray(a).dtype), example_batch)
    program = Program(model, plan, optimizer, mesh, layout, executor, batch_spec,
                      executor.build(microbatch, pipelined), nan_policy, shardings, sequential)
    return with_fresh_counters(TrainState(None, pipelined, opt_state, program, None, rng), pipelined, opt_state)


