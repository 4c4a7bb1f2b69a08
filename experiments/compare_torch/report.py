"""Writes the comparison report: ``REPORT.md`` (tables, orders, explanations) and a PNG figure."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from pathlib import Path

from experiments.compare_torch.compare import PairResult, RunResult
from experiments.compare_torch.spec import format_order

KIND_COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#55A868", "W": "#DD8452"}


def _mib(kib: float) -> str:
    return f"{kib / 1024:.0f}"


def _held(values: Sequence[int]) -> str:
    return " ".join(str(v) for v in values)


def _order_block(r: PairResult, num_devices: int) -> list[str]:
    lines = []
    for d in range(num_devices):
        j = format_order(r.jpipe_order[d], num_devices)
        t = format_order(r.torch_order[d], num_devices)
        diff = r.first_difference[d]
        lines.append(f"d{d} jpipe: {j}")
        lines.append(f"   torch: {'(identical)' if diff is None else t}")
        if diff is not None:
            lines.append(f"          first difference at action {diff}")
        if r.torch_reported is not None and r.torch_reported[d] != r.torch_order[d]:
            lines.append(f"   torch pipeline_order says: {format_order(r.torch_reported[d], num_devices)}")
    return lines


def _model_line(run: RunResult) -> str:
    m = run.config.model
    if m.arch == "mlp":
        what = f"MLP: Linear({m.in_dim}->{m.hidden}), {m.num_layers} x (h + tanh(Linear(h))), Linear->{m.out_dim}, MSE"
    else:
        what = (f"transformer: token+position embedding (vocab {m.vocab}, T={m.seq_len}), {m.num_layers} pre-norm "
                f"blocks (d={m.hidden}, {m.heads} heads, MLP x{m.mlp_ratio}, tanh-GELU), LayerNorm + head, "
                "cross-entropy")
    return f"{what}; {m.dtype}"


def write_report(runs: Sequence[RunResult], out_dir: Path, commands: Sequence[str], figure: bool = True
                 ) -> Path:
    """Writes ``out_dir/REPORT.md`` (and ``out_dir/compare_torch.png`` when matplotlib is available)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "compare_torch.png"
    figure_note = ""
    if figure:
        try:
            write_figure(runs, png)
        except ImportError as e:
            figure_note = f"(no figure: {e}; `pip install matplotlib` to draw it)"
    first = runs[0]
    P, M = first.config.pipe, first.config.microbatches
    L: list[str] = []
    L += [f"# jpipe vs torch.distributed.pipelining: P={P}, M={M}", ""]
    L += [("Same architectures, same weights (created by jpipe, copied into torch by "
          "`experiments/compare_torch/torch_models.py:to_torch`), same batch, same number of micro-batches. "
          f"torch {first.versions['torch']} runs {P} local processes (gloo on 127.0.0.1, "
          f"{first.torch_threads} intra-op thread each); jpipe (jax {first.versions['jax']}) runs one SPMD "
          f"program on {P} simulated CPU devices in one process. Machine: {os.cpu_count()} CPU cores "
          f"({platform.machine()}), shared with other work while this ran, so times are indicative."), ""]
    L += ["Reproduce (from the repository root, with `pip install \".[compare]\"`):", "", "```bash"]
    L += list(commands) + ["```", ""]
    for run in runs:
        L.append(f"- `{run.config.model.label()}`: {_model_line(run)}; micro-batch of "
                 f"{run.config.microbatch_size}, {run.config.timed_steps} timed steps after "
                 f"{run.config.warmup_steps + 1} warm-up steps")
    loads = [f"{run.config.model.label()} {run.load['start']:.1f} -> {run.load['end']:.1f}" for run in runs
             if run.load]
    if loads:
        L += ["", f"1-minute load average at the start and end of each run ({os.cpu_count()} cores): "
              + "; ".join(loads) + "."]
    L.append("")

    # -- summary ---------------------------------------------------------------------------
    L += ["## Summary", "",
          ("| model | schedule | orders identical | grad max abs diff / max abs grad (bound) | held jpipe | "
          "held torch | step jpipe / torch (ms) | ratio | peak RSS jpipe / torch (MiB) | ratio |"),
          "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for r in run.pairs:
            ok = "yes" if r.orders_equal else "**no** (see below)"
            g = f"{r.grad_max_abs_diff / r.grad_max_abs:.1e} ({r.grad_tolerance:.0e}) {'ok' if r.grads_ok else '**FAIL**'}"
            L.append(f"| {run.config.model.label()} | {r.pair.name} | {ok} | {g} | {_held(r.held_jpipe)} | "
                     f"{_held(r.held_torch)} | {1e3 * r.jpipe_step_s:.1f} / {1e3 * r.torch_step_s:.1f} | "
                     f"{r.jpipe_step_s / r.torch_step_s:.2f} | {_mib(r.jpipe_peak_rss_kib)} / "
                     f"{_mib(r.torch_peak_rss_kib)} | {r.jpipe_peak_rss_kib / r.torch_peak_rss_kib:.2f} |")
    L.append("")
    L += [f"**jpipe / torch ratios at P={P}, M={M}** (step time, peak RSS; below 1: jpipe is faster / smaller):", "",
          "| schedule | " + " | ".join(run.config.model.label() for run in runs) + " |",
          "|---|" + "---|" * len(runs)]
    for i, r0 in enumerate(first.pairs):
        cells = [f"{run.pairs[i].jpipe_step_s / run.pairs[i].torch_step_s:.2f} time, "
                 f"{run.pairs[i].jpipe_peak_rss_kib / run.pairs[i].torch_peak_rss_kib:.2f} RSS" for run in runs]
        L.append(f"| {r0.pair.name} | " + " | ".join(cells) + " |")
    L.append("")
    if figure_note:
        L += [figure_note, ""]
    else:
        L += [("![jpipe lock-step tables (simulated, unit costs) next to torch's measured last step]"
              "(compare_torch.png)"), ""]

    # -- (a) orders ------------------------------------------------------------------------
    L += ["## (a) Executed action order per device", "",
          ("jpipe: the rows of its lock-step table (what the SPMD program executes, tick by tick). torch: the "
          "order in which each rank's stages actually ran `forward_one_chunk` / `backward_one_chunk` / "
          "`backward_weight_one_chunk` in the first step (recorded by wrapping them). `F3` is micro-batch 3 "
          "on the device's first stage, `F3.1` on its second (interleaved) stage; in split schedules `B` is "
          "the input gradient (torch's `I`) and `W` the weight gradient. Orders do not depend on the model, "
          "so they are shown once."), ""]
    for r in first.pairs:
        src = "" if r.jpipe_source == "generator" else f" -- jpipe side: {r.jpipe_source}"
        opts = "".join(f", {k}={v}" for k, v in r.pair.jpipe_options)
        L += [(f"### {r.pair.name}: torch `{r.pair.torch_class}` vs jpipe `{r.pair.jpipe_schedule}`"
              f" (virtual_stages={r.pair.virtual_stages}{opts}){src}"), "", "```"]
        L += _order_block(r, P)
        L += ["```", ""]
    reported = [(r.pair.name, d) for r in first.pairs for d, ok in enumerate(r.torch_reported_matches or [])
                if not ok]
    if reported:
        L += ["torch's `pipeline_order` (the table the schedule reports) differs from what it executes for: "
              + ", ".join(f"{name} rank {d}" for name, d in reported)
              + ". In 2.13.0 `Schedule1F1B._get_pipeline_order` starts the last rank's steady state at "
              "`forward_mb + 1` with no warm-up forward, so it lists F1..FM instead of F0..F(M-1); "
              "`_step_microbatches` runs F0 first. The comparison uses the executed order.", ""]

    # -- (b) gradients ---------------------------------------------------------------------
    L += ["## (b) Gradients after one step", "",
          ("Both sides start from the same parameters; the gradient of the mean loss over the batch "
          "(jpipe: its step's gradient, mapped back to the sequential layout by `jpipe.to_sequential`; torch: "
          "`param.grad` after `schedule.step`, scaled by 1/M as `scale_grads=True` does) is compared leaf by leaf."),
          "", "| model | schedule | max abs diff | max abs grad | ratio | bound | loss jpipe | loss torch |",
          "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for r in run.pairs:
            L.append(f"| {run.config.model.label()} | {r.pair.name} | {r.grad_max_abs_diff:.2e} | "
                     f"{r.grad_max_abs:.2e} | {r.grad_max_abs_diff / r.grad_max_abs:.1e} | {r.grad_tolerance:.0e} | "
                     f"{r.loss_jpipe:.12g} | {r.loss_torch:.12g} |")
    L.append("")
    loose = [r for run in runs for r in run.pairs if run.config.model.dtype == "float64"
             and abs(r.loss_jpipe - r.loss_torch) > 1e-12 * abs(r.loss_torch)]
    if loose:
        L += [("In float64 the losses agree only to about float32 precision while the gradients agree to "
              "float64 precision: jpipe's executor accumulates the *reported* loss in float32 "
              "(`jpipe/_executor.py`, `loss=jnp.zeros((), jnp.float32)` and `loss.astype(jnp.float32)`). "
              "The gradients do not go through that path."), ""]

    # -- (c) held --------------------------------------------------------------------------
    L += ["## (c) Peak held micro-batches per device", "",
          ("(micro-batch, stage) pairs whose forward has run and whose last backward action (B, or W when "
          "split) has not, from each side's executed order (jpipe: `Table.held_microbatches()`)."), "",
          "| schedule | jpipe | torch |", "|---|---|---|"]
    for r in first.pairs:
        L.append(f"| {r.pair.name} | {_held(r.held_jpipe)} | {_held(r.held_torch)} |")
    L.append("")

    # -- (d) time and memory ---------------------------------------------------------------
    L += ["## (d) Step time and peak memory", "",
          ("Median over the timed steps of one training step (forward + backward of all M micro-batches and "
          "the SGD update); torch's step time is the slowest rank's, between two barriers. The machine was "
          "heavily shared (load averages above), so medians of 10 steps vary by up to 2x between runs; the "
          "fastest step is less sensitive to the other load. Peak RSS is "
          "`VmHWM` from `/proc/self/status`, reset (`clear_refs`) before the timed steps: jpipe's one "
          "process against the sum of torch's P processes. 'step increment' is that peak minus the RSS "
          "just before the timed steps (what the steps themselves add). Each process's baseline (the "
          "framework, XLA's compiled programs, torch's libraries) dominates the totals at these model sizes."),
          "", ("| model | schedule | jpipe ms | torch ms | jpipe/torch | fastest step jpipe / torch ms (ratio) | jpipe first step (compile) s | "
          "peak RSS jpipe MiB | torch MiB | jpipe/torch | step increment jpipe / torch MiB |"),
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for r in run.pairs:
            L.append(f"| {run.config.model.label()} | {r.pair.name} | {1e3 * r.jpipe_step_s:.2f} | "
                     f"{1e3 * r.torch_step_s:.2f} | {r.jpipe_step_s / r.torch_step_s:.2f} | "
                     f"{1e3 * r.jpipe_step_min_s:.2f} / {1e3 * r.torch_step_min_s:.2f} "
                     f"({r.jpipe_step_min_s / r.torch_step_min_s:.2f}) | "
                     f"{r.jpipe_first_step_s:.1f} | {_mib(r.jpipe_peak_rss_kib)} | {_mib(r.torch_peak_rss_kib)} | "
                     f"{r.jpipe_peak_rss_kib / r.torch_peak_rss_kib:.2f} | {r.jpipe_step_rss_kib / 1024:.1f} / "
                     f"{r.torch_step_rss_kib / 1024:.1f} |")
    L.append("")

    # -- (e) bubble ------------------------------------------------------------------------
    L += ["## (e) Simulated bubble under one cost model", "",
          ("`jpipe.schedules.simulate` on both tables (torch's executed order turned into a table by "
          "`table_from_orders`) with F = B = W = 1 per device's share of layers (1/v per chunk; an unsplit B "
          "costs B + W = 2) and no communication cost. `lockstep` times ticks as jpipe's SPMD program runs "
          "them; `async` runs each device's order as soon as inputs arrive, as torch's MPMD runtime does. "
          "Bubble = idle device-time / (P x makespan)."), "",
          "| schedule | jpipe lockstep | jpipe async | torch async | torch lockstep | ticks jpipe / torch |",
          "|---|---|---|---|---|---|"]
    for r in first.pairs:
        b = r.bubble
        L.append(f"| {r.pair.name} | {b['jpipe']['lockstep']:.3f} (makespan {r.makespan['jpipe']['lockstep']:.2f}) | "
                 f"{b['jpipe']['async']:.3f} | {b['torch']['async']:.3f} (makespan "
                 f"{r.makespan['torch']['async']:.2f}) | {b['torch']['lockstep']:.3f} | "
                 f"{r.jpipe_ticks} / {r.torch_ticks} |")
    L += ["", (f"Reference: GPipe/1F1B bubble (P-1)/(M+P-1) = {(P - 1) / (M + P - 1):.3f}; interleaved (v=2) "
          f"(P-1)/(vM+P-1) = {(P - 1) / (2 * M + P - 1):.3f}."), ""]

    # -- differences -----------------------------------------------------------------------
    L += ["## Intended differences", "", *_explanations(first), ""]
    path = out_dir / "REPORT.md"
    path.write_text("\n".join(L))
    return path


def _explanations(run: RunResult) -> list[str]:
    by = {r.pair.name: r for r in run.pairs}
    out = [
        ("- **Execution model.** jpipe runs one jitted SPMD program per step: a `lax.scan` over the table's "
        "ticks in which every device runs at most one action and then activations and cotangents move one "
        "hop (`ppermute`) for everybody at once, so a tick lasts as long as its slowest action. torch runs "
        "P independent eager processes that block on point-to-point gloo receives, so each rank starts an "
        "action as soon as its input has arrived (the `async` column). Same orders therefore give the same "
        "dependencies but different timing whenever actions differ in cost (e.g. the last stage's loss, "
        "the first stage's embedding, unsplit backwards taking ~2 F)."),
        ("- **Where the time goes.** jpipe's step is one XLA executable (no Python per action, no "
        "per-message serialization), but all P simulated devices share the same CPU cores inside one "
        "process and every tick runs a `lax.switch` over F/B/W plus two collectives. torch pays Python "
        "dispatch and a gloo send/recv (through the loopback TCP stack) per action. At these sizes both "
        "are overhead-bound; the ratios say more about runtime overhead than about schedule quality."),
        ("- **Memory.** jpipe's buffers are sized by the table's liveness (`in`/`res`/`cot` slots) and "
        "allocated once for the whole step; torch keeps each micro-batch's autograd graph alive from its "
        "forward to its backward. Held counts match whenever the orders match."),
    ]
    if "gpipe" in by and "1f1b" in by:
        g, o = by["gpipe"], by["1f1b"]
        out.append(
            "- **Lock-step ticks and unequal costs.** With an unsplit backward costing 2 F, a lock-step tick "
            "that pairs an F on one device with a B on another lasts 2: 1F1B's steady state does exactly that, "
            f"so its lock-step makespan is {o.makespan['jpipe']['lockstep']:.0f} against "
            f"{o.makespan['torch']['async']:.0f} when run asynchronously (bubble "
            f"{o.bubble['jpipe']['lockstep']:.3f} vs {o.bubble['torch']['async']:.3f}), while GPipe's "
            f"all-F then all-B phases have uniform ticks ({g.makespan['jpipe']['lockstep']:.0f} both ways). "
            "With F = B (the unit the tables are drawn in) both give (P-1)/(M+P-1). The same holds for "
            "interleaved 1F1B; ZB-H1, whose F, B and W cost the same, loses nothing to lock-step.")
    if "interleaved-1f1b" in by and "interleaved-1f1b-megatron" in by:
        d, m = by["interleaved-1f1b"], by["interleaved-1f1b-megatron"]
        out.append(
            "- **Interleaved warm-up.** jpipe's default `interleaved-1f1b` warms device d up with "
            "(v-1)g + P - d forwards (g: the first round's size): the fewest that never stall in lock-step "
            "ticks. torch's `ScheduleInterleaved1F1B` uses Megatron-LM's (v-1)g + 2(P-1-d) + 1, which "
            "leaves slack for communication in an asynchronous runtime. Same lock-step length "
            f"({d.jpipe_ticks} vs {m.jpipe_ticks} ticks), held {_held(d.held_jpipe)} vs {_held(m.held_jpipe)}. "
            "`interleaved_1f1b(..., megatron_warmup=True)` reproduces torch's order"
            + (" exactly (see above)." if m.orders_equal else " -- but here it does NOT match; see (a)."))
    if "zb-h1" in by:
        z = by["zb-h1"]
        out.append(
            "- **ZB-H1.** torch has no ZB-H1 class; its `ScheduleInterleavedZeroBubble` (ZB1P) with one stage "
            "per rank is ZB-H1: 1F1B's warm-up, B (torch: I) instead of the full backward, and rank r defers "
            "its first r weight gradients, so every rank holds at most P micro-batches. "
            + ("jpipe's `zb-h1` executes the same order. " if z.orders_equal else
               "jpipe's `zb-h1` orders differ (see (a)). ")
            + "On the first stage torch's I is a no-op (no input gradient is needed) and its W runs the whole "
            "backward; jpipe's B on the first stage computes (and drops) the input gradient.")
    out.append(
        "- **torch's reported `pipeline_order`.** For single-stage schedules it is only a description; "
        "`Schedule1F1B` runs its own loop, and in 2.13.0 the description is off by one on the last rank "
        "(the comparison uses what ran).")
    return out


def write_figure(runs: Sequence[RunResult], path: Path) -> None:
    """Per schedule: jpipe's table timed in lock-step with unit costs | torch's measured last step (of the
    transformer float32 run when there is one). Bottom: step time and peak RSS of every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.compare_torch.compare import _costs
    from jpipe.schedules import simulate

    # Gantts of the run with the most compute per step (torch's timeline is mostly overhead otherwise)
    first = max(runs, key=lambda run: (run.config.model.arch == "transformer", run.config.model.dtype == "float32"))
    P = first.config.pipe
    n = len(first.pairs)
    fig, axes = plt.subplots(n + 1, 2, figsize=(15, 1.0 + 1.25 * (n + 1) + 0.25 * P * n), squeeze=False)
    for i, r in enumerate(first.pairs):
        jt, _ = r.tables
        sim = simulate(jt, _costs(r.pair), mode="lockstep")
        ax = axes[i][0]
        for a, s in sim.start.items():
            d = a.stage % P
            ax.barh(d, sim.end[a] - s, left=s, color=KIND_COLORS[a.kind], edgecolor="white",
                    alpha=1.0 if a.stage < P else 0.6)
            ax.text(s + (sim.end[a] - s) / 2, d, str(a.microbatch), ha="center", va="center", fontsize=6)
        ax.set_title(f"jpipe {r.pair.jpipe_label}: lock-step, F=B=W=1 (bubble "
                     f"{r.bubble['jpipe']['lockstep']:.2f})", fontsize=8)
        ax.set_yticks(range(P), [f"d{d}" for d in range(P)])
        ax.invert_yaxis()
        ax = axes[i][1]
        for d, timeline in enumerate(r.torch_timeline):
            for kind, mb, stage, s, e in timeline:
                ax.barh(d, 1e3 * (e - s), left=1e3 * s, color=KIND_COLORS[kind], edgecolor="white",
                        alpha=1.0 if stage < P else 0.6)
        ax.set_title(f"torch {r.pair.torch_class}, {first.config.model.label()}: measured last step, ms "
                     f"(median step {1e3 * r.torch_step_s:.1f} ms)", fontsize=8)
        ax.set_xlim(left=0)
        ax.set_yticks(range(P), [f"rank {d}" for d in range(P)])
        ax.invert_yaxis()
    labels = [f"{run.config.model.label()}\n{r.pair.name}" for run in runs for r in run.pairs]
    x = range(len(labels))
    for j, (title, jv, tv) in enumerate((
            ("median step time (ms)", lambda r: 1e3 * r.jpipe_step_s, lambda r: 1e3 * r.torch_step_s),
            ("peak RSS (MiB; torch summed over ranks)", lambda r: r.jpipe_peak_rss_kib / 1024,
             lambda r: r.torch_peak_rss_kib / 1024))):
        ax = axes[n][j]
        rows = [r for run in runs for r in run.pairs]
        ax.bar([k - 0.2 for k in x], [jv(r) for r in rows], width=0.4, label="jpipe")
        ax.bar([k + 0.2 for k in x], [tv(r) for r in rows], width=0.4, label="torch")
        ax.set_xticks(list(x), labels, fontsize=6, rotation=60, ha="right")
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#4C72B0", "#55A868", "#DD8452")]
    fig.legend(handles, ["F", "B (torch I)", "W"], loc="upper center", fontsize=7, ncol=3)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)
