"""Profiles: per-layer costs and the mesh's communication costs; JSON and PipeDream graph files.

A :class:`Profile` is plain data. It comes from :func:`profile` (measured on the
current backend for a :class:`jpipe.Staged` model), from :func:`load` (JSON
written by :meth:`Profile.save`) or from :func:`read_graph_profile` (the
PipeDream / DAPPLE graph profiles the DAPPLE authors published).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


class LayerCost(NamedTuple):
    """Costs of one layer for one micro-batch of ``Profile.microbatch_size`` samples.

    Times are seconds: ``forward`` and ``backward`` (input and weight gradients),
    each of which includes ``*_overhead`` seconds that do not scale with the
    batch (dispatch, kernel launch). Sizes are bytes: ``activation_bytes`` the
    layer's output, ``residual_bytes`` what its backward keeps from its forward,
    ``param_bytes`` and ``optimizer_bytes`` (optimizer state) its weights'.
    """

    name: str
    forward: float
    backward: float
    activation_bytes: float
    param_bytes: float
    optimizer_bytes: float = 0.0
    residual_bytes: float = 0.0
    forward_overhead: float = 0.0
    backward_overhead: float = 0.0

    def scaled(self, factor: float) -> LayerCost:
        """The layer at ``factor`` times the profiled batch: times affine, activations linear."""
        f0, b0 = self.forward_overhead, self.backward_overhead
        return self._replace(
            forward=f0 + (self.forward - f0) * factor,
            backward=b0 + (self.backward - b0) * factor,
            activation_bytes=self.activation_bytes * factor,
            residual_bytes=self.residual_bytes * factor,
        )


class CommCost(NamedTuple):
    """Measured communication: ``latency + per_byte * bytes`` seconds.

    ``allreduce_per_byte`` is per byte of ring traffic, so an all-reduce of ``s``
    bytes over ``n`` devices takes ``allreduce_latency + allreduce_per_byte * 2 s (n-1)/n``.
    """

    ppermute_latency: float
    ppermute_per_byte: float
    allreduce_latency: float
    allreduce_per_byte: float

    def ppermute_time(self, size: float) -> float:
        return self.ppermute_latency + self.ppermute_per_byte * size if size > 0 else 0.0

    def allreduce_time(self, size: float, n: int) -> float:
        if n <= 1 or size <= 0:
            return 0.0
        return self.allreduce_latency + self.allreduce_per_byte * 2.0 * size * (n - 1) / n


@dataclasses.dataclass(frozen=True)
class Profile:
    """Per-layer costs of a ``pre -> layers -> post`` model at ``microbatch_size`` samples.

    ``cut_bytes[i]`` is what crosses a stage boundary placed after layer ``i``
    (default: that layer's output activation). ``comm`` is the mesh's measured
    communication, if any.

    >>> p = Profile(layers=(LayerCost("l0", 1e-3, 2e-3, 1024, 4096),) * 4, microbatch_size=2)
    >>> p.num_layers, p.scaled(4).layers[0].forward
    (4, 0.002)
    >>> Profile.from_json(p.to_json()) == p
    True
    """

    layers: tuple[LayerCost, ...]
    microbatch_size: int
    pre: LayerCost | None = None
    post: LayerCost | None = None
    comm: CommCost | None = None
    cut_bytes: tuple[float, ...] | None = None
    name: str = ""
    backend: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(LayerCost(*l) for l in self.layers))
        if not self.layers:
            raise ValueError("a Profile needs at least one layer")
        if self.microbatch_size < 1:
            raise ValueError(f"microbatch_size must be >= 1, got {self.microbatch_size}")
        for part in ("pre", "post"):
            value = getattr(self, part)
            if value is not None and not isinstance(value, LayerCost):
                object.__setattr__(self, part, LayerCost(*value))
        if self.comm is not None and not isinstance(self.comm, CommCost):
            object.__setattr__(self, "comm", CommCost(*self.comm))
        if self.cut_bytes is None:
            object.__setattr__(self, "cut_bytes", tuple(float(l.activation_bytes) for l in self.layers[:-1]))
        else:
            object.__setattr__(self, "cut_bytes", tuple(float(c) for c in self.cut_bytes))
        if len(self.cut_bytes) != len(self.layers) - 1:
            raise ValueError(f"cut_bytes has {len(self.cut_bytes)} entries; a profile of "
                             f"{len(self.layers)} layers needs {len(self.layers) - 1} (one per boundary)")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def scaled(self, microbatch_size: float) -> Profile:
        """The same model at another micro-batch size (times affine, bytes linear in the batch)."""
        factor = microbatch_size / self.microbatch_size
        scale = lambda l: None if l is None else l.scaled(factor)  # noqa: E731
        return dataclasses.replace(
            self, layers=tuple(l.scaled(factor) for l in self.layers), pre=scale(self.pre),
            post=scale(self.post), cut_bytes=tuple(c * factor for c in self.cut_bytes),
            microbatch_size=max(1, round(microbatch_size)))

    # -- JSON -------------------------------------------------------------------------------------
    def to_json(self) -> str:
        def layer(l: LayerCost | None) -> dict | None:
            return None if l is None else l._asdict()

        return json.dumps({
            "format": "jpipe-profile/1", "name": self.name, "backend": self.backend,
            "microbatch_size": self.microbatch_size, "pre": layer(self.pre),
            "layers": [layer(l) for l in self.layers], "post": layer(self.post),
            "cut_bytes": list(self.cut_bytes), "comm": None if self.comm is None else self.comm._asdict(),
        }, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        d = json.loads(text)
        if d.get("format") != "jpipe-profile/1":
            raise ValueError(f"not a jpipe profile (format {d.get('format')!r}); write one with Profile.save")
        layer = lambda x: None if x is None else LayerCost(**x)  # noqa: E731
        return cls(layers=tuple(layer(l) for l in d["layers"]), microbatch_size=d["microbatch_size"],
                   pre=layer(d["pre"]), post=layer(d["post"]),
                   comm=None if d["comm"] is None else CommCost(**d["comm"]),
                   cut_bytes=tuple(d["cut_bytes"]), name=d.get("name", ""), backend=d.get("backend", ""))

    def save(self, path: str | os.PathLike) -> None:
        """Writes the profile as JSON; read it back with :func:`load`."""
        with open(path, "w") as f:
            f.write(self.to_json())


def load(path: str | os.PathLike) -> Profile:
    """Reads a profile written by :meth:`Profile.save`."""
    with open(path) as f:
        return Profile.from_json(f.read())


# -------------------------------------------------------------------------------------------------
# PipeDream / DAPPLE graph profiles
# -------------------------------------------------------------------------------------------------


class GraphNode(NamedTuple):
    """One node of a PipeDream graph profile (times in milliseconds, sizes in bytes)."""

    id: str
    name: str
    forward_ms: float
    backward_ms: float
    activation_bytes: float
    param_bytes: float


_NODE = re.compile(
    r"^(?P<id>node\d+) -- (?P<name>.*) -- forward_compute_time=(?P<f>[^,]+), "
    r"backward_compute_time=(?P<b>[^,]+), activation_size=(?P<a>\[[^\]]*\]|[^,]+), "
    r"parameter_size=(?P<p>\S+)\s*$")
_EDGE = re.compile(r"^\s+(node\d+) -- (node\d+)\s*$")
_INPUT = re.compile(r"^input", re.IGNORECASE)
_PBS = re.compile(r"pbs-(\d+)")
# Nodes with parameters that are not repeated layers: they join the neighbouring layer.
_NOT_A_LAYER = re.compile(r"embed|classifier|pooler|loss|head|softmax", re.IGNORECASE)


def _size(text: str) -> float:
    text = text.strip()
    if text.startswith("["):
        return float(sum(float(x) for x in text[1:-1].split(";") if x.strip()))
    return float(text)


def read_graph(path: str | os.PathLike) -> tuple[list[GraphNode], list[tuple[str, str]]]:
    """Nodes (in file order) and edges of a PipeDream graph profile."""
    nodes, edges = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if m := _EDGE.match(line):
                edges.append((m.group(1), m.group(2)))
            elif m := _NODE.match(line.rstrip("\n")):
                nodes.append(GraphNode(m["id"], m["name"].strip(), float(m["f"]), float(m["b"]),
                                       _size(m["a"]), float(m["p"])))
            else:
                raise ValueError(f"{path}:{number}: neither a node (`nodeK -- name -- "
                                 f"forward_compute_time=..., ...`) nor an edge (`<indent>nodeA -- nodeB`): "
                                 f"{line.strip()[:80]!r}")
    if not nodes:
        raise ValueError(f"{path} holds no nodes; is it a PipeDream graph profile?")
    return nodes, edges


def _default_is_layer(node: GraphNode) -> bool:
    return node.param_bytes > 0 and not _NOT_A_LAYER.search(node.name)


def read_graph_profile(
    path: str | os.PathLike,
    microbatch_size: int | None = None,
    *,
    is_layer: Callable[[GraphNode], bool] = _default_is_layer,
    optimizer_factor: float = 2.0,
) -> Profile:
    """Reads a PipeDream / DAPPLE graph profile into a :class:`Profile` of layers.

    Nodes are grouped into layers: every node for which ``is_layer`` holds
    (default: it has parameters and is not an embedding, classifier, pooler or
    loss) starts a layer; parameter-free nodes join the layer before them,
    parameterised non-layers (a decoder's embedding) the layer after them.
    Nodes before the first layer become ``pre``, nodes after the last ``post``.
    A boundary after a layer carries the output of that layer's last node with an
    output (as the
    DAPPLE planner assumes). ``microbatch_size`` defaults to the ``pbs-N`` in
    the file name. ``optimizer_factor`` sets optimizer-state bytes per parameter
    byte (Adam: 2). Input nodes (named ``Input...``, no parameters) time the data
    pipeline, not the model: their times are dropped.
    """
    nodes, _ = read_graph(path)
    # Input nodes time the data pipeline, which overlaps training; they are not compute.
    nodes = [n._replace(forward_ms=0.0, backward_ms=0.0) if _INPUT.match(n.name) and not n.param_bytes else n
             for n in nodes]
    if microbatch_size is None:
        m = _PBS.search(os.path.basename(str(path)))
        if m is None:
            raise ValueError(f"cannot read the profile batch size from {os.path.basename(str(path))!r} "
                             f"(no 'pbs-N' in the name); pass microbatch_size=")
        microbatch_size = int(m.group(1))
    anchors = [i for i, n in enumerate(nodes) if is_layer(n)]
    if not anchors:
        raise ValueError(f"{path}: no node looks like a layer; pass is_layer= to say which are")
    owner = [0] * len(nodes)  # -1: pre, len(anchors): post, else the layer index
    for i in range(len(nodes)):
        before = [k for k, a in enumerate(anchors) if a <= i]
        if i < anchors[0]:
            owner[i] = -1
        elif i > anchors[-1]:
            owner[i] = len(anchors)
        elif nodes[i].param_bytes > 0 and i not in anchors:  # e.g. a decoder embedding
            owner[i] = before[-1] + 1
        else:
            owner[i] = before[-1]

    def merge(members: list[GraphNode], name: str) -> LayerCost | None:
        if not members:
            return None
        params = sum(n.param_bytes for n in members)
        outputs = [n.activation_bytes for n in members if n.activation_bytes > 0] or [0.0]
        return LayerCost(name, sum(n.forward_ms for n in members) / 1e3,
                         sum(n.backward_ms for n in members) / 1e3, outputs[-1],
                         params, optimizer_factor * params, sum(n.activation_bytes for n in members))

    groups: dict[int, list[GraphNode]] = {}
    for i, n in enumerate(nodes):
        groups.setdefault(owner[i], []).append(n)
    layers = tuple(merge(groups[k], nodes[a].name) for k, a in enumerate(anchors))
    name = os.path.basename(str(path)).rsplit(".", 1)[0]
    return Profile(layers=layers, microbatch_size=microbatch_size, pre=merge(groups.get(-1, []), "pre"),
                   post=merge(groups.get(len(anchors), []), "post"), name=name, backend="pipedream-graph")


# -------------------------------------------------------------------------------------------------
# Measuring a jpipe.Staged model
# -------------------------------------------------------------------------------------------------


def _tree_bytes(tree: Any) -> float:
    import jax

    return float(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _median_time(fn: Callable[[], Any], repeats: int, warmup: int) -> float:
    import time

    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def _time_part(forward: Callable, args: tuple, cotangent_of: Callable | None, repeats: int,
               warmup: int) -> tuple[float, float, float]:
    """(forward s, backward s, residual bytes) of ``forward(params, x, *rest)`` w.r.t. (params, x)."""
    import jax
    import jax.numpy as jnp

    fwd = jax.jit(forward)
    out = fwd(*args)

    def fwd_bwd(*a):
        y, vjp = jax.vjp(lambda p, x: forward(p, x, *a[2:]), a[0], a[1])
        return vjp(jnp.ones_like(y) if cotangent_of is None else cotangent_of(y))

    both = jax.jit(fwd_bwd)
    t_f = _median_time(lambda: fwd(*args), repeats, warmup)
    t_fb = _median_time(lambda: both(*args), repeats, warmup)
    residuals = jax.eval_shape(
        lambda p, x: jax.vjp(lambda p_, x_: forward(p_, x_, *args[2:]), p, x)[1].opaque_residuals,
        args[0], args[1])
    del out
    return t_f, max(t_fb - t_f, 0.0), _tree_bytes(residuals)


def _measure(model: Any, microbatch: Any, optimizer: Any, device: Any, repeats: int,
             warmup: int, seed: int) -> tuple[LayerCost, LayerCost, LayerCost]:
    import jax
    import jax.numpy as jnp

    params = model.init_stacked(jax.random.key(seed), microbatch)
    params = jax.device_put(params, device)
    microbatch = jax.device_put(microbatch, device)
    pre_p, post_p = params["pre"], params["post"]
    layer_p = jax.tree.map(lambda a: a[0], params["layers"])
    hidden = jax.jit(model.embed)(pre_p, microbatch)

    def opt_bytes(p: Any) -> float:
        return _tree_bytes(jax.eval_shape(optimizer.init, p))

    # pre: differentiate w.r.t. its parameters only (the micro-batch is data)
    f, b, r = _time_part(lambda p, x: model.embed(p, x), (pre_p, microbatch), None, repeats, warmup)
    pre = LayerCost("pre", f, b, _tree_bytes(hidden), _tree_bytes(pre_p), opt_bytes(pre_p), r)
    f, b, r = _time_part(model.layer_apply, (layer_p, hidden), None, repeats, warmup)
    layer = LayerCost("layer", f, b, _tree_bytes(hidden), _tree_bytes(layer_p), opt_bytes(layer_p), r)
    f, b, r = _time_part(lambda p, x, mb: model.head_loss(p, x, mb), (post_p, hidden, microbatch),
                         lambda y: jnp.ones_like(y), repeats, warmup)
    post = LayerCost("post", f, b, 4.0, _tree_bytes(post_p), opt_bytes(post_p), r)
    return pre, layer, post


def _fit(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``latency + per_unit * size`` (both clamped at >= 0)."""
    n = len(sizes)
    mean_s, mean_t = sum(sizes) / n, sum(times) / n
    var = sum((s - mean_s) ** 2 for s in sizes)
    slope = sum((s - mean_s) * (t - mean_t) for s, t in zip(sizes, times)) / var if var else 0.0
    slope = max(slope, 0.0)
    return max(mean_t - slope * mean_s, 0.0), slope


def measure_comm(devices: Sequence[Any] | None = None, *, sizes: Sequence[int] = (1 << 14, 1 << 18, 1 << 21),
                 repeats: int = 5, warmup: int = 2) -> CommCost | None:
    """Measures ppermute between neighbours and all-reduce over ``devices`` (default: all).

    Returns ``None`` on a single device. Under ``jax.distributed`` every process
    must call it (it runs collectives).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if n < 2:
        return None
    mesh = Mesh(np.asarray(devices, dtype=object), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    perm = [(i, (i + 1) % n) for i in range(n)]
    shift = jax.jit(jax.shard_map(lambda a: jax.lax.ppermute(a, "x", perm), mesh=mesh, in_specs=P("x"),
                                  out_specs=P("x")))
    reduce = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"),
                                   out_specs=P("x")))
    t_perm, t_ar = [], []
    for size in sizes:
        count = max(1, size // 4)
        x = jax.make_array_from_callback((n * count,), sharding,
                                         lambda idx, c=count: np.ones((c,), np.float32))
        t_perm.append(_median_time(lambda: shift(x), repeats, warmup))
        t_ar.append(_median_time(lambda: reduce(x), repeats, warmup))
    del jnp
    p_lat, p_byte = _fit(sizes, t_perm)
    ring = [2.0 * s * (n - 1) / n for s in sizes]
    a_lat, a_byte = _fit(ring, t_ar)
    return CommCost(p_lat, p_byte, a_lat, a_byte)


def profile(
    model: Any,
    example_microbatch: Any,
    *,
    optimizer: Any = None,
    devices: Sequence[Any] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    comm: bool = True,
    affine: bool = True,
    seed: int = 0,
) -> Profile:
    """Measures a :class:`jpipe.Staged` model on the current backend at one micro-batch size.

    Per part (``pre``, one ``layer`` -- every layer is the same module -- and
    ``post`` with the loss): forward and backward seconds (median of
    ``repeats`` after ``warmup`` runs, each synchronised with
    ``block_until_ready``), output activation, residual, parameter and
    optimizer-state bytes (``optimizer`` default ``optax.adam``). With ``affine``
    the compute is also timed at half the example micro-batch, so that times
    scale affinely (a fixed per-call overhead plus a per-sample part); without,
    they scale linearly. With ``comm``,
    also the mesh's ppermute and all-reduce costs over ``devices``.

    >>> import jax.numpy as jnp, jpipe.models
    >>> model = jpipe.models.mlp(in_dim=4, hidden=16, out_dim=1, num_layers=3)
    >>> mb = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 1))}
    >>> p = profile(model, mb, repeats=3, warmup=1, comm=False, affine=False)
    >>> p.num_layers, p.microbatch_size, p.layers[0].param_bytes
    (3, 8, 1088.0)
    """
    import jax
    import numpy as np
    import optax

    optimizer = optax.adam(1e-3) if optimizer is None else optimizer
    devices = list(jax.devices() if devices is None else devices)
    local = [d for d in devices if d.process_index == jax.process_index()] or jax.local_devices()
    sizes = {np.shape(a)[0] for a in jax.tree.leaves(example_microbatch)}
    if len(sizes) != 1:
        raise ValueError(f"example_microbatch leaves disagree on the leading (batch) size: {sorted(sizes)}")
    (size,) = sizes
    full = _measure(model, example_microbatch, optimizer, local[0], repeats, warmup, seed)
    if affine and size >= 2:
        half_mb = jax.tree.map(lambda a: a[: size // 2], example_microbatch)
        half = _measure(model, half_mb, optimizer, local[0], repeats, warmup, seed)
        ratio = (size // 2) / size

        def affine(big: LayerCost, small: LayerCost) -> LayerCost:
            # t(b) = t0 + k b; from t(size) and t(size/2): t0 = (t_half - ratio t_full) / (1 - ratio)
            f0 = min(max((small.forward - ratio * big.forward) / (1 - ratio), 0.0), big.forward)
            b0 = min(max((small.backward - ratio * big.backward) / (1 - ratio), 0.0), big.backward)
            return big._replace(forward_overhead=f0, backward_overhead=b0)

        full = tuple(affine(b, s) for b, s in zip(full, half))
    pre, layer, post = full
    layers = tuple(layer._replace(name=f"layer_{i}") for i in range(model.num_layers))
    comm_cost = measure_comm(devices) if comm else None
    return Profile(layers=layers, microbatch_size=int(size), pre=pre, post=post, comm=comm_cost,
                   name=type(model).__name__, backend=jax.default_backend())
