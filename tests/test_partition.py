"""Tests for jpipe.partition: profiles, DAPPLE's latency model and planner, jpipe's mesh planner.

The DAPPLE graph profiles are read from ../shared/reference/dapple-profiles/ at run time;
tests that need them skip when that folder is absent.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random

import numpy as np
import pytest

from jpipe import Plan
from jpipe.partition import (
    Cluster,
    CommCost,
    LayerCost,
    Profile,
    balanced_partition,
    dapple_latency,
    dapple_plan,
    dapple_plan_for,
    evaluate,
    load,
    measure_plans,
    overlapped_allreduce,
    read_graph_profile,
    refine,
    robust_line,
    search,
    stage_costs,
)
from jpipe.partition._cost import exposed_allreduce_table
from jpipe.partition._dapple import _place
from jpipe.partition._profile import interpolate
from jpipe.partition._search import _contention
from jpipe.schedules import Costs, simulate

PROFILES = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "reference",
                                         "dapple-profiles"))
needs_profiles = pytest.mark.skipif(not os.path.isdir(PROFILES), reason="DAPPLE profiles not present")


# -- cluster -------------------------------------------------------------------------------------

def test_cluster_presets_and_allreduce_formula():
    a, b, c = (Cluster.preset(n) for n in ("dapple-A", "dapple-B", "dapple-C"))
    assert (a.servers, a.devices_per_server, b.servers, b.devices_per_server) == (2, 8, 16, 1)
    assert c.inter_server_bandwidth == pytest.approx(b.inter_server_bandwidth * 10 / 25)
    size = 1e9
    assert a.allreduce_time(size, [1, 0]) == 0.0
    assert a.allreduce_time(size, [8, 0]) == pytest.approx(2 * size * 7 / 8 / 25e9 / 4)
    assert b.allreduce_time(size, [1] * 16) == pytest.approx(2 * size * 15 / 16 / 3e9)
    with pytest.raises(ValueError, match="dapple-A"):
        Cluster.preset("nope")


def test_placement_policies():
    assert _place((0, 0), 4, "fresh", 8) == (4, 0)
    assert _place((4, 0), 4, "fresh", 8) == (0, 4)       # an unused server first
    assert _place((4, 0), 2, "append", 8) == (2, 0)      # a server in use first
    assert _place((0, 0, 0, 0), 6, "scatter", 8) == (2, 2, 1, 1)
    assert _place((8, 8), 1, "fresh", 8) is None


# -- latency model -------------------------------------------------------------------------------

@pytest.mark.parametrize("S,M", [(1, 1), (2, 4), (4, 8), (5, 3)])
def test_latency_balanced_pipeline_is_gpipe_formula(S, M):
    lat = dapple_latency([1.0] * S, [2.0] * S, [0.0] * S, microbatches=M)
    assert lat.total == pytest.approx((M + S - 1) * 3.0)
    assert lat.pivot == S - 1


def test_latency_pivot_moves_to_slow_stage_and_allreduce_extends_the_end():
    lat = dapple_latency([1.0, 3.0, 1.0], [1.0, 3.0, 1.0], [0.0, 0.0, 0.0], microbatches=10)
    assert lat.pivot == 1
    assert lat.steady == pytest.approx(9 * 6.0)
    assert lat.warmup == pytest.approx(4.0)
    slow_ar = dapple_latency([1.0, 3.0, 1.0], [1.0, 3.0, 1.0], [0.0, 0.0, 100.0], microbatches=10)
    assert slow_ar.total > lat.total + 90   # the last stage's all-reduce dominates the end phase


def _simulated_exposure(backward, allreduce):
    """Event by event: one link, each layer's all-reduce queued when its backward ends (last layer first)."""
    clock = link = 0.0
    for b, ar in zip(reversed(backward), reversed(allreduce)):
        clock += b
        link = max(link, clock) + ar
    return max(link - clock, 0.0)


@pytest.mark.parametrize("seed", range(6))
def test_overlapped_allreduce_is_the_event_simulation_on_every_stage_range(seed):
    rng = np.random.default_rng(seed)
    L = 7
    back, ar = rng.uniform(0.1, 2.0, L), rng.uniform(0.0, 3.0, L) * rng.integers(0, 2, L)
    table = exposed_allreduce_table(back, ar)
    for lo in range(L):
        for hi in range(lo + 1, L + 1):
            want = _simulated_exposure(back[lo:hi], ar[lo:hi])
            assert table[lo, hi] == pytest.approx(want, abs=1e-12), (lo, hi)
    assert overlapped_allreduce(list(back), list(ar)) == pytest.approx(table[0, L])
    # at least the first layer's all-reduce (its gradient is ready last), at most all of it
    assert ar[0] - 1e-12 <= table[0, L] <= ar.sum() + 1e-12


def test_dapple_data_parallel_pays_only_the_exposed_allreduce():
    """One stage on every device: M (F + B) + exposed all-reduce, against M (F + B) + AR without overlap."""
    layers = tuple(LayerCost(f"l{i}", 0.01, 0.02, 1e6, 1e8 * (i + 1)) for i in range(8))
    prof = Profile(layers=layers, microbatch_size=4)
    cluster = Cluster.preset("dapple-B")
    dp = dapple_plan_for(prof, 64, cluster, [16])
    plain = dapple_plan_for(prof, 64, cluster, [16], overlap=False)
    assert dp.pattern == plain.pattern == "DP" and dp.microbatches == plain.microbatches
    M, per_replica = dp.microbatches, dp.microbatch_size / 16 / 4   # profile times are for 4 samples
    compute = M * sum(l.forward + l.backward for l in layers) * per_replica
    seconds_per_byte = cluster.allreduce_time(1.0, [1] * 16)
    ar = [l.param_bytes * seconds_per_byte for l in layers]
    assert plain.latency == pytest.approx(compute + sum(ar))
    exposed = overlapped_allreduce([l.backward * per_replica for l in layers], ar)
    assert dp.latency == pytest.approx(compute + exposed)
    assert ar[0] < exposed < sum(ar)   # weights late in the model: part of the all-reduce stays exposed
    assert dp.data_parallel_latency == dp.latency and plain.data_parallel_latency == plain.latency


