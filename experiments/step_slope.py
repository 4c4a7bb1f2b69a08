"""Where is the planner's error? Its per-micro-batch part and its per-step part, on 2 CPU processes.

At a fixed micro-batch size the step time of a plan is a line in the number of micro-batches M:
its slope is what one more micro-batch costs (for pipe=2 1F1B, two lock-step ticks of the steady
phase), its intercept the step's fixed part (pipeline fill and drain, all-reduces, optimizer,
dispatch). This script times pipe=2 1F1B and data=2 at micro-batch ``--microbatch`` with three
values of M each (global batch grown with M), in turns over ``--rounds`` rounds with a profile
(``jpipe.partition.Profiler``) in every round, and prints both lines, predicted (from the mean of
the profiles) and measured, with each step's minor page faults (``ru_minflt``, process 0).

    python experiments/step_slope.py                      # about 4 min here
    python experiments/step_slope.py --keep-freed-memory  # glibc keeps freed memory (mallopt)

Same cluster set-up as ``planner_accuracy.py`` (half the cores per process, single-threaded XLA;
on one core each, the communication threads a short time slice). Session 7's figures are in ``planner_accuracy.md``: data=2's
slope within -10..+3 % of the prediction, pipe=2's 17-33 % above it in 5 of 6 runs; with
``--keep-freed-memory`` (no more faults) within 5 % in 2 runs and 18 % above in a third.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

import planner_accuracy as pa  # the same cluster set-up

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--microbatch", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=5, help="timed steps per plan and round")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="glibc keeps freed memory (mallopt: no mmap per request, no trimming)")
    return p.parse_args(argv)


def _keep_freed_memory() -> None:
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        raise SystemExit("mallopt refused the settings (not glibc?)")


def worker(argv: list[str]) -> None:
    cores = pa._own_cores()  # before jax starts its runtime
    args = parse(argv)
    if args.keep_freed_memory:
        _keep_freed_memory()
    import resource

    import jax
    import numpy as np
    import optax

    import jpipe
    from jpipe import distributed, models, partition

    distributed.initialize()
    devices = list(jax.devices())
    model = models.gpt(256, 32, d_model=64, num_heads=4, num_layers=4)
    optimizer = optax.adam(1e-3)
    rng = np.random.default_rng(0)

    def batches(size: int) -> list[dict]:
        return [{k: rng.integers(0, 256, (size, 32), dtype=np.int32) for k in ("tokens", "targets")}
                for _ in range(4)]

    def build(plan: jpipe.Plan, global_batch: int) -> dict:
        state, step, data, _ = pa.compile_plan(model, optimizer, plan, batches(global_batch), devices)
        return {"plan": plan, "B": global_batch, "state": state, "data": data, "times": [], "faults": [],
                "step": step}

    def step(run: dict, i: int) -> float:
        start = time.perf_counter()
        run["state"], metrics = run["step"](run["state"], run["data"][i % len(run["data"])])
        jax.block_until_ready((run["state"], metrics))
        return time.perf_counter() - start

    warm = build(jpipe.Plan(pipe=2, data=1, microbatches=2, schedule="1f1b"), 2 * args.microbatch)
    if cores == 1:  # gloo's threads share the core with the compute: see planner_accuracy.py
        pa._communication_threads_short_slice(lambda: [step(warm, i) for i in range(30)])
    mb = args.microbatch
    profiler = partition.Profiler(model, batches(mb)[0], optimizer=optimizer, devices=devices,
                                  microbatch_sizes=[mb], repeats=10)
    runs = [build(jpipe.Plan(pipe=2, data=1, microbatches=m, schedule="1f1b"), mb * m) for m in (2, 4, 8)]
    runs += [build(jpipe.Plan(pipe=1, data=2, microbatches=m, schedule="1f1b"), 2 * mb * m) for m in (1, 2, 4)]
    profiles = []
    for _ in range(args.rounds):
        profiles.append(profiler.measure())
        for run in runs:
            step(run, -1)  # untimed: the first step after another plan's runs cold
            for i in range(args.steps):
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                step(run, i)
                run["times"].append(time.perf_counter() - t0)
                run["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    if jax.process_index() != 0:
        return
    prof = partition.mean_profile(profiles)
    print(f"GPT 4 layers, d_model 64, seq 32, micro-batch {mb}; 2 processes; "
          f"keep freed memory: {'yes' if args.keep_freed_memory else 'no'}")
    print(f"{'pipe':>4} {'data':>4} {'M':>3} {'batch':>5} {'predicted ms':>12} {'measured ms':>11} {'error':>7} "
          f"{'faults/step':>11}")
    lines = {}
    for run in runs:
        plan = run["plan"]
        predicted = partition.evaluate(prof, plan, run["B"]).step_time * 1e3
        measured = partition.robust_mean(run["times"]) * 1e3
        lines.setdefault((plan.pipe, plan.data), []).append((plan.microbatches, predicted, measured))
        print(f"{plan.pipe:>4} {plan.data:>4} {plan.microbatches:>3} {run['B']:>5} {predicted:>12.2f} "
              f"{measured:>11.2f} {predicted / measured - 1:>+7.1%} {np.mean(run['faults']):>11.0f}")
    for (pipe, data), points in lines.items():
        m = [p[0] for p in points]
        (sp, ip), (sm, im) = (np.polyfit(m, [p[k] for p in points], 1) for k in (1, 2))
        print(f"pipe {pipe} x data {data}: per micro-batch predicted {sp:.2f} ms, measured {sm:.2f} ms "
              f"({sm / sp - 1:+.0%}); per step predicted {ip:.2f} ms, measured {im:.2f} ms ({im - ip:+.2f} ms)")


def main() -> None:
    parse()  # --help and argument errors before any process starts
    sys.exit(pa.launch_processes(worker, [sys.argv[1:]], processes=2, timeout=900))


if __name__ == "__main__":
    main()
