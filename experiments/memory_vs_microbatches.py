"""Per-device compiled memory of one training step as the number of micro-batches grows.

At a fixed micro-batch size, GPipe holds every micro-batch's activations, so its
temp memory grows with M; 1F1B holds at most P - s, so its temp memory is flat.

    python experiments/memory_vs_microbatches.py [--pipe 4 --data 2 --microbatch-size 8]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import optax
from _bench import regression_batch, residual_mlp

import jpipe

WIDTH, SEQ = 128, 32


def model(num_layers: int) -> jpipe.Staged:
    return residual_mlp(num_layers, WIDTH)


def batch(size: int) -> dict:
    return regression_batch(size, SEQ)


def measure(schedule: str, microbatches: int, *, pipe: int, data: int, microbatch_size: int,
            remat: bool = False, num_layers: int = 8) -> dict:
    b = batch(microbatch_size * microbatches * data)
    plan = jpipe.Plan(pipe, data, microbatches, schedule=schedule, remat=remat)
    devices = jax.devices()[: pipe * data]
    state = jpipe.init(model(num_layers), plan, optax.sgd(0.1), b, rng=jax.random.key(0), devices=devices)
    start = time.perf_counter()
    mem = jpipe.compiled_memory(state, b)
    return {"schedule": schedule, "remat": remat, "M": microbatches, "compile_s": time.perf_counter() - start,
            "held": int(state.table.held_microbatches().max()), **mem}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipe", type=int, default=4)
    parser.add_argument("--data", type=int, default=2)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    args = parser.parse_args()
    print(f"pipe={args.pipe} data={args.data} micro-batch size={args.microbatch_size} "
          f"(activation of one micro-batch: {args.microbatch_size * SEQ * WIDTH * 4 / 1024:.0f} KiB)")
    print(f"{'schedule':>8} {'remat':>5} {'M':>4} {'held':>4} {'temp KiB':>10} {'argument KiB':>12} {'compile s':>9}")
    for schedule in ("gpipe", "1f1b", "1f1b-b"):
        for remat in (False, True):
            for m in args.microbatches:
                r = measure(schedule, m, pipe=args.pipe, data=args.data,
                            microbatch_size=args.microbatch_size, remat=remat)
                print(f"{r['schedule']:>8} {r['remat']!s:>5} {r['M']:>4} {r['held']:>4} "
                      f"{r['temp'] / 1024:>10.0f} {r['argument'] / 1024:>12.0f} {r['compile_s']:>9.2f}")


if __name__ == "__main__":
    main()