def test_dapple_plan_for_scores_the_planners_choice_as_the_planner_did():
    layer = LayerCost("l", 0.01, 0.02, 1e6, 4e7)
    prof = Profile(layers=(layer,) * 24, microbatch_size=2)
    cluster = Cluster.preset("dapple-A")
    plan = dapple_plan(prof, 64, cluster)
    again = dapple_plan_for(prof, 64, cluster, [s.replicas for s in plan.stages],
                            [s.num_layers for s in plan.stages])
    assert again.latency == pytest.approx(plan.latency) and again.pattern == plan.pattern
    with pytest.raises(ValueError, match="use all 16 devices"):
        dapple_plan_for(prof, 64, cluster, [8, 4])
    with pytest.raises(ValueError, match="summing to the 24 layers"):
        dapple_plan_for(prof, 64, cluster, [8, 8], [10, 10])


def test_latency_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="one entry per stage"):
        dapple_latency([1.0, 1.0], [1.0], [0.0, 0.0], microbatches=2)


# -- profiles ------------------------------------------------------------------------------------

GRAPH = """node1 -- Input0 -- forward_compute_time=5.0, backward_compute_time=0.000, activation_size=0.0, parameter_size=0.000
node2 -- Embedding -- forward_compute_time=0.1, backward_compute_time=0.2, activation_size=100.0, parameter_size=1000.0
node3 -- layer_0 -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=[100.0; 20.0], parameter_size=50.0
node4 -- Dropout -- forward_compute_time=0.5, backward_compute_time=0.5, activation_size=100.0, parameter_size=0.0
node5 -- layer_1 -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=100.0, parameter_size=50.0
node6 -- classifier -- forward_compute_time=3.0, backward_compute_time=1.0, activation_size=7.0, parameter_size=500.0
  node1 -- node2
  node2 -- node3
  node3 -- node4
  node4 -- node5
  node5 -- node6
"""


def test_read_graph_profile_groups_nodes_into_layers(tmp_path):
    path = tmp_path / "toy-2-pbs-4.txt"
    path.write_text(GRAPH)
    p = read_graph_profile(path)
    assert p.microbatch_size == 4 and p.num_layers == 2
    assert p.pre.param_bytes == 1000.0 and p.pre.forward == pytest.approx(0.1e-3)  # input time dropped
    assert p.layers[0].forward == pytest.approx(1.5e-3)    # the dropout joined layer 0
    assert p.layers[0].residual_bytes == pytest.approx(220.0)
    assert p.post.param_bytes == 500.0
    assert p.cut_bytes == (100.0,)
    (tmp_path / "bad.txt").write_text("hello\n")
    with pytest.raises(ValueError, match="bad.txt:1"):
        read_graph_profile(tmp_path / "bad.txt", 1)


@needs_profiles
@pytest.mark.parametrize("file,layers,pbs", [("bert-48-pbs-2.txt", 48, 2), ("gnmt-16-pbs-64.txt", 16, 64),
                                             ("xlnet-36-pbs-1.txt", 36, 1), ("bert-24-pbs-6.txt", 24, 6)])
def test_reads_the_published_profiles(file, layers, pbs):
    p = read_graph_profile(os.path.join(PROFILES, file))
    assert (p.num_layers, p.microbatch_size) == (layers, pbs)
    assert all(l.forward > 0 and l.param_bytes > 0 for l in p.layers)


