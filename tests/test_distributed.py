"""Two local processes on loopback (gloo): the same plan gives the same losses and parameters as one
process, with ``pipe`` and with ``data`` across processes; one process dying ends the other."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import jpipe
from jpipe import distributed

PLAN = {"pipe": 2, "data": 2, "microbatches": 4}
GLOBAL_BATCH, STEPS, LR = 16, 3, 1e-2
HEARTBEAT_S = 5


def _model_and_batch(step: int):
    from test_executor import make_batch, make_model

    return make_model("nnx", num_layers=4), {k: np.asarray(v) for k, v in make_batch(GLOBAL_BATCH, seed=step).items()}


def equality_worker(out_dir: str) -> None:
    """Each process: 2 CPU devices; pipe across processes, then data across processes."""
    from jax.experimental import multihost_utils

    from jpipe.checkpoint import Checkpointer

    info = distributed.initialize()
    results = {}
    for across in ("pipe", "data"):
        devices = distributed.mesh_devices(PLAN["pipe"], PLAN["data"], across)
        mesh = jpipe.make_mesh(PLAN["pipe"], PLAN["data"], devices)
        rows = distributed.local_rows(mesh, GLOBAL_BATCH)

        def batch(step: int, rows=rows, mesh=mesh):  # this process loads only its own rows
            _, full = _model_and_batch(step)
            return distributed.global_batch(mesh, {k: v[rows] for k, v in full.items()}, GLOBAL_BATCH)

        model, _ = _model_and_batch(0)
        state = jpipe.init(model, jpipe.Plan(**PLAN), optax.adam(LR), batch(0), rng=jax.random.key(0),
                           devices=devices)
        stages_on = {int(s.device.process_index) for s in
                     state.params["stages"]["up"]["kernel"].addressable_shards}
        losses = []
        for step in range(STEPS):
            state, metrics = jpipe.train_step(state, batch(step))
            losses.append(float(metrics["loss"]).hex())
        params = multihost_utils.process_allgather(jpipe.to_sequential(state), tiled=True)
        if across == "pipe":  # every process writes its own shards of one checkpoint ...
            with Checkpointer(Path(out_dir) / "ckpt") as ckpt:
                ckpt.save(state, force=True)
                ckpt.wait()
                # ... and both read it back onto the other layout: data across processes, all sharded
                other = distributed.mesh_devices(PLAN["pipe"], PLAN["data"], "data")
                restored = ckpt.restore(model, jpipe.Plan(**PLAN, shard="parameters"), optax.adam(LR),
                                        _model_and_batch(0)[1], devices=other)
            again = multihost_utils.process_allgather(jpipe.to_sequential(restored), tiled=True)
            results["restored_exact"] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                                            zip(jax.tree.leaves(again), jax.tree.leaves(params)))
        if info.process_id == 0:
            np.savez(Path(out_dir) / f"{across}.npz", *jax.tree.leaves(params))
        results[across] = {"losses": losses, "rows": [rows.start, rows.stop], "stage_processes": sorted(stages_on)}
    print("RESULT " + json.dumps({"process": info.process_id, "devices": len(info.local_devices), **results}))


@pytest.fixture(scope="module")
def reference():
    """The same plan in this one process, on 4 of its devices."""
    model, b0 = _model_and_batch(0)
    state = jpipe.init(model, jpipe.Plan(**PLAN), optax.adam(LR), b0, rng=jax.random.key(0),
                       devices=jax.devices()[:4])
    losses = []
    for step in range(STEPS):
        state, metrics = jpipe.train_step(state, _model_and_batch(step)[1])
        losses.append(float(metrics["loss"]).hex())
    return losses, [np.asarray(x) for x in jax.tree.leaves(jpipe.to_sequential(state))]


def test_two_processes_equal_one_process(tmp_path, reference):
    results = distributed.launch_local(equality_worker, num_processes=2, devices_per_process=2, timeout=240,
                                       args=[str(tmp_path)], check=True)
    out = [json.loads(line[len("RESULT "):]) for r in results for line in r.output.splitlines()
           if line.startswith("RESULT ")]
    assert [o["process"] for o in out] == [0, 1] and all(o["devices"] == 2 for o in out)
    losses, params = reference
    # pipe across processes: each process holds one stage (both its replicas) and the whole batch
    assert [o["pipe"]["stage_processes"] for o in out] == [[0], [1]]
    assert [o["pipe"]["rows"] for o in out] == [[0, 16], [0, 16]]
    # data across processes: each process holds both stages of one replica and half the batch
    assert [o["data"]["stage_processes"] for o in out] == [[0], [1]]
    assert [o["data"]["rows"] for o in out] == [[0, 8], [8, 16]]
    for across in ("pipe", "data"):  # identical to the last bit (a sum of two is the same either way round)
        assert [o[across]["losses"] for o in out] == [losses, losses]
        got = np.load(tmp_path / f"{across}.npz")
        for i, want in enumerate(params):
            np.testing.assert_array_equal(got[f"arr_{i}"], want)
    # each process wrote only its own shards (its stage's layers, its part of pre and post) ...
    assert [o["restored_exact"] for o in out] == [True, True]  # ... and both read them back onto 2 x 2
    for item in ("params", "state"):
        files = {p: {str(f.relative_to(tmp_path)): f.stat().st_size for f in
                     (tmp_path / "ckpt" / str(STEPS) / item / f"ocdbt.process_{p}").rglob("*") if f.is_file()}
                 for p in (0, 1)}
        written = [sum(files[p].values()) for p in (0, 1)]
        # How orbax's OCDBT spreads the arrays between the two processes' data files varies from run to run
        # (params: 27 % and 23 % on process 1 in two runs, balanced in others); the property is that
        # process 1 writes its own shards rather than handing them to process 0.
        assert min(written) > 0.15 * sum(written), (item, files)
    # the checkpoint both processes wrote reads back in this single process
    from jpipe.checkpoint import Checkpointer

    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.all_steps() == [STEPS]
        saved = jax.tree.leaves(ckpt.restore_params())
    for got, want in zip(saved, params):
        np.testing.assert_array_equal(np.asarray(got), want)


def profile_worker() -> None:
    """Each process: one CPU device; the profiler's turns alone, then a whole profile over both devices."""
    import time

    from jpipe.models import mlp
    from jpipe.partition import Profiler
    from jpipe.partition._profile import _alone_in_turns

    info = distributed.initialize()
    spans: list[tuple[float, float]] = []

    def run() -> None:
        start = time.time()  # the wall clock: the same for both processes on one machine
        time.sleep(0.02)
        spans.append((start, time.time()))

    _alone_in_turns([run], repeats=4, warmup=1)
    mb = {"x": np.ones((4, 4), np.float32), "y": np.zeros((4, 1), np.float32)}
    prof = Profiler(mlp(in_dim=4, hidden=16, out_dim=1, num_layers=2), mb, devices=jax.devices(),
                    microbatch_sizes=[2], repeats=3, warmup=1).measure()
    print("RESULT " + json.dumps({"process": info.process_id, "spans": spans, "profile": json.loads(prof.to_json())}))


