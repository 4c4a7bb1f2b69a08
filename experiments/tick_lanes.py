"""The price of lock-step: one action per tick vs one forward and one backward per tick.

Under lock-step SPMD execution a tick lasts as long as its slowest action. With
``B ~ 2F``, 1F1B's steady state has neighbours running F and B in the same tick,
so a one-action tick costs ``B`` and a micro-batch ``2B = 4F`` instead of ``3F``.
A fused tick (``jpipe.schedules.fuse_ticks``, ``jpipe.Plan(fuse_ticks=True)``)
runs a device's next forward and next backward together (two lanes, then the
tick's communication): fewer, fuller ticks, at the price of held micro-batches.

For P = 4 and each M, per schedule and tick kind this prints

- ticks, the simulated lock-step and asynchronous makespan with ``F = 1,
  B = 2`` (unsplit) or ``F = B = W = 1`` (zero-bubble), and peak held
  micro-batches per stage;
- the compiled step's per-device temp memory and the median step time of a GPT
  on 8 simulated CPU devices (pipe 4 x data 2); all configurations of one M are
  timed round-robin in the same run, and each is reported relative to one-lane
  1F1B (the first row of that M).

    python experiments/tick_lanes.py [--microbatches 8 16] [--steps 7] [--no-exec]
"""

from __future__ import annotations

import argparse
import statistics
import time

import _bench
import jax

import jpipe
from jpipe.schedules import Costs, fuse_ticks, get_schedule, simulate

SCHEDULES = ("1f1b", "1f1b-b", "gpipe", "zb-h1")


def simulated(table: jpipe.schedules.Table) -> dict:
    costs = Costs(1.0, 1.0, weight=1.0) if table.splits_backward else Costs(1.0, 2.0)
    lock, asy = simulate(table, costs), simulate(table, costs, mode="async")
    return {"ticks": table.num_ticks, "lock": lock.makespan, "async": asy.makespan,
            "held": lock.peak_held.tolist()}


def timed(plans: list[jpipe.Plan], model: jpipe.Staged, batch: dict, steps: int) -> list[dict]:
    """Compiles every plan, then times their steps alternately so that machine noise hits all alike."""
    import optax

    runs = []
    for plan in plans:
        devices = jax.devices()[: plan.num_devices]
        state = jpipe.init(model, plan, optax.sgd(1e-3), batch, rng=jax.random.key(0), devices=devices)
        compiled = jpipe.train_step.lower(state, batch).compile()
        runs.append({"state": state, "step": compiled, "times": [],
                     "temp": compiled.memory_analysis().temp_size_in_bytes})
    for i in range(steps + 1):
        for run in runs:
            start = time.perf_counter()
            run["state"], metrics = run["step"](run["state"], batch)
            jax.block_until_ready(metrics)
            if i:  # the first call warms up
                run["times"].append(time.perf_counter() - start)
    return [{"temp": r["temp"], "step_ms": 1e3 * statistics.median(r["times"])} for r in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipe", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=7, help="timed steps per configuration (median)")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--no-exec", action="store_true", help="simulate only")
    args = parser.parse_args()
    P, data = args.pipe, 2
    model = _bench.gpt(layers=8, d_model=64, seq_len=64)
    print(f"P={P}; simulated F=1, B=2 (zero-bubble: F=B=W=1), comm=0; executed: GPT 8 layers d64 seq 64 on "
          f"pipe {P} x data {data} simulated CPU devices, micro-batch {args.microbatch_size}")
    head = (f"{'schedule':<8} {'tick':<6} {'M':>3} {'ticks':>5} {'lock-step':>9} {'async':>5} {'held':<16} "
            f"{'temp MiB':>8} {'step ms':>8} {'vs 1f1b':>9}")
    print(head)
    print("-" * len(head))
    for M in args.microbatches:
        batch = _bench.batches(args.microbatch_size * M * data, seq_len=64, count=1)[0]
        rows, plans = [], []
        for name in args.schedules:
            table = get_schedule(name)(P, M)
            for fused in (False, True):
                sim = simulated(fuse_ticks(table) if fused else table)
                rows.append(f"{name:<8} {'fused' if fused else '1 lane':<6} {M:>3} {sim['ticks']:>5} "
                            f"{sim['lock']:>9.0f} {sim['async']:>5.0f} {sim['held']!s:<16}")
                plans.append(jpipe.Plan(P, data, M, schedule=name, fuse_ticks=fused))
        if args.no_exec:
            print("\n".join(rows), flush=True)
            continue
        results = timed(plans, model, batch, args.steps)
        base = results[0]["step_ms"]
        for row, res in zip(rows, results):
            print(row + f" {res['temp'] / 2**20:>8.1f} {res['step_ms']:>8.1f} {res['step_ms'] / base:>9.2f}")
        print(flush=True)

if __name__ == "__main__":
    main()
