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
    P, V, M = table.num_devices, table.num_chunks, table.num_microbatches
    S = P * V
    shape = (table.num_rows, P)
    for field in ("kind", "microbatch", "chunk", "in_slot", "res_slot", "cot_slot",
                  "recv_in_slot", "recv_cot_slot"):
        if getattr(table, field).shape != shape:
            raise ScheduleError(f"table field {field!r} has shape {getattr(table, field).shape}, expected {shape}")
    bufs = {name: [{} for _ in range(P)] for name in ("in", "res", "cot")}
    split = table.splits_backward
    done: dict[tuple[str, int, int], int] = {}

    def where(t: int, d: int, mb: int | None = None) -> str:
        return f"tick {t}, device {d}" + (f", micro-batch {mb}" if mb is not None else "")

    def read(buf: str, t: int, d: int, slot: int, want: tuple[int, int], what: str) -> None:
        if slot == NO_SLOT:
            raise ScheduleError(f"{where(t, d, want[0])}: {what} has no {buf} slot")
        held = bufs[buf][d].get(slot)
        if held is None:
            raise ScheduleError(
                f"{where(t, d, want[0])}: {what} reads {buf} slot {slot} before anything is written "
                f"there (the data it needs has not arrived yet)")
        if held != want:
            raise ScheduleError(
                f"{where(t, d, want[0])}: {what} reads {buf} slot {slot}, which holds micro-batch "
                f"{held[0]} of stage {held[1]}, not micro-batch {want[0]} of stage {want[1]}")

    def write(buf: str, t: int, d: int, slot: int, value: tuple[int, int], what: str) -> None:
        if slot < 0:
            raise ScheduleError(f"{where(t, d, value[0])}: {what} has no {buf} slot to write")
        held = bufs[buf][d].get(slot)
        if held is not None:
            raise ScheduleError(
                f"{where(t, d, value[0])}: {what} overwrites {buf} slot {slot}, which still holds "
                f"micro-batch {held[0]} of stage {held[1]}")
        bufs[buf][d][slot] = value

    lanes = table.lanes
    if lanes < 1 or table.num_rows % lanes:
        raise ScheduleError(f"table has {table.num_rows} rows, not a whole number of ticks of {lanes} lanes")
    def send(sends: dict, to: int, value: tuple[int, int], t: int, d: int, what: str) -> None:
        if to in sends:
            raise ScheduleError(
                f"{where(t, d, value[0])}: two {what} leave device {d} in one tick (micro-batches "
                f"{sends[to][0]} and {value[0]}); a tick moves one {what} per direction")
        sends[to] = value

    for t in range(table.num_ticks):
        sends_in: dict[int, tuple[int, int]] = {}
        sends_cot: dict[int, tuple[int, int]] = {}
        for r in range(t * lanes, (t + 1) * lanes):
            for d in range(P):
                kind = int(table.kind[r, d])
                if r != (t + 1) * lanes - 1 and (int(table.recv_in_slot[r, d]) != NO_SLOT
                                                 or int(table.recv_cot_slot[r, d]) != NO_SLOT):
                    raise ScheduleError(f"{where(t, d)}: arrivals are stored in the tick's last lane's row, "
                                        f"but row {r} (lane {r % lanes}) sets a recv slot")
                if kind == IDLE:
                    continue
                mb, c = int(table.microbatch[r, d]), int(table.chunk[r, d])
                if kind not in (FORWARD, BACKWARD, WEIGHT):
                    raise ScheduleError(f"{where(t, d)}: unknown action code {kind}")
                if not 0 <= mb < M:
                    raise ScheduleError(f"{where(t, d, mb)}: micro-batch outside 0..{M - 1}")
                if not 0 <= c < V:
                    raise ScheduleError(f"{where(t, d, mb)}: chunk {c} outside 0..{V - 1}")
                k = c * P + d
                label = KIND_NAMES[kind] + f"{mb} of stage {k}"
                if (kind, mb, k) in done:
                    raise ScheduleError(f"{where(t, d, mb)}: {label} runs a second time (first at tick {done[(kind, mb, k)]})")
                if kind == FORWARD:
                    if k > 0:
                        read("in", t, d, int(table.in_slot[r, d]), (mb, k), label)
                    write("res", t, d, int(table.res_slot[r, d]), (mb, k), label)
                    if k == S - 1:
                        write("cot", t, d, int(table.cot_slot[r, d]), (mb, k), label)
                    else:
                        if int(table.cot_slot[r, d]) != NO_SLOT:
                            # The executor writes every forward's dy (zeros unless last) to cot_slot.
                            raise ScheduleError(
                                f"{where(t, d, mb)}: {label} sets cot slot {int(table.cot_slot[r, d])}, "
                                f"but only the last stage's forward writes a cotangent (set it to {NO_SLOT})")
                        send(sends_in, (d + 1) % P, (mb, k + 1), t, d, "activations")
                else:
                    if (FORWARD, mb, k) not in done:
                        raise ScheduleError(f"{where(t, d, mb)}: {label} runs before its forward")
                    if kind == WEIGHT and (BACKWARD, mb, k) not in done:
                        raise ScheduleError(f"{where(t, d, mb)}: {label} runs before its B")
                    if k > 0:
                        read("in", t, d, int(table.in_slot[r, d]), (mb, k), label)
                    read("res", t, d, int(table.res_slot[r, d]), (mb, k), label)
                    read("cot", t, d, int(table.cot_slot[r, d]), (mb, k), label)
                    if kind == (WEIGHT if split else BACKWARD):  # the last reader frees the slots
                        for buf, slot in (("in", table.in_slot[r, d]), ("res", table.res_slot[r, d]),
                                          ("cot", table.cot_slot[r, d])):
                            bufs[buf][d].pop(int(slot), None)
                    if kind == BACKWARD and k > 0:
                        send(sends_cot, (d - 1) % P, (mb, k - 1), t, d, "cotangents")
                done[(kind, mb, k)] = t
        for buf, field, sends in (("in", table.recv_in_slot, sends_in), ("cot", table.recv_cot_slot, sends_cot)):
            for d in range(P):
                slot = int(field[(t + 1) * lanes - 1, d])
                if d in sends:
                    mb, k = sends[d]
                    if slot == NO_SLOT:
                        raise ScheduleError(
                            f"{where(t, d, mb)}: the {buf} for micro-batch {mb} of stage {k} arrives "
                            f"but recv_{buf}_slot is {NO_SLOT}: it would be dropped")
                    write(buf, t, d, slot, sends[d], f"arrival of {buf} for stage {k}")
                elif slot != NO_SLOT:
                    raise ScheduleError(f"{where(t, d)}: recv_{buf}_slot {slot} is set but nothing arrives")
    for mb in range(M):
        for k in range(S):
            for kind, name in ((FORWARD, "F"), (BACKWARD, "B"), (WEIGHT, "W"))[: 3 if split else 2]:
                if (kind, mb, k) not in done:
                    raise ScheduleError(
                        f"{name} of micro-batch {mb} on stage {k} (device {k % P}) never runs")
    return table
