"""The training API for Flax loops: ``init``, ``train_step``, ``to_sequential``."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpipe import _sharding
from jpipe._executor import Executor, Layout, batch_spec
from jpipe._mesh import PIPE, make_mesh
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


NAN_POLICIES = ("raise", "skip", "ignore")


class NonFiniteError(FloatingPointError):
    """A step met a NaN or inf (loss, gradients or batch) under ``nan_policy="raise"``.

    ``step`` is the failing step's number (``state.step`` after it, counting from 1)
    and ``state`` the training state without that step's update, to recover from.
    """

    def __init__(self, message: str, step: int, state: TrainState) -> None:
        super().__init__(message)
        self.step = step
        self.state = state


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


def _check_batch(batch: PyTree, plan: Plan, what: str = "batch", replicas_over_data: bool = False) -> int:
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


def _microbatch(batch: PyTree, plan: Plan) -> PyTree:
    size = jax.tree.leaves(batch)[0].shape[0] // (plan.data * plan.microbatches)
    return jax.tree.map(lambda a: jnp.asarray(a[:size]), batch)


def _check_params(params: Params, expected: Params) -> None:
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
    if not isinstance(model, Staged):
        raise TypeError(f"model must be a jpipe.Staged, got {type(model).__name__}")
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a jpipe.Plan, got {type(plan).__name__}")
    if rng is None and params is None:
        raise ValueError("give exactly one of rng= (fresh parameters) or params= (existing ones)")
    if nan_policy not in NAN_POLICIES:
        raise ValueError(f"nan_policy must be one of {list(NAN_POLICIES)}, got {nan_policy!r}")
    if plan.pipelines > 1 or plan.averaging is not None:  # AvgPipe: co-located pipelines
        from jpipe import averaging

        return averaging.init(model, plan, optimizer, example_batch, rng=rng, params=params,
                              devices=devices, nan_policy=nan_policy)
    state = abstract_state(model, plan, optimizer, example_batch, devices=devices, nan_policy=nan_policy)
    state = state.replace(rng=dropout_rng(model, rng, params, state.mesh))
    program = state.program
    shardings, opt_shardings = program.shardings
    microbatch = _microbatch(example_batch, plan)
    if params is None:
        pipelined = jax.jit(functools.partial(_init_pipelined, model, program.layout),
                            out_shardings=shardings)(rng, microbatch)
    else:
        _check_params(params, jax.eval_shape(model.init_params, jax.random.key(0), microbatch))
        pipelined = place_params(params, program.layout, shardings)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(pipelined)
    return _with_arrays(state, pipelined, opt_state)


def abstract_state(model: Staged, plan: Plan, optimizer: optax.GradientTransformation, example_batch: PyTree,
                   *, devices: Sequence[jax.Device] | None = None, nan_policy: str = "raise") -> TrainState:
    """The :class:`TrainState` that :func:`init` would build, with shape structs (carrying their
    shardings) for parameters and optimizer state: its program is built, nothing is allocated.
    Checkpoints restore into it."""
    partition = plan.stage_partition(model.num_layers)
    table = plan.table()
    mesh = make_mesh(plan.pipe, plan.data, devices)
    _check_batch(example_batch, plan, "example_batch")
    microbatch = _microbatch(example_batch, plan)
    model.check(microbatch)
    layout = Layout.from_partition(partition, plan.pipe)
    params = jax.eval_shape(functools.partial(_init_pipelined, model, layout), jax.random.key(0), microbatch)
    shardings = _sharding.param_shardings(params, mesh, plan.shard)
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_shardings = _sharding.opt_shardings(optimizer, params, mesh, plan.shard)

    def placed(tree: PyTree, where: PyTree) -> PyTree:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, where)

    return _new_state(model, plan, optimizer, table, layout, mesh, placed(params, shardings),
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


def _with_arrays(state: TrainState, params: Params, opt_state: PyTree) -> TrainState:
    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(state.mesh, P()))  # as train_step returns it
    skipped = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(state.mesh, P()))
    return state.replace(step=step, params=params, opt_state=opt_state, skipped_steps=skipped)


def _init_pipelined(model: Staged, layout: Layout, key: jax.Array, microbatch: PyTree) -> Params:
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


def _new_state(model: Staged, plan: Plan, optimizer, table, layout: Layout, mesh: Mesh, pipelined: Params,
               opt_state, example_batch: PyTree, microbatch: PyTree, nan_policy: str,
               replicas_over_data: bool = False, shardings: Any = None,
               rng: jax.Array | None = None) -> TrainState:
    """The step-0 :class:`TrainState` around placed parameters and optimizer state: builds the program."""
    executor = Executor(model, table, layout, mesh, plan.remat, replicas_over_data=replicas_over_data,
                        shard=plan.shard)
    batch_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.asarray(a).dtype), example_batch)
    program = Program(model, plan, optimizer, mesh, layout, executor, batch_spec,
                      executor.build(microbatch, pipelined), nan_policy, shardings)
    return _with_arrays(TrainState(None, pipelined, opt_state, program, None, rng), pipelined, opt_state)


def _check_step_batch(state: TrainState, batch: PyTree) -> None:
    want = state.program.batch_spec
    if jax.tree.structure(batch) != jax.tree.structure(want):
        raise ValueError(f"batch has structure {jax.tree.structure(batch)}, but the state was "
                         f"initialised with {jax.tree.structure(want)}")
    size = _check_batch(batch, state.plan, replicas_over_data=state.program.executor.replicas_over_data)
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
    if state.plan.pipelines > 1 or state.plan.averaging is not None:
        from jpipe import averaging

        return averaging.centre(state)
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
    if state.plan.pipelines > 1 or state.plan.averaging is not None:
        seq = to_sequential(state)  # the centre
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
