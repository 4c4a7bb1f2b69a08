"""Overhead of the pipelined step against a plain jitted single-device step of the same model and batch.

Both run on 8 simulated CPU devices (they share this machine's cores), measured
side by side in one process. CPU wall time shows overheads, not GPU speed: the
pipelined step does the same arithmetic spread over 8 devices plus the
schedule's per-tick work (table lookup, branch, two ppermutes, buffer writes).

    python experiments/step_overhead.py [--pipe 4 --data 2 --microbatches 8 --repeats 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(__file__))

import jax
import optax
from memory_vs_microbatches import batch, model

import jpipe


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipe", type=int, default=4)
    parser.add_argument("--data", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--remat", action="store_true")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    m = model(args.layers)
    b = batch(args.microbatch_size * args.microbatches * args.data)
    optimizer = optax.sgd(1e-3)

    # The plain model: one jitted step on one device, same global batch.
    device = jax.devices()[0]
    params = jax.device_put(m.init_params(jax.random.key(0), b), device)
    opt_state = optimizer.init(params)
    single_batch = jax.device_put(b, device)

    @jax.jit
    def single_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(m.loss_value)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    plan = jpipe.Plan(args.pipe, args.data, args.microbatches, schedule=args.schedule, remat=args.remat)
    state = jpipe.init(m, plan, optimizer, b, rng=jax.random.key(0))
    table = state.table

    def run_single():
        nonlocal params, opt_state
        params, opt_state, loss = single_step(params, opt_state, single_batch)
        return loss

    def run_pipelined():
        nonlocal state
        state, metrics = jpipe.train_step(state, b)
        return metrics["loss"]

    for fn in (run_single, run_pipelined):  # compile and warm up
        for _ in range(3):
            fn()
    # Interleave the two so that machine noise hits both alike.
    single, piped = [], []
    for _ in range(args.repeats):
        single.append(median_time(run_single, 1))
        piped.append(median_time(run_pipelined, 1))
    t_single, t_piped = statistics.median(single), statistics.median(piped)
    print(f"model: {args.layers} layers; global batch {jax.tree.leaves(b)[0].shape[0]}; "
          f"plan pipe={args.pipe} data={args.data} M={args.microbatches} schedule={args.schedule} "
          f"remat={args.remat}; {table.num_ticks} ticks")
    print(f"single-device jitted step: {t_single * 1e3:8.2f} ms (median of {args.repeats})")
    print(f"pipelined jpipe step:      {t_piped * 1e3:8.2f} ms (median of {args.repeats})")
    print(f"ratio pipelined / single:  {t_piped / t_single:8.2f}x")


if __name__ == "__main__":
    main()
