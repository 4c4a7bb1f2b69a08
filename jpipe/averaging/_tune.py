"""The AvgPipe tuner: pick the number of pipelines N and of micro-batches M.

For candidate ``(N, M)`` pairs, :func:`tune` builds the N-pipeline training
step (:func:`jpipe.averaging.init`), compiles it once, reads its exact
per-device memory from XLA and times it on the actual backend. Candidates it
does not measure are predicted from the measured ones with the schedule
simulator (:func:`jpipe.schedules.simulate`, lock-step timing):

* time: every stage's forward costs ``f = a + c * w`` per tick, where ``w =
  N * B / M`` is the samples one tick processes on one device (its N
  pipelines batched together; every data replica runs N pipelines of its
  own), and its backward ``2 f``; the simulator turns
  that into a makespan ``K(M) * f``. ``step_time = K * a + K * w * c + o``,
  with ``a, c, o >= 0`` fitted by least squares to the measured steps.
* memory: ``bytes = m0 + m1 * N + m2 * N * (B / M) * held(M)``, with
  ``held`` the schedule's peak micro-batches per device (parameters and
  optimizer state grow with N, activations with N x micro-batch x held).

The choice is the candidate with the highest *measured* throughput (samples
per second, N x data x B per step) among those that fit ``memory_limit``: after
predicting, the tuner measures the best predicted candidate that fits until
that one has been measured.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jpipe._mesh import DATA, PIPE
from jpipe._model import PyTree, Staged
from jpipe._plan import Plan
from jpipe._state import batch_size_of
from jpipe._train import train_step
from jpipe.averaging._elastic import ElasticAveraging
from jpipe.averaging._ensemble import init as _avg_init
from jpipe.averaging._ensemble import stack_batches
from jpipe.schedules import Costs, get_schedule, simulate


class TuneRow(NamedTuple):
    """One candidate: measured or predicted step time and per-device memory."""

    pipelines: int
    microbatches: int
    measured: bool
    step_time: float  # seconds per step (measured median, or predicted)
    samples_per_s: float  # pipelines x data x per-pipeline batch / step_time
    memory: int  # per-device bytes: temp + arguments + outputs - aliased (measured or predicted)
    bubble: float  # the schedule's lock-step bubble fraction (simulator)
    fits: bool


class TuneResult(NamedTuple):
    """What :func:`tune` chose (``plan`` and ``pipelines``) and every candidate's row."""

    plan: Plan
    pipelines: int
    best: TuneRow
    rows: list[TuneRow]

    def __str__(self) -> str:
        head = f"{'N':>3} {'M':>4} {'source':>9} {'step ms':>9} {'samples/s':>10} {'MiB':>8} {'bubble':>7} fits"
        lines = [head]
        for r in sorted(self.rows, key=lambda r: (r.pipelines, r.microbatches)):
            mark = " <- chosen" if r is self.best else ""
            lines.append(f"{r.pipelines:>3} {r.microbatches:>4} {'measured' if r.measured else 'predicted':>9} "
                         f"{1e3 * r.step_time:>9.2f} {r.samples_per_s:>10.1f} {r.memory / 2**20:>8.2f} "
                         f"{r.bubble:>7.3f} {'yes' if r.fits else 'no'}{mark}")
        return "\n".join(lines)


def _mesh_shape(mesh_or_devices: Mesh | Sequence[jax.Device]) -> tuple[int, int, list]:
    if isinstance(mesh_or_devices, Mesh):
        if tuple(mesh_or_devices.axis_names) != (PIPE, DATA):
            raise ValueError(f"the mesh must have axes ('pipe', 'data'), got {mesh_or_devices.axis_names}")
        return (mesh_or_devices.shape[PIPE], mesh_or_devices.shape[DATA],
                list(np.asarray(mesh_or_devices.devices).reshape(-1)))
    devices = list(mesh_or_devices)
    if not devices:
        raise ValueError("tune needs a mesh or a non-empty sequence of devices")
    return len(devices), 1, devices  # a plain device list: one pipeline stage per device


def default_candidates(pipe: int, data: int, batch_size: int) -> list[tuple[int, int]]:
    """``N`` in 1, 2, 4 and ``M`` in ``pipe``, ``2 pipe``, ``4 pipe`` (those that divide the per-pipeline batch).

    ``data`` does not restrict M: every data replica runs whole pipelines of its own.

    >>> default_candidates(pipe=2, data=1, batch_size=8)
    [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (2, 8), (4, 2), (4, 4), (4, 8)]
    """
    del data
    ms = [m for m in (pipe, 2 * pipe, 4 * pipe) if batch_size % m == 0]
    return [(n, m) for n, m in itertools.product((1, 2, 4), ms)]


