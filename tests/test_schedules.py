"""Tests for ``jpipe.schedules``: generators, lock-step timing, slot assignment, validator, rendering.

Everything here is plain numpy; no JAX tracing happens. Expectations are computed
independently of the package (closed-form orders, an independent ASAP timer, an
independent liveness count) and every negative test first checks that the
unedited table validates, so that the error is caused by the edit alone.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np
import pytest

from jpipe.schedules import (
    BACKWARD,
    FIELDS,
    FORWARD,
    IDLE,
    NO_SLOT,
    SCHEDULES,
    Action,
    ScheduleError,
    Table,
    ascii_gantt,
    early_backward,
    fuse_ticks,
    get_schedule,
    gpipe,
    one_f_one_b,
    one_f_one_b_policy_b,
    table_from_orders,
    validate,
)

Generator = Callable[[int, int], Table]

# (P, M): M < P, M == P, M not a multiple of P, P == 1, M == 1, and the larger P=8, M=16.
SIZES = [
    (1, 1), (1, 4), (2, 1), (2, 2), (2, 3), (3, 2), (3, 7), (4, 2), (4, 4),
    (4, 6), (4, 8), (5, 3), (5, 12), (8, 5), (8, 16),
]
GENERATORS: dict[str, Generator] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "1f1b-b": one_f_one_b_policy_b,
}


def warmup(name: str, P: int, M: int, s: int) -> int:
    """The number of forwards device ``s`` runs before its first backward, by definition."""
    if name == "gpipe":
        return M
    if name == "1f1b":
        return min(P - s, M)
    return min(2 * (P - s) - 1, M)


def expected_order(name: str, P: int, M: int, s: int) -> list[str]:
    """Early-backward order: K forwards, then alternating B/F, then the remaining K backwards."""
    k = warmup(name, P, M, s)
    kinds = "F" * k + "BF" * (M - k) + "B" * k
    nxt = {"F": 0, "B": 0}
    out = []
    for kind in kinds:
        out.append(f"{kind}{nxt[kind]}")
        nxt[kind] += 1
    return out


def action_ticks(table: Table) -> dict[tuple[str, int, int], list[int]]:
    """``(kind, microbatch, stage) -> ticks`` read straight from the table arrays."""
    out: dict[tuple[str, int, int], list[int]] = {}
    for t in range(table.num_ticks):
        for d in range(table.num_devices):
            kind = int(table.kind[t, d])
            if kind == IDLE:
                continue
            stage = int(table.chunk[t, d]) * table.num_devices + d
            key = ("F" if kind == FORWARD else "B", int(table.microbatch[t, d]), stage)
            out.setdefault(key, []).append(t)
    return out


def tick_of(table: Table, kind: str, mb: int, stage: int) -> int:
    (t,) = action_ticks(table)[(kind, mb, stage)]
    return t


def asap_ticks(orders: list[list[Action]], num_stages: int) -> dict[tuple[str, int, int], int]:
    """Independent lock-step timer: each action at max(previous on its device, its inputs) + 1."""
    done: dict[tuple[str, int, int], int] = {}
    pos = [0] * len(orders)
    last = [-1] * len(orders)
    progress = True
    while progress:
        progress = False
        for d, order in enumerate(orders):
            while pos[d] < len(order):
                a = order[pos[d]]
                if a.kind == "F":
                    deps = [("F", a.microbatch, a.stage - 1)] if a.stage > 0 else []
                else:
                    deps = [("F", a.microbatch, a.stage)]
                    if a.stage < num_stages - 1:
                        deps.append(("B", a.microbatch, a.stage + 1))
                if any(dep not in done for dep in deps):
                    break
                t = max([last[d]] + [done[dep] for dep in deps]) + 1
                done[(a.kind, a.microbatch, a.stage)] = last[d] = t
                pos[d] += 1
                progress = True
    assert all(p == len(o) for p, o in zip(pos, orders)), "reference timer deadlocked"
    return done


def peak_liveness(table: Table) -> tuple[int, int, int]:
    """Independent peak of live (in, res, cot) entries on any device, in half-tick phases.

    Phase ``2t`` is the compute of tick ``t`` and ``2t + 1`` the arrivals at its end. An
    input is live from its arrival to its backward, a residual from forward to backward,
    a cotangent from its arrival (or the last stage's forward) to its backward.
    """
    P, S, M = table.num_devices, table.num_stages, table.num_microbatches
    ticks = {key: ts[0] for key, ts in action_ticks(table).items()}
    phases = 2 * table.num_ticks + 2
    live = {buf: np.zeros((P, phases), dtype=int) for buf in ("in", "res", "cot")}
    for mb in range(M):
        for k in range(S):
            d, f, b = k % P, ticks[("F", mb, k)], ticks[("B", mb, k)]
            if k > 0:
                live["in"][d, 2 * ticks[("F", mb, k - 1)] + 1: 2 * b + 1] += 1
            live["res"][d, 2 * f: 2 * b + 1] += 1
            start = 2 * ticks[("B", mb, k + 1)] + 1 if k < S - 1 else 2 * f
            live["cot"][d, start: 2 * b + 1] += 1
    return tuple(int(live[buf].max()) for buf in ("in", "res", "cot"))  # type: ignore[return-value]


def edit(table: Table, **changes: dict[tuple[int, int], int]) -> Table:
    """A copy of ``table`` with ``field={(tick, device): value}`` cells changed; the original is untouched."""
    arrays = {}
    for field, cells in changes.items():
        arr = np.array(getattr(table, field), copy=True)
        for (t, d), value in cells.items():
            arr[t, d] = value
        arrays[field] = arr
    return dataclasses.replace(table, **arrays)


def move(table: Table, device: int, src: int, dst: int) -> Table:
    """Moves the action (kind, micro-batch, chunk, slots) on ``device`` from tick ``src`` to ``dst``."""
    assert table.kind[dst, device] == IDLE, "destination must be idle"
    fields = ("kind", "microbatch", "chunk", "in_slot", "res_slot", "cot_slot")
    idle = {"kind": IDLE, "microbatch": 0, "chunk": 0}
    return edit(table, **{
        f: {(dst, device): int(getattr(table, f)[src, device]), (src, device): idle.get(f, NO_SLOT)}
        for f in fields
    })


def orders_str(table: Table) -> list[list[str]]:
    return [[str(a) for a in order] for order in table.orders()]


# ---------------------------------------------------------------------------------------------
# 1. Generators
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(GENERATORS))
@pytest.mark.parametrize("P,M", SIZES)
def test_generator_validates_and_runs_every_action_once(name: str, P: int, M: int) -> None:
    """Every generated table validates and runs F and B of every (micro-batch, stage) exactly once."""
    table = GENERATORS[name](P, M)
    assert validate(table) is table
    assert (table.name, table.num_devices, table.num_chunks, table.num_microbatches) == (name, P, 1, M)
    ticks = action_ticks(table)
    expected = {(kind, mb, k) for kind in "FB" for mb in range(M) for k in range(P)}
    assert set(ticks) == expected
    assert all(len(ts) == 1 for ts in ticks.values()), {k: v for k, v in ticks.items() if len(v) > 1}
    assert int((table.kind != IDLE).sum()) == 2 * M * P
    assert set(np.unique(table.kind)) <= {IDLE, FORWARD, BACKWARD}


@pytest.mark.parametrize("name", list(GENERATORS))
@pytest.mark.parametrize("P,M", SIZES)
def test_generator_per_device_order_matches_definition(name: str, P: int, M: int) -> None:
    """Per-device orders follow the warm-up / steady / drain definition of each schedule."""
    table = GENERATORS[name](P, M)
    for s, order in enumerate(table.orders()):
        assert all(a.stage == s for a in order)
        assert [str(a) for a in order] == expected_order(name, P, M, s), f"device {s}"


def test_one_f_one_b_orders_literal() -> None:
    """DAPPLE policy A, P=4, M=8, spelled out for the first and last device."""
    orders = orders_str(one_f_one_b(4, 8))
    assert orders[0] == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "F6", "B3", "F7", "B4", "B5", "B6", "B7"]
    assert orders[1] == ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "F5", "B3", "F6", "B4", "F7", "B5", "B6", "B7"]
    assert orders[3] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5", "F6", "B6", "F7", "B7"]


def test_policy_b_orders_literal() -> None:
    """DAPPLE policy B, P=4, M=8: warm-ups 7, 5, 3, 1."""
    orders = orders_str(one_f_one_b_policy_b(4, 8))
    assert orders[0] == ["F0", "F1", "F2", "F3", "F4", "F5", "F6", "B0", "F7", "B1", "B2", "B3", "B4", "B5", "B6", "B7"]
    assert orders[2] == ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "F5", "B3", "F6", "B4", "F7", "B5", "B6", "B7"]
    assert orders[3] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5", "F6", "B6", "F7", "B7"]


@pytest.mark.parametrize("name", list(GENERATORS))
@pytest.mark.parametrize("P,M", SIZES)
def test_held_microbatches(name: str, P: int, M: int) -> None:
    """Peak in-flight micro-batches per device: min(warm-up, M) for 1F1B, M for GPipe."""
    table = GENERATORS[name](P, M)
    held = table.held_microbatches()
    assert held.tolist() == [warmup(name, P, M, s) for s in range(P)]
    # Residuals live from forward to backward, so the residual buffer is exactly the peak held.
    assert table.res_depth == int(held.max())


def test_held_microbatches_literal() -> None:
    assert one_f_one_b(4, 8).held_microbatches().tolist() == [4, 3, 2, 1]
    assert one_f_one_b_policy_b(4, 8).held_microbatches().tolist() == [7, 5, 3, 1]
    assert one_f_one_b_policy_b(4, 6).held_microbatches().tolist() == [6, 5, 3, 1]
    assert one_f_one_b(4, 2).held_microbatches().tolist() == [2, 2, 2, 1]
    assert gpipe(3, 5).held_microbatches().tolist() == [5, 5, 5]


@pytest.mark.parametrize("name", ["1f1b", "1f1b-b"])
@pytest.mark.parametrize("P", [2, 4, 8])
def test_1f1b_buffer_depths_do_not_grow_with_m(name: str, P: int) -> None:
    """1F1B buffers are bounded by the pipeline depth, not by the number of micro-batches."""
    small, large = GENERATORS[name](P, 2 * P), GENERATORS[name](P, 64)
    depths = lambda t: (t.in_depth, t.res_depth, t.cot_depth)
    assert depths(small) == depths(large)
    assert max(depths(large)) <= 2 * P
    assert large.cot_depth == 1  # a cotangent is consumed in the tick after it arrives


def test_1f1b_buffer_depths_literal() -> None:
    """Depths of P=4 tables are the same for M=8 and M=64 and match the liveness worked out by hand."""
    for M in (8, 64):
        a, b = one_f_one_b(4, M), one_f_one_b_policy_b(4, M)
        # Device 1 holds the inputs of the 4 micro-batches device 0 sends before its first backward.
        assert (a.in_depth, a.res_depth, a.cot_depth) == (4, 4, 1)
        assert (b.in_depth, b.res_depth, b.cot_depth) == (6, 7, 1)


@pytest.mark.parametrize("P", [2, 4])
def test_gpipe_buffer_depths_grow_with_m(P: int) -> None:
    """GPipe holds every micro-batch at once, so every buffer is M deep."""
    for M in (8, 64):
        t = gpipe(P, M)
        assert (t.in_depth, t.res_depth, t.cot_depth) == (M, M, M)


@pytest.mark.parametrize("name", list(GENERATORS))
@pytest.mark.parametrize("P,M", SIZES + [(4, 64)])
def test_slot_depth_equals_peak_liveness(name: str, P: int, M: int) -> None:
    """Slot assignment is tight: each buffer is exactly as deep as its peak number of live entries."""
    table = GENERATORS[name](P, M)
    assert (table.in_depth, table.res_depth, table.cot_depth) == peak_liveness(table)


@pytest.mark.parametrize("name", list(GENERATORS))
@pytest.mark.parametrize("P,M", SIZES)
def test_num_ticks_balanced_unit_costs(name: str, P: int, M: int) -> None:
    """With unit F and B costs the lock-step makespan is 2(M + P - 1) for all three schedules."""
    assert GENERATORS[name](P, M).num_ticks == 2 * (M + P - 1)


@pytest.mark.parametrize("name", list(GENERATORS))
@pytest.mark.parametrize("P,M", SIZES)
def test_lockstep_timing_is_asap(name: str, P: int, M: int) -> None:
    """Every action runs at the first tick its device is free and its inputs have arrived."""
    table = GENERATORS[name](P, M)
    expected = asap_ticks(table.orders(), table.num_stages)
    assert {key: ts[0] for key, ts in action_ticks(table).items()} == expected


@pytest.mark.parametrize("name", list(GENERATORS))
@pytest.mark.parametrize("P,M", [(1, 3), (3, 7), (4, 8)])
def test_orders_round_trip(name: str, P: int, M: int) -> None:
    """Re-timing a table's own orders reproduces it array for array."""
    table = GENERATORS[name](P, M)
    again = table_from_orders(table.orders(), M, name=table.name)
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(again, field), getattr(table, field), err_msg=field)