def test_profile_json_round_trip_and_scaling(tmp_path):
    # measured at 4 (the profile's size), 2 and 8 samples: superlinear above 4
    layer = LayerCost("l", 2e-3, 4e-3, 1e3, 1e4, 2e4, 5e3, update=1e-4,
                      curve=((0.5, 1.5e-3, 2e-3), (2.0, 5e-3, 9e-3)))
    p = Profile(layers=(layer,) * 3, microbatch_size=4, pre=layer,
                comm=CommCost(exchange=((1e3, 1e-4), (1e5, 2e-3)), allreduce=((1e3, 1e-3), (1e6, 4e-3))))
    p = dataclasses.replace(p, step_overhead=2e-3, stash_copy=((1e5, 3e-6), (1e4, 4e-7)))
    assert p.stash_copy == ((1e4, 4e-7), (1e5, 3e-6))               # points sorted by bytes
    p.save(tmp_path / "p.json")
    assert load(tmp_path / "p.json") == p
    older = json.loads(p.to_json())
    del older["step_overhead"], older["stash_copy"]                 # a profile saved before they were measured
    assert Profile.from_json(json.dumps(older)).step_overhead_at(4) == 0.0
    older["step_overhead"] = 2e-3                                   # saved as one number: the same at every size
    assert Profile.from_json(json.dumps(older)).step_overhead == ((4.0, 2e-3),)
    assert Profile.from_json(json.dumps(older)).stash_copy == ()
    assert Profile.from_json(json.dumps(older)).contention == 1.0   # saved before it was measured
    crowded = dataclasses.replace(p, contention=1.5)
    assert Profile.from_json(crowded.to_json()) == crowded and crowded.scaled(8).contention == 1.5
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="contention must be a positive factor"):
            dataclasses.replace(p, contention=bad)
    assert p.scaled(8).stash_copy == p.stash_copy                    # keyed by bytes, not by batch
    assert p.scaled(8).step_overhead == p.step_overhead              # keyed by micro-batch size
    q = dataclasses.replace(p, step_overhead=((2, 1e-3), (8, 4e-3)))
    assert q.step_overhead_at(4) == pytest.approx(2e-3) and q.step_overhead_at(8) == 4e-3
    assert Profile.from_json(q.to_json()) == q
    half = p.scaled(2)
    assert half.layers[0].forward == pytest.approx(1.5e-3)       # the measured point, not 4 / 2
    assert half.layers[0].activation_bytes == pytest.approx(500)
    assert p.scaled(6).layers[0].backward == pytest.approx(6.5e-3)   # between the points at 4 and 8
    assert p.scaled(16).layers[0].forward == pytest.approx(11e-3)    # the last segment, extended
    assert half.scaled(8).layers[0] == p.scaled(8).layers[0]          # scaling keeps every point
    assert p.comm.exchange_time(5.05e4) == pytest.approx(1.05e-3)
    assert p.comm.allreduce_time(1e3, 2) == pytest.approx(1e-3)      # ring bytes 2 s (n-1)/n = s
    with pytest.raises(ValueError, match="cut_bytes"):
        Profile(layers=(layer,) * 3, microbatch_size=1, cut_bytes=(1.0,))


# -- DAPPLE planner ------------------------------------------------------------------------------

def _check_plan_shape(plan, num_layers, cluster):
    starts = [s.layers for s in plan.stages]
    assert starts[0][0] == 0 and starts[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(starts))
    devices = [d for s in plan.stages for d in s.devices]
    assert sorted(devices) == list(range(cluster.num_devices))
    assert all(len(s.devices) == s.replicas for s in plan.stages)


def test_dapple_plan_data_parallel_when_weights_are_tiny():
    layer = LayerCost("l", 0.01, 0.02, activation_bytes=1e7, param_bytes=1e3)
    cluster = Cluster.preset("dapple-B")
    plan = dapple_plan(Profile(layers=(layer,) * 16, microbatch_size=1), 256, cluster)
    assert plan.pattern == "DP"
    _check_plan_shape(plan, 16, cluster)


def test_dapple_plan_non_uniform_replication_for_a_weight_heavy_layer():
    """A cheap layer with huge weights is kept on one device; the rest is replicated 15 ways."""
    heavy = LayerCost("l", 0.02, 0.04, 1e5, 1e6)
    head = LayerCost("head", 0.001, 0.002, 1e5, 2e9)
    slow_net = Cluster(16, 1, 25e9, 1e8, 64e9)
    # a batch of 15 x 64: micro-batches of 15 split evenly over 15 replicas (samples are whole)
    plan = dapple_plan(Profile(layers=(heavy,) * 15 + (head,), microbatch_size=1), 960, slow_net)
    _check_plan_shape(plan, 16, slow_net)
    assert plan.stages[-1].replicas == 1 and plan.stages[-1].layers[0] >= 14
    assert plan.pattern.endswith(":1") and max(s.replicas for s in plan.stages) >= 8


