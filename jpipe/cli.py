"""Command line: ``jpipe train`` (also ``python -m jpipe train``).

``jpipe train`` trains a small byte-level GPT on the Python standard library's
own source (:mod:`jpipe.data`) with a pipeline-parallel plan (by default 4
stages x 2 replicas, 4 micro-batches, 1F1B), prints the training loss as it
goes and ends with the loss on held-out files, computed by the plain
sequential model on one device.

Without accelerators it runs on ``pipe x data`` simulated CPU devices: unless
``XLA_FLAGS`` already sets ``--xla_force_host_platform_device_count``, the
command adds it before JAX starts its runtime. (The flag only concerns the
host platform; an accelerator, where there is one with enough devices, is
still used.) This module therefore does not use JAX at import time.

>>> from jpipe.cli import build_parser
>>> args = build_parser().parse_args(["train", "--steps", "10"])
>>> args.steps, args.pipe, args.data, args.microbatches, args.schedule
(10, 4, 2, 4, '1f1b')
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def build_parser() -> argparse.ArgumentParser:
    """The ``jpipe`` argument parser."""
    parser = argparse.ArgumentParser(prog="jpipe", description="Pipeline-parallel training for JAX/Flax.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = commands.add_parser(
        "train",
        help="train a small GPT on the Python standard library's source",
        description="Train a small byte-level GPT on the Python standard library's own source code "
                    "with a pipeline-parallel plan, printing the training loss and, at the end, the "
                    "loss on held-out files.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = train.add_argument
    add("--steps", type=int, default=300, help="training steps")
    add("--batch-size", type=int, default=32, help="sequences per step (global batch)")
    add("--seq-len", type=int, default=64, help="tokens (bytes) per sequence")
    add("--pipe", type=int, default=4, help="pipeline stages")
    add("--data", type=int, default=2, help="data-parallel replicas")
    add("--microbatches", type=int, default=4, help="micro-batches per step")
    add("--schedule", default="1f1b", help="pipeline schedule: gpipe, 1f1b, 1f1b-b")
    add("--lr", type=float, default=3e-3, help="Adam learning rate")
    add("--layers", type=int, default=4, help="transformer blocks")
    add("--d-model", type=int, default=64, help="model width")
    add("--heads", type=int, default=4, help="attention heads")
    add("--framework", choices=("nnx", "linen"), default="nnx", help="Flax API of the model")
    add("--seed", type=int, default=0, help="seed of the initial parameters and of the batches")
    add("--log-every", type=int, default=25, help="print the mean training loss every this many steps")
    add("--eval-batches", type=int, default=8, help="held-out batches (of --batch-size) to evaluate")
    add("--max-chars", type=int, default=3_000_000, help="bytes of standard-library source to use")
    train.set_defaults(run=_train)
    _add_plan(commands)
    return parser


def _add_plan(commands) -> None:
    plan = commands.add_parser(
        "plan",
        help="rank pipeline plans for the built-in GPT",
        description="Profile the built-in byte-level GPT on this machine's devices and print jpipe.plan's "
                    "ranked candidates: pipe x data, micro-batches, schedule, partition, predicted step "
                    "time, bubble and memory per device. Without accelerators it plans for --devices "
                    "simulated CPU devices.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = plan.add_argument
    add("--devices", type=int, default=8, help="devices to plan for")
    add("--batch-size", type=int, default=32, help="sequences per step (global batch)")
    add("--seq-len", type=int, default=64, help="tokens (bytes) per sequence")
    add("--layers", type=int, default=8, help="transformer blocks")
    add("--d-model", type=int, default=64, help="model width")
    add("--heads", type=int, default=4, help="attention heads")
    add("--memory-limit", type=float, default=None, metavar="MIB",
        help="MiB per device (default: what the device reports, else no limit)")
    add("--top", type=int, default=20, help="candidates to print (0: all)")
    plan.set_defaults(run=_plan, plan_parser=plan)


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    sub = args.plan_parser
    for name in ("devices", "batch_size", "seq_len", "layers", "d_model", "heads"):
        if getattr(args, name) < 1:
            sub.error(f"--{name.replace('_', '-')} must be >= 1")
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
                           num_layers=args.layers)
        tokens = jnp.zeros((args.batch_size, args.seq_len), jnp.int32)
        limit = None if args.memory_limit is None else args.memory_limit * 2**20
        choice = jpipe.plan(model, {"tokens": tokens, "targets": tokens}, devices=devices, memory_limit=limit)
    except ValueError as e:
        sub.error(str(e))
    print(f"GPT: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, {args.seq_len} tokens; "
          f"batch {args.batch_size} on {len(devices)} {devices[0].platform} devices "
          f"({len(choice.candidates)} candidates, fastest that fits first)")
    print(choice.table(top=args.top or None))
    p = choice.plan
    print(f"chosen: pipe {p.pipe} x data {p.data}, {p.microbatches} micro-batches, {p.schedule}, "
          f"partition {','.join(map(str, p.partition)) if p.partition else 'even'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``jpipe`` command line with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.run(args, parser)


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


def _check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("steps", "batch_size", "seq_len", "pipe", "data", "microbatches", "layers", "d_model",
                 "heads", "log_every", "eval_batches", "max_chars"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    per = args.data * args.microbatches
    if args.batch_size % per:
        parser.error(f"--batch-size {args.batch_size} must be a multiple of data x microbatches = "
                     f"{args.data} x {args.microbatches} = {per}")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    if args.pipe > args.layers:
        parser.error(f"--pipe {args.pipe} is more than --layers {args.layers}; every stage needs a layer")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _check_args(args, parser)
    num_devices = args.pipe * args.data
    _force_host_devices(num_devices)  # before JAX creates its runtime

    import jax
    import optax

    import jpipe
    from jpipe import data, models

    try:
        plan = jpipe.Plan(pipe=args.pipe, data=args.data, microbatches=args.microbatches,
                          schedule=args.schedule)
        devices = _pick_devices(num_devices)
        corpus = data.load(args.max_chars)
    except ValueError as e:
        parser.error(str(e))
    model = models.gpt(corpus.vocab_size, args.seq_len, d_model=args.d_model, num_heads=args.heads,
                       num_layers=args.layers, framework=args.framework)
    train_batches = corpus.batches(args.seq_len, args.batch_size, seed=args.seed, split="train")
    eval_batches = list(corpus.batches(args.seq_len, args.batch_size, seed=args.seed + 1,
                                       split="heldout", num_batches=args.eval_batches))

    print(f"corpus: {len(corpus.train):,} train / {len(corpus.heldout):,} held-out bytes of Python "
          f"standard-library source ({len(corpus.train_files)} / {len(corpus.heldout_files)} files)")
    print(f"model: GPT ({args.framework}), {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
          f"seq_len {args.seq_len}, byte vocabulary ({corpus.vocab_size})")
    print(f"plan: pipe {args.pipe} x data {args.data} on {num_devices} {devices[0].platform} devices, "
          f"{args.microbatches} micro-batches, schedule {args.schedule!r}; batch {args.batch_size}, "
          f"adam lr {args.lr:g}")

    start = time.perf_counter()
    state = jpipe.init(model, plan, optax.adam(args.lr), next(train_batches),
                       rng=jax.random.key(args.seed), devices=devices)
    num_params = sum(x.size for x in jax.tree.leaves(jpipe.to_sequential(state)))
    print(f"parameters: {num_params:,}")

    eval_device = devices[0]
    loss_fn = jax.jit(model.loss_value)

    def heldout_loss() -> float:
        params = jax.device_put(jpipe.to_sequential(state), eval_device)
        losses = [loss_fn(params, jax.device_put(b, eval_device)) for b in eval_batches]
        return float(sum(float(x) for x in losses) / len(losses))

    initial_heldout = heldout_loss()
    print(f"held-out loss at initialisation: {initial_heldout:.4f} (uniform: log 256 = {math.log(256):.4f})")

    tokens_per_step = args.batch_size * args.seq_len
    window: list = []
    first_loss = last_loss = float("nan")
    tick = time.perf_counter()
    for step in range(1, args.steps + 1):
        state, metrics = jpipe.train_step(state, next(train_batches))
        window.append(metrics["loss"])
        if step == 1:
            first_loss = float(metrics["loss"])
            print(f"step {step:>5}  loss {first_loss:.4f}  (includes compilation: "
                  f"{time.perf_counter() - tick:.1f}s)", flush=True)
            window, tick = [], time.perf_counter()
        elif step % args.log_every == 0 or step == args.steps:
            last_loss = float(sum(float(x) for x in window) / len(window))
            elapsed = time.perf_counter() - tick
            print(f"step {step:>5}  loss {last_loss:.4f}  "
                  f"{len(window) * tokens_per_step / elapsed:,.0f} tokens/s", flush=True)
            window, tick = [], time.perf_counter()
    if args.steps == 1:
        last_loss = first_loss

    final_heldout = heldout_loss()
    total = time.perf_counter() - start
    print(f"held-out loss: {final_heldout:.4f} (was {initial_heldout:.4f}); "
          f"train loss {first_loss:.4f} -> {last_loss:.4f}; {args.steps} steps in {total:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