def test_one_f_one_b_timing_literal() -> None:
    """1F1B, P=2, M=3, timed by hand: device 0 waits one tick for each cotangent in the drain."""
    t = one_f_one_b(2, 3)
    assert t.kind.T.tolist() == [
        [FORWARD, FORWARD, IDLE, BACKWARD, FORWARD, BACKWARD, IDLE, BACKWARD],
        [IDLE, FORWARD, BACKWARD, FORWARD, BACKWARD, FORWARD, BACKWARD, IDLE],
    ]
    assert t.microbatch.T.tolist() == [[0, 1, 0, 0, 2, 1, 0, 2], [0, 0, 0, 1, 1, 2, 2, 0]]


def test_early_backward_extremes() -> None:
    """A warm-up >= M is GPipe; a warm-up of 0 is clamped to 1 (strict alternation)."""
    big = early_backward(3, 5, lambda s: 100, "big")
    assert orders_str(big) == orders_str(gpipe(3, 5))
    zero = validate(early_backward(3, 4, lambda s: 0, "zero"))
    assert all(o == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"] for o in orders_str(zero))
    assert zero.held_microbatches().tolist() == [1, 1, 1]


def test_get_schedule() -> None:
    assert get_schedule("gpipe") is gpipe
    assert get_schedule("1f1b") is one_f_one_b
    assert get_schedule("1f1b-b") is one_f_one_b_policy_b
    assert {"gpipe", "1f1b", "1f1b-b"} <= set(SCHEDULES)
    assert all(get_schedule(name) is fn for name, fn in SCHEDULES.items())
    with pytest.raises(ValueError, match=r"unknown schedule 'zb'.*\['1f1b', '1f1b-b', .*'gpipe'"):
        get_schedule("zb")


def test_table_structure() -> None:
    """Idle cells carry no slots; stage 0 reads the batch; as_array stacks FIELDS in order."""
    for table in (one_f_one_b(4, 8), gpipe(3, 4), one_f_one_b_policy_b(4, 6), fuse_ticks(one_f_one_b(4, 8))):
        idle = table.kind == IDLE
        for field in ("in_slot", "res_slot", "cot_slot"):
            assert (getattr(table, field)[idle] == NO_SLOT).all(), field
        assert (table.in_slot[:, 0] == NO_SLOT).all()  # stage 0 (device 0) never reads an input slot
        assert (table.recv_in_slot[:, 0] == NO_SLOT).all()  # nothing flows into device 0
        assert (table.recv_cot_slot[:, -1] == NO_SLOT).all()  # nothing flows back into the last device
        fwd = table.kind == FORWARD
        assert (table.cot_slot[:, :-1][fwd[:, :-1]] == NO_SLOT).all()  # only the last stage's F writes cot
        assert (table.cot_slot[:, -1][fwd[:, -1]] != NO_SLOT).all()
        arr = table.as_array()
        assert arr.shape == (table.num_ticks, table.lanes, table.num_devices, len(FIELDS))
        assert arr.dtype == np.int32 and table.num_rows == table.num_ticks * table.lanes
        for i, field in enumerate(FIELDS):
            np.testing.assert_array_equal(arr[..., i].reshape(table.num_rows, -1), getattr(table, field))


# ---------------------------------------------------------------------------------------------
# 2. Dependency timing
# ---------------------------------------------------------------------------------------------


def interleaved_orders(P: int, V: int, M: int) -> list[list[Action]]:
    """A chunked GPipe order (all forwards chunk by chunk, then all backwards in reverse)."""
    orders = []
    for d in range(P):
        fwd = [Action("F", mb, c * P + d) for c in range(V) for mb in range(M)]
        bwd = [Action("B", mb, c * P + d) for c in reversed(range(V)) for mb in range(M)]
        orders.append(fwd + bwd)
    return orders


def all_tables() -> list[Table]:
    tables = [g(P, M) for g in GENERATORS.values() for P, M in SIZES]
    tables += [table_from_orders(interleaved_orders(P, V, M), M, num_chunks=V, name="interleaved")
               for P, V, M in [(2, 2, 2), (2, 2, 3), (1, 3, 2), (4, 2, 4)]]
    return tables


def test_dependencies_run_strictly_earlier() -> None:
    """F(mb, k) after F(mb, k-1); B(mb, k) after B(mb, k+1) and after F(mb, k); one action per cell."""
    for table in all_tables():
        ticks = {key: ts[0] for key, ts in action_ticks(table).items()}
        S = table.num_stages
        for mb in range(table.num_microbatches):
            for k in range(S):
                if k > 0:
                    assert ticks[("F", mb, k)] > ticks[("F", mb, k - 1)], (table, mb, k)
                if k < S - 1:
                    assert ticks[("B", mb, k)] > ticks[("B", mb, k + 1)], (table, mb, k)
                assert ticks[("B", mb, k)] > ticks[("F", mb, k)], (table, mb, k)


def test_interleaved_tables_validate() -> None:
    """Chunked orders (activations wrap from the last device to device 0) time and validate."""
    for P, V, M in [(2, 2, 2), (2, 2, 3), (1, 3, 2), (4, 2, 4)]:
        table = validate(table_from_orders(interleaved_orders(P, V, M), M, num_chunks=V))
        assert table.num_stages == P * V
        assert {(k, mb, s) for (k, mb, s) in action_ticks(table)} == {
            (kind, mb, s) for kind in "FB" for mb in range(M) for s in range(P * V)}
        expected = asap_ticks(table.orders(), table.num_stages)
        assert {key: ts[0] for key, ts in action_ticks(table).items()} == expected
        assert (table.in_depth, table.res_depth, table.cot_depth) == peak_liveness(table)


# ---------------------------------------------------------------------------------------------
# 3. Errors: table_from_orders and validate
# ---------------------------------------------------------------------------------------------


def test_deadlock_names_what_each_device_waits_for() -> None:
    """Device 0 wants B1 before F1: both devices stall at tick 3 and the message says on what."""
    orders = [
        [Action("F", 0, 0), Action("B", 1, 0), Action("F", 1, 0), Action("B", 0, 0)],
        [Action("F", 0, 1), Action("B", 0, 1), Action("F", 1, 1), Action("B", 1, 1)],
    ]
    msg = (r"schedule 'stuck' deadlocks at tick 3: "
           r"device 0 waits to run B1 \(needs F1 of stage 0, B1 of stage 1\); "
           r"device 1 waits to run F1 \(needs F1 of stage 0\)")
    with pytest.raises(ScheduleError, match=msg):
        table_from_orders(orders, 2, name="stuck")


def test_deadlock_at_tick_zero() -> None:
    orders = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 0, 1), Action("B", 0, 1)]]
    msg = (r"deadlocks at tick 0: device 0 waits to run B0 "
           r"\(needs F0 of stage 0, B0 of stage 1\); device 1 waits to run F0")
    with pytest.raises(ScheduleError, match=msg):
        table_from_orders(orders, 1)


