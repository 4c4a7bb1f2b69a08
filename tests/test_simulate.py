"""Tests for ``jpipe.schedules.simulate``: lock-step and asynchronous timing, bubbles, memory.

Expectations are closed forms (bubble identities, GPipe's makespan with communication)
or independent re-derivations from the table arrays (tick durations, per-device busy
time, liveness), never the simulator's own intermediate values.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from jpipe.schedules import (
    SCHEDULES,
    Action,
    Costs,
    SimResult,
    Table,
    gpipe,
    one_f_one_b,
    one_f_one_b_policy_b,
    simulate,
    table_from_orders,
)

SIZES = [(1, 1), (1, 4), (2, 1), (2, 3), (3, 7), (4, 2), (4, 4), (4, 8), (4, 16), (5, 12), (8, 16)]
UNIFORM = Costs(forward=1.0, backward=1.0)


def exact(x: float, y: float) -> bool:
    return math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-12)


def kind_name(table: Table, t: int, d: int) -> str | None:
    a = table.action(t, d)
    return None if a is None else a.kind


# ---------------------------------------------------------------------------------------------
# Bubble identities
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize("P,M", SIZES)
@pytest.mark.parametrize("mode", ["lockstep", "async"])
def test_uniform_bubble_is_exact(make, P: int, M: int, mode: str) -> None:
    """F = B, W = 0, no communication: bubble (P-1)/(M+P-1), makespan 2(M+P-1) F's."""
    r = simulate(make(P, M), UNIFORM, mode=mode)
    assert exact(r.makespan, 2 * (M + P - 1))
    assert exact(r.bubble_fraction, (P - 1) / (M + P - 1))
    np.testing.assert_allclose(r.busy, 2.0 * M)
    np.testing.assert_allclose(r.idle, 2.0 * (P - 1))


@pytest.mark.parametrize("P,M", [(2, 3), (4, 8), (5, 12)])
def test_async_one_f_one_b_with_heavier_backward(P: int, M: int) -> None:
    """Asynchronously 1F1B keeps its bubble (P-1)/(M+P-1) for any F and B: makespan (M+P-1)(F+B)."""
    r = simulate(one_f_one_b(P, M), Costs(forward=1.0, backward=2.0), mode="async")
    assert exact(r.makespan, 3 * (M + P - 1))
    assert exact(r.bubble_fraction, (P - 1) / (M + P - 1))


@pytest.mark.parametrize("make", [gpipe, one_f_one_b, one_f_one_b_policy_b], ids=["gpipe", "1f1b", "1f1b-b"])
@pytest.mark.parametrize("P,M", [(2, 3), (4, 8), (3, 7)])
def test_lockstep_tick_lasts_its_slowest_action_plus_comm(make, P: int, M: int) -> None:
    """Per-stage costs with B = 2F: every tick lasts max over devices of its action, plus comm."""
    table = make(P, M)
    fwd = np.array([1.0, 1.5, 0.5, 2.0, 1.0][:P] + [1.0] * max(0, P - 5))
    comm = 0.25
    r = simulate(table, Costs(forward=fwd, backward=2 * fwd, comm=comm))
    cost = {"F": fwd, "B": 2 * fwd}
    expected, now = 0.0, 0.0
    for t in range(table.num_ticks):
        durations = [cost[k][d] for d in range(P) if (k := kind_name(table, t, d)) is not None]
        for d in range(P):
            a = table.action(t, d)
            if a is not None:
                assert exact(r.start[a], now) and exact(r.end[a], now + cost[a.kind][d])
        now += max(durations) + comm
    expected = now
    assert exact(r.makespan, expected)
    np.testing.assert_allclose(r.busy, 3 * M * fwd)
    assert exact(r.bubble_fraction, 1 - 3 * M * fwd.sum() / (P * expected))
    assert r.mode == "lockstep"


