"""Measured refinement: time the best predicted plans with ``jpipe.train_step`` and choose by measurement.

The cost model ranks hundreds of candidates in milliseconds but is only as good as its profile: on
the shared 2-core machine of ``experiments/planner_accuracy.md`` its predictions were within
10-25 % of the measured step, while the best two or three plans were often closer than that to
each other. Where the prediction cannot tell them apart, a few compiled steps of each can.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from jpipe import distributed
from jpipe._init import init
from jpipe._mesh import make_mesh
from jpipe._plan import Plan
from jpipe._state import batch_size_of
from jpipe._train import train_step
from jpipe.partition._profile import max_over_processes, robust_mean
from jpipe.partition._search import PlanChoice


def measure_plans(model: Any, plans: Sequence[Plan], example_batch: Any, *,
                  devices: Sequence[Any] | None = None, optimizer: Any = None, steps: int = 5,
                  rounds: int = 3, warmup: int = 2) -> list[float]:
    """Mean seconds of one ``jpipe.train_step`` for each plan, on ``devices``.

    Every plan is initialised and compiled first; then ``rounds`` times, each
    plan runs one untimed step and ``steps`` timed ones (``block_until_ready``),
    the plans in turns, so that a change in the machine's load hits them alike.
    Returns each plan's :func:`robust_mean` over its timed steps. All plans'
    states are alive at once: the memory of the largest few, not of one.

    ``example_batch`` is the global batch as host arrays, the same on every
    process; under ``jax.distributed`` every process must call this with the
    same plans, each feeds its own rows, and every time is the slowest
    process's (so every process ranks the plans alike).

    >>> import jax, jax.numpy as jnp, jpipe, jpipe.models
    >>> model = jpipe.models.mlp(in_dim=4, hidden=16, out_dim=1, num_layers=4)
    >>> batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 1))}
    >>> plans = [jpipe.Plan(pipe=2, data=1, microbatches=2), jpipe.Plan(pipe=1, data=2, microbatches=1)]
    >>> times = measure_plans(model, plans, batch, devices=jax.devices()[:2], steps=2, rounds=1)
    >>> len(times), all(t > 0 for t in times)
    (2, True)
    """
    for name, value, least in (("steps", steps, 1), ("rounds", rounds, 1), ("warmup", warmup, 0)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    devices = list(jax.devices() if devices is None else devices)
    optimizer = optax.adam(1e-3) if optimizer is None else optimizer
    size = batch_size_of(example_batch)
    host = jax.tree.map(np.asarray, example_batch)
    runs = []
    for plan in plans:
        devs = distributed.mesh_devices(plan.pipe, plan.data, "pipe", devices)
        mesh = make_mesh(plan.pipe, plan.data, devs)
        rows = distributed.local_rows(mesh, size)
        batch = distributed.global_batch(mesh, jax.tree.map(lambda a, rows=rows: a[rows], host), size)
        state = init(model, plan, optimizer, batch, rng=jax.random.key(0), devices=devs, nan_policy="skip")
        step = train_step.lower(state, batch).compile()
        for _ in range(warmup):
            state, metrics = step(state, batch)
        jax.block_until_ready(state)
        runs.append({"step": step, "state": state, "batch": batch, "times": []})
    for _ in range(rounds):
        for run in runs:
            # untimed: a plan's first step after another plan's runs with cold caches
            run["state"], metrics = run["step"](run["state"], run["batch"])
            jax.block_until_ready((run["state"], metrics))
            for _ in range(steps):
                start = time.perf_counter()
                run["state"], metrics = run["step"](run["state"], run["batch"])
                jax.block_until_ready((run["state"], metrics))
                run["times"].append(time.perf_counter() - start)
    return max_over_processes([robust_mean(run["times"]) for run in runs])


def refine(choice: PlanChoice, model: Any, example_batch: Any, *, devices: Sequence[Any] | None = None,
           optimizer: Any = None, top: int = 3, within: float = 0.25, steps: int = 5, rounds: int = 3,
           warmup: int = 2) -> PlanChoice:
    """``choice`` with its best predicted candidates measured, and the fastest measured one chosen.

    Measures (:func:`measure_plans`) the fitting candidates predicted within
    ``within`` of the best prediction (the cost model's error: 25 % by
    default), at most ``top`` of them, fastest predicted first. The returned
    choice's plan is the fastest measured; its candidates have ``measured``
    set for those, ranked by measurement ahead of the rest, which keep their
    predicted order. One candidate within reach: returned as it is, measured.

    >>> import jax, jax.numpy as jnp, jpipe, jpipe.models
    >>> from jpipe import partition
    >>> model = jpipe.models.mlp(in_dim=4, hidden=16, out_dim=1, num_layers=4)
    >>> batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 1))}
    >>> devices = jax.devices()[:2]
    >>> choice = partition.refine(jpipe.plan(model, batch, devices=devices), model, batch, devices=devices,
    ...                           top=2, within=10.0, steps=2, rounds=1)
    >>> choice.plan == choice.candidates[0].plan, choice.candidates[0].measured is not None
    (True, True)
    """
    if top < 1:
        raise ValueError(f"top must be >= 1 (candidates to measure), got {top}")
    if within < 0:
        raise ValueError(f"within must be >= 0 (a fraction of the best predicted step time), got {within}")
    fitting = [c for c in choice.candidates if c.fits]
    if not fitting:
        raise ValueError("no candidate fits in memory: nothing to measure; raise the memory limit")
    best = min(c.step_time for c in fitting)
    chosen = [c for c in fitting if c.step_time <= best * (1 + within)][:top]  # fastest predicted first
    times = measure_plans(model, [c.plan for c in chosen], example_batch, devices=devices, optimizer=optimizer,
                          steps=steps, rounds=rounds, warmup=warmup)
    measured = sorted((c._replace(measured=t) for c, t in zip(chosen, times)),
                      key=lambda c: (c.measured, c.memory))
    rest = tuple(c for c in choice.candidates if not any(c is m for m in chosen))
    return PlanChoice(measured[0].plan, (*measured, *rest))

