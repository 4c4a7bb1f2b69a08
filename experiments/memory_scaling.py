"""Where the training state lives, per layout (``Plan.shard``), and the largest GPT that would fit.

The model zoo's GPT (vocab 8192, Adam, float32 parameters and optimizer state) at three
sizes on the meshes 8x1, 4x2, 2x4 and 1x8 (pipe x data; 8 simulated CPU devices when there
is no accelerator), each with the three state layouts of :mod:`jpipe._sharding`: ``None``
(today's layout: embedding, head and their Adam state on every device, each stage's Adam
state on every data replica), ``"optimizer"`` and ``"parameters"``. For each it prints:

* ``fullest``: the state bytes on the fullest device, read from the shards: the sum over
  the leaves of ``state.params`` and ``state.opt_state`` of ``shard.data.nbytes`` of every
  ``leaf.addressable_shards`` entry, per device, then the max over devices;
* ``ideal``: the whole state (params + Adam state, global bytes) / 8 devices, and
  ``fullest / ideal``;
* ``formula``: the same fullest-device bytes from the closed-form model used for the
  extrapolation below (a check of that model: it should match ``fullest``);
* ``temp``: the compiled step's per-device temp bytes (XLA's memory analysis of
  ``train_step.lower(state, batch).compile()``, exactly what ``jpipe.compiled_memory(state,
  batch)["temp"]`` returns; the compiled step is reused for the timing so nothing compiles twice);
* ``step``: the step's wall time (median over rounds) and its ratio to today's layout on the
  same mesh. The three layouts of a mesh are compiled, warmed up and then timed side by side:
  ``--rounds`` rounds, each running every layout's ``--steps`` steps in turn (the order rotates
  every round), so that a shared machine's changing load hits them alike. The ratio is the
  median of a layout's per-round times over the median of today's; the bracket is the range
  of the per-round paired ratios (each round's time over today's time in that round).

Every mesh uses the same global batch (``--batch`` sequences of ``--seq-len`` tokens, random
tokens) and the same number of micro-batches (``--microbatches``, 1F1B).

Then it extrapolates the largest GPT that trains on 8 and on 64 devices of 80 GB (80e9 bytes)
for each layout -- today's (``None``) and the best one (``"parameters"``) in particular -- from
this model of the bytes on the fullest device of a ``pipe x data`` mesh of ``N`` devices::

    P_edge  = V d + S d + 2 d + d V + V               (embedding + positions, final LN + head)
    P_layer = 12 d^2 + 13 d                           (a pre-norm block, MLP ratio 4)
    k       = ceil(L / pipe)                          (layers on the fullest device)
    state, shard=None:          12 (P_edge + k P_layer)                    [4 B param + 8 B Adam]
    state, shard="optimizer":    4 (P_edge / N + k P_layer) + 8 (P_edge / N + k P_layer / data)
    state, shard="parameters":  12 (P_edge / N + k P_layer / data)        (= whole state / N)
    temp                      = alpha[layout] (W_edge + W_stage),  W_edge = 4 P_edge,  W_stage = 4 k P_layer
    total                     = state + temp  <=  80e9 bytes

``W_edge + W_stage`` is the float32 bytes of the parameters one device's step computes with,
gathered whole (the step gathers sharded ``pre``/``post`` and stage parameters, and its float32
gradient accumulators are as large). ``alpha`` is measured per layout at the largest size run:
the step is compiled once more with micro-batches of one sequence (a global batch of ``data x
microbatches``; on 1x8 that is the table's own) and its temp divided by ``W_edge + W_stage``;
the extrapolation takes the largest over the meshes and, in its last column, the smallest.
(The table's temp, at the common global batch, holds up to 8 sequences per micro-batch, whose
activations are as large as the weights at these sizes; temp does not scale linearly with the
batch, so no intercept over batch sizes is fitted. On 8 devices with 8 layers the layers per
device and ``data`` move together, ``k = data = 8 / pipe``, so a fit of separate coefficients
for the embedding/head and the stage would not be identified: one ratio it is.) The
extrapolated GPT has GPT-3's shapes: ``d_model`` a multiple of 128 with 128-wide heads and
``L = d_model / 128`` layers (GPT-3 175B: d 12288, 96 layers), vocab 50257, 2048-token
sequences; the mesh is the best ``pipe x data`` of ``N`` (``pipe`` dividing ``N``, at most ``L``).

What the model leaves out (so its sizes are upper bounds): activations beyond what the
measured temp holds (one sequence of 32 tokens per micro-batch), while a micro-batch of one
2048-token sequence holds ``S d`` floats per stage input (1F1B holds up to ``pipe`` of them on
the first stage), ``S V`` logits on the last and, without remat, every layer's intermediates of
every held micro-batch; memory fragmentation and the runtime's own reserve; and that XLA on a
GPU may plan temp buffers differently from XLA on this CPU.

    python experiments/memory_scaling.py                  # 3 sizes x 4 meshes x 3 layouts
    python experiments/memory_scaling.py --quick          # 1 size, 2 meshes, 2 rounds: a check
    python experiments/memory_scaling.py --json out.json  # also write every row and the extrapolation
    python experiments/memory_scaling.py --from-json out.json  # print the tables again, measure nothing

Times on 8 simulated CPU devices sharing the machine's cores show overheads (the gathers and
reduce-scatters of the sharded layouts against the all-reduces of today's), not GPU speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import numpy as np
import optax

import jpipe
from jpipe import models

VOCAB = 8192
HEAD_DIM = 32  # heads = d_model / 32 for the measured sizes
MLP_RATIO = 4
MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]
SHARDS = (None, "optimizer", "parameters")
DEVICES = 8

# Adam on float32 parameters: 4 bytes of parameter + 8 bytes of moments per parameter.
PARAM_BYTES, ADAM_BYTES = 4, 8
GB80 = 80e9
# The extrapolated GPT (GPT-3 shapes).
X_VOCAB, X_SEQ, X_HEAD_DIM = 50257, 2048, 128


def layout_name(shard: str | None) -> str:
    return "None (today)" if shard is None else repr(shard)


# --------------------------------------------------------------------------------------------
# The closed-form model of the state (checked against the shards below, used to extrapolate)
# --------------------------------------------------------------------------------------------


def edge_params(vocab: int, seq_len: int, d: int) -> int:
    """Embedding (tokens + positions) and the final LayerNorm + vocabulary head."""
    return vocab * d + seq_len * d + 2 * d + d * vocab + vocab


def layer_params(d: int, mlp_ratio: int = MLP_RATIO) -> int:
    """One pre-norm block: qkv, proj, fc, out (kernels + biases) and two LayerNorms."""
    return (4 + 2 * mlp_ratio) * d * d + (9 + mlp_ratio) * d


def state_bytes(shard: str | None, p_edge: int, p_layer: int, layers: int, pipe: int, data: int) -> float:
    """Bytes of parameters + Adam state on the fullest device of a ``pipe x data`` mesh."""
    n, k = pipe * data, math.ceil(layers / pipe)
    if shard is None:
        return (PARAM_BYTES + ADAM_BYTES) * (p_edge + k * p_layer)
    if shard == "optimizer":
        return PARAM_BYTES * (p_edge / n + k * p_layer) + ADAM_BYTES * (p_edge / n + k * p_layer / data)
    return (PARAM_BYTES + ADAM_BYTES) * (p_edge / n + k * p_layer / data)


def step_weights(p_edge: int, p_layer: int, layers: int, pipe: int) -> tuple[float, float]:
    """``(W_edge, W_stage)``: float32 bytes of the parameters one device's step computes with,
    gathered whole: ``pre`` + ``post``, and the layers of the fullest device's stage."""
    return PARAM_BYTES * p_edge, PARAM_BYTES * math.ceil(layers / pipe) * p_layer


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


