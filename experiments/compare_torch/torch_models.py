"""The compared architectures in torch, and the conversion of jpipe parameters into them.

:func:`to_torch` copies jpipe's sequential parameters (what
``jpipe.to_sequential`` / ``Staged.init_params`` return, or their flat
``.npz`` form) into a :class:`TorchModel`; :func:`grads_to_jpipe` maps torch
gradients back to jpipe's flat names. The naming rule is one table
(:data:`RENAME`): a Flax ``kernel`` ``[in, out]`` is a torch ``weight``
``[out, in]`` (transposed); a LayerNorm ``scale`` and an ``Embed.embedding``
are torch ``weight``\\ s; everything else keeps its name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from experiments.compare_torch.spec import RENAME, ModelSpec, flatten, grads_to_jpipe, torch_name

__all__ = ["RENAME", "StageModule", "TorchModel", "grads_to_jpipe", "loss_fn", "to_tensor", "to_torch",
           "torch_name"]

MASK_VALUE = -1e30  # the same constant as jax_models.MASK_VALUE

def torch_dtype(spec: ModelSpec) -> torch.dtype:
    return {"float32": torch.float32, "float64": torch.float64}[spec.dtype]


class MlpInput(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.linear = nn.Linear(spec.in_dim, spec.hidden, dtype=torch_dtype(spec))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class MlpLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.linear = nn.Linear(spec.hidden, spec.hidden, dtype=torch_dtype(spec))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.linear(h))


class Embed(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        dt = torch_dtype(spec)
        self.tokens = nn.Embedding(spec.vocab, spec.hidden, dtype=dt)
        self.positions = nn.Parameter(torch.zeros(spec.seq_len, spec.hidden, dtype=dt))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens) + self.positions[: tokens.shape[1]]


def causal_attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    b, t, three_d = qkv.shape
    d = three_d // 3
    hd = d // heads
    q, k, v = (a.reshape(b, t, heads, hd) for a in qkv.split(d, dim=-1))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    scores = torch.where(mask, scores, torch.full_like(scores, MASK_VALUE))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)
    return out.reshape(b, t, d)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        dt, d = torch_dtype(spec), spec.hidden
        self.heads = spec.heads
        self.ln1 = nn.LayerNorm(d, eps=spec.ln_eps, dtype=dt)
        self.qkv = nn.Linear(d, 3 * d, dtype=dt)
        self.proj = nn.Linear(d, d, dtype=dt)
        self.ln2 = nn.LayerNorm(d, eps=spec.ln_eps, dtype=dt)
        self.fc = nn.Linear(d, spec.mlp_ratio * d, dtype=dt)
        self.out = nn.Linear(spec.mlp_ratio * d, d, dtype=dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(causal_attention(self.qkv(self.ln1(x)), self.heads))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Head(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        dt = torch_dtype(spec)
        self.ln = nn.LayerNorm(spec.hidden, eps=spec.ln_eps, dtype=dt)
        self.logits = nn.Linear(spec.hidden, spec.vocab, dtype=dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.ln(x))


class TorchModel(nn.Module):
    """``pre -> layers -> post`` with parameter names matching jpipe's (see :data:`RENAME`)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        if spec.arch == "mlp":
            self.pre: nn.Module = MlpInput(spec)
            self.layers = nn.ModuleList(MlpLayer(spec) for _ in range(spec.num_layers))
            self.post: nn.Module = nn.Linear(spec.hidden, spec.out_dim, dtype=torch_dtype(spec))
        else:
            self.pre = Embed(spec)
            self.layers = nn.ModuleList(Block(spec) for _ in range(spec.num_layers))
            self.post = Head(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        for layer in self.layers:
            h = layer(h)
        return self.post(h)

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(self.spec)(out, target)


def loss_fn(spec: ModelSpec):
    """``(outputs, target) -> mean loss`` of one micro-batch, as jpipe's loss."""
    if spec.arch == "mlp":
        return lambda out, y: torch.mean((out - y) ** 2)
    return lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten().long())


class StageModule(nn.Module):
    """Layers ``[a, b)`` of a :class:`TorchModel` (plus ``pre`` / ``post`` on the first / last stage).

    Shares the model's parameters, so gradients land in ``model.named_parameters()``.
    """

    def __init__(self, model: TorchModel, a: int, b: int, first: bool, last: bool) -> None:
        super().__init__()
        self.pre = model.pre if first else None
        self.layers = nn.ModuleList(model.layers[a:b])
        self.post = model.post if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre is not None:
            x = self.pre(x)
        for layer in self.layers:
            x = layer(x)
        return self.post(x) if self.post is not None else x


def _check_names(spec: ModelSpec, jpipe_names: list[str], torch_names: list[str]) -> None:
    mapped = [torch_name(n)[0] for n in jpipe_names]
    missing = sorted(set(torch_names) - set(mapped))
    extra = sorted(set(mapped) - set(torch_names))
    if missing or extra or len(set(mapped)) != len(mapped):
        raise ValueError(
            f"jpipe and torch parameters of the {spec.arch} model do not correspond one to one: torch "
            f"parameters without a jpipe source {missing}, jpipe parameters without a torch target {extra}")


def to_torch(spec: ModelSpec, params: Mapping[str, Any]) -> TorchModel:
    """A :class:`TorchModel` holding exactly jpipe's parameters (nested sequential layout or flat names).

    Shapes and dtypes are checked; every torch parameter must get exactly one jpipe source.
    """
    flat = flatten(params) if "pre" in params else dict(params)
    model = TorchModel(spec)
    torch_params = dict(model.named_parameters())
    _check_names(spec, list(flat), list(torch_params))
    with torch.no_grad():
        for name, value in flat.items():
            target_name, transpose = torch_name(name)
            array = np.asarray(value)
            if transpose:
                array = array.T
            target = torch_params[target_name]
            if tuple(array.shape) != tuple(target.shape):
                raise ValueError(f"jpipe {name} has shape {array.shape} (after transpose: {transpose}) but "
                                 f"torch {target_name} has {tuple(target.shape)}")
            if array.dtype != np.dtype(spec.dtype):
                raise ValueError(f"jpipe {name} is {array.dtype} but the model spec says {spec.dtype}")
            target.copy_(torch.from_numpy(np.array(array, copy=True)))
    return model


def to_tensor(array: np.ndarray) -> torch.Tensor:
    """A batch array as a torch tensor (integer token ids as int64, which torch indexes with)."""
    t = torch.from_numpy(np.array(array, copy=True))
    return t.long() if t.dtype in (torch.int32, torch.int64) else t