def test_dapple_plan_two_by_eight_keeps_stages_inside_servers():
    layer = LayerCost("l", 2.69e-3, 4.47e-3, 4.3e6, 5e7)
    cluster = Cluster.preset("dapple-A")
    plan = dapple_plan(Profile(layers=(layer,) * 24, microbatch_size=2), 64, cluster)
    _check_plan_shape(plan, 24, cluster)
    assert plan.pattern == "8:8"
    for s in plan.stages:
        assert len({d // 8 for d in s.devices}) == 1
    assert plan.speedup_over_dp > 1.5


@needs_profiles
def test_table4_bert48_config_a_and_b():
    bert = read_graph_profile(os.path.join(PROFILES, "bert-48-pbs-2.txt"))
    a = dapple_plan(bert, 64, Cluster.preset("dapple-A"))
    assert a.pattern == "8:8" and abs(a.stages[0].num_layers - 23) <= 2
    assert dapple_plan(bert, 64, Cluster.preset("dapple-B")).pattern == "straight"


# -- jpipe's planner -----------------------------------------------------------------------------

def _brute_partition(work, pre, post, stages):
    best = None
    L = len(work)
    for cuts in itertools.combinations(range(1, L), stages - 1):
        bounds = (0, *cuts, L)
        times = [sum(work[a:b]) for a, b in itertools.pairwise(bounds)]
        times[0] += pre
        times[-1] += post
        if best is None or max(times) < best - 1e-12:
            best = max(times)
    return best


def test_balanced_partition_matches_brute_force():
    rng = random.Random(0)
    for _ in range(20):
        L, S = rng.randint(3, 9), rng.randint(1, 3)
        layers = tuple(LayerCost("l", rng.uniform(0.5, 2), rng.uniform(0.5, 3), 0, 0) for _ in range(L))
        pre, post = LayerCost("pre", rng.uniform(0, 3), rng.uniform(0, 3), 0, 0), \
            LayerCost("post", rng.uniform(0, 3), rng.uniform(0, 3), 0, 0)
        prof = Profile(layers=layers, microbatch_size=1, pre=pre, post=post)
        part = balanced_partition(prof, S)
        assert sum(part) == L and min(part) >= 1
        work = [l.forward + l.backward for l in layers]
        f, b = stage_costs(prof, part)
        assert max(x + y for x, y in zip(f, b)) == pytest.approx(
            _brute_partition(work, 2 * pre.forward + pre.backward, post.forward + post.backward, S))


def _toy_profile(num_layers=8, post_factor=1.0):
    layer = LayerCost("l", 1e-3, 2e-3, activation_bytes=4e4, param_bytes=1e6, optimizer_bytes=2e6,
                      residual_bytes=1e5)
    post = LayerCost("post", 1e-3 * post_factor, 2e-3 * post_factor, 4, 1e6, 2e6, 1e5)
    return Profile(layers=(layer,) * num_layers, microbatch_size=4, post=post,
                   comm=CommCost.linear(2e-5, 2e-10, 1e-5, 1e-10))


def test_search_ranks_candidates_and_respects_memory():
    prof = _toy_profile()
    choice = search(prof, num_devices=8, global_batch=32)
    times = [c.step_time for c in choice.candidates]
    assert choice.plan == choice.candidates[0].plan and times == sorted(times)
    shapes = {(c.plan.pipe, c.plan.data) for c in choice.candidates}
    assert shapes == {(1, 8), (2, 4), (4, 2), (8, 1)}
    assert "step ms" in choice.table()
    # a limit that only pipelined plans meet (stage weights are split across devices)
    dp_memory = next(c.memory for c in choice.candidates if c.plan.pipe == 1)
    limited = search(prof, num_devices=8, global_batch=32, memory_limit=dp_memory * 0.7)
    assert limited.plan.pipe > 1 and limited.candidates[0].memory <= dp_memory * 0.7
    with pytest.raises(ValueError, match="no plan fits in 0.0 MiB per device: the smallest, pipe .* needs"):
        search(prof, num_devices=8, global_batch=32, memory_limit=1.0)


def test_refine_measures_the_best_predicted_within_reach_and_chooses_by_measurement(monkeypatch):
    from jpipe.partition import _measure

    choice = search(_toy_profile(), num_devices=8, global_batch=32)
    best = choice.candidates[0].step_time
    within_25 = [c for c in choice.candidates if c.step_time <= 1.25 * best]
    assert len(within_25) == 5  # three data-parallel ties, two pipelined plans within 20 %
    asked = []

    def measure(model, plans, batch, **kwargs):  # the last predicted is the fastest measured
        asked.append(list(plans))
        return [1.0 / (i + 1) for i in range(len(plans))]

    monkeypatch.setattr(_measure, "measure_plans", measure)
    batch = {"x": np.ones((32, 1))}
    for top, within, expect in ((3, 0.25, 3), (9, 0.25, 5), (9, 0.1, 3), (1, 0.25, 1)):
        asked.clear()
        refined = refine(choice, None, batch, top=top, within=within)
        assert asked == [[c.plan for c in choice.candidates[:expect]]]
        assert refined.plan == choice.candidates[expect - 1].plan
        assert [c.measured for c in refined.candidates[:expect]] == [1.0 / i for i in range(expect, 0, -1)]
        assert all(c.measured is None for c in refined.candidates[expect:])
        assert refined.candidates[expect:] == choice.candidates[expect:]  # the rest keep their order
        assert "measured" in refined.table() and "measured" not in choice.table()
    with pytest.raises(ValueError, match="top must be >= 1"):
        refine(choice, None, batch, top=0)
    with pytest.raises(ValueError, match="within must be >= 0"):
        refine(choice, None, batch, within=-0.1)
    unfit = choice._replace(candidates=tuple(c._replace(fits=False) for c in choice.candidates))
    with pytest.raises(ValueError, match="no candidate fits"):
        refine(unfit, None, batch)


def test_measure_plans_times_each_plan_on_its_mesh():
    import jax
    import jax.numpy as jnp

    import jpipe.models

    model = jpipe.models.mlp(in_dim=4, hidden=16, out_dim=1, num_layers=4)
    batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 1))}
    plans = [Plan(pipe=2, data=2, microbatches=2), Plan(pipe=4, data=1, microbatches=4, schedule="gpipe"),
             Plan(pipe=1, data=4, microbatches=1)]
    times = measure_plans(model, plans, batch, devices=jax.devices()[:4], steps=2, rounds=2, warmup=1)
    assert len(times) == 3 and all(0 < t < 60 and math.isfinite(t) for t in times)
    with pytest.raises(ValueError, match="pipe x data = 2 x 1 = 2 but there are 4 devices"):
        measure_plans(model, [Plan(pipe=2, data=1, microbatches=2)], batch, devices=jax.devices()[:4])
    with pytest.raises(ValueError, match="steps must be >= 1"):
        measure_plans(model, plans, batch, devices=jax.devices()[:4], steps=0)


def test_gpipe_holds_more_than_1f1b_in_predicted_memory():
    prof = _toy_profile()
    mem = {s: evaluate(prof, Plan(4, 2, 8, schedule=s), 32).memory for s in ("gpipe", "1f1b")}
    assert mem["gpipe"] > mem["1f1b"]


