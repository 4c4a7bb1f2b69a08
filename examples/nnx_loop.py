"""A plain Flax NNX training loop, pipelined with jpipe: 4 stages x 2 replicas on 8 devices.

Learns y = sin(3 x) . w on random inputs with a residual MLP; each step is one jitted
SPMD program running the 1F1B schedule over 4 micro-batches.

    python examples/nnx_loop.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # 8 CPU devices if no GPUs

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jpipe


class Embed(nnx.Module):  # pre: micro-batch -> hidden
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(16, 64, rngs=rngs)

    def __call__(self, mb):
        return self.linear(mb["x"])


class Block(nnx.Module):  # one of the repeated layers: hidden -> hidden
    def __init__(self, rngs: nnx.Rngs):
        self.norm, self.linear = nnx.LayerNorm(64, rngs=rngs), nnx.Linear(64, 64, rngs=rngs)

    def __call__(self, h):
        return h + jnp.tanh(self.linear(self.norm(h)))


model = jpipe.Staged(pre=Embed, layer=Block, post=lambda rngs: nnx.Linear(64, 1, rngs=rngs), num_layers=8,
                     loss=lambda out, mb: jnp.mean((out[:, 0] - mb["y"]) ** 2))
rng, w = np.random.default_rng(0), np.random.default_rng(1).normal(size=16).astype(np.float32)


def batch(size: int = 64) -> dict:
    x = rng.normal(size=(size, 16)).astype(np.float32)
    return {"x": x, "y": np.sin(3 * x) @ w / 4}


plan = jpipe.Plan(pipe=4, data=2, microbatches=4, schedule="1f1b")
state = jpipe.init(model, plan, optax.adam(3e-3), batch(), rng=jax.random.key(0), devices=jax.devices()[:8])
test = batch(256)
first = float(model.loss_value(jpipe.to_sequential(state), test))
for step in range(1, 101):
    state, metrics = jpipe.train_step(state, batch())
    if step % 25 == 0:
        print(f"step {step}: train loss {float(metrics['loss']):.4f}")
last = float(model.loss_value(jpipe.to_sequential(state), test))  # the plain model, on any device
print(f"test loss {first:.4f} -> {last:.4f}")
assert last < 0.5 * first, "the loop did not learn"
