"""Tests for the interleaved and zero-bubble generators (plain numpy, no JAX).

Properties are checked against the table arrays and closed forms: every table
validates, per-device orders follow the definitions, tick counts reach the
lower bounds, and held micro-batches stay within each schedule's memory bound.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from jpipe.schedules import (
    SCHEDULES,
    Action,
    Costs,
    ScheduleError,
    get_schedule,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    validate,
    zb_h1,
    zb_h2,
    zero_bubble,
)

SIZES = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 3), (3, 2), (3, 7), (4, 2), (4, 4), (4, 6), (4, 8),
         (4, 9), (5, 3), (5, 12), (8, 16)]


def strs(order: list[Action]) -> list[str]:
    return [str(a) for a in order]


# ---------------------------------------------------------------------------------------------
# Interleaved 1F1B
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("P,M", SIZES)
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("megatron", [False, True])
def test_interleaved_validates(P: int, M: int, v: int, megatron: bool) -> None:
    t = validate(interleaved_1f1b(P, M, num_chunks=v, megatron_warmup=megatron))
    assert (t.num_devices, t.num_chunks, t.num_microbatches, t.name) == (P, v, M, "interleaved-1f1b")
    for d, order in enumerate(t.orders()):
        assert all(a.stage % P == d for a in order)
        assert len(order) == 2 * v * M
        # A device runs its chunks' backwards in the reverse order of their forwards.
        fwd = [(a.microbatch, a.stage) for a in order if a.kind == "F"]
        bwd = [(a.microbatch, a.stage) for a in order if a.kind == "B"]
        assert bwd == [(mb, (v - 1 - k // P) * P + d) for mb, k in fwd]


@pytest.mark.parametrize("P,M", SIZES)
def test_interleaved_one_chunk_is_one_f_one_b(P: int, M: int) -> None:
    assert [strs(o) for o in interleaved_1f1b(P, M, num_chunks=1).orders()] == \
        [strs(o) for o in one_f_one_b(P, M).orders()]


@pytest.mark.parametrize("P,M,v", [(2, 2, 2), (2, 3, 2), (4, 4, 2), (4, 8, 2), (4, 16, 2), (4, 6, 2),
                                   (4, 9, 2), (3, 7, 3), (4, 8, 4), (8, 16, 2), (5, 12, 2)])
def test_interleaved_reaches_the_lockstep_bound(P: int, M: int, v: int) -> None:
    """With M >= P: 2(vM + P - 1) ticks, the fewest possible (the last device waits P - 1 chunk-ticks)."""
    t = interleaved_1f1b(P, M, num_chunks=v)
    assert t.num_ticks == 2 * (v * M + P - 1)


def test_interleaved_order_by_hand() -> None:
    """P = 2, M = 4, v = 2: rounds of two micro-batches, chunk 0 then chunk 1, device 0 warms up 4."""
    t = interleaved_1f1b(2, 4, num_chunks=2)
    cells = [[f"{a}/{a.stage // 2}" for a in o] for o in t.orders()]
    assert cells[0] == ["F0/0", "F1/0", "F0/1", "F1/1", "B0/1", "F2/0", "B1/1", "F3/0", "B0/0", "F2/1",
                        "B1/0", "F3/1", "B2/1", "B3/1", "B2/0", "B3/0"]
    assert cells[1][:5] == ["F0/0", "F1/0", "F0/1", "B0/1", "F1/1"]


@pytest.mark.parametrize("P,M,v", [(4, 8, 2), (4, 16, 2), (4, 8, 3), (2, 5, 2)])
def test_interleaved_memory(P: int, M: int, v: int) -> None:
    """Device d holds at most (v - 1) g + P - d chunk-micro-batches (g = first round's size, >= P);
    Megatron's warm-up holds up to P - 1 - d more."""
    g = M // max(1, M // P) + (1 if M % max(1, M // P) else 0)
    lock = interleaved_1f1b(P, M, num_chunks=v).held_microbatches()
    mega = interleaved_1f1b(P, M, num_chunks=v, megatron_warmup=True).held_microbatches()
    assert lock.tolist() == [min((v - 1) * g + P - d, v * M) for d in range(P)]
    assert mega.tolist() == [min((v - 1) * g + 2 * (P - 1 - d) + 1, v * M) for d in range(P)]


def test_megatron_warmup_hides_communication_when_asynchronous() -> None:
    """Same lock-step length; asynchronously, with comm and B = 2F, the deeper warm-up stalls less."""
    P, M, v = 4, 8, 2
    lock, mega = interleaved_1f1b(P, M, v), interleaved_1f1b(P, M, v, megatron_warmup=True)
    assert lock.num_ticks == mega.num_ticks
    costs = Costs(forward=0.5, backward=1.0, comm=0.05)
    assert simulate(mega, costs, mode="async").makespan < simulate(lock, costs, mode="async").makespan


def test_interleaved_errors() -> None:
    with pytest.raises(ValueError, match=r"num_chunks must be a positive int, got 0"):
        interleaved_1f1b(4, 8, num_chunks=0)
    with pytest.raises(ValueError, match=r"interleaved_1f1b needs at least one device and one micro-batch"):
        interleaved_1f1b(4, 0)


# ---------------------------------------------------------------------------------------------
# Zero bubble
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make,bound", [(zb_h1, lambda P: P), (zb_h2, lambda P: 2 * P - 1)],
                         ids=["zb-h1", "zb-h2"])
