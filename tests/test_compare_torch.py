"""jpipe against torch.distributed.pipelining (experiments/compare_torch) at P=2.

Needs the ``compare`` extra (``torch==2.13.0``); skipped without torch. The
comparison itself runs in subprocesses (2 torch ranks on gloo/127.0.0.1, one
jpipe process on 2 simulated devices in float64), each bounded by a timeout.
"""

from __future__ import annotations

import numpy as np
import pytest

try:
    import torch  # noqa: F401
except ImportError:
    pytest.skip("torch is not installed: `pip install \".[compare]\"` (torch==2.13.0, a CPU build) runs the "
                "comparison with torch.distributed.pipelining", allow_module_level=True)

import jax
import jax.numpy as jnp

from experiments.compare_torch import jax_models, torch_models
from experiments.compare_torch.compare import run_comparison
from experiments.compare_torch.report import write_report
from experiments.compare_torch.spec import ModelSpec, RunConfig, flatten, grads_to_jpipe


@pytest.mark.parametrize("arch", ["mlp", "transformer"])
def test_conversion_gives_the_same_model(arch):
    """jpipe's parameters copied into torch: the same loss and gradients (float32, in this process)."""
    spec = ModelSpec(arch, num_layers=1, hidden=16, dtype="float32")
    batch = spec.make_batch(4)
    model = jax_models.build(spec)
    params = model.init_params(jax.random.key(0), {k: jnp.asarray(v) for k, v in batch.items()})
    loss, grads = jax.jit(jax.value_and_grad(model.loss_value))(params, {k: jnp.asarray(v) for k, v in batch.items()})

    flat = {k: np.asarray(v) for k, v in flatten(params).items()}
    tm = torch_models.to_torch(spec, params)
    for name, value in flat.items():  # every parameter copied, kernels transposed
        target, transpose = torch_models.torch_name(name)
        np.testing.assert_array_equal(dict(tm.named_parameters())[target].detach().numpy(),
                                      value.T if transpose else value)
    t_loss = tm.loss(tm(torch_models.to_tensor(batch[spec.input_key])), torch_models.to_tensor(batch[spec.target_key]))
    t_loss.backward()
    t_grads = grads_to_jpipe({n: p.grad.numpy() for n, p in tm.named_parameters()}, list(flat))
    np.testing.assert_allclose(t_loss.item(), float(loss), rtol=1e-5)
    j_grads = {k: np.asarray(v) for k, v in flatten(grads).items()}
    scale = max(float(np.abs(g).max()) for g in j_grads.values())
    worst = max(float(np.abs(j_grads[k] - t_grads[k]).max()) for k in j_grads)
    assert worst <= 1e-5 * scale, f"{arch}: gradients differ by {worst:.3g} (max |grad| {scale:.3g})"


def test_conversion_rejects_a_mismatched_model():
    spec = ModelSpec("mlp", num_layers=2, hidden=16, dtype="float32")
    params = jax_models.build(spec).init_params(jax.random.key(0), {k: jnp.asarray(v) for k, v in
                                                                    spec.make_batch(2).items()})
    with pytest.raises(ValueError, match="has shape"):
        torch_models.to_torch(ModelSpec("mlp", num_layers=2, hidden=8, dtype="float32"), params)
    with pytest.raises(ValueError, match="one to one"):
        torch_models.to_torch(ModelSpec("mlp", num_layers=3, hidden=16, dtype="float32"), params)


@pytest.fixture(scope="module")
def p2_run(tmp_path_factory):
    config = RunConfig(ModelSpec("mlp", num_layers=4, hidden=16, dtype="float64"), pipe=2, microbatches=4,
                       microbatch_size=2, warmup_steps=0, timed_steps=1)
    workdir = tmp_path_factory.mktemp("compare_torch")
    return run_comparison(config, workdir, timeout=240), workdir


def test_p2_gradients_match_torch_in_float64(p2_run):
    run, _ = p2_run
    assert {r.pair.name for r in run.pairs} == {"gpipe", "1f1b", "interleaved-1f1b", "interleaved-1f1b-megatron",
                                                "zb-h1"}
    for r in run.pairs:
        assert r.jpipe_source == "generator"
        assert r.grad_max_abs > 0
        assert r.grads_ok, (f"{r.pair.name}: gradients differ by {r.grad_max_abs_diff:.3g} "
                            f"(max |grad| {r.grad_max_abs:.3g})")


def test_p2_executed_orders_match_torch(p2_run):
    run, _ = p2_run
    by = {r.pair.name: r for r in run.pairs}
    for name in ("gpipe", "1f1b", "interleaved-1f1b-megatron", "zb-h1"):
        r = by[name]
        assert r.orders_equal, f"{name}: first differences per device {r.first_difference}"
        assert r.held_jpipe == r.held_torch
    # jpipe's default interleaved warm-up is shorter than Megatron's/torch's: fewer held, same lock-step length.
    default, megatron = by["interleaved-1f1b"], by["interleaved-1f1b-megatron"]
    assert default.jpipe_ticks == megatron.jpipe_ticks
    assert all(a <= b for a, b in zip(default.held_jpipe, default.held_torch))
    assert by["gpipe"].held_torch == [4, 4]


def test_p2_report_is_written(p2_run):
    run, workdir = p2_run
    path = write_report([run], workdir / "report", ["python -m experiments.compare_torch --pipe 2"], figure=False)
    text = path.read_text()
    for section in ("## (a)", "## (b)", "## (c)", "## (d)", "## (e)", "python -m experiments.compare_torch"):
        assert section in text


def test_workers_are_bounded(tmp_path):
    """A failing worker stops its peers at once; a hanging one is stopped at the deadline."""
    from experiments.compare_torch._proc import WorkerError, run_workers

    sleeper = ["-c", "import time; time.sleep(60)"]
    with pytest.raises(WorkerError, match="worker 1 exited with status 1"):
        run_workers([sleeper, ["-c", "raise SystemExit('boom')"]], [tmp_path / "a.log", tmp_path / "b.log"],
                    env={}, timeout=30, what="test")
    with pytest.raises(WorkerError, match="still running after 1 s"):
        run_workers([sleeper], [tmp_path / "c.log"], env={}, timeout=1, what="test")
