"""The jpipe side: ``python -m experiments.compare_torch.jpipe_worker`` on ``P`` simulated CPU devices.

Started by :func:`run_jpipe` in its own process, because the number of
simulated devices (``XLA_FLAGS``) and float64 (``jax_enable_x64``) must be set
before JAX starts. Creates the model's parameters with jpipe when
``params.npz`` does not exist yet (both sides then start from them), and for
every job -- a registered schedule name, or explicit per-device orders --
keeps the gradient of its first step from those parameters, then times
``warmup + timed`` more jitted ``jpipe.train_step`` calls (SGD) and reads the peak
RSS over the timed ones. Writes ``jpipe_{label}.json``, ``jpipe_{label}_grads.npz``
and ``jpipe_{label}_table.npz``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.compare_torch._proc import WorkerError, run_workers
from experiments.compare_torch.spec import RunConfig, flatten, read_rss_kib, reset_peak_rss, unflatten


@dataclasses.dataclass(frozen=True)
class Job:
    """One jpipe run: ``schedule`` (a registered name) or ``orders`` (per-device action lists)."""

    label: str
    virtual_stages: int
    split: bool
    schedule: str | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    orders: list[list[tuple[str, int, int]]] | None = None


def run_jpipe(config: RunConfig, workdir: Path, jobs: list[Job], timeout: float = 600.0
              ) -> dict[str, dict[str, Any]]:
    """Runs ``jobs`` in one jpipe process on ``config.pipe`` simulated devices; returns results by label.

    Creates ``workdir/params.npz`` first if it is missing.
    """
    (workdir / "jobs.json").write_text(json.dumps([dataclasses.asdict(j) for j in jobs]))
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))
    env = {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={config.pipe}".strip(),
           "JAX_PLATFORMS": "cpu"}
    run_workers([["-m", "experiments.compare_torch.jpipe_worker", "--workdir", str(workdir)]],
                [workdir / "jpipe.log"], env=env, timeout=timeout, what=f"jpipe on {config.pipe} simulated devices")
    out = {}
    for job in jobs:
        path = workdir / f"jpipe_{job.label}.json"
        if not path.exists():
            raise WorkerError(f"the jpipe worker exited cleanly but wrote no {path}")
        out[job.label] = json.loads(path.read_text())
    return out


# -- everything below runs inside the worker -------------------------------------------------


def _run_job(config: RunConfig, job: Job, model: Any, params: Any, batch: Any, workdir: Path) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax

    import jpipe
    from jpipe.schedules import SCHEDULES, table_from_orders

    P, M, v = config.pipe, config.microbatches, job.virtual_stages
    if job.schedule is not None:
        if job.schedule not in SCHEDULES:
            return {"missing": True, "reason": f"jpipe has no schedule {job.schedule!r} registered "
                                                f"(registered: {sorted(SCHEDULES)})"}
        schedule: Any = job.schedule
        if job.options:
            schedule = functools.partial(SCHEDULES[job.schedule], **job.options)
    else:
        orders = [[tuple(a) for a in order] for order in job.orders]

        def schedule(num_devices: int, num_microbatches: int, num_chunks: int = 1) -> jpipe.schedules.Table:
            return table_from_orders(orders, num_microbatches, num_chunks=num_chunks, name=job.label)

    plan = jpipe.Plan(pipe=P, data=1, microbatches=M, schedule=schedule, virtual_stages=v)
    # The first transformation keeps the step's raw gradient in the optimizer state: one compiled
    # program gives both the exact gradient of the first step and the timed steps.
    keep_grads = optax.GradientTransformation(init=lambda p: jax.tree.map(jnp.zeros_like, p),
                                              update=lambda g, state, params=None: (g, g))
    optimizer = optax.chain(keep_grads, optax.sgd(config.lr))
    state = jpipe.init(model, plan, optimizer, batch, params=params, devices=jax.devices()[:P])
    table = state.table
    np.savez(workdir / f"jpipe_{job.label}_table.npz", **{f: getattr(table, f) for f in jpipe.schedules.FIELDS},
             meta=np.array([table.num_devices, table.num_chunks, table.num_microbatches]))

    t0 = time.perf_counter()
    state, metrics = jpipe.train_step(state, batch)  # compiles, then the step from jpipe's parameters
    jax.block_until_ready(metrics)
    first_step = time.perf_counter() - t0
    loss = float(metrics["loss"])
    grads = jpipe.to_sequential(state.replace(params=state.opt_state[0]))
    np.savez(workdir / f"jpipe_{job.label}_grads.npz", **{k: np.asarray(g) for k, g in flatten(grads).items()})
    for _ in range(config.warmup_steps):
        state, metrics = jpipe.train_step(state, batch)
    jax.block_until_ready((state, metrics))
    gc.collect()
    rss_before, _ = read_rss_kib()
    reset_ok = reset_peak_rss()
    times = []
    for _ in range(config.timed_steps):
        t0 = time.perf_counter()
        state, metrics = jpipe.train_step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    _, hwm = read_rss_kib()
    result = {
        "missing": False,
        "schedule_name": table.name,
        "order": [[tuple(a) for a in order] for order in table.orders()],
        "held": table.held_microbatches().tolist(),
        "ticks": table.num_ticks,
        "gantt": str(table),
        "loss": float(loss),
        "compile_and_first_step_s": first_step,
        "step_times": times,
        "rss_before_kib": rss_before,
        "peak_rss_kib": hwm,
        "peak_rss_reset": reset_ok,
    }
    del state, metrics, grads
    jax.clear_caches()
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args(argv)
    config = RunConfig.from_json((args.workdir / "config.json").read_text())
    jobs = [Job(**j) for j in json.loads((args.workdir / "jobs.json").read_text())]

    import jax

    if config.model.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    from experiments.compare_torch import jax_models

    if len(jax.devices()) < config.pipe:
        raise RuntimeError(f"need {config.pipe} devices, JAX sees {jax.devices()}; set XLA_FLAGS="
                           f"--xla_force_host_platform_device_count={config.pipe} before JAX starts")
    model = jax_models.build(config.model)
    batch = {k: jnp.asarray(v) for k, v in np.load(args.workdir / "batch.npz").items()}
    params_path = args.workdir / "params.npz"
    if not params_path.exists():
        microbatch = {k: v[: config.microbatch_size] for k, v in batch.items()}
        params = model.init_params(jax.random.key(config.seed), microbatch)
        np.savez(params_path, **{k: np.asarray(v) for k, v in flatten(params).items()})
    params = jax.tree.map(jnp.asarray, unflatten(dict(np.load(params_path))))
    for job in jobs:
        result = _run_job(config, job, model, params, batch, args.workdir)
        result["jax_version"] = jax.__version__
        (args.workdir / f"jpipe_{job.label}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