@pytest.mark.parametrize("P,M", SIZES)
def test_zero_bubble_validates_and_bounds_memory(make, bound, P: int, M: int) -> None:
    t = validate(make(P, M))
    assert t.splits_backward
    held = t.held_microbatches()
    assert held.max() <= min(bound(P), M)
    for d, order in enumerate(t.orders()):
        s = strs(order)
        assert len(s) == 3 * M
        for mb in range(M):
            assert s.index(f"F{mb}") < s.index(f"B{mb}") < s.index(f"W{mb}")
        # Forwards, backwards and weight gradients each run in micro-batch order.
        for kind in "FBW":
            assert [a.microbatch for a in order if a.kind == kind] == list(range(M))
    if M >= P:  # with F = B = W every device idles only P - 1 ticks: 3M + P - 1 in all
        assert t.num_ticks == 3 * M + P - 1


def test_zb_h1_order_by_hand() -> None:
    """P = 4, M = 8: the first device does B W F cycles; the last defers W until it holds P."""
    orders = [" ".join(strs(o)) for o in zb_h1(4, 8).orders()]
    assert orders[0] == "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7"
    assert orders[3] == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"


def test_zb_h1_bubble_against_1f1b() -> None:
    """F = B = W at P = 4, M = 8. Lock-step: 1F1B's unsplit backward (cost 2) stretches every tick
    it shares with a forward, so ZB-H1's bubble is under 0.4 of 1F1B's (it is 0.278). Asynchronously
    ZB-H1's idle time is exactly 1/3 of 1F1B's: (P - 1)(F + B - W) against (P - 1)(F + B + W)."""
    P, M = 4, 8
    costs = Costs(forward=1.0, backward=1.0, weight=1.0)
    zb_lock, f1b_lock = simulate(zb_h1(P, M), costs), simulate(one_f_one_b(P, M), costs)
    assert zb_lock.bubble_fraction <= 0.4 * f1b_lock.bubble_fraction
    assert zb_lock.makespan == 3 * M + P - 1
    zb_async = simulate(zb_h1(P, M), costs, mode="async")
    f1b_async = simulate(one_f_one_b(P, M), costs, mode="async")
    assert np.isclose(zb_async.idle.sum(), f1b_async.idle.sum() / 3)
    # The fraction cannot reach 0.4 x 1F1B's asynchronously: the last device starts P - 1 late and
    # has 3M of work, so any schedule's bubble is >= (P - 1) / (3M + P - 1) = 1/9 > 0.4 x 3/11.
    assert np.isclose(zb_async.bubble_fraction, (P - 1) / (3 * M + P - 1))


