"""The driver: run both sides on the same model, weights, batch and M; compare what they did.

:func:`run_comparison` writes the run's config and batch, starts the jpipe
worker (which creates the parameters with jpipe), the ``P`` torch ranks, and --
only for a jpipe schedule that is not registered -- a second jpipe worker that
replays torch's executed order; then :func:`compare` turns their outputs into
one :class:`PairResult` per schedule pair.

Only numpy and ``jpipe.schedules`` (tables and the simulator, no devices) are
used in this process; JAX computations and torch run in the workers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from experiments.compare_torch.jpipe_worker import Job, run_jpipe
from experiments.compare_torch.spec import (
    Order,
    RunConfig,
    SchedulePair,
    first_difference,
    grads_to_jpipe,
    held_from_order,
    normalize_order,
)
from experiments.compare_torch.torch_worker import run_torch

GRAD_TOLERANCE = {"float64": 1e-10, "float32": 1e-5}  # max |diff| <= tolerance x max |grad|
SIM_MODES = ("lockstep", "async")


@dataclasses.dataclass
class PairResult:
    """Everything compared for one schedule pair in one run."""

    pair: SchedulePair
    jpipe_source: str  # "generator" or "torch order replayed" (when jpipe lacks the generator)
    jpipe_order: list[Order]
    torch_order: list[Order]  # what torch executed, normalized to jpipe's kinds
    torch_reported: list[Order] | None  # what torch's pipeline_order says, normalized
    first_difference: list[int | None]  # per device: index of the first differing action
    grad_max_abs_diff: float
    grad_max_abs: float
    grad_tolerance: float
    loss_jpipe: float
    loss_torch: float
    held_jpipe: list[int]
    held_torch: list[int]
    jpipe_step_s: float
    torch_step_s: float
    jpipe_first_step_s: float
    jpipe_step_min_s: float
    torch_step_min_s: float
    jpipe_peak_rss_kib: int
    torch_peak_rss_kib: int  # summed over the P ranks
    jpipe_step_rss_kib: int  # peak during the timed steps minus RSS before them
    torch_step_rss_kib: int  # the same, summed over ranks
    bubble: dict[str, dict[str, float]]  # {"jpipe"|"torch": {mode: bubble fraction}}
    makespan: dict[str, dict[str, float]]
    jpipe_ticks: int
    torch_ticks: int  # ticks of torch's order timed in lock-step
    jpipe_gantt: str
    torch_gantt: str
    torch_timeline: list[list[tuple[str, int, int, float, float]]]  # per rank, last timed step
    tables: tuple[Any, Any] = dataclasses.field(repr=False, default=None)  # (jpipe Table, torch-order Table)

    @property
    def orders_equal(self) -> bool:
        return all(d is None for d in self.first_difference)

    @property
    def grads_ok(self) -> bool:
        return self.grad_max_abs_diff <= self.grad_tolerance * self.grad_max_abs

    @property
    def torch_reported_matches(self) -> list[bool] | None:
        if self.torch_reported is None:
            return None
        return [first_difference(a, b) is None for a, b in zip(self.torch_reported, self.torch_order)]


@dataclasses.dataclass
class RunResult:
    config: RunConfig
    pairs: list[PairResult]
    versions: dict[str, str]
    torch_threads: int
    load: dict[str, float] = dataclasses.field(default_factory=dict)  # 1-minute load average, start / end


def _jobs(config: RunConfig) -> list[Job]:
    return [Job(label=p.jpipe_label, virtual_stages=p.virtual_stages, split=p.split, schedule=p.jpipe_schedule,
                options=dict(p.jpipe_options)) for p in config.pairs()]


def run_comparison(config: RunConfig, workdir: Path, *, timeout: float = 900.0) -> RunResult:
    """Runs jpipe and torch for every schedule pair of ``config`` in ``workdir``; each side bounded by ``timeout``."""
    workdir.mkdir(parents=True, exist_ok=True)
    for pattern in ("params.npz", "load.json", "jpipe_*", "torch_rank*"):  # outputs of an earlier run
        for stale in workdir.glob(pattern):
            stale.unlink()
    (workdir / "config.json").write_text(config.to_json())
    np.savez(workdir / "batch.npz", **config.model.make_batch(config.batch_size, seed=config.seed))
    load = {"start": os.getloadavg()[0]}

    jpipe_results = run_jpipe(config, workdir, _jobs(config), timeout=timeout)  # also creates params.npz
    torch_results = run_torch(config, workdir, timeout=timeout)

    replays = []
    for p in config.pairs():
        if jpipe_results[p.jpipe_label].get("missing"):
            orders = [normalize_order(torch_results[r]["schedules"][p.torch_key]["order"], p.split)
                      for r in range(config.pipe)]
            replays.append(Job(label=f"replay-{p.name}", virtual_stages=p.virtual_stages, split=p.split,
                               orders=orders))
    if replays:
        jpipe_results.update(run_jpipe(config, workdir, replays, timeout=timeout))
    load["end"] = os.getloadavg()[0]
    (workdir / "load.json").write_text(json.dumps(load))
    return compare(config, workdir, jpipe_results, torch_results)


def load_outputs(config: RunConfig, workdir: Path) -> RunResult:
    """Compares the worker outputs already in ``workdir`` (to redo a report without rerunning)."""
    saved = RunConfig.from_json((workdir / "config.json").read_text())
    if saved != config:
        raise ValueError(f"{workdir} holds outputs of a different run: {saved} (asked for {config})")
    jpipe_results = {}
    for path in workdir.glob("jpipe_*.json"):
        jpipe_results[path.stem.removeprefix("jpipe_")] = json.loads(path.read_text())
    missing = [j.label for j in _jobs(config) if j.label not in jpipe_results]
    if missing:
        raise FileNotFoundError(f"{workdir} has no jpipe outputs for {missing}; run the comparison first")
    torch_results = [json.loads((workdir / f"torch_rank{r}.json").read_text()) for r in range(config.pipe)]
    return compare(config, workdir, jpipe_results, torch_results)


def _load_table(path: Path, name: str):
    from jpipe.schedules import FIELDS, Table

    data = np.load(path)
    num_devices, num_chunks, num_microbatches = (int(x) for x in data["meta"])
    return Table(name, num_devices, num_chunks, num_microbatches, **{f: data[f] for f in FIELDS})


def _costs(pair: SchedulePair):
    """F = B = W = 1 per layer-set of a device (each chunk of v costs 1/v): the ZB paper's unit costs."""
    from jpipe.schedules import Costs

    v = pair.virtual_stages
    return Costs(forward=1.0 / v, backward=1.0 / v, weight=1.0 / v)


