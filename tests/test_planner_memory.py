"""The planner's memory model against what a device really holds: its shard of the state plus the
compiled step's temp bytes (XLA's memory analysis, exact on CPU), on plans of every mesh shape,
schedule and shard level.

Each measured plan compiles one ``train_step`` (5-20 s on the 2-core machine); the profile is
built from shapes alone (``partition.memory_profile``), once per model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jpipe
import jpipe.models
from jpipe import Plan
from jpipe.partition import CommCost, LayerCost, Profile, evaluate, memory_profile, predict_memory
from jpipe.partition._search import _reductions


def _bf16_mlp(hidden: int = 128, num_layers: int = 4) -> jpipe.Staged:
    """An MLP whose weights, activations and optimizer state are bfloat16."""
    bf16 = jnp.bfloat16

    class Input(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(16, hidden, param_dtype=bf16, dtype=bf16, rngs=rngs)

        def __call__(self, mb: dict) -> jax.Array:
            return self.linear(mb["x"].astype(bf16))

    class Layer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(hidden, hidden, param_dtype=bf16, dtype=bf16, rngs=rngs)

        def __call__(self, h: jax.Array) -> jax.Array:
            return h + jnp.tanh(self.linear(h))

    return jpipe.Staged(pre=Input, layer=Layer,
                        post=lambda rngs: nnx.Linear(hidden, 4, param_dtype=bf16, dtype=bf16, rngs=rngs),
                        num_layers=num_layers,
                        loss=lambda out, mb: jnp.mean((out.astype(jnp.float32) - mb["y"]) ** 2))


def _regression(size: int) -> dict:
    return {"x": np.zeros((size, 16), np.float32), "y": np.zeros((size, 4), np.float32)}


def _tokens(size: int) -> dict:
    return {"tokens": np.zeros((size, 16), np.int32), "targets": np.zeros((size, 16), np.int32)}


MODELS = {
    "mlp": (lambda: jpipe.models.mlp(in_dim=16, hidden=64, out_dim=4, num_layers=8), _regression),
    "gpt": (lambda: jpipe.models.gpt(vocab_size=512, seq_len=16, d_model=32, num_heads=2, num_layers=4),
            _tokens),
    "bf16-mlp": (_bf16_mlp, _regression),
}

# (model, global batch, plan): every mesh shape of 8 devices, both schedules, every shard level, an
# uneven partition (its stages run their layers masked), bfloat16 weights
PLANS = [
    ("mlp", 64, Plan(pipe=2, data=4, microbatches=4, schedule="1f1b", shard="optimizer")),
    ("mlp", 64, Plan(pipe=4, data=2, microbatches=8, schedule="gpipe", shard=None)),
    ("mlp", 64, Plan(pipe=8, data=1, microbatches=8, schedule="1f1b", shard="parameters")),
    ("mlp", 64, Plan(pipe=1, data=8, microbatches=2, schedule="1f1b", shard=None)),
    ("mlp", 64, Plan(pipe=2, data=4, microbatches=2, schedule="gpipe", shard="parameters", partition=(3, 5))),
    ("gpt", 32, Plan(pipe=4, data=2, microbatches=8, schedule="1f1b", shard="optimizer")),
    ("bf16-mlp", 64, Plan(pipe=4, data=2, microbatches=4, schedule="1f1b", shard="parameters")),
]


@functools.cache
def _profile(name: str) -> Profile:
    """Sizes at a micro-batch of 4 samples; evaluate rescales them to each plan's micro-batch."""
    make, batch = MODELS[name]
    return memory_profile(make(), batch(4))


def _state_bytes(state: jpipe.TrainState) -> int:
    """The fullest device's bytes of parameters and optimizer state (its shards)."""
    per_device: dict[int, int] = {}
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        for shard in leaf.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    return max(per_device.values())


def _id(case: tuple) -> str:
    name, _, p = case
    uneven = "-" + "+".join(map(str, p.partition)) if p.partition else ""
    return f"{name}-{p.pipe}x{p.data}-M{p.microbatches}-{p.schedule}-{p.shard}{uneven}"


@pytest.mark.parametrize("case", PLANS, ids=[_id(c) for c in PLANS])
def test_predicted_memory_is_within_10_percent_of_state_plus_compiled_temp(case):
    name, size, plan = case
    make, batch_of = MODELS[name]
    batch = batch_of(size)
    state = jpipe.init(make(), plan, optax.adam(1e-3), batch, rng=jax.random.key(0))
    stored = _state_bytes(state)
    temp = jpipe.compiled_memory(state, batch)["temp"]
    cand = evaluate(_profile(name), plan, size)
    terms = cand.terms
    assert cand.memory == terms.total == terms.state + terms.temp
    assert terms.state == pytest.approx(stored, rel=0.01), terms.explain()
    assert cand.memory == pytest.approx(stored + temp, rel=0.10), \
        f"measured {(stored + temp) / 2**20:.3f} MiB (state {stored / 2**20:.3f} + temp " \
        f"{temp / 2**20:.3f}); predicted {terms.explain()}"


