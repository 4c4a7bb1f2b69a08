"""The ``jpipe`` command line: ``train`` (run folder, resume, config file), ``report``, ``schedule``;
and the Flax loop examples.

Every training run here is tiny (2 layers, width 16, sequences of 16 bytes) so that compiling
dominates; the runs share a module-scoped folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import runpy
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jpipe import cli, report

SMALL_CORPUS = 300_000
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--batch-size", "8", "--seq-len", "16", "--pipe", "2", "--data", "2", "--microbatches", "2",
        "--layers", "2", "--d-model", "16", "--heads", "2", "--log-every", "2", "--eval-every", "2",
        "--eval-batches", "1", "--max-chars", str(SMALL_CORPUS), "--checkpoint-every", "2", "--no-progress"]
TINY_TOML = """\
# the same tiny run as TINY, as a config file (keys mirror the options, - or _)
batch-size = 8
seq_len = 16
pipe = 2
data = 2
microbatches = 2
layers = 2
d_model = 16
heads = 2
log_every = 2
eval_every = 2
eval_batches = 1
max_chars = 300000
checkpoint_every = 2
progress = false
steps = 1
"""


def _losses(run_dir: str) -> dict[int, float]:
    train, _ = report.read_metrics(run_dir)
    return {r["step"]: r["loss"] for r in train}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> str:
    """Four uninterrupted steps, checkpoints every two, options from a config file and the command line."""
    tmp = tmp_path_factory.mktemp("runs")
    config = tmp / "tiny.toml"
    config.write_text(TINY_TOML)
    out = str(tmp / "full")
    # The config says steps = 1; the command line wins. Fused ticks must survive --resume (plan.json).
    assert cli.main(["train", "--config", str(config), "--steps", "4", "--out", out, "--schedule", "1f1b-b",
                     "--fuse-ticks"]) == 0
    return out


def test_train_writes_every_artifact(full_run, capsys):
    for name in ("config.toml", "plan.json", "metrics.jsonl", "summary.json", "schedule.png", "loss.png",
                 "report.md", "checkpoints"):
        assert os.path.exists(os.path.join(full_run, name)), name
    for png in ("schedule.png", "loss.png"):
        with open(os.path.join(full_run, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(int(s) for s in os.listdir(os.path.join(full_run, "checkpoints")) if s.isdigit()) == [2, 4]

    train, heldout = report.read_metrics(full_run)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in train)
    assert [r["step"] for r in heldout] == [0, 2, 4]
    with open(os.path.join(full_run, "plan.json")) as f:
        assert json.load(f)["fuse_ticks"] is True

    with open(os.path.join(full_run, "plan.json")) as f:
        plan = json.load(f)
    assert (plan["pipe"], plan["data"], plan["microbatches"], plan["schedule"], plan["source"]) == \
        (2, 2, 2, "1f1b-b", "options")
    assert plan["partition"] == [1, 1] and 0 < plan["simulated_bubble"] < 1
    with open(os.path.join(full_run, "summary.json")) as f:
        summary = json.load(f)
    assert 2.5 < summary["unigram_loss"] < 4.0  # the baseline: Python source's byte frequencies
    assert summary["final_heldout_loss"] == heldout[-1]["heldout_loss"]

    text = Path(full_run, "report.md").read_text()
    for needle in ("held-out loss, final", "unigram baseline", "![loss curves](loss.png)",
                   "![schedule](schedule.png)", "pipe 2 x data 2"):
        assert needle in text, needle

    # jpipe report re-renders the report from the folder's files.
    os.remove(os.path.join(full_run, "report.md"))
    os.remove(os.path.join(full_run, "loss.png"))
    assert cli.main(["report", full_run]) == 0
    assert "wrote" in capsys.readouterr().out
    assert Path(full_run, "report.md").read_text() == text
    assert os.path.exists(os.path.join(full_run, "loss.png"))


def test_config_file_options_are_saved(full_run):
    saved = Path(full_run, "config.toml").read_text()
    assert "steps = 4" in saved and "d_model = 16" in saved and "batch_size = 8" in saved
    # The saved options are a config file that gives the same run.
    args = cli._train_args(cli.build_parser(), ["train", "--config", os.path.join(full_run, "config.toml")],
                           cli.build_parser().parse_args(["train", "--config",
                                                          os.path.join(full_run, "config.toml")]))
    assert (args.steps, args.batch_size, args.pipe, args.d_model, args.progress) == (4, 8, 2, 16, None)


def test_resume_continues_the_same_step_counter_and_trajectory(full_run, tmp_path, capsys):
    # The run as if it had stopped after the checkpoint at step 2 (its metrics went on to step 4).
    out = str(tmp_path / "stopped")
    shutil.copytree(full_run, out)
    shutil.rmtree(os.path.join(out, "checkpoints", "4"))
    capsys.readouterr()
    assert cli.main(["train", "--resume", out]) == 0
    assert "resumed from the checkpoint at step 2" in capsys.readouterr().out
    train, heldout = report.read_metrics(out)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert train[2].get("compiled") and not train[1].get("compiled")  # step 3 ran first after resuming
    # Same step counter, same batches, same parameters: the uninterrupted run's losses.
    assert _losses(out) == pytest.approx(_losses(full_run), rel=1e-6)
    _, full_heldout = report.read_metrics(full_run)
    assert [r["heldout_loss"] for r in heldout] == pytest.approx([r["heldout_loss"] for r in full_heldout],
                                                                  rel=1e-6)
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["resumed_from"] == 2
    assert sorted(int(s) for s in os.listdir(os.path.join(out, "checkpoints")) if s.isdigit()) == [2, 4]
    with pytest.raises(SystemExit):  # the last checkpoint (4) is past --steps 3
        cli.main(["train", "--resume", out, "--steps", "3"])


def _snapshot(run_dir: str) -> dict[str, bytes]:
    """Every file of a run folder and its bytes (a refused command must change none)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in Path(run_dir).rglob("*") if p.is_file()}


