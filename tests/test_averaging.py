"""AvgPipe: elastic averaging, co-located pipelines, advance-forward schedule and the (N, M) tuner."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jpipe
from jpipe import averaging, models, schedules
from jpipe.averaging import _tune


def _model():
    return models.mlp(in_dim=3, hidden=16, out_dim=1, num_layers=4)


def _batch(seed, size=16):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(kx, (size, 3)), "y": jax.random.normal(ky, (size, 1))}


def _max_rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-30))


def test_one_pipeline_without_averaging_is_the_synchronous_step():
    model, batch = _model(), _batch(1)
    params = model.init_params(jax.random.key(0), batch)
    devices = jax.devices()[:4]
    sync = jpipe.init(model, jpipe.Plan(pipe=2, data=2, microbatches=2), optax.sgd(0.1), batch,
                      params=params, devices=devices)
    plan = jpipe.Plan(pipe=2, data=2, microbatches=2, schedule="advance-forward")
    ens_batch = averaging.stack_batches([batch])
    avg = averaging.init(model, plan, optax.sgd(0.1), ens_batch, pipelines=1,
                         averaging=averaging.ElasticAveraging(alpha=0.0), params=params, devices=devices)

    loss_s, grads_s = jax.jit(sync.program.grads)(sync.params, batch)
    loss_a, grads_a = jax.jit(avg.program.grads)(avg.params, ens_batch)
    assert _max_rel(loss_s, loss_a) < 1e-5
    replica0 = {"pre": jax.tree.map(lambda g: g[0], grads_a["pre"]),
                "stages": jax.tree.map(lambda g: g[:, :, :, 0], grads_a["stages"]),
                "post": jax.tree.map(lambda g: g[0], grads_a["post"])}
    for gs, ga in zip(jax.tree.leaves(grads_s), jax.tree.leaves(replica0), strict=True):
        assert _max_rel(gs, ga) < 1e-5

    sync, m_s = jpipe.train_step(sync, batch)
    avg, m_a = jpipe.train_step(avg, ens_batch)
    assert _max_rel(m_s["loss"], m_a["loss"]) < 1e-5
    for a, b in zip(jax.tree.leaves(jpipe.to_sequential(sync)), jax.tree.leaves(averaging.replicas(avg)[0])):
        assert _max_rel(a, b) < 1e-5
    # alpha = 0: the centre never moves from the starting point.
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(averaging.centre(avg))):
        np.testing.assert_array_equal(a, b)
    # The centre lives where its replicas live: stage stacks sharded over `pipe`.
    for leaf in jax.tree.leaves(avg.opt_state[1].centre["stages"]):
        assert leaf.sharding.spec == P("pipe")


def test_identical_replicas_stay_equal_and_the_centre_follows_them():
    model, batch = _model(), _batch(2, size=8)
    plan = jpipe.Plan(pipe=2, data=1, microbatches=2)
    ens_batch = averaging.stack_batches([batch, batch])
    # beta = N * alpha = 1: the (one-step-stale) centre moves all the way to the replicas' mean.
    state = averaging.init(model, plan, optax.adam(1e-2), ens_batch, pipelines=2,
                           averaging=averaging.ElasticAveraging(beta=1.0), rng=jax.random.key(0),
                           devices=jax.devices()[:2])
    start = averaging.replicas(state)
    for a, b in zip(jax.tree.leaves(averaging.centre(state)), jax.tree.leaves(start[0])):
        np.testing.assert_array_equal(a, b)
    previous = start[0]
    for _ in range(3):
        state, _ = jpipe.train_step(state, ens_batch)
        first, second = averaging.replicas(state)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
            np.testing.assert_array_equal(a, b)  # same start, same data: bitwise the same replicas
        for c, x in zip(jax.tree.leaves(averaging.centre(state)), jax.tree.leaves(previous)):
            np.testing.assert_allclose(c, x, rtol=1e-6, atol=1e-7)  # centre = replicas one step ago
        previous = first


def test_one_elastic_update_matches_the_formula():
    x = jnp.array([[1.0, -2.0], [3.0, 4.0]])  # 2 replicas (axis 0) of a [2] parameter
    u = jnp.array([[-0.5, 0.25], [-0.25, 0.0]])  # the inner optimizer's updates, -lr * g
    c = jnp.array([0.0, 2.0])
    state = averaging.ElasticState(count=jnp.zeros((), jnp.int32), centre=c)
    alpha = 0.25
    # stale (canonical EASGD): e_n = alpha (x_n - c); x_n <- x_n + u_n - e_n; c <- c + sum_n e_n
    e = np.array([[0.25, -1.0], [0.75, 0.5]])
    upd, new = averaging.elastic_averaging(alpha).update(u, state, x)
    np.testing.assert_allclose(x + upd, np.array(x) + np.array(u) - e)
    np.testing.assert_allclose(x + upd, [[0.25, -0.75], [2.0, 3.5]])
    np.testing.assert_allclose(new.centre, [1.0, 1.5])
    assert int(new.count) == 1
    # sync: the pull uses the replicas after their own update, y_n = x_n + u_n
    e = 0.25 * (np.array([[0.5, -1.75], [2.75, 4.0]]) - np.array(c))
    upd, new = averaging.elastic_averaging(alpha, centre="sync").update(u, state, x)
    np.testing.assert_allclose(x + upd, np.array(x) + np.array(u) - e)
    np.testing.assert_allclose(new.centre, np.array(c) + e.sum(0))
    # period 2: the second step is a plain inner step and the centre stays put
    tx = averaging.elastic_averaging(alpha, period=2)
    _, s1 = tx.update(u, state, x)
    upd, s2 = tx.update(u, s1, x)
    np.testing.assert_allclose(upd, u)
    np.testing.assert_allclose(s2.centre, s1.centre)


def test_clear_errors():
    model, batch = _model(), _batch(3, size=8)
    plan = jpipe.Plan(pipe=2, data=1, microbatches=2)
    with pytest.raises(ValueError, match=r"\[B, 2, \.\.\.\]"):
        averaging.init(model, plan, optax.sgd(0.1), batch, pipelines=2, rng=jax.random.key(0),
                       devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="overshoot"):
        averaging.ElasticAveraging(alpha=0.5).transform(pipelines=4)
    with pytest.raises(ValueError, match="centre must be one of"):
        averaging.ElasticAveraging(centre="fresh")
    with pytest.raises(ValueError, match="needs the replicas"):
        averaging.elastic_averaging(0.1).update(jnp.ones(2), averaging.ElasticState(jnp.int32(0), jnp.zeros(())))


def test_advance_forward_interpolates_between_1f1b_and_gpipe():
    assert schedules.advance_forward(4, 8).orders() == schedules.one_f_one_b_policy_b(4, 8).orders()
    assert schedules.advance_forward(4, 8, advance=0).orders() == schedules.one_f_one_b(4, 8).orders()
    assert schedules.advance_forward(4, 8, advance=8).orders() == schedules.gpipe(4, 8).orders()
    assert schedules.get_schedule("advance-forward") is schedules.advance_forward
    with pytest.raises(ValueError, match="one int for every stage"):
        schedules.advance_forward(4, 8, advance=[1, 2])


def test_tuner_picks_the_fastest_measured_candidate_that_fits(monkeypatch):
    # Selection logic on made-up measurements: (4, 2) is fastest but too big; (2, 4) is never
    # measured at first, is predicted, and must be measured before it can be chosen.
    fake = {(1, 2): (1.0, 100), (2, 2): (1.2, 180), (4, 2): (1.5, 400), (2, 4): (1.1, 150)}
    calls = []

    def measure(model, plan, optimizer, batch, n, avg, devices, repeats):
        calls.append((n, plan.microbatches))
        return fake[(n, plan.microbatches)]

    monkeypatch.setattr(_tune, "_measure", measure)
    result = averaging.tune(_model(), jax.devices()[:2], _batch(0, size=8), candidates=list(fake),
                            memory_limit=300, measure=[(1, 2), (2, 2), (4, 2)])
    measured = [r for r in result.rows if r.measured]
    assert {(r.pipelines, r.microbatches) for r in measured} == set(calls)
    fastest = max((r for r in measured if r.fits), key=lambda r: r.samples_per_s)
    assert (result.pipelines, result.plan.microbatches) == (fastest.pipelines, fastest.microbatches)
    assert result.best.fits and result.best.memory <= 300
    assert not next(r for r in result.rows if (r.pipelines, r.microbatches) == (4, 2)).fits

    # And for real on the backend, with a small candidate set.
    monkeypatch.undo()
    result = averaging.tune(_model(), jax.devices()[:2], _batch(0, size=8), candidates=[(1, 2), (2, 2)],
                            repeats=2)
    assert all(r.measured for r in result.rows)
    assert result.best == max(result.rows, key=lambda r: r.samples_per_s)
    assert "chosen" in str(result)


def test_plan_with_pipelines_dispatches_to_avgpipe():
    """jpipe.init / to_sequential honour Plan(pipelines=N, averaging=...); advance-forward by default."""
    model = models.mlp(in_dim=3, hidden=8, out_dim=1, num_layers=2)
    batch = averaging.stack_batches([{"x": jnp.ones((8, 3)), "y": jnp.zeros((8, 1))}] * 2)
    plan = jpipe.Plan(pipe=2, data=1, microbatches=4, pipelines=2, averaging=jpipe.ElasticAveraging(beta=0.9))
    assert plan.schedule == "advance-forward"
    state = jpipe.init(model, plan, optax.sgd(0.1), batch, rng=jax.random.key(0), devices=jax.devices()[:2])
    state, _ = jpipe.train_step(state, batch)
    assert len(averaging.replicas(state)) == 2
    for a, b in zip(jax.tree.leaves(jpipe.to_sequential(state)), jax.tree.leaves(averaging.centre(state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
