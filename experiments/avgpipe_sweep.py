"""AvgPipe sweep: per-device memory and step time for N = 1, 2, 4 co-located pipelines.

For each N, the N-pipeline step (``jpipe.averaging``, advance-forward schedule,
elastic averaging) on a small GPT with a fixed per-pipeline batch B: N
pipelines on each data replica's ``pipe`` devices, N x data pipelines in all,
each on its own B samples (global batch N x data x B, batches laid out
``[B, N x data, ...]``), coupled only through the elastic centre. Next to it the
synchronous DAPPLE step (1F1B) on the same global batch (data-parallel over
``data``: N x B samples per data replica) with the same number of
micro-batches. Reported: per-device temp memory of the
compiled step (exact, XLA), step time (the fastest of ``--repeats``: the
simulated devices share the machine's cores), samples per second.

Utilisation is predicted with the schedule simulator: every tick of the
lock-step executor costs ``f(N) = a + c * N`` per forward (``2 f`` per backward)
-- ``a`` the per-tick cost that does not grow with the work (dispatch, table
lookup, collectives, small-kernel inefficiency), ``c`` the cost of one
pipeline's micro-batch. ``a`` and ``c`` are fitted to the measured AvgPipe step
times through the simulated makespan ``K * f(N)``; the predicted utilisation is
``(1 - bubble) * c N / (a + c N)``: the share of device time spent on the
pipelines' own work. The table's bubble does not change with N (the N
pipelines share each tick); the extra pipelines fill the part of every busy
tick that one pipeline leaves idle.

    python experiments/avgpipe_sweep.py [--pipe 4 --data 2 --microbatches 4 --batch 16 --repeats 10]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import optax

import jpipe
from jpipe import averaging, models, schedules


def timed(step, state, batch, repeats):
    state, metrics = step(state, batch)  # compile and warm up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return min(times)  # the least disturbed run: 8 simulated devices share a few, busy cores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--pipe", type=int, default=4)
    add("--data", type=int, default=2)
    add("--microbatches", type=int, default=4)
    add("--batch", type=int, default=16, help="per-pipeline batch (sequences)")
    add("--seq-len", type=int, default=64)
    add("--d-model", type=int, default=64)
    add("--layers", type=int, default=8)
    add("--pipelines", type=int, nargs="+", default=[1, 2, 4])
    add("--repeats", type=int, default=10)
    args = parser.parse_args()

    model = models.gpt(vocab_size=256, seq_len=args.seq_len, d_model=args.d_model, num_heads=4,
                       num_layers=args.layers)
    rng = np.random.default_rng(0)

    def lm_batch(size):
        tokens = rng.integers(0, 256, size=(size, args.seq_len + 1), dtype=np.int32)
        return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}

    plan_avg = jpipe.Plan(args.pipe, args.data, args.microbatches, schedule="advance-forward")
    plan_sync = jpipe.Plan(args.pipe, args.data, args.microbatches, schedule="1f1b")
    sim = {name: schedules.simulate(schedules.get_schedule(name)(args.pipe, args.microbatches),
                                    schedules.Costs(forward=1.0, backward=2.0))
           for name in ("advance-forward", "1f1b")}
    print(f"pipe={args.pipe} data={args.data} M={args.microbatches} per-pipeline batch={args.batch} "
          f"(global batch N x data x {args.batch}) "
          f"GPT d={args.d_model} L={args.layers} T={args.seq_len}; devices: {jax.devices()[0].platform}")
    rows = []
    for n in args.pipelines:
        per_pipe = [lm_batch(args.batch) for _ in range(n * args.data)]  # N pipelines per data replica
        ens_batch = averaging.stack_batches(per_pipe)
        state = averaging.init(model, plan_avg, optax.adam(1e-3), ens_batch, pipelines=n,
                               rng=jax.random.key(0))
        mem_avg = jpipe.compiled_memory(state, ens_batch)
        t_avg = timed(jpipe.train_step, state, ens_batch, args.repeats)
        flat = jax.tree.map(lambda *xs: np.concatenate(xs), *per_pipe)
        sync = jpipe.init(model, plan_sync, optax.adam(1e-3), flat, rng=jax.random.key(0))
        mem_sync = jpipe.compiled_memory(sync, flat)
        t_sync = timed(jpipe.train_step, sync, flat, args.repeats)
        rows.append((n, mem_avg, t_avg, mem_sync, t_sync))
        print(f"  measured N={n}: avgpipe {t_avg * 1e3:.1f} ms, sync {t_sync * 1e3:.1f} ms", flush=True)

    # Fit f(N) = a + c N per tick through the simulated lock-step makespan K * f.
    k = sim["advance-forward"].makespan
    ns = np.array([r[0] for r in rows], float)
    times = np.array([r[2] for r in rows])
    coef, *_ = np.linalg.lstsq(np.stack([np.full_like(ns, k), k * ns], 1), times, rcond=None)
    a, c = (max(float(x), 0.0) for x in coef)
    bubble = sim["advance-forward"].bubble_fraction

    print()
    print(f"simulator: advance-forward {k:.0f} tick-units, bubble {bubble:.3f} (1F1B: "
          f"{sim['1f1b'].makespan:.0f}, {sim['1f1b'].bubble_fraction:.3f}); peak held "
          f"{sim['advance-forward'].peak_held.tolist()} vs 1F1B {sim['1f1b'].peak_held.tolist()}")
    print(f"fitted per-tick forward cost f(N) = {a * 1e3:.3f} ms + {c * 1e3:.3f} ms x N")
    print()
    print("| N | AvgPipe temp MB | AvgPipe step ms | samples/s | sync 1F1B temp MB | sync step ms | "
          "sync samples/s | predicted step ms | predicted utilisation |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, mem_avg, t_avg, mem_sync, t_sync in rows:
        pred = k * (a + c * n)
        util = (1 - bubble) * (c * n / (a + c * n) if a + c * n > 0 else 0.0)
        samples = n * args.data * args.batch
        print(f"| {n} | {mem_avg['temp'] / 1e6:.1f} | {t_avg * 1e3:.1f} | {samples / t_avg:.0f} | "
              f"{mem_sync['temp'] / 1e6:.1f} | {t_sync * 1e3:.1f} | {samples / t_sync:.0f} | "
              f"{pred * 1e3:.1f} | {util:.2f} |")


if __name__ == "__main__":
    main()
