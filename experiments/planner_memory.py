"""The planner's predicted MiB/dev against what a device holds: its shard of the state plus the
compiled step's temp bytes (XLA's memory analysis, exact on CPU), plan by plan.

    python experiments/planner_memory.py [--extra] [--terms]

The plans are those of ``tests/test_planner_memory.py`` (8 simulated CPU devices); ``--extra`` adds
plans the search does not make (remat, virtual stages) and fused ticks; ``--terms`` prints each
prediction term by term (``partition.Memory``). Figures: ``experiments/planner_memory.md``.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_planner_memory import MODELS, PLANS, _profile, _state_bytes

import jpipe
from jpipe import Plan
from jpipe.partition import evaluate

EXTRA = [
    ("mlp", 64, Plan(pipe=2, data=4, microbatches=4, schedule="1f1b", shard="optimizer", remat=True)),
    ("gpt", 32, Plan(pipe=2, data=4, microbatches=4, schedule="1f1b", shard="optimizer", remat=True)),
    ("mlp", 64, Plan(pipe=2, data=4, microbatches=8, schedule="interleaved-1f1b", virtual_stages=2)),
    ("gpt", 32, Plan(pipe=2, data=4, microbatches=8, schedule="interleaved-1f1b", virtual_stages=2,
                     shard=None)),
    ("mlp", 64, Plan(pipe=4, data=2, microbatches=16, schedule="1f1b-b", fuse_ticks=True)),
]


def describe(name: str, plan: Plan) -> str:
    extra = [f"part {'+'.join(map(str, plan.partition))}" if plan.partition else "",
             "remat" if plan.remat else "", f"V{plan.virtual_stages}" if plan.virtual_stages > 1 else "",
             "fused" if plan.fuse_ticks else ""]
    return f"{name:8} {plan.pipe}x{plan.data} M{plan.microbatches:<2} {plan.schedule:16} " \
           f"{plan.shard!s:10} {' '.join(e for e in extra if e):12}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra", action="store_true", help="also plans the search does not make")
    parser.add_argument("--terms", action="store_true", help="print each prediction term by term")
    args = parser.parse_args()
    print(f"{'model':8} {'mesh':3} {'M':3} {'schedule':16} {'shard':10} {'':12} {'state':>7} {'temp':>7} "
          f"{'measured':>8} {'predicted':>9} {'error':>6}   (MiB per device)")
    for name, size, plan in PLANS + (EXTRA if args.extra else []):
        make, batch_of = MODELS[name]
        batch = batch_of(size)
        state = jpipe.init(make(), plan, optax.adam(1e-3), batch, rng=jax.random.key(0))
        stored, temp = _state_bytes(state), jpipe.compiled_memory(state, batch)["temp"]
        cand = evaluate(_profile(name), plan, size)
        measured = stored + temp
        mib = 2**20
        print(f"{describe(name, plan)} {stored / mib:7.3f} {temp / mib:7.3f} {measured / mib:8.3f} "
              f"{cand.memory / mib:9.3f} {cand.memory / measured - 1:+6.1%}", flush=True)
        if args.terms:
            print("    " + cand.terms.explain())
        jax.clear_caches()


if __name__ == "__main__":
    main()
