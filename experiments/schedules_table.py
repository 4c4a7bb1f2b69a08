"""Every schedule at P = 4 and M in {8, 16}: simulated bubble and memory, compiled memory, step time.

Per schedule it prints

- the simulated bubble with ``F = B = W = 1`` per stage (an unsplit backward
  costs ``B + W = 2``; an interleaved chunk costs ``1 / v``), in lock-step
  (what jpipe's SPMD executor does) and asynchronously (an ideal MPMD runtime),
  and their makespan ratio, the price of lock-step;
- the peak number of micro-batches held per stage (per device: chunk-micro-batches
  for interleaved schedules);
- the compiled step's per-device temp bytes (``jpipe.compiled_memory``) and the
  median wall time of ``jpipe.train_step`` on 8 simulated CPU devices
  (pipe 4 x data 2). A schedule the executor rejects is skipped with the reason.

    python experiments/schedules_table.py [--microbatches 8 16] [--steps 5] [--no-exec]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import optax
from _bench import regression_batch, residual_mlp

import jpipe
from jpipe.schedules import Costs, get_schedule, simulate

WIDTH, SEQ, LAYERS = 64, 16, 8
# (label, registered name, generator options / Plan.virtual_stages)
SCHEDULES = [
    ("gpipe", "gpipe", {}),
    ("1f1b", "1f1b", {}),
    ("1f1b-b", "1f1b-b", {}),
    ("interleaved v=2", "interleaved-1f1b", {"num_chunks": 2}),
    ("zb-h1", "zb-h1", {}),
    ("zb-h2", "zb-h2", {}),
]


def model() -> jpipe.Staged:
    return residual_mlp(LAYERS, WIDTH)


def batch(size: int) -> dict:
    return regression_batch(size, SEQ)


def simulated(name: str, options: dict, P: int, M: int) -> dict:
    table = get_schedule(name)(P, M, **options)
    v = table.num_chunks
    costs = Costs(forward=1.0 / v, backward=1.0 / v, weight=1.0 / v)
    lock, asy = simulate(table, costs), simulate(table, costs, mode="async")
    return {"table": table, "lock": lock.bubble_fraction, "async": asy.bubble_fraction,
            "price": lock.makespan / asy.makespan, "held": lock.peak_held.tolist()}


def executed(name: str, options: dict, P: int, M: int, steps: int, microbatch_size: int) -> dict:
    data = 2
    b = batch(microbatch_size * M * data)
    plan = jpipe.Plan(P, data, M, schedule=name, virtual_stages=options.get("num_chunks", 1))
    state = jpipe.init(model(), plan, optax.sgd(0.01), b, rng=jax.random.key(0), devices=jax.devices()[: P * data])
    mem = jpipe.compiled_memory(state, b)
    times = []
    for i in range(steps + 1):  # the first call compiles
        start = time.perf_counter()
        state, metrics = jpipe.train_step(state, b)
        jax.block_until_ready(metrics)
        if i:
            times.append(time.perf_counter() - start)
    return {"temp": mem["temp"], "step_ms": 1e3 * statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipe", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per schedule (median reported)")
    parser.add_argument("--no-exec", action="store_true", help="simulate only; skip compiling and running")
    args = parser.parse_args()
    P = args.pipe
    print(f"P={P}; simulated with F=B=W=1 per stage (unsplit backward 2, interleaved chunks 1/v), comm=0; "
          f"executed on pipe={P} x data=2 simulated CPU devices, {LAYERS} layers of width {WIDTH}, "
          f"micro-batch {args.microbatch_size}x{SEQ}")
    head = (f"{'schedule':<16} {'M':>3} {'bubble lock':>11} {'bubble async':>12} {'lock/async':>10} "
            f"{'held per stage':<18} {'temp KiB':>9} {'step ms':>8}")
    print(head)
    print("-" * len(head))
    for M in args.microbatches:
        for label, name, options in SCHEDULES:
            sim = simulated(name, options, P, M)
            row = (f"{label:<16} {M:>3} {sim['lock']:>11.3f} {sim['async']:>12.3f} {sim['price']:>10.3f} "
                   f"{sim['held']!s:<18}")
            if args.no_exec:
                print(row)
                continue
            try:
                ex = executed(name, options, P, M, args.steps, args.microbatch_size)
            except Exception as e:  # noqa: BLE001 -- the executor may not run every table yet
                print(row + f" skipped: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                continue
            print(row + f" {ex['temp'] / 1024:>9.0f} {ex['step_ms']:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
