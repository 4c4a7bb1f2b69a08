"""Sharded checkpoints with orbax-checkpoint, in a layout that does not depend on the mesh.

A :class:`Checkpointer` saves every ``every`` steps (asynchronously: training
goes on while orbax writes), keeps the last ``keep`` and restores onto any
plan. Nothing is gathered: every array is saved sharded, and each process
writes only its own shards. Each layer of a stage stack (parameters and the
optimizer-state leaves that mirror them) is its own array,
``params['layers'][i]...``, so the checkpoint is the sequential model whatever
the plan. Restoring onto a plan reads each device's shards and moves every
layer to the devices of its new stage in one program: a run saved with
pipe=4, data=2 resumes with pipe=2, data=4, or any other partition or
``Plan.shard`` level, bit for bit, and no device holds much more than its own
share on the way (the programs' temp bytes are at most about one share). A
synchronous checkpoint also restores onto co-located pipelines (AvgPipe):
every pipeline starts from it.

Orbax writes each checkpoint to a temporary directory and renames it when
complete, so a write cut short (a killed process) is never listed; on top, a
checkpoint counts only with both its parts, and restoring checks a
fingerprint of every array, so a damaged file fails with
:class:`CheckpointError` instead of loading wrong numbers.

Training state only: the data position is the caller's (make batches a
function of ``state.step``, or pass it in ``extra``).

>>> import tempfile, jax, jax.numpy as jnp, optax, jpipe
>>> from jpipe import models
>>> from jpipe.checkpoint import Checkpointer
>>> model = models.mlp(in_dim=3, hidden=8, out_dim=1, num_layers=2)
>>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros((8, 1))}
>>> state = jpipe.init(model, jpipe.Plan(2, 1, 2), optax.adam(1e-2), batch, rng=jax.random.key(0),
...                    devices=jax.devices()[:2])
>>> ckpt = Checkpointer(tempfile.mkdtemp(), every=2, keep=2)
>>> for _ in range(6):
...     state, metrics = jpipe.train_step(state, batch)
...     _ = ckpt.save(state)
>>> ckpt.wait(); ckpt.all_steps()
[4, 6]
>>> again = ckpt.restore(model, jpipe.Plan(1, 2, 2), optax.adam(1e-2), batch, devices=jax.devices()[:2])
>>> int(again.step), again.plan.pipe, again.plan.data
(6, 1, 2)
>>> ckpt.close()
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Self

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpipe import _sharding, averaging
from jpipe._executor import Layout
from jpipe._init import init
from jpipe._mesh import DATA, PIPE
from jpipe._model import PyTree, Staged
from jpipe._plan import Plan
from jpipe._state import TrainState, abstract_state, check_batch, first_microbatch

FORMAT = "jpipe-checkpoint-2"
_PARAMS, _STATE, _META = "params", "state", "meta"  # state: optimizer state and step counters
_ITEMS = (_PARAMS, _STATE, _META)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or does not fit the model/optimizer."""


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - orbax is a dependency
        raise ImportError("jpipe.checkpoint needs orbax-checkpoint: pip install orbax-checkpoint") from e
    return ocp


