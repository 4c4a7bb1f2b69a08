"""Run folders of ``jpipe train``: reading their metrics, plotting them and writing the report.

A run folder holds

* ``config.toml`` -- the resolved options (a valid ``jpipe train --config`` file),
* ``plan.json`` -- the pipeline plan, where it came from and its simulated bubble,
* ``metrics.jsonl`` -- one JSON object per line: ``{"step", "loss", "step_s", "tokens_per_s",
  "elapsed_s"}`` for each training step and ``{"step", "heldout_loss"}`` for each evaluation,
* ``summary.json`` -- the measured figures of the run (wall time, baselines, ...),
* ``schedule.png`` -- the schedule's Gantt chart, ``loss.png`` -- the loss curves,
* ``report.md`` -- a short markdown report of what ran and what it measured,
* ``checkpoints/`` -- orbax checkpoints (see :mod:`jpipe.checkpoint`).

:func:`write_report` re-renders ``loss.png`` and ``report.md`` from the other files
(``jpipe report RUN_DIR``).

>>> import json, os, tempfile
>>> run = tempfile.mkdtemp()
>>> with open(os.path.join(run, "metrics.jsonl"), "w") as f:
...     for s, l in enumerate([5.5, 4.0, 3.0], start=1):
...         print(json.dumps({"step": s, "loss": l}), file=f)
...     print(json.dumps({"step": 3, "heldout_loss": 3.1}), file=f)
>>> train, heldout = read_metrics(run)
>>> [r["loss"] for r in train], heldout[-1]["heldout_loss"]
([5.5, 4.0, 3.0], 3.1)
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["load_run", "plot_loss", "read_metrics", "truncate_metrics", "write_report"]

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
PLAN = "plan.json"
CONFIG = "config.toml"
REPORT = "report.md"
LOSS_PNG = "loss.png"
SCHEDULE_PNG = "schedule.png"


def read_metrics(run_dir: str, upto: int | None = None) -> tuple[list[dict], list[dict]]:
    """The training records and the held-out evaluations of ``run_dir/metrics.jsonl``.

    A step that appears twice (a run resumed from an earlier checkpoint logs the
    steps after it again) keeps its last record. ``upto`` drops records after that step.
    """
    path = os.path.join(run_dir, METRICS)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist; is {run_dir!r} a jpipe train run folder?")
    train: dict[int, dict] = {}
    heldout: dict[int, dict] = {}
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number} is not JSON: {e}") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError(f"{path}:{number} has no integer \"step\" (every line of a jpipe train "
                                 f"metrics.jsonl is a JSON object with one): {line[:120]}")
            step = record["step"]
            if upto is not None and step > upto:
                continue
            (heldout if "heldout_loss" in record else train)[step] = record
    return [train[s] for s in sorted(train)], [heldout[s] for s in sorted(heldout)]


def truncate_metrics(run_dir: str, step: int) -> None:
    """Rewrites ``run_dir/metrics.jsonl`` without the records after ``step`` (before resuming there)."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip() and int(json.loads(line)["step"]) <= step]
    with open(path, "w") as f:
        f.writelines(lines)


def _smooth(values: Sequence[float]) -> list[float]:
    """A centred moving mean over about 1/20 of the run (narrower near the ends, so as to stay
    centred): unlike an exponential average it does not lag a falling loss, however short the run.

    >>> _smooth([5.0, 4.0, 3.0, 2.0])  # a straight line stays as it is
    [5.0, 4.0, 3.0, 2.0]
    >>> [round(x, 2) for x in _smooth([4.0, 2.0] * 20)][:3]
    [4.0, 3.33, 2.67]
    """
    n = len(values)
    half = n // 40
    out = []
    for i in range(n):
        k = min(half, i, n - 1 - i)
        window = values[i - k:i + k + 1]
        out.append(sum(window) / len(window))
    return out


def plot_loss(
    train: Sequence[Mapping[str, Any]],
    heldout: Sequence[Mapping[str, Any]],
    path: str,
    baselines: Mapping[str, float] | None = None,
    title: str = "jpipe train",
) -> str:
    """Writes a PNG of the training loss (raw and smoothed), held-out losses and baselines.

    ``baselines`` maps a label to a loss drawn as a horizontal line.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "loss.png")
    >>> plot_loss([{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}], [{"step": 2, "heldout_loss": 4.2}],
    ...           path, baselines={"unigram": 3.2}) == path
    True
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=110)
    ax = fig.add_subplot()
    if train:
        steps = [r["step"] for r in train]
        losses = [r["loss"] for r in train]
        ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="train loss (per step)")
        ax.plot(steps, _smooth(losses), color="tab:blue", linewidth=1.6, label="train loss (smoothed)")
    if heldout:
        ax.plot([r["step"] for r in heldout], [r["heldout_loss"] for r in heldout], "o-", color="tab:red",
                markersize=4, label="held-out loss")
    styles = ["--", ":", "-."]
    for i, (label, value) in enumerate((baselines or {}).items()):
        ax.axhline(value, color="gray", linestyle=styles[i % len(styles)], linewidth=1,
                   label=f"{label} ({value:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def load_run(run_dir: str) -> dict[str, Any]:
    """``{"config", "plan", "summary"}`` of a run folder (each ``{}`` when its file is missing)."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run folder {run_dir!r} does not exist")
    out: dict[str, Any] = {"config": {}, "plan": {}, "summary": {}}
    if os.path.exists(os.path.join(run_dir, CONFIG)):
        with open(os.path.join(run_dir, CONFIG), "rb") as f:
            out["config"] = tomllib.load(f)
    for key, name in (("plan", PLAN), ("summary", SUMMARY)):
        if os.path.exists(os.path.join(run_dir, name)):
            with open(os.path.join(run_dir, name)) as f:
                out[key] = json.load(f)
    return out


