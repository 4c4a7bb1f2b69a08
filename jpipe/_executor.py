"""The executor: one SPMD program that interprets a schedule table.

Inside ``jax.shard_map`` over the ``(pipe, data)`` mesh, a ``lax.scan`` runs one
iteration per tick. Each device looks up its row(s) of the table -- one per lane;
a fused tick runs a forward lane and then a backward lane -- and runs the
forward or backward of one micro-batch on one of its chunks (compute only, no
collectives), and then -- on every device, outside any branch -- one
``ppermute`` moves activations a device forward and one moves cotangents a
device back. Received data is written to the slot the table names; a spare
"trash" slot at the end of the input and cotangent buffers absorbs writes that
the table does not want, so no branch is needed for them.

The forward runs in a two-way ``lax.cond`` of its own that writes its residuals
into their buffers in place; the backward kinds share a ``lax.switch`` that only
reads the buffers. No residual-sized value ever leaves a branch: XLA would
zero-fill it on every other tick and copy it into the buffer (measured: 3x the
plain step at micro-batch 8 on CPU, from copies and from a temp buffer large
enough to be re-mapped by the allocator on every step).

Buffers hold exactly the table's liveness: ``in`` (stage inputs, arrival to
backward), ``res`` (forward residuals, forward to backward) and ``cot``
(cotangents, arrival to backward). Weight gradients accumulate in the carry
in float32, whatever the parameter dtype, and are cast once at the end.

Where the state is sharded (``Plan.shard``, see :mod:`jpipe._sharding`) the
step first all-gathers what it needs whole -- ``pre`` and ``post`` from the
whole mesh, stage parameters from ``data`` -- and at the end reduce-scatters
each gradient to where its optimizer state lives, instead of all-reducing it:
one collective per dtype and mesh-axis group, not one per parameter.

With ``replicas_over_data`` (co-located pipelines, :mod:`jpipe.averaging`) the
``data`` axis splits the ensemble's *replica* axis instead of the batch: every
parameter carries a replica axis (``pre``/``post`` ``[R, ...]``, stage stacks
``[devices, chunks, layers, R, ...]``) sharded over ``data``, batches are
``[B, R, ...]`` sharded on their second axis, and each data device computes the
gradients of its own replicas on their own samples: no mean of gradients over
``data`` (the loss is still the mean over all replicas).

Without ``remat`` the forward's residuals are kept: ``jax.vjp`` returns an
object whose ``opaque_residuals`` are the intermediates and whose ``args_res``
are the primal arguments (weights and stage input). Only the former are
stashed; the backward re-traces ``jax.vjp`` (dead code that XLA removes) and
swaps the stashed residuals in, so the weights are never copied per slot.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jpipe import _sharding
from jpipe._mesh import DATA, PIPE
from jpipe._model import Params, PyTree, Staged, sample_keys
from jpipe.schedules import BACKWARD, FIELDS, FORWARD, IDLE, WEIGHT, Table

_COL = {name: i for i, name in enumerate(FIELDS)}


class Layout(NamedTuple):
    """Where each layer lives: layer ``l`` of the sequential model is ``stages[device, chunk, j]``."""

    num_devices: int
    num_chunks: int
    counts: np.ndarray  # int[devices, chunks]: layers on each (device, chunk)
    max_layers: int

    @classmethod
    def from_partition(cls, partition: tuple[int, ...], num_devices: int) -> Layout:
        num_chunks = len(partition) // num_devices
        counts = np.zeros((num_devices, num_chunks), dtype=np.int32)
        for k, n in enumerate(partition):
            counts[k % num_devices, k // num_devices] = n
        return cls(num_devices, num_chunks, counts, int(counts.max()))

    def positions(self) -> list[tuple[int, int, int]]:
        """``(device, chunk, j)`` of each sequential layer, in order."""
        out = []
        for k in range(self.num_devices * self.num_chunks):
            d, c = k % self.num_devices, k // self.num_devices
            out += [(d, c, j) for j in range(int(self.counts[d, c]))]
        return out

    def to_stages(self, layers: PyTree) -> PyTree:
        """Stacked ``[L, ...]`` layers -> padded ``[devices, chunks, max_layers, ...]``."""
        pos = self.positions()
        d, c, j = (np.array(x) for x in zip(*pos))

        def place(a: jax.Array) -> jax.Array:
            out = jnp.zeros((self.num_devices, self.num_chunks, self.max_layers, *a.shape[1:]), a.dtype)
            return out.at[d, c, j].set(a)

        return jax.tree.map(place, layers)

    def slots(self) -> np.ndarray:
        """``int[devices, chunks, max_layers]``: the sequential index of the layer in each slot, -1 where
        a shorter chunk is padded."""
        out = np.full((self.num_devices, self.num_chunks, self.max_layers), -1, np.int64)
        for layer, (d, c, j) in enumerate(self.positions()):
            out[d, c, j] = layer
        return out

    def from_stages(self, stages: PyTree) -> PyTree:
        """Inverse of :meth:`to_stages`: padded stage stacks -> ``[L, ...]``."""
        d, c, j = (np.array(x) for x in zip(*self.positions()))
        return jax.tree.map(lambda a: a[d, c, j], stages)


def _zeros_like_tree(tree: PyTree) -> PyTree:
    return jax.tree.map(jnp.zeros_like, tree)


def _unwritten(shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """A buffer whose slots the table always writes before it reads them: left uninitialized where
    the backend allows (``lax.empty``: no fill of the stash on every step on GPU and TPU; zeros on
    CPU). The tests swap in NaN to prove that no unwritten slot is ever read."""
    return lax.empty(shape, dtype)


def _index(tree: PyTree, i: jax.Array) -> PyTree:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _set(buf: jax.Array, i: jax.Array, value: jax.Array) -> jax.Array:
    return lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i, axis=0)


def _slot(slot: jax.Array, depth: int) -> jax.Array:
    """Table slot -> buffer index; ``NO_SLOT`` (-1) maps to the trash slot at ``depth``."""
    return jnp.where(slot < 0, depth, slot)


class _Carry(NamedTuple):
    inputs: jax.Array  # [in_depth + 1, *hidden]
    residuals: list  # each [res_depth, *shape]: only a forward writes, always to a slot of its own
    cotangents: jax.Array  # [cot_depth + 1, *hidden]
    grad_stages: PyTree
    grad_pre: PyTree
    grad_post: PyTree
    loss: jax.Array


class _TickOut(NamedTuple):
    """What one tick's action produces; idle and unused fields are zeros."""

    send_act: jax.Array
    send_cot: jax.Array
    loss_grad: jax.Array
    loss: jax.Array
    grad_chunk: PyTree
    grad_pre: PyTree
    grad_post: PyTree