def _two_device_orders() -> list[list[Action]]:
    return [[Action("F", 0, 0), Action("F", 1, 0), Action("B", 0, 0), Action("B", 1, 0)],
            [Action("F", 0, 1), Action("B", 0, 1), Action("F", 1, 1), Action("B", 1, 1)]]


def test_orders_errors() -> None:
    """Malformed orders are rejected before timing, naming the device and the action."""
    good = _two_device_orders()
    validate(table_from_orders(good, 2))
    bad = _two_device_orders()
    bad[0][1] = Action("F", 5, 0)
    with pytest.raises(ScheduleError, match=r"device 0: F5 names micro-batch 5, outside 0\.\.1"):
        table_from_orders(bad, 2)
    bad = _two_device_orders()
    bad[0][0] = Action("F", 0, 1)  # stage 1 lives on device 1
    with pytest.raises(ScheduleError, match=r"device 0: F0 names stage 1, which lives on device 1"):
        table_from_orders(bad, 2)
    bad = _two_device_orders()
    bad[1][2] = Action("F", 0, 1)
    with pytest.raises(ScheduleError, match=r"device 1: F0 appears twice"):
        table_from_orders(bad, 2)
    bad = _two_device_orders()
    del bad[0][3]
    with pytest.raises(ScheduleError, match=r"1 actions are missing, e\.g\. B of micro-batch 1 on stage 0 "
                                            r"\(device 0\)"):
        table_from_orders(bad, 2)
    bad = _two_device_orders()
    bad[0][0] = Action("X", 0, 0)
    with pytest.raises(ScheduleError, match=r"device 0: unknown action kind 'X'"):
        table_from_orders(bad, 2)
    with pytest.raises(ScheduleError, match=r"at least one device"):
        table_from_orders([], 1)
    with pytest.raises(TypeError, match=r"expected an Action"):
        table_from_orders([["F0"]], 1)  # type: ignore[list-item]
    # Plain (kind, microbatch, stage) tuples are accepted.
    tuples = [[tuple(a) for a in order] for order in good]
    from_tuples = table_from_orders(tuples, 2)  # type: ignore[arg-type]
    assert orders_str(from_tuples) == orders_str(table_from_orders(good, 2))


