"""Every (pipe, data) mesh shape of 8 devices x schedule x number of micro-batches, on the model zoo's GPT.

For each configuration: the step's wall time (median over the timed steps), the per-device
temp memory of the compiled step (XLA's memory analysis, as ``jpipe.compiled_memory``), the
schedule's simulated bubble (``jpipe.schedules.simulate``, F = B, no communication), the
micro-batches a device holds at most, and the training loss after ``--steps`` steps from the
same initial parameters and batches (equal across configurations up to float rounding: every
plan computes the same gradients). Writes a CSV and a PNG.

    python experiments/mesh_sweep.py [--out experiments/results] [--steps 4] [--max-minutes 9]

Configurations run in order of M (smallest first); on a busy machine the ones that would
not finish within ``--max-minutes`` are skipped and listed, so the script always ends in time.
Times on 8 simulated CPU devices show overheads, not GPU speed.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench import batches, gpt, measure

import jpipe

SHAPES = [(1, 8), (2, 4), (4, 2), (8, 1)]
FIELDS = ["pipe", "data", "schedule", "microbatches", "step_ms", "temp_mib", "argument_mib", "simulated_bubble",
          "held_microbatches", "loss_first", "loss_last", "compile_s"]


def plot(rows: list[dict], path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4), dpi=110)
    axes = fig.subplots(1, 3)
    colors = {shape: c for shape, c in zip(SHAPES, ["tab:gray", "tab:blue", "tab:green", "tab:red"])}
    styles = {"gpipe": "--", "1f1b": "-"}
    for (pipe, data), color in colors.items():
        for schedule, style in styles.items():
            sel = sorted((r for r in rows if (r["pipe"], r["data"], r["schedule"]) == (pipe, data, schedule)),
                         key=lambda r: r["microbatches"])
            if not sel:
                continue
            m = [r["microbatches"] for r in sel]
            label = f"{pipe}x{data} {schedule}"
            for ax, key in zip(axes, ("step_ms", "temp_mib", "simulated_bubble")):
                ax.plot(m, [r[key] for r in sel], style, color=color, marker="o", markersize=3, label=label)
    for ax, title in zip(axes, ("step time (ms, 8 CPU devices)", "temp memory per device (MiB)",
                                "simulated bubble (F = B)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["microbatches"] for r in rows}), [str(m) for m in sorted({r["microbatches"] for r in rows})])
        ax.minorticks_off()
        ax.set_xlabel("micro-batches M")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, title="pipe x data", title_fontsize=7)
    fig.suptitle("jpipe mesh sweep: GPT (8 layers, d_model 64) on the standard-library corpus, global batch fixed")
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (sequences of --seq-len bytes)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4, help="steps per configuration (the first is not timed)")
    parser.add_argument("--max-minutes", type=float, default=9.0,
                        help="skip the remaining configurations (largest M last) once this would be exceeded")
    args = parser.parse_args()

    os.makedirs(args.out, exist_ok=True)
    model = gpt(layers=8, seq_len=args.seq_len)
    train = batches(args.batch_size, seq_len=args.seq_len, count=args.steps)
    rows, start = [], time.perf_counter()
    configs = [(pipe, data, schedule, m) for m in args.microbatches for pipe, data in SHAPES
               for schedule in args.schedules if args.batch_size % (data * m) == 0]
    print(f"{len(configs)} configurations, at most {args.max_minutes:g} minutes")
    print(f"{'pipe':>4} {'data':>4} {'schedule':>8} {'M':>3} {'step ms':>8} {'temp MiB':>9} {'bubble':>7} "
          f"{'held':>4} {'loss@k':>7} {'compile s':>9}")
    skipped = []
    for pipe, data, schedule, m in configs:
        elapsed = time.perf_counter() - start
        per = elapsed / len(rows) if rows else 0.0
        if elapsed + 1.5 * per > 60 * args.max_minutes:  # keep within the time budget on a busy machine
            skipped.append((pipe, data, schedule, m))
            continue
        r = measure(model, jpipe.Plan(pipe, data, m, schedule=schedule), train, args.steps)
        rows.append(r)
        print(f"{pipe:>4} {data:>4} {schedule:>8} {m:>3} {r['step_ms']:>8.1f} {r['temp_mib']:>9.2f} "
              f"{r['simulated_bubble']:>7.1%} {r['held_microbatches']:>4} {r['loss_last']:>7.4f} "
              f"{r['compile_s']:>9.1f}", flush=True)
    if skipped:
        print(f"skipped {len(skipped)} configurations to stay within --max-minutes {args.max_minutes:g}: "
              + ", ".join(f"{p}x{d} {s} M={m}" for p, d, s, m in skipped))
    csv_path = os.path.join(args.out, "mesh_sweep.csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    png_path = os.path.join(args.out, "mesh_sweep.png")
    plot(rows, png_path)
    losses = [r["loss_last"] for r in rows]
    print(f"loss after {args.steps} steps: {min(losses):.5f} .. {max(losses):.5f} over {len(rows)} configurations")
    print(f"wrote {csv_path} and {png_path} in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