def test_search_weighs_fused_ticks_against_their_memory():
    """With B = 2F, fused 1f1b-b is predicted faster than one-action 1F1B and holds more; the search
    offers it, and a memory limit between the two falls back to 1F1B."""
    layer = LayerCost("l", 1e-3, 2e-3, activation_bytes=1e6, param_bytes=1e3, optimizer_bytes=2e3,
                      residual_bytes=4e6)
    prof = Profile(layers=(layer,) * 8, microbatch_size=4)
    plain, fused = (evaluate(prof, Plan(4, 1, 16, schedule=s, fuse_ticks=f), 64)
                    for s, f in (("1f1b", False), ("1f1b-b", True)))
    assert fused.step_time < 0.85 * plain.step_time and fused.memory > plain.memory
    pipelined = [c for c in search(prof, 4, 64).candidates if c.plan.pipe == 4 and c.plan.microbatches == 16]
    assert any(c.plan.fuse_ticks for c in pipelined)
    assert "1f1b-b+fused" in search(prof, 4, 64).table()
    limit = (plain.memory + fused.memory) / 2
    fitting = [c for c in search(prof, 4, 64, memory_limit=limit).candidates if c.fits and c.plan.pipe == 4]
    assert fitting and not any(c.plan.fuse_ticks and c.plan.microbatches == 16 for c in fitting)