def per_device_bytes(tree: Any) -> dict:
    """Bytes each device holds of ``tree``: ``shard.data.nbytes`` summed over every leaf's shards."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def global_bytes(tree: Any) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def make_batch(size: int, seq_len: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, VOCAB, (size, seq_len)).astype(np.int32),
            "targets": rng.integers(0, VOCAB, (size, seq_len)).astype(np.int32)}


def measure_size(d: int, layers: int, args: argparse.Namespace, say, one_sequence: bool) -> list[dict]:
    """Every mesh x layout of one GPT size: bytes from the shards, temp, step times side by side.

    With ``one_sequence``, also the temp at micro-batches of one sequence (a second compilation with a
    global batch of ``data x microbatches`` sequences, where that differs from ``--batch``)."""
    model = models.gpt(VOCAB, args.seq_len, d_model=d, num_heads=d // HEAD_DIM, num_layers=layers,
                       mlp_ratio=MLP_RATIO)
    batch = make_batch(args.batch, args.seq_len)
    seq_params = model.init_params(jax.random.key(0), {k: v[:2] for k, v in batch.items()})  # once per size
    n_params = sum(int(a.size) for a in jax.tree.leaves(seq_params))
    p_edge, p_layer = edge_params(VOCAB, args.seq_len, d), layer_params(d)
    if n_params != p_edge + layers * p_layer:
        raise AssertionError(f"parameter formula {p_edge + layers * p_layer} != model's {n_params}")
    rows = []
    for pipe, data in args.meshes:
        runs = []
        for shard in SHARDS:
            plan = jpipe.Plan(pipe, data, args.microbatches, shard=shard)
            state = jpipe.init(model, plan, optax.adam(1e-4), batch, params=seq_params,
                               devices=jax.devices()[:DEVICES])
            held = per_device_bytes((state.params, state.opt_state))
            whole = global_bytes((state.params, state.opt_state))
            start = time.perf_counter()
            compiled = jpipe.train_step.lower(state, batch).compile()
            compile_s = time.perf_counter() - start
            temp = int(compiled.memory_analysis().temp_size_in_bytes)  # = jpipe.compiled_memory(...)["temp"]
            fullest = max(held.values())
            w_edge, w_stage = step_weights(p_edge, p_layer, layers, pipe)
            w = w_edge + w_stage
            extra = {}
            if one_sequence:
                one = data * args.microbatches  # one sequence per micro-batch
                temp_one = temp
                if one != args.batch:
                    small = make_batch(one, args.seq_len)
                    probe = jpipe.init(model, plan, optax.adam(1e-4), small, params=seq_params,
                                       devices=jax.devices()[:DEVICES])
                    temp_one = int(jpipe.train_step.lower(probe, small).compile().memory_analysis()
                                   .temp_size_in_bytes)
                    del probe
                extra = {"temp_mb1_bytes": temp_one, "temp_mb1_over_weights": temp_one / w}
            runs.append({"state": state, "step": compiled, "times": [], "row": {
                "d_model": d, "layers": layers, "params": n_params, "pipe": pipe, "data": data,
                "microbatches": args.microbatches, "shard": shard,
                "fullest_bytes": fullest, "emptiest_bytes": min(held.values()), "whole_state_bytes": whole,
                "ideal_bytes": whole / DEVICES, "fullest_over_ideal": fullest / (whole / DEVICES),
                "formula_bytes": state_bytes(shard, p_edge, p_layer, layers, pipe, data),
                "temp_bytes": temp, "w_edge_bytes": w_edge, "w_stage_bytes": w_stage,
                "temp_over_weights": temp / w,
                "compile_s": compile_s, **extra}})
        for run in runs:  # warm up (the first call of a compiled step is slower)
            for _ in range(args.warmup):
                run["state"], metrics = run["step"](run["state"], batch)
                float(metrics["loss"])
        for r in range(args.rounds):
            order = runs[r % len(runs):] + runs[:r % len(runs)]
            for run in order:
                times = []
                for _ in range(args.steps):
                    start = time.perf_counter()
                    run["state"], metrics = run["step"](run["state"], batch)
                    float(metrics["loss"])  # waits for the step
                    times.append(time.perf_counter() - start)
                run["times"].append(statistics.mean(times))
        base = runs[0]["times"]
        for run in runs:
            t = run["times"]
            paired = [a / b for a, b in zip(t, base)]
            run["row"].update(step_ms=1e3 * statistics.median(t), round_ms=[1e3 * x for x in t],
                              step_vs_none=statistics.median(t) / statistics.median(base),
                              paired_min=min(paired), paired_max=max(paired))
            rows.append(run["row"])
            row = run["row"]
            say(f"  {d}x{layers} {pipe}x{data} {layout_name(row['shard']):>14}: fullest "
                f"{mib(row['fullest_bytes']):8.2f} MiB (x{row['fullest_over_ideal']:.2f} ideal), temp "
                f"{mib(row['temp_bytes']):7.2f} MiB, step {row['step_ms']:7.0f} ms "
                f"(x{row['step_vs_none']:.2f} [{row['paired_min']:.2f}-{row['paired_max']:.2f}]), "
                f"compile {row['compile_s']:.0f}s"
                + (f", temp at 1 sequence per micro-batch {mib(row['temp_mb1_bytes']):.2f} MiB"
                   if "temp_mb1_bytes" in row else ""))
        del runs  # free this mesh's states before the next
    return rows


def mib(b: float) -> float:
    return b / 2**20


# --------------------------------------------------------------------------------------------
# Extrapolating
# --------------------------------------------------------------------------------------------


def best_fit(shard: str | None, devices: int, alpha: float, budget: float = GB80) -> dict | None:
    """The largest GPT-3-shaped model (d multiple of 128, L = d / 128) whose fullest device fits
    ``state + alpha (W_edge + W_stage)`` into ``budget``, on its best ``pipe x data`` mesh."""
    best = None
    for h in range(1, 1024):
        d, layers = X_HEAD_DIM * h, h
        p_edge, p_layer = edge_params(X_VOCAB, X_SEQ, d), layer_params(d)
        fits = []
        for pipe in (p for p in range(1, devices + 1) if devices % p == 0 and p <= layers):
            data = devices // pipe
            state = state_bytes(shard, p_edge, p_layer, layers, pipe, data)
            temp = alpha * sum(step_weights(p_edge, p_layer, layers, pipe))
            if state + temp <= budget:
                fits.append((state + temp, pipe, data, state, temp))
        if fits:
            total, pipe, data, state, temp = min(fits)
            best = {"shard": shard, "devices": devices, "d_model": d, "layers": layers,
                    "heads": h, "params": p_edge + layers * p_layer, "pipe": pipe, "data": data,
                    "state_bytes": state, "temp_bytes": temp, "total_bytes": total, "alpha": alpha}
    return best


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def markdown(rows: list[dict]) -> str:
    out = [("| model | params | whole state | pipe x data | layout | fullest device | ideal (/8) | "
            "fullest / ideal | formula | temp | step | step / None [round range] |"),
           "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = "1 (baseline)" if r["shard"] is None else \
            f"{r['step_vs_none']:.2f} [{r['paired_min']:.2f}-{r['paired_max']:.2f}]"
        out.append(f"| d{r['d_model']} L{r['layers']} | {r['params'] / 1e6:.2f} M | "
                   f"{mib(r['whole_state_bytes']):.1f} MiB | {r['pipe']}x{r['data']} | "
                   f"{layout_name(r['shard'])} | "
                   f"{mib(r['fullest_bytes']):.2f} MiB | {mib(r['ideal_bytes']):.2f} MiB | "
                   f"{r['fullest_over_ideal']:.2f} | {mib(r['formula_bytes']):.2f} MiB | "
                   f"{mib(r['temp_bytes']):.2f} MiB | {r['step_ms']:.0f} ms | {ratio} |")
    return "\n".join(out)


def extrapolation_markdown(fits: list[dict], low: dict) -> str:
    out = [("| devices (80 GB each) | layout | alpha | largest GPT | params | best pipe x data | "
            "state / device | temp / device | total / device | params at the smallest alpha |"),
           "|---:|---|---:|---|---:|---|---:|---:|---:|---:|"]
    for f in fits:
        other = low.get((f["devices"], f["shard"]))
        out.append(f"| {f['devices']} | {layout_name(f['shard'])} | {f['alpha']:.2f} | "
                   f"d{f['d_model']} L{f['layers']} | {f['params'] / 1e9:.1f} B | {f['pipe']}x{f['data']} | "
                   f"{f['state_bytes'] / 1e9:.1f} GB | {f['temp_bytes'] / 1e9:.1f} GB | "
                   f"{f['total_bytes'] / 1e9:.1f} GB | "
                   + (f"{other['params'] / 1e9:.1f} B ({other['alpha']:.2f}) |" if other else "- |"))
    return "\n".join(out)


def report(rows: list[dict], config: dict, elapsed: float, platform: str) -> dict:
    """Prints the tables and the extrapolation; returns what ``--json`` adds to the rows."""
    sizes = [tuple(s) for s in config["sizes"]]
    meshes = [tuple(m) for m in config["meshes"]]
    print("\n## Measured: state on the fullest device, compiled temp, step time\n")
    print(f"GPT vocab {VOCAB}, seq {config['seq_len']}, global batch {config['batch']} sequences, "
          f"M={config['microbatches']} (1F1B), Adam, float32; 8 devices ({platform}). "
          f"Step: median of {config['rounds']} rounds x {config['steps']} step(s), layouts in turn; the "
          f"bracket is the range of the per-round ratios to today's layout.\n")
    print(markdown(rows))

    largest = max(sizes)
    at_largest = [r for r in rows if (r["d_model"], r["layers"]) == largest]
    print("\n## Temp against the weights a step computes with, at micro-batches of one sequence\n")
    print(f"d{largest[0]} L{largest[1]}, temp compiled with a global batch of data x "
          f"{config['microbatches']} sequences of {config['seq_len']} tokens (one per micro-batch). "
          f"W_edge = 4 P_edge and W_stage = "
          f"4 ceil(L / pipe) P_layer: the float32 bytes of the embedding + head and of the fullest "
          f"device's stage, gathered whole. Each cell: temp (alpha = temp / (W_edge + W_stage)).\n")
    print("| pipe x data | W_edge | W_stage | " + " | ".join(layout_name(s) for s in SHARDS) + " |")
    print("|---|---:|---:|" + "---:|" * len(SHARDS))
    for pipe, data in meshes:
        sel = {r["shard"]: r for r in at_largest if (r["pipe"], r["data"]) == (pipe, data)}
        cells = [f"{mib(sel[s]['temp_mb1_bytes']):.2f} MiB ({sel[s]['temp_mb1_over_weights']:.2f})"
                 for s in SHARDS]
        print(f"| {pipe}x{data} | {mib(sel[None]['w_edge_bytes']):.2f} MiB | "
              f"{mib(sel[None]['w_stage_bytes']):.2f} MiB | " + " | ".join(cells) + " |")
    ratios = {s: [r["temp_mb1_over_weights"] for r in at_largest if r["shard"] == s] for s in SHARDS}
    alpha = {s: max(v) for s, v in ratios.items()}
    alpha_low = {s: min(v) for s, v in ratios.items()}

    fits = [f for devices in (8, 64) for s in SHARDS if (f := best_fit(s, devices, alpha[s])) is not None]
    low = {(devices, s): f for devices in (8, 64) for s in SHARDS
           if (f := best_fit(s, devices, alpha_low[s])) is not None}
    print("\n## Extrapolated: the largest GPT that trains on 80 GB devices\n")
    print(f"GPT-3 shapes (d_model a multiple of 128, 128-wide heads, L = d_model / 128 layers), vocab "
          f"{X_VOCAB}, sequences of {X_SEQ}; Adam, float32 parameters and moments (12 bytes per parameter). "
          f"Per device: state (closed form, the `formula` column above) + temp = alpha (W_edge + W_stage), "
          f"alpha the layout's largest above (the last column: its smallest); the best pipe x data of "
          f"the devices (pipe divides them, pipe <= L). 80 GB = 80e9 bytes.\n")
    print(extrapolation_markdown(fits, low))
    print("\nAssumed: no activation memory beyond what the measured temp holds (micro-batches of one "
          f"sequence of {config['seq_len']} tokens), so these sizes are upper bounds: a micro-batch of one "
          f"{X_SEQ}-token sequence adds S x d floats per held stage input (1F1B holds up to pipe of them), "
          "S x V logits on the last stage and, without remat, every layer's intermediates of every held "
          "micro-batch; no fragmentation or runtime reserve; XLA's temp planning on a GPU may differ from "
          "this CPU's; the measured meshes tie the layers per device to data (k = data = 8 / pipe), so "
          "alpha's dependence on each is not separated. For scale, at each answer's shape (float32):")
    for f in fits:
        held = f["pipe"] * X_SEQ * f["d_model"] * 4
        print(f"  {f['devices']} devices, {layout_name(f['shard'])}: {f['pipe']} held stage inputs "
              f"{held / 1e9:.2f} GB, one sequence's logits {X_SEQ * X_VOCAB * 4 / 1e9:.2f} GB")
    print(f"\ntook {elapsed:.0f}s to measure ({len(rows)} layouts x meshes x sizes)")
    return {"alpha": {str(s): v for s, v in alpha.items()},
            "alpha_smallest": {str(s): v for s, v in alpha_low.items()},
            "extrapolation": fits, "extrapolation_smallest_alpha": list(low.values())}


def parse_size(text: str) -> tuple[int, int]:
    d, layers = (int(x) for x in text.lower().split("x"))
    if d % HEAD_DIM:
        raise argparse.ArgumentTypeError(f"d_model {d} must be a multiple of {HEAD_DIM}")
    return d, layers


def parse_mesh(text: str) -> tuple[int, int]:
    pipe, data = (int(x) for x in text.lower().split("x"))
    if pipe * data != DEVICES:
        raise argparse.ArgumentTypeError(f"mesh {text}: pipe x data must be {DEVICES}")
    return pipe, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=[(64, 8), (128, 8), (256, 8)],
                        help="GPT sizes as d_modelxlayers (heads = d_model / 32); at least 8 layers "
                             "for pipe 8")
    parser.add_argument("--meshes", type=parse_mesh, nargs="+", default=MESHES, help="pipexdata, 8 devices")
    parser.add_argument("--batch", type=int, default=64,
                        help="global batch in sequences, the same on every mesh")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds, every layout in turn")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per layout and round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per layout after compiling")
    parser.add_argument("--quick", action="store_true",
                        help="the smallest size on the meshes 4x2 and 1x8, 2 rounds: a check that it "
                             "all runs")
    parser.add_argument("--json", default=None,
                        help="also write every row and the extrapolation to this file")
    parser.add_argument("--from-json", default=None,
                        help="measure nothing: print the tables again from a file that --json wrote")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as fh:
            saved = json.load(fh)
        report(saved["rows"], saved["config"], saved["elapsed_s"], saved["devices"])
        return
    if args.quick:
        args.sizes, args.meshes, args.rounds = [min(args.sizes)], [(4, 2), (1, 8)], 2
    for pipe, data in args.meshes:
        if args.batch % (data * args.microbatches):
            parser.error(f"--batch {args.batch} is not divisible by data x microbatches = {data} x "
                         f"{args.microbatches} on mesh {pipe}x{data}")
    if len(jax.devices()) < DEVICES:
        parser.error(f"needs {DEVICES} devices, found {len(jax.devices())} (set XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={DEVICES} before jax starts)")

    start = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - start:5.0f}s] {text}", flush=True)

    say(f"{jax.devices()[0].platform} x {len(jax.devices())}, {os.cpu_count()} CPU cores; GPT vocab {VOCAB}, "
        f"seq {args.seq_len}, global batch {args.batch}, M={args.microbatches} (1F1B), Adam, float32; "
        f"{args.rounds} rounds x {args.steps} steps per layout")
    rows: list[dict] = []
    for d, layers in args.sizes:
        say(f"GPT d_model {d}, {layers} layers, {d // HEAD_DIM} heads")
        rows += measure_size(d, layers, args, say, one_sequence=(d, layers) == max(args.sizes))
    elapsed = time.perf_counter() - start
    config = {k: v for k, v in vars(args).items() if k not in ("json", "from_json")}
    platform = f"{jax.devices()[0].platform} x {len(jax.devices())}"
    extra = report(rows, config, elapsed, platform)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": config, "rows": rows, **extra, "elapsed_s": elapsed, "devices": platform,
                       "cpu_count": os.cpu_count()}, fh, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
