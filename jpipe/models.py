"""The model zoo: small, ready-made :class:`jpipe.Staged` models in Flax NNX and Flax Linen.

* :func:`gpt` -- a decoder-only transformer language model (token + position
  embedding, pre-norm blocks of causal self-attention and a GELU MLP, final
  LayerNorm and vocabulary head), trained with next-token cross-entropy.
* :func:`mlp` -- a residual tanh MLP for regression, trained with mean squared error.

Each takes ``framework="nnx"`` (the default) or ``framework="linen"``; the two
build the same architecture with the same initialisers, but their parameter
trees are named differently. Attention is written by hand with ``jnp`` so that
it is the same computation in both frameworks. :func:`gpt` takes a compute
``dtype`` (e.g. ``jnp.bfloat16`` for mixed precision: float32 parameters and
optimizer state, bfloat16 activations between stages, float32 softmax and loss).

A model pipelined over one device (on more devices, raise ``pipe`` and
``data`` and pass that many devices):

>>> import jax, jax.numpy as jnp, optax, jpipe
>>> from jpipe import models
>>> model = models.mlp(in_dim=3, hidden=8, out_dim=2, num_layers=2)
>>> batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros((4, 2))}
>>> plan = jpipe.Plan(pipe=1, data=1, microbatches=2)
>>> state = jpipe.init(model, plan, optax.sgd(0.1), batch, rng=jax.random.key(0),
...                    devices=jax.devices()[:1])
>>> state, metrics = jpipe.train_step(state, batch)
>>> metrics["loss"].shape
()
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

from jpipe._model import Staged

__all__ = ["gpt", "mlp"]

FRAMEWORKS = ("nnx", "linen")

# The same initialisers in both frameworks (GPT-2 style embeddings and head; Flax defaults elsewhere).
_EMBED_INIT = jax.nn.initializers.normal(stddev=0.02)
_KERNEL_INIT = jax.nn.initializers.lecun_normal()
_HEAD_INIT = jax.nn.initializers.normal(stddev=0.02)  # initial loss ~ log(vocab_size)
_BIAS_INIT = jax.nn.initializers.zeros
_LN_EPS = 1e-5


def _check_framework(framework: str) -> str:
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
    return framework


def _compute_dtype(dtype: Any) -> Any:
    """``dtype`` (a floating-point dtype, its type or its name) as a NumPy dtype."""
    try:
        d = None if dtype is None else jnp.dtype(dtype)
    except TypeError:
        d = None
    if d is None or not jnp.issubdtype(d, jnp.floating):
        raise ValueError(f"dtype must be a floating-point dtype such as jnp.bfloat16, got {dtype!r}")
    return d


def _positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


# --------------------------------------------------------------------------------------------
# Shared pure pieces
# --------------------------------------------------------------------------------------------


def causal_attention(qkv: jax.Array, num_heads: int) -> jax.Array:
    """Causal multi-head self-attention on fused projections ``qkv`` ``[b, T, 3 * d]`` -> ``[b, T, d]``.

    The softmax is taken in float32 whatever the input dtype.

    >>> import jax.numpy as jnp
    >>> causal_attention(jnp.ones((2, 5, 3 * 8)), num_heads=2).shape
    (2, 5, 8)
    """
    b, t, three_d = qkv.shape
    d = three_d // 3
    if three_d != 3 * d or d % num_heads:
        raise ValueError(f"qkv has {three_d} features; expected 3 * d_model with d_model divisible "
                         f"by num_heads={num_heads}")
    head_dim = d // num_heads
    q, k, v = (a.reshape(b, t, num_heads, head_dim) for a in jnp.split(qkv, 3, axis=-1))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return out.reshape(b, t, d)


def _lm_loss(logits: jax.Array, microbatch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy of ``logits`` ``[b, T, V]`` against ``microbatch["targets"]``."""
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), microbatch["targets"])
    return jnp.mean(losses)