def compare(config: RunConfig, workdir: Path, jpipe_results: dict[str, dict], torch_results: list[dict]
            ) -> RunResult:
    """Turns the workers' outputs in ``workdir`` into one :class:`PairResult` per schedule pair."""
    from jpipe.schedules import simulate, table_from_orders

    P, M = config.pipe, config.microbatches
    params_names = list(np.load(workdir / "params.npz").keys())
    tolerance = GRAD_TOLERANCE[config.model.dtype]
    out = []
    for pair in config.pairs():
        jr = jpipe_results[pair.jpipe_label]
        source = "generator"
        if jr.get("missing"):
            jr = jpipe_results[f"replay-{pair.name}"]
            source = "torch order replayed (" + jpipe_results[pair.jpipe_label]["reason"] + ")"
        label = pair.jpipe_label if source == "generator" else f"replay-{pair.name}"
        trs = [torch_results[r]["schedules"][pair.torch_key] for r in range(P)]

        jpipe_order = [[tuple(a) for a in o] for o in jr["order"]]
        torch_order = [normalize_order(t["order"], pair.split) for t in trs]
        reported = None
        if all(t["reported_order"] is not None for t in trs):
            reported = [normalize_order(t["reported_order"], pair.split) for t in trs]
        diffs = [first_difference(a, b) for a, b in zip(jpipe_order, torch_order)]

        jg = dict(np.load(workdir / f"jpipe_{label}_grads.npz"))
        merged: dict[str, np.ndarray] = {}
        for r in range(P):
            merged.update(np.load(workdir / f"torch_rank{r}_{pair.torch_key}.npz"))
        tg = grads_to_jpipe(merged, params_names)
        scale = max(float(np.abs(g).max()) for g in jg.values())
        worst = max(float(np.abs(jg[k] - tg[k]).max()) for k in params_names)

        jt = _load_table(workdir / f"jpipe_{label}_table.npz", jr["schedule_name"])
        tt = table_from_orders(torch_order, M, num_chunks=pair.virtual_stages, name=f"torch {pair.torch_class}")
        costs = _costs(pair)
        bubble, makespan = {}, {}
        for side, table in (("jpipe", jt), ("torch", tt)):
            sims = {mode: simulate(table, costs, mode=mode) for mode in SIM_MODES}
            bubble[side] = {mode: s.bubble_fraction for mode, s in sims.items()}
            makespan[side] = {mode: s.makespan for mode, s in sims.items()}

        per_step = [max(t["step_times"][i] for t in trs) for i in range(config.timed_steps)]
        torch_loss = next(t["loss"] for t in trs if t["loss"] is not None)
        out.append(PairResult(
            pair=pair, jpipe_source=source, jpipe_order=jpipe_order, torch_order=torch_order,
            torch_reported=reported, first_difference=diffs,
            grad_max_abs_diff=worst, grad_max_abs=scale, grad_tolerance=tolerance,
            loss_jpipe=jr["loss"], loss_torch=torch_loss,
            held_jpipe=list(jr["held"]), held_torch=[held_from_order(o, pair.split) for o in torch_order],
            jpipe_step_s=statistics.median(jr["step_times"]), torch_step_s=statistics.median(per_step),
            jpipe_first_step_s=jr["compile_and_first_step_s"],
            jpipe_step_min_s=min(jr["step_times"]), torch_step_min_s=min(per_step),
            jpipe_peak_rss_kib=jr["peak_rss_kib"], torch_peak_rss_kib=sum(t["peak_rss_kib"] for t in trs),
            jpipe_step_rss_kib=jr["peak_rss_kib"] - jr["rss_before_kib"],
            torch_step_rss_kib=sum(t["peak_rss_kib"] - t["rss_before_kib"] for t in trs),
            bubble=bubble, makespan=makespan, jpipe_ticks=jt.num_ticks, torch_ticks=tt.num_ticks,
            jpipe_gantt=str(jt), torch_gantt=str(tt),
            torch_timeline=[[tuple(a) for a in t["last_step_timeline"]] for t in trs],
            tables=(jt, tt),
        ))
    versions = {"jax": next(iter(jpipe_results.values())).get("jax_version", "?"),
                "torch": torch_results[0]["torch_version"]}
    load_path = workdir / "load.json"
    load = json.loads(load_path.read_text()) if load_path.exists() else {}
    return RunResult(config, out, versions, torch_results[0]["threads"], load)


