"""The main job behind ``jpipe train``: train a small GPT on the standard library's source and
write a run folder (plan, metrics, checkpoints, pictures, report; see :mod:`jpipe.report`).

:class:`TrainConfig` holds every option of ``jpipe train`` (TOML config files use the same
keys) and :func:`train` runs it. Without plan options (``pipe``, ``data``, ``microbatches``,
``schedule`` all ``None``) the plan comes from ``jpipe.plan`` (the planner); plan options left
out beside others given default to :data:`FIXED_PLAN` (pipe 4 x data 2, 4 micro-batches, 1F1B).

>>> config = TrainConfig(steps=2, batch_size=8, pipe=2, data=1, microbatches=2)
>>> config.check(); config.plan_given, config.num_devices_wanted()
(True, 2)

``train(config)`` then writes ``runs/<timestamp>`` (or ``config.out``) and returns the
run's summary; ``jpipe train`` is its command line.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Self

from jpipe import report

__all__ = ["FIXED_PLAN", "SIMULATED_DEVICE_MIB", "Chosen", "TrainConfig", "choose_plan", "device_memory_budget",
           "dump_config", "latest_run", "load_config", "mesh_shape", "train"]

FIXED_PLAN = {"pipe": 4, "data": 2, "microbatches": 4, "schedule": "1f1b"}
PLAN_KEYS = ("pipe", "data", "microbatches", "schedule")
# Compute dtypes of the GPT (``--dtype``); its parameters and the Adam state are float32 with either.
DTYPES = ("float32", "bfloat16")
# Options that fix the model's parameter shapes or its data; a resumed run may not change them.
SHAPE_KEYS = ("layers", "d_model", "heads", "seq_len", "framework", "max_chars")


@dataclasses.dataclass
class TrainConfig:
    """Every option of ``jpipe train``; a TOML config file has the same keys (``-`` or ``_``).

    >>> TrainConfig(steps=10).steps, TrainConfig().plan_given
    (10, False)
    """

    steps: int = 300
    # The default GPT: 1.66 M parameters, 19 MiB of training state with Adam; data parallel it needs about
    # 30 MiB per device, more than SIMULATED_DEVICE_MIB, so on simulated devices the planner pipelines it.
    batch_size: int = 16
    seq_len: int = 32
    layers: int = 8
    d_model: int = 128
    heads: int = 4
    framework: str = "nnx"
    dtype: str = "float32"  # the GPT's compute dtype; parameters and optimizer state are float32 either way
    dropout: float = 0.0  # the GPT's dropout rate in training steps (evaluation runs without)
    device_memory: float | None = None  # MiB per device the planner plans for (None: see device_memory_budget)
    pipe: int | None = None
    data: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int = 1
    remat: bool = False
    fuse_ticks: bool = False
    lr: float = 3e-3
    seed: int = 0
    log_every: int = 25
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    max_chars: int = 3_000_000
    out: str | None = None
    progress: bool | None = None  # None: a progress bar when stderr is a terminal

    @property
    def plan_given(self) -> bool:
        """Whether any of ``pipe``, ``data``, ``microbatches``, ``schedule`` is set."""
        return any(getattr(self, k) is not None for k in PLAN_KEYS)

    @property
    def given_mesh(self) -> tuple[int, int]:
        """``(pipe, data)`` of the explicit plan: ``pipe`` from :data:`FIXED_PLAN` when left out,
        ``data`` filling 8 devices."""
        pipe = self.pipe or FIXED_PLAN["pipe"]
        return pipe, self.data or max(1, 8 // pipe)

    def num_devices_wanted(self) -> int:
        """Devices an explicit plan needs (8 when the planner decides)."""
        pipe, data = self.given_mesh
        return pipe * data

    def check(self) -> None:
        """Raises ``ValueError`` naming the first bad option."""
        positive = ("steps", "batch_size", "seq_len", "layers", "d_model", "heads", "virtual_stages",
                    "log_every", "eval_batches", "max_chars")
        for name in positive + ("pipe", "data", "microbatches"):
            value = getattr(self, name)
            if value is None and name in ("pipe", "data", "microbatches"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1, got {value!r}")
        for name in ("eval_every", "checkpoint_every", "keep_checkpoints"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= 0 (0: never), got {value!r}")
        if self.device_memory is not None and not (isinstance(self.device_memory, (int, float))
                                                   and self.device_memory > 0):
            raise ValueError(f"--device-memory must be > 0 (MiB per device), got {self.device_memory!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"--lr must be > 0, got {self.lr!r}")
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout!r}")
        if self.d_model % self.heads:
            raise ValueError(f"--d-model {self.d_model} must be divisible by --heads {self.heads}")
        if self.framework not in ("nnx", "linen"):
            raise ValueError(f"--framework must be 'nnx' or 'linen', got {self.framework!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.schedule is not None:
            from jpipe.schedules import get_schedule

            get_schedule(self.schedule)  # unknown names raise, listing the known ones
        if self.plan_given:
            per = self.given_mesh[1] * (self.microbatches or FIXED_PLAN["microbatches"])
            if self.batch_size % per:
                raise ValueError(f"--batch-size {self.batch_size} must be a multiple of data x microbatches "
                                 f"= {per}")


def load_config(path: str) -> dict[str, Any]:
    """The options in TOML file ``path`` (keys as in :class:`TrainConfig`, ``-`` or ``_``).

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "run.toml")
    >>> _ = open(path, "w").write('steps = 50\\nbatch-size = 16\\n')
    >>> load_config(path)
    {'steps': 50, 'batch_size': 16}
    """
    import tomllib

    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"config file {path!r} is a folder; give a TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"config file {path!r} is not valid TOML: {e}") from None
    return {key.replace("-", "_"): value for key, value in raw.items()}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string


def dump_config(config: TrainConfig, path: str) -> None:
    """Writes ``config`` as TOML (options that are ``None`` are left out).

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "config.toml")
    >>> dump_config(TrainConfig(steps=7, schedule="gpipe"), path)
    >>> cfg = load_config(path)
    >>> cfg["steps"], cfg["schedule"], "pipe" in cfg
    (7, 'gpipe', False)
    """
    lines = ["# jpipe train options; `jpipe train --config THIS_FILE` repeats the run"]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is not None and field.name not in ("out", "progress"):
            lines.append(f"{field.name} = {_toml_value(value)}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def latest_run(root: str = "runs") -> str:
    """The most recently modified run folder under ``root`` (the one ``--resume`` continues)."""
    candidates = [os.path.join(root, d) for d in os.listdir(root)] if os.path.isdir(root) else []
    candidates = [d for d in candidates if os.path.exists(os.path.join(d, report.CONFIG))]
    if not candidates:
        raise FileNotFoundError(f"no run folder under {root!r} to resume; pass --out RUN_DIR")
    return max(candidates, key=os.path.getmtime)


def _new_run_dir(root: str = "runs") -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = os.path.join(root, stamp), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(root, f"{stamp}-{n}")
    return path


MULTI_PROCESS_PLAN = ("with several processes give the plan explicitly, e.g. --pipe 2 --data 1 (and "
                      "--microbatches M, --schedule S as you like): the planner times candidates in each "
                      "process and the processes could choose different plans")


def _saved_plan(out: str | None) -> dict | None:
    path = os.path.join(out, report.PLAN) if out else None
    if path is None or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def mesh_shape(config: TrainConfig, resume: bool = False) -> tuple[int, int] | None:
    """``(pipe, data)`` of the plan :func:`train` will run, or ``None`` when the planner decides.

    >>> mesh_shape(TrainConfig(pipe=2)), mesh_shape(TrainConfig(pipe=2, data=1)), mesh_shape(TrainConfig())
    ((2, 4), (2, 1), None)
    """
    if not config.plan_given:
        rec = _saved_plan(config.out) if resume else None
        return (rec["pipe"], rec["data"]) if rec else None
    return config.given_mesh


def _shared_run_dir() -> str:
    """A new run folder name; in a multi-process run process 0's, so that all write to one folder."""
    import jax

    if jax.process_count() == 1:
        return _new_run_dir()
    import numpy as np
    from jax.experimental import multihost_utils

    size = 1024
    name = _new_run_dir().encode() if jax.process_index() == 0 else b""
    if len(name) >= size:
        raise ValueError(f"run folder name {name!r} is too long; pass --out")
    buf = np.zeros(size, np.uint8)
    buf[: len(name)] = np.frombuffer(name, np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return bytes(buf[buf != 0]).decode()


# Memory per simulated CPU device that jpipe train and jpipe plan plan for unless --device-memory
# says otherwise (a CPU device has no memory of its own to report): the default GPT's training does
# not fit in it data parallel, and fits as a pipeline.
SIMULATED_DEVICE_MIB = 16.0


def device_memory_budget(device_memory: float | None, devices: Sequence) -> tuple[float | None, str]:
    """Bytes per device the planner may use, and where the number comes from: ``device_memory``
    (MiB, ``--device-memory``) when given; else :data:`SIMULATED_DEVICE_MIB` on CPU devices; else what
    the accelerator reports (``None`` where it reports nothing).

    >>> import jax
    >>> device_memory_budget(None, jax.devices())
    (16777216.0, 'the default for simulated CPU devices')
    >>> device_memory_budget(64, jax.devices())[0] / 2**20
    64.0
    """
    if device_memory is not None:
        return float(device_memory) * 2**20, "--device-memory"
    if devices[0].platform == "cpu":
        return SIMULATED_DEVICE_MIB * 2**20, "the default for simulated CPU devices"
    from jpipe import partition

    limit = partition.device_memory(devices)
    return limit, ("the device's own" if limit is not None else "none: the device reports no limit")


class Chosen(NamedTuple):
    """What :func:`choose_plan` returns: the plan, where it came from (``"options"`` or
    ``"planner"``), the planner's ranked candidates as text, and what plan.json records of the
    choice (the memory budget, the predicted step time and memory of the plan)."""

    plan: Any
    source: str
    candidates: str | None
    record: dict[str, Any]


def choose_plan(config: TrainConfig, model, example_batch, devices: Sequence,
                log: Callable[..., None] = print) -> Chosen:
    """The plan to run: from the options (what they leave out from :data:`FIXED_PLAN`), or, with
    none, the fastest plan ``jpipe.plan`` finds that fits :func:`device_memory_budget`; ``log`` gets
    the planner's progress (what it profiles, how many candidates it ranked).

    >>> import jax
    >>> plan, source, _, _ = choose_plan(TrainConfig(pipe=2, data=1), None, None, jax.devices())
    >>> (plan.pipe, plan.data, plan.microbatches, plan.schedule), source
    ((2, 1, 4, '1f1b'), 'options')
    """
    import jpipe

    if not config.plan_given:
        budget, budget_from = device_memory_budget(config.device_memory, devices)
        log(f"planning: no plan options (--pipe, --data, --microbatches, --schedule), so the planner profiles "
            f"the model and picks the fastest plan for {len(devices)} devices that fits "
            + (f"{budget / 2**20:g} MiB per device ({budget_from})" if budget else "them"), flush=True)
        choice = jpipe.plan(model, example_batch, devices=list(devices), memory_limit=budget,
                            progress=lambda line: log(line, flush=True))
        chosen = dataclasses.replace(choice.plan, remat=choice.plan.remat or config.remat,
                                     fuse_ticks=choice.plan.fuse_ticks or config.fuse_ticks)
        best = choice.candidates[0]
        record = {"device_memory_mib": None if budget is None else budget / 2**20, "budget_from": budget_from,
                  "predicted_step_ms": best.step_time * 1e3, "predicted_memory_mib": best.memory / 2**20,
                  "candidates_fitting": sum(c.fits for c in choice.candidates),
                  "candidates": len(choice.candidates)}
        return Chosen(chosen, "planner", choice.table(10), record)
    pipe, data = config.given_mesh
    plan = jpipe.Plan(pipe=pipe, data=data, microbatches=config.microbatches or FIXED_PLAN["microbatches"],
                      schedule=config.schedule or FIXED_PLAN["schedule"], remat=config.remat,
                      virtual_stages=config.virtual_stages, fuse_ticks=config.fuse_ticks)
    if config.device_memory is None:
        return Chosen(plan, "options", None, {})
    return Chosen(plan, "options", None, _check_fits(plan, config, model, example_batch))


def _check_fits(plan, config: TrainConfig, model, example_batch) -> dict[str, Any]:
    """The predicted memory of an explicit ``plan`` against ``--device-memory`` (from shapes alone);
    refuses a plan that does not fit, naming the smallest plan that would."""
    import jax

    from jpipe import partition

    batch = config.batch_size
    microbatch = jax.tree.map(lambda a: a[: max(1, batch // plan.num_devices)], example_batch)
    sizes = partition.memory_profile(model, microbatch)
    need = partition.evaluate(sizes, plan, batch).memory
    budget = config.device_memory * 2**20
    if need > budget:
        fitting = [c for c in partition.search(sizes, plan.num_devices, batch).candidates if c.memory <= budget]
        hint = "no plan of these devices fits it; use more devices or a smaller model or batch"
        if fitting:
            p = min(fitting, key=lambda c: c.memory).plan
            hint = (f"the smallest plan that fits is --pipe {p.pipe} --data {p.data} --microbatches "
                    f"{p.microbatches} --schedule {p.schedule}, or raise --device-memory")
        raise ValueError(f"pipe {plan.pipe} x data {plan.data} with {plan.microbatches} micro-batches needs "
                         f"{need / 2**20:.1f} MiB per device, more than --device-memory {config.device_memory:g} "
                         f"MiB; {hint}")
    return {"device_memory_mib": float(config.device_memory), "budget_from": "--device-memory",
            "predicted_memory_mib": need / 2**20}


def _plan_record(plan, source: str, num_layers: int) -> dict[str, Any]:
    from jpipe import schedules

    table = plan.table()
    sim = schedules.simulate(table, schedules.Costs(forward=1.0, backward=1.0))
    return {
        "source": source,
        "pipe": plan.pipe,
        "data": plan.data,
        "microbatches": plan.microbatches,
        "schedule": plan.schedule if isinstance(plan.schedule, str) else getattr(plan.schedule, "__name__", "custom"),
        "virtual_stages": plan.virtual_stages,
        "remat": plan.remat,
        "fuse_ticks": plan.fuse_ticks,
        "partition": list(plan.stage_partition(num_layers)),
        "ticks": table.num_ticks,
        "simulated_bubble": sim.bubble_fraction,
        "peak_held_microbatches": sim.peak_held.tolist(),
        "gantt": schedules.ascii_gantt(table) if table.num_ticks <= 60 else None,
    }


# what plan.json records of the planner's choice (kept when a run resumes on its saved plan)
_CHOICE_KEYS = ("device_memory_mib", "budget_from", "predicted_step_ms", "predicted_memory_mib",
                "candidates_fitting", "candidates")


def _skip(it: Iterator, n: int) -> Iterator:
    for _ in range(n):
        next(it)
    return it


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    resume_step: int | None = None,
    overwrite: bool = False,
    devices: Sequence | None = None,
    command: str | None = None,
    log: Callable[..., None] = print,
) -> dict[str, Any]:
    """Runs ``config`` and writes its run folder; returns the run's summary (also ``summary.json``).

    With ``resume``, ``config.out`` must be a run folder with a checkpoint: training
    continues from its newest intact checkpoint (or ``resume_step``) with the same step
    counter and batches, so the loss trajectory is the one the uninterrupted run would
    have had; a damaged newest checkpoint is skipped with a warning. A new run refuses
    a folder that holds another run's checkpoints unless ``overwrite`` (which clears
    them first), and a folder another live run is writing (a lock file names it; a
    dead process's lock is taken over). A refused call changes nothing on disk.
    ``devices`` defaults to the first ``pipe x data`` of ``jax.devices()``.

    Under ``jax.distributed`` (:func:`jpipe.distributed.initialize` first) every process
    calls it alike with an explicit plan and ``devices`` over all processes (e.g.
    :func:`jpipe.distributed.mesh_devices`); each process feeds only its own rows of
    every batch, the held-out loss is computed on the whole mesh, and only process 0
    writes the run folder's files and prints; all write the checkpoints (orbax). The run
    folder must be on a file system every process sees.
    """
    wall_start = time.perf_counter()
    config.check()
    import jax

    multi_process = jax.process_count() > 1
    if multi_process and mesh_shape(config, resume or resume_step is not None) is None:
        raise ValueError(MULTI_PROCESS_PLAN)
    resume = resume or resume_step is not None
    out = config.out or _shared_run_dir()
    config = dataclasses.replace(config, out=out)
    checkpoints_dir = os.path.join(os.path.abspath(out), "checkpoints")
    _check_out_folder(out)
    if resume:
        if not os.path.isdir(out):
            raise FileNotFoundError(f"cannot resume: run folder {out!r} does not exist")
        steps = _resume_steps(checkpoints_dir, out, config.steps, resume_step)
    else:
        steps = None
        held = sorted(os.listdir(checkpoints_dir)) if os.path.isdir(checkpoints_dir) else []
        if held and not overwrite:
            raise FileExistsError(
                f"run folder {out!r} holds another run's checkpoints ({', '.join(held[:5])}); continue it "
                f"with --resume {out}, choose another --out, or pass --overwrite to delete them and start afresh")
    lock = RunLock(out, log) if jax.process_index() == 0 else None
    try:
        if overwrite and not resume and jax.process_index() == 0:
            import shutil

            shutil.rmtree(checkpoints_dir, ignore_errors=True)
        if multi_process:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jpipe run folder ready")
        with StopRequest(log) as stop:
            return _train(config, steps, devices, command, log, wall_start, stop)
    except Interrupted as e:
        raise Interrupted(f"{e}; resume from the last checkpoint with: jpipe train --resume {out}") from None
    finally:
        if lock is not None:
            lock.release()


def _resume_steps(checkpoints_dir: str, out: str, max_step: int, resume_step: int | None) -> list[int]:
    """The checkpoints to try, newest first: ``resume_step`` alone, or every complete one."""
    from jpipe.checkpoint import Checkpointer

    with Checkpointer(checkpoints_dir) as ckpt:
        complete = ckpt.all_steps()
    if not complete:
        raise FileNotFoundError(f"cannot resume: {out!r} has no complete checkpoint")
    if resume_step is not None:
        if resume_step not in complete:
            raise ValueError(f"--resume-step {resume_step}: {out!r} has no complete checkpoint at that step; "
                             f"it has {complete}")
        complete = [resume_step]
    if complete[-1] > max_step:
        raise ValueError(f"the checkpoint of {out!r} to resume is at step {complete[-1]}, after --steps "
                         f"{max_step}; raise --steps to train further")
    return complete[::-1]


def _check_out_folder(out: str) -> None:
    """Refuses an ``--out`` that is a file, or a folder (or the nearest existing parent of one) that
    this process cannot write, before anything runs."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} is a file, not a folder; give a folder for the run (it is created "
                         f"if missing)")
    existing = os.path.abspath(out)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--out {out!r} cannot be created: {existing!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out!r}: {existing!r} is not writable by this user; choose another --out")


class RunLock:
    """``RUN_DIR/.lock``: one live run per folder. Holds the owner's pid and host; a lock whose
    process is gone (same host) is taken over with a warning."""

    NAME = ".lock"

    def __init__(self, out: str, log: Callable[..., None] = print) -> None:
        os.makedirs(out, exist_ok=True)
        self.path = os.path.join(out, self.NAME)
        me = {"pid": os.getpid(), "host": platform.node()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                holder = self._holder()
                if holder.get("host") == me["host"] and not _alive(holder.get("pid")):
                    log(f"warning: taking over the lock of {out!r} from process {holder.get('pid')}, "
                        f"which is gone")
                    os.remove(self.path)
                    continue
                raise FileExistsError(
                    f"run folder {out!r} is in use by process {holder.get('pid')} on "
                    f"{holder.get('host')!r} (its lock: {self.path}); wait for that run to end or choose "
                    f"another --out") from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            return
        raise FileExistsError(f"could not take the lock {self.path}; remove it if no run uses {out!r}")

    def _holder(self) -> dict:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        if self._holder().get("pid") == os.getpid():
            os.remove(self.path)


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _train(config: TrainConfig, resume_steps: list[int] | None, devices: Sequence | None, command: str | None,
           log: Callable[..., None], wall_start: float, stop: StopRequest) -> dict[str, Any]:
    """The run, in named parts: data and model, plan, state, evaluation, the loop, the summary."""
    import jax

    from jpipe import data as jdata
    from jpipe import models
    from jpipe.checkpoint import Checkpointer

    main_process = jax.process_index() == 0
    if not main_process:  # one voice: process 0 prints, the others only fail loudly
        def log(*args: Any, **kwargs: Any) -> None:
            pass

    corpus = jdata.load(config.max_chars)
    model = models.gpt(corpus.vocab_size, config.seq_len, d_model=config.d_model, num_heads=config.heads,
                       num_layers=config.layers, framework=config.framework, dtype=config.dtype,
                       dropout=config.dropout)
    example = next(corpus.batches(config.seq_len, config.batch_size, seed=config.seed, split="train"))
    available = list(devices) if devices is not None else jax.devices()
    plan, plan_record = _resolve_plan(config, model, example, available, resume_steps is not None, log)
    run_devices = available[: plan.num_devices]
    if main_process:
        _write_plan_files(config, plan, plan_record, log)
    _describe(config, corpus, plan, plan_record, run_devices, log)
    checkpoints = Checkpointer(os.path.join(os.path.abspath(config.out), "checkpoints"),
                               every=config.checkpoint_every or config.steps + 1,
                               keep=max(1, config.keep_checkpoints))
    state, start_step, num_params = _initial_state(config, model, plan, example, run_devices, checkpoints,
                                                   resume_steps, log)
    evaluation = _Evaluation(config, model, corpus, state, run_devices)
    progress = _Progress(config, start_step, corpus.unigram_loss(), log if main_process else None)
    loop = _Loop(config, evaluation, progress, checkpoints, stop)
    try:
        if start_step == 0:
            progress.initial(evaluation.loss(state))
        state = loop.run(state, corpus, start_step)
    finally:
        progress.close()
        checkpoints.close()
    return _summarise(config, command, corpus, num_params, plan_record, run_devices, progress, loop,
                      start_step if resume_steps is not None else None, wall_start, log)


def _resolve_plan(config: TrainConfig, model, example: dict, available: Sequence, resume: bool,
                  log: Callable[..., None]) -> tuple[Any, dict[str, Any]]:
    """The plan (a resumed run's saved one, else :func:`choose_plan`'s), checked against the devices
    and the batch, and its plan.json record."""
    import jax

    import jpipe

    rec = _saved_plan(config.out) if resume and not config.plan_given else None
    if rec is not None:
        # Continue on the plan the run had (the planner might choose differently now).
        plan = jpipe.Plan(pipe=rec["pipe"], data=rec["data"], microbatches=rec["microbatches"],
                          schedule=rec["schedule"], partition=tuple(rec["partition"]),
                          remat=config.remat or rec["remat"], virtual_stages=rec.get("virtual_stages", 1),
                          fuse_ticks=rec.get("fuse_ticks", False))
        source, candidates = rec["source"], rec.get("planner_candidates")
        choice_record = {k: rec[k] for k in _CHOICE_KEYS if k in rec}
    else:
        plan, source, candidates, choice_record = choose_plan(config, model, example, available, log)
    if plan.num_devices > len(available):
        raise ValueError(f"the plan needs pipe x data = {plan.num_devices} devices but {len(available)} are "
                         f"available; lower --pipe/--data")
    per = plan.data * plan.microbatches
    if config.batch_size % per:
        raise ValueError(f"--batch-size {config.batch_size} must be a multiple of data x microbatches = "
                         f"{plan.data} x {plan.microbatches} = {per}")
    if jax.process_count() > 1 and len(available) != plan.num_devices:
        raise ValueError(f"with {jax.process_count()} processes give exactly pipe x data = {plan.num_devices} "
                         f"devices over all processes (jpipe.distributed.mesh_devices), got {len(available)}")
    plan_record = _plan_record(plan, source, config.layers)
    plan_record["planner_candidates"] = candidates
    plan_record.update(choice_record)
    return plan, plan_record


def _write_plan_files(config: TrainConfig, plan, plan_record: dict[str, Any], log: Callable[..., None]) -> None:
    """config.toml, plan.json and the schedule's picture in the run folder."""
    from jpipe import schedules

    dump_config(config, os.path.join(config.out, report.CONFIG))
    with open(os.path.join(config.out, report.PLAN), "w") as f:
        json.dump(plan_record, f, indent=2)
    try:
        schedules.gantt_png(plan.table(), os.path.join(config.out, report.SCHEDULE_PNG))
    except ImportError as e:
        log(f"no schedule picture: {e}")


def _describe(config: TrainConfig, corpus, plan, plan_record: dict[str, Any], run_devices: Sequence,
              log: Callable[..., None]) -> None:
    log(f"run folder: {config.out}")
    log(f"corpus: {len(corpus.train):,} train / {len(corpus.heldout):,} held-out bytes of Python "
        f"standard-library source ({len(corpus.train_files)} / {len(corpus.heldout_files)} files)")
    log(f"model: GPT ({config.framework}), {config.layers} layers, d_model {config.d_model}, "
        f"{config.heads} heads, seq_len {config.seq_len}, byte vocabulary ({corpus.vocab_size})"
        + (f", {config.dtype} compute with float32 parameters" if config.dtype != "float32" else ""))
    log(f"plan ({plan_record['source']}): pipe {plan.pipe} x data {plan.data} on {len(run_devices)} "
        f"{run_devices[0].platform} devices, {plan.microbatches} micro-batches, schedule "
        f"{plan_record['schedule']!r}{' + remat' if plan.remat else ''}"
        f"{' + fused ticks' if plan.fuse_ticks else ''}, layers per stage "
        f"{tuple(plan_record['partition'])}, simulated bubble {plan_record['simulated_bubble']:.1%}; "
        f"batch {config.batch_size}, adam lr {config.lr:g}")


def _initial_state(config: TrainConfig, model, plan, example: dict, run_devices: Sequence, checkpoints,
                   resume_steps: list[int] | None, log: Callable[..., None]) -> tuple[Any, int, int]:
    """The state to start from, its step and the model's parameter count: restored from the newest
    intact checkpoint, or fresh."""
    import jax
    import optax

    import jpipe

    optimizer = optax.adam(config.lr)
    main_process = jax.process_index() == 0
    if resume_steps is not None:
        state, start_step = _restore_intact(checkpoints, resume_steps, model, plan, optimizer, example,
                                            run_devices, log)
        if main_process:
            report.truncate_metrics(config.out, start_step)
        log(f"resumed from the checkpoint at step {start_step}")
    else:
        state, start_step = jpipe.init(model, plan, optimizer, example, rng=jax.random.key(config.seed),
                                       devices=run_devices), 0
        if main_process and os.path.exists(os.path.join(config.out, report.METRICS)):
            os.remove(os.path.join(config.out, report.METRICS))  # a fresh run into an existing folder
    num_params = int(sum(x.size for x in jax.tree.leaves(jpipe.to_sequential(state))))
    log(f"parameters: {num_params:,}")
    return state, start_step, num_params


class _Evaluation:
    """The held-out loss of a state's plain model, and each process's rows of a training batch."""

    def __init__(self, config: TrainConfig, model, corpus, state, run_devices: Sequence) -> None:
        import jax

        self.config = config
        heldout = list(corpus.batches(config.seq_len, config.batch_size, seed=config.seed + 1, split="heldout",
                                      num_batches=config.eval_batches))
        if jax.process_count() > 1:
            self._across_processes(model, heldout, state)
        else:
            self.device = run_devices[0]
            self.batches = [jax.device_put(b, self.device) for b in heldout]
            self.loss_fn = jax.jit(model.loss_value)
            self.rows = None

    def _across_processes(self, model, heldout: list[dict], state) -> None:
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from jpipe import distributed

        # No process can gather the parameters onto one of its devices: every device of the mesh
        # computes the held-out loss on replicated parameters, and every process reads it.
        replicated = NamedSharding(state.mesh, P())
        self.device, self.mesh = None, state.mesh
        self.batches = [jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, replicated,
                                                                            lambda idx, a=a: a[idx]), b)
                        for b in heldout]
        self.loss_fn = jax.jit(lambda params, batch: model.loss_value(
            jax.lax.with_sharding_constraint(params, replicated), batch), out_shardings=replicated)
        self.rows = distributed.local_rows(state.mesh, self.config.batch_size)
        plan = state.plan
        stages = sorted({s for s in range(plan.pipe) if any(d.process_index == jax.process_index()
                                                            for d in state.mesh.devices[s])})
        print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local "
              f"device(s), stages {stages}, batch rows {self.rows.start}:{self.rows.stop}", flush=True)

    def loss(self, state) -> float:
        import jax

        import jpipe

        params = jpipe.to_sequential(state)
        if self.device is not None:
            params = jax.device_put(params, self.device)
        losses = [self.loss_fn(params, b) for b in self.batches]
        return float(sum(float(x) for x in losses) / len(losses))

    def feed(self, batch: dict) -> dict:
        """This process's rows of the global batch (all of it in one process)."""
        if self.rows is None:
            return batch
        from jpipe import distributed

        size = self.config.batch_size
        return distributed.global_batch(self.mesh, {k: v[self.rows] for k, v in batch.items()}, size)