def test_memory_profile_knows_the_dtypes_and_accumulators_are_float32():
    f32, bf16 = _profile("mlp").layers[0], _profile("bf16-mlp").layers[0]
    assert f32.accumulator_bytes == f32.param_bytes
    assert bf16.accumulator_bytes == 2 * bf16.param_bytes               # float32 sums of bfloat16 weights
    assert bf16.param_bytes == 2 * (128 * 128 + 128)
    assert bf16.activation_bytes == 2 * 4 * 128                          # bfloat16 activations
    prof = _profile("bf16-mlp")
    m = predict_memory(prof, Plan(pipe=2, data=4, microbatches=4, shard=None), 64)
    io = prof.pre.accumulator_bytes + prof.post.accumulator_bytes
    assert m.accumulators == 2 * bf16.accumulator_bytes + io                  # 2 layers a stage


def test_shard_levels_trade_stored_state_for_gathered_copies():
    prof = _profile("mlp")
    layer, io = prof.layers[0], (prof.pre, prof.post)
    io_params = sum(p.param_bytes for p in io)
    m = {s: predict_memory(prof, Plan(pipe=2, data=4, microbatches=4, shard=s), 64) for s in
         (None, "optimizer", "parameters")}
    assert m[None].state > m["optimizer"].state > m["parameters"].state
    assert m[None].params == io_params + 4 * layer.param_bytes      # pre/post everywhere, 4 layers a stage
    assert m["optimizer"].params == io_params / 8 + 4 * layer.param_bytes
    assert m["parameters"].params == io_params / 8 + 4 * layer.param_bytes / 4
    assert (m[None].gathered, m["optimizer"].gathered, m["parameters"].gathered) == \
        (0.0, io_params, io_params + 4 * layer.param_bytes)
    # nothing is split on one device, so nothing is gathered
    assert predict_memory(prof, Plan(pipe=1, data=1, microbatches=2, shard="parameters"), 8).gathered == 0.0


def test_buffers_follow_the_schedule_depths():
    prof = _profile("mlp")
    plans = [Plan(pipe=4, data=2, microbatches=8, schedule=s) for s in ("gpipe", "1f1b")]
    gpipe, one_f_one_b = (predict_memory(prof, p, 64) for p in plans)
    assert gpipe.buffers > one_f_one_b.buffers
    layer = prof.scaled(4).layers[0]
    table = plans[0].table()
    assert gpipe.buffers == (table.in_depth + 1 + 2 * (table.cot_depth + 1)) * layer.activation_bytes \
        + table.res_depth * 2 * layer.residual_bytes                     # 2 layers a stage
    remat = predict_memory(prof, Plan(pipe=4, data=2, microbatches=8, schedule="gpipe", remat=True), 64)
    assert remat.buffers < gpipe.buffers                                  # no residuals stashed


def test_end_of_step_collectives_follow_the_shard_level():
    """All-reduce where the state is replicated; reduce-scatter (half a ring all-reduce's traffic) of the
    float32 gradients plus all-gathers of the weights where it is split."""
    layer = LayerCost("l", 0, 0, 1e3, param_bytes=1e6, optimizer_bytes=2e6, grad_bytes=2e6)   # bfloat16
    io = LayerCost("io", 0, 0, 1e3, param_bytes=1e5, optimizer_bytes=2e5, grad_bytes=2e5)
    prof = Profile(layers=(layer,) * 8, microbatch_size=4, pre=io, post=io)
    comm = CommCost.linear(0.0, 0.0, allreduce_latency=0.0, allreduce_per_byte=1e-9)
    n, data = 8, 4
    ring = lambda size, k: size * (k - 1) / k * 1e-9
    replicated = _reductions(prof, Plan(pipe=2, data=data, microbatches=4, shard=None), comm)
    assert replicated == pytest.approx(2 * ring(4e5, n) + 2 * ring(4 * 2e6, data))
    for shard in ("optimizer", "parameters"):
        split = _reductions(prof, Plan(pipe=2, data=data, microbatches=4, shard=shard), comm)
        assert split == pytest.approx(ring(4e5, n) + ring(4 * 2e6, data) + ring(2e5, n) + ring(4 * 1e6, data))
    assert split < replicated        # bfloat16 weights are gathered at half the bytes of float32 gradients
    prof32 = Profile(layers=(layer._replace(grad_bytes=None),) * 8, microbatch_size=4,
                     pre=io._replace(grad_bytes=None), post=io._replace(grad_bytes=None))
    assert _reductions(prof32, Plan(pipe=2, data=data, microbatches=4, shard="optimizer"), comm) == \
        pytest.approx(_reductions(prof32, Plan(pipe=2, data=data, microbatches=4, shard=None), comm))
