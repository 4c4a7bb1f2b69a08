"""A plain Flax Linen training loop, pipelined with jpipe: 2 stages x 4 replicas on 8 devices.

Predicts the next byte of Python source (jpipe's built-in corpus, the standard library's
own files) from the previous 8 with a residual MLP, under the GPipe schedule.

    python examples/linen_loop.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # 8 CPU devices if no GPUs

import jax
import optax
from flax import linen as nn

import jpipe
from jpipe import data

CONTEXT, WIDTH = 8, 128


class Embed(nn.Module):  # pre: the last CONTEXT bytes -> one hidden vector
    @nn.compact
    def __call__(self, mb):
        return nn.Dense(WIDTH)(nn.Embed(256, 32)(mb["tokens"][:, -CONTEXT:]).reshape(-1, CONTEXT * 32))


class Block(nn.Module):  # one of the repeated layers
    @nn.compact
    def __call__(self, h):
        return h + nn.Dense(WIDTH)(nn.gelu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(h))))


def loss(logits, mb):  # cross-entropy of the byte after the context
    return optax.softmax_cross_entropy_with_integer_labels(logits, mb["targets"][:, -1]).mean()


model = jpipe.Staged(pre=Embed(), layer=Block(), post=nn.Dense(256), num_layers=4, loss=loss)
corpus = data.load(max_chars=1_000_000)
train, test = corpus.batches(CONTEXT, 64, seed=0), next(corpus.batches(CONTEXT, 512, seed=1, split="heldout"))
plan = jpipe.Plan(pipe=2, data=4, microbatches=2, schedule="gpipe")
state = jpipe.init(model, plan, optax.adam(3e-3), next(train), rng=jax.random.key(0), devices=jax.devices()[:8])
first = float(model.loss_value(jpipe.to_sequential(state), test))
for step in range(1, 121):
    state, metrics = jpipe.train_step(state, next(train))
    if step % 40 == 0:
        print(f"step {step}: train loss {float(metrics['loss']):.3f}")
last = float(model.loss_value(jpipe.to_sequential(state), test))  # the plain model, on any device
print(f"held-out loss {first:.3f} -> {last:.3f} nats/byte (unigram baseline {corpus.unigram_loss():.3f})")
assert last < corpus.unigram_loss(), "the loop did not learn more than byte frequencies"