@pytest.fixture
def f1b() -> Table:
    """1F1B, P=2, M=2 (d0: F0 F1 . B0 . B1 / d1: . F0 B0 F1 B1 .), checked to validate."""
    t = one_f_one_b(2, 2)
    assert orders_str(t) == [["F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]]
    return validate(t)


@pytest.fixture
def gp() -> Table:
    """GPipe, P=2, M=3, checked to validate."""
    return validate(gpipe(2, 3))


def test_edit_helper_copies(f1b: Table) -> None:
    """The edits below change a copy; the generated table stays valid."""
    before = f1b.kind.copy()
    edited = edit(f1b, kind={(0, 0): IDLE})
    assert edited.kind[0, 0] == IDLE and f1b.kind[0, 0] == FORWARD
    np.testing.assert_array_equal(f1b.kind, before)
    validate(f1b)


def test_backward_before_its_cotangent_arrives(f1b: Table) -> None:
    """B0 on device 0 moved one tick earlier reads its cotangent slot before the arrival fills it."""
    b = tick_of(f1b, "B", 0, 0)
    bad = move(f1b, 0, b, b - 1)
    slot = int(f1b.cot_slot[b, 0])
    with pytest.raises(ScheduleError, match=rf"tick {b - 1}, device 0, micro-batch 0: B0 of stage 0 reads "
                                            rf"cot slot {slot} before anything is written"):
        validate(bad)


def test_forward_before_its_input_arrives(f1b: Table) -> None:
    """F1 on device 1 moved to tick 0 reads an input slot that is still empty."""
    f = tick_of(f1b, "F", 1, 1)
    bad = move(f1b, 1, f, 0)
    with pytest.raises(ScheduleError, match=r"tick 0, device 1, micro-batch 1: F1 of stage 1 reads in slot "
                                            r"\d+ before anything is written"):
        validate(bad)


def test_backward_before_its_forward(f1b: Table) -> None:
    """Swapping F0 and B0 on the last device: B0 runs before its forward."""
    f, b = tick_of(f1b, "F", 0, 1), tick_of(f1b, "B", 0, 1)
    cells = {field: {(f, 1): int(getattr(f1b, field)[b, 1]), (b, 1): int(getattr(f1b, field)[f, 1])}
             for field in ("kind", "microbatch", "chunk", "in_slot", "res_slot", "cot_slot")}
    with pytest.raises(ScheduleError, match=rf"tick {f}, device 1, micro-batch 0: B0 of stage 1 runs before "
                                            r"its forward"):
        validate(edit(f1b, **cells))


def test_read_slot_holding_another_microbatch(gp: Table) -> None:
    """B0 on device 1 pointed at the residual slot of micro-batch 1."""
    b, f1 = tick_of(gp, "B", 0, 1), tick_of(gp, "F", 1, 1)
    other = int(gp.res_slot[f1, 1])
    assert other != int(gp.res_slot[b, 1])
    msg = (rf"tick {b}, device 1, micro-batch 0: B0 of stage 1 reads res slot "
           rf"{other}, which holds micro-batch 1 of stage 1, not micro-batch 0")
    with pytest.raises(ScheduleError, match=msg):
        validate(edit(gp, res_slot={(b, 1): other}))


def test_two_arrivals_into_one_live_slot(gp: Table) -> None:
    """The inputs of micro-batches 0 and 1 both sent to device 1's first input slot."""
    t0, t1 = tick_of(gp, "F", 0, 0), tick_of(gp, "F", 1, 0)
    slot = int(gp.recv_in_slot[t0, 1])
    assert int(gp.recv_in_slot[t1, 1]) != slot
    msg = (rf"tick {t1}, device 1, micro-batch 1: arrival of in for stage 1 "
           rf"overwrites in slot {slot}, which still holds micro-batch 0 of stage 1")
    with pytest.raises(ScheduleError, match=msg):
        validate(edit(gp, recv_in_slot={(t1, 1): slot}))


def test_forward_overwrites_live_residual(gp: Table) -> None:
    """F1 on device 0 writing the residual slot F0 still needs."""
    t0, t1 = tick_of(gp, "F", 0, 0), tick_of(gp, "F", 1, 0)
    slot = int(gp.res_slot[t0, 0])
    msg = (rf"tick {t1}, device 0, micro-batch 1: F1 of stage 0 overwrites res "
           rf"slot {slot}, which still holds micro-batch 0 of stage 0")
    with pytest.raises(ScheduleError, match=msg):
        validate(edit(gp, res_slot={(t1, 0): slot}))


def test_dropped_arrival(gp: Table) -> None:
    """An arrival with recv slot -1 would be lost."""
    t = tick_of(gp, "F", 0, 0)
    msg = (rf"tick {t}, device 1, micro-batch 0: the in for micro-batch 0 of "
           r"stage 1 arrives but recv_in_slot is -1: it would be dropped")
    with pytest.raises(ScheduleError, match=msg):
        validate(edit(gp, recv_in_slot={(t, 1): NO_SLOT}))
    t = tick_of(gp, "B", 2, 1)
    msg = (rf"tick {t}, device 0, micro-batch 2: the cot for micro-batch 2 of "
           r"stage 0 arrives but recv_cot_slot is -1")
    with pytest.raises(ScheduleError, match=msg):
        validate(edit(gp, recv_cot_slot={(t, 0): NO_SLOT}))


def test_recv_slot_where_nothing_arrives(f1b: Table) -> None:
    """A recv slot is set at a tick where the neighbour sends nothing (it ran a backward)."""
    t = tick_of(f1b, "B", 0, 0)  # device 0 runs a backward: no activation goes to device 1
    assert f1b.recv_in_slot[t, 1] == NO_SLOT
    msg = (rf"tick {t}, device 1: recv_in_slot 0 is set but nothing arrives")
    with pytest.raises(ScheduleError, match=msg):
        validate(edit(f1b, recv_in_slot={(t, 1): 0}))
    with pytest.raises(ScheduleError, match=r"tick 0, device 0: recv_cot_slot 0 is set but nothing arrives"):
        validate(edit(f1b, recv_cot_slot={(0, 0): 0}))


def test_action_runs_twice(f1b: Table) -> None:
    """F0 of device 0 copied into a later idle tick."""
    f = tick_of(f1b, "F", 0, 0)
    idle = int(np.flatnonzero(f1b.kind[:, 0] == IDLE)[0])
    cells = {field: {(idle, 0): int(getattr(f1b, field)[f, 0])}
             for field in ("kind", "microbatch", "chunk", "in_slot", "res_slot", "cot_slot")}
    msg = (rf"tick {idle}, device 0, micro-batch 0: F0 of stage 0 runs a second "
           rf"time \(first at tick {f}\)")
    with pytest.raises(ScheduleError, match=msg):
        validate(edit(f1b, **cells))


def test_missing_action(f1b: Table) -> None:
    """The last backward of device 0 deleted: nothing else breaks, but it never runs."""
    b = tick_of(f1b, "B", 1, 0)
    cells = {"kind": {(b, 0): IDLE}, "microbatch": {(b, 0): 0}, "res_slot": {(b, 0): NO_SLOT},
             "cot_slot": {(b, 0): NO_SLOT}}
    with pytest.raises(ScheduleError, match=r"B of micro-batch 1 on stage 0 \(device 0\) never runs"):
        validate(edit(f1b, **cells))


def test_action_on_wrong_device(f1b: Table) -> None:
    """B1 of stage 1 moved to device 0 becomes B1 of stage 0, whose cotangent never came."""
    b = tick_of(f1b, "B", 1, 1)
    assert f1b.kind[b, 0] == IDLE
    cells = {field: {(b, 0): int(getattr(f1b, field)[b, 1]), (b, 1): {"kind": IDLE, "microbatch": 0,
                                                                     "chunk": 0}.get(field, NO_SLOT)}
             for field in ("kind", "microbatch", "chunk", "in_slot", "res_slot", "cot_slot")}
    with pytest.raises(ScheduleError, match=rf"tick {b}, device 0, micro-batch 1: B1 of stage 0"):
        validate(edit(f1b, **cells))


def test_chunk_out_of_range(f1b: Table) -> None:
    with pytest.raises(ScheduleError, match=r"tick 0, device 0, micro-batch 0: chunk 1 outside 0\.\.0"):
        validate(edit(f1b, chunk={(0, 0): 1}))


def test_microbatch_out_of_range(f1b: Table) -> None:
    t = tick_of(f1b, "F", 1, 1)
    msg = (rf"tick {t}, device 1, micro-batch 2: micro-batch outside 0\.\.1")
    with pytest.raises(ScheduleError, match=msg):
        validate(edit(f1b, microbatch={(t, 1): 2}))
    with pytest.raises(ScheduleError, match=r"tick 0, device 0, micro-batch -1: micro-batch outside 0\.\.1"):
        validate(edit(f1b, microbatch={(0, 0): -1}))


def test_unknown_kind_and_missing_slots(f1b: Table) -> None:
    with pytest.raises(ScheduleError, match=r"tick 0, device 0: unknown action code 7"):
        validate(edit(f1b, kind={(0, 0): 7}))
    f = tick_of(f1b, "F", 0, 0)
    msg = (rf"tick {f}, device 0, micro-batch 0: F0 of stage 0 has no res slot")
    with pytest.raises(ScheduleError, match=msg):
        validate(edit(f1b, res_slot={(f, 0): NO_SLOT}))
    b = tick_of(f1b, "B", 0, 1)
    msg = (rf"tick {b}, device 1, micro-batch 0: B0 of stage 1 has no in slot")
    with pytest.raises(ScheduleError, match=msg):
        validate(edit(f1b, in_slot={(b, 1): NO_SLOT}))


def test_field_shape_mismatch(f1b: Table) -> None:
    bad = dataclasses.replace(f1b, res_slot=np.array(f1b.res_slot[:-1], copy=True))
    msg = re.escape(f"table field 'res_slot' has shape ({f1b.num_ticks - 1}, 2), "
                    f"expected ({f1b.num_ticks}, 2)")
    with pytest.raises(ScheduleError, match=msg):
        validate(bad)


def test_non_last_forward_with_cot_slot_is_rejected() -> None:
    """A non-last forward must not name a cot slot: the executor writes its (zero) dy there.

    Regression: device 0 runs F3 while the cotangent of micro-batch 0 waits in cot slot 0.
    Pointing F3's cot_slot at that slot used to validate, and the executor then zeroed the
    cotangent (wrong gradients).
    """
    orders = [[Action("F", m, 0) for m in range(4)] + [Action("B", m, 0) for m in range(4)],
              [a for m in range(4) for a in (Action("F", m, 1), Action("B", m, 1))]]
    table = validate(table_from_orders(orders, 4))
    f3, arrive = tick_of(table, "F", 3, 0), tick_of(table, "B", 0, 1)
    assert arrive < f3 < tick_of(table, "B", 0, 0)  # the cotangent of mb 0 is live during F3
    slot = int(table.recv_cot_slot[arrive, 0])
    msg = (rf"tick {f3}, device 0, micro-batch 3: F3 of stage 0 sets cot slot "
           rf"{slot}, but only the last stage's forward writes a cotangent")
    with pytest.raises(ScheduleError, match=msg):
        validate(edit(table, cot_slot={(f3, 0): slot}))


# ---------------------------------------------------------------------------------------------
# 4. Rendering
# ---------------------------------------------------------------------------------------------


def test_ascii_gantt_literal() -> None:
    """1F1B, P=2, M=3, drawn by hand."""
    assert ascii_gantt(one_f_one_b(2, 3)) == (
        "1f1b: 2 devices, 3 micro-batches, 8 ticks\n"
        "d0 | F0 F1 .  B0 F2 B1 .  B2\n"
        "d1 | .  F0 B0 F1 B1 F2 B2 ."
    )


@pytest.mark.parametrize("name", list(GENERATORS))
@pytest.mark.parametrize("P,M", [(1, 2), (4, 8), (8, 16), (3, 12)])
def test_ascii_gantt_cells(name: str, P: int, M: int) -> None:
    """One header plus one line per device; cells are the table's actions, '.' when idle."""
    table = GENERATORS[name](P, M)
    lines = ascii_gantt(table).splitlines()
    assert len(lines) == P + 1
    assert lines[0] == f"{name}: {P} devices, {M} micro-batches, {table.num_ticks} ticks"
    assert str(table) == ascii_gantt(table)
    for d, line in enumerate(lines[1:]):
        prefix, _, body = line.partition(" | ")
        assert prefix == f"d{d}"
        cells = body.split()
        # The last idle cells may be stripped; everything before must line up tick by tick.
        assert len(cells) <= table.num_ticks
        cells += ["."] * (table.num_ticks - len(cells))
        for t, cell in enumerate(cells):
            kind, mb = int(table.kind[t, d]), int(table.microbatch[t, d])
            assert cell == {IDLE: ".", FORWARD: f"F{mb}", BACKWARD: f"B{mb}"}[kind], (d, t)
        assert cells.count(".") == int((table.kind[:, d] == IDLE).sum())
        assert sorted(c for c in cells if c != ".") == sorted(
            [f"F{m}" for m in range(M)] + [f"B{m}" for m in range(M)])


def test_ascii_gantt_chunks() -> None:
    """With chunks a cell also names the chunk (``F0/1``)."""
    table = table_from_orders(interleaved_orders(2, 2, 2), 2, num_chunks=2, name="il")
    # Timed by hand: stage 2 (device 0, chunk 1) waits for stage 1 on device 1, and so on.
    assert ascii_gantt(table) == (
        "il: 2 devices, 2 micro-batches, 10 ticks\n"
        "d0 | F0/0 F1/0 F0/1 F1/1 .    .    B0/1 B1/1 B0/0 B1/0\n"
        "d1 | .    F0/0 F1/0 F0/1 F1/1 B0/1 B1/1 B0/0 B1/0 ."
    )


def test_table_repr() -> None:
    assert repr(gpipe(2, 3)) == "Table('gpipe', devices=2, chunks=1, microbatches=3, ticks=8)"


# ---------------------------------------------------------------------------------------------
# Fused ticks: one forward and one backward per device per tick
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("P,M", [(1, 3), (2, 2), (3, 7), (4, 8), (4, 9)])
def test_fused_tables_validate_and_keep_each_devices_actions(name: str, P: int, M: int) -> None:
    table = get_schedule(name)(P, M)
    fused = validate(fuse_ticks(table))
    assert fused.lanes == 2 and fused.num_rows == 2 * fused.num_ticks
    assert fused.num_ticks <= table.num_ticks
    kinds = fused.as_array()[..., FIELDS.index("kind")]  # [ticks, lanes, devices]
    assert set(np.unique(kinds[:, 0])) <= {IDLE, FORWARD}  # lane 0: forwards only
    assert FORWARD not in set(np.unique(kinds[:, 1]))  # lane 1: B and W
    for mine, theirs in zip(fused.orders(), table.orders()):
        assert sorted(mine) == sorted(theirs)
    # At most one more micro-batch in flight: a tick's forward runs before its backward frees a slot.
    assert (fused.held_microbatches() <= table.held_microbatches() + 1).all()
    assert fuse_ticks(fused) is fused


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_fused_policy_b_reaches_the_asynchronous_makespan(P: int, M: int) -> None:
    """With B = 2F, one-action ticks cost 1F1B max(F, B) per action; fused 1f1b-b costs nothing extra."""
    from jpipe.schedules import Costs, simulate

    costs = Costs(forward=1.0, backward=2.0)
    plain, fused = one_f_one_b(P, M), fuse_ticks(one_f_one_b_policy_b(P, M))
    ideal = simulate(plain, costs, mode="async").makespan
    assert ideal == 3 * M + 3 * (P - 1)  # M (F + B) on one device plus the fill and drain
    assert simulate(fused, costs).makespan == ideal
    assert simulate(plain, costs).makespan > ideal  # one-action ticks pay for mixing F and B
    assert fused.num_ticks == M + 2 * (P - 1)
    assert fused.held_microbatches().tolist() == [min(2 * (P - s) - 1, M) for s in range(P)]


def test_fused_tick_lasts_as_long_as_its_busiest_device() -> None:
    from jpipe.schedules import Costs, simulate

    # d1 runs F0 and B0 in one tick (its own loss gradient): that tick costs F + B = 3.
    fused = table_from_orders([[Action("F", 0, 0), Action("B", 0, 0)], [Action("F", 0, 1), Action("B", 0, 1)]],
                              1, lanes=2)
    assert fused.num_ticks == 3
    r = simulate(fused, Costs(forward=1.0, backward=2.0))
    assert r.makespan == 1 + 3 + 2
    assert r.start[Action("B", 0, 1)] == 2.0  # after F0 on the same device, within the tick
    assert ascii_gantt(fused).splitlines()[1:] == ["d0 | F0 .  .", "   | .  .  B0", "d1 | .  F0 .", "   | .  B0 ."]


def test_fused_validator_rejects_two_sends_and_early_arrivals() -> None:
    fused = fuse_ticks(one_f_one_b(2, 4))
    # Move tick 2's lane-1 action of device 0 into an arrival slot on lane 0: arrivals belong to the last lane.
    bad = dataclasses.replace(fused, recv_in_slot=fused.recv_in_slot.copy())
    t = next(r for r in range(1, fused.num_rows, 2) if fused.recv_in_slot[r, 1] != NO_SLOT)
    bad.recv_in_slot[t - 1, 1], bad.recv_in_slot[t, 1] = bad.recv_in_slot[t, 1], NO_SLOT
    with pytest.raises(ScheduleError, match="last lane"):
        validate(bad)
    with pytest.raises(ScheduleError, match="lanes must be 1"):
        table_from_orders(one_f_one_b(2, 2).orders(), 2, lanes=3)
    # Two forwards in one tick would send two activations over one link.
    two = dataclasses.replace(fused, kind=fused.kind.copy(), microbatch=fused.microbatch.copy())
    r0 = next(r for r in range(0, fused.num_rows, 2) if fused.kind[r, 0] == FORWARD and fused.kind[r + 1, 0] == IDLE)
    two.kind[r0 + 1, 0] = FORWARD
    with pytest.raises(ScheduleError):
        validate(two)


def test_fused_repr_and_plan() -> None:
    import jpipe

    assert repr(fuse_ticks(gpipe(2, 3))) == "Table('gpipe', devices=2, chunks=1, microbatches=3, ticks=7, lanes=2)"
    plan = jpipe.Plan(4, 2, 8, schedule="1f1b-b", fuse_ticks=True)
    assert plan.table().lanes == 2 and plan.table().num_ticks == 14
    assert jpipe.Plan(4, 2, 8).table().lanes == 1
    with pytest.raises(ValueError, match="fuse_ticks"):
        jpipe.Plan(4, 2, 8, fuse_ticks=1)


def test_declared_traits_hold_for_their_schedules():
    """A schedule's Traits are what the planner trusts: below min_microbatches its table is another
    registered schedule's, so the planner skips it there."""
    from jpipe.schedules import SCHEDULES, TRAITS, schedule_traits

    assert set(TRAITS) <= set(SCHEDULES)
    for name in SCHEDULES:
        traits = schedule_traits(name)
        for pipe in (2, 3, 4, 5):
            below = range(1, traits.min_microbatches(pipe))
            for m in below:
                table = SCHEDULES[name](pipe, m)
                same = [other for other in SCHEDULES if other != name and other in ("gpipe", "1f1b")
                        and np.array_equal(table.kind, SCHEDULES[other](pipe, m).kind)
                        and np.array_equal(table.microbatch, SCHEDULES[other](pipe, m).microbatch)]
                assert same, (name, pipe, m)
            if name == "1f1b-b" and pipe > 2:   # and from the minimum on it is a schedule of its own
                m = traits.min_microbatches(pipe)
                assert not np.array_equal(SCHEDULES[name](pipe, m).kind, SCHEDULES["1f1b"](pipe, m).kind)
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule_traits("zigzag")
