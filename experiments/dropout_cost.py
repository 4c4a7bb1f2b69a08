"""What dropout costs a pipelined step: the zoo GPT with and without it, side by side.

A stochastic part runs sample by sample (``jax.vmap`` over the micro-batch, each
sample with its own key) so that masks do not depend on the mesh or the schedule;
models without stochastic layers run as before. This measures the ratio of median
step times (and the compiled temp bytes) on one plan, alternating the two models.

    python experiments/dropout_cost.py [--steps 20] [--pipe 2 --data 4 --microbatches 4]

On simulated CPU devices the ratio shows overheads, not accelerator speed.
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
from jpipe import models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pipe", type=int, default=2)
    parser.add_argument("--data", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    args = parser.parse_args()
    r = np.random.default_rng(0)
    batch = {"tokens": r.integers(0, 256, (32, 64)).astype(np.int32),
             "targets": r.integers(0, 256, (32, 64)).astype(np.int32)}
    plan = jpipe.Plan(args.pipe, args.data, args.microbatches)
    devices = jax.devices()[:args.pipe * args.data]
    states = {}
    for rate in (0.0, args.dropout):
        model = models.gpt(256, 64, d_model=64, num_heads=4, num_layers=4, dropout=rate)
        states[rate] = jpipe.init(model, plan, optax.adam(1e-3), batch, rng=jax.random.key(0),
                                  devices=devices)
        temp = jpipe.compiled_memory(states[rate], batch)["temp"]
        print(f"dropout {rate}: compiled temp {temp / 2**20:.2f} MiB per device")
    times: dict[float, list[float]] = {rate: [] for rate in states}
    for step in range(args.steps + 2):  # two warm-up steps each, then alternate
        for rate, state in list(states.items()):
            start = time.perf_counter()
            states[rate], metrics = jpipe.train_step(state, batch)
            jax.block_until_ready(metrics["loss"])
            if step >= 2:
                times[rate].append(time.perf_counter() - start)
    base, drop = (float(np.median(t)) for t in times.values())
    print(f"plan {plan.pipe}x{plan.data} M={plan.microbatches}: median step {base * 1e3:.1f} ms without "
          f"dropout, {drop * 1e3:.1f} ms with dropout {args.dropout}: {drop / base:.2f}x")


if __name__ == "__main__":
    main()
