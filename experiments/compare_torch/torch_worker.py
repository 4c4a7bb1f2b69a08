"""One rank of the torch.distributed.pipelining side: ``python -m experiments.compare_torch.torch_worker``.

Started ``P`` times by :func:`run_torch` (gloo on 127.0.0.1). For every schedule
pair of the run it builds this rank's stages from jpipe's parameters, runs one
step and keeps the gradients and the order in which the stages *executed* their
actions (recorded by wrapping each stage's ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk``), then times
``warmup + timed`` steps (step + SGD update) and reads the peak RSS over the
timed ones. Writes ``torch_rank{r}.json`` and ``torch_rank{r}_{torch_key}.npz``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from experiments.compare_torch._proc import WorkerError, free_port, run_workers
from experiments.compare_torch.spec import RunConfig, SchedulePair, read_rss_kib, reset_peak_rss

TORCH_VERSION = "2.13.0"


def run_torch(config: RunConfig, workdir: Path, timeout: float = 600.0) -> list[dict[str, Any]]:
    """Runs the torch side on ``config.pipe`` local processes; returns each rank's results.

    ``workdir`` must hold ``config.json``, ``params.npz`` and ``batch.npz``.
    """
    port = free_port()
    cmds = [["-m", "experiments.compare_torch.torch_worker", "--workdir", str(workdir), "--rank", str(r),
             "--world", str(config.pipe), "--port", str(port)] for r in range(config.pipe)]
    logs = [workdir / f"torch_rank{r}.log" for r in range(config.pipe)]
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(config.torch_threads),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    run_workers(cmds, logs, env=env, timeout=timeout, what=f"torch.distributed.pipelining on {config.pipe} ranks")
    out = []
    for r in range(config.pipe):
        path = workdir / f"torch_rank{r}.json"
        if not path.exists():
            raise WorkerError(f"torch rank {r} exited cleanly but wrote no {path}")
        out.append(json.loads(path.read_text()))
    return out


# -- everything below runs inside a rank -------------------------------------------------------


def _instrument(stage: Any, log: list[tuple]) -> None:
    """Records every action ``stage`` executes as ``(kind, microbatch, stage, start, end)``."""
    forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
    k = stage.stage_index

    def forward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = forward(chunk, *args, **kwargs)
        log.append(("F", chunk, k, t0, time.perf_counter()))
        return out

    def backward_one_chunk(chunk: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> Any:
        t0 = time.perf_counter()
        out = backward(chunk, loss=loss, full_backward=full_backward, last_backward=last_backward)
        log.append(("B" if full_backward else "I", chunk, k, t0, time.perf_counter()))
        return out

    def backward_weight_one_chunk(chunk: int, last_backward: bool = False) -> Any:
        t0 = time.perf_counter()
        out = weight(chunk, last_backward=last_backward)
        log.append(("W", chunk, k, t0, time.perf_counter()))
        return out

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def _reported_order(schedule: Any, rank: int) -> list[tuple[str, int, int]] | None:
    """The compute actions of ``schedule.pipeline_order[rank]`` (what the schedule *says* it runs)."""
    order = getattr(schedule, "pipeline_order", None)
    if not order or rank not in order:
        return None
    out = []
    for a in order[rank]:
        if a is not None and a.computation_type.value in ("F", "B", "I", "W"):
            out.append((a.computation_type.value, int(a.microbatch_index), int(a.stage_index)))
    return out


def _run_pair(config: RunConfig, pair: SchedulePair, rank: int, params: dict[str, np.ndarray],
              batch: dict[str, np.ndarray], workdir: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    from experiments.compare_torch.torch_models import StageModule, loss_fn, to_tensor, to_torch

    spec, P, M = config.model, config.pipe, config.microbatches
    S = P * pair.virtual_stages
    model = to_torch(spec, params)
    stage_ids = [rank + c * P for c in range(pair.virtual_stages)]
    stages, modules = [], []
    for k in stage_ids:
        a, b = config.layer_range(k, S)
        modules.append(StageModule(model, a, b, first=k == 0, last=k == S - 1))
        stages.append(pipelining.PipelineStage(modules[-1], k, S, torch.device("cpu")))
    # Keep only this rank's parameters (under the full model's names); the other layers are freed.
    own = {id(p) for m in modules for p in m.parameters()}
    named = [(n, p) for n, p in model.named_parameters() if id(p) in own]
    del model
    log: list[tuple] = []
    for stage in stages:
        _instrument(stage, log)
    cls = getattr(pipelining, pair.torch_class)
    single = issubclass(cls, PipelineScheduleSingle)
    if single and pair.virtual_stages != 1:
        raise ValueError(f"{pair.torch_class} runs one stage per rank, but {pair.name} has "
                         f"{pair.virtual_stages}")
    schedule = cls(stages[0] if single else stages, n_microbatches=M, loss_fn=loss_fn(spec))

    x, y = to_tensor(batch[spec.input_key]), to_tensor(batch[spec.target_key])
    has_first, has_last = 0 in stage_ids, S - 1 in stage_ids
    optimizer = torch.optim.SGD([p for _, p in named], lr=config.lr)

    def step() -> list[torch.Tensor] | None:
        losses: list[torch.Tensor] | None = [] if has_last else None
        args = (x,) if has_first else ()
        kwargs = {"target": y, "losses": losses} if has_last else {}
        schedule.step(*args, **kwargs)
        return losses

    # One step from jpipe's parameters: executed order, gradients, loss.
    losses = step()
    order = [(kind, mb, k) for kind, mb, k, _, _ in log]
    no_grad = [n for n, p in named if p.grad is None]
    if no_grad:
        raise RuntimeError(f"{pair.torch_class}: rank {rank} got no gradient for {no_grad} after one step")
    grads = {n: p.grad.detach().numpy().copy() for n, p in named}
    np.savez(workdir / f"torch_rank{rank}_{pair.torch_key}.npz", **grads)
    loss = float(sum(float(v) for v in losses) / M) if losses else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    for _ in range(config.warmup_steps):
        step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    gc.collect()
    rss_before, _ = read_rss_kib()
    reset_ok = reset_peak_rss()
    times, starts = [], []
    for _ in range(config.timed_steps):
        dist.barrier()
        log.clear()
        t0 = time.perf_counter()
        step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        starts.append(t0)
    _, hwm = read_rss_kib()
    timeline = [(kind, mb, k, s - starts[-1], e - starts[-1]) for kind, mb, k, s, e in log]
    return {
        "order": order,
        "reported_order": _reported_order(schedule, rank),
        "stage_ids": stage_ids,
        "loss": loss,
        "step_times": times,
        "last_step_timeline": timeline,
        "rss_before_kib": rss_before,
        "peak_rss_kib": hwm,
        "peak_rss_reset": reset_ok,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--gloo-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    if not torch.__version__.startswith(TORCH_VERSION):
        raise RuntimeError(f"the comparison is pinned to torch=={TORCH_VERSION}, found {torch.__version__}; "
                           f"install it with `pip install torch=={TORCH_VERSION}`")
    config = RunConfig.from_json((args.workdir / "config.json").read_text())
    torch.set_num_threads(config.torch_threads)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=args.gloo_timeout))
    try:
        params = dict(np.load(args.workdir / "params.npz"))
        batch = dict(np.load(args.workdir / "batch.npz"))
        results = {"rank": args.rank, "torch_version": torch.__version__, "threads": torch.get_num_threads(),
                   "schedules": {}}
        for pair in config.torch_runs():
            results["schedules"][pair.torch_key] = _run_pair(config, pair, args.rank, params, batch, args.workdir)
            dist.barrier()
        (args.workdir / f"torch_rank{args.rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