class _Progress:
    """metrics.jsonl, the progress bar and the log lines of the loop; keeps the step times."""

    def __init__(self, config: TrainConfig, start_step: int, unigram: float, log: Callable[..., None] | None):
        self.config, self.unigram = config, unigram
        self.tokens_per_step = config.batch_size * config.seq_len
        # Closed by close(); appended to as each step finishes.
        self.file = open(os.path.join(config.out, report.METRICS), "a") if log is not None else None  # noqa: SIM115
        self.bar = _progress_bar(config, start_step) if log is not None else None
        self.say = self.bar.write if self.bar is not None else (log or (lambda *a, **k: None))
        self.first_step_s: float | None = None
        self.window: list[tuple[float, float]] = []  # (loss, seconds) since the last log line
        self.recent: list[float] = []  # step times for the bar's tokens/s
        self.step_times: list[float] = []  # every step's seconds but the first (compiling)
        self.start = time.perf_counter()
        self.last_heldout: float | None = None

    def record(self, entry: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(entry) + "\n")
            self.file.flush()

    def initial(self, loss: float) -> None:
        self.record({"step": 0, "heldout_loss": loss})
        self.say(f"held-out loss at initialisation: {loss:.4f} (unigram baseline {self.unigram:.4f}, "
                 f"uniform log 256 = {math.log(256):.4f})")

    def step(self, step: int, loss: float, seconds: float, compiled: bool) -> None:
        if compiled:
            self.first_step_s = seconds
        else:
            self.window.append((loss, seconds))
            self.recent = (self.recent + [seconds])[-20:]
            self.step_times.append(seconds)
        self.record({"step": step, "loss": loss, "step_s": seconds,
                     "tokens_per_s": self.tokens_per_step / seconds, "elapsed_s": time.perf_counter() - self.start,
                     **({"compiled": True} if compiled else {})})
        if self.bar is not None:
            rate = self.tokens_per_step * len(self.recent) / sum(self.recent) if self.recent else float("nan")
            self.bar.set_postfix_str(f"loss {loss:.3f}" + (f", {rate:,.0f} tok/s" if self.recent else ""),
                                     refresh=False)
            self.bar.update(1)
        if compiled:
            self.say(f"step {step:>5}  loss {loss:.4f}  (includes compilation: {seconds:.1f}s)")
        elif step % self.config.log_every == 0 or step == self.config.steps:
            mean = sum(w[0] for w in self.window) / len(self.window)
            rate = len(self.window) * self.tokens_per_step / sum(w[1] for w in self.window)
            self.say(f"step {step:>5}  loss {mean:.4f}  {rate:,.0f} tokens/s")
            self.window = []

    def heldout(self, step: int, loss: float) -> None:
        self.last_heldout = loss
        self.record({"step": step, "heldout_loss": loss})
        self.say(f"step {step:>5}  held-out loss {loss:.4f}  (unigram baseline {self.unigram:.4f})")

    @property
    def median_step_s(self) -> float | None:
        return sorted(self.step_times)[len(self.step_times) // 2] if self.step_times else None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()


class _Loop:
    """The training loop: a step, its metrics, the evaluations and checkpoints it is due for; it stops
    at a step boundary when every process agreed to (Ctrl-C, SIGTERM)."""

    def __init__(self, config: TrainConfig, evaluation: _Evaluation, progress: _Progress, checkpoints,
                 stop: StopRequest) -> None:
        self.config, self.evaluation, self.progress = config, evaluation, progress
        self.checkpoints, self.stop = checkpoints, stop
        self.stopped_at: int | None = None  # the step an interrupt stopped the run at
        self.start_step = 0
        self.train_s = 0.0

    def run(self, state, corpus, start_step: int):
        import jax

        import jpipe

        config = self.config
        batches = _skip(corpus.batches(config.seq_len, config.batch_size, seed=config.seed, split="train"),
                        start_step)
        start = self.progress.start = time.perf_counter()
        self.start_step = start_step
        for step in range(start_step + 1, config.steps + 1):
            if self.stop.agreed(jax.process_count() > 1):
                self.stopped_at = step - 1
                break
            tick = time.perf_counter()
            state, metrics = jpipe.train_step(state, self.evaluation.feed(next(batches)))
            loss = float(metrics["loss"])  # waits for the step
            self.progress.step(step, loss, time.perf_counter() - tick, compiled=step == start_step + 1)
            if (config.eval_every and step % config.eval_every == 0) or step == config.steps:
                self.progress.heldout(step, self.evaluation.loss(state))
            # Batches are a function of the step, so the step is the whole data position.
            self.checkpoints.save(state, force=step == config.steps, extra={"batches_consumed": step})
        if self.stopped_at is not None:
            self.checkpoints.save(state, force=True, extra={"batches_consumed": self.stopped_at})
            self.progress.say(f"interrupted: stopped after step {self.stopped_at}, saving its checkpoint")
        self.train_s = time.perf_counter() - start
        return state


def _summarise(config: TrainConfig, command: str | None, corpus, num_params: int, plan_record: dict[str, Any],
               run_devices: Sequence, progress: _Progress, loop: _Loop, resumed_from: int | None,
               wall_start: float, log: Callable[..., None]) -> dict[str, Any]:
    """summary.json and report.md (process 0), and the run's last log lines; returns the summary."""
    import jax

    import jpipe

    out, unigram = config.out, progress.unigram
    summary = {
        "command": command,
        "steps": config.steps,
        "steps_run": (config.steps if loop.stopped_at is None else loop.stopped_at) - loop.start_step,
        "out": out,
        "interrupted": loop.stopped_at is not None,
        "stopped_at": loop.stopped_at,
        "resumed_from": resumed_from,
        "num_params": num_params,
        "tokens_per_step": progress.tokens_per_step,
        "train_bytes": len(corpus.train),
        "heldout_bytes": len(corpus.heldout),
        "unigram_loss": unigram,
        "unigram_entropy": corpus.unigram_entropy(),
        "final_heldout_loss": progress.last_heldout,
        "first_step_s": progress.first_step_s,
        "median_step_s": progress.median_step_s,
        "train_s": loop.train_s,
        "devices": f"{len(run_devices)} x {run_devices[0].platform} ({run_devices[0].device_kind})",
        "versions": f"jpipe {jpipe.__version__}, jax {jax.__version__}, Python {platform.python_version()}",
    }
    if jax.process_index() == 0:
        summary["wall_s"] = time.perf_counter() - wall_start
        with open(os.path.join(out, report.SUMMARY), "w") as f:
            json.dump(summary, f, indent=2)
        report.write_report(out)
    summary["artifacts"] = sorted(os.listdir(out))
    predicted = plan_record.get("predicted_step_ms")
    if predicted is not None and summary["median_step_s"] is not None:
        measured = summary["median_step_s"] * 1e3
        log(f"step time: the planner predicted {predicted:.1f} ms, the median step took {measured:.1f} ms "
            f"({predicted / measured - 1:+.0%})")
    if progress.last_heldout is not None:
        verdict = "below" if progress.last_heldout < unigram else "NOT below"
        log(f"held-out loss {progress.last_heldout:.4f}, {verdict} the unigram baseline {unigram:.4f}; "
            f"{summary['steps_run']} steps in {summary['train_s']:.1f}s; report: "
            f"{os.path.join(out, report.REPORT)}")
    return summary


class Interrupted(Exception):
    """A second SIGINT/SIGTERM: ``jpipe train`` aborts at once (the last checkpoint is intact)."""


class StopRequest:
    """SIGINT and SIGTERM ask ``jpipe train`` to stop at the next step boundary (with a checkpoint,
    the report and ``summary.json``); a second one aborts at once with :class:`Interrupted`. The
    previous handlers come back on exit. Outside the main thread it does nothing (Python delivers
    signals to the main thread only).

    A signal handler's exception is raised in whatever Python code runs at that moment; inside a
    finaliser or a weakref callback Python prints it as "Exception ignored" and goes on. So the
    second signal also marks the run aborted, the next step boundary raises :class:`Interrupted`
    again, and while the handlers are installed such a swallowed :class:`Interrupted` prints nothing.
    """

    SIGNALS = ("SIGINT", "SIGTERM")
    ABORTED = "interrupted twice: aborted without a final checkpoint"

    def __init__(self, log: Callable[..., None]) -> None:
        self.requested = False
        self.aborted = False
        self._log = log
        self._previous: dict = {}
        self._previous_hook: Callable | None = None

    def __enter__(self) -> Self:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name)
                self._previous[sig] = signal.signal(sig, self._handle)
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._previous_hook is not None:
            sys.unraisablehook = self._previous_hook

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            self.aborted = True
            raise Interrupted(self.ABORTED)
        self.requested = True
        self._log("stopping at the next step boundary with a checkpoint (interrupt again to abort now)",
                  flush=True)

    def _unraisable(self, unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, Interrupted):  # ours is raised again at the step boundary
            self._previous_hook(unraisable)

    def agreed(self, multi_process: bool) -> bool:
        """Whether to stop now: under ``jax.distributed``, whether any process was asked to (every
        process then stops at the same step). Raises :class:`Interrupted` where this process was
        interrupted twice."""
        if self.aborted:
            raise Interrupted(self.ABORTED)
        if not multi_process:
            return self.requested
        import numpy as np
        from jax.experimental import multihost_utils

        return bool(np.asarray(multihost_utils.process_allgather(np.int32(self.requested))).any())


