"""Shared by the mesh-configuration experiments: build a GPT run, compile its step once, measure it.

One ahead-of-time compilation per configuration gives both the exact per-device memory
(XLA's memory analysis of the compiled step, as ``jpipe.compiled_memory``) and the callable
that is then timed, so nothing is compiled twice.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jpipe
from jpipe import data, models, schedules

MAX_CHARS = 1_000_000


def gpt(layers: int = 8, d_model: int = 64, heads: int = 4, seq_len: int = 64) -> jpipe.Staged:
    """The model zoo's GPT over bytes."""
    return models.gpt(data.VOCAB_SIZE, seq_len, d_model=d_model, num_heads=heads, num_layers=layers)


class _Features(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(8, width, rngs=rngs)

    def __call__(self, mb: dict) -> jax.Array:
        return self.linear(mb["x"])


class _MLPBlock(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + self.down(jax.nn.gelu(self.up(self.norm(h))))


def residual_mlp(num_layers: int, width: int) -> jpipe.Staged:
    """Pre-norm residual MLP blocks over ``(batch, seq, 8)`` features, a scalar per position, MSE loss:
    quick to compile, for the experiments that measure the executor's memory and schedules."""
    return jpipe.Staged(pre=lambda rngs: _Features(width, rngs), layer=lambda rngs: _MLPBlock(width, rngs),
                        post=lambda rngs: nnx.Linear(width, 1, rngs=rngs), num_layers=num_layers,
                        loss=lambda out, mb: jnp.mean((out[..., 0] - mb["y"]) ** 2))


def regression_batch(size: int, seq_len: int) -> dict:
    """``size`` random rows for :func:`residual_mlp` (the same for every call)."""
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(size, seq_len, 8)).astype(np.float32),
            "y": rng.normal(size=(size, seq_len)).astype(np.float32)}


def batches(batch_size: int, seq_len: int = 64, seed: int = 0, count: int = 16) -> list[dict]:
    """``count`` training batches of the standard-library corpus (the same for every configuration)."""
    corpus = data.load(MAX_CHARS)
    return list(corpus.batches(seq_len, batch_size, seed=seed, num_batches=count))


def measure(model: jpipe.Staged, plan: jpipe.Plan, train: list[dict], steps: int, lr: float = 3e-3) -> dict[str, Any]:
    """Compiles ``plan``'s step once and runs ``steps`` steps: memory, compile time, step time, losses."""
    devices = jax.devices()[: plan.num_devices]
    state = jpipe.init(model, plan, optax.adam(lr), train[0], rng=jax.random.key(0), devices=devices)
    start = time.perf_counter()
    compiled = jpipe.train_step.lower(state, train[0]).compile()
    compile_s = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    times, losses = [], []
    for i in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, train[i % len(train)])
        losses.append(float(metrics["loss"]))  # waits for the step
        times.append(time.perf_counter() - start)
    sim = schedules.simulate(plan.table(), schedules.Costs(forward=1.0, backward=1.0))
    return {
        "pipe": plan.pipe, "data": plan.data, "microbatches": plan.microbatches,
        "schedule": plan.schedule, "remat": plan.remat,
        "step_ms": 1e3 * statistics.median(times[1:] if len(times) > 1 else times),
        "compile_s": compile_s,
        "temp_mib": analysis.temp_size_in_bytes / 2**20,
        "argument_mib": analysis.argument_size_in_bytes / 2**20,
        "held_microbatches": int(plan.table().held_microbatches().max()),
        "simulated_bubble": sim.bubble_fraction,
        "loss_first": losses[0], "loss_last": losses[-1],
    }
