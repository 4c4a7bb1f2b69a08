"""Schedule generators: each is one function from (devices, micro-batches) to a :class:`Table`.

A new schedule is a new function here (or anywhere) that builds per-device
orders and calls :func:`table_from_orders`; nothing else has to change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from jpipe.schedules._table import Action, Table, table_from_orders


def gpipe(num_devices: int, num_microbatches: int) -> Table:
    """GPipe: every forward, then every backward. Holds all ``M`` micro-batches.

    >>> gpipe(2, 3).orders()[0]
    [Action(kind='F', microbatch=0, stage=0), Action(kind='F', microbatch=1, stage=0), Action(kind='F', microbatch=2, stage=0), Action(kind='B', microbatch=0, stage=0), Action(kind='B', microbatch=1, stage=0), Action(kind='B', microbatch=2, stage=0)]
    """
    orders = [
        [Action("F", mb, s) for mb in range(num_microbatches)]
        + [Action("B", mb, s) for mb in range(num_microbatches)]
        for s in range(num_devices)
    ]
    return table_from_orders(orders, num_microbatches, name="gpipe")


def early_backward(num_devices: int, num_microbatches: int, warmup: Callable[[int], int], name: str) -> Table:
    """DAPPLE's early-backward order with a per-stage warm-up count ``warmup(s)``.

    Stage ``s`` runs ``K = min(warmup(s), M)`` forwards, then alternates one
    backward and one forward, then drains the remaining backwards. It holds at
    most ``K`` micro-batches, whatever ``M`` is.
    """
    orders = []
    for s in range(num_devices):
        k = max(1, min(warmup(s), num_microbatches))
        order = [Action("F", mb, s) for mb in range(k)]
        for r in range(num_microbatches - k):
            order += [Action("B", r, s), Action("F", k + r, s)]
        order += [Action("B", mb, s) for mb in range(num_microbatches - k, num_microbatches)]
        orders.append(order)
    return table_from_orders(orders, num_microbatches, name=name)


def one_f_one_b(num_devices: int, num_microbatches: int) -> Table:
    """DAPPLE policy A (PipeDream-Flush 1F1B): warm-up ``min(P - s, M)``.

    >>> [str(a) for a in one_f_one_b(4, 8).orders()[0]][:6]
    ['F0', 'F1', 'F2', 'F3', 'B0', 'F4']
    """
    return early_backward(num_devices, num_microbatches, lambda s: num_devices - s, "1f1b")


def one_f_one_b_policy_b(num_devices: int, num_microbatches: int) -> Table:
    """DAPPLE policy B: warm-up ``min(2(P - s) - 1, M)``, hiding communication behind compute.

    >>> one_f_one_b_policy_b(4, 8).held_microbatches().tolist()
    [7, 5, 3, 1]
    """
    return early_backward(num_devices, num_microbatches, lambda s: 2 * (num_devices - s) - 1, "1f1b-b")


def advance_forward(
    num_devices: int, num_microbatches: int, advance: int | Sequence[int] | None = None
) -> Table:
    """AvgPipe's advance forward propagation: warm-up ``min(S - s + a_s, M)`` on stage ``s``.

    Stage ``s`` runs ``a_s`` forwards *in advance* of 1F1B (DAPPLE policy A,
    warm-up ``S - s``) before it starts alternating. ``advance`` is ``None``
    (default: ``a_s = S - s - 1``, which equals DAPPLE's policy B, the count in
    AvgPipe's figures), one int for every stage, or one int per stage. Zero
    advance is 1F1B; an advance of ``M`` or more on every stage is GPipe's
    all-forward-all-backward. Stage ``s`` holds ``min(S - s + a_s, M)``
    micro-batches: a little more memory than 1F1B for fewer, shorter bubbles
    when communication is not free.

    >>> advance_forward(4, 8).held_microbatches().tolist()
    [7, 5, 3, 1]
    >>> advance_forward(4, 8, advance=0).held_microbatches().tolist()  # 1F1B
    [4, 3, 2, 1]
    >>> advance_forward(4, 8, advance=[2, 1, 0, 0]).held_microbatches().tolist()
    [6, 4, 2, 1]
    """
    if advance is None:
        per_stage = [num_devices - s - 1 for s in range(num_devices)]
    elif isinstance(advance, int) and not isinstance(advance, bool):
        per_stage = [advance] * num_devices
    else:
        per_stage = list(advance)
        if len(per_stage) != num_devices:
            raise ValueError(f"advance has {len(per_stage)} entries but there are {num_devices} stages; "
                             "give one int for every stage, or one int for all")
    if any(not isinstance(a, int) or isinstance(a, bool) or a < 0 for a in per_stage):
        raise ValueError(f"advance must be non-negative ints, got {advance!r}")
    return early_backward(num_devices, num_microbatches, lambda s: num_devices - s + per_stage[s],
                          "advance-forward")


def _check_sizes(num_devices: int, num_microbatches: int, name: str) -> None:
    if num_devices < 1 or num_microbatches < 1:
        raise ValueError(f"{name} needs at least one device and one micro-batch, got "
                         f"num_devices={num_devices}, num_microbatches={num_microbatches}")


def interleaved_1f1b(
    num_devices: int, num_microbatches: int, num_chunks: int = 2, *, megatron_warmup: bool = False
) -> Table:
    """Megatron's interleaved 1F1B: ``v = num_chunks`` virtual stages per device.

    Virtual stage ``k`` (layer chunk ``k``) runs on device ``k % P`` as its chunk
    ``k // P``. Micro-batches go in rounds of at least ``P`` (``max(1, M // P)``
    rounds, sizes as even as possible); within a round a device runs chunk 0 of
    every micro-batch, then chunk 1, ...; backwards visit the chunks in reverse.
    Device ``d`` warms up with ``(v - 1) g + P - d`` forwards (``g``: the first
    round's size), then alternates one backward and one forward, then drains.

    In lock-step ticks (activations arrive one tick after they are produced)
    this warm-up is the smallest that never stalls: with ``M >= P`` the table
    has exactly ``2(vM + P - 1)`` ticks, so with per-chunk costs ``F / v`` the
    bubble is ``(P - 1) / (vM + P - 1)``. ``megatron_warmup=True`` uses the
    warm-up of Megatron-LM and torch's ``ScheduleInterleaved1F1B``
    (``(v - 1) g + 2(P - 1 - d) + 1`` forwards before the first backward): the
    same lock-step length, more held activations, fewer stalls when
    communication takes time (see :func:`jpipe.schedules.simulate`, ``"async"``).
    With ``num_chunks=1`` this is :func:`one_f_one_b`.

    >>> t = interleaved_1f1b(2, 4, num_chunks=2)
    >>> t.num_ticks, t.held_microbatches().tolist()
    (18, [4, 3])
    >>> [f"{a}/{a.stage // 2}" for a in t.orders()[0]][:6]  # device 0: micro-batch/chunk
    ['F0/0', 'F1/0', 'F0/1', 'F1/1', 'B0/1', 'F2/0']
    """
    _check_sizes(num_devices, num_microbatches, "interleaved_1f1b")
    P, M, v = num_devices, num_microbatches, num_chunks
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    rounds = max(1, M // P)
    sizes = [M // rounds + (1 if r < M % rounds else 0) for r in range(rounds)]
    forwards: list[tuple[int, int]] = []  # (micro-batch, chunk) in the order a device runs them
    backwards: list[tuple[int, int]] = []
    first = 0
    for size in sizes:
        mbs = range(first, first + size)
        forwards += [(mb, c) for c in range(v) for mb in mbs]
        backwards += [(mb, c) for c in reversed(range(v)) for mb in mbs]
        first += size
    total = v * M
    orders = []
    for d in range(P):
        extra = 2 * (P - 1 - d) + 1 if megatron_warmup else P - d
        warm = min((v - 1) * sizes[0] + extra, total)
        order = [Action("F", mb, c * P + d) for mb, c in forwards[:warm]]
        for i, (mb, c) in enumerate(backwards):
            order.append(Action("B", mb, c * P + d))
            if warm + i < total:
                fmb, fc = forwards[warm + i]
                order.append(Action("F", fmb, fc * P + d))
        orders.append(order)
    return table_from_orders(orders, M, num_chunks=v, name="interleaved-1f1b")


def zero_bubble(
    num_devices: int, num_microbatches: int, warmup: Callable[[int], int], max_held: int, name: str
) -> Table:
    """A zero-bubble schedule: backwards split into ``B`` (input gradient) and ``W`` (weight gradient).

    Stage ``s`` runs ``min(warmup(s), M)`` forwards, then alternates ``B`` and
    ``F`` (deferring every ``W``) until it holds ``max_held`` micro-batches,
    then runs ``B W F`` cycles (one ``W`` retires a micro-batch before the next
    forward, so it never holds more than ``max_held``), then ``B W`` pairs once
    its forwards are done, and finally the ``W`` s it deferred. A micro-batch
    is held from its ``F`` to its ``W``. The deferred ``W`` s fill the time a
    stage would otherwise wait for cotangents in the drain.
    """
    _check_sizes(num_devices, num_microbatches, name)
    if max_held < 1:
        raise ValueError(f"max_held must be at least 1, got {max_held}")
    M = num_microbatches
    orders = []
    for s in range(num_devices):
        n_f = max(1, min(warmup(s), M))
        order = [Action("F", mb, s) for mb in range(n_f)]
        n_b = n_w = 0
        while n_b < M:
            order.append(Action("B", n_b, s))
            n_b += 1
            if n_f < M and n_f - n_w < max_held:
                order.append(Action("F", n_f, s))
                n_f += 1
                continue
            order.append(Action("W", n_w, s))
            n_w += 1
            if n_f < M:
                order.append(Action("F", n_f, s))
                n_f += 1
        order += [Action("W", mb, s) for mb in range(n_w, M)]
        orders.append(order)
    return table_from_orders(orders, M, name=name)


def zb_h1(num_devices: int, num_microbatches: int) -> Table:
    """Zero bubble ZB-H1 (Qi et al., ICLR 2024): 1F1B's warm-up, ``W`` deferred, at most ``P`` held.

    With ``F = B = W`` and ``M >= P`` the table has ``3M + P - 1`` ticks: every
    device idles only ``P - 1`` ticks (1F1B in the same units: ``3(P - 1)``).

    >>> t = zb_h1(4, 8)
    >>> t.num_ticks, t.held_microbatches().tolist()
    (27, [4, 4, 4, 4])
    >>> " ".join(str(a) for a in t.orders()[3][:10])
    'F0 B0 F1 B1 F2 B2 F3 B3 W0 F4'
    """
    P = num_devices
    return zero_bubble(P, num_microbatches, lambda s: P - s, max_held=P, name="zb-h1")


def zb_h2(num_devices: int, num_microbatches: int) -> Table:
    """ZB-H2-style: DAPPLE policy B's warm-up ``2(P - s) - 1``, ``W`` deferred, at most ``2P - 1`` held.

    The extra in-flight forwards keep the steady state busy when ``B`` is
    slower than ``F`` or communication takes time, at twice ZB-H1's memory.

    >>> zb_h2(4, 8).held_microbatches().tolist()
    [7, 7, 7, 7]
    """
    P = num_devices
    return zero_bubble(P, num_microbatches, lambda s: 2 * (P - s) - 1, max_held=2 * P - 1, name="zb-h2")


SCHEDULES: dict[str, Callable[[int, int], Table]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "1f1b-b": one_f_one_b_policy_b,
    "advance-forward": advance_forward,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
}


class Traits(NamedTuple):
    """What a planner needs to know of a registered schedule beyond its table.

    ``min_microbatches(pipe)``: the fewest micro-batches at which the schedule's table differs
    from another registered schedule's (policy B's warm-up ``min(2 (P - s) - 1, M)`` is 1F1B's
    ``min(P - s, M)`` on every stage while ``M <= 2``); ``fuses``: whether fused ticks
    (:func:`fuse_ticks`, one forward and one backward per tick) pay off with it (policy B's
    warm-up keeps them full; 1F1B's stall them).
    """

    min_microbatches: Callable[[int], int] = lambda pipe: 1
    fuses: bool = False


TRAITS: dict[str, Traits] = {
    "1f1b-b": Traits(min_microbatches=lambda pipe: 3, fuses=True),
}


def schedule_traits(name: str) -> Traits:
    """A registered schedule's :class:`Traits` (the defaults for a schedule that declares none).

    >>> schedule_traits("1f1b-b").min_microbatches(4), schedule_traits("1f1b").fuses
    (3, False)
    """
    get_schedule(name)
    return TRAITS.get(name, Traits())


def get_schedule(name: str) -> Callable[[int, int], Table]:
    """Looks up a generator by name; raises a ValueError listing the known names."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(
            f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)} "
            "or pass a jpipe.schedules.Table"
        ) from None
