"""The core oracle: a pipelined step equals ``jax.grad`` of the plain sequential model.

For every schedule, mesh shape, micro-batch count and partition in the grid,
for an NNX and a Linen model, with and without recompute.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jpipe

HIDDEN = 16


class NnxEmbed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(6, HIDDEN, rngs=rngs)

    def __call__(self, mb: dict) -> jax.Array:
        return jnp.tanh(self.linear(mb["x"]))


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(HIDDEN, 2 * HIDDEN, rngs=rngs)
        self.down = nnx.Linear(2 * HIDDEN, HIDDEN, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + self.down(jnp.tanh(self.up(h)))


class LinenEmbed(nn.Module):
    @nn.compact
    def __call__(self, mb: dict) -> jax.Array:
        return jnp.tanh(nn.Dense(HIDDEN)(mb["x"]))


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        return h + nn.Dense(HIDDEN)(jnp.tanh(nn.Dense(2 * HIDDEN)(h)))


def mse(out: jax.Array, mb: dict) -> jax.Array:
    return jnp.mean((out - mb["y"]) ** 2)


def make_model(framework: str, num_layers: int = 8) -> jpipe.Staged:
    if framework == "nnx":
        return jpipe.Staged(pre=NnxEmbed, layer=NnxBlock, post=lambda rngs: nnx.Linear(HIDDEN, 3, rngs=rngs),
                            num_layers=num_layers, loss=mse)
    return jpipe.Staged(pre=LinenEmbed(), layer=LinenBlock(), post=nn.Dense(3), num_layers=num_layers, loss=mse)


def make_batch(size: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": jnp.asarray(rng.normal(size=(size, 6)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(size, 3)), jnp.float32)}


def assert_step_matches_sequential(model: jpipe.Staged, plan: jpipe.Plan, batch: dict) -> None:
    lr = 0.1
    params = model.init_params(jax.random.key(1), batch)
    devices = jax.devices()[: plan.pipe * plan.data]
    state = jpipe.init(model, plan, optax.sgd(lr), batch, params=params, devices=devices)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(model.loss_value))(params, batch)
    state, metrics = jpipe.train_step(state, batch)

    np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-6)
    grads = jax.tree.map(lambda new, old: (old - new) / lr, jpipe.to_sequential(state), params)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref_grads))
    assert scale > 0
    worst = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))
    assert worst <= 1e-5 * scale, f"gradient differs by {worst:.3g} (max |grad| {scale:.3g})"


GRID = [  # (pipe, data, microbatches, partition)
    (4, 2, 8, None),
    (2, 4, 3, None),
    (4, 1, 2, None),  # fewer micro-batches than stages
    (4, 2, 5, None),  # M not a multiple of P
    (4, 2, 6, (1, 3, 2, 2)),  # uneven
    (8, 1, 16, None),
    (1, 8, 4, None),
]


def _grid_cases():
    """Every mesh of GRID x schedule x framework x stash/remat (84 cases). By default each
    (schedule, framework, remat) runs once, on the meshes of GRID in turn so that every mesh runs
    too (12 cases); the other 72 are marked ``exhaustive``."""
    combos = list(itertools.product(["gpipe", "1f1b", "1f1b-b"], ["nnx", "linen"], [False, True]))
    default = {(GRID[i % len(GRID)], combo) for i, combo in enumerate(combos)}
    for mesh in GRID:
        for combo in combos:
            schedule, framework, remat = combo
            yield pytest.param(*mesh, *combo, marks=() if (mesh, combo) in default else pytest.mark.exhaustive,
                               id="-".join(map(str, (*mesh, schedule, framework, "remat" if remat else "stash"))))


@pytest.mark.parametrize("pipe,data,microbatches,partition,schedule,framework,remat", list(_grid_cases()))
def test_step_equals_sequential_grad(pipe, data, microbatches, partition, schedule, framework, remat):
    plan = jpipe.Plan(pipe, data, microbatches, schedule=schedule, partition=partition, remat=remat)
    batch = make_batch(2 * data * microbatches)
    assert_step_matches_sequential(make_model(framework), plan, batch)


@pytest.mark.parametrize("shard", [None, "optimizer"])
@pytest.mark.parametrize("pipe,data,microbatches,partition", [(4, 2, 8, None), (2, 4, 3, None),
                                                              (4, 2, 6, (1, 3, 2, 2))], ids=lambda v: str(v))
def test_every_shard_level_gives_the_sequential_gradient(pipe, data, microbatches, partition, shard):
    """The grid above runs the default level (Plan.shard); the other levels on a few meshes."""
    plan = jpipe.Plan(pipe, data, microbatches, partition=partition, shard=shard)
    assert_step_matches_sequential(make_model("nnx"), plan, make_batch(2 * data * microbatches))


def test_training_loss_goes_down_and_state_roundtrips():
    model = make_model("nnx")
    batch = make_batch(32)
    plan = jpipe.Plan(4, 2, 4)
    state = jpipe.init(model, plan, optax.adam(1e-2), batch, rng=jax.random.key(0))
    losses = []
    for _ in range(20):
        state, metrics = jpipe.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0]
    assert int(state.step) == 20
    # to_sequential / init(params=...) is an exact round trip and evaluates the same model
    seq = jpipe.to_sequential(state)
    again = jpipe.to_sequential(jpipe.init(model, jpipe.Plan(2, 4, 2, partition=(3, 5)), optax.sgd(0.1),
                                           batch, params=seq))
    for a, b in zip(jax.tree.leaves(seq), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(seq["layers"]) == model.num_layers
    assert float(model.loss_value(seq, batch)) < losses[0]


def test_state_is_sharded_stage_by_stage():
    model = make_model("nnx")
    state = jpipe.init(model, jpipe.Plan(4, 2, 2, shard="optimizer"), optax.adam(1e-3), make_batch(8),
                       rng=jax.random.key(0))
    kernel = state.params["stages"]["up"]["kernel"]
    assert kernel.shape == (4, 1, 2, HIDDEN, 2 * HIDDEN)  # [devices, chunks, layers per stage, ...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("pipe")
    # each device holds only its own stage's layers
    assert {s.data.shape for s in kernel.addressable_shards} == {(1, 1, 2, HIDDEN, 2 * HIDDEN)}
    # and half of their optimizer state: the other half is on the stage's other data device
    mu = state.opt_state[0].mu["stages"]["up"]["kernel"]
    assert mu.sharding.spec == jax.sharding.PartitionSpec("pipe", None, None, None, "data")
    assert {s.data.shape for s in mu.addressable_shards} == {(1, 1, 2, HIDDEN, HIDDEN)}


def test_train_step_donates_and_can_be_lowered():
    model = make_model("nnx")
    batch = make_batch(16)
    state = jpipe.init(model, jpipe.Plan(4, 2, 4), optax.sgd(0.1), batch, rng=jax.random.key(0))
    compiled = jpipe.train_step.lower(state, batch).compile()
    assert compiled.memory_analysis().temp_size_in_bytes > 0
    old = state.params["pre"]["linear"]["kernel"]
    state, _ = jpipe.train_step(state, batch)
    assert old.is_deleted()


def _takes_chunks(generator) -> bool:
    import inspect

    return "num_chunks" in inspect.signature(generator).parameters


def _every_schedule_case():
    """Each schedule at P 2 and 4, M = P and 2P + 1, every chunk count. By default two per schedule:
    P=2, M=P (the fewest micro-batches) with one chunk, and P=4, M=2P+1 with the most chunks."""
    for name, generator in sorted(jpipe.schedules.SCHEDULES.items()):
        most = 2 if _takes_chunks(generator) else 1
        for pipe in (2, 4):
            for microbatches in (pipe, 2 * pipe + 1):
                for chunks in (1, 2) if _takes_chunks(generator) else (1,):
                    default = (pipe, microbatches, chunks) in {(2, 2, 1), (4, 9, most)}
                    yield pytest.param(name, pipe, microbatches, chunks, marks=() if default else pytest.mark.exhaustive,
                                       id=f"{name}-P{pipe}-M{microbatches}-v{chunks}")


@pytest.mark.parametrize("name,pipe,microbatches,chunks", list(_every_schedule_case()))
def test_every_registered_schedule_is_exact(name, pipe, microbatches, chunks):
    """Every generator in jpipe.schedules.SCHEDULES runs with exact gradients."""
    plan = jpipe.Plan(pipe, 8 // pipe, microbatches, schedule=name, virtual_stages=chunks)
    assert_step_matches_sequential(make_model("nnx"), plan, make_batch(2 * (8 // pipe) * microbatches))


@pytest.mark.parametrize("name,pipe,microbatches,chunks,remat", [
    ("1f1b-b", 4, 9, 1, False), ("1f1b", 2, 2, 1, True), ("zb-h1", 4, 4, 1, False),
    ("interleaved-1f1b", 2, 5, 2, False), ("gpipe", 4, 5, 1, True),
])
def test_fused_ticks_are_exact(name, pipe, microbatches, chunks, remat):
    """Two lanes per tick (one forward, one backward) give the same loss and gradients."""
    plan = jpipe.Plan(pipe, 8 // pipe, microbatches, schedule=name, virtual_stages=chunks, remat=remat,
                      fuse_ticks=True)
    assert plan.table().lanes == 2
    assert_step_matches_sequential(make_model("nnx"), plan, make_batch(2 * (8 // pipe) * microbatches))


def split_backward(table: jpipe.schedules.Table, defer: bool) -> jpipe.schedules.Table:
    """The same order with each backward split into B then W (right after it, or all at the end)."""
    S = jpipe.schedules
    orders = []
    for order in table.orders():
        out, deferred = [], []
        for a in order:
            out.append(a)
            if a.kind == "B":
                (deferred if defer else out).append(S.Action("W", a.microbatch, a.stage))
        orders.append(out + deferred)
    return S.table_from_orders(orders, table.num_microbatches, name="split")


def breadth_first(num_devices: int, num_microbatches: int, num_chunks: int = 2) -> jpipe.schedules.Table:
    """All forwards of every virtual stage in order, then all backwards: chunk traffic wraps the ring."""
    S = jpipe.schedules
    orders = [[] for _ in range(num_devices)]
    stages = num_devices * num_chunks
    for k in range(stages):
        orders[k % num_devices] += [S.Action("F", mb, k) for mb in range(num_microbatches)]
    for k in reversed(range(stages)):
        orders[k % num_devices] += [S.Action("B", mb, k) for mb in range(num_microbatches)]
    return S.table_from_orders(orders, num_microbatches, num_chunks=num_chunks, name="breadth-first")


@pytest.mark.parametrize("remat", [False, True], ids=["stash", "remat"])
@pytest.mark.parametrize("framework", ["nnx", "linen"])
@pytest.mark.parametrize("defer", [False, True], ids=["w-now", "w-deferred"])
def test_split_backward_is_exact(defer, framework, remat):
    plan = jpipe.Plan(4, 2, 5, remat=remat,
                      schedule=lambda p, m: split_backward(jpipe.schedules.one_f_one_b(p, m), defer))
    assert_step_matches_sequential(make_model(framework), plan, make_batch(20))


@pytest.mark.parametrize("remat", [False, True], ids=["stash", "remat"])
@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_virtual_stages_are_exact(framework, remat):
    plan = jpipe.Plan(4, 2, 3, schedule=breadth_first, virtual_stages=2, remat=remat, partition=(1, 1, 1, 2, 1, 1, 1, 1))
    assert_step_matches_sequential(make_model(framework, num_layers=9), plan, make_batch(12))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_tick_exchanges_only_after_all_its_compute(schedule):
    """Neither ppermute may be scheduled between a tick's branches: CPU collectives block until the
    neighbour arrives, so an activation sent before the backward branch makes one device's F wait
    for the other's B (the two then run one after the other, not side by side)."""
    import re

    model = make_model("nnx")
    batch = make_batch(16)
    state = jpipe.init(model, jpipe.Plan(2, 1, 4, schedule=schedule), optax.sgd(0.1), batch,
                       rng=jax.random.key(0), devices=jax.devices()[:2])
    text = jpipe.train_step.lower(state, batch).compile().as_text()  # a scheduled module prints in order
    bodies = [body for body in re.split(r"\n(?=\S)", text) if " collective-permute(" in body]
    assert bodies, "no collective-permute in the compiled step"
    for body in bodies:
        lines = body.splitlines()
        first_send = next(i for i, line in enumerate(lines) if " collective-permute(" in line)
        late = [line.split("=")[0].strip() for line in lines[first_send:] if " conditional(" in line]
        assert not late, f"branches scheduled after the first ppermute: {late}"


