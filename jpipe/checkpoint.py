"""Checkpoints with orbax-checkpoint, in a layout that does not depend on the mesh.

A :class:`Checkpointer` saves every ``every`` steps (asynchronously: training
goes on while orbax writes), keeps the last ``keep`` and restores onto any
plan. Parameters are stored in the sequential layout of :func:`jpipe.to_sequential`
(layers stacked ``[L, ...]``) and so are the optimizer-state leaves that mirror
the stage stacks; restoring goes through ``jpipe.init(..., params=...)`` and
lays the optimizer state out for the new plan, so a run saved with pipe=4,
data=2 resumes with pipe=2, data=4, or any other partition.

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

import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jpipe._executor import param_shardings
from jpipe._model import PyTree, Staged, unstack_layers
from jpipe._plan import Plan
from jpipe._train import TrainState, _check_batch, _microbatch, init

FORMAT = "jpipe-checkpoint-1"
_ARRAYS, _META = "arrays", "meta"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or does not fit the model/optimizer."""


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - orbax is a dependency
        raise ImportError("jpipe.checkpoint needs orbax-checkpoint: pip install orbax-checkpoint") from e
    return ocp


def _stage_like(path: tuple, shape: tuple[int, ...], layout: Any) -> bool:
    """Whether an optimizer-state leaf mirrors a stage stack ``[devices, chunks, layers, ...]``."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and k.key in ("pre", "stages", "post")]
    head = (layout.num_devices, layout.num_chunks, layout.max_layers)
    return bool(keys) and keys[0] == "stages" and tuple(shape[:3]) == head


def _fingerprint(a: jax.Array) -> jax.Array:
    """An order-independent uint32 checksum of the bits of ``a`` (any single bit flip changes it)."""
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    if a.dtype == jnp.bool_:
        a = a.astype(jnp.uint8)
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[a.dtype.itemsize]
    words = jax.lax.bitcast_convert_type(a, bits).astype(jnp.uint32).reshape(-1)
    index = jnp.arange(words.shape[0], dtype=jnp.uint32)
    weights = index * jnp.uint32(2654435761) * jnp.uint32(2) + jnp.uint32(1)  # odd: no bit flip cancels
    return jnp.sum(words * weights, dtype=jnp.uint32) ^ jnp.uint32(words.shape[0])


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
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=(_ARRAYS, _META))

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
        return all((path / item).is_dir() and any((path / item).iterdir()) for item in (_ARRAYS, _META))

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
            **{_ARRAYS: ocp.args.StandardSave(arrays), _META: ocp.args.JsonSave(meta)}))
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
        if getattr(plan, "pipelines", 1) > 1 or meta["plan"].get("pipelines", 1) > 1:
            # Co-located pipelines (AvgPipe) hold per-replica parameters: lay them out through a
            # freshly initialised state of the new plan instead of jpipe.init(params=...).
            fresh = init(model, plan, optimizer, example_batch, rng=jax.random.key(0), devices=devices,
                         nan_policy=nan_policy)
            return self.restore_like(fresh, step=step)
        _check_batch(example_batch, plan, "example_batch")
        microbatch = _microbatch(example_batch, plan)
        # What this model and optimizer expect, in the checkpoint's (sequential) layout.
        want_params = jax.eval_shape(model.init_stacked, jax.random.key(0), microbatch)
        _compare(meta["params"], _entries(want_params, "params"), step, self.directory, "the model",
                 "restore with the model that was saved (same layers, sizes and dtypes)")
        # Parameters first, replicated on the new mesh, then through jpipe.init(params=...).
        from jpipe._mesh import make_mesh

        mesh = make_mesh(plan.pipe, plan.data, devices)
        arrays = self._read(step, _abstract(meta, NamedSharding(mesh, P())))
        _verify(arrays, meta, step, self.directory)
        flat = [arrays[f"p{i:05d}"] for i in range(len(meta["params"]))]
        params = unstack_layers(jax.tree.unflatten(jax.tree.structure(want_params), flat))
        state = init(model, plan, optimizer, example_batch, params=params, devices=devices, nan_policy=nan_policy)
        return self._fill(state, arrays, meta, step, params=False)

    def restore_like(self, state: TrainState, *, step: int | None = None) -> TrainState:
        """Restores into the plan, model and optimizer of an existing ``state`` (no new ``jpipe.init``).

        The result shares ``state``'s compiled step, so resuming costs no
        compilation; ``state``'s own arrays are not used (it may be donated).
        """
        if not isinstance(state, TrainState):
            raise TypeError(f"restore_like takes a jpipe.TrainState, got {type(state).__name__}")
        step = self._pick(step)
        meta = self.metadata(step)
        conv = _converter(state)
        _compare(meta["params"], conv.param_entries, step, self.directory, "the model",
                 "restore with the model that was saved (same layers, sizes and dtypes)")
        arrays = self._read(step, _abstract(meta, NamedSharding(state.mesh, P())))
        _verify(arrays, meta, step, self.directory)
        return self._fill(state, arrays, meta, step, params=True)

    def _fill(self, state: TrainState, arrays: dict, meta: dict, step: int, params: bool) -> TrainState:
        """``state`` with the checkpoint's optimizer state (and parameters), laid out for its plan."""
        conv = _converter(state)
        _compare(meta["opt_state"], conv.opt_entries, step, self.directory, "the optimizer",
                 "restore with the optimizer it was saved with (the same optax chain), or start the "
                 "optimizer afresh from the parameters: jpipe.init(..., params=ckpt.restore_params())")
        saved_opt = [arrays[f"o{i:05d}"] for i in range(len(meta["opt_state"]))]
        opt_leaves, new_step, skipped = conv.place_opt(saved_opt, arrays["step"], arrays["skipped_steps"])
        changes = {"opt_state": jax.tree.unflatten(jax.tree.structure(state.opt_state), opt_leaves),
                   "step": new_step, "skipped_steps": skipped}
        if params:
            changes["params"] = conv.place_params([arrays[f"p{i:05d}"] for i in range(len(meta["params"]))])
        return state.replace(**changes)

    def restore_params(self, step: int | None = None, device: jax.Device | None = None) -> dict:
        """Only the parameters, in sequential layout on one device: for ``model.loss_value`` or ``jpipe.init``."""
        step = self._pick(step)
        meta = self.metadata(step)
        device = device or jax.local_devices()[0]
        one = jax.sharding.SingleDeviceSharding(device)
        abstract = _abstract(meta, one)
        arrays = self._read(step, abstract)
        _verify(arrays, meta, step, self.directory)
        flat = [arrays[f"p{i:05d}"] for i in range(len(meta["params"]))]
        tree = _tree_from_paths([e["path"] for e in meta["params"]], flat)
        return unstack_layers(tree["params"])

    def _read(self, step: int, abstract: dict) -> dict:
        ocp = _orbax()
        try:
            restore = ocp.args.StandardRestore(abstract)
            return self._manager.restore(step, args=ocp.args.Composite(**{_ARRAYS: restore}))[_ARRAYS]
        except Exception as e:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} is damaged or incomplete: its arrays cannot be "
                f"read ({type(e).__name__}: {str(e)[:500]}); restore an earlier step with step=, complete "
                f"ones: {self.all_steps()}") from e


