"""Schedules written by hand: a plain-text (or CSV) per-device order -> a :class:`Table`.

**Text format.** One line per device, in device order, each the device's
actions in execution order::

    # 1F1B on two devices, three micro-batches
    d0: F0 F1 B0 F2 B1 B2
    d1: F0 B0 F1 B1 F2 B2

- An action is ``F``, ``B`` or ``W`` followed by the micro-batch number
  (``F3``); with interleaved chunks add ``/chunk`` (``F3/1`` is micro-batch 3
  on this device's chunk 1, i.e. virtual stage ``chunk * P + device``).
- ``W`` (weight gradient) splits the backward: a table with any ``W`` needs
  one ``W`` after every ``B``, and each ``B`` then computes only the input
  gradient.
- The device label (``d0:``, ``0:``, ``d0 |``) is optional; devices are
  numbered by line. ``.`` (an idle tick) is ignored, so the output of
  :func:`~jpipe.schedules.ascii_gantt` loads back; its header line
  (``name: 2 devices, ...``) sets the table's name.
- ``#`` starts a comment; blank lines are skipped.

Only the order matters: :func:`~jpipe.schedules.table_from_orders` times the
actions in lock-step (each as early as its inputs allow) and assigns buffer
slots, and rejects orders that deadlock or miss actions.

**CSV format** (a file ending in ``.csv``, or text whose first line is the
header): columns ``device,kind,microbatch`` and optionally ``chunk``, one row
per action, rows of one device in execution order.

>>> t = load_table('''
... d0: F0 F1 B0 F2 B1 B2
... d1: F0 B0 F1 B1 F2 B2
... ''', name="mine")
>>> t
Table('mine', devices=2, chunks=1, microbatches=3, ticks=8)
>>> load_table("device,kind,microbatch\\n0,F,0\\n1,F,0\\n1,B,0\\n0,B,0").num_ticks
4
"""

from __future__ import annotations

import csv
import io
import os
import re

from jpipe.schedules._table import Action, ScheduleError, Table, table_from_orders

_TOKEN = re.compile(r"^([FBW])(\d+)(?:/(\d+))?$")
_LABEL = re.compile(r"^\s*d?(\d+)\s*[:|]\s*(.*)$")
_HEADER = re.compile(r"^\s*([^:|]+?)\s*:\s*\d+ devices\b")


def _is_csv(text: str) -> bool:
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            return line.replace(" ", "").lower().startswith("device,kind,microbatch")
    return False


def _parse_text(text: str) -> tuple[list[list[tuple[str, int, int]]], str | None]:
    rows: list[list[tuple[str, int, int]]] = []
    name = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not rows and name is None and (m := _HEADER.match(line)):
            name = m.group(1)
            continue
        body = line
        if m := _LABEL.match(line):
            label, body = int(m.group(1)), m.group(2)
            if label != len(rows):
                raise ScheduleError(
                    f"line {lineno}: device label {label} out of order; list devices 0, 1, ... "
                    f"one line each (expected device {len(rows)})")
        actions = []
        for tok in body.replace(",", " ").split():
            if tok == ".":
                continue
            t = _TOKEN.match(tok)
            if t is None:
                raise ScheduleError(
                    f"line {lineno}: cannot read {tok!r}; write an action as F, B or W and a "
                    f"micro-batch number (F3), with /chunk for interleaved stages (F3/1)")
            actions.append((t.group(1), int(t.group(2)), int(t.group(3) or 0)))
        rows.append(actions)
    return rows, name