@dataclasses.dataclass(frozen=True, eq=False)
class Executor:
    """Builds ``grads(params, batch) -> (loss, grads)`` for a model, table, layout and mesh."""

    model: Staged
    table: Table
    layout: Layout
    mesh: Mesh
    remat: bool
    replicas_over_data: bool = False  # co-located pipelines: `data` splits the replica axis, not B
    shard: str | None = None  # Plan.shard: what of the state is split beyond stages over `pipe`

    def stage_forward(self, count: jax.Array | None,
                      keys: jax.Array | None = None) -> Callable[[PyTree, jax.Array], jax.Array]:
        """``f(chunk_params [max_layers, ...], x) -> y``: the layers of one chunk; ``keys``
        ``[max_layers, *samples]``, each layer's sample keys (stochastic models), else ``None``."""
        model, max_layers = self.model, self.layout.max_layers

        def f(chunk_params: PyTree, x: jax.Array) -> jax.Array:
            def one(h, pjk):
                p, j, k = pjk
                if count is None:  # every chunk is full: no masking needed
                    return model.layer_apply(p, h, k), None
                return lax.cond(j < count, lambda: model.layer_apply(p, h, k), lambda: h), None

            y, _ = lax.scan(one, x, (chunk_params, jnp.arange(max_layers), keys))
            return y

        return f

    def build(self, example_microbatch: PyTree, params: Params) -> Callable:
        """The step's gradients as one shard_map'ed function ``grads(params, batch[, key]) -> (loss,
        grads)``; ``params`` are the pipelined parameters (arrays or shape structs, global shapes),
        ``key`` a stochastic model's step key (replicated: samples' keys are folded in per device)."""
        static = self._static(example_microbatch, params)
        return jax.shard_map(
            functools.partial(self._body, static),
            mesh=self.mesh,
            in_specs=(static.param_specs, batch_spec(self.replicas_over_data),
                      *([P()] if self.model.stochastic else [])),
            out_specs=(P(), static.grad_specs),
            check_vma=False,
        )

    def _static(self, example_microbatch: PyTree, params: Params) -> _Static:
        """What every device's step reads and no tick changes, from the table, layout and shapes."""
        table, layout, over_data = self.table, self.layout, self.replicas_over_data
        pre_params = params["pre"]
        if over_data:  # shapes as one data device sees them: its share of the replica axis
            pre_params = _local_replicas(pre_params, 0, self.mesh.shape[DATA])
            example_microbatch = _local_replicas(example_microbatch, 1, self.mesh.shape[DATA])
        rows = table.as_array()  # [ticks, lanes, devices, fields]
        ring = table.num_chunks > 1
        links = range(table.num_devices if ring else table.num_devices - 1)
        return _Static(
            hidden=self.model.hidden_shape(pre_params, example_microbatch),
            rows=jnp.asarray(rows),
            lane_kinds=[frozenset(np.unique(rows[:, lane, :, _COL["kind"]]).tolist()) for lane in range(table.lanes)],
            uneven=bool((layout.counts != layout.max_layers).any()),
            depths=(table.in_depth, table.res_depth, table.cot_depth),
            fwd_perm=[(i, (i + 1) % table.num_devices) for i in links],
            bwd_perm=[((i + 1) % table.num_devices, i) for i in links],
            param_specs=_sharding.param_specs(params, self.mesh, self.shard, over_data),
            grad_specs=_sharding.grad_specs(params, self.mesh, self.shard, over_data),
            # each slot's layer index [devices, chunks, max_layers]: only stochastic layers need it (their keys)
            slot_layers=jnp.asarray(np.maximum(layout.slots(), 0)) if self.model.stochastic else None,
            local_replicas=jax.tree.leaves(pre_params)[0].shape[0] if over_data else None,
        )

    def _body(self, static: _Static, params: Params, batch: PyTree, key: jax.Array | None = None):
        """One device's step inside ``shard_map``: the scan of ticks, then the gradients' reduction."""
        if not self.replicas_over_data:  # whole copies for the step (temp bytes), of what is stored split
            params = _gather(params, static.param_specs, self.mesh)
        step = _DeviceStep(self, static, params, batch, key)
        carry, _ = lax.scan(step.tick, step.initial_carry(), static.rows)
        loss, grads = self._reduce_grads(static, carry)
        return loss, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)

    def _reduce_grads(self, static: _Static, carry: _Carry) -> tuple[jax.Array, Params]:
        """The mean loss and gradients from each device's sums, each gradient left where its
        optimizer state lives."""
        scale, data = 1.0 / self.table.num_microbatches, self.mesh.shape[DATA]
        if self.replicas_over_data:  # each data device's replicas keep their own gradients
            # The loss (mean over all replicas) stays one all-reduce over the whole mesh: an
            # all-reduce over `data` groups alone could be combined by XLA with the elastic
            # centre's, which would then wait for the pipeline.
            loss = lax.psum(carry.loss, (PIPE, DATA)) * scale / data
            io = _reduce_at_once({"pre": carry.grad_pre, "post": carry.grad_post},
                                 lambda v: lax.psum(v, PIPE) * scale)
            return loss, {"pre": io["pre"], "stages": jax.tree.map(lambda g: (g * scale)[None], carry.grad_stages),
                          "post": io["post"]}
        # pre/post gradients are summed over the whole mesh (only the first/last stage has
        # them), stage gradients over `data`; each goes where its optimizer state lives.
        sums = {"pre": carry.grad_pre, "stages": jax.tree.map(lambda g: g[None], carry.grad_stages),
                "post": carry.grad_post, "loss": carry.loss}
        specs = {**static.grad_specs, "loss": P()}
        axes = {"pre": (PIPE, DATA), "stages": (DATA,), "post": (PIPE, DATA), "loss": (PIPE, DATA)}
        total = _reduce(sums, specs, {k: jax.tree.map(lambda _, a=a: a, sums[k]) for k, a in axes.items()},
                        self.mesh, scale / data)
        return total.pop("loss"), total


