"""AvgPipe: elastic averaging, co-located pipelines, advance-forward schedule and the (N, M) tuner."""

import re

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


def _global_max(tree):
    return max(float(np.max(np.abs(np.asarray(a)))) for a in jax.tree.leaves(tree))


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _fresh(state):
    """A copy of ``state`` to donate to train_step (same program, so no new compilation)."""
    return jax.tree.map(jnp.copy, state)


def test_one_pipeline_without_averaging_is_the_synchronous_step():
    model, batch = _model(), _batch(1)
    params = model.init_params(jax.random.key(0), batch)
    devices = jax.devices()[:2]
    sync = jpipe.init(model, jpipe.Plan(pipe=2, data=1, microbatches=2), optax.sgd(0.1), batch,
                      params=params, devices=devices)
    plan = jpipe.Plan(pipe=2, data=1, microbatches=2, schedule="advance-forward")
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


@pytest.mark.parametrize("pipelines", [1, 2])
def test_pipelines_are_decoupled_across_data(pipelines):
    """data = 2: N pipelines per data replica, N x 2 in all, each a plain synchronous pipeline on its slice.

    No gradient is mixed across `data` (or across the co-located pipelines); with N = 2 the inner
    optimizer clips by global norm, which must see each pipeline's own gradients only.
    """
    model, data, total = _model(), 2, 2 * pipelines
    batches = [_batch(10 + r, size=8) for r in range(total)]
    ens_batch = averaging.stack_batches(batches)
    params = model.init_params(jax.random.key(0), batches[0])
    optimizer = optax.sgd(0.1) if pipelines == 1 else optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1))
    plan = jpipe.Plan(pipe=2, data=data, microbatches=2, pipelines=pipelines,
                      averaging=averaging.ElasticAveraging(alpha=0.0))
    avg = jpipe.init(model, plan, optimizer, ens_batch, params=params, devices=jax.devices()[:4])
    for leaf in jax.tree.leaves(avg.params["stages"]):
        assert leaf.shape[3] == total and leaf.sharding.spec == P("pipe", None, None, "data")
    for leaf in jax.tree.leaves((avg.params["pre"], avg.params["post"])):
        assert leaf.shape[0] == total and leaf.sharding.spec == P("data")
    sync = jpipe.init(model, jpipe.Plan(pipe=2, data=1, microbatches=2), optimizer, batches[0], params=params,
                      devices=jax.devices()[:2])
    sync_grads = jax.jit(sync.program.grads)
    loss_a, grads_a = jax.jit(avg.program.grads)(avg.params, ens_batch)
    # The gradients in pipelined layout, read back per replica like the parameters.
    grads_a = averaging.replicas(avg.replace(params=grads_a))
    losses = []
    for r in range(total):
        loss_s, grads_s = sync_grads(sync.params, batches[r])
        losses.append(float(loss_s))
        grads_s = jpipe.to_sequential(sync.replace(params=grads_s))
        assert _max_diff(grads_a[r], grads_s) <= 1e-5 * _global_max(grads_s), r
    assert _max_rel(np.mean(losses), loss_a) < 1e-5

    avg, metrics = jpipe.train_step(avg, ens_batch)
    assert _max_rel(np.mean(losses), metrics["loss"]) < 1e-5
    reps = averaging.replicas(avg)
    assert len(reps) == total
    clipped = 0
    for r in range(total):
        expected, _ = jpipe.train_step(_fresh(sync), batches[r])
        expected = jpipe.to_sequential(expected)
        update = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), expected, params)
        # Each replica's update is its own pipeline's synchronous step.
        assert _max_diff(reps[r], expected) <= 1e-5 * _global_max(update), r
        clipped += _global_max(update) < 0.1 * _global_max(grads_a[r]) * 0.999
    if pipelines == 2:
        assert 0 < clipped  # the test means something: clipping acted on some replica
    for leaf in jax.tree.leaves(avg.params["stages"]):
        assert leaf.sharding.spec == P("pipe", None, None, "data")