def summary(run: RunResult) -> list[dict[str, Any]]:
    """One JSON-able row per pair (what the report's tables show)."""
    rows = []
    for r in run.pairs:
        rows.append({
            "model": run.config.model.label(), "P": run.config.pipe, "M": run.config.microbatches,
            "schedule": r.pair.name, "jpipe_source": r.jpipe_source, "orders_equal": r.orders_equal,
            "first_difference": r.first_difference, "torch_reported_matches": r.torch_reported_matches,
            "grad_rel_diff": r.grad_max_abs_diff / r.grad_max_abs, "grad_tolerance": r.grad_tolerance,
            "grads_ok": r.grads_ok, "loss_jpipe": r.loss_jpipe, "loss_torch": r.loss_torch,
            "held_jpipe": r.held_jpipe, "held_torch": r.held_torch,
            "jpipe_step_ms": 1e3 * r.jpipe_step_s, "torch_step_ms": 1e3 * r.torch_step_s,
            "step_ratio": r.jpipe_step_s / r.torch_step_s,
            "jpipe_step_min_ms": 1e3 * r.jpipe_step_min_s, "torch_step_min_ms": 1e3 * r.torch_step_min_s,
            "jpipe_peak_rss_mib": r.jpipe_peak_rss_kib / 1024, "torch_peak_rss_mib": r.torch_peak_rss_kib / 1024,
            "rss_ratio": r.jpipe_peak_rss_kib / r.torch_peak_rss_kib,
            "jpipe_step_rss_mib": r.jpipe_step_rss_kib / 1024, "torch_step_rss_mib": r.torch_step_rss_kib / 1024,
            "bubble": r.bubble, "makespan": r.makespan, "jpipe_ticks": r.jpipe_ticks, "torch_ticks": r.torch_ticks,
        })
    return rows


def save_summary(runs: list[RunResult], path: Path) -> None:
    path.write_text(json.dumps([row for run in runs for row in summary(run)], indent=1))
