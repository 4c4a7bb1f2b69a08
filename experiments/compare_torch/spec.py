"""Plain data shared by every part of the comparison: no JAX and no torch imported here.

The driver, the jpipe worker and the torch workers exchange JSON configs and
``.npz`` files; this module defines their contents: the model
(:class:`ModelSpec`), the schedule pairs (:data:`PAIRS`), one run
(:class:`RunConfig`), flat parameter names, and action-order helpers.

An *action* is ``(kind, microbatch, stage)`` with ``kind`` one of ``"F"``
(forward), ``"B"`` (the whole backward, or its input-gradient half when the
schedule splits backwards) and ``"W"`` (the weight-gradient half).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

Action = tuple[str, int, int]  # (kind, microbatch, stage)
Order = list[Action]

ARCHS = ("mlp", "transformer")
DTYPES = ("float32", "float64")
SEP = "."


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One architecture, built identically in Flax NNX (for jpipe) and in torch.

    ``arch="mlp"``: ``pre = Linear(x)``, ``num_layers`` x ``h + tanh(Linear(h))``,
    ``post = Linear``, mean squared error against ``y``.
    ``arch="transformer"``: token + learned position embedding, pre-norm blocks
    (LayerNorm, causal multi-head attention, residual; LayerNorm, tanh-GELU MLP,
    residual), final LayerNorm and vocabulary head, mean next-token
    cross-entropy. Every computation stays in ``dtype`` (no float32 casts), so
    float64 runs are float64 end to end.

    >>> ModelSpec("mlp", num_layers=8).microbatch_shapes(4)["x"]
    (4, 16)
    """

    arch: Literal["mlp", "transformer"]
    num_layers: int = 8
    hidden: int = 32
    dtype: Literal["float32", "float64"] = "float64"
    in_dim: int = 16  # mlp
    out_dim: int = 4  # mlp
    vocab: int = 64  # transformer
    seq_len: int = 16  # transformer
    heads: int = 4  # transformer
    mlp_ratio: int = 2  # transformer
    ln_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.arch == "transformer" and self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")

    def microbatch_shapes(self, size: int) -> dict[str, tuple[int, ...]]:
        if self.arch == "mlp":
            return {"x": (size, self.in_dim), "y": (size, self.out_dim)}
        return {"tokens": (size, self.seq_len), "targets": (size, self.seq_len)}

    def make_batch(self, size: int, seed: int = 0) -> dict[str, np.ndarray]:
        """The global batch both frameworks train on: ``{"x", "y"}`` or ``{"tokens", "targets"}``."""
        rng = np.random.default_rng(seed)
        if self.arch == "mlp":
            return {"x": rng.normal(size=(size, self.in_dim)).astype(self.dtype),
                    "y": rng.normal(size=(size, self.out_dim)).astype(self.dtype)}
        tokens = rng.integers(0, self.vocab, size=(size, self.seq_len + 1), dtype=np.int64)
        return {"tokens": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}

    @property
    def input_key(self) -> str:
        return "x" if self.arch == "mlp" else "tokens"

    @property
    def target_key(self) -> str:
        return "y" if self.arch == "mlp" else "targets"

    def label(self) -> str:
        return f"{self.arch}-{self.dtype}"


@dataclasses.dataclass(frozen=True)
class SchedulePair:
    """A torch.distributed.pipelining schedule class and its jpipe counterpart.

    ``virtual_stages`` is the number of stages per device on both sides (torch:
    stages per rank, stage ``k`` on rank ``k % P``; jpipe: ``Plan(virtual_stages=)``,
    the same placement). ``split`` says whether the schedule splits backwards
    into B (input gradient) and W (weight gradient). ``jpipe_options`` are
    keyword arguments for jpipe's generator. Pairs with the same
    :attr:`torch_key` share one torch run.
    """

    name: str
    torch_class: str
    jpipe_schedule: str
    virtual_stages: int = 1
    split: bool = False
    jpipe_options: tuple[tuple[str, Any], ...] = ()

    @property
    def torch_key(self) -> str:
        return f"{self.torch_class}-v{self.virtual_stages}"

    @property
    def jpipe_label(self) -> str:
        opts = "".join(f"-{k}={v}" for k, v in self.jpipe_options)
        return f"{self.jpipe_schedule}-v{self.virtual_stages}{opts}"