class _Static(NamedTuple):
    """What :meth:`Executor.build` derives once: shapes, the table as an array, buffer depths, links."""

    hidden: jax.ShapeDtypeStruct  # one micro-batch's hidden state, as a device sees it
    rows: jax.Array  # int[ticks, lanes, devices, fields]: the table
    lane_kinds: list[frozenset[int]]  # the action kinds each lane ever runs (only those are compiled)
    uneven: bool  # some chunk holds fewer layers than the largest: layers are masked by their count
    depths: tuple[int, int, int]  # slots of the in, res and cot buffers (in and cot have a trash slot more)
    fwd_perm: list[tuple[int, int]]  # activations: device i -> i + 1 (a ring with virtual stages)
    bwd_perm: list[tuple[int, int]]  # cotangents: device i + 1 -> i
    param_specs: PyTree
    grad_specs: PyTree
    slot_layers: jax.Array | None  # int[devices, chunks, max_layers]: each slot's layer (stochastic models)
    local_replicas: int | None  # co-located pipelines: the replicas one data device holds


class _Lane(NamedTuple):
    """One row of the table as a device reads it in a tick, and what that row's action works on."""

    kind: jax.Array
    chunk: jax.Array
    in_i: jax.Array  # buffer indices, the trash slot where the table names none
    res_i: jax.Array
    cot_i: jax.Array
    first: jax.Array  # this device's chunk is the model's first stage (it embeds)
    last: jax.Array  # ... its last stage (it computes the loss)
    data: PyTree  # the micro-batch
    chunk_p: PyTree  # the chunk's parameters [max_layers, ...]
    f: Callable  # the chunk's forward (x -> y)
    pre_keys: jax.Array | None
    post_keys: jax.Array | None
    nothing: _TickOut  # the action's output where it produces nothing: zeros of every field


