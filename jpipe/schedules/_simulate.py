"""Time a schedule table under a cost model: makespan, bubble, busy time and memory.

Two timing models, both driven by the same :class:`~jpipe.schedules.Table`:

``"lockstep"``
    What jpipe's SPMD executor does: tick ``t`` starts on every device at once
    and ends when its slowest action has finished and the tick's activations and
    cotangents have moved one hop (``comm`` seconds, charged to every tick when
    there is more than one device). A device whose action is shorter than the
    tick's slowest one waits. In a two-lane table (:func:`~jpipe.schedules.fuse_ticks`)
    a device runs its forward and then its backward within the tick, and the
    tick lasts as long as the busiest device's sum. With ``Costs.contention``,
    the actions of a tick in which ``k`` devices compute take
    ``contention[k - 1]`` times their cost: on devices that share a resource
    (two CPU processes on cores that slow each other down) a tick in which one
    device computes alone runs faster than one in which all do.
``"async"``
    What an MPMD runtime (one program per device, point-to-point sends) does:
    each device runs its actions in the table's order, each as soon as the
    device is free and the action's inputs have arrived (the producer's end plus
    ``comm`` when the producer sits on another device). Only the per-device
    order of the table matters here, not its ticks.

**Bubble.** ``bubble_fraction = idle device-time / total device-time`` with
total device-time ``P x makespan`` and idle the part of it in which a device
runs no action. Under lock-step, a device is busy only for its own action's
duration: time spent waiting for a slower neighbour to finish the tick, or for
the tick's communication, is idle. With uniform ``F = B`` (``W = 0``) and
``comm = 0`` every action lasts exactly one tick, so the bubble is the share
of idle cells in the table: GPipe and 1F1B take ``2(M + P - 1)`` ticks, each
device is busy in ``2M`` of them, and the bubble is exactly
``(P - 1) / (M + P - 1)``; interleaved 1F1B with per-chunk costs ``F / v``
takes ``2(vM + P - 1)`` ticks and gives ``(P - 1) / (vM + P - 1)``.

**Costs** are per *virtual* stage (``P x v`` of them; scalars broadcast). In a
table that splits backwards, ``B`` costs ``backward`` and ``W`` costs
``weight``; in one that does not, ``B`` computes both and costs
``backward + weight``. ``weight=None`` means 0: all backward time is in
``backward``.

**Memory.** ``peak_held[d]``: the most (micro-batch, virtual stage) pairs on
device ``d`` whose forward has run and whose last backward action (``B``, or
``W`` when split) has not. It depends only on each device's order, so both
modes give the same value. ``peak_bytes[d]`` weighs each held pair by the
stage's ``activation_bytes``.

>>> from jpipe.schedules import one_f_one_b, simulate, Costs
>>> r = simulate(one_f_one_b(4, 8), Costs(forward=1.0, backward=1.0))
>>> r.makespan, round(r.bubble_fraction, 4), r.peak_held.tolist()
(22.0, 0.2727, [4, 3, 2, 1])
>>> simulate(one_f_one_b(4, 8), Costs(1.0, 2.0), mode="async").makespan
33.0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jpipe.schedules._table import Action, ScheduleError, Table

MODES = ("lockstep", "async")

CostValue = float | Sequence[float] | np.ndarray


class Costs(NamedTuple):
    """Durations (seconds) per virtual stage and per-hop communication time.

    ``forward``, ``backward``, ``weight`` and ``activation_bytes`` are a scalar
    (every virtual stage the same) or one value per virtual stage.
    ``contention`` (lock-step only) has one factor per number of devices computing
    at once: ``contention[k - 1]`` scales the actions of a tick in which ``k``
    devices run one (``None``: 1 for every ``k``).

    >>> Costs(forward=1.0, backward=2.0).weight is None
    True
    """

    forward: CostValue
    backward: CostValue
    weight: CostValue | None = None
    comm: float = 0.0
    activation_bytes: CostValue | None = None
    contention: Sequence[float] | None = None


class SimResult(NamedTuple):
    """What :func:`simulate` predicts for one table.

    ``busy``, ``peak_held`` and ``peak_bytes`` are per device; ``start`` and
    ``end`` map every :class:`Action` to its start and end time in seconds.
    """

    makespan: float
    bubble_fraction: float
    busy: np.ndarray
    peak_held: np.ndarray
    peak_bytes: np.ndarray | None
    start: dict[Action, float]
    end: dict[Action, float]
    mode: str

    @property
    def idle(self) -> np.ndarray:
        """Per device, seconds within the makespan in which the device runs nothing."""
        return self.makespan - self.busy


def _per_stage(value: CostValue | None, num_stages: int, name: str) -> np.ndarray:
    if value is None:
        return np.zeros(num_stages)
    arr = np.asarray(value, dtype=float)
    if arr.ndim == 0:
        arr = np.full(num_stages, float(arr))
    if arr.shape != (num_stages,):
        raise ValueError(
            f"Costs.{name} has {arr.size} values but the table has {num_stages} virtual stages "
            f"(devices x chunks); give a scalar or one value per virtual stage")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"Costs.{name} must be finite and non-negative, got {arr.tolist()}")
    return arr


def action_costs(table: Table, costs: Costs) -> dict[str, np.ndarray]:
    """Per-kind, per-virtual-stage durations the simulator charges (``{"F", "B", "W"}``).

    >>> from jpipe.schedules import gpipe
    >>> action_costs(gpipe(2, 1), Costs(1.0, 2.0, weight=0.5))["B"].tolist()
    [2.5, 2.5]
    """
    S = table.num_stages
    f = _per_stage(costs.forward, S, "forward")
    b = _per_stage(costs.backward, S, "backward")
    w = _per_stage(costs.weight, S, "weight")
    if table.splits_backward:
        return {"F": f, "B": b, "W": w}
    return {"F": f, "B": b + w, "W": w}


def _deps(a: Action, num_stages: int) -> list[Action]:
    if a.kind == "F":
        return [Action("F", a.microbatch, a.stage - 1)] if a.stage > 0 else []
    if a.kind == "W":
        return [Action("B", a.microbatch, a.stage)]
    deps = [Action("F", a.microbatch, a.stage)]
    if a.stage < num_stages - 1:
        deps.append(Action("B", a.microbatch, a.stage + 1))
    return deps


def _lockstep(table: Table, dur: dict[str, np.ndarray], comm: float, contention: np.ndarray | None = None):
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    hop = comm if table.num_devices > 1 else 0.0
    now = 0.0
    for t in range(table.num_ticks):
        rows = range(t * table.lanes, (t + 1) * table.lanes)
        actions = [[a for r in rows if (a := table.action(r, d)) is not None] for d in range(table.num_devices)]
        computing = sum(1 for acts in actions if acts)
        scale = 1.0 if contention is None or not computing else float(contention[computing - 1])
        longest = 0.0
        for acts in actions:
            at = now  # a device runs its lanes one after the other
            for a in acts:
                c = float(dur[a.kind][a.stage]) * scale
                start[a], end[a] = at, at + c
                at += c
            longest = max(longest, at - now)
        now += longest + hop
    return now, start, end


def _async(table: Table, dur: dict[str, np.ndarray], comm: float):
    P, S = table.num_devices, table.num_stages
    orders = table.orders()
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    free = [0.0] * P
    pos = [0] * P
    progress = True
    while progress:
        progress = False
        for d in range(P):
            while pos[d] < len(orders[d]):
                a = orders[d][pos[d]]
                deps = _deps(a, S)
                if any(dep not in end for dep in deps):
                    break
                ready = max([free[d]] + [end[dep] + (comm if dep.stage % P != d else 0.0) for dep in deps])
                start[a], end[a] = ready, ready + float(dur[a.kind][a.stage])
                free[d] = end[a]
                pos[d] += 1
                progress = True
    if any(p < len(o) for p, o in zip(pos, orders)):
        stuck = [f"device {d} at {orders[d][pos[d]]}" for d in range(P) if pos[d] < len(orders[d])]
        raise ScheduleError(f"schedule {table.name!r} deadlocks when run asynchronously: " + ", ".join(stuck))
    return max(end.values(), default=0.0), start, end


def _memory(table: Table, activation_bytes: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    last = "W" if table.splits_backward else "B"
    held = np.zeros(table.num_devices, dtype=int)
    peak_bytes = np.zeros(table.num_devices) if activation_bytes is not None else None
    for d, order in enumerate(table.orders()):
        live, live_bytes = 0, 0.0
        for a in order:
            if a.kind == "F":
                live += 1
                held[d] = max(held[d], live)
                if peak_bytes is not None:
                    live_bytes += float(activation_bytes[a.stage])
                    peak_bytes[d] = max(peak_bytes[d], live_bytes)
            elif a.kind == last:
                live -= 1
                if peak_bytes is not None:
                    live_bytes -= float(activation_bytes[a.stage])
    return held, peak_bytes


def simulate(table: Table, costs: Costs, mode: str = "lockstep") -> SimResult:
    """Times ``table`` under ``costs`` in the ``"lockstep"`` (SPMD) or ``"async"`` (MPMD) model.

    >>> from jpipe.schedules import gpipe
    >>> r = simulate(gpipe(4, 4), Costs(forward=1.0, backward=1.0))
    >>> r.makespan, round(r.bubble_fraction, 4), r.busy.tolist(), r.peak_held.tolist()
    (14.0, 0.4286, [8.0, 8.0, 8.0, 8.0], [4, 4, 4, 4])
    """
    if mode not in MODES:
        raise ValueError(f"unknown simulation mode {mode!r}; choose 'lockstep' or 'async'")
    if not isinstance(costs, Costs):
        raise TypeError(f"costs must be a jpipe.schedules.Costs, got {type(costs).__name__}")
    comm = float(costs.comm)
    if not np.isfinite(comm) or comm < 0:
        raise ValueError(f"Costs.comm must be finite and non-negative, got {costs.comm!r}")
    contention = None
    if costs.contention is not None:
        if mode != "lockstep":
            raise ValueError("Costs.contention is a lock-step model (devices compute tick by tick); "
                             "simulate with mode='lockstep' or leave it None")
        contention = np.asarray(costs.contention, dtype=float)
        if contention.shape != (table.num_devices,) or not np.all(np.isfinite(contention)) or np.any(contention <= 0):
            raise ValueError(f"Costs.contention needs one positive factor per number of devices computing at once "
                             f"(1..{table.num_devices}), got {np.asarray(costs.contention).tolist()}")
    dur = action_costs(table, costs)
    act_bytes = (None if costs.activation_bytes is None
                 else _per_stage(costs.activation_bytes, table.num_stages, "activation_bytes"))
    if mode == "lockstep":
        makespan, start, end = _lockstep(table, dur, comm, contention)
    else:
        makespan, start, end = _async(table, dur, comm)
    busy = np.zeros(table.num_devices)
    for a, s in start.items():
        busy[a.stage % table.num_devices] += end[a] - s
    total = table.num_devices * makespan
    bubble = float(1.0 - busy.sum() / total) if total > 0 else 0.0
    held, peak_bytes = _memory(table, act_bytes)
    return SimResult(float(makespan), bubble, busy, held, peak_bytes, start, end, mode)
