"""The compared architectures as :class:`jpipe.Staged` models (Flax NNX), dtype-preserving.

They mirror :mod:`jpipe.models` (``mlp`` and ``gpt``) but keep every
computation in the model's dtype -- ``jpipe.models`` takes the attention
softmax and the loss in float32, which would cap a float64 comparison at
float32 precision. :mod:`.torch_models` builds the same computations in torch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jpipe
from experiments.compare_torch.spec import ModelSpec

MASK_VALUE = -1e30  # added to masked attention scores; the same constant on the torch side


def _dtype(spec: ModelSpec) -> jnp.dtype:
    dt = jnp.dtype(spec.dtype)
    if dt == jnp.float64 and not jax.config.jax_enable_x64:
        raise RuntimeError(
            "a float64 model needs jax.config.update('jax_enable_x64', True) before it is built; "
            "without it JAX silently makes float32 parameters")
    return dt


def _linear(i: int, o: int, dt: jnp.dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(i, o, dtype=dt, param_dtype=dt, rngs=rngs)


def _layer_norm(d: int, spec: ModelSpec, dt: jnp.dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(d, epsilon=spec.ln_eps, dtype=dt, param_dtype=dt, use_fast_variance=False,
                         rngs=rngs)


class MlpInput(nnx.Module):
    """``Linear(mb["x"])``."""

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs) -> None:
        self.linear = _linear(spec.in_dim, spec.hidden, _dtype(spec), rngs)

    def __call__(self, mb: dict[str, jax.Array]) -> jax.Array:
        return self.linear(mb["x"])


class MlpLayer(nnx.Module):
    """``h + tanh(Linear(h))``."""

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs) -> None:
        self.linear = _linear(spec.hidden, spec.hidden, _dtype(spec), rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + jnp.tanh(self.linear(h))


class Embed(nnx.Module):
    """Token plus learned position embedding of ``mb["tokens"]``."""

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs) -> None:
        dt = _dtype(spec)
        self.tokens = nnx.Embed(spec.vocab, spec.hidden, dtype=dt, param_dtype=dt, rngs=rngs)
        self.positions = nnx.Param(0.02 * jax.random.normal(rngs.params(), (spec.seq_len, spec.hidden), dt))

    def __call__(self, mb: dict[str, jax.Array]) -> jax.Array:
        tokens = mb["tokens"]
        return self.tokens(tokens) + self.positions[...][: tokens.shape[1]]


def causal_attention(qkv: jax.Array, heads: int) -> jax.Array:
    """Causal multi-head self-attention on fused ``qkv`` ``[b, T, 3d]`` -> ``[b, T, d]``, in qkv's dtype."""
    b, t, three_d = qkv.shape
    d = three_d // 3
    hd = d // heads
    q, k, v = (a.reshape(b, t, heads, hd) for a in jnp.split(qkv, 3, axis=-1))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), scores, MASK_VALUE)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(b, t, d)


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + out(gelu(fc(ln2(x))))``."""

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs) -> None:
        dt, d = _dtype(spec), spec.hidden
        self.heads = spec.heads
        self.ln1 = _layer_norm(d, spec, dt, rngs)
        self.qkv = _linear(d, 3 * d, dt, rngs)
        self.proj = _linear(d, d, dt, rngs)
        self.ln2 = _layer_norm(d, spec, dt, rngs)
        self.fc = _linear(d, spec.mlp_ratio * d, dt, rngs)
        self.out = _linear(spec.mlp_ratio * d, d, dt, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.proj(causal_attention(self.qkv(self.ln1(x)), self.heads))
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x)), approximate=True))


class Head(nnx.Module):
    """Final LayerNorm and vocabulary projection."""

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs) -> None:
        dt = _dtype(spec)
        self.ln = _layer_norm(spec.hidden, spec, dt, rngs)
        self.logits = _linear(spec.hidden, spec.vocab, dt, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.logits(self.ln(x))


def _mse(out: jax.Array, mb: dict[str, jax.Array]) -> jax.Array:
    return jnp.mean((out - mb["y"]) ** 2)


def _cross_entropy(logits: jax.Array, mb: dict[str, jax.Array]) -> jax.Array:
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, mb["targets"]))


def build(spec: ModelSpec) -> jpipe.Staged:
    """The :class:`jpipe.Staged` model for ``spec``.

    >>> import jax
    >>> model = build(ModelSpec("mlp", num_layers=2, dtype="float32"))
    >>> params = model.init_params(jax.random.key(0), {"x": jnp.ones((2, 16)), "y": jnp.ones((2, 4))})
    >>> sorted(params["layers"][0]["linear"])
    ['bias', 'kernel']
    """
    if spec.arch == "mlp":
        return jpipe.Staged(
            pre=lambda rngs: MlpInput(spec, rngs=rngs), layer=lambda rngs: MlpLayer(spec, rngs=rngs),
            post=lambda rngs: _linear(spec.hidden, spec.out_dim, _dtype(spec), rngs),
            num_layers=spec.num_layers, loss=_mse)
    return jpipe.Staged(
        pre=lambda rngs: Embed(spec, rngs=rngs), layer=lambda rngs: Block(spec, rngs=rngs),
        post=lambda rngs: Head(spec, rngs=rngs), num_layers=spec.num_layers, loss=_cross_entropy)
