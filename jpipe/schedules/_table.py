"""Schedule tables: what every device does at every tick, and where data waits.

A schedule starts as per-device *orders* (like torch.distributed.pipelining's
per-rank action lists). :func:`table_from_orders` times them in lock-step --
the way one SPMD program executes them: in tick ``t`` every device runs at most
one action, then activations move one device forward and cotangents one device
back, arriving for tick ``t + 1`` -- and assigns buffer slots from liveness.

With ``lanes=2`` (:func:`fuse_ticks`) a tick has two lanes that run one after
the other on each device before the tick's communication: lane 0 may run one
forward and lane 1 one backward (``B`` or ``W``). Steady-state 1F1B then costs
``F + B`` per tick instead of ``2 max(F, B)``, and the tick count roughly
halves; a device may hold one more micro-batch (the forward of a tick runs
before the backward that frees a slot). Row ``t * lanes + l`` of the arrays is
lane ``l`` of tick ``t``.

The resulting :class:`Table` is plain data (numpy arrays, no JAX): the executor
interprets it, the validator checks it, the simulator times it and the
renderers draw it.

Virtual stage ``k`` lives on device ``k % P`` as its chunk ``k // P`` (one chunk
per device unless the schedule interleaves). Activations flow from stage ``k``
to ``k + 1`` and cotangents from ``k + 1`` back to ``k``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
KIND_NAMES = {IDLE: ".", FORWARD: "F", BACKWARD: "B", WEIGHT: "W"}
_KIND_CODES = {"F": FORWARD, "B": BACKWARD, "W": WEIGHT}

NO_SLOT = -1

# Column order of Table.as_array(); the executor reads rows by these indices.
FIELDS = (
    "kind",  # IDLE / FORWARD / BACKWARD / WEIGHT
    "microbatch",  # micro-batch index of the action (0 when idle)
    "chunk",  # which of the device's chunks (virtual stages) the action runs
    "in_slot",  # input buffer slot the action reads (NO_SLOT: reads the batch)
    "res_slot",  # residual slot F writes and B (and W) read (stash of the forward)
    "cot_slot",  # cotangent slot B (and W) read; F of the last stage writes its loss gradient here
    "recv_in_slot",  # where the activation arriving at the end of this tick is stored (last lane's row)
    "recv_cot_slot",  # where the cotangent arriving at the end of this tick is stored (last lane's row)
)


class Action(NamedTuple):
    """One unit of work on one micro-batch and one (virtual) stage.

    ``F`` is the forward, ``B`` the backward. A schedule may split the backward:
    then ``B`` computes only the input gradient (what the previous stage waits
    for) and ``W`` the weight gradient, which can be deferred into bubbles.

    >>> Action("F", microbatch=0, stage=1)
    Action(kind='F', microbatch=0, stage=1)
    """

    kind: str
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


class ScheduleError(ValueError):
    """A schedule table that cannot execute correctly; the message names tick, device and micro-batch."""


@dataclasses.dataclass(frozen=True, eq=False)
class Table:
    """A lock-step schedule: ``[row, device]`` arrays of actions and buffer slots.

    Row ``t * lanes + l`` is lane ``l`` of tick ``t`` (with one lane, rows are
    ticks). Build one with a generator (``jpipe.schedules.one_f_one_b(4, 8)``)
    or with :func:`table_from_orders`; check one with
    :func:`jpipe.schedules.validate`.
    """

    name: str
    num_devices: int
    num_chunks: int
    num_microbatches: int
    kind: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    in_slot: np.ndarray
    res_slot: np.ndarray
    cot_slot: np.ndarray
    recv_in_slot: np.ndarray
    recv_cot_slot: np.ndarray
    lanes: int = 1

    @property
    def num_rows(self) -> int:
        """Rows of the arrays: ``num_ticks * lanes``."""
        return int(self.kind.shape[0])

    @property
    def num_ticks(self) -> int:
        """Lock-step ticks: each ends with one hop of communication in each direction."""
        return self.num_rows // self.lanes

    @property
    def splits_backward(self) -> bool:
        """Whether backwards are split into B (input gradient) and W (weight gradient)."""
        return bool((self.kind == WEIGHT).any())

    @property
    def num_stages(self) -> int:
        """Number of virtual stages (devices x chunks)."""
        return self.num_devices * self.num_chunks

    def stage_of(self, device: int, chunk: int) -> int:
        return chunk * self.num_devices + device

    def action(self, row: int, device: int) -> Action | None:
        """What ``device`` runs in ``row`` (a tick, or lane ``row % lanes`` of tick ``row // lanes``)."""
        kind = int(self.kind[row, device])
        if kind == IDLE:
            return None
        stage = self.stage_of(device, int(self.chunk[row, device]))
        return Action(KIND_NAMES[kind], int(self.microbatch[row, device]), stage)

    def orders(self) -> list[list[Action]]:
        """Per-device action lists in execution order (the torch-style view)."""
        return [
            [a for r in range(self.num_rows) if (a := self.action(r, d)) is not None]
            for d in range(self.num_devices)
        ]

    def _depth(self, *fields: np.ndarray) -> int:
        return int(max((int(f.max(initial=NO_SLOT)) for f in fields), default=NO_SLOT)) + 1

    @property
    def in_depth(self) -> int:
        """Input-buffer slots a device needs: the most stage inputs it holds at once."""
        return self._depth(self.in_slot, self.recv_in_slot)

    @property
    def res_depth(self) -> int:
        """Residual slots a device needs: the most forwards awaiting their backward."""
        return self._depth(self.res_slot)

    @property
    def cot_depth(self) -> int:
        return self._depth(self.cot_slot, self.recv_cot_slot)

    def held_microbatches(self) -> np.ndarray:
        """Per device, the peak number of micro-batches whose forward ran and whose backward
        (its W, when backwards are split) has not."""
        done = WEIGHT if self.splits_backward else BACKWARD
        held = np.zeros(self.num_devices, dtype=int)
        live = np.zeros(self.num_devices, dtype=int)
        for r in range(self.num_rows):
            live += self.kind[r] == FORWARD
            held = np.maximum(held, live)
            live -= self.kind[r] == done
        return held

    def as_array(self) -> np.ndarray:
        """``int32[ticks, lanes, devices, len(FIELDS)]``, the form the executor scans over."""
        rows = np.stack([getattr(self, f) for f in FIELDS], axis=-1).astype(np.int32)
        return rows.reshape(self.num_ticks, self.lanes, self.num_devices, len(FIELDS))

    def __repr__(self) -> str:
        lanes = f", lanes={self.lanes}" if self.lanes > 1 else ""
        return (
            f"Table({self.name!r}, devices={self.num_devices}, chunks={self.num_chunks}, "
            f"microbatches={self.num_microbatches}, ticks={self.num_ticks}{lanes})"
        )

    def __str__(self) -> str:
        from jpipe.schedules._render import ascii_gantt

        return ascii_gantt(self)


def _parse_action(a: Action | tuple | str) -> Action:
    if isinstance(a, Action):
        return a
    if isinstance(a, tuple):
        return Action(*a)
    raise TypeError(f"expected an Action or (kind, microbatch, stage) tuple, got {a!r}")


def table_from_orders(
    orders: Sequence[Sequence[Action]],
    num_microbatches: int,
    *,
    num_chunks: int = 1,
    name: str = "custom",
    lanes: int = 1,
) -> Table:
    """Times per-device action orders in lock-step and assigns buffer slots.

    Each device runs its actions in the given order, each at the first tick at
    which its inputs have arrived. Slots are reused as soon as they are free, so
    buffer depth follows the schedule's liveness, not ``num_microbatches``.

    With ``lanes=2`` a tick runs the longest prefix of a device's remaining
    order that puts at most one forward in lane 0 and one ``B``/``W`` in lane 1
    (see :func:`fuse_ticks`).

    >>> orders = [[Action("F", 0, 0), Action("B", 0, 0)], [Action("F", 0, 1), Action("B", 0, 1)]]
    >>> table_from_orders(orders, num_microbatches=1).num_ticks
    4
    >>> table_from_orders(orders, num_microbatches=1, lanes=2).num_ticks  # F0 and B0 share a tick on d1
    3
    """
    num_devices = len(orders)
    if num_devices < 1:
        raise ScheduleError("a schedule needs at least one device")
    if lanes not in (1, 2):
        raise ScheduleError(f"lanes must be 1 (one action per tick) or 2 (one forward and one backward "
                            f"per tick), got {lanes!r}")
    orders = [[_parse_action(a) for a in order] for order in orders]
    num_stages = num_devices * num_chunks
    _check_orders(orders, num_microbatches, num_chunks)

    def lane_of(a: Action) -> int:
        return 0 if lanes == 1 or a.kind == "F" else 1

    ran: dict[tuple[str, int, int], tuple[int, int]] = {}  # (kind, microbatch, stage) -> (tick, lane)
    position = [0] * num_devices
    ticks: list[list[list[Action | None]]] = []  # [tick][lane][device]
    total = sum(len(o) for o in orders)
    while len(ran) < total:
        tick = len(ticks)
        cells: list[list[Action | None]] = [[None] * num_devices for _ in range(lanes)]
        for d in range(num_devices):
            # the longest prefix of the device's order that fits the tick's free lanes
            while position[d] < len(orders[d]):
                a = orders[d][position[d]]
                lane = lane_of(a)
                if cells[lane][d] is not None or not _ready(a, ran, tick, lane, num_stages):
                    break
                cells[lane][d] = a
                ran[(a.kind, a.microbatch, a.stage)] = (tick, lane)
                position[d] += 1
        if all(a is None for lane in cells for a in lane):
            waiting = [
                f"device {d} waits to run {orders[d][position[d]]} "
                f"({_missing(orders[d][position[d]], ran, num_stages)})"
                for d in range(num_devices)
                if position[d] < len(orders[d])
            ]
            raise ScheduleError(
                f"schedule {name!r} deadlocks at tick {tick}: " + "; ".join(waiting)
                + ". Reorder the actions so that every dependency runs earlier."
            )
        ticks.append(cells)
    rows = [lane for cells in ticks for lane in cells]
    return _assign_slots(rows, num_devices, num_chunks, num_microbatches, name, lanes)


def fuse_ticks(table: Table) -> Table:
    """Re-times ``table``'s per-device orders with two lanes per tick: one forward and one backward.

    Under lock-step a one-lane tick lasts as long as its slowest action, so in
    1F1B's steady state (neighbours running F and B in the same tick) every
    tick costs ``max(F, B)`` and a micro-batch ``2 max(F, B)``. A fused tick
    runs a device's next forward and next backward together, costing ``F + B``:
    fewer, fuller ticks (and half the per-tick communication and overhead) for
    at most one more held micro-batch per device.

    A fused tick needs more forwards in flight to stay full: the cotangent of a
    stage's forward comes back ``2(P - 1 - s) + 1`` ticks later, so 1F1B's
    warm-up of ``P - s`` stalls while DAPPLE's policy B (``2(P - s) - 1``,
    ``"1f1b-b"``) keeps every fused tick busy and reaches the asynchronous
    makespan under lock-step.

    >>> from jpipe.schedules import Costs, one_f_one_b, one_f_one_b_policy_b, simulate
    >>> a, b = one_f_one_b(4, 8), one_f_one_b_policy_b(4, 8)
    >>> [(t.num_ticks, fuse_ticks(t).num_ticks) for t in (a, b)]
    [(22, 17), (22, 14)]
    >>> [simulate(t, Costs(forward=1.0, backward=2.0)).makespan for t in (a, fuse_ticks(b))]
    [40.0, 33.0]
    >>> a.held_microbatches().tolist(), fuse_ticks(b).held_microbatches().tolist()
    ([4, 3, 2, 1], [7, 5, 3, 1])
    """
    if table.lanes == 2:
        return table
    return table_from_orders(table.orders(), table.num_microbatches, num_chunks=table.num_chunks,
                             name=table.name, lanes=2)


def _check_orders(orders: list[list[Action]], num_microbatches: int, num_chunks: int) -> None:
    num_devices = len(orders)
    num_stages = num_devices * num_chunks
    kinds = "FBW" if any(a.kind == "W" for order in orders for a in order) else "FB"
    expected = {
        (kind, mb, k) for kind in kinds for mb in range(num_microbatches) for k in range(num_stages)
    }
    seen: set[tuple[str, int, int]] = set()
    for d, order in enumerate(orders):
        for a in order:
            key = (a.kind, a.microbatch, a.stage)
            if a.kind not in _KIND_CODES:
                raise ScheduleError(f"device {d}: unknown action kind {a.kind!r} (use 'F', 'B' or 'W')")
            if not 0 <= a.microbatch < num_microbatches:
                raise ScheduleError(
                    f"device {d}: {a} names micro-batch {a.microbatch}, "
                    f"outside 0..{num_microbatches - 1}"
                )
            if not 0 <= a.stage < num_stages or a.stage % num_devices != d:
                raise ScheduleError(
                    f"device {d}: {a} names stage {a.stage}, which lives on device "
                    f"{a.stage % num_devices} (stage k runs on device k % {num_devices})"
                )
            if key in seen:
                raise ScheduleError(f"device {d}: {a} appears twice")
            seen.add(key)
    missing = sorted(expected - seen)
    if missing:
        kind, mb, k = missing[0]
        raise ScheduleError(
            f"{len(missing)} actions are missing, e.g. {kind} of micro-batch {mb} on stage {k} "
            f"(device {k % num_devices}); every stage needs F and B of every micro-batch, and W "
            "too when any backward is split"
        )


def _deps(a: Action, num_stages: int) -> list[tuple[str, int, int]]:
    if a.kind == "F":
        return [("F", a.microbatch, a.stage - 1)] if a.stage > 0 else []
    if a.kind == "W":
        return [("B", a.microbatch, a.stage)]
    deps = [("F", a.microbatch, a.stage)]
    if a.stage < num_stages - 1:
        deps.append(("B", a.microbatch, a.stage + 1))
    return deps


def _ready(a: Action, ran: dict, tick: int, lane: int, num_stages: int) -> bool:
    """Inputs from other stages arrive by the end of an earlier tick; the same stage's earlier
    actions (F before B, B before W) may also have run in an earlier lane of this tick."""
    for dep in _deps(a, num_stages):
        when = ran.get(dep)
        if when is None:
            return False
        if when[0] < tick:
            continue
        if not (when[0] == tick and when[1] < lane and dep[2] == a.stage):
            return False
    return True


def _missing(a: Action, ran: dict, num_stages: int) -> str:
    missing = [dep for dep in _deps(a, num_stages) if dep not in ran]
    return "needs " + ", ".join(f"{k}{mb} of stage {s}" for k, mb, s in missing) if missing else "?"


class _SlotPool:
    """Greedy slot assignment: a slot is free again once its last reader has run."""

    def __init__(self) -> None:
        self.free_from: list[float] = []  # slot -> first phase at which it may be written again

    def take(self, start: float, end: float) -> int:
        for slot, free in enumerate(self.free_from):
            if free <= start:
                self.free_from[slot] = end + 0.5
                return slot
        self.free_from.append(end + 0.5)
        return len(self.free_from) - 1


def _assign_slots(
    rows: list[list[Action | None]],
    num_devices: int,
    num_chunks: int,
    num_microbatches: int,
    name: str,
    lanes: int = 1,
) -> Table:
    num_rows = len(rows)
    num_stages = num_devices * num_chunks
    shape = (num_rows, num_devices)
    arrays = {f: np.full(shape, NO_SLOT, dtype=np.int32) for f in FIELDS}
    arrays["kind"][:] = IDLE
    arrays["microbatch"][:] = 0
    arrays["chunk"][:] = 0
    when: dict[tuple[str, int, int], int] = {}
    for t, row in enumerate(rows):
        for d, a in enumerate(row):
            if a is not None:
                when[(a.kind, a.microbatch, a.stage)] = t
                arrays["kind"][t, d] = _KIND_CODES[a.kind]
                arrays["microbatch"][t, d] = a.microbatch
                arrays["chunk"][t, d] = a.stage // num_devices

    def arrival_row(row: int) -> int:
        """What is sent in ``row`` arrives at the end of its tick: the tick's last row."""
        return row - row % lanes + lanes - 1

    # Phases order events: 2r = compute of row r, 2r + 1 = arrivals at its end (last lane only).
    # A buffer entry is live from the phase it is written to the phase of its last read.
    intervals: list[tuple[float, float, str, int, int]] = []  # (start, end, buffer, mb, stage)
    split = any(kind == "W" for kind, _, _ in when)
    for mb in range(num_microbatches):
        for k in range(num_stages):
            # b: the last action that reads the stashed state (W when backwards are split)
            f, b = when[("F", mb, k)], when[("W" if split else "B", mb, k)]
            # recv_*[r, d]: the slot on device d that takes what arrives at the end of row r.
            if k > 0:  # the input arrives at the end of the previous stage's forward's tick
                intervals.append((2 * arrival_row(when[("F", mb, k - 1)]) + 1, 2 * b, "in", mb, k))
            intervals.append((2 * f, 2 * b, "res", mb, k))
            if k < num_stages - 1:  # the cotangent arrives at the end of the next stage's B's tick
                intervals.append((2 * arrival_row(when[("B", mb, k + 1)]) + 1, 2 * b, "cot", mb, k))
            else:  # the last stage's forward produces the loss gradient itself
                intervals.append((2 * f, 2 * b, "cot", mb, k))

    pools = {(buf, d): _SlotPool() for buf in ("in", "res", "cot") for d in range(num_devices)}
    for start, end, buf, mb, k in sorted(intervals):
        d = k % num_devices
        slot = pools[(buf, d)].take(start, end)
        f = when[("F", mb, k)]
        readers = [when[(kind, mb, k)] for kind in ("BW" if split else "B")]
        if buf == "in":
            arrays["in_slot"][[f, *readers], d] = slot
            arrays["recv_in_slot"][arrival_row(when[("F", mb, k - 1)]), d] = slot
        elif buf == "res":
            arrays["res_slot"][[f, *readers], d] = slot
        else:
            arrays["cot_slot"][readers, d] = slot
            if k < num_stages - 1:
                arrays["recv_cot_slot"][arrival_row(when[("B", mb, k + 1)]), d] = slot
            else:
                arrays["cot_slot"][f, d] = slot
    return Table(name, num_devices, num_chunks, num_microbatches, **arrays, lanes=lanes)

