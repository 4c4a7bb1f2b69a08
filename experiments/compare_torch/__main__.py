"""Command line: ``python -m experiments.compare_torch --pipe 4 --microbatches 8``."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

from experiments.compare_torch.compare import load_outputs, run_comparison, save_summary
from experiments.compare_torch.report import write_report
from experiments.compare_torch.spec import ARCHS, DTYPES, PAIRS, ModelSpec, RunConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.compare_torch", description=__doc__)
    parser.add_argument("--pipe", type=int, default=4, help="devices / torch ranks (P)")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (M)")
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--layers", type=int, default=None, help="layers (default 2P: divisible by P x 2 chunks)")
    parser.add_argument("--archs", nargs="+", choices=ARCHS, default=list(ARCHS))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float64", "float32"])
    parser.add_argument("--schedules", nargs="+", choices=[p.name for p in PAIRS], default=[p.name for p in PAIRS])
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds allowed to each worker group")
    parser.add_argument("--out", type=Path, default=Path("experiments/compare_torch/results"))
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the workers exchange files (kept); default: a temporary folder, removed")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report from the outputs already in --workdir, running nothing")
    parser.add_argument("--no-figure", action="store_true")
    args = parser.parse_args(argv)
    if args.report_only and args.workdir is None:
        parser.error("--report-only needs --workdir (the folder of an earlier run)")
    # Stop the workers (their `finally`) when this driver is terminated.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    layers = args.layers or 2 * args.pipe
    runs = []
    scratch = None if args.workdir else tempfile.TemporaryDirectory(prefix="compare_torch_")
    workdir = args.workdir or Path(scratch.name)
    for arch in args.archs:
        for dtype in args.dtypes:
            config = RunConfig(ModelSpec(arch, num_layers=layers, dtype=dtype), pipe=args.pipe,
                               microbatches=args.microbatches, microbatch_size=args.microbatch_size,
                               schedules=tuple(args.schedules), warmup_steps=args.warmup_steps,
                               timed_steps=args.timed_steps)
            t0 = time.perf_counter()
            if args.report_only:
                run = load_outputs(config, workdir / config.model.label())
            else:
                run = run_comparison(config, workdir / config.model.label(), timeout=args.timeout)
            runs.append(run)
            bad = [r.pair.name for r in run.pairs if not r.grads_ok]
            print(f"{config.model.label()}: {len(run.pairs)} schedule pairs in {time.perf_counter() - t0:.0f} s; "
                  f"orders identical: {[r.pair.name for r in run.pairs if r.orders_equal]}; "
                  f"gradient mismatches: {bad or 'none'}", flush=True)
    given = list(argv if argv is not None else sys.argv[1:])
    shown = []  # the command that reproduces the run (without where its scratch files went)
    for i, a in enumerate(given):
        if a == "--report-only" or a.startswith("--workdir") or (i and given[i - 1] == "--workdir"):
            continue
        shown.append(a)
    commands = ["python -m experiments.compare_torch " + " ".join(shlex.quote(a) for a in shown),
                "python -m pytest tests/test_compare_torch.py  # the P=2 comparison, as CI runs it"]
    report = write_report(runs, args.out, commands, figure=not args.no_figure)
    save_summary(runs, args.out / "summary.json")
    print(f"wrote {report}")
    if scratch is not None:
        scratch.cleanup()
    return 0 if all(r.grads_ok for run in runs for r in run.pairs) else 1


if __name__ == "__main__":
    sys.exit(main())