@pytest.fixture
def unwritten_slots_hold_nan(monkeypatch):
    """The executor's buffers start as NaN instead of ``lax.empty`` (zeros on CPU, garbage on GPU):
    a step that ever read a slot before the table wrote it would get a NaN loss or gradient."""
    from jpipe import _executor

    monkeypatch.setattr(_executor, "_unwritten", lambda shape, dtype: jnp.full(shape, jnp.nan, dtype)
                        if jnp.issubdtype(dtype, jnp.inexact) else jnp.zeros(shape, dtype))
    jax.clear_caches()  # train_step compiled with the real buffers must not be reused
    yield
    jax.clear_caches()


@pytest.mark.parametrize("name,pipe,microbatches,chunks,remat,fuse", [
    pytest.param(name, 4, 5, 2 if _takes_chunks(generator) else 1, False, False, id=name)
    for name, generator in sorted(jpipe.schedules.SCHEDULES.items())
] + [pytest.param("1f1b", 4, 6, 1, True, False, id="1f1b-remat"),
     pytest.param("1f1b-b", 4, 9, 1, False, True, id="1f1b-b-fused")])
def test_no_unwritten_buffer_slot_is_ever_read(unwritten_slots_hold_nan, name, pipe, microbatches, chunks, remat,
                                               fuse):
    plan = jpipe.Plan(pipe, 8 // pipe, microbatches, schedule=name, virtual_stages=chunks, remat=remat,
                      fuse_ticks=fuse)
    assert_step_matches_sequential(make_model("nnx"), plan, make_batch(2 * (8 // pipe) * microbatches))


@pytest.mark.parametrize("shard", [None, "parameters"])
def test_value_and_grad_is_the_sequential_gradient_and_leaves_the_state(shard):
    model, batch = make_model("linen"), make_batch(16)
    params = model.init_params(jax.random.key(1), batch)
    state = jpipe.init(model, jpipe.Plan(4, 2, 2, shard=shard), optax.sgd(0.1), batch, params=params)
    loss, grads = jpipe.value_and_grad(state, batch)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(model.loss_value))(params, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref_grads))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert float(jnp.abs(a - b).max()) <= 1e-5 * scale
    assert int(state.step) == 0  # not updated, not donated: it still trains
    state, metrics = jpipe.train_step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-6)