class _DeviceStep:
    """One device's trace of a step (inside ``shard_map``): its parameters, micro-batches and
    position, and the tick that :meth:`Executor._body` scans over the table's rows. Every method
    runs at trace time; shapes are per device (``stages`` ``[chunks, max_layers, ...]``,
    ``microbatches`` ``[M, b, ...]``, hidden states ``static.hidden``)."""

    def __init__(self, executor: Executor, static: _Static, params: Params, batch: PyTree,
                 key: jax.Array | None) -> None:
        self.executor, self.static, self.model, self.key = executor, static, executor.model, key
        self.table = executor.table
        M = self.table.num_microbatches
        self.stages = jax.tree.map(lambda a: a[0], params["stages"])  # [chunks, max_layers, ...]
        self.pre_p, self.post_p = params["pre"], params["post"]
        self.microbatches = jax.tree.map(lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:]), batch)
        self.size = jax.tree.leaves(self.microbatches)[0].shape[1]
        self.device = lax.axis_index(PIPE)
        self.counts = jnp.asarray(executor.layout.counts)[self.device]
        self.zeros_h = jnp.zeros(static.hidden.shape, static.hidden.dtype)

    def keys_of(self, part: int | jax.Array, mb: jax.Array) -> jax.Array | None:
        """Micro-batch ``mb``'s sample keys for model ``part`` (0 pre, 1 + l layer l, L + 1 post):
        where its samples sit in the global batch, whatever the mesh and schedule."""
        if not self.model.stochastic:
            return None
        size, key = self.size, self.key
        if not self.executor.replicas_over_data:
            return sample_keys(key, part, (lax.axis_index(DATA) * self.table.num_microbatches + mb) * size, size)
        replicas = lax.axis_index(DATA) * self.static.local_replicas + jnp.arange(self.static.local_replicas)
        return jax.vmap(lambda r: sample_keys(jax.random.fold_in(key, r), part, mb * size, size))(replicas)

    def forward_fn(self, chunk: jax.Array, mb: jax.Array) -> Callable[[PyTree, jax.Array], jax.Array]:
        layer_keys = None if not self.model.stochastic else jax.vmap(lambda l: self.keys_of(1 + l, mb))(
            self.static.slot_layers[self.device, chunk])
        return self.executor.stage_forward(self.counts[chunk] if self.static.uneven else None, layer_keys)

    def initial_carry(self) -> _Carry:
        """Empty buffers (their slots are written before they are read) and zero gradient sums."""
        depths, hidden = self.static.depths, self.static.hidden
        res_shapes = [] if self.executor.remat else jax.eval_shape(
            lambda p, x: jax.vjp(self.forward_fn(jnp.int32(0), jnp.int32(0)), p, x)[1].opaque_residuals,
            _index(self.stages, jnp.int32(0)), self.zeros_h)
        return _Carry(
            inputs=_unwritten((depths[0] + 1, *hidden.shape), hidden.dtype),
            residuals=[_unwritten((depths[1], *r.shape), r.dtype) for r in res_shapes],
            cotangents=_unwritten((depths[2] + 1, *hidden.shape), hidden.dtype),
            grad_stages=_f32_zeros_like(self.stages),
            grad_pre=_f32_zeros_like(self.pre_p),
            grad_post=_f32_zeros_like(self.post_p),
            loss=jnp.zeros((), jnp.float32),
        )

    def tick(self, carry: _Carry, tick_rows: jax.Array) -> tuple[_Carry, None]:
        """``tick_rows`` ``[lanes, devices, fields]``: this device's lanes one after the other, then
        the two ppermutes, and the arrivals written to the slots the tick's last row names."""
        static, device, zeros_h = self.static, self.device, self.zeros_h
        outs = []
        for lane, kinds in enumerate(static.lane_kinds):
            carry, out = self.run_lane(carry, tick_rows[lane, device], kinds)
            outs.append((kinds, out))
        send_act = sum((o.send_act for k, o in outs if FORWARD in k), zeros_h)
        send_cot = sum((o.send_cot for k, o in outs if BACKWARD in k), zeros_h)
        # Each ppermute needs only its own branch, so XLA may start the activation's right
        # after the forward; with blocking collectives (CPU) that is a barrier in the middle
        # of the tick at which a device's F and its neighbour's B wait for each other instead
        # of running side by side. A zero that depends on both sends (XLA does not fold x * 0
        # for floats) makes both wait for the whole tick.
        if static.fwd_perm:  # every device takes part in both collectives on every tick
            both = (send_act.ravel()[0] + send_cot.ravel()[0]) * 0
            send_act, send_cot = send_act + both, send_cot + both
            recv_act = lax.ppermute(send_act, PIPE, static.fwd_perm)
            recv_cot = lax.ppermute(send_cot, PIPE, static.bwd_perm)
        else:
            recv_act, recv_cot = send_act, send_cot
        row = tick_rows[self.table.lanes - 1, device]  # arrivals are stored per the tick's last row
        depths = static.depths
        carry = carry._replace(
            inputs=_set(carry.inputs, _slot(row[_COL["recv_in_slot"]], depths[0]), recv_act),
            cotangents=_set(carry.cotangents, _slot(row[_COL["recv_cot_slot"]], depths[2]), recv_cot))
        return carry, None

    def lane(self, row: jax.Array) -> _Lane:
        """``row`` ``int[fields]`` -> the action's micro-batch, chunk, slots and forward."""
        depths, device = self.static.depths, self.device
        mb, chunk = row[_COL["microbatch"]], row[_COL["chunk"]]
        num_dev, num_chunks = self.table.num_devices, self.table.num_chunks
        chunk_p = _index(self.stages, chunk)
        nothing = _TickOut(send_act=self.zeros_h, send_cot=self.zeros_h, loss_grad=self.zeros_h,
                           loss=jnp.zeros((), jnp.float32), grad_chunk=_zeros_like_tree(chunk_p),
                           grad_pre=_zeros_like_tree(self.pre_p), grad_post=_zeros_like_tree(self.post_p))
        return _Lane(
            kind=row[_COL["kind"]], chunk=chunk,
            in_i=_slot(row[_COL["in_slot"]], depths[0]),
            res_i=_slot(row[_COL["res_slot"]], depths[1]),
            cot_i=_slot(row[_COL["cot_slot"]], depths[2]),
            first=(device == 0) & (chunk == 0),
            last=(device == num_dev - 1) & (chunk == num_chunks - 1),
            data=_index(self.microbatches, mb),
            chunk_p=chunk_p,
            f=self.forward_fn(chunk, mb),
            pre_keys=self.keys_of(0, mb), post_keys=self.keys_of(self.model.num_layers + 1, mb),
            nothing=nothing,
        )

    def run_lane(self, carry: _Carry, row: jax.Array, kinds: frozenset[int]) -> tuple[_Carry, _TickOut]:
        """One lane of a tick: the device's action of this row, and its local writes.

        The switch's branches only read the buffers; a buffer passed through the switch is
        copied by XLA on every tick. The forward runs in a two-way cond of its own that writes
        its residuals into their buffers in place, so that no residual-sized value leaves a
        branch (zeros on every other tick, then a copy into the buffer).
        """
        lane = self.lane(row)
        nothing = lane.nothing
        if FORWARD in kinds:
            is_fwd = lane.kind == FORWARD
            # the buffers pass through the cond in place; the switch below reads them after it
            residuals, fwd = lax.cond(is_fwd, functools.partial(self.forward, carry, lane),
                                      lambda bufs: (bufs, nothing), list(carry.residuals))
            carry = carry._replace(residuals=residuals)  # what backward() reads
        split = self.table.splits_backward
        actions = {
            BACKWARD: functools.partial(self.backward, carry, lane, grads_for_weights=not split, grads_for_input=True),
            WEIGHT: functools.partial(self.backward, carry, lane, grads_for_weights=True, grads_for_input=False),
        }
        # Only the kinds this lane ever runs are compiled: kind code -> branch index.
        present = sorted(kinds - {IDLE, FORWARD})
        branch_of = np.zeros(max(FORWARD, *actions) + 1, np.int32)
        for i, k in enumerate(present):
            branch_of[k] = i + 1
        out = lax.switch(jnp.asarray(branch_of)[lane.kind], [lambda: nothing] + [actions[k] for k in present]) \
            if present else nothing
        if FORWARD in kinds:
            out = out._replace(send_act=fwd.send_act, loss_grad=fwd.loss_grad, loss=fwd.loss,
                               grad_post=fwd.grad_post)
            # The last stage's F stores its loss gradient; other writes go to the trash slot.
            cot_w = jnp.where(is_fwd & lane.last, lane.cot_i, self.static.depths[2])
            carry = carry._replace(
                cotangents=_set(carry.cotangents, cot_w, out.loss_grad),
                grad_post=jax.tree.map(jnp.add, carry.grad_post, out.grad_post),
                loss=carry.loss + out.loss)
        if kinds & {BACKWARD, WEIGHT}:
            carry = carry._replace(
                grad_stages=jax.tree.map(lambda acc, g: _set(acc, lane.chunk, acc[lane.chunk] + g),
                                         carry.grad_stages, out.grad_chunk),
                grad_pre=jax.tree.map(jnp.add, carry.grad_pre, out.grad_pre))
        return carry, out

    def forward(self, carry: _Carry, lane: _Lane, res_bufs: list) -> tuple[list, _TickOut]:
        """F: the chunk's forward (after pre's on the first stage, with the loss and its gradient on
        the last), its residuals written into ``res_bufs`` (in place) unless the plan recomputes."""
        model, hidden, nothing = self.model, self.static.hidden, lane.nothing
        x = lax.cond(lane.first, lambda: model.embed(self.pre_p, lane.data, lane.pre_keys).astype(hidden.dtype),
                     lambda: carry.inputs[lane.in_i])
        if self.executor.remat:
            y, residuals = lane.f(lane.chunk_p, x), []
        else:
            y, vjp = jax.vjp(lane.f, lane.chunk_p, x)
            residuals = list(vjp.opaque_residuals)

        def head():
            loss, (g_post, dy) = jax.value_and_grad(model.head_loss, argnums=(0, 1))(
                self.post_p, y, lane.data, lane.post_keys)
            return loss.astype(jnp.float32), g_post, dy.astype(hidden.dtype)

        def no_head():
            return nothing.loss, nothing.grad_post, self.zeros_h

        loss, g_post, dy = lax.cond(lane.last, head, no_head)
        res_bufs = [_set(b, lane.res_i, r) for b, r in zip(res_bufs, residuals)]
        return res_bufs, nothing._replace(send_act=y, loss_grad=dy, loss=loss, grad_post=g_post)

    def backward(self, carry: _Carry, lane: _Lane, grads_for_weights: bool, grads_for_input: bool) -> _TickOut:
        """B (or, in split schedules, one half of it: the input's gradient or the weights'): the
        chunk's vjp from the stashed residuals (or recomputed), and pre's on the first stage.
        Whatever is not asked for is dead code that XLA removes."""
        model, hidden, nothing, zeros_h = self.model, self.static.hidden, lane.nothing, self.zeros_h

        def chunk_vjp(x: jax.Array):
            _, vjp = jax.vjp(lane.f, lane.chunk_p, x)
            if not self.executor.remat:  # the re-traced forward is dead code once residuals are swapped
                stashed = [b[lane.res_i] for b in carry.residuals]
                vjp = dataclasses.replace(vjp, opaque_residuals=stashed)
            return vjp(carry.cotangents[lane.cot_i])

        def first_stage():
            # pre's weight gradient needs dx: on the first stage all of it is weight work
            if not grads_for_weights:
                return nothing.grad_chunk, zeros_h, nothing.grad_pre
            x, pre_vjp = jax.vjp(lambda p: model.embed(p, lane.data, lane.pre_keys).astype(hidden.dtype), self.pre_p)
            g_chunk, dx = chunk_vjp(x)
            return g_chunk, zeros_h, pre_vjp(dx.astype(hidden.dtype))[0]

        def later_stage():
            g_chunk, dx = chunk_vjp(carry.inputs[lane.in_i])
            return g_chunk, dx.astype(hidden.dtype), nothing.grad_pre

        g_chunk, dx, g_pre = lax.cond(lane.first, first_stage, later_stage)
        return nothing._replace(
            send_cot=dx if grads_for_input else zeros_h,
            grad_chunk=g_chunk if grads_for_weights else nothing.grad_chunk,
            grad_pre=g_pre if grads_for_weights else nothing.grad_pre)