def test_zb_h2_beats_zb_h1_with_slow_backward() -> None:
    costs = Costs(forward=1.0, backward=2.0, weight=1.0, comm=0.1)
    for mode in ("lockstep", "async"):
        assert simulate(zb_h2(4, 8), costs, mode=mode).makespan < simulate(zb_h1(4, 8), costs, mode=mode).makespan


def test_zero_bubble_custom_and_errors() -> None:
    t = validate(zero_bubble(3, 5, warmup=lambda s: 1, max_held=2, name="zb-tight"))
    assert t.name == "zb-tight" and t.held_microbatches().max() <= 2
    with pytest.raises(ValueError, match=r"max_held must be at least 1, got 0"):
        zero_bubble(2, 2, warmup=lambda s: 1, max_held=0, name="x")


def test_registered() -> None:
    for name, fn in {"interleaved-1f1b": interleaved_1f1b, "zb-h1": zb_h1, "zb-h2": zb_h2}.items():
        assert SCHEDULES[name] is fn and get_schedule(name) is fn
        validate(fn(4, 8))
    assert get_schedule("interleaved-1f1b")(4, 8, num_chunks=3).num_chunks == 3


def test_a_deadlocking_table_still_raises() -> None:
    """Generators go through table_from_orders; a hand-broken zero-bubble order is rejected there."""
    from jpipe.schedules import table_from_orders
    orders = [[Action("F", 0, 0), Action("W", 0, 0), Action("B", 0, 0)],
              [Action("F", 0, 1), Action("B", 0, 1), Action("W", 0, 1)]]
    with pytest.raises(ScheduleError, match=r"deadlocks"):
        table_from_orders(orders, 1)


# ---------------------------------------------------------------------------------------------
# User tables (text / CSV), pictures, main_show
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,kw", [("gpipe", {}), ("1f1b", {}), ("zb-h1", {}), ("zb-h2", {}),
                                     ("interleaved-1f1b", {"num_chunks": 2}),
                                     ("interleaved-1f1b", {"num_chunks": 3})])
def test_text_round_trips(name: str, kw: dict) -> None:
    """format_orders and ascii_gantt both load back into the same orders (and name)."""
    from jpipe.schedules import ascii_gantt, format_orders, load_table
    t = get_schedule(name)(4, 6, **kw)
    for text in (format_orders(t), ascii_gantt(t)):
        back = load_table(text)
        assert back.orders() == t.orders() and back.name == t.name
        assert (back.num_chunks, back.num_microbatches) == (t.num_chunks, t.num_microbatches)
        np.testing.assert_array_equal(back.as_array(), t.as_array())


def test_load_table_from_files(tmp_path) -> None:
    from jpipe.schedules import load_table
    txt = tmp_path / "mine.txt"
    txt.write_text("# two devices\n\nd0: F0 F1 B0 B1   # all forwards first\nd1: F0 B0 F1 B1\n")
    t = validate(load_table(txt))
    assert t.name == "mine" and t.orders()[0] == [Action("F", 0, 0), Action("F", 1, 0),
                                                  Action("B", 0, 0), Action("B", 1, 0)]
    assert validate(load_table(str(txt), name="other")).name == "other"
    csv = tmp_path / "split.csv"
    csv.write_text("device, kind, microbatch, chunk\n"
                   + "".join(f"0,{k},0,{c}\n" for k, c in [("F", 0), ("F", 1), ("B", 1), ("W", 1),
                                                            ("B", 0), ("W", 0)]))
    t = validate(load_table(csv))
    assert (t.num_devices, t.num_chunks, t.splits_backward) == (1, 2, True)