@pytest.mark.parametrize("make", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize("P,M", [(2, 1), (2, 4), (4, 8)])
def test_lockstep_contention_scales_a_tick_by_how_many_devices_compute(make, P: int, M: int) -> None:
    """Each tick's actions are scaled by contention[k - 1], k = the devices with an action in it,
    re-derived from the table's cells; all-ones contention changes nothing."""
    table = make(P, M)
    contention = np.linspace(0.5, 1.0, P)  # alone: half the profiled cost; all computing: as profiled
    costs = Costs(forward=1.0, backward=2.0, comm=0.25)
    plain = simulate(table, costs)
    assert simulate(table, costs._replace(contention=[1.0] * P)).makespan == plain.makespan
    r = simulate(table, costs._replace(contention=contention))
    expected = 0.0
    for t in range(table.num_ticks):
        kinds = [k for d in range(P) if (k := kind_name(table, t, d)) is not None]
        scale = contention[len(kinds) - 1]
        expected += max({"F": 1.0, "B": 2.0}[k] for k in kinds) * scale + 0.25
    assert exact(r.makespan, expected)
    if M == 1:  # one device computes at a time: every action at half its cost
        assert exact(r.makespan, 0.5 * (plain.makespan - 0.25 * table.num_ticks) + 0.25 * table.num_ticks)
    assert r.makespan < plain.makespan


def test_contention_errors() -> None:
    t = one_f_one_b(2, 4)
    with pytest.raises(ValueError, match=r"one positive factor per number of devices computing at once \(1..2\)"):
        simulate(t, Costs(1.0, 1.0, contention=[0.5, 0.7, 1.0]))
    with pytest.raises(ValueError, match=r"one positive factor"):
        simulate(t, Costs(1.0, 1.0, contention=[0.0, 1.0]))
    with pytest.raises(ValueError, match=r"Costs.contention is a lock-step model"):
        simulate(t, Costs(1.0, 1.0, contention=[0.5, 1.0]), mode="async")


@pytest.mark.parametrize("P,M", [(2, 3), (4, 8)])
def test_lockstep_is_never_faster_than_async(P: int, M: int) -> None:
    for name in ("gpipe", "1f1b", "1f1b-b"):
        table = SCHEDULES[name](P, M)
        costs = Costs(forward=1.0, backward=2.0, comm=0.1)
        lock, asy = simulate(table, costs), simulate(table, costs, mode="async")
        assert asy.makespan <= lock.makespan + 1e-12
        np.testing.assert_allclose(asy.busy, lock.busy)


@pytest.mark.parametrize("P,M", [(2, 1), (3, 5), (4, 8)])
def test_async_gpipe_with_communication(P: int, M: int) -> None:
    """GPipe, F = B = 1, comm c per hop: 2M + 2(P-1)(1+c) (the fill and the drain each pay P-1 hops)."""
    c = 0.3
    r = simulate(gpipe(P, M), Costs(1.0, 1.0, comm=c), mode="async")
    assert exact(r.makespan, 2 * M + 2 * (P - 1) * (1 + c))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "1f1b-b"])
def test_async_starts_are_tight(name: str) -> None:
    """Each action starts at the later of its device being free and its inputs arriving, no later."""
    P, M, comm = 4, 6, 0.2
    table = SCHEDULES[name](P, M)
    fwd = np.array([1.0, 0.7, 1.3, 0.9])
    r = simulate(table, Costs(fwd, 2 * fwd, comm=comm), mode="async")
    for d, order in enumerate(table.orders()):
        prev_end = 0.0
        for a in order:
            deps = []
            if a.kind == "F" and a.stage > 0:
                deps.append(Action("F", a.microbatch, a.stage - 1))
            if a.kind == "B":
                deps.append(Action("F", a.microbatch, a.stage))
                if a.stage < P - 1:
                    deps.append(Action("B", a.microbatch, a.stage + 1))
            arrivals = [r.end[x] + (comm if x.stage != a.stage else 0.0) for x in deps]
            assert exact(r.start[a], max([prev_end] + arrivals)), a
            assert exact(r.end[a] - r.start[a], (fwd if a.kind == "F" else 2 * fwd)[d])
            prev_end = r.end[a]
    assert exact(r.makespan, max(r.end.values()))


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("P,M", SIZES)
def test_peak_held(P: int, M: int) -> None:
    """GPipe holds M on every device, 1F1B min(S - s, M) on stage s; both modes agree with the table."""
    for mode in ("lockstep", "async"):
        g = simulate(gpipe(P, M), UNIFORM, mode=mode)
        assert g.peak_held.tolist() == [M] * P
        o = simulate(one_f_one_b(P, M), UNIFORM, mode=mode)
        assert o.peak_held.tolist() == [min(P - s, M) for s in range(P)]
        assert o.peak_held.tolist() == one_f_one_b(P, M).held_microbatches().tolist()


def test_peak_bytes_weighs_held_stages() -> None:
    P, M = 4, 8
    act = np.array([10.0, 20.0, 30.0, 40.0])
    r = simulate(one_f_one_b(P, M), Costs(1.0, 1.0, activation_bytes=act))
    np.testing.assert_allclose(r.peak_bytes, act * np.array([4, 3, 2, 1]))
    assert simulate(one_f_one_b(P, M), UNIFORM).peak_bytes is None
    r = simulate(gpipe(P, M), Costs(1.0, 1.0, activation_bytes=1024))
    np.testing.assert_allclose(r.peak_bytes, 1024.0 * M)


# ---------------------------------------------------------------------------------------------
# Costs and errors
# ---------------------------------------------------------------------------------------------


def test_weight_is_charged_to_unsplit_backward() -> None:
    """Without W actions, B computes both gradients: it costs backward + weight."""
    a = simulate(one_f_one_b(4, 8), Costs(1.0, 1.0, weight=1.0), mode="async")
    b = simulate(one_f_one_b(4, 8), Costs(1.0, 2.0), mode="async")
    assert exact(a.makespan, b.makespan)
    np.testing.assert_allclose(a.busy, 24.0)


def test_single_device_has_no_comm_and_no_bubble() -> None:
    r = simulate(one_f_one_b(1, 5), Costs(1.0, 2.0, comm=7.0))
    assert exact(r.makespan, 15.0) and exact(r.bubble_fraction, 0.0)