@pytest.mark.parametrize("mode", ["stale", "sync"])
def test_centre_after_one_step_is_the_formula_over_all_replicas(mode):
    """alpha > 0, data = 2, N = 2: the centre sums the elastic pulls of all N x data replicas."""
    model, alpha, lr, total = _model(), 0.2, 0.1, 4
    batches = [_batch(20 + r, size=8) for r in range(total)]
    ens_batch = averaging.stack_batches(batches)
    params = model.init_params(jax.random.key(1), batches[0])
    plan = jpipe.Plan(pipe=2, data=2, microbatches=2, pipelines=2,
                      averaging=averaging.ElasticAveraging(alpha=alpha, centre=mode))
    state = averaging.init(model, plan, optax.sgd(lr), ens_batch, params=params, devices=jax.devices()[:4])
    # Replicas that differ from each other and from the centre.
    noise = jax.tree.map(lambda a: 0.05 * jax.random.normal(jax.random.key(a.size), a.shape, a.dtype),
                         state.params)
    moved = jax.tree.map(lambda a, b: (a + b).astype(a.dtype), state.params, noise)
    state = state.replace(params=jax.device_put(moved, jax.tree.map(lambda a: a.sharding, state.params)))
    x0 = [jax.tree.map(np.asarray, x) for x in averaging.replicas(state)]
    c0 = jax.tree.map(np.asarray, averaging.centre(state))
    _, grads = jax.jit(state.program.grads)(state.params, ens_batch)
    g = [jax.tree.map(np.asarray, x) for x in averaging.replicas(state.replace(params=grads))]

    state, _ = jpipe.train_step(state, ens_batch)
    # Hand-computed: e_r = alpha (x_r - c) (stale) or alpha (x_r - lr g_r - c) (sync);
    # x_r <- x_r - lr g_r - e_r; c <- c + sum over all N x data replicas of e_r.
    pulled = [jax.tree.map(lambda x, gr: x - lr * gr, x, gr) if mode == "sync" else x for x, gr in zip(x0, g)]
    e = [jax.tree.map(lambda p, c: alpha * (p - c), p, c0) for p in pulled]
    want_centre = jax.tree.map(lambda c, *es: c + sum(es), c0, *e)
    scale = _global_max(want_centre)
    assert _max_diff(averaging.centre(state), want_centre) <= 1e-6 * scale
    for r, rep in enumerate(averaging.replicas(state)):
        want = jax.tree.map(lambda x, gr, er: x - lr * gr - er, x0[r], g[r], e[r])
        assert _max_diff(rep, want) <= 1e-6 * scale, r


def _entry_instructions(hlo: str) -> dict[str, str]:
    """The ENTRY computation of an HLO module's text: instruction name -> the rest of its line."""
    out = {}
    for line in hlo[hlo.index("\nENTRY "):].splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)", line)
        if m:
            out[m.group(1)] = m.group(2)
        elif line.startswith("}"):
            break
    return out