def _restore_intact(checkpoints, steps: list[int], model, plan, optimizer, example, devices, log):
    """The state of the newest of ``steps`` whose checkpoint restores intact, and its step."""
    from jpipe.checkpoint import CheckpointError

    for i, step in enumerate(steps):
        try:
            return checkpoints.restore(model, plan, optimizer, example, step=step, devices=devices), step
        except CheckpointError as e:
            if i + 1 == len(steps):
                checkpoints.close()
                raise
            log(f"warning: skipping the checkpoint at step {step}, which is damaged ({str(e)[:300]}); "
                f"trying step {steps[i + 1]}")
    raise AssertionError("no steps to resume from")


def _progress_bar(config: TrainConfig, start_step: int):
    show = config.progress if config.progress is not None else sys.stderr.isatty()
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=config.steps, initial=start_step, unit="step", dynamic_ncols=True, smoothing=0.1,
                desc="train")


def command_line(argv: Sequence[str]) -> str:
    """The command as typed: ``jpipe`` and the quoted ``argv``."""
    return " ".join(["jpipe", *map(shlex.quote, argv)])


def config_from_mapping(values: Mapping[str, Any]) -> TrainConfig:
    """A :class:`TrainConfig` from a mapping with exactly its field names (others ignored)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in values.items() if k in names})