def test_load_table_errors() -> None:
    from jpipe.schedules import load_table
    with pytest.raises(ScheduleError, match=r"line 2: cannot read 'X0'; write an action as F, B or W"):
        load_table("d0: F0 B0\nd1: F0 X0")
    with pytest.raises(ScheduleError, match=r"line 1: device label 1 out of order"):
        load_table("d1: F0 B0\nd0: F0 B0")
    with pytest.raises(ScheduleError, match=r"lists no actions"):
        load_table("# nothing\n")
    with pytest.raises(ScheduleError, match=r"deadlocks"):
        load_table("d0: B0 F0\nd1: F0 B0")
    with pytest.raises(ScheduleError, match=r"1 actions are missing, e\.g\. B of micro-batch 1 on stage 0"):
        load_table("d0: F0 F1 B0\nd1: F0 B0 F1 B1")
    with pytest.raises(ScheduleError, match=r"CSV row 3: kind must be F, B or W, got 'Q'"):
        load_table("device,kind,microbatch\n0,F,0\n0,Q,0")
    with pytest.raises(ScheduleError, match=r"CSV lists no actions for device 0"):
        load_table("device,kind,microbatch\n1,F,0\n1,B,0")


def test_gantt_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from jpipe.schedules import gantt_png
    for table, costs in ((zb_h1(4, 8), None), (interleaved_1f1b(4, 8, 2), Costs(0.5, 1.0, comm=0.1))):
        out = gantt_png(table, tmp_path / f"{table.name}.png", costs)
        data = pathlib.Path(out).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.parametrize("pipe, microbatches, costs", [(2, 3, None), (2, 3, Costs(1.0, 1.0, 1.0)),
                                                       (4, 8, Costs(0.5, 1.0)), (8, 16, None)])
def test_gantt_title_axis_label_and_legend_fit_and_do_not_overlap(pipe, microbatches, costs) -> None:
    pytest.importorskip("matplotlib")
    from jpipe.schedules._plot import _gantt_figure
    fig = _gantt_figure(zb_h1(pipe, microbatches), costs, unit="cost units")
    fig.canvas.draw()  # lays the labels out as the PNG has them
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    boxes = {"title": ax.title.get_window_extent(renderer), "xlabel": ax.xaxis.label.get_window_extent(renderer),
             "legend": fig.legends[0].get_window_extent(renderer), "axes": ax.get_window_extent(renderer)}
    page = fig.bbox
    for name, box in boxes.items():
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, name
    names = list(boxes)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not boxes[a].overlaps(boxes[b]), (a, b)
    assert ax.xaxis.label.get_text() == ("tick" if costs is None else "time (cost units)")


def test_main_show(tmp_path) -> None:
    from jpipe.schedules import format_orders, main_show
    text = main_show("zb-h1", 4, 8)
    assert text.splitlines()[0] == "zb-h1: 4 devices, 8 micro-batches, 27 ticks"
    assert "bubble: lock-step 11.1%, async 11.1%" in text
    assert "peak held micro-batches per device: [4, 4, 4, 4]" in text
    assert "interleaved-1f1b: 4 devices, 8 micro-batches, 38 ticks" in main_show("interleaved-1f1b", 4, 8,
                                                                                  num_chunks=2)
    f = tmp_path / "t.txt"
    f.write_text(format_orders(one_f_one_b(2, 3)))
    assert main_show(str(f), 0, 0).splitlines()[0] == "1f1b: 2 devices, 3 micro-batches, 8 ticks"
    with pytest.raises(ValueError, match=r"is a schedule for pipe=2, but pipe=4 was asked for"):
        main_show(str(f), 4, 3)
    with pytest.raises(ValueError, match=r"unknown schedule 'nope'"):
        main_show("nope", 4, 8)
    if __import__("importlib").util.find_spec("matplotlib"):
        png = tmp_path / "g.png"
        assert main_show("gpipe", 2, 2, png=png).endswith(f"wrote {png}") and png.exists()
