"""Bad input fails early with a ValueError that names the offending values and the fix."""

from __future__ import annotations

import jax
import optax
import pytest
from test_executor import make_batch, make_model

import jpipe


@pytest.fixture(scope="module")
def model() -> jpipe.Staged:
    return make_model("nnx", num_layers=8)


def test_mesh_size_must_match_devices():
    with pytest.raises(ValueError, match=r"pipe x data = 4 x 4 = 16 but there are 8 devices"):
        jpipe.make_mesh(4, 4)


def test_init_with_plan_not_matching_devices(model):
    with pytest.raises(ValueError, match=r"4 x 1 = 4 but there are 8 devices.*devices="):
        jpipe.init(model, jpipe.Plan(4, 1, 2), optax.sgd(0.1), make_batch(8), rng=jax.random.key(0))


def test_batch_not_divisible_by_data_times_microbatches(model):
    with pytest.raises(ValueError, match=r"10 samples, not divisible by data x microbatches = 2 x 4 = 8"):
        jpipe.init(model, jpipe.Plan(4, 2, 4), optax.sgd(0.1), make_batch(10), rng=jax.random.key(0))


def test_train_step_batch_not_divisible(model):
    state = jpipe.init(model, jpipe.Plan(4, 2, 4), optax.sgd(0.1), make_batch(16), rng=jax.random.key(0))
    with pytest.raises(ValueError, match=r"12 samples, not divisible by data x microbatches = 2 x 4 = 8"):
        jpipe.train_step(state, make_batch(12))


def test_train_step_batch_with_wrong_feature_shape(model):
    state = jpipe.init(model, jpipe.Plan(4, 2, 4), optax.sgd(0.1), make_batch(16), rng=jax.random.key(0))
    bad = make_batch(16)
    bad["x"] = bad["x"][:, :5]
    with pytest.raises(ValueError, match=r"batch\['x'\] is float32\[16, 5\].*float32\[16, 6\]"):
        jpipe.train_step(state, bad)


def test_train_step_batch_with_missing_key(model):
    state = jpipe.init(model, jpipe.Plan(4, 2, 4), optax.sgd(0.1), make_batch(16), rng=jax.random.key(0))
    with pytest.raises(ValueError, match=r"batch has structure"):
        jpipe.train_step(state, {"x": make_batch(16)["x"]})


@pytest.mark.parametrize(
    "partition, message",
    [
        ((2, 0, 3, 3), r"partition \(2, 0, 3, 3\) has a stage with 0 layers"),
        ((2, 2, 2, 3), r"partition \(2, 2, 2, 3\) sums to 9 but the model has 8 layers"),
        ((4, 4), r"partition \(4, 4\) has 2 entries but there are 4 stages"),
    ],
)
def test_bad_partition(model, partition, message):
    with pytest.raises(ValueError, match=message):
        jpipe.init(model, jpipe.Plan(4, 2, 4, partition=partition), optax.sgd(0.1), make_batch(16),
                   rng=jax.random.key(0))


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match=r"8 pipeline stages but the model has only 4 layers"):
        jpipe.init(make_model("nnx", num_layers=4), jpipe.Plan(8, 1, 8), optax.sgd(0.1), make_batch(16),
                   rng=jax.random.key(0))


def test_unknown_schedule():
    with pytest.raises(ValueError, match=r"unknown schedule 'zb-h9'; choose one of \[.*'1f1b-b'.*'gpipe'.*\]"):
        jpipe.Plan(4, 2, 4, schedule="zb-h9")


@pytest.mark.parametrize("field", ["pipe", "data", "microbatches"])
def test_counts_must_be_positive(field):
    kwargs = {"pipe": 4, "data": 2, "microbatches": 4, field: 0}
    with pytest.raises(ValueError, match=rf"Plan.{field} must be an int >= 1, got 0"):
        jpipe.Plan(**kwargs)


def test_params_with_wrong_layer_count(model):
    params = make_model("nnx", num_layers=6).init_params(jax.random.key(0), make_batch(8))
    with pytest.raises(ValueError, match=r"params\['layers'\] has 6 entries, the model has 8 layers"):
        jpipe.init(model, jpipe.Plan(4, 2, 4), optax.sgd(0.1), make_batch(16), params=params)


def test_rng_or_params_exactly_one(model):
    with pytest.raises(ValueError, match=r"exactly one of rng="):
        jpipe.init(model, jpipe.Plan(4, 2, 4), optax.sgd(0.1), make_batch(16))


def test_nnx_module_instance_instead_of_constructor():
    from flax import nnx

    with pytest.raises(TypeError, match=r"pass a constructor instead"):
        jpipe.Staged(pre=nnx.Linear(2, 2, rngs=nnx.Rngs(0)), layer=lambda rngs: nnx.Linear(2, 2, rngs=rngs),
                     post=lambda rngs: nnx.Linear(2, 2, rngs=rngs), num_layers=2, loss=lambda o, b: o.mean())


def test_schedule_function_for_wrong_sizes(model):
    plan = jpipe.Plan(4, 2, 4, schedule=lambda devices, m: jpipe.schedules.one_f_one_b(devices, m + 1))
    with pytest.raises(ValueError, match=r"table for 4 devices, 5 micro-batches and 1 chunks per device; "
                                         r"the plan has pipe=4, microbatches=4"):
        jpipe.init(model, plan, optax.sgd(0.1), make_batch(16), rng=jax.random.key(0))