def _ancestors(instrs: dict[str, str], name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for dep in re.findall(r"%([\w.\-]+)", instrs[todo.pop()]):
            if dep in instrs and dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


@pytest.mark.parametrize("mode", ["stale", "sync"])
def test_stale_centre_all_reduce_does_not_wait_for_the_pipeline(mode):
    """In the compiled step, the centre's all-reduce over `data` does not depend on the pipeline loop.

    The centre's update sums the pulls of the replicas, which are split over `data`: on each
    device a partial sum of the centre's shape, all-reduced over `data`. With the stale centre its
    operands are step-start values only, so it depends on no while loop (the pipeline's scan) and
    XLA is free to overlap it with the pipeline; with the sync centre it waits for the gradients.
    """
    model = _model()
    ens_batch = averaging.stack_batches([_batch(30), _batch(31)])
    plan = jpipe.Plan(pipe=2, data=2, microbatches=2, pipelines=1,
                      averaging=averaging.ElasticAveraging(alpha=0.3, centre=mode))
    state = averaging.init(model, plan, optax.sgd(0.1), ens_batch, rng=jax.random.key(0),
                           devices=jax.devices()[:4])
    centre = jax.tree.leaves(state.opt_state[1].centre)
    # Local (per-device) shapes as HLO prints them, e.g. f32[1,1,2,16,16] for a stage stack.
    want = {f"f32[{','.join(map(str, a.sharding.shard_shape(a.shape)))}]" for a in centre}
    instrs = _entry_instructions(jpipe.train_step.lower(state, ens_batch).compile().as_text())
    loops = {name for name, rest in instrs.items() if re.search(r"\swhile\(", rest)}
    assert loops, "no pipeline loop found in the compiled step"
    found, waiting = set(), set()
    for name, rest in instrs.items():
        if re.search(r"\sall-reduce(-start)?\(", rest):
            head = re.sub(r"\{[\d,]*\}", "", rest.split("all-reduce")[0])  # result shape(s), layouts dropped
            shapes = set(re.findall(r"[a-z]+\d*\[[\d,]*\]", head)) & want
            found |= shapes
            if shapes and _ancestors(instrs, name) & loops:
                waiting |= shapes
    assert found == want  # every centre leaf is all-reduced
    assert waiting == (set() if mode == "stale" else want)


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
    # data = 2: N pipelines on each data replica, so the replica axis holds N x data.
    plan = jpipe.Plan(pipe=2, data=2, microbatches=2, pipelines=2)
    with pytest.raises(ValueError, match=r"pipelines=2 x data=2 .*\[B, 4, \.\.\.\]"):
        averaging.init(model, plan, optax.sgd(0.1), averaging.stack_batches([batch] * 2), rng=jax.random.key(0),
                       devices=jax.devices()[:4])
    with pytest.raises(ValueError, match="not divisible by microbatches"):
        averaging.init(model, plan, optax.sgd(0.1), averaging.stack_batches([_batch(3, size=3)] * 4),
                       rng=jax.random.key(0), devices=jax.devices()[:4])


def test_per_replica_optimizer_clips_each_replica_on_its_own():
    """optax.clip_by_global_norm (and a momentum) under per_replica: each replica as if alone."""
    ks = jax.random.split(jax.random.key(5), 6)
    # Two replicas in the pipelined layout: pre/post [R, ...], stage stacks [devices, chunks, layers, R, ...].
    params = {"pre": {"w": jax.random.normal(ks[0], (2, 3))},
              "stages": {"w": jax.random.normal(ks[1], (2, 1, 2, 2, 4))},
              "post": {"w": jax.random.normal(ks[2], (2, 5))}}
    grads = {"pre": {"w": jax.random.normal(ks[3], (2, 3))},
             "stages": {"w": jax.random.normal(ks[4], (2, 1, 2, 2, 4)).at[:, :, :, 1].multiply(20.0)},
             "post": {"w": jax.random.normal(ks[5], (2, 5))}}
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
    tx = averaging.per_replica(inner, averaging.REPLICA_AXIS)
    state = tx.init(params)
    # The momentum keeps the replica axis where the parameters have it (so that it shards like them).
    assert state[1][0].trace["stages"]["w"].shape == (2, 1, 2, 2, 4)
    for _ in range(2):
        updates, state = tx.update(grads, state, params)

    def take(tree, r):
        return {k: jax.tree.map(lambda a, k=k: jnp.take(a, r, axis=averaging.REPLICA_AXIS[k]), v)
                for k, v in tree.items()}

    for r in range(2):
        one, g = take(params, r), take(grads, r)
        s = inner.init(one)
        for _ in range(2):
            want, s = inner.update(g, s, one)
        got = take(updates, r)
        assert _max_diff(got, want) <= 1e-6 * _global_max(want)
    # The global norm of all replicas together would clip replica 0 too: make sure that is not what happened.
    s = inner.init(params)
    for _ in range(2):
        together, s = inner.update(grads, s, params)
    assert _max_diff(together, updates) > 1e-3


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