def test_profile_times_each_process_alone_in_turns_and_agrees_across_processes():
    results = distributed.launch_local(profile_worker, num_processes=2, devices_per_process=1, timeout=240,
                                       check=True)
    out = [json.loads(line[len("RESULT "):]) for r in results for line in r.output.splitlines()
           if line.startswith("RESULT ")]
    assert [o["process"] for o in out] == [0, 1]
    first, second = out[0]["spans"], out[1]["spans"]
    assert len(first) == len(second) == 1 + 1 + 4  # warm-up, the block's untimed call, the timed calls
    assert max(end for _, end in first) <= min(start for start, _ in second)  # process 1 waited for 0
    # every number is the slowest process's: both plan from the same profile
    assert out[0]["profile"] == out[1]["profile"]
    assert out[0]["profile"]["contention"] >= 1.0 and out[0]["profile"]["comm"] is not None


def measure_worker() -> None:
    """Each process: one CPU device; a pipe=2 and a data=2 plan timed over both devices."""
    from jpipe.models import mlp
    from jpipe.partition import measure_plans

    info = distributed.initialize()
    batch = {"x": np.arange(32, dtype=np.float32).reshape(8, 4), "y": np.zeros((8, 1), np.float32)}
    plans = [jpipe.Plan(pipe=2, data=1, microbatches=2), jpipe.Plan(pipe=1, data=2, microbatches=1)]
    times = measure_plans(mlp(in_dim=4, hidden=16, out_dim=1, num_layers=2), plans, batch, steps=2, rounds=2,
                          warmup=1)
    print("RESULT " + json.dumps({"process": info.process_id, "times": times}))