def _mse_loss(out: jax.Array, microbatch: dict[str, jax.Array]) -> jax.Array:
    y = jnp.reshape(microbatch["y"], out.shape)
    return jnp.mean((out.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)


def _check_tokens(tokens: jax.Array, seq_len: int) -> None:
    if tokens.ndim != 2:
        raise ValueError(f'mb["tokens"] must be int [batch, seq_len], got shape {tokens.shape}')
    if tokens.shape[1] > seq_len:
        raise ValueError(f'mb["tokens"] has {tokens.shape[1]} positions but the model was built '
                         f"with seq_len={seq_len}")


def _check_token_range(batch: dict, vocab_size: int) -> None:
    """On the host: ``tokens`` and ``targets`` must be ids in ``[0, vocab_size)`` (out of range, the
    embedding would clamp them and the cross-entropy read garbage, without a word)."""
    for key in ("tokens", "targets"):
        if not isinstance(batch, dict) or key not in batch:
            continue
        leaf = batch[key]
        pieces = [s.data for s in leaf.addressable_shards] if isinstance(leaf, jax.Array) else [leaf]
        for piece in pieces:
            piece = np.asarray(piece)
            if piece.size and (piece.min() < 0 or piece.max() >= vocab_size):
                bad = piece.min() if piece.min() < 0 else piece.max()
                raise ValueError(f'batch["{key}"] holds {int(bad)}, outside the vocabulary [0, {vocab_size}); '
                                 f"token ids and targets must be in range (no -1 padding: mask the loss instead)")


# --------------------------------------------------------------------------------------------
# GPT, Flax NNX
# --------------------------------------------------------------------------------------------


class NNXEmbed(nnx.Module):
    """Token plus learned position embedding of ``mb["tokens"]``."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, *, dtype: Any = jnp.float32,
                 dropout: float = 0.0, rngs: nnx.Rngs):
        self.seq_len = seq_len
        self.dtype = dtype
        self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None
        self.tokens = nnx.Embed(vocab_size, d_model, embedding_init=_EMBED_INIT, dtype=dtype,
                                param_dtype=jnp.float32, rngs=rngs)
        self.positions = nnx.Param(_EMBED_INIT(rngs.params(), (seq_len, d_model), jnp.float32))

    def __call__(self, mb: dict[str, jax.Array]) -> jax.Array:
        tokens = mb["tokens"]
        _check_tokens(tokens, self.seq_len)
        h = self.tokens(tokens) + self.positions[: tokens.shape[1]].astype(self.dtype)
        return h if self.drop is None else self.drop(h)


class NNXBlock(nnx.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, d_model: int, num_heads: int, mlp_ratio: int, *, dtype: Any = jnp.float32,
                 dropout: float = 0.0, rngs: nnx.Rngs):
        def linear(i: int, o: int) -> nnx.Linear:
            return nnx.Linear(i, o, kernel_init=_KERNEL_INIT, bias_init=_BIAS_INIT, dtype=dtype,
                              param_dtype=jnp.float32, rngs=rngs)

        self.num_heads = num_heads
        self.ln1 = nnx.LayerNorm(d_model, epsilon=_LN_EPS, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.qkv = linear(d_model, 3 * d_model)
        self.proj = linear(d_model, d_model)
        self.ln2 = nnx.LayerNorm(d_model, epsilon=_LN_EPS, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.fc = linear(d_model, mlp_ratio * d_model)
        self.out = linear(mlp_ratio * d_model, d_model)
        self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None  # on each residual branch

    def __call__(self, x: jax.Array) -> jax.Array:
        branch = (lambda h: h) if self.drop is None else self.drop
        x = x + branch(self.proj(causal_attention(self.qkv(self.ln1(x)), self.num_heads)))
        return x + branch(self.out(jax.nn.gelu(self.fc(self.ln2(x)))))


class NNXHead(nnx.Module):
    """Final LayerNorm and vocabulary projection."""

    def __init__(self, d_model: int, vocab_size: int, *, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(d_model, epsilon=_LN_EPS, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.logits = nnx.Linear(d_model, vocab_size, kernel_init=_HEAD_INIT, bias_init=_BIAS_INIT,
                                 dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.logits(self.ln(x))


# --------------------------------------------------------------------------------------------
# GPT, Flax Linen
# --------------------------------------------------------------------------------------------


class LinenEmbed(nn.Module):
    """Token plus learned position embedding of ``mb["tokens"]``."""

    vocab_size: int
    seq_len: int
    d_model: int
    dtype: Any = jnp.float32
    dropout: float = 0.0

    @nn.compact
    def __call__(self, mb: dict[str, jax.Array], deterministic: bool = True) -> jax.Array:
        tokens = mb["tokens"]
        _check_tokens(tokens, self.seq_len)
        tok = nn.Embed(self.vocab_size, self.d_model, embedding_init=_EMBED_INIT, dtype=self.dtype,
                       param_dtype=jnp.float32, name="tokens")
        positions = self.param("positions", _EMBED_INIT, (self.seq_len, self.d_model), jnp.float32)
        h = tok(tokens) + positions[: tokens.shape[1]].astype(self.dtype)
        return nn.Dropout(self.dropout)(h, deterministic=deterministic) if self.dropout else h


class LinenBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    d_model: int
    num_heads: int
    mlp_ratio: int
    dtype: Any = jnp.float32
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        def dense(features: int, name: str) -> nn.Dense:
            return nn.Dense(features, kernel_init=_KERNEL_INIT, bias_init=_BIAS_INIT, dtype=self.dtype,
                            param_dtype=jnp.float32, name=name)

        def layer_norm(name: str) -> nn.LayerNorm:
            return nn.LayerNorm(epsilon=_LN_EPS, dtype=self.dtype, param_dtype=jnp.float32, name=name)

        def branch(h: jax.Array) -> jax.Array:  # dropout on each residual branch
            return nn.Dropout(self.dropout)(h, deterministic=deterministic) if self.dropout else h

        h = layer_norm("ln1")(x)
        attention = causal_attention(dense(3 * self.d_model, "qkv")(h), self.num_heads)
        x = x + branch(dense(self.d_model, "proj")(attention))
        h = layer_norm("ln2")(x)
        mlp = dense(self.d_model, "out")(jax.nn.gelu(dense(self.mlp_ratio * self.d_model, "fc")(h)))
        return x + branch(mlp)


class LinenHead(nn.Module):
    """Final LayerNorm and vocabulary projection."""

    vocab_size: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.LayerNorm(epsilon=_LN_EPS, dtype=self.dtype, param_dtype=jnp.float32, name="ln")(x)
        return nn.Dense(self.vocab_size, kernel_init=_HEAD_INIT, bias_init=_BIAS_INIT, dtype=self.dtype,
                        param_dtype=jnp.float32, name="logits")(x)


def gpt(
    vocab_size: int,
    seq_len: int,
    d_model: int = 64,
    num_heads: int = 4,
    num_layers: int = 4,
    mlp_ratio: int = 4,
    framework: str = "nnx",
    dtype: Any = jnp.float32,
    dropout: float = 0.0,
) -> Staged:
    """A GPT-style decoder-only language model as a :class:`jpipe.Staged`.

    ``pre`` embeds ``mb["tokens"]`` (int32 ``[b, T]``, ``T <= seq_len``) with a
    token and a learned position embedding; each of the ``num_layers`` layers
    is a pre-norm block (LayerNorm, causal multi-head self-attention, residual;
    LayerNorm, GELU MLP of width ``mlp_ratio * d_model``, residual); ``post`` is
    a final LayerNorm and a vocabulary head; the loss is the mean next-token
    cross-entropy against ``mb["targets"]`` (int32 ``[b, T]``).

    ``dtype`` is the compute dtype (default float32). With ``jnp.bfloat16`` the
    embeddings, LayerNorms, matmuls and GELUs compute in bfloat16 and the
    hidden activations passed between pipeline stages are bfloat16 (half the
    bytes), while the parameters stay float32 -- so is the optimizer state --
    and the attention softmax and the cross-entropy are taken in float32
    (LayerNorm statistics too). The executor accumulates gradients in float32.

    ``dropout`` (GPT-2's places: the embeddings and each residual branch) is on in
    training steps and off in ``loss_value`` without a key (evaluation); see
    :func:`jpipe.step_rng`.

    >>> import jax, jax.numpy as jnp
    >>> model = gpt(vocab_size=16, seq_len=8, d_model=16, num_heads=2, num_layers=2)
    >>> batch = {"tokens": jnp.zeros((2, 8), jnp.int32), "targets": jnp.ones((2, 8), jnp.int32)}
    >>> params = model.init_params(jax.random.key(0), batch)
    >>> len(params["layers"]), params["pre"]["positions"].shape
    (2, (8, 16))
    >>> loss = model.loss_value(params, batch)  # close to log(16) ~ 2.77 at initialisation
    >>> 2.0 < float(loss) < 4.0
    True
    >>> linen = gpt(vocab_size=16, seq_len=8, d_model=16, num_heads=2, num_layers=2, framework="linen")
    >>> 2.0 < float(linen.loss_value(linen.init_params(jax.random.key(0), batch), batch)) < 4.0
    True

    Mixed precision: the same float32 parameters (tree, initialisers, values for
    a key), computed in bfloat16.

    >>> mixed = gpt(vocab_size=16, seq_len=8, d_model=16, num_heads=2, num_layers=2, dtype=jnp.bfloat16)
    >>> mixed.hidden_shape(params["pre"], batch).dtype  # the activations between stages
    dtype(bfloat16)
    >>> abs(float(mixed.loss_value(params, batch)) - float(loss)) < 0.05  # `model`'s parameters
    True
    """
    _check_framework(framework)
    _positive(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, num_heads=num_heads,
              num_layers=num_layers, mlp_ratio=mlp_ratio)
    if d_model % num_heads:
        raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    dtype = _compute_dtype(dtype)
    pre: Any
    layer: Any
    post: Any
    if framework == "nnx":
        def pre(rngs):
            return NNXEmbed(vocab_size, seq_len, d_model, dtype=dtype, dropout=dropout, rngs=rngs)

        def layer(rngs):
            return NNXBlock(d_model, num_heads, mlp_ratio, dtype=dtype, dropout=dropout, rngs=rngs)

        def post(rngs):
            return NNXHead(d_model, vocab_size, dtype=dtype, rngs=rngs)
    else:
        pre = LinenEmbed(vocab_size, seq_len, d_model, dtype, dropout)
        layer = LinenBlock(d_model, num_heads, mlp_ratio, dtype, dropout)
        post = LinenHead(vocab_size, dtype)
    return Staged(pre=pre, layer=layer, post=post, num_layers=num_layers, loss=_lm_loss,
                  check_batch=functools.partial(_check_token_range, vocab_size=vocab_size))


# --------------------------------------------------------------------------------------------
# MLP
# --------------------------------------------------------------------------------------------


class NNXInput(nnx.Module):
    """``Linear(mb["x"])``."""

    def __init__(self, in_dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(in_dim, hidden, kernel_init=_KERNEL_INIT, bias_init=_BIAS_INIT, rngs=rngs)

    def __call__(self, mb: dict[str, jax.Array]) -> jax.Array:
        return self.linear(mb["x"])


class NNXResidualTanh(nnx.Module):
    """``x + tanh(Linear(x))``."""

    def __init__(self, hidden: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(hidden, hidden, kernel_init=_KERNEL_INIT, bias_init=_BIAS_INIT, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.linear(x))


class LinenInput(nn.Module):
    """``Dense(mb["x"])``."""

    hidden: int

    @nn.compact
    def __call__(self, mb: dict[str, jax.Array]) -> jax.Array:
        return nn.Dense(self.hidden, kernel_init=_KERNEL_INIT, bias_init=_BIAS_INIT, name="linear")(mb["x"])


class LinenResidualTanh(nn.Module):
    """``x + tanh(Dense(x))``."""

    hidden: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(nn.Dense(self.hidden, kernel_init=_KERNEL_INIT, bias_init=_BIAS_INIT,
                                     name="linear")(x))


def mlp(in_dim: int, hidden: int, out_dim: int, num_layers: int, framework: str = "nnx") -> Staged:
    """A regression MLP as a :class:`jpipe.Staged`.

    ``pre`` is a linear map of ``mb["x"]`` (``[b, in_dim]``) to ``hidden``
    features, each of the ``num_layers`` layers is ``h + tanh(Linear(h))``,
    ``post`` a linear map to ``out_dim``; the loss is the mean squared error
    against ``mb["y"]`` (``[b, out_dim]``).

    >>> import jax, jax.numpy as jnp
    >>> batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros((4, 1))}
    >>> for framework in ("nnx", "linen"):
    ...     model = mlp(3, 8, 1, num_layers=3, framework=framework)
    ...     params = model.init_params(jax.random.key(0), batch)
    ...     print(framework, len(params["layers"]), float(model.loss_value(params, batch)) >= 0)
    nnx 3 True
    linen 3 True
    """
    _check_framework(framework)
    _positive(in_dim=in_dim, hidden=hidden, out_dim=out_dim, num_layers=num_layers)
    pre: Any
    layer: Any
    post: Any
    if framework == "nnx":
        def pre(rngs):
            return NNXInput(in_dim, hidden, rngs=rngs)

        def layer(rngs):
            return NNXResidualTanh(hidden, rngs=rngs)

        def post(rngs):
            return nnx.Linear(hidden, out_dim, kernel_init=_KERNEL_INIT, bias_init=_BIAS_INIT, rngs=rngs)
    else:
        pre = LinenInput(hidden)
        layer = LinenResidualTanh(hidden)
        post = nn.Dense(out_dim, kernel_init=_KERNEL_INIT, bias_init=_BIAS_INIT)
    return Staged(pre=pre, layer=layer, post=post, num_layers=num_layers, loss=_mse_loss)