def _fingerprint(a: jax.Array) -> jax.Array:
    """An order-independent uint32 checksum of the bits of ``a`` (any single bit flip changes it)."""
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    if a.dtype == jnp.bool_:
        a = a.astype(jnp.uint8)
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[a.dtype.itemsize]
    words = jax.lax.bitcast_convert_type(a, bits).astype(jnp.uint32)
    # The row-major index of every element, built from iotas rather than by flattening, which would
    # regather an array split on any axis but the first.
    index, stride = jnp.zeros((), jnp.uint32), 1
    for axis in reversed(range(words.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    weights = index * jnp.uint32(2654435761) * jnp.uint32(2) + jnp.uint32(1)  # odd: no bit flip cancels
    return jnp.sum(words * weights, dtype=jnp.uint32) ^ jnp.uint32(words.size % 2**32)


_fingerprints = jax.jit(lambda xs: [_fingerprint(x) for x in xs])


def _entries(tree: PyTree, prefix: str) -> list[tuple[str, Any]]:
    return [(f"{prefix}{jax.tree_util.keystr(path)}", leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


class Checkpointer:
    """Saves and restores :class:`jpipe.TrainState` in ``directory`` with orbax-checkpoint.

    ``every``: :meth:`save` writes only when ``state.step`` is a multiple of it.
    ``keep``: how many of the newest checkpoints to keep (``None``: all).
    ``async_save``: write in the background (call :meth:`wait` or :meth:`close`
    before reading them back or exiting). In a multi-process run every process
    calls :meth:`save` and :meth:`restore` alike.
    """

    def __init__(self, directory: str | os.PathLike, *, every: int = 1, keep: int | None = 3,
                 async_save: bool = True) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be an int >= 1 or None, got {keep!r}")
        ocp = _orbax()
        self.directory = Path(directory).absolute()
        self.every = every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
            cleanup_tmp_directories=True)  # leftovers of writes cut short
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)

    # -- which checkpoints there are --------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (a write in progress or cut short is not one)."""
        self._manager.reload()
        return sorted(s for s in self._manager.all_steps() if self._complete(s))

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _complete(self, step: int) -> bool:
        path = self.directory / str(step)
        return all((path / item).is_dir() and any((path / item).iterdir()) for item in _ITEMS)

    # -- saving -----------------------------------------------------------------------------
    def save(self, state: TrainState, *, force: bool = False, extra: dict | None = None) -> bool:
        """Saves ``state`` if ``state.step`` is a multiple of ``every`` (or ``force``); returns whether it did.

        ``extra`` is a JSON-serialisable dict stored alongside (e.g. a data
        position); read it back with :meth:`extra`. Returns at once when
        saving asynchronously; the checkpoint counts once it is complete.
        """
        if not isinstance(state, TrainState):
            raise TypeError(f"save takes a jpipe.TrainState, got {type(state).__name__}")
        step = int(state.step)
        if not force and step % self.every:
            return False
        if step in self._manager.all_steps():
            return False
        arrays, meta = _to_checkpoint(state)
        meta["extra"] = extra or {}
        ocp = _orbax()
        self._manager.save(step, args=ocp.args.Composite(
            **{_PARAMS: ocp.args.StandardSave({k: v for k, v in arrays.items() if k.startswith("p")}),
               _STATE: ocp.args.StandardSave({k: v for k, v in arrays.items() if not k.startswith("p")}),
               _META: ocp.args.JsonSave(meta)}))
        return True

    def wait(self) -> None:
        """Blocks until every save has been written."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- restoring --------------------------------------------------------------------------
    def _pick(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(f"no complete checkpoint for step {step} in {self.directory}; "
                                    f"complete ones: {steps}")
        return step

    def metadata(self, step: int | None = None) -> dict:
        """The stored description of a checkpoint (default: the latest): step, plan, arrays, extra."""
        step = self._pick(step)
        ocp = _orbax()
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
        except Exception as e:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is damaged: its metadata "
                                  f"cannot be read ({type(e).__name__}: {e}); restore an earlier step with "
                                  f"step=, complete ones: {self.all_steps()}") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is not a {FORMAT} checkpoint")
        return meta

    def extra(self, step: int | None = None) -> dict:
        """The ``extra`` dict saved with a checkpoint (default: the latest)."""
        return self.metadata(step)["extra"]

    def restore(
        self,
        model: Staged,
        plan: Plan,
        optimizer: optax.GradientTransformation,
        example_batch: PyTree,
        *,
        step: int | None = None,
        devices: Sequence[jax.Device] | None = None,
        nan_policy: str = "raise",
    ) -> TrainState:
        """A :class:`jpipe.TrainState` for ``plan`` from a checkpoint (default: the latest complete one).

        Takes the arguments of :func:`jpipe.init`; ``plan`` may differ from the
        one that saved (mesh shape, partition, schedule). The optimizer must be
        the same kind (its state is checked leaf by leaf). Parameters and
        optimizer state are exactly the saved ones.
        """
        step = self._pick(step)
        meta = self.metadata(step)
        if plan.pipelines > 1 or plan.averaging is not None:
            if meta["plan"].get("pipelines", 1) == 1:  # a synchronous run: every pipeline starts from it
                return self._restore_into_pipelines(model, plan, optimizer, example_batch, step, devices,
                                                    nan_policy)
            fresh = init(model, plan, optimizer, example_batch, rng=jax.random.key(0), devices=devices,
                         nan_policy=nan_policy)
            return self.restore_like(fresh, step=step)
        check_batch(example_batch, plan, "example_batch")
        want = _entries(jax.eval_shape(model.init_params, jax.random.key(0), first_microbatch(example_batch, plan)),
                        "params")
        _compare(meta["params"], want, step, self.directory, "the model",
                 "restore with the model that was saved (same layers, sizes and dtypes)")
        # The new plan's state as shape structs: every array is then read straight into its shards.
        return self.restore_like(abstract_state(model, plan, optimizer, example_batch, devices=devices,
                                                nan_policy=nan_policy), step=step)

    def _restore_into_pipelines(self, model: Staged, plan: Plan, optimizer: optax.GradientTransformation,
                                example_batch: PyTree, step: int, devices: Sequence[jax.Device] | None,
                                nan_policy: str) -> TrainState:
        """A synchronous checkpoint onto co-located pipelines (AvgPipe): restored onto the synchronous
        plan with the same devices and stages, then copied into every pipeline on its own devices."""
        sync_plan = dataclasses.replace(plan, pipelines=1, averaging=None, shard="parameters",
                                        partition=plan.stage_partition(model.num_layers))
        # Any batch of the synchronous plan's shape: only its shapes are used.
        one = averaging.batch_slice(example_batch, 0)
        sync_batch = jax.tree.map(lambda a: jnp.concatenate([jnp.asarray(a)] * plan.data), one)
        sync = self.restore(model, sync_plan, optimizer, sync_batch, step=step, devices=devices,
                            nan_policy=nan_policy)
        return averaging.from_synchronous(sync, plan, optimizer, example_batch)

    def restore_like(self, state: TrainState, *, step: int | None = None) -> TrainState:
        """Restores into the plan, model and optimizer of an existing ``state`` (no new ``jpipe.init``).

        The result shares ``state``'s compiled step, so resuming costs no
        compilation; ``state``'s own arrays are not used (it may be donated).
        """
        if not isinstance(state, TrainState):
            raise TypeError(f"restore_like takes a jpipe.TrainState, got {type(state).__name__}")
        step = self._pick(step)
        meta = self.metadata(step)
        entries = _entries_of(state)
        want = [(e.path, jax.ShapeDtypeStruct(e.shape, e.leaf.dtype)) for e in entries]
        _compare(meta["params"], [w for w in want if w[0].startswith("params")], step, self.directory,
                 "the model", "restore with the model that was saved (same layers, sizes and dtypes)")
        _compare(meta["opt_state"], [w for w in want if w[0].startswith("opt_state")], step, self.directory,
                 "the optimizer",
                 "restore with the optimizer it was saved with (the same optax chain), or start the "
                 "optimizer afresh from the parameters: jpipe.init(..., params=ckpt.restore_params())")
        keys = {e["path"]: f"p{i:05d}" for i, e in enumerate(meta["params"])}
        keys.update({e["path"]: f"o{i:05d}" for i, e in enumerate(meta["opt_state"])})
        conv = _converter(state)
        replicated = NamedSharding(state.mesh, P())
        abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
                    "skipped_steps": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)}
        for e, shape, sharding in zip(entries, conv.shapes, conv.shardings):  # each process reads its shards
            abstract[keys[e.path]] = jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)
        stochastic = state.program.model.stochastic
        if stochastic:
            if "rng" not in meta:
                raise CheckpointError(
                    f"the checkpoint at step {step} in {self.directory} has no dropout key, but the model "
                    f"has stochastic layers: it was saved for a model without them; restore its parameters "
                    f"with jpipe.init(..., params=ckpt.restore_params(), rng=...)")
            abstract["rng"] = jax.ShapeDtypeStruct(tuple(meta["rng"]["shape"]), jnp.uint32,
                                                   sharding=replicated)
        arrays = self._read(step, abstract)
        rng = jax.random.wrap_key_data(arrays["rng"], impl=meta["rng"]["impl"]) if stochastic else None
        params, opt_state, prints = conv.from_checkpoint([arrays[keys[e.path]] for e in entries])
        saved = {e["path"]: e["fingerprint"] for e in meta["params"] + meta["opt_state"]}
        _verify([(e.path, saved[e.path]) for e in entries], [int(x) for x in jax.device_get(prints)], step,
                self.directory)
        return state.replace(params=params, opt_state=opt_state, step=arrays["step"],
                             skipped_steps=arrays["skipped_steps"], rng=rng)

    def restore_params(self, step: int | None = None, device: jax.Device | None = None) -> dict:
        """Only the parameters, in sequential layout on one device: for ``model.loss_value`` or ``jpipe.init``.

        For models larger than one device, restore onto a plan with :meth:`restore`.
        """
        step = self._pick(step)
        meta = self.metadata(step)
        one = jax.sharding.SingleDeviceSharding(device or jax.local_devices()[0])
        abstract = {f"p{i:05d}": jax.ShapeDtypeStruct(tuple(e["shape"]), np.dtype(e["dtype"]), sharding=one)
                    for i, e in enumerate(meta["params"])}
        arrays = self._read(step, abstract)
        flat = [arrays[f"p{i:05d}"] for i in range(len(meta["params"]))]
        prints = jax.device_get(_fingerprints(flat))
        _verify([(e["path"], e["fingerprint"]) for e in meta["params"]], [int(x) for x in prints], step,
                self.directory)
        return _tree_from_paths([e["path"] for e in meta["params"]], flat)["params"]

    def _read(self, step: int, abstract: dict) -> dict:
        ocp = _orbax()
        try:
            parts = {_PARAMS: {k: v for k, v in abstract.items() if k.startswith("p")},
                     _STATE: {k: v for k, v in abstract.items() if not k.startswith("p")}}
            args = {item: ocp.args.StandardRestore(part) for item, part in parts.items() if part}
            read = self._manager.restore(step, args=ocp.args.Composite(**args))
            return {k: v for item in args for k, v in read[item].items()}
        except Exception as e:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} is damaged or incomplete: its arrays cannot be "
                f"read ({type(e).__name__}: {str(e)[:500]}); restore an earlier step with step=, complete "
                f"ones: {self.all_steps()}") from e


def _is_stage(sharding: NamedSharding) -> bool:
    """A stage stack ``[devices, chunks, layers, ...]``: split over ``pipe`` alone on its first axis."""
    return len(sharding.spec) > 0 and sharding.spec[0] == PIPE


def _layer_path(path: str, layer: int) -> str:
    if "['stages']" not in path:
        raise AssertionError(f"a stage stack outside 'stages': {path}")
    return path.replace("['stages']", f"['layers'][{layer}]", 1)


class _Entry(NamedTuple):
    path: str
    leaf: Any  # an array of the state, or its shape struct
    position: tuple[int, int, int] | None  # (device, chunk, j) of one layer of a stage stack

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.leaf.shape[3:] if self.position else self.leaf.shape)


def _entries_of(state: TrainState) -> list[_Entry]:
    """Every array a checkpoint of ``state`` holds; stage stacks give one entry per layer, in order."""
    positions = state.program.layout.positions()
    out = []
    for prefix, tree, shardings in (("params", state.params, state.program.shardings[0]),
                                    ("opt_state", state.opt_state, state.program.shardings[1])):
        for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(shardings),
                                          strict=True):
            name = f"{prefix}{jax.tree_util.keystr(path)}"
            if _is_stage(sharding):
                out += [_Entry(_layer_path(name, i), leaf, pos) for i, pos in enumerate(positions)]
            else:
                out.append(_Entry(name, leaf, None))
    return out


class _StageMove(NamedTuple):
    """How one stage leaf's layers travel between the state's stack and the checkpoint's arrays.

    A layer lives on its ``pipe`` row (split over ``data`` on ``data_axis`` where
    the plan shards it). In the checkpoint it is split over ``pipe`` as well, on
    ``pipe_axis``: the ``P`` layers at the same ``(chunk, j)`` of the ``P`` rows
    then trade pieces in one ``all_to_all``, so a device never holds more than
    its share plus one such group of pieces. With no axis that ``pipe`` divides,
    the layers are gathered over ``pipe`` instead (small leaves: biases of odd size).
    """

    spec: P  # of the stage stack
    data_axis: int | None  # layer axis split over `data`
    pipe_axis: int | None  # layer axis split over `pipe` in the checkpoint; None: gathered over `pipe`

    @classmethod
    def of(cls, shape: tuple[int, ...], spec: P, mesh: Mesh) -> _StageMove:
        layer = shape[_sharding.STAGE_HEAD:]
        data_axis = next((i - _sharding.STAGE_HEAD for i, n in enumerate(spec)
                          if i >= _sharding.STAGE_HEAD and n is not None), None)
        local = [n // (mesh.shape[DATA] if i == data_axis else 1) for i, n in enumerate(layer)]
        if data_axis is not None and _sharding.shard_axis((local[data_axis],), mesh.shape[PIPE]) is not None:
            pipe_axis = data_axis  # split the data pieces further
        else:
            pipe_axis = _sharding.shard_axis(tuple(n if i != data_axis else 0 for i, n in enumerate(local)),
                                             mesh.shape[PIPE])
        return cls(spec, data_axis, pipe_axis)

    def layer_spec(self, ndim: int) -> P:
        spec: list[Any] = [None] * ndim
        if self.data_axis is not None:
            spec[self.data_axis] = DATA
        if self.pipe_axis is not None:
            spec[self.pipe_axis] = (DATA, PIPE) if self.pipe_axis == self.data_axis else PIPE
        return P(*spec)

    def to_layers(self, stack: jax.Array, layout: Layout) -> list[jax.Array]:
        """Inside ``shard_map``: this device's ``[1, chunks, J, ...]`` stack -> its piece of every layer."""
        pieces = {}
        for c in range(layout.num_chunks):
            for j in range(layout.max_layers):
                mine = stack[0, c, j]
                if self.pipe_axis is None:
                    rows = jax.lax.all_gather(mine, PIPE)
                else:
                    rows = jax.lax.all_to_all(mine[None], PIPE, self.pipe_axis + 1, 0, tiled=True)
                for d in range(layout.num_devices):
                    pieces[d, c, j] = rows[d]
        return [pieces[p] for p in layout.positions()]

    def from_layers(self, layers: list[jax.Array], layout: Layout) -> jax.Array:
        """The inverse of :meth:`to_layers`: pieces of every layer -> this device's stack."""
        by_position = dict(zip(layout.positions(), layers, strict=True))
        like = layers[0]
        stack = None
        for c in range(layout.num_chunks):
            for j in range(layout.max_layers):
                rows = jnp.stack([by_position.get((d, c, j), jnp.zeros_like(like))
                                  for d in range(layout.num_devices)])
                if self.pipe_axis is None:
                    slot = rows[jax.lax.axis_index(PIPE)]
                else:
                    slot = jax.lax.all_to_all(rows, PIPE, 0, self.pipe_axis + 1, tiled=True)[0]
                if stack is None:  # written in place, one slot at a time
                    stack = jnp.zeros((1, layout.num_chunks, layout.max_layers, *slot.shape), slot.dtype)
                stack = stack.at[0, c, j].set(slot)
        return stack


class _Converter:
    """A plan's two programs between its state and the checkpoint's arrays.

    Both are compiled for the whole mesh, so every process runs them and every
    array they give is a global one that orbax writes shard by shard (orbax
    refuses arrays that live on one process's devices only, as a layer on its
    stage's devices would). Leaves outside the stage stacks keep the state's
    sharding; each layer of a stack is split over ``pipe`` and ``data`` (see
    :class:`_StageMove`), and moves with explicit collectives, so neither
    program holds more than about one device's share of the state in temp bytes.
    """

    def __init__(self, state: TrainState) -> None:
        program = state.program
        mesh, layout = program.mesh, program.layout
        entries = _entries_of(state)
        leaves = jax.tree.leaves((state.params, state.opt_state))
        shardings = jax.tree.leaves(program.shardings)
        treedef = jax.tree.structure((state.params, state.opt_state))  # no reference to the arrays
        self.shapes = [jax.ShapeDtypeStruct(e.shape, e.leaf.dtype) for e in entries]
        moves = [_StageMove.of(tuple(a.shape), s.spec, mesh) if _is_stage(s) else None
                 for a, s in zip(leaves, shardings, strict=True)]
        stage_specs = [m.spec for m in moves if m is not None]
        layer_specs = [m.layer_spec(len(a.shape) - _sharding.STAGE_HEAD)
                       for a, m in zip(leaves, moves) if m is not None]
        count = len(layout.positions())
        self.shardings = []  # of each checkpoint array, in entry order
        for a, s, m in zip(leaves, shardings, moves):
            if m is None:
                self.shardings.append(s)
            else:
                self.shardings += [NamedSharding(mesh, m.layer_spec(len(a.shape) - _sharding.STAGE_HEAD))] * count
        stage_moves = [m for m in moves if m is not None]

        def split(stacks: list) -> list:
            return [layer for stack, m in zip(stacks, stage_moves) for layer in m.to_layers(stack, layout)]

        def join(layers: list) -> list:
            return [m.from_layers(layers[i * count:(i + 1) * count], layout) for i, m in enumerate(stage_moves)]

        split_map = jax.shard_map(split, mesh=mesh, in_specs=(stage_specs,),
                                  out_specs=[s for s in layer_specs for _ in range(count)], check_vma=False)
        join_map = jax.shard_map(join, mesh=mesh, in_specs=([s for s in layer_specs for _ in range(count)],),
                                 out_specs=stage_specs, check_vma=False)

        def to_checkpoint(params: PyTree, opt_state: PyTree):
            flat = jax.tree.leaves((params, opt_state))
            layers = iter(split_map([a for a, m in zip(flat, moves) if m is not None]))
            arrays = []
            for a, m in zip(flat, moves):
                arrays += [a] if m is None else [next(layers) for _ in range(count)]
            return arrays, [_fingerprint(a) for a in arrays]

        kept_mask = [m is None for m in moves for _ in range(1 if m is None else count)]

        def from_checkpoint(kept: list, layers: list):
            kept_it, stacks = iter(kept), iter(join_map(layers))
            flat = [next(kept_it) if m is None else next(stacks) for m in moves]
            params, opt_state = jax.tree.unflatten(treedef, flat)
            kept_it, layers_it = iter(kept), iter(layers)
            return params, opt_state, [_fingerprint(next(kept_it if k else layers_it)) for k in kept_mask]

        replicated = NamedSharding(mesh, P())
        self.to_checkpoint = jax.jit(to_checkpoint, out_shardings=(self.shardings, replicated))
        # The kept arrays, just read, are donated: they become the state's leaves without a copy.
        self.join = jax.jit(from_checkpoint, out_shardings=(*program.shardings, replicated), donate_argnums=0)
        self._kept_mask = kept_mask

    def split_read(self, arrays: list) -> tuple[list, list]:
        """The arrays read, in entry order -> ``join``'s arguments: (kept leaves, layers of the stacks)."""
        return ([a for a, k in zip(arrays, self._kept_mask) if k],
                [a for a, k in zip(arrays, self._kept_mask) if not k])

    def from_checkpoint(self, arrays: list) -> tuple[PyTree, PyTree, list]:
        """The arrays read (donated) -> ``(params, opt_state, fingerprints)`` of the plan."""
        return self.join(*self.split_read(arrays))


_CONVERTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _converter(state: TrainState) -> _Converter:
    conv = _CONVERTERS.get(state.program)
    if conv is None:
        conv = _CONVERTERS[state.program] = _Converter(state)
    return conv


def _to_checkpoint(state: TrainState) -> tuple[dict, dict]:
    """The state's arrays as the checkpoint holds them (stage stacks cut into layers), and their description."""
    program = state.program
    entries = _entries_of(state)
    arrays_list, prints = _converter(state).to_checkpoint(state.params, state.opt_state)
    prints = [int(x) for x in jax.device_get(prints)]
    params, opt = [], []
    arrays = {}
    for path, array, fingerprint in zip((e.path for e in entries), arrays_list, prints):
        group = params if path.startswith("params") else opt
        key = f"{'p' if group is params else 'o'}{len(group):05d}"
        group.append({"path": path, "shape": list(array.shape), "dtype": str(array.dtype),
                      "fingerprint": fingerprint})
        arrays[key] = array
    replicated = NamedSharding(state.mesh, P())
    skipped = state.skipped_steps if state.skipped_steps is not None else jnp.zeros((), jnp.int32)
    arrays["step"] = jax.device_put(state.step.astype(jnp.int32), replicated)
    arrays["skipped_steps"] = jax.device_put(jnp.asarray(skipped, jnp.int32), replicated)
    extra = {}
    if state.rng is not None:  # a stochastic model's dropout key: the resumed steps draw the same masks
        arrays["rng"] = jax.device_put(jax.random.key_data(state.rng), replicated)
        extra["rng"] = {"shape": list(arrays["rng"].shape), "impl": str(jax.random.key_impl(state.rng))}
    plan = program.plan
    return arrays, {
        **extra,
        "format": FORMAT,
        "step": int(jax.device_get(state.step)),
        "num_layers": program.model.num_layers,
        "plan": {"pipe": plan.pipe, "data": plan.data, "microbatches": plan.microbatches,
                 "schedule": plan.schedule if isinstance(plan.schedule, str) else repr(plan.schedule),
                 "partition": [int(n) for n in program.layout.counts.T.reshape(-1)], "remat": plan.remat,
                 "pipelines": getattr(plan, "pipelines", 1), "shard": plan.shard},
        "params": params,
        "opt_state": opt,
    }


def _compare(saved: list[dict], want: list[tuple[str, Any]], step: int, directory: Path, what: str,
             fix: str) -> None:
    saved_map = {e["path"]: (tuple(e["shape"]), e["dtype"]) for e in saved}
    want_map = {p: (tuple(a.shape), str(a.dtype)) for p, a in want}
    missing = [f"{p} is missing from the checkpoint" for p in sorted(want_map.keys() - saved_map.keys())]
    extra = [f"{p} is in the checkpoint but not in {what}" for p in sorted(saved_map.keys() - want_map.keys())]
    differ = [f"{p} is {saved_map[p][1]}{list(saved_map[p][0])} in the checkpoint but {what} has "
              f"{want_map[p][1]}{list(want_map[p][0])}"
              for p in sorted(want_map.keys() & saved_map.keys()) if saved_map[p] != want_map[p]]
    problems = missing + extra + differ
    if problems:
        shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        raise CheckpointError(f"checkpoint step {step} in {directory} does not match {what} ({len(saved)} "
                              f"arrays saved, {len(want)} expected): {shown}. {fix}")


def _verify(saved: list[tuple[str, int]], got: list[int], step: int, directory: Path) -> None:
    """Checks the fingerprint of every array read back against the one computed when saving."""
    bad = [path for (path, want), print_ in zip(saved, got, strict=True) if print_ != want]
    if bad:
        raise CheckpointError(f"checkpoint step {step} in {directory} is damaged: {', '.join(bad[:5])} "
                              f"read back different from what was saved (fingerprint mismatch); restore an "
                              f"earlier step with step=")


def _tree_from_paths(paths: list[str], leaves: list[Any]) -> dict:
    """Rebuilds nested dicts/lists from ``keystr`` paths such as ``params['layers']['w']``."""
    import ast
    import re

    root: dict = {}
    for path, leaf in zip(paths, leaves):
        head, _, rest = path.partition("[")
        keys = [head] + [ast.literal_eval(k) for k in re.findall(r"\[([^\]]*)\]", "[" + rest)]
        node = root
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = leaf
    return _lists(root)


def _lists(node: Any) -> Any:
    """Dicts keyed 0..n-1 (as ``['layers'][i]`` paths give) back into lists."""
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node