def _abstract(meta: dict, sharding: jax.sharding.Sharding) -> dict:
    """What a checkpoint holds, as ShapeDtypeStructs to read it into ``sharding``."""
    def spec(e: dict) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(tuple(e["shape"]), np.dtype(e["dtype"]), sharding=sharding)

    abstract = {f"p{i:05d}": spec(e) for i, e in enumerate(meta["params"])}
    abstract.update({f"o{i:05d}": spec(e) for i, e in enumerate(meta["opt_state"])})
    abstract["step"] = abstract["skipped_steps"] = spec({"shape": [], "dtype": "int32"})
    return abstract


class _Converter:
    """A plan's jitted conversions between its pipelined state and the checkpoint's layout (cached)."""

    def __init__(self, state: TrainState) -> None:
        program = state.program
        layout = program.layout
        num_layers = int(layout.counts.sum())
        opt = jax.tree_util.tree_leaves_with_path(state.opt_state)
        stage = [_stage_like(path, leaf.shape, layout) for path, leaf in opt]
        mesh = program.mesh
        replicated = NamedSharding(mesh, P())

        def sequential(params):
            return {"pre": params["pre"], "layers": layout.from_stages(params["stages"]), "post": params["post"]}

        def to_checkpoint(params, opt_leaves, step, skipped):
            seq = sequential(params)
            opt_seq = [layout.from_stages(v) if s else v for v, s in zip(opt_leaves, stage)]
            prints = [_fingerprint(a) for a in jax.tree.leaves(seq) + opt_seq]
            return seq, opt_seq, step.astype(jnp.int32), skipped.astype(jnp.int32), prints

        def place_params(seq_flat):
            seq = jax.tree.unflatten(self.seq_treedef, seq_flat)
            return {"pre": seq["pre"], "stages": layout.to_stages(seq["layers"]), "post": seq["post"]}

        def place_opt(opt_values, step, skipped):
            return [layout.to_stages(v) if s else v for v, s in zip(opt_values, stage)], step, skipped

        seq_shape = jax.eval_shape(sequential, state.params)
        self.seq_treedef = jax.tree.structure(seq_shape)
        self.param_entries = _entries(seq_shape, "params")
        self.opt_entries = [
            (f"opt_state{jax.tree_util.keystr(path)}",
             jax.ShapeDtypeStruct((num_layers, *leaf.shape[3:]) if s else leaf.shape, leaf.dtype))
            for (path, leaf), s in zip(opt, stage)]
        self.opt_paths = [p for p, _ in self.opt_entries]
        self.to_checkpoint = jax.jit(to_checkpoint, out_shardings=replicated)
        self.place_params = jax.jit(place_params, out_shardings=param_shardings(
            mesh, state.params, program.executor.replicas_over_data))
        self.place_opt = jax.jit(place_opt, out_shardings=([leaf.sharding for _, leaf in opt], replicated,
                                                           replicated))


_CONVERTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _converter(state: TrainState) -> _Converter:
    conv = _CONVERTERS.get(state.program)
    if conv is None:
        conv = _CONVERTERS[state.program] = _Converter(state)
    return conv


def _to_checkpoint(state: TrainState) -> tuple[dict, dict]:
    """The state as flat replicated arrays in sequential layout, and their description."""
    program = state.program
    conv = _converter(state)
    skipped = state.skipped_steps if state.skipped_steps is not None else jnp.zeros((), jnp.int32)
    seq, opt_seq, step, skipped, prints = conv.to_checkpoint(state.params, jax.tree.leaves(state.opt_state),
                                                             state.step, skipped)
    params = _entries(seq, "params")
    opt_entries = list(zip(conv.opt_paths, opt_seq))
    prints = [int(x) for x in jax.device_get(prints)]
    arrays = {f"p{i:05d}": v for i, (_, v) in enumerate(params)}
    arrays.update({f"o{i:05d}": v for i, (_, v) in enumerate(opt_entries)})
    arrays["step"], arrays["skipped_steps"] = step, skipped
    plan = program.plan

    def describe(entries, offset):
        return [{"path": p, "shape": list(v.shape), "dtype": str(v.dtype), "fingerprint": prints[offset + i]}
                for i, (p, v) in enumerate(entries)]

    return arrays, {
        "format": FORMAT,
        "step": int(jax.device_get(step)),
        "num_layers": program.model.num_layers,
        "plan": {"pipe": plan.pipe, "data": plan.data, "microbatches": plan.microbatches,
                 "schedule": plan.schedule if isinstance(plan.schedule, str) else repr(plan.schedule),
                 "partition": [int(n) for n in program.layout.counts.T.reshape(-1)], "remat": plan.remat,
                 "pipelines": getattr(plan, "pipelines", 1)},
        "params": describe(params, 0),
        "opt_state": describe(opt_entries, len(params)),
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


def _verify(arrays: dict, meta: dict, step: int, directory: Path) -> None:
    """Checks the fingerprint of every array read back against the one computed when saving."""
    entries = [(f"p{i:05d}", e) for i, e in enumerate(meta["params"])]
    entries += [(f"o{i:05d}", e) for i, e in enumerate(meta["opt_state"])]
    entries = [(k, e) for k, e in entries if k in arrays]
    prints = jax.device_get(_fingerprints([arrays[k] for k, _ in entries]))
    bad = [e["path"] for (_, e), got in zip(entries, prints) if int(got) != e["fingerprint"]]
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
    return root