def test_run_folders_are_owned(full_run, tmp_path, capsys):
    out = str(tmp_path / "owned")
    shutil.copytree(full_run, out)
    before = _snapshot(out)

    def refused(argv: list[str], needle: str) -> None:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and needle in capsys.readouterr().err, needle
        assert _snapshot(out) == before  # nothing on disk changed

    refused(["train", *TINY, "--steps", "2", "--out", out], "holds another run's checkpoints")
    refused(["train", "--resume", out, "--steps", "3"], "raise --steps to train further")
    refused(["train", "--resume", out, "--resume-step", "3"], "no complete checkpoint at that step; it has [2, 4]")
    lock = Path(out) / ".lock"
    lock.write_text(json.dumps({"pid": os.getpid(), "host": platform.node()}))  # a live run holds it
    before = _snapshot(out)
    refused(["train", "--resume", out, "--steps", "6"], f"is in use by process {os.getpid()}")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    lock.write_text(json.dumps({"pid": gone.pid, "host": platform.node()}))  # its process died
    capsys.readouterr()
    assert cli.main(["train", *TINY, "--steps", "2", "--out", out, "--overwrite"]) == 0
    assert f"taking over the lock of {out!r} from process {gone.pid}" in capsys.readouterr().out
    assert not lock.exists()  # released at the end
    assert sorted(int(s) for s in os.listdir(os.path.join(out, "checkpoints")) if s.isdigit()) == [2]
    assert sorted(_losses(out)) == [1, 2]


