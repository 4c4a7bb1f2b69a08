"""Command line: ``jpipe train | schedule | report`` (also ``python -m jpipe ...``).

``jpipe train`` trains a small byte-level GPT on the Python standard library's
own source (:mod:`jpipe.data`) with a pipeline-parallel plan -- from the planner
when there is one and no plan option is given, else pipe 4 x data 2, 4
micro-batches, 1F1B -- showing a progress bar, evaluating on held-out files and
writing a run folder (``runs/<timestamp>`` or ``--out``): plan, metrics (JSON
lines), orbax checkpoints, the schedule's Gantt chart, the loss curves and a
markdown report (see :mod:`jpipe.run` and :mod:`jpipe.report`). ``--config
FILE.toml`` takes the same options as keys; options on the command line win.
``--resume`` continues the run in ``--out`` (default: the latest under ``runs/``)
from its last checkpoint.

``jpipe schedule show NAME --pipe P --microbatches M [--png FILE]`` prints a
schedule table and its simulated bubble; ``jpipe report RUN_DIR`` re-renders a
run's report.

Without accelerators it runs on ``pipe x data`` simulated CPU devices: unless
``XLA_FLAGS`` already sets ``--xla_force_host_platform_device_count``, the
command adds it before JAX starts its runtime. (The flag only concerns the
host platform; an accelerator, where there is one with enough devices, is
still used.) This module therefore does not use JAX at import time.

>>> from jpipe.cli import build_parser
>>> args = build_parser().parse_args(["train", "--steps", "10", "--pipe", "2"])
>>> args.steps, args.pipe, args.data, args.microbatches, args.schedule
(10, 2, None, None, None)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
INTERRUPTED = 130  # the shell's exit code for SIGINT
# Destinations of ``jpipe train`` that are not options of the run (and not config-file keys).
_NOT_CONFIG = {"command", "run", "config", "resume", "resume_step", "overwrite", "help"}
# Options of ``jpipe train`` that say where a process runs, not what the run is (not config keys either).
_LAUNCH = {"coordinator", "num_processes", "process_id", "distributed", "across"}
_NOT_CONFIG |= _LAUNCH


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only where it says something: not when the help already states its
    default, and not for unset (None) options or off switches."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def _add_train(commands) -> argparse.ArgumentParser:
    from jpipe.run import FIXED_PLAN, TrainConfig

    d = TrainConfig  # the defaults live in one place
    train = commands.add_parser(
        "train",
        help="train a small GPT on the Python standard library's source",
        description="Train a small byte-level GPT on the Python standard library's own source code "
                    "with a pipeline-parallel plan; writes a run folder with the plan, metrics, "
                    "checkpoints, pictures and a report. A --config FILE.toml takes the same options as "
                    "keys (e.g. batch_size = 64); options on the command line win.",
        formatter_class=_DefaultsHelp,
    )
    add = train.add_argument
    add("--config", metavar="FILE.toml", help="read options from a TOML file (keys as the options)")
    add("--out", default=None, help="run folder (default: runs/<timestamp>)")
    add("--resume", nargs="?", const=True, default=False, metavar="RUN_DIR",
        help="continue RUN_DIR (or --out, or the latest run under runs/) from its newest intact checkpoint "
             "(a damaged newest one is skipped with a warning); the step counter, batches and loss "
             "trajectory continue where they stopped")
    add("--resume-step", type=int, default=None, metavar="N",
        help="with --resume: continue from the checkpoint at step N rather than the newest")
    add("--overwrite", action="store_true",
        help="start afresh in an --out folder that holds another run's checkpoints (deletes them)")
    add("--steps", type=int, default=d.steps, help="training steps")
    _add_model_options(add)
    add("--dropout", type=float, default=d.dropout,
        help="dropout rate of the GPT's embeddings and residual branches in training steps (evaluation "
             "runs without); masks depend on --seed, the step and the sample, not on the plan")
    plan_default = "the planner's choice; beside other plan options, {}"
    add("--pipe", type=int, default=None, help="pipeline stages (default: " +
        plan_default.format(FIXED_PLAN["pipe"]) + ")")
    add("--data", type=int, default=None, help="data-parallel replicas (default: " +
        plan_default.format("8 / pipe") + ")")
    add("--microbatches", type=int, default=None, help="micro-batches per step (default: " +
        plan_default.format(FIXED_PLAN["microbatches"]) + ")")
    add("--schedule", default=None, help="pipeline schedule, e.g. gpipe, 1f1b, 1f1b-b (default: " +
        plan_default.format(FIXED_PLAN["schedule"]) + ")")
    add("--virtual-stages", type=int, default=d.virtual_stages,
        help="model chunks per device (for interleaved schedules)")
    add("--remat", action=argparse.BooleanOptionalAction, default=d.remat,
        help="recompute each stage's forward in its backward")
    add("--fuse-ticks", action=argparse.BooleanOptionalAction, default=d.fuse_ticks,
        help="one forward and one backward per device per tick (pair with --schedule 1f1b-b)")
    add("--lr", type=float, default=d.lr, help="Adam learning rate")
    add("--seed", type=int, default=d.seed, help="seed of the initial parameters and of the batches")
    add("--log-every", type=int, default=d.log_every, help="print the mean training loss every this many steps")
    add("--eval-every", type=int, default=d.eval_every, help="held-out evaluation every this many steps (0: at the end)")
    add("--eval-batches", type=int, default=d.eval_batches, help="held-out batches (of --batch-size) to evaluate")
    add("--checkpoint-every", type=int, default=d.checkpoint_every,
        help="save a checkpoint every this many steps, and at the end (0: only at the end)")
    add("--keep-checkpoints", type=int, default=d.keep_checkpoints, help="checkpoints to keep")
    add("--max-chars", type=int, default=d.max_chars, help="bytes of standard-library source to use")
    add("--progress", action=argparse.BooleanOptionalAction, default=None,
        help="show a progress bar (default: when stderr is a terminal)")
    multi = train.add_argument_group(
        "multi-process runs (jax.distributed)",
        "Start the same command once per process (host), each with its --process-id, or with "
        "--distributed under SLURM/Open MPI. Every process needs an explicit plan (--pipe/--data) and "
        "writes to one run folder (--out, or process 0's runs/<timestamp>) on a file system all of them see; each feeds only its own rows of every batch "
        "and process 0 writes the run folder. On CPU each process gets pipe x data / N devices.")
    multi.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                       help="address of process 0 (it listens there); with --num-processes and --process-id")
    multi.add_argument("--num-processes", type=int, default=None, metavar="N", help="processes in the run")
    multi.add_argument("--process-id", type=int, default=None, metavar="I", help="this process, 0 to N-1")
    multi.add_argument("--distributed", action="store_true",
                       help="join the run the environment describes: the JPIPE_* variables of "
                            "jpipe.distributed.launch_local, or a cluster JAX detects (SLURM, Open MPI, "
                            "TPU pods, ...)")
    multi.add_argument("--across", choices=("pipe", "data"), default="pipe",
                       help="which mesh axis crosses processes: pipe (stages on different hosts) or data "
                            "(replicas on different hosts)")
    train.set_defaults(run=_train)
    return train


def _add_model_options(add: Callable[..., Any]) -> None:
    """The built-in GPT and its batch: one declaration, so ``jpipe plan`` plans the model that
    ``jpipe train`` trains (same options, same defaults: :class:`jpipe.run.TrainConfig`'s)."""
    from jpipe.run import DTYPES, SIMULATED_DEVICE_MIB
    from jpipe.run import TrainConfig as d

    add("--batch-size", type=int, default=d.batch_size, help="sequences per step (global batch)")
    add("--seq-len", type=int, default=d.seq_len, help="tokens (bytes) per sequence")
    add("--layers", type=int, default=d.layers, help="transformer blocks")
    add("--d-model", type=int, default=d.d_model, help="model width")
    add("--heads", type=int, default=d.heads, help="attention heads")
    add("--framework", choices=("nnx", "linen"), default=d.framework, help="Flax API of the model")
    add("--dtype", choices=DTYPES, default=d.dtype,
        help="compute dtype of the model (activations, matmuls, what stages send each other); parameters, "
             "gradients and the Adam state stay float32, softmax and loss are float32 (mixed precision)")
    add("--device-memory", "--memory-limit", dest="device_memory", type=float, default=d.device_memory,
        metavar="MIB", help="memory per device the planner plans for (default: what an accelerator reports; "
                            f"{SIMULATED_DEVICE_MIB:g} MiB for simulated CPU devices); with a plan given by "
                            "options, a plan that does not fit is refused")


def _add_schedule(commands) -> None:
    schedule = commands.add_parser("schedule", help="show a pipeline schedule",
                                   description="Show a schedule's table, its simulated bubble and, with "
                                               "--png, its Gantt chart.")
    actions = schedule.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print a schedule table and its simulated bubble")
    show.add_argument("name", metavar="NAME", help="a schedule name (e.g. 1f1b, gpipe)")
    show.add_argument("--pipe", type=int, default=4, help="devices (pipeline stages)")
    show.add_argument("--microbatches", type=int, default=8, help="micro-batches")
    show.add_argument("--chunks", type=int, default=None, help="model chunks per device (interleaved schedules)")
    show.add_argument("--png", metavar="FILE", default=None, help="also write the Gantt chart to FILE")
    show.add_argument("--fused", action="store_true",
                      help="fused ticks: one forward and one backward per device per tick")
    show.set_defaults(run=_schedule_show)


def _add_report(commands) -> None:
    rep = commands.add_parser("report", help="re-render a run folder's report",
                              description="Re-render report.md and loss.png of a jpipe train run folder.")
    rep.add_argument("run_dir", metavar="RUN_DIR", help="the run folder")
    rep.set_defaults(run=_report)


def build_parser() -> argparse.ArgumentParser:
    """The ``jpipe`` argument parser."""
    from importlib.metadata import version  # not jpipe.__version__: importing jpipe imports jax

    parser = argparse.ArgumentParser(prog="jpipe", description="Pipeline-parallel training for JAX/Flax.")
    parser.add_argument("--version", action="version", version=f"jpipe {version('jpipe')}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_train(commands)
    _add_schedule(commands)
    _add_report(commands)
    _add_plan(commands)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def _check_config_values(train: argparse.ArgumentParser, values: dict[str, Any], where: str) -> dict[str, Any]:
    """Checks config-file ``values`` against the options of ``jpipe train``; returns them typed."""
    actions = {a.dest: a for a in train._actions if a.dest not in _NOT_CONFIG and a.option_strings}
    out = {}
    for key, value in values.items():
        action = actions.get(key)
        if action is None:
            valid = ", ".join(sorted(k.replace("_", "-") for k in actions))
            raise ValueError(f"{where}: unknown key {key!r}; valid keys: {valid}")
        option = action.option_strings[0]
        if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ValueError(f"{where}: {key} must be true or false (like {option}), got {value!r}")
        elif action.type is int:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{where}: {key} must be an integer (like {option}), got {value!r}")
        elif action.type is float:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{where}: {key} must be a number (like {option}), got {value!r}")
            value = float(value)
        elif not isinstance(value, str):
            raise ValueError(f"{where}: {key} must be a string (like {option}), got {value!r}")
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"{where}: {key} must be one of {sorted(action.choices)}, got {value!r}")
        out[key] = value
    return out


def _add_plan(commands) -> None:
    plan = commands.add_parser(
        "plan",
        help="rank pipeline plans for the built-in GPT",
        description="Profile the built-in byte-level GPT on this machine's devices and print jpipe.plan's "
                    "ranked candidates: pipe x data, micro-batches, schedule, partition, predicted step "
                    "time, bubble and memory per device. Without accelerators it plans for --devices "
                    "simulated CPU devices.",
        formatter_class=_DefaultsHelp,
    )
    add = plan.add_argument
    add("--devices", type=int, default=8, help="devices to plan for")
    _add_model_options(add)
    add("--profile-rounds", type=int, default=1, metavar="N",
        help="profiles taken back to back and averaged: steadier on a shared machine, N times the profiling")
    add("--measure", type=int, default=0, metavar="N",
        help="also time the N best predicted plans (those within 25%% of the best prediction) with "
             "train_step and choose the fastest measured (jpipe.partition.refine); 0: predict only")
    add("--top", type=int, default=20, help="candidates to print (0: all)")
    add("--explain", action="store_true",
        help="also print the terms of the three best predictions: compute, bubble, communication, "
             "contention, all-reduce, optimizer, step overhead (ms) and the memory terms (MiB)")
    plan.set_defaults(run=_plan, plan_parser=plan)


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    sub = args.plan_parser
    for name in ("devices", "batch_size", "seq_len", "layers", "d_model", "heads", "profile_rounds"):
        if getattr(args, name) < 1:
            sub.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.measure < 0:
        sub.error("--measure must be >= 0 (plans to time; 0: predict only)")
    if args.batch_size < args.devices:
        sub.error(f"--batch-size {args.batch_size} is smaller than --devices {args.devices}; every data "
                  f"replica needs at least one sequence")
    _force_host_devices(args.devices)  # before JAX creates its runtime
    try:
        devices = _pick_devices(args.devices)
        import jax.numpy as jnp

        import jpipe
        from jpipe import models

        model = models.gpt(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, num_heads=args.heads,
                           num_layers=args.layers, framework=args.framework, dtype=args.dtype)
        tokens = jnp.zeros((args.batch_size, args.seq_len), jnp.int32)
        from jpipe.run import device_memory_budget

        limit, _ = device_memory_budget(args.device_memory, devices)
        batch = {"tokens": tokens, "targets": tokens}
        choice = jpipe.plan(model, batch, devices=devices, memory_limit=limit, profile_rounds=args.profile_rounds,
                            progress=lambda line: print(line, file=sys.stderr, flush=True))  # stdout: the table
        if args.measure:
            from jpipe import partition

            choice = partition.refine(choice, model, batch, devices=devices, top=args.measure)
    except ValueError as e:
        sub.error(str(e))
    print(f"GPT: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, {args.seq_len} tokens; "
          f"batch {args.batch_size} on {len(devices)} {devices[0].platform} devices "
          f"({len(choice.candidates)} candidates, " + ("the measured ones first, fastest measured first, "
                                                       "then by prediction" if args.measure
                                                       else "the chosen first, then fastest first") + ")")
    print(choice.table(top=args.top or None))
    if args.explain:
        print(choice.explain(top=3))
    p = choice.plan
    print(f"chosen: pipe {p.pipe} x data {p.data}, {p.microbatches} micro-batches, {p.schedule}, "
          f"partition {','.join(map(str, p.partition)) if p.partition else 'even'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``jpipe`` command line with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before jpipe train took over the signal, or outside it
        print("jpipe: interrupted", file=sys.stderr)
        return INTERRUPTED


def _main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "train":
        args = _train_args(parser, argv, args)
        args.argv = argv
    return args.run(args, parser)


def _train_args(parser: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace) -> argparse.Namespace:
    """Re-parses ``jpipe train`` with the resumed run's options, then the --config file's, as defaults."""
    from jpipe import run

    train = _subparser(parser, "train")
    defaults: dict[str, Any] = {}
    try:
        if args.resume:
            run_dir = args.resume if isinstance(args.resume, str) else (args.out or run.latest_run())
            saved = os.path.join(run_dir, "config.toml")
            if not os.path.exists(saved):
                raise FileNotFoundError(f"cannot resume {run_dir!r}: it has no config.toml (not a jpipe "
                                        f"train run folder?)")
            defaults.update(_check_config_values(train, run.load_config(saved), saved))
            defaults["out"] = run_dir
        if args.config:
            defaults.update(_check_config_values(train, run.load_config(args.config), args.config))
    except (OSError, ValueError) as e:
        train.error(str(e))
    if not defaults:
        return args
    train.set_defaults(**defaults)
    new = parser.parse_args(argv)
    if args.resume:
        changed = [k for k in run.SHAPE_KEYS if k in defaults and getattr(new, k) != defaults[k]]
        if changed:
            train.error(f"cannot resume with other {', '.join('--' + k.replace('_', '-') for k in changed)} "
                        f"than the run had; they fix the model's parameters and data")
        new.out = defaults["out"]
    return new


def _force_host_devices(count: int) -> None:
    """Asks XLA for ``count`` host (CPU) devices unless the user's ``XLA_FLAGS`` already chose."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={count}".strip()


def _pick_devices(count: int):
    """``count`` devices: the default backend's if it has enough, else the host's."""
    import jax

    devices = jax.devices()
    if len(devices) >= count:
        return devices[:count]
    try:
        cpus = jax.devices("cpu")
    except RuntimeError:  # e.g. JAX_PLATFORMS names only an accelerator
        cpus = []
    if len(cpus) >= count:
        print(f"the {devices[0].platform} backend has {len(devices)} device(s), fewer than "
              f"pipe x data = {count}; running on {count} CPU devices instead")
        return cpus[:count]
    raise ValueError(
        f"pipe x data = {count} devices are needed but there are {len(devices)} "
        f"{devices[0].platform} and {len(cpus)} CPU devices (JAX started before {_DEVICE_FLAG} "
        f"could be set, or XLA_FLAGS sets it lower); lower --pipe/--data or set "
        f"XLA_FLAGS={_DEVICE_FLAG}={count}")


def _distributed_request(args: argparse.Namespace) -> dict[str, Any] | None:
    """``jax.distributed`` arguments the options ask for: ``None`` (one process), ``{}`` (detect) or explicit."""
    explicit = {"coordinator": args.coordinator, "num_processes": args.num_processes, "process_id": args.process_id}
    if all(v is None for v in explicit.values()):
        return {} if args.distributed else None
    if args.distributed:
        raise ValueError("give either --distributed (detect the run from the environment) or --coordinator "
                         "HOST:PORT --num-processes N --process-id I, not both")
    missing = [f"--{k.replace('_', '-')}" for k, v in explicit.items() if v is None]
    if missing:
        raise ValueError(f"a multi-process run needs --coordinator HOST:PORT --num-processes N --process-id I; "
                         f"missing {' '.join(missing)}")
    from jpipe import distributed

    distributed.parse_coordinator(args.coordinator)
    if args.num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {args.num_processes}")
    if not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id must be from 0 to --num-processes - 1 = {args.num_processes - 1}, "
                         f"got {args.process_id}")
    return explicit


# jpipe train's wait for every process to join: a misconfigured run (a process missing, a duplicate
# --process-id) then ends within a minute rather than JAX's default five
INIT_TIMEOUT_S = 45


def _pick_process_devices(pipe: int, data: int, across: str) -> list:
    """``pipe x data`` devices, the same number from every process, ordered so that ``across`` crosses them."""
    import jax

    from jpipe import distributed

    count = jax.process_count()
    per = pipe * data // count
    default = jax.devices()
    for platform in (None, "cpu"):
        try:
            devices = default if platform is None else jax.devices(platform)
        except RuntimeError:
            continue
        by_process: dict[int, list] = {}
        for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
            by_process.setdefault(d.process_index, []).append(d)
        if len(by_process) == count and all(len(v) >= per for v in by_process.values()):
            if platform is not None and devices[0].platform != default[0].platform:
                print(f"the {default[0].platform} backend has fewer than {per} device(s) in some process; "
                      f"running on CPU devices instead")
            chosen = [d for p in sorted(by_process) for d in by_process[p][:per]]
            return distributed.mesh_devices(pipe, data, across, devices=chosen)
    local = len(jax.local_devices())
    raise ValueError(
        f"pipe x data = {pipe * data} devices over {count} processes need {per} per process, but process "
        f"{jax.process_index()} has {local} {default[0].platform} device(s); lower --pipe/--data, or on CPU "
        f"set XLA_FLAGS={_DEVICE_FLAG}={per} in every process")


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from jpipe import run

    train = _subparser(parser, "train")
    config = run.config_from_mapping(vars(args))
    resume = bool(args.resume)
    try:
        if args.resume_step is not None and not resume:
            raise ValueError("--resume-step goes with --resume: jpipe train --resume RUN_DIR --resume-step N")
        config.check()
        request = _distributed_request(args)
    except ValueError as e:
        train.error(str(e))
    if request is None:
        _force_host_devices(config.num_devices_wanted())  # before JAX creates its runtime
        try:
            devices = _pick_devices(config.num_devices_wanted())
        except ValueError as e:
            train.error(str(e))
    else:
        devices = _join(train, args, config, request, resume)
    from jpipe.checkpoint import CheckpointError

    try:
        summary = run.train(config, resume=resume, resume_step=args.resume_step, overwrite=args.overwrite,
                            devices=devices, command=run.command_line(args.argv))
    except (ValueError, FileNotFoundError, FileExistsError, CheckpointError) as e:
        train.error(str(e))
    except run.Interrupted as e:
        print(f"jpipe train: {e}", file=sys.stderr)
        return INTERRUPTED
    if summary["interrupted"]:
        print(f"jpipe train: interrupted after step {summary['stopped_at']} (checkpoint saved); resume with: "
              f"jpipe train --resume {config.out or summary['out']}", file=sys.stderr)
        return INTERRUPTED
    return 0


def _join(train: argparse.ArgumentParser, args: argparse.Namespace, config, request: dict[str, Any],
          resume: bool) -> list:
    """Joins the ``jax.distributed`` run ``request`` describes; returns the run's devices over all processes."""
    from jpipe import distributed, run

    shape = run.mesh_shape(config, resume)
    if shape is None:
        train.error(run.MULTI_PROCESS_PLAN)
    pipe, data = shape
    expected = request.get("num_processes") or distributed.detected_num_processes()
    if expected is not None:
        if (pipe * data) % expected:
            train.error(f"pipe x data = {pipe} x {data} = {pipe * data} devices cannot be split evenly over "
                        f"{expected} processes; choose --pipe/--data with a product that is a multiple of "
                        f"{expected}")
        _force_host_devices((pipe * data) // expected)  # before JAX creates its runtime
    if request:  # say what it waits for: JAX is silent until every process has joined or time is up
        print(f"process {request['process_id']} of {request['num_processes']}: joining the run at "
              f"{request['coordinator']} (waiting up to {INIT_TIMEOUT_S} s for all "
              f"{request['num_processes']} processes)", file=sys.stderr, flush=True)
        # JAX ends a failed join from C++ with "another task died"; its status names the cause
        print("  if JAX then ends a process, the status it prints names the cause: 'ALREADY_EXISTS' or "
              "'different incarnation' means two processes were started with the same --process-id; "
              f"'DEADLINE_EXCEEDED' means not every process joined in time (one was not started, or cannot "
              f"reach {request['coordinator']})", file=sys.stderr, flush=True)
    try:
        info = distributed.initialize(**request, initialization_timeout=INIT_TIMEOUT_S)
    except (ValueError, RuntimeError) as e:
        train.error(str(e))
    if (pipe * data) % info.num_processes:
        train.error(f"pipe x data = {pipe} x {data} = {pipe * data} devices cannot be split evenly over "
                    f"{info.num_processes} processes; choose --pipe/--data with a product that is a multiple "
                    f"of {info.num_processes}")
    try:
        return _pick_process_devices(pipe, data, args.across)
    except ValueError as e:
        train.error(str(e))


def _schedule_show(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from jpipe import schedules

    options = {} if args.chunks is None else {"num_chunks": args.chunks}
    try:
        print(schedules.main_show(args.name, args.pipe, args.microbatches, args.png, fused=args.fused,
                                  **options))
    except (ValueError, TypeError, schedules.ScheduleError) as e:
        _subparser(_subparser(parser, "schedule"), "show").error(str(e))
    return 0


def _report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from jpipe import report

    try:
        path = report.write_report(args.run_dir)
    except (OSError, ValueError) as e:
        _subparser(parser, "report").error(str(e))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
