"""Checkpoints: restore onto another mesh, keep the last n, exact resume after SIGKILL mid-write."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from test_executor import make_batch, make_model

import jpipe
from jpipe.checkpoint import Checkpointer

PLAN = jpipe.Plan(4, 2, 2)
SMALL = jpipe.Plan(2, 2, 2)  # for the kill-and-resume run: 4 devices, 4 layers
LR = 1e-2


def batch_for(step: int) -> dict:
    """The batch of a step: a function of the step alone, so a resumed run sees the same data."""
    return make_batch(16, seed=1000 + step)


def _bits(tree) -> list[np.ndarray]:
    return [np.asarray(x).view(np.uint8) for x in jax.tree.leaves(tree)]


def assert_same_bits(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(_bits(a), _bits(b)):
        np.testing.assert_array_equal(x, y)


def _sequential_opt(state: jpipe.TrainState):
    """Adam's mu and nu in sequential layout, for comparing across plans."""
    adam = state.opt_state[0]
    return [jpipe.to_sequential(state.replace(params=t)) for t in (adam.mu, adam.nu)], int(adam.count)


def test_restore_onto_a_different_mesh_is_exact(tmp_path):
    model = make_model("nnx", num_layers=4)
    state = jpipe.init(model, PLAN, optax.adam(LR), batch_for(0), rng=jax.random.key(0))
    for step in range(3):
        state, _ = jpipe.train_step(state, batch_for(step))
    with Checkpointer(tmp_path, every=3) as ckpt:
        assert ckpt.save(state)
        ckpt.wait()
        other = jpipe.Plan(2, 4, 1, schedule="gpipe", partition=(1, 3))
        restored = ckpt.restore(model, other, optax.adam(LR), batch_for(0))
    assert restored.mesh.shape == {"pipe": 2, "data": 4}
    assert int(restored.step) == 3
    assert_same_bits(jpipe.to_sequential(restored), jpipe.to_sequential(state))
    (mu_nu, count), (mu_nu_again, count_again) = _sequential_opt(state), _sequential_opt(restored)
    assert count == count_again == 3
    assert_same_bits(mu_nu, mu_nu_again)
    assert restored.params["stages"]["up"]["kernel"].shape[:3] == (2, 1, 3)  # [devices, chunks, layers]


def test_every_k_keep_last_n_and_params_only(tmp_path):
    model = make_model("nnx", num_layers=4)
    state = jpipe.init(model, jpipe.Plan(2, 1, 2), optax.sgd(LR), batch_for(0), rng=jax.random.key(0),
                       devices=jax.devices()[:2])
    saved = []
    with Checkpointer(tmp_path, every=2, keep=2) as ckpt:
        for step in range(7):
            state, _ = jpipe.train_step(state, batch_for(step))
            saved.append(ckpt.save(state, extra={"data_position": int(state.step)}))
        ckpt.wait()
        assert saved == [False, True, False, True, False, True, False]
        assert ckpt.all_steps() == [4, 6] and ckpt.latest_step() == 6
        assert ckpt.extra() == {"data_position": 6}
        params = ckpt.restore_params(step=4)
    assert len(params["layers"]) == 4
    assert np.isfinite(float(model.loss_value(params, batch_for(0))))


def test_half_written_checkpoint_is_never_the_latest(tmp_path):
    model = make_model("nnx", num_layers=4)
    state = jpipe.init(model, jpipe.Plan(2, 1, 2), optax.sgd(LR), batch_for(0), rng=jax.random.key(0),
                       devices=jax.devices()[:2])
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, force=True)
    # What a write cut short leaves: orbax's temporary directory, and a step without its parts.
    (tmp_path / "9.orbax-checkpoint-tmp-1234" / "arrays").mkdir(parents=True)
    (tmp_path / "9.orbax-checkpoint-tmp-1234" / "arrays" / "partial").write_bytes(b"\0" * 10)
    (tmp_path / "7" / "arrays").mkdir(parents=True)
    ckpt = Checkpointer(tmp_path)
    assert ckpt.all_steps() == [0] and ckpt.latest_step() == 0
    assert int(ckpt.restore(model, jpipe.Plan(2, 1, 2), optax.sgd(LR), batch_for(0),
                            devices=jax.devices()[:2]).step) == 0
    ckpt.close()


# ---- SIGKILL mid-training, mid-write; resume; compare with an uninterrupted run ---------------

STEPS, EVERY, HANG_AT = 10, 2, 6


