"""jpipe's analogue of DAPPLE's Table 5: GPipe vs 1F1B (DAPPLE's early backward), each with and
without recomputation (remat): per-device memory and step time as the number of micro-batches M grows.

The micro-batch size is fixed, so the global batch grows with M. GPipe holds all M micro-batches'
activations (memory grows with M), 1F1B at most ``pipe - s`` (flat); remat keeps only stage
inputs. Memory is XLA's analysis of the compiled step (exact, per device); step time is the
median of the timed steps on 8 simulated CPU devices (it shows overheads, not GPU speed).
Writes a markdown table, a CSV and a PNG.

    python experiments/dapple_table5.py [--pipe 4 --data 2 --microbatch-size 4 --microbatches 2 4 8 16]
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

VARIANTS = [("gpipe", False), ("gpipe", True), ("1f1b", False), ("1f1b", True)]


def name(schedule: str, remat: bool) -> str:
    return {"gpipe": "GPipe", "1f1b": "1F1B"}[schedule] + (" + remat" if remat else "")


def table(rows: list[dict], ms: list[int]) -> str:
    head = "| schedule | " + " | ".join(f"M={m}" for m in ms) + " |"
    lines = ["Per-device temp memory of the compiled step (MiB) / step time (ms):", "", head,
             "|---|" + "---|" * len(ms)]
    for schedule, remat in VARIANTS:
        cells = []
        for m in ms:
            r = next((r for r in rows if (r["schedule"], r["remat"], r["microbatches"]) == (schedule, remat, m)), None)
            cells.append(f"{r['temp_mib']:.1f} / {r['step_ms']:.0f}" if r else "-")
        lines.append(f"| {name(schedule, remat)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=110)
    axes = fig.subplots(1, 2)
    for (schedule, remat), color in zip(VARIANTS, ["tab:orange", "tab:orange", "tab:blue", "tab:blue"]):
        sel = sorted((r for r in rows if (r["schedule"], r["remat"]) == (schedule, remat)),
                     key=lambda r: r["microbatches"])
        m = [r["microbatches"] for r in sel]
        style = "--" if remat else "-"
        axes[0].plot(m, [r["temp_mib"] for r in sel], style, marker="o", color=color, label=name(schedule, remat))
        axes[1].plot(m, [r["step_ms"] for r in sel], style, marker="o", color=color, label=name(schedule, remat))
    for ax, label in zip(axes, ("temp memory per device (MiB)", "step time (ms, 8 CPU devices)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["microbatches"] for r in rows}), [str(m) for m in sorted({r["microbatches"] for r in rows})])
        ax.minorticks_off()
        ax.set_xlabel("micro-batches M (fixed micro-batch size)")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--pipe", type=int, default=4)
    parser.add_argument("--data", type=int, default=2)
    parser.add_argument("--microbatch-size", type=int, default=4, help="sequences (of 64 bytes) per micro-batch")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=4, help="steps per configuration (the first is not timed)")
    args = parser.parse_args()

    os.makedirs(args.out, exist_ok=True)
    model = gpt(layers=8)
    rows, start = [], time.perf_counter()
    for m in args.microbatches:
        train = batches(args.microbatch_size * args.data * m, count=args.steps)
        for schedule, remat in VARIANTS:
            plan = jpipe.Plan(args.pipe, args.data, m, schedule=schedule, remat=remat)
            r = measure(model, plan, train, args.steps)
            rows.append(r)
            print(f"M={m:>3} {name(schedule, remat):>14}: temp {r['temp_mib']:7.2f} MiB, step {r['step_ms']:7.1f} ms, "
                  f"held {r['held_microbatches']}", flush=True)
    title = (f"GPT (8 layers, d_model 64, seq 64), pipe {args.pipe} x data {args.data}, "
             f"micro-batch {args.microbatch_size} sequences")
    text = f"{title}\n\n{table(rows, args.microbatches)}\n"
    print()
    print(text)
    base = os.path.join(args.out, "dapple_table5")
    with open(base + ".md", "w") as f:
        f.write(text)
    with open(base + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["schedule", "remat", "microbatches", "temp_mib", "argument_mib",
                                               "step_ms", "held_microbatches", "simulated_bubble", "compile_s"],
                                extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, base + ".png", title)
    print(f"wrote {base}.md, .csv and .png in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
