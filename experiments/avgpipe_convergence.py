"""Convergence on real text: synchronous DAPPLE 1F1B against AvgPipe with N = 2 (and 4) pipelines.

A small byte-level GPT (``jpipe.models.gpt``) on the built-in corpus (the Python
standard library's own source, ``jpipe.data``; no download). Every run sees the
same samples in the same order from the same initial parameters and uses Adam
with the same learning rate:

* sync: one pipeline (1F1B), global batch ``B`` per step;
* AvgPipe N: N co-located pipelines (advance-forward schedule), the same ``B``
  samples per step split into N per-pipeline batches of ``B / N``, each
  pipeline with its own Adam, coupled by elastic averaging (beta = N alpha =
  0.9, period 1, one-step-stale centre). Its curve is the *centre* model's.

Every ``--eval-every`` steps the held-out loss (fixed held-out windows,
evaluated by the plain sequential model on one device) is recorded. The target
is the synchronous run's final held-out loss; AvgPipe trains on the same
samples and, if its centre has not reached the target by then, on (up to
``--max-extra`` x the samples) until it does. Writes
``avgpipe_convergence.csv`` and, if matplotlib is installed,
``avgpipe_convergence.png`` into ``--out``.

    python experiments/avgpipe_convergence.py [--steps 200 --pipelines 2 4 --out experiments/out]
"""

from __future__ import annotations

import argparse
import csv
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import optax

import jpipe
from jpipe import averaging, data, models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--steps", type=int, default=200, help="steps of the synchronous run")
    add("--batch", type=int, default=16, help="global batch (sequences per step)")
    add("--seq-len", type=int, default=64)
    add("--d-model", type=int, default=64)
    add("--layers", type=int, default=4)
    add("--pipe", type=int, default=4)
    add("--microbatches", type=int, default=4)
    add("--lr", type=float, default=3e-3)
    add("--pipelines", type=int, nargs="+", default=[2])
    add("--beta", type=float, default=0.9)
    add("--eval-every", type=int, default=10)
    add("--eval-batches", type=int, default=8, help="held-out batches of 32 sequences")
    add("--max-extra", type=float, default=1.5, help="AvgPipe may train up to this x the sync samples")
    add("--max-chars", type=int, default=1_000_000)
    add("--seed", type=int, default=0)
    add("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    corpus = data.load(max_chars=args.max_chars)
    model = models.gpt(vocab_size=corpus.vocab_size, seq_len=args.seq_len, d_model=args.d_model,
                       num_heads=4, num_layers=args.layers)
    devices = jax.devices()[: args.pipe]
    max_steps = int(args.steps * args.max_extra)
    train = list(corpus.batches(args.seq_len, args.batch, seed=args.seed, num_batches=max_steps))
    heldout = list(corpus.batches(args.seq_len, 32, seed=1, split="heldout", num_batches=args.eval_batches))
    params0 = model.init_params(jax.random.key(args.seed), train[0])
    eval_loss = jax.jit(lambda p: sum(model.loss_value(p, b) for b in heldout) / len(heldout))
    print(f"GPT d={args.d_model} L={args.layers} T={args.seq_len}, batch {args.batch}, pipe={args.pipe}, "
          f"M={args.microbatches}, Adam lr={args.lr}; corpus {len(corpus)} bytes; unigram loss "
          f"{corpus.unigram_loss():.3f}", flush=True)

    def run(name, state, to_batch, read_params, steps, target=None):
        curve = [(0, 0, float(eval_loss(params0)), float("nan"))]
        start, losses = time.perf_counter(), []
        for step in range(1, steps + 1):
            state, metrics = jpipe.train_step(state, to_batch(train[step - 1]))
            losses.append(metrics["loss"])
            if step % args.eval_every == 0 or step == steps:
                held = float(eval_loss(read_params(state)))
                curve.append((step, step * args.batch, held, float(np.mean(jax.device_get(losses)))))
                losses = []
                if target is not None and held <= target and step >= args.steps:
                    break
        print(f"  {name}: {curve[-1][0]} steps, {curve[-1][1]} samples, held-out {curve[-1][2]:.4f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        return curve

    curves = {}
    plan = jpipe.Plan(pipe=args.pipe, data=1, microbatches=args.microbatches, schedule="1f1b")
    state = jpipe.init(model, plan, optax.adam(args.lr), train[0], params=params0, devices=devices)
    curves["sync"] = run("sync 1F1B", state, lambda b: b, jpipe.to_sequential, args.steps)
    target = curves["sync"][-1][2]

    for n in args.pipelines:
        if args.batch % (n * args.microbatches):
            raise SystemExit(f"--batch {args.batch} must be a multiple of N x M = {n} x {args.microbatches}")
        plan = jpipe.Plan(pipe=args.pipe, data=1, microbatches=args.microbatches, schedule="advance-forward")
        ens = averaging.split_batch(train[0], n)
        state = averaging.init(model, plan, optax.adam(args.lr), ens, pipelines=n, params=params0,
                               averaging=averaging.ElasticAveraging(beta=args.beta), devices=devices)
        curves[f"avgpipe-{n}"] = run(f"AvgPipe N={n}", state, lambda b, n=n: averaging.split_batch(b, n),
                                     averaging.centre, max_steps, target=target)

    path = os.path.join(args.out, "avgpipe_convergence.csv")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "step", "samples", "heldout_loss", "train_loss"])
        for name, curve in curves.items():
            w.writerows([name, *row] for row in curve)
    print(f"wrote {path}")

    sync_samples = curves["sync"][-1][1]
    print(f"\ntarget: the synchronous run's final held-out loss {target:.4f} after {sync_samples} samples")
    print("| run | samples to target | x sync | final held-out loss |")
    print("|---|---|---|---|")
    for name, curve in curves.items():
        hit = next((s for _, s, h, _ in curve if h <= target), None)
        ratio = f"{hit / sync_samples:.2f}" if hit else f"> {curve[-1][1] / sync_samples:.2f}"
        print(f"| {name} | {hit if hit else 'not reached'} | {ratio} | {curve[-1][2]:.4f} |")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, curve in curves.items():
        ax.plot([c[1] for c in curve], [c[2] for c in curve], label=name, marker=".")
    ax.axhline(target, color="grey", linestyle="--", linewidth=0.8, label="sync final")
    ax.set_xlabel("training samples (sequences)")
    ax.set_ylabel("held-out loss (nats / byte)")
    ax.set_ylim(top=min(ax.get_ylim()[1], curves["sync"][0][2] + 0.2))
    ax.set_title("Sync 1F1B vs AvgPipe (centre model), byte-level GPT on the stdlib corpus")
    ax.legend()
    fig.tight_layout()
    png = os.path.join(args.out, "avgpipe_convergence.png")
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