def child(directory: str) -> None:
    """Trains, checkpointing every EVERY steps; the write of step HANG_AT stalls just before its commit."""
    from orbax.checkpoint._src.path import async_path

    rename = async_path.rename

    async def stalling_rename(src, dst):
        if Path(str(dst)).name == str(HANG_AT):
            print(f"WRITING {HANG_AT}", flush=True)
            while True:  # the parent kills us here, mid-write
                time.sleep(1)  # noqa: ASYNC251 (blocks the writer thread on purpose)
        return await rename(src, dst)

    async_path.rename = stalling_rename
    model = make_model("nnx", num_layers=4)
    state = jpipe.init(model, SMALL, optax.adam(LR), batch_for(0), rng=jax.random.key(0),
                       devices=jax.devices()[:4])
    ckpt = Checkpointer(directory, every=EVERY, keep=3)
    for step in range(STEPS):
        state, metrics = jpipe.train_step(state, batch_for(step))
        print(f"LOSS {int(state.step)} {float(metrics['loss']).hex()}", flush=True)
        ckpt.save(state)
    ckpt.close()


def _run_child_and_kill(directory: Path) -> list[str]:
    code = (f"import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}]; "
            f"import test_checkpoint; test_checkpoint.child({str(directory)!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen, deadline = [], time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                if proc.poll() is not None:
                    break
                continue
            seen.append(line)
            if line.startswith(f"WRITING {HANG_AT}"):
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
                return seen
        pytest.fail("the child never reached the write of step 6:\n" + "".join(seen[-50:]))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return seen


def test_sigkill_mid_write_then_resume_is_bit_identical(tmp_path):
    seen = _run_child_and_kill(tmp_path)
    killed_losses = {int(s): h for s, h in (line.split()[1:] for line in seen if line.startswith("LOSS"))}
    assert max(killed_losses) >= HANG_AT
    # the interrupted write is on disk, but is not a checkpoint
    assert any(p.name.startswith(f"{HANG_AT}.orbax-checkpoint-tmp") for p in tmp_path.iterdir())
    model = make_model("nnx", num_layers=4)
    # an uninterrupted run in this process
    state = jpipe.init(model, SMALL, optax.adam(LR), batch_for(0), rng=jax.random.key(0),
                       devices=jax.devices()[:4])
    reference = {}
    for step in range(STEPS):
        state, metrics = jpipe.train_step(state, batch_for(step))
        reference[int(state.step)] = float(metrics["loss"]).hex()
    with Checkpointer(tmp_path, every=EVERY) as ckpt:
        assert ckpt.latest_step() == HANG_AT - EVERY
        state = ckpt.restore_like(state)  # same plan: reuses the compiled step
    resumed = {}
    for step in range(int(state.step), STEPS):
        state, metrics = jpipe.train_step(state, batch_for(step))
        resumed[int(state.step)] = float(metrics["loss"]).hex()
    assert resumed == {s: reference[s] for s in range(HANG_AT - EVERY + 1, STEPS + 1)}
    assert killed_losses == {s: reference[s] for s in killed_losses}


def test_synchronous_checkpoint_restores_into_colocated_pipelines(tmp_path):
    """4x2... -> AvgPipe: every pipeline and the centre start from the synchronous run's parameters,
    every pipeline's optimizer state from its optimizer state, and the step count goes on."""
    from jpipe import averaging

    model = make_model("nnx", num_layers=4)
    state = jpipe.init(model, jpipe.Plan(2, 2, 2), optax.adam(LR), batch_for(0), rng=jax.random.key(0),
                       devices=jax.devices()[:4])
    for step in range(2):
        state, _ = jpipe.train_step(state, batch_for(step))
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, force=True)
        ckpt.wait()
        plan = jpipe.Plan(2, 2, 2, pipelines=2)
        batch = averaging.stack_batches([make_batch(4, seed=r) for r in range(4)])  # [B, 2 x 2 pipelines]
        pipelines = ckpt.restore(model, plan, optax.adam(LR), batch, devices=jax.devices()[:4])
    assert int(pipelines.step) == 2 and pipelines.plan.pipelines == 2
    params = jpipe.to_sequential(state)
    mu = jpipe.to_sequential(state.replace(params=state.opt_state[0].mu))
    assert_same_bits(averaging.centre(pipelines), params)
    copies = averaging.replicas(pipelines)
    mus = averaging.replicas(pipelines.replace(params=pipelines.opt_state[0][0].mu))
    assert len(copies) == len(mus) == 4
    for copy, copy_mu in zip(copies, mus):
        assert_same_bits(copy, params)
        assert_same_bits(copy_mu, mu)
    pipelines, metrics = jpipe.train_step(pipelines, batch)
    assert np.isfinite(float(metrics["loss"])) and int(pipelines.step) == 3
