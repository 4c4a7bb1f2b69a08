"""Bad input of every kind fails at once with an error that names the problem and the fix: no hang, no
crash, no wrong result, nothing changed on disk.

Sections: the batch, the plan, partition and schedule, the model's parts, NaN and inf, consumed states,
the parameters' layout, checkpoints, the zoo's token ids, the command line (options, config files, run
folders, paths, ``jpipe report`` and ``jpipe schedule show``) and multi-process runs. Cases that need a
finished run (a refused ``--resume`` leaves the folder as it was) are in ``test_cli.py``; those that need
two live processes in ``test_distributed.py`` (each bounded at 60 s).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
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
    parts = {"pre": NnxEmbed, "layer": NnxBlock, "post": lambda rngs: nnx.Linear(HIDDEN, 3, rngs=rngs),
             "num_layers": 4, "loss": mse}
    return jpipe.Staged(**{**parts, **changes})


@pytest.mark.parametrize("model, message", [
    (_staged(layer=lambda rngs: nnx.Linear(HIDDEN, 8, rngs=rngs)),
     (r"layer maps the hidden state float32\[8, 16\] to float32\[8, 8\]; every layer must keep the hidden "
      r"shape and dtype")),
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


def test_nnx_module_instance_instead_of_constructor():
    with pytest.raises(TypeError, match=r"pass a constructor instead"):
        jpipe.Staged(pre=nnx.Linear(2, 2, rngs=nnx.Rngs(0)), layer=lambda rngs: nnx.Linear(2, 2, rngs=rngs),
                     post=lambda rngs: nnx.Linear(2, 2, rngs=rngs), num_layers=2, loss=lambda o, b: o.mean())


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
    with pytest.raises(ValueError, match=r"unknown schedule 'zb-h9'; choose one of \[.*'1f1b-b'.*'gpipe'.*\]"):
        jpipe.Plan(2, 1, 2, schedule="zb-h9")


def test_mesh_size_must_match_devices():
    with pytest.raises(ValueError, match=r"pipe x data = 4 x 4 = 16 but there are 8 devices"):
        jpipe.make_mesh(4, 4)


def test_init_with_a_plan_smaller_than_the_devices_names_devices(model):
    with pytest.raises(ValueError, match=r"4 x 1 = 4 but there are 8 devices.*devices="):
        jpipe.init(model, jpipe.Plan(4, 1, 2), optax.sgd(0.1), make_batch(8), rng=jax.random.key(0))


def test_batch_not_divisible_by_data_times_microbatches(model):
    with pytest.raises(ValueError, match=r"10 samples, not divisible by data x microbatches = 1 x 4 = 4"):
        jpipe.init(model, jpipe.Plan(2, 1, 4), optax.sgd(0.1), make_batch(10), rng=jax.random.key(0),
                   devices=DEVICES)


def test_more_stages_than_layers(model):
    with pytest.raises(ValueError, match=r"8 pipeline stages but the model has only 4 layers"):
        jpipe.init(model, jpipe.Plan(8, 1, 8), optax.sgd(0.1), make_batch(16), rng=jax.random.key(0))


@pytest.mark.parametrize("field", ["pipe", "data", "microbatches"])
def test_counts_must_be_positive(field):
    kwargs = {"pipe": 2, "data": 1, "microbatches": 2, field: 0}
    with pytest.raises(ValueError, match=rf"Plan.{field} must be an int >= 1, got 0"):
        jpipe.Plan(**kwargs)


def test_params_with_wrong_layer_count(model):
    params = make_model("nnx", num_layers=6).init_params(jax.random.key(0), make_batch(8))
    with pytest.raises(ValueError, match=r"params\['layers'\] has 6 entries, the model has 4 layers"):
        jpipe.init(model, PLAN, optax.sgd(0.1), make_batch(16), params=params, devices=DEVICES)


def test_rng_or_params_exactly_one(model):
    with pytest.raises(ValueError, match=r"exactly one of rng="):
        jpipe.init(model, PLAN, optax.sgd(0.1), make_batch(16), devices=DEVICES)


def test_schedule_function_for_wrong_sizes(model):
    plan = jpipe.Plan(2, 1, 2, schedule=lambda devices, m: schedules.one_f_one_b(devices, m + 1))
    with pytest.raises(ValueError, match=r"table for 2 devices, 3 micro-batches and 1 chunks per device; "
                                         r"the plan has pipe=2, microbatches=2"):
        jpipe.init(model, plan, optax.sgd(0.1), make_batch(16), rng=jax.random.key(0), devices=DEVICES)


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


# ---- the command line ----------------------------------------------------------------------------
# Each case: the argv (built in a fresh folder) and a fragment of the one-paragraph error, exit code 2.

SMALL = ["--max-chars", "300000", "--steps", "1"]
PLANNED = ["--pipe", "2", "--data", "4", "--microbatches", "2", *SMALL]


def _config(text: str | bytes) -> Callable[[Path], list[str]]:
    def write(tmp: Path) -> list[str]:
        path = tmp / "run.toml"
        (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
        return ["train", "--config", str(path)]
    return write


def _held_folder(tmp: Path) -> list[str]:
    (tmp / "run" / "checkpoints" / "2").mkdir(parents=True)  # another run's checkpoint
    return ["train", *PLANNED, "--out", str(tmp / "run")]


def _locked_folder(tmp: Path) -> list[str]:
    (tmp / "run").mkdir()
    (tmp / "run" / ".lock").write_text(json.dumps({"pid": os.getppid(), "host": platform.node()}))
    return ["train", *PLANNED, "--out", str(tmp / "run")]


def _out_is_a_file(tmp: Path) -> list[str]:
    (tmp / "afile").write_text("")
    return ["train", *PLANNED, "--out", str(tmp / "afile")]


def _out_under_a_file(tmp: Path) -> list[str]:
    (tmp / "afile").write_text("")
    return ["train", *PLANNED, "--out", str(tmp / "afile" / "run")]


def _metrics_without_step(tmp: Path) -> list[str]:
    (tmp / "run").mkdir()
    (tmp / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"loss": 1.0}\n')
    return ["report", str(tmp / "run")]


JOIN = ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"]
CLI_CASES = {
    "batch-not-divisible": (["train", "--batch-size", "6", "--pipe", "2", "--data", "2", "--microbatches", "2",
                             *SMALL], "multiple of data x microbatches"),
    "unknown-schedule": (["train", "--schedule", "zigzag", *SMALL], "unknown schedule 'zigzag'; choose one of"),
    "heads-do-not-divide-width": (["train", "--d-model", "10", "--heads", "4"], "divisible"),
    "dropout-of-one": (["train", "--dropout", "1.0"], "--dropout must be in [0, 1)"),
    "resume-step-without-resume": (["train", "--resume-step", "2"], "--resume-step goes with --resume"),
    "config-unknown-key": (_config("stepz = 3\n"), "unknown key 'stepz'"),
    "config-wrong-type": (_config('steps = "many"\n'), "steps must be an integer"),
    "config-not-toml": (_config("steps = \n"), "not valid TOML"),
    "config-binary": (_config(bytes(range(128, 256))), "run.toml' is not valid TOML"),
    "config-missing": (lambda tmp: ["train", "--config", str(tmp / "missing.toml")], "does not exist"),
    "resume-no-run": (lambda tmp: ["train", "--resume", str(tmp / "nothing")], "no config.toml"),
    "folder-of-another-run": (_held_folder, "holds another run's checkpoints (2); continue it with --resume"),
    "folder-in-use": (_locked_folder, f"is in use by process {os.getppid()}"),
    "out-is-a-file": (_out_is_a_file, "is a file, not a folder; give a folder"),
    "out-under-a-file": (_out_under_a_file, "cannot be created"),
    "report-no-folder": (lambda tmp: ["report", str(tmp / "nothing")], "does not exist"),
    "report-line-without-step": (_metrics_without_step, 'metrics.jsonl:2 has no integer "step"'),
    "show-negative-microbatches": (["schedule", "show", "1f1b", "--microbatches", "-3"],
                                   "microbatches must be at least 1, got -3"),
    "show-zero-pipe": (["schedule", "show", "1f1b", "--pipe", "0"], "pipe must be at least 1, got 0"),
    "show-chunks-of-a-plain-schedule": (["schedule", "show", "1f1b", "--chunks", "2"],
                                        "schedule '1f1b' takes no num_chunks (it is not interleaved"),
    "show-unknown-schedule": (["schedule", "show", "zigzag"], "unknown schedule 'zigzag'; choose one of"),
    "plan-zero-rounds": (["plan", "--profile-rounds", "0"], "--profile-rounds must be >= 1"),
    "plan-negative-measure": (["plan", "--measure", "-1"], "--measure must be >= 0"),
    "process-id-missing": (["train", "--coordinator", "127.0.0.1:1", "--num-processes", "2"],
                           "missing --process-id"),
    "coordinator-without-port": (["train", "--pipe", "2", "--coordinator", "127.0.0.1", "--num-processes", "2",
                                  "--process-id", "0"], "coordinator must be HOST:PORT"),
    "process-id-too-large": (["train", "--pipe", "2", *JOIN[:4], "--process-id", "2"],
                             "--process-id must be from 0 to"),
    "coordinator-and-distributed": (["train", "--pipe", "2", *JOIN, "--distributed"], "not both"),
    "multi-process-without-a-plan": (["train", *JOIN], "give the plan explicitly"),
    "batch-rows-over-processes": (["train", "--pipe", "3", "--data", "1", "--microbatches", "2", "--batch-size",
                                   "6", *JOIN], "cannot be split evenly over 2 processes"),
}


@pytest.mark.parametrize("case", CLI_CASES)
def test_the_command_line_refuses_with_one_paragraph(case, tmp_path, capsys):
    from jpipe import cli

    argv, message = CLI_CASES[case]
    argv = argv(tmp_path) if callable(argv) else argv
    before = sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err
    assert "Traceback" not in err
    assert sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before  # nothing on disk changed


# ---- multi-process runs (the cases with two live processes are in test_distributed.py) -----------

@pytest.mark.parametrize("args, message", [
    (("10.0.0.1", 2, 0), "coordinator must be HOST:PORT"),
    (("127.0.0.1:1234", 2), "also give process_id"),
    (("127.0.0.1:1234", 2, 2), "process_id must be an int from 0 to num_processes - 1 = 1"),
], ids=["no-port", "no-process-id", "process-id-too-large"])
def test_initialize_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        distributed.initialize(*args)


def test_the_coordinator_port_in_use_is_named_at_once():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"coordinator port {port} is already in use"):
            distributed.initialize(f"127.0.0.1:{port}", 2, 0)