def _f32_zeros_like(tree: PyTree) -> PyTree:
    """Gradient accumulators: float32 for floating-point parameters, whatever their dtype."""
    def zeros(a):
        dtype = jnp.float32 if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize <= 4 else a.dtype
        return jnp.zeros(a.shape, dtype)

    return jax.tree.map(zeros, tree)


def _mesh_size(mesh: Mesh, names: Any) -> int:
    names = names if isinstance(names, tuple) else (names,)
    return int(np.prod([mesh.shape[n] for n in names]))


def _gather(tree: PyTree, specs: PyTree, mesh: Mesh) -> PyTree:
    """Inside shard_map: every leaf whole again along its split axis (``pipe`` on axis 0 of a stage
    leaf aside), through one ``all_gather`` per dtype and mesh-axis group."""
    leaves, treedef = jax.tree.flatten(tree)
    split = [_sharding.split_axis(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))]
    out = list(leaves)
    groups: dict = {}
    for i, (leaf, (axis, names)) in enumerate(zip(leaves, split, strict=True)):
        if axis is not None:
            groups.setdefault((jnp.result_type(leaf), names), []).append(i)
    for (_, names), indices in groups.items():
        n = _mesh_size(mesh, names)
        moved = [jnp.moveaxis(leaves[i], split[i][0], 0) for i in indices]
        flat = lax.all_gather(jnp.concatenate([m.reshape(-1) for m in moved]), names, axis=0, tiled=False)
        start = 0
        for i, m in zip(indices, moved):
            whole = flat[:, start:start + m.size].reshape(n * m.shape[0], *m.shape[1:])
            out[i] = jnp.moveaxis(whole, 0, split[i][0])
            start += m.size
    return jax.tree.unflatten(treedef, out)