def test_measured_plans_agree_across_processes():
    results = distributed.launch_local(measure_worker, num_processes=2, devices_per_process=1, timeout=240,
                                       check=True)
    out = [json.loads(line[len("RESULT "):]) for r in results for line in r.output.splitlines()
           if line.startswith("RESULT ")]
    assert [o["process"] for o in out] == [0, 1]
    # each time is the slowest process's: every process ranks the plans alike and chooses the same one
    assert out[0]["times"] == out[1]["times"] and all(t > 0 for t in out[0]["times"])


def dying_worker(victim: int) -> None:
    """Trains pipe=2 across the two processes; ``victim`` is SIGKILLed after two steps."""
    info = distributed.initialize(heartbeat_timeout_seconds=HEARTBEAT_S, shutdown_timeout_seconds=5)
    model, b = _model_and_batch(0)
    state = jpipe.init(model, jpipe.Plan(2, 1, 2), optax.sgd(LR), b, rng=jax.random.key(0))
    step = 0
    while True:
        if step == 2 and info.process_id == victim:
            print("DYING", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        state, metrics = jpipe.train_step(state, b)
        print(f"step {step} loss {float(metrics['loss'])}", flush=True)
        step += 1


@pytest.mark.parametrize("victim", [
    1,
    pytest.param(0, marks=pytest.mark.exhaustive),  # another 2-process run
], ids=["worker-dies", "coordinator-dies"])
def test_one_process_dies_the_other_exits_with_a_clear_error(victim):
    results = distributed.launch_local(dying_worker, num_processes=2, devices_per_process=1, timeout=180,
                                       args=[victim], grace=90)
    dead, survivor = results[victim], results[1 - victim]
    print(f"victim ended at {dead.elapsed_s:.1f}s, survivor at {survivor.elapsed_s:.1f}s")
    assert "DYING" in dead.output and dead.returncode == -signal.SIGKILL, dead.output[-2000:]
    assert not survivor.killed, "the survivor hung until the launcher killed it:\n" + survivor.output[-3000:]
    assert survivor.returncode != 0
    assert "another task died" in survivor.output or "stopped sending heartbeats" in survivor.output, \
        survivor.output[-3000:]
    # bounded: the heartbeat timeout plus a margin for a loaded machine
    assert survivor.elapsed_s - dead.elapsed_s < HEARTBEAT_S + 40, (survivor.elapsed_s, dead.elapsed_s)


# ---------------------------------------------------------------------------------------------
# jpipe train as a multi-process run

TINY_RUN = ["--steps", "3", "--batch-size", "8", "--seq-len", "16", "--microbatches", "2", "--layers", "2",
            "--d-model", "16", "--heads", "2", "--log-every", "1", "--eval-every", "2", "--eval-batches", "1",
            "--max-chars", "300000", "--checkpoint-every", "2", "--no-progress"]


def cli_worker(out: str, argv: list[str], explicit: bool) -> None:
    """One process of ``jpipe train``: the run from --coordinator/--num-processes/--process-id, or --distributed."""
    from jpipe import cli

    if explicit:  # the flags a user types on each host; launch_local's variables only supply the values
        env = os.environ
        argv = [*argv, "--coordinator", env[distributed.ENV_COORDINATOR],
                "--num-processes", env[distributed.ENV_NUM_PROCESSES], "--process-id", env[distributed.ENV_PROCESS_ID]]
    else:
        argv = [*argv, "--distributed"]
    sys.exit(cli.main(["train", *argv, "--out", out]))


def _metrics(run_dir: Path) -> tuple[list, list]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return ([(r["step"], r["loss"]) for r in rows if "loss" in r],
            [(r["step"], r["heldout_loss"]) for r in rows if "heldout_loss" in r])


@pytest.mark.parametrize("across, pipe, data, explicit", [
    ("pipe", 2, 1, True),
    pytest.param("data", 1, 2, False, marks=pytest.mark.exhaustive),  # another 2-process run
], ids=["pipe-across-coordinator-flags", "data-across-distributed-flag"])
def test_jpipe_train_two_processes_equals_one_process(tmp_path, across, pipe, data, explicit):
    from jpipe import cli
    from jpipe.checkpoint import Checkpointer

    plan = ["--pipe", str(pipe), "--data", str(data)]
    out = tmp_path / "two"
    results = distributed.launch_local(cli_worker, num_processes=2, devices_per_process=1, timeout=240,
                                       args=[str(out), [*TINY_RUN, *plan, "--across", across], explicit],
                                       check=True)
    rows = ["0:8", "0:8"] if across == "pipe" else ["0:4", "4:8"]
    stages = ["[0]", "[1]"] if across == "pipe" else ["[0]", "[0]"]
    for r in results:  # each process holds its stage(s) and loads only its own rows of the batch
        assert f"process {r.process_id} of 2: 1 local device(s), stages {stages[r.process_id]}, " \
               f"batch rows {rows[r.process_id]}" in r.output, r.output[-2000:]
    assert "run folder:" in results[0].output and "run folder:" not in results[1].output  # process 0 speaks

    ref = tmp_path / "one"
    assert cli.main(["train", *TINY_RUN, *plan, "--out", str(ref)]) == 0  # the same run in one process
    train_two, heldout_two = _metrics(out)
    train_one, heldout_one = _metrics(ref)
    assert [s for s, _ in train_two] == [1, 2, 3] and [s for s, _ in heldout_two] == [0, 2, 3]
    # identical to the last bit: training losses and the held-out loss (computed on the whole mesh)
    assert [float(x).hex() for _, x in train_two] == [float(x).hex() for _, x in train_one]
    assert [float(x).hex() for _, x in heldout_two] == [float(x).hex() for _, x in heldout_one]
    for name in ("config.toml", "plan.json", "summary.json", "report.md"):
        assert (out / name).exists(), name
    assert "coordinator" not in (out / "config.toml").read_text()  # not an option of the run
    saved = json.loads((out / "plan.json").read_text())
    assert (saved["pipe"], saved["data"], saved["source"]) == (pipe, data, "options")
    # the checkpoints both processes wrote through orbax hold the single-process run's parameters
    with Checkpointer(out / "checkpoints") as two, Checkpointer(ref / "checkpoints") as one:
        assert two.all_steps() == one.all_steps() == [2, 3]
        for got, want in zip(jax.tree.leaves(two.restore_params()), jax.tree.leaves(one.restore_params())):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def interrupted_cli_worker(out: str, argv: list[str]) -> None:
    """:func:`cli_worker`, where process 1 alone gets Ctrl-C (SIGINT) once process 0 has recorded step 1."""
    import threading

    if os.environ[distributed.ENV_PROCESS_ID] == "1":
        metrics = Path(out) / "metrics.jsonl"

        def interrupt_after_the_first_step() -> None:
            while not (metrics.exists() and '"loss"' in metrics.read_text()):
                time.sleep(0.02)
            print("SIGINT", flush=True)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt_after_the_first_step, daemon=True).start()
    cli_worker(out, argv, explicit=False)


