"""What to run: mesh shape, micro-batches, schedule, partition, recompute."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from jpipe.schedules import Table, fuse_ticks, get_schedule, validate

SHARD_LEVELS = (None, "optimizer", "parameters")
DEFAULT_SHARD = "parameters"

ScheduleSpec = str | Callable[[int, int], Table]

if TYPE_CHECKING:
    from jpipe.averaging import ElasticAveraging


@dataclasses.dataclass(frozen=True)
class Plan:
    """How to pipeline a model: ``pipe`` stages x ``data`` replicas, ``microbatches`` per step.

    ``schedule`` is a name (see ``jpipe.schedules.SCHEDULES``) or a function
    ``(num_devices, num_microbatches) -> Table``. ``virtual_stages`` is the number
    of chunks per device for interleaved schedules (virtual stage ``c * pipe + s``
    lives on device ``s``; the generator is called with ``num_chunks=``).
    ``partition`` gives the layers of each (virtual) stage, uneven allowed,
    default an even split; ``remat`` recomputes each stage's forward inside its
    backward so that only stage inputs are held.

    ``fuse_ticks=True`` gives each lock-step tick two lanes, one forward and one
    backward per device (:func:`jpipe.schedules.fuse_ticks`): fewer, fuller
    ticks, for up to one more held micro-batch per device; pair it with
    ``schedule="1f1b-b"`` (enough forwards in flight to keep fused ticks full).

    ``shard`` says what of the training state is split beyond the stages over
    ``pipe`` (ZeRO's levels; see :mod:`jpipe._sharding`): ``"optimizer"``
    splits the optimizer state and ``pre``/``post`` over the whole mesh and
    reduce-scatters gradients; ``"parameters"`` (the default for one pipeline:
    the leanest level, measured within 1.15x of the unsharded step) also
    splits the stage parameters over ``data`` and gathers them for the step;
    ``None`` replicates ``pre``/``post`` on every device and each stage's
    optimizer state on every ``data`` replica. Co-located pipelines already
    hold one replica per ``data`` device: they take ``None`` (the default
    for ``pipelines`` > 1, and what ``jpipe.averaging.init`` sets).

    ``pipelines`` > 1 co-locates that many pipelines on each data replica's
    devices (``pipelines x data`` in all, each on its own batch slice), coupled
    only by elastic ``averaging`` (AvgPipe; see :mod:`jpipe.averaging`); their
    default schedule is ``"advance-forward"``, otherwise ``"1f1b"``.

    >>> plan = Plan(pipe=4, data=2, microbatches=8, partition=(5, 7, 7, 5))
    >>> plan.stage_partition(24)
    (5, 7, 7, 5)
    >>> Plan(pipe=4, data=2, microbatches=8).stage_partition(10)
    (3, 3, 2, 2)
    """

    pipe: int
    data: int
    microbatches: int
    schedule: ScheduleSpec | None = None
    partition: tuple[int, ...] | None = None
    remat: bool = False
    virtual_stages: int = 1
    pipelines: int = 1
    averaging: ElasticAveraging | None = None
    fuse_ticks: bool = False
    shard: str | None = "auto"

    def __post_init__(self) -> None:
        for name in ("pipe", "data", "microbatches", "virtual_stages", "pipelines"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Plan.{name} must be an int >= 1, got {value!r}")
        if self.schedule is None:
            object.__setattr__(self, "schedule", "advance-forward" if self.pipelines > 1 else "1f1b")
        if isinstance(self.schedule, str):
            get_schedule(self.schedule)  # raises on unknown names
        elif not callable(self.schedule):
            raise ValueError(
                f"Plan.schedule must be a schedule name or a function (devices, microbatches) -> "
                f"Table, got {self.schedule!r}")
        if self.partition is not None:
            entries = tuple(self.partition)
            if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in entries):
                raise ValueError(f"Plan.partition must be whole layer counts per stage, got {self.partition!r}; "
                                 f"give ints such as (3, 3, 2)")
            object.__setattr__(self, "partition", tuple(int(n) for n in entries))
        if self.shard == "auto":
            object.__setattr__(self, "shard", None if self.pipelines > 1 else DEFAULT_SHARD)
        if self.shard not in SHARD_LEVELS:
            raise ValueError(f"Plan.shard must be one of {list(SHARD_LEVELS)}, got {self.shard!r}")
        if self.shard is not None and self.pipelines > 1:
            raise ValueError(
                f"Plan.shard={self.shard!r} with pipelines={self.pipelines}: co-located pipelines keep "
                f"each replica's state on its own data device already; use shard=None")
        for name in ("remat", "fuse_ticks"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"Plan.{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def num_devices(self) -> int:
        return self.pipe * self.data

    @property
    def num_stages(self) -> int:
        """Pipeline stages, counting each device's chunks: ``pipe * virtual_stages``."""
        return self.pipe * self.virtual_stages

    def stage_partition(self, num_layers: int) -> tuple[int, ...]:
        """Layers per stage; checks an explicit partition against ``num_layers``."""
        stages = self.num_stages
        if stages > num_layers:
            raise ValueError(
                f"{stages} pipeline stages but the model has only {num_layers} layers; "
                f"use pipe x virtual_stages <= {num_layers} and put the other devices on the data axis")
        if self.partition is None:
            base, extra = divmod(num_layers, stages)
            return tuple(base + (s < extra) for s in range(stages))
        p = self.partition
        if len(p) != stages:
            raise ValueError(f"partition {p} has {len(p)} entries but there are {stages} stages; "
                             f"give one layer count per stage")
        if any(n < 1 for n in p):
            raise ValueError(f"partition {p} has a stage with {min(p)} layers; every stage needs at "
                             f"least one layer")
        if sum(p) != num_layers:
            raise ValueError(f"partition {p} sums to {sum(p)} but the model has {num_layers} layers; "
                             f"make the entries sum to {num_layers}")
        return p

    def table(self) -> Table:
        """The validated schedule table for this plan's devices and micro-batches."""
        return validate(self.unvalidated_table())

    def unvalidated_table(self) -> Table:
        """The table, not yet validated (the planner times thousands of registered ones)."""
        make = get_schedule(self.schedule) if isinstance(self.schedule, str) else self.schedule
        if "num_chunks" in inspect.signature(make).parameters:
            table = make(self.pipe, self.microbatches, num_chunks=self.virtual_stages)
        elif self.virtual_stages == 1:
            table = make(self.pipe, self.microbatches)
        else:
            raise ValueError(
                f"schedule {self.schedule!r} has no virtual stages (it takes no num_chunks); use an "
                f"interleaved schedule or virtual_stages=1")
        got = (table.num_devices, table.num_microbatches, table.num_chunks)
        want = (self.pipe, self.microbatches, self.virtual_stages)
        if got != want:
            raise ValueError(
                f"schedule returned a table for {got[0]} devices, {got[1]} micro-batches and {got[2]} "
                f"chunks per device; the plan has pipe={want[0]}, microbatches={want[1]}, "
                f"virtual_stages={want[2]}")
        return fuse_ticks(table) if self.fuse_ticks else table
