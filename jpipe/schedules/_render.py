"""Text rendering of schedule tables."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jpipe.schedules._table import Table


def ascii_gantt(table: Table) -> str:
    """One row per device, one column per tick: ``F3`` / ``B3`` boxes, ``.`` for idle.

    A table with fused ticks (two lanes) gets one line per lane: the device's
    forwards, then (``  |``) its backwards.

    >>> from jpipe.schedules import gpipe, fuse_ticks
    >>> print(ascii_gantt(gpipe(2, 2)))  # doctest: +NORMALIZE_WHITESPACE
    gpipe: 2 devices, 2 micro-batches, 6 ticks
    d0 | F0 F1 .  .  B0 B1
    d1 | .  F0 F1 B0 B1 .
    >>> print(ascii_gantt(fuse_ticks(gpipe(2, 2))))  # doctest: +NORMALIZE_WHITESPACE
    gpipe: 2 devices, 2 micro-batches, 5 ticks of 2 lanes (F | B)
    d0 | F0 F1 .  .  .
       | .  .  .  B0 B1
    d1 | .  F0 F1 .  .
       | .  .  B0 B1 .
    """
    def cell(r: int, d: int) -> str:
        a = table.action(r, d)
        if a is None:
            return "."
        return str(a) + (f"/{a.stage // table.num_devices}" if table.num_chunks > 1 else "")

    lanes = table.lanes
    cells = [[[cell(t * lanes + lane, d) for t in range(table.num_ticks)] for lane in range(lanes)]
             for d in range(table.num_devices)]
    width = max((len(c) for dev in cells for row in dev for c in row), default=1)
    head = (f"{table.name}: {table.num_devices} devices, {table.num_microbatches} micro-batches, "
            f"{table.num_ticks} ticks" + (f" of {lanes} lanes (F | B)" if lanes > 1 else ""))
    lines = [head]
    for d, dev in enumerate(cells):
        for lane, row in enumerate(dev):
            label = f"d{d}" if lane == 0 else " " * len(f"d{d}")
            lines.append(f"{label} | " + " ".join(c.ljust(width) for c in row).rstrip())
    return "\n".join(lines)