def _fit_nonneg(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients, by trying the subsets of columns."""
    k = features.shape[1]
    best, best_err = np.zeros(k), np.inf
    for size in range(min(k, len(target)), 0, -1):
        for cols in itertools.combinations(range(k), size):
            coef, *_ = np.linalg.lstsq(features[:, cols], target, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(k)
            full[list(cols)] = coef
            err = float(np.sum((features @ full - target) ** 2))
            if err < best_err - 1e-12 * max(1.0, best_err):
                best, best_err = full, err
    return best


def _measure(model, plan, optimizer, batch, n, averaging, devices, repeats) -> tuple[float, int]:
    ens_batch = stack_batches([batch] * (n * plan.data))  # N pipelines on each data replica
    state = _avg_init(model, plan, optimizer, ens_batch, pipelines=n, averaging=averaging,
                      rng=jax.random.key(0), devices=devices)
    compiled = train_step.lower(state, ens_batch).compile()
    mem = compiled.memory_analysis()
    memory = int(mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
                 - mem.alias_size_in_bytes)
    state, metrics = compiled(state, ens_batch)  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = compiled(state, ens_batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times), memory


def _first_measured(cands: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The candidates measured before any prediction: all of up to four, else the grid's corners."""
    if len(cands) <= 4:
        return cands
    ns, ms = sorted({c[0] for c in cands}), sorted({c[1] for c in cands})
    corners = [(ns[0], ms[0]), (ns[0], ms[-1]), (ns[-1], ms[0]), (ns[-1], ms[-1])]
    return [c for c in corners if c in cands] or cands[:1]


def _rows(cands: list[tuple[int, int]], measured: dict[tuple[int, int], tuple[float, int]],
          features: Callable[[int, int], tuple[list[float], list[float]]], sims: dict[int, Any],
          samples_per_pipeline: int) -> list[TuneRow]:
    """Every candidate's row: measured where it was, else predicted by a non-negative least-squares
    fit of the measured times and memories on ``features`` (``fits`` left ``True``)."""
    keys = list(measured)
    t_coef = _fit_nonneg(np.array([features(*c)[0] for c in keys]), np.array([measured[c][0] for c in keys]))
    m_coef = _fit_nonneg(np.array([features(*c)[1] for c in keys]),
                         np.array([measured[c][1] for c in keys], dtype=float))
    rows = []
    for n, m in cands:
        if (n, m) in measured:
            t, mem = measured[(n, m)]
        else:
            t = float(np.dot(features(n, m)[0], t_coef))
            mem = round(float(np.dot(features(n, m)[1], m_coef)))
        rows.append(TuneRow(n, m, (n, m) in measured, t, n * samples_per_pipeline / t if t > 0 else float("inf"),
                            mem, float(sims[m].bubble_fraction), True))
    return rows


def tune(
    model: Staged,
    mesh_or_devices: Mesh | Sequence[jax.Device],
    example_batch: PyTree,
    candidates: Sequence[tuple[int, int]] | None = None,
    memory_limit: int | None = None,
    *,
    optimizer: optax.GradientTransformation | None = None,
    schedule: str = "advance-forward",
    averaging: ElasticAveraging | None = None,
    measure: Sequence[tuple[int, int]] | None = None,
    repeats: int = 3,
) -> TuneResult:
    """Picks ``(N pipelines, M micro-batches)`` by measured throughput within ``memory_limit``.

    ``example_batch`` is one pipeline's batch (``B`` samples; a step of N
    pipelines on each of ``data`` replicas trains on ``N x data x B``).
    ``mesh_or_devices`` is a ``(pipe, data)`` mesh, or a list of devices used
    as ``pipe = len(devices)``, ``data = 1``.
    ``candidates`` are ``(N, M)`` pairs (default :func:`default_candidates`);
    ``measure`` the ones to measure first (default: all of them when there are
    at most four, else the corners of the grid); the rest are predicted, and
    the best predicted one that fits is measured until the choice is a
    measured candidate. ``memory_limit`` is per-device bytes (``None``: no
    limit). Returns a :class:`TuneResult`; ``str(result)`` is its table.
    """
    pipe, data, devices = _mesh_shape(mesh_or_devices)
    optimizer = optax.sgd(1e-3) if optimizer is None else optimizer
    batch_size = batch_size_of(example_batch)
    cands = [tuple(map(int, c)) for c in (candidates or default_candidates(pipe, data, batch_size))]
    bad = [c for c in cands if c[0] < 1 or c[1] < 1 or batch_size % c[1]]
    if bad:
        raise ValueError(f"candidates {bad} do not fit: N and M must be >= 1 and the per-pipeline batch "
                         f"({batch_size}) divisible by M")
    if not cands:
        raise ValueError("no candidate (N, M) pairs to tune over")
    make = get_schedule(schedule)
    sims = {m: simulate(make(pipe, m), Costs(forward=1.0, backward=2.0)) for m in {m for _, m in cands}}

    def features(n: int, m: int) -> tuple[list[float], list[float]]:
        k, w = sims[m].makespan, n * batch_size / m
        held = float(np.max(sims[m].peak_held))
        return [k, k * w, 1.0], [1.0, n, w * held]

    measure = _first_measured(cands) if measure is None else measure
    measured: dict[tuple[int, int], tuple[float, int]] = {}

    def run(c: tuple[int, int]) -> None:
        plan = Plan(pipe=pipe, data=data, microbatches=c[1], schedule=schedule)
        measured[c] = _measure(model, plan, optimizer, example_batch, c[0], averaging, devices, repeats)

    for c in measure:
        run(tuple(c))

    def fits(mem: float) -> bool:
        return memory_limit is None or mem <= memory_limit

    while True:
        rows = [row._replace(fits=fits(row.memory))
                for row in _rows(cands, measured, features, sims, data * batch_size)]
        fitting = [r for r in rows if r.fits]
        if not fitting:
            raise ValueError(f"no candidate fits memory_limit={memory_limit} bytes per device; the smallest "
                             f"needs {min(r.memory for r in rows)} bytes\n" + str(TuneResult(None, 0, None, rows)))
        top = max(fitting, key=lambda r: r.samples_per_s)
        if top.measured:
            break
        run((top.pipelines, top.microbatches))  # confirm the best prediction on the backend
    best = max((r for r in rows if r.measured and r.fits), key=lambda r: r.samples_per_s)
    plan = Plan(pipe=pipe, data=data, microbatches=best.microbatches, schedule=schedule)
    return TuneResult(plan, best.pipelines, best, rows)


__all__: list[Any] = ["TuneResult", "TuneRow", "default_candidates", "tune"]
