"""Text rendering of schedule tables."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jpipe.schedules._table import Table


def ascii_gantt(table: Table) -> str:
    """One row per device, one column per tick: ``F3`` / ``B3`` boxes, ``.`` for idle.

    >>> from jpipe.schedules import gpipe
    >>> print(ascii_gantt(gpipe(2, 2)))  # doctest: +NORMALIZE_WHITESPACE
    gpipe: 2 devices, 2 micro-batches, 6 ticks
    d0 | F0 F1 .  .  B0 B1
    d1 | .  F0 F1 B0 B1 .
    """
    def cell(t: int, d: int) -> str:
        a = table.action(t, d)
        if a is None:
            return "."
        return str(a) + (f"/{a.stage // table.num_devices}" if table.num_chunks > 1 else "")

    cells = [[cell(t, d) for t in range(table.num_ticks)] for d in range(table.num_devices)]
    width = max(len(c) for row in cells for c in row)
    head = (f"{table.name}: {table.num_devices} devices, {table.num_microbatches} micro-batches, "
            f"{table.num_ticks} ticks")
    lines = [head] + [f"d{d} | " + " ".join(c.ljust(width) for c in row).rstrip()
                      for d, row in enumerate(cells)]
    return "\n".join(lines)
