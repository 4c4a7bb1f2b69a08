"""Checks a :class:`Table` before anything is compiled.

The validator replays the table on symbolic buffers: every slot holds the
``(micro-batch, stage)`` it was written with, or nothing. It rejects a table
whose dependencies cannot be met in lock-step, that reads a slot before it is
written (or that holds something else), or that overwrites a live slot -- and
names the tick, device and micro-batch.
"""

from __future__ import annotations

from jpipe.schedules._table import BACKWARD, FORWARD, IDLE, KIND_NAMES, NO_SLOT, WEIGHT, ScheduleError, Table


def validate(table: Table) -> Table:
    """Returns ``table`` unchanged if it executes correctly; raises :class:`ScheduleError` otherwise.

    >>> from jpipe.schedules import one_f_one_b
    >>> validate(one_f_one_b(4, 8)).name
    '1f1b'
    """
    shape = (table.num_rows, table.num_devices)
    for field in ("kind", "microbatch", "chunk", "in_slot", "res_slot", "cot_slot",
                  "recv_in_slot", "recv_cot_slot"):
        if getattr(table, field).shape != shape:
            raise ScheduleError(f"table field {field!r} has shape {getattr(table, field).shape}, expected {shape}")
    if table.lanes < 1 or table.num_rows % table.lanes:
        raise ScheduleError(f"table has {table.num_rows} rows, not a whole number of ticks of {table.lanes} lanes")
    replay = _Replay(table)
    for t in range(table.num_ticks):
        replay.tick(t)
    replay.check_every_action_ran()
    return table


def _where(t: int, d: int, mb: int | None = None) -> str:
    return f"tick {t}, device {d}" + (f", micro-batch {mb}" if mb is not None else "")