def _parse_csv(text: str) -> list[list[tuple[str, int, int]]]:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    reader = csv.DictReader(io.StringIO("\n".join(lines)), skipinitialspace=True)
    fields = [f.strip().lower() for f in reader.fieldnames or []]
    reader.fieldnames = fields
    if fields[:3] != ["device", "kind", "microbatch"] or not set(fields) <= {"device", "kind", "microbatch", "chunk"}:
        raise ScheduleError(f"CSV header must be device,kind,microbatch[,chunk], got {','.join(fields)}")
    per_device: dict[int, list[tuple[str, int, int]]] = {}
    for rowno, row in enumerate(reader, 2):
        try:
            d, mb = int(row["device"]), int(row["microbatch"])
            chunk = int(row.get("chunk") or 0)
        except (TypeError, ValueError):
            raise ScheduleError(f"CSV row {rowno}: device, microbatch and chunk must be integers, got {row}") from None
        kind = (row["kind"] or "").strip().upper()
        if kind not in ("F", "B", "W"):
            raise ScheduleError(f"CSV row {rowno}: kind must be F, B or W, got {row['kind']!r}")
        if d < 0 or mb < 0 or chunk < 0:
            raise ScheduleError(f"CSV row {rowno}: negative device, micro-batch or chunk in {row}")
        per_device.setdefault(d, []).append((kind, mb, chunk))
    if not per_device:
        return []
    missing = sorted(set(range(max(per_device) + 1)) - set(per_device))
    if missing:
        raise ScheduleError(f"CSV lists no actions for device {missing[0]}; every device needs a row")
    return [per_device[d] for d in range(max(per_device) + 1)]


def read_orders(text: str) -> tuple[list[list[Action]], int, int, str | None]:
    """Parses the text or CSV format: ``(orders, num_microbatches, num_chunks, name or None)``.

    >>> orders, m, v, name = read_orders("d0: F0/0 F0/1 B0/1 B0/0")
    >>> orders, m, v
    ([[Action(kind='F', microbatch=0, stage=0), Action(kind='F', microbatch=0, stage=1), Action(kind='B', microbatch=0, stage=1), Action(kind='B', microbatch=0, stage=0)]], 1, 2)
    """
    if _is_csv(text):
        rows, name = _parse_csv(text), None
    else:
        rows, name = _parse_text(text)
    if not rows or not any(rows):
        raise ScheduleError("the schedule lists no actions; write one line per device, e.g. 'd0: F0 B0'")
    P = len(rows)
    num_chunks = 1 + max(c for row in rows for _, _, c in row)
    num_microbatches = 1 + max(mb for row in rows for _, mb, _ in row)
    orders = [[Action(kind, mb, c * P + d) for kind, mb, c in row] for d, row in enumerate(rows)]
    return orders, num_microbatches, num_chunks, name


def load_table(source: str | os.PathLike, *, name: str | None = None) -> Table:
    """A :class:`Table` from a schedule file (text or ``.csv``) or from the text itself.

    ``source`` is read as a path when it names an existing file, otherwise as
    the schedule text. Micro-batch and chunk counts are the largest numbers
    used plus one.

    >>> load_table("d0: F0 B0\\nd1: F0 B0").orders()[1]
    [Action(kind='F', microbatch=0, stage=1), Action(kind='B', microbatch=0, stage=1)]
    """
    text = str(source)
    default_name = "custom"
    if isinstance(source, os.PathLike) or ("\n" not in text and os.path.isfile(text)):
        with open(source, encoding="utf-8") as f:
            text = f.read()
        default_name = os.path.splitext(os.path.basename(str(source)))[0]
    orders, num_microbatches, num_chunks, header = read_orders(text)
    return table_from_orders(orders, num_microbatches, num_chunks=num_chunks,
                             name=name or header or default_name)


def format_orders(table: Table) -> str:
    """A table's per-device orders in the text format; :func:`load_table` reads it back, name included.

    >>> from jpipe.schedules import one_f_one_b
    >>> print(format_orders(one_f_one_b(2, 2)))
    1f1b: 2 devices, 2 micro-batches, 1 chunk per device
    d0: F0 F1 B0 B1
    d1: F0 B0 F1 B1
    """
    P, v = table.num_devices, table.num_chunks
    head = (f"{table.name}: {P} devices, {table.num_microbatches} micro-batches, "
            f"{v} chunk{'s' if v > 1 else ''} per device")
    lines = [head]
    for d, order in enumerate(table.orders()):
        cells = [str(a) + (f"/{a.stage // P}" if v > 1 else "") for a in order]
        lines.append(f"d{d}: " + " ".join(cells))
    return "\n".join(lines)
