"""Bad input of every kind fails at once with an error naming the problem: no hang, no wrong result.

Kinds covered here: batch feature shape, batch dtype, batch leading size, leaves that disagree on it,
a missing batch key, something that is not a TrainState, a plan that does not fit the devices, three
partition errors, a schedule table that deadlocks, a schedule table for other devices, an unknown
schedule, NaN and inf in the batch, a non-finite loss, a bad NaN policy, parameters in the wrong
layout, an optimizer that does not match the checkpoint, a model that does not match it, a damaged
array file, damaged metadata, an empty checkpoint directory, bad checkpoint settings and a bad
coordinator address.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_executor import HIDDEN, NnxBlock, NnxEmbed, make_batch, make_model, mse

import jpipe
from jpipe import distributed, schedules
from jpipe._train import NonFiniteError
from jpipe.checkpoint import Checkpointer, CheckpointError

DEVICES = jax.devices()[:2]
PLAN = jpipe.Plan(2, 1, 2)


@pytest.fixture(scope="module")
def model() -> jpipe.Staged:
    return make_model("nnx", num_layers=4)


@pytest.fixture(scope="module")
def live(model):
    """One state shared by the tests below (each puts back a usable state), so it compiles once."""
    return {"state": jpipe.init(model, PLAN, optax.adam(1e-2), make_batch(16), rng=jax.random.key(0),
                                devices=DEVICES)}


# ---- the batch ---------------------------------------------------------------------------------

def _with(**changes) -> dict:
    batch = make_batch(16)
    batch.update(changes)
    return batch


@pytest.mark.parametrize("batch, error, message", [
    (_with(x=jnp.ones((16, 5))), ValueError, r"batch\['x'\] is float32\[16, 5\].*float32\[16, 6\]"),
    (_with(x=jnp.ones((16, 6), jnp.float16)), ValueError, r"batch\['x'\] is float16\[16, 6\].*float32"),
    (make_batch(12), ValueError, (r"batch has 12 samples but the state was initialised with an "
                                  r"example_batch of 16")),
    (_with(y=jnp.ones((8, 3))), ValueError, r"disagree on the leading \(batch\) size: \[8, 16\]"),
    ({"x": jnp.ones((16, 6))}, ValueError, r"batch has structure"),
], ids=["feature-shape", "dtype", "leading-size", "leading-sizes-disagree", "missing-key"])
def test_bad_batch(live, batch, error, message):
    with pytest.raises(error, match=message):
        jpipe.train_step(live["state"], batch)


def test_odd_leading_size(live):
    with pytest.raises(ValueError, match=r"15 samples, not divisible by data x microbatches = 1 x 2 = 2"):
        jpipe.train_step(live["state"], make_batch(15))


def test_not_a_train_state():
    with pytest.raises(TypeError, match=r"train_step takes a jpipe.TrainState .* got dict"):
        jpipe.train_step({"params": 1}, make_batch(16))


# ---- plan, partition, schedule -------------------------------------------------------------------

def test_plan_does_not_fit_the_devices(model):
    with pytest.raises(ValueError, match=r"pipe x data = 4 x 4 = 16 but there are 8 devices"):
        jpipe.init(model, jpipe.Plan(4, 4, 2), optax.sgd(0.1), make_batch(32), rng=jax.random.key(0))


@pytest.mark.parametrize("partition, message", [
    ((4, 0), r"partition \(4, 0\) has a stage with 0 layers"),
    ((2, 3), r"partition \(2, 3\) sums to 5 but the model has 4 layers"),
    ((1, 1, 2), r"partition \(1, 1, 2\) has 3 entries but there are 2 stages"),
])
def test_bad_partition(model, partition, message):
    with pytest.raises(ValueError, match=message):
        jpipe.init(model, jpipe.Plan(2, 1, 2, partition=partition), optax.sgd(0.1), make_batch(16),
                   rng=jax.random.key(0), devices=DEVICES)


def _staged(**changes) -> jpipe.Staged:
    parts = dict(pre=NnxEmbed, layer=NnxBlock, post=lambda rngs: nnx.Linear(HIDDEN, 3, rngs=rngs), num_layers=4,
                 loss=mse)
    parts.update(changes)
    return jpipe.Staged(**parts)


@pytest.mark.parametrize("model, message", [
    (_staged(layer=lambda rngs: nnx.Linear(HIDDEN, 8, rngs=rngs)),
     r"layer maps the hidden state float32\[8, 16\] to float32\[8, 8\]; every layer must keep the hidden "
     r"shape and dtype"),
    (_staged(layer=lambda rngs: nnx.Linear(HIDDEN, HIDDEN, dtype=jnp.bfloat16, rngs=rngs)),
     r"layer maps the hidden state float32\[8, 16\] to bfloat16\[8, 16\]"),
    (_staged(loss=lambda out, mb: (out - mb["y"]) ** 2),
     r"the loss returns float32\[8, 3\], not a scalar; return the micro-batch's mean loss"),
    (_staged(pre=lambda rngs: nnx.Linear(6, HIDDEN, rngs=rngs)),
     r"pre cannot take the micro-batch \{\['x'\]: float32\[8, 6\], \['y'\]: float32\[8, 3\]\}"),
], ids=["layer-shape", "layer-dtype", "vector-loss", "pre-takes-no-dict"])
def test_model_parts_that_do_not_fit_are_named_at_init(model, message):
    with pytest.raises(ValueError, match=message):
        jpipe.init(model, PLAN, optax.sgd(0.1), make_batch(16), rng=jax.random.key(0), devices=DEVICES)


class KeywordBlock(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:  # NNX's usual keyword-only rngs
        self.linear = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)

    def __call__(self, h):
        return h + self.linear(h)


def test_nnx_constructors_may_take_rngs_by_keyword():
    state = jpipe.init(_staged(layer=KeywordBlock), PLAN, optax.sgd(0.1), make_batch(16), rng=jax.random.key(0),
                       devices=DEVICES)
    assert np.isfinite(float(jpipe.train_step(state, make_batch(16))[1]["loss"]))


@pytest.mark.parametrize("kwargs, message", [
    ({"partition": (2.5, 1.5)}, r"Plan.partition must be whole layer counts per stage, got \(2.5, 1.5\)"),
    ({"remat": "no"}, r"Plan.remat must be True or False, got 'no'"),
    ({"fuse_ticks": 1}, r"Plan.fuse_ticks must be True or False, got 1"),
], ids=["fractional-partition", "remat-string", "fuse-ticks-int"])
def test_plan_fields_of_the_wrong_type(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jpipe.Plan(2, 1, 2, **kwargs)


def _deadlocking(num_devices: int, num_microbatches: int) -> schedules.Table:
    A = schedules.Action
    orders = [[A("B", m, d) for m in range(num_microbatches)] + [A("F", m, d) for m in range(num_microbatches)]
              for d in range(num_devices)]
    return schedules.table_from_orders(orders, num_microbatches, name="backwards-first")


def test_schedule_table_that_deadlocks(model):
    with pytest.raises(schedules.ScheduleError, match=r"'backwards-first' deadlocks at tick 0"):
        jpipe.init(model, jpipe.Plan(2, 1, 2, schedule=_deadlocking), optax.sgd(0.1), make_batch(16),
                   rng=jax.random.key(0), devices=DEVICES)


def test_schedule_table_for_other_devices(model):
    def wrong(num_devices, num_microbatches):
        return schedules.gpipe(num_devices * 2, num_microbatches)

    with pytest.raises(ValueError, match=r"schedule returned a table for 4 devices.*the plan has pipe=2"):
        jpipe.init(model, jpipe.Plan(2, 1, 2, schedule=wrong), optax.sgd(0.1), make_batch(16),
                   rng=jax.random.key(0), devices=DEVICES)


def test_unknown_schedule():
    with pytest.raises(ValueError, match=r"unknown schedule 'zb-h9'"):
        jpipe.Plan(2, 1, 2, schedule="zb-h9")


# ---- NaN and inf ------------------------------------------------------------------------------

@pytest.mark.parametrize("value, where", [(np.nan, "x"), (np.inf, "y")])
def test_nonfinite_batch_raises_with_the_step(live, value, where):
    state = live["state"]
    state, _ = jpipe.train_step(state, make_batch(16))
    skipped = int(state.skipped_steps)
    good_params = jax.tree.map(np.asarray, jpipe.to_sequential(state))
    bad = make_batch(16)
    bad[where] = bad[where].at[3, 1].set(value)
    step = int(state.step) + 1
    with pytest.raises(NonFiniteError, match=rf"step {step}: the batch has NaN or inf in batch\['{where}'\]") as e:
        jpipe.train_step(state, bad)
    assert e.value.step == step
    # the update was left out: the state in the error holds the parameters from before it
    for a, b in zip(jax.tree.leaves(jpipe.to_sequential(e.value.state)), jax.tree.leaves(good_params)):
        np.testing.assert_array_equal(np.asarray(a), b)
    live["state"], metrics = jpipe.train_step(e.value.state, make_batch(16))
    assert bool(metrics["finite"]) and int(metrics["skipped_steps"]) == skipped + 1


def test_nonfinite_loss_from_a_finite_batch_raises(live):
    huge = _with(y=jnp.full((16, 3), 3e38, jnp.float32))  # finite, but its squared error is inf
    with pytest.raises(NonFiniteError, match=r"non-finite values at step \d+: the loss is inf") as e:
        jpipe.train_step(live["state"], huge)
    live["state"] = e.value.state


def test_an_update_that_overflows_the_parameters_raises(model):
    """Finite batch, loss and gradients, but an infinite learning rate: the updated parameters are
    checked too, so the NaN state is never kept (nor checkpointed)."""
    state = jpipe.init(model, PLAN, optax.sgd(float("inf")), make_batch(16), rng=jax.random.key(0),
                       devices=DEVICES)
    before = jax.tree.map(np.asarray, jpipe.to_sequential(state))
    with pytest.raises(NonFiniteError, match=r"the update made a parameter NaN or inf: lower the learning rate") as e:
        jpipe.train_step(state, make_batch(16))
    for a, b in zip(jax.tree.leaves(jpipe.to_sequential(e.value.state)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_a_consumed_state_is_refused_by_name(live):
    old = live["state"]
    live["state"], _ = jpipe.train_step(old, make_batch(16))
    with pytest.raises(ValueError, match=r"an earlier train_step already consumed .* use the returned state"):
        jpipe.train_step(old, make_batch(16))


def test_skip_policy_skips_and_counts(model):
    state = jpipe.init(model, PLAN, optax.sgd(0.1), make_batch(16), rng=jax.random.key(0), devices=DEVICES,
                       nan_policy="skip")
    before = jax.tree.map(np.asarray, jpipe.to_sequential(state))
    bad = _with(x=make_batch(16)["x"].at[0, 0].set(jnp.nan))
    state, metrics = jpipe.train_step(state, bad)
    assert not bool(metrics["finite"]) and int(metrics["skipped_steps"]) == 1 and int(state.step) == 1
    for a, b in zip(jax.tree.leaves(jpipe.to_sequential(state)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)
    state, metrics = jpipe.train_step(state, make_batch(16))
    assert bool(metrics["finite"]) and int(metrics["skipped_steps"]) == 1 and int(state.step) == 2


def test_bad_nan_policy(model):
    with pytest.raises(ValueError, match=r"nan_policy must be one of \['raise', 'skip', 'ignore'\]"):
        jpipe.init(model, PLAN, optax.sgd(0.1), make_batch(16), rng=jax.random.key(0), devices=DEVICES,
                   nan_policy="warn")


def test_params_in_the_wrong_layout(model, live):
    with pytest.raises(ValueError, match=r"params must be a dict with keys 'pre', 'layers', 'post'"):
        jpipe.init(model, PLAN, optax.sgd(0.1), make_batch(16), params=live["state"].params, devices=DEVICES)


# ---- checkpoints -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory, live) -> Path:
    directory = tmp_path_factory.mktemp("ckpt")
    with Checkpointer(directory) as ckpt:
        ckpt.save(live["state"], force=True)
    return directory


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_optimizer_state_does_not_match_after_restore(saved, model):
    with Checkpointer(saved) as ckpt, pytest.raises(CheckpointError, match=(
            r"does not match the optimizer \(41 arrays saved, 41 expected\): opt_state.* is missing from the "
            r"checkpoint.*"
            r"restore with the optimizer it was saved with")):
        ckpt.restore(model, PLAN, optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), make_batch(16),
                     devices=DEVICES)


def test_checkpoint_of_another_model(saved):
    with Checkpointer(saved) as ckpt, pytest.raises(CheckpointError, match=(
            r"does not match the model \(20 arrays saved, 28 expected\): params\['layers'\]\[4\]\['down'\]\['bias'\] "
            r"is missing from the checkpoint")):
        ckpt.restore(make_model("nnx", num_layers=6), PLAN, optax.adam(1e-2), make_batch(16), devices=DEVICES)


def test_damaged_array_file(saved, tmp_path, live):
    directory = _copy(saved, tmp_path / "ckpt")
    # the largest data file of the merged OCDBT database that restore reads (<item>/d/...)
    data = max((p for p in directory.rglob("*") if p.is_file() and p.parent.name == "d"
                and p.parent.parent.name in ("params", "state")), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    with Checkpointer(directory) as ckpt, pytest.raises(CheckpointError, match=r"checkpoint step \d+ .* damaged"):
        ckpt.restore_like(live["state"])


def test_damaged_metadata(saved, tmp_path, model):
    directory = _copy(saved, tmp_path / "ckpt")
    (meta,) = [p for p in directory.rglob("metadata") if p.parent.name == "meta"]
    meta.write_text(meta.read_text()[:100])
    with Checkpointer(directory) as ckpt, pytest.raises(CheckpointError, match=r"damaged: its metadata cannot"):
        ckpt.restore(model, PLAN, optax.adam(1e-2), make_batch(16), devices=DEVICES)


def test_no_checkpoint(tmp_path, model):
    with Checkpointer(tmp_path) as ckpt, pytest.raises(FileNotFoundError, match=r"no complete checkpoint in"):
        ckpt.restore(model, PLAN, optax.adam(1e-2), make_batch(16), devices=DEVICES)


@pytest.mark.parametrize("kwargs, message", [({"every": 0}, "every must be an int >= 1"),
                                             ({"keep": 0}, "keep must be an int >= 1 or None")])
def test_bad_checkpoint_settings(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Checkpointer(tmp_path, **kwargs)


def test_bad_coordinator_address():
    with pytest.raises(ValueError, match=r"coordinator must be HOST:PORT"):
        distributed.initialize("10.0.0.1", 2, 0)


@pytest.mark.parametrize("key, value", [("targets", -1), ("tokens", 16)])
def test_the_zoo_gpt_checks_token_ids_on_the_host(key, value):
    from jpipe import models

    gpt = models.gpt(vocab_size=16, seq_len=8, d_model=16, num_heads=2, num_layers=2)
    batch = {"tokens": jnp.zeros((4, 8), jnp.int32), "targets": jnp.ones((4, 8), jnp.int32)}
    state = jpipe.init(gpt, PLAN, optax.sgd(0.1), batch, rng=jax.random.key(0), devices=DEVICES)
    bad = dict(batch, **{key: batch[key].at[1, 2].set(value)})
    with pytest.raises(ValueError, match=rf'batch\["{key}"\] holds {value}, outside the vocabulary \[0, 16\)'):
        jpipe.train_step(state, bad)
    assert int(state.step) == 0  # refused before the step: the state is intact
    state, metrics = jpipe.train_step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