def _fmt(value: Any, spec: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def write_report(run_dir: str) -> str:
    """Re-renders ``loss.png`` and ``report.md`` of ``run_dir`` from its files; returns the report's path.

    >>> import os, tempfile
    >>> run = tempfile.mkdtemp()
    >>> with open(os.path.join(run, "metrics.jsonl"), "w") as f:
    ...     _ = f.write('{"step": 1, "loss": 5.0}\\n{"step": 1, "heldout_loss": 5.1}\\n')
    >>> path = write_report(run)
    >>> "held-out loss" in open(path).read(), os.path.exists(os.path.join(run, "loss.png"))
    (True, True)
    """
    run = load_run(run_dir)
    config, plan, summary = run["config"], run["plan"], run["summary"]
    train, heldout = read_metrics(run_dir)
    pictures = _plot(run_dir, train, heldout, summary)
    lines = [f"# jpipe run `{os.path.basename(os.path.abspath(run_dir))}`", ""]
    if summary.get("command"):
        lines += [f"Command: `{summary['command']}`", ""]
    lines += _what_ran(config, plan, summary)
    lines += _what_it_measured(train, heldout, plan, summary)
    lines += _pictures_and_files(run_dir, plan, pictures)
    path = os.path.join(run_dir, REPORT)
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def _plot(run_dir: str, train: list[dict], heldout: list[dict], summary: dict) -> str:
    """Writes ``loss.png``; returns a note for the report where it cannot (no matplotlib), else ``""``."""
    baselines = {}
    if summary.get("unigram_loss") is not None:
        baselines["unigram (character frequencies)"] = summary["unigram_loss"]
    baselines["uniform over 256 bytes"] = math.log(256)
    try:
        plot_loss(train, heldout, os.path.join(run_dir, LOSS_PNG), baselines,
                  title=f"jpipe train: {os.path.basename(os.path.abspath(run_dir))}")
        return ""
    except ImportError:  # matplotlib is missing: the report goes without pictures
        return "(No pictures: matplotlib is not installed; `pip install matplotlib`, then `jpipe report`.)"


def _what_ran(config: dict, plan: dict, summary: dict) -> list[str]:
    """The report's first table: model, data, training, plan, devices, versions."""
    lines: list[str] = []
    lines += ["## What ran", "", "| | |", "|---|---|"]
    if config:
        lines.append(f"| model | GPT ({config.get('framework', 'nnx')}), {config.get('layers')} layers, d_model "
                     f"{config.get('d_model')}, {config.get('heads')} heads, seq_len {config.get('seq_len')}, "
                     f"{_fmt(summary.get('num_params'), ',')} parameters"
                     + (f", {config['dtype']} compute (float32 parameters)"
                        if config.get("dtype", "float32") != "float32" else "") + " |")
        lines.append(f"| data | {_fmt(summary.get('train_bytes'), ',')} train / "
                     f"{_fmt(summary.get('heldout_bytes'), ',')} held-out bytes of Python standard-library "
                     f"source (byte vocabulary, 256) |")
        lines.append(f"| training | {config.get('steps')} steps, batch {config.get('batch_size')} x "
                     f"{config.get('seq_len')} tokens, Adam lr {config.get('lr')}, seed {config.get('seed')} |")
    if plan:
        part = plan.get("partition")
        lines.append(f"| plan ({plan.get('source', '?')}) | pipe {plan.get('pipe')} x data {plan.get('data')}, "
                     f"{plan.get('microbatches')} micro-batches, schedule `{plan.get('schedule')}`"
                     f"{', remat' if plan.get('remat') else ''}"
                     f"{f', layers per stage {tuple(part)}' if part else ''} |")
    if summary.get("devices"):
        lines.append(f"| devices | {summary['devices']} |")
    if summary.get("versions"):
        lines.append(f"| versions | {summary['versions']} |")
    return lines


def _what_it_measured(train: list[dict], heldout: list[dict], plan: dict, summary: dict) -> list[str]:
    """The report's second table: losses against the baselines, step times against the planner's
    prediction, memory against the budget."""
    final_heldout = heldout[-1]["heldout_loss"] if heldout else None
    initial_heldout = heldout[0]["heldout_loss"] if heldout else None
    unigram = summary.get("unigram_loss")
    last_train = train[-min(len(train), 25):] if train else []
    timed = [r for r in train if r.get("step_s") is not None and not r.get("compiled")]
    step_s = sorted(r["step_s"] for r in timed)[len(timed) // 2] if timed else None
    tokens = summary.get("tokens_per_step")
    lines: list[str] = []
    lines += ["", "## What it measured", "", "| | |", "|---|---|"]
    lines.append(f"| held-out loss, final | **{_fmt(final_heldout)}** (at initialisation {_fmt(initial_heldout)}) |")
    if unigram is not None:
        verdict = ""
        if final_heldout is not None:
            verdict = (f" -- the model is {unigram - final_heldout:.3f} nats/byte below it"
                       if final_heldout < unigram else " -- the model is NOT below it")
        lines.append(f"| unigram baseline (held-out bytes under the training split's byte frequencies) | "
                     f"{_fmt(unigram)}{verdict} |")
    if summary.get("unigram_entropy") is not None:
        lines.append(f"| entropy of the training split's byte frequencies | {_fmt(summary['unigram_entropy'])} |")
    lines.append(f"| uniform over 256 bytes (log 256) | {math.log(256):.4f} |")
    if last_train:
        lines.append(f"| training loss, first step -> mean of the last {len(last_train)} | "
                     f"{_fmt(train[0]['loss'])} -> {_fmt(sum(r['loss'] for r in last_train) / len(last_train))} |")
    if step_s is not None:
        tps = f", {tokens / step_s:,.0f} tokens/s" if tokens else ""
        lines.append(f"| median step time | {step_s * 1000:.1f} ms{tps} |")
    if plan.get("predicted_step_ms") is not None and step_s is not None:
        predicted = plan["predicted_step_ms"]
        lines.append(f"| planner's predicted step time | {predicted:.1f} ms "
                     f"({predicted / (step_s * 1e3) - 1:+.0%} against the median) |")
    if plan.get("device_memory_mib") is not None:
        fit = (f"; {plan['candidates_fitting']} of {plan['candidates']} candidate plans fit"
               if plan.get("candidates") else "")
        lines.append(f"| memory per device | budget {plan['device_memory_mib']:g} MiB ({plan.get('budget_from')}); "
                     f"the plan needs {plan.get('predicted_memory_mib', float('nan')):.1f} MiB (predicted){fit} |")
    if summary.get("first_step_s") is not None:
        lines.append(f"| first step (includes compilation) | {summary['first_step_s']:.1f} s |")
    if summary.get("wall_s") is not None:
        lines.append(f"| wall time of the last invocation (start to report) | {summary['wall_s']:.1f} s |")
    if summary.get("resumed_from") is not None:
        lines.append(f"| resumed from checkpoint at step | {summary['resumed_from']} |")
    if plan.get("simulated_bubble") is not None:
        lines.append(f"| simulated bubble of the schedule (F = B, no communication) | "
                     f"{plan['simulated_bubble']:.1%} |")
    if summary.get("memory"):
        mem = summary["memory"]
        lines.append(f"| per-device memory of the compiled step | temp {mem.get('temp', 0) / 2**20:.1f} MiB, "
                     f"arguments {mem.get('argument', 0) / 2**20:.1f} MiB |")
    return lines


def _pictures_and_files(run_dir: str, plan: dict, pictures: str) -> list[str]:
    """The loss curves, the schedule, the planner's ranked candidates and the run folder's files."""
    lines = [""]
    if pictures:
        lines += [pictures, ""]
    if os.path.exists(os.path.join(run_dir, LOSS_PNG)):
        lines += [f"![loss curves]({LOSS_PNG})", ""]
    if os.path.exists(os.path.join(run_dir, SCHEDULE_PNG)):
        lines += ["## Schedule", "", f"![schedule]({SCHEDULE_PNG})", ""]
    if plan.get("gantt"):
        lines += ["```", plan["gantt"], "```", ""]
    if plan.get("planner_candidates"):
        lines += ["The planner's ranked candidates (predicted step time, bubble, memory per device):", "",
                  "```", plan["planner_candidates"], "```", ""]
    lines += ["## Files", "",
              (f"`{CONFIG}` (options; `jpipe train --config {CONFIG}` repeats the run), `{PLAN}`, `{METRICS}` "
              f"(one JSON object per step and per evaluation), `{SUMMARY}`, `checkpoints/` (orbax; "
              f"`jpipe train --out RUN_DIR --resume` continues), "
              f"`{LOSS_PNG}`, `{SCHEDULE_PNG}`. Re-render this report with `jpipe report RUN_DIR`."), ""]
    return lines