class _Replay:
    """The table run on symbolic buffers: per device, slot -> the ``(micro-batch, stage)`` it holds."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.P, self.V, self.M = table.num_devices, table.num_chunks, table.num_microbatches
        self.S = self.P * self.V
        self.bufs = {name: [{} for _ in range(self.P)] for name in ("in", "res", "cot")}
        self.split = table.splits_backward
        self.done: dict[tuple[int, int, int], int] = {}  # (kind, micro-batch, stage) -> tick

    def read(self, buf: str, t: int, d: int, slot: int, want: tuple[int, int], what: str) -> None:
        if slot == NO_SLOT:
            raise ScheduleError(f"{_where(t, d, want[0])}: {what} has no {buf} slot")
        held = self.bufs[buf][d].get(slot)
        if held is None:
            raise ScheduleError(
                f"{_where(t, d, want[0])}: {what} reads {buf} slot {slot} before anything is written "
                f"there (the data it needs has not arrived yet)")
        if held != want:
            raise ScheduleError(
                f"{_where(t, d, want[0])}: {what} reads {buf} slot {slot}, which holds micro-batch "
                f"{held[0]} of stage {held[1]}, not micro-batch {want[0]} of stage {want[1]}")

    def write(self, buf: str, t: int, d: int, slot: int, value: tuple[int, int], what: str) -> None:
        if slot < 0:
            raise ScheduleError(f"{_where(t, d, value[0])}: {what} has no {buf} slot to write")
        held = self.bufs[buf][d].get(slot)
        if held is not None:
            raise ScheduleError(
                f"{_where(t, d, value[0])}: {what} overwrites {buf} slot {slot}, which still holds "
                f"micro-batch {held[0]} of stage {held[1]}")
        self.bufs[buf][d][slot] = value

    @staticmethod
    def send(sends: dict, to: int, value: tuple[int, int], t: int, d: int, what: str) -> None:
        if to in sends:
            raise ScheduleError(
                f"{_where(t, d, value[0])}: two {what} leave device {d} in one tick (micro-batches "
                f"{sends[to][0]} and {value[0]}); a tick moves one {what} per direction")
        sends[to] = value

    def tick(self, t: int) -> None:
        """Every lane's actions of tick ``t``, then what arrives at its end."""
        table, lanes = self.table, self.table.lanes
        sends_in: dict[int, tuple[int, int]] = {}
        sends_cot: dict[int, tuple[int, int]] = {}
        for r in range(t * lanes, (t + 1) * lanes):
            for d in range(self.P):
                if r != (t + 1) * lanes - 1 and (int(table.recv_in_slot[r, d]) != NO_SLOT
                                                 or int(table.recv_cot_slot[r, d]) != NO_SLOT):
                    raise ScheduleError(f"{_where(t, d)}: arrivals are stored in the tick's last lane's row, "
                                        f"but row {r} (lane {r % lanes}) sets a recv slot")
                if int(table.kind[r, d]) != IDLE:
                    self.action(t, r, d, sends_in, sends_cot)
        for buf, field, sends in (("in", table.recv_in_slot, sends_in), ("cot", table.recv_cot_slot, sends_cot)):
            for d in range(self.P):
                self.arrival(buf, t, d, int(field[(t + 1) * lanes - 1, d]), sends)

    def action(self, t: int, r: int, d: int, sends_in: dict, sends_cot: dict) -> None:
        """The action in row ``r`` on device ``d``: its reads, writes and sends."""
        table = self.table
        kind = int(table.kind[r, d])
        mb, c = int(table.microbatch[r, d]), int(table.chunk[r, d])
        if kind not in (FORWARD, BACKWARD, WEIGHT):
            raise ScheduleError(f"{_where(t, d)}: unknown action code {kind}")
        if not 0 <= mb < self.M:
            raise ScheduleError(f"{_where(t, d, mb)}: micro-batch outside 0..{self.M - 1}")
        if not 0 <= c < self.V:
            raise ScheduleError(f"{_where(t, d, mb)}: chunk {c} outside 0..{self.V - 1}")
        k = c * self.P + d
        label = KIND_NAMES[kind] + f"{mb} of stage {k}"
        if (kind, mb, k) in self.done:
            raise ScheduleError(
                f"{_where(t, d, mb)}: {label} runs a second time (first at tick {self.done[(kind, mb, k)]})")
        if kind == FORWARD:
            self.forward(t, r, d, mb, k, label, sends_in)
        else:
            self.backward(t, r, d, kind, mb, k, label, sends_cot)
        self.done[(kind, mb, k)] = t

    def forward(self, t: int, r: int, d: int, mb: int, k: int, label: str, sends_in: dict) -> None:
        table = self.table
        if k > 0:
            self.read("in", t, d, int(table.in_slot[r, d]), (mb, k), label)
        self.write("res", t, d, int(table.res_slot[r, d]), (mb, k), label)
        if k == self.S - 1:
            self.write("cot", t, d, int(table.cot_slot[r, d]), (mb, k), label)
            return
        if int(table.cot_slot[r, d]) != NO_SLOT:
            # The executor writes every forward's dy (zeros unless last) to cot_slot.
            raise ScheduleError(
                f"{_where(t, d, mb)}: {label} sets cot slot {int(table.cot_slot[r, d])}, "
                f"but only the last stage's forward writes a cotangent (set it to {NO_SLOT})")
        self.send(sends_in, (d + 1) % self.P, (mb, k + 1), t, d, "activations")

    def backward(self, t: int, r: int, d: int, kind: int, mb: int, k: int, label: str, sends_cot: dict) -> None:
        """A backward (or, with a split backward, its input half ``B`` or weight half ``W``)."""
        table = self.table
        if (FORWARD, mb, k) not in self.done:
            raise ScheduleError(f"{_where(t, d, mb)}: {label} runs before its forward")
        if kind == WEIGHT and (BACKWARD, mb, k) not in self.done:
            raise ScheduleError(f"{_where(t, d, mb)}: {label} runs before its B")
        if k > 0:
            self.read("in", t, d, int(table.in_slot[r, d]), (mb, k), label)
        self.read("res", t, d, int(table.res_slot[r, d]), (mb, k), label)
        self.read("cot", t, d, int(table.cot_slot[r, d]), (mb, k), label)
        if kind == (WEIGHT if self.split else BACKWARD):  # the last reader frees the slots
            for buf, slot in (("in", table.in_slot[r, d]), ("res", table.res_slot[r, d]),
                              ("cot", table.cot_slot[r, d])):
                self.bufs[buf][d].pop(int(slot), None)
        if kind == BACKWARD and k > 0:
            self.send(sends_cot, (d - 1) % self.P, (mb, k - 1), t, d, "cotangents")

    def arrival(self, buf: str, t: int, d: int, slot: int, sends: dict) -> None:
        """What reaches device ``d`` at the end of tick ``t`` is stored in its ``recv`` slot."""
        if d in sends:
            mb, k = sends[d]
            if slot == NO_SLOT:
                raise ScheduleError(
                    f"{_where(t, d, mb)}: the {buf} for micro-batch {mb} of stage {k} arrives "
                    f"but recv_{buf}_slot is {NO_SLOT}: it would be dropped")
            self.write(buf, t, d, slot, sends[d], f"arrival of {buf} for stage {k}")
        elif slot != NO_SLOT:
            raise ScheduleError(f"{_where(t, d)}: recv_{buf}_slot {slot} is set but nothing arrives")

    def check_every_action_ran(self) -> None:
        for mb in range(self.M):
            for k in range(self.S):
                for kind, name in ((FORWARD, "F"), (BACKWARD, "B"), (WEIGHT, "W"))[: 3 if self.split else 2]:
                    if (kind, mb, k) not in self.done:
                        raise ScheduleError(
                            f"{name} of micro-batch {mb} on stage {k} (device {k % self.P}) never runs")