def test_ctrl_c_on_one_process_stops_every_process_at_the_same_step_and_resumes_exactly(tmp_path):
    from jpipe import cli
    from jpipe.checkpoint import Checkpointer

    argv = [*TINY_RUN, "--steps", "12", "--eval-every", "0", "--pipe", "2", "--data", "1", "--across", "pipe"]
    out = tmp_path / "two"
    results = distributed.launch_local(interrupted_cli_worker, num_processes=2, devices_per_process=1,
                                       timeout=240, args=[str(out), argv], grace=60)
    stopped = set()
    for r in results:
        assert r.returncode == 130 and not r.killed and "Traceback" not in r.output, r.output[-3000:]
        said = [line for line in r.output.splitlines() if "jpipe train: interrupted after step" in line]
        assert len(said) == 1 and f"resume with: jpipe train --resume {out}" in said[0], r.output[-2000:]
        stopped.add(int(said[0].split("after step ")[1].split()[0]))
    assert "SIGINT" in results[1].output
    assert len(stopped) == 1, stopped  # every process stopped after the same step
    (step,) = stopped
    assert 1 <= step < 12
    assert abs(results[0].elapsed_s - results[1].elapsed_s) < 30  # no process waited for a heartbeat timeout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["stopped_at"] == step
    with Checkpointer(out / "checkpoints") as ckpt:
        assert ckpt.latest_step() == step

    # the resumed run (here in one process) continues the uninterrupted run's losses to the last bit
    assert cli.main(["train", "--resume", str(out)]) == 0
    ref = tmp_path / "one"
    assert cli.main(["train", *argv, "--out", str(ref)]) == 0
    resumed, _ = _metrics(out)
    uninterrupted, _ = _metrics(ref)
    assert [s for s, _ in resumed] == list(range(1, 13))
    assert [float(x).hex() for _, x in resumed] == [float(x).hex() for _, x in uninterrupted]


