"""Gantt pictures of schedule tables (matplotlib, an optional extra: ``pip install "jpipe[plot]"``).

Drawn like the figures of the GPipe / DAPPLE / zero-bubble papers: one row per
device (device 0 on top), a box per action coloured by kind (forward,
backward, weight gradient; later chunks of an interleaved schedule in a darker
shade) with the micro-batch number inside, and idle time left blank.
"""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jpipe.schedules._simulate import Costs
    from jpipe.schedules._table import Table

# Light/dark pairs per kind: chunk 0 light, the last chunk dark (colour-blind-safe hues).
COLORS = {
    "F": ("#9ecae1", "#3182bd"),
    "B": ("#fdae6b", "#e6550d"),
    "W": ("#a1d99b", "#31a354"),
}
LABELS = {"F": "forward", "B": "backward", "W": "weight gradient"}


def _require_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            'gantt_png needs matplotlib, an optional extra: pip install "jpipe[plot]" '
            "(or pip install matplotlib)") from e
    return Figure, FigureCanvasAgg, Rectangle, Patch


def _shade(kind: str, chunk: int, num_chunks: int) -> str:
    from matplotlib.colors import to_hex, to_rgb

    light, dark = (to_rgb(c) for c in COLORS[kind])
    f = chunk / (num_chunks - 1) if num_chunks > 1 else 0.0
    return to_hex(tuple(a + (b - a) * f for a, b in zip(light, dark)))


def gantt_png(
    table: Table,
    path: str | os.PathLike,
    costs: Costs | None = None,
    *,
    mode: str = "lockstep",
    title: str | None = None,
    unit: str = "s",
    dpi: int = 120,
) -> str:
    """Writes a Gantt chart of ``table`` to ``path`` (PNG) and returns the path.

    Without ``costs`` the time axis is ticks (every action one tick wide).
    With ``costs`` it is time from :func:`jpipe.schedules.simulate` in
    ``mode`` (``"lockstep"`` or ``"async"``) in ``unit``, the costs' unit
    (seconds for profiled costs, ``"cost units"`` for relative ones), and the
    title gives the makespan and bubble. Title, axis label and legend do not
    overlap and stay inside the picture.

    >>> import os, tempfile
    >>> from jpipe.schedules import one_f_one_b
    >>> path = gantt_png(one_f_one_b(4, 8), os.path.join(tempfile.mkdtemp(), "1f1b.png"))
    >>> open(path, "rb").read(4) == b"\\x89PNG"
    True
    """
    fig = _gantt_figure(table, costs, mode=mode, title=title, unit=unit, dpi=dpi)
    path = os.fspath(path)
    fig.savefig(path, format="png")
    return path


