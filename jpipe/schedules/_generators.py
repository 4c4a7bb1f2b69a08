"""Schedule generators: each is one function from (devices, micro-batches) to a :class:`Table`.

A new schedule is a new function here (or anywhere) that builds per-device
orders and calls :func:`table_from_orders`; nothing else has to change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


SCHEDULES: dict[str, Callable[[int, int], Table]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "1f1b-b": one_f_one_b_policy_b,
    "advance-forward": advance_forward,
}


def get_schedule(name: str) -> Callable[[int, int], Table]:
    """Looks up a generator by name; raises a ValueError listing the known names."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(
            f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)} "
            "or pass a jpipe.schedules.Table"
        ) from None