def test_gpt_with_heavy_head_gets_an_uneven_partition():
    """Acceptance: a GPT-like model whose head costs much more than a layer, planned for 8 CPU devices."""
    import jax
    import jax.numpy as jnp

    import jpipe.models
    from jpipe.partition import profile

    model = jpipe.models.gpt(vocab_size=8192, seq_len=16, d_model=32, num_heads=2, num_layers=8)
    batch = {"tokens": jnp.zeros((32, 16), jnp.int32), "targets": jnp.zeros((32, 16), jnp.int32)}
    prof = profile(model, jax.tree.map(lambda a: a[:8], batch), repeats=5, warmup=1, comm=False,
                   microbatch_sizes=[8], devices=jax.devices()[:1])  # the ratio of two times: no sharing runs
    head = prof.post.forward + prof.post.backward
    layer = prof.layers[0].forward + prof.layers[0].backward
    assert head > 2 * layer, (head, layer)
    choice = search(prof, num_devices=8, global_batch=32)
    for pipe in (2, 4):
        cand = next(c for c in choice.candidates if c.plan.pipe == pipe)
        part = cand.plan.partition
        assert part[-1] < max(part), part           # the head's stage holds fewer layers
        f, b = stage_costs(prof, part)
        even = Plan(pipe, 8 // pipe, 1).stage_partition(8)
        fe, be = stage_costs(prof, even)
        assert max(np.add(f, b)) < max(np.add(fe, be))   # and the stages are better balanced


@needs_profiles
@pytest.mark.parametrize("overlap", [True, False])
def test_table4_reproduction_matches_at_least_eight_cells(overlap):
    """Acceptance: DAPPLE's Table 4 replication pattern in >= 8 of 9 cells under either data-parallel
    model, splits within 2 layers."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "experiments", "dapple_table4.py")
    spec = importlib.util.spec_from_file_location("dapple_table4", path)
    table4 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table4)
    matches = 0
    for name, file, batch in table4.MODELS:
        prof = read_graph_profile(os.path.join(PROFILES, file))
        for config in table4.CONFIGS:
            plan = dapple_plan(prof, batch, Cluster.preset(config), overlap=overlap)
            pattern, split = table4.PAPER[(name, config)]
            if plan.pattern != pattern:
                continue
            matches += 1
            if split is not None:
                got, want = map(int, plan.split.split(":")), map(int, split.split(":"))
                assert max(abs(a - b) for a, b in zip(got, want)) <= 2, (name, config, plan.split, split)
    assert matches >= 8, matches


def test_dapple_search_space_and_full_search():
    """search='dapple' returns DP, straight or two stages; search='full' may go deeper, never slower."""
    layer = LayerCost("l", 0.01, 0.02, 1e6, 2e8)
    prof = Profile(layers=(layer,) * 16, microbatch_size=1)
    cluster = Cluster.preset("dapple-B")
    dapple = dapple_plan(prof, 256, cluster)
    full = dapple_plan(prof, 256, cluster, search="full")
    assert dapple.pattern in ("DP", "straight") or len(dapple.stages) == 2
    assert full.latency <= dapple.latency + 1e-12
    _check_plan_shape(full, 16, cluster)
    with pytest.raises(ValueError, match="search must be one of"):
        dapple_plan(prof, 256, cluster, search="nope")


def test_profile_times_every_asked_size_and_the_optimizer_step():
    import jax.numpy as jnp

    import jpipe.models
    from jpipe.partition import memory_profile, profile

    model = jpipe.models.mlp(in_dim=4, hidden=32, out_dim=1, num_layers=3)
    mb = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 1))}
    p = profile(model, mb, repeats=3, warmup=1, comm=False, microbatch_sizes=[2, 8, 32])
    layer = p.layers[0]
    assert [point[0] for point in layer.curve] == [0.25, 4.0]     # 2 and 32 samples, relative to 8
    at_32 = p.scaled(32).layers[0]
    assert (at_32.forward, at_32.backward) == layer.curve[1][1:]   # a measured size is read, not scaled
    assert at_32.activation_bytes == 4 * layer.activation_bytes
    assert layer.update > 0 and p.pre.update > 0 and p.post.update > 0
    # what train_step of pre, the layers and post took beyond its parts
    assert [size for size, _ in p.step_overhead] == [2, 8, 32]     # measured at every size
    assert all(math.isfinite(t) and 0 <= t for _, t in p.step_overhead)
    # a stash slot's copy, at each size: the timed stack's (all 3 layers') residuals
    assert [nbytes for nbytes, _ in p.stash_copy] == [3 * p.scaled(s).layers[0].residual_bytes for s in (2, 8, 32)]
    assert all(t > 0 for _, t in p.stash_copy)
    # the sizes alone, from shapes (nothing compiled), are the timed profile's
    sizes = memory_profile(model, mb)
    for timed, shapes in zip((p.pre, p.layers[0], p.post), (sizes.pre, sizes.layers[0], sizes.post)):
        assert timed._replace(forward=0.0, backward=0.0, update=0.0, curve=(), name="") == \
            shapes._replace(name="")
    assert sizes.layers[0].accumulator_bytes == sizes.layers[0].param_bytes          # float32 weights
    with pytest.raises(ValueError, match="microbatch_sizes"):
        profile(model, mb, comm=False, microbatch_sizes=[0])


def test_profiler_measures_again_without_compiling():
    import jax
    import jax.numpy as jnp
    from jax import monitoring

    import jpipe.models
    from jpipe.partition import Profiler

    model = jpipe.models.mlp(in_dim=4, hidden=32, out_dim=1, num_layers=3)
    mb = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 1))}
    profiler = Profiler(model, mb, devices=jax.devices()[:2], microbatch_sizes=[2, 4, 8], warmup=1)
    compiled: list[str] = []

    def listen(event: str, seconds: float, **kwargs) -> None:  # compiled, or read from the tests' cache
        if event in ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec"):
            compiled.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        first = profiler.measure(repeats=3)
        compiles = len(compiled)
        again = profiler.measure(repeats=3)
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert compiles > 0 and len(compiled) == compiles                 # every run was compiled by the first
    assert again.layers[0].curve != () and again.comm is not None
    # the same sizes, measured afresh
    assert [c[0] for c in again.layers[0].curve] == [c[0] for c in first.layers[0].curve] == [0.25, 0.5]
    assert [x for x, _ in again.comm.exchange] == [x for x, _ in first.comm.exchange]
    assert again.layers[0].forward > 0 and again.comm.allreduce[0][1] > 0


def test_devices_of_one_process_scale_every_time_by_how_much_they_slow_each_other(monkeypatch):
    """Simulated devices share the host's cores: the stack timed on all of them at once took 3x its time
    on one alone (faked here), so every time is the all-computing one and contention is 3."""
    import jax
    import jax.numpy as jnp

    import jpipe.models
    from jpipe.partition import Profiler, _profile

    model = jpipe.models.mlp(in_dim=4, hidden=16, out_dim=1, num_layers=2)
    mb = {"x": jnp.ones((4, 4)), "y": jnp.zeros((4, 1))}
    real = _profile._timed
    profilers = []

    def fake(parts, repeats, warmup, also=()):
        costs, times = real(parts, 1, 0, also=also)
        sharing = profilers[-1]._sharing
        if sharing is not None:
            assert also[:2] == list(sharing)                 # timed in turns with the parts
            times = [3e-3, 1e-3, *times[2:]]                  # every device computing, one alone
        return [c._replace(forward=1e-3, backward=2e-3) for c in costs], times

    monkeypatch.setattr(_profile, "_timed", fake)
    measured = []
    for devices in (jax.devices()[:4], jax.devices()[:1]):
        profilers.append(Profiler(model, mb, devices=devices, comm=False, microbatch_sizes=[4], warmup=0))
        measured.append(profilers[-1].measure(repeats=1))
    shared, alone = measured
    assert shared.contention == pytest.approx(3.0) and alone.contention == 1.0
    for part in ("pre", "post"):
        assert getattr(shared, part).forward == pytest.approx(3e-3)
        assert getattr(alone, part).forward == pytest.approx(1e-3)
    assert shared.layers[0].backward == pytest.approx(6e-3) and alone.layers[0].backward == pytest.approx(2e-3)


def test_predictions_within_the_tie_go_to_the_least_memory_then_the_fewest_microbatches():
    from jpipe.partition._search import TIE

    for prof in (_toy_profile(), _toy_profile(post_factor=3.0)):
        choice = search(prof, num_devices=8, global_batch=32)
        first, rest = choice.candidates[0], choice.candidates[1:]
        fastest = min(c.step_time for c in choice.candidates if c.fits)
        close = [c for c in choice.candidates if c.fits and c.step_time <= fastest * (1 + TIE)]
        assert first.plan == choice.plan
        assert (first.memory, first.plan.microbatches) == min((c.memory, c.plan.microbatches) for c in close)
        assert [c.step_time for c in rest] == sorted(c.step_time for c in rest)


def test_mean_profile_averages_every_time_and_keeps_every_size():
    from jpipe.partition import mean_profile

    def at(t: float) -> Profile:
        layer = LayerCost("l", t, 2 * t, 1e3, 1e4, 2e4, update=t / 10, curve=((0.5, t / 2, t),))
        comm = CommCost(exchange=((8e3, t), (64e3, 3 * t)), allreduce=((1e5, 5 * t),))
        return Profile(layers=(layer,) * 3, microbatch_size=4, pre=layer, post=layer, comm=comm,
                       step_overhead=t, name="m", stash_copy=((1e4, t), (1e5, 4 * t)))

    mean = mean_profile([at(1e-3), at(2e-3), at(6e-3)])
    expected = at(3e-3)
    for got, want in zip([mean.pre, *mean.layers, mean.post], [expected.pre, *expected.layers, expected.post]):
        assert got.name == want.name and got.activation_bytes == want.activation_bytes
        assert got.curve[0][0] == 0.5                                   # sizes are not averaged
        assert np.allclose([got.forward, got.backward, got.update, *got.curve[0][1:]],
                           [want.forward, want.backward, want.update, *want.curve[0][1:]])
    assert [x for x, _ in mean.comm.exchange] == [8e3, 64e3]
    assert np.allclose([t for _, t in mean.comm.exchange + mean.comm.allreduce], [3e-3, 9e-3, 15e-3])
    assert mean.step_overhead_at(4) == pytest.approx(3e-3) and mean.microbatch_size == 4
    assert [x for x, _ in mean.stash_copy] == [1e4, 1e5]
    assert np.allclose([t for _, t in mean.stash_copy], [3e-3, 12e-3])
    assert mean_profile([at(1e-3)]) == at(1e-3)
    shorter = dataclasses.replace(at(1e-3), layers=at(1e-3).layers[:2], cut_bytes=None)
    with pytest.raises(ValueError, match="same sizes"):
        mean_profile([at(1e-3), shorter])
    with pytest.raises(ValueError, match="at least one"):
        mean_profile([])


def test_profiler_rounds_average_that_many_measurements(monkeypatch):
    import jax.numpy as jnp

    import jpipe.models
    from jpipe.partition import Profiler, _profile

    model = jpipe.models.mlp(in_dim=4, hidden=16, out_dim=1, num_layers=2)
    profiler = Profiler(model, {"x": jnp.ones((4, 4)), "y": jnp.zeros((4, 1))}, comm=False,
                        microbatch_sizes=[4], warmup=0)
    timed = _profile._timed
    calls = []
    monkeypatch.setattr(_profile, "_timed", lambda *a, **k: calls.append(1) or timed(*a, **k))
    mean = profiler.measure(repeats=1, rounds=3)
    assert len(calls) == 3 and mean.num_layers == 2 and mean.layers[0].forward > 0
    with pytest.raises(ValueError, match="rounds"):
        profiler.measure(rounds=0)


def test_plan_profiles_that_many_rounds(monkeypatch):
    import jax
    import jax.numpy as jnp

    import jpipe
    import jpipe.models
    from jpipe.partition import _profile

    model = jpipe.models.mlp(in_dim=4, hidden=16, out_dim=1, num_layers=4)
    batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 1))}
    timed = _profile._timed
    calls = []
    monkeypatch.setattr(_profile, "_timed", lambda *a, **k: calls.append(1) or timed(*a, **k))
    choice = jpipe.plan(model, batch, devices=jax.devices()[:2], profile_rounds=2)
    assert len(calls) == 2 and choice.plan.pipe * choice.plan.data == 2
    with pytest.raises(ValueError, match="profile_rounds must be >= 1"):
        jpipe.plan(model, batch, devices=jax.devices()[:2], profile_rounds=0)


def test_step_prediction_adds_the_largest_stage_optimizer_step():
    layer = LayerCost("l", 1e-3, 2e-3, 1e3, 1e4, 2e4, update=1e-4)
    io = LayerCost("io", 1e-3, 1e-3, 1e3, 1e4, 2e4, update=3e-4)
    with_update = Profile(layers=(layer,) * 6, microbatch_size=4, pre=io, post=io)
    without = Profile(layers=(layer._replace(update=0.0),) * 6, microbatch_size=4,
                      pre=io._replace(update=0.0), post=io._replace(update=0.0))
    plan = Plan(2, 1, 4, partition=(2, 4))
    extra = evaluate(with_update, plan, 16).step_time - evaluate(without, plan, 16).step_time
    assert extra == pytest.approx(4 * 1e-4 + 2 * 3e-4)   # 4 layers on the larger stage, pre and post on each


def test_step_prediction_adds_the_step_overhead_once_per_step():
    layer = LayerCost("l", 1e-3, 2e-3, 1e3, 1e4, 2e4)
    bare = Profile(layers=(layer,) * 4, microbatch_size=4, pre=layer, post=layer)
    for plan in (Plan(2, 1, 4), Plan(1, 2, 8), Plan(4, 1, 2, schedule="gpipe")):
        extra = evaluate(dataclasses.replace(bare, step_overhead=5e-3), plan, 32).step_time \
            - evaluate(bare, plan, 32).step_time
        assert extra == pytest.approx(5e-3)                        # not per micro-batch, not per stage
    # measured at several micro-batch sizes: read at the plan's (global batch / (data x M))
    growing = dataclasses.replace(bare, step_overhead=((1, 1e-3), (4, 2e-3), (8, 6e-3)))
    for plan, size in ((Plan(2, 1, 4), 8), (Plan(1, 2, 4), 4), (Plan(1, 2, 16), 1), (Plan(2, 1, 16), 2)):
        extra = evaluate(growing, plan, 32).step_time - evaluate(bare, plan, 32).step_time
        assert extra == pytest.approx(growing.step_overhead_at(size))
    assert growing.step_overhead_at(2) == pytest.approx(1e-3 + 1e-3 / 3)   # between the measured sizes


def test_contention_cheapens_only_the_ticks_in_which_some_devices_idle():
    """A profile timed with every device computing, c times slower than one alone: ticks where one of
    two stages computes charge 1/c of the profiled cost; ticks where all do, the profiled cost."""
    layer = LayerCost("l", 1e-3, 2e-3, 1e3, 1e4, 2e4)
    bare = Profile(layers=(layer,) * 4, microbatch_size=4, pre=layer, post=layer)
    crowded = dataclasses.replace(bare, contention=1.6)
    for plan in (Plan(1, 2, 4), Plan(1, 4, 2)):                    # data parallel: every device always computes
        assert evaluate(crowded, plan, 16).step_time == evaluate(bare, plan, 16).step_time
    one_at_a_time = Plan(2, 1, 1, schedule="gpipe")                  # M=1: never more than one device computes
    compute = simulate(one_at_a_time.unvalidated_table(),
                       Costs(*stage_costs(bare.scaled(16), one_at_a_time.stage_partition(4)))).makespan
    saved = evaluate(bare, one_at_a_time, 16).step_time - evaluate(crowded, one_at_a_time, 16).step_time
    assert saved == pytest.approx(compute * (1 - 1 / 1.6))
    for m in (2, 4, 8):                                              # warm-up and cool-down ticks only
        plan = Plan(2, 1, m)
        table = plan.unvalidated_table()
        lonely = sum(1 for t in range(table.num_ticks)
                     if sum(table.action(t, d) is not None for d in range(2)) == 1)
        assert 0 < lonely < table.num_ticks
        assert evaluate(crowded, plan, 16).step_time < evaluate(bare, plan, 16).step_time
    # pipe=2 x data=2: a tick with one stage computing has 2 of 4 devices computing
    assert _contention(1.6, 2, 2) == pytest.approx([(1 + 0.6 / 3) / 1.6, 1.0])
    assert _contention(1.6, 4, 1) == pytest.approx([1 / 1.6, (1 + 0.6 / 3) / 1.6, (1 + 1.2 / 3) / 1.6, 1.0])
    assert _contention(1.0, 4, 1) is None


@pytest.mark.parametrize("contention", [1.0, 1.6])
def test_step_prediction_is_the_sum_of_named_terms(contention):
    """Each term of Candidate.time_terms is what it says, computed here from its own source."""
    layer = LayerCost("l", 1e-3, 2e-3, 1e3, 1e4, 2e4, update=1e-4)
    comm = CommCost.linear(2e-4, 1e-9, 1e-3, 1e-9)
    prof = Profile(layers=(layer,) * 6, microbatch_size=4, pre=layer, post=layer, comm=comm,
                   step_overhead=5e-4, contention=contention)
    plan = Plan(2, 2, 4, partition=(2, 4))
    cand = evaluate(prof, plan, 32)
    terms = cand.time_terms
    assert terms.total == pytest.approx(cand.step_time, rel=1e-12)
    scaled = prof.scaled(32 / (2 * 4))
    fwd, bwd = stage_costs(scaled, plan.stage_partition(6))
    table = plan.unvalidated_table()
    assert terms.compute == pytest.approx(4 * max(f + b for f, b in zip(fwd, bwd)))
    plain = simulate(table, Costs(fwd, bwd), mode="lockstep").makespan
    assert terms.bubble == pytest.approx(plain - terms.compute) and terms.bubble > 0
    assert terms.communication == pytest.approx(table.num_ticks * comm.exchange_time(scaled.layers[0].activation_bytes))
    assert terms.optimizer == pytest.approx(4 * 1e-4 + 2 * 1e-4)   # the larger stage's 4 layers, pre, post
    assert terms.overhead == pytest.approx(5e-4) and terms.allreduce > 0
    if contention == 1.0:
        assert terms.contention == 0.0
    else:   # warm-up and cool-down ticks, where one stage of two computes, run faster than profiled
        assert terms.contention < 0
    choice = search(prof, 4, 32)
    explained = choice.explain(top=2).splitlines()
    assert len(explained) == 6 and explained[1].strip().startswith("time") and "compute" in explained[1]
    assert f"{choice.candidates[0].step_time * 1e3:.2f} ms = compute" in explained[1]


def test_step_prediction_adds_a_stash_copy_per_action_where_a_device_holds_two_microbatches():
    layer = LayerCost("l", 1e-3, 2e-3, 1e3, 1e4, 2e4, 5e3)      # 5 kB of residuals a layer at 4 samples
    bare = Profile(layers=(layer,) * 4, microbatch_size=4, pre=layer, post=layer)
    copying = dataclasses.replace(bare, stash_copy=((1e4, 1e-4), (1e5, 1e-3)))
    for plan in (Plan(2, 1, 4), Plan(2, 1, 4, schedule="gpipe"), Plan(4, 1, 4)):
        assert plan.unvalidated_table().res_depth > 1
        extra = evaluate(copying, plan, 16).step_time - evaluate(bare, plan, 16).step_time
        # every forward and backward copies one slot of the largest stage's residuals (4 / pipe layers),
        # so every tick of the lock-step grows by one copy
        slot = 4 // plan.pipe * 5e3
        assert extra == pytest.approx(plan.unvalidated_table().num_ticks * interpolate(copying.stash_copy, slot))
    # one slot (data parallel, or M=1), or nothing stashed (remat): no copy
    for plan in (Plan(1, 2, 4), Plan(2, 1, 1), Plan(2, 1, 4, remat=True)):
        assert evaluate(copying, plan, 16).step_time == evaluate(bare, plan, 16).step_time


def test_robust_line_ignores_one_wild_point_that_least_squares_follows():
    xs = [8e3, 16e3, 32e3, 64e3, 128e3]
    ys = [2e-4 + 1e-8 * x for x in xs]
    ys[1] = 3.4e-3  # one exchange timed during a hiccup (a real profile on the 2-core machine)
    intercept, slope = robust_line(list(zip(xs, ys)))
    assert intercept == pytest.approx(2e-4) and slope == pytest.approx(1e-8)
    _, ls_intercept = np.polyfit(xs, ys, 1)
    assert abs(ls_intercept - 2e-4) > 5e-4  # what a least-squares line would have read
    with pytest.raises(ValueError, match="two or more distinct x"):
        robust_line([(1.0, 2.0), (1.0, 3.0)])