def test_launcher_kills_all_on_timeout_and_returns_outputs(tmp_path):
    script = tmp_path / "sleepy.py"
    script.write_text("import os, time\nprint('up', os.environ['JPIPE_PROCESS_ID'], flush=True)\n"
                      "if os.environ['JPIPE_PROCESS_ID'] == '1': time.sleep(600)\n")
    results = distributed.launch_local(script, num_processes=2, timeout=5)
    assert results[0].ok and not results[0].killed
    assert results[1].killed and results[1].returncode == -signal.SIGKILL and "up 1" in results[1].output
    assert results[1].elapsed_s < 30


def test_launcher_kills_the_rest_when_one_fails(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys, time\nif os.environ['JPIPE_PROCESS_ID'] == '0': sys.exit(3)\n"
                      "time.sleep(600)\n")
    results = distributed.launch_local(script, num_processes=3, timeout=120)
    assert results[0].returncode == 3
    assert all(r.killed for r in results[1:]) and max(r.elapsed_s for r in results) < 30
    with pytest.raises(distributed.LaunchError, match="process 0: exit 3"):
        distributed.launch_local(script, num_processes=2, timeout=120, check=True)


def mismatched_worker() -> None:
    """Process 1 says there are three processes; process 0 (the coordinator) says two."""
    env = os.environ
    me = int(env[distributed.ENV_PROCESS_ID])
    try:
        distributed.initialize(env[distributed.ENV_COORDINATOR], 2 + me, me, initialization_timeout=60)
    except RuntimeError as e:
        print("REFUSED", e, flush=True)
        sys.exit(3)
    time.sleep(120)


def test_a_process_with_another_num_processes_is_refused_by_every_process():
    results = distributed.launch_local(mismatched_worker, num_processes=2, devices_per_process=1, timeout=120)
    for r in results:  # both refuse at once (the launcher may end the second after the first exits)
        assert "has 2 processes (process 0's --num-processes), but process 1 with 3" in r.output, r.output[-2000:]
        assert r.returncode == 3 or r.killed
        assert r.elapsed_s < 60
    assert any(r.returncode == 3 for r in results)


def _join_alone(ids: list[int], out: Path, stagger_s: float = 1.0) -> list[tuple[int, str, float]]:
    """Starts ``jpipe train`` once per entry of ``ids`` (its --process-id) in a run of 2 processes;
    returns each one's exit code, stderr and seconds, all bounded at 90 s."""
    import subprocess

    address = f"127.0.0.1:{distributed.free_port()}"
    argv = [sys.executable, "-m", "jpipe", "train", "--pipe", "2", "--data", "1", "--microbatches", "2",
            "--batch-size", "8", "--seq-len", "16", "--layers", "2", "--d-model", "16", "--heads", "2",
            "--steps", "2", "--max-chars", "300000", "--no-progress", "--coordinator", address,
            "--num-processes", "2"]
    start, procs = time.perf_counter(), []
    for i, pid in enumerate(ids):
        if i:
            time.sleep(stagger_s)
        procs.append(subprocess.Popen([*argv, "--process-id", str(pid), "--out", str(out)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, 90 - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        out.append((p.returncode, err, time.perf_counter() - start))
    return out


HINT = "'ALREADY_EXISTS' or 'different incarnation' means two processes were started with the same --process-id"


@pytest.mark.exhaustive  # about 50 s of waiting for a peer
def test_a_missing_peer_ends_within_60_s_and_the_status_is_explained(tmp_path):
    ((code, err, seconds),) = _join_alone([0], tmp_path / "run")
    assert code != 0 and seconds < 60, (code, seconds, err[-2000:])
    assert "waiting up to 45 s for all 2 processes" in err and HINT in err
    assert "DEADLINE_EXCEEDED" in err, err[-2000:]


@pytest.mark.exhaustive  # up to 50 s: the second process 1 waits for the deadline
def test_a_duplicate_process_id_ends_within_60_s_and_the_status_is_explained(tmp_path):
    results = _join_alone([0, 1, 1], tmp_path / "run")
    assert all(code != 0 and seconds < 60 for code, _, seconds in results), [(c, s) for c, _, s in results]
    said = " ".join(err for _, err, _ in results)
    assert HINT in said and ("different incarnation" in said or "ALREADY_EXISTS" in said), said[-3000:]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
