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
        """The step's gradients as one shard_map'ed function; ``params`` are the pipelined parameters
        (arrays or shape structs, global shapes)."""
        table, layout, model = self.table, self.layout, self.model
        num_dev, num_chunks, M = table.num_devices, table.num_chunks, table.num_microbatches
        over_data = self.replicas_over_data
        data = self.mesh.shape[DATA]
        param_specs = _sharding.param_specs(params, self.mesh, self.shard, over_data)
        grad_specs = _sharding.grad_specs(params, self.mesh, self.shard, over_data)
        pre_params = params["pre"]
        if over_data:  # shapes as one data device sees them: its share of the replica axis
            pre_params = _local_replicas(pre_params, 0, self.mesh.shape[DATA])
            example_microbatch = _local_replicas(example_microbatch, 1, self.mesh.shape[DATA])
        hidden = model.hidden_shape(pre_params, example_microbatch)
        rows_np = table.as_array()  # [ticks, lanes, devices, fields]
        rows = jnp.asarray(rows_np)
        lane_kinds = [frozenset(np.unique(rows_np[:, lane, :, _COL["kind"]]).tolist())
                      for lane in range(table.lanes)]
        counts_all = layout.counts
        uneven = bool((counts_all != layout.max_layers).any())
        depths = (table.in_depth, table.res_depth, table.cot_depth)
        ring = num_chunks > 1
        fwd_perm = [(i, (i + 1) % num_dev) for i in range(num_dev if ring else num_dev - 1)]
        bwd_perm = [((i + 1) % num_dev, i) for i in range(num_dev if ring else num_dev - 1)]
        remat = self.remat
        stochastic = model.stochastic
        # each slot's layer index [devices, chunks, max_layers]: only stochastic layers need it (their keys)
        slot_layers = jnp.asarray(np.maximum(layout.slots(), 0)) if stochastic else None

        def body(params: Params, batch: PyTree, key: jax.Array | None = None):
            if not over_data:  # whole copies for the step (temp bytes), of what is stored split
                params = _gather(params, param_specs, self.mesh)
            stages = jax.tree.map(lambda a: a[0], params["stages"])  # [chunks, max_layers, ...]
            pre_p, post_p = params["pre"], params["post"]
            microbatches = jax.tree.map(lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:]), batch)
            device = lax.axis_index(PIPE)
            counts = jnp.asarray(counts_all)[device]
            zeros_h = jnp.zeros(hidden.shape, hidden.dtype)

            size = jax.tree.leaves(microbatches)[0].shape[1]

            def keys_of(part: jax.Array, mb: jax.Array) -> jax.Array | None:
                """Micro-batch ``mb``'s sample keys for model ``part`` (0 pre, 1 + l layer l, L + 1 post):
                where its samples sit in the global batch, whatever the mesh and schedule."""
                if not stochastic:
                    return None
                if not over_data:
                    return sample_keys(key, part, (lax.axis_index(DATA) * M + mb) * size, size)
                local = jax.tree.leaves(pre_params)[0].shape[0]  # this data device's replicas
                replicas = lax.axis_index(DATA) * local + jnp.arange(local)
                return jax.vmap(lambda r: sample_keys(jax.random.fold_in(key, r), part, mb * size, size))(
                    replicas)

            def forward_fn(chunk: jax.Array, mb: jax.Array):
                layer_keys = None if not stochastic else jax.vmap(lambda l: keys_of(1 + l, mb))(
                    slot_layers[device, chunk])
                return self.stage_forward(counts[chunk] if uneven else None, layer_keys)

            chunk0 = _index(stages, jnp.int32(0))
            res_shapes = [] if remat else jax.eval_shape(
                lambda p, x: jax.vjp(forward_fn(jnp.int32(0), jnp.int32(0)), p, x)[1].opaque_residuals,
                chunk0, zeros_h)
            carry = _Carry(
                inputs=_unwritten((depths[0] + 1, *hidden.shape), hidden.dtype),
                residuals=[_unwritten((depths[1], *r.shape), r.dtype) for r in res_shapes],
                cotangents=_unwritten((depths[2] + 1, *hidden.shape), hidden.dtype),
                grad_stages=_f32_zeros_like(stages),
                grad_pre=_f32_zeros_like(pre_p),
                grad_post=_f32_zeros_like(post_p),
                loss=jnp.zeros((), jnp.float32),
            )

            def run_lane(carry: _Carry, row: jax.Array, kinds: frozenset[int]):
                """One lane of a tick: the device's action of this row, and its local writes."""
                mb, chunk = row[_COL["microbatch"]], row[_COL["chunk"]]
                in_i = _slot(row[_COL["in_slot"]], depths[0])
                res_i = _slot(row[_COL["res_slot"]], depths[1])
                cot_i = _slot(row[_COL["cot_slot"]], depths[2])
                first = (device == 0) & (chunk == 0)
                last = (device == num_dev - 1) & (chunk == num_chunks - 1)
                data = _index(microbatches, mb)
                chunk_p = _index(stages, chunk)
                f = forward_fn(chunk, mb)
                pre_keys, post_keys = keys_of(0, mb), keys_of(model.num_layers + 1, mb)
                # The switch's branches only read the buffers; a buffer passed through the switch
                # is copied by XLA on every tick. The forward runs in a two-way cond of its own that
                # writes its residuals into their buffers in place, so that no residual-sized value
                # leaves a branch (zeros on every other tick, then a copy into the buffer).
                nothing = _TickOut(
                    send_act=zeros_h, send_cot=zeros_h,
                    loss_grad=zeros_h, loss=jnp.zeros((), jnp.float32), grad_chunk=_zeros_like_tree(chunk_p),
                    grad_pre=_zeros_like_tree(pre_p), grad_post=_zeros_like_tree(post_p))

                def embed() -> jax.Array:
                    return model.embed(pre_p, data, pre_keys).astype(hidden.dtype)

                def idle() -> _TickOut:
                    return nothing

                def forward(res_bufs: list) -> tuple[list, _TickOut]:
                    x = lax.cond(first, embed, lambda: carry.inputs[in_i])
                    if remat:
                        y, residuals = f(chunk_p, x), []
                    else:
                        y, vjp = jax.vjp(f, chunk_p, x)
                        residuals = list(vjp.opaque_residuals)

                    def head():
                        loss, (g_post, dy) = jax.value_and_grad(model.head_loss, argnums=(0, 1))(
                            post_p, y, data, post_keys)
                        return loss.astype(jnp.float32), g_post, dy.astype(hidden.dtype)

                    def no_head():
                        return nothing.loss, nothing.grad_post, zeros_h

                    loss, g_post, dy = lax.cond(last, head, no_head)
                    res_bufs = [_set(b, res_i, r) for b, r in zip(res_bufs, residuals)]
                    return res_bufs, nothing._replace(send_act=y, loss_grad=dy, loss=loss, grad_post=g_post)

                def backward(grads_for_weights: bool, grads_for_input: bool) -> _TickOut:
                    """The backward of one micro-batch; split schedules ask for one half at a time.

                    Whatever is not asked for is dead code that XLA removes.
                    """

                    def chunk_vjp(x: jax.Array):
                        _, vjp = jax.vjp(f, chunk_p, x)
                        if not remat:  # the re-traced forward is dead code once residuals are swapped
                            stashed = [b[res_i] for b in carry.residuals]
                            vjp = dataclasses.replace(vjp, opaque_residuals=stashed)
                        return vjp(carry.cotangents[cot_i])

                    def first_stage():
                        # pre's weight gradient needs dx: on the first stage all of it is weight work
                        if not grads_for_weights:
                            return nothing.grad_chunk, zeros_h, nothing.grad_pre
                        x, pre_vjp = jax.vjp(
                            lambda p: model.embed(p, data, pre_keys).astype(hidden.dtype), pre_p)
                        g_chunk, dx = chunk_vjp(x)
                        return g_chunk, zeros_h, pre_vjp(dx.astype(hidden.dtype))[0]

                    def later_stage():
                        g_chunk, dx = chunk_vjp(carry.inputs[in_i])
                        return g_chunk, dx.astype(hidden.dtype), nothing.grad_pre

                    g_chunk, dx, g_pre = lax.cond(first, first_stage, later_stage)
                    return nothing._replace(
                        send_cot=dx if grads_for_input else zeros_h,
                        grad_chunk=g_chunk if grads_for_weights else nothing.grad_chunk,
                        grad_pre=g_pre if grads_for_weights else nothing.grad_pre)

                split = table.splits_backward
                actions = {
                    BACKWARD: functools.partial(backward, grads_for_weights=not split, grads_for_input=True),
                    WEIGHT: functools.partial(backward, grads_for_weights=True, grads_for_input=False),
                }
                kind = row[_COL["kind"]]
                if FORWARD in kinds:
                    is_fwd = kind == FORWARD
                    # the buffers pass through the cond in place; the switch below reads them after it
                    residuals, fwd = lax.cond(is_fwd, forward, lambda bufs: (bufs, nothing), list(carry.residuals))
                    carry = carry._replace(residuals=residuals)  # what backward() reads
                # Only the kinds this lane ever runs are compiled: kind code -> branch index.
                present = sorted(kinds - {IDLE, FORWARD})
                branch_of = np.zeros(max(FORWARD, *actions) + 1, np.int32)
                for i, k in enumerate(present):
                    branch_of[k] = i + 1
                out = lax.switch(jnp.asarray(branch_of)[kind], [idle] + [actions[k] for k in present]) \
                    if present else nothing
                if FORWARD in kinds:
                    out = out._replace(send_act=fwd.send_act, loss_grad=fwd.loss_grad, loss=fwd.loss,
                                       grad_post=fwd.grad_post)
                    # The last stage's F stores its loss gradient; other writes go to the trash slot.
                    cot_w = jnp.where(is_fwd & last, cot_i, depths[2])
                    carry = carry._replace(
                        cotangents=_set(carry.cotangents, cot_w, out.loss_grad),
                        grad_post=jax.tree.map(jnp.add, carry.grad_post, out.grad_post),
                        loss=carry.loss + out.loss)
                if kinds & {BACKWARD, WEIGHT}:
                    carry = carry._replace(
                        grad_stages=jax.tree.map(lambda acc, g: _set(acc, chunk, acc[chunk] + g),
                                                 carry.grad_stages, out.grad_chunk),
                        grad_pre=jax.tree.map(jnp.add, carry.grad_pre, out.grad_pre))
                return carry, out

            def tick(carry: _Carry, tick_rows: jax.Array):
                outs = []
                for lane in range(table.lanes):  # a device runs its lanes one after the other
                    carry, out = run_lane(carry, tick_rows[lane, device], lane_kinds[lane])
                    outs.append((lane_kinds[lane], out))
                send_act = sum((o.send_act for k, o in outs if FORWARD in k), zeros_h)
                send_cot = sum((o.send_cot for k, o in outs if BACKWARD in k), zeros_h)
                # Each ppermute needs only its own branch, so XLA may start the activation's right
                # after the forward; with blocking collectives (CPU) that is a barrier in the middle
                # of the tick at which a device's F and its neighbour's B wait for each other instead
                # of running side by side. A zero that depends on both sends (XLA does not fold x * 0
                # for floats) makes both wait for the whole tick.
                if fwd_perm:  # every device takes part in both collectives on every tick
                    both = (send_act.ravel()[0] + send_cot.ravel()[0]) * 0
                    send_act, send_cot = send_act + both, send_cot + both
                    recv_act = lax.ppermute(send_act, PIPE, fwd_perm)
                    recv_cot = lax.ppermute(send_cot, PIPE, bwd_perm)
                else:
                    recv_act, recv_cot = send_act, send_cot
                row = tick_rows[table.lanes - 1, device]  # arrivals are stored per the tick's last row
                carry = carry._replace(
                    inputs=_set(carry.inputs, _slot(row[_COL["recv_in_slot"]], depths[0]), recv_act),
                    cotangents=_set(carry.cotangents, _slot(row[_COL["recv_cot_slot"]], depths[2]), recv_cot))
                return carry, None

            carry, _ = lax.scan(tick, carry, rows)
            scale = 1.0 / M
            if over_data:  # each data device's replicas keep their own gradients
                # The loss (mean over all replicas) stays one all-reduce over the whole mesh: an
                # all-reduce over `data` groups alone could be combined by XLA with the elastic
                # centre's, which would then wait for the pipeline.
                loss = lax.psum(carry.loss, (PIPE, DATA)) * scale / data
                io = _reduce_at_once({"pre": carry.grad_pre, "post": carry.grad_post},
                                     lambda v: lax.psum(v, PIPE) * scale)
                grads = {"pre": io["pre"], "stages": jax.tree.map(lambda g: (g * scale)[None], carry.grad_stages),
                         "post": io["post"]}
            else:
                # pre/post gradients are summed over the whole mesh (only the first/last stage has
                # them), stage gradients over `data`; each goes where its optimizer state lives.
                sums = {"pre": carry.grad_pre, "stages": jax.tree.map(lambda g: g[None], carry.grad_stages),
                        "post": carry.grad_post, "loss": carry.loss}
                specs = {**grad_specs, "loss": P()}
                axes = {"pre": (PIPE, DATA), "stages": (DATA,), "post": (PIPE, DATA), "loss": (PIPE, DATA)}
                total = _reduce(sums, specs, {k: jax.tree.map(lambda _, a=a: a, sums[k]) for k, a in axes.items()},
                                self.mesh, scale / data)
                loss, grads = total.pop("loss"), total
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
            return loss, grads

        # a stochastic model's step takes its key, replicated (samples' keys are folded in per device)
        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(param_specs, batch_spec(over_data), *([P()] if stochastic else [])),
            out_specs=(P(), grad_specs),
            check_vma=False,
        )


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