PAIRS: tuple[SchedulePair, ...] = (
    SchedulePair("gpipe", "ScheduleGPipe", "gpipe"),
    SchedulePair("1f1b", "Schedule1F1B", "1f1b"),
    # jpipe's default interleaved warm-up is the smallest that never stalls in lock-step ticks ...
    SchedulePair("interleaved-1f1b", "ScheduleInterleaved1F1B", "interleaved-1f1b", virtual_stages=2),
    # ... and megatron_warmup=True is Megatron-LM's (and torch's) warm-up.
    SchedulePair("interleaved-1f1b-megatron", "ScheduleInterleaved1F1B", "interleaved-1f1b", virtual_stages=2,
                 jpipe_options=(("megatron_warmup", True),)),
    # torch's ScheduleInterleavedZeroBubble with one stage per rank is ZB-H1 (the paper's ZB1P).
    SchedulePair("zb-h1", "ScheduleInterleavedZeroBubble", "zb-h1", split=True),
)
PAIR_BY_NAME = {p.name: p for p in PAIRS}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One comparison run: a model, P devices/ranks, M micro-batches, some schedule pairs."""

    model: ModelSpec
    pipe: int
    microbatches: int
    microbatch_size: int = 4
    schedules: tuple[str, ...] = tuple(p.name for p in PAIRS)
    warmup_steps: int = 2
    timed_steps: int = 10
    lr: float = 1e-3
    seed: int = 0
    torch_threads: int = 1

    def __post_init__(self) -> None:
        if self.pipe < 2:
            raise ValueError(f"pipe must be >= 2 (torch pipelining needs two ranks), got {self.pipe}")
        unknown = [s for s in self.schedules if s not in PAIR_BY_NAME]
        if unknown:
            raise ValueError(f"unknown schedules {unknown}; choose from {sorted(PAIR_BY_NAME)}")
        for s in self.schedules:
            stages = self.pipe * PAIR_BY_NAME[s].virtual_stages
            if self.model.num_layers % stages:
                raise ValueError(f"{s}: num_layers={self.model.num_layers} is not divisible by the "
                                 f"{stages} stages; use a multiple of {stages}")
        if self.timed_steps < 1 or self.warmup_steps < 0:
            raise ValueError("need timed_steps >= 1 and warmup_steps >= 0")

    @property
    def batch_size(self) -> int:
        return self.microbatches * self.microbatch_size

    def pairs(self) -> list[SchedulePair]:
        return [PAIR_BY_NAME[s] for s in self.schedules]

    def torch_runs(self) -> list[SchedulePair]:
        """One pair per distinct torch run (pairs that share a torch schedule share its run)."""
        runs: dict[str, SchedulePair] = {}
        for p in self.pairs():
            runs.setdefault(p.torch_key, p)
        return list(runs.values())

    def layer_range(self, stage: int, num_stages: int) -> tuple[int, int]:
        """Layers ``[a, b)`` of virtual stage ``stage`` (an even split, like jpipe's default)."""
        per = self.model.num_layers // num_stages
        return stage * per, (stage + 1) * per

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        raw = json.loads(text)
        raw["model"] = ModelSpec(**raw["model"])
        raw["schedules"] = tuple(raw["schedules"])
        return cls(**raw)


# -- flat parameter names ---------------------------------------------------------------------


def flatten(tree: Mapping[str, Any] | Sequence[Any], prefix: str = "") -> dict[str, Any]:
    """``{"pre": {"linear": {"kernel": a}}, "layers": [...]}`` -> ``{"pre.linear.kernel": a, "layers.0....": ...}``.

    >>> flatten({"pre": {"k": 1}, "layers": [{"k": 2}, {"k": 3}]})
    {'pre.k': 1, 'layers.0.k': 2, 'layers.1.k': 3}
    """
    items = enumerate(tree) if isinstance(tree, (list, tuple)) else tree.items()
    out: dict[str, Any] = {}
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, (Mapping, list, tuple)):
            out.update(flatten(value, name + SEP))
        else:
            out[name] = value
    return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`flatten` for jpipe's sequential layout (``layers`` becomes a list).

    >>> unflatten({"pre.k": 1, "layers.0.k": 2, "layers.1.k": 3})
    {'pre': {'k': 1}, 'layers': [{'k': 2}, {'k': 3}]}
    """
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split(SEP)
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    if "layers" in tree:
        layers = tree["layers"]
        tree["layers"] = [layers[str(i)] for i in range(len(layers))]
    return tree


# jpipe leaf name -> (torch leaf name, transpose): a Flax kernel [in, out] is a torch weight [out, in].
RENAME: dict[str, tuple[str, bool]] = {
    "kernel": ("weight", True),
    "scale": ("weight", False),
    "embedding": ("weight", False),
}


def torch_name(jpipe_name: str) -> tuple[str, bool]:
    """jpipe flat name -> (torch parameter name, transpose).

    >>> torch_name("layers.3.qkv.kernel")
    ('layers.3.qkv.weight', True)
    >>> torch_name("pre.positions")
    ('pre.positions', False)
    """
    *parents, leaf = jpipe_name.split(SEP)
    new, transpose = RENAME.get(leaf, (leaf, False))
    return SEP.join([*parents, new]), transpose


def grads_to_jpipe(torch_grads: Mapping[str, np.ndarray], jpipe_names: Iterable[str]) -> dict[str, np.ndarray]:
    """Torch gradients (by torch parameter name) -> jpipe flat names, kernels transposed back.

    >>> g = grads_to_jpipe({"post.weight": np.zeros((2, 3))}, ["post.kernel"])
    >>> g["post.kernel"].shape
    (3, 2)
    """
    out = {}
    for name in jpipe_names:
        source, transpose = torch_name(name)
        if source not in torch_grads:
            raise KeyError(f"no torch gradient for {source} (jpipe {name}); did every rank report its stage?")
        g = np.asarray(torch_grads[source])
        out[name] = g.T if transpose else g
    return out


# -- action orders ----------------------------------------------------------------------------


def normalize_order(order: Iterable[Sequence[Any]], split: bool) -> Order:
    """Orders as ``(kind, microbatch, stage)`` with torch's kinds mapped to jpipe's.

    torch names the input-gradient half of a split backward ``I``; jpipe calls
    it ``B``. In a split schedule a full backward ``B`` (torch may merge an
    adjacent I and W) is the same work as ``B`` followed by ``W``.

    >>> normalize_order([("F", 0, 1), ("I", 0, 1), ("W", 0, 1)], split=True)
    [('F', 0, 1), ('B', 0, 1), ('W', 0, 1)]
    >>> normalize_order([("F", 0, 1), ("B", 0, 1)], split=True)
    [('F', 0, 1), ('B', 0, 1), ('W', 0, 1)]
    """
    out: Order = []
    for kind, mb, stage, *_ in order:
        kind, mb, stage = str(kind), int(mb), int(stage)
        if kind == "I":
            out.append(("B", mb, stage))
        elif kind == "B" and split:
            out += [("B", mb, stage), ("W", mb, stage)]
        elif kind in ("F", "B", "W"):
            out.append((kind, mb, stage))
        else:
            raise ValueError(f"unknown action kind {kind!r} in {order!r}")
    return out


def held_from_order(order: Iterable[Action], split: bool) -> int:
    """Peak number of (micro-batch, stage) pairs whose forward ran and whose last backward
    action (``B``, or ``W`` when split) has not -- jpipe's ``Table.held_microbatches`` for one device.

    >>> held_from_order([("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("F", 2, 0)], split=False)
    2
    """
    done = "W" if split else "B"
    live = peak = 0
    for kind, _, _ in order:
        if kind == "F":
            live += 1
            peak = max(peak, live)
        elif kind == done:
            live -= 1
    return peak


def format_order(order: Iterable[Action], num_devices: int) -> str:
    """``F0 F1 B0 ...``; stages past the first chunk get a suffix (``F3.1`` = chunk 1)."""
    parts = []
    for kind, mb, stage in order:
        chunk = stage // num_devices
        parts.append(f"{kind}{mb}" + (f".{chunk}" if chunk else ""))
    return " ".join(parts)


def first_difference(a: Sequence[Action], b: Sequence[Action]) -> int | None:
    """Index of the first differing action of two orders, ``None`` when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if tuple(x) != tuple(y):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def read_rss_kib() -> tuple[int, int]:
    """``(VmRSS, VmHWM)`` of this process in KiB (Linux ``/proc/self/status``)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


def reset_peak_rss() -> bool:
    """Resets this process's peak RSS (VmHWM) to its current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