def _reduce(tree: PyTree, specs: PyTree, axes: PyTree, mesh: Mesh, scale: float) -> PyTree:
    """Inside shard_map: ``scale`` x the sum of every leaf over its mesh ``axes``, left split as its
    spec says (a reduce-scatter) or whole (an all-reduce); one collective per dtype and axis group."""
    leaves, treedef = jax.tree.flatten(tree)
    split = [_sharding.split_axis(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))]
    over = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    out: list = [None] * len(leaves)
    groups: dict = {}
    for i, (leaf, (axis, names), ax) in enumerate(zip(leaves, split, over, strict=True)):
        if axis is not None and (names if isinstance(names, tuple) else (names,)) != ax:
            raise AssertionError(f"a leaf split over {names} is summed over {ax}")
        groups.setdefault((jnp.result_type(leaf), ax, axis is not None), []).append(i)
    for (_, ax, scatter), indices in groups.items():
        if not scatter:
            flat = lax.psum(jnp.concatenate([jnp.ravel(leaves[i]) for i in indices]), ax) * scale
            start = 0
            for i in indices:
                size = int(np.prod(jnp.shape(leaves[i]), dtype=int))
                out[i] = flat[start:start + size].reshape(jnp.shape(leaves[i]))
                start += size
            continue
        n = _mesh_size(mesh, ax)
        moved = [jnp.moveaxis(leaves[i], split[i][0], 0) for i in indices]
        rows = [m.reshape(n, -1) for m in moved]
        flat = lax.psum_scatter(jnp.concatenate(rows, axis=1), ax, scatter_dimension=0, tiled=False) * scale
        start = 0
        for i, m, r in zip(indices, moved, rows):
            part = flat[start:start + r.shape[1]].reshape(m.shape[0] // n, *m.shape[1:])
            out[i] = jnp.moveaxis(part, 0, split[i][0])
            start += r.shape[1]
    return jax.tree.unflatten(treedef, out)


def _reduce_at_once(tree: PyTree, reduce: Callable[[jax.Array], jax.Array]) -> PyTree:
    """Applies an element-wise collective ``reduce`` to every leaf through one call per dtype.

    Each collective call has a fixed latency (milliseconds with gloo between CPU processes), and
    XLA does not always combine per-leaf all-reduces: flattening makes it one call.
    """
    leaves, treedef = jax.tree.flatten(tree)
    out: list = [None] * len(leaves)
    groups: dict = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(jnp.result_type(leaf), []).append(i)
    for indices in groups.values():
        flat = reduce(jnp.concatenate([jnp.ravel(leaves[i]) for i in indices]))
        start = 0
        for i in indices:
            size = int(np.prod(jnp.shape(leaves[i]), dtype=int))
            out[i] = flat[start:start + size].reshape(jnp.shape(leaves[i]))
            start += size
    return jax.tree.unflatten(treedef, out)


def _local_replicas(tree: PyTree, axis: int, data: int) -> PyTree:
    """Shape structs of ``tree`` with its replica ``axis`` cut to one data device's share."""
    def local(a):
        shape = tuple(np.shape(a))
        if shape[axis] % data:
            raise ValueError(f"the replica axis ({axis}) of a leaf of shape {shape} is not divisible by "
                             f"data = {data}")
        return jax.ShapeDtypeStruct((*shape[:axis], shape[axis] // data, *shape[axis + 1:]), jnp.result_type(a))

    return jax.tree.map(local, tree)


def batch_spec(replicas_over_data: bool = False) -> P:
    """How a global batch is split: over ``data`` on its leading axis, or on its replica axis ``[B, R, ...]``."""
    return P(None, DATA) if replicas_over_data else P(DATA)