def test_resume_skips_a_damaged_newest_checkpoint(full_run, tmp_path, capsys):
    out = str(tmp_path / "damaged")
    shutil.copytree(full_run, out)
    newest = Path(out) / "checkpoints" / "4"
    data = max((p for p in newest.rglob("*") if p.is_file() and p.parent.name == "d"
                and p.parent.parent.name == "params"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    assert cli.main(["train", "--resume", out]) == 0
    printed = capsys.readouterr().out
    assert "warning: skipping the checkpoint at step 4, which is damaged" in printed
    assert "resumed from the checkpoint at step 2" in printed
    assert _losses(out) == pytest.approx(_losses(full_run), rel=1e-6)  # steps 3 and 4 again, as before


def _interrupt(out: str, *when: str, options: list[str] | None = None) -> tuple[int, str]:
    """Runs ``jpipe train`` as its own process and sends it SIGINT once a line containing ``when[0]``
    is printed, again after ``when[1]`` (if given), ...; returns the exit code and stderr."""
    options = [*TINY, "--steps", "4", "--schedule", "1f1b-b", "--fuse-ticks"] if options is None else options
    argv = [sys.executable, "-m", "jpipe", "train", *options, "--out", out]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    waiting = list(when)
    for line in proc.stdout:
        if waiting[0] in line:
            proc.send_signal(signal.SIGINT)
            waiting.pop(0)
            if not waiting:
                break
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


@pytest.mark.parametrize("when", ["run folder:", "held-out loss 2"], ids=["before-the-first-step", "first-checkpoint"])
def test_an_interrupted_run_stops_with_a_checkpoint_and_resumes_exactly(full_run, tmp_path, when, capsys):
    out = str(tmp_path / "interrupted")
    code, err = _interrupt(out, when.replace("held-out loss 2", "step     2  held-out"))
    assert code == 130 and "Traceback" not in err, err
    assert f"resume with: jpipe train --resume {out}" in err.strip().splitlines()[-1]
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["interrupted"] and summary["stopped_at"] in range(4)
    assert os.path.isfile(os.path.join(out, "report.md"))
    assert cli.main(["train", "--resume", out]) == 0
    assert _losses(out) == pytest.approx(_losses(full_run), rel=1e-6)


def test_an_interrupt_during_planning_stops_before_the_first_step_and_resumes_on_the_chosen_plan(tmp_path):
    unplanned = [a for i, a in enumerate(TINY) if not {a, TINY[i - 1]} & {"--pipe", "--data", "--microbatches"}]
    options = [*unplanned, "--steps", "3"]
    out = str(tmp_path / "planning")
    code, err = _interrupt(out, "profiling: timing", options=options)
    assert code == 130 and "Traceback" not in err, err
    assert f"interrupted after step 0 (checkpoint saved); resume with: jpipe train --resume {out}" in err
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["interrupted"] and summary["stopped_at"] == 0 and summary["steps_run"] == 0
    with open(os.path.join(out, "plan.json")) as f:
        plan = json.load(f)
    assert plan["source"] == "planner" and plan["pipe"] * plan["data"] == 8

    assert cli.main(["train", "--resume", out]) == 0  # on the plan chosen before the interrupt
    ref = str(tmp_path / "uninterrupted")
    explicit = ["--pipe", str(plan["pipe"]), "--data", str(plan["data"]), "--microbatches",
                str(plan["microbatches"]), "--schedule", plan["schedule"]]
    explicit += ["--remat"] * plan["remat"] + ["--fuse-ticks"] * plan["fuse_ticks"]
    assert cli.main(["train", *options, *explicit, "--out", ref]) == 0
    assert sorted(_losses(out)) == [1, 2, 3]
    assert [x.hex() for x in _losses(out).values()] == [x.hex() for x in _losses(ref).values()]


def test_a_second_interrupt_aborts_at_once_without_a_traceback(tmp_path):
    code, err = _interrupt(str(tmp_path / "aborted"), "run folder:", "stopping at the next step boundary")
    assert code == 130 and "Traceback" not in err, err
    assert "interrupted twice" in err


def test_a_second_interrupt_that_a_finaliser_swallows_still_aborts_at_the_next_step_boundary(capsys):
    """A signal handler's exception surfaces in whatever code runs; inside a finaliser Python prints
    "Exception ignored ... Traceback" and goes on (seen when the second Ctrl-C met a weakref callback)."""
    from jpipe import run

    with run.StopRequest(lambda *a, **k: None) as stop:
        handler = signal.getsignal(signal.SIGINT)
        handler(signal.SIGINT, None)
        assert stop.agreed(multi_process=False)  # the first asks for a stop at the step boundary

        class Finalised:
            def __del__(self) -> None:
                handler(signal.SIGINT, None)  # the second arrives while a finaliser runs

        Finalised()
        with pytest.raises(run.Interrupted, match="interrupted twice"):
            stop.agreed(multi_process=False)
    assert signal.getsignal(signal.SIGINT) is not handler
    assert "Traceback" not in capsys.readouterr().err


def test_schedule_show(tmp_path, capsys):
    png = tmp_path / "g.png"
    assert cli.main(["schedule", "show", "1f1b", "--pipe", "2", "--microbatches", "3", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "d0 | F0 F1 .  B0 F2 B1 .  B2" in out and "bubble" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["schedule", "show", "1f1b-b", "--pipe", "2", "--microbatches", "3", "--fused"]) == 0
    out = capsys.readouterr().out
    assert "ticks of 2 lanes" in out and "   | " in out
    with pytest.raises(SystemExit):
        cli.main(["schedule", "show", "zigzag"])


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("jpipe ")


@pytest.mark.parametrize("name", ["nnx_loop.py", "linen_loop.py"])
def test_examples_run(name, capsys):
    runpy.run_path(os.path.join(ROOT, "examples", name), run_name="__main__")  # each asserts it learned
    assert "loss" in capsys.readouterr().out


def test_plan_prints_the_ranked_candidates_measuring_the_best(capsys):
    assert cli.main(["plan", "--devices", "2", "--batch-size", "4", "--seq-len", "8", "--layers", "2",
                     "--d-model", "16", "--heads", "2", "--profile-rounds", "2", "--measure", "2",
                     "--top", "4", "--explain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "batch 4 on 2" in lines[0]
    rows = [line.split() for line in lines if line.strip()[:1].isdigit()]
    assert "measured" in lines[1] and len(rows) == 4
    measured = [float(r[7]) for r in rows if r[7] != "-"]
    assert 1 <= len(measured) <= 2 and measured == sorted(measured)  # the measured ones first, fastest first
    assert all(r[7] == "-" for r in rows[len(measured):])
    pipe, data, micro = rows[0][1:4]
    assert lines[-1].startswith(f"chosen: pipe {pipe} x data {data}, {micro} micro-batches")
    explained = lines[lines.index(next(line for line in lines if line.startswith("#1 "))):-1]
    assert explained[0].startswith(f"#1 pipe {pipe} x data {data}, M={micro}")
    assert len(explained) == 9 and all(term in explained[1] for term in
                                       ("compute", "bubble", "communication", "contention", "allreduce"))
    assert explained[2].strip().startswith("memory") and "state" in explained[2]
    for flag, value, message in (("--profile-rounds", "0", "--profile-rounds must be >= 1"),
                                 ("--measure", "-1", "--measure must be >= 0")):
        with pytest.raises(SystemExit):
            cli.main(["plan", flag, value])
        assert message in capsys.readouterr().err


def test_plan_and_train_describe_the_same_model():
    parser = cli.build_parser()
    train, plan = (cli._subparser(parser, name) for name in ("train", "plan"))
    names = ("batch_size", "seq_len", "layers", "d_model", "heads", "framework", "dtype")
    assert {n: plan.get_default(n) for n in names} == {n: train.get_default(n) for n in names}
    assert train.get_default("layers") == 8  # TrainConfig's


def test_train_without_plan_options_runs_the_planners_choice():
    import jax
    import jax.numpy as jnp

    import jpipe.models
    from jpipe.run import TrainConfig, choose_plan

    model = jpipe.models.mlp(in_dim=4, hidden=16, out_dim=1, num_layers=4)
    batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 1))}
    plan, source, table, record = choose_plan(TrainConfig(remat=True), model, batch, jax.devices()[:2])
    assert source == "planner" and plan.remat  # the option --remat survives the planner's plan
    assert plan.pipe * plan.data == 2
    assert record["budget_from"] == "the default for simulated CPU devices" and record["device_memory_mib"] == 16
    assert record["predicted_step_ms"] > 0 and 0 < record["predicted_memory_mib"] <= 16
    best = next(line.split() for line in table.splitlines() if line.strip()[:1].isdigit())
    assert best[1:5] == [str(plan.pipe), str(plan.data), str(plan.microbatches), plan.schedule]
    plan, source, table, _ = choose_plan(TrainConfig(pipe=2), model, batch, jax.devices())
    assert (source, table, plan.pipe, plan.data) == ("options", None, 2, 4)  # the rest from FIXED_PLAN


def test_the_default_model_is_pipelined_under_the_default_memory_budget():
    """Issue 31: under SIMULATED_DEVICE_MIB per device no plan of the default GPT with pipe 1 fits (from
    shapes alone, as the planner predicts memory), so whatever the planner picks by time pipelines."""
    import jax.numpy as jnp

    from jpipe import models, partition
    from jpipe.run import SIMULATED_DEVICE_MIB, TrainConfig

    d = TrainConfig()
    model = models.gpt(256, d.seq_len, d_model=d.d_model, num_heads=d.heads, num_layers=d.layers)
    tokens = jnp.zeros((d.batch_size // 8, d.seq_len), jnp.int32)
    sizes = partition.memory_profile(model, {"tokens": tokens, "targets": tokens})
    choice = partition.search(sizes, 8, d.batch_size, memory_limit=SIMULATED_DEVICE_MIB * 2**20)
    fitting = [c for c in choice.candidates if c.fits]
    assert fitting and all(c.plan.pipe >= 2 for c in fitting)
    data_parallel = min(c.memory for c in choice.candidates if c.plan.pipe == 1)
    assert data_parallel > 1.5 * SIMULATED_DEVICE_MIB * 2**20   # not a near miss of the memory model


def test_an_explicit_plan_that_does_not_fit_the_device_memory_is_refused():
    import jax
    import jax.numpy as jnp

    from jpipe import models
    from jpipe.run import TrainConfig, choose_plan

    model = models.gpt(256, 16, d_model=32, num_heads=2, num_layers=4)
    tokens = jnp.zeros((16, 16), jnp.int32)
    batch = {"tokens": tokens, "targets": tokens}
    config = TrainConfig(pipe=1, data=8, microbatches=1, batch_size=16, seq_len=16, d_model=32, heads=2, layers=4)
    with pytest.raises(ValueError, match=r"needs .* MiB per device, more than --device-memory 0.05 MiB; "
                                         r"(the smallest plan that fits is --pipe \d|no plan of these devices)"):
        choose_plan(dataclasses.replace(config, device_memory=0.05), model, batch, jax.devices())
    plan, source, _, record = choose_plan(dataclasses.replace(config, device_memory=1024.0), model, batch,
                                          jax.devices())
    assert (plan.pipe, plan.data, source) == (1, 8, "options") and 0 < record["predicted_memory_mib"] < 1024


def test_dtype_option_sets_the_gpts_compute_dtype(tmp_path, monkeypatch, capsys):
    from jpipe import models, run

    parser = cli.build_parser()
    assert parser.parse_args(["train"]).dtype == "float32"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--dtype", "float16"])
    train = cli._subparser(parser, "train")
    assert cli._check_config_values(train, {"dtype": "bfloat16"}, "x.toml") == {"dtype": "bfloat16"}
    with pytest.raises(ValueError, match="dtype must be one of"):
        cli._check_config_values(train, {"dtype": "fp8"}, "x.toml")
    with pytest.raises(ValueError, match="--dtype"):
        run.TrainConfig(dtype="float16").check()

    # `jpipe train --dtype bfloat16` builds the GPT with bfloat16 compute (float32 parameters): stop there.
    built = {}

    class Built(Exception):
        pass

    def gpt(*args, **kwargs):
        built.update(kwargs)
        raise Built

    monkeypatch.setattr(models, "gpt", gpt)
    with pytest.raises(Built):
        cli.main(["train", *TINY, "--steps", "1", "--dtype", "bfloat16", "--out", str(tmp_path / "bf16")])
    assert built["dtype"] == "bfloat16"