def _gantt_figure(table: Table, costs: Costs | None, *, mode: str = "lockstep", title: str | None = None,
                  unit: str = "s", dpi: int = 120):
    """The matplotlib figure that :func:`gantt_png` writes."""
    Figure, FigureCanvasAgg, Rectangle, Patch = _require_matplotlib()
    P, v = table.num_devices, table.num_chunks
    if costs is None:
        spans = {}
        for r in range(table.num_rows):  # lane l of tick t fills the l-th part of the tick
            t, lane = divmod(r, table.lanes)
            for d in range(P):
                a = table.action(r, d)
                if a is not None:
                    spans[a] = (t + lane / table.lanes, t + (lane + 1) / table.lanes)
        makespan, xlabel = float(table.num_ticks), "tick"
        subtitle = f"{table.num_ticks} ticks"
    else:
        from jpipe.schedules._simulate import simulate

        r = simulate(table, costs, mode=mode)
        spans = {a: (r.start[a], r.end[a]) for a in r.start}
        makespan, xlabel = r.makespan, f"time ({unit})"
        subtitle = f"{mode}: makespan {r.makespan:.4g} {unit}, bubble {r.bubble_fraction:.1%}"
    idle_frac = 1.0 - sum(e - s for s, e in spans.values()) / (P * makespan) if makespan > 0 else 0.0
    if costs is None:
        subtitle += f", idle {idle_frac:.1%}"

    width = min(40.0, max(6.0, 0.28 * len(spans) / P + 1.5))
    legend_inches = 0.35  # a row under the axis label, kept free by tight_layout's rect
    height = 0.55 * P + 1.6 + legend_inches
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    shortest = min((e - s for s, e in spans.values() if e > s), default=1.0)
    box_points = shortest / makespan * width * 72 * 0.85 if makespan > 0 else 10.0
    font = max(4.0, min(9.0, 0.6 * box_points))
    for a, (s, e) in spans.items():
        d, chunk = a.stage % P, a.stage // P
        y = P - 1 - d
        ax.add_patch(Rectangle((s, y + 0.1), e - s, 0.8, facecolor=_shade(a.kind, chunk, v),
                               edgecolor="black", linewidth=0.5))
        if e > s:
            ax.text((s + e) / 2, y + 0.5, str(a.microbatch), ha="center", va="center", fontsize=font)
    ax.set_xlim(0, makespan)
    ax.set_ylim(0, P)
    ax.set_yticks([P - 1 - d + 0.5 for d in range(P)])
    ax.set_yticklabels([f"device {d}" for d in range(P)])
    ax.set_xlabel(xlabel)
    ax.set_facecolor("#f4f4f4")  # idle time shows as the grey background
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    kinds = [k for k in "FBW" if any(a.kind == k for a in spans)]
    handles = [Patch(facecolor=_shade(k, 0, 1), edgecolor="black", label=LABELS[k]) for k in kinds]
    if v > 1:
        handles.append(Patch(facecolor=_shade("F", v - 1, v), edgecolor="black", label=f"chunk {v - 1} (darker)"))
    handles.append(Patch(facecolor="#f4f4f4", edgecolor="black", label="idle"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=8)
    head = title or (f"{table.name}: {P} devices" + (f" x {v} chunks" if v > 1 else "")
                     + f", {table.num_microbatches} micro-batches")
    ax.set_title(f"{head}\n{subtitle}", fontsize=10)  # two lines: narrow pictures do not clip it
    fig.tight_layout(rect=(0, legend_inches / height, 1, 1))
    return fig


def main_show(
    name: str,
    pipe: int,
    microbatches: int,
    png: str | os.PathLike | None = None,
    *,
    costs: Costs | None = None,
    fused: bool = False,
    **options,
) -> str:
    """What ``jpipe schedule show NAME --pipe P --microbatches M [--png FILE] [--fused]`` prints.

    ``name`` is a registered schedule (``jpipe.schedules.SCHEDULES``; extra
    ``options`` such as ``num_chunks=2`` go to its generator) or the path of a
    schedule file (see :func:`jpipe.schedules.load_table`; then ``pipe`` and
    ``microbatches`` must match the file, or be 0 to take the file's). Returns
    the ASCII Gantt chart, then the simulated bubble (lock-step and
    asynchronous) and peak held micro-batches per device under ``costs``
    (default ``F = B = W = 1``: an unsplit backward costs 2). With ``png``,
    also writes the picture (matplotlib) with the lock-step time axis. With
    ``fused``, the table is re-timed with fused ticks (one forward and one
    backward per device per tick, :func:`jpipe.schedules.fuse_ticks`).

    >>> print(main_show("1f1b", 2, 3))  # doctest: +NORMALIZE_WHITESPACE
    1f1b: 2 devices, 3 micro-batches, 8 ticks
    d0 | F0 F1 .  B0 F2 B1 .  B2
    d1 | .  F0 B0 F1 B1 F2 B2 .
    costs: F=1 B=1 W=1 (an unsplit B costs B+W), comm=0
    bubble: lock-step 35.7%, async 25.0%
    peak held micro-batches per device: [2, 1]
    """
    from jpipe.schedules._csv import load_table
    from jpipe.schedules._generators import SCHEDULES, get_schedule
    from jpipe.schedules._render import ascii_gantt
    from jpipe.schedules._simulate import Costs, simulate

    if name not in SCHEDULES and os.path.isfile(name):
        if options:
            raise ValueError(f"options {sorted(options)} only apply to named schedules, not to a file")
        table = load_table(name)
        for what, want, got in (("pipe", pipe, table.num_devices),
                                ("microbatches", microbatches, table.num_microbatches)):
            if want and want != got:
                raise ValueError(f"{name} is a schedule for {what}={got}, but {what}={want} was asked for")
    else:
        for what, value in (("pipe", pipe), ("microbatches", microbatches), *options.items()):
            if isinstance(value, int) and value < 1:
                raise ValueError(f"{what} must be at least 1, got {value}")
        make = get_schedule(name)
        accepted = inspect.signature(make).parameters
        unknown = sorted(k for k in options if k not in accepted)
        if unknown:
            raise ValueError(f"schedule {name!r} takes no {', '.join(unknown)}"
                             + (" (it is not interleaved: one chunk per device); drop --chunks, or pick an "
                                "interleaved schedule" if "num_chunks" in unknown else ""))
        table = make(pipe, microbatches, **options)
    if fused:
        from jpipe.schedules._table import fuse_ticks

        table = fuse_ticks(table)
    given_costs = costs is not None
    costs = costs if given_costs else Costs(forward=1.0, backward=1.0, weight=1.0)
    lock, asy = simulate(table, costs), simulate(table, costs, mode="async")

    def fmt(x) -> str:
        return "per-stage" if not isinstance(x, (int, float)) else f"{x:g}"

    lines = [
        ascii_gantt(table),
        (f"costs: F={fmt(costs.forward)} B={fmt(costs.backward)} W={fmt(costs.weight or 0.0)} "
         f"(an unsplit B costs B+W), comm={fmt(costs.comm)}"),
        f"bubble: lock-step {lock.bubble_fraction:.1%}, async {asy.bubble_fraction:.1%}",
        f"peak held micro-batches per device: {lock.peak_held.tolist()}",
    ]
    if png is not None:
        lines.append(f"wrote {gantt_png(table, png, costs, unit='s' if given_costs else 'cost units')}")
    return "\n".join(lines)