def test_result_is_a_named_tuple() -> None:
    r = simulate(gpipe(2, 2), UNIFORM)
    assert isinstance(r, SimResult) and isinstance(r, tuple)
    assert set(r.start) == set(r.end) == {a for order in gpipe(2, 2).orders() for a in order}
    assert all(r.end[a] >= r.start[a] for a in r.start)


def test_cost_errors() -> None:
    t = one_f_one_b(4, 8)
    with pytest.raises(ValueError, match=r"Costs.forward has 3 values but the table has 4 virtual stages"):
        simulate(t, Costs([1.0, 1.0, 1.0], 1.0))
    with pytest.raises(ValueError, match=r"Costs.backward must be finite and non-negative"):
        simulate(t, Costs(1.0, -1.0))
    with pytest.raises(ValueError, match=r"Costs.comm must be finite and non-negative"):
        simulate(t, Costs(1.0, 1.0, comm=float("nan")))
    with pytest.raises(ValueError, match=r"unknown simulation mode 'mpmd'; choose 'lockstep' or 'async'"):
        simulate(t, UNIFORM, mode="mpmd")
    with pytest.raises(TypeError, match=r"costs must be a jpipe.schedules.Costs"):
        simulate(t, (1.0, 1.0))  # type: ignore[arg-type]


def test_custom_orders_simulate() -> None:
    """A hand-written table: device 1 runs F0 B0 F1 B1, device 0 both forwards first."""
    orders = [[Action("F", 0, 0), Action("F", 1, 0), Action("B", 0, 0), Action("B", 1, 0)],
              [Action("F", 0, 1), Action("B", 0, 1), Action("F", 1, 1), Action("B", 1, 1)]]
    r = simulate(table_from_orders(orders, 2), Costs(1.0, 2.0), mode="async")
    # d1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]; d0: F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]
    assert r.end[Action("B", 1, 0)] == 9.0 and r.start[Action("B", 0, 0)] == 4.0


# ---------------------------------------------------------------------------------------------
# Interleaved and split-backward tables
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("P,M,v", [(2, 2, 2), (2, 5, 2), (4, 4, 2), (4, 8, 2), (4, 16, 2), (4, 6, 3),
                                   (4, 8, 4), (8, 16, 2), (3, 7, 3)])
def test_interleaved_uniform_bubble_is_exact(P: int, M: int, v: int) -> None:
    """Per-chunk costs F / v (a device's v chunks together cost what its stage did): (P-1)/(vM+P-1)."""
    from jpipe.schedules import interleaved_1f1b
    r = simulate(interleaved_1f1b(P, M, num_chunks=v), Costs(forward=1.0 / v, backward=1.0 / v))
    assert exact(r.bubble_fraction, (P - 1) / (v * M + P - 1))
    assert exact(r.makespan, 2 * (v * M + P - 1) / v)
    np.testing.assert_allclose(r.busy, 2.0 * M)


def test_split_backward_charges_b_and_w_separately() -> None:
    from jpipe.schedules import zb_h1
    t = zb_h1(4, 8)
    r = simulate(t, Costs(forward=1.0, backward=2.0, weight=0.5), mode="async")
    np.testing.assert_allclose(r.busy, 8 * (1.0 + 2.0 + 0.5))
    for a in r.start:
        assert exact(r.end[a] - r.start[a], {"F": 1.0, "B": 2.0, "W": 0.5}[a.kind])
        if a.kind == "W":  # W waits for its own B, on the same device
            assert r.start[a] >= r.end[Action("B", a.microbatch, a.stage)]
    # weight=None: W is free and B carries all the backward time.
    r0 = simulate(t, Costs(forward=1.0, backward=2.0))
    assert all(r0.end[a] == r0.start[a] for a in r0.start if a.kind == "W")


@pytest.mark.parametrize("P,M", [(2, 3), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_peak_held(P: int, M: int) -> None:
    """A micro-batch is held until its W: ZB-H1 <= P, ZB-H2 <= 2P - 1; both modes agree with the table."""
    from jpipe.schedules import zb_h1, zb_h2
    for make, bound in ((zb_h1, P), (zb_h2, 2 * P - 1)):
        t = make(P, M)
        for mode in ("lockstep", "async"):
            r = simulate(t, Costs(1.0, 1.0, 1.0), mode=mode)
            assert r.peak_held.tolist() == t.held_microbatches().tolist()
            assert r.peak_held.max() <= min(bound, M)


def test_zb_h1_acceptance_bubble() -> None:
    """F = B = W, P = 4, M = 8: ZB-H1's lock-step bubble is <= 0.4 x 1F1B's (1F1B's B costs B + W)."""
    from jpipe.schedules import zb_h1
    costs = Costs(1.0, 1.0, 1.0)
    zb, f1b = simulate(zb_h1(4, 8), costs), simulate(one_f_one_b(4, 8), costs)
    assert zb.bubble_fraction <= 0.4 * f1b.bubble_fraction
    assert exact(zb.bubble_fraction, 3 / 27)
