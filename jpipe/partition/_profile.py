"""Profiles: per-layer costs and the mesh's communication costs; JSON and PipeDream graph files.

A :class:`Profile` is plain data. It comes from :func:`profile` (measured on the
current backend for a :class:`jpipe.Staged` model), from :func:`load` (JSON
written by :meth:`Profile.save`) or from :func:`read_graph_profile` (the
PipeDream / DAPPLE graph profiles the DAPPLE authors published).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import re
import statistics
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

Points = tuple[tuple[float, ...], ...]


def interpolate(points: Sequence[Sequence[float]], x: float, column: int = 1) -> float:
    """``points[:, column]`` at ``x`` (sorted by ``points[:, 0]``): piecewise linear between the points,
    the nearest segment's line beyond them, never below 0.

    >>> interpolate([(1, 1.0), (2, 3.0), (4, 4.0)], 3), interpolate([(1, 1.0), (2, 3.0)], 0)
    (3.5, 0.0)
    """
    if len(points) == 1:
        return float(points[0][column])
    i = 1
    while i < len(points) - 1 and x > points[i][0]:
        i += 1
    (x0, *r0), (x1, *r1) = points[i - 1], points[i]
    y0, y1 = r0[column - 1], r1[column - 1]
    if x == x1:  # a measured point is read as measured, without rounding
        return max(0.0, float(y1))
    return max(0.0, float(y0 + (y1 - y0) * (x - x0) / (x1 - x0)))


class LayerCost(NamedTuple):
    """Costs of one layer for one micro-batch of ``Profile.microbatch_size`` samples.

    Times are seconds: ``forward`` and ``backward`` (input and weight gradients)
    and ``update``, the optimizer's step on the layer's weights. ``curve`` holds
    the same layer timed at other batch sizes, as ``(batch relative to this one,
    forward, backward)``; :meth:`scaled` interpolates between the measured sizes
    (extrapolating the nearest segment) and, without a curve, scales linearly.
    Sizes are bytes: ``activation_bytes`` the layer's output, ``residual_bytes``
    what its backward keeps from its forward, ``param_bytes`` and
    ``optimizer_bytes`` (optimizer state) its weights', in their dtypes, and ``grad_bytes``
    its weights' gradient accumulator (float32 whatever the weights' dtype, as the executor
    accumulates; ``None``: as many as ``param_bytes``, float32 weights). :attr:`accumulator_bytes`
    reads it. ``mask_bytes``: what the layer's residuals hold beyond ``residual_bytes`` when it
    runs masked, as the executor runs the layers of a partition's shorter stages (a ``lax.cond``
    whose backward keeps the layer's weights too); it does not grow with the batch.

    >>> l = LayerCost("l", 2.0, 4.0, 8.0, 0.0, curve=((0.5, 1.5, 2.0),))
    >>> l.scaled(0.75)[1:4], l.scaled(2)[1:3], l.scaled(0.5).curve
    ((1.75, 3.0, 6.0), (3.0, 8.0), ((2.0, 2.0, 4.0),))
    >>> [LayerCost("bf16", 0, 0, 0, 2e3, grad_bytes=g).accumulator_bytes for g in (None, 4e3)]
    [2000.0, 4000.0]
    """

    name: str
    forward: float
    backward: float
    activation_bytes: float
    param_bytes: float
    optimizer_bytes: float = 0.0
    residual_bytes: float = 0.0
    update: float = 0.0
    curve: Points = ()
    grad_bytes: float | None = None
    mask_bytes: float = 0.0

    @property
    def accumulator_bytes(self) -> float:
        """Bytes of the float32 gradient accumulator of the weights (``grad_bytes``, else ``param_bytes``)."""
        return float(self.param_bytes if self.grad_bytes is None else self.grad_bytes)

    def scaled(self, factor: float) -> LayerCost:
        """The layer at ``factor`` times the profiled batch (bytes linear in the batch)."""
        points = sorted({(1.0, self.forward, self.backward), *map(tuple, self.curve)})
        if len(points) == 1:
            forward, backward = self.forward * factor, self.backward * factor
        else:
            forward, backward = interpolate(points, factor, 1), interpolate(points, factor, 2)
        return self._replace(
            forward=forward, backward=backward,
            activation_bytes=self.activation_bytes * factor,
            residual_bytes=self.residual_bytes * factor,
            curve=tuple((s / factor, f, b) for s, f, b in points if not math.isclose(s, factor)),
        )


class CommCost(NamedTuple):
    """Measured communication as points ``(bytes, seconds)``, interpolated by :func:`interpolate`.

    ``exchange``: one tick of the executor between pipe neighbours -- the
    activation ppermute forward and the cotangent ppermute backward, ``bytes``
    each way. ``allreduce``: one all-reduce, by bytes of ring traffic, so an
    all-reduce of ``s`` bytes over ``n`` devices is read at ``2 s (n-1)/n``; a
    reduce-scatter of ``s`` bytes (each device keeps ``s/n`` of the sum) and an
    all-gather of ``s`` bytes (from ``s/n`` on each) move half that, ``s (n-1)/n``,
    and are read off the same points.

    >>> c = CommCost.linear(exchange_latency=1e-4, exchange_per_byte=1e-9, allreduce_latency=1e-3,
    ...                     allreduce_per_byte=1e-9)
    >>> round(c.exchange_time(1e6), 6), round(c.allreduce_time(1e6, 2), 6), c.allreduce_time(1e6, 1)
    (0.0011, 0.002, 0.0)
    >>> round(c.reduce_scatter_time(1e6, 2), 6), round(c.all_gather_time(1e6, 2), 6)
    (0.0015, 0.0015)
    """

    exchange: Points
    allreduce: Points

    @classmethod
    def linear(cls, exchange_latency: float, exchange_per_byte: float, allreduce_latency: float,
               allreduce_per_byte: float) -> CommCost:
        """Latency + bytes x per-byte, for both."""
        line = lambda lat, per: ((0.0, lat), (1e9, lat + per * 1e9))
        return cls(line(exchange_latency, exchange_per_byte), line(allreduce_latency, allreduce_per_byte))

    def exchange_time(self, size: float) -> float:
        return interpolate(self.exchange, size) if size > 0 else 0.0

    def allreduce_time(self, size: float, n: int) -> float:
        if n <= 1 or size <= 0:
            return 0.0
        return interpolate(self.allreduce, 2.0 * size * (n - 1) / n)

    def reduce_scatter_time(self, size: float, n: int) -> float:
        """A ring reduce-scatter of ``size`` bytes over ``n`` devices: ``size (n-1)/n`` bytes of traffic."""
        if n <= 1 or size <= 0:
            return 0.0
        return interpolate(self.allreduce, size * (n - 1) / n)

    def all_gather_time(self, size: float, n: int) -> float:
        """A ring all-gather of ``size`` bytes in all over ``n`` devices: as a reduce-scatter of them."""
        return self.reduce_scatter_time(size, n)


@dataclasses.dataclass(frozen=True)
class Profile:
    """Per-layer costs of a ``pre -> layers -> post`` model at ``microbatch_size`` samples.

    ``cut_bytes[i]`` is what crosses a stage boundary placed after layer ``i``
    (default: that layer's output activation). ``comm`` is the mesh's measured
    communication, if any. ``step_overhead`` holds points ``(micro-batch size, seconds)``:
    what a training step costs beyond its parts (its buffers' set-up, the reductions of the
    loss and gradients on a device, the launch), as ``jpipe.train_step`` measured it above
    the sum of its parts' times at that micro-batch size (a number: the same at every size);
    read it with :meth:`step_overhead_at`. ``stash_copy`` holds points ``(bytes, seconds)``: what copying one
    slot of a residual stash costs (the executor's stash is indexed by a slot number
    known only at run time, so a forward copies its residuals into their slot and a
    backward copies them out, once a stage holds more than one micro-batch).
    ``contention`` is how many times slower the devices computed with every device of the cluster
    computing at once (as the profile's times are given) than with one computing alone: 1 where
    devices share nothing (accelerators); above 1 where they share cores, memory or a bus (CPU
    processes on one machine, simulated CPU devices in one process), so that a tick in which fewer
    devices compute runs faster.

    >>> p = Profile(layers=(LayerCost("l0", 1e-3, 2e-3, 1024, 4096),) * 4, microbatch_size=2)
    >>> p.num_layers, p.scaled(4).layers[0].forward
    (4, 0.002)
    >>> Profile.from_json(p.to_json()) == p
    True
    >>> q = dataclasses.replace(p, step_overhead=((2, 1e-3), (8, 4e-3)))
    >>> q.step_overhead_at(4), q.scaled(8).step_overhead_at(4)
    (0.002, 0.002)
    """

    layers: tuple[LayerCost, ...]
    microbatch_size: int
    pre: LayerCost | None = None
    post: LayerCost | None = None
    comm: CommCost | None = None
    cut_bytes: tuple[float, ...] | None = None
    name: str = ""
    backend: str = ""
    step_overhead: Points | float = ()
    stash_copy: Points = ()
    contention: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(_layer_cost(l) for l in self.layers))
        if not self.layers:
            raise ValueError("a Profile needs at least one layer")
        if self.microbatch_size < 1:
            raise ValueError(f"microbatch_size must be >= 1, got {self.microbatch_size}")
        if not self.contention > 0:  # also NaN
            raise ValueError(f"contention must be a positive factor (1: devices do not slow each other down), "
                             f"got {self.contention!r}")
        object.__setattr__(self, "contention", float(self.contention))
        for part in ("pre", "post"):
            value = getattr(self, part)
            if value is not None:
                object.__setattr__(self, part, _layer_cost(value))
        object.__setattr__(self, "stash_copy", _points(self.stash_copy))
        if isinstance(self.step_overhead, (int, float)):
            object.__setattr__(self, "step_overhead", ((self.microbatch_size, self.step_overhead),))
        object.__setattr__(self, "step_overhead", _points(self.step_overhead))
        if self.comm is not None:
            exchange, allreduce = self.comm
            object.__setattr__(self, "comm", CommCost(_points(exchange), _points(allreduce)))
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

    def step_overhead_at(self, microbatch_size: float) -> float:
        """Seconds a step with micro-batches of ``microbatch_size`` samples costs beyond its parts
        (interpolated between the measured sizes; 0 when none was measured)."""
        return interpolate(self.step_overhead, microbatch_size) if self.step_overhead else 0.0

    def scaled(self, microbatch_size: float) -> Profile:
        """The same model at another micro-batch size (times affine, bytes linear in the batch)."""
        factor = microbatch_size / self.microbatch_size
        scale = lambda l: None if l is None else l.scaled(factor)
        return dataclasses.replace(
            self, layers=tuple(l.scaled(factor) for l in self.layers), pre=scale(self.pre),
            post=scale(self.post), cut_bytes=tuple(c * factor for c in self.cut_bytes),
            microbatch_size=max(1, round(microbatch_size)))

    # -- JSON -------------------------------------------------------------------------------------
    def to_json(self) -> str:
        def layer(l: LayerCost | None) -> dict | None:
            return None if l is None else l._asdict()

        return json.dumps({
            "format": "jpipe-profile/2", "name": self.name, "backend": self.backend,
            "microbatch_size": self.microbatch_size, "pre": layer(self.pre),
            "layers": [layer(l) for l in self.layers], "post": layer(self.post),
            "cut_bytes": list(self.cut_bytes), "comm": None if self.comm is None else self.comm._asdict(),
            "step_overhead": [list(p) for p in self.step_overhead], "stash_copy": [list(p) for p in self.stash_copy],
            "contention": self.contention,
        }, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        d = json.loads(text)
        if d.get("format") == "jpipe-profile/1":
            d = _from_format_1(d)
        if d.get("format") != "jpipe-profile/2":
            raise ValueError(f"not a jpipe profile (format {d.get('format')!r}); write one with Profile.save")
        layer = lambda x: None if x is None else LayerCost(**x)
        return cls(layers=tuple(layer(l) for l in d["layers"]), microbatch_size=d["microbatch_size"],
                   pre=layer(d["pre"]), post=layer(d["post"]),
                   comm=None if d["comm"] is None else CommCost(**d["comm"]),
                   cut_bytes=tuple(d["cut_bytes"]), name=d.get("name", ""), backend=d.get("backend", ""),
                   step_overhead=d.get("step_overhead", ()), stash_copy=d.get("stash_copy", ()),
                   contention=d.get("contention", 1.0))

    def save(self, path: str | os.PathLike) -> None:
        """Writes the profile as JSON; read it back with :func:`load`."""
        with open(path, "w") as f:
            f.write(self.to_json())


def _points(points: Any) -> Points:
    return tuple(sorted(tuple(float(v) for v in p) for p in points))


def _layer_cost(value: Any) -> LayerCost:
    cost = LayerCost(*value)
    return cost._replace(curve=_points(cost.curve))


def _from_format_1(d: dict) -> dict:
    """A ``jpipe-profile/1`` dict in format 2: affine overheads become a point at half the batch,
    the linear communication fit becomes two points."""

    def layer(x: dict | None) -> dict | None:
        if x is None:
            return None
        x = dict(x)
        f0, b0 = x.pop("forward_overhead", 0.0), x.pop("backward_overhead", 0.0)
        if f0 or b0:
            x["curve"] = [(0.5, f0 + (x["forward"] - f0) / 2, b0 + (x["backward"] - b0) / 2)]
        return x

    c = d["comm"]
    comm = None if c is None else CommCost.linear(2 * c["ppermute_latency"], 2 * c["ppermute_per_byte"],
                                                  c["allreduce_latency"], c["allreduce_per_byte"])._asdict()
    return {**d, "format": "jpipe-profile/2", "pre": layer(d["pre"]), "post": layer(d["post"]),
            "layers": [layer(l) for l in d["layers"]], "comm": comm}


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


def robust_mean(samples: Sequence[float]) -> float:
    """The mean of ``samples`` without gross outliers (those above twice the median).

    The mean, not the median: a step's time is the sum of its parts' and only
    means add up. On a shared machine a part's time is a skewed, even quantised
    variable (with CPU collectives a blocked thread resumes at the scheduler's
    next 4 ms tick), and the median of such a sample snaps between levels, so
    a sum of medians misses the step's mean. Samples above twice the median
    (a garbage collection, another program) are dropped.

    >>> robust_mean([1.0, 1.0, 2.0, 1.0, 9.0])
    1.25
    """
    if not samples:
        raise ValueError("robust_mean needs at least one sample")
    ordered = sorted(samples)
    median = ordered[len(ordered) // 2]
    kept = [t for t in ordered if t <= 2 * median]
    return sum(kept) / len(kept)


def robust_line(points: Sequence[Sequence[float]]) -> tuple[float, float]:
    """``(intercept, slope)`` of the Theil-Sen line through ``(x, y)`` points: the median of the
    pairwise slopes, then the median intercept. One wild point in three or more moves it little,
    where a least-squares line would follow it.

    >>> robust_line([(1, 1.0), (2, 2.0), (3, 30.0), (4, 4.0), (5, 5.0)])
    (0.0, 1.0)
    """
    pts = [(float(x), float(y)) for x, y in points]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        raise ValueError(f"a line needs points at two or more distinct x, got {pts}")
    slopes = sorted((y1 - y0) / (x1 - x0) for i, (x0, y0) in enumerate(pts) for x1, y1 in pts[i + 1:]
                    if x1 != x0)
    slope = statistics.median(slopes)
    return statistics.median(y - slope * x for x, y in pts), slope


def mean_profile(profiles: Sequence[Profile]) -> Profile:
    """The profile whose every time is the mean of ``profiles``' (taken of the same model at the same
    sizes, e.g. by one :class:`Profiler` at several moments); sizes and names are the first's.

    On a shared machine a part's or an exchange's time drifts over tens of seconds, so the mean of
    profiles spread over a minute predicts a long run better than any one of them.

    >>> a = Profile(layers=(LayerCost("l", 1e-3, 2e-3, 64, 256),), microbatch_size=2, step_overhead=1e-3)
    >>> b = Profile(layers=(LayerCost("l", 3e-3, 2e-3, 64, 256),), microbatch_size=2, step_overhead=3e-3)
    >>> m = mean_profile([a, b])
    >>> m.layers[0].forward, m.layers[0].backward, m.step_overhead_at(2)
    (0.002, 0.002, 0.002)
    """
    if not profiles:
        raise ValueError("mean_profile needs at least one profile")

    def mean(*xs: Any) -> Any:
        if isinstance(xs[0], dict):
            if any(set(x) != set(xs[0]) for x in xs):
                raise ValueError("mean_profile: the profiles disagree on which parts they hold")
            return {k: mean(*(x[k] for x in xs)) for k in xs[0]}
        if isinstance(xs[0], list):
            if any(len(x) != len(xs[0]) for x in xs):
                raise ValueError("mean_profile: the profiles were measured at different sizes or layer counts; "
                                 "average only profiles of the same model at the same sizes")
            return [mean(*column) for column in zip(*xs)]
        if isinstance(xs[0], float) and len(set(xs)) > 1:  # equal sizes stay exactly equal
            return statistics.fmean(xs)
        return xs[0]

    return Profile.from_json(json.dumps(mean(*(json.loads(p.to_json()) for p in profiles))))


def _mean_times(fns: Sequence[Callable[[], Any]], repeats: int, warmup: int, block: int = 5) -> list[float]:
    """:func:`robust_mean` seconds of each of ``fns`` over ``repeats`` calls, timed in blocks of
    ``block`` calls, the functions in turns, so that a drift in the machine's speed hits them alike.
    Each block starts with one untimed call: the first call after another function's runs cold."""
    import time

    import jax

    for _ in range(warmup):
        for fn in fns:
            jax.block_until_ready(fn())
    times: list[list[float]] = [[] for _ in fns]
    while len(times[0]) < repeats:
        for fn, out in zip(fns, times):
            jax.block_until_ready(fn())
            for _ in range(min(block, repeats - len(out))):
                start = time.perf_counter()
                jax.block_until_ready(fn())
                out.append(time.perf_counter() - start)
    return [robust_mean(t) for t in times]


def _mean_time(fn: Callable[[], Any], repeats: int, warmup: int) -> float:
    return _mean_times([fn], repeats, warmup, block=repeats)[0]


def _part_runs(forward: Callable, args: tuple, cotangent_of: Callable | None,
               keep_residuals: bool = False) -> tuple[Callable[[], Any], Callable[[], Any], Any]:
    """(run the forward, run forward + backward, residual shapes) of ``forward(params, x, *rest)``
    w.r.t. (params, x): two compiled calls to time, and what the backward keeps.

    With ``keep_residuals`` the forward runs as the executor's forward tick
    runs it: ``jax.vjp``'s forward, returning the residuals the backward needs.
    """
    import jax
    import jax.numpy as jnp

    def vjp_of(a: tuple) -> tuple[Any, Any]:
        return jax.vjp(lambda p, x: forward(p, x, *a[2:]), a[0], a[1])

    def fwd_keep(*a):
        y, vjp = vjp_of(a)
        return y, vjp.opaque_residuals

    def fwd_bwd(*a):
        y, vjp = vjp_of(a)
        return vjp(jnp.ones_like(y) if cotangent_of is None else cotangent_of(y))

    fwd, both = (jax.jit(f).lower(*args).compile() for f in (fwd_keep if keep_residuals else forward, fwd_bwd))
    residuals = jax.eval_shape(lambda *a: vjp_of(a)[1].opaque_residuals, *args)
    return (lambda: fwd(*args)), (lambda: both(*args)), residuals


# Layers are timed in a stack of (up to) this many, run by a lax.scan as a pipeline stage runs them:
# a layer timed alone, its inputs and residuals still in cache, runs faster than within a stage.
_STACK = 4


def _stack_forward(model: Any) -> Callable[[Any, Any], Any]:
    """``f(stacked layer params, x) -> y``: the layers in a ``lax.scan``, as a stage runs them."""
    import jax

    return lambda p, x: jax.lax.scan(lambda h, pj: (model.layer_apply(pj, h), None), x, p)[0]


def _masked_stack_forward(model: Any) -> Callable[[Any, Any, Any], Any]:
    """``f(stacked layer params, x, count) -> y``: the layers as the executor runs a stage shorter than
    the largest (``Executor.stage_forward``): each in a ``lax.cond`` on its index below ``count``."""
    import jax
    import jax.numpy as jnp

    def f(p: Any, x: Any, count: Any) -> Any:
        layers = jax.tree.leaves(p)[0].shape[0]

        def one(h: Any, pj: Any) -> Any:
            q, j = pj
            return jax.lax.cond(j < count, lambda: model.layer_apply(q, h), lambda: h), None

        return jax.lax.scan(one, x, (p, jnp.arange(layers)))[0]

    return f


class _Part(NamedTuple):
    """A part of the model ready to time: its sizes (times 0), two runs, and how many layers it holds."""

    cost: LayerCost
    forward: Callable[[], Any]
    forward_backward: Callable[[], Any]
    layers: int
    residuals: Any = None  # the shapes of what the backward keeps


# A stash copy is timed as a loop of this many slot-to-slot copies (each a copy out and a copy in).
_COPIES = 8


def _stash_copy_run(residuals: Any, device: Any) -> tuple[float, Callable[[], Any]]:
    """(bytes of one slot, run of ``_COPIES`` copies out of and into a 2-slot stash of ``residuals``).

    The executor's stash slot is a run-time index: a forward's residuals are copied into their slot
    and a backward copies them out before its matrix products read them (a dynamic slice is not a
    view); with one slot, both copies fold away.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    stash = jax.device_put(jax.tree.map(lambda r: jnp.zeros((2, *r.shape), r.dtype), residuals), device)

    @functools.partial(jax.jit, donate_argnums=0)
    def copies(stash: Any) -> Any:
        def one(t: jax.Array, stash: Any) -> Any:
            i = t % 2
            out = jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, i, keepdims=False), stash)
            out = lax.optimization_barrier(out)  # a buffer of its own, as a backward's operands are
            return jax.tree.map(lambda b, o: lax.dynamic_update_index_in_dim(b, o, 1 - i, 0), stash, out)

        return lax.fori_loop(0, _COPIES, one, stash)

    box = [stash]

    def run() -> Any:
        box[0] = copies(box[0])  # the stash is donated: keep the new one
        return box[0]

    return _tree_bytes(residuals), run


def _accumulator_bytes(tree: Any) -> float:
    """Bytes of the executor's gradient accumulators for ``tree``: float32 for floating-point leaves of
    at most 4 bytes an element (bfloat16 and float16 weights included), the leaf's own dtype otherwise."""
    import jax
    import jax.numpy as jnp

    def one(x: Any) -> int:
        floating = jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize <= 4  # bfloat16 too
        return math.prod(x.shape) * (4 if floating else x.dtype.itemsize)

    return float(sum(one(x) for x in jax.tree.leaves(tree)))


def _part_sizes(model: Any, microbatch: Any, optimizer: Any,
                layers: int) -> tuple[LayerCost, LayerCost, LayerCost, Any]:
    """``pre``, one layer (of a stack of ``layers``, as a stage runs them) and ``post`` with the loss, at
    ``microbatch``: their sizes in bytes, in their dtypes (times 0), and the stack's residual shapes.
    From shapes alone (``jax.eval_shape``): nothing is compiled or run."""
    import jax
    import jax.numpy as jnp

    params = jax.eval_shape(model._init_stacked, jax.random.key(0), microbatch)
    pre_p, post_p = params["pre"], params["post"]
    stack_p = jax.tree.map(lambda a: jax.ShapeDtypeStruct((layers, *a.shape[1:]), a.dtype), params["layers"])
    hidden = jax.eval_shape(model.embed, pre_p, microbatch)
    k = layers

    def residuals(forward: Callable, *args: Any) -> Any:  # what jax.vjp keeps w.r.t. the first two arguments
        return jax.eval_shape(lambda *a: jax.vjp(lambda p, x: forward(p, x, *a[2:]), a[0], a[1])[1]
                              .opaque_residuals, *args)

    def cost(name: str, out: float, p: Any, res: Any, per: int = 1) -> LayerCost:
        return LayerCost(name, 0.0, 0.0, out, _tree_bytes(p) / per,
                         _tree_bytes(jax.eval_shape(optimizer.init, p)) / per, _tree_bytes(res) / per,
                         grad_bytes=_accumulator_bytes(p) / per)

    stack_res = residuals(lambda p, x: _stack_forward(model)(p, x), stack_p, hidden)
    zeros = jax.ShapeDtypeStruct(hidden.shape, hidden.dtype)
    count = jax.ShapeDtypeStruct((), jnp.int32)
    masked_res = residuals(lambda p, x, c: _masked_stack_forward(model)(p, x, c), stack_p, zeros, count)
    # pre: differentiated w.r.t. its parameters and the micro-batch (data: float0 cotangents)
    pre_res = residuals(lambda p, x: model.embed(p, x), pre_p, microbatch)
    pre = cost("pre", _tree_bytes(hidden), pre_p, pre_res)
    layer = cost("layer", _tree_bytes(hidden), stack_p, stack_res, k)
    layer = layer._replace(mask_bytes=max(0.0, (_tree_bytes(masked_res) - _tree_bytes(stack_res)) / k))
    post = cost("post", 4.0, post_p, residuals(lambda p, x, mb: model.head_loss(p, x, mb), post_p, zeros,
                                                microbatch))
    return pre, layer, post, stack_res


def memory_profile(model: Any, example_microbatch: Any, *, optimizer: Any = None) -> Profile:
    """A :class:`Profile` of ``model``'s sizes alone (every time 0), at ``example_microbatch``: parameter,
    optimizer-state, float32 gradient-accumulator, activation and residual bytes of ``pre``, each layer
    and ``post``, as :func:`profile` measures them, from shapes alone (``jax.eval_shape``: nothing is
    compiled or run, in milliseconds). Enough for :func:`jpipe.partition.evaluate`'s memory; no use
    for its times.

    >>> import jax.numpy as jnp, jpipe.models
    >>> model = jpipe.models.mlp(in_dim=4, hidden=16, out_dim=1, num_layers=3)
    >>> p = memory_profile(model, {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 1))})
    >>> p.num_layers, p.layers[0].param_bytes, p.layers[0].accumulator_bytes, p.layers[0].activation_bytes
    (3, 1088.0, 1088.0, 512.0)
    """
    import jax
    import numpy as np
    import optax

    optimizer = optax.adam(1e-3) if optimizer is None else optimizer
    sizes = {np.shape(a)[0] for a in jax.tree.leaves(example_microbatch)}
    if len(sizes) != 1:
        raise ValueError(f"example_microbatch leaves disagree on the leading (batch) size: {sorted(sizes)}")
    pre, layer, post, _ = _part_sizes(model, example_microbatch, optimizer, min(_STACK, model.num_layers))
    layers = tuple(layer._replace(name=f"layer_{i}") for i in range(model.num_layers))
    return Profile(layers=layers, microbatch_size=int(sizes.pop()), pre=pre, post=post,
                   name=type(model).__name__, backend="shapes")


def _timed_stack(params: Any) -> Any:
    """The layers a profile times (the first ``_STACK``) of stacked ``params``."""
    import jax

    return jax.tree.map(lambda a: a[:_STACK], params["layers"])


def _parts(model: Any, params: Any, microbatch: Any, optimizer: Any, device: Any) -> tuple[_Part, _Part, _Part]:
    """``pre``, a stack of (up to) ``_STACK`` layers and ``post`` with the loss, at ``microbatch``;
    ``params`` (stacked, on ``device``) are the same at every size."""
    import jax
    import jax.numpy as jnp

    microbatch = jax.device_put(microbatch, device)
    pre_p, post_p, stack_p = params["pre"], params["post"], _timed_stack(params)
    k = min(_STACK, model.num_layers)
    pre_c, layer_c, post_c, stack_res = _part_sizes(model, microbatch, optimizer, k)

    # pre: differentiate w.r.t. its parameters only (the micro-batch is data)
    f, fb, _ = _part_runs(lambda p, x: model.embed(p, x), (pre_p, microbatch), None)
    pre = _Part(pre_c, f, fb, 1)
    hidden = f()  # pre's forward, compiled to be timed, gives the layers' input
    f, fb, _ = _part_runs(_stack_forward(model), (stack_p, hidden), None, keep_residuals=True)
    layer = _Part(layer_c, f, fb, k, stack_res)
    f, fb, _ = _part_runs(lambda p, x, mb: model.head_loss(p, x, mb), (post_p, hidden, microbatch),
                          lambda y: jnp.ones_like(y))
    post = _Part(post_c, f, fb, 1)
    return pre, layer, post


def _timed(parts: Sequence[_Part], repeats: int, warmup: int,
           also: Sequence[Callable[[], Any]] = ()) -> tuple[list[LayerCost], list[float]]:
    """Every part's per-layer forward and backward seconds, and the mean seconds of each run in
    ``also``, the runs timed in turns, a few calls each (a machine whose speed drifts over seconds
    then bends no size's time against the others')."""
    runs = [run for part in parts for run in (part.forward, part.forward_backward)]
    times = _mean_times([*runs, *also], repeats, warmup)
    times, also_times = times[:len(runs)], times[len(runs):]
    return [part.cost._replace(forward=t_f / part.layers, backward=max(t_fb - t_f, 0.0) / part.layers)
            for part, t_f, t_fb in zip(parts, times[::2], times[1::2])], also_times


def _update_runs(params: Any, optimizer: Any) -> list[Callable[[], Any]]:
    """Runs of ``optimizer.update`` + ``optax.apply_updates`` (and ``train_step``'s check for a
    non-finite gradient) on pre's, the stacked layers' and post's weights, as a stage holds them."""
    import jax
    import jax.numpy as jnp
    import optax

    @jax.jit
    def step(p: Any, state: Any) -> Any:
        updates, new_state = optimizer.update(p, state, p)  # any gradient of the right shape will do
        new_p = optax.apply_updates(p, updates)
        # as train_step's default nan_policy: a non-finite gradient keeps the old weights and state
        finite = jnp.stack([jnp.isfinite(a).all() for a in jax.tree.leaves(p)]).all()
        return jax.tree.map(lambda new, old: jnp.where(finite, new, old), (new_p, new_state), (p, state))

    runs = []
    for part in ("pre", "layers", "post"):
        p = params[part]
        state = jax.jit(optimizer.init)(p)
        runs.append(lambda p=p, state=state: step(p, state))
    return runs


def _step_runs(model: Any, microbatches: Sequence[Any], optimizer: Any, device: Any,
               seed: int) -> list[Callable[[], Any]]:
    """Runs of ``jpipe.train_step`` on ``device`` for the model cut to the timed stack of layers, one
    per micro-batch (each a batch of one micro-batch): a step's time less its parts' is what it
    costs beyond them. The runs share one state's arrays, each with the program of its size."""
    import jax

    from jpipe._init import init
    from jpipe._plan import Plan
    from jpipe._state import abstract_state
    from jpipe._train import train_step

    small = dataclasses.replace(model, num_layers=min(_STACK, model.num_layers))
    plan = Plan(pipe=1, data=1, microbatches=1)
    batches = [jax.device_put(mb, device) for mb in microbatches]
    state = [init(small, plan, optimizer, batches[0], rng=jax.random.key(seed), devices=[device])]

    def run_of(batch: Any) -> Callable[[], Any]:
        program = abstract_state(small, plan, optimizer, batch, devices=[device]).program
        step = train_step.lower(state[0].replace(program=program), batch).compile()

        def run() -> Any:
            state[0], metrics = step(state[0].replace(program=program), batch)  # donated: keep the new one
            return state[0], metrics

        return run

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # XLA compiles without the GIL
        return list(pool.map(run_of, batches))


def _resize(tree: Any, rows: int) -> Any:
    """``tree`` with ``rows`` rows, repeating its rows cyclically when it has fewer."""
    import jax
    import numpy as np

    return jax.tree.map(lambda a: np.asarray(a)[np.arange(rows) % np.shape(a)[0]], tree)


def max_over_processes(values: list[float]) -> list[float]:
    """Each value's maximum over the processes (all of them must call it)."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    flat = np.asarray(values, np.float32)
    return np.asarray(multihost_utils.process_allgather(flat)).reshape(-1, flat.size).max(axis=0).tolist()


def _alone_in_turns(fns: Sequence[Callable[[], Any]], repeats: int, warmup: int) -> list[float]:
    """:func:`_mean_times` of ``fns`` on each process while every other process waits at a barrier,
    one process after another (all of them must call it): what a device's work costs when no other
    device computes."""
    import jax
    from jax.experimental import multihost_utils

    mine = [0.0] * len(fns)
    for p in range(jax.process_count()):
        multihost_utils.sync_global_devices(f"jpipe.partition.profile: process {p} alone")
        if p == jax.process_index():
            mine = _mean_times(fns, repeats, warmup)
    multihost_utils.sync_global_devices("jpipe.partition.profile: every process done alone")
    return mine


def _times_scaled(cost: LayerCost, factor: float) -> LayerCost:
    """``cost`` with every time (forward, backward, optimizer update, the curve's) ``factor`` times longer.

    >>> c = _times_scaled(LayerCost("l", 1.0, 2.0, 0, 0, update=0.5, curve=((2.0, 3.0, 4.0),)), 2.0)
    >>> c.forward, c.backward, c.update, c.curve
    (2.0, 4.0, 1.0, ((2.0, 6.0, 8.0),))
    """
    return cost._replace(forward=cost.forward * factor, backward=cost.backward * factor, update=cost.update * factor,
                         curve=tuple((r, f * factor, b * factor) for r, f, b in cost.curve))


def _slowest_process(costs: list[LayerCost]) -> list[LayerCost]:
    """Under ``jax.distributed``, every time is the slowest process's (the lock-step pipeline and the
    all-reduces wait for it), and every process gets the same profile. Every process must call it."""
    def times(c: LayerCost) -> list[float]:
        return [c.forward, c.backward, c.update, *(v for point in c.curve for v in point[1:])]

    worst = max_over_processes([t for c in costs for t in times(c)])
    out = []
    for c in costs:
        n = 3 + 2 * len(c.curve)
        t, worst = worst[:n], worst[n:]
        curve = tuple((point[0], t[3 + 2 * i], t[4 + 2 * i]) for i, point in enumerate(c.curve))
        out.append(c._replace(forward=t[0], backward=t[1], update=t[2], curve=curve))
    return out


_EXCHANGE_TICKS = 8


def _sharing_runs(model: Any, params: Any, microbatch: Any, devices: Sequence[Any]) -> tuple[Callable, Callable]:
    """Runs of the timed stack's forward and backward on every one of ``devices`` at once, and on
    the first alone (the same program on a one-device mesh): their times' ratio is how much devices
    of one process slow each other down (simulated CPU devices share the host's cores)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    stack = _timed_stack(params)
    hidden = jax.eval_shape(model.embed, params["pre"], microbatch)
    hidden = jnp.ones(hidden.shape, hidden.dtype)
    forward = _stack_forward(model)

    def forward_backward(p: Any, x: Any) -> Any:
        y, vjp = jax.vjp(forward, p, x)
        return vjp(jnp.ones_like(y))

    def on(devs: Sequence[Any]) -> Callable[[], Any]:
        mesh = Mesh(np.array(devs), ("x",))
        each = NamedSharding(mesh, P("x"))
        args = jax.tree.map(lambda a: jax.device_put(jnp.broadcast_to(a, (len(devs), *a.shape)), each),
                            (stack, hidden))
        one = lambda p, x: jax.tree.map(lambda a: a[None], forward_backward(*jax.tree.map(lambda a: a[0], (p, x))))
        run = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
        return lambda: run(*args)

    return on(devices), on(devices[:1])


def _exchange_runs(model: Any, params: Any, microbatch: Any, devices: Sequence[Any],
                   ticks: int = _EXCHANGE_TICKS) -> tuple[float, Callable[[], Any], Callable[[], Any]]:
    """(bytes, run with, run without): what one tick's exchange of ``microbatch``'s activations adds to
    a tick that also computes is the difference of the runs' times over ``ticks`` -- a scan of ticks
    each running a stage's forward on every device, with and without the two ppermutes. Between
    computations an exchange can cost much more than in a tight loop of ppermutes (gloo on CPU:
    ~0.5 ms against ~0.1 ms at 16 KiB), and that is what a pipeline tick pays."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    mesh = Mesh(np.asarray(devices, dtype=object), ("x",))
    stack = _timed_stack(params)
    hidden = jax.eval_shape(model.embed, params["pre"], microbatch)
    forward = [(i, i + 1) for i in range(n - 1)]
    backward = [(i + 1, i) for i in range(n - 1)]
    stage = _stack_forward(model)

    def run(exchange: bool) -> Callable:
        def loop(p: Any, h: jax.Array) -> jax.Array:
            def tick(c: jax.Array, _: None) -> tuple[jax.Array, None]:
                c = stage(p, c)
                if exchange:
                    c = jax.lax.ppermute(c, "x", forward) + jax.lax.ppermute(c, "x", backward)
                return c, None

            return jax.lax.scan(tick, h, None, length=ticks)[0]

        return jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(P(), P("x")), out_specs=P("x"), check_vma=False))

    # from the host: a sharding over other processes' devices takes no array committed to a device
    stack = jax.device_put(jax.tree.map(np.asarray, stack), NamedSharding(mesh, P()))
    h = jax.make_array_from_callback((n * hidden.shape[0], *hidden.shape[1:]), NamedSharding(mesh, P("x")),
                                     lambda idx: np.ones(hidden.shape, hidden.dtype))
    with_exchange, without = run(True), run(False)
    return _tree_bytes(hidden), (lambda: with_exchange(stack, h)), (lambda: without(stack, h))


def measure_comm(devices: Sequence[Any] | None = None, *,
                 exchange_sizes: Sequence[float] = (1 << 14, 1 << 18, 1 << 21),
                 allreduce_sizes: Sequence[float] = (1 << 14, 1 << 18, 1 << 21),
                 ticks: int = 8, repeats: int = 5, warmup: int = 2) -> CommCost | None:
    """Measures the executor's per-tick exchange and all-reduce over ``devices`` (default: all).

    The exchange is timed as the executor runs it: a ``lax.scan`` of ``ticks``
    ticks, each a ppermute to the next device and one to the previous,
    ``size`` bytes each. The all-reduce is one ``psum`` of ``size`` bytes over
    every device. Both are kept as measured points (latency on some
    interconnects is far from linear in the size), so pass the sizes a plan
    will use. Returns ``None`` on a single device. Under ``jax.distributed``
    every process must call it (it runs collectives).
    """
    import jax

    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < 2:
        return None
    runs = _comm_runs(devices, exchange_sizes, allreduce_sizes, ticks)
    return _time_comm(runs, len(devices), ticks, repeats, warmup)


class _CommRuns(NamedTuple):
    exchange: list[tuple[float, Callable[[], Any]]]  # (bytes, run of `ticks` exchanges)
    allreduce: list[tuple[float, Callable[[], Any]]]  # (bytes, run of one psum)


def _comm_runs(devices: Sequence[Any], exchange_sizes: Sequence[float], allreduce_sizes: Sequence[float],
               ticks: int) -> _CommRuns:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    mesh = Mesh(np.asarray(devices, dtype=object), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    forward = [(i, i + 1) for i in range(n - 1)]
    backward = [(i + 1, i) for i in range(n - 1)]

    def exchange(a: jax.Array) -> jax.Array:
        def tick(carry: jax.Array, _: None) -> tuple[jax.Array, None]:
            return jax.lax.ppermute(carry, "x", forward) + jax.lax.ppermute(carry, "x", backward), None

        return jax.lax.scan(tick, a, None, length=ticks)[0]

    shard = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                                check_vma=False))
    run_exchange, run_allreduce = shard(exchange), shard(lambda a: jax.lax.psum(a, "x"))

    def on(fn: Callable, size: float) -> tuple[float, Callable[[], Any]]:
        count = max(1, int(size) // 4)
        x = jax.make_array_from_callback((n * count,), sharding, lambda idx: np.ones((count,), np.float32))
        return float(size), lambda: fn(x)

    return _CommRuns([on(run_exchange, s) for s in sorted(set(exchange_sizes))],
                     [on(run_allreduce, s) for s in sorted(set(allreduce_sizes))])


def _time_comm(runs: _CommRuns, n: int, ticks: int, repeats: int, warmup: int) -> CommCost:
    times = [_mean_time(fn, repeats, warmup) / ticks for _, fn in runs.exchange] + \
            [_mean_time(fn, repeats, warmup) for _, fn in runs.allreduce]
    times = max_over_processes(times)  # every process plans from the same numbers
    exchange_points = tuple((s, t) for (s, _), t in zip(runs.exchange, times))
    allreduce_points = tuple((2.0 * s * (n - 1) / n, t) for (s, _), t in zip(runs.allreduce, times[len(runs.exchange):]))
    return CommCost(exchange_points, allreduce_points)


class Profiler:
    """A model's profile, compiled once and measured as often as wanted: :meth:`measure` times
    every part afresh and returns a :class:`Profile` (what :func:`profile` returns, which is
    ``Profiler(...).measure()``). Profiles taken at several moments -- say, in turns with
    whatever else runs -- can then be compared or averaged; the first :meth:`measure` compiles.
    Under ``jax.distributed`` every process must build it and call :meth:`measure` together.

    >>> import jax.numpy as jnp, jpipe.models
    >>> model = jpipe.models.mlp(in_dim=4, hidden=16, out_dim=1, num_layers=3)
    >>> profiler = Profiler(model, {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 1))}, comm=False,
    ...                     microbatch_sizes=[8], warmup=1)
    >>> first, again = profiler.measure(repeats=3), profiler.measure(repeats=3)
    >>> first.num_layers, again.layers[0].param_bytes == first.layers[0].param_bytes
    (3, True)
    """

    def __init__(
        self,
        model: Any,
        example_microbatch: Any,
        *,
        optimizer: Any = None,
        devices: Sequence[Any] | None = None,
        microbatch_sizes: Sequence[int] | None = None,
        repeats: int = 5,
        warmup: int = 2,
        comm: bool = True,
        seed: int = 0,
        progress: Callable[[str], None] | None = None,
    ) -> None:
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
        if microbatch_sizes is not None and any(int(s) < 1 for s in microbatch_sizes):
            raise ValueError(f"microbatch_sizes must be >= 1, got {list(microbatch_sizes)}")
        self.repeats, self.warmup = repeats, warmup
        self._progress = progress or (lambda message: None)
        self._model, self._size = model, int(size)
        self._others = sorted({int(s) for s in (microbatch_sizes or [size // 2]) if s >= 1} - {size})
        self._progress(f"profiling: compiling pre, one layer, post and a training step at micro-batch sizes "
                       f"{sorted({self._size, *self._others})} on {local[0]}")
        # one set of weights for every size and every run: they do not depend on the micro-batch's size
        params = jax.device_put(model.init_stacked(jax.random.key(seed), example_microbatch), local[0])
        microbatches = [example_microbatch, *(_resize(example_microbatch, o) for o in self._others)]
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # XLA compiles without the GIL
            parts = pool.map(lambda mb: _parts(model, params, mb, optimizer, local[0]), microbatches)
            self._parts = [part for three in parts for part in three]
        self._updates = _update_runs(params, optimizer)
        # a step at every size: what it costs beyond its parts grows with its buffers, not evenly
        self._steps = _step_runs(model, microbatches, optimizer, local[0], seed)
        self._copies = [_stash_copy_run(part.residuals, local[0]) for part in self._parts[1::3]]
        self._processes = len({d.process_index for d in devices})
        self._sharing = None
        if len(local) > 1:
            self._progress(f"profiling: compiling the layers on all {len(local)} devices of this process at once, "
                           f"and on one alone (devices that share a host slow each other down)")
            self._sharing = _sharing_runs(model, params, example_microbatch, local)
        self._comm = None
        if comm and len(devices) > 1:
            pre, layer, post = self._parts[:3]
            io = pre.cost.param_bytes + post.cost.param_bytes
            every = io + layer.cost.param_bytes * model.num_layers
            self._progress(f"profiling: compiling the activation exchange and the gradient all-reduce over "
                           f"{len(devices)} devices")
            self._comm = (
                len(devices),
                _comm_runs(devices, [], [io, (io + every) / 2, every], _EXCHANGE_TICKS),
                # the exchange as a computing tick pays it, not a tight loop of ppermutes
                [_exchange_runs(model, params, mb, devices) for mb in microbatches],
            )

    def measure(self, repeats: int | None = None, rounds: int = 1) -> Profile:
        """Times every part now (``repeats`` calls each, default the constructor's) into a :class:`Profile`;
        with ``rounds`` > 1, that many times back to back, averaged by :func:`mean_profile` (a profile
        spread over more time sees more of a machine whose speed drifts)."""
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        if rounds > 1:
            return mean_profile([self.measure(repeats) for _ in range(rounds)])
        import jax

        repeats = self.repeats if repeats is None else repeats
        self._progress(f"profiling: timing every part {repeats} times"
                       + (" with the communication" if self._comm is not None else ""))
        # the communication is timed in turns with the parts, not after them: on a shared machine what an
        # exchange costs drifts over tens of seconds (gloo on 2 CPU processes: 0.9-2.4 ms a tick at 128 KiB
        # in 5 s windows), and a profile should see it over the same span as the compute it is set against
        num_devices, comm_runs, exchange_runs = self._comm if self._comm is not None else (0, _CommRuns([], []), [])
        also = [*self._steps, *(run for _, run in self._copies), *(fn for _, fn in comm_runs.allreduce),
                *(run for _, with_exchange, without in exchange_runs for run in (with_exchange, without))]
        sharing = list(self._sharing or ())
        costs, t_also = _timed(self._parts, repeats, self.warmup, also=[*sharing, *also])
        t_sharing, t_also = t_also[:len(sharing)], t_also[len(sharing):]
        t_steps, t_also = t_also[:len(self._steps)], t_also[len(self._steps):]
        t_copies, t_comm = t_also[:len(self._copies)], t_also[len(self._copies):]
        t_allreduce, t_exchange = t_comm[:len(comm_runs.allreduce)], t_comm[len(comm_runs.allreduce):]
        # one copy of a slot: each of the loop's steps copies a slot out and back in
        per_copy = max_over_processes([t / (2 * _COPIES) for t in t_copies])
        stash_copy = [(nbytes, t) for (nbytes, _), t in zip(self._copies, per_copy)]
        curves: list[list[tuple[float, float, float]]] = [[], [], []]
        for i, other in enumerate(self._others, 1):
            for curve, cost in zip(curves, costs[3 * i:3 * i + 3]):
                curve.append((other / self._size, cost.forward, cost.backward))
        u_pre, u_layers, u_post = (_mean_time(run, repeats, self.warmup) for run in self._updates)
        updates = (u_pre, u_layers / self._model.num_layers, u_post)
        # devices of this process that compute at once share its cores: with every one computing (as a
        # tick of a full pipeline or data parallelism runs) each part takes `shared` times its time alone
        shared = 1.0 if not t_sharing else max(1.0, max_over_processes([t_sharing[0] / t_sharing[1]])[0])
        # the step of pre, the stack of layers and post at each size: what it costs beyond its parts
        stack = self._parts[1].layers
        parts = [sum(c.forward * n + c.backward * n + u * n
                     for c, u, n in zip(costs[3 * i:3 * i + 3], updates, (1, stack, 1)))
                 for i in range(len(t_steps))]
        # (measured on one device alone: with every device stepping at once it takes `shared` times longer)
        beyond = max_over_processes([max(t - p, 0.0) * shared for t, p in zip(t_steps, parts)])
        contention = shared
        if self._processes > 1:
            # the steps again, each process alone: on devices that share a machine a step can run much
            # faster when no other device computes (2 CPU processes on 2 vCPUs: 1.05-1.7x on the hosts seen)
            together = max_over_processes(t_steps)
            alone = max_over_processes(_alone_in_turns(self._steps, repeats, self.warmup))
            contention *= max(1.0, sum(together) / sum(alone))  # never faster for others computing
        step_overhead = list(zip((self._size, *self._others), beyond))
        pre, layer, post = _slowest_process([_times_scaled(cost._replace(update=u, curve=tuple(c)), shared)
                                             for cost, u, c in zip(costs[:3], updates, curves)])
        layers = tuple(layer._replace(name=f"layer_{i}") for i in range(self._model.num_layers))
        comm_cost = None
        if self._comm is not None:
            ticks = [max(t_with - t_without, 0.0) / _EXCHANGE_TICKS
                     for t_with, t_without in zip(t_exchange[::2], t_exchange[1::2])]
            worst = max_over_processes([*t_allreduce, *ticks])  # every process plans from the same numbers
            allreduce = [(2.0 * s * (num_devices - 1) / num_devices, t)
                         for (s, _), t in zip(comm_runs.allreduce, worst)]
            exchange = [(nbytes, t) for (nbytes, _, _), t in zip(exchange_runs, worst[len(t_allreduce):])]
            if len(exchange) >= 3:  # each size is a difference of two noisy times: read them off a robust line
                a, b = robust_line(exchange)
                exchange = [(x, max(0.0, a + b * x)) for x, _ in exchange]
            comm_cost = CommCost(_points(exchange), _points(allreduce))
        return Profile(layers=layers, microbatch_size=self._size, pre=pre, post=post, comm=comm_cost,
                       name=type(self._model).__name__, backend=jax.default_backend(),
                       step_overhead=step_overhead, stash_copy=stash_copy, contention=contention)


def profile(
    model: Any,
    example_microbatch: Any,
    *,
    optimizer: Any = None,
    devices: Sequence[Any] | None = None,
    microbatch_sizes: Sequence[int] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    comm: bool = True,
    seed: int = 0,
    rounds: int = 1,
    progress: Callable[[str], None] | None = None,
) -> Profile:
    """Measures a :class:`jpipe.Staged` model on the current backend.

    Per part (``pre``, one ``layer`` -- every layer is the same module -- and
    ``post`` with the loss): forward and backward seconds (:func:`robust_mean` of
    ``repeats`` after ``warmup`` runs, each synchronised with
    ``block_until_ready``; every part at every size timed in turns, a few calls
    at a time, so that a drift in the machine's speed does not bend the curve
    over the sizes) at
    the example micro-batch and at every size in
    ``microbatch_sizes`` (default: the example's and half of it; rows are
    repeated for sizes above the example's), so that :meth:`Profile.scaled`
    interpolates between measured sizes instead of assuming times linear in
    the batch; the optimizer step on each part's weights (``optimizer``
    default ``optax.adam``); output activation, residual, parameter and
    optimizer-state bytes; and what a training step costs beyond its parts
    at each size (``step_overhead``: ``jpipe.train_step`` of pre, the timed stack of
    layers and post on one device, in turns with the parts, less their times); and what
    copying one slot of a residual stash costs at each size (``stash_copy``: a
    loop of slot-to-slot copies of the timed stack's residuals). With
    ``comm``, also, over ``devices``, what a tick's exchange of each size's
    activations adds to a tick that runs a stage's forward (a scan of ticks
    timed with and without the ppermutes; with three sizes or more, read off a
    :func:`robust_line` through them), and the all-reduce at the gradient
    sizes a plan reduces, both in turns with the parts. Under
    ``jax.distributed`` every process must call it: each times its own first
    device, and every time in the result is the slowest process's (a lock-step
    step waits for it), the same profile on every process; with more than one
    process, the training steps are timed once more with each process alone in
    turns (the others wait at a barrier), and the ratio is ``contention``. Where a process holds
    more than one of ``devices`` (simulated CPU devices share its cores), the timed stack's
    forward and backward also runs on all of them at once and on one alone: every time is
    scaled by that ratio (the times of a tick in which every device computes) and
    ``contention`` includes it. With ``rounds`` > 1,
    the mean (:func:`mean_profile`) of that many profiles taken back to back: on
    a shared machine an exchange's cost drifts over tens of seconds, and one
    profile of a few seconds can miss a long run's mean by 2x. ``progress``, if given, is called
    with a line before each phase (what it compiles, what it times).

    >>> import jax.numpy as jnp, jpipe.models
    >>> model = jpipe.models.mlp(in_dim=4, hidden=16, out_dim=1, num_layers=3)
    >>> mb = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 1))}
    >>> p = profile(model, mb, repeats=3, warmup=1, comm=False, microbatch_sizes=[8])
    >>> p.num_layers, p.microbatch_size, p.layers[0].param_bytes
    (3, 8, 1088.0)
    """
    return Profiler(model, example_microbatch, optimizer=optimizer, devices=devices,
                    microbatch_sizes=microbatch_sizes, repeats=repeats, warmup=warmup, comm=comm,
                    seed=seed, progress=progress).measure(rounds=rounds)
